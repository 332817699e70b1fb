"""topp: queue the predicted experts that are neither resident nor queued or in flight, best
first, while the bytes of prefetches queued or in flight stay within ``max_inflight_bytes``."""
from __future__ import annotations

from simulator.engine.link import PREFETCH_BYTES, enqueue
from simulator.engine.state import PREFETCH
from simulator.jit import jit
from simulator.policies.prefetch._base import Options, state

__all__ = ["Options"]


def make_state(params):
    return state(params, active=True)


@jit(allocates=False, inline=True)
def issue(core, st, c, link, n, t1, step):
    for j in range(n):
        x = st.buf[j]
        if core.resident[x] or link.pending[x]:
            continue
        size = c.expert_bytes[x // c.num_experts]
        if 0 <= st.max_inflight_bytes < link.qstate[PREFETCH_BYTES] + size:
            return
        enqueue(core.run_counts, link, x, t1, PREFETCH, step + st.distance)


class Reference:
    def __init__(self, sim):
        self.sim = sim
        s = make_state(sim.params)
        self.distance, self.max_inflight_bytes = s.distance, s.max_inflight_bytes

    def issue(self, xs, t1, step):
        link = self.sim.link
        for x in xs:
            if self.sim.resident[x] or x in link.pending:
                continue
            size = self.sim.expert_size(x)
            if 0 <= self.max_inflight_bytes < link.prefetch_bytes + size:
                return
            link.enqueue(x, t1, PREFETCH, step + self.distance)
