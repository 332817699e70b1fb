"""moe-emulate on tiny random MoE models (CPU): exactness, substitution, and the simulator's mass."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the emulator runs models: it needs the [capture] extra
pytest.importorskip("transformers")
# ruff: noqa: E402 (the imports below need torch)

from transformers import AutoModelForCausalLM, DynamicCache, OlmoeConfig, Qwen3MoeConfig

from analysis import quality
from simulator.engine import simulate
from simulator.engine.params import CPU, HIT, SUBSTITUTE
from simulator.gpu.emulate import (
    DecisionPool,
    Strategy,
    Tokens,
    check_summary,
    default_strategies,
    emulate,
    emulation_meta,
    main,
    moe_sites,
    normalised_gates,
    parse_strategy,
    plain_config,
    strategy_params,
    summary_arrays,
)
from simulator.run import CONF_DIR, build_params
from traces.errors import InputError
from traces.format import open_trace

VOCAB = 61


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread (and the same on every machine)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def tiny_config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                  max_position_embeddings=64, num_experts=16, num_experts_per_tok=4)
    if arch == "qwen3_moe":
        return Qwen3MoeConfig(**common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
                              mlp_only_layers=[0], head_dim=16, norm_topk_prob=True)
    # OLMoE does not renormalise its top-k weights: gates and weights differ
    return OlmoeConfig(**common, intermediate_size=16, num_hidden_layers=2, norm_topk_prob=False)


def tiny_model(arch: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32).eval()
    with torch.no_grad():  # sharpen the router so gate weights spread like a trained model's
        for site in moe_sites(model):
            site.module.weight.mul_(8.0)
    return model


def tiny_tokens(windows: int = 2, window_tokens: int = 12, streams: int = 2, seed: int = 0) -> Tokens:
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, VOCAB - 1, 9) for _ in range(6)]
    return Tokens.from_documents(docs, [i % 3 for i in range(6)], window_tokens,
                                 windows * window_tokens * streams, streams, separator=VOCAB - 1)


def setup(arch: str):
    model = tiny_model(arch)
    sites = moe_sites(model)
    return model, sites, emulation_meta(model, sites, f"tiny-{arch}", ["a", "b", "c"])


WARM_ALL = ("cache.init=frequency", "cache.warmup_tokens=2")


def test_plain_config_matches_hydra_composition():
    from hydra import compose, initialize_config_dir

    from simulator.config import register_configs

    _, _, meta = setup("qwen3_moe")
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        shapes = [s for s in default_strategies([0.25]) if "." not in s.name or s.name in ("tau0.3_r0", "tau0.3_r1")]
        for s in [*shapes, Strategy("cpu_offload", 0.5, ("policy=cpu_offload", *WARM_ALL))]:
            mine = strategy_params(s, meta)
            hydra, _ = build_params(compose(config_name="simulate", overrides=s.config_overrides()), meta)
            for name, value in vars(mine).items():
                assert np.array_equal(value, getattr(hydra, name)), (s.label, name)


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_every_expert_resident_reproduces_the_plain_model_exactly(arch):
    model, sites, meta = setup(arch)
    tokens = tiny_tokens()
    strategies = [
        Strategy("fetch_all", 0.25, ("policy=fetch_all",)),
        # every expert resident after two warm-up tokens: nothing is ever missing
        Strategy("substitute_all", 1.0, ("policy=substitute_all", *WARM_ALL)),
        Strategy("rule015", 1.0, ("policy=rule015", *WARM_ALL)),
        # misses computed on the CPU run the selected expert exactly
        Strategy("cpu_offload", 0.25, ("policy=cpu_offload", *WARM_ALL)),
    ]
    seen = {}
    em = emulate(model, sites, meta, tokens, strategies, check=False, open_loop=False,
                 observe=lambda u, logits: seen.setdefault(u, logits.clone()))
    lanes = len(strategies) * tokens.streams
    start = torch.as_tensor(tokens.spans()[:, 0]).repeat(len(strategies))
    ids = torch.as_tensor(tokens.token_id)
    cache = None
    with torch.inference_mode():
        for u in range(len(tokens) // tokens.streams):
            cache = DynamicCache(config=model.config) if tokens.pos[u] == 0 else cache
            out = model(input_ids=ids[start + u][:, None], use_cache=True, cache=cache)
            assert out.logits.shape[0] == lanes
            assert torch.equal(out.logits[:, -1], seen[u]), f"token {u}"
    codes = em.rec.codes
    assert (codes[1:3][codes[1:3] >= 0] == HIT).all()
    assert (codes[3] == CPU).any() and not (codes == SUBSTITUTE).any()


@pytest.mark.parametrize("arch", ["qwen3_moe", "olmoe"])
def test_substitute_runs_the_chosen_expert_with_the_missing_gate_weight(arch):
    model, sites, meta = setup(arch)
    tokens = tiny_tokens(windows=1)
    strategies = [Strategy("fetch_all", 0.25, ("policy=fetch_all",)),
                  Strategy("substitute_all", 0.25, ("policy=substitute_all", "cache.init=cold")),
                  Strategy("first_choice", 0.25, ("policy=first_choice",))]
    router, run = [], []
    hooks = []
    for j, s in enumerate(sites):
        hooks.append(s.module.register_forward_hook(
            lambda m, a, out, j=j: router.append((j, out[0].clone(), out[1].clone(), out[2].clone()))))
        hooks.append(s.moe_block.experts.register_forward_hook(
            lambda m, a, out, j=j: run.append((j, a[0].clone(), a[1].clone(), a[2].clone(), out.clone()))))
    try:
        em = emulate(model, sites, meta, tokens, strategies, check=False, open_loop=False)
    finally:
        for h in hooks:
            h.remove()
    rec, S = em.rec, tokens.streams
    strategy = np.repeat(np.arange(len(strategies)), S)
    assert len(router) == len(run) == len(tokens) // S * len(sites)
    substituted = 0
    for step, ((j, _, weights, ids), (j2, hidden, ran, ran_w, out)) in enumerate(zip(router, run, strict=True)):
        assert j == j2
        u = step // len(sites)
        t = tokens.spans()[np.arange(len(strategy)) % S, 0] + u
        codes, subs = rec.codes[strategy, t, j], rec.subs[strategy, t, j]
        assert np.array_equal(rec.experts[strategy, t, j], ids.numpy())
        expected = np.where(codes == SUBSTITUTE, subs, ids.numpy())
        assert np.array_equal(ran.numpy(), expected)
        assert torch.equal(ran_w, weights)  # a substitute carries the missing expert's weight
        substituted += int((codes == SUBSTITUTE).sum())
        # the block's output is the gate-weighted sum of the experts that ran
        ex = sites[j].moe_block.experts
        with torch.no_grad():
            gate, up = torch.einsum("nh,nkih->nki", hidden, ex.gate_up_proj[ran]).chunk(2, dim=-1)
            y = torch.einsum("nki,nkhi->nkh", ex.act_fn(gate) * up, ex.down_proj[ran])
        torch.testing.assert_close(out, (y * ran_w[..., None]).sum(1), rtol=1e-5, atol=1e-6)
        # the substitute was not selected, and its mass is the missing experts' normalised gates
        g = normalised_gates(weights.numpy())
        for lane in np.flatnonzero((codes == SUBSTITUTE).any(1)):
            sub_ranks = codes[lane] == SUBSTITUTE
            assert not np.isin(subs[lane][sub_ranks], ids[lane].numpy()).any()
            assert rec.mass[strategy[lane], t[lane], j] == pytest.approx(g[lane][sub_ranks].sum(), abs=1e-6)
    assert substituted > 0
    assert not (rec.codes[0] == SUBSTITUTE).any()


def test_simulator_mass_on_the_emulation_trace_equals_the_emulation_mass(tmp_path):
    model, sites, meta = setup("qwen3_moe")
    tokens = tiny_tokens()
    strategies = [*(s.with_overrides(["cache.warmup_tokens=3"]) for s in default_strategies([0.25])),
                  Strategy("sa_cold", 0.5, ("policy=substitute_all", "cache.init=cold"))]
    em = emulate(model, sites, meta, tokens, strategies, trace_dir=tmp_path)
    arrays = summary_arrays(em)
    # lane by lane, moe-sim's reference engine on the lane's own trace
    for c in em.checks:
        assert c["mass"].shape[0] > 0
    checks = check_summary(em, arrays)
    assert all(c["mass_equal"] and c["counts_equal"] for c in checks), checks
    assert (arrays["substitutions"].sum(1) > 0).sum() >= 10
    # and the moe-sim app itself (Numba engine, summary statistics) on one written trace
    r = next(i for i, s in enumerate(strategies) if s.name == "quality_first")
    s = strategies[r]
    for stream in range(tokens.streams):
        path = tmp_path / f"{s.name}_f{s.fraction:g}_s{stream}.parquet"
        with open_trace(path) as source:
            res = simulate(source, strategy_params(s, meta), engine="numba")
        a, b = tokens.spans()[stream]
        assert np.array_equal(res.mass, arrays["mass"][r, a:b])


def test_open_loop_replays_decisions_from_the_unperturbed_routing(tmp_path):
    model, sites, meta = setup("qwen3_moe")
    tokens = tiny_tokens()
    strategies = [Strategy("fetch_all", 0.25, ("policy=fetch_all",)),
                  Strategy("substitute_all", 0.25, ("policy=substitute_all", "cache.init=cold"))]
    em = emulate(model, sites, meta, tokens, strategies, trace_dir=tmp_path)
    arrays = summary_arrays(em)
    ok = np.isfinite(arrays["nll"][0])
    # batched and token-by-token attention agree up to float32 rounding
    np.testing.assert_allclose(arrays["open_nll"][0, ok], arrays["nll"][0, ok], rtol=1e-4, atol=1e-5)
    assert arrays["open_substitutions"][1].sum() > 0 and arrays["open_applied_mass"][1].sum() > 0
    assert not np.allclose(arrays["open_nll"][1, ok], arrays["open_nll"][0, ok])
    # the open loop's decisions are the simulator's on the fetch_all trace
    params = strategy_params(strategies[1], meta)
    for stream in range(tokens.streams):
        with open_trace(tmp_path / f"fetch_all_f0.25_s{stream}.parquet") as source:
            res = simulate(source, params, engine="reference")
        a, b = tokens.spans()[stream]
        assert np.array_equal(res.mass, arrays["open_mass"][1, a:b])


def test_decisions_do_not_depend_on_worker_processes():
    _, _, meta = setup("qwen3_moe")
    rng = np.random.default_rng(3)
    T, L, k, E = 30, meta.num_layers, meta.top_k, meta.num_experts
    logits = rng.normal(size=(T, L, E)).astype(np.float16) * 3
    experts = np.argsort(-logits.astype(np.float32), axis=-1, kind="stable")[..., :k].astype(np.int32)
    weights = np.exp(np.take_along_axis(logits.astype(np.float32), experts, -1))
    params = [strategy_params(s, meta) for s in default_strategies([0.25])[:5]]
    spans = np.array([[0, T]] * len(params))
    warmup = np.zeros(len(params), np.int64)
    args = (warmup, spans, experts, normalised_gates(weights), logits,
            np.zeros(T, np.int32), np.arange(T, dtype=np.int32), np.zeros(T, np.int16))
    with DecisionPool(params, meta, workers=0) as pool:
        local = pool.replay(*args)
    with DecisionPool(params, meta, workers=2) as pool:
        spread = pool.replay(*args)
    for name in ("codes", "subs", "mass"):
        assert np.array_equal(getattr(local, name), getattr(spread, name))
    assert (local.codes == SUBSTITUTE).any()


def test_strategy_specs_and_input_errors():
    s = parse_strategy("tau0.3@0.25 policy=rule015 policy.tau=0.3")
    assert (s.name, s.fraction, s.label) == ("tau0.3", 0.25, "tau0.3@25%")
    assert parse_strategy("rule015@0.1").overrides == ("policy=rule015",)
    for bad in ("rule015", "rule015@2", "@0.25"):
        with pytest.raises(InputError):
            parse_strategy(bad)
    with pytest.raises(InputError, match="not a preset"):
        plain_config(["policy=nope"])
    with pytest.raises(InputError, match="not a field"):
        plain_config(["policy.tua=0.3"])
    _, _, meta = setup("qwen3_moe")
    with pytest.raises(InputError, match="belady"):
        strategy_params(Strategy("b", 0.25, ("policy=rule015", "cache.eviction=belady")), meta)
    assert math.isinf(plain_config(["policy=first_choice"])["policy"]["tau"])
    with pytest.raises(InputError, match="whole"):
        Tokens(np.arange(10), np.zeros(10, np.int16), window_tokens=4, streams=1)


def test_command_line_and_quality_report(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny_model("qwen3_moe")
    model.config.save_pretrained(tmp_path / "model")
    words = [f"w{i}" for i in range(VOCAB - 2)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(["<eot>", "<unk>", *words])}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eot>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    rng = np.random.default_rng(0)
    with (tmp_path / "text.jsonl").open("w") as f:
        for i in range(8):
            text = " ".join(rng.choice(words, 15))
            f.write(json.dumps({"text": text, "domain": ["code", "prose"][i % 2]}) + "\n")
    out = tmp_path / "run"
    main(["--config", str(tmp_path / "model" / "config.json"), "--tokenizer", str(tmp_path / "tok"),
          "--dtype", "float32", "--device", "cpu", "--text", str(tmp_path / "text.jsonl"),
          "--max-tokens", "96", "--window-tokens", "24", "--streams", "2", "--fractions", "0.25",
          "--set", "cache.warmup_tokens=4", "--out", str(out)])
    info = json.loads((out / "emulation.json").read_text())
    assert info["tokens"] == 96 and len(info["strategies"]) == 23 and info["strategies"][0]["name"] == "fetch_all"
    assert all(c["mass_equal"] and c["counts_equal"] for c in info["checks"])
    run = quality.load(out)
    rows = quality.strategy_table(run)
    assert rows[0]["label"] == "fetch_all@25%" and rows[0]["ppl_increase"] == 0.0
    assert quality.switch_events(run, 8)
    text = quality.report(run, block_tokens=8, after_tokens=8, n_boot=50)
    for heading in ("Per strategy", "0.15 rule", "across strategies", "across inputs",
                    "domain switches", "open loop"):
        assert heading in text
    doc = tmp_path / "QUALITY.md"
    doc.write_text("intro\n\n" + quality.BEGIN.format("") + "\nSTALE TABLES\n" + quality.END.format("") + "\n\noutro\n")
    quality.replace_generated(doc, text)
    quality.replace_generated(doc, "second run\n", block="cpu")
    new = doc.read_text()
    assert new.startswith("intro") and "outro" in new and "STALE" not in new
    assert new.rstrip().endswith(quality.END.format(" cpu")) and "second run" in new
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(tmp_path / "model" / "config.json"), "--tokenizer", str(tmp_path / "tok"),
              "--text", str(tmp_path / "missing.jsonl"), "--out", str(out)])
    assert exit_info.value.code == 2


def test_pearson_and_bootstrap_helpers():
    x = np.arange(10.0)
    assert quality.pearson(x, 2 * x + 1) == pytest.approx(1.0)
    assert quality.pearson(x, -x) == pytest.approx(-1.0)
    assert math.isnan(float(quality.pearson(x, np.ones(10))))
    w = quality.resample_weights(7, 100, 0)
    assert w.shape == (100, 7) and (w.sum(1) == 7).all()
    assert quality.slope(x, 3 * x - 2) == pytest.approx(3.0)
    assert math.isnan(float(quality.slope(np.ones(4), x[:4])))
    assert quality.ranks(np.array([0.3, 0.1, 0.2])).tolist() == [2.0, 0.0, 1.0]


def test_text_from_a_captured_trace(tmp_path):
    from simulator.gpu.emulate import trace_documents
    from traces.format import TraceMeta, TraceWriter

    meta = TraceMeta(model="m", num_layers=1, num_experts=4, top_k=2, expert_bytes=[8], domains=["code", "prose"])
    # three capture windows, each starting with BOS (0): two of one code document, one of prose
    ids = [[0, 5, 6, 7], [0, 8, 9], [0, 3, 4]]
    seq = np.repeat(np.arange(3), [len(w) for w in ids]).astype(np.int32)
    T = seq.shape[0]
    with TraceWriter(tmp_path / "t.parquet", meta) as w:
        w.write(seq=seq, pos=np.concatenate([np.arange(len(x)) for x in ids]).astype(np.int32),
                phase=np.ones(T, np.int8), experts=np.tile([[[0, 1]]], (T, 1, 1)),
                weights=np.full((T, 1, 2), 0.5, np.float32), token_id=np.concatenate(ids).astype(np.int32),
                domain=np.repeat([0, 0, 1], [4, 3, 3]).astype(np.int16))
    docs, domains, names = trace_documents(tmp_path / "t.parquet", strip=0)
    assert [d.tolist() for d in docs] == [[5, 6, 7, 8, 9], [3, 4]]
    assert domains == [0, 1] and names == ["code", "prose"]
    tokens = Tokens.from_documents(docs, domains, window_tokens=4, separator=0)
    assert tokens.token_id.tolist() == [5, 6, 7, 8, 9, 0, 3, 4]
    assert tokens.domain.tolist() == [0] * 6 + [1] * 2


def test_time_limit_keeps_the_windows_every_stream_finished():
    model, sites, meta = setup("qwen3_moe")
    tokens = tiny_tokens(windows=3)
    strategies = [Strategy("fetch_all", 0.25, ("policy=fetch_all",)),
                  Strategy("rule015", 0.25, ("policy=rule015",))]
    em = emulate(model, sites, meta, tokens, strategies, max_seconds=0.0)
    assert len(em.tokens) == tokens.streams * tokens.window_tokens
    assert em.rec.codes.shape[1] == em.nll.shape[1] == em.open_nll.shape[1] == len(em.tokens)
    assert all(c["mass_equal"] for c in check_summary(em, summary_arrays(em)))
    first = tokens.first_steps(tokens.window_tokens)[1]
    full = emulate(model, sites, meta, tokens, strategies, check=False, open_loop=False)
    np.testing.assert_array_equal(em.nll, full.nll[:, first])
