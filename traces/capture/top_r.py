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

:func:`stored_rows` makes a whole block's stored routing columns in one launch with the same
selection: the logits cast to float16 in the kernel, the real token slots picked there, the
experts and weights written in their stored dtypes, straight into host memory registered with
the device (the trace writer's shared memory). Step by step that took the model's thread about
ten launches and a copy per column per forward.
"""
from __future__ import annotations

import torch

from traces.capture.kernels import give_up, triton_kernel

# a row's experts the kernel sorts in registers, at most (measured up to 512; ids fit the key's
# 15-bit field up to 2^15 - 1, but a sort of that many would spill): beyond, the sorts
MAX_EXPERTS = 4096
_FAILED: list[str] = []  # the kernel's first error on this host: then never tried again
_ROWS_FAILED: list[str] = []  # the stored-rows kernel's: then the recording stores by separate steps


@triton_kernel
def _kernels(triton, tl):
    """The Triton kernels (the top-R selection of each row; a block's stored routing columns in one
    launch), or None when Triton is not installed. Both select through ``_select``, inlined: the
    same operations. A kernel finds the functions it calls among its module's globals (Triton's
    interpreter finds no others), so ``_select`` is made one."""
    global _select

    @triton.jit
    def _select(x_ptr, sel_ptr, E, R, K: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
        # one row's top R: (float16 values, int32 ids, kept lanes) in R_PAD lanes; the row's
        # logits read as float16 (a cast of a wider dtype, as torch's ``.to(torch.float16)``)
        cols = tl.arange(0, E_PAD)
        inside = cols < E
        x = tl.load(x_ptr + cols, mask=inside, other=0.0).to(tl.float16)
        bits = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = tl.where(bits == 0x8000, 0, bits)  # -0.0 as 0.0
        # order-preserving: negative values have every bit flipped, the others the sign bit set
        up = tl.where((bits & 0x8000) != 0, bits ^ 0xFFFF, bits | 0x8000)
        selected = cols < 0
        for j in tl.static_range(K):
            selected = selected | (cols == tl.load(sel_ptr + j))
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
        values = tl.load(x_ptr + ids, mask=kept, other=0.0).to(tl.float16)
        bits = values.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
        bits = tl.where(bits == 0x8000, 0, bits)
        up = tl.where((bits & 0x8000) != 0, bits ^ 0xFFFF, bits | 0x8000)
        was_inf = tl.where((first >> 16) == inf - 0x8000, 1, 0)  # the score: selected, or a real +inf
        stored = tl.where(kept, ((up - 0x8000) << 16) | (was_inf << 15) | (first & 0x7FFF), least)
        ranked = tl.sort(stored, 0, descending=True)
        ids = 32767 - (ranked & 0x7FFF)
        values = tl.load(x_ptr + ids, mask=kept, other=0.0).to(tl.float16)
        return values, ids, kept

    @triton.jit
    def top_r_rows(x_ptr, sel_ptr, val_ptr, id_ptr, E, stride, R,
                   K: tl.constexpr, E_PAD: tl.constexpr, R_PAD: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        values, ids, kept = _select(x_ptr + row * stride, sel_ptr + row * K, E, R, K, E_PAD, R_PAD)
        rank = tl.arange(0, R_PAD)
        tl.store(val_ptr + row * R + rank, values, mask=kept)
        tl.store(id_ptr + row * R + rank, ids.to(tl.int16), mask=kept)

    @triton.jit
    def stored_rows(x_ptr, ex_ptr, w_ptr, slot_ptr, val_ptr, id_ptr, ex_out, w_out, L, E, R,
                    SLOTS: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, E_PAD: tl.constexpr,
                    R_PAD: tl.constexpr):
        # program r: token t = r // L, layer l = r mod L of the rows stored; read from token slot
        # t (or slots[t]) of the stacked routing [slots, L, *], contiguous
        row = tl.program_id(0).to(tl.int64)
        t = row // L
        if SLOTS:
            t = tl.load(slot_ptr + t).to(tl.int64)
        src = t * L + row % L
        values, ids, kept = _select(x_ptr + src * E, ex_ptr + src * K, E, R, K, E_PAD, R_PAD)
        rank = tl.arange(0, R_PAD)
        tl.store(val_ptr + row * R + rank, values, mask=kept)
        tl.store(id_ptr + row * R + rank, ids.to(tl.int16), mask=kept)
        ranks = tl.arange(0, K_PAD)
        used = ranks < K
        tl.store(ex_out + row * K + ranks, tl.load(ex_ptr + src * K + ranks, mask=used).to(tl.int16), mask=used)
        tl.store(w_out + row * K + ranks, tl.load(w_ptr + src * K + ranks, mask=used).to(tl.float32), mask=used)

    return top_r_rows, stored_rows


def _kernel():
    """The top-R selection kernel, or None when Triton is not installed."""
    kernels = _kernels()
    return None if kernels is None else kernels[0]


def _rows_kernel():
    """The stored-rows kernel (:func:`stored_rows`), or None when Triton is not installed."""
    kernels = _kernels()
    return None if kernels is None else kernels[1]


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


def uses_rows_kernel(logits: torch.Tensor) -> bool:
    """Whether :func:`stored_rows` may run for the stacked ``logits`` [N, L, E] (CUDA, Triton, a
    float dtype, E <= :data:`MAX_EXPERTS`, the kernel not failed on this host)."""
    return (logits.is_cuda and logits.is_floating_point() and logits.shape[-1] <= MAX_EXPERTS
            and not _ROWS_FAILED and _rows_kernel() is not None)


def stored_rows(logits: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, slots: torch.Tensor | None,
                out: dict[str, torch.Tensor]) -> bool:
    """A block's stored routing columns in one launch: for the token slots ``slots`` (int64[T];
    None: all N) of the stacked routing ``logits`` [N, L, E] (any float dtype), ``experts``
    int64[N, L, k] (rank order) and ``weights`` [N, L, k] (any float dtype), all contiguous, write
    ``out["logits"]`` float16[T, L, R] and ``out["logit_ids"]`` int16[T, L, R] (the top R, as
    :func:`top_r` of the float16 logits), ``out["experts"]`` int16[T, L, k] and ``out["weights"]``
    float32[T, L, k]: contiguous tensors the device writes (its memory, or host memory registered
    with it, such as the trace writer's shared memory, :func:`traces.capture.capture._registered`).
    The same values as the casts, index selection and :func:`top_r` they replace, in one launch
    instead of about ten. False where the kernel failed (a warning, once; the caller then takes
    those steps). Call only where :func:`uses_rows_kernel`."""
    N, L, E = logits.shape
    k, r = experts.shape[-1], out["logits"].shape[-1]
    logits, experts, weights = (t if t.is_contiguous() else t.contiguous() for t in (logits, experts, weights))
    rows = out["logits"].shape[0] * L
    if rows:
        e_pad = _next_power_of_2(E)
        try:
            _rows_kernel()[(rows,)](logits, experts, weights, logits if slots is None else slots, out["logits"],
                                    out["logit_ids"], out["experts"], out["weights"], L, E, r,
                                    SLOTS=slots is not None, K=k, K_PAD=_next_power_of_2(k), E_PAD=e_pad,
                                    R_PAD=_next_power_of_2(r), num_warps=max(1, min(8, e_pad // 128)))
        except Exception as e:  # noqa: BLE001 - e.g. a GPU or driver Triton cannot compile for
            give_up(_ROWS_FAILED, "the stored-rows kernel", "storing the rows step by step instead", e)
            return False
    return True


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()
