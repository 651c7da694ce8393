"""The `quik` layout (formats/quik.md): integer base weights for the non-outlier input columns, float16 weights for
the outlier columns, their indices, per-output-channel scales and the row sums `wreduced` of the dequantized base
weights (the zero-point correction of per-token asymmetric activation quantization)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from qtool.errors import CheckpointError
from qtool.layouts.base import StoredLayout, check_scales, posint
from qtool.layouts.bitpack import pack_codes, packed_words, unpack_codes

FORMAT = "quik"
WEIGHT_BITS = (4, 8)
ACT_BITS = (4, 8)
SPARSITY_24 = "2:4"


def base_indices(in_features: int, outlier_idx: torch.Tensor) -> torch.Tensor:
    """The non-outlier columns in ascending order (the column order of the integer base weights)."""
    keep = torch.ones(in_features, dtype=torch.bool, device=outlier_idx.device)
    keep[outlier_idx.long()] = False
    return torch.nonzero(keep)[:, 0]


def row_sums(codes: torch.Tensor, scales: torch.Tensor, bits: int) -> torch.Tensor:
    """`wreduced[n] = s_w[n] · Σ_k c[n,k]` in float32, with `c` the signed codes (the exact integer sum times the
    float16 scale, rounded once to float32)."""
    signed = codes.to(torch.int64) - (1 << (bits - 1))
    return (scales.to(torch.float64) * signed.sum(dim=1).to(torch.float64)).to(torch.float32)


def violations_24(codes: torch.Tensor, bits: int) -> tuple[int, int, int] | None:
    """First (row, first column, count) of a group of 4 base columns with more than 2 non-zero signed codes."""
    signed = codes.to(torch.int64) - (1 << (bits - 1))
    n, kb = signed.shape
    pad = (-kb) % 4
    nz = torch.nn.functional.pad(signed != 0, (0, pad)).reshape(n, -1, 4).sum(dim=2)
    bad = torch.nonzero(nz > 2)
    if bad.numel() == 0:
        return None
    r, g = int(bad[0, 0]), int(bad[0, 1])
    return r, 4 * g, int(nz[r, g])


def scheme_problem(cfg: dict) -> tuple[str, object, str] | None:
    """(key, found, expected) for layer parameters outside the layout's domain, else None."""
    for key, allowed in (("bits", WEIGHT_BITS), ("act_bits", ACT_BITS)):
        if cfg.get(key) not in allowed or isinstance(cfg.get(key), bool):
            return key, cfg.get(key), " or ".join(map(str, allowed))
    for key in ("in_features", "out_features"):
        if not posint(cfg.get(key)):
            return key, cfg.get(key), "a positive integer"
    kk = cfg.get("num_outliers")
    if not isinstance(kk, int) or isinstance(kk, bool) or not 0 <= kk <= cfg["in_features"]:
        return "num_outliers", kk, f"an integer in 0..{cfg['in_features']}"
    if cfg.get("group_size") is not None:
        return "group_size", cfg.get("group_size"), "null (one scale per output channel)"
    if cfg.get("symmetric") is not True:
        return "symmetric", cfg.get("symmetric"), "true"
    if cfg.get("sparsity") not in (None, SPARSITY_24):
        return "sparsity", cfg.get("sparsity"), f"null or {SPARSITY_24!r}"
    return None


