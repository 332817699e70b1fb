"""Import ``route_trace v1`` CSV files (llama.cpp-based engines: one row per routed expert).

The file starts with ``#`` lines: ``# route_trace v1``, a model line with ``n_layer``,
``n_expert`` and ``n_expert_used``, and ``# layer=N expert_bytes=B dense_bytes=D`` for every
layer; then the column line ``turn,phase,step,layer,slot,expert,weight,residency,expert_bytes``
and one row per (token, layer, rank), in any order.

Mapping: turn -> seq, step -> pos (a turn's steps number its prompt tokens 0..P-1, then its
decode tokens P, P+1, ...), phase 0/1 -> prefill/decode, slot -> rank, weight -> weights,
residency -> residency (1 = the recording engine had the expert resident). Per-layer expert and
dense bytes come from the header. The per-row ``expert_bytes`` column (bytes the engine read for
that lookup: 0 on a hit and on a repeat within a prefill batch) is not kept. There are no logits.

Prefill rows: the whole prompt is one batch per layer, except that at the last layer llama.cpp
computes only the token whose output it needs, so the other prompt tokens have no rows there.
The trace format needs every token at every layer: such a token-layer copies the routing of the
last token of its batch that has rows at that layer. The batch then looks up exactly the
experts the engine looked up; only selection counts of that layer grow.
``meta.extra["route_csv"]["filled_token_layers"]`` says how many token-layers were filled.
"""
from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
from tqdm import tqdm

from traces.errors import InputError
from traces.format import (
    PHASE_DECODE,
    TraceChunk,
    TraceMeta,
    TraceWriter,
    find_problem,
    group_ids,
    make_chunk,
)

MAGIC = "# route_trace v1"
COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes")
_QUANT = re.compile(r"(?i)[-_.]((?:I?Q\d\w*)|BF16|F16|F32)$")


def import_route_csv(src: str | os.PathLike, dst: str | os.PathLike, progress: bool = False) -> TraceMeta:
    """Convert a route_trace v1 CSV into a trace file at ``dst`` (written atomically)."""
    meta, cols = read_route_csv(src, progress=progress)
    with TraceWriter(dst, meta) as writer:
        writer.write(**cols)
    return meta


def load_route_csv(path: str | os.PathLike) -> tuple[TraceMeta, TraceChunk]:
    """A route_trace v1 CSV in memory: (meta, one chunk)."""
    meta, cols = read_route_csv(path)
    return meta, make_chunk(meta, **cols)


