"""Structured configs of the moe-sim app: every field with its help text, registered with Hydra.

The YAML groups under ``conf/`` (``policy/``, ``cache/``, ``hardware/``, ``model/``, ``trace/``)
are named presets of these schemas; command-line overrides are the user interface, so the field
names here are stable. A policy variant's own settings come from its module's ``Options``
(``simulator.policies``) and appear in its family's section (eviction options under ``cache``).

The same fields are the source of ``moe-sim --help`` (:func:`help_text`), of the README's
override table (:func:`markdown_table`; ``python -m simulator.config --write-readme`` rewrites
it) and of the check of every override before Hydra composes (:func:`check_overrides`).
"""
from __future__ import annotations

import dataclasses
import difflib
import re
import sys
import textwrap
import typing
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore

from simulator.engine.params import INITS, SCOPES
from simulator.policies.eviction import REGISTRY as EVICTIONS
from simulator.policies.miss_action import REGISTRY as MISS_ACTIONS
from simulator.policies.predictor import REGISTRY as PREDICTORS
from simulator.policies.prefetch import REGISTRY as PREFETCHES
from simulator.policies.substitute import REGISTRY as SUBSTITUTES
from traces.errors import InputError

REPO_ROOT = Path(__file__).resolve().parent.parent
CONF_DIR = REPO_ROOT / "conf"
README = REPO_ROOT / "README.md"
ENGINES = ("numba", "reference")  # simulator.engine.ENGINES (that package loads Numba)
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def opt(default, help: str, **extra):
    """A config field with its help text (``moe-sim --help`` prints it); ``choices=`` lists the
    values it takes."""
    if isinstance(default, list | dict):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TraceConfig:
    path: str = opt("traces/samples/fixture.parquet", "trace file (Parquet, see traces/format.py)")
    max_tokens: int | None = opt(None, "simulate only the first N tokens; null = all")
    chunk_tokens: int | None = opt(None, "tokens decoded per chunk, >= 1; null = sized to ~64 MiB of what "
                                   "the run decodes (from the trace cache: no logits where none are read)")
    cache: bool = opt(False, "decode once into a memory-mapped copy keyed by the file's hash "
                      "($MOE_SIM_CACHE or ~/.cache/moe-offload-sim), re-used by later runs; "
                      "moe-trace cache list | clear")


@dataclass
class _PolicyFields:
    name: str = opt("fetch_all", "label reported in results")
    protect_ranks: int = opt(0, "r: a miss with rank < r is always fetched")
    tau: float = opt(0.0, "a miss with normalised gate weight >= tau is fetched; inf = never by weight")
    miss_action: str = opt("substitute", "what happens to a miss that is not fetched",
                           choices=tuple(MISS_ACTIONS))
    substitute_by: str = opt("auto", "which resident runs in place of a miss (auto: logit when the "
                             "trace has logits)", choices=("auto", *SUBSTITUTES))



@dataclass
class _CacheFields:
    scope: str = opt("per_layer", "per_layer (capacity per layer) or global (one pool in bytes)",
                     choices=SCOPES)
    fraction: float = opt(0.25, "resident share of experts, in (0, 1]")
    budget_bytes: int | None = opt(None, "global scope only: pool size in bytes (overrides fraction)")
    eviction: str = opt("lru", "eviction policy", choices=tuple(EVICTIONS))
    lfu_decay: float | None = opt(None, "frequency decay per token in (0, 1] (lfu eviction, "
                                  "frequency substitutes); null = none")
    init: str = opt("cold", "cold (empty) or frequency (warm from the first warmup_tokens tokens)",
                    choices=INITS)
    warmup_tokens: int = opt(256, "init=frequency: tokens used to warm; excluded from statistics")


def _with_options(name: str, base: type, *registries) -> type:
    """``base`` plus a field for every variant option of the ``registries`` (help text kept)."""
    extra = [(f.name, hint, field(default=f.default, metadata=f.metadata))
             for registry in registries for f, hint in registry.option_fields()]
    return dataclasses.make_dataclass(name, extra, bases=(base,))


