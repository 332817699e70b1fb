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
result["kernel_launches"] = len(launches)
result["kernel_failed"] = list(top_r._ROWS_FAILED)  # a failure falls back to the steps: equal, but not a test
atomic_write_text(out / "rows_kernel_check.json", json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
