"""Synthetic router traces: a parametric model, and a model fitted to a real trace.

Both generators draw the k experts of a token-layer one by one without replacement from a
distribution p over the layer's experts, which is exactly the top-k of ``log p + Gumbel noise``;
router logits are built from those perturbed scores (the unselected experts' scores drawn from
their Gumbel law truncated below the k-th), so the top-k of the logits are the selected experts
in rank order. Logits are rounded to float16, as stored, then kept strictly ordered; gate
weights are the softmax of the top-k logits (a renormalised routing softmax). ``--logits top:R``
keeps only the R highest logits (the rest read as ``-inf``), ``none`` stores none.

**The parametric model** (:class:`SynthSpec`, ``moe-trace synth`` with shape options), per
MoE layer:

- **Popularity** is Zipf-like over a random order of the experts; the exponent rises linearly
  from ``skew_first`` (first layer, flatter) to ``skew_last`` (last layer).
- **Domains** (topics): every sequence has one; a domain adds Gaussian offsets of standard
  deviation ``domain_shift`` to the log-popularity, so a topic switch changes the hot experts.
- **Temporal reuse**: a sequence passes through windows of ``reuse_tokens`` tokens (offset per
  layer, so layers do not switch together); each window has a working set of ``working_set``
  experts drawn from the popularity, and a pick comes from the working set with probability
  ``reuse``. Nearby tokens therefore re-pick each other's experts. p is that mixture.
- **Logits** are the perturbed scores times ``logit_scale``.
- **Sequences** have geometric lengths (mean ``seq_tokens``); a share ``prompt_share`` of them
  opens with a prefill prompt (geometric, mean ``prompt_tokens``), the rest of a sequence decodes.

**The fitted model** (:class:`RoutingFit`, estimated from a real trace by traces/fit.py,
``moe-trace synth --like`` / ``--preset``; docs/SYNTH.md): every layer keeps the LRU stack of
its experts (most recently selected first), and at every token

    p(x) ~ popularity(x | domain) * favourite(x | token type) * recency(stack position of x)

- the popularity is a fitted rank-frequency curve over an order of the experts, times
  per-domain log-normal factors (offsets to the log popularity of fitted std ``domain_shift``);
- a token's type (one of ``token_types``, uniform, independent between tokens) is shared by all
  its layers and gives its ``top_k`` favourite experts of every layer the factor
  ``e^type_boost``: the co-activation across layers (real routing follows the token at every
  layer, so layer l - 2 predicts layer l about as well as layer l - 1 does);
- the recency weight is a fitted step function of the stack position, with one weight for
  experts not selected yet, separately for prefill and decode tokens;
- the k experts drawn are ranked by ``rank_weight * log(popularity * recency) + Gumbel``;
- gates follow fitted per-rank distributions of the logit gaps ``log g_r - log g_(r+1)``, and
  unselected logits continue below the k-th at a fitted scale (``tail_scale``);
- the sequence layout (prompt and decode lengths, domains) repeats the real trace's sequences.

Tokens are generated in blocks of ``BLOCK_TOKENS`` from per-block random streams and hashed
uniforms, so a trace depends only on its options (not on how it is written), and a block with or
without logits selects the same experts with the same gates. Memory is bounded by a block (the
fitted model's stacks carry over); the first N tokens of a longer fitted trace are the N-token
trace.
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
from tqdm import tqdm

from simulator.jit import jit
from traces.errors import InputError
from traces.format import (
    PHASE_DECODE,
    PHASE_PREFILL,
    TraceChunk,
    TraceMeta,
    TraceWriter,
    make_chunk,
)

BLOCK_TOKENS = 1024
QWEN3_NEXT_EXPERT_BYTES = 2048 * 512 * 3 * 2  # hidden x moe_intermediate x (gate, up, down) x bf16
PRESETS_DIR = Path(__file__).parent / "synth_presets"
LOGITS_HELP = "router logits to store: 'full' (all E), 'top:R' (the R highest) or 'none'"


def _opt(default, help: str, **check):
    return field(default=default, metadata={"help": help, **check})


def logits_option(value: str, top_k: int, num_experts: int) -> tuple[bool, int]:
    """``--logits`` -> (has_logits, logits_top_r): full (True, 0), top:R (True, R), none (False, 0)."""
    if value in ("full", "none"):
        return value == "full", 0
    head, _, count = value.partition(":")
    if head == "top" and count.isdigit() and top_k <= int(count) <= num_experts:
        r = int(count)
        return True, 0 if r == num_experts else r
    raise InputError(f"synth option 'logits' (--logits) is {value!r}; it must be full, none or "
                     f"top:R with top_k {top_k} <= R <= experts {num_experts}")


def logits_name(has_logits: bool, top_r: int) -> str:
    """The ``--logits`` value of a trace with this metadata (the inverse of logits_option)."""
    return "none" if not has_logits else f"top:{top_r}" if top_r else "full"


@dataclass(frozen=True)
class SynthSpec:
    """Every option of a synthetic trace; the trace is a function of these alone."""

    tokens: int = field(metadata={"help": "tokens in the trace", "min": 1})
    layers: int = field(metadata={"help": "MoE layers", "min": 1})
    experts: int = field(metadata={"help": "routed experts per layer", "min": 1, "max": 32767})
    top_k: int = field(metadata={"help": "experts selected per token and layer", "min": 1})
    seed: int = field(metadata={"help": "random seed (same seed, same trace)", "min": 0})
    logits: str = _opt("full", LOGITS_HELP)
    domains: int = _opt(4, "topics; each sequence has one, a topic shifts expert popularity", min=1)
    seq_tokens: int = _opt(512, "mean tokens per sequence (geometric)", min=1)
    prompt_share: float = _opt(0.5, "share of sequences that open with a prefill prompt", min=0, max=1)
    prompt_tokens: int = _opt(128, "mean prompt length in tokens (geometric)", min=1)
    skew_first: float = _opt(0.5, "Zipf exponent of expert popularity at the first layer", min=0)
    skew_last: float = _opt(1.0, "Zipf exponent of expert popularity at the last layer", min=0)
    domain_shift: float = _opt(0.8, "std of a topic's offsets to log-popularity", min=0)
    reuse: float = _opt(0.7, "probability that a pick comes from the recent working set",
                        min=0, below=1)
    reuse_tokens: int = _opt(16, "tokens a working set lasts", min=1)
    working_set: int = _opt(0, "experts in a working set (0: 2 * top_k)", min=0)
    logit_scale: float = _opt(0.35, "router logit = scale * perturbed log-probability", above=0)
    expert_bytes: int = _opt(QWEN3_NEXT_EXPERT_BYTES, "bytes of one expert (default: Qwen3-Next bf16)",
                             min=1)
    model: str = _opt("synthetic", "model name recorded in the metadata")

    def check(self) -> None:
        """Raise InputError naming the first option out of range."""
        for f in fields(self):
            value, rules = getattr(self, f.name), f.metadata
            flag = "--" + f.name.replace("_", "-")
            broken = (
                ("min" in rules and value < rules["min"], f">= {rules.get('min')}"),
                ("max" in rules and value > rules["max"], f"<= {rules.get('max')}"),
                ("below" in rules and value >= rules["below"], f"< {rules.get('below')}"),
                ("above" in rules and value <= rules["above"], f"> {rules.get('above')}"),
            )
            for failed, rule in broken:
                if failed:
                    raise InputError(f"synth option '{f.name}' ({flag}) is {value!r}; it must be {rule}")
        if self.top_k > self.experts:
            raise InputError(f"synth option 'top_k' (--top-k) is {self.top_k}; it must be <= experts "
                             f"({self.experts})")
        logits_option(self.logits, self.top_k, self.experts)

    @property
    def working_set_size(self) -> int:
        return self.working_set or 2 * self.top_k


def synth_meta(spec: SynthSpec) -> TraceMeta:
    """The metadata of the trace ``spec`` describes."""
    has_logits, top_r = logits_option(spec.logits, spec.top_k, spec.experts)
    return TraceMeta(
        model=spec.model,
        num_layers=spec.layers,
        num_experts=spec.experts,
        top_k=spec.top_k,
        expert_bytes=[spec.expert_bytes] * spec.layers,
        has_logits=has_logits,
        logits_top_r=top_r,
        layer_ids=list(range(spec.layers)),
        domains=[f"topic{d}" for d in range(spec.domains)],
        source="synth",
        extra={"synth": asdict(spec)},
    )


def checked_spec(**options) -> SynthSpec:
    """A SynthSpec from keyword options, checked (InputError names a bad option)."""
    spec = SynthSpec(**options)
    spec.check()
    return spec


def synth_trace(tokens: int, layers: int, experts: int, top_k: int, seed: int,
                logits: str = "full", **options) -> tuple[TraceMeta, TraceChunk]:
    """A synthetic trace in memory: (meta, one chunk). ``options``: the other SynthSpec fields."""
    spec = checked_spec(tokens=tokens, layers=layers, experts=experts, top_k=top_k, seed=seed,
                        logits=logits, **options)
    return _in_memory(synth_meta(spec), synth_blocks(spec))


def write_synth_trace(path: str | os.PathLike, tokens: int, layers: int, experts: int, top_k: int,
                      seed: int, logits: str = "full", progress: bool = False, **options) -> TraceMeta:
    """Generate and write a synthetic trace block by block (bounded memory); returns its meta."""
    spec = checked_spec(tokens=tokens, layers=layers, experts=experts, top_k=top_k, seed=seed,
                        logits=logits, **options)
    return _write(path, synth_meta(spec), synth_blocks(spec), tokens, progress)


def _in_memory(meta: TraceMeta, blocks: Iterator[dict[str, np.ndarray]]) -> tuple[TraceMeta, TraceChunk]:
    blocks = list(blocks)
    return meta, make_chunk(meta, **{name: np.concatenate([b[name] for b in blocks]) for name in blocks[0]})


def _write(path: str | os.PathLike, meta: TraceMeta, blocks: Iterator[dict[str, np.ndarray]],
           tokens: int, progress: bool) -> TraceMeta:
    with TraceWriter(path, meta) as writer, tqdm(total=tokens, unit="tok", desc="synth",
                                                 disable=not progress) as bar:
        for block in blocks:
            writer.write(**block)
            bar.update(block["seq"].shape[0])
    return meta


def synth_blocks(spec: SynthSpec) -> Iterator[dict[str, np.ndarray]]:
    """Token arrays (the TraceWriter.write keywords) for consecutive blocks of BLOCK_TOKENS."""
    model = _Model(spec)
    for block, t0 in enumerate(range(0, spec.tokens, BLOCK_TOKENS)):
        yield model.block(block, np.arange(t0, min(t0 + BLOCK_TOKENS, spec.tokens)))


class _Model:
    """The fixed part of the parametric model: popularity, sequences, window offsets."""

    def __init__(self, spec: SynthSpec):
        self.spec = spec
        self.has_logits, self.top_r = logits_option(spec.logits, spec.top_k, spec.experts)
        num_layers, num_experts, num_domains = spec.layers, spec.experts, spec.domains
        rng = _rng(spec.seed, 2)
        depth = np.linspace(0.0, 1.0, num_layers) if num_layers > 1 else np.zeros(1)
        skew = spec.skew_first + (spec.skew_last - spec.skew_first) * depth
        rank_of = np.argsort(rng.random((num_layers, num_experts)), axis=1)  # random expert order
        log_pop = -skew[:, None, None] * np.log1p(rank_of)[:, None, :]
        log_pop = log_pop + spec.domain_shift * rng.standard_normal((num_layers, num_domains, num_experts))
        pop = np.exp(log_pop - log_pop.max(axis=-1, keepdims=True))
        self.pop = (pop / pop.sum(axis=-1, keepdims=True)).reshape(num_layers * num_domains, num_experts)
        # inverse CDF over all (layer, domain) rows at once: row r owns values in (r, r + 1]
        cum = np.cumsum(self.pop, axis=1)
        cum[:, -1] = 1.0
        self.cum = (cum + np.arange(num_layers * num_domains)[:, None]).reshape(-1)
        self.window_offset = rng.integers(0, spec.reuse_tokens, num_layers)
        self.hash_key = _hash_key(spec.seed)
        self._sequences(rng)

    def _sequences(self, rng: np.random.Generator) -> None:
        spec = self.spec
        lengths: list[np.ndarray] = []
        covered = 0
        while covered < spec.tokens:
            more = rng.geometric(1.0 / spec.seq_tokens, size=max(16, spec.tokens // spec.seq_tokens))
            lengths.append(more)
            covered += int(more.sum())
        lengths_all = np.concatenate(lengths)
        count = lengths_all.shape[0]
        prompt = np.minimum(rng.geometric(1.0 / spec.prompt_tokens, size=count), lengths_all - 1)
        self.prompt = np.where(rng.random(count) < spec.prompt_share, prompt, 0)
        self.seq_start = np.concatenate([[0], np.cumsum(lengths_all)])
        self.seq_domain = rng.integers(0, spec.domains, count)

    def inverse_cdf(self, row: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Expert drawn with probability pop[row] for uniforms u in [0, 1)."""
        flat = np.searchsorted(self.cum, row + u, side="right")
        return np.minimum(flat - row * self.spec.experts, self.spec.experts - 1)

    def block(self, block: int, tokens: np.ndarray) -> dict[str, np.ndarray]:
        spec = self.spec
        num_layers, num_domains = spec.layers, spec.domains
        b = tokens.shape[0]
        seq = np.searchsorted(self.seq_start, tokens, side="right") - 1
        pos = tokens - self.seq_start[seq]
        phase = np.where(pos < self.prompt[seq], PHASE_PREFILL, PHASE_DECODE)
        domain = self.seq_domain[seq]
        # rows are (layer, token), layer-major
        layer = np.repeat(np.arange(num_layers), b)
        pop_row = layer * num_domains + np.tile(domain, num_layers)
        ws = self.working_sets(np.tile(seq, num_layers), np.tile(pos, num_layers), layer, pop_row)
        rng = _rng(spec.seed, 0, block)
        chosen = self.select(rng, pop_row, ws)
        scores = _chain_scores(rng, self.chosen_probabilities(pop_row, ws, chosen))
        top16 = _strictly_decreasing((spec.logit_scale * scores).astype(np.float16))
        top = top16.astype(np.float32)
        weights = np.exp(top - top[:, :1])
        weights /= weights.sum(axis=1, keepdims=True)

        def per_token(rows: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(rows.reshape(num_layers, b, -1).transpose(1, 0, 2))

        out = dict(seq=seq.astype(np.int32), pos=pos.astype(np.int32), phase=phase.astype(np.int8),
                   experts=per_token(chosen).astype(np.int16), weights=per_token(weights),
                   domain=domain.astype(np.int16))
        if self.has_logits:
            out["logits"] = self.full_logits(block, pop_row, ws, chosen, scores, top16)
        return out

    def working_sets(self, seq, pos, layer, pop_row) -> np.ndarray:
        """int16[rows, w]: the working set of each row's window (hashed, so block-independent)."""
        w = self.spec.working_set_size
        window = (pos + self.window_offset[layer]) // self.spec.reuse_tokens
        # rows of one window are adjacent (layer-major, tokens in order): draw each window once
        new = np.ones(seq.shape[0], dtype=bool)
        new[1:] = (seq[1:] != seq[:-1]) | (window[1:] != window[:-1]) | (layer[1:] != layer[:-1])
        first = np.flatnonzero(new)
        keys = [seq[first], window[first], layer[first]]
        u = _hash_uniform(self.hash_key, *[key[:, None] for key in keys], np.arange(w)[None, :])
        members = self.inverse_cdf(pop_row[first][:, None], u).astype(np.int16)
        return members[np.cumsum(new) - 1]

    def probabilities(self, pop_row: np.ndarray, ws: np.ndarray) -> np.ndarray:
        """float64[rows, E]: the mixture p each row draws its experts from."""
        n, e = ws.shape[0], self.spec.experts
        w = ws.shape[1]
        counts = np.bincount((np.arange(n)[:, None] * e + ws).reshape(-1), minlength=n * e)
        return (1 - self.spec.reuse) * self.pop[pop_row] + self.spec.reuse / w * counts.reshape(n, e)

    def select(self, rng: np.random.Generator, pop_row: np.ndarray, ws: np.ndarray) -> np.ndarray:
        """int16[rows, k]: experts drawn one by one without replacement from p, in draw order."""
        k, reuse = self.spec.top_k, self.spec.reuse
        n, w = ws.shape
        chosen = np.full((n, k), -1, dtype=np.int16)
        count = np.zeros(n, dtype=np.int64)
        active = np.arange(n)
        for _ in range(20 * k):  # rejection sampling; rare stragglers are finished exactly below
            if not active.size:
                break
            candidate = ws[active, rng.integers(0, w, active.size)]
            from_pop = np.flatnonzero(rng.random(active.size) >= reuse)
            candidate[from_pop] = self.inverse_cdf(pop_row[active[from_pop]], rng.random(from_pop.size))
            fresh = (chosen[active] != candidate[:, None]).all(axis=1)
            taken = active[fresh]
            chosen[taken, count[taken]] = candidate[fresh]
            count[taken] += 1
            active = active[count[active] < k]
        if active.size:
            # the rest of a draw without replacement is the Gumbel-top of the experts not yet drawn
            scores = np.log(self.probabilities(pop_row[active], ws[active])) + rng.gumbel(
                size=(active.size, self.spec.experts))
            drawn = chosen[active]
            row, slot = np.nonzero(drawn >= 0)
            scores[row, drawn[row, slot]] = -np.inf
            order = np.argsort(-scores, axis=1, kind="stable")
            need = np.arange(k)[None, :] - count[active][:, None]  # slot -> place in `order`
            rest = np.take_along_axis(order, np.maximum(need, 0), axis=1)
            chosen[active] = np.where(need >= 0, rest, drawn)
        return chosen

    def chosen_probabilities(self, pop_row, ws, chosen) -> np.ndarray:
        """float64[rows, k]: p of each drawn expert."""
        spec = self.spec
        p = (1 - spec.reuse) * self.pop[pop_row[:, None], chosen]
        return p + spec.reuse / ws.shape[1] * (ws[:, None, :] == chosen[:, :, None]).sum(axis=2)

    def full_logits(self, block, pop_row, ws, chosen, scores, top16) -> np.ndarray:
        """float16[T, L, E]: logits whose top-k are the chosen experts, in rank order."""
        spec = self.spec
        num_layers, b = spec.layers, pop_row.shape[0] // spec.layers
        rng = _rng(spec.seed, 1, block)  # own stream: selection does not depend on the logits
        logits = np.empty((b, num_layers, spec.experts), dtype=np.float16)
        for layer in range(num_layers):
            rows = slice(layer * b, (layer + 1) * b)
            loc = np.log(self.probabilities(pop_row[rows], ws[rows]))
            logits[:, layer, :] = _logits_below(rng, loc, scores[rows, -1:], top16[rows], chosen[rows],
                                                lambda rest: spec.logit_scale * rest)
        return _keep_top(logits, self.top_r)


def _chain_scores(rng: np.random.Generator, p: np.ndarray) -> np.ndarray:
    """float64[rows, k]: the perturbed scores (log p + Gumbel) of experts drawn in this order, decreasing.

    ``p`` (rows, k): the probability of each drawn expert (p sums to 1 over all experts). The
    maximum over the experts left after j draws is Gumbel(log of their total p), truncated
    below the previous maximum, and independent of which expert it is.
    """
    left = np.maximum(1.0 - np.cumsum(p, axis=1) + p, 1e-300)  # total p before each draw
    scores = np.empty(p.shape)
    scores[:, 0] = rng.gumbel(size=p.shape[0])
    for j in range(1, p.shape[1]):
        scores[:, j] = _truncated_gumbel(rng, np.log(left[:, j]), scores[:, j - 1])
    return scores


def _logits_below(rng: np.random.Generator, loc: np.ndarray, kth_score: np.ndarray, top16: np.ndarray,
                  chosen: np.ndarray, to_logit: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """float16[rows, E]: the chosen experts' logits ``top16``, every other expert strictly below.

    The others' scores are Gumbel(``loc`` = log p) truncated below the k-th score; ``to_logit``
    maps scores to logits (monotone increasing).
    """
    return _place_top(to_logit(_truncated_gumbel(rng, loc, kth_score)).astype(np.float16), top16, chosen)


def _place_top(rest16: np.ndarray, top16: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """float16[..., E]: ``rest16`` kept strictly below the k-th of ``top16``, which the chosen get."""
    rest16 = np.minimum(rest16, np.nextafter(top16[..., -1:], np.float16(-np.inf)))
    np.put_along_axis(rest16, chosen.astype(np.intp), top16, axis=-1)
    return rest16


def _keep_top(logits: np.ndarray, top_r: int) -> np.ndarray:
    """The R highest logits of every token-layer, ``-inf`` elsewhere (as a top-R trace reads back).

    Ties at the R-th value keep the lower expert ids, as the trace writer does; ``top_r`` 0: all.
    """
    if not top_r:
        return logits
    threshold = -np.partition(-logits, top_r - 1, axis=-1)[..., top_r - 1:top_r]
    above = logits > threshold
    tied = logits == threshold
    room = top_r - above.sum(axis=-1, keepdims=True)
    keep = above | (tied & (np.cumsum(tied, axis=-1) <= room))
    return np.where(keep, logits, np.float16(-np.inf))


FIT_VERSION = 1
WEIGHT_RANGE = 40.0  # log weights below the largest by more than this are raised to it


@dataclass
class RoutingFit:
    """The parameters of the fitted model (JSON in a trace's ``extra.fit`` and in presets).

    Per-layer lists have one entry per MoE layer. Stack positions and popularity ranks count
    from 0 (position 0: the expert selected last). Log weights are natural logs, up to a
    constant per layer.
    """

    model: str  # model name the synthetic trace records
    layers: int
    experts: int
    top_k: int
    expert_bytes: list[int]  # [L] bytes of one routed expert
    dense_bytes: list[int]  # [L] or []
    layer_ids: list[int]  # [L] or []
    dtype: str
    domains: list[str]  # domain names ([] when the trace has none)
    sequences: list[list[int]]  # [prompt tokens, tokens, domain index or -1] per sequence, repeated
    recency_edges: list[int]  # stack positions where each recency bin starts; last = experts
    recency: list[list[list[float]]]  # [phase][L][bins] log recency weight of each bin (0: prefill)
    recency_cold: list[list[float]]  # [phase][L] log weight of an expert not selected yet
    popularity_ranks: list[int]  # knot ranks of the rank-frequency curve, 0 .. experts - 1
    popularity: list[list[float]]  # [L][knots] log popularity at each knot (linear between)
    domain_shift: list[float]  # [L] std of a domain's offsets to log popularity
    token_types: int  # types a token draws its type from (uniformly)
    type_boost: list[float]  # [L] log weight factor of a type's top_k favourite experts
    rank_weight: float  # ranks order the drawn experts by this x log(popularity x recency) + Gumbel
    gate_levels: list[float]  # quantile levels 0 .. 1 of the gap distributions
    gate_gaps: list[list[float]]  # [k - 1][levels] quantiles of logit gap rank r -> r + 1
    logit_level: float  # the first choice's router logit
    tail_scale: float  # logits below the k-th: logit units per unit of perturbed log p
    structure_seed: int  # seed of the fixed draws the weights were fitted with: the popularity
    # order, domain offsets and token types' favourites (a trace's own seed draws its tokens)
    source: dict = field(default_factory=dict)  # provenance and the fit's own check
    version: int = FIT_VERSION

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict, where: str) -> RoutingFit:
        """A fit from its JSON object, checked; ``where`` names the file in errors."""
        if not isinstance(raw, dict):
            raise InputError(f"{where}: a routing fit must be a JSON object; re-create it with "
                             "python -m traces.fit")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        missing = sorted(name for name in known - set(raw) if name not in ("source", "version"))
        if unknown or missing:
            name = (unknown or missing)[0]
            raise InputError(f"{where}: routing fit field '{name}' is {'unknown' if unknown else 'missing'}; "
                             "re-create the fit with python -m traces.fit")
        fit = cls(**raw)
        fit.check(where)
        return fit

    def check(self, where: str) -> None:
        """Raise InputError naming the first field of the wrong size or range."""
        L, E, k = self.layers, self.experts, self.top_k
        bins, knots = len(self.recency_edges) - 1, len(self.popularity_ranks)
        rules = [
            ("version", self.version == FIT_VERSION, f"{FIT_VERSION}"),
            ("layers", L >= 1, ">= 1"),
            ("experts", 1 <= E <= 32767, "1 .. 32767"),
            ("top_k", 1 <= k <= E, f"1 .. experts ({E})"),
            ("expert_bytes", len(self.expert_bytes) == L and min(self.expert_bytes) >= 1,
             f"{L} positive sizes"),
            ("dense_bytes", len(self.dense_bytes) in (0, L), f"0 or {L} entries"),
            ("layer_ids", len(self.layer_ids) in (0, L), f"0 or {L} entries"),
            ("sequences", len(self.sequences) >= 1 and all(
                len(s) == 3 and 0 <= s[0] <= s[1] and s[1] >= 1 and -1 <= s[2] < max(1, len(self.domains))
                for s in self.sequences), "[prompt <= tokens >= 1, domain] triples"),
            ("recency_edges", bins >= 1 and self.recency_edges[0] == 0 and self.recency_edges[-1] == E
             and all(a < b for a, b in zip(self.recency_edges, self.recency_edges[1:], strict=False)),
             f"increasing positions from 0 to experts ({E})"),
            ("recency", len(self.recency) == 2 and all(_table_shape(t) == (L, bins) for t in self.recency),
             f"2 phases of {L} rows of {bins} weights"),
            ("recency_cold", _table_shape(self.recency_cold) == (2, L), f"2 phases of {L} weights"),
            ("popularity_ranks", knots >= 1 and self.popularity_ranks[0] == 0
             and self.popularity_ranks[-1] == E - 1 and all(
                 a < b for a, b in zip(self.popularity_ranks, self.popularity_ranks[1:], strict=False)),
             f"increasing ranks from 0 to experts - 1 ({E - 1})"),
            ("popularity", _table_shape(self.popularity) == (L, knots), f"{L} rows of {knots} weights"),
            ("domain_shift", len(self.domain_shift) == L and min(self.domain_shift) >= 0,
             f"{L} values >= 0"),
            ("token_types", self.token_types >= 1, ">= 1"),
            ("type_boost", len(self.type_boost) == L and min(self.type_boost) >= 0, f"{L} values >= 0"),
            ("rank_weight", self.rank_weight >= 0, ">= 0"),
            ("gate_levels", len(self.gate_levels) >= 2 and self.gate_levels[0] == 0
             and self.gate_levels[-1] == 1, "quantile levels from 0 to 1"),
            ("gate_gaps", _table_shape(self.gate_gaps) in ((k - 1, len(self.gate_levels)), (0, 0)) and all(
                0 <= a <= b for row in self.gate_gaps for a, b in zip(row, row[1:], strict=False)),
             f"{k - 1} rows of non-decreasing gaps >= 0"),
            ("tail_scale", self.tail_scale > 0, "> 0"),
            ("structure_seed", self.structure_seed >= 0, ">= 0"),
        ]
        for name, ok, want in rules:
            values = np.asarray(getattr(self, name), dtype=object).ravel()
            finite = all(not isinstance(v, float) or math.isfinite(v) for v in values)
            if not ok or not finite:
                shown = repr(getattr(self, name))
                shown = shown if len(shown) <= 60 else shown[:57] + "..."
                raise InputError(f"{where}: routing fit field '{name}' is {shown}; it must be {want} "
                                 "(re-create the fit with python -m traces.fit)")


def _table_shape(rows) -> tuple[int, int]:
    """(rows, width) of a list of equally long lists of numbers; width -1 if it is not one."""
    if not isinstance(rows, list) or not all(isinstance(row, list) for row in rows):
        return -1, -1
    widths = {len(row) for row in rows}
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for row in rows for v in row):
        return len(rows), -1
    return (len(rows), widths.pop()) if len(widths) == 1 else (len(rows), -1 if rows else 0)


def preset_names() -> list[str]:
    """Names of the bundled fits (``traces/synth_presets/NAME.json``)."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.json"))


def load_preset(name: str) -> RoutingFit:
    """A bundled fit by name (``traces/synth_presets/NAME.json``), or a fit file (``*.json``)."""
    path = Path(name) if name.endswith(".json") else PRESETS_DIR / f"{name}.json"
    if not path.is_file():
        raise InputError(f"synth option 'preset' (--preset) is {name!r}: no such fit; give a .json fit "
                         f"file or one of: {', '.join(preset_names()) or '(none bundled)'}")
    try:
        raw = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: not a JSON routing fit ({' '.join(str(exc).split())}); re-create it "
                         "with python -m traces.fit") from None
    return RoutingFit.from_dict(raw, str(path))


def check_draw(tokens: int, seed: int) -> None:
    """Raise InputError unless a fitted trace of ``tokens`` tokens and ``seed`` can be drawn."""
    for name, value, least in (("tokens", tokens, 1), ("seed", seed, 0)):
        if value < least:
            raise InputError(f"synth option '{name}' (--{name}) is {value}; it must be >= {least}")


def fitted_meta(fit: RoutingFit, logits: str, extra: dict | None = None) -> TraceMeta:
    """The metadata of a trace drawn from ``fit``; ``extra.fit`` records the parameters."""
    has_logits, top_r = logits_option(logits, fit.top_k, fit.experts)
    return TraceMeta(
        model=fit.model,
        num_layers=fit.layers,
        num_experts=fit.experts,
        top_k=fit.top_k,
        expert_bytes=list(fit.expert_bytes),
        dtype=fit.dtype,
        has_logits=has_logits,
        logits_top_r=top_r,
        layer_ids=list(fit.layer_ids),
        domains=list(fit.domains),
        dense_bytes=list(fit.dense_bytes),
        source="synth",
        extra={**(extra or {}), "fit": fit.to_dict()},
    )


def fitted_trace(fit: RoutingFit, tokens: int, seed: int, logits: str = "full",
                 extra: dict | None = None) -> tuple[TraceMeta, TraceChunk]:
    """A trace of ``tokens`` tokens drawn from ``fit``, in memory: (meta, one chunk)."""
    check_draw(tokens, seed)
    return _in_memory(fitted_meta(fit, logits, extra), fitted_blocks(fit, tokens, seed, logits))


def write_fitted_trace(path: str | os.PathLike, fit: RoutingFit, tokens: int, seed: int,
                       logits: str = "full", extra: dict | None = None,
                       progress: bool = False) -> TraceMeta:
    """Draw ``tokens`` tokens from ``fit`` and write them block by block; returns the meta."""
    check_draw(tokens, seed)
    meta = fitted_meta(fit, logits, extra)
    return _write(path, meta, fitted_blocks(fit, tokens, seed, logits), tokens, progress)


def fitted_blocks(fit: RoutingFit, tokens: int, seed: int, logits: str) -> Iterator[dict[str, np.ndarray]]:
    """Token arrays (the TraceWriter.write keywords) of consecutive blocks of BLOCK_TOKENS."""
    check_draw(tokens, seed)
    has_logits, top_r = logits_option(logits, fit.top_k, fit.experts)
    router = RoutingModel(fit, seed)
    layout = SequenceLayout(fit.sequences)
    level = np.float64(fit.logit_level)
    for block, t0 in enumerate(range(0, tokens, BLOCK_TOKENS)):
        t = np.arange(t0, min(t0 + BLOCK_TOKENS, tokens))
        seq, pos, phase, domain = layout.at(t)
        chosen, p_chosen, p_all = router.route(t, phase, np.maximum(domain, 0), p_all=has_logits)
        b, L, k = chosen.shape
        rng = _rng(seed, 0, block)
        gaps = _quantile_draws(rng, fit.gate_levels, fit.gate_gaps, (b, L))
        top = level - np.concatenate([np.zeros((b, L, 1)), np.cumsum(gaps, axis=-1)], axis=-1)
        top16 = _strictly_decreasing(top.reshape(b * L, k).astype(np.float16)).reshape(b, L, k)
        top32 = top16.astype(np.float32)
        weights = np.exp(top32 - top32[..., :1])
        weights /= weights.sum(axis=-1, keepdims=True)
        out = dict(seq=seq, pos=pos, phase=phase, experts=chosen, weights=weights)
        if fit.domains:
            out["domain"] = domain.astype(np.int16)
        if has_logits:
            out["logits"] = _fitted_logits(_hash_key(seed, 1), t, fit.tail_scale, chosen, p_chosen, p_all,
                                           top16, top_r)
        yield out


def _quantile_draws(rng: np.random.Generator, levels: list[float], quantiles: list[list[float]],
                    shape: tuple[int, ...]) -> np.ndarray:
    """float64[*shape, len(quantiles)]: draws of each distribution given by its quantiles."""
    u = rng.random((*shape, len(quantiles)))
    for r, q in enumerate(quantiles):
        u[..., r] = np.interp(u[..., r], levels, q)
    return u


def _fitted_logits(key, tokens, tail_scale, chosen, p_chosen, p_all, top16, top_r) -> np.ndarray:
    """float16[T, L, E]: logits of the fitted model; unselected ones continue below the k-th.

    ``p_all`` (float32[T, L, E], p of every expert) is overwritten with the unselected logits.
    """
    _scores_below(p_all, p_chosen, top16[..., -1].astype(np.float64), tail_scale, key,
                  np.ascontiguousarray(tokens, dtype=np.int64))
    return _keep_top(_place_top(p_all.astype(np.float16), top16, chosen), top_r)


class SequenceLayout:
    """Sequences of given prompt and total lengths and domains, repeated without end."""

    def __init__(self, sequences: list[list[int]]):
        table = np.asarray(sequences, dtype=np.int64).reshape(-1, 3)
        self.prompt, self.length, self.domain = table[:, 0], table[:, 1], table[:, 2]
        self.start = np.concatenate([[0], np.cumsum(self.length)])
        self.cycle = int(self.start[-1])

    def at(self, tokens: np.ndarray):
        """(seq int32, pos int32, phase int8, domain int64 (-1: none)) of global token indices."""
        turn, within = np.divmod(tokens, self.cycle)
        j = np.searchsorted(self.start, within, side="right") - 1
        pos = within - self.start[j]
        phase = np.where(pos < self.prompt[j], PHASE_PREFILL, PHASE_DECODE)
        seq = turn * len(self.length) + j
        return seq.astype(np.int32), pos.astype(np.int32), phase.astype(np.int8), self.domain[j]


class RoutingModel:
    """The fitted model's selection: per layer an LRU stack; p = popularity x favourite x recency.

    ``route`` continues the process over the next tokens (stacks carry over between calls);
    uniforms are hashed from (seed, stream, token index, layer, draw), so a token's routing
    depends only on the tokens before it. The structure (popularity order, domain offsets,
    favourites) comes from ``fit.structure_seed``: the fitted weights belong to it.
    ``reset(stream)`` starts an independent replica, as the fitting needs.
    """

    def __init__(self, fit: RoutingFit, seed: int):
        L, E, k = fit.layers, fit.experts, fit.top_k
        rng = _rng(fit.structure_seed, 2)
        # each token type's top_k favourite experts per layer (distinct, uniform); the experts
        # most types favour take the top popularity ranks, so that ranks stay what they say
        self.favourites = np.argsort(rng.random((L, fit.token_types, E)), axis=-1)[..., :k].astype(np.int16)
        favoured = np.stack([np.bincount(self.favourites[layer].ravel(), minlength=E) for layer in range(L)])
        order = np.lexsort((rng.random((L, E)), -favoured), axis=-1)  # most favoured first
        self.rank_of = np.argsort(order, axis=1)  # int[L, E]: popularity rank of each expert
        base = np.stack([np.interp(self.rank_of[layer], fit.popularity_ranks, fit.popularity[layer])
                         for layer in range(L)])
        domains = max(1, len(fit.domains))
        shift = np.asarray(fit.domain_shift)[:, None, None] * rng.standard_normal((L, domains, E))
        log_w = base[:, None, :] + shift
        # weights are kept within e^-WEIGHT_RANGE of the largest, so that no p underflows to 0
        self.w = np.exp(np.maximum(log_w - log_w.max(axis=-1, keepdims=True), -WEIGHT_RANGE))
        recency = np.asarray(fit.recency, dtype=np.float64)  # [phase, L, bins]
        cold = np.asarray(fit.recency_cold, dtype=np.float64)
        top = np.maximum(recency.max(axis=2), cold)
        by_position = np.repeat(recency - top[..., None], np.diff(fit.recency_edges), axis=2)
        self.kappa = np.exp(np.maximum(by_position, -WEIGHT_RANGE))
        self.kappa_cold = np.exp(np.maximum(cold - top, -WEIGHT_RANGE))
        self.boost = np.exp(np.asarray(fit.type_boost, dtype=np.float64))
        self.rank_weight = float(fit.rank_weight)
        self.seed = seed
        self.top_k = k
        self.reset()

    def reset(self, stream: int = 0) -> None:
        """Forget all history (every expert unselected, as at the first token); draw from ``stream``."""
        self.key = _hash_key(self.seed, stream)
        _, L, E = self.kappa.shape
        self.stack = np.tile(np.arange(E, dtype=np.int32), (L, 1))
        self.pos = self.stack.copy()
        self.used = np.zeros(L, dtype=np.int32)

    def route(self, tokens: np.ndarray, phase: np.ndarray, domain: np.ndarray, p_all: bool = False):
        """Select the experts of the next tokens: global indices ``tokens``, their phases and domain
        indices (recency weights are per phase: a prompt reuses experts unlike generated text).

        Returns chosen int16[T, L, k] (rank order), p_chosen float64[T, L, k] (p of the j-th
        expert drawn, in draw order: the chain of perturbed scores needs it) and, with
        ``p_all``, float32[T, L, E] p of every expert (else empty).
        """
        T, (_, L, E), k = tokens.shape[0], self.kappa.shape, self.top_k
        chosen = np.empty((T, L, k), dtype=np.int16)
        p_chosen = np.empty((T, L, k), dtype=np.float64)
        p_out = np.empty((T if p_all else 0, L, E), dtype=np.float32)
        _route(np.ascontiguousarray(tokens, dtype=np.int64), np.ascontiguousarray(phase, dtype=np.int64),
               np.ascontiguousarray(domain, dtype=np.int64),
               self.w, self.favourites, self.boost, self.kappa, self.kappa_cold, self.rank_weight, self.key,
               self.stack, self.pos, self.used, chosen, p_chosen, p_out)
        return chosen, p_chosen, p_out


FIRST_USE = -1  # stack position of an expert never selected before
REPEAT = -2  # of an expert its group selected already (not a lookup)


def stack_positions(experts: np.ndarray, num_experts: int, group: np.ndarray) -> np.ndarray:
    """int32[T, L, k]: the LRU stack position of every lookup at its group's start.

    The simulator's steps (simulator/mrc.py): a group (one decode token, or a prefill batch)
    looks up its distinct experts once each, in first-appearance order, then they move to the
    top in that order; position d means d more recently used experts, so an LRU pool of c
    experts hits exactly the positions below c. FIRST_USE marks an expert's first selection,
    REPEAT a selection its group made already. ``experts``: int[T, L, k] of one trace from its
    first token; ``group``: int[T] non-decreasing group ids.
    """
    T, L, k = experts.shape
    stack = np.tile(np.arange(num_experts, dtype=np.int32), (L, 1))
    pos, used = stack.copy(), np.zeros(L, dtype=np.int32)
    position = np.empty((T, L, k), dtype=np.int32)
    _replay(np.ascontiguousarray(experts, dtype=np.int16), np.ascontiguousarray(group, dtype=np.int64),
            stack, pos, used, position)
    return position


def _truncated_gumbel(rng: np.random.Generator, loc: np.ndarray, below: np.ndarray) -> np.ndarray:
    """Gumbel(loc) draws conditioned on being below ``below`` (inverse CDF)."""
    u = rng.random(np.broadcast_shapes(np.shape(loc), np.shape(below)))
    return loc - np.log(np.exp(loc - below) - np.log(u))


def _strictly_decreasing(top16: np.ndarray) -> np.ndarray:
    """Nudge float16 ties down so that rank j's logit is strictly below rank j-1's."""
    for j in range(1, top16.shape[1]):
        top16[:, j] = np.minimum(top16[:, j], np.nextafter(top16[:, j - 1], np.float16(-np.inf)))
    return top16


def _rng(seed: int, *stream: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence(seed, spawn_key=stream))


def _hash_key(seed: int, *stream: int) -> np.uint64:
    """The key of a trace's hashed uniforms."""
    return np.random.SeedSequence(seed, spawn_key=(3, *stream)).generate_state(1, np.uint64)[0]


def _hash_uniform(key: np.uint64, *parts: np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1) from integer keys (splitmix64 chained over the parts), broadcast."""
    h = np.full(np.broadcast_shapes(*(np.shape(p) for p in parts)), key, dtype=np.uint64)
    for part in parts:
        h = _splitmix64(h ^ np.asarray(part).astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 output function (NumPy arrays, or compiled on one np.uint64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


# The fitted model's kernels (plain arrays and scalars; see RoutingModel)

_mix = jit(_splitmix64, allocates=False)


@jit(allocates=False)
def _uniform(h):
    return np.float64(h >> np.uint64(11)) * 2.0**-53


@jit(allocates=False)
def _touch(stack, pos, used, layer, x):
    """Move expert x to the top of the layer's stack (every expert above it moves down one)."""
    p = pos[layer, x]
    for i in range(p, 0, -1):
        y = stack[layer, i - 1]
        stack[layer, i] = y
        pos[layer, y] = i
    stack[layer, 0] = x
    pos[layer, x] = 0
    if p >= used[layer]:
        used[layer] += 1


@jit
def _replay(experts, group, stack, pos, used, position):
    T, L, k = experts.shape
    E = stack.shape[1]
    mark = np.full(E, -1, dtype=np.int64)  # last group that looked the expert up
    order = np.empty(T * k, dtype=np.int64)  # a group's distinct experts, first appearance first
    start = 0
    while start < T:
        stop = start + 1
        while stop < T and group[stop] == group[start]:
            stop += 1
        for layer in range(L):
            n = 0
            for t in range(start, stop):
                for r in range(k):
                    x = experts[t, layer, r]
                    if mark[x] == start:
                        position[t, layer, r] = REPEAT
                        continue
                    mark[x] = start
                    order[n] = x
                    n += 1
                    position[t, layer, r] = pos[layer, x] if pos[layer, x] < used[layer] else FIRST_USE
            for j in range(n):
                _touch(stack, pos, used, layer, order[j])
            for j in range(n):
                mark[order[j]] = -1
        start = stop


REDRAWS = 4  # rejected draws in a row after which a pick re-normalises over the experts left


@jit
def _route(tokens, phase, domain, w, favourites, boost, kappa, kappa_cold, rank_weight, key, stack, pos,
           used, chosen, p_chosen, p_all):
    """The fitted model's selections for consecutive tokens (see RoutingModel.route).

    A token's type is uniform over ``favourites.shape[1]``; at every layer the type's
    ``favourites[layer, type]`` get the weight factor ``boost[layer]``. The k experts drawn are
    then ranked by ``rank_weight * log(popularity * recency) + Gumbel``.
    """
    T = tokens.shape[0]
    L, _, E = w.shape
    k = chosen.shape[2]
    q = np.empty(E)  # weight of each expert
    cum = np.empty(E)  # cumulative weight over the stack, most recent first
    taken = np.full(E, -1, dtype=np.int64)
    boosted = np.full(E, -1, dtype=np.int64)
    drawn = np.empty(k, dtype=np.int64)
    score = np.empty(k)
    step = 0
    for t in range(T):
        d, ph = domain[t], phase[t]
        h_token = _mix(key ^ np.uint64(tokens[t]))
        c = min(int(_uniform(h_token) * favourites.shape[1]), favourites.shape[1] - 1)
        for layer in range(L):
            step += 1
            for j in range(favourites.shape[2]):
                boosted[favourites[layer, c, j]] = step
            total = 0.0
            seen = used[layer]
            for i in range(E):
                x = stack[layer, i]
                v = w[layer, d, x] * (kappa[ph, layer, i] if i < seen else kappa_cold[ph, layer])
                if boosted[x] == step:
                    v *= boost[layer]
                q[x] = v
                total += v
                cum[i] = total
            h_layer = _mix(h_token ^ np.uint64(layer + 1))
            draw = 0
            left = total
            for r in range(k):
                rejected = 0
                while True:
                    draw += 1
                    target = _uniform(_mix(h_layer ^ np.uint64(draw))) * left
                    lo, hi = 0, E - 1  # first stack position with cum > target
                    while lo < hi:
                        mid = (lo + hi) // 2
                        if cum[mid] > target:
                            hi = mid
                        else:
                            lo = mid + 1
                    if taken[stack[layer, lo]] != step:
                        break
                    rejected += 1
                    if rejected == REDRAWS:  # the experts drawn hold most of p: drop them
                        left = 0.0
                        for i in range(E):
                            x = stack[layer, i]
                            if taken[x] != step:
                                left += q[x]
                            cum[i] = left
                        rejected = 0
                x = stack[layer, lo]
                taken[x] = step
                drawn[r] = x
                p_chosen[t, layer, r] = q[x] / total
                own = w[layer, d, x] * (kappa[ph, layer, lo] if lo < seen else kappa_cold[ph, layer])
                score[r] = rank_weight * math.log(own) - math.log(-math.log(
                    max(_uniform(_mix(h_layer ^ np.uint64(2**32 + r))), 1e-300)))
            for r in range(k):  # rank = order of the scores, highest first
                best = r
                for j in range(r + 1, k):
                    if score[j] > score[best]:
                        best = j
                score[r], score[best] = score[best], score[r]
                drawn[r], drawn[best] = drawn[best], drawn[r]
                chosen[t, layer, r] = drawn[r]
            if p_all.shape[0]:
                for x in range(E):
                    p_all[t, layer, x] = q[x] / total
            for r in range(k):
                _touch(stack, pos, used, layer, chosen[t, layer, r])


@jit(allocates=False)
def _scores_below(p_all, p_chosen, kth_logit, tail_scale, key, tokens):
    """Turn p (float32[T, L, E], in place) into the logits of experts scoring below the k-th.

    The perturbed scores (log p + Gumbel) of the k drawn experts follow the chain of
    :func:`_chain_scores` (``p_chosen``: p of each draw, in draw order); every other expert's
    score is Gumbel(log p) truncated below the k-th score; its logit is
    ``kth_logit + tail_scale * (score - kth_score)``. Uniforms are hashed from the token index,
    so a token's logits do not depend on its block. The chosen experts' entries are
    overwritten afterwards.
    """
    T, L, E = p_all.shape
    k = p_chosen.shape[2]
    for t in range(T):
        h_token = _mix(key ^ np.uint64(tokens[t]))
        for layer in range(L):
            h_layer = _mix(h_token ^ np.uint64(layer))
            left = 1.0
            below = 0.0
            for j in range(k):
                u = max(_uniform(_mix(h_layer ^ np.uint64(E + j))), 1e-300)
                if j == 0:
                    below = -math.log(-math.log(u))
                else:
                    loc = math.log(max(left, 1e-300))
                    below = loc - math.log(math.exp(loc - below) - math.log(u))
                left -= p_chosen[t, layer, j]
            base, scale_below = kth_logit[t, layer], math.exp(-below)
            for x in range(E):
                p = max(np.float64(p_all[t, layer, x]), 1e-300)
                u = max(_uniform(_mix(h_layer ^ np.uint64(x))), 1e-300)
                # Gumbel(log p) below the k-th score, by inverse CDF: e^(loc - below) = p e^-below
                score = math.log(p) - math.log(p * scale_below - math.log(u))
                p_all[t, layer, x] = base + tail_scale * (score - below)
