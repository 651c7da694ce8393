"""Capture what the decoder blocks receive: each sample's hidden states entering the first block and every block's
keyword arguments (attention mask, rotary embeddings, positions), so blocks can then be run one at a time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def blocks_standing_aside(
    blocks: nn.ModuleList, seen: Callable[[int, torch.Tensor, dict], None]
) -> Iterator[None]:
    """Within the `with`, a forward of the model runs what precedes its blocks and then calls `seen(i, hidden,
    kwargs)` for each block i in turn instead of running it (the hidden states pass through unchanged; the pass
    ends with StopForward after the last block). The blocks may be on the meta device."""

    def stand_in(i: int):
        def forward(*args, **kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            seen(i, hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"})
            if i == len(blocks) - 1:
                raise StopForward
            return hidden

        return forward

    # A forward set on the instance (accelerate's hooks wrap it so) is put back afterwards.
    saved = [block.__dict__.get("forward") for block in blocks]
    for i, block in enumerate(blocks):
        block.forward = stand_in(i)
    try:
        yield
    finally:
        for block, forward in zip(blocks, saved, strict=True):
            if forward is None:
                block.__dict__.pop("forward", None)
            else:
                block.forward = forward


class BlockKwargs:
    """Each block's keyword arguments, on one device: blocks that were given the same objects (every block of a
    Llama; the blocks of one attention type in Gemma, which alternates sliding-window and full layers with their
    own masks and rotary embeddings) share one dict."""

    def __init__(self, device: torch.device | str) -> None:
        self.device = device
        self.per_block: dict[int, dict] = {}
        self._shared: dict[tuple, dict] = {}

    def add(self, i: int, kwargs: dict) -> None:
        if i in self.per_block:
            return
        key = tuple((k, id(v)) for k, v in sorted(kwargs.items()))
        if key not in self._shared:
            self._shared[key] = to_device(kwargs, self.device)
        self.per_block[i] = self._shared[key]

    def as_list(self, blocks: int) -> list[dict]:
        return [self.per_block[i] for i in range(blocks)]


def capture_block_inputs(
    model: nn.Module, blocks: nn.ModuleList, windows: torch.Tensor, device: torch.device, store=None
) -> tuple[list[torch.Tensor], list[dict]]:
    """Run the model up to its blocks for each window; return ([1, T, H] hidden states entering the first block
    per window on `device`, or appended to `store` (an ActivationStore), and each block's keyword arguments on
    `device` (BlockKwargs))."""
    inputs = [] if store is None else store
    kwargs = BlockKwargs(device)

    def seen(i: int, hidden: torch.Tensor, kw: dict) -> None:
        if i == 0:
            inputs.append(hidden.detach() if store is not None else hidden.detach().to(device))
        kwargs.add(i, kw)

    # Only the embedding (and what the model computes before its blocks) runs, where the model is.
    embed_device = _embedding_device(model)
    with blocks_standing_aside(blocks, seen), torch.no_grad():
        for row in windows:
            try:
                model(row[None].to(embed_device), use_cache=False)
            except StopForward:
                pass
    return inputs, kwargs.as_list(len(blocks))


def _embedding_device(model: nn.Module) -> torch.device:
    return model.get_input_embeddings().weight.device


def block_output(out: Any) -> torch.Tensor:
    """Decoder blocks return a tensor or a tuple whose first item is the hidden states."""
    return out[0] if isinstance(out, tuple) else out
