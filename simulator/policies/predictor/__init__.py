"""Predictors: which experts a later layer of the same token will select (prefetch's input).

At a decode step of token row ``a`` at layer l, a predictor names up to ``top_p`` experts of layer
l + d (d = ``prefetch.distance``), best first; prefetch copies the ones not resident in the
background. ``moe-trace predict`` scores every predictor on a trace (analysis/predict.py). One
module per predictor, with:

Kernel (jitted; ``core``, ``c`` as in simulator.policies.eviction, ``ch`` the kernel's Chunk):

- ``make_state(params, layout) -> State`` (Python);
- ``predict(core, st, c, ch, a, layer, d, top_p, out) -> n``: write the flat ids
  ``x = (layer + d) * E + e`` of up to ``top_p`` distinct predicted experts to ``out[:n]``, best
  first, so that a smaller ``top_p`` names a prefix of a larger one's (layer + d < L and
  ``top_p >= 1`` are guaranteed by the caller). It may read the selections of layers <= l of row
  ``a`` and anything of earlier rows, never what row ``a`` selects at layer l + d;
- ``observe(core, st, c, ch, a, layer)``: the decode step of row ``a`` at ``layer`` is over (its
  selections are ``ch.experts[a, layer]``): update what the predictor remembers;
- ``NEEDS_LOOKAHEAD``: the trace must carry look-ahead routing (``meta.lookahead_depth >= d``);
- ``TRAIN_TOKENS``: the option naming how many leading tokens train it (not simulated), or None;
  such a predictor also has ``train(st, experts, max_distance) -> State`` (Python): the state
  learned from ``experts`` (int[N, L, k], the selections of the trace's first N tokens, every
  phase) for distances 1 .. ``max_distance``.

Selection frequencies (``core.freq``) advance at the start of each step, as the engines do
(docs/semantics.md), so at layer l they include the current token's layers <= l.

Reference twin ``Reference(sim)``: ``predict(chunk, a, layer, d, top_p) -> list of flat ids`` and
``observe(chunk, a, layer)``, where ``chunk`` is the TraceChunk being simulated, and ``train(experts,
max_distance)`` where the module has one.
"""
from simulator.policies import Registry

REGISTRY = Registry("prefetch.predictor", __name__,
                    ("none", "lookahead", "previous", "frequency", "coactivation"))
