"""GPTQ's column loop of one lazy batch as one kernel (kernels/gptq/gptq.cu), bit-identical to the torch loop of
qtool/quant/gptq.py: the solve on a GPU then costs a few launches per batch instead of ~10 per column."""

from __future__ import annotations

import torch

from qtool.cuda import compile as cc

SOURCE = "gptq/gptq.cu"
ROWS = 32  # kernels/gptq/gptq.cu ROWS: rows per block, one thread each
# Shared memory of a block: weights of the batch's remaining columns and the errors of the quantized ones.
_MAX_SMEM = 200 * 1024


def _smem(bs: int, c0: int, c1: int) -> int:
    return ((bs - c0) + (c1 - c0)) * (ROWS + 1) * 4


def usable(w: torch.Tensor, batch: int) -> bool:
    """Whether the batch kernel runs `w`'s solve: float32 on a GPU with the kernels available, and a batch whose
    columns fit one block's shared memory. QTOOL_KERNELS=reference keeps the torch loop."""
    if not w.is_cuda or w.dtype != torch.float32 or _smem(batch, 0, batch) > _MAX_SMEM:
        return False
    return cc.kernel_mode() != "reference" and cc.cupy_available()


def columns(
    w1: torch.Tensor,
    q1: torch.Tensor,
    err1: torch.Tensor,
    hinv1: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_of: torch.Tensor,
    c0: int,
    c1: int,
    maxq: float,
) -> None:
    """Quantize the batch columns [c0, c1) of every row: codes into q1 and fed-back errors into err1 (those
    columns only), the columns [c1, bs) of w1 updated in place, exactly as the torch loop does.

    w1, q1, err1: float32 [n, bs], contiguous; hinv1: the batch's [bs, bs] block of the upper Cholesky factor of
    the inverse Hessian; scales, zeros: float32 [n, G] (unit column stride); group_of: int32
    [bs], the group of each batch column."""
    n, bs = w1.shape
    for name, t in (("w1", w1), ("q1", q1), ("err1", err1)):
        if t.dtype != torch.float32 or t.shape != (n, bs) or not t.is_contiguous():
            raise ValueError(
                f"gptq columns: {name} is {t.dtype} {list(t.shape)}, expected contiguous float32 [{n}, {bs}]"
            )
    if hinv1.shape != (bs, bs) or hinv1.dtype != torch.float32:
        raise ValueError(
            f"gptq columns: hinv1 is {hinv1.dtype} {list(hinv1.shape)}, expected float32 [{bs}, {bs}]"
        )
    if hinv1.stride(1) != 1:
        # torch's upper Cholesky factor is column-major; the walk reads the factor's rows.
        hinv1 = hinv1.contiguous()
    for name, t in (("scales", scales), ("zeros", zeros)):
        if t.dtype != torch.float32 or t.shape[0] != n or t.stride(1) != 1 or t.stride(0) != scales.stride(0):
            raise ValueError(
                f"gptq columns: {name} is {t.dtype} {list(t.shape)} stride {t.stride()}, expected "
                f"float32 [{n}, G] with unit column stride, as scales"
            )
    if group_of.dtype != torch.int32 or group_of.shape != (bs,) or not group_of.is_contiguous():
        raise ValueError(
            f"gptq columns: group_of is {group_of.dtype} {list(group_of.shape)}, expected int32 [{bs}]"
        )
    if not 0 <= c0 < c1 <= bs:
        raise ValueError(f"gptq columns: columns [{c0}, {c1}) of a batch of {bs}")
    smem = _smem(bs, c0, c1)
    dev = cc.device_index(w1.device)
    fn = cc.load_module(SOURCE, device=dev).fn("gptq_columns_f32")
    if smem > 48 * 1024:
        cc.allow_shared_memory(fn, smem)
    cc.launch(
        fn,
        ((n + ROWS - 1) // ROWS,),
        (ROWS,),
        (
            cc.ptr(w1),
            cc.ptr(q1),
            cc.ptr(err1),
            cc.i32(bs),
            cc.ptr(hinv1),
            cc.i32(hinv1.stride(0)),
            cc.ptr(scales),
            cc.ptr(zeros),
            cc.i32(scales.stride(0)),
            cc.ptr(group_of),
            cc.i32(n),
            cc.i32(bs),
            cc.i32(c0),
            cc.i32(c1),
            cc.f32(maxq),
        ),
        shared_mem=smem,
        device=dev,
    )
