"""Executes the `qoq` layout (formats/qoq.md): per-token symmetric INT8 activations, an exact int32 product with the
layer's integer weight, and the float32 epilogue `acc·(s_x·s0) + bias`. This torch path is the ground truth the
CUDA kernels (qtool/cuda/qoq.py) are checked against; on a GPU, `forward` takes a kernel where one applies."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from qtool.layouts.qoq.layout import ACT_BITS, QoQWeight
from qtool.layouts.quik.module import int_matmul

ACT_MAX = (1 << (ACT_BITS - 1)) - 1  # 127: symmetric, -128 unused


class ActInt8(NamedTuple):
    codes: torch.Tensor  # int32 [T, K] in -127..127
    scale: torch.Tensor  # float32 [T]: s_x
    rowsum: torch.Tensor  # int32 [T]: Σ_k codes


def quantize_activations(x: torch.Tensor) -> ActInt8:
    """Per-token symmetric INT8 of `x` [T, K] (float32): `a = max|x|`, `r = 127/a`, `s_x = a/127` (both IEEE
    float32 divisions; `r = s_x = 1` when a = 0), `q = clamp(round_half_even(x·r), -127, 127)` with `x·r` one
    float32 multiply."""
    amax = x.abs().amax(dim=1)
    empty = amax == 0
    one = torch.ones_like(amax)
    top = torch.full_like(amax, float(ACT_MAX))
    # Divide by a tensor, not a Python number: torch on CUDA turns division by a scalar into multiplication by its
    # reciprocal, which is not the IEEE quotient the format specifies.
    safe = torch.where(empty, one, amax)
    recip = torch.where(empty, one, top / safe)
    scale = torch.where(empty, one, safe / top)
    codes = torch.clamp(torch.round(x * recip[:, None]), -ACT_MAX, ACT_MAX).to(torch.int32)
    return ActInt8(codes, scale, codes.sum(dim=1, dtype=torch.int32))


class QoQLinear(nn.Module):
    def __init__(self, weight: QoQWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.bits = weight.bits
        self.group_size = weight.group_size
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("group_scales", weight.group_scales)
        self.register_buffer("zeros", weight.zeros)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.bias = None
        # The reference's int32 operand, unpacked on first use on each device (a kernel never needs it).
        self._operand: torch.Tensor | None = None

    @property
    def layout(self) -> QoQWeight:
        return QoQWeight(
            self.bits,
            self.group_size,
            self.in_features,
            self.out_features,
            self.qweight,
            self.scales,
            self.group_scales,
            self.zeros,
        )

    @property
    def per_channel_zeros(self) -> bool:
        """W4 per channel: the product runs on the codes q and subtracts `z[n]·rowsum[t]` (the same integer)."""
        return self.bits == 4 and self.group_size is None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.layout.dequantize(dtype)

    def weight_operand(self) -> torch.Tensor:
        """int32 [N, K]: Q8 (W8), the codes q (W4 per channel), s1·(q - z) (progressive)."""
        w = self._operand
        if w is None or w.device != self.qweight.device:
            layout = self.layout
            w = layout.codes() if self.per_channel_zeros else layout.integer_weight()
            self._operand = w = w.to(torch.int32)
        return w

    def accumulate(self, act: ActInt8) -> torch.Tensor:
        """`acc[t,n] = Σ_k q_x[t,k]·Wint[n,k]`, exact int32."""
        w = self.weight_operand()
        wmax = 15 if self.per_channel_zeros else 128
        acc = int_matmul(act.codes, w, self.in_features * ACT_MAX * wmax)
        if self.per_channel_zeros:
            acc = acc - act.rowsum[:, None] * self.zeros.to(torch.int32)[None, :]
        return acc

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            try:  # CPU use never loads the GPU runtime; a build without it runs the reference
                from qtool.layouts.qoq.cuda import module_forward
            except ImportError:
                module_forward = None
            if module_forward is not None:
                y = module_forward(self, x)
                if y is not None:
                    return y
        return self.reference_forward(x)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        act = quantize_activations(x.reshape(-1, self.in_features).to(torch.float32))
        acc = self.accumulate(act)
        # The two scales multiply first (float32), then the accumulator: the order a kernel's epilogue uses.
        y = acc.to(torch.float32) * (act.scale[:, None] * self.scales.to(torch.float32)[None, :])
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _apply(self, fn, recurse: bool = True):
        # `model.to(dtype)` casts floating buffers; the packed scales must stay float16.
        super()._apply(fn, recurse)
        if self.scales.dtype != torch.float16:
            self.scales = self.scales.to(torch.float16)
        return self

    def extra_repr(self) -> str:
        g = self.group_size or "channel"
        return f"in={self.in_features}, out={self.out_features}, w{self.bits}a{ACT_BITS} g={g}"
