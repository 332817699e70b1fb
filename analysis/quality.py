"""Quality analyses of a moe-emulate run, as tables for docs/QUALITY.md.

Reads a run folder (``results.npz``, ``open_loop.npz``, ``emulation.json`` of ``moe-emulate``) and
computes, per strategy, the perplexity and its increase over fetch_all, the substitution rate
and the mean substituted mass; then the 0.15 rule against substitute-all, the mass hypothesis
across strategies and across inputs (Pearson r with bootstrap confidence intervals), background
admission right after domain switches, and closed loop against open loop.

    python -m analysis.quality runs/emulate                       # print the tables
    python -m analysis.quality runs/emulate --doc docs/QUALITY.md # replace the generated block

Definitions (the simulator's names, docs/metrics.md): *scored tokens* are the tokens every
strategy simulated that have a prediction (not the first token of a window); perplexity is
``exp(mean NLL)`` over them. ``mean_mass`` is substituted gate mass per decode token-layer,
``substitution_rate`` substitutions per expert call. A token's NLL is paired with the mass of
the forward that predicted it (the previous token's routing) wherever tokens are grouped.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BEGIN = "<!-- BEGIN GENERATED: python -m analysis.quality{} -->"
END = "<!-- END GENERATED{} -->"
MAIN_POLICIES = ("substitute_all", "rule015", "first_choice", "quality_first", "speed_first")
# admission on/off pairs: (with background admission, the same policy without it)
ADMISSION_PAIRS = (
    ("quality_first", "rule015_lfu"),
    ("speed_first", "first_choice_lfu"),
    ("quality_first_beta0.25", "rule015_lfu"),
    ("quality_first_beta1", "rule015_lfu"),
    ("quality_first_beta2", "rule015_lfu"),
)


@dataclass
class Run:
    """A moe-emulate run: per strategy r and token t arrays, plus the run's description."""

    info: dict
    arrays: dict[str, np.ndarray]

    @property
    def labels(self) -> list[str]:
        return [s["label"] for s in self.info["strategies"]]

    @property
    def names(self) -> list[str]:
        return [s["name"] for s in self.info["strategies"]]

    @property
    def fractions(self) -> list[float]:
        return [s["fraction"] for s in self.info["strategies"]]

    def index(self, name: str, fraction: float | None = None) -> int | None:
        for i, s in enumerate(self.info["strategies"]):
            if s["name"] == name and (fraction is None or math.isclose(s["fraction"], fraction)):
                return i
        return None

    @property
    def reference(self) -> int:
        r = self.index("fetch_all")
        if r is None:
            raise ValueError("the run has no fetch_all strategy to compare with")
        return r

    @property
    def L(self) -> int:
        return int(self.info["meta"]["num_layers"])

    @property
    def k(self) -> int:
        return int(self.info["meta"]["top_k"])

    def scored(self) -> np.ndarray:
        """bool[T]: every strategy simulated the token and its NLL is defined."""
        a = self.arrays
        ok = (a["pos"] > 0) & a["simulated"].all(0) & np.isfinite(a["nll"]).all(0)
        # the predicting forward (previous token) must have been simulated too
        ok[1:] &= a["simulated"][:, :-1].all(0)
        return ok

    def predicting_mass(self, name: str = "mass") -> np.ndarray:
        """float[R, T]: substituted mass of the forward that predicted token t (token t-1's)."""
        m = self.arrays[name]
        out = np.zeros_like(m)
        out[:, 1:] = m[:, :-1]
        return out


def load(run_dir: str | Path) -> Run:
    run_dir = Path(run_dir)
    info = json.loads((run_dir / "emulation.json").read_text())
    arrays = {}
    for name in ("results.npz", "open_loop.npz"):
        if (run_dir / name).exists():
            with np.load(run_dir / name) as z:
                arrays.update({k: z[k] for k in z.files})
    return Run(info, arrays)


# ---- statistics ----------------------------------------------------------------------------


def pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson r along the last axis (NaN where a side is constant)."""
    x = x - x.mean(-1, keepdims=True)
    y = y - y.mean(-1, keepdims=True)
    den = np.sqrt((x * x).sum(-1) * (y * y).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, (x * y).sum(-1) / np.where(den > 0, den, 1.0), np.nan)


def slope(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slope of y on x along the last axis (NaN where x is constant)."""
    x = x - x.mean(-1, keepdims=True)
    var = (x * x).sum(-1)
    cov = (x * (y - y.mean(-1, keepdims=True))).sum(-1)
    return np.where(var > 0, cov / np.where(var > 0, var, 1.0), np.nan)


