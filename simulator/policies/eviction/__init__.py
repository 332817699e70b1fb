"""Eviction: which resident leaves a pool that is over its budget (docs/semantics.md, Cache).

A pool is trimmed at the end of every step (and after a background admission): victims come
first from residents not used in the step, in the policy's order; only if those run out are used
ones evicted, again in policy order. One module per policy, with these hooks:

Kernel (jitted; ``core``: :class:`simulator.engine.state.CoreState`, ``st``: the module's own
``State``, ``c``: :class:`simulator.engine.state.Consts`, x a flat expert id, p its pool, s the
step ordinal):

- ``make_state(params, layout, first_use=None) -> State`` (Python; ``first_use``: each expert's
  first selection's group, for an eviction that reads the future)
- ``on_insert(core, st, c, x, p, s)``: x became resident (an insertion is a use)
- ``on_use(core, st, c, x, p, s)``: a hit or a substitute's use of resident x. Where a decode
  step has no background arrival and no variant reads its selections before its lookups (no
  ``on_select``), the kernel counts and marks each selection as its lookup comes: in these
  two hooks, only x's own frequency and mark are the step's (``simulator.policies.kernel_needs``)
- ``on_select(core, st, c, chunk, t, layer, i, x, p, s)``: the router selected x (token t,
  rank i), after its frequency rose
- ``on_group(core, st, c, ch, a, b)``: the group of chunk rows ``a..b-1`` starts
- ``on_rescale(core, st, c)``: every frequency was divided by the increment (``lfu_decay``)
- ``victim(core, st, c, p, stamp) -> x``: remove pool p's next victim from the policy's order
  and return it, residents marked ``stamp`` (used in the step) last; the engine then drops it
  (:func:`simulator.engine.state.drop`) and asks again while the pool is over budget
- ``end_trim(core, st, c, p)``: the trim of pool p is over (restore what a victim search set
  aside)

Optional flags: ``STEP_USES_LAST`` (a used resident becomes the last victim, as in LRU: where
every pool holds a step, a trim never reaches one and is passed
:data:`simulator.engine.state.NO_STAMP`); ``MARKS_BY_LAST_USE`` (``on_use`` and ``on_insert``
store the step and nothing else: the kernel marks no lookup and passes a negative stamp below
NO_STAMP, :func:`simulator.engine.state.step_stamp`, and the victim search tells used residents
by their last use, less those whose ``core.fresh`` is ``state.FRESH``: background arrivals not
selected in the step and not used. Before a step's first background arrival the kernel calls
``on_use`` for each of the step's selections, resident or not, so that the arrival's trim keeps
them; a later insertion stores its own step).

Optional ``kernel_hooks(params, layout, needs, num_tokens, first_use=None) -> (module, state) |
None``: another module with the same kernel hooks and the same victims, and its state, for the
runs where it is faster (``num_tokens``: a bound on the run's tokens where the source knows it,
else None; ``first_use``: as ``make_state``'s); the kernel is then compiled with that module in
place of the variant's own (lru's, lfu's and belady's packed keys for small per-layer pools:
``_lru_scan``, ``_lfu_scan``, ``_belady_scan``). The reference twin stays the one.
Optional ``on_fresh(core, st, c, x, p)``: x, a background arrival its own trim kept, is left
``state.FRESH`` (not used in the step: a later trim of the step may evict it); the kernel calls it
right after, for a structure that tells a step's used residents by their keys.

Reference twin ``Reference(sim)`` (plain Python, ``sim`` the reference engine): ``on_insert(x,
step)``, ``on_use(x, step)``, ``on_select(x, layer, step, token, next_group)`` (``token``: the
token's index in its group), ``on_group(num_tokens)``,
``on_rescale()``, ``on_evict(x)`` and ``victim(p, pinned) -> x``.
"""
from simulator.policies import Registry

REGISTRY = Registry("cache.eviction", __name__,
                    ("lru", "fifo", "lfu", "random", "belady", "window_lfu", "lru2"))
