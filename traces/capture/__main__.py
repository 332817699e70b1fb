"""moe-capture without Hydra: ``python -m traces.capture [--summary FILE] key=value ...``.

For hosts without hydra-core (the fixture build scripts use it). The overrides are moe-capture's
(``traces/capture/config.py``): dotted field names, values read by the field's type (``true`` /
``false``, numbers, ``null``, lists as ``[a,b]``). ``--summary`` writes the run's summary JSON,
the ``capture.json`` that moe-capture leaves in Hydra's run directory. Bad input prints one line
and exits with code 2.

    python -m traces.capture model.path=traces/fixtures/model 'input.paths=[text/]' out=t.parquet
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from traces.atomic import atomic_write_text
from traces.capture.app import summary_line
from traces.capture.config import CaptureConfig
from traces.errors import EXIT_INPUT_ERROR, InputError


def _value(text: str, type_name: str, key: str):
    """An override's text as the field's type (annotations are strings: ``int``, ``str | None``, ...)."""
    kinds = [t.strip() for t in type_name.split("|")]
    if text == "null" and "None" in kinds:
        return None
    kind = kinds[0]
    try:
        if kind == "bool":
            if text not in ("true", "false"):
                raise ValueError
            return text == "true"
        if kind in ("int", "float"):
            return {"int": int, "float": float}[kind](text)
        if kind.startswith("list"):
            if not (text.startswith("[") and text.endswith("]")):
                raise ValueError
            return [item.strip().strip("'\"") for item in text[1:-1].split(",") if item.strip()]
    except ValueError:
        raise InputError(f"{key}={text} is not a valid {type_name}") from None
    return text


def apply_overrides(cfg: CaptureConfig, overrides: list[str]) -> CaptureConfig:
    """``cfg`` with ``key=value`` overrides applied (nested fields by dotted names)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        path = key.split(".")
        target = cfg
        for name in path[:-1]:
            target = getattr(target, name, None)
            if not dataclasses.is_dataclass(target):
                raise InputError(f"override '{item}': '{name}' is not a config group of moe-capture")
        fields = {f.name: f for f in dataclasses.fields(target)}
        if not sep or path[-1] not in fields or dataclasses.is_dataclass(getattr(target, path[-1])):
            raise InputError(f"override '{item}' is not key=value with a field of moe-capture (traces/capture/config.py)")
        setattr(target, path[-1], _value(text, fields[path[-1]].type, key))
    return cfg


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m traces.capture", description=__doc__.splitlines()[0])
    p.add_argument("--summary", default=None, help="write the run's summary JSON here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    args = p.parse_args(argv)
    from transformers.utils import logging as hf_logging

    from traces.capture.capture import run_capture

    hf_logging.set_verbosity_error()
    try:
        stats = run_capture(apply_overrides(CaptureConfig(), args.overrides))
    except InputError as e:
        print(f"moe-capture: error: {e}", file=sys.stderr)
        sys.exit(EXIT_INPUT_ERROR)
    if args.summary:
        Path(args.summary).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(args.summary, json.dumps(stats, indent=2) + "\n")
    print(summary_line(stats))


if __name__ == "__main__":
    main()
