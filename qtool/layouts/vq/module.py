"""Executes the `vq` layout (formats/vq.md) in torch. Two reference paths, mirroring the two kernels the layout is
built for: with few input rows (decode, at most `LOOKUP_ROWS`), the codebook-centric GEMV, which multiplies each
input vector by every entry of its codebook once and then sums the products the indices select (no weight is
dequantized); with more rows (prefill), the dequantized weight in a dense matmul, as a GEMM that decodes codes into
its tiles computes. The tests check the lookup path against `dequantize()`. On CUDA (QTOOL_KERNELS picks, as for every
layout), up to LOOKUP_ROWS float16 rows run the GEMV kernel of qtool/cuda/vq.py and more rows the fused GEMM of
qtool/cuda/vq_gemm.py, where they apply."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qtool.layouts.module import PackedLinear
from qtool.layouts.vq.layout import VQWeight

LOOKUP_ROWS = 16


class VQLinear(PackedLinear):
    layout_cls = VQWeight
    float16_fields = ("codebooks",)

    def __init__(self, weight: VQWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight, bias)
        # Unpacked indices, built on first use per device; a kernel never needs them.
        self._codes: dict[torch.device, torch.Tensor] = {}

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.layout.dequantize(dtype)

    def codes(self, device: torch.device) -> torch.Tensor:
        c = self._codes.get(device)
        if c is None:
            c = self._codes[device] = self.layout.codes().to(device)
        return c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            # The CUDA GEMV (qtool/cuda/vq.py) for up to LOOKUP_ROWS rows; imported here so CPU-only use never
            # loads the GPU runtime. None: the paths below.
            from qtool.layouts.vq.cuda import module_forward

            y = module_forward(self, x)
            if y is not None:
                return y
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] <= LOOKUP_ROWS:
            y = self.lookup_forward(x2)
        else:
            y = self.gemm_forward(x2)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y.reshape(*shape[:-1], self.out_features)

    def gemm_forward(self, x: torch.Tensor) -> torch.Tensor:
        """y [T, N] for more than LOOKUP_ROWS rows: the fused VQ GEMM on CUDA where it applies, else the dequantized
        weight in a dense matmul."""
        if x.is_cuda:
            # Imported here so CPU-only use never loads the GPU runtime.
            from qtool.layouts.vq.cuda_gemm import module_forward

            y = module_forward(self, x)
            if y is not None:
                return y
        return F.linear(x, self.dense_weight(x.device, x.dtype))

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

    def drop_caches(self) -> None:
        super().drop_caches()
        self._codes = {}
        self.__dict__.pop("_qtool_prepared", None)  # the kernel view of the old tensors

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
