"""CUDA execution of the `grouped_int` layout: load-time preparation, the kernels, and the dispatch rule.

Paths, chosen per call from the token count M, the activation dtype and the layer's parameters:

* ``gemv-fma``: a CUDA-core kernel for 1..FMA_MAX_M tokens (fp16 activations).
* ``gemv``: the tensor-core skinny kernel (weights streamed once, dequantized in registers), fp16 activations,
  M <= GEMV_MAX_M; a programmatic dependent launch where its grid is one wave of 16-warp blocks (gemv_dependent).
* ``mma``: the Hopper wgmma kernel (kernels/grouped_int/mma.cu): weight rows as wgmma's M dimension, dequantized
  in registers into its A fragments, tokens as its N dimension (8..256 per block), split-K across blocks when the
  tiles are too few to fill the GPU; from WS_SHORT_MIN_M tokens its warp-specialized form (bulk tensor copies
  into an mbarrier ring, a copy warpgroup), and once 256-token tiles fill the GPU the persistent one (one block
  per SM walking the tiles). fp16 activations, group sizes >= 32 or per-channel, MMA_MIN_M <= M <= MMA_MAX_M,
  M <= WS_MID_MAX_M on layers of at least WS_MID_MIN_N outputs, or M >= MMA_LONG_MIN_M where the tiles fill the
  GPU and rows hold at least MMA_LONG_MIN_K codes.
* ``dequant+cublas``: a CUDA kernel writes the dense fp16/bf16 weight, then cuBLAS multiplies. Used between
  MMA_MAX_M (WS_MID_MAX_M on wide layers) and MMA_LONG_MIN_M tokens, for long prefills of narrow or short-row
  layers, off Hopper, and for bf16 activations.
* ``reference``: the float32 torch reference (any bits/group size the kernels do not cover).

The checkpoint tensors are used in place when K is a multiple of 128; otherwise a zero-padded copy of `qweight`
(rows of Kp*bits/32 words) is made once and cached on the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch, split_k, tma

SOURCE = "grouped_int/gemv.cu"
MMA_SOURCE = "grouped_int/mma.cu"
KP_MULTIPLE = 128
# Dispatch thresholds, from `qtool bench kernels` on an H200 (kernels/NOTES.md):
# * the tensor-core skinny kernel beats dequantize+cuBLAS up to M = 32 and loses at M = 64;
# * the CUDA-core kernel beats it only for a single token with rows of at most 512 16-byte pieces
#   (K <= 16384 at 4 bits, K <= 8192 at 8 bits; at 256 before it became a dependent launch); at M = 2..4 the
#   tensor-core kernel is faster.
GEMV_MAX_M = min(64, cc.env_int("QTOOL_GEMV_MAX_M", 32))
FMA_MAX_TOKENS = 2  # the CUDA-core kernel's builds: 1 and 2 token slots
FMA_MAX_M = min(FMA_MAX_TOKENS, cc.env_int("QTOOL_FMA_MAX_M", 1))
FMA_MAX_PIECES = 512
# One-token 4-bit rows longer than 128 pieces (K > 4096) run in blocks of this many warps whose threads walk
# several pieces, instead of one thread per piece. On an H100 (kernels/NOTES.md), against one thread per piece with
# the register-capped entry that rows of 257-384 pieces took before: 10.2 vs 12.2 us at 11008x4096, 11.0 vs 12.5 at
# 12288x4096, 25.0 vs 27.9 at 11008x11008; 12.7 vs 15.5 at 14336x4096 and 7.9 vs 8.7 at 8192x4096 (both uncapped).
# Capping the registers (three blocks of 384 threads per SM) made 4-warp blocks 6-12% slower, so no entry caps them.
FMA_ONE_TOKEN_WARPS = 4
# The wgmma kernel runs M = MMA_MIN_M..MMA_MAX_M tokens on Hopper: the skinny kernels win below, dequantize +
# cuBLAS above (`qtool bench kernels` on an H100, kernels/NOTES.md).
MMA_MIN_M = cc.env_int("QTOOL_MMA_MIN_M", 17)
MMA_MAX_M = cc.env_int("QTOOL_MMA_MAX_M", 256)
# From MMA_LONG_MIN_M tokens on, the persistent warp-specialized form of the wgmma kernel: on an H100 it beat
# dequantize + cuBLAS at every Llama-2-7B shape at M = 1024 and 2048, 4 and 8 bits; at M = 512 it lost at two of
# the three. It takes only layers whose 256-token tiles cover WS_MIN_WAVE of the SMs and whose rows hold at least
# MMA_LONG_MIN_K codes: on narrower layers (GQA key/value projections, 4096x1024 at M = 2048: 44.9 vs 28.9 us) and
# short rows (576x1536 at M = 4096: 30.9 vs 16.2 us) dequantize + cuBLAS was faster, while rows of 3584 (Qwen2-7B)
# still won (3584x3584 at M = 1024: 42.2 vs 48.1 us); 3072 lies between the two (kernels/NOTES.md).
MMA_LONG_MIN_K = cc.env_int("QTOOL_MMA_LONG_MIN_K", 3072)
MMA_LONG_MIN_M = cc.env_int("QTOOL_MMA_LONG_MIN_M", 1024)
# From WS_SHORT_MIN_M tokens on, the wgmma kernel runs warp-specialized with split-K (``ws``) instead of
# block-synchronous (``sync``), and up to WS_MID_MAX_M tokens on layers of at least WS_MID_MIN_N outputs it also
# replaces dequantize + cuBLAS. On an H100 at Llama-2-7B shapes (kernels/NOTES.md): 128 tokens 19.0-19.8 / 36.9 /
# 34.7-35.6 us against sync's 20.8-21.6 / 51.3 / 37.1-37.6; 512 tokens 35.3-37.1 / 96.5-97.4 / 78 us against
# dequantize + cuBLAS's 40.1-40.5 / 106.4-107.0 / 105.2-105.4. At 64 tokens neither won everywhere, and on 1024
# outputs (GQA key/value projections) dequantize + cuBLAS won from 256 tokens.
WS_SHORT_MIN_M = cc.env_int("QTOOL_WS_SHORT_MIN_M", 65)
WS_MID_MAX_M = cc.env_int("QTOOL_WS_MID_MAX_M", 512)
WS_MID_MIN_N = 4096
# Layers of at least WS_WIDE_MIN_N outputs take ``ws`` from MMA_MIN_M tokens: on an H200 at 32 and 64 tokens it beat
# ``sync`` by 3-25% at 4096x11008, 4096x12288 (fused q/k/v) and 4096x22016 (fused gate/up), and lost by 1-20% on
# 4096 and 1024 outputs at 32 tokens (kernels/NOTES.md).
WS_WIDE_MIN_N = cc.env_int("QTOOL_WS_WIDE_MIN_N", 8192)
_SUPPORTED_BITS = (4, 8)


@dataclass
class Prepared:
    """Device-side view of one layer, ready for the kernels."""

    qweight: torch.Tensor  # int32 [N, Kp*bits/32]
    scales: torch.Tensor  # fp16 [N, G]
    zeros: torch.Tensor | None  # uint8 [N, G]
    meta: torch.Tensor  # int32 [N, G]: fp16 scale bits | zero point << 16 (what the gemv kernel reads)
    bits: int
    group_size: int  # columns per group (K for per-channel)
    in_features: int  # K
    out_features: int  # N
    kp: int
    num_groups: int
    source_ptr: int  # data_ptr of the checkpoint qweight this was built from

    @property
    def sym_zero(self) -> int:
        return 1 << (self.bits - 1)

    @property
    def group_shift(self) -> int:
        """log2(group size) for the gemv kernel; 31 (every k maps to group 0) for one group per row."""
        if self.num_groups == 1:
            return 31
        return self.group_size.bit_length() - 1


def unsupported_reason(bits: int, group_size: int | None, in_features: int) -> str | None:
    """Why the kernels cannot run this layer (None when they can)."""
    if bits not in _SUPPORTED_BITS:
        return f"bits={bits} (kernels cover {_SUPPORTED_BITS})"
    cpl = 128 // bits
    g = group_size or in_features
    if g < in_features and (g % cpl != 0 or g & (g - 1)):
        return f"group_size={g} (kernels need a power of two that is a multiple of {cpl} for {bits}-bit, or per-channel)"
    return None


def prepare(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    bits: int,
    group_size: int | None,
    in_features: int,
    out_features: int,
) -> Prepared:
    """Check the packed tensors and build the kernel view (pads `qweight` rows only when K % 128 != 0)."""
    k, n = in_features, out_features
    reason = unsupported_reason(bits, group_size, k)
    if reason is not None:
        raise cc.CudaUnavailableError(f"grouped_int layer: {reason}; use the reference path")
    g = group_size or k
    num_groups = (k + g - 1) // g
    words = (k * bits + 31) // 32
    if qweight.dtype != torch.int32 or tuple(qweight.shape) != (n, words):
        raise ValueError(
            f"qweight: found {qweight.dtype} {list(qweight.shape)}, expected torch.int32 {[n, words]}"
        )
    if scales.dtype != torch.float16 or tuple(scales.shape) != (n, num_groups):
        raise ValueError(
            f"scales: found {scales.dtype} {list(scales.shape)}, expected torch.float16 {[n, num_groups]}"
        )
    if zeros is not None and (zeros.dtype != torch.uint8 or tuple(zeros.shape) != (n, num_groups)):
        raise ValueError(
            f"zeros: found {zeros.dtype} {list(zeros.shape)}, expected torch.uint8 {[n, num_groups]}"
        )
    for name, t in (("qweight", qweight), ("scales", scales), ("zeros", zeros)):
        if t is not None and not t.is_cuda:
            raise ValueError(f"{name}: found device {t.device}, expected a CUDA tensor")
    kp = (k + KP_MULTIPLE - 1) // KP_MULTIPLE * KP_MULTIPLE
    wp = kp * bits // 32
    qw = qweight.contiguous()
    if wp != words or qw.data_ptr() % 16:
        padded = torch.zeros(n, wp, dtype=torch.int32, device=qweight.device)
        padded[:, :words] = qweight
        qw = padded
    # One 4-byte word per (row, group) so the kernel fetches scale and zero point with a single aligned
    # asynchronous copy (costs 4 bytes per group: ~6% of a 4-bit g128 weight).
    zero = (
        zeros.to(torch.int32)
        if zeros is not None
        else torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    )
    meta = ((scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF) | (zero << 16)).contiguous()
    return Prepared(
        qw,
        scales.contiguous(),
        None if zeros is None else zeros.contiguous(),
        meta,
        bits,
        g,
        k,
        n,
        kp,
        num_groups,
        qweight.data_ptr(),
    )


def _pad_activations(x2: torch.Tensor, kp: int) -> torch.Tensor:
    x2 = x2.contiguous()
    if x2.shape[1] != kp or x2.data_ptr() % 16:
        x2 = F.pad(x2, (0, kp - x2.shape[1]))
    return x2


def _n_tiles(m: int) -> int:
    for nt in (1, 2, 4, 8):
        if m <= 8 * nt:
            return nt
    raise ValueError(f"gemv: found M={m} tokens, expected at most 64")


# Tuning overrides for the bench; unset in normal use.
_WARPS_OVERRIDE = cc.env_int("QTOOL_GEMV_WARPS", 0)  # 0: the tuned choice


def gemv_warps(n: int, nt: int, kp: int, bits: int, sms: int) -> int:
    """Warps per block (they split K): about 16 warps per SM when the blocks are few, at most 16 per block,
    a reduction buffer within 48 KB of shared memory, no more than there are K-spans."""
    blocks = (n + 15) // 16
    want = -(-16 * sms // blocks)
    warps = 4
    while warps < want and warps < 16:
        warps *= 2
    if _WARPS_OVERRIDE:
        warps = _WARPS_OVERRIDE
    spans = kp // (4 * (128 // bits))
    return max(1, min(warps, 16, 96 // nt, spans))


def _gemv_args(
    x: torch.Tensor, p: Prepared, bias: torch.Tensor | None, out: torch.Tensor | None, max_m: int
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Checked (padded activations, output, M, device) for the skinny kernels."""
    if x.dtype != torch.float16:
        raise ValueError(f"x: found {x.dtype}, expected torch.float16 for the gemv kernels")
    if x.shape[-1] != p.in_features:
        raise ValueError(f"x: found last dim {x.shape[-1]}, expected in_features={p.in_features}")
    x2 = x.reshape(-1, p.in_features)
    m = x2.shape[0]
    if not 1 <= m <= max_m:
        raise ValueError(f"x: found M={m} tokens, expected 1..{max_m} for this kernel")
    x2 = _pad_activations(x2, p.kp)
    if bias is not None and (bias.dtype != torch.float16 or bias.numel() != p.out_features):
        raise ValueError(
            f"bias: found {bias.dtype} {list(bias.shape)}, expected torch.float16 [{p.out_features}]"
        )
    out = cc.f16_out(out, (m, p.out_features), x.device)
    dev = cc.device_index(x.device)
    return x2, out, m, dev


