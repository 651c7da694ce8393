"""Rotary embedding of queries and keys fused with the KV-cache write (kernels/decoder/rope_cache.cu): the decode step's
per-layer attention prologue as one kernel. The torch form it replaces (qtool/bench/e2e.py `rope` plus two
`index_copy_`) is its reference: the results are bit-identical."""

from __future__ import annotations

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch

SOURCE = "decoder/rope_cache.cu"
THREADS = 256


def rope_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    pos: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> torch.Tensor:
    """qkv float16 [B, T, heads + 2 kv_heads, D] (contiguous); cos/sin float16 [L', D/2] tables indexed by the
    int64 positions `pos` [T]; caches kc/vc float16 [B, kv_heads, L, D]. Writes the rotated keys and the values at
    the positions and returns the rotated queries [B, heads, T, D]."""
    if qkv.dim() != 4 or qkv.shape[2] != heads + 2 * kv_heads or qkv.shape[3] % 2:
        raise ValueError(f"qkv: found {list(qkv.shape)}, expected [B, T, {heads + 2 * kv_heads}, even D]")
    b, t, _, d = qkv.shape
    for name, x in (("qkv", qkv), ("cos", cos), ("sin", sin), ("kc", kc), ("vc", vc)):
        cc.check_f16(name, x)
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != d // 2:
        raise ValueError(
            f"cos/sin: found {list(cos.shape)} and {list(sin.shape)}, expected [L, {d // 2}] each"
        )
    if kc.shape != vc.shape or tuple(kc.shape[:2]) != (b, kv_heads) or kc.shape[3] != d:
        raise ValueError(
            f"kc/vc: found {list(kc.shape)} and {list(vc.shape)}, expected [{b}, {kv_heads}, L, {d}]"
        )
    if pos.dtype != torch.int64 or pos.shape != (t,) or pos.device != qkv.device:
        raise ValueError(
            f"pos: found {pos.dtype} {list(pos.shape)} on {pos.device}, expected int64 [{t}] on {qkv.device}"
        )
    q = torch.empty(b, heads, t, d, dtype=torch.float16, device=qkv.device)
    dev = cc.device_index(qkv.device)
    total = b * t * (heads + 2 * kv_heads) * (d // 2)
    blocks = max(1, min(-(-total // THREADS), cc.sm_count(dev) * 8))
    dependent_launch.launch(
        cc.load_module(SOURCE, device=dev).fn("rope_cache_f16"),
        (blocks,),
        (THREADS,),
        (
            cc.ptr(qkv),
            cc.ptr(cos),
            cc.ptr(sin),
            cc.ptr(pos),
            cc.ptr(q),
            cc.ptr(kc),
            cc.ptr(vc),
            cc.i32(b),
            cc.i32(t),
            cc.i32(heads),
            cc.i32(kv_heads),
            cc.i32(d),
            cc.i32(kc.shape[2]),
        ),
        device=dev,
    )
    return q
