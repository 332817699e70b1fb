"""Config composition and validation: presets, overrides, hardware profiles, impossible sizes."""
from __future__ import annotations

import copy
import math

import numpy as np
import pytest
from omegaconf import OmegaConf

from simulator.hardware import layer_times, validate_profile
from simulator.run import build_params, compose, model_sizes
from traces.errors import InputError
from traces.format import TraceMeta

POLICIES = ["fetch_all", "rule015", "first_choice", "substitute_all", "quality_first", "speed_first", "cpu_offload"]


def meta(L=4, E=16, k=2, logits=True, expert_bytes=1000):
    return TraceMeta(
        model="toy", num_layers=L, num_experts=E, top_k=k, expert_bytes=[expert_bytes] * L, has_logits=logits
    )


def cfg(*overrides):
    return OmegaConf.to_container(compose(list(overrides)), resolve=True)


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_preset_composes_and_builds(name):
    c = cfg(f"policy={name}")
    params, _ = build_params(c, meta())
    assert c["policy"]["name"] == name
    assert params.top_k == 2


def test_presets_encode_the_papers_rules():
    rules = {n: cfg(f"policy={n}") for n in POLICIES}
    assert (rules["fetch_all"]["policy"]["protect_ranks"], rules["fetch_all"]["policy"]["tau"]) == (0, 0.0)
    assert (rules["rule015"]["policy"]["protect_ranks"], rules["rule015"]["policy"]["tau"]) == (1, 0.15)
    assert rules["first_choice"]["policy"]["protect_ranks"] == 1 and math.isinf(rules["first_choice"]["policy"]["tau"])
    assert rules["substitute_all"]["policy"]["protect_ranks"] == 0 and math.isinf(rules["substitute_all"]["policy"]["tau"])
    for combo, base in (("quality_first", "rule015"), ("speed_first", "first_choice")):
        c = rules[combo]
        assert c["cache"]["eviction"] == "lfu" and c["admission"]["beta"] == 0.5
        assert c["policy"]["tau"] == rules[base]["policy"]["tau"]
    assert rules["fetch_all"]["admission"]["beta"] is None
    assert rules["cpu_offload"]["policy"]["miss_action"] == "cpu"


def test_command_line_overrides_win_over_presets():
    c = cfg("policy=quality_first", "cache.eviction=lru", "admission.beta=0.25", "policy.tau=0.3")
    params, _ = build_params(c, meta())
    assert params.eviction == "lru"
    assert params.beta == 0.25 and params.tau == 0.3


def test_substitute_by_auto_follows_logits():
    c = cfg("policy=rule015")
    assert build_params(c, meta(logits=True))[0].substitute_by == "logit"
    p, name = build_params(c, meta(logits=False))
    assert p.substitute_by == "frequency" and name == "frequency"
    with pytest.raises(InputError, match="policy.substitute_by"):
        build_params(cfg("policy=rule015", "policy.substitute_by=logit"), meta(logits=False))


def test_cache_budgets_per_layer_and_global():
    p, _ = build_params(cfg("cache.fraction=0.25"), meta(E=16, expert_bytes=1000))
    assert p.pool_budget_bytes.tolist() == [4000] * 4
    p, _ = build_params(cfg("cache=global", "cache.fraction=0.5"), meta(L=4, E=16, expert_bytes=1000))
    assert p.pool_budget_bytes.tolist() == [32_000]
    p, _ = build_params(cfg("cache=global", "cache.budget_bytes=5000"), meta())
    assert p.pool_budget_bytes.tolist() == [5000]


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        (["cache.fraction=0"], "cache.fraction"),
        (["cache.fraction=1.5"], "cache.fraction"),
        (["cache.fraction=0.01"], "cache.fraction"),  # < one expert per layer of 16
        (["cache=global", "cache.budget_bytes=999"], "cache.budget_bytes"),
        (["cache.budget_bytes=5000"], "cache.budget_bytes"),  # per_layer scope
        (["cache.eviction=mru"], "cache.eviction"),
        (["cache.scope=sharded"], "cache.scope"),
        (["policy.miss_action=drop"], "policy.miss_action"),
        (["policy.tau=-1"], "policy.tau"),
        (["admission.beta=0"], "admission.beta"),
        (["cache.lfu_decay=1.5"], "cache.lfu_decay"),
    ],
)
def test_impossible_configs_fail_with_one_line_naming_the_field(overrides, field):
    with pytest.raises(InputError) as err:
        build_params(cfg(*overrides), meta())
    message = str(err.value)
    assert field in message and "\n" not in message


