"""What the modules that run a packed layout share (`PackedLinear`): the layout's parameters as attributes and its
tensors as buffers (so `.to(device)` moves them and `state_dict` holds them), an optional frozen bias, the layout
rebuilt from them, one cache of what is derived from the tensors, floating tensors of the stored format that
`model.to(dtype)` must not cast, and one dispatch: the format's CUDA launch code on a GPU where it applies, the torch
reference everywhere else.

The cache (`derived`) holds the reference path's operands (a dense weight, unpacked codes, an integer operand) and
the kernels' prepared view of the tensors, built on first use and dropped when the tensors move or are cast. An
entry built with `scoped=True` is kept only inside `reference_cache(model)` (an evaluation): outside it, such an
operand (a whole dense copy of the weight) is built again at each call, so a model that is only loaded holds its
packed bytes alone."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any, ClassVar

import torch
from torch import nn

from qtool.layouts.base import StoredLayout


class PackedLinear(nn.Module):
    layout_cls: ClassVar[type[StoredLayout]]
    # The module (import path) whose `module_forward(layer, x)` runs this layout on a GPU, or returns None when
    # the reference should; imported on first use so that CPU-only use never loads the GPU runtime.
    cuda_module: ClassVar[str]
    # Floating tensors stored in a fixed dtype whatever the model's (the kernels and the checks read them so).
    pinned_dtypes: ClassVar[dict[str, torch.dtype]] = {}

    def __init__(self, weight: StoredLayout, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        for p in self.layout_cls.params():
            setattr(self, p, getattr(weight, p))
        for f in self.layout_cls.FIELDS:
            self.register_buffer(f, getattr(weight, f))
        if bias is not None:
            self.bias = nn.Parameter(bias, requires_grad=False)
        else:
            self.bias = None
        self._derived: dict[Hashable, Any] = {}
        self._scoped: set[Hashable] = set()
        self._keep_scoped = False

    def layout_with(self, move: Callable[[torch.Tensor], torch.Tensor] = lambda t: t):
        """The layout over this module's tensors, each passed through `move`."""
        return self.layout_cls(
            **{p: getattr(self, p) for p in self.layout_cls.params()},
            **{f: None if (t := getattr(self, f)) is None else move(t) for f in self.layout_cls.FIELDS},
        )

    @property
    def layout(self):
        return self.layout_with()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.layout.dequantize(dtype)

    def dense_float32(self) -> torch.Tensor:
        """The weight [N, K] in float32, as the reference multiplies with it."""
        return self.dequantize(torch.float32)

    def dense_weight(self, device: torch.device, dtype: torch.dtype, scoped: bool = False) -> torch.Tensor:
        return self.derived(
            ("dense", device, dtype),
            lambda: self.dense_float32().to(device=device, dtype=dtype),
            scoped=scoped,
        )

    @property
    def prepared(self):
        """The kernels' view of the tensors (built by the format's CUDA launch code on a GPU forward), or None."""
        return self._derived.get("cuda")

    def derived(
        self,
        key: Hashable,
        make: Callable[[], Any],
        valid: Callable[[Any], bool] | None = None,
        scoped: bool = False,
    ) -> Any:
        """The value `make()` derives from the stored tensors, cached under `key` (rebuilt when `valid` says the
        cached one no longer fits); `scoped`: cached only inside `reference_cache`."""
        if scoped and not self._keep_scoped:
            return make()
        value = self._derived.get(key)
        if value is None or (valid is not None and not valid(value)):
            value = self._derived[key] = make()
            if scoped:
                self._scoped.add(key)
        return value

    def drop_derived(self, scoped_only: bool = False) -> None:
        """Forget what was derived from the tensors (all of it: they moved or were cast)."""
        if scoped_only:
            for key in self._scoped:
                self._derived.pop(key, None)
        else:
            self._derived.clear()
        self._scoped.clear()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            y = self.cuda_forward(x)
            if y is not None:
                return y
        return self.reference_forward(x)

    def cuda_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The format's CUDA path for `x`, or None where the reference runs (QTOOL_KERNELS decides)."""
        return importlib.import_module(self.cuda_module).module_forward(self, x)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _apply(self, fn, recurse: bool = True):
        super()._apply(fn, recurse)
        for f, dtype in self.pinned_dtypes.items():
            t = getattr(self, f)
            if t is not None and t.dtype != dtype:
                setattr(self, f, t.to(dtype))
        self.drop_derived()
        return self


@contextmanager
def reference_cache(model: nn.Module) -> Iterator[int]:
    """Within the block, packed modules keep the reference path's scoped operands (a dense weight, float copies of
    integer codes) after their first forward, so evaluating a packed model on the CPU costs about what the float
    model costs; they are dropped when the block ends. Activations are still quantized per call, so results are
    unchanged bit for bit. Yields how many modules keep them."""
    modules = [m for m in model.modules() if isinstance(m, PackedLinear)]
    for m in modules:
        m._keep_scoped = True
    try:
        yield len(modules)
    finally:
        for m in modules:
            m._keep_scoped = False
            m.drop_derived(scoped_only=True)
