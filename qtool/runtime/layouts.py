"""Registry of packed layouts: format name (as in `quantization_config.layers[*].format`) → (layout dataclass,
module that executes it). The pipeline, the writer and the loader go through it, so a new layout is one entry."""

from __future__ import annotations

from torch import nn

from qtool.packing.grouped_int import FORMAT as GROUPED_INT
from qtool.packing.grouped_int import GroupedIntWeight
from qtool.packing.mixed import FORMAT as MIXED
from qtool.packing.mixed import MixedWeight
from qtool.packing.qoq import FORMAT as QOQ
from qtool.packing.qoq import QoQWeight
from qtool.packing.quik import FORMAT as QUIK
from qtool.packing.quik import QuikWeight
from qtool.packing.vq import FORMAT as VQ
from qtool.packing.vq import VQWeight
from qtool.runtime.mixed_linear import MixedLinear
from qtool.runtime.qlinear import GroupedIntLinear
from qtool.runtime.qoq_linear import QoQLinear
from qtool.runtime.quik_linear import QuikLinear
from qtool.runtime.vq_linear import VQLinear

LAYOUTS: dict[str, tuple[type, type[nn.Module]]] = {
    GROUPED_INT: (GroupedIntWeight, GroupedIntLinear),
    QUIK: (QuikWeight, QuikLinear),
    QOQ: (QoQWeight, QoQLinear),
    MIXED: (MixedWeight, MixedLinear),
    VQ: (VQWeight, VQLinear),
}


def module_for(layout, bias) -> nn.Module:
    """The quantized module executing `layout` (an instance of one of the registered layout classes)."""
    for layout_cls, module_cls in LAYOUTS.values():
        if isinstance(layout, layout_cls):
            return module_cls(layout, bias)
    raise TypeError(f"no module registered for layout {type(layout).__name__}")
