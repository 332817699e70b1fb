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
import tempfile
from pathlib import Path

import torch

from traces.capture import writer as W
from traces.capture.capture import batch_tokens, build_meta, capture_windows, open_writer
from traces.capture.config import CaptureConfig, ModelConfig
from traces.capture.hooks import router_returns_probabilities
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents
from traces.format import recorded_content_hash

out = Path(os.environ.get("OUT", "/tmp/shared_rows_check"))
out.mkdir(parents=True, exist_ok=True)
cfg = CaptureConfig(model=ModelConfig(config="traces/fixtures/shapes/qwen3_next_small.json",
                                      tokenizer="traces/fixtures/model"), batch_size=16)
model, tokenizer, sites, name = load_model(cfg.model)
windows, domains = make_windows(read_documents(["docs", "traces", "simulator"]), tokenizer, 512,
                                max_tokens=65536)
probs = router_returns_probabilities(model, sites)
hashes = {}
with tempfile.TemporaryDirectory() as tmp:
    for run, shared in (("shared", True), ("pinned", False), ("shared_again", True)):
        meta = build_meta(model, sites, name, domains, cfg, {}, probs)
        path = Path(tmp) / f"{run}.parquet"
        with open_writer(path, meta, batch_tokens=batch_tokens(cfg)) as w:
            stats = capture_windows(model, sites, windows, cfg, lambda rows: w.write(**rows.columns()),
                                    logits_are_probs=probs, block=w.block if shared else None)
        hashes[run] = {"hash": recorded_content_hash(path), "tokens": stats["tokens"]}
result = {
    "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    "hashes": hashes,
    "equal": len({h["hash"] for h in hashes.values()}) == 1,
    "slabs": [{"bytes": s.size, "registered": s.pinned} for s in W._SLABS],
    "dev_shm_free_gib": round(shutil.disk_usage("/dev/shm").free / 2**30, 1) if os.path.isdir("/dev/shm") else None,
    "cpus": os.cpu_count(),
}
print(json.dumps(result, indent=2))
(out / "shared_rows_check.json").write_text(json.dumps(result, indent=2) + "\n")
