"""Executes the `quik` layout: per-token asymmetric activation quantization of the non-outlier columns, an exact
integer matmul of the codes, the dequantization epilogue of formats/quik.md (Eq. 1 zero-point correction with
`wreduced`), plus the float outlier product. This torch path is the ground truth the CUDA kernels
(qtool/layouts/quik/cuda.py) are checked against; on a GPU, `forward` takes the kernels where they apply."""

from __future__ import annotations

import torch

from qtool.layouts.base import EXACT_F32, EXACT_F64, int_matmul
from qtool.layouts.module import PackedLinear
from qtool.layouts.quik.layout import ActQuant, QuikWeight, base_indices, quantize_activations


class QuikLinear(PackedLinear):
    layout_cls = QuikWeight
    cuda_module = "qtool.layouts.quik.cuda"
    pinned_dtypes = {"scales": torch.float16, "outlier_weight": torch.float16, "wreduced": torch.float32}

    @property
    def base_idx(self) -> torch.Tensor:
        """The base (non-outlier) column indices, ascending."""
        return self.derived("base_idx", lambda: base_indices(self.in_features, self.outlier_idx))

    @property
    def wcodes(self) -> torch.Tensor:
        """The signed codes [N, K-k] as int32."""
        return self.derived("wcodes", lambda: self.layout.signed_codes().to(torch.int32))

    def accumulate(self, x2: torch.Tensor) -> tuple[torch.Tensor, ActQuant]:
        """The int32 accumulators `Σ_k q[t,k]·c[n,k]` over the base columns of `x2` [T, K] (float32)."""
        act = quantize_activations(x2[:, self.base_idx], self.act_bits)
        kb = self.base_idx.numel()
        bound = kb * (1 << (self.act_bits - 1)) * (1 << (self.bits - 1))
        codes = self.wcodes
        if bound < EXACT_F64:
            # int_matmul's float operand for this bound, converted once per evaluation under reference_cache.
            dt = torch.float32 if bound < EXACT_F32 else torch.float64
            codes = self.derived(("wcodes", dt), lambda: self.wcodes.to(dt), scoped=True)
        return int_matmul(act.codes, codes, bound), act

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        outlier_weight = self.derived(
            "outlier_weight", lambda: self.outlier_weight.to(torch.float32), scoped=True
        )
        y = x2[:, self.outlier_idx.long()] @ outlier_weight.T
        if self.base_idx.numel():
            acc, act = self.accumulate(x2)
            half = float(1 << (self.act_bits - 1))
            # Eq. 1: x ≈ s_x·(q + half) + z_x, so Σ_k x_k·s_w·c_k = s_x·s_w·acc + (z_x + half·s_x)·wreduced.
            scales = self.derived("scales", lambda: self.scales.to(torch.float32), scoped=True)
            y = y + acc.to(torch.float32) * act.scale[:, None] * scales[None, :]
            y = y + (act.zero + half * act.scale)[:, None] * self.wreduced[None, :]
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        sparse = ", 2:4" if self.sparsity_24 else ""
        return (
            f"in={self.in_features}, out={self.out_features}, w{self.bits}a{self.act_bits}, "
            f"outliers={self.outlier_idx.numel()}{sparse}"
        )
