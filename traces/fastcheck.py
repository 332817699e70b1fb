"""A one-pass Numba check of a unit's top-R ids, in front of the NumPy checks that name a problem.

``traces.format.find_problem`` checks that each token-layer's top-R ``logit_ids`` are R distinct
experts in 0..E-1 that hold its selected experts. In NumPy that takes a table of E flags per
token-layer (13 MB for a 3,206-token unit of an 8 x 512 shape), written, counted and read back.
:func:`top_r_ids_ok` answers the same question in one pass over the ids with a bitset per
token-layer. ``find_problem`` uses it on units of at least ``FAST_CHECK_MIN_IDS`` ids (a
capture's; loading Numba costs a process about a second once) and runs the NumPy checks, which
name a problem, only where it finds one; the two must agree on every input (tests/test_format.py
checks that on randomised units).

On such a unit with top-64 ids (2 cores, medians of 31 alternating runs, two runs): the NumPy
checks 11.6 and 11.7 ms of CPU, this one 3.5 and 3.6 ms; all of ``find_problem`` 5.5 ms. The
capture's encoders check every unit they write.
"""
from __future__ import annotations

import numpy as np

from simulator.jit import jit


@jit
def _ids_ok(ids, experts, num_experts):
    """``ids`` (n, L, R) and ``experts`` (n, L, k), any integer dtype."""
    n, layers, r = ids.shape
    k = experts.shape[2]
    words = (num_experts + 63) // 64
    bits = np.zeros(words, np.uint64)
    one = np.uint64(1)
    for t in range(n):
        for layer in range(layers):
            for j in range(r):
                v = np.int64(ids[t, layer, j])
                if v < 0 or v >= num_experts:
                    return False
                word, bit = v >> 6, one << np.uint64(v & 63)
                if bits[word] & bit:
                    return False
                bits[word] |= bit
            for j in range(k):
                v = np.int64(experts[t, layer, j])
                if v < 0 or v >= num_experts or not bits[v >> 6] & (one << np.uint64(v & 63)):
                    return False
            if words <= r:  # clear what this row set: every word, or the words of its ids
                bits[:] = 0
            else:
                for j in range(r):
                    bits[np.int64(ids[t, layer, j]) >> 6] = 0
    return True


def top_r_ids_ok(ids: np.ndarray, experts: np.ndarray, num_experts: int) -> bool:
    """Every token-layer's top-R ``ids`` are distinct experts in 0..E-1 that hold its ``experts``
    (both (tokens, layers, n)). False says only that one is not; the NumPy checks name it."""
    if ids.ndim != 3 or experts.ndim != 3 or ids.shape[:2] != experts.shape[:2]:
        return False
    return bool(_ids_ok(ids, experts, num_experts))


@jit
def _weights_ok(weights):
    """``weights`` (n, L, k) contiguous float: a flat pass for finite and non-negative (no early
    exit, so it vectorises), then one for a positive weight per token-layer."""
    n, layers, k = weights.shape
    flat = weights.reshape(-1)
    bad = False
    for i in range(flat.size):
        x = flat[i]
        bad |= not (x >= 0) or x == np.inf  # NaN fails x >= 0
    if bad:
        return False
    for row in range(n * layers):
        positive = False
        for j in range(k):
            positive |= flat[row * k + j] > 0
        if not positive:
            return False
    return True


def weights_ok(weights: np.ndarray) -> bool:
    """Every gate weight (tokens, layers, k) finite and non-negative, and every token-layer with
    a positive one; the answer of ``traces.format``'s NumPy check (which names a bad one)."""
    if weights.ndim != 3:
        raise ValueError(f"weights must be (tokens, layers, k), got shape {weights.shape}")
    return bool(_weights_ok(np.ascontiguousarray(weights)))


# NumPy sums a contiguous run of at most this many float32 values in one fixed order (below)
PAIRWISE_BLOCK = 128


@jit(inline=True)
def _numpy_sum(w, t, layer, k):
    """The float32 sum of w[t, layer, :k] in NumPy's order for k <= PAIRWISE_BLOCK: one by one
    from 0 below 8 values; else eight running sums over blocks of 8, combined as a tree, then
    the remainder one by one."""
    if k < 8:
        s = np.float32(0)
        for j in range(k):
            s += w[t, layer, j]
        return s
    r0, r1, r2, r3 = w[t, layer, 0], w[t, layer, 1], w[t, layer, 2], w[t, layer, 3]
    r4, r5, r6, r7 = w[t, layer, 4], w[t, layer, 5], w[t, layer, 6], w[t, layer, 7]
    j = 8
    while j < k - k % 8:
        r0 += w[t, layer, j]
        r1 += w[t, layer, j + 1]
        r2 += w[t, layer, j + 2]
        r3 += w[t, layer, j + 3]
        r4 += w[t, layer, j + 4]
        r5 += w[t, layer, j + 5]
        r6 += w[t, layer, j + 6]
        r7 += w[t, layer, j + 7]
        j += 8
    s = ((r0 + r1) + (r2 + r3)) + ((r4 + r5) + (r6 + r7))
    while j < k:
        s += w[t, layer, j]
        j += 1
    return s


@jit
def _gates(weights, out):
    """out = weights / their float32 sum per token-layer; False where a sum or a gate is not
    finite (the caller then takes NumPy's path, which widens or refuses)."""
    n, layers, k = weights.shape
    for t in range(n):
        for layer in range(layers):
            s = _numpy_sum(weights, t, layer, k)
            if not abs(s) < np.inf:
                return False
            for j in range(k):
                g = weights[t, layer, j] / s
                if not abs(g) < np.inf:
                    return False
                out[t, layer, j] = g
    return True


_SAME_AS_NUMPY: dict[int, bool] = {}


def _same_order_as_numpy(k: int) -> bool:
    """Whether :func:`_gates` gives NumPy's float32 gates bit for bit at width ``k`` on this
    machine's NumPy (checked once per width on random weights of a wide range)."""
    if k not in _SAME_AS_NUMPY:
        rng = np.random.default_rng(k)
        probe = (rng.random((64, 8, k)) * 10.0 ** rng.integers(-6, 7, (64, 8, k))).astype(np.float32)
        fast = np.empty_like(probe)
        _SAME_AS_NUMPY[k] = bool(_gates(probe, fast)) and np.array_equal(
            fast.view(np.uint32), (probe / probe.sum(axis=-1, keepdims=True)).view(np.uint32))
    return _SAME_AS_NUMPY[k]


def gates(weights: np.ndarray) -> np.ndarray | None:
    """Contiguous float32 ``weights`` (tokens, layers, k) divided by their sum per token-layer,
    bit for bit as ``traces.format.normalised_gates`` computes them with NumPy, in one pass; None
    where this path does not apply (k above NumPy's one-order block, an order that differs from
    this NumPy's, a sum or gate that is not finite) and NumPy's must be taken."""
    k = weights.shape[-1]
    if weights.ndim != 3 or weights.dtype != np.float32 or not 0 < k <= PAIRWISE_BLOCK:
        return None
    if not weights.flags.c_contiguous or not _same_order_as_numpy(k):
        return None
    out = np.empty_like(weights)
    return out if _gates(weights, out) else None
