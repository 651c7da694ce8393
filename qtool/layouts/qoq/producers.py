"""QoQ's code producers: the decode step's residual add + RMSNorm and its SwiGLU, each writing the next W4A8
layer's INT8 activation codes (formats/qoq.md, per-token symmetric) in the same kernel, so no separate quantize
kernel runs between them and the GEMM. Their float16 halves are the plain kernels of qtool/cuda/rms_norm.py and
qtool/cuda/swiglu.py, built from the same sources. The kernels write each code at the GEMM's position computed from
the layer's width (`perm`), not gathered through the layer's column map `dest`."""

from __future__ import annotations

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch, rms_norm, swiglu
from qtool.layouts.qoq import cuda as qoq

# swiglu_codes spreads a row over a cluster of this many blocks (kernels/decoder/swiglu.cu swiglu_q8): the largest
# that keeps every block resident at once (two blocks a multiprocessor: the kernel's registers allow two of 256
# threads) and leaves each block at least SWIGLU_MIN_PIECES pieces of 8 columns.
SWIGLU_CLUSTERS = (1, 2, 4, 8)
SWIGLU_MIN_PIECES = 64
SWIGLU_BLOCKS_PER_SM = 2


def code_order(p: qoq.QoQPrepared) -> int:
    """The producers' `perm`: 1 where the layer's codes sit in the 4-bit order (quik.act_positions(k, 4), what
    `p.dest` holds for 4-bit layers), 0 in column order (8-bit layers)."""
    return 1 if p.bits == 4 else 0


def swiglu_cluster(rows: int, i: int, sms: int, limit: int = 8) -> int:
    """Blocks a row of swiglu_codes takes (one cluster): the largest of SWIGLU_CLUSTERS, at most `limit` (the
    driver's: dependent_launch.cluster_limit()), with rows x blocks within SWIGLU_BLOCKS_PER_SM a multiprocessor and
    at least SWIGLU_MIN_PIECES pieces of 8 of the row's i columns a block."""
    best = 1
    for c in SWIGLU_CLUSTERS:
        if c <= limit and rows * c <= SWIGLU_BLOCKS_PER_SM * sms and i // 8 >= SWIGLU_MIN_PIECES * c:
            best = c
    return best


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
    fn = cc.load_module(rms_norm.SOURCE, device=dev).fn("add_rms_norm_q8")
    smem = 2 * d  # a thread's pieces past the ones it holds in registers, at their own slots
    cc.allow_shared_memory(fn, smem)
    dependent_launch.launch(
        fn,
        (rows,),
        (rms_norm.THREADS,),
        (
            cc.ptr(h),
            cc.ptr(y),
            cc.ptr(weight),
            cc.ptr(hs if y is not None else None),
            cc.ptr(out),
            cc.i32(d),
            cc.f32(eps),
            cc.i32(code_order(p)),
            cc.i32(p.kp),
            cc.ptr(a.codes),
            cc.ptr(a.scale),
            cc.ptr(a.rowsum),
        ),
        shared_mem=smem,
        device=dev,
    )
    return hs, out, a


def swiglu_codes(
    gu: torch.Tensor,
    p: qoq.QoQPrepared,
    with_rows: bool = False,
    a: qoq.QoQActivations | None = None,
    cluster: int | None = None,
) -> tuple[torch.Tensor | None, qoq.QoQActivations]:
    """(silu(gate) * up or None, its QoQ INT8 codes for the W4A8 layer `p`) in one kernel, a row over a cluster of
    blocks (`swiglu_cluster`, or `cluster` of SWIGLU_CLUSTERS): the codes, s_x and sums are those of
    quantize_activations(swiglu(gu), p), bit for bit; the float16 rows are written only with `with_rows`."""
    cc.check_f16("gu", gu, aligned=True)
    if gu.dim() == 0 or gu.shape[-1] % 16 or gu.shape[-1] // 2 != p.in_features:
        raise ValueError(
            f"gu: found {gu.dtype} {list(gu.shape)}, expected a last dimension of 2 x the layer's input "
            f"({p.in_features}), divisible by 16"
        )
    if cluster is not None and cluster not in SWIGLU_CLUSTERS:
        raise ValueError(f"swiglu_codes: found cluster {cluster}, expected one of {SWIGLU_CLUSTERS}")
    i = gu.shape[-1] // 2
    rows = gu.numel() // (2 * i)
    out = cc.f16_out(None, (*gu.shape[:-1], i), gu.device, aligned=True) if with_rows else None
    if a is None:
        a = qoq.empty_activations(rows, p, gu.device)
    if rows == 0:
        return out, a
    dev = cc.device_index(gu.device)
    if cluster is None:
        cluster = swiglu_cluster(rows, i, cc.sm_count(dev), dependent_launch.cluster_limit())
    fn = cc.load_module(swiglu.SOURCE, device=dev).fn("swiglu_q8")
    # a thread's pieces past the ones it holds in registers, at their own slots: room for the whole row, which one
    # block takes where the driver refuses the cluster
    smem = 2 * p.kp
    cc.allow_shared_memory(fn, smem)
    # a one-dimensional grid, cluster blocks a row: rows may exceed a grid's 65535 along y
    dependent_launch.launch(
        fn,
        (cluster * rows,),
        (swiglu.THREADS,),
        (
            cc.ptr(gu),
            cc.ptr(out),
            cc.i32(i),
            cc.i32(code_order(p)),
            cc.i32(p.kp),
            cc.i32(cluster),
            cc.ptr(a.codes),
            cc.ptr(a.scale),
            cc.ptr(a.rowsum),
        ),
        shared_mem=smem,
        device=dev,
        cluster=(cluster, 1, 1) if cluster > 1 else None,
    )
    return out, a
