"""Capture: recorded routing equals what each architecture's own router computes, in both modes."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from traces.capture.capture import Rows, capture_windows, parse_logits_storage, run_capture  # noqa: E402
from traces.capture.config import CaptureConfig, GenerateConfig, InputConfig, ModelConfig  # noqa: E402
from traces.capture.hooks import RouterRecorder, router_returns_probabilities  # noqa: E402
from traces.capture.routers import GROUPED_SIGMOID, LOGIT_TOPK, find_routers, routing_metadata  # noqa: E402
from traces.capture.text import Window  # noqa: E402
from traces.errors import EXIT_INPUT_ERROR, InputError  # noqa: E402
from traces.format import PHASE_DECODE, PHASE_PREFILL  # noqa: E402

VOCAB = 96
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
              max_position_embeddings=256, eos_token_id=None, bos_token_id=None, pad_token_id=None)
# tiny versions of each supported architecture; dense layers where the architecture has them
TINY = {
    "qwen3_moe": dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
                      num_experts_per_tok=2, mlp_only_layers=[0], norm_topk_prob=True),
    "qwen2_moe": dict(num_hidden_layers=2, intermediate_size=48, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=3),
    "olmoe": dict(num_hidden_layers=2, intermediate_size=16, num_experts=8, num_experts_per_tok=2),
    "mixtral": dict(num_hidden_layers=2, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
                        num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
                        n_shared_experts=1, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, head_dim=8, routed_scaling_factor=2.5, num_key_value_heads=2,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "gpt_oss": dict(num_hidden_layers=2, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=8),
    "qwen3_next": dict(num_hidden_layers=4, intermediate_size=48, moe_intermediate_size=16,
                       shared_expert_intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                       linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                       linear_value_head_dim=8, linear_conv_kernel_dim=4, full_attention_interval=2),
}
LAYER_IDS = {"qwen3_moe": [1, 2], "deepseek_v3": [1, 2]}
_MODELS: dict = {}


def tiny_config(arch: str):
    return transformers.AutoConfig.for_model(arch, **{**COMMON, **TINY[arch]})


def tiny_model(arch: str):
    """A randomly initialised float32 model (built once per architecture)."""
    if arch not in _MODELS:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
        for site in find_routers(model):
            bias = getattr(site.module, "e_score_correction_bias", None)
            if bias is not None:  # a selection bias that changes the choice and the rank order
                bias.copy_(torch.rand_like(bias) * 0.2)
        _MODELS[arch] = model
    return _MODELS[arch]


def windows(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [Window(i, i % 2, rng.integers(0, VOCAB, n), "test") for i, n in enumerate(lengths)]


def record(model, wins, **kw) -> Rows:
    cfg = CaptureConfig(batch_size=kw.pop("batch_size", 8), **kw)
    rows: list[Rows] = []
    capture_windows(model, find_routers(model), wins, cfg, rows.append)
    return Rows(**{f: (np.concatenate([getattr(r, f) for r in rows]) if getattr(rows[0], f) is not None
                       else None) for f in rows[0].columns()})


def router_inputs(model, token_ids):
    """Run one unpadded sequence; return per MoE layer the hidden states its router received."""
    sites = find_routers(model)
    seen: dict[int, list] = {j: [] for j in range(len(sites))}
    handles = [s.module.register_forward_pre_hook(lambda m, a, j=j: seen[j].append(a[0].detach()))
               for j, s in enumerate(sites)]
    try:
        with torch.inference_mode():
            out = model(input_ids=torch.as_tensor(token_ids)[None])
    finally:
        for h in handles:
            h.remove()
    assert all(len(v) == 1 for v in seen.values())
    return sites, [seen[j][0].reshape(-1, seen[j][0].shape[-1]) for j in range(len(sites))], out.logits[0]


def reference_routing(site, x):
    """The router's own output on x, and an independent computation of its rank-ordered choice."""
    with torch.inference_mode():
        logits, weights, ids = site.module(x)
    logits = logits.reshape(-1, site.num_experts).float()
    k, m = site.top_k, site.module
    if site.family is LOGIT_TOPK:
        val, ref_ids = torch.topk(logits, k, dim=-1)
        ref_w = torch.softmax(val, dim=-1)
    elif site.family is GROUPED_SIGMOID:
        scores = logits.sigmoid()
        choice = scores + m.e_score_correction_bias
        groups = choice.view(-1, m.num_group, site.num_experts // m.num_group).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(groups).scatter_(1, groups.topk(m.topk_group, dim=-1)[1], 1)
        keep = keep.repeat_interleave(site.num_experts // m.num_group, dim=1).bool()
        ref_ids = choice.masked_fill(~keep, float("-inf")).topk(k, dim=-1)[1]  # sorted: rank order
        ref_w = scores.gather(1, ref_ids)
        if m.norm_topk_prob:
            ref_w = ref_w / (ref_w.sum(-1, keepdim=True) + 1e-20)
        ref_w = ref_w * m.routed_scaling_factor
    else:
        probs = torch.softmax(logits, dim=-1)
        ref_w, ref_ids = torch.topk(probs, k, dim=-1)
        if getattr(m, "norm_topk_prob", True):
            ref_w = ref_w / ref_w.sum(-1, keepdim=True)
    # the router's own ids are the same set (the model's choice, whatever its order)
    assert torch.equal(ids.reshape(-1, k).sort(-1)[0], ref_ids.sort(-1)[0])
    return logits, ref_ids, ref_w


def check_sequence(model, rows: Rows, seq: int) -> np.ndarray:
    """Recorded rows of one sequence equal the model's routing of it run alone; returns the LM logits."""
    sel = rows.seq == seq
    tokens = rows.token_id[sel]
    sites, xs, lm_logits = router_inputs(model, tokens)
    for j, (site, x) in enumerate(zip(sites, xs, strict=True)):
        logits, ids, w = reference_routing(site, x)
        np.testing.assert_array_equal(rows.experts[sel][:, j], ids.numpy())
        np.testing.assert_allclose(rows.weights[sel][:, j], w.numpy(), rtol=1e-5, atol=1e-6)
        if rows.logits is not None:
            np.testing.assert_allclose(rows.logits[sel][:, j], logits.numpy(), rtol=1e-3, atol=1e-3)
    return lm_logits.float().numpy()


def nll_of(lm_logits: np.ndarray, tokens: np.ndarray) -> np.ndarray:
    lp = lm_logits - np.log(np.exp(lm_logits - lm_logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) \
        - lm_logits.max(-1, keepdims=True)
    return np.r_[np.nan, -lp[np.arange(len(tokens) - 1), tokens[1:]]]


@pytest.mark.parametrize("arch", list(TINY))
def test_teacher_forced_records_the_models_routing(arch):
    model = tiny_model(arch)
    lengths = [9, 14, 3, 14, 6]
    rows = record(model, windows(lengths), batch_size=3, prefill_tokens=4)
    # no padding rows: exactly the real tokens, in (seq, pos) order
    assert rows.num_tokens == sum(lengths)
    np.testing.assert_array_equal(rows.seq, np.repeat(np.arange(5), lengths))
    np.testing.assert_array_equal(rows.pos, np.concatenate([np.arange(n) for n in lengths]))
    np.testing.assert_array_equal(rows.phase, np.where(rows.pos < 4, PHASE_PREFILL, PHASE_DECODE))
    np.testing.assert_array_equal(rows.domain, rows.seq % 2)
    for seq in range(5):
        lm = check_sequence(model, rows, seq)
        np.testing.assert_allclose(rows.nll[rows.seq == seq], nll_of(lm, rows.token_id[rows.seq == seq]),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", list(TINY))
def test_generation_records_the_models_routing(arch):
    model = tiny_model(arch)
    gen = GenerateConfig(prompt_tokens=6, new_tokens=4)
    rows = record(model, windows([10, 3, 7], seed=1), batch_size=3, mode="generate", generate=gen)
    counts = [6 + 4, 3 + 4, 6 + 4]
    assert rows.num_tokens == sum(counts)
    np.testing.assert_array_equal(rows.seq, np.repeat(np.arange(3), counts))
    for seq, n in enumerate(counts):
        sel = rows.seq == seq
        np.testing.assert_array_equal(rows.pos[sel], np.arange(n))
        np.testing.assert_array_equal(rows.phase[sel], [PHASE_PREFILL] * (n - 4) + [PHASE_DECODE] * 4)
        lm = check_sequence(model, rows, seq)  # KV-cache decode routes as a full forward would
        tokens = rows.token_id[sel]
        np.testing.assert_array_equal(tokens[n - 4:], lm[n - 5:n - 1].argmax(-1))  # greedy
        np.testing.assert_allclose(rows.nll[sel], nll_of(lm, tokens), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["qwen3_next", "deepseek_v3"])
def test_forwards_held_in_blocks_record_the_rows_of_forwards_handed_on_alone(arch):
    """record_block_tokens holds the routing of several forwards and hands it on in one block:
    the same rows as one forward at a time, with padded and unpadded forwards mixed (a run of
    equal-shape forwards takes one stack), look-ahead and full logits; no block larger than what
    comes after it, the last forward alone."""
    from traces.capture.config import LookaheadConfig

    model = tiny_model(arch)
    # batches of 2: (14, 14) twice and (9, 14) of 28 slots, (3, 6), (4, 4), (5, 5), (7, 7), (20, 20), (11,)
    wins = windows([14, 14, 14, 14, 9, 14, 3, 6, 4, 4, 5, 5, 7, 7, 20, 20, 11], seed=3)
    la = LookaheadConfig(enabled=True, depth=1, logits="full")
    kw = dict(batch_size=2, logits="full", lookahead=la, prefill_tokens=5)
    alone, blocks = [], []
    capture_windows(model, find_routers(model), wins, CaptureConfig(record_block_tokens=0, **kw), alone.append)
    capture_windows(model, find_routers(model), wins, CaptureConfig(record_block_tokens=100, **kw), blocks.append)
    assert [r.num_tokens for r in alone] == [28, 28, 23, 9, 8, 10, 14, 40, 11]
    # forwards of 28, 28, 28, 12, 8, 10, 14, 40 and 11 slots: held while the slots held and the
    # next forward's fit in 100 and in the slots of the forwards after the next (151, 123, 95, 83,
    # 75, 65, 51, 11, 0). The first block is one run of equal shape, padded or not
    assert [r.num_tokens for r in blocks] == [28 + 28 + 23, 9 + 8 + 10 + 14, 40, 11]
    kept = [f for f in Rows.__dataclass_fields__ if getattr(alone[0], f) is not None]
    assert {"logits", "lookahead_logits", "nll"} <= set(kept)
    for f in kept:
        a, b = (np.concatenate([getattr(r, f) for r in rows]) for rows in (alone, blocks))
        np.testing.assert_array_equal(a, b, err_msg=f)


@pytest.mark.parametrize("seed", range(6))
def test_blocks_keep_to_their_bounds_and_shrink_towards_the_end(seed, monkeypatch):
    """Random windows, batch sizes, record_block_tokens and device memory bounds: each block is
    consecutive forwards; a block of several holds no more token slots than record_block_tokens,
    nor router outputs than RECORD_BLOCK_BYTES, nor slots than the forwards after it, and could
    not have taken the next forward too; the last forward goes alone."""
    from traces.capture import capture as cap
    from traces.capture.hooks import RawStep

    rng = np.random.default_rng(seed)
    model = tiny_model("qwen3_moe")
    lengths = rng.integers(2, 20, size=int(rng.integers(6, 16))).tolist()
    batch, bound, bytes_bound = int(rng.integers(1, 4)), int(rng.integers(10, 90)), int(rng.integers(10, 90))
    per_slot = []
    take = RouterRecorder.take

    def spy(self, n):
        raw = take(self, n)
        per_slot.append(RawStep.nbytes(raw) / n)
        return raw

    monkeypatch.setattr(RouterRecorder, "take", spy)
    record(model, windows([3]), batch_size=1)
    monkeypatch.setattr(cap, "RECORD_BLOCK_BYTES", int(per_slot[0] * bytes_bound))
    bound_both = min(bound, bytes_bound)
    blocks = []
    capture_windows(model, find_routers(model), windows(lengths, seed=seed),
                    CaptureConfig(batch_size=batch, record_block_tokens=bound, logits="top:4"),
                    lambda rows: blocks.append(sorted(set((rows.seq // batch).tolist()))))
    slots = [len(lengths[i:i + batch]) * max(lengths[i:i + batch]) for i in range(0, len(lengths), batch)]
    assert [f for b in blocks for f in b] == list(range(len(slots)))  # consecutive, in order
    assert blocks[-1] == [len(slots) - 1]
    for b in blocks:
        held, after = sum(slots[f] for f in b), sum(slots[b[-1] + 1:])
        if len(b) > 1:
            assert held <= min(bound_both, after)
        if b[-1] + 1 < len(slots):  # the next forward did not fit
            assert held + slots[b[-1] + 1] > min(bound_both, sum(slots[b[-1] + 2:]))
    assert len(set(per_slot)) == 1  # a slot's router outputs take as many bytes in every forward


def test_a_block_of_forwards_is_handed_on_early_at_the_device_memory_bound(monkeypatch):
    """RECORD_BLOCK_BYTES bounds what a block holds: a bound of about two forwards' router
    outputs hands the rows on two forwards at a time, whatever record_block_tokens allows."""
    from traces.capture import capture as cap
    from traces.capture.hooks import RawStep

    model, wins = tiny_model("qwen3_moe"), windows([8] * 10, seed=5)
    per_forward = []
    take = RouterRecorder.take

    def spy(self, n):
        raw = take(self, n)
        per_forward.append(RawStep.nbytes(raw))
        return raw

    monkeypatch.setattr(RouterRecorder, "take", spy)
    record(model, wins[:1], batch_size=1)
    monkeypatch.setattr(cap, "RECORD_BLOCK_BYTES", 2 * per_forward[0])
    sizes = []
    capture_windows(model, find_routers(model), wins, CaptureConfig(batch_size=1, logits="top:4"),
                    lambda rows: sizes.append(rows.num_tokens))
    assert sizes == [16, 16, 16, 16, 8, 8]  # two at a time; the one before the last, and the last, alone


def test_metadata_per_architecture():
    meta = routing_metadata(tiny_model("deepseek_v3"), find_routers(tiny_model("deepseek_v3")))
    assert meta["layer_ids"] == [1, 2] and meta["score_function"] == "sigmoid" and meta["renormalize"]
    assert meta["extra"]["routed_scaling_factor"] == 2.5 and meta["extra"]["n_group"] == 4
    assert meta["extra"]["shared_experts"] == 1 and meta["extra"]["selection_bias"]
    assert meta["expert_bytes"] == [3 * 32 * 16 * 4] * 2  # gate, up, down of 32 x 16 in float32
    qwen = routing_metadata(tiny_model("qwen3_moe"), find_routers(tiny_model("qwen3_moe")))
    assert qwen["layer_ids"] == [1, 2] and qwen["extra"]["shared_experts"] == 0
    q2 = routing_metadata(tiny_model("qwen2_moe"), find_routers(tiny_model("qwen2_moe")))
    assert not q2["renormalize"] and q2["extra"]["shared_expert_gate"] == "sigmoid"
    assert q2["extra"]["shared_expert_bytes"] == [3 * 32 * 24 * 4] * 2
    oss = routing_metadata(tiny_model("gpt_oss"), find_routers(tiny_model("gpt_oss")))
    assert oss["renormalize"] and oss["expert_bytes"][0] == (3 * 32 * 16 + 2 * 16 + 32) * 4


def test_hook_must_fire_once_per_forward():
    model = tiny_model("olmoe")
    sites = find_routers(model)
    ids = torch.zeros(1, 4, dtype=torch.long)
    with torch.inference_mode(), RouterRecorder(sites) as rec:
        model(input_ids=ids)
        model(input_ids=ids)
        with pytest.raises(RuntimeError, match="exactly once"):
            rec.collect(4)
        model(input_ids=ids)
        assert rec.collect(4).experts.shape == (4, 2, 2)


def test_router_returning_probabilities_is_recorded_as_log_probabilities():
    """Some transformers releases return the softmax as 'router_logits'; the trace keeps logits."""
    model = tiny_model("mixtral")
    sites = find_routers(model)
    assert not router_returns_probabilities(model, sites)
    true_logits = []
    originals = [s.module.forward for s in sites]

    def as_probs(forward):
        def wrapped(x):
            logits, weights, ids = forward(x)
            true_logits.append(logits.detach())
            return torch.softmax(logits.float(), dim=-1), weights, ids
        return wrapped

    try:
        for s in sites:
            s.module.forward = as_probs(s.module.forward)
        probs = router_returns_probabilities(model, sites)
        assert probs
        true_logits.clear()
        rows: list[Rows] = []
        capture_windows(model, sites, windows([5]), CaptureConfig(), rows.append, logits_are_probs=probs)
    finally:
        for s, f in zip(sites, originals, strict=True):
            s.module.forward = f
    expected = torch.log_softmax(torch.stack(true_logits, 1).float(), dim=-1).numpy()
    np.testing.assert_allclose(rows[0].logits, expected, rtol=2e-3, atol=2e-3)


def test_top_r_capture_stores_the_models_highest_logits(tmp_path):
    from traces.capture.capture import build_meta, open_writer
    from traces.format import read_trace

    model, r = tiny_model("qwen3_moe"), 3  # 8 experts, top-2
    sites = find_routers(model)
    meta = build_meta(model, sites, "tiny", ["a", "b"], CaptureConfig(logits=f"top:{r}"), {})
    assert meta.has_logits and meta.logits_top_r == r and "logits_storage_note" not in meta.extra
    path = tmp_path / "top.parquet"
    with open_writer(path, meta) as writer:
        capture_windows(model, sites, windows([9, 14, 5]), CaptureConfig(logits=f"top:{r}", batch_size=2),
                        lambda rows: writer.write(**rows.columns()))
    meta, chunk = read_trace(path)
    assert meta.logits_top_r == r and chunk.logits.shape == (28, 2, 8)
    for seq in range(3):
        sel = chunk.seq == seq
        sites, xs, _ = router_inputs(model, chunk.token_id[sel])
        for j, (site, x) in enumerate(zip(sites, xs, strict=True)):
            logits, ids, _ = reference_routing(site, x)
            logits, got = logits.numpy(), chunk.logits[sel][:, j]
            np.testing.assert_array_equal(chunk.experts[sel][:, j], ids.numpy())
            kept = np.isfinite(got)
            assert (kept.sum(-1) == r).all() and (got[~kept] == -np.inf).all()
            np.testing.assert_allclose(got[kept], logits[kept], rtol=1e-3, atol=1e-3)
            # the kept ones are the model's R highest (up to float16 rounding of near ties)
            lowest_kept = np.where(kept, logits, np.inf).min(-1)
            assert (np.where(kept, -np.inf, logits).max(-1) <= lowest_kept + 1e-3).all()


@pytest.mark.parametrize("seed", range(6))
def test_capture_top_r_selection_equals_the_formats(seed):
    """The capture's top-R (float16 scores, on the device) picks and orders exactly as the
    format's numpy definition: ties to the lower id, -0.0 equal to 0.0, selected experts kept
    even below the R highest, a selected expert's +inf score tied with a real +inf."""
    from traces.capture.capture import top_r_logits
    from traces.format import TraceMeta, _stored_logits

    rng = np.random.default_rng(seed)
    E = int(rng.choice([8, 64, 512]))
    k = int(rng.integers(1, 9))
    r = int(rng.integers(k, E + 1))
    n, L = 37, 3
    tied = np.array([-np.inf, -3.5, -1.0, -0.0, 0.0, 6e-8, 0.5, 2.25, 65504, np.inf], np.float16)
    logits = (tied[rng.integers(0, len(tied), (n, L, E))] if seed % 2
              else rng.normal(size=(n, L, E)).astype(np.float16))
    experts = np.argsort(rng.random((n, L, E)), axis=-1)[..., :k]  # not the highest: kept anyway
    meta = TraceMeta.__new__(TraceMeta)
    meta.logits_top_r = r
    want = _stored_logits(meta, logits, experts)
    values, ids = top_r_logits(torch.from_numpy(logits), torch.from_numpy(experts), r)
    np.testing.assert_array_equal(ids.numpy(), want["logit_ids"])
    np.testing.assert_array_equal(values.numpy().view(np.uint16), want["logits"].view(np.uint16))


def test_top_r_cost_compares_the_capture_selection_with_the_float32_yardstick(monkeypatch):
    from traces.capture import top_r_cost
    from traces.capture.capture import top_r_logits

    shape = ("tiny", 64, 2, 16, 3, 5)
    fig = top_r_cost.measure("cpu", repeats=2, shapes=(shape,))
    (row,) = fig["shapes"]
    assert row["equal"] and row["format_equal"] and row["float16_ms"] > 0 and row["float32_ms"] > 0
    assert row["kernel_ms"] is None  # no GPU: the kernel is neither timed nor compared
    # a float16 selection that differs from the yardstick's and the format's is reported as such
    def flipped(logits, experts, r):
        return top_r_logits(logits.flip(-1), experts, r, kernel=False)

    monkeypatch.setattr(top_r_cost, "float16_sorts", flipped)
    (row,) = top_r_cost.measure("cpu", repeats=1, shapes=(shape,))["shapes"]
    assert not row["equal"] and not row["format_equal"]


def test_top_r_cost_refuses_a_missing_cuda_device_in_one_line(capsys, monkeypatch):
    from traces.capture import top_r_cost

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        top_r_cost.main(["--device", "cuda"])
    assert exc.value.code == 2 and "--device cuda" in capsys.readouterr().err


def test_logits_storage_values():
    assert parse_logits_storage("full") == ("full", None)
    assert parse_logits_storage("top:8") == ("top", 8)
    for bad in ("top:0", "top:x", "all"):
        with pytest.raises(InputError):
            parse_logits_storage(bad)


def test_dense_model_is_refused():
    config = transformers.AutoConfig.for_model("qwen3", **COMMON, num_hidden_layers=1, intermediate_size=16)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(InputError, match="no MoE router"):
        find_routers(model)


def _tiny_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0} | {chr(c): i + 1 for i, c in enumerate(range(32, 32 + VOCAB - 1))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>").save_pretrained(folder)


def test_run_capture_writes_a_trace_and_refuses_to_overwrite(tmp_path):
    from traces.format import open_trace

    tiny_config("qwen3_moe").save_pretrained(tmp_path / "m")
    _tiny_tokenizer(tmp_path / "m")
    (tmp_path / "text" / "prose").mkdir(parents=True)
    (tmp_path / "text" / "prose" / "a.txt").write_text("the quick brown fox " * 10)
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "def f(x): return x\n" * 5, "domain": "code"}))
    cfg = CaptureConfig(
        model=ModelConfig(config=str(tmp_path / "m" / "config.json"), dtype="float32", device="cpu"),
        input=InputConfig(paths=[str(tmp_path / "text"), str(tmp_path / "more.jsonl")], window_tokens=64, min_window_tokens=2),
        out=str(tmp_path / "t.parquet"), batch_size=2, progress=False,
    )
    import traces.capture.capture as C

    expected, real_open = [], C.open_writer
    C.open_writer = lambda *a, **k: (expected.append(a[6]), real_open(*a, **k))[1]
    try:
        stats = run_capture(cfg)
    finally:
        C.open_writer = real_open
    assert stats["tokens"] == 200 + 95 and stats["layers"] == 2
    assert expected == [stats["tokens"]]  # the writer knows which write is the last
    # the loop's waits for the writer, on its queue and to lend memory: parts of the capture's time
    assert 0 <= stats["blocked_s"] + stats["lend_wait_s"] <= stats["seconds"] and stats["lend_wait_s"] >= 0
    trace = open_trace(cfg.out)
    assert trace.meta.layer_ids == [1, 2] and trace.meta.domains == ["prose", "code"]
    assert trace.meta.has_logits and trace.meta.source == "capture"
    chunk = next(iter(trace.iter_chunks()))
    assert chunk.num_tokens == 295 and set(np.unique(chunk.domain)) == {0, 1}
    with pytest.raises(InputError, match="force=true"):
        run_capture(cfg)
    cfg.force, cfg.logits = True, "none"
    run_capture(cfg)
    assert not open_trace(cfg.out).meta.has_logits
    cfg.logits = "top:3"
    run_capture(cfg)
    meta = open_trace(cfg.out).meta
    assert meta.has_logits and meta.logits_top_r == 3 and meta.extra["logits_storage"] == "top:3"


def test_app_refuses_a_dense_model_with_one_line_and_exit_2(tmp_path, monkeypatch, capsys):
    from traces.capture import app

    config = transformers.AutoConfig.for_model("qwen3", **COMMON, num_hidden_layers=1, intermediate_size=16)
    config.save_pretrained(tmp_path)
    (tmp_path / "x.txt").write_text("some text")
    monkeypatch.setattr(sys, "argv", [
        "moe-capture", f"model.config={tmp_path / 'config.json'}", f"input.paths=[{tmp_path / 'x.txt'}]",
        f"out={tmp_path / 'o.parquet'}", f"hydra.run.dir={tmp_path / 'run'}",
    ])
    with pytest.raises(SystemExit) as exc:
        app.main()
    assert exc.value.code == EXIT_INPUT_ERROR
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "no MoE router" in lines[0]
    assert not (tmp_path / "o.parquet").exists()


def hidden_states(model, token_ids):
    """One unpadded sequence: per MoE layer its router's input and its decoder layer's output."""
    sites = find_routers(model)
    seen: dict[str, dict[int, list]] = {"moe_input": {}, "layer_output": {}}
    handles = []
    for j, s in enumerate(sites):
        handles.append(s.module.register_forward_pre_hook(
            lambda m, a, j=j: seen["moe_input"].setdefault(j, []).append(a[0].detach())))
        handles.append(s.decoder_layer.register_forward_hook(
            lambda m, a, out, j=j: seen["layer_output"].setdefault(j, []).append(
                (out[0] if isinstance(out, tuple) else out).detach())))
    try:
        with torch.inference_mode():
            model(input_ids=torch.as_tensor(token_ids)[None])
    finally:
        for h in handles:
            h.remove()
    return sites, {src: [v[j][0].reshape(-1, v[j][0].shape[-1]) for j in range(len(sites))]
                   for src, v in seen.items()}


def lookahead_reference(sites, hidden, source: str, j: int, d: int) -> np.ndarray:
    """float32[n, E]: router j+d's own logits on layer j's hidden state, computed directly."""
    target = sites[j + d]
    x = hidden[source][j]
    with torch.inference_mode():
        if source == "layer_output":
            x = target.decoder_layer.post_attention_layernorm(x)
        logits, _, _ = target.module(x)
    return logits.reshape(x.shape[0], -1).float().numpy()


def capture_file(model, wins, path, **cfg_fields):
    """Capture ``wins`` into ``path`` through the capture's own writer and, as moe-capture does by
    default, the writer's shared memory (``shared_rows``); returns (meta, chunk)."""
    from traces.capture.capture import build_meta, open_writer
    from traces.format import read_trace

    cfg = CaptureConfig(**cfg_fields)
    sites = find_routers(model)
    meta = build_meta(model, sites, "tiny", ["a", "b"], cfg, {})
    with open_writer(path, meta, workers=3) as writer:
        capture_windows(model, sites, wins, cfg, lambda rows: writer.write(**rows.columns()),
                        block=writer.block if cfg.shared_rows else None)
    return read_trace(path)


LOOKAHEAD_CASES = [("moe_input", "top:3"), ("layer_output", "full")]


@pytest.mark.parametrize("arch", list(TINY))
@pytest.mark.parametrize(("source", "storage"), LOOKAHEAD_CASES, ids=[c[0] for c in LOOKAHEAD_CASES])
def test_lookahead_equals_the_routers_ahead_on_layer_l(arch, source, storage, tmp_path):
    """Recorded look-ahead = router_{l+d}(hidden state of layer l), as the model's own routers compute it."""
    from traces.capture.config import LookaheadConfig

    model = tiny_model(arch)
    L = len(find_routers(model))
    depth = min(2, L - 1)
    lookahead = LookaheadConfig(enabled=True, depth=depth, source=source, logits=storage)
    meta, chunk = capture_file(model, windows([9, 14, 5]), tmp_path / "la.parquet", batch_size=2,
                               lookahead=lookahead)
    width = 3 if storage == "top:3" else 8
    assert (meta.lookahead_depth, meta.lookahead_source) == (depth, source)
    assert meta.lookahead_top_r == (3 if storage == "top:3" else 0)
    assert chunk.lookahead_ids.shape == (28, L, depth, width)
    for seq in range(3):
        sel = chunk.seq == seq
        sites, hidden = hidden_states(model, chunk.token_id[sel])
        ids, got = chunk.lookahead_ids[sel], chunk.lookahead_logits[sel]
        for j in range(L):
            for d in range(1, depth + 1):
                if j + d >= L:  # no layer l + d: the sentinel
                    assert (ids[:, j, d - 1] == -1).all() and (got[:, j, d - 1] == -np.inf).all()
                    continue
                ref = lookahead_reference(sites, hidden, source, j, d)
                np.testing.assert_allclose(got[:, j, d - 1], np.take_along_axis(ref, ids[:, j, d - 1], -1),
                                           rtol=1e-3, atol=1e-3)
                # the listed experts are the router's highest, in order (up to float16 rounding)
                kept = np.zeros_like(ref, dtype=bool)
                np.put_along_axis(kept, ids[:, j, d - 1], True, -1)
                assert (np.where(kept, -np.inf, ref).max(-1) <= np.where(kept, ref, np.inf).min(-1) + 1e-3).all()
                assert (np.diff(got[:, j, d - 1], axis=-1) <= 0).all()


def test_lookahead_in_generation_follows_the_kv_cache_decode(tmp_path):
    """Decode steps (one token per forward, KV cache) record the same look-ahead as a full forward."""
    from traces.capture.config import LookaheadConfig

    model = tiny_model("qwen3_next")
    gen = GenerateConfig(prompt_tokens=5, new_tokens=4)
    meta, chunk = capture_file(model, windows([8, 6], seed=2), tmp_path / "gen.parquet", batch_size=2,
                               mode="generate", generate=gen, lookahead=LookaheadConfig(enabled=True, depth=3))
    for seq in range(2):
        sel = chunk.seq == seq
        sites, hidden = hidden_states(model, chunk.token_id[sel])
        for j in range(3):
            ref = lookahead_reference(sites, hidden, "moe_input", j, 3 - j)
            ids = chunk.lookahead_ids[sel][:, j, 2 - j]
            np.testing.assert_allclose(chunk.lookahead_logits[sel][:, j, 2 - j],
                                       np.take_along_axis(ref, ids, -1), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(("kind", "shared"), [("threads", "no"), ("threads", "yes"), ("processes", "yes"),
                                             ("processes", "refused"), ("dispatcher", "yes"), ("dispatcher", "no")])
def test_capture_writes_what_the_single_writer_wrote_before(tmp_path, kind, shared):
    """Top-R on the device and row groups encoded in parallel give the trace the host path gave;
    also with the rows written into the writer's shared memory (``shared``), where the encoder
    threads or processes read them in place, and where the writer has no room for them; and with
    the whole writer in a dispatcher process."""
    from traces.capture.capture import build_meta
    from traces.format import TraceWriter, read_trace

    model, wins = tiny_model("deepseek_v3"), windows([9, 14, 3, 14, 6, 11], seed=4)  # biased selection
    sites = find_routers(model)
    # before: dense float16 logits, the top R chosen by the format on the host, one writer thread
    dense = record(model, wins, logits="full", batch_size=4)
    meta = build_meta(model, sites, "tiny", ["a", "b"], CaptureConfig(logits="top:5"), {})
    with TraceWriter(tmp_path / "before.parquet", meta) as writer:
        writer.write(**dense.columns())
    # now: the capture's defaults with small units, so the file joins many parts
    with open_writer_units(tmp_path / "now.parquet", meta, unit_tokens=5, kind=kind) as writer:
        capture_windows(model, sites, wins, CaptureConfig(logits="top:5", batch_size=4),
                        lambda rows: writer.write(**rows.columns()),
                        block={"no": None, "yes": writer.block, "refused": lambda columns: None}[shared])
    before, now = read_trace(tmp_path / "before.parquet"), read_trace(tmp_path / "now.parquet")
    assert before[0] == now[0]
    for name in ("seq", "pos", "phase", "token_id", "domain", "experts", "gates", "logits", "nll"):
        np.testing.assert_array_equal(getattr(before[1], name), getattr(now[1], name), err_msg=name)
    import pyarrow.parquet as pq

    assert pq.ParquetFile(tmp_path / "now.parquet").metadata.num_row_groups == -(-57 // 5)


# In Triton's interpreter (CPU tensors; a process of its own): captures with the stored-rows
# kernel and with the steps it replaces store the same trace, with padded forwards, blocks of
# forwards, a float32 model with a selection bias and a bfloat16 one, rows in the writer's shared
# memory and in buffers of their own.
ROWS_KERNEL_CAPTURE = """
import sys, tempfile
from pathlib import Path
import torch
sys.path.insert(0, "tests")
from test_capture import tiny_model, windows
from traces.capture import top_r
from traces.capture.capture import build_meta, capture_windows, open_writer
from traces.capture.config import CaptureConfig
from traces.capture.routers import find_routers
from traces.format import recorded_content_hash
launches = []
real = top_r.stored_rows
top_r.uses_rows_kernel = lambda logits: True  # the interpreter runs the kernel on CPU tensors
top_r.stored_rows = lambda *args: launches.append(1) or real(*args)
bad = []
for arch, dtype in (("deepseek_v3", torch.float32), ("qwen3_next", torch.bfloat16)):
    model = tiny_model(arch).to(dtype)
    sites = find_routers(model)
    wins = windows([9, 14, 3, 14, 6, 11, 14, 14], seed=4)
    for shared in (False, True):
        hashes = []
        for fused in (False, True):
            cfg = CaptureConfig(logits="top:5", batch_size=3, rows_kernel=fused, record_block_tokens=40)
            path = Path(tempfile.mkdtemp()) / "t.parquet"
            before = len(launches)
            with open_writer(path, build_meta(model, sites, "tiny", ["a", "b"], cfg, {}), workers=2,
                             writer="threads", unit_tokens=7) as w:
                capture_windows(model, sites, wins, cfg, lambda rows: w.write(**rows.columns()),
                                block=w.block if shared else None)
            if (len(launches) > before) != fused:
                bad.append((arch, shared, fused, "launches"))
            hashes.append(recorded_content_hash(path))
        if hashes[0] != hashes[1] or hashes[0] is None:
            bad.append((arch, shared, hashes))
print("ok" if not bad else bad)
"""


@pytest.mark.skipif(not __import__("importlib").util.find_spec("triton"), reason="Triton is not installed")
def test_the_stored_rows_kernel_captures_the_trace_the_steps_capture():
    import os
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", ROWS_KERNEL_CAPTURE], env=env, capture_output=True, text=True,
                          timeout=900, cwd=Path(__file__).parent.parent)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), (done.stdout[-2000:], done.stderr[-2000:])


def test_a_stored_rows_kernel_that_fails_leaves_the_steps_once_with_a_warning(monkeypatch, broken_kernel):
    """The block it failed on, and every one after, stored step by step: the same rows."""
    from traces.capture import top_r

    kernel, launches = broken_kernel
    model, wins = tiny_model("deepseek_v3"), windows([9, 14, 3, 14, 6, 11], seed=4)
    want = record(model, wins, logits="top:5", batch_size=2, rows_kernel=False)
    monkeypatch.setattr(top_r, "_rows_kernel", lambda: kernel)
    monkeypatch.setattr(top_r, "_ROWS_FAILED", [])
    monkeypatch.setattr(top_r, "uses_rows_kernel", lambda logits: not top_r._ROWS_FAILED)
    with pytest.warns(RuntimeWarning, match="stored-rows kernel failed .*no compiler.*step by step instead"):
        got = record(model, wins, logits="top:5", batch_size=2, rows_kernel=True)
    assert len(launches) == 1 and top_r._ROWS_FAILED == ["RuntimeError: no compiler for this GPU"]
    for name, value in want.columns().items():
        if value is None:
            assert getattr(got, name) is None, name
        else:
            np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)


def open_writer_units(path, meta, unit_tokens, kind="threads"):
    from traces.capture.capture import open_writer

    return open_writer(path, meta, workers=3, writer=kind, unit_tokens=unit_tokens)


def test_a_capture_in_many_parts_records_the_content_hash_one_writer_of_its_rows_records(tmp_path, capsys):
    """The joined file's content hash, metadata and page checksums are those of one file."""
    from traces.capture.capture import build_meta
    from traces.capture.config import LookaheadConfig
    from traces.cli import main
    from traces.format import TraceWriter, recorded_content_hash

    model, wins = tiny_model("qwen3_moe"), windows([12, 7, 15, 9], seed=6)
    sites = find_routers(model)
    cfg = CaptureConfig(logits="top:4", batch_size=2, lookahead=LookaheadConfig(enabled=True, logits="top:3"))
    meta = build_meta(model, sites, "tiny", ["a", "b"], cfg, {})
    captured: list[Rows] = []
    many, one = tmp_path / "many.parquet", tmp_path / "one.parquet"
    with open_writer_units(many, meta, unit_tokens=4) as writer:
        def write(rows: Rows) -> None:
            captured.append(rows)
            writer.write(**rows.columns())

        capture_windows(model, sites, wins, cfg, write)
    with TraceWriter(one, meta) as writer:
        for rows in captured:
            writer.write(**rows.columns())
    import pyarrow.parquet as pq

    assert pq.ParquetFile(many).metadata.num_row_groups == -(-43 // 4)  # one part per 4 tokens
    assert recorded_content_hash(many) == recorded_content_hash(one) is not None
    assert main(["info", str(many), "--verify"]) == 0 and "verified" in capsys.readouterr().out


def test_lookahead_settings_are_checked_before_the_model_runs():
    from traces.capture.capture import Storage
    from traces.capture.config import LookaheadConfig

    def storage(**la):
        return Storage.of(CaptureConfig(lookahead=LookaheadConfig(enabled=True, **la)), 8, 3)

    assert storage(logits="top:8").lookahead_top_r == 0  # all E: the ids would add nothing
    assert storage(logits="top:4").lookahead_top_r == 4
    assert Storage.of(CaptureConfig(logits="top:8"), 8, 3).logits == "full"
    for bad, words in [({"depth": 3}, "lookahead.depth=3"), ({"source": "attention"}, "lookahead.source"),
                       ({"logits": "none"}, "lookahead.logits=none"), ({"logits": "top:0"}, "lookahead.logits")]:
        with pytest.raises(InputError, match=words):
            storage(**bad)


def test_writer_settings_are_checked_before_the_model_runs():
    from traces.capture.capture import check_config

    for bad, words in [({"writer": "fork"}, "writer=fork is not valid; choose one of: processes, threads"),
                       ({"writers": -1}, "writers=-1 must be >= 0"),
                       ({"unit_tokens": -5}, "unit_tokens=-5 must be >= 0"),
                       ({"recording_stream": "other"}, "recording_stream=other is not valid; choose one of: side, main"),
                       ({"record_block_tokens": -1}, r"record_block_tokens=-1 must be >= 0 \(0: every forward's rows")]:
        with pytest.raises(InputError, match=words):  # before the input paths are looked at
            check_config(CaptureConfig(**bad))
    with pytest.raises(InputError, match="input.paths is empty"):
        check_config(CaptureConfig(writer="threads"))


def test_a_shared_folder_that_is_not_one_is_refused_before_the_model_runs(tmp_path, monkeypatch):
    from traces.capture.capture import check_config
    from traces.capture.config import InputConfig

    monkeypatch.setenv("MOE_TRACE_SHARED_DIR", str(tmp_path / "no"))
    with pytest.raises(InputError, match=r"^MOE_TRACE_SHARED_DIR=\S+/no is not a folder; create it .* or unset it$"):
        check_config(CaptureConfig(input=InputConfig(paths=[str(tmp_path)])))
    monkeypatch.setenv("MOE_TRACE_SHARED_DIR", str(tmp_path))
    check_config(CaptureConfig(input=InputConfig(paths=[str(tmp_path)])))


def _tiny_model_dir(tmp_path) -> Path:
    tiny_config("qwen3_moe").save_pretrained(tmp_path / "m")
    _tiny_tokenizer(tmp_path / "m")
    (tmp_path / "a.txt").write_text("the quick brown fox jumps over the lazy dog " * 8)
    return tmp_path / "m" / "config.json"


def test_plain_capture_command_takes_moe_captures_overrides(tmp_path, capsys):
    """python -m traces.capture: the GPU hosts' path without Hydra, same override names."""
    from traces.capture.__main__ import main
    from traces.format import read_trace

    config = _tiny_model_dir(tmp_path)
    summary, out = tmp_path / "run" / "capture.json", tmp_path / "t.parquet"
    common = [f"model.config={config}", "model.dtype=float32", "model.device=cpu", f"input.paths=[{tmp_path / 'a.txt'}]",
              "input.window_tokens=40", "batch_size=2", "progress=false", f"out={out}"]
    main([f"--summary={summary}", *common, "lookahead.enabled=true", "lookahead.logits=top:3", "logits=top:4",
          "unit_tokens=100"])
    stats = json.loads(summary.read_text())
    meta, chunk = read_trace(out)
    assert stats["tokens"] == chunk.num_tokens == 352 and stats["path"] == str(out)
    import pyarrow.parquet as pq

    md = pq.ParquetFile(out).metadata  # one row group per unit of 100 tokens x 2 layers
    assert [md.row_group(i).num_rows for i in range(md.num_row_groups)] == [200, 200, 200, 104]
    assert (meta.logits_top_r, meta.lookahead_depth, meta.lookahead_top_r) == (4, 1, 3)
    assert capsys.readouterr().out.startswith("moe-capture: 352 tokens x 2 MoE layers")
    for bad, words in [("batch_sise=3", "'batch_sise=3' is not key=value"), ("lookahead.depth=x", "is not a valid int"),
                       ("lookahead=3", "is not key=value"), ("force=yes", "force=yes is not a valid bool")]:
        with pytest.raises(SystemExit) as exc:
            main([*common, "force=true", bad])
        assert exc.value.code == EXIT_INPUT_ERROR
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0], err


def test_bench_measures_the_capture_defaults_and_prints_a_table(tmp_path, capsys):
    from traces.capture import bench

    config = _tiny_model_dir(tmp_path)
    out = tmp_path / "bench.json"
    bench.main(["--config", str(config), "--input", str(tmp_path / "a.txt"), "--tokens", "200", "--window", "50",
                "--batch-sizes", "1,4", "--repeats", "1", "--device", "cpu", "--dtype", "float32",
                "--lookahead-depth", "1", "--writers", "2,1", "--writer", "processes,threads,dispatcher",
                "--unit-tokens", "30", "--shared-rows", "1,0", "--recording-stream", "side,main", "--out", str(out)])
    result = json.loads(out.read_text())
    writers = ("processes", "threads", "dispatcher")  # side by side in the same rounds: one forward for all
    streams = ("side", "main")
    assert [(r["writer"], r["recording_stream"], r["writers"], r["batch_size"], r["shared_rows"])
            for r in result["runs"]] == [
        (w, st, n, b, s) for n in (2, 1) for b in (1, 4) for s in (True, False) for w in writers for st in streams]
    for i in range(0, len(result["runs"]), 6):
        same = result["runs"][i:i + 6]
        assert len({(r["forward_tokens_per_s"], tuple(r["rounds_s"]["forward"])) for r in same}) == 1
        # the hooks pass of a stream is shared by its writers, and the two streams' are two passes
        hooks = {r["recording_stream"]: tuple(r["rounds_s"]["hooks"]) for r in same}
        assert all(tuple(r["rounds_s"]["hooks"]) == hooks[r["recording_stream"]] for r in same)
    assert result["device"] == "cpu"
    import tempfile
    assert result["page_cache"]["folder"] == tempfile.gettempdir()  # where the capture passes wrote
    for r in result["runs"]:  # one timed pass each: the pages dirty and under writeback at its close
        assert {k: len(v) for k, v in r["dirty_at_close_mib"].items()} == {"dirty": 1, "writeback": 1}
    from traces.provenance import capture_commit, sources_fingerprint
    assert result["capture_commit"] == capture_commit()  # the code timed (tests/test_provenance.py)
    assert result["capture_sources"] == sources_fingerprint()
    for r in result["runs"]:
        assert r["logits"] == CaptureConfig().logits and r["lookahead"].startswith("1 x")
        assert r["tokens"] == 200 and r["unit_tokens"] == 30 and r["open_s"] >= 0
        # the overhead is the time ratio of the two rates (each rounded to a whole token/s)
        fwd, cap = r["forward_tokens_per_s"], r["capture_tokens_per_s"]
        assert (fwd - 0.5) / (cap + 0.5) - 1e-3 <= 1 + r["capture_overhead_pct"] / 100 <= (fwd + 0.5) / (cap - 0.5) + 1e-3
        assert 0 <= r["writer_wait_pct"] <= 100 and 0 <= r["lend_wait_pct"] <= 100
        # one round: the by-round overhead is that round's ratio (its times rounded to 1 ms)
        (c,), (f,) = r["rounds_s"]["capture"], r["rounds_s"]["forward"]
        assert (c - 5e-4) / (f + 5e-4) - 1e-3 <= 1 + r["capture_overhead_by_round_pct"] / 100 <= (c + 5e-4) / (f - 5e-4) + 1e-3
        # one round: nothing to resample, the intervals are that round's figures
        assert r["capture_overhead_by_round_ci95_pct"] == [r["capture_overhead_by_round_pct"]] * 2
        assert r["hooks_overhead_by_round_ci95_pct"] == [r["hooks_overhead_by_round_pct"]] * 2
        assert r["capture_overhead_ci95_pct"] == [r["capture_overhead_by_round_pct"]] * 2
    printed = capsys.readouterr().out.splitlines()
    assert any(line.endswith(f"tokens per pass, capture code of {result['capture_commit']} "
                             f"(sources {result['capture_sources']}):") for line in printed)
    table = [line for line in printed if line.startswith("| top:64 |")]
    # the default record_block_tokens (8,192) as it acted: four 50-token forwards two at a time,
    # then the last two alone; one forward of four windows alone
    assert [r["record_block_forwards"] for r in result["runs"]] == [2 if r["batch_size"] == 1 else 1
                                                                    for r in result["runs"]]
    assert len(table) == 48 and [table[i].split("|")[3:5] for i in (18, 27, 35)] == [
        [" 2 processes, 30-token units, rows copied, recording on the side stream, " + ALONE, " 4 "],
        [" 1 threads, 30-token units, rows shared in place, recording on the main stream, " + HELD, " 1 "],
        [" 1 dispatcher, 30-token units, rows copied, recording on the main stream, " + HELD, " 1 "]]


HELD = "forwards held in blocks of 8,192 tokens (up to 2) "  # the default record_block_tokens, in the bench's table
ALONE = "forwards handed on alone (record_block_tokens 8,192 holds no two of them) "


def _bench_spied(tmp_path, monkeypatch, spy, *flags) -> list[dict]:
    """The bench's runs on a tiny model (CPU, 200 tokens in 50-token windows, one encoder), each
    ``capture_windows`` call going through ``spy(real, model, sites, windows, cfg, write, ...)``."""
    from traces.capture import bench
    from traces.capture import capture as C

    real = C.capture_windows
    monkeypatch.setattr(C, "capture_windows", lambda *args, **kwargs: spy(real, *args, **kwargs))
    out = tmp_path / "bench.json"
    bench.main(["--config", str(_tiny_model_dir(tmp_path)), "--input", str(tmp_path / "a.txt"), "--tokens", "200",
                "--window", "50", "--device", "cpu", "--dtype", "float32", "--writers", "1", *flags,
                "--out", str(out)])
    return json.loads(out.read_text())["runs"]


def test_bench_compares_forwards_held_in_blocks_with_forwards_alone_in_the_same_rounds(tmp_path, capsys,
                                                                                         monkeypatch):
    writes: dict[int, list[int]] = {}

    def spy(real, model, sites, windows, cfg, write, *args, **kwargs):
        n = writes.setdefault(cfg.record_block_tokens, [])
        n.append(0)

        def counted(rows):
            n[-1] += 1
            return write(rows)
        return real(model, sites, windows, cfg, counted, *args, **kwargs)

    runs = _bench_spied(tmp_path, monkeypatch, spy, "--batch-sizes", "1", "--repeats", "1", "--writer", "threads",
                        "--record-block-tokens", "100,0")
    assert [r["record_block_tokens"] for r in runs] == [100, 0]
    assert [r["record_block_forwards"] for r in runs] == [2, 1]
    assert len({tuple(r["rounds_s"]["forward"]) for r in runs}) == 1  # one forward for both
    # four forwards of 50 tokens: in blocks of 100, two together, then the last two alone; per pass
    # (a warm-up and a round), a hooks pass and a capture pass of each setting
    assert writes == {100: [3] * 4, 0: [4] * 4}
    rows = [line.split("|")[3].strip() for line in capsys.readouterr().out.splitlines() if line.startswith("| top:64 |")]
    assert [r.split("stream, ")[1] for r in rows] == ["forwards held in blocks of 100 tokens (up to 2)",
                                                     "forwards handed on alone"]


def test_bench_compares_the_top_r_kernel_with_the_sorts_in_the_same_rounds(tmp_path, capsys, monkeypatch):
    calls = []

    def spy(real, model, sites, windows, cfg, write, *args, block=None, **kwargs):
        calls.append((cfg.top_r_kernel, block is not None))  # a capture lends the writer's memory
        return real(model, sites, windows, cfg, write, *args, block=block, **kwargs)

    runs = _bench_spied(tmp_path, monkeypatch, spy, "--batch-sizes", "4", "--repeats", "2",
                        "--writer", "threads,dispatcher", "--top-r-kernel", "1,0")
    assert [(r["writer"], r["top_r_kernel"]) for r in runs] == [
        ("threads", True), ("threads", False), ("dispatcher", True), ("dispatcher", False)]
    assert len({tuple(r["rounds_s"]["forward"]) for r in runs}) == 1  # one forward for all
    # per pass (a warm-up and 2 rounds): a hooks pass per kernel setting, shared by the writers,
    # and a capture pass per writer and setting
    assert sorted(calls) == sorted([(True, False), (False, False)] * 3 + [(True, True), (False, True)] * 6)
    hooks = {r["top_r_kernel"]: tuple(r["rounds_s"]["hooks"]) for r in runs}
    assert all(tuple(r["rounds_s"]["hooks"]) == hooks[r["top_r_kernel"]] for r in runs)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| top:64 |")]
    assert [", top-R by sorts, " in row for row in (r.split("|")[3] for r in rows)] == [False, True] * 2


def test_bench_compares_the_stored_rows_kernel_with_the_steps_in_the_same_rounds(tmp_path, capsys, monkeypatch):
    calls = []

    def spy(real, model, sites, windows, cfg, write, *args, block=None, **kwargs):
        calls.append((cfg.rows_kernel, block is not None))
        return real(model, sites, windows, cfg, write, *args, block=block, **kwargs)

    runs = _bench_spied(tmp_path, monkeypatch, spy, "--batch-sizes", "4", "--repeats", "1", "--writer", "threads",
                        "--rows-kernel", "1,0")
    assert [r["rows_kernel"] for r in runs] == [True, False]
    assert len({tuple(r["rounds_s"]["forward"]) for r in runs}) == 1  # one forward for both
    # per pass (a warm-up and a round): a hooks pass and a capture pass of each setting
    assert sorted(calls) == sorted([(True, False), (False, False), (True, True), (False, True)] * 2)
    rows = [line.split("|")[3] for line in capsys.readouterr().out.splitlines() if line.startswith("| top:64 |")]
    assert ["stored columns in one launch" in row for row in rows] == [True, False]


@pytest.mark.parametrize(("flag", "words"), [(["--writer", "processes,fork"], "--writer fork is not valid"),
                                             (["--repeats", "0"], "--repeats 0: rounds must be at least 1"),
                                             (["--unit-tokens", "0,-1"], "--unit-tokens 0,-1: give whole numbers"),
                                             (["--writers", "4,x"], "--writers 4,x: give whole numbers"),
                                             (["--shared-rows", "1,yes"], "--shared-rows 1,yes: give 1 or 0"),
                                             (["--recording-stream", "side,both"],
                                              "--recording-stream both is not valid"),
                                             (["--top-r-kernel", "1,yes"], "--top-r-kernel 1,yes: give 1 or 0"),
                                             (["--rows-kernel", "2"], "--rows-kernel 2: give 1 or 0"),
                                             (["--record-block-tokens", "0,-5"],
                                              "--record-block-tokens 0,-5: give whole numbers")])
def test_bench_refuses_bad_settings_before_loading_a_model(tmp_path, capsys, flag, words):
    from traces.capture import bench

    with pytest.raises(SystemExit) as stop:
        bench.main(["--model", str(tmp_path / "none"), "--input", str(tmp_path), *flag])
    assert stop.value.code == 2 and words in capsys.readouterr().err


def test_bench_page_cache_facts_name_the_folder_s_file_system_and_the_writeback_settings(tmp_path):
    from traces.capture.bench import meminfo_kb, page_cache_facts

    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "sys" / "vm").mkdir(parents=True)
    cgroup.mkdir()
    (proc / "mounts").write_text("/dev/vda / ext4 rw 0 0\ntmpfs /tmp tmpfs rw 0 0\ntmpfs /tmpx tmpfs rw 0 0\n"
                                 "/dev/vdb /tmp/scratch xfs rw 0 0\n")
    for name, value in (("dirty_ratio", "20"), ("dirty_background_ratio", "10"), ("dirty_bytes", "0")):
        (proc / "sys" / "vm" / name).write_text(value + "\n")
    (proc / "meminfo").write_text("MemTotal:       24683772 kB\nMemFree:  1 kB\nMemAvailable:   24174256 kB\n"
                                  "Dirty:              12 kB\nWriteback:           0 kB\n")
    (cgroup / "memory.max").write_text("max\n")
    facts = page_cache_facts("/tmp/x", str(proc), str(cgroup))
    assert (facts["mount"], facts["filesystem"]) == ("/tmp", "tmpfs")  # the longest mount holding it
    assert page_cache_facts("/tmp/scratch/a", str(proc), str(cgroup))["filesystem"] == "xfs"
    assert page_cache_facts("/tmpxy", str(proc), str(cgroup))["filesystem"] == "ext4"  # not /tmpx's
    assert facts["vm"] == {"dirty_ratio": 20, "dirty_background_ratio": 10, "dirty_bytes": 0,
                           "dirty_background_bytes": None, "dirty_expire_centisecs": None}
    assert facts["memory_kb"] == {"MemTotal": 24683772, "MemAvailable": 24174256}
    assert facts["cgroup_memory_max"] == "max"
    (cgroup / "memory.max").unlink()  # cgroup v1: its own file
    (cgroup / "memory").mkdir()
    (cgroup / "memory" / "memory.limit_in_bytes").write_text("68719476736\n")
    assert page_cache_facts("/tmp/x", str(proc), str(cgroup))["cgroup_memory_max"] == "68719476736"
    assert meminfo_kb(path=str(proc / "meminfo")) == {"Dirty": 12, "Writeback": 0}
    assert meminfo_kb(path=str(tmp_path / "none")) is None
    assert page_cache_facts("/x", str(tmp_path / "none"), str(tmp_path / "none")) == {
        "folder": "/x", "mount": None, "filesystem": None, "vm": dict.fromkeys(facts["vm"]),
        "memory_kb": None, "cgroup_memory_max": None}


def test_bench_rounds_count_the_cpu_of_the_calling_thread_apart_from_the_others():
    """The CPU a pass costs the thread that drives the model is told apart from what the
    process's other threads (the drain, the writer's) and its running child processes (the
    encoders) spend beside it."""
    import subprocess
    import threading
    import time

    from traces.capture.bench import _timed_rounds

    def spin(seconds):
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    def busy_here():
        spin(0.05)

    def busy_elsewhere():
        t = threading.Thread(target=spin, args=(0.05,))
        t.start()
        t.join()

    spinner = ("import time\nt = time.process_time()\n"
               "while time.process_time() - t < 0.3: pass\nprint('spun', flush=True)\ninput()")

    def busy_child():  # a running child, as the writer's encoders are kept between writers
        spin.child = subprocess.Popen([sys.executable, "-c", spinner], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert spin.child.stdout.readline() == b"spun\n"  # it spun 0.3 s, and waits for its input

    def busy_grandchild():  # a dispatcher's encoders: children of a child
        spin.child = subprocess.Popen([sys.executable, "-c", "import subprocess, sys\n"
                                       f"subprocess.run([sys.executable, '-c', {spinner!r}])"],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert spin.child.stdout.readline() == b"spun\n"

    def end_child():
        spin.child.communicate(b"\n")

    *_, cpu = _timed_rounds({"here": busy_here, "elsewhere": busy_elsewhere, "child": busy_child,
                             "ended": end_child, "grandchild": busy_grandchild, "ended again": end_child}, repeats=3)
    assert cpu["here"]["main_thread"] >= 0.045 and cpu["here"]["other_threads"] < 0.02
    assert cpu["elsewhere"]["main_thread"] < 0.02 and cpu["elsewhere"]["other_threads"] >= 0.045
    assert cpu["elsewhere"]["child_processes"] == 0
    if Path("/proc/self/stat").exists():
        assert cpu["child"]["child_processes"] >= 0.25 and cpu["child"]["main_thread"] < 0.05
        assert cpu["grandchild"]["child_processes"] >= 0.25


def test_bench_rounds_time_a_self_timed_pass_by_its_own_measure():
    """A capture pass says how long it took up to its file closed: what comes after (removing
    the file) is left out of its time, while other passes are timed whole."""
    import time

    from traces.capture.bench import Timed, _timed_rounds

    calls = []

    def self_timed():
        calls.append("capture")
        time.sleep(0.02)  # after the measured part: not counted
        return Timed(0.005 * len(calls), "stats")

    def plain():
        time.sleep(0.01)
        return "rows"

    medians, last, rounds, _ = _timed_rounds({"plain": plain, "capture": self_timed}, repeats=3)
    assert last == {"plain": "rows", "capture": "stats"} and len(calls) == 4  # warm-up + 3 rounds
    assert rounds["capture"] == [0.010, 0.015, 0.020] and len(rounds["plain"]) == 3
    assert medians["capture"] == 0.015  # the rounds' own measures 0.010, 0.015, 0.020
    assert 0.01 <= medians["plain"] < 0.05


def test_bench_rounds_alternate_their_order_when_asked():
    """With ``alternate``, every other round runs the passes in the reverse order, so that a
    drift within a round or what the pass before leaves behind favours none of them; each pass's
    times stay its own, in the order of the rounds."""
    from traces.capture.bench import Timed, _timed_rounds

    calls = []

    def named(name):
        def fn():
            calls.append(name)
            return Timed(len(calls), name)  # its position among all the calls
        return fn

    fns = {name: named(name) for name in ("forward", "hooks", "capture")}
    _, last, rounds, _ = _timed_rounds(fns, repeats=3, alternate=True)
    assert calls == ["forward", "hooks", "capture",  # warm-up
                     "forward", "hooks", "capture", "capture", "hooks", "forward",
                     "forward", "hooks", "capture"]
    assert rounds["forward"] == [4, 9, 10] and rounds["capture"] == [6, 7, 12]
    assert last == {"forward": "forward", "hooks": "hooks", "capture": "capture"}
    calls.clear()
    _timed_rounds(fns, repeats=2)  # the default: the same order every round
    assert calls[3:] == ["forward", "hooks", "capture"] * 2


def test_bench_overhead_intervals_bracket_the_figures_and_narrow_with_rounds():
    """The bootstrap interval of each overhead figure holds the figure, is a point where every
    round has the same ratio, keeps each round's two passes together (a host whose speed moves
    from round to round, with the capture always 10 % slower in its round, gives exactly 10 %),
    and narrows as the rounds grow; bad input is one clear error."""
    import numpy as np

    from traces.capture.bench import _by_round, overhead_interval

    assert overhead_interval([1.1] * 5, [1.0] * 5) == [10.0, 10.0]
    assert overhead_interval([1.1], [1.0], by_round=True) == [10.0, 10.0]
    speed = np.random.default_rng(1).uniform(1.0, 3.0, 25)  # the host's speed, round by round
    assert overhead_interval(list(1.1 * speed), list(speed), by_round=True) == [10.0, 10.0]
    low, high = overhead_interval(list(1.1 * speed), list(speed))  # the medians: pairs not kept
    assert low < 10.0 < high or (low, high) == (10.0, 10.0)
    rng = np.random.default_rng(2)
    widths = []
    for rounds in (9, 225):
        forward = rng.uniform(1.8, 3.0, rounds)
        capture = forward * rng.normal(1.12, 0.08, rounds)
        for by_round in (False, True):
            low, high = overhead_interval(list(capture), list(forward), by_round=by_round)
            point = (_by_round(list(capture), list(forward)) if by_round
                     else round(100 * (np.median(capture) / np.median(forward) - 1), 1))
            assert low <= point <= high
            widths.append(high - low)
    assert widths[2] < widths[0] / 2 and widths[3] < widths[1] / 2  # 25x the rounds: about a fifth as wide
    with pytest.raises(ValueError, match="one forward time per round"):
        overhead_interval([1.0, 2.0], [1.0])


def test_pooled_overhead_is_the_mean_of_the_runs_with_an_interval_over_runs_and_rounds(tmp_path):
    """Runs of one setting together: the mean of their figures, an interval that is a point where
    every round of every run has the same ratio, spans the runs where each is steady but they
    differ, and widens with the noise within runs; ``docs/capture/intervals.py --pooled`` prints
    it as a last row and refuses runs of different settings with one line."""
    import os
    import subprocess
    from pathlib import Path

    from traces.capture.bench import pooled_overhead

    assert pooled_overhead([([1.1] * 5, [1.0] * 5)] * 3) == (10.0, [10.0, 10.0])
    steady = [([1.05] * 5, [1.0] * 5), ([1.15] * 4, [1.0] * 4)]  # two hosts: +5 % and +15 %
    assert pooled_overhead(steady) == pooled_overhead(steady, by_round=True) == (10.0, [5.0, 15.0])
    rng = np.random.default_rng(3)
    noisy = [(list(f * rng.normal(r, 0.05, 9)), list(f)) for r in (1.05, 1.15) for f in [rng.uniform(1, 3, 9)]]
    point, (low, high) = pooled_overhead(noisy, by_round=True)
    assert low < 5.0 and high > 15.0 and low <= point <= high
    three = noisy + [(list(np.asarray(noisy[0][1]) * 1.1), noisy[0][1])]
    assert pooled_overhead(three[::-1]) == pooled_overhead(three) != pooled_overhead(three[:2])  # whatever their order
    with pytest.raises(ValueError, match="at least one run"):
        pooled_overhead([])
    with pytest.raises(ValueError, match="one forward time per round"):
        pooled_overhead([([1.0, 2.0], [1.0])])

    def result(name, batch, ratio, commit=None, sources=None):
        run = {"batch_size": batch, "tokens": 64, "writers": 2, "writer": "dispatcher", "capture_overhead_pct": 0.0,
               "hooks_overhead_pct": 0.0, "rounds_s": {"forward": [1.0] * 3, "hooks": [1.0] * 3, "capture": [ratio] * 3}}
        # results before the bench recorded the code lack both
        code = {k: v for k, v in (("capture_commit", commit), ("capture_sources", sources)) if v}
        (tmp_path / name).write_text(json.dumps({"model": "m", "gpu": "g", **code, "runs": [run]}))
        return str(tmp_path / name)

    root = Path(__file__).resolve().parents[1]
    tool = [sys.executable, str(root / "docs" / "capture" / "intervals.py"), "--pooled"]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(tool + [result("a.json", 16, 1.05), result("b.json", 16, 1.15)], capture_output=True,
                         text=True, env=env, check=True).stdout
    assert out.splitlines()[-1].startswith("| pooled: 2 runs |") and "+10.0 % (+5.0 to +15.0 %)" in out
    # each row and the pooled one name the capture code timed, where the results record it: the
    # commit recorded, or the one whose sources have the recorded fingerprint (traces.provenance)
    from traces.provenance import CAPTURE_SOURCES, commit_fingerprint, source_commit
    names = ["| a (abc1234)", "| b (def5678+)", "| d"]
    files = [result("a.json", 16, 1.05, "abc1234", "0123456789ab"), result("b.json", 16, 1.15, "def5678+"),
             result("d.json", 16, 1.1)]
    if source_commit((".",), root) != "?":  # a git checkout: a fingerprint of its history names its commit
        rev = subprocess.run(["git", "log", "-1", "--format=%h", "--", *CAPTURE_SOURCES], cwd=root, check=True,
                             capture_output=True, text=True).stdout.strip()
        files.append(result("e.json", 16, 1.1, "fedcba9+", commit_fingerprint(rev)))
        names.append(f"| e ({rev})")
    out = subprocess.run(tool + files, capture_output=True, text=True, env=env, check=True).stdout.splitlines()
    codes = sorted(n[n.index("(") + 1:-1] for n in names if "(" in n)
    assert [line.split(" | ")[0] for line in out[2:]] == [
        *names, f"| pooled: {len(files)} runs ({', '.join(codes)})"]
    bad = subprocess.run(tool + [result("a.json", 16, 1.05), result("c.json", 1, 1.15)], capture_output=True, text=True,
                         env=env)
    assert bad.returncode != 0 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == ['error: --pooled: the runs differ in batch_size (1, 16); pool runs of '
                                               'one setting only']
    def with_setting(key, as_before, other, names):
        """Two copies of a.json with ``key`` set: to what results without it ran (pooled with b.json,
        which lacks it) and to ``other`` (refused with b.json); the first's pooled output, the
        second's error lines and its own row."""
        run = json.loads((tmp_path / "a.json").read_text())
        for name, value in zip(names, (as_before, other), strict=True):
            run["runs"][0][key] = value
            (tmp_path / name).write_text(json.dumps(run))
        ok, bad = (subprocess.run(tool + [str(tmp_path / name), result("b.json", 16, 1.15)], capture_output=True,
                                  text=True, env=env) for name in names)
        row = subprocess.run(tool[:-1] + [str(tmp_path / names[1])], capture_output=True, text=True, env=env,
                             check=True).stdout.splitlines()[-1]
        return ok.stdout, bad.stderr.strip().splitlines(), row

    # results saved before record_block_tokens existed ran every forward alone: they pool with
    # block 0 and not with blocks, which the rows name
    ok, bad, row = with_setting("record_block_tokens", 0, 32768, ("alone.json", "held.json"))
    assert "pooled: 2 runs" in ok and "blocks" not in ok
    assert bad == ['error: --pooled: the runs differ in record_block_tokens (0, 32768); pool runs of one setting only']
    assert "dispatcher, forwards held in blocks of 32,768 tokens |" in row
    held = json.loads((tmp_path / "held.json").read_text())
    # a run whose setting held no two forwards (each forward larger than half a block) ran them alone
    held["runs"][0]["record_block_forwards"] = 1
    (tmp_path / "none_held.json").write_text(json.dumps(held))
    ok = subprocess.run(tool + [str(tmp_path / "none_held.json"), str(tmp_path / "alone.json")], capture_output=True,
                        text=True, env=env, check=True).stdout
    assert "pooled: 2 runs" in ok and "blocks" not in ok
    # --where keeps the runs of one setting: results from before it count as what they ran
    both = json.loads((tmp_path / "held.json").read_text())
    both["runs"].append({**both["runs"][0], "record_block_tokens": 0,
                         "rounds_s": {**both["runs"][0]["rounds_s"], "capture": [1.15] * 3}})
    (tmp_path / "both.json").write_text(json.dumps(both))
    out = subprocess.run(tool + ["--where", "record_block_tokens=0", str(tmp_path / "both.json"),
                                 result("a.json", 16, 1.05)], capture_output=True, text=True, env=env,
                         check=True).stdout.splitlines()
    assert [line.split(" | ")[0] for line in out[2:]] == ["| both", "| a", "| pooled: 2 runs"]
    assert "+10.0 % (+5.0 to +15.0 %)" in out[-1]
    bad = subprocess.run(tool + ["--where", "blocks=0", str(tmp_path / "both.json")], capture_output=True,
                         text=True, env=env)
    err = bad.stderr.strip().splitlines()
    assert bad.returncode != 0 and len(err) == 1 and err[0].startswith(
        "error: --where blocks=0: give KEY=VALUE with KEY one of model, batch_size,") and "record_block_tokens" in err[0]
    short = json.loads((tmp_path / "a.json").read_text())
    short["runs"][0]["rounds_s"]["capture"].pop()  # a round without its capture time
    (tmp_path / "short.json").write_text(json.dumps(short))
    bad = subprocess.run(tool + [str(tmp_path / "short.json")], capture_output=True, text=True, env=env)
    assert bad.returncode != 0 and bad.stdout == "" and len(bad.stderr.strip().splitlines()) == 1
    assert "rounds_s: forward, hooks and capture need one time each per round" in bad.stderr
    # the top-R kernel in fewer programs (run 1207q, the setting since removed): not pooled with
    # the default, which results without the field ran; named in its row
    ok, bad, row = with_setting("top_r_programs", 0, 132, ("one_per_row.json", "capped.json"))
    assert "pooled: 2 runs" in ok
    assert bad == ['error: --pooled: the runs differ in top_r_programs (0, 132); pool runs of one setting only']
    assert "dispatcher, top-R kernel in at most 132 programs |" in row


def test_bench_rounds_end_early_once_every_capture_interval_is_narrow_enough():
    """``--ci-width``: rounds stop after the first round (from MIN_ROUNDS on) where every capture's
    interval is narrow enough, never before MIN_ROUNDS, and not at all while one is wide; 0 runs
    every round."""
    from traces.capture.bench import MIN_ROUNDS, Timed, _narrow_enough, _timed_rounds

    assert _narrow_enough(0.0, ["capture"]) is None
    steady = {"forward": [1.0] * 9, "capture": [1.1] * 9, "noisy": [1.1, 1.5, 0.8, 1.3, 0.9, 1.6, 1.0, 1.4, 0.7]}
    narrow = _narrow_enough(1.0, ["capture"])
    assert [narrow({k: v[:n] for k, v in steady.items()}) for n in range(1, 10)] == [False] * (MIN_ROUNDS - 1) + [True] * (10 - MIN_ROUNDS)
    assert not _narrow_enough(1.0, ["capture", "noisy"])(steady)  # every capture must be narrow
    calls = []

    def fn(seconds):
        def timed():
            calls.append(seconds)
            return Timed(seconds, None)
        return timed

    _, _, rounds, _ = _timed_rounds({"forward": fn(1.0), "capture": fn(1.1)}, repeats=9, enough=narrow)
    assert len(rounds["forward"]) == MIN_ROUNDS == len(rounds["capture"]) and len(calls) == 2 * (MIN_ROUNDS + 1)
    _, _, rounds, _ = _timed_rounds({"forward": fn(1.0), "capture": fn(1.1)}, repeats=9)
    assert len(rounds["capture"]) == 9


def test_bench_stops_at_the_interval_width_asked_and_rejects_a_negative_one(tmp_path, capsys):
    from traces.capture import bench

    config = _tiny_model_dir(tmp_path)
    args = ["--config", str(config), "--input", str(tmp_path / "a.txt"), "--tokens", "100", "--window", "50",
            "--batch-sizes", "2", "--device", "cpu", "--dtype", "float32", "--writers", "1",
            "--writer", "threads", "--unit-tokens", "50"]
    out = tmp_path / "bench.json"
    bench.main([*args, "--repeats", "8", "--ci-width", "1e9", "--out", str(out)])  # any width: 5 rounds
    (run,) = json.loads(out.read_text())["runs"]
    assert run["rounds"] == bench.MIN_ROUNDS == len(run["rounds_s"]["capture"])
    assert f"in {bench.MIN_ROUNDS} rounds" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        bench.main([*args, "--ci-width", "-1"])
    assert exc.value.code == 2 and "--ci-width -1.0: give a width in points >= 0" in capsys.readouterr().err


def test_bench_rounds_start_only_where_they_would_end_by_the_deadline(monkeypatch, capsys):
    """``deadline``: a round starts only where it would end by the deadline as long as the longest
    round so far took; the first round always runs; each round's end and an early stop are
    reported on stderr. A clock that each pass moves on by its seconds."""
    from traces.capture import bench

    class Clock:
        now = 100.0

        def perf_counter(self):
            return self.now

        def process_time(self):
            return 0.0

        thread_time = process_time

    clock = Clock()
    monkeypatch.setattr(bench, "time", clock)

    def takes(seconds):
        def fn():
            clock.now += seconds
            return seconds
        return fn

    fns = {"forward": takes(1.0), "capture": takes(1.5)}  # 2.5 s a round, the warm-up too
    # ends of the rounds: 105, 107.5, 110, 112.5 (starts: the warm-up ends at 102.5)
    for deadline, rounds in ((110.0, 3), (111.0, 3), (112.5, 4), (120.0, 5), (50.0, 1), (None, 5)):
        clock.now = 100.0
        _, _, times, _ = bench._timed_rounds(fns, repeats=5, deadline=deadline)
        assert len(times["forward"]) == len(times["capture"]) == rounds, deadline
        err = capsys.readouterr().err
        assert err.count("[bench] round ") == rounds
        assert (f"[bench] {rounds} of 5 rounds: the next would end past --time-limit" in err) == (rounds < 5)


def test_bench_time_limit_keeps_one_round_per_setting_and_rejects_a_negative_one(tmp_path, monkeypatch, capsys):
    """``--time-limit``: once the limit is near, each setting runs its first round only; every
    setting's result is in the file; a negative limit is refused before a model loads."""
    runs = _bench_spied(tmp_path, monkeypatch, lambda real, *a, **k: real(*a, **k), "--batch-sizes", "1,2",
                        "--repeats", "4", "--writer", "threads", "--time-limit", "0.001")
    assert [(r["batch_size"], r["rounds"], len(r["rounds_s"]["capture"])) for r in runs] == [(1, 1, 1), (2, 1, 1)]
    assert json.loads((tmp_path / "bench.json").read_text())["time_limit_s"] == 0.001
    assert capsys.readouterr().err.count("the next would end past --time-limit") == 2
    from traces.capture import bench

    with pytest.raises(SystemExit) as exc:
        bench.main(["--model", str(tmp_path / "none"), "--input", str(tmp_path), "--time-limit", "-5"])
    assert exc.value.code == 2 and "--time-limit -5.0: give seconds >= 0 (0: no limit)" in capsys.readouterr().err


def test_the_writers_auto_unit_is_one_forward_within_1_16_to_1_2_of_a_row_group(monkeypatch):
    from traces.capture import capture as C
    from traces.capture.config import GenerateConfig, InputConfig

    monkeypatch.setattr(C, "default_row_group_tokens", lambda meta: 16000)
    assert [C.auto_unit_tokens(None, b) for b in (0, 512, 4096, 8192)] == [1000, 1000, 4096, 8000]
    monkeypatch.setattr(C, "default_row_group_tokens", lambda meta: 1600)  # a large model's rows
    assert [C.auto_unit_tokens(None, b) for b in (0, 512, 8192)] == [256, 512, 800]
    assert C.batch_tokens(CaptureConfig(batch_size=16, input=InputConfig(window_tokens=300))) == 4800
    assert C.batch_tokens(CaptureConfig(mode="generate", batch_size=4,
                                        generate=GenerateConfig(prompt_tokens=10, new_tokens=20))) == 120
