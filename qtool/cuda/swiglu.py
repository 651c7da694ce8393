"""SwiGLU of a fused gate/up projection (kernels/decoder/swiglu.cu): silu(gate) * up in one kernel, each step rounded to
float16 as torch's F.silu and half multiply round it."""

from __future__ import annotations

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch

SOURCE = "decoder/swiglu.cu"
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
