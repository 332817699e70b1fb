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
