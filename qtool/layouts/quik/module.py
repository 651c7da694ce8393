"""Executes the `quik` layout: per-token asymmetric activation quantization of the non-outlier columns, an exact
integer matmul of the codes, the dequantization epilogue of formats/quik.md (Eq. 1 zero-point correction with
`wreduced`), plus the float outlier product. This torch path is the ground truth the CUDA kernels
(qtool/cuda/quik.py) are checked against; on a GPU, `forward` takes the kernels where they apply."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from qtool.layouts.quik.layout import QuikWeight, base_indices

# Partial sums of integer products are exact in float32 below 2^24 and in float64 below 2^53.
_EXACT_F32 = 1 << 24
_EXACT_F64 = 1 << 53


class ActQuant(NamedTuple):
    codes: torch.Tensor  # int32 [T, Kb], signed: q - 2^(act_bits-1)
    scale: torch.Tensor  # float32 [T]
    zero: torch.Tensor  # float32 [T]: the row minimum


def quantize_activations(xb: torch.Tensor, act_bits: int) -> ActQuant:
    """Per-token asymmetric quantization of `xb` [T, Kb] (float32): `s = (max - min) / (2^b - 1)` (IEEE division;
    1 when the row is constant), `y = 1 / s` (IEEE division), `q = clamp(round_half_even((x - min) · y), 0, 2^b - 1)`
    with `x - min` rounded to float32 and the product exact (not rounded to float32 first), stored signed."""
    maxq = (1 << act_bits) - 1
    lo = xb.amin(dim=1)
    hi = xb.amax(dim=1)
    # Divide by a tensor, not a Python number: torch on CUDA turns division by a scalar into multiplication by its
    # reciprocal, which is not the IEEE quotient the format specifies.
    scale = torch.where(hi > lo, (hi - lo) / torch.full_like(lo, maxq), torch.ones_like(lo))
    recip = torch.ones_like(scale) / scale
    # Two float32 significands multiply exactly in float64 (48 of 53 bits), so rounding the float64 product to an
    # integer is the one rounding a kernel's fused multiply-add performs.
    q = torch.round((xb - lo[:, None]).double() * recip.double()[:, None])
    q = torch.clamp(q, 0, maxq)
    return ActQuant((q - (1 << (act_bits - 1))).to(torch.int32), scale, lo)


def int_matmul(a: torch.Tensor, b: torch.Tensor, bound: int) -> torch.Tensor:
    """`a @ b.T` for int32 codes with int32 accumulation. `bound` ≥ Σ|a||b| over any row pair: below 2^24 (2^53) a
    float32 (float64) matmul is exact and much faster than an integer one, so the result is identical."""
    if bound < _EXACT_F32:
        return (a.to(torch.float32) @ b.to(torch.float32).T).to(torch.int32)
    if bound < _EXACT_F64:
        return (a.to(torch.float64) @ b.to(torch.float64).T).to(torch.int32)
    return a @ b.T


class QuikLinear(nn.Module):
    def __init__(self, weight: QuikWeight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.bits = weight.bits
        self.act_bits = weight.act_bits
        self.sparsity_24 = weight.sparsity_24
        self.in_features = weight.in_features
        self.out_features = weight.out_features
        self.register_buffer("qweight", weight.qweight)
        self.register_buffer("scales", weight.scales)
        self.register_buffer("outlier_idx", weight.outlier_idx)
        self.register_buffer("outlier_weight", weight.outlier_weight)
        self.register_buffer("wreduced", weight.wreduced)
        # Derived once (not stored): the base column indices and the signed codes.
        self.register_buffer(
            "base_idx", base_indices(weight.in_features, weight.outlier_idx), persistent=False
        )
        self.register_buffer("wcodes", weight.signed_codes().to(torch.int32), persistent=False)
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.bias = None
        self.reference_cache: dict | None = None  # see qtool/runtime/cache.py

    @property
    def layout(self) -> QuikWeight:
        return QuikWeight(
            self.bits,
            self.act_bits,
            self.in_features,
            self.out_features,
            self.sparsity_24,
            self.qweight,
            self.scales,
            self.outlier_idx,
            self.outlier_weight,
            self.wreduced,
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.layout.dequantize(dtype)

    def accumulate(self, x2: torch.Tensor) -> tuple[torch.Tensor, ActQuant]:
        """The int32 accumulators `Σ_k q[t,k]·c[n,k]` over the base columns of `x2` [T, K] (float32)."""
        act = quantize_activations(x2[:, self.base_idx], self.act_bits)
        kb = self.base_idx.numel()
        bound = kb * (1 << (self.act_bits - 1)) * (1 << (self.bits - 1))
        codes = self.wcodes
        if bound < _EXACT_F64:
            # int_matmul's float operand for this bound, converted once per evaluation under reference_cache.
            dt = torch.float32 if bound < _EXACT_F32 else torch.float64
            codes = self._cached(("wcodes", dt), lambda: self.wcodes.to(dt))
        return int_matmul(act.codes, codes, bound), act

    def _cached(self, key, make):
        cache = getattr(self, "reference_cache", None)
        if cache is None:
            return make()
        if key not in cache:
            cache[key] = make()
        return cache[key]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from qtool.layouts.quik.cuda import module_forward  # CPU use never loads the GPU runtime

            y = module_forward(self, x)
            if y is not None:
                return y
        return self.reference_forward(x)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        outlier_weight = self._cached("outlier_weight", lambda: self.outlier_weight.to(torch.float32))
        y = x2[:, self.outlier_idx.long()] @ outlier_weight.T
        if self.base_idx.numel():
            acc, act = self.accumulate(x2)
            half = float(1 << (self.act_bits - 1))
            # Eq. 1: x ≈ s_x·(q + half) + z_x, so Σ_k x_k·s_w·c_k = s_x·s_w·acc + (z_x + half·s_x)·wreduced.
            scales = self._cached("scales", lambda: self.scales.to(torch.float32))
            y = y + acc.to(torch.float32) * act.scale[:, None] * scales[None, :]
            y = y + (act.zero + half * act.scale)[:, None] * self.wreduced[None, :]
        if self.bias is not None:
            y = y + self.bias.to(torch.float32)
        return y.to(x.dtype).reshape(*shape[:-1], self.out_features)

    def _apply(self, fn, recurse: bool = True):
        # `model.to(dtype)` casts floating buffers; the packed fields keep their specified dtypes.
        super()._apply(fn, recurse)
        for field, dtype in (
            ("scales", torch.float16),
            ("outlier_weight", torch.float16),
            ("wreduced", torch.float32),
        ):
            if getattr(self, field).dtype != dtype:
                setattr(self, field, getattr(self, field).to(dtype))
        return self

    def extra_repr(self) -> str:
        sparse = ", 2:4" if self.sparsity_24 else ""
        return (
            f"in={self.in_features}, out={self.out_features}, w{self.bits}a{self.act_bits}, "
            f"outliers={self.outlier_idx.numel()}{sparse}"
        )
