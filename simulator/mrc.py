"""One-pass miss-ratio curves for fetch-every-miss with LRU eviction (stack distances).

LRU with the engine's step semantics (docs/semantics.md) is a stack algorithm: after every
step a pool holds the most recently used experts that fit its budget, and the experts a step
selects are distinct, so a lookup is a hit exactly when the expert's *stack distance* at the
step's start (the size of the expert plus all distinct experts of its pool used after it) is at
most the budget. One pass over the trace records every lookup's distance; the hit count at any
cache size is then a prefix sum, equal to a per-size run of the engine with ``policy=fetch_all``,
``cache.eviction=lru``, ``cache.init=cold`` and no background admission.

Distances come from a Fenwick tree over access times (O(log n) per lookup): each pool keeps one
entry per resident-or-seen expert at its last access time, weighted by its size; the distance
of x is the weight at times after x's last access, plus x's own size. When a pool's time
counter reaches the tree's width, the live entries are renumbered in access order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce

import numpy as np

from simulator.engine.params import SCOPES
from simulator.jit import jit
from traces.errors import InputError
from traces.format import PHASE_DECODE

MAX_UNITS = 100_000_000  # largest histogram (pool size in units) a curve may need
CHUNK_BYTES = 64 << 20  # decoded bytes per chunk read from the source


@dataclass
class MissRatioCurve:
    """Lookups by stack distance, for one cache scope; sizes are in units of ``unit_bytes``.

    ``per_layer``: a size is experts per layer (every layer's pool holds that many; budget
    ``size * expert_bytes[l]``). ``global``: a size is the pool budget in units of
    ``unit_bytes`` (the gcd of the layers' expert bytes; with equal bytes a unit is one expert).
    ``decode_hist[d]`` counts decode lookups with stack distance d (d = 1..max_size);
    ``decode_cold`` those never seen before (a miss at every size). Prefill lookups likewise.
    """

    scope: str
    unit_bytes: int
    max_size: int
    decode_hist: np.ndarray  # int64[max_size + 1]; index 0 unused
    decode_cold: int
    prefill_hist: np.ndarray  # int64[max_size + 1]
    prefill_cold: int

    @property
    def decode_lookups(self) -> int:
        return int(self.decode_hist.sum()) + self.decode_cold

    @property
    def prefill_lookups(self) -> int:
        return int(self.prefill_hist.sum()) + self.prefill_cold

    @property
    def decode_hits(self) -> np.ndarray:
        """int64[max_size + 1]: decode hits at every cache size 0..max_size."""
        return np.cumsum(self.decode_hist)

    @property
    def prefill_hits(self) -> np.ndarray:
        """int64[max_size + 1]: prefill hits at every cache size 0..max_size."""
        return np.cumsum(self.prefill_hist)

    @property
    def hit_rate(self) -> np.ndarray:
        """float64[max_size + 1]: decode hit rate at every cache size (NaN without decode steps)."""
        n = self.decode_lookups
        return self.decode_hits / n if n else np.full(self.max_size + 1, np.nan)

    def size_of(self, *, fraction: float | None = None, budget_bytes: int | None = None,
                num_experts: int | None = None, expert_bytes=None) -> int:
        """The cache size (in this curve's units) that a ``cache.fraction`` or budget gives.

        Same rounding as the moe-sim app: per_layer ``floor(fraction * E)``; global
        ``floor(budget / unit_bytes)`` with ``budget = budget_bytes`` or
        ``floor(fraction * E * sum(expert_bytes))``.
        """
        if self.scope == "per_layer":
            if fraction is None or num_experts is None:
                raise InputError("per_layer sizes need fraction and num_experts")
            return min(math.floor(fraction * num_experts), self.max_size)
        if budget_bytes is None:
            if fraction is None or num_experts is None or expert_bytes is None:
                raise InputError("global sizes need budget_bytes, or fraction, num_experts and expert_bytes")
            budget_bytes = math.floor(fraction * int(np.sum(expert_bytes)) * num_experts)
        return min(int(budget_bytes) // self.unit_bytes, self.max_size)


def mrc(source, scope: str = "per_layer", expert_bytes=None, chunk_tokens: int | None = None
        ) -> MissRatioCurve:
    """Miss-ratio curve of ``source`` (a chunk source, see traces/format.py) in one pass.

    ``scope``: ``per_layer`` or ``global``. ``expert_bytes`` (int[L], bytes per expert of each
    layer) only matters for ``global`` and defaults to the trace's metadata.
    """
    if scope not in SCOPES:
        raise InputError(f"'scope={scope}' is not valid; choose one of: {', '.join(SCOPES)}")
    meta = source.meta
    L, E = meta.num_layers, meta.num_experts
    per_layer = scope == "per_layer"
    if per_layer:
        units = np.ones(L, dtype=np.int64)
        unit_bytes = 0
        pool_of_layer = np.arange(L, dtype=np.int64)
        items_per_pool = E
    else:
        eb = np.asarray(meta.expert_bytes if expert_bytes is None else expert_bytes, dtype=np.int64)
        if eb.shape != (L,) or (eb <= 0).any():
            raise InputError(f"expert_bytes needs {L} positive values, one per MoE layer")
        unit_bytes = int(reduce(math.gcd, eb.tolist()))
        units = eb // unit_bytes
        pool_of_layer = np.zeros(L, dtype=np.int64)
        items_per_pool = L * E
    max_size = int(units.max()) * items_per_pool if per_layer else int(units.sum()) * E
    if max_size > MAX_UNITS:
        raise InputError(
            f"a global curve over these expert sizes needs {max_size} size units; give the "
            "layers equal expert_bytes (or use scope=per_layer)"
        )
    state = _State.new(L, E, pool_of_layer, units, items_per_pool, max_size)
    if chunk_tokens is None:
        per_token = L * meta.top_k * 8 + (L * E * 4 if meta.has_logits else 0)
        chunk_tokens = max(1, CHUNK_BYTES // per_token)
    for c in source.iter_chunks(chunk_tokens):
        if c.num_tokens:
            state.step_ordinal = _mrc_chunk(
                np.ascontiguousarray(c.experts, dtype=np.int32),
                np.ascontiguousarray(c.group, dtype=np.int64),
                np.ascontiguousarray(c.phase, dtype=np.int8),
                E, state.pool_of_layer, state.item_units, state.pool_first, state.pool_items,
                state.last, state.mark, state.tree, state.clock, state.total,
                state.hist, state.buf, state.who, state.step_ordinal,
            )
    return MissRatioCurve(
        scope=scope,
        unit_bytes=unit_bytes,
        max_size=max_size,
        decode_hist=state.hist[1, : max_size + 1].copy(),
        decode_cold=int(state.hist[1, max_size + 1]),
        prefill_hist=state.hist[0, : max_size + 1].copy(),
        prefill_cold=int(state.hist[0, max_size + 1]),
    )


@dataclass
class _State:
    pool_of_layer: np.ndarray  # int64[L]
    item_units: np.ndarray  # int64[L*E]: size units of expert x
    pool_first: np.ndarray  # int64[P]: first flat id of the pool's contiguous id range
    pool_items: np.ndarray  # int64[P]: experts in the pool
    last: np.ndarray  # int64[L*E]: time of the last access in its pool's tree, -1 = never
    mark: np.ndarray  # int64[L*E]: last step ordinal that listed x (de-duplicates a step)
    tree: np.ndarray  # int32[P, W + 1]: Fenwick tree of units by access time, 1-based (sums
    # stay below MAX_UNITS)
    clock: np.ndarray  # int64[P]: next access time
    total: np.ndarray  # int64[P]: units of all experts seen so far
    hist: np.ndarray  # int64[2, max_size + 2]: [phase == decode, distance]; last = cold
    buf: np.ndarray  # int64[E]: one step's distinct experts
    who: np.ndarray  # int64[W]: scratch of a renumbering (expert at each access time)
    step_ordinal: int

    @classmethod
    def new(cls, L, E, pool_of_layer, units, items_per_pool, max_size):
        P = int(pool_of_layer.max()) + 1
        width = max(8 * items_per_pool, 64)
        return cls(
            pool_of_layer=pool_of_layer,
            item_units=np.repeat(units, E),
            pool_first=np.arange(P, dtype=np.int64) * items_per_pool,
            pool_items=np.full(P, items_per_pool, dtype=np.int64),
            last=np.full(L * E, -1, dtype=np.int64),
            mark=np.full(L * E, -1, dtype=np.int64),
            tree=np.zeros((P, width + 1), dtype=np.int32),
            clock=np.zeros(P, dtype=np.int64),
            total=np.zeros(P, dtype=np.int64),
            hist=np.zeros((2, max_size + 2), dtype=np.int64),
            buf=np.zeros(E, dtype=np.int64),
            who=np.zeros(width, dtype=np.int64),
            step_ordinal=0,
        )


@jit(allocates=False)
def _fenwick_add(tree, p, i, v):
    n = tree.shape[1] - 1
    i += 1
    while i <= n:
        tree[p, i] += v
        i += i & -i


@jit(allocates=False)
def _fenwick_prefix(tree, p, i):
    """Sum of entries at times 0..i."""
    s = 0
    i += 1
    while i > 0:
        s += tree[p, i]
        i -= i & -i
    return s


@jit(allocates=False)
def _compact(p, pool_first, pool_items, item_units, last, tree, clock, who):
    """Renumber the pool's live access times 0..n-1 in access order and rebuild its tree.

    ``who`` (int64[W]) is scratch: live times are distinct, so a pass over them sorts them.
    """
    first, n_items = pool_first[p], pool_items[p]
    width = tree.shape[1] - 1
    who[:width] = -1
    for i in range(first, first + n_items):
        if last[i] >= 0:
            who[last[i]] = i
    tree[p, :] = 0
    t = 0
    for old in range(width):
        i = who[old]
        if i < 0:
            continue
        last[i] = t
        tree[p, t + 1] += item_units[i]
        t += 1
    for i in range(1, width + 1):  # O(n) Fenwick build
        parent = i + (i & -i)
        if parent <= width:
            tree[p, parent] += tree[p, i]
    clock[p] = t


@jit(allocates=False)
def _mrc_chunk(experts, group, phase, E, pool_of_layer, item_units, pool_first, pool_items,
               last, mark, tree, clock, total, hist, buf, who, step_ordinal):
    """Record the stack distance of every lookup of one chunk; returns the next step ordinal."""
    T, L, k = experts.shape
    width = tree.shape[1] - 1
    cold = hist.shape[1] - 1
    start = 0
    while start < T:
        stop = start + 1
        while stop < T and group[stop] == group[start]:
            stop += 1
        row = 1 if phase[start] == PHASE_DECODE else 0
        for layer in range(L):
            p = pool_of_layer[layer]
            n = 0
            for t in range(start, stop):  # the step's distinct experts, in first-appearance order
                for r in range(k):
                    x = layer * E + experts[t, layer, r]
                    if mark[x] != step_ordinal:
                        mark[x] = step_ordinal
                        buf[n] = x
                        n += 1
            for j in range(n):  # distances at the step's start
                x = buf[j]
                if last[x] < 0:
                    hist[row, cold] += 1
                else:
                    d = total[p] - _fenwick_prefix(tree, p, last[x]) + item_units[x]
                    hist[row, d] += 1
            for j in range(n):  # then the step's uses, in processing order
                x = buf[j]
                u = item_units[x]
                if last[x] >= 0:
                    _fenwick_add(tree, p, last[x], -u)
                else:
                    total[p] += u
                if clock[p] == width:
                    last[x] = -1  # not live while the pool is renumbered
                    _compact(p, pool_first, pool_items, item_units, last, tree, clock, who)
                last[x] = clock[p]
                _fenwick_add(tree, p, clock[p], u)
                clock[p] += 1
            step_ordinal += 1
        start = stop
    return step_ordinal
