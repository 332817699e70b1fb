"""The shipped fixture model and the bundled trace: they load, fit their budgets, and agree."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from traces.capture.capture import run_capture  # noqa: E402
from traces.capture.config import CaptureConfig, InputConfig, ModelConfig  # noqa: E402
from traces.capture.model import load_model  # noqa: E402
from traces.format import open_trace, read_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "traces" / "fixtures" / "model"
TRACE = ROOT / "traces" / "samples" / "fixture.parquet"
MODEL2 = ROOT / "traces" / "fixtures" / "fixture2" / "model"
TRACE2 = ROOT / "traces" / "samples" / "fixture2.parquet"
MAX_FILE_BYTES = 20 * 2**20  # no file in the repository is larger
needs_model = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="fixture model not built")
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="bundled trace not built")
needs_fixture2 = pytest.mark.skipif(not ((MODEL2 / "training.json").exists() and TRACE2.exists()),
                                    reason="second fixture not built (traces/fixtures/build2.sh)")
needs_model2 = pytest.mark.skipif(not any(MODEL2.glob("*.safetensors")),
                                  reason="second fixture's weights not built (the repository ships its trace: "
                                         "STAGES=train bash traces/fixtures/build2.sh)")


@pytest.fixture(scope="module")
def fixture_model():
    return load_model(ModelConfig(path=str(MODEL), device="cpu"))


@needs_model
def test_fixture_files_fit_and_report_quality():
    assert (MODEL / "model.safetensors").stat().st_size <= 16 * 10**6
    training = json.loads((MODEL / "training.json").read_text())
    assert training["val_ppl"] < 0.25 * training["unigram_ppl"]
    uniform = training["uniform_share"]
    assert min(training["top10pct_share_per_layer"]) > 1.5 * uniform  # clearly non-uniform routing


@needs_model
def test_fixture_model_loads_and_captures(fixture_model, tmp_path):
    model, tokenizer, sites, _ = fixture_model
    assert [s.layer_id for s in sites] == [1, 2, 3, 4, 5, 6]
    assert sites[0].num_experts == 64 and sites[0].top_k >= 4
    text = tmp_path / "code"
    text.mkdir()
    (text / "a.py").write_text("def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n" * 4)
    cfg = CaptureConfig(model=ModelConfig(path=str(MODEL), device="cpu"),
                        input=InputConfig(paths=[str(text)], window_tokens=48, min_window_tokens=2),
                        out=str(tmp_path / "t.parquet"), progress=False, mode="generate")
    cfg.generate.prompt_tokens, cfg.generate.new_tokens = 16, 4
    stats = run_capture(cfg)
    meta, chunk = read_trace(cfg.out)
    assert meta.num_layers == 6 and meta.has_logits and meta.layer_ids == [1, 2, 3, 4, 5, 6]
    assert chunk.num_tokens == stats["tokens"] > 0
    later = chunk.pos > 0  # the first token of a sequence has no context, so no NLL
    assert np.isnan(chunk.nll[~later]).all() and (chunk.nll[later] < 12).all()


@needs_trace
def test_bundled_trace_meets_its_specification():
    # 20,000 tokens x 6 layers x 64 bf16-valued logits hold ~10.2 MB of information on their own:
    # the bundled file rounds them to 1/32 to stay within 10 MB (traces/samples/README.md)
    assert TRACE.stat().st_size <= 10 * 10**6
    trace = open_trace(TRACE)
    meta = trace.meta
    assert meta.num_layers >= 6 and meta.num_experts >= 64 and meta.has_logits
    assert len(meta.domains) >= 4 and meta.source == "capture"
    tokens = sum(c.num_tokens for c in trace.iter_chunks())
    assert tokens >= 20_000


def first_sequence_routing(model, sites, chunk):
    """Re-run the trace's first sequence: per MoE layer (router input, chosen ids) of the model."""
    sel = chunk.seq == chunk.seq[0]
    seen = {j: [] for j in range(len(sites))}
    handles = [s.module.register_forward_hook(lambda m, a, out, j=j: seen[j].append((a[0], out[2])))
               for j, s in enumerate(sites)]
    try:
        with torch.inference_mode():
            model(input_ids=torch.as_tensor(chunk.token_id[sel], dtype=torch.long)[None])
    finally:
        for h in handles:
            h.remove()
    return sel, [seen[j][0] for j in range(len(sites))]


@needs_model
@needs_trace
def test_bundled_trace_is_this_models_routing(fixture_model):
    """Re-run the first sequence on the CPU: the recorded first choices are the model's (up to bf16 noise)."""
    model, _, sites, _ = fixture_model
    meta, chunk = read_trace(TRACE)
    sel, routing = first_sequence_routing(model, sites, chunk)
    first = np.stack([ids[:, 0].numpy() for _, ids in routing], axis=1)
    assert (first == chunk.experts[sel][:, :, 0]).mean() > 0.9