def ranks(x: np.ndarray) -> np.ndarray:
    return np.argsort(np.argsort(x, kind="stable"), kind="stable").astype(np.float64)


def resample_weights(n: int, n_boot: int, seed: int) -> np.ndarray:
    """int[n_boot, n]: how often each of n units is drawn in each bootstrap sample."""
    rng = np.random.default_rng(seed)
    return rng.multinomial(n, np.full(n, 1.0 / n), size=n_boot)


def ci(samples: np.ndarray, level: float = 0.95) -> tuple[float, float]:
    s = samples[np.isfinite(samples)]
    if not s.size:
        return math.nan, math.nan
    lo, hi = np.quantile(s, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


@dataclass
class Blocks:
    """Scored tokens grouped into consecutive blocks (the bootstrap's resampling unit).

    Sums per strategy and block: ``nll`` [R, B], ``mass`` [R, B] (predicting mass), ``n`` [B].
    """

    nll: np.ndarray
    mass: np.ndarray
    n: np.ndarray

    @classmethod
    def of(cls, run: Run, block_tokens: int, nll_name: str = "nll", mass_name: str = "mass") -> Blocks:
        ok = run.scored()
        t = np.arange(ok.shape[0])
        block = t // block_tokens
        B = int(block.max()) + 1
        w = ok.astype(np.float64)
        nll = np.where(ok, run.arrays[nll_name], 0.0)
        mass = run.predicting_mass(mass_name) * w
        sums = [np.stack([np.bincount(block, x[r], B) for r in range(x.shape[0])]) for x in (nll, mass)]
        n = np.bincount(block, w, B)
        keep = n > 0
        return cls(sums[0][:, keep], sums[1][:, keep], n[keep])

    def ppl(self, weights: np.ndarray | None = None) -> np.ndarray:
        """Perplexity per strategy [R] (or [n_boot, R] with block weights [n_boot, B])."""
        if weights is None:
            return np.exp(self.nll.sum(1) / self.n.sum())
        return np.exp((weights @ self.nll.T) / (weights @ self.n)[:, None])

    def mean_mass(self, L: int, weights: np.ndarray | None = None) -> np.ndarray:
        if weights is None:
            return self.mass.sum(1) / (self.n.sum() * L)
        return (weights @ self.mass.T) / ((weights @ self.n)[:, None] * L)


# ---- the analyses --------------------------------------------------------------------------


def strategy_table(run: Run) -> list[dict]:
    """Per strategy: perplexity, increase over fetch_all, substitution rate, mean mass, ..."""
    a, ok, ref = run.arrays, run.scored(), run.reference
    ppl = np.exp(a["nll"][:, ok].mean(1))
    open_ppl = np.exp(a["open_nll"][:, ok].mean(1)) if "open_nll" in a else None
    rows = []
    for r, s in enumerate(run.info["strategies"]):
        sim = a["simulated"][r]
        n = int(sim.sum())
        row = {
            "label": s["label"], "name": s["name"], "fraction": s["fraction"],
            "protect_ranks": s["protect_ranks"], "tau": s["tau"], "beta": s["beta"], "eviction": s["eviction"],
            "ppl": float(ppl[r]), "ppl_increase": float(ppl[r] / ppl[ref] - 1),
            "substitution_rate": float(a["substitutions"][r, sim].sum() / (n * run.L * run.k)),
            "first_choice_substitutions": int(a["first_choice_substitutions"][r, sim].sum()),
            "mean_mass": float(a["mass"][r, sim].sum() / (n * run.L)),
            "hit_rate": float(a["hits"][r, sim].sum() / (n * run.L * run.k)),
        }
        if open_ppl is not None:
            row["open_ppl_increase"] = float(open_ppl[r] / open_ppl[ref] - 1)
            row["open_mean_mass"] = float(a["open_mass"][r, sim].sum() / (n * run.L))
            row["open_applied_mass"] = float(a["open_applied_mass"][r, sim].sum() / (n * run.L))
        rows.append(row)
    return rows


def mass_hypothesis_across_strategies(run: Run, rows: list[dict], block_tokens: int = 128,
                                      n_boot: int = 2000, seed: int = 0) -> list[dict]:
    """Pearson r between mean mass and perplexity increase across strategies, on the same
    tokens, with a bootstrap CI over token blocks; for strategies that never substitute a first
    choice (the hypothesis's domain) and for those that do, pooled and per fraction."""
    blocks = Blocks.of(run, block_tokens)
    W = resample_weights(blocks.n.shape[0], n_boot, seed)
    ref = run.reference
    ppl_b = blocks.ppl(W)
    inc_b = ppl_b / ppl_b[:, ref : ref + 1] - 1
    mass_b = blocks.mean_mass(run.L, W)
    inc = blocks.ppl() / blocks.ppl()[ref] - 1
    mass = blocks.mean_mass(run.L)
    protected = [i for i, row in enumerate(rows) if row["first_choice_substitutions"] == 0]
    exposed = [i for i, row in enumerate(rows) if row["first_choice_substitutions"] > 0]
    out = []
    groups = [("first choice always fetched", protected), ("first choices substituted", exposed),
              ("all strategies", protected + exposed)]
    for f in sorted(set(run.fractions)):
        at = [i for i in protected if math.isclose(rows[i]["fraction"], f)]
        groups.append((f"first choice always fetched, {f * 100:g} % resident", at))
    for title, idx in groups:
        idx = sorted(set(idx))
        if len(idx) < 3:
            continue
        r = float(pearson(mass[idx], inc[idx]))
        lo, hi = ci(pearson(mass_b[:, idx], inc_b[:, idx]))
        out.append({"set": title, "strategies": len(idx), "r": r, "ci_low": lo, "ci_high": hi,
                    "spearman": float(pearson(ranks(mass[idx]), ranks(inc[idx]))),
                    "slope": float(slope(mass[idx], inc[idx])),
                    "slope_ci": ci(slope(mass_b[:, idx], inc_b[:, idx])),
                    "blocks": int(blocks.n.shape[0]), "block_tokens": block_tokens})
    return out


def mass_hypothesis_across_inputs(run: Run, fraction: float, block_tokens: int = 128,
                                  n_boot: int = 2000, seed: int = 1) -> list[dict]:
    """Per strategy: Pearson r across token blocks between the block's mean mass and its NLL
    increase over fetch_all (log perplexity ratio), with a bootstrap CI over blocks."""
    blocks = Blocks.of(run, block_tokens)
    ref = run.reference
    W = resample_weights(blocks.n.shape[0], n_boot, seed)
    out = []
    for name in (*MAIN_POLICIES, "tau0.3_r1", "tau0.5_r0"):
        r_ = run.index(name, fraction)
        if r_ is None:
            continue
        x = blocks.mass[r_] / (blocks.n * run.L)
        y = (blocks.nll[r_] - blocks.nll[ref]) / blocks.n
        rs = np.array([pearson(np.repeat(x, w), np.repeat(y, w)) for w in W])
        lo, hi = ci(rs)
        out.append({"label": run.labels[r_], "r": float(pearson(x, y)), "ci_low": lo, "ci_high": hi,
                    "blocks": int(x.shape[0]), "block_tokens": block_tokens})
    return out


def rule_vs_substitute_all(rows: list[dict]) -> list[dict]:
    """Each 0.15-rule row beside substitute-all at the same fraction, and beside the strategy
    that substitutes first choices (substitute-all or a protect_ranks=0 threshold) whose
    substitution rate is closest to the rule's."""
    exposed = [r for r in rows if r["first_choice_substitutions"] > 0]
    out = []
    for rule in (r for r in rows if r["name"] == "rule015"):
        same = [r for r in rows if r["name"] == "substitute_all" and math.isclose(r["fraction"], rule["fraction"])]
        closest = min(exposed, key=lambda s: abs(s["substitution_rate"] - rule["substitution_rate"]), default=None)
        out.append({"rule015": rule, "substitute_all": same[0] if same else None, "closest": closest})
    return out


def switch_events(run: Run, after_tokens: int) -> list[np.ndarray]:
    """Token indices of the first ``after_tokens`` scored tokens after each domain switch
    (a token whose domain differs from the previous token's, in the same stream)."""
    a = run.arrays
    dom, stream = a["domain"], a["stream"]
    ok = run.scored()
    starts = np.flatnonzero((dom[1:] != dom[:-1]) & (stream[1:] == stream[:-1])) + 1
    events = []
    for s in starts:
        t = np.arange(s, min(s + after_tokens, dom.shape[0]))
        t = t[(stream[t] == stream[s]) & ok[t]]
        if t.size:
            events.append(t)
    return events


def admission_after_switches(run: Run, rows: list[dict], after_tokens: int = 64,
                             n_boot: int = 2000, seed: int = 2) -> list[dict]:
    """Perplexity with and without background admission, right after domain switches and
    overall; CI of the relative difference by resampling switch events."""
    a = run.arrays
    events = switch_events(run, after_tokens)
    if not events:
        return []
    ok = run.scored()
    ev_nll = np.stack([a["nll"][:, t].sum(1) for t in events], 1)  # [R, events]
    ev_n = np.array([t.size for t in events], np.float64)
    W = resample_weights(len(events), n_boot, seed)
    ref = run.reference
    out = []
    for f in sorted(set(run.fractions)):
        for with_name, without_name in ADMISSION_PAIRS:
            w, wo = run.index(with_name, f), run.index(without_name, f)
            if w is None or wo is None:
                continue
            after = np.exp(ev_nll[[w, wo, ref]].sum(1) / ev_n.sum())
            boot = np.exp((W @ ev_nll[[w, wo]].T) / (W @ ev_n)[:, None])
            overall = np.exp(a["nll"][[w, wo, ref]][:, ok].mean(1))
            out.append({
                "fraction": f, "with": run.labels[w], "without": run.labels[wo],
                "after_with": after[0] / after[2] - 1, "after_without": after[1] / after[2] - 1,
                "after_change": after[0] / after[1] - 1,
                "after_ci": ci(boot[:, 0] / boot[:, 1] - 1),
                "overall_with": overall[0] / overall[2] - 1, "overall_without": overall[1] / overall[2] - 1,
                "overall_change": overall[0] / overall[1] - 1,
                "events": len(events), "after_tokens": after_tokens,
            })
    return out


def closed_vs_open(run: Run, rows: list[dict]) -> list[dict]:
    """How well open-loop perplexity increases track the closed-loop truth across strategies:
    Pearson r, mean absolute and relative differences, for the first-choice-protected strategies,
    the others, and all (fetch_all excluded)."""
    if "open_ppl_increase" not in rows[0]:
        return []
    protected = [i for i, row in enumerate(rows)
                 if row["first_choice_substitutions"] == 0 and row["name"] != "fetch_all"]
    exposed = [i for i, row in enumerate(rows) if row["first_choice_substitutions"] > 0]
    out = []
    for title, idx in (("first choice always fetched", protected), ("first choices substituted", exposed),
                       ("all strategies", protected + exposed)):
        if len(idx) < 3:
            continue
        closed = np.array([rows[i]["ppl_increase"] for i in idx])
        open_ = np.array([rows[i]["open_ppl_increase"] for i in idx])
        big = np.abs(closed) > 0.005  # relative error only where the closed-loop effect is visible
        out.append({
            "set": title, "strategies": len(idx), "r": float(pearson(closed, open_)),
            "mean_abs_diff": float(np.abs(open_ - closed).mean()),
            "median_rel_diff": float(np.median(np.abs(open_[big] / closed[big] - 1))) if big.any() else math.nan,
        })
    return out


def reference_ppl(run: Run) -> tuple[float, float]:
    """fetch_all's perplexity token by token (closed loop) and in the batched pass (open loop)."""
    a, ok, ref = run.arrays, run.scored(), run.reference
    return math.exp(float(a["nll"][ref, ok].mean())), math.exp(float(a["open_nll"][ref, ok].mean()))


# ---- markdown ------------------------------------------------------------------------------


def pct(v: float, digits: int = 2) -> str:
    return "n/a" if v is None or not math.isfinite(v) else f"{v * 100:+.{digits}f} %"


def _r(d: dict) -> str:
    return f"{d['r']:.2f} [{d['ci_low']:.2f}, {d['ci_high']:.2f}]"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


def report(run: Run, block_tokens: int = 128, after_tokens: int = 64, n_boot: int = 2000) -> str:
    """The generated part of docs/QUALITY.md."""
    info = run.info
    rows = strategy_table(run)
    ok = run.scored()
    checks = info.get("checks") or []
    equal = sum(c["mass_equal"] and c["counts_equal"] for c in checks)
    refs = [i for i, name in enumerate(run.names) if name == "fetch_all"]
    diff = np.abs(run.arrays["nll"][refs][:, ok] - run.arrays["nll"][refs[0], ok])
    warm = {s["warmup_tokens"] for s in info["strategies"] if s["warmup_tokens"]}
    meta = info["meta"]
    out = [
        f"Run: `{info['command']}` on {info['device']} ({info['dtype']}, torch {info['versions']['torch']}, "
        f"transformers {info['versions']['transformers']}), {info['wall_seconds']:.0f} s.",
        f"Model `{info['model']}`: {meta['num_layers']} MoE layers, {meta['num_experts']} experts, "
        f"top-{meta['top_k']}. {info['tokens']} held-out tokens in {info['tokens'] // info['window_tokens']} "
        f"windows of {info['window_tokens']} ({info['streams']} stream(s) of whole windows, each an independent run "
        f"starting with an empty cache unless warmed); {int(ok.sum())} scored tokens; {len(rows)} strategies."
        + (f" Strategies with a warm start (cache.init=frequency) fill their caches from the first "
           f"{', '.join(map(str, sorted(warm)))} tokens of each stream, which are not scored." if warm else ""),
        "",
        f"**Simulator replay check**: {equal} of {len(checks)} strategies' own traces, replayed by "
        "moe-sim's engine with the same policy, give exactly the emulation's per-token mass and counts "
        f"(largest difference {max((c['max_abs_mass_diff'] for c in checks), default=0.0):.3g}).",
        "",
    ]
    if len(refs) > 1:
        ppl = np.exp(run.arrays["nll"][refs][:, ok].mean(1))
        out += [
            f"**Noise floor**: the {len(refs)} fetch_all rows run the same experts; their token NLLs differ "
            f"on {(diff > 0).any(0).mean() * 100:.1f} % of tokens (mean |difference| {diff.mean():.2g} nats, "
            f"largest {diff.max():.3g}) and their perplexities by {(ppl.max() / ppl.min() - 1) * 100:.4f} %: "
            "the rounding of a row depends on what the other rows of the batch route where.",
            "",
        ]
    out += [
        "### Per strategy",
        "",
    ]
    body = []
    for row in rows:
        body.append([
            row["label"], f"{row['ppl']:.3f}", pct(row["ppl_increase"]),
            f"{row['substitution_rate'] * 100:.2f} %", str(row["first_choice_substitutions"]),
            f"{row['mean_mass']:.4f}", f"{row['hit_rate'] * 100:.1f} %",
            pct(row.get("open_ppl_increase")) if "open_ppl_increase" in row else "",
        ])
    out += _table(["strategy", "perplexity", "vs fetch_all", "substitution rate", "first-choice subs",
                   "mean mass", "hit rate", "open loop vs fetch_all"], body)

    out += ["", "### The 0.15 rule against substitute-all", ""]

    def cells(row: dict | None) -> list[str]:
        if row is None:
            return ["", "", "", ""]
        return [row["label"], f"{row['substitution_rate'] * 100:.2f} %", f"{row['mean_mass']:.4f}",
                pct(row["ppl_increase"])]

    body = [cells(p["rule015"]) + cells(p["substitute_all"]) + cells(p["closest"])
            for p in rule_vs_substitute_all(rows)]
    out += _table(["0.15 rule", "subst. rate", "mean mass", "perplexity",
                   "substitute-all", "subst. rate", "mean mass", "perplexity",
                   "first choices substituted, closest rate", "subst. rate", "mean mass", "perplexity"], body)
    out += ["", "Perplexity: increase over fetch_all. The last group is the strategy among those that "
            "substitute first choices (substitute-all, protect_ranks=0 thresholds) whose substitution rate "
            "is closest to the rule's."]

    out += ["", "### Mass hypothesis across strategies (same tokens)", ""]
    hyp = mass_hypothesis_across_strategies(run, rows, block_tokens, n_boot)
    out += _table(["strategies", "n", "Pearson r [95 % CI]", "Spearman r",
                   "slope: perplexity increase per 0.1 mass [95 % CI]"],
                  [[h["set"], str(h["strategies"]), _r(h), f"{h['spearman']:.2f}",
                    f"{pct(h['slope'] / 10, 1)} [{pct(h['slope_ci'][0] / 10, 1)}, {pct(h['slope_ci'][1] / 10, 1)}]"]
                   for h in hyp])
    out += ["", f"Between mean mass and perplexity increase over fetch_all; CI: bootstrap over "
            f"{hyp[0]['blocks'] if hyp else 0} blocks of {block_tokens} tokens ({n_boot} resamples)."]

    fractions = sorted(set(run.fractions))
    mid = fractions[len(fractions) // 2]
    out += ["", f"### Mass hypothesis across inputs ({mid * 100:g} % resident)", ""]
    inputs = mass_hypothesis_across_inputs(run, mid, block_tokens, n_boot)
    out += _table(["strategy", "blocks", "Pearson r [95 % CI]"],
                  [[d["label"], str(d["blocks"]), _r(d)] for d in inputs])
    out += ["", f"r across blocks of {block_tokens} tokens between the block's mean mass and its "
            "NLL increase over fetch_all; CI: bootstrap over blocks."]

    adm = admission_after_switches(run, rows, after_tokens, n_boot)
    if adm:
        body = [[d["with"], d["without"], pct(d["after_with"]), pct(d["after_without"]),
                 f"{pct(d['after_change'])} [{pct(d['after_ci'][0])}, {pct(d['after_ci'][1])}]",
                 pct(d["overall_change"])] for d in adm]
        out += ["", "### Background admission after domain switches", ""]
        out += _table(["with admission", "without", f"first {after_tokens} tokens after a switch: with",
                       "without", "change [95 % CI]", "change overall"], body)
        out += ["", f"Perplexity increase over fetch_all on the first {after_tokens} scored tokens after "
                f"each of {adm[0]['events']} domain switches; CI: bootstrap over switches."]

    cvo = closed_vs_open(run, rows)
    if cvo:
        closed_ppl, open_ppl = reference_ppl(run)
        out += ["", "### Closed loop against open loop", "",
                "Open loop: decisions replayed by the simulator from the unperturbed routing, applied in "
                "one batched pass per window; closed loop: token by token (the truth). Perplexity "
                "increases are each relative to fetch_all run the same way (fetch_all: "
                f"{closed_ppl:.4f} token by token, {open_ppl:.4f} batched: the two attention paths round "
                "differently).", ""]
        out += _table(["strategies", "n", "Pearson r (open vs closed)", "mean abs difference",
                       "median relative difference"],
                      [[c["set"], str(c["strategies"]), f"{c['r']:.3f}", f"{c['mean_abs_diff'] * 100:.2f} points",
                        f"{c['median_rel_diff'] * 100:.1f} %"] for c in cvo])
        body = [[row["label"], pct(row["ppl_increase"]), pct(row["open_ppl_increase"]),
                 f"{row['mean_mass']:.4f}", f"{row['open_mean_mass']:.4f}", f"{row['open_applied_mass']:.4f}"]
                for row in rows if row["name"] in MAIN_POLICIES]
        out += [""] + _table(["strategy", "closed loop", "open loop", "mass (closed)",
                              "mass (simulator, unperturbed trace)", "mass applied (open)"], body)
    return "\n".join(out) + "\n"


def replace_generated(doc: Path, text: str, block: str = "") -> None:
    """Put ``text`` between the markers of generated block ``block`` in ``doc`` (appended if
    there are none)."""
    begin, end = BEGIN.format(f" {block}" if block else ""), END.format(f" {block}" if block else "")
    old = doc.read_text() if doc.exists() else ""
    block = f"{begin}\n{text}{end}"
    if begin in old and end in old:
        new = old[: old.index(begin)] + block + old[old.index(end) + len(end):]
    else:
        new = (old.rstrip() + "\n\n" if old else "") + block + "\n"
    doc.write_text(new)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m analysis.quality", description=__doc__.splitlines()[0])
    p.add_argument("run", help="moe-emulate output folder")
    p.add_argument("--doc", help="markdown file whose generated block to replace (else print)")
    p.add_argument("--block", default="", help="name of the generated block in --doc (several runs, one page)")
    p.add_argument("--block-tokens", type=int, default=128, help="tokens per bootstrap block")
    p.add_argument("--after-tokens", type=int, default=64, help="tokens counted after a domain switch")
    p.add_argument("--boot", type=int, default=2000, help="bootstrap resamples")
    args = p.parse_args(argv)
    text = report(load(args.run), args.block_tokens, args.after_tokens, args.boot)
    if args.doc:
        replace_generated(Path(args.doc), text, args.block)
    else:
        print(text, end="")


if __name__ == "__main__":
    main()
