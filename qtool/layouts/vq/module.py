"""Executes the `vq` layout (formats/vq.md) in torch. Two reference paths, mirroring the two kernels the layout is
built for: with few input rows (decode, at most `LOOKUP_ROWS`), the codebook-centric GEMV, which multiplies each
input vector by every entry of its codebook once and then sums the products the indices select (no weight is
dequantized); with more rows (prefill), the dequantized weight in a dense matmul, as a GEMM that decodes codes into
its tiles computes. The tests check the lookup path against `dequantize()`. On CUDA (QTOOL_KERNELS picks, as for every
layout), up to LOOKUP_ROWS float16 rows run the GEMV kernel of qtool/layouts/vq/cuda.py and more rows the fused GEMM of
qtool/layouts/vq/cuda_gemm.py, where they apply."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qtool.layouts.module import PackedLinear
from qtool.layouts.vq.layout import VQWeight

LOOKUP_ROWS = 16


class VQLinear(PackedLinear):
    layout_cls = VQWeight
    cuda_module = "qtool.layouts.vq.cuda"
    pinned_dtypes = {"codebooks": torch.float16}

    def codes(self, device: torch.device) -> torch.Tensor:
        """The unpacked indices on `device`, built on first use there; a kernel never needs them."""
        return self.derived(("codes", device), lambda: self.layout.codes().to(device))

    def cuda_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        # The GEMV (qtool/layouts/vq/cuda.py) takes up to LOOKUP_ROWS rows; above them the fused GEMM
        # (qtool/layouts/vq/cuda_gemm.py), where it applies.
        y = super().cuda_forward(x)
        if y is not None:
            return y
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= LOOKUP_ROWS:
            return None
        from qtool.layouts.vq.cuda_gemm import module_forward

        y = module_forward(self, x2)
        if y is None:
            return None
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*x.shape[:-1], self.out_features)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= LOOKUP_ROWS:
            y = self.lookup_forward(x2)
        else:
            y = F.linear(x2, self.dense_weight(x.device, x.dtype))
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def lookup_forward(self, x: torch.Tensor) -> torch.Tensor:
        """y [T, N] = x [T, K] Wᵀ without dequantizing W: products of every input vector with every entry of its
        codebooks, P[rt, r, v, e, t] = x[t, v]·C[rt, ct(v), r, e], then y[t, n] = Σ_r Σ_v P[rt(n), r, v, code, t]
        (float32)."""
        lay = self.layout
        t, d = x.shape[0], self.vector_size
        v = self.in_features // d
        rt, ct = lay.scope_of(x.device)
        books = self.codebooks.to(device=x.device, dtype=torch.float32)  # [R, C, z, E, d]
        xv = x.to(torch.float32).reshape(t, v, d)
        codes = self.codes(x.device)
        y = torch.zeros(self.out_features, t, dtype=torch.float32, device=x.device)
        for ci in range(books.shape[1]):  # one codebook switch per column tile
            vs = (ct == ci).nonzero().flatten()
            prod = torch.einsum("azed,tvd->azvet", books[:, ci], xv[:, vs])  # [R, z, Vc, E, T]
            vi = torch.arange(vs.numel(), device=x.device)[None, :]
            for r in range(self.residuals):
                y += prod[rt[:, None], r, vi, codes[r][:, vs]].sum(dim=1)
        return y.T.to(x.dtype)

    def extra_repr(self) -> str:
        scope = (
            "tensor"
            if self.tile_rows is None and self.tile_cols is None
            else f"tiles {self.tile_rows or self.out_features}x{self.tile_cols or self.in_features}"
        )
        return (
            f"in={self.in_features}, out={self.out_features}, {self.layout.notation()} per {scope}"
            f"{', re-indexed' if self.reindexed else ''}"
        )
