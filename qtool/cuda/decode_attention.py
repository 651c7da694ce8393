"""One decode step's attention over a static KV cache (kernels/decoder/decode_attention.cu): a block per sequence and
query head, float32 softmax, output in the [B, 1, H, D] layout the output projection reads. It replaces
`scaled_dot_product_attention` with an `arange(L) <= pos` mask plus the transposing copy after it; results agree
with a float64 reference to float16 rounding."""

from __future__ import annotations

import math

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch

SOURCE = "decoder/decode_attention.cu"
THREADS = 256
MAX_HEAD_DIM = 256


def decode_attention(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """q float16 [B, H, 1, D]; caches kc/vc float16 [B, KVH, L, D] (H a multiple of KVH); pos int64 [1]: the step
    attends to cache positions 0..pos. Returns (or fills `out`) float16 [B, 1, H, D]."""
    for name, x in (("q", q), ("kc", kc), ("vc", vc)):
        cc.check_f16(name, x)
    four_d = q.dim() == 4 and kc.dim() == 4
    b, h, t, d = q.shape if four_d else (0, 0, 0, 0)
    kvh, length = (kc.shape[1], kc.shape[2]) if four_d else (0, 0)
    if (
        not four_d
        or t != 1
        or kc.shape != vc.shape
        or kc.shape[0] != b
        or kc.shape[3] != d
        or not kvh
        or h % kvh
        or d % 2
        or d > MAX_HEAD_DIM
    ):
        raise ValueError(
            f"decode_attention: found q {list(q.shape)}, caches {list(kc.shape)} and {list(vc.shape)}; "
            f"expected q [B, H, 1, D] (one query token), equal caches [B, KVH, L, D] with H a multiple "
            f"of KVH and an even D <= {MAX_HEAD_DIM}"
        )
    if pos.dtype != torch.int64 or pos.numel() != 1 or pos.device != q.device:
        raise ValueError(
            f"pos: found {pos.dtype} {list(pos.shape)} on {pos.device}, expected int64 [1] on {q.device}"
        )
    shape = (b, 1, h, d)
    out = cc.f16_out(out, shape, q.device)
    dev = cc.device_index(q.device)
    smem = 4 * (length + d + THREADS // 32 * d)
    fn = cc.load_module(SOURCE, device=dev).fn("decode_attention_f16")
    cc.allow_shared_memory(fn, smem)
    dependent_launch.launch(
        fn,
        (b * h,),
        (THREADS,),
        (
            cc.ptr(q),
            cc.ptr(kc),
            cc.ptr(vc),
            cc.ptr(pos),
            cc.ptr(out),
            cc.i32(h),
            cc.i32(kvh),
            cc.i32(length),
            cc.i32(d),
            cc.f32(1.0 / math.sqrt(d)),
        ),
        shared_mem=smem,
        device=dev,
    )
    return out
