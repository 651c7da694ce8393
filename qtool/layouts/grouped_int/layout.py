"""The `grouped_int` layout (formats/grouped-int.md): packed codes, float16 scales, uint8 zero points."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.errors import CheckpointError
from qtool.layouts.base import StoredLayout, check_scales
from qtool.layouts.bitpack import pack_codes, packed_words, unpack_codes

FORMAT = "grouped_int"
PACK_CHUNK = 1 << 24  # codes per packing step (three int64 temporaries of 128 MiB)


@dataclass(frozen=True)
class GridSpec:
    """The integer grid of a grouped_int layer: codes in 0..2^bits - 1, a scale per group of `group_size` input
    columns (None: one group per output row), a zero point per group unless symmetric."""

    bits: int
    symmetric: bool
    group_size: int | None  # None: one group per output row

    @property
    def maxq(self) -> int:
        return (1 << self.bits) - 1

    @property
    def sym_zero(self) -> int:
        return 1 << (self.bits - 1)

    def num_groups(self, in_features: int) -> int:
        g = self.group_size or in_features
        return (in_features + g - 1) // g

    def group_bounds(self, in_features: int) -> list[tuple[int, int]]:
        g = self.group_size or in_features
        return [(s, min(s + g, in_features)) for s in range(0, in_features, g)]


@dataclass
class GroupedIntWeight(StoredLayout):
    FORMAT = FORMAT
    FIELDS = ("qweight", "scales", "zeros")

    spec: GridSpec
    in_features: int
    out_features: int
    qweight: torch.Tensor  # int32 [N, ceil(K*bits/32)]
    scales: torch.Tensor  # float16 [N, G]
    zeros: torch.Tensor | None  # uint8 [N, G] when asymmetric

    @classmethod
    def from_codes(
        cls, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, spec: GridSpec
    ) -> GroupedIntWeight:
        """Build from integer codes [N, K] and per-group scales/zeros [N, G] (any float dtype)."""
        n, k = codes.shape
        # Packed where the codes are (on the GPU in a CUDA run, where a 7B block's codes take seconds to pack on
        # one CPU thread, as each rank has under torchrun), in row chunks that bound the int64 temporaries.
        rows = max(1, PACK_CHUNK // max(1, k))
        return cls(
            spec=spec,
            in_features=k,
            out_features=n,
            qweight=torch.cat([pack_codes(codes[i : i + rows], spec.bits).cpu() for i in range(0, n, rows)]),
            scales=scales.to(torch.float16).cpu().contiguous(),
            zeros=None if spec.symmetric else zeros.round().to(torch.uint8).cpu().contiguous(),
        )

    @classmethod
    def concat_rows(cls, parts: list[GroupedIntWeight]) -> GroupedIntWeight:
        """One layer from `parts`, consecutive output rows of it quantized apart, in row order: every tensor leads
        with the rows."""
        first = parts[0]
        for p in parts[1:]:
            if (p.spec, p.in_features) != (first.spec, first.in_features):
                raise ValueError(
                    f"grouped_int: row slices of different layers ({p.spec}, {p.in_features} inputs "
                    f"against {first.spec}, {first.in_features})"
                )
        return cls(
            first.spec,
            first.in_features,
            sum(p.out_features for p in parts),
            torch.cat([p.qweight for p in parts]),
            torch.cat([p.scales for p in parts]),
            None if first.zeros is None else torch.cat([p.zeros for p in parts]),
        )

    def codes(self) -> torch.Tensor:
        return unpack_codes(self.qweight, self.spec.bits, self.in_features)

    def group_index(self) -> torch.Tensor:
        g = self.spec.group_size or self.in_features
        return torch.arange(self.in_features, device=self.qweight.device) // g

    def dequantize(
        self, dtype: torch.dtype = torch.float32, device: torch.device | None = None
    ) -> torch.Tensor:
        """`(code - zero)·scale` [N, K], computed on `device` (default: where the tensors are). Every device gives
        the same values: the unpacking is integer, then one exact subtraction and one rounded product per weight
        in float32, so the GPTQ stage dequantizes where it solved instead of unpacking on the host."""
        layer = self if device is None else self.to(device)
        idx = layer.group_index()
        # In row chunks, as packing does: the unpacking's int64 temporaries stay bounded.
        rows = max(1, PACK_CHUNK // max(1, self.in_features))
        out = torch.empty(self.out_features, self.in_features, dtype=dtype, device=layer.qweight.device)
        for i in range(0, self.out_features, rows):
            scales = layer.scales[i : i + rows].to(torch.float32)[:, idx]
            if layer.zeros is None:
                zeros = float(self.spec.sym_zero)
            else:
                zeros = layer.zeros[i : i + rows].to(torch.float32)[:, idx]
            codes = unpack_codes(layer.qweight[i : i + rows], self.spec.bits, self.in_features)
            out[i : i + rows] = (codes.to(torch.float32) - zeros) * scales
        return out

    def to(self, device: torch.device | str) -> GroupedIntWeight:
        """The same layer with its tensors on `device`."""
        return self.map_tensors(lambda t: t.to(device))

    def config(self) -> dict:
        return {
            "format": FORMAT,
            "bits": self.spec.bits,
            "group_size": self.spec.group_size,
            "symmetric": self.spec.symmetric,
            "in_features": self.in_features,
            "out_features": self.out_features,
        }

    @classmethod
    def params_from_config(cls, cfg: dict) -> dict:
        return {
            "spec": spec_from_config(cfg),
            "in_features": cfg["in_features"],
            "out_features": cfg["out_features"],
        }

    @staticmethod
    def expected_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        spec = spec_from_config(cfg)
        n, k = cfg["out_features"], cfg["in_features"]
        g = spec.num_groups(k)
        shapes = {
            "qweight": ((n, packed_words(k, spec.bits)), torch.int32),
            "scales": ((n, g), torch.float16),
        }
        if not spec.symmetric:
            shapes["zeros"] = ((n, g), torch.uint8)
        return shapes

    @classmethod
    def from_tensors(cls, name: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> GroupedIntWeight:
        """Validate stored tensors against the layer config; errors name the tensor."""
        layout = cls.checked(name, cfg, tensors)
        check_scales(name, layout.scales)
        zeros, spec = layout.zeros, layout.spec
        if zeros is not None and int(zeros.max()) > spec.maxq:
            raise CheckpointError(
                f"tensor {name}.zeros: found {int(zeros.max())}, expected at most {spec.maxq}"
            )
        return layout


def spec_from_config(cfg: dict) -> GridSpec:
    return GridSpec(bits=int(cfg["bits"]), symmetric=bool(cfg["symmetric"]), group_size=cfg["group_size"])
