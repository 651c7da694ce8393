"""What the modules that run a packed layout dataclass (qtool/packing/checks.py `StoredLayout`) share: the layout's
parameters as attributes and its tensors as buffers (so `.to(device)` moves them and `state_dict` holds them), an
optional frozen bias, the layout rebuilt from them, a dense weight dequantized once per (device, dtype), and
floating tensors of the stored format that `model.to(dtype)` must not cast."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn


class PackedLinear(nn.Module):
    layout_cls: ClassVar[type]
    # Floating tensors stored as float16 whatever the model's dtype (the kernels and the checks read them so).
    float16_fields: ClassVar[tuple[str, ...]] = ()

    def __init__(self, weight, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        for p in self.params():
            setattr(self, p, getattr(weight, p))
        for f in self.layout_cls.FIELDS:
            self.register_buffer(f, getattr(weight, f))
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.bias = None
        # The dense weight, built on first use per (device, dtype); a kernel never needs it.
        self._dense: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    @classmethod
    def params(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls.layout_cls) if f.name not in cls.layout_cls.FIELDS]

    def layout_with(self, move: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        """The layout over this module's tensors, each passed through `move`."""
        return self.layout_cls(
            **{p: getattr(self, p) for p in self.params()},
            **{f: move(getattr(self, f)) for f in self.layout_cls.FIELDS},
        )

    @property
    def layout(self):
        return self.layout_with()

    def dense_float32(self) -> torch.Tensor:
        """The weight [N, K] in float32, as the reference multiplies with it."""
        return self.layout.dequantize(torch.float32)

    def dense_weight(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        w = self._dense.get(key)
        if w is None:
            w = self._dense[key] = self.dense_float32().to(device=device, dtype=dtype)
        return w

    def drop_caches(self) -> None:
        """Forget everything derived from the tensors (they moved or were cast)."""
        self._dense = {}

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        for f in self.float16_fields:
            if getattr(self, f).dtype != torch.float16:
                setattr(self, f, getattr(self, f).to(torch.float16))
        self.drop_caches()
        return self
