"""Residual add fused with RMSNorm (kernels/decoder/rms_norm.cu): one kernel per normalization of the decode step instead
of torch's add and normalization kernels. The sum is bit-identical to torch's half add; the normalized rows agree
with torch's rms_norm to float16 rounding (the squares are summed in another order)."""

from __future__ import annotations

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch

SOURCE = "decoder/rms_norm.cu"
THREADS = 256


def add_rms_norm(
    h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + y, rms_norm(h + y) * weight) for float16 rows [..., D]; with y None, (h, rms_norm(h) * weight).
    `out` (like h) receives the normalized rows when given."""
    d = h.shape[-1]
    named = (("h", h), ("weight", weight)) + ((("y", y),) if y is not None else ())
    for name, x in named:
        cc.check_f16(name, x, aligned=True)
    if d % 8 or weight.shape != (d,) or (y is not None and y.shape != h.shape):
        raise ValueError(
            f"add_rms_norm: found h {list(h.shape)}, y {None if y is None else list(y.shape)}, weight "
            f"{list(weight.shape)}; expected rows of a multiple of 8, y like h, weight [D]"
        )
    rows = h.numel() // d
    hs = torch.empty_like(h) if y is not None else h
    out = cc.f16_out(out, h.shape, h.device, aligned=True)
    if rows == 0:
        return hs, out
    dev = cc.device_index(h.device)
    dependent_launch.launch(
        cc.load_module(SOURCE, device=dev).fn("add_rms_norm_f16"),
        (rows,),
        (THREADS,),
        (
            cc.ptr(h),
            cc.ptr(y),
            cc.ptr(weight),
            cc.ptr(hs if y is not None else None),
            cc.ptr(out),
            cc.i32(d),
            cc.f32(eps),
        ),
        device=dev,
    )
    return hs, out
