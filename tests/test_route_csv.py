"""The route_trace v1 CSV importer: the real Qwen3 trace, structure, and malformed files."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from traces.cli import main
from traces.errors import InputError
from traces.format import PHASE_DECODE, PHASE_PREFILL, read_trace
from traces.importers.route_csv import import_route_csv, load_route_csv, read_route_csv

REPO = Path(__file__).resolve().parent.parent
SHARED_ROUTE = REPO.parent / "shared" / "traces" / "qwen3-30b-a3b.route.csv"

HEADER = [
    "# route_trace v1",
    "# model=/models/Tiny-MoE-Q8_0.gguf arch=qwen3moe n_layer=2 n_expert=4 n_expert_used=2",
    "# layer=0 expert_bytes=100 dense_bytes=10",
    "# layer=1 expert_bytes=200 dense_bytes=20",
    "turn,phase,step,layer,slot,expert,weight,residency,expert_bytes",
]
FIRST_ROW_LINE = len(HEADER) + 1


def small_rows() -> list[str]:
    """A 3-token prompt (one batch per layer; the last layer only for the last token), 2 decode."""
    rows = []
    for layer, steps in ((0, (0, 1, 2)), (1, (2,))):
        for step in steps:
            first = (step + layer) % 4
            rows += [f"0,0,{step},{layer},0,{first},0.7,0,100",
                     f"0,0,{step},{layer},1,{(first + 1) % 4},0.3,0,0"]
    for step in (3, 4):
        for layer in (0, 1):
            rows += [f"0,1,{step},{layer},0,{step % 4},0.6,1,0",
                     f"0,1,{step},{layer},1,{(step + 2) % 4},0.4,0,{100 * (layer + 1)}"]
    return rows


def write_csv(path: Path, header: list[str] = HEADER, rows: list[str] | None = None) -> Path:
    path.write_text("\n".join(header + (small_rows() if rows is None else rows)) + "\n")
    return path


def test_small_file_maps_rows_to_tokens(tmp_path):
    meta, chunk = load_route_csv(write_csv(tmp_path / "small.csv"))
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (2, 4, 2)
    assert meta.expert_bytes == [100, 200] and meta.dense_bytes == [10, 20]
    assert meta.model == "Tiny-MoE-Q8_0" and meta.dtype == "Q8_0" and meta.source == "route-csv"
    assert meta.has_residency and not meta.has_logits and meta.renormalize
    assert chunk.seq.tolist() == [0] * 5 and chunk.pos.tolist() == [0, 1, 2, 3, 4]
    assert chunk.phase.tolist() == [PHASE_PREFILL] * 3 + [PHASE_DECODE] * 2
    assert chunk.group.tolist() == [0, 0, 0, 1, 2]
    assert chunk.experts[1, 0].tolist() == [1, 2]  # step 1, layer 0: rank order from the slots
    np.testing.assert_allclose(chunk.gates[3, 1], [0.6, 0.4])
    assert chunk.residency[3, :, 0].tolist() == [1, 1] and chunk.residency[3, :, 1].tolist() == [0, 0]
    # prompt tokens 0 and 1 have no rows at the last layer: they copy the last prompt token's
    assert meta.extra["route_csv"]["filled_token_layers"] == 2
    assert (chunk.experts[:3, 1] == chunk.experts[2, 1]).all()


def test_rows_in_any_order(tmp_path):
    rows = small_rows()
    shuffled = [rows[i] for i in np.random.default_rng(0).permutation(len(rows))]
    _, a = load_route_csv(write_csv(tmp_path / "a.csv"))
    _, b = load_route_csv(write_csv(tmp_path / "b.csv", rows=shuffled))
    np.testing.assert_array_equal(a.experts, b.experts)
    np.testing.assert_array_equal(a.gates, b.gates)


def replace_row(index: int, text: str) -> list[str]:
    rows = small_rows()
    rows[index] = text
    return rows


BAD_CSV = {
    # name: (header, rows, words the message must contain)
    "magic": (["# route_trace v2"] + HEADER[1:], None, ["line 1", "route_trace v1"]),
    "no_model_line": ([HEADER[0]] + HEADER[2:], None, ["n_layer"]),
    "no_layer_line": (HEADER[:3] + HEADER[4:], None, ["layer=1"]),
    "column_line": (HEADER[:4] + ["turn,phase,step"], None, ["line 5", "column line"]),
    "short_row": (HEADER, replace_row(3, "0,0,1,0,1,2"), [f"line {FIRST_ROW_LINE + 3}", "expected 9"]),
    "empty_line": (HEADER, replace_row(2, ""), [f"line {FIRST_ROW_LINE + 2}"]),
    "not_integer": (HEADER, replace_row(4, "0,0,2,0,0,x,0.7,0,100"),
                    [f"line {FIRST_ROW_LINE + 4}", "'expert'", "integer"]),
    "not_number": (HEADER, replace_row(4, "0,0,2,0,0,1,heavy,0,100"),
                   [f"line {FIRST_ROW_LINE + 4}", "'weight'"]),
    "expert_range": (HEADER, replace_row(9, "0,1,3,0,1,4,0.4,0,100"),
                     [f"line {FIRST_ROW_LINE + 9}", "'expert'", "outside 0..3"]),
    "duplicate_expert": (HEADER, replace_row(9, "0,1,3,0,1,3,0.4,0,100"),
                         [f"line {FIRST_ROW_LINE + 8}", "repeats"]),
    "duplicate_slot": (HEADER, replace_row(9, "0,1,3,0,0,2,0.4,0,100"),
                       [f"line {FIRST_ROW_LINE + 8}", "'slot'"]),
    "slot_range": (HEADER, replace_row(9, "0,1,3,0,2,2,0.4,0,100"),
                   [f"line {FIRST_ROW_LINE + 9}", "'slot'", "0..1"]),
    "phase_range": (HEADER, replace_row(9, "0,2,3,0,1,2,0.4,0,100"),
                    [f"line {FIRST_ROW_LINE + 9}", "'phase'"]),
    "mixed_phase": (HEADER, replace_row(9, "0,0,3,0,1,2,0.4,0,100"),
                    [f"line {FIRST_ROW_LINE + 8}", "'phase'"]),
    "layer_range": (HEADER, replace_row(9, "0,1,3,2,1,2,0.4,0,100"),
                    [f"line {FIRST_ROW_LINE + 9}", "'layer'"]),
    "negative_weight": (HEADER, replace_row(9, "0,1,3,0,1,2,-0.4,0,100"),
                        [f"line {FIRST_ROW_LINE + 9}", "'weight'"]),
    "decode_missing_layer": (HEADER, small_rows()[:-2], ["step 4", "needs every layer"]),
}


@pytest.mark.parametrize("case", sorted(BAD_CSV))
def test_malformed_file_names_line_and_field(case, tmp_path, capsys):
    header, rows, words = BAD_CSV[case]
    path = write_csv(tmp_path / f"{case}.csv", header, rows)
    with pytest.raises(InputError) as caught:
        read_route_csv(path)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(str(path)), message
    assert all(word in message for word in words), message
    out = tmp_path / "out.parquet"
    assert main(["import", "route-csv", str(path), str(out)]) == 2
    stdout, stderr = capsys.readouterr()
    assert stdout == "" and stderr.count("\n") == 1 and stderr.startswith("moe-trace: error: ")
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == [path.name]


needs_shared = pytest.mark.skipif(not SHARED_ROUTE.exists(),
                                  reason="the shared route trace is not beside the repo")


@needs_shared
def test_real_qwen3_trace_counts_phases_and_hit_rate(tmp_path):
    meta, cols = read_route_csv(SHARED_ROUTE)
    out = tmp_path / "qwen3.parquet"
    assert import_route_csv(SHARED_ROUTE, out) == meta
    meta, chunk = read_trace(out)
    assert (meta.num_layers, meta.num_experts, meta.top_k) == (48, 128, 6)
    assert meta.expert_bytes[0] == 3_059_712 and meta.expert_bytes[6] == 2_654_208
    assert meta.dense_bytes[6] == 11_682_816 and meta.dtype == "Q4_K_M"
    filled = meta.extra["route_csv"]["filled_token_layers"]
    # 44,766 recorded expert rows = 6 per recorded token-layer; the prompt's last layer was
    # recorded for its last token only
    assert chunk.num_tokens * 48 - filled == 44_766 // 6 and filled == 27
    prefill, decode = chunk.phase == PHASE_PREFILL, chunk.phase == PHASE_DECODE
    assert prefill.sum() == 28 and decode.sum() == 128
    assert np.unique(chunk.group[prefill]).size == 1  # the prompt is one batch
    assert chunk.pos.tolist() == list(range(156))
    assert int(chunk.residency[decode].sum()) == 29_597 and chunk.residency[decode].size == 36_864
    assert chunk.experts[0, 0].tolist() == [49, 19, 58, 29, 16, 70]  # the file's first six rows
    np.testing.assert_allclose(cols["weights"][0, 0, :2], [0.221297, 0.191844], rtol=1e-6)
    np.testing.assert_allclose(chunk.gates.sum(-1), 1.0, rtol=1e-5)
