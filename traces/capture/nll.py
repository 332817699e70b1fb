"""The teacher-forced NLL of every token: log-sum-exp of the LM logits in one pass over them.

A forward of 16 windows of 512 tokens through a model with a 151,936-token vocabulary returns
2.5 GB of bfloat16 logits. ``log_softmax`` over them writes a float32 copy (5 GB) to read back
one value per row: on an H200 it cost 8.6 ms per such forward, 3 % of the forward itself. The
NLL needs only each row's log-sum-exp and the target's logit; on CUDA, when Triton is installed
(it comes with CUDA builds of torch), a kernel reads every row once, accumulating in float32 with
an online maximum, and writes each token's NLL itself (:func:`token_nll`: one launch per forward
where the log-sum-exp, the target's gather and the difference had taken a dozen calls of torch:
0.024 against 0.082 ms of the model's thread per forward of the small Qwen3-Next shape at batch
16 on an H100 host, the same values bit for bit, docs/CAPTURE.md run 1207af). Elsewhere
``log_softmax`` in float32 does it, a few windows at a time.
"""
from __future__ import annotations

import torch

from traces.capture.kernels import give_up, triton_kernel

CHUNK_ELEMENTS = 1 << 28  # bound the float32 log-softmax without the kernel (1 GiB)
LSE_BLOCK = 2048  # logits one kernel program reads per iteration (a row is read in blocks)


@triton_kernel
def _kernels(triton, tl):
    """The Triton kernels (log-sum-exp of each row; each token's NLL), or None when Triton is not
    installed. Both take a row's log-sum-exp from ``_row_lse``, inlined: the same operations. A
    kernel finds the functions it calls among its module's globals (Triton's interpreter finds
    no others), so ``_row_lse`` is made one."""
    global _row_lse

    @triton.jit
    def _row_lse(base, cols, BLOCK: tl.constexpr):
        # per lane: running maximum and sum of exp(x - maximum); finite start, so masked lanes
        # (-inf) add exp(-inf) = 0 instead of NaN
        m = tl.full([BLOCK], -3.0e38, tl.float32)
        s = tl.zeros([BLOCK], tl.float32)
        for start in range(0, cols, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            x = tl.load(base + idx, mask=idx < cols, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
            m = m_new
        top = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(m - top), axis=0)
        return top + tl.log(total)

    @triton.jit
    def lse_rows(x_ptr, out_ptr, cols, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        tl.store(out_ptr + row, _row_lse(x_ptr + row * stride, cols, BLOCK))

    @triton.jit
    def nll_rows(x_ptr, ids_ptr, out_ptr, S, cols, stride, BLOCK: tl.constexpr):
        # program r (token s = r mod S of its window): NaN where s = 0, else the log-sum-exp of
        # logit row r - 1 less that row's logit of token r, both float32: bit for bit what
        # lse_rows and torch's gather and difference give
        row = tl.program_id(0).to(tl.int64)
        if row % S == 0:
            tl.store(out_ptr + row, float("nan"))
        else:
            base = x_ptr + (row - 1) * stride
            target = tl.load(base + tl.load(ids_ptr + row).to(tl.int64)).to(tl.float32)
            tl.store(out_ptr + row, _row_lse(base, cols, BLOCK) - target)

    return lse_rows, nll_rows


def _kernel():
    """The log-sum-exp kernel, or None when Triton is not installed."""
    kernels = _kernels()
    return None if kernels is None else kernels[0]


def _nll_kernel():
    """The NLL kernel (:func:`token_nll`), or None when Triton is not installed."""
    kernels = _kernels()
    return None if kernels is None else kernels[1]


_FAILED: list[str] = []  # the kernel's first error on this host: then never tried again
_NLL_FAILED: list[str] = []  # the NLL kernel's: then the log-sum-exp kernel and torch take its place


def uses_kernel(x: torch.Tensor) -> bool:
    """Whether :func:`log_sum_exp` of ``x`` runs the one-pass kernel."""
    return x.is_cuda and not _FAILED and _kernel() is not None


def log_sum_exp(x: torch.Tensor) -> torch.Tensor:
    """float32[N]: log(sum(exp(x[i]))) of each row of ``x`` [N, V] (any float dtype): the one-pass
    kernel where :func:`uses_kernel`, else ``logsumexp`` of a float32 copy."""
    if not uses_kernel(x):
        return torch.logsumexp(x.float(), dim=-1)
    n, cols = x.shape
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(n, dtype=torch.float32, device=x.device)
    if n:
        try:
            _kernel()[(n,)](x, out, cols, x.stride(0), BLOCK=LSE_BLOCK, num_warps=8)
        except Exception as e:  # noqa: BLE001 - e.g. a GPU or driver Triton cannot compile for
            give_up(_FAILED, "the one-pass NLL kernel", "using log_softmax instead", e)
            return torch.logsumexp(x.float(), dim=-1)
    return out


def token_nll(lm_logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Teacher-forced NLL (nats) of each token given the ones before it: float32[B, S], NaN at 0.

    NLL of token s = log-sum-exp of the logits at s - 1 minus the logit of token s there. On CUDA
    with Triton, one kernel computes it; where that kernel fails on a host, the log-sum-exp kernel
    and torch's gather and difference do (the same values); without either, ``log_softmax``
    accumulating in float32, a few windows at a time.
    """
    B, S, V = lm_logits.shape
    if S >= 2 and uses_kernel(lm_logits) and not _NLL_FAILED:
        x = lm_logits.reshape(B * S, V)
        x = x if x.stride(1) == 1 else x.contiguous()
        ids = input_ids.reshape(B * S)
        ids = ids if ids.is_contiguous() else ids.contiguous()
        nll = torch.empty((B, S), dtype=torch.float32, device=lm_logits.device)
        try:
            _nll_kernel()[(B * S,)](x, ids, nll, S, V, x.stride(0), BLOCK=LSE_BLOCK, num_warps=8)
            return nll
        except Exception as e:  # noqa: BLE001 - e.g. a GPU or driver Triton cannot compile for
            give_up(_NLL_FAILED, "the one-kernel NLL", "using the log-sum-exp kernel and torch instead", e)
    nll = torch.full((B, S), float("nan"), dtype=torch.float32, device=lm_logits.device)
    if S < 2:
        return nll
    if uses_kernel(lm_logits):  # the same values in a dozen calls
        lse = log_sum_exp(lm_logits.reshape(B * S, V)).view(B, S)[:, :-1]
        nll[:, 1:] = lse - lm_logits[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1).float()
        return nll
    rows = max(1, CHUNK_ELEMENTS // max(1, S * V))
    for b in range(0, B, rows):
        logp = torch.log_softmax(lm_logits[b : b + rows], dim=-1, dtype=torch.float32)
        nll[b : b + rows, 1:] = -logp[:, :-1].gather(-1, input_ids[b : b + rows, 1:, None]).squeeze(-1)
    return nll
