"""CUDA execution of the `qoq` layout (formats/qoq.md; kernels/qoq/gemm.cu, the quantize kernel and the GEMMs on
the INT8 wgmma engine of kernels/common/int8_wgmma.cuh, and the decode GEMV in kernels/qoq/gemv.cu): per-token
symmetric INT8 activations with their code sums, then W4A8 on the INT8 tensor cores (`wgmma ... s32.u8.s8`,
Hopper) or, for 1-4 tokens, dp4a on the CUDA cores, with the zero-point correction and the per-token x
per-channel scaling in the epilogue; W8A8 through `torch._int_mm`.

The arithmetic is the layout's (formats/qoq.md), so the kernels reproduce the integer products exactly:
  * activations: amax = max|x|, r = 127 / amax, s_x = amax / 127 (float32, IEEE division; amax = 0: both 1),
    qx = clamp(rint(x·r), -127, 127) with one rounded product, rowsum = Σ qx;
  * acc = Σ qx·Wint with Wint = Q8 (W8), q - z (W4 per-channel) or Q8hat = s1·(q - z) (W4 progressive);
  * y = float32(acc) · (s_x · s0) (the scale product first), + bias, then float16.

The 4-bit GEMM consumes the checkpoint's nibble streams as stored (code k at nibble k % 8 of word k / 8): a word's
low nibbles feed wgmma k positions 4t..4t+3 of its 32-code step and the high nibbles 16 + 4t.., so the activation
codes sit at quik's 4-bit positions (qtool/layouts/quik/cuda.py act_positions). Progressive groups travel as one int32
"group word" per (row, group): byte 0 = 128 - z·s1 in [2, 128], byte 1 = s1, from which the kernel forms
Q8hat + 128 = q·s1 + (128 - z·s1) with one IMAD per 4 codes and takes 128·rowsum off in the epilogue.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtool.cuda import compile as cc
from qtool.cuda import split_k, tma
from qtool.layouts.bitpack import packed_words, unpack_codes
from qtool.layouts.quik import cuda as quik

GROUP_SIZES = (
    32,
    64,
    128,
)  # progressive group sizes with a GEMM entry (a k-step of 32 codes lies in one group)
KP_MULTIPLE = quik.KP_MULTIPLE  # activation rows and weight rows padded to whole stages of 128 codes
ROWS = quik.ROWS
INT_MM_MIN_ROWS = (
    32  # torch._int_mm takes more than 16 rows (multiples of 8): fewer are padded with zero rows
)
# The 4-bit forms: `gemv` (kernels/qoq/gemv.cu) runs a warp per weight row on dp4a for decode (up to
# GEMV_MAX_TOKENS tokens), from float16 rows it quantizes itself (gemv) or from the codes the producing kernel wrote
# (gemv_codes); in kernels/qoq/gemm.cu, `sync` is the block-synchronous cp.async GEMM with split-K for tiles of up
# to 128 tokens and `ws` / `wsp` are the warp-specialized copy-engine GEMMs (a tile per block / persistent), with
# the ring depths below (the stage: TN x 128 activation bytes, 8 KB of codes and, for progressive groups, the
# stage's group words).
# `ws` splits K over up to WS_SPLIT_MAX blocks per tile (int32 shares added by the tile's last block), so
# layers with few tiles still fill the GPU.
GEMM_KERNELS = ("gemv", "sync", "ws", "wsp")
GEMM_SOURCE = "qoq/gemm.cu"  # the quantize kernel and the GEMMs
GEMV_SOURCE = "qoq/gemv.cu"
GEMV_TOKENS = (1, 2, 4)  # token slots of the gemv entries
GEMV_MAX_TOKENS = 4
# The GEMV build (kernels/qoq/gemv.cu QG_F* / QG_C*), per form and token slots: (weight rows = warps per block,
# 16-byte weight chunks in flight per lane, group sums (0: one IMAD per 4 codes; 1: two per 32-code chunk on the
# chunk's code sum), minimum blocks per multiprocessor). Rows, chunks and group sums from the sweep in
# kernels/NOTES.md (python scripts/qoq_gemv_variants.py); the minimum blocks keep the registers where the sweep
# had them (the fused form at 64, two blocks of 16 rows) or cap them (the codes form at one token at 48: 40 rows per
# multiprocessor in flight instead of 32).
GEMV_CONFIG = {
    ("fused", 1): (16, 4, 0, 2),
    ("fused", 2): (16, 4, 0, 2),
    ("fused", 4): (16, 4, 0, 1),
    ("codes", 1): (8, 4, 1, 5),
    ("codes", 2): (8, 4, 0, 4),
    ("codes", 4): (8, 8, 0, 1),
}
# At 3-4 tokens the GEMV (its 4-token slot) lost to the GEMM on layers larger than 4096 x 4096 (kernels/NOTES.md):
# there it takes at most 2 tokens.
GEMV_WIDE_MAX_TOKENS = 2
GEMV_ALL_TOKENS_MAX_WEIGHTS = 4096 * 4096
# Activation code rows are allocated in multiples of the smallest token tile (empty_activations).
ACT_ROW_PAD = 64
WS_RINGS = {
    ("ws", 16): 16,
    ("ws", 32): 12,
    ("ws", 64): 8,
    ("ws", 128): 6,
    ("ws", 256): 4,
    ("wsp", 128): 6,
    ("wsp", 256): 4,
}
WS_SPLIT_MAX = 16
WS_SMALL_TILES = (16, 32)  # `ws` token tiles the dispatch takes up to their size
# every token tile some form is built for (`tokens` of gemm)
TILES_BUILT = frozenset(quik.GEMM_TILES) | {t for _, t in WS_RINGS}
# A split tile's shares have at least this many stages: a share ends in a round trip through L2 (its int32 sums,
# the tile's counter, the last block's reads), which shorter shares did not pay for on the H100 (kernels/NOTES.md)
WS_SPLIT_MIN_STAGES = 10
# time of one stage of the persistent form's tiles relative to the 128-token one (H100, 11008x4096 at 512 tokens)
WSP_STAGE_COST = {128: 1.0, 256: 1.7}
WS_RULE_MAX_TOKENS = 512  # the dispatch rule measured on the H100 (gemm_kernel) covers up to this many tokens


def _round_up(v: int, m: int) -> int:
    return (v + m - 1) // m * m


def unsupported_reason(
    bits: int, group_size: int | None, in_features: int, out_features: int, device: torch.device
) -> str | None:
    """Why the kernels cannot run this layer here (None when they can)."""
    if device.type != "cuda":
        return f"device {device} (the kernels run on CUDA)"
    if bits == 4:
        if group_size is not None and group_size not in GROUP_SIZES:
            return f"group_size {group_size} (the W4A8 GEMM takes per-channel or groups of {GROUP_SIZES})"
    elif bits == 8:
        if group_size is not None:
            return f"w8 group_size {group_size} (8-bit weights are per-channel)"
    else:
        return f"bits {bits} (kernels cover w4a8 and w8a8)"
    if group_size is not None and in_features % group_size:
        return f"in_features {in_features} not a multiple of group_size {group_size}"
    if in_features > quik.QUANT_MAX_K:
        return f"in_features {in_features} (the quantize kernel takes rows of at most {quik.QUANT_MAX_K} columns)"
    cap = torch.cuda.get_device_capability(device)
    if cap != (9, 0):
        return f"compute capability {cap[0]}.{cap[1]} (the kernels use wgmma: Hopper, 9.0)"
    return None


@dataclass
class QoQPrepared:
    """Device-side view of one layer, ready for the kernels."""

    bits: int
    group_size: int | None
    in_features: int  # K
    out_features: int  # N
    kp: int  # K padded to KP_MULTIPLE: activation code row length
    wq: (
        torch.Tensor
    )  # 4-bit: int32 [N, kp / 8] nibble streams; 8-bit: int8 [N rounded up to 8, kp] Q8 (signed)
    scales: torch.Tensor  # fp16 [N]: s0 (s per-channel)
    zeros: torch.Tensor | None  # int32 [N]: z (W4 per-channel only)
    gwords: torch.Tensor | None  # int32 [N, kp / g]: (128 - z·s1) | s1 << 8 (W4 progressive only)
    gstage: (
        torch.Tensor | None
    )  # the same words stage-major for the copy engine: [ceil(N / 128), kt, 128, 128 / g]
    dest: torch.Tensor  # int32 [K]: byte position of column b's code in an activation row
    oflag: torch.Tensor  # uint8 [ceil(K / 8)], zero: the quantize kernel's outlier bits (QoQ has none)
    bias: torch.Tensor | None  # fp16 [N]
    source_ptr: int
    maps: tma.MapCache | None = None  # the weight codes' tensor map (warp-specialized kernels)


def group_words(group_scales: torch.Tensor, zeros: torch.Tensor, qmax: torch.Tensor) -> torch.Tensor:
    """The GEMM's int32 group words from s1 and z [N, K/g]: byte 0 = 128 - z·s1, byte 1 = s1. The kernel forms
    q·s1 + (128 - z·s1) = Q8hat + 128 for four codes in one 32-bit multiply-add, so each byte must stay in
    [0, 255]: 128 - z·s1 >= 0, and for the group's largest code `qmax` [N, K/g], qmax·s1 + 128 - z·s1 <= 255
    (what the layout's protective range guarantees for the codes it produces; a code the quantizer cannot
    produce, e.g. q = 15 where z = 7 and s1 = 16, may exist in no group). One-line error otherwise."""
    s1 = group_scales.to(torch.int32)
    c = 128 - zeros.to(torch.int32) * s1
    bad = (s1 < 0) | (s1 > 255) | (c < 0) | (qmax.to(torch.int32) * s1 + c > 255)
    if bool(bad.any()):
        n, g = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"qoq layer: group ({n}, {g}) has s1 {int(s1[n, g])}, z {int(zeros[n, g])} and codes up "
            f"to {int(qmax[n, g])}: s1·(q - z) leaves [-128, 127]"
        )
    return c | (s1 << 8)


def build(
    bits: int,
    group_size: int | None,
    in_features: int,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_scales: torch.Tensor | None,
    bias: torch.Tensor | None,
    source_ptr: int = 0,
) -> QoQPrepared:
    """One layer's tensors for the kernels (once per layer), from the checkpoint's fields (formats/qoq.md)."""
    dev = qweight.device
    n, k = qweight.shape[0], in_features
    kp = _round_up(max(k, 1), KP_MULTIPLE)
    if bits == 8:
        # codes Q8 + 128 in little-endian byte streams -> signed Q8, zero-padded to kp columns
        codes = qweight.contiguous().view(torch.uint8).view(n, -1)[:, :k].to(torch.int16) - 128
        # rows padded to a multiple of 8 for torch._int_mm; the padding rows' sums are dropped
        wq = torch.zeros(_round_up(n, 8), kp, dtype=torch.int8, device=dev)
        wq[:n, :k] = codes.to(torch.int8)
        positions = torch.arange(k, device=dev)
    else:
        words = kp // 8
        if qweight.shape[1] == words and qweight.is_contiguous() and qweight.dtype == torch.int32:
            wq = qweight
        else:  # padding codes meet the activations' zero padding: any value is right
            wq = torch.zeros(n, words, dtype=torch.int32, device=dev)
            wq[:, : min(words, qweight.shape[1])] = qweight[:, :words]
        positions = quik.act_positions(k, 4, dev)
    zc = gw = gs = None
    if bits == 4 and group_size is None:
        zc = zeros.to(device=dev, dtype=torch.int32).reshape(n).contiguous()
    elif bits == 4:
        codes = unpack_codes(qweight[:, : packed_words(k, 4)].contiguous(), 4, k)
        codes = codes.reshape(n, k // group_size, group_size)
        words = group_words(group_scales.to(dev), zeros.to(dev), codes.amax(dim=2))
        gw = torch.zeros(n, kp // group_size, dtype=torch.int32, device=dev)
        gw[:, : words.shape[1]] = words
        gs = stage_words(gw, group_size)
    dest = positions.to(torch.int32).contiguous()
    return QoQPrepared(
        bits=bits,
        group_size=group_size,
        in_features=k,
        out_features=n,
        kp=kp,
        wq=wq,
        scales=scales.to(device=dev, dtype=torch.float16).reshape(n).contiguous(),
        zeros=zc,
        gwords=gw,
        gstage=gs,
        dest=dest,
        oflag=torch.zeros((k + 7) // 8, dtype=torch.uint8, device=dev),
        bias=None if bias is None else bias.detach().to(device=dev, dtype=torch.float16).contiguous(),
        source_ptr=source_ptr,
        maps=tma.MapCache(limit=4),
    )


def stage_words(gwords: torch.Tensor, group_size: int) -> torch.Tensor:
    """The group words [N, kp / g] rearranged so that one stage (128 codes) of one 128-row tile is 128 x 128 / g
    contiguous words: [ceil(N / 128), kt, 128, 128 / g]; the warp-specialized GEMM copies a stage's words with one
    1-D bulk copy (rows past N are zero and never stored)."""
    n, words = gwords.shape
    gps = KP_MULTIPLE // group_size
    kt = words // gps
    nt = (n + ROWS - 1) // ROWS
    padded = torch.zeros(nt * ROWS, words, dtype=torch.int32, device=gwords.device)
    padded[:n] = gwords
    return padded.view(nt, ROWS, kt, gps).permute(0, 2, 1, 3).contiguous()


def prepare(layer: torch.nn.Module) -> QoQPrepared:
    """The layer's prepared tensors, cached on it (rebuilt when its qweight storage changes)."""
    return layer.derived(
        "cuda",
        lambda: build(
            layer.bits,
            layer.group_size,
            layer.in_features,
            layer.qweight,
            layer.scales,
            layer.zeros,
            layer.group_scales,
            layer.bias,
            source_ptr=layer.qweight.data_ptr(),
        ),
        valid=lambda p: p.source_ptr == layer.qweight.data_ptr() and p.wq.device == layer.qweight.device,
    )


