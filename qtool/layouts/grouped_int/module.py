"""Executes the `grouped_int` layout. The reference path dequantizes in float32 and runs a dense matmul; it is the
ground truth every CUDA kernel (qtool/layouts/grouped_int/cuda.py) is tested against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qtool.layouts.grouped_int.layout import GroupedIntWeight
from qtool.layouts.module import PackedLinear


class GroupedIntLinear(PackedLinear):
    layout_cls = GroupedIntWeight
    cuda_module = "qtool.layouts.grouped_int.cuda"
    pinned_dtypes = {"scales": torch.float16}

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dense_weight(x.device, x.dtype, scoped=True), bias)

    def extra_repr(self) -> str:
        g = self.spec.group_size or "channel"
        kind = "sym" if self.spec.symmetric else "asym"
        return f"in={self.in_features}, out={self.out_features}, w{self.spec.bits} g={g} {kind}"