# The tensor-core kernel's dependent-launch entry (`_dep`) is built for up to this many 8-token tiles.
GEMV_DEP_MAX_TILES = 2


def gemv_dependent(nt: int, warps: int, blocks: int, sms: int) -> bool:
    """Whether the tensor-core kernel runs as a programmatic dependent launch: where its grid is one wave of
    16-warp blocks (two per SM), each block then loads its first weights during the tail of the kernel ahead.
    Measured on an H100 at M = 8 and 16: 3-7% faster at N = 4096. With 4 or 8 warps per block (at N = 11008 the
    tuned count is 4) it lost 15-58%, most likely because the next kernel's early blocks then find room beside
    the running ones and hold it while they wait (kernels/NOTES.md)."""
    return dependent_launch.ENABLED and nt <= GEMV_DEP_MAX_TILES and warps == 16 and blocks <= 2 * sms


def gemv(
    x: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    warps: int | None = None,
    dependent: bool | None = None,
) -> torch.Tensor:
    """y = x . W^T (+ bias) with the tensor-core skinny kernel; x fp16 [..., K] with at most 64 rows.
    `dependent` picks the dependent-launch entry (by default gemv_dependent's choice; at most 16 rows)."""
    lead = x.shape[:-1]
    x2, out, m, dev = _gemv_args(x, p, bias, out, 64)
    mod = cc.load_module(SOURCE, device=dev)
    nt = _n_tiles(m)
    sms = cc.sm_count(dev)
    if warps is None:
        warps = gemv_warps(p.out_features, nt, p.kp, p.bits, sms)
    elif not 1 <= warps <= 16 or warps * nt * 512 > 48 * 1024:
        raise ValueError(f"warps: found {warps}, expected 1..16 with warps * token tiles <= 96")
    blocks = (p.out_features + 15) // 16
    if dependent is None:
        dependent = gemv_dependent(nt, warps, blocks, sms)
    elif dependent and nt > GEMV_DEP_MAX_TILES:
        raise ValueError(
            f"dependent: found {m} rows, expected at most {8 * GEMV_DEP_MAX_TILES} for the "
            "dependent-launch entry"
        )
    name = f"grouped_int_gemv_b{p.bits}_nt{nt}_" + ("dep" if dependent else "v1")
    args = (
        cc.ptr(p.qweight),
        cc.ptr(p.scales),
        cc.ptr(p.zeros),
        cc.ptr(x2),
        cc.ptr(bias),
        cc.ptr(out),
        cc.i32(m),
        cc.i32(p.out_features),
        cc.i32(p.kp),
        cc.i32(p.num_groups),
        cc.i32(p.group_size),
        cc.i32(p.sym_zero),
    )
    # the dependent entry as a dependent launch wherever those are enabled; the ordinary entry never
    dependent_launch.launch(
        mod.fn(name),
        (blocks,),
        (32 * warps,),
        args,
        shared_mem=warps * nt * 4 * 32 * 4,
        device=dev,
        dependent=None if dependent else False,
    )
    return out.reshape(*lead, p.out_features)