@needs_fixture2
def test_second_fixture_fits_the_papers_regime_and_its_budgets():
    training = json.loads((MODEL2 / "training.json").read_text())
    recorded = training["weight_files"]  # the shards as the build wrote them (the repository ships none)
    assert recorded and all(size <= MAX_FILE_BYTES for size in recorded.values())
    assert all(w.stat().st_size == recorded[w.name] for w in MODEL2.glob("*.safetensors"))
    assert TRACE2.stat().st_size <= MAX_FILE_BYTES
    assert training["val_ppl"] < 0.25 * training["unigram_ppl"]
    assert min(training["top10pct_share_per_layer"]) > 1.5 * training["uniform_share"]
    meta = open_trace(TRACE2).meta
    assert meta.num_experts >= 256 and 8 <= meta.top_k <= 10 and meta.num_layers >= 8
    assert meta.logits_top_r > 0 and meta.lookahead_depth >= 1 and meta.lookahead_source == "moe_input"


@needs_fixture2
@needs_model2
def test_second_fixtures_trace_is_its_routing_and_look_ahead():
    """The first sequence again on the CPU: first choices and the look-ahead of the next layer's router."""
    model, _, sites, _ = load_model(ModelConfig(path=str(MODEL2), device="cpu"))
    meta, chunk = read_trace(TRACE2)
    sel, routing = first_sequence_routing(model, sites, chunk)
    first = np.stack([ids[:, 0].numpy() for _, ids in routing], axis=1)
    assert (first == chunk.experts[sel][:, :, 0]).mean() > 0.9
    with torch.inference_mode():  # router of layer 1 on layer 0's MoE input: its top choice, recorded
        ahead = sites[1].module(routing[0][0])[0].float().argmax(-1).numpy()
    assert (ahead == chunk.lookahead_ids[sel][:, 0, 0, 0]).mean() > 0.9


def test_fit_keeps_the_longest_whole_sequence_prefix_under_the_cap(tmp_path):
    from traces.fixtures.fixture2 import fit_trace
    from traces.format import write_trace
    from traces.synth import synth_trace

    meta, chunk = synth_trace(tokens=2000, layers=4, experts=64, top_k=4, seed=0, logits="full", seq_tokens=100)
    write_trace(tmp_path / "all.parquet", meta, chunk)
    size = (tmp_path / "all.parquet").stat().st_size
    record = fit_trace(tmp_path / "all.parquet", tmp_path / "fit.parquet", size // 3)
    _, kept = read_trace(tmp_path / "fit.parquet")
    assert record["kept_bytes"] == (tmp_path / "fit.parquet").stat().st_size <= size // 3
    assert kept.num_tokens == record["kept_tokens"] and 400 <= kept.num_tokens < 2000
    assert kept.seq[-1] != chunk.seq[kept.num_tokens]  # whole sequences only
    np.testing.assert_array_equal(kept.experts, chunk.experts[:kept.num_tokens])
    assert fit_trace(tmp_path / "all.parquet", tmp_path / "same.parquet", size)["kept_tokens"] == 2000


@pytest.mark.slow
def test_second_fixture_build_runs_end_to_end_on_the_cpu(tmp_path):
    """build2.sh with tiny sizes: train, capture with look-ahead, fit, bench both fixtures, card."""
    env = {**os.environ, "PY": sys.executable, "RESULTS": str(tmp_path / "r"), "DEVICE": "cpu",
           "MODEL2": str(tmp_path / "model"), "TRACE2": str(tmp_path / "fixture2.parquet"),
           "CARD2": str(tmp_path / "README.md"), "CAPTURE_TOKENS": "1200", "MAX_TRACE_MB": "0.3",
           "BENCH_TOKENS": "64", "BENCH_BATCHES": "1,2", "REPEATS": "1",
           "TRAIN_SET": "steps=2 batch_size=2 max_domain_chars=300000 max_doc_chars=4000 val_tokens=1024 "
                        "warmup_steps=1 train_seconds=0 moe_layers=3 num_experts=64 top_k=8 hidden_size=64 "
                        "num_heads=2 num_kv_heads=1 vocab_size=512 max_shard_mb=1"}
    proc = subprocess.run(["bash", str(ROOT / "traces" / "fixtures" / "build2.sh")], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = tmp_path / "r"
    assert len(list((tmp_path / "model").glob("*.safetensors"))) == 2  # shards
    fit = json.loads((r / "fit.json").read_text())
    assert fit["kept_tokens"] < fit["captured_tokens"] == 1200 and fit["kept_bytes"] <= 0.3 * 2**20
    meta, chunk = read_trace(tmp_path / "fixture2.parquet")
    assert (meta.logits_top_r, meta.lookahead_depth, meta.lookahead_top_r) == (32, 2, 20)
    assert chunk.num_tokens == fit["kept_tokens"] and meta.num_experts == 64 and meta.top_k == 8
    assert open_trace(r / "fixture2_layer_output.parquet").meta.lookahead_source == "layer_output"
    for name in ("bench_fixture", "bench_fixture2", "bench_fixture2_lookahead"):
        runs = json.loads((r / f"{name}.json").read_text())["runs"]
        assert [run["batch_size"] for run in runs] == [1, 2]
    card = (tmp_path / "README.md").read_text()
    assert f"{chunk.num_tokens:,} tokens" in card and "Capture overhead" in card and "+nan" not in card


def test_gpu_host_entry_points_need_neither_polars_nor_hydra():
    """The H200 host has neither: the build scripts' modules must import without them."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('polars', 'hydra', 'omegaconf'):\n"
        "            raise ImportError(f'{name} is not on the GPU host')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import traces.capture.__main__, traces.capture.bench, traces.capture.capture\n"
        "import traces.fixtures.train_fixture, traces.fixtures.fixture2, traces.fixtures.card\n"
        "print('ok')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
