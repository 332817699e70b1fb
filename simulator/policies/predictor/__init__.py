"""Predictors: which experts a later layer of the same token will select (prefetch's input).

At a decode step of token row ``a`` at layer l, a predictor names up to ``top_p`` experts of layer
l + d (d = ``prefetch.distance``), best first; prefetch copies the ones not resident in the
background. One module per predictor, with:

Kernel (jitted; ``core``, ``c`` as in simulator.policies.eviction, ``ch`` the kernel's Chunk):

- ``make_state(params, layout) -> State`` (Python);
- ``predict(core, st, c, ch, a, layer, d, top_p, out) -> n``: write the flat ids
  ``x = (layer + d) * E + e`` of up to ``top_p`` predicted experts to ``out[:n]``, best first
  (layer + d < L is guaranteed by the caller);
- ``observe(core, st, c, ch, a, layer)``: the decode step of row ``a`` at ``layer`` is over (its
  selections are ``ch.experts[a, layer]``): update what the predictor remembers;
- ``NEEDS_LOOKAHEAD``: the trace must carry look-ahead routing (``meta.lookahead_depth >= d``);
- ``TRAIN_TOKENS``: the option naming how many leading tokens train it (not simulated), or None.

Reference twin ``Reference(sim)``: ``predict(chunk, a, layer, d, top_p) -> list of flat ids`` and
``observe(chunk, a, layer)``, where ``chunk`` is the TraceChunk being simulated.
"""
from simulator.policies import Registry

REGISTRY = Registry("prefetch.predictor", __name__, ("none", "lookahead"))
