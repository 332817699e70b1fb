"""Forward hooks on the routers: what every MoE layer chose in one model forward.

The hooks only keep references to the router's own outputs (on the model's device, no copy and
no host synchronisation); :meth:`RouterRecorder.take` hands them on per forward, and
:meth:`StepRouting.stacked` stacks those of one or more forwards at once.

*Look-ahead routing* (optional): at MoE layer l the recorder also runs the routers of MoE layers
l+1 .. l+D on a hidden state of layer l, through each router's own ``forward`` (the very
computation the model runs at layer l+d, hooks bypassed). Which hidden state (``source``):

- ``moe_input`` (the "stale gate"): the input of layer l's MoE block, which is what layer l's
  router receives: the residual stream after layer l's attention, through layer l's
  post-attention RMSNorm. Defined for every supported architecture.
- ``layer_output``: the output of decoder layer l (the residual stream after its MoE block: the
  input of the next decoder layer, before that layer's norm and attention), through layer
  l+d's own post-attention RMSNorm, the normalisation its router was trained behind. Defined
  for the architectures whose decoder layers have a ``post_attention_layernorm`` (all seven
  supported ones do).

Some transformers 5.x releases overwrite ``router_logits`` with the softmax before returning it
(the ids and weights are unaffected). :func:`router_returns_probabilities` finds out with one
tiny forward; the recorder then stores the log of those probabilities, which equal the logits
up to a per-token shift (the same softmax, the same ranking).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from traces.capture.routers import RouterSite, rank_order
from traces.errors import InputError

LOOKAHEAD_SOURCES = ("moe_input", "layer_output")


@dataclass
class RawStep:
    """What the hooks kept in one forward over N token slots, on the device and not yet stacked:
    per MoE layer (logits or None, weights, ids), each [N, ...], and the look-ahead [N, D, E]
    per layer (None without look-ahead)."""

    outputs: list[tuple]
    ahead: list[torch.Tensor] | None
    num_slots: int

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (those not None)."""
        return [t for o in self.outputs for t in o if t is not None] + list(self.ahead or [])

    def nbytes(self) -> int:
        """Device bytes these tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors())


def stack_layers(parts: list[list[torch.Tensor]]) -> torch.Tensor:
    """[sum of N_i, L, ...] from ``parts[i][l]`` [N_i, ...] (forward i, layer l): each forward's
    layers stacked on axis 1, the forwards one after the other. Consecutive forwards of equal
    shape take one stack and one copy together, however many they are."""
    runs: list[list[list[torch.Tensor]]] = []
    for p in parts:
        if runs and runs[-1][0][0].shape == p[0].shape:
            runs[-1].append(p)
        else:
            runs.append([p])
    out = []
    for run in runs:
        if len(run) == 1:
            out.append(torch.stack(run[0], dim=1))
            continue
        flat = torch.stack([t for p in run for t in p])  # [K * L, N, ...]
        k, layers, n = len(run), len(run[0]), flat.shape[1]
        out.append(flat.view(k, layers, *flat.shape[1:]).transpose(1, 2).reshape(k * n, layers, *flat.shape[2:]))
    return out[0] if len(out) == 1 else torch.cat(out)


@dataclass
class StepRouting:
    """Routing of one forward over N token slots (padding included), L MoE layers, on device."""

    experts: torch.Tensor  # int64[N, L, k], rank order
    weights: torch.Tensor  # float32[N, L, k], as applied by the model (the router's dtype: see stacked)
    logits: torch.Tensor | None  # [N, L, E] in the router's dtype, or None when not kept
    lookahead: torch.Tensor | None = None  # float32[N, L, D, E]: routers of l+1..l+D at l; -inf: none

    @classmethod
    def stacked(cls, steps: list[RawStep], float_weights: bool = True) -> StepRouting:
        """The routing of one or more forwards (:meth:`RouterRecorder.take`), token slots one
        after the other: every forward's layers stacked, in a few device copies for all of them
        (one stack per run of forwards of equal size), not a few per forward. ``float_weights``
        False: the weights stay in the router's dtype (:meth:`with_float_weights` casts them)."""
        def join(field: int) -> torch.Tensor | None:
            if steps[0].outputs[0][field] is None:
                return None
            return stack_layers([[o[field] for o in s.outputs] for s in steps])

        ahead = None
        if steps[0].ahead is not None:
            ahead = stack_layers([s.ahead for s in steps])
        weights = join(1)
        return cls(experts=join(2), weights=weights.float() if float_weights else weights, logits=join(0),
                   lookahead=ahead)

    def with_float_weights(self) -> StepRouting:
        """This routing with float32 weights (itself where they are)."""
        if self.weights.dtype == torch.float32:
            return self
        return StepRouting(self.experts, self.weights.float(), self.logits, self.lookahead)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held (those not None)."""
        return [t for t in (self.experts, self.weights, self.logits, self.lookahead) if t is not None]


@dataclass(frozen=True)
class Lookahead:
    """What look-ahead routing to record: ``depth`` D layers ahead, from the hidden state ``source``."""

    depth: int
    source: str = "moe_input"


class RouterRecorder:
    """Hooks every router of a model; use as a context manager around the forwards to record.

    ``keep_logits`` False drops the logits at the hook (storage ``none``); ``lookahead`` adds the
    look-ahead routing (module docstring). Each forward must be followed by :meth:`take` (or :meth:`collect`),
    which checks that every MoE layer's hooks fired exactly once.
    """

    def __init__(self, sites: list[RouterSite], keep_logits: bool = True, logits_are_probs: bool = False,
                 lookahead: Lookahead | None = None):
        self.sites = sites
        self.keep_logits = keep_logits
        self.logits_are_probs = logits_are_probs
        self.lookahead = lookahead if lookahead and lookahead.depth else None
        self._norms = _lookahead_norms(sites, self.lookahead)
        self._outputs: list[tuple | None] = [None] * len(sites)
        self._ahead: list[torch.Tensor | None] = [None] * len(sites)
        self._calls = [0] * len(sites)
        self._handles: list = []

    def __enter__(self) -> RouterRecorder:
        for j, site in enumerate(self.sites):
            self._handles.append(site.module.register_forward_hook(self._hook(j)))
            if self._norms:
                self._handles.append(site.decoder_layer.register_forward_hook(self._layer_output_hook(j)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()
        self.reset()

    def reset(self) -> None:
        self._outputs = [None] * len(self.sites)
        self._ahead = [None] * len(self.sites)
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
            if logits.requires_grad:  # outside inference mode: keep no graph alive
                logits, weights, ids = logits.detach(), weights.detach(), ids.detach()
            # at batch 1 every tensor op here is host time the forward waits for: reshape only when needed
            if logits.dim() != 2:
                logits = logits.reshape(-1, site.num_experts)
            if weights.dim() != 2:
                weights = weights.reshape(-1, site.top_k)
            if ids.dim() != 2:
                ids = ids.reshape(-1, site.top_k)
            logits = self._as_logits(logits)
            if self.lookahead and self.lookahead.source == "moe_input":
                self._ahead[j] = self._routers_ahead(j, args[0])
            order = rank_order(site, logits, ids)
            if order is not None:
                ids = ids.gather(1, order)
                weights = weights.gather(1, order)
            self._outputs[j] = (logits if self.keep_logits else None, weights, ids)

        return hook

    def _layer_output_hook(self, j: int):
        def hook(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            self._ahead[j] = self._routers_ahead(j, hidden)

        return hook

    def _as_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Router output -> logits; log-softmax when the router returned probabilities (same ranking)."""
        return torch.log(logits.float()) if self.logits_are_probs else logits

    def _routers_ahead(self, j: int, hidden: torch.Tensor) -> torch.Tensor:
        """float32[N, D, E]: the routers of MoE layers j+1 .. j+D on ``hidden``; -inf past the last layer."""
        hidden = hidden.detach().reshape(-1, hidden.shape[-1])
        depth, n = self.lookahead.depth, hidden.shape[0]
        ahead = torch.full((n, depth, self.sites[j].num_experts), float("-inf"), device=hidden.device)
        for d in range(1, min(depth, len(self.sites) - 1 - j) + 1):
            x = self._norms[j + d](hidden) if self._norms else hidden
            logits = self.sites[j + d].module.forward(x)[0]  # .forward: the recording hooks stay out
            ahead[:, d - 1] = self._as_logits(logits.detach().reshape(n, -1))
        return ahead

    def take(self, num_slots: int) -> RawStep:
        """What the hooks kept in the forward that just ran, not yet stacked (cheap: no device
        work); reset for the next one. :meth:`StepRouting.stacked` stacks one or more of them.

        ``num_slots`` is the number of token slots the forward saw (batch x length).
        """
        calls, outputs, ahead = self._calls, self._outputs, self._ahead
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
        if self.lookahead:
            missing = [self.sites[j].layer_id for j, a in enumerate(ahead) if a is None]
            if missing:
                raise RuntimeError(f"no look-ahead recorded at MoE layers {missing} in this forward")
        return RawStep(outputs=outputs, ahead=ahead if self.lookahead else None, num_slots=num_slots)

    def collect(self, num_slots: int) -> StepRouting:
        """The routing of the forward that just ran, stacked (:meth:`take`, then
        :meth:`StepRouting.stacked`); reset for the next one."""
        return StepRouting.stacked([self.take(num_slots)])


def check_lookahead_source(source: str) -> None:
    """Raise InputError unless ``source`` names a hidden state the recorder knows."""
    if source not in LOOKAHEAD_SOURCES:
        raise InputError(f"lookahead.source={source} is not valid; choose one of: {', '.join(LOOKAHEAD_SOURCES)}")


def _lookahead_norms(sites: list[RouterSite], lookahead: Lookahead | None) -> list | None:
    """Per MoE layer the norm that ``layer_output`` look-ahead puts before the router, or None."""
    if lookahead is None:
        return None
    check_lookahead_source(lookahead.source)
    if lookahead.source == "moe_input":
        return None
    norms = [getattr(s.decoder_layer, "post_attention_layernorm", None) for s in sites]
    lacking = [s.name for s, n in zip(sites, norms, strict=True) if n is None]
    if lacking:
        raise InputError(f"lookahead.source=layer_output needs a post_attention_layernorm in the decoder "
                         f"layer of '{lacking[0]}'; use lookahead.source=moe_input")
    return norms


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
