"""moe-calibrate on the CPU: the copy-time fit, profile validation and writing, the no-GPU exit."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from simulator.gpu import calibrate, storage
from simulator.gpu.calibrate import (
    Fit,
    build_profile,
    fit_fixed_plus_bandwidth,
    fit_or_rate,
    profile_from_samples,
    render_profile_yaml,
)
from simulator.gpu.kernels import KIB, MIB
from simulator.hardware import validate_profile
from traces.errors import InputError

REPO = Path(__file__).resolve().parent.parent
MEASURED = REPO / "conf" / "hardware" / "h200_measured.yaml"


def _measured() -> dict:
    return yaml.safe_load(MEASURED.read_text())


def test_fit_recovers_fixed_cost_and_bandwidth():
    rng = np.random.default_rng(0)
    sizes = [2**k for k in range(16, 30)]  # 64 KiB .. 512 MiB
    times = [(7.0 + s / 54e3) * (1 + 0.01 * rng.standard_normal()) for s in sizes]
    fit = fit_fixed_plus_bandwidth(sizes, times)
    assert fit.fixed_us == pytest.approx(7.0, abs=0.6)
    assert fit.bandwidth_gbps == pytest.approx(54.0, rel=0.02)
    assert fit.max_rel_err < 0.05


def test_fit_clamps_a_negative_fixed_cost():
    sizes = [1e6, 2e6, 4e6]
    fit = fit_fixed_plus_bandwidth(sizes, [s / 50e3 - 1.0 for s in sizes])
    assert fit.fixed_us == 0.0
    assert fit.bandwidth_gbps > 0


@pytest.mark.parametrize("sizes, times", [([1e6], [20.0]), ([1e6, 1e6], [20.0, 21.0]), ([1e6, 2e6], [20.0, -1.0])])
def test_fit_needs_two_sizes_and_positive_times(sizes, times):
    with pytest.raises(InputError):
        fit_fixed_plus_bandwidth(sizes, times)


def test_fit_or_rate_falls_back_when_times_do_not_grow():
    fit = fit_or_rate([1e6, 2e6, 4e6], [40.0, 30.0, 20.0], "test")
    assert fit == Fit(0.0, 4e6 / 20.0 / 1e3, fit.max_rel_err)


def test_committed_profiles_validate():
    for path in sorted((REPO / "conf" / "hardware").glob("*.yaml")):
        validate_profile(yaml.safe_load(path.read_text()), origin=str(path))


def test_rtx3090_profile_stays_datasheet_derived():
    profile = yaml.safe_load((REPO / "conf" / "hardware" / "rtx3090_pcie4.yaml").read_text())
    assert profile["source"] == "datasheet"
    assert "not measured" in profile["host"]["method"]


def _broken(edit):
    p = copy.deepcopy(_measured())
    edit(p)
    return p


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda p: p["pcie"].pop("bandwidth_gbps"), "pcie.bandwidth_gbps"),  # missing field
        (lambda p: p.pop("gpu"), "hardware.gpu"),  # missing section
        (lambda p: p["pcie"].update(bandwidth_gbps=-54.0), "pcie.bandwidth_gbps"),  # negative bandwidth
        (lambda p: p["ssd"].update(bandwidth_gbps=0), "ssd.bandwidth_gbps"),
        (lambda p: p["pcie"].update(bandwidth_mbps=54000.0), "pcie.bandwidth_mbps"),  # unknown unit
        (lambda p: p["pcie"].update(latency_us="7 us"), "pcie.latency_us"),  # unit in the value
        (lambda p: p["pcie"].update(latency_us=True), "pcie.latency_us"),
        (lambda p: p["compute"]["qwen3_next_80b_a3b"].update(gpu_expert_ms=0.003), "gpu_expert_ms"),
        (lambda p: p.update(speed="fast"), "hardware.speed"),  # unknown key
        (lambda p: p.update(source="guessed"), "hardware.source"),
    ],
)
def test_bad_profiles_fail_with_one_clear_line(edit, field):
    with pytest.raises(InputError) as err:
        validate_profile(_broken(edit), origin="test profile")
    message = str(err.value)
    assert "\n" not in message
    assert field in message


def test_rendered_profile_reads_back_equal():
    profile = _measured()
    again = yaml.safe_load(render_profile_yaml(profile, header=["a header line"]))
    assert again == profile
    validate_profile(again)


def test_build_profile_rejects_what_validation_rejects():
    fit = Fit(5.0, 50.0, 0.0)
    with pytest.raises(InputError, match="gpu_expert_us"):
        build_profile("x", host={"gpu": "g", "pcie": "p", "date": "d", "method": "m"}, h2d=fit,
                      pageable_gbps=10.0, ssd=fit, gpu_expert=fit, layer_fixed_us=1.0, cpu_expert=fit,
                      compute={"m": {"gpu_expert_us": -1.0}}, samples_file=None)


def test_measured_profile_is_what_its_samples_give():
    """The committed profile is rebuilt exactly from its raw samples (moe-calibrate --from-samples)."""
    import json

    samples = json.loads((MEASURED.with_suffix(".samples.json")).read_text())
    profile, fits = profile_from_samples(samples, "h200_measured", "h200_measured.samples.json",
                                         samples["fits"]["expert_mode"], samples["fits"]["h2d_used"])
    assert profile == _measured()
    assert fits["expert_mode"] == "batched"


def test_without_a_gpu_it_stops_with_one_line(tmp_path):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    done = subprocess.run([sys.executable, "-m", "simulator.gpu.calibrate", "--out", str(tmp_path / "p.yaml")],
                          capture_output=True, text=True, timeout=120, cwd=REPO)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "no CUDA GPU" in lines[0]
    assert not (tmp_path / "p.yaml").exists()


def test_cpu_test_run_writes_a_valid_profile_and_samples(tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "cpu.yaml"
    calibrate.main(["--device", "cpu", "--out", str(out), "--reps", "3", "--skip-ssd",
                    "--models", "qwen3_next_80b_a3b"])
    profile = yaml.safe_load(out.read_text())
    validate_profile(profile)
    assert profile["samples"] == "cpu.samples.json"
    assert set(profile["compute"]) == {"qwen3_next_80b_a3b"}
    assert (tmp_path / "cpu.samples.json").exists()


def _expert_file(tmp_path, mib: int = 4) -> Path:
    pytest.importorskip("torch")
    try:
        return storage.write_expert_file(tmp_path / "experts.bin", mib * MIB)
    except InputError as e:
        pytest.skip(f"no O_DIRECT here: {e}")


def test_ssd_reads_bypass_the_page_cache(tmp_path):
    path = _expert_file(tmp_path)
    for pattern in ("sequential", "random"):
        s = calibrate.measure_ssd_reads(path, 64 * KIB, pattern, qd=2, seconds=0.2, max_reads=64)
        assert s["reads"] > 0 and s["gbps"] > 0 and s["median_us"] > 0


# --------------------------------------------------------------------------- the new terms


def _samples() -> dict:
    import json

    return json.loads(MEASURED.with_suffix(".samples.json").read_text())


def test_models_take_an_optional_top_k():
    assert calibrate.parse_models("qwen3_next_80b_a3b, qwen3_30b_a3b:6") == [("qwen3_next_80b_a3b", None),
                                                                             ("qwen3_30b_a3b", 6)]
    for bad, field in (("nope", "unknown model 'nope'"), ("qwen3_30b_a3b:0", "top-k >= 1"), ("", "empty")):
        with pytest.raises(InputError, match=field) as err:
            calibrate.parse_models(bad)
        assert "\n" not in str(err.value)


def test_idle_latency_and_pageable_bandwidth_come_from_isolated_copies():
    """Copies at 20 us + bytes / 50 GB/s alone and 6 us + bytes / 50 GB/s back to back, pageable at
    20 us + bytes / 10 GB/s: the profile's two latencies, one bandwidth and the pageable rate."""
    samples = _samples()
    sizes = [2**k for k in range(16, 30)] + samples["expert_bytes"]
    h2d = []
    for kind, mode, fixed, gbps in (("pinned", "isolated", 20.0, 50.0), ("pinned", "burst", 6.0, 50.0),
                                    ("pageable", "isolated", 20.0, 10.0)):
        h2d += [dict(kind=kind, mode=mode, streams=1, bytes=b, times_us=[fixed + b / (gbps * 1e3)] * 3)
                for b in sizes]
    samples["h2d"] = h2d
    profile, fits = profile_from_samples(samples, "x", None)
    assert profile["pcie"]["latency_us"] == pytest.approx(6.0, rel=1e-3)
    assert profile["pcie"]["idle_latency_us"] == pytest.approx(20.0, rel=1e-3)
    assert profile["pcie"]["bandwidth_gbps"] == pytest.approx(50.0, rel=1e-3)
    assert profile["pcie"]["pageable_bandwidth_gbps"] == pytest.approx(10.0, rel=1e-3)
    assert fits["h2d_idle_latency_us"] == pytest.approx(20.0, rel=1e-6)


