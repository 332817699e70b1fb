"""Miss rule: which misses are fetched synchronously; the others get the miss action.

One module per rule, with:

- ``make_state(params) -> State``: the rule's parameters as numbers;
- ``fetch(rule, rank, gate) -> bool`` (kernel, jitted): fetch a miss at ``rank`` with
  normalised gate weight ``gate``;
- ``can_leave_misses(rule, top_k) -> bool``: whether the rule ever leaves a miss unfetched;
- ``Reference(sim)`` with ``fetch(rank, gate)``.
"""
from simulator.policies import Registry

REGISTRY = Registry("policy.miss_rule", __name__, ("threshold",))
