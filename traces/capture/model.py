"""Loading the model to capture: a local checkpoint, or a random initialisation from a config."""
from __future__ import annotations

from pathlib import Path

import torch

from traces.capture.config import ModelConfig
from traces.capture.routers import RouterSite, find_routers
from traces.errors import InputError


def resolve_device(device: str) -> torch.device:
    """``auto`` picks the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"model.device={device} but no CUDA device is available")
    return dev


def _dtype(name: str, default: torch.dtype | str) -> torch.dtype | str:
    if name == "auto":
        return default
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise InputError(f"model.dtype={name} is not a floating-point torch dtype")
    return dtype


def _load_config(cfg: ModelConfig):
    from transformers import AutoConfig

    if (cfg.path is None) == (cfg.config is None):
        raise InputError("give exactly one of model.path (a checkpoint) or model.config (a config.json)")
    src = Path(cfg.path or cfg.config).expanduser()
    if not src.exists():
        raise InputError(f"model source '{src}' does not exist")
    try:
        return AutoConfig.from_pretrained(str(src)), src
    except (OSError, ValueError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"cannot read a model config from '{src}': {first}") from None


def check_routers(config) -> None:
    """Fail fast, before any weight is loaded, when the architecture has no supported router."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        try:
            skeleton = AutoModelForCausalLM.from_config(config)
        except ValueError as e:
            raise InputError(f"not a causal language model config: {str(e).splitlines()[0]}") from None
    find_routers(skeleton)


def load_model(cfg: ModelConfig) -> tuple[torch.nn.Module, object, list[RouterSite], str]:
    """(model in eval mode on its device, tokenizer, router sites, model name)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config, src = _load_config(cfg)
    check_routers(config)
    device = resolve_device(cfg.device)
    kwargs = {}
    if cfg.attn_implementation:
        kwargs["attn_implementation"] = cfg.attn_implementation
    if cfg.path is not None:
        model = AutoModelForCausalLM.from_pretrained(str(src), dtype=_dtype(cfg.dtype, "auto"), **kwargs)
        tok_src = cfg.tokenizer or str(src)
    else:
        torch.manual_seed(cfg.seed)
        dtype = _dtype(cfg.dtype, torch.bfloat16)
        config.dtype = dtype
        with device:  # initialise where it will run: a large random model never visits the CPU
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
        tok_src = cfg.tokenizer or str(src.parent if src.is_file() else src)
    try:
        tokenizer = AutoTokenizer.from_pretrained(tok_src)
    except (OSError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise InputError(f"no tokenizer at '{tok_src}' (set model.tokenizer): {first}") from None
    if len(tokenizer) > model.config.vocab_size:
        raise InputError(
            f"tokenizer has {len(tokenizer)} tokens but the model's vocabulary is {model.config.vocab_size}"
        )
    model.to(device).eval()
    name = cfg.name or (src.name if src.is_dir() else src.parent.name if src.name == "config.json" else src.stem)
    return model, tokenizer, find_routers(model), name
