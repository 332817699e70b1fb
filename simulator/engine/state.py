"""The Numba engine's named state: one container per concern, created in one place.

- :class:`Consts`: per-run constants (layout, per-layer times, scalars);
- :class:`CoreState`: the GPU cache every policy shares (residency, per-layer resident lists,
  pool bytes, step marks, selection frequencies, the clock) and the counters of
  :mod:`simulator.metrics`;
- the link and host tiers: :class:`simulator.engine.link.LinkState`;
- each policy variant's own state: its module's ``State`` (``simulator.policies``).

Kernels receive these whole (no positional lists of arrays) and take only arrays and scalars
inside them. Residents used in the current step carry ``mark[x] == stamp``; the stamp grows by
one per step and per background admission, so nothing needs clearing.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from simulator.engine.layout import Layout
from simulator.engine.params import SimParams
from simulator.jit import ix, jit
from simulator.metrics import LAYER, LAYER_SUMS, MASS_BINS, RUN, RunCount

# columns of CoreState.pools[P, 2]
BUDGET, BYTES = 0, 1
# where a resident came from (CoreState.src) and the source tag of a background transfer
DEMAND, ADMISSION, PREFETCH = 0, 1, 2
# CoreState.istate[] entries
# the step stamp; the bytes of prefill steps' synchronous fetches (counted in
# RunCount.BYTES_FETCHED after the run where no host-RAM tier counts them as they are copied:
# kernel.derived_counts)
STAMP, PREFILL_FETCH_BYTES = 0, 1
N_ISTATE = 2
# The stamp a trim passes where it can never reach a resident marked in the step (a decode step's
# trim where used residents are the last victims and every pool holds a step): marks are never
# negative, so a victim search that tests them finds none marked, and one may skip the test
# (simulator.engine.structures.list_victim: no load of the head's mark).
NO_STAMP = -1
# CoreState.fresh values: a background arrival not used yet; in the step-marks kernel
# (KernelNeeds.step_marks) one selected in the current step, which the step's trims keep
FRESH, FRESH_SELECTED = 1, 2


@jit(allocates=False, inline=True)
def step_stamp(s):
    """The stamp a trim passes where the eviction tells the residents used in step ``s`` by
    their last use (``KernelNeeds.step_marks``: every use and insertion stores its step; a
    background arrival inserted and not used in the step is ``fresh``): ``-2 - s``, below
    NO_STAMP (``s = -2 - stamp``)."""
    return -2 - s
# CoreState.fstate[] entries: the clock, the frequency increment (lfu_decay)
CLOCK, INC = 0, 1
N_FSTATE = 2


class Consts(NamedTuple):
    """Per-run constants. Times in microseconds, sizes in bytes."""

    num_experts: int
    lfu_decay: float
    token_fixed_us: float
    pool_of_layer: np.ndarray  # int32[L]
    pool_offset: np.ndarray  # int64[P]: start of a pool's segment in per-pool slot arrays
    expert_bytes: np.ndarray  # int64[L]
    layer_of: np.ndarray  # int32[X]: x // num_experts (Layout.layer_of)
    pool_expert_bytes: np.ndarray  # int64[P]: Layout.pool_expert_bytes (0: the pool's layers' sizes differ)
    nonexpert_us: np.ndarray  # float64[L]: non-expert compute plus the fixed cost of a step
    gpu_expert_us: np.ndarray  # float64[L]
    cpu_expert_us: np.ndarray  # float64[L]
    decode_gpu_us: np.ndarray  # float64[L]: k x gpu_expert_us, a decode step's experts without CPU calls


class CoreState(NamedTuple):
    """The shared GPU cache state and the counters, carried between chunks."""

    resident: np.ndarray  # int8[X]
    layer_res: np.ndarray  # int32[L, E]: residents of each layer, swap-removed (LIST_RESIDENTS)
    layer_res_n: np.ndarray  # int32[L]
    res_pos: np.ndarray  # int32[X]: position of a resident in its layer's list
    mark: np.ndarray  # int64[X]: the stamp of the step that last used or selected x
    src: np.ndarray  # int8[X]: DEMAND, ADMISSION or PREFETCH: what made the resident resident
    fresh: np.ndarray  # int8[X]: 1 while a background arrival has not been used
    freq: np.ndarray  # float64[X]: selection frequency (scaled by INC, docs/semantics.md)
    pools: np.ndarray  # int64[P, 2]: BUDGET, BYTES
    istate: np.ndarray  # int64[N_ISTATE]
    fstate: np.ndarray  # float64[N_FSTATE]
    uniq: np.ndarray  # int32[X]: scratch, a prefill step's unique experts
    scratch: np.ndarray  # int32[X]: scratch for policies (ranked substitutes, set-aside victims)
    layer_counts: np.ndarray  # int64[L, len(LAYER)]: simulator.metrics.LayerCount
    layer_sums: np.ndarray  # float64[L, len(LAYER_SUMS)]: simulator.metrics.LayerSum
    run_counts: np.ndarray  # int64[len(RUN)]: simulator.metrics.RunCount
    mass_hist: np.ndarray  # int64[MASS_BINS + 1]
    # float64[MASS_BUFFER]: masses of decode steps not yet counted in mass_hist (bin_masses)
    mass_buf: np.ndarray


# The mass histogram (800 KB) is counted in batches of this many decode steps: one increment per
# step in its own random cache line stalled the step behind it (16 % of rule015 + LRU's kernel
# time); a loop of increments keeps many of those loads in flight at once.
MASS_BUFFER = 4096


@jit(allocates=False, inline=True)
def bin_masses(mass_hist, mass_buf, n):
    """Count the first ``n`` buffered step masses into the histogram's bins."""
    bins = mass_hist.shape[0] - 1
    for i in range(n):
        mass_hist[ix(min(np.int64(mass_buf[i] * bins), bins))] += 1


