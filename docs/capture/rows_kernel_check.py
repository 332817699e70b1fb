"""On a GPU host: does the stored-rows kernel (``rows_kernel``: a block's stored routing columns
written by one launch into the writer's shared memory) store what the steps it replaces store?
One model load (the small Qwen3-Next shape), the same windows captured teacher-forced with the
kernel, without it and with it again: at batch 16 with the rows in the writer's shared memory
(the default) and through pinned buffers (``shared_rows`` off), and at batch 1 in blocks of
forwards; the content hashes of the files.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/rows_kernel_check.py``
(writes DIR/rows_kernel_check.json). Result: docs/capture/rows_kernel_check_*.json
(docs/CAPTURE.md).
"""
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from same_bytes import equal, hashes, load, out_dir  # noqa: E402

from traces.atomic import atomic_write_text  # noqa: E402
from traces.capture import top_r  # noqa: E402

out = out_dir("/tmp/rows_kernel_check")
launches = []
_real = top_r.stored_rows
top_r.stored_rows = lambda *args: launches.append(1) or _real(*args)  # capture.py calls it through the module
s = load(int(os.environ.get("TOKENS", 65536)))
runs = {"kernel": {"rows_kernel": True}, "steps": {"rows_kernel": False}, "kernel_again": {"rows_kernel": True}}
result: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "torch": torch.__version__,
                "windows_of_other_lengths": sum(len(w.tokens) != 512 for w in s.windows),
                "runs": {"batch_16": hashes(s, s.base, runs),
                         "batch_16_pinned": hashes(s, replace(s.base, shared_rows=False), runs),
                         "batch_1": hashes(s, replace(s.base, batch_size=1), runs, s.windows[:48])}}
result["equal"] = {mode: equal(runs) for mode, runs in result["runs"].items()}


def kernel_times(repeats: int = 40) -> dict:
    """Device ms per launch of the kernel on one forward's stacked routing (batch 16, 512 tokens,
    the shape's layers and experts, top-64), writing into device memory and into host memory
    registered with the device; and the calling thread's CPU ms per launch."""
    import time

    import numpy as np

    from traces.capture.capture import _registered
    from traces.capture.writer import _lend_slab

    n, L, E, k, r = 16 * 512, len(s.sites), s.sites[0].num_experts, s.sites[0].top_k, 64
    logits = torch.randn(n, L, E, device="cuda").to(torch.bfloat16)
    experts = torch.rand(n, L, E, device="cuda").argsort(-1)[..., :k].contiguous()
    weights = torch.rand(n, L, k, device="cuda").to(torch.bfloat16)
    shapes = {"logits": ((n, L, r), torch.float16), "logit_ids": ((n, L, r), torch.int16),
              "experts": ((n, L, k), torch.int16), "weights": ((n, L, k), torch.float32)}
    device = {name: torch.empty(shape, dtype=dt, device="cuda") for name, (shape, dt) in shapes.items()}
    nbytes = sum(int(np.prod(shape)) * torch.empty((), dtype=dt).element_size() for shape, dt in shapes.values())
    slab = _lend_slab(nbytes + 4096)
    registered = _registered(slab)
    host, offset = {}, 0
    for name, (shape, dt) in shapes.items():
        size = int(np.prod(shape)) * torch.empty((), dtype=dt).element_size()
        host[name] = torch.frombuffer(slab.map, dtype=torch.uint8, count=size, offset=offset).view(dt).view(shape)
        offset += -(-size // 64) * 64
    found = {"registered": registered}
    for where, out in (("device", device), ("registered host", host)):
        top_r.stored_rows(logits, experts, weights, None, out)  # compiled, warm
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cpu = time.thread_time()
        start.record()
        for _ in range(repeats):
            top_r.stored_rows(logits, experts, weights, None, out)
        end.record()
        cpu = time.thread_time() - cpu
        end.synchronize()
        found[where] = {"device_ms": round(start.elapsed_time(end) / repeats, 3),
                        "host_cpu_ms": round(1000 * cpu / repeats, 3)}
    same = all(torch.equal(device[name].cpu().view(torch.int16 if device[name].element_size() == 2 else torch.int32),
                           host[name].view(torch.int16 if host[name].element_size() == 2 else torch.int32))
               for name in shapes)
    found["same_values"] = same
    return found


if torch.cuda.is_available():
    result["kernel"] = kernel_times()
result["kernel_launches"] = len(launches)
result["kernel_failed"] = list(top_r._ROWS_FAILED)  # a failure falls back to the steps: equal, but not a test
atomic_write_text(out / "rows_kernel_check.json", json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
