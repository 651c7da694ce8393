"""CUDA execution of the `quik` layout (kernels/quik_gemm.cu): a fused split + quantize kernel, then an INT8
tensor-core GEMM (wgmma, Hopper) with the Eq. 1 dequantization and the float16 outlier product in its epilogue.

Paths (`linear`, `module_forward`): ``fused`` (the two kernels; float16 activations, W4A4 or W8A8, Hopper) or ``reference``
(the torch path of qtool/runtime/quik_linear.py: other GPUs, bf16/float32 activations, mixed weight/activation
widths). The unfused pieces (`quantize_torch`, raw int32 `gemm`, `epilogue_torch`) exist for the bench ladder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.cuda import compile as cc

SOURCE = "quik_gemm.cu"
KP_MULTIPLE = 128  # base columns padded to whole 4-bit k-steps (64 bytes of codes per row and step)
KO_MULTIPLE = 32  # outlier columns per float16 k-step (64 bytes per row)
TILE = 128  # rows and columns of one GEMM tile
# 128x128 tiles, both operands through swizzled shared memory, two blocks per SM. Three other variants (128x256
# with register A fragments, two warp-specialized ones) were slower on an H200: kernels/NOTES.md.
GEMM_SMEM = 3 * 2 * 128 * 128 + 1024  # three stages of two 16 KB tiles, plus alignment slack
QUANT_ROW_CHOICES = (1, 2, 4)  # token rows per 256-thread quantize block
QUANT_BLOCKS_PER_SM = 8  # cap on resident quantize blocks per SM (shared memory may allow fewer)
QUANT_SMEM_MAX = 200 * 1024


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def unsupported_reason(bits: int, act_bits: int, device: torch.device) -> str | None:
    """Why the kernels cannot run this layer here (None when they can)."""
    if (bits, act_bits) not in ((4, 4), (8, 8)):
        return f"w{bits}a{act_bits} (kernels cover w4a4 and w8a8)"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} (the kernels use wgmma: Hopper, 9.0)"
    return None


@dataclass
class QuikPrepared:
    """Device-side view of one layer, ready for the kernels."""

    bits: int
    act_bits: int
    in_features: int  # K
    out_features: int  # N
    kb: int  # base columns
    kp: int  # base columns padded to KP_MULTIPLE
    ko: int  # outlier columns
    kop: int  # outlier columns padded to KO_MULTIPLE
    wq: torch.Tensor  # int32 [N, kp*bits/32]: base codes, rows padded
    scales: torch.Tensor  # fp16 [N]
    wreduced: torch.Tensor  # fp32 [N]
    wo: torch.Tensor  # fp16 [N, kop]
    base_idx: torch.Tensor  # int32 [kb]
    outlier_idx: torch.Tensor  # int32 [ko]
    bias: torch.Tensor | None  # fp16 [N]
    source_ptr: int


def prepare(layer: torch.nn.Module) -> QuikPrepared:
    """Pad the code rows to whole k-steps and the outlier weights to whole float16 steps (once per layer)."""
    dev = layer.qweight.device
    bits, n = layer.bits, layer.out_features
    ko = int(layer.outlier_idx.numel())
    kb = layer.in_features - ko
    kp = _round_up(max(kb, 1), KP_MULTIPLE)
    kop = _round_up(ko, KO_MULTIPLE)
    words = kp * bits // 32
    qw = layer.qweight
    if qw.shape[1] == words:
        wq = qw.contiguous()
    else:  # padding codes are multiplied by the activations' signed-zero padding: any value is right
        wq = torch.zeros(n, words, dtype=torch.int32, device=dev)
        wq[:, : qw.shape[1]] = qw
    wo = torch.zeros(n, kop, dtype=torch.float16, device=dev)
    wo[:, :ko] = layer.outlier_weight.to(torch.float16)
    bias = None if layer.bias is None else layer.bias.detach().to(torch.float16).contiguous()
    base_idx = layer.base_idx.to(torch.int32).contiguous()
    return QuikPrepared(
        bits=bits, act_bits=layer.act_bits, in_features=layer.in_features, out_features=n, kb=kb, kp=kp, ko=ko,
        kop=kop, wq=wq, scales=layer.scales.to(torch.float16).contiguous(),
        wreduced=layer.wreduced.to(torch.float32).contiguous(), wo=wo,
        base_idx=base_idx, outlier_idx=layer.outlier_idx.to(torch.int32).contiguous(),
        bias=bias, source_ptr=layer.qweight.data_ptr(),
    )


def _module(dev: torch.device) -> cc.KernelModule:
    return cc.load_module(SOURCE, device=dev.index if dev.index is not None else torch.cuda.current_device())


@dataclass
class QuantizedActivations:
    codes: torch.Tensor  # int32 [M, kp*act_bits/32]: packed unsigned codes, signed zero in the padding
    outliers: torch.Tensor  # fp16 [M, kop]
    scale: torch.Tensor  # fp32 [M]
    zero: torch.Tensor  # fp32 [M]


def empty_activations(m: int, p: QuikPrepared, device: torch.device) -> QuantizedActivations:
    return QuantizedActivations(
        codes=torch.empty(m, p.kp * p.act_bits // 32, dtype=torch.int32, device=device),
        outliers=torch.empty(m, p.kop, dtype=torch.float16, device=device),
        scale=torch.empty(m, dtype=torch.float32, device=device),
        zero=torch.empty(m, dtype=torch.float32, device=device),
    )


_GRIDS: dict[tuple[int, int, int], int] = {}


def _quant_grid(smem: int, dev: torch.device, blocks_per_sm: int) -> int:
    """Blocks resident at once: the kernel is persistent and stages the column map once per block."""
    key = (smem, dev.index or 0, blocks_per_sm)
    if key not in _GRIDS:
        props = torch.cuda.get_device_properties(dev)
        sm_smem = int(getattr(props, "shared_memory_per_multiprocessor", 228 * 1024))
        per_sm = max(1, min(blocks_per_sm, (sm_smem - 1024) // (smem + 1024)))
        _GRIDS[key] = props.multi_processor_count * per_sm
    return _GRIDS[key]


def default_rows(k: int) -> int:
    """Rows per quantize block: two short rows share a block; long rows (K > 8192) get a block each (H200 bench,
    kernels/NOTES.md)."""
    return 2 if k <= 8192 else 1


def quantize(x2: torch.Tensor, p: QuikPrepared, rows_per_block: int | None = None,
             out: QuantizedActivations | None = None, blocks_per_sm: int = QUANT_BLOCKS_PER_SM) -> QuantizedActivations:
    """Fused split + per-token quantization of fp16 `x2` [M, K]: one read of each row."""
    if x2.dtype != torch.float16:
        raise cc.CudaUnavailableError(f"quik quantize kernel: found activations {x2.dtype}, expected float16")
    if x2.stride(1) != 1 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    m, k = x2.shape
    dev = x2.device
    words = p.kp * p.act_bits // 32
    if out is None:
        out = empty_activations(m, p, dev)
    if m == 0:
        return out
    rows_per_block = rows_per_block or default_rows(k)
    idx_bytes = 4 * ((p.kb + 3) // 4 * 4)
    if idx_bytes + 2 * k > QUANT_SMEM_MAX:
        raise cc.CudaUnavailableError(f"quik quantize kernel: in_features {k} exceeds the shared-memory buffers "
                                      f"({QUANT_SMEM_MAX // 6} columns)")
    while rows_per_block > 1 and idx_bytes + rows_per_block * 2 * k > QUANT_SMEM_MAX:
        rows_per_block //= 2
    if rows_per_block not in QUANT_ROW_CHOICES:
        raise ValueError(f"rows_per_block: found {rows_per_block}, expected one of {QUANT_ROW_CHOICES}")
    fn = _module(dev).fn(f"quik_quantize_a{p.act_bits}_r{rows_per_block}")
    smem = idx_bytes + rows_per_block * k * 2
    cc.allow_shared_memory(fn, smem)
    cc.launch(
        fn, (min((m + rows_per_block - 1) // rows_per_block, _quant_grid(smem, dev, blocks_per_sm)),), (256,),
        (cc.ptr(x2), cc.i32(x2.stride(0)), cc.i32(m), cc.i32(k), cc.ptr(p.base_idx), cc.i32(p.kb),
         cc.ptr(p.outlier_idx), cc.i32(p.ko), cc.ptr(out.codes), cc.i32(words), cc.ptr(out.outliers), cc.i32(p.kop),
         cc.ptr(out.scale), cc.ptr(out.zero)),
        shared_mem=smem, device=dev.index,
    )
    return out


def gemm(a: QuantizedActivations, p: QuikPrepared, fused: bool = True,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """`fused`: fp16 [M, N] = Eq. 1 epilogue of the integer product + outlier product + bias. Otherwise the raw
    int32 accumulators [M, N] (no outliers, no bias)."""
    m = a.codes.shape[0]
    n = p.out_features
    dev = a.codes.device
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16 if fused else torch.int32, device=dev)
    if m == 0:
        return out
    fn = _module(dev).fn(f"quik_gemm_w{p.bits}")
    cc.allow_shared_memory(fn, GEMM_SMEM)
    kt = p.kp * p.bits // 512 if p.kb > 0 else 0  # 64 bytes of codes per step
    kto = p.kop // KO_MULTIPLE if fused else 0
    cc.launch(
        fn, ((n + TILE - 1) // TILE, (m + TILE - 1) // TILE), (256,),
        (cc.ptr(a.codes), cc.i32(a.codes.shape[1]), cc.ptr(p.wq), cc.i32(p.wq.shape[1]), cc.i32(m), cc.i32(n),
         cc.i32(kt), cc.ptr(a.outliers), cc.ptr(p.wo), cc.i32(p.kop), cc.i32(kto),
         cc.ptr(a.scale), cc.ptr(a.zero), cc.ptr(p.scales), cc.ptr(p.wreduced), cc.ptr(p.bias if fused else None),
         cc.ptr(out), cc.i32(n), cc.i32(0 if fused else 1)),
        shared_mem=GEMM_SMEM, device=dev.index,
    )
    return out


def quantize_torch(x2: torch.Tensor, p: QuikPrepared) -> QuantizedActivations:
    """The unfused split + quantize (torch ops: gather, min/max, divide, round, pack): the bench's first rung."""
    from qtool.runtime.quik_linear import quantize_activations  # noqa: PLC0415

    xf = x2.to(torch.float32)
    m = x2.shape[0]
    half = 1 << (p.act_bits - 1)
    codes = torch.full((m, p.kp), half, dtype=torch.int64, device=x2.device)
    if p.kb:
        act = quantize_activations(xf[:, p.base_idx.long()], p.act_bits)
        codes[:, : p.kb] = act.codes + half
        scale, zero = act.scale, act.zero
    else:  # no base columns: what the kernel writes (an empty row's min/max and the unit scale)
        scale = torch.ones(m, dtype=torch.float32, device=x2.device)
        zero = torch.full((m,), float("inf"), dtype=torch.float32, device=x2.device)
    per = 32 // p.act_bits
    shifts = torch.arange(per, device=x2.device, dtype=torch.int64) * p.act_bits
    packed = (codes.view(m, -1, per) << shifts).sum(dim=2)  # disjoint bit fields: the sum is the word
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    xo = torch.zeros(m, p.kop, dtype=torch.float16, device=x2.device)
    xo[:, : p.ko] = x2[:, p.outlier_idx.long()].to(torch.float16)
    return QuantizedActivations(packed, xo, scale, zero)


