"""The packed formats by name (`quantization_config.layers[*].format`): each format's module class, whose
`layout_cls` is its stored layout. The pipeline, the checkpoint writer and loader, the exporter and `qtool pack`
find a format here and then ask its layout; a sixth format is a folder beside the others and one entry below."""

from __future__ import annotations

from qtool.layouts.base import StoredLayout
from qtool.layouts.grouped_int.module import GroupedIntLinear
from qtool.layouts.mixed.module import MixedLinear
from qtool.layouts.module import PackedLinear
from qtool.layouts.qoq.module import QoQLinear
from qtool.layouts.quik.module import QuikLinear
from qtool.layouts.vq.module import VQLinear

LAYOUTS: dict[str, type[PackedLinear]] = {
    m.layout_cls.FORMAT: m for m in (GroupedIntLinear, QuikLinear, QoQLinear, MixedLinear, VQLinear)
}


def layout_class(fmt: str) -> type[StoredLayout]:
    return LAYOUTS[fmt].layout_cls


def module_for(layout: StoredLayout, bias) -> PackedLinear:
    """The quantized module executing `layout` (an instance of one of the registered layout classes)."""
    module_cls = LAYOUTS.get(getattr(layout, "FORMAT", None))
    if module_cls is None or not isinstance(layout, module_cls.layout_cls):
        raise TypeError(f"no module registered for layout {type(layout).__name__}")
    return module_cls(layout, bias)
