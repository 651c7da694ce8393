"""Residual add fused with RMSNorm (kernels/rms_norm.cu): one kernel per normalization of the decode step instead
of torch's add and normalization kernels. The sum is bit-identical to torch's half add; the normalized rows agree
with torch's rms_norm to float16 rounding (the squares are summed in another order)."""

from __future__ import annotations

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch
from qtool.layouts.qoq import cuda as qoq

SOURCE = "rms_norm.cu"
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


def add_rms_norm_codes(
    h: torch.Tensor,
    y: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    p: qoq.QoQPrepared,
    with_rows: bool = False,
    a: qoq.QoQActivations | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, qoq.QoQActivations]:
    """(h + y, the normalized rows or None, their QoQ INT8 codes for the W4A8 layer `p`) in one kernel: the codes,
    s_x and code sums are those of quantize_activations(rms_norm(h + y) * weight, p), bit for bit; the float16
    rows are written only with `with_rows`; `a` receives the codes when given."""
    d = h.shape[-1]
    named = (("h", h), ("weight", weight)) + ((("y", y),) if y is not None else ())
    for name, x in named:
        cc.check_f16(name, x, aligned=True)
    if d % 8 or weight.shape != (d,) or (y is not None and y.shape != h.shape) or p.in_features != d:
        raise ValueError(
            f"add_rms_norm_codes: found h {list(h.shape)}, y {None if y is None else list(y.shape)}, "
            f"weight {list(weight.shape)}, layer input {p.in_features}; expected rows of a multiple of "
            f"8 as wide as the layer's input, y like h, weight [D]"
        )
    rows = h.numel() // d
    hs = torch.empty_like(h) if y is not None else h
    out = cc.f16_out(None, h.shape, h.device, aligned=True) if with_rows else None
    if a is None:
        a = qoq.empty_activations(rows, p, h.device)
    if rows == 0:
        return hs, out, a
    dev = cc.device_index(h.device)
    fn = cc.load_module(SOURCE, device=dev).fn("add_rms_norm_q8")
    smem = (2 * d + 15) // 16 * 16 + p.kp
    cc.allow_shared_memory(fn, smem)
    dependent_launch.launch(
        fn,
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
            cc.ptr(p.dest),
            cc.i32(p.kp),
            cc.ptr(a.codes),
            cc.ptr(a.scale),
            cc.ptr(a.rowsum),
        ),
        shared_mem=smem,
        device=dev,
    )
    return hs, out, a
