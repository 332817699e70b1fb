"""The moe-capture app: a thin Hydra wrapper around :func:`traces.capture.capture.run_capture`.

The trace goes to ``out`` (relative to the working directory); Hydra's run directory receives
``capture.json`` with the run's summary. Bad input prints one line and exits with code 2.
Without Hydra (hosts without hydra-core): ``python -m traces.capture`` takes the same overrides.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from traces.atomic import atomic_write_text
from traces.errors import EXIT_INPUT_ERROR, InputError

REPO_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = REPO_ROOT / "conf"


def register_configs() -> None:
    """Register the capture schema so ``conf/capture.yaml`` and overrides are type-checked."""
    from hydra.core.config_store import ConfigStore

    from traces.capture.config import CaptureConfig

    ConfigStore.instance().store(name="capture_schema", node=CaptureConfig)


def _task(cfg) -> dict:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf
    from transformers.utils import logging as hf_logging

    from traces.capture.capture import run_capture

    hf_logging.set_verbosity_error()
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        stats = run_capture(OmegaConf.to_object(cfg))
    except InputError as e:
        print(f"moe-capture: error: {e}", file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR)
    atomic_write_text(run_dir / "capture.json", json.dumps(stats, indent=2) + "\n")
    print(summary_line(stats))
    return stats


def summary_line(stats: dict) -> str:
    """The line moe-capture prints when a capture is done."""
    return (
        f"moe-capture: {stats['tokens']} tokens x {stats['layers']} MoE layers "
        f"({stats['experts']} experts, top-{stats['top_k']}) in {stats['seconds']:.1f} s "
        f"({stats['tokens_per_s']:.0f} tokens/s) -> {stats['path']} ({stats['bytes'] / 1e6:.2f} MB)"
    )


def main() -> None:
    import hydra

    register_configs()
    hydra.main(config_path=str(CONF_DIR), config_name="capture", version_base=None)(_task)()


if __name__ == "__main__":
    main()
