"""Synthetic router traces with the structure real ones show (tests, demos, runs at scale).

The generative model, per MoE layer:

- **Popularity** is Zipf-like over a random order of the experts; the exponent rises linearly
  from ``skew_first`` (first layer, flatter) to ``skew_last`` (last layer).
- **Domains** (topics): every sequence has one; a domain adds Gaussian offsets of standard
  deviation ``domain_shift`` to the log-popularity, so a topic switch changes the hot experts.
- **Temporal reuse**: a sequence passes through windows of ``reuse_tokens`` tokens (offset per
  layer, so layers do not switch together); each window has a working set of ``working_set``
  experts drawn from the popularity, and a pick comes from the working set with probability
  ``reuse``. Nearby tokens therefore re-pick each other's experts.
- **Selection**: the k experts of a token-layer are drawn one by one without replacement from
  that mixture p. This is exactly the top-k of ``log p + Gumbel noise``; the router logits are
  those perturbed scores times ``logit_scale`` (the scores of the unselected experts drawn from
  their Gumbel law truncated below the k-th), so the top-k of the logits are the selected
  experts in rank order. The logits are rounded to float16, as stored, then kept strictly
  ordered. Gate weights are the softmax of the top-k logits (a renormalised routing softmax).
- **Sequences** have geometric lengths (mean ``seq_tokens``); a share ``prompt_share`` of them
  opens with a prefill prompt (geometric, mean ``prompt_tokens``), the rest of a sequence decodes.

Tokens are generated in blocks of ``BLOCK_TOKENS`` from per-block random streams and hashed
working sets, so the trace depends only on the options (not on how it is written), and a
block with or without logits selects the same experts. Memory is bounded by a block.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields

import numpy as np
from tqdm import tqdm

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


def _opt(default, help: str, **check):
    return field(default=default, metadata={"help": help, **check})


@dataclass(frozen=True)
class SynthSpec:
    """Every option of a synthetic trace; the trace is a function of these alone."""

    tokens: int = field(metadata={"help": "tokens in the trace", "min": 1})
    layers: int = field(metadata={"help": "MoE layers", "min": 1})
    experts: int = field(metadata={"help": "routed experts per layer", "min": 1, "max": 32767})
    top_k: int = field(metadata={"help": "experts selected per token and layer", "min": 1})
    seed: int = field(metadata={"help": "random seed (same seed, same trace)", "min": 0})
    logits: str = _opt("full", "store the full router logits ('full') or not ('none')",
                       choices=("full", "none"))
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
                ("choices" in rules and value not in rules["choices"], f"one of {rules.get('choices')}"),
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

    @property
    def working_set_size(self) -> int:
        return self.working_set or 2 * self.top_k


def synth_meta(spec: SynthSpec) -> TraceMeta:
    """The metadata of the trace ``spec`` describes."""
    return TraceMeta(
        model=spec.model,
        num_layers=spec.layers,
        num_experts=spec.experts,
        top_k=spec.top_k,
        expert_bytes=[spec.expert_bytes] * spec.layers,
        has_logits=spec.logits == "full",
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
    meta = synth_meta(spec)
    blocks = list(synth_blocks(spec))
    return meta, make_chunk(meta, **{name: np.concatenate([b[name] for b in blocks]) for name in blocks[0]})


def write_synth_trace(path: str | os.PathLike, tokens: int, layers: int, experts: int, top_k: int,
                      seed: int, logits: str = "full", progress: bool = False, **options) -> TraceMeta:
    """Generate and write a synthetic trace block by block (bounded memory); returns its meta."""
    spec = checked_spec(tokens=tokens, layers=layers, experts=experts, top_k=top_k, seed=seed,
                        logits=logits, **options)
    meta = synth_meta(spec)
    with TraceWriter(path, meta) as writer, tqdm(total=tokens, unit="tok", desc="synth",
                                                 disable=not progress) as bar:
        for block in synth_blocks(spec):
            writer.write(**block)
            bar.update(block["seq"].shape[0])
    return meta


def synth_blocks(spec: SynthSpec) -> Iterator[dict[str, np.ndarray]]:
    """Token arrays (the TraceWriter.write keywords) for consecutive blocks of BLOCK_TOKENS."""
    model = _Model(spec)
    for block, t0 in enumerate(range(0, spec.tokens, BLOCK_TOKENS)):
        yield model.block(block, np.arange(t0, min(t0 + BLOCK_TOKENS, spec.tokens)))


class _Model:
    """The fixed part of the generative model: popularity, sequences, window offsets."""

    def __init__(self, spec: SynthSpec):
        self.spec = spec
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
        self.hash_key = np.random.SeedSequence(spec.seed, spawn_key=(3,)).generate_state(1, np.uint64)[0]
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
        scores = self.chosen_scores(rng, pop_row, ws, chosen)
        top16 = _strictly_decreasing((spec.logit_scale * scores).astype(np.float16))
        top = top16.astype(np.float32)
        weights = np.exp(top - top[:, :1])
        weights /= weights.sum(axis=1, keepdims=True)

        def per_token(rows: np.ndarray) -> np.ndarray:
            return np.ascontiguousarray(rows.reshape(num_layers, b, -1).transpose(1, 0, 2))

        out = dict(seq=seq.astype(np.int32), pos=pos.astype(np.int32), phase=phase.astype(np.int8),
                   experts=per_token(chosen).astype(np.int16), weights=per_token(weights),
                   domain=domain.astype(np.int16))
        if spec.logits == "full":
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

    def chosen_scores(self, rng, pop_row, ws, chosen) -> np.ndarray:
        """float64[rows, k]: the perturbed scores (log p + Gumbel) of the drawn experts, decreasing.

        The maximum over the experts left after j draws is Gumbel(log of their total p),
        truncated below the previous maximum, and independent of which expert it is.
        """
        spec = self.spec
        p = (1 - spec.reuse) * self.pop[pop_row[:, None], chosen]
        p += spec.reuse / ws.shape[1] * (ws[:, None, :] == chosen[:, :, None]).sum(axis=2)
        left = np.maximum(1.0 - np.cumsum(p, axis=1) + p, 1e-300)  # total p before each draw
        scores = np.empty(chosen.shape)
        scores[:, 0] = rng.gumbel(size=chosen.shape[0])
        for j in range(1, chosen.shape[1]):
            scores[:, j] = _truncated_gumbel(rng, np.log(left[:, j]), scores[:, j - 1])
        return scores

    def full_logits(self, block, pop_row, ws, chosen, scores, top16) -> np.ndarray:
        """float16[T, L, E]: logits whose top-k are the chosen experts, in rank order."""
        spec = self.spec
        num_layers, b = spec.layers, pop_row.shape[0] // spec.layers
        rng = _rng(spec.seed, 1, block)  # own stream: selection does not depend on the logits
        logits = np.empty((b, num_layers, spec.experts), dtype=np.float16)
        for layer in range(num_layers):
            rows = slice(layer * b, (layer + 1) * b)
            loc = np.log(self.probabilities(pop_row[rows], ws[rows]))
            rest = _truncated_gumbel(rng, loc, scores[rows, -1:])
            rest16 = (spec.logit_scale * rest).astype(np.float16)
            below = np.nextafter(top16[rows, -1:], np.float16(-np.inf))
            rest16 = np.minimum(rest16, below)
            np.put_along_axis(rest16, chosen[rows], top16[rows], axis=1)
            logits[:, layer, :] = rest16
        return logits


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


def _hash_uniform(key: np.uint64, *parts: np.ndarray) -> np.ndarray:
    """Uniforms in [0, 1) from integer keys (splitmix64 chained over the parts), broadcast."""
    h = np.full(np.broadcast_shapes(*(np.shape(p) for p in parts)), key, dtype=np.uint64)
    for part in parts:
        h = _splitmix64(h ^ np.asarray(part).astype(np.uint64))
    return (h >> np.uint64(11)).astype(np.float64) * 2.0**-53


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))
