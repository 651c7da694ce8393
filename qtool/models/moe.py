"""Mixture-of-experts blocks as linears. transformers keeps a block's experts as two 3-D tensors (`gate_up_proj`
[E, 2I, H], `down_proj` [E, H, I]) multiplied inside one module; qtool quantizes each expert's matrices as linears,
so that module is replaced by `ExpertLinears`: a list of `Expert`s with `gate_proj`, `up_proj` and `down_proj` as
nn.Linear (named `<experts>.<e>.gate_proj`, as the checkpoints on the hub store them), computing what transformers'
module computes with the same routing loop (the tokens routed to an expert, in expert order), up to the rounding
of the gate and up products taken apart. The router stays as it is, in float.

For calibration statistics only, `route_all(model)` sends every token through every expert: an expert chosen
rarely otherwise sees a handful of tokens (its Hessian then rests on the damping)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int, act_fn: nn.Module, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, inter, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(inter, hidden, bias=False, dtype=dtype, device=device)
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class ExpertLinears(nn.ModuleList):
    """The experts of one block, each one `Expert`; called as transformers calls its experts module."""

    def __init__(self, fused: nn.Module) -> None:
        gate_up, down = fused.gate_up_proj, fused.down_proj
        num, two_inter, hidden = gate_up.shape
        meta = gate_up.device.type == "meta"
        experts = []
        for e in range(num):
            ex = Expert(hidden, two_inter // 2, fused.act_fn, gate_up.dtype, gate_up.device)
            if not meta:
                with torch.no_grad():
                    gate, up = gate_up[e].chunk(2, dim=0)  # transformers' chunk: the gate rows first
                    ex.gate_proj.weight.copy_(gate)
                    ex.up_proj.weight.copy_(up)
                    ex.down_proj.weight.copy_(down[e])
            experts.append(ex)
        super().__init__(experts)
        self.route_all = False

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        if self.route_all:
            # Every token through every expert (what the statistics hooks then see), each once; the output still
            # weighs the routed experts' outputs.
            outs = torch.stack([expert(hidden_states) for expert in self])  # [E, T, H]
            tokens = torch.arange(hidden_states.shape[0], device=hidden_states.device)[:, None]
            picked = outs[top_k_index, tokens]  # [T, k, H]
            return (picked * top_k_weights[..., None]).sum(dim=1).to(hidden_states.dtype)
        final = torch.zeros_like(hidden_states)
        with torch.no_grad():
            mask = nn.functional.one_hot(top_k_index, num_classes=len(self) + 1).permute(2, 1, 0)
            hit = torch.greater(mask.sum(dim=(-1, -2)), 0).nonzero()
        for e in hit:
            e = int(e[0])
            if e == len(self):
                continue
            pos, token = torch.where(mask[e])
            out = self[e](hidden_states[token]) * top_k_weights[token, pos, None]
            final.index_add_(0, token, out.to(final.dtype))
        return final


def unfuse_experts(model: nn.Module, blocks: nn.ModuleList, path: str) -> int:
    """Replace each block's experts module (at `path` in the block) by ExpertLinears; returns how many."""
    count = 0
    for block in blocks:
        parent_name, _, child = path.rpartition(".")
        parent = block.get_submodule(parent_name) if parent_name else block
        fused = getattr(parent, child)
        if not isinstance(fused, ExpertLinears):
            setattr(parent, child, ExpertLinears(fused))
            count += 1
    return count


@contextmanager
def route_all(module: nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, every ExpertLinears under `module` also runs every expert on every token."""
    experts = [m for m in module.modules() if isinstance(m, ExpertLinears)] if enabled else []
    for m in experts:
        m.route_all = True
    try:
        yield
    finally:
        for m in experts:
            m.route_all = False