def test_ssd_fit_takes_expert_sized_reads():
    """Reads of 1 MiB and more lie on 100 us + bytes / 1 GB/s, a 4 KiB read at 40 us: the fit is the
    large reads' (experts never see the small-read latency); with one large size, all of them."""
    samples = _samples()

    def read(block, us):
        return dict(block_bytes=block, pattern="random", qd=1, median_us=us)

    samples.pop("read_copy")  # without back-to-back reads the QD1 fit is the profile's
    large = [read(b, 100.0 + b / 1e3) for b in (MIB, 4 * MIB, 9 * MIB)]
    samples["ssd"] = [read(4 * KIB, 40.0), *large, dict(read(9 * MIB, 1.0), qd=8)]
    profile, _ = profile_from_samples(samples, "x", None)
    assert profile["ssd"]["latency_us"] == pytest.approx(100.0, rel=1e-3)
    assert profile["ssd"]["bandwidth_gbps"] == pytest.approx(1.0, rel=1e-3)
    samples["ssd"] = [read(4 * KIB, 40.0), large[-1]]
    profile, _ = profile_from_samples(samples, "x", None)
    assert profile["ssd"]["latency_us"] < 100.0


def test_back_to_back_reads_are_the_ssd_line_where_measured():
    """Read-then-copy pipelines whose reads end every 500 us + bytes / 2 GB/s after the one before
    (the first read slower: the reader's start) give that line, not the isolated QD1 reads'."""
    samples = _samples()

    def pipeline(kind, b, first=5000.0):
        step = 500.0 + b / 2e3
        ends = [first + i * step for i in range(16)]
        return dict(kind=kind, bytes=b, n=16, total_us=[ends[-1] + 100.0], read_end_us=[ends, ends])

    samples["read_copy"] = [pipeline(k, b) for k in ("pinned", "pageable") for b in (6 * MIB, 9 * MIB)]
    profile, fits = profile_from_samples(samples, "x", None)
    assert profile["ssd"]["latency_us"] == pytest.approx(500.0, rel=1e-6)
    assert profile["ssd"]["bandwidth_gbps"] == pytest.approx(2.0, rel=1e-6)
    assert fits["ssd_used"] == "back_to_back" and fits["ssd_random_qd1"]["bandwidth_gbps"] != pytest.approx(2.0)
    samples["read_copy"] = [pipeline("pinned", 9 * MIB)]  # one size: no line, the QD1 fit
    profile, fits = profile_from_samples(samples, "x", None)
    assert fits["ssd_used"] == "random_qd1" and profile["ssd"]["latency_us"] != pytest.approx(500.0)


