"""Per-linear input statistics (absmax, mean square, token count, optional Hessian) and their stats file."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from qtool.errors import InputError
from qtool.output import Output, reserve_output

STATS_KEY = "qtool_stats"


class LinearStats:
    """Accumulates statistics of the inputs x [..., K] seen by one linear layer.

    The Hessian is GPTQ's `H = 2/n Σ x xᵀ` (n tokens), the curvature of the layer's squared output error.
    """

    def __init__(self, in_features: int, hessian: bool, device: torch.device | str = "cpu") -> None:
        self.in_features = in_features
        self.tokens = 0
        self.absmax = torch.zeros(in_features, dtype=torch.float32, device=device)
        self.sq_sum = torch.zeros(in_features, dtype=torch.float64, device=device)
        self._xtx = (
            torch.zeros(in_features, in_features, dtype=torch.float32, device=device) if hessian else None
        )

    @property
    def has_hessian(self) -> bool:
        return self._xtx is not None

    def update(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, self.in_features).to(torch.float32)
        self.tokens += x.shape[0]
        self.absmax = torch.maximum(self.absmax, x.abs().amax(dim=0))
        self.sq_sum += (x.double() ** 2).sum(dim=0)
        if self._xtx is not None:
            self._xtx.addmm_(x.T, x)

    def all_reduce(self, world) -> None:
        """Combine the statistics the ranks of a data-parallel run (qtool/distributed.py) collected on their
        samples into those of all samples: counts, squares and x xᵀ summed, max |x| the maximum."""
        if not world.joined:
            return
        tokens = torch.tensor([float(self.tokens)], dtype=torch.float64, device=self.sq_sum.device)
        world.all_reduce(tokens)
        self.tokens = int(tokens[0])
        world.all_reduce(self.absmax, "max")
        world.all_reduce(self.sq_sum)
        if self._xtx is not None:
            world.all_reduce(self._xtx)

    @property
    def mean_sq(self) -> torch.Tensor:
        return (self.sq_sum / max(self.tokens, 1)).to(torch.float32)

    def hessian(self) -> torch.Tensor:
        if self._xtx is None:
            raise ValueError("these statistics were collected without a Hessian")
        return self._xtx * (2.0 / max(self.tokens, 1))

    def hessian_diag(self) -> torch.Tensor:
        """diag(H) = 2·E[x²]: available even without the full Hessian."""
        return 2.0 * self.mean_sq

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {
            "absmax": self.absmax.cpu(),
            "mean_sq": self.mean_sq.cpu(),
            "tokens": torch.tensor([self.tokens], dtype=torch.int64),
        }
        if self._xtx is not None:
            out["hessian"] = self.hessian().cpu()
        return out

    @classmethod
    def from_tensors(cls, t: dict[str, torch.Tensor]) -> LinearStats:
        k = t["absmax"].shape[0]
        s = cls(k, hessian=False)
        s.tokens = int(t["tokens"][0])
        s.absmax = t["absmax"].to(torch.float32)
        s.sq_sum = t["mean_sq"].double() * s.tokens
        if "hessian" in t:
            s._xtx = t["hessian"].to(torch.float32) * (max(s.tokens, 1) / 2.0)
        return s


def save_stats(
    path: Path, stats: dict[str, LinearStats], stamp: dict, reserved: Output | None = None
) -> None:
    """Write the stats file through a temporary sibling (`reserved`, or one made here), so `path` is whole or
    untouched."""
    if reserved is None:
        with reserve_output(path, directory=False, overwrite=True) as reserved:
            return save_stats(path, stats, stamp, reserved)
    tensors = {
        f"{name}.{field}": v.contiguous()
        for name, s in sorted(stats.items())
        for field, v in s.tensors().items()
    }
    save_file(tensors, str(reserved.tmp), metadata={STATS_KEY: json.dumps(stamp, sort_keys=True)})
    reserved.publish()


def load_stats(path: Path) -> tuple[dict[str, LinearStats], dict]:
    """The statistics of a stats file, each linear with its absmax, mean_sq and tokens, all finite; anything else
    is one InputError naming the file and the tensor."""
    from safetensors import SafetensorError

    from qtool.models.integrity import check_finite, read_header

    header = read_header(
        Path(path), InputError
    )  # a truncated or garbled file is named before safetensors reads it
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if STATS_KEY not in meta:
                raise InputError(f"{path}: not a qtool stats file (no '{STATS_KEY}' metadata)")
            try:
                stamp = json.loads(meta[STATS_KEY])
            except json.JSONDecodeError:
                raise InputError(f"{path}: garbled '{STATS_KEY}' metadata (not JSON)") from None
            grouped: dict[str, dict[str, torch.Tensor]] = {}
            for key in f.keys():
                name, _, field = key.rpartition(".")
                grouped.setdefault(name, {})[field] = f.get_tensor(key)
    except (OSError, ValueError, SafetensorError) as e:  # safetensors raises these for unreadable files
        raise InputError(f"{path}: cannot read stats file: {e}") from None
    for name, t in sorted(grouped.items()):
        missing = [k for k in ("absmax", "mean_sq", "tokens") if k not in t]
        if missing:
            raise InputError(
                f"{path}: statistics of {name or '?'} lack {', '.join(missing)}; expected a stats file "
                f"written by qtool calibrate"
            )
        check_finite(((f"{name}.{k}", v) for k, v in sorted(t.items())), InputError, header)
    return {name: LinearStats.from_tensors(t) for name, t in grouped.items()}, stamp
