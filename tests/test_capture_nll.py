"""The teacher-forced NLL of a capture: the one-pass NLL kernel and its fallback."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from traces.capture import nll  # noqa: E402


def reference_nll(lm: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """float64 NLL of ids[:, s] given the logits at s - 1; NaN at position 0."""
    lm = lm.astype(np.float64)
    top = lm.max(-1, keepdims=True)
    lse = (np.log(np.exp(lm - top).sum(-1, keepdims=True)) + top)[..., 0]
    out = np.full(ids.shape, np.nan)
    out[:, 1:] = lse[:, :-1] - np.take_along_axis(lm[:, :-1], ids[:, 1:, None], -1)[..., 0]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_token_nll_is_the_log_softmax_of_the_next_token(dtype):
    gen = torch.Generator().manual_seed(0)
    lm = (torch.randn(3, 9, 301, generator=gen) * 5).to(dtype)
    ids = torch.randint(0, 301, (3, 9), generator=gen)
    got = nll.token_nll(lm, ids)
    assert got.dtype == torch.float32 and torch.isnan(got[:, 0]).all()
    np.testing.assert_allclose(got.numpy(), reference_nll(lm.float().numpy(), ids.numpy()), rtol=1e-5, atol=1e-5)


def test_chunked_fallback_equals_one_chunk(monkeypatch):
    lm = torch.randn(4, 6, 50, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids = torch.randint(0, 50, (4, 6))
    whole = nll.token_nll(lm, ids)
    monkeypatch.setattr(nll, "CHUNK_ELEMENTS", 6 * 50)  # one window (6 x 50 logits) per chunk
    np.testing.assert_array_equal(nll.token_nll(lm, ids).numpy(), whole.numpy())


def test_a_single_position_has_no_nll():
    out = nll.token_nll(torch.randn(2, 1, 7), torch.zeros(2, 1, dtype=torch.long))
    assert out.shape == (2, 1) and torch.isnan(out).all()


KERNEL_CHECK = """
import numpy as np, torch
from traces.capture import nll
nll.LSE_BLOCK = 256  # rows longer than a block, and a ragged last block
gen = torch.Generator().manual_seed(2)
for B, S, V, dtype in [(2, 5, 1000, torch.bfloat16), (3, 4, 2048, torch.float16), (2, 6, 333, torch.float32)]:
    lm = (torch.randn(B, S, V, generator=gen) * 8).to(dtype)
    lm[0, 1, 7] = 60000 if dtype != torch.bfloat16 else 1e30  # one huge logit
    lm[B - 1, 2] = float("-inf")  # a row of -inf but one, that one the next token
    lm[B - 1, 2, V - 1] = 2.5
    ids = torch.randint(0, V, (B, S), generator=gen)
    ids[B - 1, 3] = V - 1
    got = nll._nll_kernel(lm, ids)
    assert got.shape == (B, S) and got.dtype == torch.float32
    nan = torch.full((B,), float("nan"))
    assert torch.equal(got[:, 0].view(torch.int32), nan.view(torch.int32)), "NaN at 0, with torch's bits"
    logp = torch.log_softmax(lm.double(), -1)
    ref = -logp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    np.testing.assert_allclose(got[:, 1:].numpy(), ref.numpy(), rtol=1e-6, atol=1e-6)
    assert got[B - 1, 3] == 0.0
    again = nll._nll_kernel(lm[::2], ids[::2])  # windows not contiguous: the same bits
    assert torch.equal(again.view(torch.int32), got[::2].view(torch.int32))
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_one_pass_kernel_is_the_log_softmax_of_the_next_token():
    """The NLL kernel in Triton's interpreter (CPU tensors; a process of its own, since the
    interpreter is chosen when Triton is first imported) against float64 ``log_softmax``: rows
    longer than a block, a ragged last block, a huge logit, a row of -inf but one, NaN at each
    window's first token with torch's bits, windows that are not contiguous."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_kernel_that_fails_falls_back_once_with_a_warning(monkeypatch, broken_kernel):
    """A host where Triton cannot compile the kernel: one warning, the same NLL, no retry."""
    kernel, calls = broken_kernel
    monkeypatch.setattr(nll, "_kernel", lambda: kernel)
    monkeypatch.setattr(nll, "_FAILED", [])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    lm = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, 40, (2, 5))
    with pytest.warns(RuntimeWarning, match="no compiler for this GPU"):
        got = nll.token_nll(lm, ids)
    again = nll.token_nll(lm, ids)  # the log_softmax path now, without another attempt
    assert len(calls) == 1 and nll._FAILED == ["RuntimeError: no compiler for this GPU"]
    expected = reference_nll(lm.numpy(), ids.numpy())
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(again.numpy(), expected, rtol=1e-5, atol=1e-5)
