"""moe-calibrate on the CPU: the copy-time fit, profile validation and writing, the no-GPU exit."""
from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from simulator.gpu import calibrate
from simulator.gpu.calibrate import (
    Fit,
    build_profile,
    fit_fixed_plus_bandwidth,
    fit_or_rate,
    profile_from_samples,
    render_profile_yaml,
    validate_profile,
)
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


def test_ssd_reads_bypass_the_page_cache(tmp_path):
    try:
        path = calibrate.make_direct_file(str(tmp_path), 4 * calibrate.MIB)
    except InputError as e:
        pytest.skip(f"no O_DIRECT here: {e}")
    try:
        for pattern in ("sequential", "random"):
            s = calibrate.measure_ssd_reads(path, 64 * calibrate.KIB, pattern, qd=2, seconds=0.2, max_reads=64)
            assert s["reads"] > 0 and s["gbps"] > 0 and s["median_us"] > 0
    finally:
        Path(path).unlink()