PolicyConfig = _with_options("PolicyConfig", _PolicyFields, SUBSTITUTES)
CacheConfig = _with_options("CacheConfig", _CacheFields, EVICTIONS)


@dataclass
class _PrefetchFields:
    predictor: str = opt("none", "what prefetch predicts from; none = no prefetch",
                         choices=tuple(PREDICTORS))
    policy: str = opt("topp", "how predictions become transfers", choices=tuple(PREFETCHES))


PrefetchConfig = _with_options("PrefetchConfig", _PrefetchFields, PREFETCHES, PREDICTORS)


@dataclass
class AdmissionConfig:
    beta: float | None = opt(None, "background admission threshold on substituted mass; null = off")


@dataclass
class MemoryConfig:
    check: bool = opt(True, "stop when dense weights + resident experts + reserve exceed the GPU's "
                      "memory (hardware.gpu.memory_bytes)")
    reserve_bytes: int = opt(2 * 2**30, "GPU memory kept for the KV cache, activations and the "
                             "runtime, bytes")


@dataclass
class SimulateConfig:
    trace: TraceConfig = field(default_factory=TraceConfig)
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    prefetch: PrefetchConfig = field(default_factory=PrefetchConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    hardware: Any = opt(None, "a hardware profile (conf/hardware/*.yaml), validated by simulator.hardware")
    hardware_file: str | None = opt(None, "a hardware profile file instead of a preset (as "
                                    "conf/hardware/TEMPLATE.yaml); hardware=PATH.yaml sets it")
    model: Any = opt(None, 'model shapes and expert sizes (conf/model/*.yaml); "trace" = from the trace')
    engine: str = opt("numba", "numba, or reference (plain Python, same semantics, slow)",
                      choices=ENGINES)
    seed: int = opt(0, "random eviction and anything else random")
    progress: bool | None = opt(None, "progress bar; null = only when stderr is a terminal")
    per_token: bool = opt(True, "write per_token.parquet")


# model.* fields (the group is free-form: presets carry more, e.g. attention shapes for the GPU tools)
MODEL_FIELDS = {
    "name": ("str", "trace", "the model's name; trace = the sizes the trace records"),
    "expert_bytes": ("int or list", None, "bytes of one routed expert, or one per MoE layer; "
                     "null = the trace's"),
    "dense_bytes_per_layer": ("int or list", None, "non-expert weight bytes per MoE layer (one, or "
                              "one per layer), >= 0; null = the trace's (0 when absent)"),
    "embedding_bytes": ("int", None, "embeddings and output head, for the GPU-memory check; null = 0"),
    "sizes_only": ("bool", False, "take only the preset's byte sizes onto a trace of another "
                   "routing shape"),
}
# groups whose presets are not listed as choices (a template to copy, not a profile to pick)
HIDDEN_PRESETS = {"TEMPLATE"}


def register_configs() -> None:
    """Register the schemas so YAML presets and overrides are type-checked, and the resolver
    that names run directories (conf/simulate.yaml's ``hydra.run.dir``)."""
    from omegaconf import OmegaConf

    cs = ConfigStore.instance()
    cs.store(name="simulate_schema", node=SimulateConfig)
    OmegaConf.register_new_resolver("moe_sim_run_name", run_dir_name, replace=True)


def run_dir_name(policy: str, override_dirname: str, max_chars: int = 80) -> str:
    """The part of a run directory's name after the time: the policy, then the overrides that
    set this run apart (``quality_first_fraction=0.5,beta=0.25``): last key parts only, file
    paths as their names, cut to ``max_chars``."""
    items: list[str] = []
    for item in str(override_dirname).split(","):
        if "=" not in item and items and not item.startswith("~"):  # a list value's comma
            items[-1] += "," + item
        elif item:
            items.append(item)
    parts = []
    for item in items:
        key, _, value = item.partition("=")
        key = key.lstrip("+")
        if key != "policy" and not key.startswith("~"):
            parts.append(f"{key.rsplit('.', 1)[-1]}={Path(value.strip(chr(39))).name or value}")
    name = "_".join([str(policy), ",".join(parts)]) if parts else str(policy)
    return "".join(ch if ch.isalnum() or ch in "=,._+-" else "-" for ch in name)[:max_chars]


# --- the settings, as help and tables ----------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One command-line setting: ``key=value`` (or a preset ``group=name``)."""

    key: str
    type: str
    default: Any
    help: str
    choices: tuple[str, ...] = ()


def _type_name(hint) -> str:
    args = typing.get_args(hint)
    if args:
        names = [_type_name(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    return getattr(hint, "__name__", str(hint))


def field_default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def schema_fields(schema: type = SimulateConfig, prefix: str = "") -> Iterator[tuple[str, dataclasses.Field, Any]]:
    """(dotted key, field, resolved type) of every leaf of ``schema``; ``Any`` leaves (the free-form
    ``hardware`` and ``model`` groups) included as they are."""
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from schema_fields(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, hints[f.name]


def group_options(group: str) -> dict[str, str]:
    """The presets of ``conf/<group>/`` and the first line of each one's leading comment."""
    options = {}
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        if path.stem in HIDDEN_PRESETS:
            continue
        lines = path.read_text().splitlines()
        comment = next((ln.lstrip("# ").strip() for ln in lines
                        if ln.startswith("#") and "@package" not in ln), "")
        options[path.stem] = comment
    return options


def groups() -> tuple[str, ...]:
    """The config groups of ``conf/`` a run selects a preset of (``hydra/`` aside)."""
    return tuple(sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir() and p.name != "hydra"))


def default_presets() -> dict[str, str]:
    """Group -> the preset conf/simulate.yaml's defaults list picks."""
    import yaml

    defaults = yaml.safe_load((CONF_DIR / "simulate.yaml").read_text())["defaults"]
    return {k: v for entry in defaults if isinstance(entry, dict) for k, v in entry.items()}


def settings() -> list[Setting]:
    """Every setting moe-sim takes: the preset groups, then the schema fields in order."""
    chosen = default_presets()
    rows = [Setting(g, "preset", chosen.get(g), _GROUP_HELP.get(g, ""), tuple(group_options(g)))
            for g in groups()]
    for key, f, hint in schema_fields():
        if key == "model":
            rows += [Setting(f"model.{name}", kind, default, text)
                     for name, (kind, default, text) in MODEL_FIELDS.items()]
            continue
        if key == "hardware":
            rows += hardware_settings()
            continue
        rows.append(Setting(key, _type_name(hint), field_default(f), f.metadata.get("help", ""),
                            tuple(f.metadata.get("choices", ()))))
    return rows


TEMPLATE = CONF_DIR / "hardware" / "TEMPLATE.yaml"
_TEMPLATE_LINE = re.compile(r"^(?P<indent> *)(?P<key>\w+):[^#]*(#\s*(?P<help>.*))?$")


def hardware_settings() -> list[Setting]:
    """The numbers of a hardware profile, explained by conf/hardware/TEMPLATE.yaml's comments
    (the template is where a profile's fields are documented); ``hardware.x.y=`` overrides one."""
    from simulator.hardware import PROFILE_CHOICES, PROFILE_FIELDS

    text: dict[str, str] = {}
    section = None
    for line in TEMPLATE.read_text().splitlines():
        m = _TEMPLATE_LINE.match(line)
        if not m:
            continue
        if not m["indent"]:
            section = m["key"]
            text[section] = m["help"] or ""
        elif section is not None:
            text[f"{section}.{m['key']}"] = m["help"] or ""
    fields = [(f"{sec}.{name}", required) for sec, names in PROFILE_FIELDS.items()
              for name, (required, _, _) in names.items()]
    fields += [("host_ram_bytes", False), ("host_pinned_bytes", False)]
    kinds = {key: "number" if required else "number or null" for key, required in fields}
    for sec, names in PROFILE_CHOICES.items():
        for name, options in names.items():
            kinds[f"{sec}.{name}"] = " or ".join(options)
    rows = []
    for key, kind in kinds.items():
        help_text = text.get(key, "").removeprefix("optional: ")
        section = text.get(key.split(".")[0], "") if "." in key else ""
        rows.append(Setting(f"hardware.{key}", kind,
                            "(profile)", f"{help_text} [{section}]" if section else help_text))
    return rows


_GROUP_HELP = {
    "trace": "a trace preset (conf/trace/), or trace.path=FILE",
    "model": "expert and dense byte sizes: trace (the trace's) or a model preset",
    "hardware": "a hardware profile preset, or a profile file: hardware=PATH.yaml",
    "cache": "the cache layout preset (cache.* fields below)",
    "policy": "the strategy preset (it may also set cache.eviction and admission.beta)",
}


def _shown(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


HELP_HEAD = """\
moe-sim: replay a router trace through an expert-offloading policy; write summary.json,
per_token.parquet and per_layer.parquet into the run directory.

usage: moe-sim [GROUP=PRESET] [KEY=VALUE ...]        one run (runs/<date>/<time>_<overrides>/)
       moe-sim -m KEY=A,B [KEY=C,D ...]              a sweep over every combination
                                                     (multirun/<date>/<time>/<job>/; report:
                                                     moe-report DIR)
       moe-sim --hydra-help                          Hydra's own flags (launchers, --cfg job, ...)
A bad setting stops with one line 'moe-sim: error: ...' and exit code 2.
"""


def help_text(width: int = 100) -> str:
    """``moe-sim --help``: every preset and setting with type, default, help and choices."""
    out = [HELP_HEAD, "Presets (GROUP=PRESET):"]
    rows = settings()
    for s in (r for r in rows if r.type == "preset"):
        out.append(f"  {s.key}={_shown(s.default)}  {s.help}")
        out += [f"      {name:<26} {text}" if text else f"      {name}"
                for name, text in group_options(s.key).items()]
    out.append("\nSettings (KEY=VALUE; type, default):")
    for s in (r for r in rows if r.type != "preset"):
        out.append(f"  {s.key}  ({s.type}, default {_shown(s.default)})")
        text = s.help + (f"; one of: {', '.join(s.choices)}" if s.choices else "")
        out += textwrap.wrap(text, width, initial_indent=" " * 6, subsequent_indent=" " * 6)
    return "\n".join(out) + "\n"


def markdown_table() -> str:
    """The README's override table (one row per setting; presets list their choices)."""
    lines = ["| override | type | default | what |", "|---|---|---|---|"]
    for s in settings():
        what = s.help.replace("|", "\\|")
        if s.choices:
            what += "; " + ", ".join(f"`{c}`" for c in s.choices)
        key = f"`{s.key}`" if s.type != "preset" else f"`{s.key}=`"
        lines.append(f"| {key} | {s.type} | `{_shown(s.default)}` | {what} |")
    return "\n".join(lines)


TABLE_BEGIN = "<!-- overrides: python -m simulator.config --write-readme -->"
TABLE_END = "<!-- /overrides -->"


def readme_with_table(text: str) -> str:
    """README text with the block between the override-table markers regenerated."""
    pattern = re.compile(re.escape(TABLE_BEGIN) + ".*?" + re.escape(TABLE_END), re.S)
    if not pattern.search(text):
        raise InputError(f"{README}: no override table markers ({TABLE_BEGIN} ... {TABLE_END})")
    return pattern.sub(lambda _: f"{TABLE_BEGIN}\n{markdown_table()}\n{TABLE_END}", text)


# --- overrides checked before Hydra composes ---------------------------------------------------

HYDRA_KEYS = ("hydra",)  # Hydra's own node and groups (hydra/launcher=...)


def _known_keys() -> dict[str, Any]:
    """Dotted schema key -> resolved type (``Any`` for the free-form groups)."""
    return {key: hint for key, _, hint in schema_fields()}


def _choices() -> dict[str, tuple[str, ...]]:
    return {key: tuple(f.metadata["choices"]) for key, f, _ in schema_fields()
            if "choices" in f.metadata}


def check_overrides(overrides: Sequence[str]) -> None:
    """Raise one InputError for the first override moe-sim cannot take: a syntax error, an unknown
    preset or key (``+`` additions included, with the closest known key), a value of the wrong
    type, an int beyond int64, or a value outside a field's choices. Every value of a sweep is
    checked; interpolations (``${...}``) and glob sweeps are left to Hydra."""
    parsed = parse_overrides(overrides)
    known, choices, group_names = _known_keys(), _choices(), groups()
    for o in parsed:
        key = o.key_or_group
        if key.split("/")[0].split(".")[0] in HYDRA_KEYS or o.is_delete():
            continue
        if o.is_sweep_override() and o.value_type.name == "GLOB_CHOICE_SWEEP":
            continue
        values = list(o.sweep_iterator()) if o.is_sweep_override() else [o.value()]
        if key in group_names and not o.is_add():
            for value in values:
                _check_preset(key, value)
            continue
        free = next((g for g in ("hardware", "model") if key.startswith(g + ".")), None)
        if free is not None:
            continue  # checked with the profile or model when the run starts
        if key not in known:
            raise InputError(_unknown(key, o.is_add(), known))
        if o.is_add() and not o.is_force_add():
            raise InputError(f"'+{key}' adds a setting that exists; write {key}=... without the +")
        for value in values:
            _check_value(key, value, known[key], choices.get(key))


def parse_overrides(overrides: Sequence[str]) -> list:
    """Hydra's parse of ``overrides``; a syntax error as one InputError naming the override."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    parser = OverridesParser.create()
    parsed = []
    for text in overrides:
        try:
            parsed += parser.parse_overrides([text])
        except OverrideParseException:
            raise InputError(f"'{text}' is not KEY=VALUE in Hydra's override syntax; quote a value "
                             f"with special characters, e.g. 'key=\"a^b\"'") from None
    return parsed


def _check_preset(group: str, value: Any) -> None:
    options = group_options(group)
    if isinstance(value, str) and (value in options or (CONF_DIR / group / f"{value}.yaml").is_file()):
        return
    extra = " or a profile file hardware=PATH.yaml" if group == "hardware" else ""
    named = f"'{group}={_shown(value) if value != '' else ''}'"
    raise InputError(f"{named} is not a {group} preset; choose one of: {', '.join(options)}{extra}")


def _unknown(key: str, added: bool, known: dict[str, Any]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    given = f"+{key}" if added else key
    return (f"unknown setting '{given}'; {hint}moe-sim --help lists every setting "
            "(only hardware.* and model.* take new keys)")


def _check_value(key: str, value: Any, hint, choices: tuple[str, ...] | None) -> None:
    """One value against its field's type, int64 range and choices."""
    if isinstance(value, str) and "${" in value:
        return
    args = typing.get_args(hint)
    kinds = [a for a in args if a is not type(None)] if args else [hint]
    if value is None:
        if type(None) in args:
            return
        raise InputError(f"'{key}' cannot be null; give a {_type_name(hint)}")
    kind = kinds[0]
    shown = f"'{key}={_shown(value)}'"
    if kind is bool:
        if not isinstance(value, bool):
            raise InputError(f"{shown} must be true or false")
    elif kind is int:
        if isinstance(value, str):
            try:
                value = int(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, int):
            raise InputError(f"{shown} must be a whole number, e.g. {key}=1000")
        if not INT64_MIN <= value <= INT64_MAX:
            raise InputError(f"{shown} is beyond the int64 range (at most {INT64_MAX}); check the "
                             "number of digits")
    elif kind is float:
        if isinstance(value, bool | list | dict) or not _reads_as_float(value):
            raise InputError(f"{shown} must be a number, e.g. {key}=0.25 (inf for none)")
    elif kind is str and isinstance(value, list | dict):
        raise InputError(f"{shown} must be one value, not a list or mapping")
    if choices and value not in choices:
        raise InputError(f"{shown} is not valid; choose one of: {', '.join(choices)}")


def _reads_as_float(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    """``python -m simulator.config [--write-readme]``: print the override table, or rewrite the
    README's copy of it."""
    args = sys.argv[1:] if argv is None else argv
    if args == ["--write-readme"]:
        from traces.atomic import atomic_write_text

        atomic_write_text(README, readme_with_table(README.read_text()))
        return 0
    sys.stdout.write(markdown_table() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
