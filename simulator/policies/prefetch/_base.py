"""The state every prefetch policy shares."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np


@dataclass(frozen=True)
class Options:
    distance: int = field(default=1, metadata={
        "help": "prefetch: predict the layer this many layers ahead of the current one, >= 1",
        "min": 1})
    top_p: int = field(default=0, metadata={
        "help": "prefetch: experts predicted per step (0: the model's top-k)", "min": 0})
    max_inflight_bytes: int = field(default=-1, metadata={
        "help": "prefetch: bytes of prefetches queued or in flight at most; -1 = no cap", "min": -1})
    cancel_stale: bool = field(default=True, metadata={
        "help": "prefetch: drop a prefetch not yet started once its target step has passed"})


class State(NamedTuple):
    distance: int
    top_p: int  # 0: prefetch is off
    max_inflight_bytes: int  # -1: no cap
    buf: np.ndarray  # int32[E]: the predictor's experts of one step, best first


def state(params, active: bool) -> State:
    """The prefetch state of ``params`` (options as in :class:`Options`); inactive: top_p 0."""
    top_p = int(params.options.get("top_p", 0)) or params.top_k
    return State(int(params.options.get("distance", 1)), top_p if active else 0,
                 int(params.options.get("max_inflight_bytes", -1)),
                 np.zeros(params.num_experts, np.int32))
