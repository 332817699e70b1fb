"""On a GPU host: does a capture that holds the routing of several forwards and hands it on in
blocks (``record_block_tokens`` 32,768; the default is 8,192) store what one that hands every forward on
alone (``0``) stores? One model load (the small Qwen3-Next shape), the same windows captured
teacher-forced at batch 16 and at batch 1, and with look-ahead routing 2 layers ahead, each with
blocks, alone and with blocks again; the content hashes of the files.

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/record_block_check.py``
(writes DIR/record_block_check.json). Result: docs/capture/record_block_check_*.json
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
from traces.capture.config import LookaheadConfig  # noqa: E402

out = out_dir("/tmp/record_block_check")
s = load(int(os.environ.get("TOKENS", 65536)))
runs = {"blocks": {"record_block_tokens": 32768}, "alone": {"record_block_tokens": 0},
        "blocks_again": {"record_block_tokens": 32768}}
result: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "torch": torch.__version__,
                "runs": {"batch_16": hashes(s, s.base, runs),
                         "batch_1": hashes(s, replace(s.base, batch_size=1), runs, s.windows[:48]),
                         "lookahead": hashes(s, replace(s.base, lookahead=LookaheadConfig(enabled=True, depth=2)),
                                             runs, s.windows[:64])}}
result["equal"] = {mode: equal(runs) for mode, runs in result["runs"].items()}
atomic_write_text(out / "record_block_check.json", json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
