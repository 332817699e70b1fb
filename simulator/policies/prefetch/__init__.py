"""Prefetch: background transfers of experts a predictor expects a later layer to select.

After every decode step of token row ``a`` at layer l (with l + distance < L), the engine asks
the chosen predictor (simulator.policies.predictor) for up to ``top_p`` experts of layer
l + distance into the state's ``buf`` and hands them to the prefetch policy, which queues
background transfers (the link's queue, below synchronous fetches, source PREFETCH, enqueue time
the step's t1, stale once the target step has passed: ``prefetch.cancel_stale``). One module per
policy, sharing one state layout (:class:`simulator.policies.prefetch._base.State`):

- ``make_state(params) -> State``;
- ``issue(core, st, c, link, n, t1, step)`` (kernel, jitted): the predictor wrote ``n`` experts
  to ``st.buf``;
- ``Reference(sim)`` with ``issue(xs, t1, step)``.
"""
from simulator.policies import Registry

REGISTRY = Registry("prefetch.policy", __name__, ("none", "topp"))
