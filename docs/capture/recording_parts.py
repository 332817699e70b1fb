"""On a GPU host: which part of the recording costs a launch-bound forward its time? The capture
loop built up one part at a time, each pass timed forward by forward, in rounds:

1. ``forward``: the model alone (the bench's first pass);
2. ``hooks``: the router hooks and the routing stacked after each forward, nothing more;
3. ``device``: and the stored forms made on the drain's stream (casts, the top-R selection, the
   per-token NLL), neither copied nor handed on;
4. ``recording``: moe-capture's loop with the rows dropped (the bench's second pass: the host
   columns, the copies into pinned memory, the drain thread);
5. ``capture``: and the trace writer (the bench's third pass; the writer's open left out, its close in).

So ``hooks - forward`` bounds what the hooks cost, ``device - hooks`` what the device work and its
launches cost, ``recording - device`` the copies, host columns and drain, and ``capture -
recording`` the writer. Rounds in turn, every other one reversed, as the bench runs them.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/recording_parts.py [ROUNDS] [TOKENS]``
(writes DIR/recording_parts.json; ``DEVICE=cpu`` for a dry run). Result of run 1206g:
docs/capture/recording_parts_1206g.json (docs/CAPTURE.md).
"""
import json
import sys
import time

import gpu_passes
import numpy as np
import torch

from traces.atomic import atomic_write_text
from traces.capture.bench import _sync
from traces.capture.capture import (
    CAPTURE_SWITCH_INTERVAL_S,
    Storage,
    _Drain,
    _real,
    _routing_parts,
    batches,
    right_padded,
)
from traces.capture.hooks import RouterRecorder
from traces.capture.nll import token_nll

s = gpu_passes.setup("docs/capture/recording_parts.py", __doc__, rounds=10)
model, cfg = s.model, s.cfg
storage = Storage.of(cfg, s.sites[0].num_experts, len(s.sites))
if storage.lookahead:
    sys.exit("this check times the default capture, without look-ahead")


def partial(device_work: bool) -> gpu_passes.Marks:
    """The capture loop's forwards with the hooks, and with ``device_work`` the stored forms made
    on the drain's stream; nothing copied to the host. As capture_windows, with its switch interval."""
    marks = gpu_passes.Marks()
    drain = _Drain(lambda rows: None, model.device, side=cfg.recording_stream == "side")
    interval = sys.getswitchinterval()
    sys.setswitchinterval(min(interval, CAPTURE_SWITCH_INTERVAL_S))
    try:
        with torch.inference_mode(), RouterRecorder(s.sites, storage.logits != "none", s.probs) as rec:
            for batch in batches(s.windows, cfg.batch_size):
                ids, lengths, input_ids, mask = right_padded(batch, model.device)
                B, S = ids.shape
                lm = model(input_ids=input_ids, attention_mask=mask, use_cache=False)
                routing = rec.collect(B * S)
                if device_work:  # as teacher_forced: the real token slots where windows are padded
                    slots = None
                    if mask is not None:
                        slots = torch.from_numpy(np.concatenate([b * S + np.arange(n) for b, n in enumerate(lengths)]))
                        slots = slots.to(model.device)
                    with drain.beside(*routing.tensors(), lm.logits, input_ids, slots):
                        dev = _routing_parts(routing, slots, storage, None, cfg.top_r_kernel)
                        dev["nll"] = _real(token_nll(lm.logits, input_ids).reshape(-1), slots)
                marks.update()
        _sync(model.device)
    finally:
        drain.close()
        sys.setswitchinterval(interval)
    marks.times.append(time.perf_counter())
    return marks


passes = {"forward": lambda: gpu_passes.forward(s), "hooks": lambda: partial(False),
          "device": lambda: partial(True), "recording": lambda: gpu_passes.recording(s),
          "capture": lambda: gpu_passes.capture(s)}
timed = gpu_passes.timed_rounds(passes, s.args.rounds)
summary = gpu_passes.summarise(timed)
gpu = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None
result = {"model": s.name, "config": gpu_passes.CONFIG, "device": str(model.device), "gpu": gpu,
          "batch": cfg.batch_size, "tokens": sum(len(w.tokens) for w in s.windows), "rounds": s.args.rounds,
          "forwards": len(timed["forward"][0]) - 1, "summary": summary, "per_forward_s": timed}
atomic_write_text(s.out / "recording_parts.json", json.dumps(result) + "\n")
print(json.dumps(summary, indent=1))