def is_route_csv(path: str | os.PathLike) -> bool:
    """Whether the file starts with the route_trace v1 header line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().strip() == MAGIC
    except OSError:
        return False


def read_route_csv(path: str | os.PathLike, progress: bool = False) -> tuple[TraceMeta, dict]:
    """Parse and check a route_trace v1 CSV: (meta, token arrays as TraceWriter.write takes them)."""
    path = Path(path)
    where = str(path)
    if not path.is_file():
        raise InputError(f"{where}: no such file; check the path")
    header, body_line = _read_header(path, where)
    rows = _read_rows(path, where, body_line, progress)
    return _to_trace(where, header, rows, body_line)


def _read_header(path: Path, where: str) -> tuple[dict, int]:
    """Header fields and the line number (1-based) of the first data row."""
    model: dict[str, str] = {}
    layers: dict[int, tuple[int, int]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if number == 1:
                if line.strip() != MAGIC:
                    raise InputError(f"{where}: line 1: expected '{MAGIC}', found {line[:60]!r}; "
                                     "this importer reads route_trace v1 CSV files")
                continue
            if not line.startswith("#"):
                if tuple(c.strip() for c in line.split(",")) != COLUMNS:
                    raise InputError(f"{where}: line {number}: expected the column line "
                                     f"'{','.join(COLUMNS)}', found {line[:80]!r}; fix the header")
                break
            fields = dict(part.split("=", 1) for part in line[1:].split() if "=" in part)
            if "layer" in fields:
                try:
                    layer = int(fields["layer"])
                    layers[layer] = (int(fields["expert_bytes"]), int(fields["dense_bytes"]))
                except (KeyError, ValueError):
                    raise InputError(f"{where}: line {number}: expected '# layer=N expert_bytes=B "
                                     f"dense_bytes=D' with integers, found {line[:80]!r}") from None
            elif "n_layer" in fields:
                model = fields
        else:
            raise InputError(f"{where}: the column line '{','.join(COLUMNS)}' is missing; "
                             "the file is truncated or not a route_trace v1 CSV")
    try:
        shape = {key: int(model[key]) for key in ("n_layer", "n_expert", "n_expert_used")}
    except (KeyError, ValueError):
        raise InputError(f"{where}: header: the model line needs integer n_layer, n_expert and "
                         "n_expert_used; add '# model=... n_layer=L n_expert=E n_expert_used=K'") from None
    missing = sorted(set(range(shape["n_layer"])) - set(layers))
    if missing:
        raise InputError(f"{where}: header: no '# layer={missing[0]} expert_bytes=... dense_bytes=...' "
                         f"line ({len(missing)} layers lack one); give one per layer")
    header = {**shape, "model": model, "layers": [layers[i] for i in range(shape["n_layer"])]}
    return header, number + 1


def _read_rows(path: Path, where: str, body_line: int, progress: bool) -> dict[str, np.ndarray]:
    """The data rows as numpy columns; a malformed line raises InputError with its number."""
    types = {name: pa.int64() for name in COLUMNS}
    types["weight"] = pa.float64()
    try:
        reader = pacsv.open_csv(
            path,
            read_options=pacsv.ReadOptions(skip_rows=body_line - 1, column_names=list(COLUMNS)),
            parse_options=pacsv.ParseOptions(ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(column_types=types),
        )
        batches = []
        with tqdm(unit="row", desc="read", disable=not progress) as bar:
            for batch in reader:
                batches.append(batch)
                bar.update(batch.num_rows)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise _locate_bad_line(path, where, body_line) or InputError(
            f"{where}: the rows cannot be parsed ({' '.join(str(exc).split())[:200]}); fix the file"
        ) from None
    table = pa.Table.from_batches(batches, schema=reader.schema)
    for name in COLUMNS:
        column = table.column(name)
        if column.null_count:  # an empty line or an empty field
            row = int(np.argmax(column.is_null().to_numpy(zero_copy_only=False)))
            raise _locate_bad_line(path, where, body_line) or InputError(
                f"{where}: line {body_line + row}: column '{name}' is empty; fill in the value")
    return {name: table.column(name).to_numpy() for name in COLUMNS}


def _locate_bad_line(path: Path, where: str, body_line: int) -> InputError | None:
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            if number < body_line:
                continue
            values = line.rstrip("\r\n").split(",")
            if len(values) != len(COLUMNS):
                return InputError(f"{where}: line {number}: expected {len(COLUMNS)} comma-separated "
                                  f"values ({','.join(COLUMNS)}), found {len(values)}; fix or remove the line")
            for name, value in zip(COLUMNS, values, strict=True):
                try:
                    float(value) if name == "weight" else int(value)
                except ValueError:
                    kind = "a number" if name == "weight" else "an integer"
                    return InputError(f"{where}: line {number}: column '{name}' is {value!r}, "
                                      f"expected {kind}; fix the line")
    return None


def _to_trace(where: str, header: dict, rows: dict[str, np.ndarray], body_line: int):
    num_layers, num_experts, k = header["n_layer"], header["n_expert"], header["n_expert_used"]
    line = body_line + np.arange(rows["turn"].shape[0])

    def fail(mask: np.ndarray, column: str, problem: str, fix: str):
        i = int(np.argmax(mask))
        raise InputError(f"{where}: line {line[i]}: column '{column}' is {rows[column][i]}, {problem}; {fix}")

    for column, low, high in (("turn", 0, 2**31 - 1), ("step", 0, 2**31 - 1), ("phase", 0, 1),
                              ("layer", 0, num_layers - 1), ("slot", 0, k - 1),
                              ("expert", 0, num_experts - 1), ("residency", 0, 1)):
        outside = (rows[column] < low) | (rows[column] > high)
        if outside.any():
            fail(outside, column, f"outside {low}..{high}", "fix the line or the header's model line")
    bad_weight = ~np.isfinite(rows["weight"]) | (rows["weight"] < 0)
    if bad_weight.any():
        fail(bad_weight, "weight", "not a finite non-negative gate weight", "fix the line")

    order = np.lexsort((rows["slot"], rows["layer"], rows["step"], rows["turn"]))
    srt = {name: rows[name][order] for name in COLUMNS}
    sline = line[order]
    # one block of rows per (turn, step, layer); each must hold the slots 0..k-1 once
    key_change = np.zeros(order.shape[0], dtype=bool)
    key_change[:1] = True
    for name in ("turn", "step", "layer"):
        key_change[1:] |= srt[name][1:] != srt[name][:-1]
    starts = np.flatnonzero(key_change)
    sizes = np.diff(starts, append=order.shape[0])
    slot_ok = np.ones(starts.shape[0], dtype=bool)
    if (sizes == k).all():
        slot_ok = (srt["slot"].reshape(-1, k) == np.arange(k)).all(axis=1)
    bad = (sizes != k) | ~slot_ok
    if bad.any():
        i = int(np.argmax(bad))
        rows_of = slice(starts[i], starts[i] + sizes[i])
        raise InputError(
            f"{where}: line {sline[rows_of].min()}: column 'slot' of turn {srt['turn'][starts[i]]} step "
            f"{srt['step'][starts[i]]} layer {srt['layer'][starts[i]]} has {sorted(srt['slot'][rows_of].tolist())}, "
            f"expected each of 0..{k - 1} once (n_expert_used={k}); fix the rows or the header"
        )
    block_line = np.minimum.reduceat(sline, starts)
    blocks = {name: srt[name][starts] for name in ("turn", "step", "layer", "phase")}
    token_change = np.ones(starts.shape[0], dtype=bool)
    token_change[1:] = (blocks["turn"][1:] != blocks["turn"][:-1]) | (blocks["step"][1:] != blocks["step"][:-1])
    token_of_block = np.cumsum(token_change) - 1
    first_block = np.flatnonzero(token_change)
    token_phase = blocks["phase"][first_block][token_of_block]
    mixed = (srt["phase"].reshape(-1, k) != token_phase[:, None]).any(axis=1)
    if mixed.any():
        b = int(np.argmax(mixed))
        raise InputError(f"{where}: line {block_line[b]}: column 'phase' differs between rows of turn "
                         f"{blocks['turn'][b]} step {blocks['step'][b]}; a token is prefill or decode")

    num_tokens = first_block.shape[0]
    seq = blocks["turn"][first_block].astype(np.int32)
    pos = blocks["step"][first_block].astype(np.int32)
    phase = blocks["phase"][first_block].astype(np.int8)
    experts = np.zeros((num_tokens, num_layers, k), dtype=np.int64)
    weights = np.zeros((num_tokens, num_layers, k), dtype=np.float32)
    residency = np.zeros((num_tokens, num_layers, k), dtype=np.int8)
    present = np.zeros((num_tokens, num_layers), dtype=bool)
    line_of = np.zeros((num_tokens, num_layers), dtype=np.int64)
    at = (token_of_block, blocks["layer"])
    experts[at] = srt["expert"].reshape(-1, k)
    weights[at] = srt["weight"].reshape(-1, k)
    residency[at] = srt["residency"].reshape(-1, k)
    present[at] = True
    line_of[at] = block_line

    filled = _fill_prefill_layers(where, seq, pos, phase, present, line_of, (experts, weights, residency))
    cols = dict(seq=seq, pos=pos, phase=phase, experts=experts, weights=weights, residency=residency)
    meta = _meta(where, header, filled, weights)
    problem = find_problem(meta, cols)
    if problem:
        raise InputError(
            f"{where}: line {line_of[problem.token, problem.layer]}: column "
            f"'{ {'experts': 'expert', 'weights': 'weight'}.get(problem.column, problem.column)}' of turn "
            f"{seq[problem.token]} step {pos[problem.token]} layer {problem.layer}: {problem.what}; "
            f"{problem.fix}"
        )
    cols["experts"] = experts.astype(np.int16)
    return meta, cols


def _fill_prefill_layers(where, seq, pos, phase, present, line_of, arrays) -> int:
    """Give prefill token-layers without rows the routing of their batch's last token there."""
    missing = ~present
    if not missing.any():
        return 0
    decode_gap = missing & (phase == PHASE_DECODE)[:, None]
    if decode_gap.any():
        t, layer = np.unravel_index(int(np.argmax(decode_gap)), decode_gap.shape)
        raise InputError(f"{where}: line {line_of[t][present[t]].min()}: turn {seq[t]} step {pos[t]} "
                         f"(decode) has no rows for layer {layer}; a decode token needs every layer")
    group = group_ids(seq, phase)
    group_start = np.flatnonzero(np.diff(group, prepend=-1))
    token = np.arange(seq.shape[0])[:, None]
    last_present = np.maximum.reduceat(np.where(present, token, -1), group_start, axis=0)
    gap_t, gap_l = np.nonzero(missing)
    src = last_present[group[gap_t], gap_l]
    if (src < 0).any():
        i = int(np.argmax(src < 0))
        t = gap_t[i]
        raise InputError(f"{where}: line {line_of[t][present[t]].min()}: the prefill batch of turn "
                         f"{seq[t]} has no rows at layer {gap_l[i]}; record every layer of a batch")
    for array in arrays:
        array[gap_t, gap_l] = array[src, gap_l]
    line_of[gap_t, gap_l] = line_of[src, gap_l]
    return int(gap_t.shape[0])


def _meta(where: str, header: dict, filled: int, weights: np.ndarray) -> TraceMeta:
    model = header["model"]
    model_path = model.get("model", "")
    stem = Path(model_path).stem if model_path else Path(where).stem
    quant = _QUANT.search(stem)
    sums = weights.sum(axis=-1)
    return TraceMeta(
        model=stem,
        num_layers=header["n_layer"],
        num_experts=header["n_expert"],
        top_k=header["n_expert_used"],
        expert_bytes=[expert for expert, _ in header["layers"]],
        dtype=quant.group(1) if quant else "unknown",
        score_function="softmax",
        renormalize=bool(sums.size and np.all(np.abs(sums - 1) < 1e-3)),
        has_residency=True,
        layer_ids=list(range(header["n_layer"])),
        dense_bytes=[dense for _, dense in header["layers"]],
        source="route-csv",
        extra={"route_csv": {
            "file": Path(where).name, "model_path": model_path, "arch": model.get("arch", ""),
            "filled_token_layers": filled,
            "note": "score_function assumed softmax; residency is the recording engine's cache state",
        }},
    )