@dataclass
class QoQActivations:
    codes: torch.Tensor  # int8 [M, kp]: qx at the prepared positions, zero in the padding
    scale: torch.Tensor  # fp32 [M]: s_x
    rowsum: torch.Tensor  # int32 [M]: Σ qx


def empty_activations(m: int, p: QoQPrepared, device: torch.device) -> QoQActivations:
    """Buffers for m tokens. The code rows' storage runs on to a multiple of ACT_ROW_PAD rows (never written or
    read as results): the warp-specialized GEMMs map those rows too (tma.padded_rows), so their activation boxes
    stay inside the tensor."""
    rows = _round_up(max(m, 1), ACT_ROW_PAD)
    return QoQActivations(
        codes=torch.empty(rows, p.kp, dtype=torch.int8, device=device)[:m],
        scale=torch.empty(m, dtype=torch.float32, device=device),
        rowsum=torch.empty(m, dtype=torch.int32, device=device),
    )


def _module(dev: torch.device) -> cc.KernelModule:
    return cc.load_module(GEMM_SOURCE, device=cc.device_index(dev))


def quantize_activations(
    x2: torch.Tensor, p: QoQPrepared, out: QoQActivations | None = None
) -> QoQActivations:
    """Per-token symmetric INT8 codes of fp16 `x2` [M, K], their scales and sums, in one read of each row (a block
    per row: quik's quantize kernel in its symmetric mode)."""
    if x2.dtype != torch.float16:
        raise ValueError(f"qoq quantize kernel: found activations {x2.dtype}, expected float16")
    if x2.dim() != 2 or x2.shape[1] != p.in_features:
        raise ValueError(
            f"qoq quantize kernel: found activations {list(x2.shape)}, expected [M, {p.in_features}]"
        )
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    m, k = x2.shape
    dev = x2.device
    if out is None:
        out = empty_activations(m, p, dev)
    if m == 0:
        return out
    vec = k % 8 == 0 and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0
    threads, ppt = quik.quant_shape(k)
    fn = _module(dev).fn(f"qoq_quantize_t{threads}_p{ppt}")
    cc.allow_shared_memory(fn, p.kp)
    quik._dependent_launch(
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
            cc.i32(p.kp),
            cc.ptr(out.codes),
            cc.ptr(out.scale),
            cc.ptr(out.rowsum),
        ),
        shared_mem=p.kp,
        device=cc.device_index(dev),
    )
    return out