@dataclass
class QuikWeight(StoredLayout):
    FORMAT = FORMAT
    FIELDS = ("qweight", "scales", "outlier_idx", "outlier_weight", "wreduced")
    scheme_problem = staticmethod(scheme_problem)

    bits: int  # weight bits, 4 or 8
    act_bits: int  # activation bits, 4 or 8
    in_features: int  # K
    out_features: int  # N
    sparsity_24: bool
    qweight: torch.Tensor  # int32 [N, ceil((K-k)*bits/32)]: unsigned codes c + 2^(bits-1), base column order
    scales: torch.Tensor  # float16 [N]
    outlier_idx: torch.Tensor  # int32 [k], strictly increasing
    outlier_weight: torch.Tensor  # float16 [N, k]
    wreduced: torch.Tensor  # float32 [N]

    @property
    def num_outliers(self) -> int:
        return int(self.outlier_idx.numel())

    @property
    def base_features(self) -> int:
        return self.in_features - self.num_outliers

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        outlier_idx: torch.Tensor,
        outlier_weight: torch.Tensor,
        bits: int,
        act_bits: int,
        sparsity_24: bool = False,
    ) -> QuikWeight:
        """Build from unsigned codes [N, K-k] (base columns in ascending order), scales [N], outlier column indices
        [k] (any order; stored ascending) and outlier weights [N, k] in the order of `outlier_idx`."""
        order = torch.argsort(outlier_idx.cpu())
        idx = outlier_idx.cpu()[order].to(torch.int32).contiguous()
        n, kb = codes.shape
        scales16 = scales.reshape(n).to(torch.float16).cpu().contiguous()
        codes = codes.to(torch.int64).cpu()
        return cls(
            bits=bits,
            act_bits=act_bits,
            in_features=kb + idx.numel(),
            out_features=n,
            sparsity_24=sparsity_24,
            qweight=pack_codes(codes, bits),
            scales=scales16,
            outlier_idx=idx,
            outlier_weight=outlier_weight.cpu()[:, order].to(torch.float16).contiguous(),
            wreduced=row_sums(codes, scales16, bits).contiguous(),
        )

    @classmethod
    def concat_rows(cls, parts: list[QuikWeight]) -> QuikWeight:
        """One layer from `parts`, consecutive output rows of it quantized apart, in row order: the outlier
        columns are the layer's (the same in every part), every other tensor leads with the rows."""
        first = parts[0]
        key = (first.bits, first.act_bits, first.in_features, first.sparsity_24)
        for p in parts[1:]:
            if (p.bits, p.act_bits, p.in_features, p.sparsity_24) != key or not torch.equal(
                p.outlier_idx, first.outlier_idx
            ):
                raise ValueError("quik: row slices with different schemes or outlier columns")
        cat = lambda field: torch.cat([getattr(p, field) for p in parts])  # noqa: E731
        return cls(
            first.bits,
            first.act_bits,
            first.in_features,
            sum(p.out_features for p in parts),
            first.sparsity_24,
            cat("qweight"),
            cat("scales"),
            first.outlier_idx,
            cat("outlier_weight"),
            cat("wreduced"),
        )

    def codes(self) -> torch.Tensor:
        """Unsigned codes [N, K-k] of the base columns."""
        return unpack_codes(self.qweight, self.bits, self.base_features)

    def signed_codes(self) -> torch.Tensor:
        return self.codes() - (1 << (self.bits - 1))

    def base_index(self) -> torch.Tensor:
        return base_indices(self.in_features, self.outlier_idx)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] in the original column order: `s_w·c` on base columns, the float16 outlier weights."""
        w = torch.empty(self.out_features, self.in_features, dtype=torch.float32, device=self.qweight.device)
        w[:, self.base_index()] = (
            self.signed_codes().to(torch.float32) * self.scales.to(torch.float32)[:, None]
        )
        w[:, self.outlier_idx.long()] = self.outlier_weight.to(torch.float32)
        return w.to(dtype)

    def config(self) -> dict:
        return {
            "format": FORMAT,
            "bits": self.bits,
            "act_bits": self.act_bits,
            # Weights are always symmetric per output channel; the keys keep tools that summarise layouts uniform.
            "group_size": None,
            "symmetric": True,
            "num_outliers": self.num_outliers,
            "sparsity": SPARSITY_24 if self.sparsity_24 else None,
            "in_features": self.in_features,
            "out_features": self.out_features,
        }

    @classmethod
    def params_from_config(cls, cfg: dict) -> dict:
        return {
            "bits": int(cfg["bits"]),
            "act_bits": int(cfg["act_bits"]),
            "in_features": cfg["in_features"],
            "out_features": cfg["out_features"],
            "sparsity_24": cfg.get("sparsity") is not None,
        }

    @staticmethod
    def expected_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, k, kk = cfg["out_features"], cfg["in_features"], cfg["num_outliers"]
        return {
            "qweight": ((n, packed_words(k - kk, cfg["bits"])), torch.int32),
            "scales": ((n,), torch.float16),
            "outlier_idx": ((kk,), torch.int32),
            "outlier_weight": ((n, kk), torch.float16),
            "wreduced": ((n,), torch.float32),
        }

    @classmethod
    def from_tensors(cls, name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> QuikWeight:
        """Validate stored tensors against the layer config; errors name the tensor."""
        layout = cls.checked(name, cfg, tensors)
        k = cfg["in_features"]
        scales = tensors["scales"]
        check_scales(name, scales)
        idx = tensors["outlier_idx"].to(torch.int64)
        if idx.numel():
            if int(idx.min()) < 0 or int(idx.max()) >= k:
                raise CheckpointError(
                    f"tensor {name}.outlier_idx: found values in [{int(idx.min())}, "
                    f"{int(idx.max())}], expected column indices in 0..{k - 1}"
                )
            if idx.numel() > 1 and bool((idx[1:] <= idx[:-1]).any()):
                raise CheckpointError(
                    f"tensor {name}.outlier_idx: found indices not strictly increasing, "
                    f"expected sorted unique column indices"
                )
        if not bool(torch.isfinite(tensors["outlier_weight"]).all()):
            raise CheckpointError(
                f"tensor {name}.outlier_weight: found non-finite values, expected finite weights"
            )
        codes = layout.codes()
        expect = row_sums(codes, scales, layout.bits)
        diff = (tensors["wreduced"] - expect).abs()
        tol = (
            1e-6
            * (scales.to(torch.float32) * codes.to(torch.float32).sub(1 << (layout.bits - 1)).abs().sum(1))
            + 1e-30
        )
        if bool((diff > tol).any()):
            r = int(torch.argmax(diff - tol))
            raise CheckpointError(
                f"tensor {name}.wreduced: row {r} found {float(tensors['wreduced'][r])!r}, expected "
                f"{float(expect[r])!r} (scales · sum of the signed base codes)"
            )
        if layout.sparsity_24:
            v = violations_24(codes, layout.bits)
            if v is not None:
                r, c, count = v
                raise CheckpointError(
                    f"tensor {name}.qweight: row {r}, base columns {c}..{c + 3} hold {count} "
                    f"non-zero codes, expected at most 2 (sparsity 2:4)"
                )
        return layout


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
