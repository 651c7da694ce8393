"""Executes the `mixed-2-4-16` layout (formats/mixed-2-4-16.md). On CUDA the kernels of qtool/cuda/mixed.py run
it (QTOOL_KERNELS picks, as for every layout); elsewhere, and where they do not apply, the torch reference: the
dense part `(q - z)·ŝ` as one matmul, then the CSR outliers as a separate sparse product added to its output. The
reference is what the kernels are checked against."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from qtool.packing.mixed import FIELDS, MixedWeight


class MixedLinear(nn.Module):
    def __init__(self, weight: MixedWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.group_size = weight.group_size
        self.scale_group_size = weight.scale_group_size
        self.assign = weight.assign
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        for f in FIELDS:
            self.register_buffer(f, getattr(weight, f))
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.bias = None
        # The dense weight, dequantized on first use per (device, dtype); a kernel never needs it.
        self._dense: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @property
    def layout(self) -> MixedWeight:
        return MixedWeight(self.group_size, self.scale_group_size, self.assign, self.in_features,
                           self.out_features, *(getattr(self, f) for f in FIELDS))

    def cpu_layout(self) -> MixedWeight:
        """The layout on the CPU, where its unpacking runs (it builds CPU index tensors)."""
        return MixedWeight(self.group_size, self.scale_group_size, self.assign, self.in_features,
                           self.out_features, *(getattr(self, f).cpu() for f in FIELDS))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.cpu_layout().dequantize(dtype)

    def dense_weight(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        w = self._dense.get(key)
        if w is None:
            w = self._dense[key] = self.cpu_layout().dense().to(device=device, dtype=dtype)
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # Imported here so CPU-only use never loads the GPU runtime.
            from qtool.cuda.mixed import module_forward

            y = module_forward(self, x)
            if y is not None:
                return y
        return self.reference_forward(x)

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

    def _apply(self, fn, recurse: bool = True):
        # `model.to(dtype)` casts floating buffers; the packed float16 fields must stay float16.
        super()._apply(fn, recurse)
        for f in ("scales_2nd", "scales4", "outlier_values"):
            if getattr(self, f).dtype != torch.float16:
                setattr(self, f, getattr(self, f).to(torch.float16))
        self._dense = {}
        self.__dict__.pop("_qtool_prepared", None)  # the kernel view of the old tensors
        return self

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, 2/4-bit stripes of {self.group_size} "
                f"({self.layout.stripes_4bit} at 4 bits, {self.assign}), {self.outlier_values.numel()} outliers")
