"""Policy families, each a registry of variants; one module per variant.

A variant module holds its kernel hooks (Numba, specialised into the engine at compile time:
:func:`simulator.jit.specialise`) and its reference twin (plain Python) side by side, with the
same meaning; each family's package docstring lists the hooks. Families:

- ``eviction``: which resident leaves a pool over budget (lru, fifo, lfu, random, belady, ...);
- ``miss_rule``: which misses are fetched synchronously (threshold: protect_ranks and tau);
- ``miss_action``: what happens to a miss that is not fetched (substitute, cpu);
- ``substitute``: which resident runs in place of a missing expert (logit, frequency);
- ``admission``: background transfers started by substitutions (none, mass: beta);
- ``predictor``: which experts a later layer will select (none, lookahead, ...);
- ``prefetch``: background transfers of predicted experts (none, topp).

A variant whose kernel hooks read the engine's selection frequencies (``core.freq``) says so
with ``READS_FREQUENCY = True``: the kernel skips counting them when no chosen variant does.
The kernel also skips the layers' resident lists where nothing substitutes, and the decode
step's marking pass before its lookups where nothing reads the marks before the step's trim
(:func:`kernel_needs`).

A variant's own settings are an ``Options`` dataclass in its module (one field per setting,
with help text); moe-sim exposes them under the family's config section.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import typing
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import NamedTuple

from traces.errors import InputError


class Registry(Mapping):
    """The variants of one policy family by name; a variant's module is imported on first use."""

    def __init__(self, family: str, package: str, names: tuple[str, ...]):
        self.family, self.package, self._names = family, package, names
        self._modules: dict[str, ModuleType] = {}  # imported so far (a run asks ~40 times)

    def __getitem__(self, name: str) -> ModuleType:
        module = self._modules.get(name)
        if module is None:
            if name not in self._names:
                raise InputError(
                    f"{self.family} '{name}' is not known; choose one of: {', '.join(self._names)}"
                )
            module = self._modules[name] = importlib.import_module(f"{self.package}.{name}")
        return module

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def option_fields(self) -> list[tuple[dataclasses.Field, type]]:
        """Every variant's ``Options`` fields with their resolved types (a name belongs to one
        variant)."""
        out: dict[str, tuple[dataclasses.Field, type]] = {}
        for name in self._names:
            options = getattr(self[name], "Options", None)
            hints = typing.get_type_hints(options) if options else {}
            for f in dataclasses.fields(options) if options else ():
                if f.name in out and out[f.name][0] is not f:  # variants may share one Options
                    raise RuntimeError(f"{self.family}: option '{f.name}' defined twice")
                out[f.name] = (f, hints[f.name])
        return list(out.values())

    def options_of(self, name: str, values: Mapping) -> dict:
        """The chosen variant's options from ``values`` (a config section), checked against
        each field's ``min``; missing ones take their defaults."""
        options = getattr(self[name], "Options", None)
        if options is None:
            return {}
        chosen = {}
        for f in dataclasses.fields(options):
            value = values.get(f.name, f.default)
            low = f.metadata.get("min")
            if low is not None and (value is None or value < low):
                section = self.family.split(".")[0]
                raise InputError(f"'{section}.{f.name}={value}' must be >= {low} "
                                 f"({f.metadata['help']})")
            chosen[f.name] = value
        return chosen


class NoState(NamedTuple):
    """The kernel state of a variant that keeps none."""


def no_state(params, *context) -> NoState:
    return NoState()


FAMILIES = ("eviction", "miss_rule", "miss_action", "substitute", "admission", "predictor",
            "prefetch")


@functools.cache
def registries() -> dict[str, Registry]:
    """Each family's registry, by the name the engines call its hooks under (one dict: do not
    change it)."""
    from simulator.policies import (
        admission,
        eviction,
        miss_action,
        miss_rule,
        predictor,
        prefetch,
        substitute,
    )

    return {"eviction": eviction.REGISTRY, "miss_rule": miss_rule.REGISTRY,
            "miss_action": miss_action.REGISTRY, "substitute": substitute.REGISTRY,
            "admission": admission.REGISTRY, "predictor": predictor.REGISTRY,
            "prefetch": prefetch.REGISTRY}


def chosen(params) -> dict[str, str]:
    """The variant of each family that ``params`` (a SimParams) runs.

    Families that cannot act are set to their plainest variant (a rule that fetches every miss
    never reaches its miss action; the CPU action never substitutes), so equivalent policies
    share one compiled kernel.
    """
    reg = registries()
    rule = reg["miss_rule"][params.miss_rule]
    action = params.miss_action
    leaves = rule.can_leave_misses(rule.make_state(params), params.top_k)
    substitutes = _substitutes(params)
    return {
        "eviction": params.eviction,
        "miss_rule": params.miss_rule,
        "miss_action": action if leaves else "substitute",
        "substitute": params.substitute_by if substitutes else "frequency",
        "admission": "mass" if substitutes and params.beta != float("inf") else "none",
        "predictor": params.predictor if params.prefetch != "none" else "none",
        "prefetch": params.prefetch if params.predictor != "none" else "none",
    }


