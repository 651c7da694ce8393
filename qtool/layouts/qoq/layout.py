"""The `qoq` layout (formats/qoq.md): W8 or W4 weights for per-token symmetric INT8 activations (QServe's W4A8).

Three weight rungs share it: W8 per channel (`scales` = s0), W4 per channel (`scales` = s, `zeros` = z per row)
and W4 progressive (`scales` = s0, `group_scales` = s1 and `zeros` = z per group). Each rung's integer weight
(`integer_weight`) is what the int8 activations multiply; `scales` turn the int32 sums into outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from qtool.errors import CheckpointError
from qtool.layouts.base import StoredLayout, check_scales, posint
from qtool.layouts.bitpack import pack_codes, packed_words, unpack_codes

FORMAT = "qoq"
WEIGHT_BITS = (4, 8)
ACT_BITS = 8
W8_OFFSET = 128  # W8 codes are stored as Q8 + 128 (unsigned, as the bit stream holds them)
W8_MAX = 127
LEVEL1_MAX = 15
MAX_GROUP_SCALE = 16  # s1 = round(238/15) at most (formats/qoq.md, "Protective range")


def grid_problem(bits: object, group_size: object, in_features: int) -> tuple[str, object, str] | None:
    """(key, found, expected) for parameters outside the layout's domain, else None."""
    if bits not in WEIGHT_BITS or isinstance(bits, bool):
        return "bits", bits, "4 or 8"
    if group_size is None:
        return None
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        return "group_size", group_size, "a positive integer or null"
    if bits == 8:
        return "group_size", group_size, "null with bits 8 (W8 has one scale per output channel)"
    if in_features % group_size:
        return "group_size", group_size, f"a divisor of in_features {in_features}"
    return None


def scheme_problem(cfg: dict) -> tuple[str, object, str] | None:
    """(key, found, expected) for layer parameters outside the layout's domain, else None."""
    for key in ("in_features", "out_features"):
        if not posint(cfg.get(key)):
            return key, cfg.get(key), "a positive integer"
    if cfg.get("act_bits") != ACT_BITS or isinstance(cfg.get("act_bits"), bool):
        return "act_bits", cfg.get("act_bits"), str(ACT_BITS)
    return grid_problem(cfg.get("bits"), cfg.get("group_size"), cfg["in_features"])


