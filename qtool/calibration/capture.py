"""Capture what the first decoder block receives: each sample's hidden states and the shared keyword arguments
(attention mask, rotary embeddings, positions), so blocks can then be run one at a time."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class StopForward(Exception):
    """Raised from a hook to end a forward pass once it has produced what was needed."""


def to_device(obj: Any, device: torch.device | str) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def capture_block_inputs(
    model: nn.Module, blocks: nn.ModuleList, windows: torch.Tensor, device: torch.device, store=None
) -> tuple[list[torch.Tensor], dict]:
    """Run the model up to its first block for each window; return ([1, T, H] hidden states per window on
    `device`, or appended to `store` (an ActivationStore), the block's keyword arguments on `device`)."""
    captured: dict[str, Any] = {"inputs": [] if store is None else store}

    def hook(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        captured["inputs"].append(hidden.detach() if store is not None else hidden.detach().to(device))
        if "kwargs" not in captured:
            rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
            captured["kwargs"] = to_device(rest, device)
        raise StopForward

    # The model stays on the CPU: only the embedding runs before the hook stops the pass.
    handle = blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        embed_device = _embedding_device(model)
        with torch.no_grad():
            for row in windows:
                try:
                    model(row[None].to(embed_device), use_cache=False)
                except StopForward:
                    pass
    finally:
        handle.remove()
    return captured["inputs"], captured["kwargs"]


def _embedding_device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def block_output(out: Any) -> torch.Tensor:
    """Decoder blocks return a tensor or a tuple whose first item is the hidden states."""
    return out[0] if isinstance(out, tuple) else out
