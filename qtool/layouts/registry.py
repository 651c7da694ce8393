"""Registry of packed layouts: format name (as in `quantization_config.layers[*].format`) → (layout dataclass,
module that executes it). The pipeline, the writer and the loader go through it, so a new layout is one entry."""

from __future__ import annotations

from torch import nn

from qtool.layouts.grouped_int.layout import FORMAT as GROUPED_INT
from qtool.layouts.grouped_int.layout import GroupedIntWeight
from qtool.layouts.grouped_int.module import GroupedIntLinear
from qtool.layouts.mixed.layout import FORMAT as MIXED
from qtool.layouts.mixed.layout import MixedWeight
from qtool.layouts.mixed.module import MixedLinear
from qtool.layouts.qoq.layout import FORMAT as QOQ
from qtool.layouts.qoq.layout import QoQWeight
from qtool.layouts.qoq.module import QoQLinear
from qtool.layouts.quik.layout import FORMAT as QUIK
from qtool.layouts.quik.layout import QuikWeight
from qtool.layouts.quik.module import QuikLinear
from qtool.layouts.vq.layout import FORMAT as VQ
from qtool.layouts.vq.layout import VQWeight
from qtool.layouts.vq.module import VQLinear

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
