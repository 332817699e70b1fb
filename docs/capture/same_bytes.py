"""What the GPU-host checks that a capture setting stores the same bytes share
(``shared_rows_check.py``, ``recording_stream_check.py``, ``top_r_kernel_check.py``): one load
of the small Qwen3-Next shape, the same windows captured once per setting, the content hashes of
the files. Run from the repository root with ``PYTHONPATH=.``.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from traces.capture.capture import batch_tokens, build_meta, capture_windows, open_writer
from traces.capture.config import CaptureConfig, GenerateConfig, ModelConfig
from traces.capture.hooks import router_returns_probabilities
from traces.capture.model import load_model
from traces.capture.text import make_windows, read_documents
from traces.format import recorded_content_hash


class Setup(NamedTuple):
    base: CaptureConfig  # teacher-forced at batch 16
    model: object
    sites: list
    name: str
    windows: list
    domains: list
    probs: bool


def load(tokens: int = 65536) -> Setup:
    """The small Qwen3-Next shape and ``tokens`` of this repository's text in 512-token windows."""
    base = CaptureConfig(model=ModelConfig(config="traces/fixtures/shapes/qwen3_next_small.json",
                                           tokenizer="traces/fixtures/model"), batch_size=16)
    model, tokenizer, sites, name = load_model(base.model)
    windows, domains = make_windows(read_documents(["docs", "traces", "simulator"]), tokenizer, 512,
                                    max_tokens=tokens)
    return Setup(base, model, sites, name, windows, domains, router_returns_probabilities(model, sites))


def out_dir(default: str) -> Path:
    """$OUT, or ``default``; created."""
    out = Path(os.environ.get("OUT", default))
    out.mkdir(parents=True, exist_ok=True)
    return out


def generating(base: CaptureConfig) -> CaptureConfig:
    """``base`` generating at batch 8: 64-token prompts, 32 new tokens."""
    return replace(base, mode="generate", batch_size=8, generate=GenerateConfig(prompt_tokens=64, new_tokens=32))


def hashes(s: Setup, cfg: CaptureConfig, runs: dict[str, dict], windows: list | None = None) -> dict:
    """Each run (name -> the config fields it sets over ``cfg``) captured to a file of its own:
    ``{run: {"hash", "tokens"}}``. The rows go into the writer's shared memory where the run's
    ``shared_rows`` says so, as in moe-capture."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for run, fields in runs.items():
            c = replace(cfg, **fields)
            meta = build_meta(s.model, s.sites, s.name, s.domains, c, {}, s.probs)
            path = Path(tmp) / f"{run}.parquet"
            with open_writer(path, meta, batch_tokens=batch_tokens(c)) as w:
                stats = capture_windows(s.model, s.sites, s.windows if windows is None else windows, c,
                                        lambda rows, w=w: w.write(**rows.columns()), logits_are_probs=s.probs,
                                        block=w.block if c.shared_rows else None)
            found[run] = {"hash": recorded_content_hash(path), "tokens": stats["tokens"]}
    return found


def equal(runs: dict) -> bool:
    """Whether every run of :func:`hashes` wrote the same content."""
    return len({r["hash"] for r in runs.values()}) == 1
