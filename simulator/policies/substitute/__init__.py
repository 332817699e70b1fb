"""Substitute choice: which resident runs in place of a missing expert.

The candidates are the layer's residents that are not selected in the step and not already
used as a substitute in it; the variant scores them, the best score wins, ties by the lower id.
One module per variant, with:

- ``make_state(params) -> State``;
- ``choose(core, st, c, chunk, a, layer, want, stamp, n_cand, next_cand)`` (kernel, jitted) ->
  ``(x, n_cand, next_cand)``: the next substitute of token row ``a``'s step at ``layer`` (-1 if
  none is eligible). ``want`` bounds how many the step can still need; the kernel starts every
  step with ``n_cand = -1, next_cand = 0`` and passes back what it got, so a variant may rank
  the step's candidates once (residents used by the step carry ``core.mark == stamp``);
- ``NEEDS_LOGITS``: whether the trace must carry router logits;
- ``READS_SELECTION_MARKS``: whether ``choose`` relies on every selection of the step being
  marked before the step's lookups (else it must not meet a selected expert, or mark them);
  default True;
- ``SCANS_LAYER_RESIDENTS``: whether it reads the layers' resident lists (``core.layer_res``);
  default True;
- ``Reference(sim)`` with ``choose(layer, selected, substituted, logits) -> x or -1``.
"""
from simulator.policies import Registry

REGISTRY = Registry("policy.substitute_by", __name__, ("logit", "frequency"))
