"""Engine results pinned: every preset policy, and the other eviction, scope, init and host-tier
choices, on the bundled trace and on a synthetic Qwen3-Next-shape trace, give exactly the stored
summaries (tests/data/pinned_summaries.json; wall-clock fields aside).

A refactoring of the engines must leave every number unchanged. A deliberate change of the
semantics regenerates the file (``python tests/test_pinned_summaries.py``) in its own commit that
says why the numbers moved.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest

from simulator.run import simulate_overrides
from traces.format import TraceMeta, make_chunk, write_trace

REPO = Path(__file__).resolve().parent.parent
EXPECTED = REPO / "tests" / "data" / "pinned_summaries.json"
BUNDLED = REPO / "traces" / "samples" / "fixture.parquet"
WALL_CLOCK = {"sim_seconds"}
POLICIES = ("fetch_all", "rule015", "first_choice", "substitute_all", "quality_first",
            "speed_first", "cpu_offload")
VARIANTS = {
    "fifo": ["policy=rule015", "cache.eviction=fifo"],
    "random": ["policy=rule015", "cache.eviction=random", "seed=7"],
    "belady": ["policy=fetch_all", "cache.eviction=belady"],
    "lfu_decay": ["policy=quality_first", "cache.lfu_decay=0.99"],
    "global_lru": ["policy=rule015", "cache=global", "cache.fraction=0.2"],
    "warm_lfu": ["policy=speed_first", "cache.init=frequency", "cache.warmup_tokens=40"],
    "host_tier": ["policy=quality_first", "hardware=rtx3090_pcie4", "+hardware.host_ram_bytes=400000000",
                  "memory.check=false"],
    "frequency_substitutes": ["policy=rule015", "policy.substitute_by=frequency"],
}
COMMON = ["model=qwen3_next_80b_a3b", "model.sizes_only=true", "hardware=h200_measured", "cache.fraction=0.25", "per_token=false"]


def qwen3_next_shape_trace(path: Path) -> Path:
    """160 tokens at Qwen3-Next's routing shape (48 layers x 512 experts, top-10), full logits:
    a prompt, decode tokens of two topics (skewed popularity per layer and topic)."""
    rng = np.random.default_rng(20261201)
    L, E, k = 48, 512, 10
    seq = np.repeat([0, 1], [90, 70])
    phase = np.ones(160, np.int8)
    phase[:24] = 0  # sequence 0 opens with a 24-token prompt
    pos = np.concatenate([np.arange(90), np.arange(70)])
    ranks = rng.permuted(np.tile(np.arange(E), (2, L, 1)), axis=-1)
    topic_pop = -1.2 * np.log1p(ranks)  # popularity ~ (1 + rank)^-1.2, a random order per topic
    scores = topic_pop[seq] + rng.gumbel(size=(160, L, E))
    experts = np.argsort(-scores, axis=-1, kind="stable")[..., :k]
    top = np.take_along_axis(scores, experts, axis=-1)
    weights = np.exp(top - top.max(axis=-1, keepdims=True))
    meta = TraceMeta(model="qwen3-next-shape", num_layers=L, num_experts=E, top_k=k,
                     expert_bytes=[6291456] * L, has_logits=True, domains=["a", "b"])
    chunk = make_chunk(meta, seq=seq, pos=pos, phase=phase, experts=experts, weights=weights,
                       logits=scores.astype(np.float32), domain=seq)
    write_trace(path, meta, chunk)
    return path


def cases() -> dict[str, list[str]]:
    """Name -> moe-sim overrides (the trace path is added per trace)."""
    out = {f"policy={p}": [f"policy={p}"] for p in POLICIES}
    out.update(VARIANTS)
    return out


def summaries(synthetic: Path) -> dict[str, dict]:
    found = {}
    # the synthetic trace is short: warm caches (init=frequency) from its first 40 tokens
    traces = (("bundled", BUNDLED, []), ("qwen3_next_shape", synthetic, ["cache.warmup_tokens=40"]))
    for trace_name, path, extra in traces:
        for name, overrides in cases().items():
            s = simulate_overrides([f"trace.path={path}", *COMMON, *extra, *overrides])
            # provenance names the run's inputs (paths, the profile), not its results
            found[f"{trace_name} {name}"] = {k: v for k, v in s.items()
                                             if k not in WALL_CLOCK and k != "provenance"}
    return found


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return a == b or (math.isnan(a) and math.isnan(b))
    return a == b


@pytest.mark.slow
def test_summaries_equal_the_pinned_ones(tmp_path):
    expected = json.loads(EXPECTED.read_text())
    found = summaries(qwen3_next_shape_trace(tmp_path / "qnext.parquet"))
    assert sorted(found) == sorted(expected)
    for case, fields in expected.items():
        for key, value in fields.items():
            assert key in found[case], f"{case}: {key} missing"
            assert _same(found[case][key], value), f"{case}: {key} = {found[case][key]!r}, pinned {value!r}"


if __name__ == "__main__":  # regenerate the pinned file
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        result = summaries(qwen3_next_shape_trace(Path(tmp) / "qnext.parquet"))
    EXPECTED.parent.mkdir(exist_ok=True)
    EXPECTED.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(result)} summaries to {EXPECTED}", file=sys.stderr)
