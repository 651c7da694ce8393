"""The `mixed-2-4-16` layout (formats/mixed-2-4-16.md): 2-bit and 4-bit stripes of `g1` input channels in one
weight matrix (one bit width per stripe, shared by every output row), second-order 4-bit scales for the 2-bit
groups, and sparse float16 outliers (CSR) inside the 2-bit stripes.

The codes are split into two matrices so that a GEMV thread's loads are aligned whatever the assignment:
`qweight_a` gives every stripe exactly `2·g1` bits of each row (a 2-bit stripe's codes, or the first half of a
4-bit stripe's codes), so stripe `j` of row `n` sits at a fixed bit offset; `qweight_b` holds the second halves of
the 4-bit stripes, in stripe order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.errors import CheckpointError
from qtool.layouts.base import StoredLayout, check_positive, posint
from qtool.layouts.bitpack import pack_codes, packed_words, unpack_codes

FORMAT = "mixed-2-4-16"
ASSIGN_RULES = ("block4", "global")
SCALE_BITS = 4  # N_s: bits of a 2-bit group's first-order scale code
OUTLIER_BITS = 32  # float16 value + 16-bit column index
MAX_COLUMNS = 1 << 16  # column indices are stored as unsigned 16-bit
FIELDS = (
    "qweight_a",
    "qweight_b",
    "stripe_bits",
    "scale_codes",
    "zeros2",
    "scales_2nd",
    "zeros_2nd",
    "scales4",
    "zeros4",
    "outlier_values",
    "outlier_cols",
    "outlier_rowptr",
)


def stripe_counts(in_features: int, group_size: int, stripes_4bit: int) -> tuple[int, int, int]:
    """(stripes, 2-bit stripes, 4-bit stripes) of a row."""
    s = in_features // group_size
    return s, s - stripes_4bit, stripes_4bit


def shapes_for(
    out_features: int,
    in_features: int,
    group_size: int,
    scale_group_size: int,
    stripes_4bit: int,
    outliers: int,
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shape and dtype of every stored tensor of one layer."""
    n, k, g1, g2 = out_features, in_features, group_size, scale_group_size
    s, s2, s4 = stripe_counts(k, g1, stripes_4bit)
    return {
        "qweight_a": ((n, packed_words(k, 2)), torch.int32),
        "qweight_b": ((n, packed_words(s4 * g1 // 2, 4)), torch.int32),
        "stripe_bits": ((s,), torch.uint8),
        "scale_codes": ((n, packed_words(s2, SCALE_BITS)), torch.int32),
        "zeros2": ((n, packed_words(s2, 2)), torch.int32),
        "scales_2nd": ((n // g2, s2), torch.float16),
        "zeros_2nd": ((n // g2, s2), torch.uint8),
        "scales4": ((n, s4), torch.float16),
        "zeros4": ((n, packed_words(s4, 4)), torch.int32),
        "outlier_values": ((outliers,), torch.float16),
        "outlier_cols": ((outliers,), torch.int16),
        "outlier_rowptr": ((n + 1,), torch.int32),
    }


def bits_for(
    out_features: int,
    in_features: int,
    group_size: int,
    scale_group_size: int,
    stripes_4bit: int,
    outliers: int,
) -> int:
    """Stored bits of one layer (every tensor of the layout, padding included)."""
    shapes = shapes_for(out_features, in_features, group_size, scale_group_size, stripes_4bit, outliers)
    total = 0
    for shape, dtype in shapes.values():
        numel = 1
        for d in shape:
            numel *= d
        total += numel * torch.empty((), dtype=dtype).element_size() * 8
    return total


def eq10_bits(
    in_features: int,
    group_size: int,
    scale_group_size: int,
    stripes_4bit: int,
    outliers: int,
    out_features: int,
) -> float:
    """The paper's accounting (Eq. 10) of the same layer, plus its 30 bits per outlier ((16 + 16 - 2)·ratio)."""
    s, s2, _ = stripe_counts(in_features, group_size, stripes_4bit)
    alpha = s2 / s
    g1, g2 = group_size, scale_group_size
    dense = alpha * (2 + (2 + SCALE_BITS) / g1 + (SCALE_BITS + 16) / (g1 * g2)) + (1 - alpha) * 4
    return dense + (OUTLIER_BITS - 2) * outliers / (out_features * in_features)


def scheme_problem(cfg: dict) -> tuple[str, object, str] | None:
    """(key, found, expected) for layer parameters outside the layout's domain, else None."""
    for key in ("in_features", "out_features"):
        if not posint(cfg.get(key)):
            return key, cfg.get(key), "a positive integer"
    n, k = cfg["out_features"], cfg["in_features"]
    g1, g2 = cfg.get("group_size"), cfg.get("scale_group_size")
    if not posint(g1) or g1 % 8 or k % g1:
        return "group_size", g1, f"a multiple of 8 dividing in_features {k}"
    if not posint(g2) or n % g2:
        return "scale_group_size", g2, f"a positive integer dividing out_features {n}"
    if cfg.get("scale_bits") != SCALE_BITS:
        return "scale_bits", cfg.get("scale_bits"), str(SCALE_BITS)
    assign = cfg.get("assign")
    if assign not in ASSIGN_RULES:
        return "assign", assign, " or ".join(ASSIGN_RULES)
    s = k // g1
    s4 = cfg.get("stripes_4bit")
    if not isinstance(s4, int) or isinstance(s4, bool) or not 0 <= s4 <= s:
        return "stripes_4bit", s4, f"an integer in 0..{s}"
    if assign == "block4" and (s % 4 or s4 != s // 4):
        return (
            "stripes_4bit",
            s4,
            f"{s // 4} with assign block4 ({s} stripes, one 4-bit stripe in every four)",
        )
    nnz = cfg.get("outliers")
    if not isinstance(nnz, int) or isinstance(nnz, bool) or not 0 <= nnz <= n * (s - s4) * g1:
        return "outliers", nnz, "a count of weights in 2-bit stripes"
    if nnz and k > MAX_COLUMNS:
        return "in_features", k, f"at most {MAX_COLUMNS} with outliers (16-bit column indices)"
    return None


@dataclass
class MixedWeight(StoredLayout):
    FORMAT = FORMAT
    FIELDS = FIELDS
    scheme_problem = staticmethod(scheme_problem)

    group_size: int  # g1: input channels per stripe (and per first-order group)
    scale_group_size: int  # g2: output rows per second-order group
    assign: str  # "block4" or "global": how the stripes were chosen (block4 is checked at load)
    in_features: int  # K
    out_features: int  # N
    qweight_a: torch.Tensor  # int32 [N, K/16]: 2·g1 bits of every stripe
    qweight_b: torch.Tensor  # int32 [N, S4·g1/8]: second halves of the 4-bit stripes
    stripe_bits: torch.Tensor  # uint8 [S]: 2 or 4
    scale_codes: torch.Tensor  # int32 [N, ceil(S2/8)]: 4-bit first-order scale codes of the 2-bit groups
    zeros2: torch.Tensor  # int32 [N, ceil(S2/16)]: 2-bit zeros of the 2-bit groups
    scales_2nd: torch.Tensor  # float16 [N/g2, S2]
    zeros_2nd: torch.Tensor  # uint8 [N/g2, S2]: u in 0..15, s = (code + u)·scales_2nd
    scales4: torch.Tensor  # float16 [N, S4]
    zeros4: torch.Tensor  # int32 [N, ceil(S4/8)]: 4-bit zeros of the 4-bit groups
    outlier_values: torch.Tensor  # float16 [nnz]: w - dense dequantized value
    outlier_cols: torch.Tensor  # int16 [nnz]: column, read as unsigned 16-bit
    outlier_rowptr: torch.Tensor  # int32 [N+1]

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    def from_codes(
        cls,
        codes: torch.Tensor,
        is4: torch.Tensor,
        group_size: int,
        scale_group_size: int,
        assign: str,
        scale_codes: torch.Tensor,
        zeros2: torch.Tensor,
        scales_2nd: torch.Tensor,
        zeros_2nd: torch.Tensor,
        scales4: torch.Tensor,
        zeros4: torch.Tensor,
        outlier_rows: torch.Tensor,
        outlier_cols: torch.Tensor,
        outlier_values: torch.Tensor,
    ) -> MixedWeight:
        """Build from the codes [N, K] (2-bit in 2-bit stripes, 4-bit in 4-bit stripes), the stripe mask `is4`
        [S], the 2-bit groups' scale codes and zeros [N, S2], the second-order scales and zeros [N/g2, S2], the
        4-bit groups' scales and zeros [N, S4] and the outliers (row, column, value) in any order."""
        n, k = codes.shape
        g1 = group_size
        s = k // g1
        codes = codes.to(torch.int64).cpu()
        is4 = is4.cpu().bool()
        if is4.shape != (s,) or k % g1 or g1 % 8:
            raise ValueError(f"mixed layout: {k} columns, group_size {g1}, stripe mask {tuple(is4.shape)}")
        by_stripe = codes.reshape(n, s, g1)
        half = g1 // 2
        units = by_stripe.clone()  # 2-bit units of matrix A, stripe by stripe
        lo = by_stripe[:, is4, :half]  # first halves of the 4-bit stripes, 4-bit codes
        units[:, is4] = torch.stack([lo & 3, lo >> 2], dim=-1).reshape(n, -1, g1)
        hi = by_stripe[:, is4, half:].reshape(n, -1)
        rows, cols = outlier_rows.to(torch.int64).cpu(), outlier_cols.to(torch.int64).cpu()
        order = torch.argsort(rows * k + cols)
        rows, cols = rows[order], cols[order]
        rowptr = torch.zeros(n + 1, dtype=torch.int64)
        rowptr[1:] = torch.cumsum(torch.bincount(rows, minlength=n), 0)
        u8 = lambda t: t.round().to(torch.uint8).cpu().contiguous()  # noqa: E731
        return cls(
            group_size=g1,
            scale_group_size=scale_group_size,
            assign=assign,
            in_features=k,
            out_features=n,
            qweight_a=pack_codes(units.reshape(n, k), 2),
            qweight_b=pack_codes(hi, 4),
            stripe_bits=torch.where(is4, 4, 2).to(torch.uint8),
            scale_codes=pack_codes(scale_codes.to(torch.int64).cpu(), SCALE_BITS),
            zeros2=pack_codes(zeros2.to(torch.int64).cpu(), 2),
            scales_2nd=scales_2nd.to(torch.float16).cpu().contiguous(),
            zeros_2nd=u8(zeros_2nd),
            scales4=scales4.to(torch.float16).cpu().contiguous(),
            zeros4=pack_codes(zeros4.to(torch.int64).cpu(), 4),
            outlier_values=outlier_values.cpu()[order].to(torch.float16).contiguous(),
            outlier_cols=torch.where(cols >= 1 << 15, cols - (1 << 16), cols).to(torch.int16).contiguous(),
            outlier_rowptr=rowptr.to(torch.int32),
        )

    @classmethod
    def concat_rows(cls, parts: list[MixedWeight]) -> MixedWeight:
        """One layer from `parts`, consecutive output rows of it (from and to multiples of scale_group_size)
        quantized apart, in row order: the stripe widths are the layer's (the same in every part), the outliers'
        row pointers are shifted by the outliers of the parts before, every other tensor leads with the rows (or
        with the groups of scale_group_size rows)."""
        first = parts[0]
        key = (first.group_size, first.scale_group_size, first.assign, first.in_features)
        for p in parts[1:]:
            if (p.group_size, p.scale_group_size, p.assign, p.in_features) != key or not torch.equal(
                p.stripe_bits, first.stripe_bits
            ):
                raise ValueError("mixed-2-4-16: row slices with different schemes or stripe widths")
        cat = lambda field: torch.cat([getattr(p, field) for p in parts])  # noqa: E731
        rowptr, at = [torch.zeros(1, dtype=torch.int32)], 0
        for p in parts:
            rowptr.append(p.outlier_rowptr[1:] + at)
            at += p.num_outliers
        return cls(
            first.group_size,
            first.scale_group_size,
            first.assign,
            first.in_features,
            sum(p.out_features for p in parts),
            cat("qweight_a"),
            cat("qweight_b"),
            first.stripe_bits,
            cat("scale_codes"),
            cat("zeros2"),
            cat("scales_2nd"),
            cat("zeros_2nd"),
            cat("scales4"),
            cat("zeros4"),
            cat("outlier_values"),
            cat("outlier_cols"),
            torch.cat(rowptr),
        )

    # ---- reading ------------------------------------------------------------------------------------------

    @property
    def is4(self) -> torch.Tensor:
        return self.stripe_bits == 4

    @property
    def stripes_4bit(self) -> int:
        return int(self.is4.sum())

    @property
    def num_outliers(self) -> int:
        return int(self.outlier_values.numel())

    def codes(self) -> torch.Tensor:
        """The codes [N, K] (int64): 0..3 in 2-bit stripes, 0..15 in 4-bit stripes."""
        n, k, g1 = self.out_features, self.in_features, self.group_size
        s = k // g1
        is4 = self.is4.cpu()
        units = unpack_codes(self.qweight_a, 2, k).reshape(n, s, g1)
        codes = units.clone()
        half = g1 // 2
        pairs = units[:, is4].reshape(n, -1, half, 2)
        lo = pairs[..., 0] | (pairs[..., 1] << 2)
        hi = unpack_codes(self.qweight_b, 4, self.stripes_4bit * half).reshape(n, -1, half)
        codes[:, is4] = torch.cat([lo, hi], dim=-1)
        return codes.reshape(n, k)

    def group_params(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero) of every group [N, S] in float32: ŝ = (code + u)·s2 for 2-bit groups, the float16 scale
        for 4-bit ones."""
        n, g2 = self.out_features, self.scale_group_size
        s, s4 = self.in_features // self.group_size, self.stripes_4bit
        s2 = s - s4
        is4 = self.is4.cpu()
        c = unpack_codes(self.scale_codes, SCALE_BITS, s2).to(torch.float32)
        u = self.zeros_2nd.to(torch.float32).repeat_interleave(g2, dim=0)
        sc2 = self.scales_2nd.to(torch.float32).repeat_interleave(g2, dim=0)
        scale = torch.empty(n, s, dtype=torch.float32)
        zero = torch.empty(n, s, dtype=torch.float32)
        scale[:, ~is4] = (c + u) * sc2
        zero[:, ~is4] = unpack_codes(self.zeros2, 2, s2).to(torch.float32)
        scale[:, is4] = self.scales4.to(torch.float32)
        zero[:, is4] = unpack_codes(self.zeros4, 4, s4).to(torch.float32)
        return scale, zero

    def dense(self) -> torch.Tensor:
        """The dense part [N, K] float32, `(q - z)·ŝ` (exact in float32), without the outliers."""
        n, k, g1 = self.out_features, self.in_features, self.group_size
        scale, zero = self.group_params()
        q = self.codes().to(torch.float32).reshape(n, -1, g1)
        return ((q - zero[:, :, None]) * scale[:, :, None]).reshape(n, k)

    def outliers(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rows, columns, values float32) of the sparse part."""
        counts = (self.outlier_rowptr[1:] - self.outlier_rowptr[:-1]).to(torch.int64).cpu()
        rows = torch.repeat_interleave(torch.arange(self.out_features), counts)
        cols = self.outlier_cols.to(torch.int64).cpu() & 0xFFFF
        return rows, cols, self.outlier_values.to(torch.float32).cpu()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense part plus the sparse residuals, in float32, cast to `dtype`."""
        w = self.dense()
        rows, cols, vals = self.outliers()
        w.index_put_((rows, cols), vals, accumulate=True)
        return w.to(dtype)

    # ---- storage ------------------------------------------------------------------------------------------

    def config(self) -> dict:
        return {
            "format": FORMAT,
            "group_size": self.group_size,
            "scale_group_size": self.scale_group_size,
            "scale_bits": SCALE_BITS,
            "assign": self.assign,
            "stripes_4bit": self.stripes_4bit,
            "outliers": self.num_outliers,
            "in_features": self.in_features,
            "out_features": self.out_features,
        }

    @classmethod
    def describe(cls, cfg: dict) -> str:
        """The stripe widths vary per stripe: the group size and the assignment rule name the scheme."""
        return f"{cfg['format']} w2/4 g{cfg['group_size']} {cfg.get('assign')}"

    def bits_report(self) -> dict[str, float]:
        """Bits per weight of this layer: as stored, and as the paper's Eq. 10 counts it."""
        nk = self.in_features * self.out_features
        return {
            "stored": self.stored_bits() / nk,
            "eq10": eq10_bits(
                self.in_features,
                self.group_size,
                self.scale_group_size,
                self.stripes_4bit,
                self.num_outliers,
                self.out_features,
            ),
        }

    @staticmethod
    def expected_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return shapes_for(
            cfg["out_features"],
            cfg["in_features"],
            cfg["group_size"],
            cfg["scale_group_size"],
            cfg["stripes_4bit"],
            cfg["outliers"],
        )

    @classmethod
    def from_tensors(cls, name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> MixedWeight:
        """Validate stored tensors against the layer config; errors name the tensor."""
        layout = cls.checked(name, cfg, tensors)
        k, g1 = cfg["in_features"], cfg["group_size"]
        bits = tensors["stripe_bits"]
        if bool(((bits != 2) & (bits != 4)).any()):
            raise CheckpointError(
                f"tensor {name}.stripe_bits: found values {sorted(set(bits.tolist()))}, expected 2 or 4"
            )
        s4 = int((bits == 4).sum())
        if s4 != cfg["stripes_4bit"]:
            raise CheckpointError(
                f"tensor {name}.stripe_bits: found {s4} stripes of 4 bits, expected "
                f"{cfg['stripes_4bit']} (stripes_4bit)"
            )
        if cfg["assign"] == "block4" and not bool(((bits == 4).reshape(-1, 4).sum(1) == 1).all()):
            raise CheckpointError(
                f"tensor {name}.stripe_bits: expected one 4-bit stripe in every four (block4)"
            )
        for field in ("scales_2nd", "scales4"):
            check_positive(name, field, tensors[field])
        if tensors["zeros_2nd"].numel() and int(tensors["zeros_2nd"].max()) > 15:
            raise CheckpointError(
                f"tensor {name}.zeros_2nd: found {int(tensors['zeros_2nd'].max())}, expected at most 15"
            )
        if not bool(torch.isfinite(tensors["outlier_values"]).all()):
            raise CheckpointError(f"tensor {name}.outlier_values: found non-finite values")
        rp = tensors["outlier_rowptr"].to(torch.int64)
        if int(rp[0]) != 0 or int(rp[-1]) != cfg["outliers"] or bool((rp[1:] < rp[:-1]).any()):
            raise CheckpointError(
                f"tensor {name}.outlier_rowptr: expected non-decreasing offsets from 0 to {cfg['outliers']}"
            )
        _, cols, _ = layout.outliers()
        if cols.numel():
            if int(cols.max()) >= k:
                raise CheckpointError(
                    f"tensor {name}.outlier_cols: found column {int(cols.max())}, expected "
                    f"columns below in_features {k}"
                )
            if bool(layout.is4[cols // g1].any()):
                raise CheckpointError(
                    f"tensor {name}.outlier_cols: found an outlier in a 4-bit stripe, expected "
                    f"outliers only in 2-bit stripes"
                )
        return layout