@dataclass
class QoQWeight(StoredLayout):
    FORMAT = FORMAT
    FIELDS = ("qweight", "scales", "group_scales", "zeros")
    scheme_problem = staticmethod(scheme_problem)

    bits: int  # 4 or 8
    group_size: int | None  # None: per channel; g: progressive groups of g input columns (bits 4 only)
    in_features: int  # K
    out_features: int  # N
    qweight: torch.Tensor  # int32 [N, ceil(K*bits/32)]: Q8 + 128 (bits 8) or u4 codes q (bits 4)
    scales: torch.Tensor  # float16 [N]: s0 (W8, progressive) or s (W4 per channel)
    group_scales: torch.Tensor | None  # uint8 [N, K/g]: s1 in 1..16 (progressive only)
    zeros: torch.Tensor | None  # uint8 [N] (W4 per channel) or [N, K/g] (progressive): z in 0..15

    act_bits = ACT_BITS

    @property
    def progressive(self) -> bool:
        return self.group_size is not None

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bits: int,
        group_size: int | None = None,
        group_scales: torch.Tensor | None = None,
        zeros: torch.Tensor | None = None,
    ) -> QoQWeight:
        """Build from integer codes [N, K] (signed Q8 for bits 8; u4 q for bits 4), scales [N], and for bits 4 the
        zeros ([N] per channel, [N, K/g] progressive) and, progressive, the integer group scales [N, K/g]."""
        n, k = codes.shape
        problem = grid_problem(bits, group_size, k)
        if problem is not None:
            key, found, expected = problem
            raise ValueError(f"qoq layout: {key} found {found!r}, expected {expected}")
        codes = codes.to(torch.int64).cpu()
        if bits == 8:
            codes = codes + W8_OFFSET
        as_u8 = (lambda t: t.round().to(torch.uint8).cpu().contiguous()) if bits == 4 else (lambda t: None)
        return cls(
            bits=bits,
            group_size=group_size,
            in_features=k,
            out_features=n,
            qweight=pack_codes(codes, bits),
            scales=scales.reshape(n).to(torch.float16).cpu().contiguous(),
            group_scales=as_u8(group_scales) if group_size is not None else None,
            zeros=as_u8(zeros),
        )

    @classmethod
    def concat_rows(cls, parts: list[QoQWeight]) -> QoQWeight:
        """One layer from `parts`, consecutive output rows of it quantized apart, in row order: every tensor
        (level-0 scales, level-1 scales and zeros included) leads with the rows."""
        first = parts[0]
        for p in parts[1:]:
            if (p.bits, p.group_size, p.in_features) != (first.bits, first.group_size, first.in_features):
                raise ValueError("qoq: row slices with different schemes")

        def cat(field: str) -> torch.Tensor | None:
            return None if getattr(first, field) is None else torch.cat([getattr(p, field) for p in parts])

        return cls(
            first.bits,
            first.group_size,
            first.in_features,
            sum(p.out_features for p in parts),
            cat("qweight"),
            cat("scales"),
            cat("group_scales"),
            cat("zeros"),
        )

    def codes(self) -> torch.Tensor:
        """The stored unsigned codes [N, K] (int64)."""
        return unpack_codes(self.qweight, self.bits, self.in_features)

    def integer_weight(self) -> torch.Tensor:
        """The integer weight Wint [N, K] (int64): Q8 (bits 8), q - z (W4 per channel), s1·(q - z) (progressive)."""
        c = self.codes()
        if self.bits == 8:
            return c - W8_OFFSET
        if not self.progressive:
            return c - self.zeros.to(torch.int64)[:, None]
        n, k = c.shape
        z = self.zeros.to(torch.int64)[:, :, None]
        s1 = self.group_scales.to(torch.int64)[:, :, None]
        return ((c.reshape(n, -1, self.group_size) - z) * s1).reshape(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """`scales[n]·Wint[n, k]` in float32 (one rounding: the integer is exact), cast to `dtype`."""
        w = self.scales.to(torch.float32)[:, None] * self.integer_weight().to(torch.float32)
        return w.to(dtype)

    def config(self) -> dict:
        return {
            "format": FORMAT,
            "bits": self.bits,
            "act_bits": ACT_BITS,
            "group_size": self.group_size,
            "in_features": self.in_features,
            "out_features": self.out_features,
        }

    @classmethod
    def params_from_config(cls, cfg: dict) -> dict:
        return {
            "bits": int(cfg["bits"]),
            "group_size": cfg["group_size"],
            "in_features": cfg["in_features"],
            "out_features": cfg["out_features"],
        }

    @staticmethod
    def expected_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        n, k, bits, g = cfg["out_features"], cfg["in_features"], cfg["bits"], cfg["group_size"]
        shapes = {"qweight": ((n, packed_words(k, bits)), torch.int32), "scales": ((n,), torch.float16)}
        if g is not None:
            shapes["group_scales"] = ((n, k // g), torch.uint8)
            shapes["zeros"] = ((n, k // g), torch.uint8)
        elif bits == 4:
            shapes["zeros"] = ((n,), torch.uint8)
        return shapes

    @classmethod
    def from_tensors(cls, name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> QoQWeight:
        """Validate stored tensors against the layer config; errors name the tensor."""
        layout = cls.checked(name, cfg, tensors)
        check_scales(name, layout.scales)
        if layout.bits == 8:
            lowest = int(layout.codes().min())
            if lowest < W8_OFFSET - W8_MAX:
                raise CheckpointError(
                    f"tensor {name}.qweight: found code {lowest} (Q8 = {lowest - W8_OFFSET}), "
                    f"expected codes {W8_OFFSET - W8_MAX}..255 (Q8 in -{W8_MAX}..{W8_MAX})"
                )
            return layout
        if int(layout.zeros.max()) > LEVEL1_MAX:
            raise CheckpointError(
                f"tensor {name}.zeros: found {int(layout.zeros.max())}, expected at most {LEVEL1_MAX}"
            )
        if layout.progressive:
            s1 = layout.group_scales
            if int(s1.min()) < 1 or int(s1.max()) > MAX_GROUP_SCALE:
                raise CheckpointError(
                    f"tensor {name}.group_scales: found values in [{int(s1.min())}, "
                    f"{int(s1.max())}], expected integers in 1..{MAX_GROUP_SCALE}"
                )
            wint = layout.integer_weight()
            lo, hi = int(wint.min()), int(wint.max())
            if lo < -128 or hi > 127:
                r, c = divmod(int(torch.argmax((wint.clamp(-128, 127) - wint).abs())), layout.in_features)
                raise CheckpointError(
                    f"tensor {name}.qweight: row {r} column {c} dequantizes to the integer "
                    f"{int(wint[r, c])} (group_scales·(code - zeros)), expected -128..127"
                )
        return layout


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
