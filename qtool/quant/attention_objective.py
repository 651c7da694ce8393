"""QServe's clipping objective for q_proj and k_proj (Eq. 10): their quantization error matters through the
attention it produces, not through their own outputs, so a clip ratio is scored by the error of the attention
output over the calibration inputs with that projection's weight replaced.

The attention output is taken before o_proj (the per-head outputs, concatenated): heads are then independent, so a
query head's rows, or a KV head's rows (summing the errors of the query heads that share it), choose their ratio
on their own. Block(X; W) of Eq. 10 would add o_proj, which mixes the heads and makes the search one ratio per
layer."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from qtool.calibration.capture import StopForward


class AttentionProbe:
    """The calls the block makes to its attention module on the calibration inputs, and the per-head output of each
    with the weights the block has now (the reference)."""

    def __init__(
        self,
        block: nn.Module,
        attention: nn.Module,
        o_proj: nn.Module,
        inputs: list[torch.Tensor],
        kwargs: dict,
        heads: int,
        kv_heads: int,
        head_dim: int,
    ) -> None:
        self.attention, self.o_proj = attention, o_proj
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.calls: list[tuple[tuple, dict]] = []

        def grab(module, args, kw):
            self.calls.append((args, kw))
            raise StopForward

        handle = attention.register_forward_pre_hook(grab, with_kwargs=True)
        try:
            with torch.no_grad():
                for x in inputs:
                    try:
                        block(x, **kwargs)
                    except StopForward:
                        pass
        finally:
            handle.remove()
        self.reference = [self._heads_output(a, k) for a, k in self.calls]

    def _heads_output(self, args: tuple, kwargs: dict) -> torch.Tensor:
        got: list[torch.Tensor] = []

        def grab(module, a):
            got.append(a[0])
            raise StopForward

        handle = self.o_proj.register_forward_pre_hook(grab)
        try:
            with torch.no_grad():
                try:
                    self.attention(*args, **kwargs)
                except StopForward:
                    pass
        finally:
            handle.remove()
        return got[0].float().reshape(-1, self.heads, self.head_dim)

    def head_errors(self, linear: nn.Linear, weight: torch.Tensor) -> torch.Tensor:
        """Squared error of each query head's output [heads] with `linear`'s weight set to `weight`."""
        old = linear.weight.data
        linear.weight.data = weight.to(device=old.device, dtype=old.dtype)
        try:
            err = torch.zeros(self.heads, dtype=torch.float64)
            for (a, k), ref in zip(self.calls, self.reference, strict=True):
                d = self._heads_output(a, k) - ref
                err += (d.double() ** 2).sum(dim=(0, 2)).cpu()
        finally:
            linear.weight.data = old
        return err

    def row_score(self, linear: nn.Linear, kind: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """A per-row error function of a candidate weight of q_proj (`kind` "q") or k_proj ("k"): the error of the
        head the row belongs to."""
        group = self.heads // self.kv_heads

        def score(weight: torch.Tensor) -> torch.Tensor:
            err = self.head_errors(linear, weight)
            if kind == "k":
                err = err.view(self.kv_heads, group).sum(dim=1)
            rows = err.repeat_interleave(self.head_dim)
            if rows.numel() != weight.shape[0]:
                raise ValueError(
                    f"attention objective: found {weight.shape[0]} rows, expected {rows.numel()} "
                    f"({'query' if kind == 'q' else 'key'} heads x head_dim {self.head_dim})"
                )
            return rows.to(device=weight.device, dtype=weight.dtype)

        return score
