"""CUDA execution of the `quik` layout (kernels/quik/gemm.cu, on kernels/common/int8_wgmma.cuh): a fused split +
quantize kernel, then an INT8 tensor-core GEMM (wgmma, Hopper) with the Eq. 1 dequantization and the float16
outlier product in its epilogue.

Paths (`linear`, `module_forward`): ``fused`` (the two kernels, or for W4A4 prefills one kernel that quantizes
its own rows under the GEMM: `quantize_gemm`; float16 activations, W4A4 or W8A8, Hopper) or ``reference``
(the torch path of qtool/layouts/quik/module.py: other GPUs, bf16/float32 activations, mixed weight/activation
widths). The unfused pieces (`quantize_torch`, raw int32 `gemm`, `epilogue_torch`) exist for the bench ladder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch, split_k, tma

SOURCE = "quik/gemm.cu"
KP_MULTIPLE = 128  # base columns padded to whole stages (128 codes)
KO_MULTIPLE = 64  # outlier columns per float16 stage (128 bytes per row)
ROWS = 128  # weight rows (output features) per GEMM block
# Tokens per GEMM block -> pipeline stages. Weight rows are wgmma's M and tokens its N, so the weight codes are
# dequantized straight into register fragments and only the activation tile passes through shared memory.
GEMM_TILES = {64: 4, 128: 4, 256: 3}
# The warp-specialized GEMM (bulk tensor copies into an mbarrier ring, a copy warpgroup and two math warpgroups):
# tokens per block -> ring stages (~192 KB of shared memory each).
WS_TILES = {64: 8, 128: 6, 256: 4}
# Its persistent form: one block per multiprocessor walks the tiles, so the next tile's copies and the sx/zx
# loads overlap the epilogue, which transposes 32 tokens at a time into the 8 KB buffers beside the ring (as many as
# fit: wsp_epilogue_bytes) and stores them through the copy engine without waiting (or, where the output allows no
# tensor map, with 16-byte stores from the threads).
WSP_TILES = {128: 6, 256: 4}
# 4-bit stages are smaller (WS_OUTLIER_COLUMNS), so a fifth fits at 256 tokens, leaving two epilogue buffers
# instead of seven: it pays for layers whose tiles have at least WSP_DEEP_RING_STEPS stages (11008 x 4096: 107)
# and cost at 4096 x 4096 (38; kernels/NOTES.md)
WSP_RINGS_W4 = {128: (6,), 256: (4, 5)}
WSP_DEEP_RING_STEPS = 64
# float16 outlier columns per stage of the warp-specialized kernels: 4-bit stages hold the weight tile of an
# integer stage (8 KB), so their outlier stages take 32 columns; 8-bit stages 64, as the block-synchronous kernel
WS_OUTLIER_COLUMNS = {4: 32, 8: 64}
SMEM_BLOCK_MAX = 232448  # bytes of shared memory a block may have on Hopper (227 KB)
# False: the persistent kernel's epilogue stores from the threads even where the output allows a tensor map (A/B)
TMA_STORE = True
# sync: all 256 threads copy (cp.async) and meet at a barrier every stage; ws / wsp: warp-specialized; gemv: a
# warp per weight row on the CUDA cores (dp4a), for up to GEMV_MAX_TOKENS tokens
GEMM_KERNELS = ("sync", "ws", "wsp", "gemv")
GEMV_MAX_TOKENS = 2
GEMV_WARPS = 8  # weight rows per block (kernels/quik/gemm.cu)
WS_MIN_TOKENS = 256  # the warp-specialized kernel is the default from this tile size on (kernels/NOTES.md)
# Split-K for the block-synchronous kernel's decode tiles (kernels/common/int8_wgmma.cuh SPLIT_MAX_TOKENS): at
# M <= 128 a layer has one tile per 128 output rows (32 at N = 4096), too few blocks to stream the weights
SPLIT_MAX_TOKENS = 128
SPLIT_MIN_STAGES = 4  # stages (128 codes or 64 outlier columns) per split block, at least
SPLIT_MAX = 16
QUANT_MAX_K = (
    32768  # the block-per-row quantize kernel holds a row in registers: 512 threads x 8 pieces of 8 columns
)
# (threads, 16-byte pieces per thread) of the quantize kernels, smallest first (kernels/quik/gemm.cu)
QUANT_SHAPES = ((128, 1), (128, 2), (256, 2), (512, 4), (512, 8))
# block: a block per row, row in registers; warp: a warp per row, rows staged in shared memory by bulk copies
QUANT_KERNELS = ("block", "warp")
# row buffers per team and warps per team (a team quantizes a row): the defaults from the sweep in kernels/NOTES.md;
# the team size is planned per call (warp_plan) from the sizes in QUANT_WARP_PLAN_TEAMS
QUANT_WARP_STAGES = 1
QUANT_WARP_STAGE_CHOICES = (1, 2, 3)
QUANT_WARP_TEAM = 4
QUANT_WARP_TEAM_CHOICES = (1, 2, 4)
QUANT_WARP_PLAN_TEAMS = (2, 4)
# The fused form (quik_gemm_wsq_*, `quantize_gemm`): the persistent 256-token GEMM quantizes its own rows, the first
# ones before its first tiles, the rest by the copy warpgroup's idle warps under them. Built for W4A4 with a 4-stage
# ring and two epilogue buffers; the column maps and up to WSQ_COPY_WARPS row buffers take the rest of the shared
# memory. Its first tiles wait for their rows from every block and for the counts that publish them: on the H100 it
# was not faster than the two kernels at their best (M = 2048, 256 outliers: 4096 x 4096 66-67 us against 63-66;
# 4096 x 11008 179-183 against 170-205; kernels/NOTES.md). So `linear` does not take it (FUSED_QUANTIZE False);
# True: where the tiles fill at least WSQ_MIN_ROUNDS rounds of the grid.
FUSED_QUANTIZE = False
WSQ_MIN_ROUNDS = 6
WSQ_STAGES = 4
WSQ_EPILOGUE_BUFFERS = 2
WSQ_COPY_WARPS = 3
SMEM_STATIC_SLACK = (
    5 * 1024
)  # the warp-specialized kernels' static shared arrays (s_x, z_x + h s_x, barriers)


def _byte_offsets(columns: torch.Tensor) -> torch.Tensor:
    """Byte offsets 2 * column (< 2 * QUANT_MAX_K, so they fit 16 bits) as uint16 bits stored in int16: the kernels'
    shared-memory maps."""
    off = 2 * columns.to(torch.int32)
    return torch.where(off >= 1 << 15, off - (1 << 16), off).to(torch.int16)


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def unsupported_reason(bits: int, act_bits: int, device: torch.device, in_features: int = 0) -> str | None:
    """Why the kernels cannot run this layer here (None when they can)."""
    if (bits, act_bits) not in ((4, 4), (8, 8)):
        return f"w{bits}a{act_bits} (kernels cover w4a4 and w8a8)"
    if in_features > QUANT_MAX_K:
        return f"in_features {in_features} (the quantize kernel takes rows of at most {QUANT_MAX_K} columns)"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} (the kernels use wgmma: Hopper, 9.0)"
    return None


@dataclass
class QuikPrepared:
    """Device-side view of one layer, ready for the kernels (kernels/quik/gemm.cu, runtime contract)."""

    bits: int
    act_bits: int
    in_features: int  # K
    out_features: int  # N
    kb: int  # base columns
    kp: int  # base columns padded to KP_MULTIPLE
    ko: int  # outlier columns
    kop: int  # outlier columns padded to KO_MULTIPLE
    wq: torch.Tensor  # int32 [N, kp*bits/32]: base codes, rows padded to whole stages
    scales: torch.Tensor  # fp16 [N]
    wreduced: torch.Tensor  # fp32 [N]
    wo: torch.Tensor  # fp16 [N, kop]
    base_idx: torch.Tensor  # int32 [kb]
    outlier_idx: torch.Tensor  # int32 [ko]
    dest: torch.Tensor  # int32 [K]: byte position of a base column's code, -(1 + slot) for an outlier column
    oflag: torch.Tensor  # uint8 [ceil(K/8) rounded up to 128]: one bit per column, set for outliers
    osrc: (
        torch.Tensor
    )  # int16 [kop]: byte offset (2 * column, as uint16 bits) of each outlier column, 0 past ko
    src: (
        torch.Tensor
    )  # int16 [kp]: byte offset (2 * column, as uint16 bits) of the base column whose code sits at
    # each position, -1 (0xFFFF) for a hole (code 0)
    omask: torch.Tensor  # int16 [8 * ceil(K/8)]: -1 (0xFFFF) for outlier columns, 0 for base columns
    bias: torch.Tensor | None  # fp16 [N]
    source_ptr: int
    maps: tma.MapCache = field(default_factory=lambda: tma.MapCache(limit=8))  # weight tensor maps


def act_positions(kb: int, bits: int, device: torch.device | str | None = None) -> torch.Tensor:
    """Byte position of base column b's code in an activation row: at 4 bits the even columns of each group of 32
    come first, then the odd ones (the order a 4-bit weight word unpacks in); at 8 bits column order."""
    b = torch.arange(kb, device=device)
    if bits == 4:
        return 32 * (b // 32) + 16 * (b % 2) + (b % 32) // 2
    return b


def build(
    bits: int,
    act_bits: int,
    in_features: int,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    wreduced: torch.Tensor,
    outlier_weight: torch.Tensor,
    base_idx: torch.Tensor,
    outlier_idx: torch.Tensor,
    bias: torch.Tensor | None,
    source_ptr: int = 0,
) -> QuikPrepared:
    """One layer's tensors for the kernels (once per layer): padded where needed, plus the quantize kernel's column
    map. `qweight` holds the checkpoint's int32 code words [N, >= kb*bits/32], `outlier_weight` [N, ko]."""
    dev = qweight.device
    n, k = qweight.shape[0], in_features
    ko = int(outlier_idx.numel())
    kb = k - ko
    kp = _round_up(max(kb, 1), KP_MULTIPLE)
    kop = _round_up(ko, KO_MULTIPLE)
    words = kp * bits // 32
    # The checkpoint's tensors are used as stored where they already have whole stages (the common case: no copy
    # of the weights); otherwise a padded copy. Padding codes meet the activations' zero padding: any value is right.
    if qweight.shape[1] == words and qweight.is_contiguous():
        wq = qweight
    else:
        wq = torch.zeros(n, words, dtype=torch.int32, device=dev)
        wq[:, : min(words, qweight.shape[1])] = qweight[:, :words]
    if kop == ko and outlier_weight.dtype == torch.float16 and outlier_weight.is_contiguous():
        wo = outlier_weight
    else:
        wo = torch.zeros(n, kop, dtype=torch.float16, device=dev)
        wo[:, :ko] = outlier_weight.to(torch.float16)
    base_idx = base_idx.to(device=dev, dtype=torch.int32).contiguous()
    outlier_idx = outlier_idx.to(device=dev, dtype=torch.int32).contiguous()
    dest = torch.empty(k, dtype=torch.int32, device=dev)
    if kb:
        dest[base_idx.long()] = act_positions(kb, act_bits, dev).to(torch.int32)
    if ko:
        dest[outlier_idx.long()] = -1 - torch.arange(ko, dtype=torch.int32, device=dev)
    pieces = (k + 7) // 8
    flags = torch.zeros(pieces * 8, dtype=torch.int32, device=dev)
    flags[outlier_idx.long()] = 1
    oflag = (flags.view(pieces, 8) << torch.arange(8, device=dev, dtype=torch.int32)).sum(1).to(torch.uint8)
    # padded to 128 bytes: the fused GEMM copies it whole into shared memory (a bulk copy of 128-byte rows)
    oflag = torch.cat([oflag, oflag.new_zeros(_round_up(pieces, 128) - pieces)])
    src = torch.full((kp,), -1, dtype=torch.int16, device=dev)
    if kb:
        src[act_positions(kb, act_bits, dev)] = _byte_offsets(base_idx)
    omask = -flags.to(torch.int16)
    osrc = torch.zeros(kop, dtype=torch.int16, device=dev)
    if ko:
        osrc[:ko] = _byte_offsets(outlier_idx)
    return QuikPrepared(
        bits=bits,
        act_bits=act_bits,
        in_features=k,
        out_features=n,
        kb=kb,
        kp=kp,
        ko=ko,
        kop=kop,
        wq=wq,
        scales=scales.to(device=dev, dtype=torch.float16).contiguous(),
        wreduced=wreduced.to(device=dev, dtype=torch.float32).contiguous(),
        wo=wo,
        base_idx=base_idx,
        outlier_idx=outlier_idx,
        dest=dest,
        oflag=oflag,
        osrc=osrc,
        src=src,
        omask=omask,
        bias=None if bias is None else bias.detach().to(device=dev, dtype=torch.float16).contiguous(),
        source_ptr=source_ptr,
    )


