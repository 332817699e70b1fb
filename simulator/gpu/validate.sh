#!/usr/bin/env bash
# The GPU-host validation of the timing model (docs/VALIDATION.md), in two halves:
#
#   simulator/gpu/validate.sh plans   anywhere the project is installed (moe-replay plan needs
#                                     Hydra): the traces, then the plans, in runs/validation/
#   OUT=DIR simulator/gpu/validate.sh on the GPU host: calibrate, then every replay run; every
#                                     result file lands under $OUT, a summary table last
#
# The plans (runs/validation/plans/, ignored by git, about 8 MB) are what travels to the GPU
# host: carry that folder with the working tree. They are made with the committed profile
# (conf/hardware/h200_measured.yaml); the GPU host needs only python3 with torch (+ Triton),
# numpy, pyarrow and pyyaml. Then, back here, with the results copied into docs/validation/:
#
#   moe-replay compare docs/validation/{qwen3_next,qwen3_30b,ssd,prefetch}.json \
#       --profile docs/validation/h200_pooled.yaml --out docs/VALIDATION.md
#
# (h200_pooled.yaml: the calibration before the replays and the copies and disk measured again
# after them, pooled; h200_measured.yaml is the first alone.)
#
# Stages on the H200 host (estimates from the last run's logs, each capped by a timeout so that
# a stuck stage leaves time to the others; all of it under 10 minutes): calibrate about 2 min
# (writing the 4 GiB expert file included), Qwen3-Next replay about 2 min (15 runs of 256
# tokens, 24 GiB of pinned host experts), Qwen3-30B replay about 1 min (15 runs of 128
# tokens), SSD path about 4 min (6 runs of 128 tokens, 3 executions each, SSD-bound at 50-150 ms per
# token), prefetch about 1 min (6 runs, 3 executions each), the copies and the disk again about 1 min.
set -euo pipefail
cd "$(dirname "$0")/../.."

PLANS=${PLANS:-runs/validation/plans}
TRACES=${TRACES:-runs/validation}
NEXT_TRACE=$TRACES/qwen3_next_synth_320.parquet
Q30_TRACE=$TRACES/qwen3_30b_a3b.route.parquet
PROFILE=conf/hardware/h200_measured.yaml

plans() {
    local bin=${BIN:-.venv/bin}
    mkdir -p "$TRACES" "$PLANS"
    # (b) the Qwen3-Next shape: a synthetic trace, regenerated deterministically
    "$bin/moe-trace" synth "$NEXT_TRACE" --tokens 320 --layers 48 --experts 512 --top-k 10 --seed 0 \
        --prompt-share 0 --seq-tokens 100000 --model qwen3_next_80b_a3b --force
    # (a) the public Qwen3-30B-A3B route trace at its real dims (48 x 128, top-6 as recorded)
    "$bin/moe-trace" import route-csv ../shared/traces/qwen3-30b-a3b.route.csv "$Q30_TRACE" --force
    "$bin/moe-replay" plan --trace "$NEXT_TRACE" --profile "$PROFILE" --model qwen3_next_80b_a3b \
        --override cache.init=frequency --override cache.warmup_tokens=64 \
        --label "Qwen3-Next-80B-A3B shape, synthetic trace" --out "$PLANS/qwen3_next.npz"
    # bf16 experts (the replay's kernels); the warm-up is the recorded prompt, so 128 decode tokens
    local q30=(--trace "$Q30_TRACE" --profile "$PROFILE" --model qwen3_30b_a3b --override model.sizes_only=true
               --override cache.init=frequency --override cache.warmup_tokens=28)
    "$bin/moe-replay" plan "${q30[@]}" --label "Qwen3-30B-A3B, public route trace (real routing)" \
        --out "$PLANS/qwen3_30b.npz"
    "$bin/moe-replay" plan "${q30[@]}" --policies rule015,speed_first --fractions 0.25 --host-ram 2,4,8 \
        --pinned-share 0.5 --label "Qwen3-30B-A3B, public route trace, host RAM limited" --out "$PLANS/ssd.npz"
    # (c) prefetch: the second fixture's trace (8 x 512, top-10, look-ahead routing captured) at
    # Qwen3-Next sizes, prefetching layer l+1's look-ahead top-10 as background copies
    "$bin/moe-replay" plan --trace traces/samples/fixture2.parquet --profile "$PROFILE" --model qwen3_next_80b_a3b \
        --override model.sizes_only=true --override trace.max_tokens=320 --override cache.init=frequency \
        --override cache.warmup_tokens=64 --override prefetch.predictor=lookahead \
        --policies fetch_all,quality_first,speed_first --fractions 0.1,0.25 \
        --label "fixture 2 trace (8 x 512, top-10) at Qwen3-Next sizes, prefetch from look-ahead routing" \
        --out "$PLANS/prefetch.npz"
    ls -l "$PLANS"
}

