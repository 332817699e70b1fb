"""Eviction order shared by both engines (docs/semantics.md, Cache).

``lru`` and ``fifo`` are orders of use and insertion; ``lfu`` and ``belady`` order residents by
:func:`eviction_key`; ``random`` draws slots with :func:`splitmix64`.
"""
from __future__ import annotations

from simulator.engine.params import EVICTIONS

LRU = EVICTIONS["lru"]
LFU = EVICTIONS["lfu"]
FIFO = EVICTIONS["fifo"]
RANDOM = EVICTIONS["random"]
BELADY = EVICTIONS["belady"]

NEVER_GROUP = 2**31 - 1  # in next-use rows (int32 group ordinals): never selected again
NEVER_STEP = 2**63 - 1  # next-use step ordinal of an expert that is never selected again

# lfu_decay multiplies frequencies by d once per group as a growing increment (inc /= d);
# past this the increment and all frequencies are divided by it
LFU_RENORMALISE_ABOVE = 1e100

_MASK64 = 0xFFFFFFFFFFFFFFFF


def splitmix64(state):
    """One step of the splitmix64 generator: ``(next_state, output)``, both unsigned 64-bit.

    Works on Python ints and, compiled, on ``np.uint64`` (where the masks are no-ops).
    """
    state = (state + 0x9E3779B97F4A7C15) & _MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return state, z ^ (z >> 31)


def next_use_step(next_group, layer, num_layers):
    """Step ordinal of an expert's next selection, from the group ordinal of a next-use row."""
    if next_group == NEVER_GROUP:
        return NEVER_STEP
    return next_group * num_layers + layer


def eviction_key(eviction, freq, last_use, next_step):
    """Key of one resident under ``lfu`` or ``belady``; the victim has the least (key, x).

    lfu: (frequency, last-use step): lowest frequency, then least recently used. belady:
    (0.0, -next-use step): the furthest next use first. Arguments are the expert's values.
    """
    if eviction == LFU:
        return freq, last_use
    return 0.0, -next_step