class KernelNeeds(NamedTuple):
    """What a kernel must keep for the chosen variants (compile-time choices of the kernel)."""

    frequency: bool = True  # selections counted in core.freq (a READS_FREQUENCY variant)
    selections: bool = True  # a decode step runs its selection pass before its lookups
    layer_residents: bool = True  # each layer's resident list (core.layer_res) is kept
    background: bool = True  # something queues background transfers (admission, prefetch)
    leaves_misses: bool = True  # the miss rule can leave a miss unfetched (it reads the gate)
    lookup_marks: bool = True  # a decode step's rank loop marks each lookup's expert (when not marked before)
    prefetches: bool = True  # a prefetch variant can queue transfers (a miss may find one late)
    step_marks: bool = False  # the trim tells the step's used residents by their last use (no marks)


def kernel_needs(params, layout=None) -> KernelNeeds:
    """What the variants ``params`` runs read in the kernel (``layout``: the run's pools, from
    simulator.engine.layout; None assumes the least).

    - ``frequency``: a chosen variant reads ``core.freq`` (``READS_FREQUENCY``), a substitute
      only where it can act;
    - ``layer_residents``: a substitute that can act scans the layers' resident lists
      (``SCANS_LAYER_RESIDENTS``);
    - ``background``: an admission or prefetch variant can queue background transfers;
    - ``prefetches``: a prefetch variant can (else no queued transfer is a late prefetch);
    - ``step_marks``: the eviction stores each use's step (``MARKS_BY_LAST_USE``): the residents
      a step used are those last used in it, so lookups need no mark (a background arrival,
      inserted in the step and not selected, is told apart by ``core.fresh``);
    - ``leaves_misses``: the miss rule can leave a miss to the miss action (else the kernel
      fetches every miss without reading its gate);
    - ``lookup_marks``: without the marking pass, whether the trim still reads the marks that
      each lookup leaves: not for an eviction whose used residents are its last victims
      (``STEP_USES_LAST``) where every pool holds k experts of its largest size, since a trim
      then stops before it reaches one (substitutes mark themselves: a step must not use one
      twice);
    - ``selections``: before a decode step's lookups, something reads which experts the step
      selected: an eviction ``on_select`` hook or a substitute's eligibility. A substitute whose
      ``READS_SELECTION_MARKS`` is False marks them itself where it needs to. Otherwise the
      kernel counts and marks the selections where they are first read: at the step's first
      background arrival (whose trim must not evict them), or as the rank loop reaches each
      lookup's expert; frequencies and marks are the same by the step's trim, and no hook
      called in the rank loop reads another selected expert's frequency or mark.
    """
    from simulator.policies.eviction._base import ignore_select

    names = chosen(params)
    reg = registries()
    rule = reg["miss_rule"][params.miss_rule]
    substitutes = _substitutes(params)
    frequency = any(getattr(reg[family][names[family]], "READS_FREQUENCY", False)
                    for family in FAMILIES if family != "substitute" or substitutes)
    background = names["admission"] != "none" or names["prefetch"] != "none"
    selects = reg["eviction"][names["eviction"]].on_select is not ignore_select
    substitute = reg["substitute"][names["substitute"]]
    # a variant that does not say keeps both (the safe side)
    marks = substitutes and getattr(substitute, "READS_SELECTION_MARKS", True)
    step_last = getattr(reg["eviction"][names["eviction"]], "STEP_USES_LAST", False)
    step_marks = getattr(reg["eviction"][names["eviction"]], "MARKS_BY_LAST_USE", False)
    lookup_marks = not step_marks and not (step_last and layout is not None
                                           and _pools_hold_a_step(params, layout))
    return KernelNeeds(frequency=frequency, selections=selects or marks,
                       layer_residents=substitutes and getattr(substitute, "SCANS_LAYER_RESIDENTS", True), background=background,
                       leaves_misses=rule.can_leave_misses(rule.make_state(params), params.top_k),
                       lookup_marks=lookup_marks, prefetches=names["prefetch"] != "none",
                       step_marks=step_marks)


def _pools_hold_a_step(params, layout) -> bool:
    """Every pool's budget holds k experts of the largest size among its layers."""
    return bool((layout.pool_budget_bytes >= params.top_k * layout.pool_largest_bytes).all())


def _substitutes(params) -> bool:
    rule = registries()["miss_rule"][params.miss_rule]
    return (rule.can_leave_misses(rule.make_state(params), params.top_k)
            and registries()["miss_action"][params.miss_action].USES_SUBSTITUTES)


def modules(names: Mapping[str, str]) -> dict[str, ModuleType]:
    """The variant modules of ``names`` (family -> variant), in FAMILIES order."""
    reg = registries()
    return {family: reg[family][names[family]] for family in FAMILIES}