def prepare(layer: torch.nn.Module) -> QuikPrepared:
    return build(
        layer.bits,
        layer.act_bits,
        layer.in_features,
        layer.qweight,
        layer.scales,
        layer.wreduced,
        layer.outlier_weight,
        layer.base_idx,
        layer.outlier_idx,
        layer.bias,
        source_ptr=layer.qweight.data_ptr(),
    )


def _module(dev: torch.device) -> cc.KernelModule:
    return cc.load_module(SOURCE, device=cc.device_index(dev))


@dataclass
class QuantizedActivations:
    codes: torch.Tensor  # int8 [M, kp]: signed codes at act_positions, zero in the padding
    outliers: torch.Tensor  # fp16 [M, kop]
    scale: torch.Tensor  # fp32 [M]
    zero: torch.Tensor  # fp32 [M]


def empty_activations(m: int, p: QuikPrepared, device: torch.device) -> QuantizedActivations:
    return QuantizedActivations(
        codes=torch.empty(m, p.kp, dtype=torch.int8, device=device),
        outliers=torch.empty(m, p.kop, dtype=torch.float16, device=device),
        scale=torch.empty(m, dtype=torch.float32, device=device),
        zero=torch.empty(m, dtype=torch.float32, device=device),
    )


def quant_shape(k: int) -> tuple[int, int]:
    """(threads, 16-byte pieces per thread) of the quantize block for rows of k columns."""
    pieces = (k + 7) // 8
    for threads, ppt in QUANT_SHAPES:
        if pieces <= threads * ppt:
            return threads, ppt
    raise cc.CudaUnavailableError(f"quik quantize kernel: in_features {k} exceeds {QUANT_MAX_K} columns")


