"""The shipped fixture model and the bundled trace: they load, fit their budgets, and agree."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from traces.capture.capture import run_capture  # noqa: E402
from traces.capture.config import CaptureConfig, InputConfig, ModelConfig  # noqa: E402
from traces.capture.model import load_model  # noqa: E402
from traces.format import open_trace, read_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MODEL = ROOT / "traces" / "fixtures" / "model"
TRACE = ROOT / "traces" / "samples" / "fixture.parquet"
needs_model = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="fixture model not built")
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="bundled trace not built")


@pytest.fixture(scope="module")
def fixture_model():
    return load_model(ModelConfig(path=str(MODEL), device="cpu"))


@needs_model
def test_fixture_files_fit_and_report_quality():
    assert (MODEL / "model.safetensors").stat().st_size <= 16 * 10**6
    training = json.loads((MODEL / "training.json").read_text())
    assert training["val_ppl"] < 0.25 * training["unigram_ppl"]
    uniform = training["uniform_share"]
    assert min(training["top10pct_share_per_layer"]) > 1.5 * uniform  # clearly non-uniform routing


@needs_model
def test_fixture_model_loads_and_captures(fixture_model, tmp_path):
    model, tokenizer, sites, _ = fixture_model
    assert [s.layer_id for s in sites] == [1, 2, 3, 4, 5, 6]
    assert sites[0].num_experts == 64 and sites[0].top_k >= 4
    text = tmp_path / "code"
    text.mkdir()
    (text / "a.py").write_text("def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n" * 4)
    cfg = CaptureConfig(model=ModelConfig(path=str(MODEL), device="cpu"),
                        input=InputConfig(paths=[str(text)], window_tokens=48, min_window_tokens=2),
                        out=str(tmp_path / "t.parquet"), progress=False, mode="generate")
    cfg.generate.prompt_tokens, cfg.generate.new_tokens = 16, 4
    stats = run_capture(cfg)
    meta, chunk = read_trace(cfg.out)
    assert meta.num_layers == 6 and meta.has_logits and meta.layer_ids == [1, 2, 3, 4, 5, 6]
    assert chunk.num_tokens == stats["tokens"] > 0
    later = chunk.pos > 0  # the first token of a sequence has no context, so no NLL
    assert np.isnan(chunk.nll[~later]).all() and (chunk.nll[later] < 12).all()


@needs_trace
def test_bundled_trace_meets_its_specification():
    # 20,000 tokens x 6 layers x 64 bf16-valued logits hold ~10.2 MB of information on their own:
    # the bundled file rounds them to 1/32 to stay within 10 MB (traces/samples/README.md)
    assert TRACE.stat().st_size <= 10 * 10**6
    trace = open_trace(TRACE)
    meta = trace.meta
    assert meta.num_layers >= 6 and meta.num_experts >= 64 and meta.has_logits
    assert len(meta.domains) >= 4 and meta.source == "capture"
    tokens = sum(c.num_tokens for c in trace.iter_chunks())
    assert tokens >= 20_000


@needs_model
@needs_trace
def test_bundled_trace_is_this_models_routing(fixture_model):
    """Re-run the first sequence on the CPU: the recorded first choices are the model's (up to bf16 noise)."""
    model, _, sites, _ = fixture_model
    meta, chunk = read_trace(TRACE)
    sel = chunk.seq == chunk.seq[0]
    seen = {j: [] for j in range(len(sites))}
    handles = [s.module.register_forward_hook(lambda m, a, out, j=j: seen[j].append(out[2].detach()))
               for j, s in enumerate(sites)]
    try:
        with torch.inference_mode():
            model(input_ids=torch.as_tensor(chunk.token_id[sel], dtype=torch.long)[None])
    finally:
        for h in handles:
            h.remove()
    first = np.stack([seen[j][0][:, 0].numpy() for j in range(len(sites))], axis=1)
    assert (first == chunk.experts[sel][:, :, 0]).mean() > 0.9