def test_fixed_costs_are_the_sequence_beyond_its_parts():
    """A layer's sequence 3 us above the profile's non-expert + k expert times, a synchronised
    token 120 us above its layers: step_fixed_us 3, token_fixed_us 120; a negative residue is 0."""
    samples = _samples()
    samples.pop("fixed", None)  # samples of a calibration without the sequence timings
    profile, fits = profile_from_samples(samples, "x", None)
    assert "token_fixed_us" not in profile["gpu"]  # no term: the engine charges 0
    extra = {"qwen3_next_80b_a3b": (3.0, 120.0), "qwen3_30b_a3b": (-2.0, 120.0)}
    samples["fixed"] = {}
    for m, (step, token) in extra.items():
        c, d = fits["compute"][m], samples["models"][m]  # unrounded: the residues are exact
        seq = c["nonexpert_layer_us"] + d["top_k"] * c["gpu_expert_us"] + step
        samples["fixed"][m] = dict(layers=d["num_layers"], top_k=d["top_k"], copy_bytes=6 * MIB, copies=[1],
                                   nonexpert_us=[c["nonexpert_layer_us"]], experts_us=[d["top_k"] * c["gpu_expert_us"]],
                                   sequence_us=[seq], sequence_1_copies_us=[seq + 150.0],
                                   token_us=[d["num_layers"] * seq + token])
    profile, fits = profile_from_samples(samples, "x", None)
    assert profile["gpu"]["step_fixed_us"] == pytest.approx((3.0 + 0.0) / 2, rel=1e-2)
    assert profile["gpu"]["token_fixed_us"] == pytest.approx(120.0, rel=1e-2)
    assert fits["fixed"]["qwen3_30b_a3b"]["step_fixed_us"] == pytest.approx(-2.0, abs=0.05)
    assert fits["fixed"]["qwen3_next_80b_a3b"]["copies_us"]["1"] == pytest.approx(150.0)
    assert yaml.safe_load(render_profile_yaml(profile)) == profile


