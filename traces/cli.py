"""moe-trace: make, import and inspect router traces.

    moe-trace synth OUT --tokens T --layers L --experts E --top-k K --seed S [--logits full|none|top:R] ...
    moe-trace synth OUT --like REAL --tokens T [--seed S] [--logits ...] [--check]
    moe-trace synth OUT --preset NAME --tokens T [--seed S] [--logits ...]
    moe-trace synth --check REAL SYNTH
    moe-trace import route-csv IN OUT
    moe-trace repack IN OUT [--logits-quantum Q] [--compact-logits]
    moe-trace info PATH [--json] [--verify]
    moe-trace cache list [--json] | clear [KEY ...]    the decoded copies moe-sim keeps (trace.cache)
    moe-trace predict TRACE [--predictor NAME ...] [--distance D ...] [--top-p P ...] [--train-tokens N] [--out DIR]

Bad input, and a disk or permission error, prints ``moe-trace: error: <one line>`` on stderr
(control characters escaped) and exits 2; an output file is written completely or not at all,
and an existing one is replaced only with ``--force``. Pipes and devices are refused unread.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
import unicodedata
from dataclasses import MISSING, fields
from pathlib import Path

import numpy as np

from traces.errors import EXIT_INPUT_ERROR, InputError
from traces.format import (
    PHASE_DECODE,
    PHASE_PREFILL,
    ArraySource,
    ensure_memory,
    open_trace,
    regular_file,
    repack_trace,
)
from traces.importers.route_csv import (
    MAGIC,
    SHOWN_CHARS,
    import_route_csv,
    is_route_csv,
    load_route_csv,
    shown_line,
)
from traces.synth import (
    SynthSpec,
    check_draw,
    load_preset,
    logits_name,
    logits_option,
    preset_names,
    write_fitted_trace,
    write_synth_trace,
)

TOP_SHARE = 0.10  # "top 10 % of experts" in the popularity summary
PARQUET_MAGIC = b"PAR1"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the moe-trace console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.command(args) or 0
    except InputError as exc:
        print(f"moe-trace: error: {printable(str(exc))}", file=sys.stderr)
    except OSError as exc:  # a read or write no check foresaw: still one line naming the path
        cause = " ".join((exc.strerror or str(exc)).split())
        print(f"moe-trace: error: {printable(str(exc.filename or '?'))}: {printable(cause)}; check "
              "the path, free disk space and permissions", file=sys.stderr)
    return EXIT_INPUT_ERROR


def printable(text: str) -> str:
    """``text`` with control characters and lone surrogates escaped: safe to print as one line."""
    return "".join(ch if unicodedata.category(ch)[0] != "C" else ascii(ch)[1:-1] for ch in text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-trace", description="Make, import and inspect router traces.")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    synth = commands.add_parser(
        "synth", help="write a synthetic trace (parametric, or fitted to a real trace)",
        description="Write a synthetic trace: from the parametric model's options, from a fit to a "
                    "real trace (--like) or from a bundled fit (--preset); see docs/SYNTH.md. "
                    "--check REAL SYNTH compares two traces' LRU hit-rate curves.")
    synth.add_argument("out", metavar="OUT", nargs="?", help="trace file to write (.parquet)")
    synth.add_argument("--like", metavar="REAL", help="fit the model to this trace and draw from the fit "
                       "(its shape, expert bytes and layout; recorded under extra.fit)")
    synth.add_argument("--preset", metavar="NAME", help="draw from a bundled fit "
                       f"({', '.join(preset_names())}) or a fit file (.json, python -m traces.fit)")
    synth.add_argument("--check", nargs="*", metavar="TRACE",
                       help="with --like: print the per-fraction LRU hit-rate table; REAL SYNTH: "
                            "compare two traces (nothing is written)")
    for f in fields(SynthSpec):
        required = f.default is MISSING
        kind = {"int": int, "float": float, "str": str}[f.type]
        default = " (required)" if required else f" (default: {f.default})"
        synth.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=None,
                           help=f.metadata["help"] + default)
    _force(synth)
    synth.set_defaults(command=_synth)

    imports = commands.add_parser("import", help="convert a foreign trace format")
    formats = imports.add_subparsers(required=True, metavar="FORMAT")
    route = formats.add_parser("route-csv", help="route_trace v1 CSV (llama.cpp-based engines)")
    route.add_argument("src", metavar="IN", help="route_trace v1 CSV file")
    route.add_argument("out", metavar="OUT", help="trace file to write (.parquet)")
    _force(route)
    route.set_defaults(command=_import_route_csv)

    repack = commands.add_parser("repack", help="rewrite a trace (smaller encoding, optional logit rounding)")
    repack.add_argument("src", metavar="IN", help="trace file")
    repack.add_argument("out", metavar="OUT", help="trace file to write (.parquet)")
    repack.add_argument("--logits-quantum", type=_fraction, default=None, metavar="Q",
                        help="round router logits to multiples of Q, e.g. 1/32 (lossy; recorded "
                             "in the metadata); default: keep them exact")
    repack.add_argument("--model-name", default=None, help="set the model name recorded in the metadata")
    repack.add_argument("--compact-logits", action="store_true",
                        help="store the logits as float16 lists with byte-stream-split and zstd "
                             "(and the ids, experts and weights as lists, as earlier versions did): "
                             "smaller files (about 30 %% less), slower to decode (about 7x); "
                             "default: float16 bytes with LZ4, the rest as zstd bytes")
    _force(repack)
    repack.set_defaults(command=_repack)

    info = commands.add_parser("info", help="metadata and summary statistics of a trace")
    info.add_argument("path", metavar="PATH", help="trace file, or a route_trace v1 CSV")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    info.add_argument("--verify", action="store_true",
                      help="decode every value and check the trace against its recorded content hash")
    info.set_defaults(command=_info)

    cache = commands.add_parser(
        "cache", help="list or clear the decoded copies moe-sim keeps (trace.cache=true)",
        description="The trace cache: decoded, memory-mapped copies of traces under $MOE_SIM_CACHE "
                    "(default ~/.cache/moe-offload-sim), one per trace content.")
    actions = cache.add_subparsers(required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="each copy's key, size, tokens and trace")
    listing.add_argument("--json", action="store_true", help="print the list as JSON")
    listing.set_defaults(command=_cache_list)
    clear = actions.add_parser("clear", help="remove copies (all of them without KEY)")
    clear.add_argument("keys", nargs="*", metavar="KEY", help="a copy's key or its first characters")
    clear.set_defaults(command=_cache_clear)
    for action in (listing, clear):
        action.add_argument("--cache-dir", default=None,
                            help="the cache directory (default: $MOE_SIM_CACHE or ~/.cache/moe-offload-sim)")
    predict = commands.add_parser(
        "predict", help="score the prefetch predictors: recall@k, precision and bytes moved",
        description="Score every prefetch predictor (simulator/policies/predictor) on a trace: per "
                    "distance and P, recall@k, precision and the bytes a prefetch would move, per "
                    "predicted layer and overall, on the decode tokens after a training part; a "
                    "Markdown table on stdout, predict.md, predict.json and predict.png in --out "
                    "(docs/PREDICT.md).")
    _predict_arguments(predict)
    predict.set_defaults(command=_predict)
    return parser


def _predict_arguments(parser: argparse.ArgumentParser) -> None:
    from simulator.policies.predictor import REGISTRY  # the names only: no kernel is imported

    parser.add_argument("trace", metavar="TRACE", help="trace file (.parquet)")
    parser.add_argument("--predictor", nargs="+", default=None, metavar="NAME",
                        help=f"predictors to score, of {', '.join(REGISTRY)} (default: every one "
                             "but none; one that needs look-ahead routing the trace lacks is "
                             "skipped with a note)")
    parser.add_argument("--distance", nargs="+", type=int, default=[1], metavar="D",
                        help="layers ahead to predict, 1 .. L - 1 (default: 1)")
    parser.add_argument("--top-p", nargs="+", type=int, default=None, metavar="P",
                        help="experts predicted per layer (default: the trace's top-k)")
    parser.add_argument("--train-tokens", type=int, default=None, metavar="N",
                        help="leading tokens that train coactivation and are scored for no "
                             "predictor (default: coactivation's train_tokens option, at most a "
                             "quarter of the trace)")
    parser.add_argument("--out", type=Path, default=None, metavar="DIR",
                        help="write predict.md, predict.json and predict.png here (default: "
                             "runs/predict/<trace name>)")


def _predict(args: argparse.Namespace) -> None:
    from analysis.predict import predict_command

    predict_command(Path(args.trace), predictors=args.predictor, distances=args.distance,
                    top_ps=args.top_p, train_tokens=args.train_tokens, out=args.out)


def _force(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--force", action="store_true", help="replace OUT if it exists")


def _check_out(out: str, force: bool) -> None:
    path = Path(out)
    if path.is_dir():
        raise InputError(f"{out}: is a directory; give OUT a file name, e.g. {path / 'trace.parquet'}")
    if path.exists() or path.is_symlink():
        if not path.is_file():
            raise InputError(f"{out}: exists and is not a regular file; choose another OUT")
        if not force:
            raise InputError(f"{out}: exists; pass --force to replace it")


def _progress() -> bool:
    return sys.stderr.isatty()


def _wrote(out: str, started: float) -> None:
    """The closing line of a command that wrote a trace, beside its progress bar (a terminal)."""
    if not _progress():
        return
    with open_trace(out) as written:
        meta, tokens = written.meta, written.num_tokens
    size = Path(out).stat().st_size
    print(f"moe-trace: wrote {out}: {tokens:,} tokens x {meta.num_layers} MoE layers x "
          f"{meta.num_experts} experts, top-{meta.top_k} ({size / 2**20:,.1f} MiB) in "
          f"{time.perf_counter() - started:.1f} s", file=sys.stderr)


FITTED_OPTIONS = ("tokens", "seed", "logits")  # the SynthSpec options a fitted trace takes


def _synth(args: argparse.Namespace) -> None:
    given = {f.name: getattr(args, f.name) for f in fields(SynthSpec) if getattr(args, f.name) is not None}
    files = args.check or []
    if len(files) == 2 and args.out is None and not (args.like or args.preset or given):
        return _print_check(*files, table=True)
    if files:
        raise InputError("synth option 'check' (--check) takes REAL SYNTH alone, or no files after "
                         "OUT --like REAL; give one of the two forms")
    if args.out is None:
        raise InputError("synth needs OUT, the trace file to write (or --check REAL SYNTH)")
    _check_out(args.out, args.force)
    if args.like or args.preset:
        return _synth_fitted(args, given)
    if args.check is not None:
        raise InputError("synth option 'check' (--check) without files needs --like REAL")
    defaults = {f.name: f.default for f in fields(SynthSpec) if f.default is not MISSING}
    missing = [f.name for f in fields(SynthSpec) if f.name not in given and f.name not in defaults]
    if missing:
        raise InputError(f"synth option '{missing[0]}' (--{missing[0].replace('_', '-')}) is missing; "
                         "give it, or draw a fitted trace with --like REAL or --preset NAME")
    started = time.perf_counter()
    write_synth_trace(args.out, progress=_progress(), **{**defaults, **given})
    _wrote(args.out, started)
    return None


def _synth_fitted(args: argparse.Namespace, given: dict) -> None:
    """``synth OUT --like REAL`` or ``--preset NAME``: draw from a fit, then check a fit to REAL."""
    if args.like and args.preset:
        raise InputError("synth options 'like' and 'preset' exclude each other; give one")
    extra = sorted(set(given) - set(FITTED_OPTIONS))
    if extra:
        raise InputError(f"synth option '{extra[0]}' (--{extra[0].replace('_', '-')}) does not apply to a "
                         "fitted trace: its shape and layout come from the fit; leave it out")
    if "tokens" not in given:
        raise InputError("synth option 'tokens' (--tokens) is missing; give the tokens to draw")
    tokens, seed = given["tokens"], given.get("seed", 0)
    check_draw(tokens, seed)
    if args.preset:
        fit, logits, origin = load_preset(args.preset), given.get("logits", "full"), {"preset": args.preset}
    else:
        from traces.fit import fit_routing

        with open_trace(args.like) as real:
            meta = real.meta
            logits = given.get("logits", logits_name(meta.has_logits, meta.logits_top_r))
            logits_option(logits, meta.top_k, meta.num_experts)  # bad options stop before the fit
            fit = fit_routing(real, progress=_progress(), name=args.like)
        origin = {"like": args.like}
    started = time.perf_counter()
    write_fitted_trace(args.out, fit, tokens, seed, logits, progress=_progress(),
                       extra={"synth": {**origin, "tokens": tokens, "seed": seed, "logits": logits}})
    _wrote(args.out, started)
    if args.like:
        _print_check(args.like, args.out, table=args.check is not None)


def _print_check(real_path: str, synth_path: str, table: bool) -> None:
    """Print the LRU hit-rate comparison of two traces: its table, then one closing line."""
    from traces.fit import CHECK_FRACTIONS, format_check, max_delta, mrc_check

    with open_trace(real_path) as real, open_trace(synth_path) as synth:
        tokens, rows = mrc_check(real, synth)
    if table:
        print(format_check(rows))
    deltas = {scope: max_delta(rows, scope) for scope in ("per_layer", "global")}
    gaps = (", ".join(f"{d * 100:.1f} pp {scope}" for scope, d in deltas.items())
            if all(math.isfinite(d) for d in deltas.values()) else "n/a (no decode lookups)")
    fractions = f"{CHECK_FRACTIONS[0]:.2f}..{CHECK_FRACTIONS[-1]:.2f}"
    print(f"mrc check: {synth_path} vs {real_path}, first {tokens:,} tokens (decode lookups, LRU, cold "
          f"start): max |delta hit rate| {gaps} over fractions {fractions}")


def _import_route_csv(args: argparse.Namespace) -> None:
    _check_out(args.out, args.force)
    started = time.perf_counter()
    import_route_csv(args.src, args.out, progress=_progress())
    _wrote(args.out, started)


def _fraction(text: str) -> float:
    """A number or a fraction such as 1/32."""
    try:
        num, _, den = text.partition("/")
        return float(num) / float(den) if den else float(num)
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"not a number or fraction: {text!r}") from None


def _repack(args: argparse.Namespace) -> None:
    _check_out(args.out, args.force)
    started = time.perf_counter()
    repack_trace(args.src, args.out, logits_quantum=args.logits_quantum, model_name=args.model_name,
                 progress=_progress(), compact_logits=args.compact_logits)
    _wrote(args.out, started)


def _info(args: argparse.Namespace) -> None:
    path = regular_file(args.path, "trace file or route_trace v1 CSV")
    if is_route_csv(path):
        if args.verify:
            raise InputError(f"{path}: --verify checks Parquet traces; a route_trace CSV records no "
                             "content hash (import it, then verify the trace)")
        summary = summarize(ArraySource(*load_route_csv(path)), args.path)
    else:
        with path.open("rb") as f:
            start = f.read(len(PARQUET_MAGIC))
        if start != PARQUET_MAGIC:
            raise InputError(_not_a_trace(path))
        with open_trace(path) as source:
            summary = summarize(source, args.path)
            summary["content_hash"] = source.verify() if args.verify else source.content_hash
            summary["verified"] = args.verify
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))


def _cache_list(args: argparse.Namespace) -> None:
    from simulator.trace_cache import cache_entries, cache_root

    entries = cache_entries(args.cache_dir)
    if args.json:
        print(json.dumps([{"key": e.key, "path": str(e.path), "trace": e.source_file,
                           "tokens": e.num_tokens, "bytes": e.bytes} for e in entries], indent=2))
        return
    for e in entries:
        tokens = f"{e.num_tokens:,} tokens" if e.num_tokens is not None else "unreadable manifest"
        print(f"{e.key[:16]}  {e.bytes / 2**20:>10,.1f} MiB  {tokens:>16}  "
              f"{printable(e.source_file or '?')}")
    total = sum(e.bytes for e in entries)
    print(f"{len(entries)} decoded {'copy' if len(entries) == 1 else 'copies'}, "
          f"{total / 2**20:,.1f} MiB in {cache_root(args.cache_dir)}")


def _cache_clear(args: argparse.Namespace) -> None:
    from simulator.trace_cache import cache_root, clear_cache

    removed = clear_cache(args.cache_dir, args.keys or None)
    print(f"removed {len(removed)} decoded {'copy' if len(removed) == 1 else 'copies'}, "
          f"{sum(e.bytes for e in removed) / 2**20:,.1f} MiB, from {cache_root(args.cache_dir)}")


def _not_a_trace(path: Path) -> str:
    """What a file that is neither a Parquet trace nor a route_trace CSV looks like, in one line."""
    with path.open("rb") as f:
        head = f.read(SHOWN_CHARS + 1)
    first = head.split(b"\n", 1)[0].decode("utf-8", "replace")
    shown = shown_line(first)
    if not head:
        kind = "is empty"
    elif all(ch.isprintable() or ch in "\t\r" for ch in first) and ("," in first or path.suffix.lower() == ".csv"):
        kind = f"is a CSV/text file whose line 1 is {shown}, not '{MAGIC}'"
    else:
        kind = f"is not a Parquet file (it starts with {shown})"
    return (f"{path}: {kind}; moe-trace reads Parquet traces and route_trace v1 CSV files (moe-trace "
            "import converts the CSV)")


def summarize(source, path: str = "") -> dict:
    """Summary statistics of a chunk source (one streaming pass), as plain JSON-able values."""
    meta = source.meta
    num_layers, num_experts = meta.num_layers, meta.num_experts
    # the counts, their per-chunk increment and the sorted copy
    ensure_memory(3 * 8 * num_layers * num_experts,
                  f"counting calls per expert ({num_layers} layers x {num_experts} experts)", path)
    calls = np.zeros(num_layers * num_experts, dtype=np.int64)
    domain_tokens = np.zeros(len(meta.domains) + 1, dtype=np.int64)  # last bin: no domain
    tokens = prefill = sequences = prefill_batches = hits = decode_calls = 0
    last_seq = None
    layer_offset = (np.arange(num_layers) * num_experts)[None, :, None]
    for chunk in source.iter_chunks():
        tokens += chunk.num_tokens
        is_prefill = chunk.phase == PHASE_PREFILL
        prefill += int(is_prefill.sum())
        sequences += int(np.count_nonzero(np.diff(chunk.seq, prepend=last_seq if last_seq is not None
                                                  else chunk.seq[0] - 1)))
        prefill_batches += np.unique(chunk.group[is_prefill]).size  # chunks never split a group
        last_seq = chunk.seq[-1]
        calls += np.bincount((chunk.experts + layer_offset).reshape(-1), minlength=calls.size)
        domain_tokens += np.bincount(np.where(chunk.domain < 0, len(meta.domains), chunk.domain),
                                     minlength=domain_tokens.size)
        if meta.has_residency:
            decode = chunk.phase == PHASE_DECODE
            hits += int(chunk.residency[decode].sum())
            decode_calls += int(decode.sum()) * num_layers * meta.top_k
    top = max(1, math.ceil(TOP_SHARE * num_experts))
    per_layer = np.sort(calls.reshape(num_layers, num_experts), axis=1)[:, ::-1]
    used = per_layer.sum(axis=1) > 0
    share = per_layer[used, :top].sum(axis=1) / per_layer[used].sum(axis=1)
    quantum = meta.extra.get("logits_quantum")  # free-form metadata: a number or nothing
    quantum = quantum if isinstance(quantum, int | float) and not isinstance(quantum, bool) else None
    domains = {name: int(n) for name, n in zip(meta.domains, domain_tokens[:-1], strict=True)}
    if domain_tokens[-1]:
        domains["(none)"] = int(domain_tokens[-1])
    return {
        "path": str(path),
        "model": meta.model,
        "source": meta.source,
        "schema_version": meta.schema_version,
        "layers": num_layers,
        "experts": num_experts,
        "top_k": meta.top_k,
        "has_logits": meta.has_logits,
        "logits_top_r": meta.logits_top_r,
        "has_residency": meta.has_residency,
        "logits_quantum": quantum,
        "expert_bytes": {"min": min(meta.expert_bytes), "max": max(meta.expert_bytes),
                         "total": int(sum(meta.expert_bytes)) * num_experts},
        "tokens": tokens,
        "prefill_tokens": prefill,
        "decode_tokens": tokens - prefill,
        "prefill_batches": prefill_batches,
        "sequences": sequences,
        "domains": domains,
        "top_experts": top,
        "top_experts_call_share": None if not share.size else {
            "min": float(share.min()), "median": float(np.median(share)), "max": float(share.max())},
        "decode_hit_rate": None if not meta.has_residency else {
            "hits": hits, "calls": decode_calls, "rate": hits / decode_calls if decode_calls else None},
    }


def format_summary(s: dict) -> str:
    """The summary as aligned text lines."""
    def gib(n: int) -> str:
        return f"{n / 2**30:.1f} GiB"

    logits = f"top-{s['logits_top_r']}" if s.get("logits_top_r") else "yes" if s["has_logits"] else "no"
    lines = [
        ("trace", s["path"]),
        ("model", f"{s['model']} (source {s['source'] or '?'}, schema {s['schema_version']})"),
        ("shape", f"{s['layers']} layers x {s['experts']} experts, top-{s['top_k']}; "
                  f"logits {logits}, "
                  f"residency {'yes' if s['has_residency'] else 'no'}"),
        ("experts", f"{s['expert_bytes']['min']:,}..{s['expert_bytes']['max']:,} bytes each, "
                    f"{gib(s['expert_bytes']['total'])} in all"),
        ("tokens", f"{s['tokens']:,}: {s['prefill_tokens']:,} prefill in {s['prefill_batches']:,} "
                   f"batches, {s['decode_tokens']:,} decode; {s['sequences']:,} sequences"),
        ("domains", ", ".join(f"{name} {n:,}" for name, n in s["domains"].items()) or "-"),
    ]
    if s.get("logits_quantum"):
        lines.insert(3, ("logits", f"rounded to multiples of {s['logits_quantum']:g} (lossy repack)"))
    share = s["top_experts_call_share"]
    if share:
        lines.append(("popularity", f"the top {s['top_experts']} experts of a layer (10 %) take "
                                    f"{_pct(share['min'])} / {_pct(share['median'])} / {_pct(share['max'])} "
                                    "of its calls (min / median / max over layers)"))
    hit = s["decode_hit_rate"]
    if hit and hit["calls"]:
        lines.append(("recorded", f"decode hit rate {_pct(hit['rate'])} "
                                  f"({hit['hits']:,} of {hit['calls']:,} decode calls)"))
    if "content_hash" in s:
        recorded = s["content_hash"]
        lines.append(("integrity", f"content {recorded} and every page checksum verified"
                      if s["verified"] else
                      f"content hash {recorded} recorded (--verify checks it); page checksums "
                      "checked on every read" if recorded else
                      "no content hash or page checksums (an older file; moe-trace repack writes "
                      "a copy with both)"))
    width = max(len(key) for key, _ in lines)
    # metadata is free text: a name must not move the cursor or clear the terminal
    return "\n".join(f"{key:<{width}}  {printable(str(value))}" for key, value in lines)


def _pct(fraction: float) -> str:
    return f"{fraction * 100:.1f} %"


if __name__ == "__main__":
    sys.exit(main())