def test_model_preset_scales_the_trace_sizes():
    c = cfg("model=qwen3_next_80b_a3b", "model.sizes_only=true")
    name, expert, dense = model_sizes(c["model"], meta(L=3))
    assert name == "qwen3_next_80b_a3b"
    assert expert.tolist() == [2048 * 512 * 3 * 2] * 3
    assert (dense > 0).all()
    name, expert, dense = model_sizes(cfg()["model"], meta(L=3, expert_bytes=777))
    assert name == "toy" and expert.tolist() == [777] * 3 and dense.tolist() == [0, 0, 0]


def test_cpu_offload_params():
    p, _ = build_params(cfg("policy=cpu_offload"), meta())
    assert p.miss_action == "cpu" and p.warmup_tokens == 256


# --- hardware profiles -------------------------------------------------------------------


@pytest.fixture
def profile():
    return cfg()["hardware"]


def test_shipped_profiles_validate():
    for name in ("h200_pcie5", "rtx3090_pcie4"):
        validate_profile(cfg(f"hardware={name}")["hardware"])
    assert cfg("hardware=rtx3090_pcie4")["hardware"]["source"] == "datasheet"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda p: p["pcie"].pop("bandwidth_gbps"), "hardware.pcie.bandwidth_gbps"),
        (lambda p: p.pop("gpu"), "hardware.gpu"),
        (lambda p: p["pcie"].__setitem__("bandwidth_gbps", -5.0), "hardware.pcie.bandwidth_gbps"),
        (lambda p: p["ssd"].__setitem__("bandwidth_gbps", 0), "hardware.ssd.bandwidth_gbps"),
        (lambda p: p["pcie"].__setitem__("bandwidth_mbps", 5.0), "hardware.pcie.bandwidth_mbps"),
        (lambda p: p["gpu"].__setitem__("expert_fixed_us", "15 ms"), "hardware.gpu.expert_fixed_us"),
        (lambda p: p.__setitem__("source", "guess"), "hardware.source"),
        (lambda p: p.__setitem__("compute", {"m": {"gpu_expert_ms": 3}}), "hardware.compute.m.gpu_expert_ms"),
    ],
)
def test_bad_profiles_fail_with_one_line(profile, mutate, field):
    bad = copy.deepcopy(profile)
    mutate(bad)
    with pytest.raises(InputError) as err:
        validate_profile(bad)
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("mutate", "words"),
    [
        (lambda p: p["pcie"].__setitem__("latency_us", 1e308), ["'hardware.pcie.latency_us'", "sanity cap 1e+06"]),
        (lambda p: p["pcie"].__setitem__("latency_us", math.inf), ["'hardware.pcie.latency_us'", "finite"]),
        (lambda p: p["gpu"].__setitem__("memory_bandwidth_gbps", 5e6), ["memory_bandwidth_gbps", "cap 100000"]),
        (lambda p: p["ssd"].__setitem__("bandwidth_gbps", 2e4), ["'hardware.ssd.bandwidth_gbps'", "cap 10000"]),
        (lambda p: p.__setitem__("host_ram_bytes", 2**60), ["'hardware.host_ram_bytes'", "cap"]),
        (lambda p: p["cpu"].__setitem__("expert_fixed_us", math.nan), ["'hardware.cpu.expert_fixed_us'"]),
        (lambda p: p.__setitem__("compute", {"m": {"cpu_expert_us": 1e7}}), ["hardware.compute.m.cpu_expert_us"]),
        (lambda p: p.__setitem__("pcie", [1, 2]), ["'hardware.pcie' must map"]),
    ],
)
def test_profile_numbers_beyond_their_sanity_caps_are_refused(profile, mutate, words):
    bad = copy.deepcopy(profile)
    mutate(bad)
    with pytest.raises(InputError) as err:
        validate_profile(bad)
    assert all(w in str(err.value) for w in words) and "\n" not in str(err.value), str(err.value)


