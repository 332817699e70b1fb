"""On a GPU host: does a capture whose top-R logits are selected by the Triton kernel
(``top_r_kernel=true``, the default) store what the two sorts store (``false``)? One model load
(the small Qwen3-Next shape), the same windows captured teacher-forced at batch 16 and generated
at batch 8, each with the kernel, the sorts and the kernel again; the content hashes of the files,
and whether the kernel ran (Triton present, no failure).

From the repository root: ``OUT=DIR PYTHONPATH=. python docs/capture/top_r_kernel_check.py``
(writes DIR/top_r_kernel_check.json). Result: docs/capture/top_r_kernel_check_*.json
(docs/CAPTURE.md).
"""
import json
import os
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from traces.atomic import atomic_write_text
from traces.capture import top_r
from traces.capture.capture import batch_tokens, build_meta, capture_windows, open_writer
from traces.capture.config import CaptureConfig, GenerateConfig, ModelConfig
from traces.capture.hooks import router_returns_probabilities
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents
from traces.format import recorded_content_hash

out = Path(os.environ.get("OUT", "/tmp/top_r_kernel_check"))
out.mkdir(parents=True, exist_ok=True)
base = CaptureConfig(model=ModelConfig(config="traces/fixtures/shapes/qwen3_next_small.json",
                                       tokenizer="traces/fixtures/model"), batch_size=16)
model, tokenizer, sites, name = load_model(base.model)
windows, domains = make_windows(read_documents(["docs", "traces", "simulator"]), tokenizer, 512,
                                max_tokens=int(os.environ.get("TOKENS", 65536)))
probs = router_returns_probabilities(model, sites)
configs = {"teacher_forced": base,
           "generate": replace(base, mode="generate", batch_size=8,
                               generate=GenerateConfig(prompt_tokens=64, new_tokens=32))}
probe = torch.zeros(2, 1, sites[0].num_experts, dtype=torch.float16, device=model.device)
result: dict = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
                "torch": torch.__version__,
                "kernel_usable": top_r.uses_kernel(probe), "runs": {}}
with tempfile.TemporaryDirectory() as tmp:
    for mode, cfg in configs.items():
        for run, kernel in (("kernel", True), ("sorts", False), ("kernel_again", True)):
            c = replace(cfg, top_r_kernel=kernel)
            meta = build_meta(model, sites, name, domains, c, {}, probs)
            path = Path(tmp) / f"{mode}_{run}.parquet"
            with open_writer(path, meta, batch_tokens=batch_tokens(c)) as w:
                stats = capture_windows(model, sites, windows if mode == "teacher_forced" else windows[:32], c,
                                        lambda rows: w.write(**rows.columns()), logits_are_probs=probs,
                                        block=w.block)
            result["runs"].setdefault(mode, {})[run] = {"hash": recorded_content_hash(path), "tokens": stats["tokens"]}
result["kernel_failed"] = list(top_r._FAILED)
result["equal"] = {mode: len({r["hash"] for r in runs.values()}) == 1 for mode, runs in result["runs"].items()}
atomic_write_text(out / "top_r_kernel_check.json", json.dumps(result, indent=1) + "\n")
print(json.dumps(result, indent=1))