@pytest.mark.parametrize("ssd_gbps", [0.5, 500.0])
def test_read_copy_time_is_the_engines(tiny_trace, ssd_gbps):
    """read_copy_us (the calibration's check of the pipelines) is the engine's stall for a step
    whose fetches all read from the SSD: reads back to back, each copy after its read; with a
    slow SSD every copy starts on an idle link, with a fast one they run back to back."""
    from omegaconf import OmegaConf

    from simulator.engine import simulate
    from simulator.engine.reference import Observer
    from simulator.run import build_params, compose

    source = tiny_trace(tokens=4, layers=1, experts=16, top_k=4, prompt_share=0.0)
    cfg = OmegaConf.to_container(compose(["policy=fetch_all", "cache.fraction=0.5"]), resolve=True)
    profile = dict(_measured(), host_ram_bytes=2**30)
    profile["ssd"] = dict(latency_us=20.0, bandwidth_gbps=ssd_gbps)
    profile["pcie"] = dict(profile["pcie"], idle_latency_us=19.0)
    cfg["hardware"] = profile
    params = build_params(cfg, source.meta)[0]

    class First(Observer):
        stalls: list = []

        def on_step(self, group, layer, decision):
            self.stalls.append(decision.stall_us)

    obs = First()
    simulate(source, params, engine="reference", observer=obs)
    b = float(params.expert_bytes[0])
    expected = calibrate.read_copy_us(4, 20.0 + b / (ssd_gbps * 1e3), b / (profile["pcie"]["bandwidth_gbps"] * 1e3),
                                      19.0, profile["pcie"]["latency_us"])
    assert obs.stalls[0] == pytest.approx(expected, rel=1e-12)


