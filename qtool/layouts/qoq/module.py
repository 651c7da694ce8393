"""Executes the `qoq` layout (formats/qoq.md): per-token symmetric INT8 activations, an exact int32 product with the
layer's integer weight, and the float32 epilogue `acc·(s_x·s0) + bias`. This torch path is the ground truth the
CUDA kernels (qtool/layouts/qoq/cuda.py) are checked against; on a GPU, `forward` takes a kernel where one applies."""

from __future__ import annotations

import torch

from qtool.layouts.base import int_matmul
from qtool.layouts.module import PackedLinear
from qtool.layouts.qoq.layout import ACT_BITS, ACT_MAX, ActInt8, QoQWeight, quantize_activations


class QoQLinear(PackedLinear):
    layout_cls = QoQWeight
    cuda_module = "qtool.layouts.qoq.cuda"
    pinned_dtypes = {"scales": torch.float16}

    @property
    def per_channel_zeros(self) -> bool:
        """W4 per channel: the product runs on the codes q and subtracts `z[n]·rowsum[t]` (the same integer)."""
        return self.bits == 4 and self.group_size is None

    def weight_operand(self) -> torch.Tensor:
        """int32 [N, K]: Q8 (W8), the codes q (W4 per channel), s1·(q - z) (progressive); unpacked on first use on
        each device (a kernel never needs it)."""

        def make() -> torch.Tensor:
            layout = self.layout
            w = layout.codes() if self.per_channel_zeros else layout.integer_weight()
            return w.to(torch.int32)

        return self.derived("operand", make, valid=lambda w: w.device == self.qweight.device)

    def accumulate(self, act: ActInt8) -> torch.Tensor:
        """`acc[t,n] = Σ_k q_x[t,k]·Wint[n,k]`, exact int32."""
        w = self.weight_operand()
        wmax = 15 if self.per_channel_zeros else 128
        acc = int_matmul(act.codes, w, self.in_features * ACT_MAX * wmax)
        if self.per_channel_zeros:
            acc = acc - act.rowsum[:, None] * self.zeros.to(torch.int32)[None, :]
        return acc

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        act = quantize_activations(x.reshape(-1, self.in_features).to(torch.float32))
        acc = self.accumulate(act)
        # The two scales multiply first (float32), then the accumulator: the order a kernel's epilogue uses.
        y = acc.to(torch.float32) * (act.scale[:, None] * self.scales.to(torch.float32)[None, :])
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        g = self.group_size or "channel"
        return f"in={self.in_features}, out={self.out_features}, w{self.bits}a{ACT_BITS} g={g}"