def epilogue_torch(acc: torch.Tensor, a: QuantizedActivations, p: QuikPrepared) -> torch.Tensor:
    """Eq. 1 and the outlier product as separate torch ops on the raw int32 accumulators (unfused rungs)."""
    half = float(1 << (p.act_bits - 1))
    y = acc.to(torch.float32) * a.scale[:, None] * p.scales.to(torch.float32)[None, :]
    y += (a.zero + half * a.scale)[:, None] * p.wreduced[None, :]
    if p.ko:
        y += torch.matmul(a.outliers, p.wo.t()).to(torch.float32)
    if p.bias is not None:
        y += p.bias.to(torch.float32)
    return y.to(torch.float16)


def linear(x: torch.Tensor, p: QuikPrepared) -> torch.Tensor:
    x2 = x.reshape(-1, p.in_features)
    y = gemm(quantize(x2, p), p)
    return y.reshape(*x.shape[:-1], p.out_features)


def module_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """CUDA forward for a QuikLinear, or None when the caller should run the reference path.

    QTOOL_KERNELS=cuda turns every fallback into a one-line error instead."""
    if cc.kernel_mode() == "reference":
        return None
    reason = unsupported_reason(layer.bits, layer.act_bits, x.device)
    if reason is None and x.dtype != torch.float16:
        reason = f"activations {x.dtype} (the kernels read float16)"
    if not cc.use_kernels("quik", reason):
        return None
    p = getattr(layer, "_qtool_prepared", None)
    if p is None or p.source_ptr != layer.qweight.data_ptr() or p.wq.device != x.device:
        p = prepare(layer)
        layer._qtool_prepared = p
    return linear(x, p)
