"""Load a Hugging Face causal LM (local directory or hub id) and its adapter."""

from __future__ import annotations

import os
import re
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from qtool.errors import QtoolError
from qtool.models.adapters import Adapter, adapter_for, supported_architectures

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_hub_id(ref: str, base: Path | None = None) -> bool:
    """A reference that is not an existing path (relative to `base` or the working directory) and looks like
    `org/name`."""
    if ref.startswith((".", "/", "~")) or not _HUB_ID.match(ref):
        return False
    return not os.path.exists(ref) and not (base is not None and (base / ref).exists())


def load_config(ref: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(ref)
    except (OSError, ValueError) as e:
        raise QtoolError(f"model '{ref}': cannot read its config ({_first_line(e)}); expected a model directory "
                         f"with config.json or a reachable hub id") from None


def check_architecture(ref: str, config: PretrainedConfig) -> Adapter:
    adapter = adapter_for(getattr(config, "architectures", None))
    if adapter is None:
        found = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise QtoolError(f"model '{ref}': architecture {found} is not supported; expected one of "
                         f"{', '.join(supported_architectures())}")
    return adapter


def config_dtype(config: PretrainedConfig) -> torch.dtype:
    dt = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    if isinstance(dt, str):
        dt = getattr(torch, dt)
    return dt


def load_model(ref: str, dtype: torch.dtype = torch.float32):
    """Return (model on CPU in `dtype`, tokenizer, adapter, original parameter dtype)."""
    config = load_config(ref)
    adapter = check_architecture(ref, config)
    original = config_dtype(config)
    try:
        model = AutoModelForCausalLM.from_pretrained(ref, dtype=dtype, low_cpu_mem_usage=True)
        tokenizer = AutoTokenizer.from_pretrained(ref)
    except (OSError, ValueError) as e:
        raise QtoolError(f"model '{ref}': cannot be loaded ({_first_line(e)})") from None
    model.eval()
    return model, tokenizer, adapter, original


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def resolve_path(ref: str, base: Path) -> str:
    """Resolve a local reference relative to `base` (the recipe's folder); hub ids pass through."""
    if is_hub_id(ref, base):
        return ref
    p = Path(os.path.expanduser(ref))
    return str(p if p.is_absolute() else (base / p).resolve())
