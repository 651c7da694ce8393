"""Executes the `mixed-2-4-16` layout (formats/mixed-2-4-16.md). On CUDA the kernels of qtool/layouts/mixed/cuda.py run
it (QTOOL_KERNELS picks, as for every layout); elsewhere, and where they do not apply, the torch reference: the
dense part `(q - z)·ŝ` as one matmul, then the CSR outliers as a separate sparse product added to its output. The
reference is what the kernels are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qtool.layouts.mixed.layout import MixedWeight
from qtool.layouts.module import PackedLinear


class MixedLinear(PackedLinear):
    layout_cls = MixedWeight
    cuda_module = "qtool.layouts.mixed.cuda"
    pinned_dtypes = {"scales_2nd": torch.float16, "scales4": torch.float16, "outlier_values": torch.float16}

    def cpu_layout(self) -> MixedWeight:
        """The layout on the CPU, where its unpacking runs (it builds CPU index tensors)."""
        return self.layout_with(lambda t: t.cpu())

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.cpu_layout().dequantize(dtype)

    def dense_float32(self) -> torch.Tensor:
        # Without the outliers: the reference adds them as a separate sparse product.
        return self.cpu_layout().dense()

    def forward_swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU of this layer's output read as a row-interleaved gate/up projection (in each run of four output
        rows: gate 2j, 2j + 1, then up 2j, 2j + 1): [..., K] -> [..., N/2]. On CUDA the one-token GEMV computes it in
        its epilogue, so no projection output is written and no SwiGLU kernel runs after it."""
        # qtool.layouts.mixed.cuda imports no GPU runtime by itself; swiglu_interleaved is plain torch
        from qtool.layouts.mixed.cuda import module_forward_swiglu, swiglu_interleaved

        if x.is_cuda:
            y = module_forward_swiglu(self, x)
            if y is not None:
                return y
        return swiglu_interleaved(self.reference_forward(x))

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        y = F.linear(x2, self.dense_weight(x.device, x.dtype))
        if self.outlier_values.numel():
            rows, cols, vals = self.layout.outliers()
            rows, cols = rows.to(x.device), cols.to(x.device)
            # y[t, n] += Σ_{(n, k) in CSR} v·x[t, k]
            y.index_add_(1, rows, x2[:, cols] * vals.to(device=x.device, dtype=x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features}, 2/4-bit stripes of {self.group_size} "
            f"({self.layout.stripes_4bit} at 4 bits, {self.assign}), {self.outlier_values.numel()} outliers"
        )
