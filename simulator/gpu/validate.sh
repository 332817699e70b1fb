#!/usr/bin/env bash
# The GPU-host validation of the timing model (docs/VALIDATION.md): predict, then measure.
#
#   simulator/gpu/validate.sh traces  anywhere the project is installed: the two traces the plans
#                                     read, in runs/validation/ (carry that folder to the GPU host)
#   OUT=DIR simulator/gpu/validate.sh on the GPU host: calibrate; plan every run with that
#                                     calibration (moe-replay plan, Hydra carried as wheels); then
#                                     execute the plans; every result file lands under $OUT, a
#                                     summary table last
#   simulator/gpu/validate.sh plans   the plans made here instead, with the committed profile
#                                     (conf/hardware/h200_measured.yaml); the GPU host then runs
#                                     them with PLAN_HERE=0
#
# Planning on the host right after its calibration makes each prediction before its measurement
# with the profile of the same host and minutes: the executed decisions are the ones the
# simulator makes with that profile (a plan made elsewhere can sit on the other side of a
# threshold: a prefetch that lands just before or just after its layer). The SSD rows carry one
# more calibration: the disk's read-then-copy pipelines measured again before each round of their
# executions and after the last (moe-replay run --disk-samples), pooled with the first
# calibration into $OUT/h200_ssd.yaml, since the leased hosts' disks drift by 10-15 % within
# minutes. Then, back here, with the results copied into docs/validation/:
#
#   moe-replay compare docs/validation/{qwen3_next,qwen3_30b,prefetch,ssd}.json \
#       --profile P --profile P --profile P --profile docs/validation/h200_ssd.yaml --out docs/VALIDATION.md
#
# (P: the calibration the plans were made with, docs/validation/h200_measured.yaml.)
#
# SECTIONS picks the plans to run (default all four, in the order below); the stages, each capped
# by a timeout so that a stuck one leaves time to the others (estimates from the last runs' logs):
# calibrate about 1.5 min (writing the 4 GiB expert file included), planning under 1 min with 12
# workers, Qwen3-Next replay about 2 min (15 runs of 256 tokens, 24 GiB of pinned host experts),
# Qwen3-30B replay about 1 min (15 runs of 128 tokens), prefetch about 1 min (6 runs, 3
# executions each), SSD path about 4.5 min (6 runs of 128 tokens, SSD-bound at 50-150 ms per
# token, 3 executions each in rounds, the disk measured between them). All four exceed one
# 10-minute call: run SECTIONS="qwen3_next qwen3_30b prefetch", then SECTIONS=ssd.
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/../.."

PLANS=${PLANS:-runs/validation/plans}
TRACES=${TRACES:-runs/validation}
NEXT_TRACE=$TRACES/qwen3_next_synth_320.parquet
Q30_TRACE=$TRACES/qwen3_30b_a3b.route.parquet
ALL_SECTIONS="qwen3_next qwen3_30b prefetch ssd"

traces() {
    local bin=${BIN:-.venv/bin}
    mkdir -p "$TRACES"
    # (b) the Qwen3-Next shape: a synthetic trace, regenerated deterministically
    "$bin/moe-trace" synth "$NEXT_TRACE" --tokens 320 --layers 48 --experts 512 --top-k 10 --seed 0 \
        --prompt-share 0 --seq-tokens 100000 --model qwen3_next_80b_a3b --force
    # (a) the public Qwen3-30B-A3B route trace at its real dims (48 x 128, top-6 as recorded)
    "$bin/moe-trace" import route-csv ../shared/traces/qwen3-30b-a3b.route.csv "$Q30_TRACE" --force
}

