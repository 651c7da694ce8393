"""SwiGLU of a fused gate/up projection (kernels/swiglu.cu): silu(gate) * up in one kernel, each step rounded to
float16 as torch's F.silu and half multiply round it."""

from __future__ import annotations

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch
from qtool.layouts.qoq import cuda as qoq

SOURCE = "swiglu.cu"
THREADS = 256


def swiglu(gu: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """gu float16 [..., 2I] (gate columns, then up columns) -> silu(gate) * up [..., I] (into `out` if given)."""
    cc.check_f16("gu", gu, aligned=True)
    if gu.dim() == 0 or gu.shape[-1] % 16:
        raise ValueError(
            f"gu: found {gu.dtype} {list(gu.shape)}, expected a last dimension divisible by 16 (gate "
            f"columns, then up columns)"
        )
    i = gu.shape[-1] // 2
    rows = gu.numel() // (2 * i)
    shape = (*gu.shape[:-1], i)
    out = cc.f16_out(out, shape, gu.device, aligned=True)
    if rows == 0:
        return out
    dev = cc.device_index(gu.device)
    total = rows * (i // 8)
    blocks = max(1, min(-(-total // THREADS), cc.sm_count(dev) * 8))
    dependent_launch.launch(
        cc.load_module(SOURCE, device=dev).fn("swiglu_f16"),
        (blocks,),
        (THREADS,),
        (cc.ptr(gu), cc.ptr(out), cc.i32(rows), cc.i32(i)),
        device=dev,
    )
    return out


def swiglu_codes(
    gu: torch.Tensor,
    p: qoq.QoQPrepared,
    with_rows: bool = False,
    a: qoq.QoQActivations | None = None,
) -> tuple[torch.Tensor | None, qoq.QoQActivations]:
    """(silu(gate) * up or None, its QoQ INT8 codes for the W4A8 layer `p`) in one kernel, a block per row: the
    codes, s_x and sums are those of quantize_activations(swiglu(gu), p), bit for bit; the float16 rows are written
    only with `with_rows`."""
    cc.check_f16("gu", gu, aligned=True)
    if gu.dim() == 0 or gu.shape[-1] % 16 or gu.shape[-1] // 2 != p.in_features:
        raise ValueError(
            f"gu: found {gu.dtype} {list(gu.shape)}, expected a last dimension of 2 x the layer's input "
            f"({p.in_features}), divisible by 16"
        )
    i = gu.shape[-1] // 2
    rows = gu.numel() // (2 * i)
    out = cc.f16_out(None, (*gu.shape[:-1], i), gu.device, aligned=True) if with_rows else None
    if a is None:
        a = qoq.empty_activations(rows, p, gu.device)
    if rows == 0:
        return out, a
    dev = cc.device_index(gu.device)
    fn = cc.load_module(SOURCE, device=dev).fn("swiglu_q8")
    smem = (2 * i + 15) // 16 * 16 + p.kp
    cc.allow_shared_memory(fn, smem)
    dependent_launch.launch(
        fn,
        (rows,),
        (THREADS,),
        (
            cc.ptr(gu),
            cc.ptr(out),
            cc.i32(i),
            cc.ptr(p.dest),
            cc.i32(p.kp),
            cc.ptr(a.codes),
            cc.ptr(a.scale),
            cc.ptr(a.rowsum),
        ),
        shared_mem=smem,
        device=dev,
    )
    return out, a
