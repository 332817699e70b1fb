"""Background admission: experts queued for a transfer off the critical path because of
substitutions (docs/semantics.md, Background admission). Transfers go through the link's
background queue (simulator.engine.link), at lower priority than synchronous fetches.

One module per variant, with:

- ``make_state(params) -> State``;
- ``on_substitute(core, st, c, link, x, gate, t1)`` (kernel, jitted): missing expert x was
  substituted with weight ``gate`` in a step whose expert phase starts at ``t1``;
- ``Reference(sim)`` with ``on_substitute(x, gate, t1)``.
"""
from simulator.policies import Registry

REGISTRY = Registry("admission", __name__, ("none", "mass"))
