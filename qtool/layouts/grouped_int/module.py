"""Quantized replacements for `nn.Linear`, one class per packed layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qtool.layouts.grouped_int.layout import GroupedIntWeight
from qtool.quant.grid import GridSpec


class GroupedIntLinear(nn.Module):
    """Executes the `grouped_int` layout. The reference path dequantizes in float32 and runs a dense matmul;
    it is the ground truth every CUDA kernel is tested against."""

    def __init__(self, weight: GroupedIntWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.spec: GridSpec = weight.spec
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("zeros", weight.zeros)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.bias = None
        self.reference_cache: dict | None = None  # see qtool/runtime/cache.py

    @property
    def layout(self) -> GroupedIntWeight:
        return GroupedIntWeight(
            self.spec, self.in_features, self.out_features, self.qweight, self.scales, self.zeros
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.layout.dequantize(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # Imported here so CPU-only use never loads the GPU runtime (which imports cupy lazily anyway).
            from qtool.layouts.grouped_int.cuda import module_forward

            y = module_forward(self, x)
            if y is not None:
                return y
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.reference_weight(x.dtype), bias)

    def reference_weight(self, dtype: torch.dtype) -> torch.Tensor:
        cache = getattr(self, "reference_cache", None)
        w = None if cache is None else cache.get(dtype)
        if w is None:
            w = self.dequantize(torch.float32).to(dtype)
            if cache is not None:
                cache[dtype] = w
        return w

    def _apply(self, fn, recurse: bool = True):
        # `model.to(dtype)` / `.half()` cast floating buffers; the packed scales must stay float16.
        super()._apply(fn, recurse)
        if self.scales.dtype != torch.float16:
            self.scales = self.scales.to(torch.float16)
        return self

    def extra_repr(self) -> str:
        g = self.spec.group_size or "channel"
        kind = "sym" if self.spec.symmetric else "asym"
        return f"in={self.in_features}, out={self.out_features}, w{self.spec.bits} g={g} {kind}"