FMA_ROWS = 4  # must match FMA_ROWS in kernels/grouped_int/gemv.cu


def gemv_fma(
    x: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    warps: int | None = None,
) -> torch.Tensor:
    """y = x . W^T (+ bias) with the CUDA-core kernel for 1..FMA_MAX_TOKENS tokens (contiguous 512-byte row
    reads)."""
    lead = x.shape[:-1]
    x2, out, m, dev = _gemv_args(x, p, bias, out, FMA_MAX_TOKENS)
    pieces = p.kp // (128 // p.bits)
    # Measured on an H200 at one token: 4-bit is issue-bound and wants occupancy (one row group per block, fewer
    # registers, and its weights loaded before the dependency wait); 8-bit wants the persistent grid that prefetches
    # the next row group while it computes the current one (kernels/grouped_int/NOTES.md).
    pipe = p.bits == 8
    if warps is None:
        warps = fma_warps(p.bits, m, pipe, pieces)
    elif not 1 <= warps <= 16:
        raise ValueError(
            f"warps: found {warps}, expected 1..16 (the kernel is built for at most 512 threads)"
        )
    mod = cc.load_module(SOURCE, device=dev)
    fn = mod.fn(f"grouped_int_gemv_fma_b{p.bits}_m{m}_p{int(pipe)}_s1")
    threads = 32 * warps
    groups = (p.out_features + FMA_ROWS - 1) // FMA_ROWS
    grid = groups
    if pipe:
        # Persistent grid: as many blocks as fit on the GPU at once, each taking the same number of row groups.
        max_blocks = cc.sm_count(dev) * cc.resident_blocks(fn, threads, 0, dev, cap=32)
        rounds = -(-groups // max_blocks)
        grid = -(-groups // rounds)
    dependent_launch.launch(
        fn,
        (grid,),
        (threads,),
        (
            cc.ptr(p.qweight),
            cc.ptr(p.meta),
            cc.ptr(x2),
            cc.ptr(bias),
            cc.ptr(out),
            cc.i32(m),
            cc.i32(p.out_features),
            cc.i32(p.kp),
            cc.i32(p.num_groups),
            cc.i32(p.group_shift),
        ),
        device=dev,
    )
    return out.reshape(*lead, p.out_features)


def fma_warps(bits: int, token_slots: int, pipe: bool, pieces: int) -> int:
    """Default warps per block of `gemv_fma`: one thread per 16-byte piece of the row (at most 16 warps), except
    one-token 4-bit rows on the one-row-group grid, which take at most FMA_ONE_TOKEN_WARPS."""
    warps = max(1, min(16, -(-pieces // 32)))
    if bits == 4 and token_slots == 1 and not pipe:
        warps = min(warps, FMA_ONE_TOKEN_WARPS)
    return warps


def dequantize(
    p: Prepared, dtype: torch.dtype = torch.float16, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The dense weight as [N, Kp] fp16 or bf16 (columns K..Kp-1 are padding), bit-identical to the reference's
    float32 dequantization cast to `dtype`."""
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"dtype: found {dtype}, expected torch.float16 or torch.bfloat16")
    n = p.out_features
    if out is None:
        out = torch.empty(n, p.kp, dtype=dtype, device=p.qweight.device)
    elif out.dtype != dtype or tuple(out.shape) != (n, p.kp) or not out.is_contiguous():
        raise ValueError(f"out: found {out.dtype} {list(out.shape)}, expected contiguous {dtype} {[n, p.kp]}")
    dev = cc.device_index(p.qweight.device)
    mod = cc.load_module(SOURCE, device=dev)
    octs = n * (p.kp // 8)  # one thread per 8 codes
    name = f"grouped_int_dequant_b{p.bits}_{'bf16' if dtype == torch.bfloat16 else 'f16'}"
    cc.launch(
        mod.fn(name),
        ((octs + 255) // 256,),
        (256,),
        (
            cc.ptr(p.qweight),
            cc.ptr(p.scales),
            cc.ptr(p.zeros),
            cc.ptr(out),
            cc.i32(n),
            cc.i32(p.kp),
            cc.i32(p.num_groups),
            cc.i32(p.group_size),
            cc.i32(p.sym_zero),
        ),
        device=dev,
    )
    return out


# ---- the wgmma kernel ----------------------------------------------------------------------------------------
MMA_TOKENS = (8, 16, 32, 64, 128, 256)  # token tile sizes the source instantiates
# (token tile, weight rows per block) -> the shared-memory stage counts the source instantiates, the default first.
# More stages keep more bytes in flight for small tiles; fewer fit the large ones.
MMA_KERNELS = {
    (8, 128): (8,),
    (16, 128): (8,),
    (32, 128): (8,),
    (64, 128): (6, 8),
    (128, 128): (6, 4),
    (256, 128): (5, 4),
    (64, 256): (6,),
    (128, 256): (5, 4),
}
_MMA_SPLIT_OVERRIDE = cc.env_int("QTOOL_MMA_SPLIT", 0)  # 0: the tuned choice


def mma_unsupported_reason(p: Prepared, device: int | None = None) -> str | None:
    """Why the wgmma kernel cannot run this layer on this device (None when it can)."""
    arch = cc.target_arch(device)
    if arch != "sm_90a":
        return f"the wgmma kernel needs a Hopper GPU (found {arch})"
    if p.num_groups > 1 and p.group_size < 32:
        return f"group_size={p.group_size} (the wgmma kernel needs >= 32 or per-channel)"
    return None


def mma_tokens(m: int) -> int:
    """Token tile for M tokens: the smallest instantiated tile holding them all, at most 256."""
    for tn in MMA_TOKENS:
        if m <= tn:
            return tn
    return MMA_TOKENS[-1]


def _mma_smem(bits: int, tn: int, rows: int, stages: int) -> int:
    # activations, codes, scale/zero words per stage; + alignment of the 1024-byte swizzle atoms
    return stages * (tn * 128 + rows * 64 * bits // 8 + 2 * rows * 4) + 1024


def mma_split(p: Prepared, m: int, tn: int, rows: int, blocks_per_sm: int, sms: int) -> int:
    """Blocks splitting K per output tile: as many as keep all blocks within one wave (a second, partial wave
    cost more than the split saved, measured on an H100), at most 16, at least 4 stages of 64 codes each."""
    tiles = -(-p.out_features // rows) * -(-m // tn)
    return max(1, min(blocks_per_sm * sms // tiles, p.kp // 64 // 4, 16))


# The warp-specialized form (bulk tensor copies into an mbarrier ring, a copy warpgroup and two math warpgroups),
# stages of 64 codes in its ring. ``ws`` runs one tile of 128 rows x 64, 128 or 256 tokens per block, with split-K
# across blocks where the tiles are few; ``wsp`` is persistent (256-token tiles without split-K: one block per
# multiprocessor walks the tiles, the next tile's copies overlap the current tile's epilogue, which leaves through
# the copy engine) and needs a 16-byte-aligned output row.
WS_STAGES = {"ws": 5, "wsp": 4}  # ring depth by default at 256 tokens; 4 and 5 are built for both
WS_KERNELS = ("ws", "wsp")
# ``ws`` token tiles -> the ring depths the source instantiates, the default first (smaller tiles, deeper rings);
# 64-token tiles two blocks per SM have rings of WS_X2_STAGES
WS_TILE_STAGES = {64: (8,), 128: (6,), 256: (5, 4)}
WS_X2_STAGES = (6,)
# The warp-specialized kernels (no split-K) run by default once the 256-token tiles fill this share of the
# multiprocessors: 128 tiles on 132 (M = 1024, N = 4096) ran 0.92-0.98x cuBLAS FP16 persistent on an H100.
WS_MIN_WAVE = 0.75
WSP_EPILOGUE_BUFFERS = 3  # 8 KB each, beside the ring (kernels/grouped_int/mma.cu GI_WSP_EB)
_WS_MAPS = tma.MapCache(limit=64)


def ws_smem(kernel: str, bits: int, stages: int, tokens: int = 256) -> int:
    """Dynamic shared memory of a warp-specialized kernel: the ring (the persistent form's slots hold the code
    tile's own size, the other's the 8-bit size), its epilogue buffers, and slack to align the 1024-byte swizzle
    atoms."""
    if kernel == "wsp":
        return stages * (256 * 128 + 128 * 8 * bits) + WSP_EPILOGUE_BUFFERS * 8192 + 1024
    return stages * (tokens * 128 + 128 * 64) + 1024


def ws_tokens(m: int) -> int:
    """``ws`` token tile for M tokens: the smallest built tile holding them all, at most 256."""
    return next((tn for tn in WS_TILE_STAGES if m <= tn), 256)


# A cost model for picking the ``ws`` token tile, fitted to H100 timings at 128-768 tokens on Llama-2-7B and GQA
# shapes (kernels/NOTES.md): the time of one 64-code stage by token tile, one block per SM, and the cost of each
# share of a split tile per 256 tokens (its float32 partial written, and read back by the tile's last block).
# 64-token tiles also run two blocks per SM (`_x2` entries): each block's stage then took 0.79 us (H200, 172 blocks
# of 64 stages at 4096x22016 and 4096x11008), more stages per SM and us than one block alone.
WS_STAGE_US = {64: 0.46, 128: 0.53, 256: 0.70}
WS_STAGE_US_X2 = 0.79
WS_SHARE_US = 3.0


def ws_plan(n: int, m: int, kp: int, sms: int) -> tuple[int, int, int]:
    """(token tile, split, blocks per SM) for a ``ws`` launch: the smallest tile holding all M tokens or half of
    it (64-token tiles one or two blocks per SM), each split as mma_split splits, whichever WS_STAGE_US and
    WS_SHARE_US rate faster (small tiles win where a large one would be split many ways: its partials cost more
    than its stages save)."""
    nst = kp // 64
    full = ws_tokens(m)
    best: tuple[float, int, int, int] | None = None
    for tn in (full, full // 2) if full > 64 else (full,):
        for per_sm in (1, 2) if tn == 64 else (1,):
            tiles = -(-n // 128) * -(-m // tn)
            split = max(1, min(per_sm * sms // tiles, nst // 4, 16))
            waves = -(-tiles * split // (per_sm * sms))
            stage = WS_STAGE_US_X2 if per_sm == 2 else WS_STAGE_US[tn]
            cost = waves * -(-nst // split) * stage + (WS_SHARE_US * split * tn / 256 if split > 1 else 0.0)
            if best is None or cost < best[0]:
                best = (cost, tn, split, per_sm)
    assert best is not None
    return best[1], best[2], best[3]


def wsp_full_tiles(tiles: int, grid: int) -> int:
    """How many 256-token tiles the persistent kernel runs whole: all of them, or, where the tiles leave a last
    partial round of the grid whose 64-token quarters fit in one round, the whole rounds before it (the rest run
    as quarters, so that round takes about a quarter of a tile's time instead of a whole one)."""
    rest = tiles % grid
    if tiles > grid and 0 < 4 * rest <= grid:
        return tiles - rest
    return tiles


def _mma_ws(
    x2: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    m: int,
    dev: int,
    stages: int,
    kernel: str,
    blocks: int | None,
    tn: int = 256,
    split: int = 1,
    per_sm: int = 1,
) -> None:
    fn = cc.load_module(MMA_SOURCE, device=dev).fn(
        f"grouped_int_{kernel}_b{p.bits}_n{tn}_s{stages}" + ("_x2" if per_sm == 2 else "")
    )
    smem = ws_smem(kernel, p.bits, stages, tn)
    cc.allow_shared_memory(fn, smem)
    mx = _WS_MAPS.get(x2, 128, tn, 128)
    mq = _WS_MAPS.get(p.qweight, 8 * p.bits, 128, 8 * p.bits)
    n = p.out_features
    tiles = -(-n // 128) * -(-m // tn)
    if kernel == "wsp":
        grid = min(tiles, blocks or cc.sm_count(dev))
        full = wsp_full_tiles(tiles, grid)
        mx64 = _WS_MAPS.get(x2, 128, 64, 128) if full < tiles else mx
        mo = _WS_MAPS.get(out, 128, 32, 128)
        cc.launch(
            fn,
            (grid,),
            (384,),
            (
                mx.arg,
                mx64.arg,
                mq.arg,
                mo.arg,
                cc.ptr(p.meta),
                cc.i32(p.num_groups),
                cc.i32(p.group_shift),
                cc.ptr(bias),
                cc.i32(m),
                cc.i32(n),
                cc.i32(p.kp // 64),
                cc.i32(full),
            ),
            shared_mem=smem,
            device=dev,
        )
        return
    split, ws, cnt = split_k.split_buffers(dev, split, tiles, 128, tn)
    cc.launch(
        fn,
        (-(-n // 128), -(-m // tn), split),
        (384,),
        (
            mx.arg,
            mq.arg,
            cc.ptr(p.meta),
            cc.i32(p.num_groups),
            cc.i32(p.group_shift),
            cc.ptr(bias),
            cc.ptr(out),
            cc.i32(n),
            cc.ptr(ws),
            cc.ptr(cnt),
            cc.i32(m),
            cc.i32(n),
            cc.i32(p.kp // 64),
        ),
        shared_mem=smem,
        device=dev,
    )


def mma(
    x: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tokens: int | None = None,
    rows: int | None = None,
    split: int | None = None,
    stages: int | None = None,
    kernel: str | None = None,
    blocks: int | None = None,
    per_sm: int | None = None,
) -> torch.Tensor:
    """y = x . W^T (+ bias) with the Hopper wgmma kernel; x fp16 [..., K], any number of rows.

    `tokens` (token tile), `rows` (weight rows per block), `split` (blocks per tile along K) and `stages` override
    the tuned choices (MMA_KERNELS and WS_TILE_STAGES list the combinations). `kernel` picks ``sync`` (cp.async, a
    block barrier per stage), ``ws`` (warp-specialized, one tile of 64-256 tokens per block, split-K) or ``wsp``
    (persistent, 256-token tiles without split-K); by default ``wsp`` wherever the 256-token tiles cover
    WS_MIN_WAVE of the SMs and the output rows allow it (else ``ws`` there), ``ws`` from WS_SHORT_MIN_M tokens up
    to WS_MID_MAX_M, and from MMA_MIN_M on layers of at least WS_WIDE_MIN_N outputs (token tile, split and blocks
    per SM by ws_plan), ``sync`` otherwise. `blocks` caps the persistent grid (tests: several tiles per block on
    small problems); `per_sm` 2 runs ``ws`` 64-token tiles two blocks per SM (by default ws_plan's choice where it
    picks the tile and split, else 1)."""
    lead = x.shape[:-1]
    x2, out, m, dev = _gemv_args(x, p, bias, out, 1 << 31)
    reason = mma_unsupported_reason(p, dev)
    if reason is not None:
        raise cc.CudaUnavailableError(f"grouped_int mma: {reason}; use another path")
    if kernel not in (None, "sync", *WS_KERNELS):
        raise ValueError(f"kernel: found {kernel!r}, expected sync, ws or wsp")
    tma_ok = rows in (None, 128) and tma.usable(x2) and tma.usable(p.qweight)
    long_ok = tma_ok and tokens in (None, 256) and split in (None, 1) and m > 128
    if kernel == "wsp" and not long_ok:
        raise ValueError(
            "kernel wsp: needs 256-token tiles of 128 rows without split-K, more than 128 tokens and "
            "16-byte aligned rows"
        )
    if kernel == "ws" and not tma_ok:
        raise ValueError("kernel ws: needs tiles of 128 rows and 16-byte aligned rows")
    if kernel == "wsp" and not tma.usable(out):
        raise ValueError(
            f"kernel wsp: found output rows of {out.stride(0)} halves at {out.data_ptr():#x}, expected "
            "16-byte aligned rows (out_features a multiple of 8)"
        )
    if kernel is None:
        if long_ok and long_tiles_fill(m, p.out_features, cc.sm_count(dev)):
            kernel = "wsp" if tma.usable(out) else "ws"
        elif (
            tma_ok
            and (WS_SHORT_MIN_M <= m or p.out_features >= WS_WIDE_MIN_N)
            and m <= WS_MID_MAX_M
            and tokens in (None, *WS_TILE_STAGES)
        ):
            kernel = "ws"
        else:
            kernel = "sync"
    if per_sm not in (None, 1) and kernel != "ws":
        raise ValueError(
            f"per_sm: found {per_sm} for kernel {kernel}, expected 1 (only ws runs two blocks per SM)"
        )
    if blocks is not None and (kernel != "wsp" or blocks < 1):
        raise ValueError(f"blocks: found {blocks} for kernel {kernel}; only wsp takes a grid cap (>= 1)")
    nst = p.kp // 64
    if kernel in WS_KERNELS:
        tn = 256 if kernel == "wsp" else (ws_tokens(m) if tokens is None else tokens)
        if kernel == "ws" and tokens is None and split is None:
            tn, split, planned = ws_plan(p.out_features, m, p.kp, cc.sm_count(dev))
            per_sm = planned if per_sm is None else per_sm
        per_sm = 1 if per_sm is None else per_sm
        if tn not in WS_TILE_STAGES:
            raise ValueError(f"tokens: found {tn} for kernel ws, expected one of {tuple(WS_TILE_STAGES)}")
        if per_sm not in (1, 2) or (per_sm == 2 and (kernel != "ws" or tn != 64)):
            raise ValueError(
                f"per_sm: found {per_sm} for kernel {kernel} with tokens={tn}, expected 1, or 2 for "
                "kernel ws with tokens=64"
            )
        built = (4, 5) if kernel == "wsp" else WS_X2_STAGES if per_sm == 2 else WS_TILE_STAGES[tn]
        st = (WS_STAGES[kernel] if tn == 256 else built[0]) if stages is None else stages
        if st not in built:
            raise ValueError(
                f"stages: found {st} for kernel {kernel} with tokens={tn}, expected one of {built}"
            )
        if split is None:
            split = 1 if kernel == "wsp" else mma_split(p, m, tn, 128, per_sm, cc.sm_count(dev))
        if not 1 <= split <= nst:
            raise ValueError(f"split: found {split}, expected 1..{nst} (stages of 64 codes)")
        _mma_ws(x2, p, bias, out, m, dev, st, kernel, blocks, tn, split, per_sm)
        return out.reshape(*lead, p.out_features)
    tn = mma_tokens(m) if tokens is None else tokens
    if tn not in MMA_TOKENS:
        raise ValueError(f"tokens: found {tn}, expected one of {MMA_TOKENS}")
    rows = 128 if rows is None else rows  # 256-row blocks measured slower on an H100 (kernels/NOTES.md)
    if (tn, rows) not in MMA_KERNELS:
        raise ValueError(
            f"rows: found {rows} with tokens={tn}, expected one of "
            f"{sorted(r for t, r in MMA_KERNELS if t == tn)}"
        )
    st = MMA_KERNELS[(tn, rows)][0] if stages is None else stages
    if st not in MMA_KERNELS[(tn, rows)]:
        raise ValueError(f"stages: found {st}, expected one of {MMA_KERNELS[(tn, rows)]}")
    mod = cc.load_module(MMA_SOURCE, device=dev)
    fn = mod.fn(f"grouped_int_mma_b{p.bits}_n{tn}_s{st}_r{rows // 128}")
    smem = _mma_smem(p.bits, tn, rows, st)
    cc.allow_shared_memory(fn, smem)
    n = p.out_features
    if split is None and _MMA_SPLIT_OVERRIDE:
        split = _MMA_SPLIT_OVERRIDE
    if split is None:
        split = mma_split(p, m, tn, rows, cc.resident_blocks(fn, 256, smem, dev), cc.sm_count(dev))
    if not 1 <= split <= nst:
        raise ValueError(f"split: found {split}, expected 1..{nst} (stages of 64 codes)")
    tiles = -(-n // rows) * -(-m // tn)
    split, ws, cnt = split_k.split_buffers(dev, split, tiles, rows, tn)
    grid = (-(-n // rows), -(-m // tn), split)
    cc.launch(
        fn,
        grid,
        (256,),
        (
            cc.ptr(x2),
            cc.i32(x2.stride(0)),
            cc.ptr(p.qweight),
            cc.i32(p.qweight.stride(0)),
            cc.ptr(p.meta),
            cc.i32(p.num_groups),
            cc.i32(p.group_shift),
            cc.ptr(bias),
            cc.ptr(out),
            cc.i32(n),
            cc.ptr(ws),
            cc.ptr(cnt),
            cc.i32(m),
            cc.i32(n),
            cc.i32(nst),
        ),
        shared_mem=smem,
        device=dev,
    )
    return out.reshape(*lead, n)


def dequant_matmul(x: torch.Tensor, p: Prepared, bias: torch.Tensor | None = None) -> torch.Tensor:
    bias = None if bias is None else bias.to(x.dtype)
    return F.linear(x, dequantize(p, x.dtype)[:, : p.in_features], bias)


def mma_eligible(
    dtype: torch.dtype, group_size: int | None, in_features: int, hopper: bool | None = None
) -> bool:
    """Whether the wgmma kernel can run a kernel-supported layer: fp16, groups of >= 32 (or one per row), and a
    Hopper GPU (`hopper`; default: the current CUDA device builds for sm_90a)."""
    if hopper is None:
        hopper = torch.cuda.is_available() and cc.target_arch() == "sm_90a"
    return (
        bool(hopper) and dtype == torch.float16 and (group_size is None or group_size >= min(32, in_features))
    )


def long_tiles_fill(m: int, out_features: int, sms: int) -> bool:
    """Whether the 256-token x 128-row tiles of an M-token layer cover WS_MIN_WAVE of `sms` multiprocessors (the
    condition for the warp-specialized wgmma kernels)."""
    return -(-out_features // 128) * -(-m // 256) >= WS_MIN_WAVE * sms


PATHS = ("gemv-fma", "gemv", "mma", "dequant+cublas", "reference")


def choose_path(
    m: int,
    dtype: torch.dtype,
    bits: int,
    group_size: int | None,
    in_features: int,
    out_features: int,
    hopper: bool | None = None,
    sms: int | None = None,
) -> str:
    """The path `linear` takes for M tokens: gemv-fma, gemv, mma, dequant+cublas or reference.

    `hopper` (default: whether the current CUDA device builds for sm_90a) enables the wgmma kernel; `sms` (default:
    the current CUDA device's, else an H100's 132) decides whether a long prefill's tiles fill the GPU."""
    if unsupported_reason(bits, group_size, in_features) is not None:
        return "reference"
    if (
        MMA_MIN_M <= m
        and (m <= MMA_MAX_M or (m <= WS_MID_MAX_M and out_features >= WS_MID_MIN_N))
        and mma_eligible(dtype, group_size, in_features, hopper)
    ):
        return "mma"
    if (
        m >= MMA_LONG_MIN_M
        and in_features >= MMA_LONG_MIN_K
        and mma_eligible(dtype, group_size, in_features, hopper)
    ):
        if sms is None:
            sms = cc.sm_count(torch.cuda.current_device()) if torch.cuda.is_available() else 132
        if long_tiles_fill(m, out_features, sms):
            return "mma"
    if dtype == torch.float16 and 1 <= m <= FMA_MAX_M:
        kp = (in_features + KP_MULTIPLE - 1) // KP_MULTIPLE * KP_MULTIPLE
        if kp // (128 // bits) <= FMA_MAX_PIECES:
            return "gemv-fma"
    if dtype == torch.float16 and 1 <= m <= GEMV_MAX_M:
        return "gemv"
    if dtype in (torch.float16, torch.bfloat16):
        return "dequant+cublas"
    return "reference"


def linear(
    x: torch.Tensor, p: Prepared, bias: torch.Tensor | None = None, path: str | None = None
) -> torch.Tensor:
    """y = x . W^T + bias on the fastest available path for this shape (`path`: what `choose_path` gave for it,
    when the caller has it already)."""
    m = x.numel() // max(1, x.shape[-1])
    if path is None:
        path = choose_path(
            m,
            x.dtype,
            p.bits,
            p.group_size if p.group_size < p.in_features else None,
            p.in_features,
            p.out_features,
        )
    elif path not in PATHS:
        raise ValueError(f"path: found {path!r}, expected one of {', '.join(PATHS)}")
    if path == "gemv-fma":
        return gemv_fma(x, p, None if bias is None else bias.to(torch.float16))
    if path == "gemv":
        return gemv(x, p, None if bias is None else bias.to(torch.float16))
    if path == "mma":
        return mma(x, p, None if bias is None else bias.to(torch.float16))
    if path == "dequant+cublas":
        return dequant_matmul(x, p, bias)
    raise cc.CudaUnavailableError(
        f"grouped_int: no CUDA path for M={m}, dtype={x.dtype}; use the reference path"
    )


def module_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """CUDA forward for a GroupedIntLinear, or None when the caller should run the reference path.

    QTOOL_KERNELS=cuda turns every fallback into a one-line error instead.
    """
    if cc.kernel_mode() == "reference":
        return None
    spec = layer.spec
    m = x.numel() // max(1, x.shape[-1])
    reason = None
    path = choose_path(m, x.dtype, spec.bits, spec.group_size, layer.in_features, layer.out_features)
    if path == "reference":
        reason = unsupported_reason(spec.bits, spec.group_size, layer.in_features) or f"dtype {x.dtype}"
    if not cc.use_kernels("grouped_int", reason):
        return None
    p = layer.derived(
        "cuda",
        lambda: prepare(
            layer.qweight,
            layer.scales,
            layer.zeros,
            spec.bits,
            spec.group_size,
            layer.in_features,
            layer.out_features,
        ),
        valid=lambda p: p.source_ptr == layer.qweight.data_ptr() and p.qweight.device == x.device,
    )
    return linear(x, p, layer.bias, path)
