"""Device time of the capture's top-R logit selection (:func:`traces.capture.capture.top_r_logits`).

Times the selection as moe-capture runs it (on a GPU with Triton, one kernel:
:mod:`traces.capture.top_r`) beside the two stable sorts on float16 scores (the fallback) and
on float32 scores (how it ran first; the yardstick) on random router logits of the shapes the
capture bench uses, one forward's tokens each, and checks that all give the same ids and values,
and the format's own definition (``traces.format``) on tie-heavy logits (-0.0, +-inf, repeats):

    python -m traces.capture.top_r_cost --out top_r.json

Medians of ``--repeats`` calls, milliseconds, synchronised after each call on a GPU.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from traces.atomic import atomic_write_text
from traces.capture import top_r
from traces.capture.capture import top_r_logits
from traces.format import TraceMeta, _stored_logits

# (name, tokens, MoE layers, experts, top-k, R): one forward's tokens at batch 16 and batch 1; top-k 0:
# look-ahead (traces.capture.capture.top_r_lookahead), each layer's D rows counted as layers
SHAPES = (("small Qwen3-Next, batch 16", 8192, 8, 512, 10, 64),
          ("small Qwen3-Next, batch 16, R 16", 8192, 8, 512, 10, 16),
          ("small Qwen3-Next, batch 1", 512, 8, 512, 10, 64),
          ("Qwen3-30B-A3B, batch 16", 8192, 48, 128, 8, 64),
          ("Qwen3-30B-A3B, batch 1", 512, 48, 128, 8, 64),
          # look-ahead routing 2 layers ahead: 8 layers x 2 rows of 512 per token, none selected
          ("small Qwen3-Next look-ahead (depth 2), batch 16", 8192, 16, 512, 0, 64))
TIED = (-float("inf"), -3.5, -1.0, -0.0, 0.0, 6e-8, 0.5, 2.25, 65504.0, float("inf"))


def float32_scores(logits: torch.Tensor, experts: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same selection with the scores widened to float32 (the yardstick)."""
    return top_r_logits(logits, experts, r, score_dtype=torch.float32)


def float16_sorts(logits: torch.Tensor, experts: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same selection by two sorts on float16 scores (the capture's without the kernel)."""
    return top_r_logits(logits, experts, r, kernel=False)


def _selections(logits: torch.Tensor) -> dict:
    """The selections to time and compare on ``logits``: the kernel only where it runs."""
    fns = {"float16": float16_sorts, "float32": float32_scores}
    return {"kernel": top_r_logits, **fns} if top_r.uses_kernel(logits) else fns


def _same(a, b) -> bool:
    return bool(torch.equal(a[1], b[1]) and torch.equal(a[0].view(torch.int16), b[0].view(torch.int16)))


def _format_agrees(device: str, n: int, L: int, E: int, k: int, r: int, g: torch.Generator) -> bool:
    """Every selection of :func:`_selections` on tie-heavy logits equals traces.format's numpy one."""
    tied = torch.tensor(TIED, dtype=torch.float16, device=device)
    logits = tied[torch.randint(0, len(TIED), (n, L, E), device=device, generator=g)]
    experts = torch.rand(n, L, E, device=device, generator=g).argsort(-1)[..., :k]
    meta = TraceMeta.__new__(TraceMeta)
    meta.logits_top_r = r
    want = _stored_logits(meta, logits.cpu().numpy(), experts.cpu().numpy())
    return all(bool((ids.cpu().numpy() == want["logit_ids"]).all()
                    and (values.cpu().numpy().view("u2") == want["logits"].view("u2")).all())
               for values, ids in (f(logits, experts, r) for f in _selections(logits).values()))


def _median_ms(f, args, repeats: int, cuda: bool) -> float:
    for _ in range(3):
        f(*args)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        f(*args)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def measure(device: str, repeats: int, shapes=SHAPES) -> dict:
    """The selections timed and compared on each of ``shapes`` (SHAPES' rows); ``kernel_ms`` is
    None where the kernel does not run (no GPU, or no Triton)."""
    cuda = device == "cuda"
    out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__, "shapes": []}
    for name, n, L, E, k, r in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        logits = torch.randn(n, L, E, device=device, generator=g).to(torch.float16)
        logits[..., ::7] = torch.round(logits[..., ::7])  # ties, -0.0 among them
        experts = logits.float().topk(k, dim=-1).indices
        args = (logits, experts, r)
        fns = _selections(logits)
        first, *rest = (f(*args) for f in fns.values())
        row = {"shape": name, "tokens": n, "layers": L, "experts": E, "top_k": k, "R": r,
               "equal": all(_same(first, other) for other in rest),
               "format_equal": _format_agrees(device, min(n, 1024), L, E, k, r, g),
               "kernel_ms": None}
        row.update({f"{key}_ms": _median_ms(f, args, repeats, cuda) for key, f in fns.items()})
        out["shapes"].append(row)
        kernel = f"kernel {row['kernel_ms']:.3f} ms, " if row["kernel_ms"] is not None else ""
        print(f"{name}: {kernel}sorts on float16 scores {row['float16_ms']:.3f} ms, float32 "
              f"{row['float32_ms']:.3f} ms; equal {row['equal']}, as the format {row['format_equal']}", flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m traces.capture.top_r_cost", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto (cuda when available) | cuda | cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args(argv)
    if args.device not in ("auto", "cuda", "cpu"):
        ap.error(f"--device {args.device}: choose auto, cuda or cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: this torch sees no CUDA device; use --device cpu or auto")
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: calls must be at least 1")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    fig = measure(device, args.repeats)
    if args.out:
        atomic_write_text(args.out, json.dumps(fig, indent=1) + "\n")


if __name__ == "__main__":
    main()