def test_cpu_calibration_measures_the_disk_and_the_fixed_costs(tmp_path):
    """The whole measurement at tiny shapes with an expert file: queue depths, read-then-copy
    pipelines, the fixed costs; the profile carries the new terms and --from-samples rebuilds it."""
    path = _expert_file(tmp_path, 16)
    out = tmp_path / "cpu.yaml"
    calibrate.main(["--device", "cpu", "--out", str(out), "--reps", "2", "--models", "qwen3_30b_a3b:3",
                    "--ssd-file", str(path), "--ssd-qds", "1,2", "--read-copy-experts", "4"])
    import json

    samples = json.loads((tmp_path / "cpu.samples.json").read_text())
    assert samples["models"]["qwen3_30b_a3b"]["top_k"] == 3
    expert_block = storage.round_up(samples["expert_bytes"][0])
    assert {s["qd"] for s in samples["ssd"] if s["block_bytes"] == expert_block} == {1, 2}
    (pipe,) = samples["read_copy"]
    assert pipe["n"] == 4 and all(len(e) == 4 and e == sorted(e) for e in pipe["read_end_us"])
    assert all(t >= e[-1] for t, e in zip(pipe["total_us"], pipe["read_end_us"], strict=True))
    f = samples["fixed"]["qwen3_30b_a3b"]
    assert len(f["token_us"]) == 8 and f["layers"] == 4 and len(f["sequence_3_copies_us"]) == 2
    profile = yaml.safe_load(out.read_text())
    assert {"token_fixed_us", "step_fixed_us"} <= set(profile["gpu"]) and "idle_latency_us" in profile["pcie"]
    assert samples["fits"]["read_copy"][0]["predicted_us"] > 0
    again = tmp_path / "again" / "cpu.yaml"
    calibrate.main(["--from-samples", str(tmp_path / "cpu.samples.json"), "--out", str(again)])
    assert yaml.safe_load(again.read_text()) == profile


def test_buffers_are_page_aligned_and_an_expert_file_is_kept(tmp_path, monkeypatch):
    path = _expert_file(tmp_path, 1)
    stamp = path.stat().st_mtime_ns
    assert storage.write_expert_file(path, 64 * MIB) == path and path.stat().st_mtime_ns == stamp
    assert path.stat().st_size == MIB
    monkeypatch.setattr(storage.HostBuffers, "CHUNK_BYTES", 5 * 8192)  # four rows a chunk: several chunks
    bufs = storage.HostBuffers(6, 5000, pinned=False)
    assert len(bufs) == 6 and all(row.shape == (8192,) for row in bufs.rows)
    assert all(bufs[i].data_ptr() % storage.DIRECT_ALIGN == 0 for i in range(6))
    assert len({bufs[i].data_ptr() for i in range(6)}) == 6
    with storage.DirectFile(path, 8192) as f:
        assert f.blocks == MIB // 8192 and f.read(f.blocks + 1, bufs.arrays[5]) == 8192
    assert bufs[5].sum().item() > 0  # the read landed in the row's memory


def test_a_layer_stack_runs_each_steps_experts(tmp_path):
    """Eager layer stack: a step's experts add exactly their SwiGLU outputs (a prefill step of more
    than max_n experts included)."""
    torch = pytest.importorskip("torch")
    from simulator.gpu.kernels import ExpertKernel, LayerStack, model_dims, tiny_dims

    dims = tiny_dims(model_dims("qwen3_30b_a3b"))
    cpu = torch.device("cpu")
    slots = torch.randn((8, 3 * dims.hidden * dims.expert_intermediate), dtype=torch.float32) * 0.05
    stack = LayerStack(dims, slots, cpu, torch.float32, 16, "eager", 2, 8)
    stack.load([[1, 2], [3, 4, 5, 6, 7]])
    assert stack.launches == [1, 3]
    ref = ExpertKernel(dims.hidden, dims.expert_intermediate, cpu, torch.float32)
    ref.x.copy_(stack.kern.x)
    for step, ids in ((0, [1, 2]), (1, [3, 4, 5, 6, 7])):
        stack.kern.y.zero_()
        ref.y.zero_()
        stack.experts(step)
        for i in ids:
            ref.run(slots[i])
        torch.testing.assert_close(stack.kern.y, ref.y)


# --------------------------------------------------------------------------- pooled calibrations


