"""The NLL in one kernel on the GPU: the same values bit for bit as the log-sum-exp kernel with
torch's gather and difference (the path before it), and the host time each takes per forward.

Runs the small Qwen3-Next shape over the repository's text at batch 16 (as the capture bench
does), and for each of ``ROUNDS`` forwards computes the NLL both ways from the same LM logits:
every value must be equal (NaN where the window starts); then times each way, alternately, in
``ROUNDS`` rounds of 20 calls (the calling thread's CPU time, and wall time with the device
synchronised at the end of each round). With ``BEFORE`` (the ``nll.py`` of an earlier tree), its
``token_nll`` must give the same values too. Writes ``$OUT/nll_fused_check.json``:

    OUT=DIR BEFORE=OLD/traces/capture/nll.py PYTHONPATH=.:docs/capture python docs/capture/nll_fused_check.py [ROUNDS] [TOKENS]
"""
from __future__ import annotations

import importlib.util
import json
import os
import statistics
import time

import torch
from gpu_passes import _sync, batches, right_padded, setup

from traces.capture import nll


def unfused(lm_logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """The NLL as token_nll computed it before the fused kernel (the log-sum-exp kernel, then torch)."""
    B, S, V = lm_logits.shape
    out = torch.full((B, S), float("nan"), dtype=torch.float32, device=lm_logits.device)
    lse = nll.log_sum_exp(lm_logits.reshape(B * S, V)).view(B, S)[:, :-1]
    out[:, 1:] = lse - lm_logits[:, :-1].gather(-1, input_ids[:, 1:, None]).squeeze(-1).float()
    return out


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where the other is NaN."""
    return bool(torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(), b.nan_to_num()))


def _before():
    """``token_nll`` of the ``nll.py`` that ``BEFORE`` names, or None."""
    path = os.environ.get("BEFORE")
    if not path:
        return None
    if not os.path.isfile(path):
        raise SystemExit(f"error: BEFORE={path} is not a file; give the nll.py of an earlier tree")
    spec = importlib.util.spec_from_file_location("nll_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.token_nll


def main() -> None:
    s = setup("nll_fused_check.py", __doc__, 5)
    if not nll.uses_kernel(torch.empty(1, device=s.model.device)):
        raise SystemExit("error: this check compares two Triton kernels: it needs a CUDA device and Triton")
    rounds = s.args.rounds
    equal, checked, forwards = True, 0, []
    before, equal_before = _before(), None
    with torch.inference_mode():
        for batch in list(batches(s.windows, s.cfg.batch_size))[:rounds]:
            _, _, input_ids, mask = right_padded(batch, s.model.device)
            lm = s.model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits
            a, b = unfused(lm, input_ids), nll.token_nll(lm, input_ids)
            equal &= _same(a, b)
            if before is not None:
                equal_before = (equal_before is not False) and _same(before(lm, input_ids), b)
            checked += a.numel()
            forwards.append((lm, input_ids))
        times = {"unfused": [], "fused": []}
        for r in range(rounds):
            lm, input_ids = forwards[r % len(forwards)]
            for name, fn in (("unfused", unfused), ("fused", nll.token_nll))[:: 1 if r % 2 == 0 else -1]:
                _sync(s.model.device)
                cpu, wall = time.thread_time(), time.perf_counter()
                for _ in range(20):
                    fn(lm, input_ids)
                cpu = time.thread_time() - cpu
                _sync(s.model.device)
                times[name].append((1e3 * cpu / 20, 1e3 * (time.perf_counter() - wall) / 20))
    cuda = s.model.device.type == "cuda"
    result = {"device": torch.cuda.get_device_name() if cuda else "cpu", "uses_kernel": nll.uses_kernel(forwards[0][0]),
              "routers_return_probabilities": s.probs, "values_checked": checked, "bit_equal": equal,
              "bit_equal_to_before": equal_before,
              "ms_per_call": {k: {"host_cpu_median": round(statistics.median(c for c, _ in v), 4),
                                  "wall_median": round(statistics.median(w for _, w in v), 4)} for k, v in times.items()}}
    print(json.dumps(result, indent=1))
    (s.out / "nll_fused_check.json").write_text(json.dumps(result, indent=1) + "\n")
    if not equal or equal_before is False:
        raise SystemExit("error: the fused NLL differs from the unfused one")


if __name__ == "__main__":
    main()
