"""Router discovery per architecture: which modules route tokens, how they score, what they chose.

Hugging Face ``transformers`` 5.x gives every supported MoE architecture a router module that
returns ``(router_logits, gate_weights, expert_ids)``: the raw logits over all experts, the
weights the experts are multiplied with, and the ids those weights belong to. A forward hook on
that module therefore sees exactly what the model used. Routers are found by class name (so no
model class has to be importable); this module knows, per family, how the scores were made, so
the trace metadata can say it, and how to put the chosen ids into rank order where the model
leaves them unsorted (DeepSeek-V3 selects with ``topk(sorted=False)``).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn

from traces.errors import InputError


@dataclass(frozen=True)
class RouterFamily:
    """How one family of router modules scores and selects experts."""

    name: str
    classes: tuple[str, ...]  # class names of the router modules of this family
    score_function: str  # "softmax" or "sigmoid"
    selection: str  # how the k experts are picked (a short description for the metadata)
    sorted_ids: bool  # the router returns ids in rank order already


SOFTMAX_TOPK = RouterFamily(
    name="softmax_topk",
    classes=(
        "Qwen3MoeTopKRouter",
        "Qwen2MoeTopKRouter",
        "Qwen3NextTopKRouter",
        "OlmoeTopKRouter",
        "MixtralTopKRouter",
    ),
    score_function="softmax",
    selection="top-k of softmax(logits)",
    sorted_ids=True,
)
# gpt-oss: top-k of the raw logits, then softmax over those k (= the full softmax renormalised).
LOGIT_TOPK = RouterFamily(
    name="logit_topk_softmax",
    classes=("GptOssTopKRouter",),
    score_function="softmax",
    selection="top-k of logits (with router bias), softmax over the k",
    sorted_ids=True,
)
# DeepSeek-V3: sigmoid scores; selection on score + e_score_correction_bias within the best
# topk_group of n_group groups; weights are the unbiased scores, optionally renormalised, times
# routed_scaling_factor.
GROUPED_SIGMOID = RouterFamily(
    name="grouped_sigmoid",
    classes=("DeepseekV3TopkRouter",),
    score_function="sigmoid",
    selection="group-limited top-k of sigmoid(logits) + selection bias",
    sorted_ids=False,
)
FAMILIES = (SOFTMAX_TOPK, LOGIT_TOPK, GROUPED_SIGMOID)
_BY_CLASS = {cls: fam for fam in FAMILIES for cls in fam.classes}
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ROUTER_LIKE = re.compile(r"(Router|Gate)$")


@dataclass
class RouterSite:
    """One MoE layer's router: where it sits and what it routes between."""

    layer_id: int  # real decoder-layer index in the model
    name: str  # module path, e.g. "model.layers.3.mlp.gate"
    module: nn.Module
    family: RouterFamily
    num_experts: int
    top_k: int
    moe_block: nn.Module  # the router's parent (holds the experts and any shared expert)
    decoder_layer: nn.Module | None


