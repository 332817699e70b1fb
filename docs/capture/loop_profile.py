"""On a GPU host: what the capturing process calls, per forward, when the capture records and writes.

The capture bench puts the small Qwen3-Next shape's overhead at batch 16 at about 13 % (run v),
about half of it recording, and the model's thread spends that much more CPU on the same
forwards. This check runs the capture loop at batch 16 three ways (the forward alone, recording
with the rows dropped, recording and the default writer), each after an untimed pass, under
``cProfile``, and lists per forward the functions (Python and the C functions they call: torch's
ops, stream and event calls) whose own time grew most over the forward alone. cProfile's own cost
is in every figure; the differences between the three are what to read. On Python 3.12 and later
cProfile (built on ``sys.monitoring``) sees every thread of the process, not only the model's:
the drain's and the writer's threads are in the lists too, with their blocking waits
(``pickle.load`` on the dispatcher's pipe, ``queue.get``, ``wait``, lock acquires), which are
time spent waiting, not work.

From the repository root: ``OUT=DIR TOKENS=131072 PYTHONPATH=. python docs/capture/loop_profile.py``
(``TOKENS`` per pass, default 131,072; ``TOP`` rows, default 40). Writes DIR/loop_profile.json.
"""
import cProfile
import json
import os
import pstats
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(__file__))
from recording_host_time import whole  # noqa: E402
from same_bytes import load, out_dir  # noqa: E402

from traces.atomic import atomic_write_text  # noqa: E402
from traces.capture.bench import _forward_only  # noqa: E402
from traces.capture.capture import batch_tokens, build_meta, capture_windows, open_writer  # noqa: E402


def one_pass(s, mode: str) -> None:
    if mode == "forward alone":
        _forward_only(s.model, s.windows, s.base.batch_size)
    elif mode == "recording":
        capture_windows(s.model, s.sites, s.windows, s.base, lambda rows: None, logits_are_probs=s.probs)
    else:
        meta = build_meta(s.model, s.sites, s.name, s.domains, s.base, {}, s.probs)
        with tempfile.TemporaryDirectory() as tmp, \
                open_writer(Path(tmp) / "p.parquet", meta, s.base.writers, s.base.writer, s.base.unit_tokens,
                            batch_tokens(s.base)) as w:
            capture_windows(s.model, s.sites, s.windows, s.base, lambda rows: w.write(**rows.columns()),
                            logits_are_probs=s.probs, block=w.block if s.base.shared_rows else None)


def profiled(s, mode: str) -> dict[str, tuple[int, float]]:
    """{function: (calls, own seconds)} of the calling thread over one pass of ``mode``."""
    one_pass(s, mode)  # untimed: kernels, allocator, the writer's processes
    prof = cProfile.Profile()
    prof.enable()
    one_pass(s, mode)
    prof.disable()
    stats = pstats.Stats(prof).stats
    return {f"{Path(file).name}:{line}({name})" if line else name: (calls, own)
            for (file, line, name), (_, calls, own, _, _) in stats.items()}


def main() -> None:
    tokens, top = whole("TOKENS", 131072), whole("TOP", 40)
    out = out_dir("/tmp/loop_profile")
    s = load(tokens)
    forwards = -(-len(s.windows) // s.base.batch_size)
    modes = ("forward alone", "recording", "recording and writer")
    runs = {mode: profiled(s, mode) for mode in modes}
    base = runs["forward alone"]
    result = {"python": sys.version.split()[0], "model": s.name, "shape": s.base.model.config, "tokens": tokens, "forwards": forwards,
              "unit": "calls and own ms per forward",
              "total_ms_per_forward": {m: round(1e3 * sum(v[1] for v in r.values()) / forwards, 3)
                                       for m, r in runs.items()}}
    for mode in modes[1:]:
        grown = sorted(runs[mode], key=lambda f: -(runs[mode][f][1] - base.get(f, (0, 0.0))[1]))[:top]
        result[f"{mode}: grown most over the forward alone"] = [
            [f, round(runs[mode][f][0] / forwards, 2), round(1e3 * runs[mode][f][1] / forwards, 4),
             round(1e3 * base.get(f, (0, 0.0))[1] / forwards, 4)] for f in grown]
    result["columns"] = ["function", "calls per forward", "own ms per forward", "the forward alone's own ms"]
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    atomic_write_text(out / "loop_profile.json", text + "\n")


if __name__ == "__main__":
    main()