# plan_section NAME PROFILE JOBS COMMAND...: the recipe of one plan (its trace, runs and
# overrides), made by COMMAND (moe-replay, or python -m simulator.gpu.replay) with PROFILE, JOBS
# runs at once
plan_section() {
    local name=$1 profile=$2 jobs=$3
    shift 3
    local plan=("$@" plan --profile "$profile" --jobs "$jobs" --out "$PLANS/$name.npz")
    # bf16 experts (the replay's kernels); the warm-up is the recorded prompt, so 128 decode tokens
    local q30=(--trace "$Q30_TRACE" --model qwen3_30b_a3b --override model.sizes_only=true
               --override cache.init=frequency --override cache.warmup_tokens=28)
    mkdir -p "$PLANS"
    case $name in
        qwen3_next) "${plan[@]}" --trace "$NEXT_TRACE" --model qwen3_next_80b_a3b \
            --override cache.init=frequency --override cache.warmup_tokens=64 \
            --label "Qwen3-Next-80B-A3B shape, synthetic trace" ;;
        qwen3_30b) "${plan[@]}" "${q30[@]}" --label "Qwen3-30B-A3B, public route trace (real routing)" ;;
        ssd) "${plan[@]}" "${q30[@]}" --policies rule015,speed_first --fractions 0.25 --host-ram 2,4,8 \
            --pinned-share 0.5 --label "Qwen3-30B-A3B, public route trace, host RAM limited" ;;
        # (c) prefetch: the second fixture's trace (8 x 512, top-10, look-ahead routing captured) at
        # Qwen3-Next sizes, prefetching layer l+1's look-ahead top-10 as background copies
        prefetch) "${plan[@]}" --trace traces/samples/fixture2.parquet --model qwen3_next_80b_a3b \
            --override model.sizes_only=true --override trace.max_tokens=320 --override cache.init=frequency \
            --override cache.warmup_tokens=64 --override prefetch.predictor=lookahead \
            --policies fetch_all,quality_first,speed_first --fractions 0.1,0.25 \
            --label "fixture 2 trace (8 x 512, top-10) at Qwen3-Next sizes, prefetch from look-ahead routing" ;;
        *) echo "unknown section $name (known: $ALL_SECTIONS)" >&2; return 2 ;;
    esac
}

plans() {
    local bin=${BIN:-.venv/bin}
    traces
    for name in ${SECTIONS:-$ALL_SECTIONS}; do
        plan_section "$name" conf/hardware/h200_measured.yaml "${PLAN_JOBS:-2}" "$bin/moe-replay"
    done
    ls -l "$PLANS"
}

gpu() {
    : "${OUT:?set OUT to the folder for the result files}"
    # DEVICE=cpu: the same stages at tiny shapes (a test of this script, not of a host)
    local py=${PY:-python3} dev=${DEVICE:-cuda} ssd_file=${SSD_FILE:-/var/tmp/moe-experts.bin} log=$OUT/validate.log
    local sections=${SECTIONS:-$ALL_SECTIONS} profile=$OUT/h200_measured.yaml
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
    stage calibrate 150 "$py" -m simulator.gpu.calibrate --device "$dev" --out "$profile" \
        --models qwen3_next_80b_a3b,qwen3_30b_a3b:6 --ssd-file "$ssd_file" --ssd-file-mib 4096
    local name limit repeats
    if [[ ${PLAN_HERE:-1} == 1 ]]; then
        for name in $sections; do
            rm -f "$PLANS/$name.npz"  # a failed plan must not leave an older one to run
            [[ -f $profile ]] && stage "plan $name" 120 bash "$SELF" plan-section "$name" "$profile" \
                "${PLAN_JOBS:-12}" "$py" -m simulator.gpu.replay
        done
    fi
    # section:seconds:executions. The SSD rows run 3 times, in rounds over the runs, the disk
    # measured before each round and after the last.
    for plan in qwen3_next:160:1 qwen3_30b:90:1 prefetch:60:${PREFETCH_REPEATS:-3} ssd:300:${SSD_REPEATS:-3}; do
        IFS=: read -r name limit repeats <<<"$plan"
        [[ " $sections " == *" $name "* ]] || continue
        if [[ ! -f $PLANS/$name.npz ]]; then
            echo "== replay $name: skipped (no $PLANS/$name.npz)" >>"$log"
            failed=$((failed + 1))
            continue
        fi
        local disk=()
        [[ $name == ssd && -f ${profile%.yaml}.samples.json ]] && disk=(--disk-samples "${profile%.yaml}.samples.json")
        stage "replay $name" "$limit" "$py" -m simulator.gpu.replay run --device "$dev" --repeats "$repeats" \
            --plan "$PLANS/$name.npz" --out "$OUT/$name" --ssd-file "$ssd_file" --ssd-file-mib 4096 "${disk[@]}"
    done
    if [[ -f $OUT/ssd/disk.samples.json ]]; then
        stage "pool the calibration with the disk rounds" 30 "$py" -m simulator.gpu.calibrate \
            --out "$OUT/h200_ssd.yaml" --from-samples "${profile%.yaml}.samples.json,$OUT/ssd/disk.samples.json"
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
    traces) traces ;;
    plans) plans ;;
    plan-section) shift; plan_section "$@" ;;
    gpu) gpu ;;
    *) echo "usage: $0 [traces|plans|gpu]" >&2; exit 2 ;;
esac
