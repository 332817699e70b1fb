"""Forward hooks on the routers: what every MoE layer chose in one model forward.

The hooks only keep references to the router's own outputs (on the model's device, no copy and
no host synchronisation); :meth:`RouterRecorder.collect` stacks them once per forward.

Some transformers 5.x releases overwrite ``router_logits`` with the softmax before returning it
(the ids and weights are unaffected). :func:`router_returns_probabilities` finds out with one
tiny forward; the recorder then stores the log of those probabilities, which equal the logits
up to a per-token shift (the same softmax, the same ranking).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from traces.capture.routers import RouterSite, rank_order


@dataclass
class StepRouting:
    """Routing of one forward over N token slots (padding included), L MoE layers, on device."""

    experts: torch.Tensor  # int64[N, L, k], rank order
    weights: torch.Tensor  # float32[N, L, k], as applied by the model
    logits: torch.Tensor | None  # [N, L, E] in the router's dtype, or None when not kept


class RouterRecorder:
    """Hooks every router of a model; use as a context manager around the forwards to record.

    ``keep_logits`` False drops the logits at the hook (storage ``none``). Each forward must be
    followed by :meth:`collect`, which checks that every MoE layer's hook fired exactly once.
    """

    def __init__(self, sites: list[RouterSite], keep_logits: bool = True, logits_are_probs: bool = False):
        self.sites = sites
        self.keep_logits = keep_logits
        self.logits_are_probs = logits_are_probs
        self._outputs: list[tuple | None] = [None] * len(sites)
        self._calls = [0] * len(sites)
        self._handles: list = []

    def __enter__(self) -> RouterRecorder:
        for j, site in enumerate(self.sites):
            self._handles.append(site.module.register_forward_hook(self._hook(j)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()

    def reset(self) -> None:
        self._outputs = [None] * len(self.sites)
        self._calls = [0] * len(self.sites)

    def _hook(self, j: int):
        site = self.sites[j]

        def hook(module, args, output):
            self._calls[j] += 1
            if not (isinstance(output, tuple) and len(output) == 3):
                raise TypeError(
                    f"router '{site.name}' returned {type(output).__name__}, expected "
                    "(router_logits, weights, ids); this transformers version is not supported"
                )
            logits, weights, ids = output
            E, k = site.num_experts, site.top_k
            logits = logits.detach().reshape(-1, E)
            if self.logits_are_probs:  # log-softmax: the logits up to a per-token shift
                logits = torch.log(logits.float())
            weights = weights.detach().reshape(-1, k)
            ids = ids.detach().reshape(-1, k)
            order = rank_order(site, logits, ids)
            if order is not None:
                ids = ids.gather(1, order)
                weights = weights.gather(1, order)
            self._outputs[j] = (logits if self.keep_logits else None, weights, ids)

        return hook

    def collect(self, num_slots: int) -> StepRouting:
        """Stack the routing of the forward that just ran; reset for the next one.

        ``num_slots`` is the number of token slots the forward saw (batch x length).
        """
        calls, outputs = self._calls, self._outputs
        self.reset()
        bad = [(s.layer_id, c) for s, c in zip(self.sites, calls, strict=True) if c != 1]
        if bad:
            raise RuntimeError(
                "each MoE router must fire exactly once per forward; (layer, calls): "
                + ", ".join(f"({lid}, {c})" for lid, c in bad)
            )
        for site, (_, _, ids) in zip(self.sites, outputs, strict=True):
            if ids.shape[0] != num_slots:
                raise RuntimeError(
                    f"router '{site.name}' saw {ids.shape[0]} tokens, the forward had {num_slots}"
                )
        experts = torch.stack([o[2] for o in outputs], dim=1)
        weights = torch.stack([o[1] for o in outputs], dim=1).float()
        logits = torch.stack([o[0] for o in outputs], dim=1) if self.keep_logits else None
        return StepRouting(experts=experts, weights=weights, logits=logits)


def router_returns_probabilities(model, sites: list[RouterSite]) -> bool:
    """True if the routers' first output is a softmax (non-negative rows summing to 1)."""
    if sites[0].family.score_function != "softmax":
        return False
    seen = []
    handle = sites[0].module.register_forward_hook(lambda m, a, out: seen.append(out[0].detach()))
    try:
        with torch.inference_mode():
            model(input_ids=torch.zeros(1, 2, dtype=torch.long, device=model.device), use_cache=False)
    finally:
        handle.remove()
    first = seen[0].float().reshape(-1, sites[0].num_experts)
    return bool(((first >= 0).all() & ((first.sum(-1) - 1).abs() < 1e-3).all()).item())
