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
    META_BOUNDS,
    PHASE_DECODE,
    TraceChunk,
    TraceMeta,
    TraceWriter,
    ensure_memory,
    find_problem,
    group_ids,
    make_chunk,
    regular_file,
)

MAGIC = "# route_trace v1"
COLUMNS = ("turn", "phase", "step", "layer", "slot", "expert", "weight", "residency", "expert_bytes")
_QUANT = re.compile(r"(?i)[-_.]((?:I?Q\d\w*)|BF16|F16|F32)$")
SHOWN_CHARS = 200  # of a line quoted in a message
INT64 = (-(2**63), 2**63 - 1)
# header fields -> the metadata fields whose bounds they obey
SHAPE_FIELDS = {"n_layer": "num_layers", "n_expert": "num_experts", "n_expert_used": "top_k"}
LAYER_FIELDS = {"expert_bytes": "expert_bytes", "dense_bytes": "dense_bytes"}
ROW_BYTES = 3 * len(COLUMNS) * 8  # a parsed row as int64/float64 columns, sorted, and their copies
TOKEN_LAYER_RANK_BYTES = 8 + 4 + 1 + 2  # the token arrays: experts (int64, then int16), weights, residency


def shown_line(text: str) -> str:
    """A line quoted for a message: repr, cut to SHOWN_CHARS characters."""
    return repr(text[:SHOWN_CHARS]) + ("..." if len(text) > SHOWN_CHARS else "")


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
            return f.readline(len(MAGIC) + 2).strip() == MAGIC  # bounded: a file may have no newline
    except OSError:
        return False


def read_route_csv(path: str | os.PathLike, progress: bool = False) -> tuple[TraceMeta, dict]:
    """Parse and check a route_trace v1 CSV: (meta, token arrays as TraceWriter.write takes them)."""
    path = regular_file(path, "route_trace v1 CSV file")
    where = str(path)
    header, body_line = _read_header(path, where)
    most_rows = path.stat().st_size // len("0,0,0,0,0,0,0,0,0\n")  # all rows as short as can be
    ensure_memory(most_rows * ROW_BYTES, f"reading up to {most_rows:,} rows", where)
    rows = _read_rows(path, where, body_line, progress)
    if not rows["turn"].size:
        raise InputError(f"{where}: line {body_line}: no data rows after the column line; the file is "
                         "empty or truncated, record at least one token")
    return _to_trace(where, header, rows, body_line)


def _read_header(path: Path, where: str) -> tuple[dict, int]:
    """Header fields and the line number (1-based) of the first data row."""
    model: dict[str, str] = {}
    model_line = 0
    layers: dict[int, tuple[int, int]] = {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if number == 1:
                if line.strip() != MAGIC:
                    raise InputError(f"{where}: line 1: expected '{MAGIC}', found {shown_line(line)}; "
                                     "this importer reads route_trace v1 CSV files")
                continue
            if not line.startswith("#"):
                if tuple(c.strip() for c in line.split(",")) != COLUMNS:
                    raise InputError(f"{where}: line {number}: expected the column line "
                                     f"'{','.join(COLUMNS)}', found {shown_line(line)}; fix the header")
                break
            fields = dict(part.split("=", 1) for part in line[1:].split() if "=" in part)
            if "layer" in fields:
                try:
                    layer = int(fields["layer"])
                    sizes = {name: int(fields[name]) for name in LAYER_FIELDS}
                except (KeyError, ValueError):
                    raise InputError(f"{where}: line {number}: expected '# layer=N expert_bytes=B "
                                     f"dense_bytes=D' with integers, found {shown_line(line)}") from None
                for name, value in sizes.items():
                    _check_bound(where, f"line {number}", name, value, LAYER_FIELDS[name])
                layers[layer] = (sizes["expert_bytes"], sizes["dense_bytes"])
            elif "n_layer" in fields:
                model, model_line = fields, number
        else:
            raise InputError(f"{where}: the column line '{','.join(COLUMNS)}' is missing; "
                             "the file is truncated or not a route_trace v1 CSV")
    try:
        shape = {key: int(model[key]) for key in SHAPE_FIELDS}
    except (KeyError, ValueError):
        raise InputError(f"{where}: header: the model line needs integer n_layer, n_expert and "
                         "n_expert_used; add '# model=... n_layer=L n_expert=E n_expert_used=K'") from None
    for key, value in shape.items():  # before anything is sized by them
        _check_bound(where, f"line {model_line}", key, value, SHAPE_FIELDS[key])
    if shape["n_expert_used"] > shape["n_expert"]:
        raise InputError(f"{where}: line {model_line}: n_expert_used={shape['n_expert_used']} exceeds "
                         f"n_expert={shape['n_expert']}; fix the model line")
    missing = sorted(set(range(shape["n_layer"])) - set(layers))
    if missing:
        raise InputError(f"{where}: header: no '# layer={missing[0]} expert_bytes=... dense_bytes=...' "
                         f"line ({len(missing)} layers lack one); give one per layer")
    header = {**shape, "model": model, "layers": [layers[i] for i in range(shape["n_layer"])]}
    return header, number + 1


def _check_bound(where: str, line: str, name: str, value: int, meta_field: str) -> None:
    low, high, why = META_BOUNDS[meta_field]
    if not low <= value <= high:
        side = f"below {low}" if value < low else f"above the cap {high:,} ({why})"
        raise InputError(f"{where}: {line}: {name}={value} is {side}; fix the header")


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
            f"{where}: the rows cannot be parsed ({' '.join(str(exc).split())[:SHOWN_CHARS]}); fix the file"
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
                                  f"values ({','.join(COLUMNS)}), found {len(values)} in "
                                  f"{shown_line(line.rstrip())}; fix or remove the line")
            for name, value in zip(COLUMNS, values, strict=True):
                kind = "a number" if name == "weight" else "an integer in the int64 range"
                try:
                    number_value = float(value.strip('" ')) if name == "weight" else int(value.strip('" '))
                except ValueError:
                    number_value = None
                if number_value is None or (name != "weight" and not INT64[0] <= number_value <= INT64[1]):
                    return InputError(f"{where}: line {number}: column '{name}' is {shown_line(value)}, "
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
    ensure_memory(num_tokens * num_layers * (k * TOKEN_LAYER_RANK_BYTES + 9),
                  f"{num_tokens:,} tokens x {num_layers} layers x {k} experts", where)
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
    sums = weights.sum(axis=-1, dtype=np.float64)
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

