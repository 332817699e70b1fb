"""On a GPU host: the recording's host work cut, side by side with the code before the cut.

Run 1207w found the small Qwen3-Next shape's forward at batch 16 bound by its thread's CPU (wall
= thread CPU, 25.1 ms a forward on a steady host) and the recording adding 1.8 ms of that CPU a
forward. The cut (this tree):

- the NLL in one Triton kernel (``traces.capture.nll``), where the log-sum-exp kernel and a
  gather, cast, subtraction and copy after it took six launches;
- a forward handed on alone takes one switch to the drain's stream for its NLL, stored forms and
  copies, where it took three (``capture._hand_on``);
- the block's routing held until the next hand-on (``capture._Kept``) instead of marked with
  ``record_stream``: freed with device work still queued on it, a marked tensor makes the caching
  allocator query an event at each allocation of the next forward until that work is done;
- the numpy dtypes of the device columns looked up once.

Needs the tree of 8b86823: the cut was taken out again after runs 1207x-z found no gain in the
capture (docs/CAPTURE.md). The code before (the tree at a3fe356) is imported from ``before_a3fe356/`` beside this file
(its ``capture.py`` and ``nll.py``, the first importing the second; make it with
``make_before.sh``). The check first captures the same windows with both (batch 16, batch 1 in
blocks, generate mode) and compares the files' content hashes: the rows must be the same. Then
rounds in turn, every other one reversed, at batch 16: the forward alone, recording (rows
dropped) and capture (the default writer), each with the code before and after; then batch 1 the
same way with the capture only.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/recording_host_cuts.py [ROUNDS] [TOKENS]``
(writes DIR/recording_host_cuts.json; ``DEVICE=cpu`` for a dry run; ``BATCH1=0``: batch 16 only).
"""
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import before_a3fe356.capture as before
import gpu_passes
import torch

from traces.atomic import atomic_write_text
from traces.capture import capture as after
from traces.capture.config import GenerateConfig
from traces.format import recorded_content_hash

if not hasattr(after, "_Kept"):
    raise SystemExit("recording_host_cuts.py needs the tree of 8b86823 (the cut was taken out after runs 1207x-z)")
s = gpu_passes.setup("docs/capture/recording_host_cuts.py", __doc__, rounds=14)
CODES = {"before": before, "after": after}


def content(code, setup, cfg, windows) -> dict:
    """The content hash and tokens of ``windows`` captured with ``code``'s loop (the writer as moe-capture's)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "check.parquet"
        meta = after.build_meta(setup.model, setup.sites, setup.name, setup.domains, cfg, {}, setup.probs)
        with after.open_writer(path, meta, batch_tokens=after.batch_tokens(cfg)) as w:
            stats = code.capture_windows(setup.model, setup.sites, windows, cfg,
                                         lambda rows, w=w: w.write(**rows.columns()), logits_are_probs=setup.probs,
                                         block=w.block if cfg.shared_rows else None)
        return {"hash": recorded_content_hash(path), "tokens": stats["tokens"]}


checks = {
    "batch 16": (s.cfg, s.windows[:128]),
    "batch 1, blocks": (replace(s.cfg, batch_size=1), s.windows[:40]),
    "generate, batch 8": (replace(s.cfg, mode="generate", batch_size=8,
                                  generate=GenerateConfig(prompt_tokens=64, new_tokens=32)), s.windows[:24]),
}
same = {}
for label, (cfg, windows) in checks.items():
    found = {name: content(code, s, cfg, windows) for name, code in CODES.items()}
    same[label] = {**found, "equal": len({f["hash"] for f in found.values()}) == 1}
    print(label, same[label], flush=True)
if not all(v["equal"] for v in same.values()):
    atomic_write_text(s.out / "recording_host_cuts.json", json.dumps({"same_rows": same}) + "\n")
    raise SystemExit("the rows differ: not timed")


def with_code(code, run, setup):
    """A pass of gpu_passes run through ``code``'s capture loop."""
    def timed():
        original = gpu_passes.capture_windows
        gpu_passes.capture_windows = code.capture_windows
        try:
            return run(setup)
        finally:
            gpu_passes.capture_windows = original
    return timed


start = time.perf_counter()
b16 = {"forward": lambda: gpu_passes.forward(s),
       "recording, before": with_code(before, gpu_passes.recording, s),
       "recording, after": with_code(after, gpu_passes.recording, s),
       "capture, before": with_code(before, gpu_passes.capture, s),
       "capture, after": with_code(after, gpu_passes.capture, s)}
timed16 = gpu_passes.timed_rounds(b16, s.args.rounds)
summary = {"batch 16": gpu_passes.summarise(timed16, (("recording, before", "recording, after"),
                                                      ("capture, before", "capture, after")))}
print(json.dumps(summary, indent=1), flush=True)
s1 = s._replace(cfg=replace(s.cfg, batch_size=1), windows=s.windows[:64])
timed1 = {}
if os.environ.get("BATCH1", "1") != "0":
    b1 = {"forward": lambda: gpu_passes.forward(s1),
          "capture, before": with_code(before, gpu_passes.capture, s1),
          "capture, after": with_code(after, gpu_passes.capture, s1)}
    timed1 = gpu_passes.timed_rounds(b1, s.args.rounds)
    summary["batch 1"] = gpu_passes.summarise(timed1, (("capture, before", "capture, after"),))
gpu = torch.cuda.get_device_name(s.model.device) if s.model.device.type == "cuda" else None
result = {"model": s.name, "config": gpu_passes.CONFIG, "device": str(s.model.device), "gpu": gpu,
          "cpus": len(os.sched_getaffinity(0)), "tokens": sum(len(w.tokens) for w in s.windows),
          "tokens_batch_1": sum(len(w.tokens) for w in s1.windows), "rounds": s.args.rounds,
          "timed_s": round(time.perf_counter() - start, 1), "same_rows": same, "summary": summary,
          "per_forward_s": {"batch 16": timed16, "batch 1": timed1}}
atomic_write_text(s.out / "recording_host_cuts.json", json.dumps(result) + "\n")
print(json.dumps(summary.get("batch 1"), indent=1))
