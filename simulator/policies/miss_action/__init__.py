"""Miss action: what happens to a miss the miss rule does not fetch.

One module per action, with:

- ``make_state(params) -> State``;
- ``serve(st, rank, gate) -> outcome`` (kernel, jitted; a constant for today's actions, so the
  compiler removes the other branches): ``SUBSTITUTE`` (a resident runs in its place, chosen by
  the ``substitute`` family; with none eligible the miss is a forced fetch) or ``CPU`` (the
  expert runs on the CPU);
- ``USES_SUBSTITUTES``: whether the substitute choice and admission matter at all;
- ``Reference(sim)`` with ``serve(rank, gate)``.
"""
from simulator.policies import Registry

REGISTRY = Registry("policy.miss_action", __name__, ("substitute", "cpu"))