def _smem_optin(device: int) -> int:
    if device not in _SMEM_OPTIN:
        _SMEM_OPTIN[device] = int(
            getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 227 * 1024)
        )
    return _SMEM_OPTIN[device]


_SMEM_OPTIN: dict[int, int] = {}


def quant_teams(k: int, smem_optin: int, stages: int = QUANT_WARP_STAGES, team: int = QUANT_WARP_TEAM) -> int:
    """Most row teams per block of the warp-per-row quantize kernel: as many as `stages` row buffers of k columns
    each fit in `smem_optin` bytes of shared memory beside the column maps, at most 32 warps; 0 when not even one
    team's buffers fit."""
    row = _round_up(2 * k, 128)
    static = 8 * (1 + 32 * stages)  # the kernel's mbarriers
    maps = _quant_map_bytes(k)
    return max(0, min(32 // team, (smem_optin - static - maps) // (stages * row)))


def _quant_map_bytes(k: int) -> int:
    """Shared memory the warp-per-row kernel's column maps take per block: the position -> offset map (kp int16,
    kp <= k rounded up to KP_MULTIPLE) and the outlier mask (k int16), each padded to 128 bytes."""
    return _round_up(2 * _round_up(max(k, 1), KP_MULTIPLE), 128) + _round_up(2 * k, 128)


def warp_plan(m: int, k: int, sms: int, smem_optin: int) -> tuple[int, int]:
    """(warps per team, teams per block) for m rows of k columns: teams enough that one block per SM covers the rows
    once (small m spreads over all SMs instead of filling a few), capped by what fits; of the team sizes, the one
    that puts the most warps on an SM, the smaller on a tie (fewer warps share a row: no barrier waits for a slow
    one, and more rows are in flight). Teams is 0 when the kernel cannot take rows of k columns."""
    per_sm = -(-m // sms)
    best = (QUANT_WARP_TEAM, 0)
    for team in sorted(QUANT_WARP_PLAN_TEAMS, reverse=True):
        teams = min(quant_teams(k, smem_optin, QUANT_WARP_STAGES, team), per_sm)
        if teams and teams * team >= best[0] * best[1]:
            best = (team, teams)
    return best


def quantize_kernel(m: int, k: int, vec: bool, sms: int, smem_optin: int) -> str:
    """The quantize kernel for m rows of k columns: "warp" (rows staged in shared memory by bulk copies, a team of
    warps per row) wherever its rows are 16-byte aligned and fit; it won at every M measured (kernels/NOTES.md).
    Otherwise "block" (a block per row, the row in registers)."""
    return "warp" if vec and warp_plan(m, k, sms, smem_optin)[1] > 0 else "block"


def quantize(
    x2: torch.Tensor,
    p: QuikPrepared,
    out: QuantizedActivations | None = None,
    *,
    kernel: str | None = None,
    stages: int = QUANT_WARP_STAGES,
    team: int | None = None,
    teams: int | None = None,
    blocks: int | None = None,
) -> QuantizedActivations:
    """Fused split + per-token quantization of fp16 `x2` [M, K]: one read of each row. `kernel`, `stages`, `team`
    (warps per row), `teams` (per block) and `blocks` override the choice (the bench's A/B runs; tests: many rows
    per team on small inputs)."""
    if x2.dtype != torch.float16:
        raise cc.CudaUnavailableError(f"quik quantize kernel: found activations {x2.dtype}, expected float16")
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    dev = x2.device
    if out is None:
        out = empty_activations(m, p, dev)
    if m == 0:
        return out
    vec = k % 8 == 0 and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0
    kernel = kernel or quantize_kernel(m, k, vec, cc.sm_count(dev.index), _smem_optin(dev.index))
    if kernel == "warp":
        _quantize_warp(x2, p, out, vec, stages, team, teams, blocks)
        return out
    if kernel != "block":
        raise ValueError(f"quik quantize kernel: found {kernel!r}, expected one of {QUANT_KERNELS}")
    threads, ppt = quant_shape(k)
    fn = _module(dev).fn(f"quik_quantize_a{p.act_bits}_t{threads}_p{ppt}")
    smem = p.kp + 2 * p.kop
    cc.allow_shared_memory(fn, smem)
    # A block per row: a persistent grid with the next row prefetched was slower (kernels/NOTES.md).
    _dependent_launch(
        fn,
        (m,),
        (threads,),
        (
            cc.ptr(x2),
            cc.i32(x2.stride(0)),
            cc.i32(m),
            cc.i32(k),
            cc.i32(int(vec)),
            cc.ptr(p.dest),
            cc.ptr(p.oflag),
            cc.i32(p.kb),
            cc.i32(p.kp),
            cc.i32(p.ko),
            cc.i32(p.kop),
            cc.ptr(out.codes),
            cc.ptr(out.outliers),
            cc.ptr(out.scale),
            cc.ptr(out.zero),
        ),
        shared_mem=smem,
        device=dev.index,
    )
    return out


def _quantize_warp(
    x2: torch.Tensor,
    p: QuikPrepared,
    out: QuantizedActivations,
    vec: bool,
    stages: int,
    team: int | None,
    teams: int | None,
    blocks: int | None,
) -> None:
    m, k = x2.shape
    dev = x2.device.index
    if not vec:
        raise ValueError("quik quantize kernel 'warp': rows must be 16-byte aligned with K % 8 == 0")
    if stages not in QUANT_WARP_STAGE_CHOICES:
        raise ValueError(
            f"quik quantize kernel 'warp': found {stages} row buffers per team, expected one of "
            f"{QUANT_WARP_STAGE_CHOICES}"
        )
    if team not in (None, *QUANT_WARP_TEAM_CHOICES):
        raise ValueError(
            f"quik quantize kernel 'warp': found teams of {team} warps, expected one of "
            f"{QUANT_WARP_TEAM_CHOICES}"
        )
    sms = cc.sm_count(dev)
    if team is None:
        team, planned = warp_plan(m, k, sms, _smem_optin(dev))
        teams = teams or planned or None
    most = quant_teams(k, _smem_optin(dev), stages, team)
    t = teams or min(most, -(-m // sms))
    if not 1 <= t <= most:
        raise ValueError(
            f"quik quantize kernel 'warp': found {t} teams per block, expected 1..{most} for K = {k}"
        )
    blocks = min(blocks or sms, -(-m // t))
    fn = _module(x2.device).fn(f"quik_quantize_warp_a{p.act_bits}_s{stages}_t{team}")
    smem = _round_up(2 * p.kp, 128) + _round_up(2 * k, 128) + t * stages * _round_up(2 * k, 128)
    cc.allow_shared_memory(fn, smem)
    _dependent_launch(
        fn,
        (blocks,),
        (32 * team * t,),
        (
            cc.ptr(x2),
            cc.i32(x2.stride(0)),
            cc.i32(m),
            cc.i32(k),
            cc.ptr(p.src),
            cc.ptr(p.omask),
            cc.ptr(p.outlier_idx),
            cc.i32(p.kb),
            cc.i32(p.kp),
            cc.i32(p.ko),
            cc.i32(p.kop),
            cc.ptr(out.codes),
            cc.ptr(out.outliers),
            cc.ptr(out.scale),
            cc.ptr(out.zero),
        ),
        shared_mem=smem,
        device=dev,
    )


def ws_stage_bytes(tn: int, bits: int) -> int:
    """One ring stage of the warp-specialized kernels: the activation tile and an integer stage's weight tile
    (kernels/common/int8_wgmma.cuh WsTile::SB)."""
    return tn * 128 + ROWS * 16 * bits


def wsp_epilogue_bytes(tn: int, bits: int, stages: int) -> int:
    """The persistent kernel's epilogue buffers of 8 KB (32 tokens x 128 float16 features) beside a ring of
    `stages`: what fits with the alignment slack and the static arrays, at most 8 (WsTile::epi_buffers)."""
    buffers = min(8, (SMEM_BLOCK_MAX - stages * ws_stage_bytes(tn, bits) - 1024 - 5 * 1024) // 8192)
    return buffers * 8192


def ws_rings(kernel: str, bits: int, tn: int) -> tuple[int, ...]:
    """The ring depths built for warp-specialized kernel `kernel` ("ws" or "wsp") at tiles of tn tokens."""
    if kernel == "wsp" and bits == 4:
        table = WSP_RINGS_W4
    else:
        table = {t: (st,) for t, st in (WS_TILES if kernel == "ws" else WSP_TILES).items()}
    if tn not in table:
        raise ValueError(f"tokens: found {tn} for kernel {kernel}, expected one of {sorted(table)}")
    return table[tn]


def ws_stages(kernel: str, bits: int, tn: int, steps: int) -> int:
    """Ring stages of warp-specialized kernel `kernel` for tiles of tn tokens and `steps` stages per tile: the
    deepest ring built where the tiles are long (WSP_DEEP_RING_STEPS), else the shallowest."""
    rings = ws_rings(kernel, bits, tn)
    return rings[-1] if steps >= WSP_DEEP_RING_STEPS else rings[0]


def gemm_tokens(m: int) -> int:
    """Tokens per GEMM block: the smallest tile that holds M, up to 256."""
    return next((tn for tn in sorted(GEMM_TILES) if m <= tn), max(GEMM_TILES))


_ACT_MAPS = tma.MapCache(limit=64)
_OUT_MAPS = tma.MapCache(limit=64)


def _ws_ready(a: QuantizedActivations, p: QuikPrepared) -> bool:
    """Whether the copy engine can address every operand (16-byte aligned rows)."""
    ts = [a.codes, p.wq] + ([a.outliers, p.wo] if p.kop else [])
    return all(tma.usable(t) for t in ts)


def gemm_kernel(m: int, a: QuantizedActivations, p: QuikPrepared, tokens: int | None = None) -> str:
    """The GEMM kernel the dispatch picks for M tokens: the CUDA-core GEMV for up to GEMV_MAX_TOKENS (decode; unless
    a token tile is asked for), warp-specialized from 256-token tiles on, persistent for 4-bit weights (it won every
    4-bit Llama-2-7B shape on the H100; at 8 bits it lost one; kernels/NOTES.md)."""
    if tokens is None and m <= GEMV_MAX_TOKENS:
        return "gemv"
    tn = tokens or gemm_tokens(m)
    if tn < WS_MIN_TOKENS or not _ws_ready(a, p):
        return "sync"
    return "wsp" if p.bits == 4 and tn in WSP_TILES else "ws"


def gemm_split(tiles: int, steps: int, blocks_per_sm: int, sms: int) -> int:
    """Blocks per output tile along K for the block-synchronous kernel: as many as keep every block in one wave,
    each with at least SPLIT_MIN_STAGES stages, at most SPLIT_MAX."""
    return max(1, min(blocks_per_sm * sms // max(1, tiles), steps // SPLIT_MIN_STAGES, SPLIT_MAX))


def _dependent_launch(
    fn: Any, grid: tuple[int, ...], block: tuple[int, ...], args: tuple, shared_mem: int, device: int | None
) -> None:
    """Every quik kernel waits for the kernel ahead (griddepcontrol) before it reads what that kernel may write or
    writes what it may read, so they are launched as dependents: a GEMM's launch, prologue and first weight copies
    overlap the quantize kernel, and a quantize kernel's launch and column-map loads overlap the end of whatever
    ran before (the previous layer's GEMM lets it start at its last tile)."""
    dependent_launch.launch(fn, grid, block, args, shared_mem=shared_mem, device=device)


def gemm(
    a: QuantizedActivations,
    p: QuikPrepared,
    fused: bool = True,
    out: torch.Tensor | None = None,
    tokens: int | None = None,
    kernel: str | None = None,
    blocks: int | None = None,
    split: int | None = None,
    stages: int | None = None,
) -> torch.Tensor:
    """`fused`: fp16 [M, N] = Eq. 1 epilogue of the integer product + outlier product + bias. Otherwise the raw
    int32 accumulators [M, N] (no outliers, no bias). `tokens` and `kernel` override the dispatch (tests, bench);
    `blocks` caps the persistent kernel's grid (tests: several tiles per block on small problems); `split` sets the
    blocks per tile along K of the block-synchronous kernel (fused, tiles of at most SPLIT_MAX_TOKENS tokens; by
    default gemm_split's choice); `stages` the ring depth of the warp-specialized kernels (one of ws_rings; by
    default ws_stages' choice)."""
    m = a.codes.shape[0]
    n = p.out_features
    dev = a.codes.device
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16 if fused else torch.int32, device=dev)
    if m == 0:
        return out
    tn = tokens or gemm_tokens(m)
    if tn not in GEMM_TILES:
        raise ValueError(f"tokens: found {tn}, expected one of {sorted(GEMM_TILES)}")
    kernel = kernel or gemm_kernel(m, a, p, tokens)
    if kernel not in GEMM_KERNELS:
        raise ValueError(f"kernel: found {kernel!r}, expected one of {GEMM_KERNELS}")
    if split is not None and kernel != "sync":
        raise ValueError(f"split: found {split} for kernel {kernel}, which does not split K (only sync does)")
    if stages is not None and kernel not in ("ws", "wsp"):
        raise ValueError(f"stages: found {stages} for kernel {kernel}; only ws and wsp take a ring depth")
    if kernel == "gemv" and m > GEMV_MAX_TOKENS:
        raise ValueError(f"kernel gemv: found {m} tokens, expected at most {GEMV_MAX_TOKENS}")
    kt = p.kp // KP_MULTIPLE if p.kb > 0 else 0
    kto = p.kop // KO_MULTIPLE if fused else 0
    tail = (
        cc.i32(m),
        cc.i32(n),
        cc.i32(kt),
        cc.i32(kto),
        cc.ptr(a.scale),
        cc.ptr(a.zero),
        cc.ptr(p.scales),
        cc.ptr(p.wreduced),
        cc.ptr(p.bias if fused else None),
        cc.ptr(out),
        cc.i32(n),
        cc.i32(0 if fused else 1),
    )
    grid = ((n + ROWS - 1) // ROWS, (m + tn - 1) // tn)
    # the operands as pointers and byte strides, for the kernels that read them without tensor maps
    operands = (
        cc.ptr(a.codes),
        cc.i32(a.codes.stride(0)),
        cc.ptr(p.wq),
        cc.i32(4 * p.wq.stride(0)),
        cc.ptr(a.outliers),
        cc.i32(2 * a.outliers.stride(0)),
        cc.ptr(p.wo),
        cc.i32(2 * p.wo.stride(0)),
    )
    if kernel == "gemv":
        fn = _module(dev).fn(f"quik_gemv_w{p.bits}_m{1 if m == 1 else 2}")
        _dependent_launch(
            fn, (-(-n // GEMV_WARPS),), (32 * GEMV_WARPS,), operands + tail, shared_mem=0, device=dev.index
        )
        return out
    if kernel in ("ws", "wsp"):
        tiles = grid[0] * grid[1]
        kto_ws = p.kop // WS_OUTLIER_COLUMNS[p.bits] if fused else 0
        rings = ws_rings(kernel, p.bits, tn)
        if stages is None:
            stages = ws_stages(kernel, p.bits, tn, kt + kto_ws)
        elif stages not in rings:
            raise ValueError(
                f"stages: found {stages} for kernel {kernel} at {tn} tokens, w{p.bits}; expected one "
                f"of {rings}"
            )
        smem = (
            stages * ws_stage_bytes(tn, p.bits) + 1024
        )  # plus alignment slack for the 1024-byte swizzle atoms
        if kernel == "wsp":
            smem += wsp_epilogue_bytes(tn, p.bits, stages)
            idx = cc.device_index(dev)
            tiles = min(tiles, blocks or cc.sm_count(idx))
        fn = _module(dev).fn(f"quik_gemm_{kernel}_w{p.bits}_n{tn}_s{stages}")
        ma = _ACT_MAPS.get(a.codes, 128, tn, 128)
        mw = p.maps.get(p.wq, 16 * p.bits, ROWS, 16 * p.bits)
        # with no outlier stages the outlier maps are never read: any valid map fills the parameter
        ob = 2 * WS_OUTLIER_COLUMNS[p.bits]  # outlier bytes per row and stage
        mxo = _ACT_MAPS.get(a.outliers, ob, tn, ob) if p.kop else ma
        mwo = p.maps.get(p.wo, ob, ROWS, ob) if p.kop else mw
        tail = tail[:3] + (cc.i32(kto_ws),) + tail[4:]
        # the persistent kernel stores its tiles through the copy engine where the output rows allow a map
        tmo = kernel == "wsp" and fused and TMA_STORE and tma.usable(out)
        mo = _OUT_MAPS.get(out, 128, 32, 128) if tmo else ma
        cc.allow_shared_memory(fn, smem)
        _dependent_launch(
            fn,
            (tiles,),
            (384,),
            (ma, mw, mxo, mwo, mo) + tail + (cc.i32(int(tmo)),),
            shared_mem=smem,
            device=dev.index,
        )
        return out
    stages = GEMM_TILES[tn]
    fn = _module(dev).fn(f"quik_gemm_w{p.bits}_n{tn}_s{stages}")
    smem = stages * (tn * 128 + ROWS * 128) + 1024
    cc.allow_shared_memory(fn, smem)
    idx = cc.device_index(dev)
    steps = kt + kto
    tiles = grid[0] * grid[1]
    splittable = fused and tn <= SPLIT_MAX_TOKENS
    if split is None:
        split = (
            gemm_split(tiles, steps, cc.resident_blocks(fn, 256, smem, idx), cc.sm_count(idx))
            if splittable
            else 1
        )
    elif split != 1 and not splittable:
        raise ValueError(
            f"split: found {split}; K is split only for the fused output at tiles of at most "
            f"{SPLIT_MAX_TOKENS} tokens (here {tn}{'' if fused else ', raw sums'})"
        )
    if not 1 <= split <= max(1, steps):
        raise ValueError(f"split: found {split}, expected 1..{max(1, steps)} (the layer's stages)")
    split, ws, cnt = split_k.split_buffers(idx, split, tiles, ROWS, tn)
    _dependent_launch(
        fn,
        grid + (split,),
        (256,),
        operands + tail + (cc.ptr(ws), cc.ptr(cnt)),
        shared_mem=smem,
        device=dev.index,
    )
    return out


def wsq_shared_bytes(p: QuikPrepared, copy_warps: int) -> int:
    """Dynamic shared memory of the fused form: the ring, its epilogue buffers, the column maps (src, oflag, osrc) and
    `copy_warps` row buffers (kernels/quik/gemm.cu FusedProducer, the engine's ws_body FUSED)."""
    k = p.in_features
    return (
        WSQ_STAGES * ws_stage_bytes(256, p.bits)
        + 1024
        + WSQ_EPILOGUE_BUFFERS * 8192
        + _round_up(2 * p.kp, 128)
        + _round_up(k // 8, 128)
        + 2 * p.kop
        + copy_warps * _round_up(2 * k, 128)
    )


def wsq_copy_warps(p: QuikPrepared) -> int:
    """The copy warps whose row buffers fit beside the fused form's ring (0: the form cannot take this layer)."""
    fit = [
        w
        for w in range(1, WSQ_COPY_WARPS + 1)
        if wsq_shared_bytes(p, w) <= SMEM_BLOCK_MAX - SMEM_STATIC_SLACK
    ]
    return fit[-1] if fit else 0


def wsq_first_rows(m: int, n: int, grid: int) -> int:
    """Rows the fused form quantizes before its first tiles: those of the token tiles the grid's first tiles read
    (tiles run 128 output rows fastest, so `grid` tiles span ceil(grid / row blocks) token tiles)."""
    row_blocks = -(-n // ROWS)
    return min(m, 256 * -(-min(grid, row_blocks * -(-m // 256)) // row_blocks))


def fused_quantize_reason(x2: torch.Tensor, p: QuikPrepared) -> str | None:
    """Why `quantize_gemm` cannot take this call (None when it can): W4A4 only; a 256-token tile (M > 128); rows of
    16-byte aligned float16; a tile short enough for the 4-stage ring (longer ones run the 5-stage two-kernel path,
    WSP_DEEP_RING_STEPS); output rows the copy engine can store; the maps and a row buffer fit."""
    m, k = x2.shape
    n = p.out_features
    if (p.bits, p.act_bits) != (4, 4):
        return f"w{p.bits}a{p.act_bits} (built for w4a4)"
    if m <= 128:
        return f"{m} tokens (the fused form has 256-token tiles: M > 128)"
    if x2.dtype != torch.float16 or x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16 or k % 8:
        return "activation rows not 16-byte aligned float16"
    steps = p.kp // KP_MULTIPLE + p.kop // WS_OUTLIER_COLUMNS[p.bits]
    if steps >= WSP_DEEP_RING_STEPS:
        return f"{steps} stages per tile (the 5-stage ring of the two-kernel path is faster from {WSP_DEEP_RING_STEPS})"
    if n % 8:
        return f"out_features {n} (output rows must be 16-byte aligned for the copy engine)"
    if 2 * k > 256 * 128:
        return f"in_features {k} (a row must fit a ring slot's activation area)"
    if wsq_copy_warps(p) == 0:
        return f"in_features {k} (the column maps and a row buffer do not fit beside the ring)"
    return None


def quantize_gemm(
    x2: torch.Tensor,
    p: QuikPrepared,
    out: torch.Tensor | None = None,
    acts: QuantizedActivations | None = None,
    *,
    first_rows: int | None = None,
    copy_warps: int | None = None,
    blocks: int | None = None,
) -> tuple[torch.Tensor, QuantizedActivations]:
    """The fused form: fp16 [M, N] = `gemm(quantize(x2, p), p)`, bit for bit, from one kernel that writes the
    quantized activations (returned as well) and reads them back. `first_rows` (rows quantized before the first
    tiles; default wsq_first_rows), `copy_warps` (1..3) and `blocks` (grid cap) override the plan (tests)."""
    reason = fused_quantize_reason(x2, p)
    if reason is not None:
        raise ValueError(f"quik fused quantize + GEMM: {reason}")
    m, k = x2.shape
    n = p.out_features
    dev = x2.device
    idx = cc.device_index(dev)
    if out is None:
        out = torch.empty(m, n, dtype=torch.float16, device=dev)
    if acts is None:
        acts = empty_activations(m, p, dev)
    most = wsq_copy_warps(p)
    copy_warps = most if copy_warps is None else copy_warps
    if not 1 <= copy_warps <= most:
        raise ValueError(f"copy_warps: found {copy_warps}, expected 1..{most} for in_features {k}")
    tiles = -(-n // ROWS) * -(-m // 256)
    grid = min(tiles, blocks or cc.sm_count(idx))
    first_rows = wsq_first_rows(m, n, grid) if first_rows is None else first_rows
    if not 0 <= first_rows <= m:
        raise ValueError(f"first_rows: found {first_rows}, expected 0..{m}")
    bufs = split_k.workspace(idx, 0, -(-m // 256) + 1)
    if bufs is None:  # the counters would have to grow during CUDA-graph capture
        return gemm(quantize(x2, p, acts), p, out=out), acts
    ready = bufs[1]
    kt = p.kp // KP_MULTIPLE if p.kb > 0 else 0
    kto = p.kop // WS_OUTLIER_COLUMNS[p.bits]
    ob = 2 * WS_OUTLIER_COLUMNS[p.bits]
    ma = _ACT_MAPS.get(acts.codes, 128, 256, 128)
    mw = p.maps.get(p.wq, 16 * p.bits, ROWS, 16 * p.bits)
    mxo = _ACT_MAPS.get(acts.outliers, ob, 256, ob) if p.kop else ma
    mwo = p.maps.get(p.wo, ob, ROWS, ob) if p.kop else mw
    mo = _OUT_MAPS.get(out, 128, 32, 128)
    fn = _module(dev).fn(f"quik_gemm_wsq_w{p.bits}_n256_s{WSQ_STAGES}")
    smem = wsq_shared_bytes(p, copy_warps)
    cc.allow_shared_memory(fn, smem)
    _dependent_launch(
        fn,
        (grid,),
        (384,),
        (
            ma,
            mw,
            mxo,
            mwo,
            mo,
            cc.i32(m),
            cc.i32(n),
            cc.i32(kt),
            cc.i32(kto),
            cc.ptr(acts.scale),
            cc.ptr(acts.zero),
            cc.ptr(p.scales),
            cc.ptr(p.wreduced),
            cc.ptr(p.bias),
            cc.ptr(out),
            cc.i32(n),
            cc.ptr(x2),
            cc.i32(x2.stride(0)),
            cc.i32(k),
            cc.ptr(p.src),
            cc.ptr(p.oflag),
            cc.ptr(p.osrc),
            cc.ptr(p.outlier_idx),
            cc.i32(p.kb),
            cc.i32(p.kp),
            cc.i32(p.ko),
            cc.i32(p.kop),
            cc.ptr(acts.codes),
            cc.ptr(acts.outliers),
            cc.ptr(ready),
            cc.i32(first_rows),
            cc.i32(copy_warps),
        ),
        shared_mem=smem,
        device=idx,
    )
    return out, acts


def quantize_torch(x2: torch.Tensor, p: QuikPrepared) -> QuantizedActivations:
    """The unfused split + quantize (torch ops: gather, min/max, divide, round, scatter): the bench's first rung,
    and the layout the kernel must write."""
    from qtool.layouts.quik.layout import quantize_activations

    xf = x2.to(torch.float32)
    m = x2.shape[0]
    codes = torch.zeros(m, p.kp, dtype=torch.int8, device=x2.device)
    if p.kb:
        act = quantize_activations(xf[:, p.base_idx.long()], p.act_bits)
        codes[:, act_positions(p.kb, p.act_bits, x2.device)] = act.codes.to(torch.int8)
        scale, zero = act.scale, act.zero
    else:  # no base columns: what the kernel writes (an empty row's min/max and the unit scale)
        scale = torch.ones(m, dtype=torch.float32, device=x2.device)
        zero = torch.full((m,), float("inf"), dtype=torch.float32, device=x2.device)
    xo = torch.zeros(m, p.kop, dtype=torch.float16, device=x2.device)
    xo[:, : p.ko] = x2[:, p.outlier_idx.long()].to(torch.float16)
    return QuantizedActivations(codes, xo, scale, zero)


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


def fused_quantize_pays(m: int, n: int, sms: int) -> bool:
    """Whether `linear` takes the fused form for M tokens and N output rows (when it can): tiles of 256 tokens for
    WSQ_MIN_ROUNDS rounds of the grid at least (the last one may be partial)."""
    return -(-(-(-n // ROWS) * -(-m // 256)) // sms) >= WSQ_MIN_ROUNDS


def linear(x: torch.Tensor, p: QuikPrepared) -> torch.Tensor:
    x2 = x.reshape(-1, p.in_features)
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if (
        FUSED_QUANTIZE
        and fused_quantize_pays(x2.shape[0], p.out_features, cc.sm_count(cc.device_index(x2.device)))
        and fused_quantize_reason(x2, p) is None
    ):
        y = quantize_gemm(x2, p)[0]
    else:
        y = gemm(quantize(x2, p), p)
    return y.reshape(*x.shape[:-1], p.out_features)


def module_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """CUDA forward for a QuikLinear, or None when the caller should run the reference path.

    QTOOL_KERNELS=cuda turns every fallback into a one-line error instead."""
    if cc.kernel_mode() == "reference":
        return None
    reason = unsupported_reason(layer.bits, layer.act_bits, x.device, layer.in_features)
    if reason is None and x.dtype != torch.float16:
        reason = f"activations {x.dtype} (the kernels read float16)"
    if not cc.use_kernels("quik", reason):
        return None
    p = layer.derived(
        "cuda",
        lambda: prepare(layer),
        valid=lambda p: p.source_ptr == layer.qweight.data_ptr() and p.wq.device == x.device,
    )
    return linear(x, p)