def test_every_bad_profile_field_is_reported_at_once(profile):
    bad = copy.deepcopy(profile)
    del bad["pcie"]["latency_us"]
    bad["ssd"]["bandwidth_gbps"] = -5.0
    bad["gpu"]["memory_bandwidth_gbps"] = 1e9
    bad["cpu"]["typo_us"] = 1.0
    del bad["source"]
    with pytest.raises(InputError) as err:
        validate_profile(bad, origin="hardware profile 'x'")
    message = str(err.value)
    problems = message.removeprefix("hardware profile 'x': ").split("; ")
    assert "\n" not in message and len(problems) == 5, message
    for field in ("hardware.pcie.latency_us", "hardware.ssd.bandwidth_gbps", "hardware.gpu.memory_bandwidth_gbps",
                  "hardware.cpu.typo_us", "hardware.source"):
        assert sum(field in p for p in problems) == 1, (field, problems)


def test_a_profile_that_is_not_a_mapping_is_one_line():
    for bad in ([{"pcie": 1}], "h200", None):
        with pytest.raises(InputError, match="expected a mapping of sections") as err:
            validate_profile(bad)
        assert "\n" not in str(err.value)


def test_layer_times_roofline_and_measured_override(profile):
    expert = np.array([1_000_000, 2_000_000])
    dense = np.array([0, 43_000_000])
    t = layer_times(profile, "toy", expert, dense)
    gpu = profile["gpu"]
    assert t.gpu_expert_us[1] == pytest.approx(gpu["expert_fixed_us"] + 2e6 / (gpu["memory_bandwidth_gbps"] * 1e3))
    assert t.nonexpert_us[0] == gpu["layer_fixed_us"]
    assert t.gpu_expert_us[1] > t.gpu_expert_us[0]
    profile = dict(profile, compute={"toy": {"gpu_expert_us": 16.0}})
    t2 = layer_times(profile, "toy", expert, dense)
    assert t2.gpu_expert_us.tolist() == [16.0, 16.0]
    assert t2.cpu_expert_us.tolist() == t.cpu_expert_us.tolist()


# --- model shapes and GPU memory -------------------------------------------------------------


def test_a_preset_of_another_shape_is_refused_unless_sizes_only():
    with pytest.raises(InputError, match="another routing shape") as err:
        model_sizes(cfg("model=mixtral_8x7b")["model"], meta(L=3))
    assert "num_layers 32 vs 3" in str(err.value) and "model.sizes_only=true" in str(err.value)
    name, expert, _ = model_sizes(cfg("model=mixtral_8x7b", "model.sizes_only=true")["model"], meta(L=3))
    assert name == "mixtral_8x7b" and expert.tolist() == [352321536] * 3


def test_quantised_qwen3_next_sizes_per_layer():
    """Q4_K_M: down projections in Q6_K on llama.cpp's "more bits" layers, else Q4_K."""
    c = cfg("model=qwen3_next_80b_a3b_q4km")["model"]
    m = meta(L=48, E=512, k=10)
    _, expert, _ = model_sizes(c, m)
    q4, q6 = 2048 * 512 * 144 // 256, 2048 * 512 * 210 // 256
    more = [i for i in range(48) if i < 6 or i >= 42 or (i - 6) % 3 == 2]
    assert expert.tolist() == [2 * q4 + (q6 if i in more else q4) for i in range(48)]
    assert len(more) == 24


@pytest.mark.parametrize("overrides, fits", [
    (["model=qwen3_next_80b_a3b", "cache.fraction=0.25"], False),  # bf16: 36 GiB of experts
    (["model=qwen3_next_80b_a3b_q4km", "cache.fraction=0.25"], True),  # Q4_K_M: 10.9 GiB
    (["model=qwen3_next_80b_a3b", "cache.fraction=0.25", "memory.check=false"], True),
])
def test_gpu_memory_feasibility(overrides, fits):
    c = cfg("hardware=rtx3090_16gb", *overrides)
    m = meta(L=48, E=512, k=10)
    if fits:
        build_params(c, m)
        return
    with pytest.raises(InputError, match="does not fit the GPU") as err:
        build_params(c, m)
    assert "GiB > 24.00 GiB" in str(err.value) and "\n" not in str(err.value)