def _parent_name(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else ""


def find_routers(model: nn.Module) -> list[RouterSite]:
    """Every MoE router of ``model``, ordered by layer; raises InputError if there is none."""
    sites: list[RouterSite] = []
    unknown: set[str] = set()
    for name, module in model.named_modules():
        cls = type(module).__name__
        family = _BY_CLASS.get(cls)
        if family is None:
            if _ROUTER_LIKE.search(cls) and hasattr(module, "top_k"):
                unknown.add(cls)
            continue
        m = _LAYER_INDEX.search(name)
        if m is None:
            raise InputError(f"router module '{name}' is not inside a numbered decoder layer")
        layer_id = int(m.group(1))
        block_name = _parent_name(name)
        layer_name = name[: m.end() - 1]
        sites.append(
            RouterSite(
                layer_id=layer_id,
                name=name,
                module=module,
                family=family,
                num_experts=int(module.num_experts),
                top_k=int(module.top_k),
                moe_block=model.get_submodule(block_name),
                decoder_layer=model.get_submodule(layer_name),
            )
        )
    if not sites:
        known = ", ".join(sorted(_BY_CLASS))
        found = f"; unsupported router types found: {', '.join(sorted(unknown))}" if unknown else ""
        raise InputError(
            f"model {type(model).__name__} has no MoE router of a supported type "
            f"(supported: {known}){found}"
        )
    sites.sort(key=lambda s: s.layer_id)
    ids = [s.layer_id for s in sites]
    if len(set(ids)) != len(ids):
        raise InputError(f"more than one router per decoder layer in {type(model).__name__}: {ids}")
    for attr in ("num_experts", "top_k"):
        values = {getattr(s, attr) for s in sites}
        if len(values) != 1:
            raise InputError(f"MoE layers differ in {attr} ({sorted(values)}); a trace needs one value")
    return sites


def rank_order(site: RouterSite, logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor | None:
    """Permutation (N, k) that puts the model's chosen ids in rank order, or None if they are.

    The ids are the model's; only their order is derived, from the score the router selected
    on (DeepSeek-V3: sigmoid(logit) + selection bias).
    """
    if site.family.sorted_ids:
        return None
    score = torch.sigmoid(logits.float()).gather(1, ids)
    bias = getattr(site.module, "e_score_correction_bias", None)
    if bias is not None:
        score = score + bias.float()[ids]
    return torch.argsort(score, dim=1, descending=True, stable=True)


def _renormalize(site: RouterSite) -> bool:
    if site.family is LOGIT_TOPK:
        return True
    return bool(getattr(site.module, "norm_topk_prob", True))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def checkpoint_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the checkpoint stores its weights in (config.dtype), else the loaded one."""
    dtype = getattr(model.config, "dtype", None) or getattr(model.config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next(model.parameters()).dtype


def _param_elements(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _shared_expert(block: nn.Module) -> nn.Module | None:
    for attr in ("shared_expert", "shared_experts", "shared_mlp"):
        sub = getattr(block, attr, None)
        if isinstance(sub, nn.Module):
            return sub
    return None


def routing_metadata(model: nn.Module, sites: list[RouterSite]) -> dict:
    """Per-model routing facts for TraceMeta: scoring, renormalisation, expert and dense bytes.

    Returns a dict with keys ``num_experts, top_k, layer_ids, score_function, renormalize,
    dtype, expert_bytes, dense_bytes, extra``. Byte sizes are for the checkpoint dtype:
    ``expert_bytes`` is one routed expert (all its weight and bias tensors), ``dense_bytes`` the
    rest of the decoder layer (attention, norms, router, shared expert).
    """
    dtype = checkpoint_dtype(model)
    itemsize = torch.empty((), dtype=dtype).element_size()
    E = sites[0].num_experts
    expert_bytes, dense_bytes, shared_bytes = [], [], []
    for s in sites:
        experts = getattr(s.moe_block, "experts", None)
        if experts is None:
            raise InputError(f"MoE block of '{s.name}' has no 'experts' module")
        per_expert = sum(p.numel() for p in experts.parameters() if p.dim() and p.shape[0] == E)
        if per_expert == 0:  # experts kept as a ModuleList of E modules
            per_expert = _param_elements(experts)
        expert_bytes.append(per_expert // E * itemsize)
        dense_bytes.append((_param_elements(s.decoder_layer) - _param_elements(experts)) * itemsize)
        shared_bytes.append(_param_elements(_shared_expert(s.moe_block)) * itemsize)
    first = sites[0]
    family = first.family
    extra: dict = {
        "router_family": family.name,
        "router_class": type(first.module).__name__,
        "selection": family.selection,
        "architecture": type(model).__name__,
        "model_type": getattr(model.config, "model_type", ""),
        "num_decoder_layers": int(getattr(model.config, "num_hidden_layers", 0) or 0),
        "shared_experts": int(getattr(model.config, "n_shared_experts", 0) or 0)
        or (1 if any(shared_bytes) else 0),
        "shared_expert_bytes": shared_bytes,
    }
    if any(shared_bytes) and hasattr(first.moe_block, "shared_expert_gate"):
        extra["shared_expert_gate"] = "sigmoid"
    if family is GROUPED_SIGMOID:
        m = first.module
        extra.update(
            selection_bias=getattr(m, "e_score_correction_bias", None) is not None,
            n_group=int(m.num_group),
            topk_group=int(m.topk_group),
            routed_scaling_factor=float(m.routed_scaling_factor),
        )
    if family is LOGIT_TOPK:
        extra["router_bias"] = getattr(first.module, "bias", None) is not None
    qc = getattr(model.config, "quantization_config", None)
    if qc:
        extra["quantization"] = qc if isinstance(qc, dict) else getattr(qc, "to_dict", dict)()
    return {
        "num_experts": E,
        "top_k": first.top_k,
        "layer_ids": [s.layer_id for s in sites],
        "score_function": family.score_function,
        "renormalize": _renormalize(first),
        "dtype": _dtype_name(dtype),
        "expert_bytes": expert_bytes,
        "dense_bytes": dense_bytes,
        "extra": extra,
    }
