# Two set-up commands work on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEMO_TRACE ?= traces/samples/fixture.parquet
DEMO_DIR ?= runs/demo
POLICIES ?= fetch_all,rule015,first_choice,quality_first,speed_first

.PHONY: env env-capture demo test lint bench paper prefetch import-route clean

# The environment: created once, re-installed when pyproject.toml changes.
$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,sweep,bench]'
	touch $@

env: $(VENV)/.installed

# GPU-host tools (capture, calibrate, replay, emulate) need torch; bring your own CUDA build,
# or TORCH='torch==2.13.0' for the CPU build these tests use.
TORCH ?= torch
env-capture: env
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[capture]'

# The headline comparison on the bundled trace, scaled to Qwen3-Next-80B-A3B expert sizes on the
# measured H200 profile: five strategies at 25 % resident.
DEMO_ARGS ?= model=qwen3_next_80b_a3b model.sizes_only=true hardware=h200_measured
demo: env
	@test -f $(DEMO_TRACE) || $(BIN)/moe-trace synth $(DEMO_TRACE) --tokens 4000 --layers 16 --experts 128 --top-k 8 --seed 0 --logits full
	rm -rf $(DEMO_DIR)
	$(BIN)/moe-sim -m trace.path=$(DEMO_TRACE) $(DEMO_ARGS) policy=$(POLICIES) cache.fraction=0.25 hydra.sweep.dir=$(DEMO_DIR)
	$(BIN)/moe-report $(DEMO_DIR) --table

# The paper's comparison in the paper's setting (README, "The paper's setting"): a synthetic
# trace of Qwen3-Next-80B-A3B's shape fitted to the paper's figures (48 x 512, top-10, 4,000
# tokens), its Q4_K_M sizes, the datasheet RTX 3090 host with 16 GB of host RAM and an NVMe SSD,
# 25 % resident, six strategies; then, row by row, where the speedups land against the paper's
# 2.5-3.0x and why (runs/paper/setting/report/paper.md). Then the same strategies on the bundled
# real trace at bf16 sizes on two profiles, and background admission's beta.
PAPER_DIR ?= runs/paper
PAPER_TRACE ?= runs/paper-trace/qwen3_next_paper.parquet
PAPER_ARGS = trace.path=$(DEMO_TRACE) model=qwen3_next_80b_a3b model.sizes_only=true hardware=rtx3090_pcie4,h200_measured cache.fraction=0.25
paper: env
	rm -rf $(PAPER_DIR)
	mkdir -p $(dir $(PAPER_TRACE))
	test -f $(PAPER_TRACE) || $(BIN)/moe-trace synth $(PAPER_TRACE) --preset qwen3_next_paper --tokens 4000 --seed 0
	$(BIN)/moe-sim -m trace.path=$(PAPER_TRACE) model=qwen3_next_80b_a3b_q4km hardware=rtx3090_16gb cache.fraction=0.25 \
	  policy=$(POLICIES),substitute_all hydra.sweep.dir=$(PAPER_DIR)/setting
	$(BIN)/moe-report $(PAPER_DIR)/setting
	$(PY) -m analysis.paper $(PAPER_DIR)/setting
	$(BIN)/moe-sim -m $(PAPER_ARGS) policy=$(POLICIES),cpu_offload hydra.sweep.dir=$(PAPER_DIR)/strategies
	$(BIN)/moe-sim -m $(PAPER_ARGS) policy=fetch_all,quality_first,speed_first admission.beta=null,0.25,0.5,1.0 \
	  hydra.sweep.dir=$(PAPER_DIR)/beta
	$(BIN)/moe-report $(PAPER_DIR)/beta
	$(BIN)/moe-report $(PAPER_DIR)/strategies --table

# Prefetch against substitution (docs/PREFETCH.md): the second fixture's trace (512 experts,
# top-10, look-ahead routing) at Qwen3-Next-80B-A3B expert sizes, on the measured H200 and the
# paper's RTX 3090 host with 16 GB of host RAM and an NVMe SSD, each with the device's copy order
# (background copies submitted at once and served in order, as measured on the H200) and with an
# engine that holds its background queue (priority); three strategies with and without look-ahead
# prefetch at 10 / 25 / 50 % resident (72 runs, about a minute), then the report and the prefetch
# table and plot (runs/prefetch/report/prefetch.md, prefetch.png).
PREFETCH_DIR ?= runs/prefetch
PREFETCH_TRACE ?= traces/samples/fixture2.parquet
prefetch: env
	rm -rf $(PREFETCH_DIR)
	$(BIN)/moe-sim -m trace.path=$(PREFETCH_TRACE) model=qwen3_next_80b_a3b model.sizes_only=true \
	  hardware=h200_measured,rtx3090_16gb ++hardware.pcie.copy_order=submission,priority \
	  policy=fetch_all,quality_first,speed_first prefetch.predictor=none,lookahead cache.fraction=0.1,0.25,0.5 \
	  hydra.sweep.dir=$(PREFETCH_DIR)
	$(BIN)/moe-report $(PREFETCH_DIR)
	$(PY) -m analysis.prefetch $(PREFETCH_DIR)

# Tests in parallel processes (pytest-xdist), one per core up to TEST_JOBS_MAX: each compiles the
# kernels its tests run, up to 1.5 GB at its peak. TEST_JOBS=0 runs them all in one process.
TEST_JOBS ?= auto
TEST_JOBS_MAX ?= 4
test: env
	$(PY) -m pytest -q -n $(TEST_JOBS) --maxprocesses $(TEST_JOBS_MAX)

lint: env
	$(BIN)/ruff check simulator traces analysis tests

# Throughput, memory and JIT start-up, side by side with the reference engine and libCacheSim
# (about ten minutes on two cores; writes a 1,000,000-token trace to a temporary directory), then
# configurations per minute of a 40-job multirun (docs/SWEEPS.md, two minutes).
bench: env
	$(PY) -m simulator.bench --out docs/BENCHMARKS.md --json docs/benchmarks.json
	$(PY) -m simulator.bench_sweep --launchers default --repeats 3 --out docs/SWEEPS.md

# Import the public Qwen3-30B-A3B route trace that sits beside the project (../shared/traces).
import-route: env
	$(BIN)/moe-trace import route-csv ../shared/traces/qwen3-30b-a3b.route.csv traces/samples/qwen3-30b-a3b.route.parquet --force

clean:
	rm -rf runs multirun outputs .pytest_cache