def make_consts(params: SimParams, layout: Layout) -> Consts:
    def f64(a):
        return np.ascontiguousarray(a, dtype=np.float64)

    return Consts(
        num_experts=int(params.num_experts),
        lfu_decay=float(params.lfu_decay),
        token_fixed_us=float(params.token_fixed_us),
        pool_of_layer=layout.pool_of_layer,
        pool_offset=layout.pool_offset,
        expert_bytes=np.ascontiguousarray(params.expert_bytes, dtype=np.int64),
        layer_of=layout.layer_of,
        pool_expert_bytes=layout.pool_expert_bytes,
        nonexpert_us=f64(params.nonexpert_us) + float(params.step_fixed_us),
        gpu_expert_us=f64(params.gpu_expert_us),
        cpu_expert_us=f64(params.cpu_expert_us),
        decode_gpu_us=params.top_k * f64(params.gpu_expert_us),
    )


def make_core_state(params: SimParams, layout: Layout) -> CoreState:
    L, E = params.num_layers, params.num_experts
    X = L * E
    pools = np.zeros((layout.pool_budget_bytes.shape[0], 2), np.int64)
    pools[:, BUDGET] = layout.pool_budget_bytes
    fstate = np.zeros(N_FSTATE, np.float64)
    fstate[INC] = 1.0
    return CoreState(
        resident=np.zeros(X, np.int8),
        layer_res=np.zeros((L, E), np.int32),
        layer_res_n=np.zeros(L, np.int32),
        res_pos=np.zeros(X, np.int32),
        mark=np.zeros(X, np.int64),
        src=np.zeros(X, np.int8),
        fresh=np.zeros(X, np.int8),
        freq=np.zeros(X, np.float64),
        pools=pools,
        istate=np.zeros(N_ISTATE, np.int64),
        fstate=fstate,
        uniq=np.zeros(X, np.int32),
        scratch=np.zeros(X, np.int32),
        layer_counts=np.zeros((L, len(LAYER)), np.int64),
        layer_sums=np.zeros((L, len(LAYER_SUMS)), np.float64),
        run_counts=np.zeros(len(RUN), np.int64),
        mass_hist=np.zeros(MASS_BINS + 1, np.int64),
        mass_buf=np.zeros(MASS_BUFFER, np.float64),
    )


@jit(allocates=False, inline=True)
def make_resident(core, c, x, layer, p):
    """The cache bookkeeping of x becoming resident in pool p (the policy orders it apart; the
    layer's resident list apart: :func:`list_resident`)."""
    core.resident[x] = 1
    core.pools[p, BYTES] += c.expert_bytes[layer]
    core.src[x] = DEMAND
    core.fresh[x] = 0


@jit(allocates=False, inline=True)
def list_resident(core, x, layer):
    """Append resident x to its layer's resident list (kept where a substitute scans it)."""
    n = core.layer_res_n[layer]
    core.layer_res[layer, n] = x
    core.res_pos[x] = n
    core.layer_res_n[layer] = n + 1


@jit(allocates=False, inline=True)
def unlist_resident(core, x, layer):
    """Swap-remove x from its layer's resident list."""
    n = core.layer_res_n[layer] - 1
    last = core.layer_res[layer, n]
    core.layer_res[layer, core.res_pos[x]] = last
    core.res_pos[last] = core.res_pos[x]
    core.layer_res_n[layer] = n


@jit(allocates=False, inline=True)
def drop(core, c, x, p):
    """The cache bookkeeping of evicting x (already out of its policy's order structure and
    its layer's resident list)."""
    layer = ix(c.layer_of[x])
    core.resident[x] = 0
    core.pools[p, BYTES] -= c.expert_bytes[layer]  # evictions are counted by derived_counts
    if core.fresh[x]:  # a background arrival evicted before any use
        core.fresh[x] = 0
        wasted_background(core.run_counts, core.src[x], c.expert_bytes[layer])


@jit(allocates=False, inline=True)
def wasted_background(run_counts, source, size):
    """Count the copied bytes of a background transfer that served no use."""
    if source == ADMISSION:
        run_counts[RunCount.WASTED_ADMISSIONS] += 1
        run_counts[RunCount.WASTED_ADMISSION_BYTES] += size
    else:
        run_counts[RunCount.WASTED_PREFETCH_BYTES] += size


@jit(allocates=False, inline=True)
def used(core, x):
    """A hit or substitute use of resident x: a prefetched arrival's first use makes it useful."""
    if core.fresh[x]:
        core.fresh[x] = 0
        if core.src[x] == PREFETCH:
            core.run_counts[RunCount.USEFUL_PREFETCHES] += 1


@jit(allocates=False, inline=True)
def over_budget(core, p):
    return core.pools[p, BYTES] > core.pools[p, BUDGET]


def kernel_array(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as a C-contiguous, writable array of ``dtype`` (copied only if it is not one).

    Numba compiles a separate specialisation for read-only arrays (a memory map, an Arrow
    buffer); a copy of one chunk costs far less than compiling the kernel again.
    """
    a = np.ascontiguousarray(a, dtype=dtype)
    return a if a.flags.writeable else a.copy()
