"""The capture's top-R selection kernel (traces.capture.top_r) against the format's definition,
and its fallback to the two sorts."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

from traces.capture import capture, top_r  # noqa: E402

# In Triton's interpreter (CPU tensors; a process of its own, since the interpreter is chosen when
# Triton is first imported). Each case: (E, k, R, tie-heavy logits, rows); R = k, R = E - 1,
# E not a power of two, the selected experts drawn at random (most of them below the R highest),
# none selected (k = 0: look-ahead routing, also against the capture's sorts).
KERNEL_CHECK = """
import numpy as np, torch
from traces.capture import capture, top_r
from traces.format import TraceMeta, _stored_logits
tied = np.array([-np.inf, -3.5, -1.0, -0.0, 0.0, 6e-8, 0.5, 2.25, 65504, np.inf], np.float16)
cases = [(8, 2, 6, True, 6), (8, 1, 1, False, 6), (60, 5, 33, True, 4), (64, 8, 8, True, 4),
         (64, 3, 63, False, 4), (100, 7, 64, True, 3), (128, 8, 16, False, 2), (512, 10, 64, True, 1),
         (64, 0, 16, True, 4), (100, 0, 64, False, 3)]
bad = []
for case, (E, k, r, ties, rows) in enumerate(cases):
    rng = np.random.default_rng(case)
    logits = tied[rng.integers(0, len(tied), (rows, 2, E))] if ties else rng.normal(size=(rows, 2, E)).astype(np.float16)
    experts = np.argsort(rng.random((rows, 2, E)), axis=-1)[..., :k]
    meta = TraceMeta.__new__(TraceMeta)
    meta.logits_top_r = r
    want = _stored_logits(meta, logits, experts)
    values, ids = top_r.top_r(torch.from_numpy(logits), torch.from_numpy(experts), r)
    if not ((ids.numpy() == want["logit_ids"]).all()
            and (values.numpy().view(np.uint16) == want["logits"].view(np.uint16)).all()):
        bad.append((E, k, r, ties))
    if not k:
        ahead = torch.from_numpy(logits)[:, None]  # [n, 1 layer, D = 2, E]
        sorts = capture.top_r_lookahead(ahead, r, torch.zeros(1, 2, dtype=torch.bool), kernel=False)
        if not (torch.equal(sorts[1][:, 0], ids) and torch.equal(sorts[0][:, 0].view(torch.int16), values.view(torch.int16))):
            bad.append(("look-ahead", E, r, ties))
