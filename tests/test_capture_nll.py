"""The teacher-forced NLL of a capture: the one-pass log-sum-exp kernel and its fallback."""
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
kernel = nll._kernel()
gen = torch.Generator().manual_seed(2)
for cols, dtype in [(1000, torch.bfloat16), (2048, torch.float16), (333, torch.float32)]:
    x = (torch.randn(5, cols, generator=gen) * 8).to(dtype)
    x[1, 7] = 60000 if dtype != torch.bfloat16 else 1e30
    x[3] = float("-inf")
    x[3, cols - 1] = 2.5
    out = torch.empty(5)
    kernel[(5,)](x, out, cols, x.stride(0), BLOCK=256)
    np.testing.assert_allclose(out.numpy(), torch.logsumexp(x.double(), -1).numpy(), rtol=1e-6)
print("ok")
"""


NLL_KERNEL_CHECK = """
import numpy as np, torch
from traces.capture import nll
lse_kernel, nll_kernel = nll._kernel(), nll._nll_kernel()
gen = torch.Generator().manual_seed(5)
for (B, S, V), dtype in [((3, 7, 1000), torch.bfloat16), ((2, 5, 300), torch.float16), ((1, 4, 2048), torch.float32)]:
    lm = (torch.randn(B, S, V, generator=gen) * 6).to(dtype)
    lm[0, 1, 3] = 60000 if dtype != torch.bfloat16 else 1e30
    ids = torch.randint(0, V, (B, S), generator=gen)
    x = lm.reshape(B * S, V)
    fused = torch.empty(B, S)
    nll_kernel[(B * S,)](x, ids.reshape(-1), fused, S, V, x.stride(0), BLOCK=256)
    lse = torch.empty(B * S)
    lse_kernel[(B * S,)](x, lse, V, x.stride(0), BLOCK=256)
    apart = torch.full((B, S), float("nan"))
    apart[:, 1:] = lse.view(B, S)[:, :-1] - lm[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1).float()
    assert torch.isnan(fused[:, 0]).all()
    assert torch.equal(fused[:, 1:], apart[:, 1:]), (fused - apart).abs().max()
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_the_nll_kernel_is_the_log_sum_exp_kernel_less_the_target_bit_for_bit():
    """The fused kernel that :func:`nll.token_nll` runs on CUDA, in Triton's interpreter: NaN at
    each window's first token, and elsewhere exactly the log-sum-exp kernel's value of the row
    before less that row's logit of the token, as the unfused path computed it."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", NLL_KERNEL_CHECK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_one_pass_kernel_equals_logsumexp():
    """The kernel in Triton's interpreter (CPU tensors; a process of its own, since the
    interpreter is chosen when Triton is first imported): rows longer than a block, a ragged last
    block, a row with one huge logit and a row of -inf but one."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_log_sum_exp_without_the_kernel():
    x = torch.randn(4, 70, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    np.testing.assert_allclose(nll.log_sum_exp(x).numpy(), torch.logsumexp(x.double(), -1).numpy(), rtol=1e-6)


def on_a_gpu_host(monkeypatch, lse_kernel, nll_kernel) -> None:
    """CPU tensors taken for CUDA ones, with these kernels, none failed yet."""
    monkeypatch.setattr(nll, "_kernel", lambda: lse_kernel)
    monkeypatch.setattr(nll, "_nll_kernel", lambda: nll_kernel)
    monkeypatch.setattr(nll, "_FAILED", [])
    monkeypatch.setattr(nll, "_NLL_FAILED", [])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


def test_an_nll_kernel_that_fails_leaves_the_log_sum_exp_kernel_to_compute_it(monkeypatch, broken_kernel):
    """A host where the one-kernel NLL fails but the log-sum-exp kernel runs: one warning, then
    the NLL as before it (that kernel, torch's gather and difference), without another attempt."""
    kernel, calls = broken_kernel
    lse_calls = []

    class Lse:  # the log-sum-exp kernel, in torch
        def __getitem__(self, grid):
            def launch(x, out, cols, stride, **kwargs):
                lse_calls.append(grid)
                out.copy_(torch.logsumexp(x.float(), dim=-1))
            return launch

    on_a_gpu_host(monkeypatch, Lse(), kernel)
    lm = torch.randn(2, 6, 30, generator=torch.Generator().manual_seed(6))
    ids = torch.randint(0, 30, (2, 6))
    with pytest.warns(RuntimeWarning, match="one-kernel NLL failed"):
        got = nll.token_nll(lm, ids)
    again = nll.token_nll(lm, ids)
    assert len(calls) == 1 and len(lse_calls) == 2 and not nll._FAILED
    expected = reference_nll(lm.numpy(), ids.numpy())
    for out in (got, again):
        np.testing.assert_allclose(out.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_a_kernel_that_fails_falls_back_once_with_a_warning(monkeypatch, broken_kernel):
    """A host where Triton cannot compile the kernel: one warning, the same NLL, no retry."""
    kernel, calls = broken_kernel
    on_a_gpu_host(monkeypatch, kernel, kernel)
    lm = torch.randn(2, 5, 40, generator=torch.Generator().manual_seed(4))
    ids = torch.randint(0, 40, (2, 5))
    with pytest.warns(RuntimeWarning, match="no compiler for this GPU") as warned:
        got = nll.token_nll(lm, ids)  # the NLL kernel fails, then the log-sum-exp kernel
    again = nll.token_nll(lm, ids)  # the log_softmax path now, without another attempt
    assert len(warned) == 2 and "one-kernel NLL" in str(warned[0].message)
    assert len(calls) == 2 and nll._FAILED == nll._NLL_FAILED == ["RuntimeError: no compiler for this GPU"]
    expected = reference_nll(lm.numpy(), ids.numpy())
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(again.numpy(), expected, rtol=1e-5, atol=1e-5)