gpu() {
    : "${OUT:?set OUT to the folder for the result files}"
    # DEVICE=cpu: the same stages at tiny shapes (a test of this script, not of a host)
    local py=${PY:-python3} dev=${DEVICE:-cuda} ssd_file=${SSD_FILE:-/var/tmp/moe-experts.bin} log=$OUT/validate.log
    export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
    mkdir -p "$OUT"
    local failed=0
    stage() {  # stage NAME SECONDS COMMAND...: logged, timed, capped; a failed stage leaves the rest
        local name=$1 limit=$2 t0=$SECONDS
        shift 2
        echo "== $name (at most $limit s)" >>"$log"
        if timeout "$limit" "$@" >>"$log" 2>&1; then
            echo "== $name: done in $((SECONDS - t0)) s" >>"$log"
        else
            echo "== $name: FAILED (exit $?) after $((SECONDS - t0)) s" >>"$log"
            failed=$((failed + 1))
        fi
    }
    stage calibrate 150 "$py" -m simulator.gpu.calibrate --device "$dev" --out "$OUT/h200_measured.yaml" \
        --models qwen3_next_80b_a3b,qwen3_30b_a3b:6 --ssd-file "$ssd_file" --ssd-file-mib 4096
    # plan:seconds:executions per run. The SSD rows run 3 times, in rounds over the runs: the
    # leased hosts' disks drift by 10-15 % within a minute, more than the row target allows.
    local name limit repeats
    for plan in qwen3_next:160:1 qwen3_30b:90:1 ssd:280:${SSD_REPEATS:-3} prefetch:60:${PREFETCH_REPEATS:-3}; do
        IFS=: read -r name limit repeats <<<"$plan"
        if [[ ! -f $PLANS/$name.npz ]]; then  # a plans folder made without this plan
            echo "== replay $name: skipped (no $PLANS/$name.npz)" >>"$log"
            continue
        fi
        stage "replay $name" "$limit" "$py" -m simulator.gpu.replay run --device "$dev" --repeats "$repeats" \
            --plan "$PLANS/$name.npz" --out "$OUT/$name" --ssd-file "$ssd_file" --ssd-file-mib 4096
    done
    # the copies and the disk again at the end, pooled with the first calibration: the profile to
    # compare against then holds the link's drift over the replays (calibration only, no replay)
    stage "calibrate again (copies and disk)" 75 "$py" -m simulator.gpu.calibrate --link-only --device "$dev" \
        --out "$OUT/h200_measured_end.yaml" --models qwen3_next_80b_a3b,qwen3_30b_a3b:6 --ssd-file "$ssd_file" \
        --ssd-file-mib 4096
    if [[ -f $OUT/h200_measured.samples.json && -f $OUT/h200_measured_end.samples.json ]]; then
        stage "pool the calibrations" 30 "$py" -m simulator.gpu.calibrate --out "$OUT/h200_pooled.yaml" \
            --from-samples "$OUT/h200_measured.samples.json,$OUT/h200_measured_end.samples.json"
    fi
    rm -f "$ssd_file"
    grep '^== ' "$log"
    shopt -s nullglob
    local results=("$OUT"/*/replay.json)
    if ((${#results[@]})); then
        "$py" -m simulator.gpu.replay summary "${results[@]}" | tee "$OUT/summary.txt"
    fi
    return $((failed > 0))
}

case "${1:-gpu}" in
    plans) plans ;;
    gpu) gpu ;;
    *) echo "usage: $0 [plans|gpu]" >&2; exit 2 ;;
esac
