"""The capture's top-R logit selection in one Triton kernel, exactly as the format defines it.

``traces.format`` keeps, per token-layer, the R highest router logits with the selected experts
always among them (their scores raised to +inf), ties to the lower id, -0.0 equal to 0.0, then
orders the R by value descending (stable). With torch alone that is two stable sorts and eight
more tensor operations per forward (:func:`traces.capture.capture.top_r_logits`, the fallback):
1.68 ms of an H100 per forward of the small Qwen3-Next shape at batch 16, 3.51 ms on the 30B
shape; the kernel takes 0.75 and 0.77 ms (docs/CAPTURE.md, run o of 2026-12-05).

The kernel sorts each row in registers on one 32-bit key per expert that holds the whole order:
the value's bits mapped to an order-preserving unsigned integer (-0.0 taken as 0.0), and below
them the complement of the id, so that every key is distinct and a descending sort gives ties
to the lower id. A first sort of all E on the selection key (selected experts at +inf) ranks
them; its first R, the kept experts, are sorted again on the stored order's key, whose one extra
bit says whether the score was +inf (a selected expert, or a real +inf, which ties by id alone
as in the format). The values are read back at the ids, so the stored bits are the logits' own.
The look-ahead routing's top R is the same selection with no expert selected (k = 0).
"""
from __future__ import annotations

import torch

from traces.capture.kernels import give_up, triton_kernel

# a row's experts the kernel sorts in registers, at most (measured up to 512; ids fit the key's
# 15-bit field up to 2^15 - 1, but a sort of that many would spill): beyond, the sorts
MAX_EXPERTS = 4096
_FAILED: list[str] = []  # the kernel's first error on this host: then never tried again


@triton_kernel
def _kernel(triton, tl):
    """The Triton kernel, or None when Triton is not installed."""
    @triton.jit
    def top_r_rows(x_ptr, sel_ptr, val_ptr, id_ptr, E, stride, R,
                   K: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, E_PAD)
        inside = cols < E
        x = tl.load(x_ptr + row * stride + cols, mask=inside, other=0.0)
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = tl.where(bits == 0x8000, 0, bits)  # -0.0 as 0.0
        # order-preserving: negative values have every bit flipped, the others the sign bit set
        up = tl.where((bits & 0x8000) != 0, bits ^ 0xFFFF, bits | 0x8000)
        selected = cols < 0
        for j in tl.static_range(K):
            selected = selected | (cols == tl.load(sel_ptr + row * K + j))
        inf = 0xFC00  # +inf's bits, 0x7C00, mapped
        score = tl.where(selected, inf, up)
        low = 32767 - cols  # descending keys: ties to the lower id
        least = -2147483648  # below every expert's key (an id field of 0 would need id 32767)
        key = tl.where(inside, ((score - 0x8000) << 16) | low, least)
        ranked = tl.sort(key, 0, descending=True)
        # the R_PAD highest keys, in order: the kept experts first
        first = tl.sum(tl.where(tl.arange(0, E_PAD // R_PAD)[:, None] == 0,
                                tl.reshape(ranked, (E_PAD // R_PAD, R_PAD)), 0), axis=0)
        rank = tl.arange(0, R_PAD)
        kept = rank < R
        ids = 32767 - (first & 0x7FFF)
        values = tl.load(x_ptr + row * stride + ids, mask=kept, other=0.0)
        bits = values.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = tl.where(bits == 0x8000, 0, bits)
        up = tl.where((bits & 0x8000) != 0, bits ^ 0xFFFF, bits | 0x8000)
        was_inf = tl.where((first >> 16) == inf - 0x8000, 1, 0)  # the score: selected, or a real +inf
        stored = tl.where(kept, ((up - 0x8000) << 16) | (was_inf << 15) | (first & 0x7FFF), least)
        ranked = tl.sort(stored, 0, descending=True)
        ids = 32767 - (ranked & 0x7FFF)
        values = tl.load(x_ptr + row * stride + ids, mask=kept, other=0.0)
        tl.store(val_ptr + row * R + rank, values, mask=kept)
        tl.store(id_ptr + row * R + rank, ids.to(tl.int16), mask=kept)

    return top_r_rows


def uses_kernel(logits: torch.Tensor) -> bool:
    """Whether :func:`top_r` of ``logits`` runs the kernel (CUDA, Triton, float16, E <= :data:`MAX_EXPERTS`)."""
    return (logits.is_cuda and logits.dtype == torch.float16 and logits.shape[-1] <= MAX_EXPERTS
            and not _FAILED and _kernel() is not None)


def top_r(logits: torch.Tensor, experts: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float16[..., E] logits and int[..., k] selected experts (k may be 0: look-ahead routing) ->
    (float16[..., R] descending, int16[..., R] their ids) by the kernel; None where the kernel
    failed (a warning, once; the caller then selects with sorts). Call only where
    :func:`uses_kernel`."""
    *lead, E = logits.shape
    k = experts.shape[-1]
    x = logits.reshape(-1, E)
    x = x if x.stride(1) == 1 else x.contiguous()
    sel = experts.reshape(-1, k).contiguous() if k else x  # none selected: a pointer never read
    rows = x.shape[0]
    values = torch.empty((rows, r), dtype=torch.float16, device=x.device)
    ids = torch.empty((rows, r), dtype=torch.int16, device=x.device)
    if rows:
        e_pad = _next_power_of_2(E)
        try:
            _kernel()[(rows,)](x, sel, values, ids, E, x.stride(0), r, K=k, E_PAD=e_pad, R_PAD=_next_power_of_2(r),
                               num_warps=max(1, min(8, e_pad // 128)))
        except Exception as e:  # noqa: BLE001 - e.g. a GPU or driver Triton cannot compile for
            give_up(_FAILED, "the top-R kernel", "selecting with sorts instead", e)
            return None
    return values.view(*lead, r), ids.view(*lead, r)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
