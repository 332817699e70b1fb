"""On a GPU host: does a capture whose top-R logits are selected by the Triton kernel
(``top_r_kernel=true``, the default) store what the two sorts store (``false``)? One model load
(the small Qwen3-Next shape), the same windows captured teacher-forced at batch 16, with
look-ahead routing 2 layers ahead (top 32) and generated at batch 8, each with the kernel, the
sorts and the kernel again; the content hashes of the files, and whether the kernel ran (Triton
present, no failure).

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/top_r_kernel_check.py``
(writes DIR/top_r_kernel_check.json). Result: docs/capture/top_r_kernel_check_*.json
(docs/CAPTURE.md).
"""
import json
import os
import sys
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(__file__))
from same_bytes import equal, generating, hashes, load, out_dir  # noqa: E402

from traces.atomic import atomic_write_text  # noqa: E402
from traces.capture import top_r  # noqa: E402
from traces.capture.config import LookaheadConfig  # noqa: E402

out = out_dir("/tmp/top_r_kernel_check")
s = load(int(os.environ.get("TOKENS", 65536)))
runs = {"kernel": {"top_r_kernel": True}, "sorts": {"top_r_kernel": False}, "kernel_again": {"top_r_kernel": True}}
probe = torch.zeros(2, 1, s.sites[0].num_experts, dtype=torch.float16, device=s.model.device)
result: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "torch": torch.__version__, "kernel_usable": top_r.uses_kernel(probe),
                "runs": {"teacher_forced": hashes(s, s.base, runs),
                         "lookahead": hashes(s, replace(s.base, lookahead=LookaheadConfig(enabled=True, depth=2)),
                                             runs, s.windows[:64]),
                         "generate": hashes(s, generating(s.base), runs, s.windows[:32])}}
result["kernel_failed"] = list(top_r._FAILED)
result["equal"] = {mode: equal(runs) for mode, runs in result["runs"].items()}
atomic_write_text(out / "top_r_kernel_check.json", json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