def _without_method(profile: dict) -> dict:
    out = copy.deepcopy(profile)
    out["host"].pop("method")
    return out


def test_a_calibration_pooled_with_itself_gives_its_profile():
    """Pooling concatenates each measurement's samples: with a copy of the same samples every
    median and fit is unchanged, and only the method line says that samples were pooled."""
    samples = _samples()
    alone, _ = profile_from_samples(samples, "p", None)
    pooled_samples = calibrate.pool_samples([samples, copy.deepcopy(samples)], ["a.json", "b.json"])
    pooled, _ = profile_from_samples(pooled_samples, "p", None)
    assert _without_method(pooled) == _without_method(alone)
    assert "pooled over 2 calibrations" in pooled["host"]["method"]
    first = next(e for e in pooled_samples["h2d"] if e["mode"] == "burst")
    assert len(first["times_us"]) == 2 * len(next(e for e in samples["h2d"] if e["mode"] == "burst")["times_us"])


def test_a_slower_link_later_moves_the_pooled_fit_between_the_two():
    samples = _samples()
    later = copy.deepcopy(samples)
    for e in later["h2d"]:
        e["times_us"] = [1.5 * t for t in e["times_us"]]
    for e in later["read_copy"]:
        e["read_end_us"] = [[2 * t for t in ends] for ends in e["read_end_us"]]
    first = profile_from_samples(samples, "p", None)[0]
    second = profile_from_samples(later, "p", None)[0]
    pooled = profile_from_samples(calibrate.pool_samples([samples, later]), "p", None)[0]
    for section, field in (("pcie", "bandwidth_gbps"), ("pcie", "idle_latency_us"), ("ssd", "bandwidth_gbps")):
        lo, hi = sorted((first[section][field], second[section][field]))
        assert lo < pooled[section][field] < hi, (section, field)
    assert pooled["compute"] == first["compute"]  # compute comes from the first calibration


def test_pooling_refuses_another_host_and_link_only_samples_alone():
    samples = _samples()
    other = copy.deepcopy(samples)
    other["host"]["gpu"] = "NVIDIA RTX 3090"
    with pytest.raises(InputError, match="host gpu"):
        calibrate.pool_samples([samples, other], ["a.json", "b.json"])
    link = {k: v for k, v in samples.items() if k not in calibrate.COMPUTE_SECTIONS}
    with pytest.raises(InputError, match="gpu_expert.*full calibration"):
        calibrate.pool_samples([link, copy.deepcopy(link)])


def test_a_link_only_calibration_pools_with_a_full_one(tmp_path):
    """--link-only writes the copies' and the disk's samples only; --from-samples FULL,LINK builds
    a valid profile whose method says so, and rebuilding from the pooled samples alone gives it."""
    import json

    path = _expert_file(tmp_path, 16)
    common = ["--device", "cpu", "--reps", "2", "--models", "qwen3_30b_a3b:3", "--ssd-file", str(path),
              "--ssd-qds", "1", "--read-copy-experts", "4"]
    calibrate.main([*common, "--out", str(tmp_path / "full.yaml")])
    calibrate.main([*common, "--link-only", "--out", str(tmp_path / "end.yaml")])
    assert not (tmp_path / "end.yaml").exists()
    link = json.loads((tmp_path / "end.samples.json").read_text())
    assert "h2d" in link and "read_copy" in link and not set(calibrate.COMPUTE_SECTIONS) & set(link)
    out = tmp_path / "pooled.yaml"
    calibrate.main(["--from-samples", f"{tmp_path / 'full.samples.json'},{tmp_path / 'end.samples.json'}",
                    "--out", str(out)])
    profile = yaml.safe_load(out.read_text())
    validate_profile(profile)
    assert "end.samples.json (copies and disk only)" in profile["host"]["method"]
    again = tmp_path / "again" / "pooled.yaml"
    calibrate.main(["--from-samples", str(tmp_path / "pooled.samples.json"), "--out", str(again)])
    assert yaml.safe_load(again.read_text()) == profile