print("ok" if not bad else bad)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernel_selects_and_orders_as_the_format():
    """Ties to the lower id, -0.0 equal to 0.0, selected experts kept below the R highest, a
    selected expert's +inf score tied with a real +inf by id alone, the stored bits the logits'."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", KERNEL_CHECK], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.stdout[-2000:], done.stderr[-2000:])


def _routing(seed: int = 5, E: int = 40, k: int = 4):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, 3, E, generator=gen).to(torch.float16)
    experts = torch.rand(6, 3, E, generator=gen).argsort(-1)[..., :k]
    return logits, experts


def test_a_kernel_that_fails_falls_back_to_the_sorts_once_with_a_warning(monkeypatch, broken_kernel):
    kernel, calls = broken_kernel
    monkeypatch.setattr(top_r, "_kernel", lambda: kernel)
    monkeypatch.setattr(top_r, "_FAILED", [])
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    logits, experts = _routing()
    with pytest.warns(RuntimeWarning, match="top-R kernel failed .*no compiler for this GPU.*sorts instead"):
        got = capture.top_r_logits(logits, experts, 9)
    again = capture.top_r_logits(logits, experts, 9)  # the sorts now, without another attempt
    assert len(calls) == 1 and top_r._FAILED == ["RuntimeError: no compiler for this GPU"]
    want = capture.top_r_logits(logits, experts, 9, kernel=False)
    for out in (got, again):
        assert torch.equal(out[1], want[1]) and torch.equal(out[0].view(torch.int16), want[0].view(torch.int16))


def test_the_kernel_runs_only_where_asked_and_able(monkeypatch):
    """Asked (``top_r_kernel``), on a CUDA tensor of float16 logits, with Triton: else the sorts."""
    ran = []
    monkeypatch.setattr(top_r, "top_r", lambda *args: ran.append(args) or None)
    logits, experts = _routing()
    assert not top_r.uses_kernel(logits)  # a CPU tensor
    capture.top_r_logits(logits, experts, 9)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(top_r, "_kernel", lambda: object())
    assert top_r.uses_kernel(logits) and not top_r.uses_kernel(logits.float())
    assert not top_r.uses_kernel(torch.zeros(2, top_r.MAX_EXPERTS + 1, dtype=torch.float16))  # too wide a row
    capture.top_r_logits(logits, experts, 9, kernel=False)
    capture.top_r_logits(logits, experts, 9, score_dtype=torch.float32)
    assert ran == []
    out = capture.top_r_logits(logits, experts, 9)  # the kernel asked for (here it returns None: sorts)
    assert len(ran) == 1 and out[1].shape == (6, 3, 9)
    monkeypatch.setattr(top_r, "_kernel", lambda: None)  # no Triton
    assert not top_r.uses_kernel(logits)


# The stored-rows kernel against the steps it replaces (casts, index selection, the sorts), in
# Triton's interpreter: float16, bfloat16 and float32 logits, ties, padded slots, k = 1 and
# k not a power of two, R = 1, E = 512.
ROWS_CHECK = """
import numpy as np, torch
from traces.capture import capture, top_r
from traces.capture.capture import Storage
from traces.capture.hooks import StepRouting
tied = np.array([-np.inf, -3.5, -1.0, -0.0, 0.0, 6e-8, 0.5, 2.25, 65504, 70000, np.inf], np.float32)
bad = []
cases = [(5, 3, 40, 4, 9, torch.float16, None, False), (6, 2, 64, 8, 16, torch.bfloat16, [0, 2, 3, 5], True),
         (4, 2, 100, 7, 64, torch.float32, [1, 3], False), (3, 4, 8, 1, 1, torch.float32, None, True),
         (2, 2, 512, 10, 64, torch.bfloat16, [1], False)]
for case, (N, L, E, k, R, dtype, slots, ties) in enumerate(cases):
    g = torch.Generator().manual_seed(case)
    if ties:
        logits = torch.from_numpy(tied[np.random.default_rng(case).integers(0, len(tied), (N, L, E))]).to(dtype)
    else:
        logits = (torch.randn(N, L, E, generator=g) * 30).to(dtype)
    experts = torch.rand(N, L, E, generator=g).argsort(-1)[..., :k]  # not contiguous
    weights = torch.rand(N, L, k, generator=g).to(dtype)
    s = None if slots is None else torch.tensor(slots)
    storage = Storage(logits="top", logits_top_r=R, lookahead=None, lookahead_top_r=0)
    want = capture._routing_parts(StepRouting(experts, weights.float(), logits), s, storage, None, kernel=False)
    T = N if s is None else len(slots)
    shapes = {"logits": ((T, L, R), torch.float16), "logit_ids": ((T, L, R), torch.int16),
              "experts": ((T, L, k), torch.int16), "weights": ((T, L, k), torch.float32)}
    out = {name: torch.full(shape, 7, dtype=dt) for name, (shape, dt) in shapes.items()}
    assert top_r.stored_rows(logits, experts, weights, s, out)
    for name, got in out.items():
        bits = {torch.float16: torch.int16, torch.float32: torch.int32}.get(got.dtype, got.dtype)
        if not torch.equal(got.view(bits), want[name].view(bits)):
            bad.append((case, name))
print("ok" if not bad else bad)
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_stored_rows_kernel_writes_what_the_steps_write():
    """One launch gives the bits of the casts, the real slots' selection and the top-R sorts."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", ROWS_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.stdout[-2000:], done.stderr[-2000:])
