"""On a GPU host: does a capture whose rows the device writes into the writer's shared memory
(``shared_rows``) store what the pinned buffers' way stores? One model load, the same windows
captured three times (shared, pinned, shared again) through the small Qwen3-Next shape at batch
16; the content hashes of the three files, whether the slabs were registered with CUDA, and
what /dev/shm holds.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/shared_rows_check.py``
(writes DIR/shared_rows_check.json). Result: docs/capture/shared_rows_check_*.json
(docs/CAPTURE.md).
"""
import json
import os
import shutil
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from same_bytes import equal, hashes, load, out_dir  # noqa: E402

from traces.capture import writer as W  # noqa: E402

out = out_dir("/tmp/shared_rows_check")
setup = load(int(os.environ.get("TOKENS", 65536)))
found = hashes(setup, setup.base, {"shared": {"shared_rows": True}, "pinned": {"shared_rows": False},
                                   "shared_again": {"shared_rows": True}})
result = {
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "hashes": found,
    "equal": equal(found),
    "slabs": [{"bytes": s.size, "registered": s.pinned} for s in W._SLABS],
    "dev_shm_free_gib": round(shutil.disk_usage("/dev/shm").free / 2**30, 1) if os.path.isdir("/dev/shm") else None,
    "cpus": os.cpu_count(),
}
print(json.dumps(result, indent=2))
(out / "shared_rows_check.json").write_text(json.dumps(result, indent=2) + "\n")