def quantize_torch(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout's activation quantization in torch ops: (codes int8 [M, K] in column order, s_x fp32 [M],
    rowsum int32 [M]); what the kernel must write (at its positions)."""
    xf = x2.to(torch.float32)
    amax = xf.abs().amax(dim=1)
    ones = torch.ones_like(amax)
    nz = amax > 0
    # Tensor by tensor: torch on CUDA turns a division involving a Python number into a multiplication by a
    # reciprocal, which is not the IEEE quotient the layout specifies.
    full = torch.full_like(amax, 127.0)
    safe = torch.where(nz, amax, ones)
    r = torch.where(nz, full / safe, ones)
    sx = torch.where(nz, safe / full, ones)
    q = torch.round(xf * r[:, None]).clamp_(-127, 127)
    return q.to(torch.int8), sx, q.sum(dim=1).to(torch.int32)


def scheme(p: QoQPrepared) -> str:
    """The GEMM entry's scheme name (kernels/qoq/gemm.cu qoq_gemm_<scheme>_n<tokens>_s<stages>)."""
    return "pc" if p.group_size is None else f"g{p.group_size}"


def gemm_kernel(
    m: int,
    n: int,
    a: QoQActivations,
    p: QoQPrepared,
    tokens: int | None = None,
    split: int | None = None,
    sms: int = 132,
) -> tuple[str, int, int | None, int | None]:
    """(form, token tile, K split, whole tiles) for M tokens of quantized activations (None: the form's own
    choice). `sync` wherever the copy engine cannot address the operands, wherever a K split is asked for without
    a form, and up to GEMV_MAX_TOKENS (a model calls the GEMV there). The rule from the H100 sweep
    (kernels/NOTES.md, qoq section; scripts/qoq_gemm_forms.py), up to WS_RULE_MAX_TOKENS:
      * `ws` tiles of 16 or 32 tokens up to that many tokens (fewer activation bytes per stage, more weight
        stages in flight: the H200 sweep, kernels/qoq/NOTES.md), then 64-token tiles while 128-token tiles would
        leave more than half the SMs idle (up to 64 tokens always), each tile split along K over as many blocks
        as fit one wave, with shares of at least WS_SPLIT_MIN_STAGES stages (a 4096-row layer: 32 tiles, 3-4
        blocks each);
      * otherwise the persistent form at 128 or 256 tokens, whichever needs fewer rounds of tiles weighted by
        its stage time (WSP_STAGE_COST; 256 from 256 tokens).
    Above: the token tile that gives the most tiles within one wave of `sms` blocks (the persistent form for
    256-token tiles), and where no tile fits one wave, the persistent form (the H200 sweep)."""
    if split is not None or not (tma.usable(a.codes) and tma.usable(p.wq)):
        return "sync", tokens or quik.gemm_tokens(m), split, None
    if tokens is not None:
        return ("wsp" if tokens == 256 else "ws"), tokens, None, None
    if m <= GEMV_MAX_TOKENS:
        return "sync", quik.gemm_tokens(m), None, None
    rows = (n + ROWS - 1) // ROWS
    if m <= WS_RULE_MAX_TOKENS:
        if m <= 64 or 2 * rows * ((m + 127) // 128) < sms:
            tn = next(t for t in WS_SMALL_TILES + (64,) if m <= t or t == 64)
            tiles = rows * ((m + tn - 1) // tn)
            kt = p.kp // KP_MULTIPLE
            return "ws", tn, max(1, min(sms // tiles, kt // WS_SPLIT_MIN_STAGES, WS_SPLIT_MAX)), 0
        tn = min(
            (t for t in WSP_STAGE_COST if t <= max(m, 128)),
            key=lambda t: (-(-rows * ((m + t - 1) // t) // sms) * WSP_STAGE_COST[t], t),
        )
        return "wsp", tn, None, None
    fits = [tn for tn in (64, 128, 256) if rows * ((m + tn - 1) // tn) <= sms]
    if not fits:
        return "wsp", 256, None, None
    tn = min(fits, key=lambda t: (-(rows * ((m + t - 1) // t)), t))
    return ("wsp" if tn == 256 else "ws"), tn, None, None


def gemm(
    a: QoQActivations,
    p: QoQPrepared,
    out: torch.Tensor | None = None,
    *,
    raw: bool = False,
    tokens: int | None = None,
    split: int | None = None,
    kernel: str | None = None,
    blocks: int | None = None,
    whole: int | None = None,
) -> torch.Tensor:
    """fp16 [M, N] = the layout's y from quantized activations; `raw`: the exact int32 products acc [M, N] instead.
    Up to gemv_tokens(p) tokens the codes GEMV runs (gemv_codes). `tokens` (tile: 64, 128, 256), `split` (blocks
    per tile along K: of `sync`, fp16 output at tiles of at most 128 tokens; of `ws`, any output, up to
    WS_SPLIT_MAX), `whole` (`ws` with a split: the first `whole` tiles are not split) and `kernel` (gemv, sync, ws,
    wsp) override the dispatch (tests, bench); `blocks` caps the persistent kernel's grid (tests: several tiles per
    block on small problems)."""
    m = a.codes.shape[0]
    n = p.out_features
    dev = a.codes.device
    if out is None:
        out = torch.empty(m, n, dtype=torch.int32 if raw else torch.float16, device=dev)
    if m == 0:
        return out
    if p.bits == 8:
        return _gemm_w8(a, p, out, raw)
    if kernel == "gemv" or (
        kernel is None
        and tokens is None
        and split is None
        and m <= gemv_tokens(p)
        and gemv_codes_reason(a, p) is None
    ):
        return gemv_codes(a, p, out, raw=raw)
    if tokens is not None and tokens not in TILES_BUILT:
        raise ValueError(f"tokens: found {tokens}, expected one of {sorted(TILES_BUILT)}")
    idx = cc.device_index(dev)
    if kernel is None:
        kernel, tn, pick, pick_whole = gemm_kernel(m, n, a, p, tokens, split, cc.sm_count(idx))
        split = split if split is not None else pick
        whole = whole if whole is not None else pick_whole
    else:
        tn = tokens or (quik.gemm_tokens(m) if kernel == "sync" else 256 if kernel == "wsp" else 128)
    if kernel not in ("sync", "ws", "wsp"):
        raise ValueError(f"kernel: found {kernel!r}, expected one of gemv, sync, ws, wsp")
    if kernel == "sync" and tn not in quik.GEMM_TILES:
        raise ValueError(f"tokens: found {tn} for kernel sync, expected one of {sorted(quik.GEMM_TILES)}")
    kt = p.kp // KP_MULTIPLE
    if kernel in ("ws", "wsp"):
        if kernel == "wsp" and split not in (None, 1):
            raise ValueError(f"split: found {split} for kernel wsp, which does not split K (sync and ws do)")
        if split is not None and not 1 <= split <= WS_SPLIT_MAX:
            raise ValueError(f"split: found {split}, expected 1..{WS_SPLIT_MAX} blocks per tile")
        if (kernel, tn) not in WS_RINGS:
            raise ValueError(
                f"tokens: found {tn} for kernel {kernel}, expected one of "
                f"{sorted(t for k, t in WS_RINGS if k == kernel)}"
            )
        return _gemm_ws(a, p, out, raw, kernel, tn, kt, idx, blocks, split or 1, whole)
    stages = quik.GEMM_TILES[tn]
    fn = _module(dev).fn(f"qoq_gemm_{scheme(p)}_n{tn}_s{stages}")
    smem = stages * (tn * 128 + ROWS * 128) + 1024
    cc.allow_shared_memory(fn, smem)
    grid = ((n + ROWS - 1) // ROWS, (m + tn - 1) // tn)
    tiles = grid[0] * grid[1]
    splittable = not raw and tn <= quik.SPLIT_MAX_TOKENS
    if split is None:
        split = (
            quik.gemm_split(tiles, kt, cc.resident_blocks(fn, 256, smem, idx), cc.sm_count(idx))
            if splittable
            else 1
        )
    elif split != 1 and not splittable:
        raise ValueError(
            f"split: found {split}; K is split only for the fp16 output at tiles of at most "
            f"{quik.SPLIT_MAX_TOKENS} tokens (here {tn}{', raw sums' if raw else ''})"
        )
    if not 1 <= split <= kt:
        raise ValueError(f"split: found {split}, expected 1..{kt} (the layer's stages)")
    split, ws, cnt = split_k.split_buffers(idx, split, tiles, ROWS, tn)
    gw = p.gwords
    quik._dependent_launch(
        fn,
        grid + (split,),
        (256,),
        (
            cc.ptr(a.codes),
            cc.i32(a.codes.stride(0)),
            cc.ptr(p.wq),
            cc.i32(4 * p.wq.stride(0)),
            cc.ptr(gw),
            cc.i32(0 if gw is None else 4 * gw.stride(0)),
            cc.i32(m),
            cc.i32(n),
            cc.i32(kt),
            cc.ptr(a.scale),
            cc.ptr(a.rowsum),
            cc.ptr(p.scales),
            cc.ptr(p.zeros),
            cc.ptr(None if raw else p.bias),
            cc.ptr(out),
            cc.i32(n),
            cc.i32(int(raw)),
            cc.ptr(ws),
            cc.ptr(cnt),
        ),
        shared_mem=smem,
        device=idx,
    )
    return out


def ws_stage_bytes(tn: int, group_size: int | None) -> int:
    """A ring stage of the warp-specialized QoQ kernels (kernels/common/int8_wgmma.cuh WsTile<TN, 4, 128 / g>::SB:
    the group words are the engine's side words)."""
    gwb = 0 if group_size is None else _round_up(ROWS * (KP_MULTIPLE // group_size) * 4, 1024)
    return tn * 128 + ROWS * 64 + gwb


def _gemm_ws(
    a: QoQActivations,
    p: QoQPrepared,
    out: torch.Tensor,
    raw: bool,
    kernel: str,
    tn: int,
    kt: int,
    idx: int,
    blocks: int | None,
    split: int = 1,
    whole: int | None = None,
) -> torch.Tensor:
    m, n = a.codes.shape[0], p.out_features
    stages = WS_RINGS[(kernel, tn)]
    sb = ws_stage_bytes(tn, p.group_size)
    smem = stages * sb + 1024
    tiles = ((n + ROWS - 1) // ROWS) * ((m + tn - 1) // tn)
    if kernel == "wsp":
        buffers = min(8, (quik.SMEM_BLOCK_MAX - stages * sb - 1024 - 5 * 1024) // 8192)
        smem += buffers * 8192
        tiles = min(tiles, blocks or cc.sm_count(idx))
    fn = _module(a.codes.device).fn(f"qoq_gemm_{kernel}_{scheme(p)}_n{tn}_s{stages}")
    ma = quik._ACT_MAPS.get(tma.padded_rows(a.codes, tn), 128, tn, 128)
    mw = p.maps.get(p.wq, 64, ROWS, 64)
    tmo = kernel == "wsp" and not raw and quik.TMA_STORE and tma.usable(out)
    mo = quik._OUT_MAPS.get(out, 128, 32, 128) if tmo else ma
    cc.allow_shared_memory(fn, smem)
    ws = cnt = None
    dp = tiles if split == 1 else min(tiles, whole or 0)  # tiles taken whole, then `split` blocks per tile
    # int32 shares: split x (tiles - dp) x 128 x tn (kernels/common/int8_wgmma.cuh ws_split_add)
    if dp < tiles:
        bufs = split_k.workspace(idx, split * (tiles - dp) * ROWS * tn, tiles - dp)
        if bufs is None:  # it would have to grow during CUDA-graph capture
            split, dp = 1, tiles
        else:
            ws, cnt = bufs
    quik._dependent_launch(
        fn,
        (dp + (tiles - dp) * split,),
        (384,),
        (
            ma,
            mw,
            mo,
            cc.ptr(p.gstage),
            cc.i32(m),
            cc.i32(n),
            cc.i32(kt),
            cc.ptr(a.scale),
            cc.ptr(a.rowsum),
            cc.ptr(p.scales),
            cc.ptr(p.zeros),
            cc.ptr(None if raw else p.bias),
            cc.ptr(out),
            cc.i32(n),
            cc.i32(int(raw)),
            cc.i32(int(tmo)),
            cc.i32(dp),
            cc.i32(split),
            cc.ptr(ws),
            cc.ptr(cnt),
        ),
        shared_mem=smem,
        device=idx,
    )
    return out


def gemv_tokens(p: QoQPrepared) -> int:
    """The most tokens for which the dispatch (linear, gemm) picks the GEMV on this layer."""
    small = p.in_features * p.out_features <= GEMV_ALL_TOKENS_MAX_WEIGHTS
    return GEMV_MAX_TOKENS if small else GEMV_WIDE_MAX_TOKENS


def gemv_reason(x2: torch.Tensor, p: QoQPrepared) -> str | None:
    """Why the fused-quantization GEMV cannot take these float16 rows (None when it can)."""
    m, k = x2.shape
    if p.bits != 4:
        return "8-bit weights (they run torch._int_mm)"
    if m > GEMV_MAX_TOKENS:
        return f"{m} tokens (the gemv takes at most {GEMV_MAX_TOKENS})"
    if k % 8 or x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        return "activation rows not in whole 16-byte pieces"
    return None


def gemv_codes_reason(a: QoQActivations, p: QoQPrepared) -> str | None:
    """Why the GEMV cannot take these activation codes (None when it can)."""
    m, kp = a.codes.shape
    if p.bits != 4:
        return "8-bit weights (they run torch._int_mm)"
    if m > GEMV_MAX_TOKENS:
        return f"{m} tokens (the gemv takes at most {GEMV_MAX_TOKENS})"
    if kp != p.kp or a.codes.stride(1) != 1 or a.codes.stride(0) % 16 or a.codes.data_ptr() % 16:
        return "code rows not in whole 16-byte pieces of the layer's padded width"
    return None


def _gemv_module(dev: torch.device, tuning: bool = False) -> cc.KernelModule:
    opts = tuple(
        f"-DQG_{form[0].upper()}{mt}_{field}={v}"
        for (form, mt), cfg in GEMV_CONFIG.items()
        for field, v in zip(("W", "U", "GS", "B"), cfg, strict=True)
    )
    return cc.load_module(
        GEMV_SOURCE,
        extra_options=opts + (("-DQOQ_GEMV_TUNING=1",) if tuning else ()),
        device=cc.device_index(dev),
    )


def _gemv_launch(
    form: str,
    x2: torch.Tensor | None,
    a: QoQActivations | None,
    p: QoQPrepared,
    out: torch.Tensor,
    raw: bool,
    variant: tuple[str, int] | None,
) -> torch.Tensor:
    m = (x2 if x2 is not None else a.codes).shape[0]
    dev = out.device
    mt = next(t for t in GEMV_TOKENS if m <= t)
    if variant is None:
        fn = _gemv_module(dev).fn(f"qoq_gemv_{'codes_' if form == 'codes' else ''}{scheme(p)}_m{mt}")
        warps, _, sums, _ = GEMV_CONFIG[(form, mt)]
    else:  # a measurement build's entry and its warps per block (scripts/qoq_gemv_variants.py)
        fn = _gemv_module(dev, tuning=True).fn(variant[0])
        warps, sums = variant[1], int(variant[0].endswith("gs1"))
    # code rows of kp rounded up to 1024 bytes (kernels/qoq/gemv.cu qg_at), then the chunk sums
    smem = mt * _round_up(p.kp, 1024) + (mt * p.kp // 8 if sums and p.group_size is not None else 0)
    cc.allow_shared_memory(fn, smem)
    gw = p.gwords
    n = p.out_features
    act = (
        (
            cc.ptr(None),
            cc.i32(0),
            cc.ptr(a.codes),
            cc.i32(a.codes.stride(0)),
            cc.ptr(a.scale),
            cc.ptr(a.rowsum),
        )
        if x2 is None
        else (cc.ptr(x2), cc.i32(x2.stride(0)), cc.ptr(None), cc.i32(0), cc.ptr(None), cc.ptr(None))
    )
    quik._dependent_launch(
        fn,
        ((n + warps - 1) // warps,),
        (32 * warps,),
        act
        + (
            cc.i32(m),
            cc.i32(p.in_features),
            cc.i32(p.kp),
            cc.ptr(p.wq),
            cc.i32(p.wq.stride(0)),
            cc.ptr(gw),
            cc.i32(0 if gw is None else gw.stride(0)),
            cc.i32(n),
            cc.ptr(p.scales),
            cc.ptr(p.zeros),
            cc.ptr(None if raw else p.bias),
            cc.ptr(out),
            cc.i32(n),
            cc.i32(int(raw)),
        ),
        shared_mem=smem,
        device=cc.device_index(dev),
    )
    return out


def gemv(
    x2: torch.Tensor,
    p: QoQPrepared,
    out: torch.Tensor | None = None,
    *,
    raw: bool = False,
    variant: tuple[str, int] | None = None,
) -> torch.Tensor:
    """fp16 [M, N] (or `raw` int32 products) from float16 rows x2 [M, K], M <= GEMV_MAX_TOKENS, quantizing them
    inside the GEMV (the codes, s_x and sums are the quantize kernel's, bit for bit). `variant`: (entry, warps) of
    the measurement build instead of the dispatched entry."""
    reason = gemv_reason(x2, p)
    if reason is not None:
        raise ValueError(f"qoq gemv: {reason}")
    m, n = x2.shape[0], p.out_features
    if out is None:
        out = torch.empty(m, n, dtype=torch.int32 if raw else torch.float16, device=x2.device)
    if m == 0:
        return out
    return _gemv_launch("fused", x2, None, p, out, raw, variant)


def gemv_codes(
    a: QoQActivations,
    p: QoQPrepared,
    out: torch.Tensor | None = None,
    *,
    raw: bool = False,
    variant: tuple[str, int] | None = None,
) -> torch.Tensor:
    """fp16 [M, N] (or `raw` int32 products) from activation codes, s_x and sums made beforehand (by the kernel that
    produced the rows, or the quantize kernel), M <= GEMV_MAX_TOKENS: what gemm() runs at decode sizes."""
    reason = gemv_codes_reason(a, p)
    if reason is not None:
        raise ValueError(f"qoq gemv: {reason}")
    m, n = a.codes.shape[0], p.out_features
    if out is None:
        out = torch.empty(m, n, dtype=torch.int32 if raw else torch.float16, device=a.codes.device)
    if m == 0:
        return out
    return _gemv_launch("codes", None, a, p, out, raw, variant)


def epilogue_torch(acc: torch.Tensor, scale: torch.Tensor, p: QoQPrepared) -> torch.Tensor:
    """y = float32(acc) · (s_x · s0) + bias as float16, in the layout's order (torch ops)."""
    y = acc.to(torch.float32) * (scale[:, None] * p.scales.to(torch.float32)[None, :])
    if p.bias is not None:
        y = y + p.bias.to(torch.float32)
    return y.to(torch.float16)


def _gemm_w8(a: QoQActivations, p: QoQPrepared, out: torch.Tensor, raw: bool) -> torch.Tensor:
    m = a.codes.shape[0]
    codes = a.codes
    if m < INT_MM_MIN_ROWS or m % 8:
        codes = torch.zeros(
            max(INT_MM_MIN_ROWS, _round_up(m, 8)), p.kp, dtype=torch.int8, device=codes.device
        )
        codes[:m] = a.codes
    acc = torch._int_mm(codes, p.wq.t())[:m, : p.out_features]
    out.copy_(acc if raw else epilogue_torch(acc, a.scale, p))
    return out


def linear(x: torch.Tensor, p: QoQPrepared, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ (+ bias) through the kernels; `bias` overrides the prepared one."""
    x2 = x.reshape(-1, p.in_features)
    if bias is not None:
        p = QoQPrepared(
            **{**p.__dict__, "bias": bias.detach().to(device=x.device, dtype=torch.float16).contiguous()}
        )
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    if x2.shape[0] <= gemv_tokens(p) and gemv_reason(x2, p) is None:
        y = gemv(x2, p)
    else:
        y = gemm(quantize_activations(x2, p), p)
    return y.reshape(*x.shape[:-1], p.out_features)


def module_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """CUDA forward for a QoQLinear, or None when the caller should run the reference path (CPU tensors, shapes or
    cards the kernels do not take, no cupy). QTOOL_KERNELS=cuda turns every fallback into a one-line error."""
    if cc.kernel_mode() == "reference":
        return None
    reason = unsupported_reason(layer.bits, layer.group_size, layer.in_features, layer.out_features, x.device)
    if reason is None and x.dtype != torch.float16:
        reason = f"activations {x.dtype} (the kernels read float16)"
    if not cc.use_kernels("qoq", reason):
        return None
    return linear(x, prepare(layer))
