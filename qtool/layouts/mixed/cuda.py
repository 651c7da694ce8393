"""CUDA execution of the `mixed-2-4-16` layout (kernels/mixed/gemv.cu, kernels/mixed/gemm.cu): load-time
preparation, the kernels, the dispatch rule.

Paths, chosen per call from the token count M and the activation dtype:

* ``gemv``: the CUDA-core GEMV for 1..GEMV_MAX_M tokens (fp16), the outliers added inside it (``fused``) or by a
  second kernel in the same stream (``spmv``, the paper's separate sparse product; OUTLIERS picks);
* ``gemm``: more tokens on a Hopper GPU, the tensor-core GEMM reading the tiled streams (outliers in its epilogue);
  ``gemm_ws`` is its warp-specialized form (kernels/mixed/gemm_ws.cu), which `linear` takes where GEMM_WS is set;
* ``dequant+cublas``: more tokens elsewhere (or for layers without tiled streams): a kernel writes the dense fp16
  weight (outliers added into it), then cuBLAS multiplies;
* ``reference``: the torch reference (other dtypes, group sizes other than 16, K not a multiple of 64).

Preparation adds two small tables: `binfo` (per 64-channel block: the rank of its first 4-bit stripe, its number of
4-bit stripes and the positions of its stripes, 4 bytes per 64 input channels) and, for the checkpoint-layout
kernels, `s2f` (per second-order group, 64·s2 and 64·u·s2 in float32, so a first-order scale is one exact fma).
Block4 layers with g2 a multiple of 4 get the tiled streams (`tiled_streams`: the same bits re-laid so a thread's
share of a row and 64-channel block is one 16-byte and one 8-byte load), which the GEMV (``tiled``; the
checkpoint layout's GEMV is ``direct``) and the GEMM read. Where the GEMM runs (Hopper), such a layer keeps only the
tiled streams on the GPU: `module_forward` moves the module's checkpoint tensors to host memory (the reference
path and `state_dict` read them there), so the layer's GPU memory is its stored size, not twice it
(QTOOL_MIXED_KEEP_CHECKPOINT=1 keeps them on the GPU).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch, f16_ws, tma

SOURCE = "mixed/gemv.cu"
LAYOUT = "mixed-2-4-16"
GEMV_MAX_M = 16
TOKEN_SLOTS = (1, 2, 4, 8, 16)  # the GEMV's builds: M is rounded up to one of these
ROWS = 4  # output rows per block: must match the entries of kernels/mixed/gemv.cu
MAX_WARPS = 8  # must match MAX_WARPS in kernels/mixed/gemv.cu
# Warps per block (at most; fewer where K has fewer 64-channel blocks). At one token, 2 warps of 4-row blocks beat 1
# and 4 warps and 2- and 8-row blocks at 4096x4096, 4096x11008, 11008x4096 and 8192x28672 on an H100, and 1 and 4
# warps on an H200 (tied with 1 at 8192x28672; kernels/NOTES.md).
GEMV_WARPS = cc.env_int("QTOOL_MIXED_WARPS", 2)
# "fused" or "spmv". At one token with 0.2% outliers, fused 4.65 / 11.71 / 10.47 / 43.29 us at 4096x4096 /
# 4096x11008 / 11008x4096 / 8192x28672 (KxN) against 7.7 / 14.8 / 15.2 / 45.7 as a second kernel (tiled GEMV, an
# H100); the direct GEMV on an H200: 6.32 / 15.22 / 14.48 / 59.54 against 7.97 / 17.48 / 16.97 / 60.99
# (kernels/NOTES.md).
OUTLIERS = "fused"
# The prefill GEMM's outliers: "spmv" (mixed_spmv after the GEMM) or "fused" (its epilogue, which walks each row's
# outliers serially: Llama-2-7B prefill of 128 tokens with 0.2% outliers ran at 0.19x FP16 against 0.69x without
# outliers on an H100, kernels/NOTES.md).
GEMM_OUTLIERS = "spmv"
MAX_K = 1 << 20  # binfo holds 4-bit ranks in 16 bits: K/16 < 2^16
# The tiled GEMV: 4-row blocks (must match its entries in kernels/mixed/gemv.cu), 2 warps, and at one token the
# next block's loads ahead of the arithmetic (the only one-token build). At one token on an H100 these were best or
# within noise of the best at the Llama-2-7B shapes and 8192x28672 (4096x4096: 4.21 us, without the prefetch 4.88,
# 1 warp 6.44, 8-row blocks 4.72-7.78; kernels/mixed/NOTES.md).
TILED_ROWS = 4
TILED_WARPS = cc.env_int("QTOOL_MIXED_TILED_WARPS", 2)
# 0 (default): where the GEMM runs, a layer with tiled streams keeps only them on the GPU (module_forward moves its
# checkpoint tensors to host memory); 1: the checkpoint tensors stay on the GPU as well (the direct GEMV and the
# dequantize kernel need them).
KEEP_CHECKPOINT = cc.env_int("QTOOL_MIXED_KEEP_CHECKPOINT", 0)
# 1 (default): more than GEMV_MAX_M tokens take the tensor-core GEMM on a Hopper GPU; 0: dequantize + cuBLAS (the
# layers then keep their checkpoint tensors on the GPU)
GEMM = cc.env_int("QTOOL_MIXED_GEMM", 1)


@dataclass
class Prepared:
    """Device-side view of one layer, ready for the kernels: binfo, the outliers, and the checkpoint tensors plus s2f
    (the direct GEMV and the dequantize kernel), the tiled streams (the tiled GEMV and the GEMM), or both."""

    binfo: torch.Tensor  # int32 [K/64]
    rowptr: torch.Tensor
    ocols: torch.Tensor
    ovals: torch.Tensor
    in_features: int
    out_features: int
    scale_group_size: int
    s2: int
    s4: int
    block4: bool  # every 64-channel block holds exactly one 4-bit stripe
    nnz: int
    source_ptr: int
    qweight_a: torch.Tensor | None = None
    qweight_b: torch.Tensor | None = None
    scale_codes: torch.Tensor | None = None
    zeros2: torch.Tensor | None = None
    s2f: torch.Tensor | None = None  # float32 [N/g2, S2, 2]: 64·s2, 64·u·s2
    scales4: torch.Tensor | None = None
    zeros4: torch.Tensor | None = None
    tiled: Tiled | None = None  # the tiled streams (block4 layers with g2 a multiple of 4)
    maps: tma.MapCache | None = None  # the warp-specialized GEMM's tensor map of ta
    otile: TileOutliers | None = None  # the outliers as the tile form adds them (tile_outliers)

    @property
    def has_checkpoint(self) -> bool:
        """Whether the checkpoint-layout tensors are on the device (the direct GEMV, the dequantize kernel)."""
        return self.qweight_a is not None

    @property
    def device(self) -> torch.device:
        return self.binfo.device

    def _need_checkpoint(self, what: str) -> None:
        if not self.has_checkpoint:
            raise ValueError(
                f"{what}: this {LAYOUT} layer keeps only its tiled streams on the GPU (prepare it with "
                "keep_checkpoint=True)"
            )

    def layer_args(self) -> tuple:
        self._need_checkpoint("the checkpoint-layout kernels")
        p = self
        return (
            cc.ptr(p.qweight_a),
            cc.ptr(p.qweight_b),
            cc.ptr(p.scale_codes),
            cc.ptr(p.zeros2),
            cc.ptr(p.s2f),
            cc.ptr(p.scales4),
            cc.ptr(p.zeros4),
            cc.ptr(p.binfo),
        )

    def shape_args(self) -> tuple:
        self._need_checkpoint("the checkpoint-layout kernels")
        p = self
        return (
            cc.i32(p.out_features),
            cc.i32(p.in_features),
            cc.i32(p.s2),
            cc.i32(p.s4),
            cc.i32(p.scale_codes.shape[1]),
            cc.i32(p.zeros2.shape[1]),
            cc.i32(p.zeros4.shape[1]),
            cc.i32(p.scale_group_size),
        )

    def nbytes(self, layout: str | None = None) -> int:
        """Bytes the GEMV reads of the layer (what it streams and what it looks up) on `layout` ("tiled" or
        "direct"; by default the one `gemv` takes)."""
        if gemv_layout(self, layout) == "tiled":
            t = self.tiled
            ts = [t.ta, t.tm, t.tz, t.tt, self.binfo]
        else:
            ts = [
                self.qweight_a,
                self.qweight_b,
                self.scale_codes,
                self.zeros2,
                self.s2f,
                self.scales4,
                self.zeros4,
                self.binfo,
            ]
        if self.nnz:
            ts += [self.rowptr, self.ocols, self.ovals]
        return sum(t.numel() * t.element_size() for t in ts)

    def tensors(self) -> list[torch.Tensor]:
        """Every device tensor of the view (what it holds in GPU memory)."""
        ts = [
            self.binfo,
            self.rowptr,
            self.ocols,
            self.ovals,
            self.qweight_a,
            self.qweight_b,
            self.scale_codes,
            self.zeros2,
            self.s2f,
            self.scales4,
            self.zeros4,
        ]
        if self.tiled is not None:
            ts += [self.tiled.ta, self.tiled.tm, self.tiled.tz, self.tiled.tt]
        return [t for t in ts if t is not None]


@dataclass
class Tiled:
    """The tiled streams of a block4 layer (kernels/mixed/gemv.cu, "The tiled GEMV"), int32 words."""

    ta: (
        torch.Tensor
    )  # [N, K/16]: per 64-channel block, its three 2-bit stripes, then its 4-bit stripe's first half
    tm: (
        torch.Tensor
    )  # [N, K/32]: per block, its 4-bit stripe's second half; s4 | c0, c1, c2 << 16.. | z4 << 28
    tz: torch.Tensor  # [ceil(N/4), K/64]: the 2-bit zeros of 4 rows
    tt: torch.Tensor  # [N/g2, K/32]: per block, s2 of its three 2-bit stripes and their u


def _words(t: torch.Tensor) -> torch.Tensor:
    """int32 words as int64 in 0..2^32-1."""
    return t.to(torch.int64) & 0xFFFFFFFF


def _int32(t: torch.Tensor) -> torch.Tensor:
    return torch.where(t >= 1 << 31, t - (1 << 32), t).to(torch.int32)


def _fields(words: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first `count` `bits`-bit codes of each row of packed words [R, W] (LSB-first), int64 [R, count]."""
    per = 32 // bits
    shifts = torch.arange(per, device=words.device) * bits
    return ((_words(words).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1)[
        :, :count
    ]


def pair_order(words: torch.Tensor, bits: int) -> torch.Tensor:
    """Code words (int64, codes LSB-first) with codes 2n, 2n+1 moved to fields n of the low and high halves (the
    tiled order: an unpacked pair is (w_2n, w_2n+1), the order of the activations' 32-bit words)."""
    mask = (1 << bits) - 1
    out = torch.zeros_like(words)
    for j in range(32 // bits):
        out |= ((words >> (bits * j)) & mask) << (bits * (j // 2) + 16 * (j % 2))
    return out


def tiled_streams(
    qweight_a: torch.Tensor,
    qweight_b: torch.Tensor,
    scale_codes: torch.Tensor,
    zeros2: torch.Tensor,
    scales_2nd: torch.Tensor,
    zeros_2nd: torch.Tensor,
    scales4: torch.Tensor,
    zeros4: torch.Tensor,
    binfo: torch.Tensor,
    scale_group_size: int,
) -> Tiled:
    """The tiled streams of a block4 layer with group_size 16 (built where qweight_a lives): the same bits as the
    checkpoint tensors but the second-order zero, which takes 4 bits instead of 8, and each block's zeros, padded
    from 6 to 8 bits."""
    n, k = qweight_a.shape[0], qweight_a.shape[1] * 16
    nblk = k // 64
    dev = qweight_a.device
    info = _words(binfo.to(dev))
    pos = torch.stack(
        [(info >> (24 + 2 * i)) & 3 for i in range(4)], dim=-1
    )  # [nblk, 4]: 2-bit ones, then 4-bit
    qa = torch.gather(_words(qweight_a).reshape(n, nblk, 4), 2, pos.expand(n, nblk, 4))
    ta = torch.cat([pair_order(qa[..., :3], 2), pair_order(qa[..., 3:], 4)], dim=-1)
    s2 = 3 * nblk
    c = _fields(scale_codes, 4, s2).reshape(n, nblk, 3)
    s4 = scales4.to(dev).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    z4 = _fields(zeros4, 4, nblk)
    my = s4 | (c[..., 0] << 16) | (c[..., 1] << 20) | (c[..., 2] << 24) | (z4 << 28)
    tm = torch.stack([pair_order(_words(qweight_b), 4), my], dim=-1)
    z = _fields(zeros2, 2, s2).reshape(n, nblk, 3)
    zb = z[..., 0] | (z[..., 1] << 2) | (z[..., 2] << 4)
    groups = -(-n // 4)
    zb = torch.cat([zb, zb.new_zeros(4 * groups - n, nblk)]).reshape(groups, 4, nblk)
    tz = sum(zb[:, r] << (8 * r) for r in range(4))
    h = scales_2nd.shape[0]
    sc2 = (scales_2nd.to(dev).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF).reshape(h, nblk, 3)
    u = zeros_2nd.to(dev).to(torch.int64).reshape(h, nblk, 3)
    tt = torch.stack(
        [
            sc2[..., 0] | (sc2[..., 1] << 16),
            sc2[..., 2] | (u[..., 0] << 16) | (u[..., 1] << 20) | (u[..., 2] << 24),
        ],
        dim=-1,
    )
    del scale_group_size  # rows n..n+3 share tt row n // g2 (g2 a multiple of 4: checked by the caller)
    return Tiled(
        ta=_int32(ta).reshape(n, k // 16).contiguous(),
        tm=_int32(tm).reshape(n, 2 * nblk).contiguous(),
        tz=_int32(tz).contiguous(),
        tt=_int32(tt).reshape(h, 2 * nblk).contiguous(),
    )


# The tile form's outliers per 128-row block and 64-channel stage (kernels/mixed/gemm_ws.cu OUT_CAP): the copy warp
# brings this many entries a stage; a block-stage's outliers past them are added by mixed_spmv after the GEMM.
# SmolLM2-135M's mixed-2-4-16 checkpoint (0.2%): 14.7 a block-stage on average, the most 142 (5 of 210 layers past
# 128, all o_proj; 48 the median layer's most).
GEMM_WS_OUT_CAP = 128


@dataclass
class TileOutliers:
    """A layer's outliers as the tile form of the warp-specialized GEMM adds them into its decoded tiles, and those
    past the cap (`rest`: the layer's view holding only them, for mixed_spmv; None when there are none)."""

    optr: torch.Tensor  # int32 [ceil(N/128)·K/64 + 1]: block b's stage gs from optr[b·K/64 + gs]
    olist: torch.Tensor  # int32: row % 128 · 64 + the column in the tile's field order, fp16 bits << 16
    rest: Prepared | None


def tile_outliers(p: Prepared) -> TileOutliers | None:
    """The CSR outliers of `p` ordered by 128-row block and stage, each entry its position in the decoded tile
    (where the tile form writes field i of a stage: column 16 i + j for the stripe at binfo position i, so that a
    column's stripe is found through binfo's inverse) and its fp16 bits: the first GEMM_WS_OUT_CAP of a
    block-stage in CSR order, the others left to mixed_spmv. Built where p's tensors live; None without outliers."""
    if p.nnz == 0:
        return None
    n, k = p.out_features, p.in_features
    dev, nblk, nb = p.ovals.device, k // 64, -(-n // GEMM_ROWS)
    counts = (p.rowptr[1:] - p.rowptr[:-1]).to(torch.int64)
    rows = torch.repeat_interleave(torch.arange(n, device=dev), counts)
    col = p.ocols.to(torch.int64) & 0xFFFF
    gs = col // 64
    info = _words(p.binfo.to(dev))
    pos = torch.stack([(info >> (24 + 2 * i)) & 3 for i in range(4)], dim=-1)  # [nblk, 4]: field -> stripe
    field = torch.argsort(pos, dim=-1)  # [nblk, 4]: stripe -> field (pos is a permutation of 0..3)
    tcol = 16 * field[gs, (col % 64) // 16] + col % 16
    key = (rows // GEMM_ROWS) * nblk + gs
    order = torch.argsort(key, stable=True)  # CSR order within a block-stage
    per = torch.bincount(key, minlength=nb * nblk)
    first = torch.cumsum(per, 0) - per
    rank = torch.empty_like(order)
    rank[order] = torch.arange(p.nnz, device=dev) - first[key[order]]
    kept = rank < GEMM_WS_OUT_CAP
    bits = p.ovals.to(torch.float16).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    entry = (rows % GEMM_ROWS) * 64 + tcol + (bits << 16)
    order = order[kept[order]]
    optr = torch.cat([per.new_zeros(1), torch.cumsum(per.clamp(max=GEMM_WS_OUT_CAP), 0)])
    rest = None
    if not bool(kept.all()):
        left = ~kept
        rowptr = torch.cat([counts.new_zeros(1), torch.cumsum(torch.bincount(rows[left], minlength=n), 0)])
        rest = dataclasses.replace(
            p,
            rowptr=rowptr.to(torch.int32),
            ocols=p.ocols[left].contiguous(),
            ovals=p.ovals[left].contiguous(),
            nnz=int(left.sum()),
            otile=None,
        )
    return TileOutliers(optr=optr.to(torch.int32), olist=_int32(entry[order]), rest=rest)


def tiled_eligible(block4: bool, scale_group_size: int) -> bool:
    return block4 and scale_group_size % 4 == 0


def add_tiled(p: Prepared, scales_2nd: torch.Tensor, zeros_2nd: torch.Tensor) -> Prepared:
    """`p` with its tiled streams (when the layer has a tiled GEMV)."""
    if tiled_eligible(p.block4, p.scale_group_size):
        p.tiled = tiled_streams(
            p.qweight_a,
            p.qweight_b,
            p.scale_codes,
            p.zeros2,
            scales_2nd,
            zeros_2nd,
            p.scales4,
            p.zeros4,
            p.binfo,
            p.scale_group_size,
        )
    return p


def unsupported_reason(group_size: int, in_features: int) -> str | None:
    """Why the kernels cannot run a layer of these parameters (None when they can)."""
    if group_size != 16:
        return f"group_size={group_size} (the kernels cover 16)"
    if in_features % 64:
        return f"in_features={in_features} (the kernels need a multiple of 64)"
    if in_features >= MAX_K:
        return f"in_features={in_features} (the kernels take fewer than {MAX_K})"
    return None


def block_info(stripe_bits: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """binfo (int32 [S/4], see kernels/mixed/gemv.cu) from the stripe widths, and whether every block holds
    exactly one 4-bit stripe."""
    is4 = (stripe_bits.to(torch.int64).cpu() == 4).reshape(-1, 4)
    n4 = is4.sum(1)
    r4 = torch.cumsum(n4, 0) - n4
    # positions of the 2-bit stripes (increasing), then the 4-bit ones: a stable sort on the width
    order = torch.sort(is4.to(torch.int64), dim=1, stable=True).indices
    packed = (order << torch.tensor([0, 2, 4, 6])).sum(1)
    info = r4 | (n4 << 16) | (packed << 24)
    info = torch.where(info >= 1 << 31, info - (1 << 32), info)
    return info.to(torch.int32), bool((n4 == 1).all())


def gemm_capable(device: torch.device | int | None = None) -> bool:
    """Whether the GEMM runs here: a Hopper GPU (wgmma), unless QTOOL_MIXED_GEMM=0."""
    return bool(GEMM) and cc.target_arch(device) == "sm_90a"


def prepare(layout, device: torch.device | None = None, keep_checkpoint: bool | None = None) -> Prepared:
    """The kernel view of a `MixedWeight` (or a `MixedLinear`: anything with the layout's fields) on `device` (by
    default where qweight_a lives, which must then be CUDA). A layer with tiled streams keeps only them (and binfo
    and the outliers) where the GEMM covers its prefill, unless `keep_checkpoint` (default: KEEP_CHECKPOINT) asks
    for the checkpoint tensors too."""
    k, n = layout.in_features, layout.out_features
    reason = unsupported_reason(layout.group_size, k)
    if reason is not None:
        raise cc.CudaUnavailableError(f"{LAYOUT} layer: {reason}; use the reference path")
    dev = torch.device(device) if device is not None else layout.qweight_a.device
    if dev.type != "cuda":
        raise ValueError(f"qweight_a: found device {dev}, expected a CUDA tensor")

    def on(t: torch.Tensor) -> torch.Tensor:
        return t.to(dev).contiguous()

    binfo, block4 = block_info(layout.stripe_bits)
    tiled = tiled_eligible(block4, layout.scale_group_size)
    keep = bool(KEEP_CHECKPOINT) if keep_checkpoint is None else keep_checkpoint
    keep = keep or not tiled or not gemm_capable(dev)
    qa, qb, sc, z2, s4t, z4 = (
        on(t)
        for t in (
            layout.qweight_a,
            layout.qweight_b,
            layout.scale_codes,
            layout.zeros2,
            layout.scales4,
            layout.zeros4,
        )
    )
    p = Prepared(
        binfo=on(binfo),
        rowptr=on(layout.outlier_rowptr),
        ocols=on(layout.outlier_cols),
        ovals=on(layout.outlier_values),
        in_features=k,
        out_features=n,
        scale_group_size=layout.scale_group_size,
        s2=int(layout.scales_2nd.shape[1]),
        s4=int(layout.scales4.shape[1]),
        block4=block4,
        nnz=int(layout.outlier_values.numel()),
        source_ptr=layout.qweight_a.data_ptr(),
    )
    if tiled:
        p.tiled = tiled_streams(
            qa,
            qb,
            sc,
            z2,
            on(layout.scales_2nd),
            on(layout.zeros_2nd),
            s4t,
            z4,
            p.binfo,
            layout.scale_group_size,
        )
    if tiled and gemm_capable(dev):
        p.otile = tile_outliers(p)
    if keep:
        p.qweight_a = qa if qa.data_ptr() % 16 == 0 else qa.clone()
        p.qweight_b, p.scale_codes, p.zeros2, p.scales4, p.zeros4 = qb, sc, z2, s4t, z4
        p.s2f = on(second_order_table(layout.scales_2nd, layout.zeros_2nd))
    return p


def offload_checkpoint(layer: torch.nn.Module) -> None:
    """Move a MixedLinear's checkpoint tensors to host memory (its prepared view holds what the kernels read)."""
    for f in layer.layout_cls.FIELDS:
        t = getattr(layer, f)
        if t.is_cuda:
            setattr(layer, f, t.cpu())


def second_order_table(scales_2nd: torch.Tensor, zeros_2nd: torch.Tensor) -> torch.Tensor:
    """(64·s2, 64·u·s2) in float32 [N/g2, S2, 2]: both exact (u <= 15 times an fp16 times a power of two)."""
    s2 = scales_2nd.to(torch.float32) * 64
    return torch.stack([s2, zeros_2nd.to(torch.float32) * s2], dim=-1).contiguous()


def _bias(bias: torch.Tensor | None, p: Prepared) -> torch.Tensor | None:
    if bias is None:
        return None
    if bias.numel() != p.out_features:
        raise ValueError(f"bias: found {list(bias.shape)}, expected [{p.out_features}]")
    return bias.to(torch.float16).contiguous()


def token_slots(m: int) -> int:
    for s in TOKEN_SLOTS:
        if m <= s:
            return s
    raise ValueError(f"x: found M={m} tokens, expected 1..{GEMV_MAX_M} for the {LAYOUT} GEMV")


def gemv_warps(k: int, warps: int | None = None) -> int:
    """Warps per block: no more than the row's 64-channel blocks need, at most `warps` (default GEMV_WARPS)."""
    want = GEMV_WARPS if warps is None else warps
    return max(1, min(want, MAX_WARPS, -(-(k // 64) // 32)))


def spmv(x2: torch.Tensor, p: Prepared, out: torch.Tensor) -> torch.Tensor:
    """out[M, N] += the outliers' product with x2 (fp16, in place), one warp per row."""
    if p.nnz == 0:
        return out
    dev = cc.device_index(x2.device)
    fn = cc.load_module(SOURCE, device=dev).fn("mixed_spmv")
    m = x2.shape[0]
    dependent_launch.launch(
        fn,
        (-(-p.out_features // 8),),
        (256,),
        (
            cc.ptr(p.rowptr),
            cc.ptr(p.ocols),
            cc.ptr(p.ovals),
            cc.ptr(x2),
            cc.ptr(out),
            cc.i32(m),
            cc.i32(p.out_features),
            cc.i32(p.in_features),
        ),
        device=dev,
    )
    return out


def outlier_mode(outliers: str | None = None, default: str = OUTLIERS) -> str:
    """How the GEMV (or, with `default` GEMM_OUTLIERS, the GEMM) adds the outliers: "fused" or "spmv"."""
    mode = default if outliers is None else outliers
    if mode not in ("fused", "spmv"):
        raise ValueError(f"outliers: found {mode!r}, expected fused or spmv")
    return mode


def gemv_layout(p: Prepared, layout: str | None = None) -> str:
    """Which streams the GEMV reads: "tiled" where the layer has them (1.22-1.30x faster at one token on an H100,
    kernels/NOTES.md), else "direct" (the checkpoint tensors); `layout` forces one."""
    if layout is None:
        return "tiled" if p.tiled is not None else "direct"
    if layout not in ("tiled", "direct"):
        raise ValueError(f"layout: found {layout!r}, expected tiled or direct")
    if layout == "tiled" and p.tiled is None:
        raise ValueError(
            "layout: found 'tiled' for a layer without tiled streams (block4 with g2 a multiple of 4)"
        )
    if layout == "direct":
        p._need_checkpoint("layout 'direct'")
    return layout


def gemv(
    x: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    outliers: str | None = None,
    warps: int | None = None,
    layout: str | None = None,
) -> torch.Tensor:
    """y = x . W^T (+ bias) for 1..16 tokens; `outliers` "fused" (in the GEMV) or "spmv" (a second kernel);
    `layout` "tiled" or "direct" (gemv_layout); `warps` overrides the tuned warps per block."""
    lead = x.shape[:-1]
    x2 = cc.f16_rows(x, p.in_features, LAYOUT)
    m = x2.shape[0]
    mt = token_slots(m)
    outliers = outlier_mode(outliers)
    layout = gemv_layout(p, layout)
    out = cc.f16_out(out, (m, p.out_features), x.device)
    dev = cc.device_index(x.device)
    fuse = outliers == "fused" and p.nnz > 0
    tail = (
        cc.ptr(p.rowptr),
        cc.ptr(p.ocols),
        cc.ptr(p.ovals),
        cc.ptr(x2),
        cc.ptr(_bias(bias, p)),
        cc.ptr(out),
        cc.i32(m),
    )
    if layout == "tiled":
        r, w, piped = tiled_config(p.in_features, mt, warps)
        name = f"mixed_gemv_tiled_r{r}_m{mt}_f{int(fuse)}_p{int(piped)}"
        t = p.tiled
        args = (
            cc.ptr(t.ta),
            cc.ptr(t.tm),
            cc.ptr(t.tz),
            cc.ptr(t.tt),
            cc.ptr(p.binfo),
            *tail,
            cc.i32(p.out_features),
            cc.i32(p.in_features // 64),
            cc.i32(p.scale_group_size),
        )
    else:
        r = ROWS
        w = gemv_warps(p.in_features, warps)
        name = f"mixed_gemv_r{ROWS}_m{mt}_b{int(p.block4)}_f{int(fuse)}_p0"
        args = (*p.layer_args(), *tail, *p.shape_args())
    fn = cc.load_module(SOURCE, device=dev).fn(name)
    dependent_launch.launch(fn, (-(-p.out_features // r),), (32 * w,), args, device=dev)
    if not fuse:
        spmv(x2, p, out)
    return out.reshape(*lead, p.out_features)


def tiled_config(k: int, token_slots: int, warps: int | None = None) -> tuple[int, int, bool]:
    """(rows per block, warps per block, prefetch) of the tiled GEMV: the tuned warps unless `warps` is given; the
    prefetch at one token only (the builds for more tokens have none)."""
    return TILED_ROWS, gemv_warps(k, TILED_WARPS if warps is None else warps), token_slots == 1


def dequantize(p: Prepared, outliers: bool = True) -> torch.Tensor:
    """The weight as fp16 [N, K]: the dense part rounded once as the reference casts it, plus the outliers."""
    p._need_checkpoint("dequantize")
    n, k = p.out_features, p.in_features
    out = torch.empty(n, k, dtype=torch.float16, device=p.qweight_a.device)
    dev = cc.device_index(out.device)
    mod = cc.load_module(SOURCE, device=dev)
    threads = n * (k // 64)
    cc.launch(
        mod.fn(f"mixed_dequant_b{int(p.block4)}"),
        (-(-threads // 256),),
        (256,),
        (*p.layer_args(), cc.ptr(out), *p.shape_args()),
        device=dev,
    )
    if outliers and p.nnz:
        cc.launch(
            mod.fn("mixed_outliers_into_dense"),
            (-(-n // 8),),
            (256,),
            (cc.ptr(p.rowptr), cc.ptr(p.ocols), cc.ptr(p.ovals), cc.ptr(out), cc.i32(n), cc.i32(k)),
            device=dev,
        )
    return out


def dequant_matmul(x: torch.Tensor, p: Prepared, bias: torch.Tensor | None = None) -> torch.Tensor:
    b = None if bias is None else bias.to(x.dtype)
    return F.linear(x, dequantize(p), b)


GEMM_SOURCE = "mixed/gemm.cu"
GEMM_ROWS = 128  # weight rows per GEMM block (two warpgroups of 64): must match kernels/mixed/gemm.cu
GEMM_BUILT = {64: 6, 128: 4, 256: 3}  # token tile -> ring stages, as kernels/mixed/gemm.cu instantiates them


def gemm_smem(tokens: int, stages: int) -> int:
    """Dynamic shared memory of a GEMM block: the ring (activations; ta, tm of 128 rows; tz, tt of 32 four-row
    groups; binfo), and slack to align the 1024-byte swizzle atoms (kernels/mixed/gemm.cu MTile)."""
    slot = tokens * 128 + 128 * 16 + 128 * 8 + 32 * 4 + 32 * 8 + 16
    return stages * (-(-slot // 1024) * 1024) + 1024


def gemm_tokens(m: int) -> int:
    """Token tile for M rows: the smallest built tile holding them all, else the largest."""
    tiles = sorted(GEMM_BUILT)
    return next((tn for tn in tiles if m <= tn), tiles[-1])


def plan_split(n: int, m: int, k: int, tokens: int, blocks_per_sm: int, sms: int) -> int:
    """Blocks splitting K per output tile: as many as keep every block in one wave, at most 16, at least 4 stages
    each (grouped_int's rule for its wgmma kernel)."""
    tiles = -(-n // GEMM_ROWS) * -(-m // tokens)
    return max(1, min(blocks_per_sm * sms // tiles, k // 64 // 4, 16))


def gemm_reason(p: Prepared) -> str | None:
    """Why the GEMM cannot run this layer here (None when it can)."""
    if p.tiled is None:
        return "no tiled streams (block4 layers with g2 a multiple of 4)"
    if not gemm_capable(p.device):
        return f"the GEMM needs a Hopper GPU (wgmma; found {cc.target_arch(p.device)}) and QTOOL_MIXED_GEMM=1"
    return None


def gemm(
    x: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tokens: int | None = None,
    split: int | None = None,
    outliers: str | None = None,
) -> torch.Tensor:
    """y = x . W^T (+ bias) (+ the outliers) with the tensor-core GEMM on the tiled streams; x fp16 [..., K], any
    number of rows. `tokens` (token tile) and `split` (blocks per output tile along K) override the defaults;
    `outliers` "spmv" (a second kernel) or "fused" (the GEMM's epilogue), by default GEMM_OUTLIERS."""
    from qtool.cuda import split_k

    fused = outlier_mode(outliers, GEMM_OUTLIERS) == "fused"
    reason = gemm_reason(p)
    if reason is not None:
        raise cc.CudaUnavailableError(f"{LAYOUT} GEMM: {reason}")
    lead = x.shape[:-1]
    x2 = cc.f16_rows(x, p.in_features, LAYOUT)
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    m, k, n = x2.shape[0], p.in_features, p.out_features
    out = cc.f16_out(out, (m, n), x.device)
    if m == 0:
        return out.reshape(*lead, n)
    tn = gemm_tokens(m) if tokens is None else tokens
    if tn not in GEMM_BUILT:
        raise ValueError(f"tokens: found {tn}, expected one of {tuple(GEMM_BUILT)}")
    st = GEMM_BUILT[tn]
    dev = cc.device_index(x.device)
    fn = cc.load_module(GEMM_SOURCE, device=dev).fn(f"mixed_gemm_n{tn}_s{st}")
    smem = gemm_smem(tn, st)
    cc.allow_shared_memory(fn, smem)
    nblk = k // 64
    if split is None:
        split = plan_split(n, m, k, tn, cc.resident_blocks(fn, 256, smem, dev), cc.sm_count(dev))
    if not 1 <= split <= nblk:
        raise ValueError(f"split: found {split}, expected 1..{nblk} (64-channel blocks)")
    tiles = -(-n // GEMM_ROWS) * -(-m // tn)
    split, ws, cnt = split_k.split_buffers(dev, split, tiles, GEMM_ROWS, tn)
    t = p.tiled
    cc.launch(
        fn,
        (-(-n // GEMM_ROWS), -(-m // tn), split),
        (256,),
        (
            cc.ptr(x2),
            cc.i32(k),
            cc.ptr(t.ta),
            cc.ptr(t.tm),
            cc.ptr(t.tz),
            cc.ptr(t.tt),
            cc.ptr(p.binfo),
            cc.ptr(p.rowptr if p.nnz and fused else None),
            cc.ptr(p.ocols),
            cc.ptr(p.ovals),
            cc.ptr(_bias(bias, p)),
            cc.ptr(out),
            cc.i32(n),
            cc.ptr(ws),
            cc.ptr(cnt),
            cc.i32(m),
            cc.i32(n),
            cc.i32(nblk),
            cc.i32(p.scale_group_size),
        ),
        shared_mem=smem,
        device=dev,
    )
    if not fused:
        spmv(x2, p, out)
    return out.reshape(*lead, n)


GEMM_WS_SOURCE = "mixed/gemm_ws.cu"
# The two forms of kernels/mixed/gemm_ws.cu: "regs" (common/f16_ws_wgmma.cuh: a copy warp and two MMA warpgroups
# whose lanes decode their own A fragments) and "tile" (common/f16_ws_tile_wgmma.cuh: two decode warpgroups write
# an fp16 tile that wgmma reads from shared memory beside two MMA warpgroups). Threads per block:
# (form, token tile) -> (copy-ring slots, decoded tiles, blocks per SM its registers are capped for), as
# kernels/mixed/gemm_ws.cu instantiates them: each ring as deep as fits those blocks, at most 12 copy slots; the
# tile form keeps 4 decoded tiles (two being decoded, two read by wgmmas in flight) and stops at 128 tokens (a
# 512-thread block has 128 registers a thread). The regs form stops at 128 too: an SM's four schedulers hold 16K
# registers each, so the 9 warps of a block put 3 on one of them (170 registers a thread), and the 256-token tile's
# 224 registers do not launch (CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES on an H200).
GEMM_WS_BUILT = {
    ("regs", 16): (12, 0, 2),
    ("regs", 32): (12, 0, 2),
    ("regs", 64): (9, 0, 2),
    ("regs", 128): (11, 0, 1),
    ("tile", 16): (7, 4, 2),
    ("tile", 32): (5, 4, 2),
    ("tile", 64): (12, 4, 1),
    ("tile", 128): (8, 4, 1),
}
GEMM_WS_TOKENS = (16, 32, 64, 128)
# The form by default, from one `scripts/mixed_ws_variants.py` run (H200, kernels/mixed/NOTES.md): without outliers
# the regs form at every token tile (it reads no decoded tile; ahead of the tile form at 15 of the 16 cells of the
# Llama-2-7B shapes and 8192x28672 at 16-2048 tokens), with outliers the tile form (it adds them in its decoded tile,
# 2-6x ahead of either GEMM followed by mixed_spmv from 64 tokens up).
GEMM_WS_FORM = {False: "regs", True: "tile"}
# The largest M an outlier-free layer sends to gemm_ws; above, gemm.cu's 256-token tiles, which decode each row half
# as often. The same runs (kernels/mixed/NOTES.md): gemm_ws ahead of gemm.cu by 1.3-1.5x at 16 tokens, at 256 on
# three of four shapes and at 512 on the three timed, behind by 3-7% at 64 on three; even at 1024, gemm.cu ahead at
# 2048 on three of four. A layer with outliers always takes gemm_ws (gemm.cu adds them by mixed_spmv: 1.8-5x slower).
GEMM_WS_MAX_M = 512
# The most tokens the GEMV takes where gemm_ws runs; from 5 up, gemm_ws. The same kind of run (H200, 4096x4096,
# 11008x4096, 8192x28672, 0 and 0.2% outliers): the GEMV ahead at 2 and 4 tokens (1.0-2.8x), gemm_ws at 8 (1.2-1.7x)
# and 16 (2.3-3.5x).
GEMV_BEFORE_GEMM_WS_M = 4
# a stage's tiled words (kernels/mixed/tiled.cuh MixedWords) and the tile form's outlier entries (OUT_CAP)
GEMM_WS_WORDS = 128 * 16 + 128 * 8 + 32 * 4 + 32 * 8 + 16 + 4 * 128
# 1 (default): linear's "gemm" path takes gemm_ws where takes_gemm_ws says; 0: always the block-synchronous gemm.cu.
GEMM_WS = cc.env_int("QTOOL_MIXED_GEMM_WS", 1)


def gemm_ws_smem(tokens: int, copy_stages: int, tile_stages: int) -> int:
    """Dynamic shared memory of a warp-specialized GEMM block (qtool/cuda/f16_ws.py `smem` with this decode's words)."""
    return f16_ws.smem(tokens, GEMM_WS_WORDS, copy_stages, tile_stages)


def gemm_ws_fits(form: str, tokens: int) -> bool:
    """Whether the build fits its blocks per SM in shared memory (qtool/cuda/f16_ws.py `fits`)."""
    sc, sa, blocks = GEMM_WS_BUILT[form, tokens]
    return f16_ws.fits(tokens, GEMM_WS_WORDS, sc, sa, blocks)


def gemm_ws_entry(form: str, tokens: int) -> str:
    """The kernel name of a build (kernels/mixed/gemm_ws.cu's entry macros)."""
    sc, sa, _ = GEMM_WS_BUILT[form, tokens]
    return f"mixed_gemm_ws_n{tokens}_s{sc}" if form == "regs" else f"mixed_gemm_wst_n{tokens}_s{sc}_a{sa}"


def gemm_ws_plan(
    m: int, tokens: int | None = None, form: str | None = None, outliers: bool = False
) -> tuple[str, int]:
    """(form, token tile) for M rows: the smallest tile holding them all, else the largest; GEMM_WS_FORM for a layer
    with or without `outliers` unless `form` is given, a given `tokens` kept."""
    tn = next((t for t in GEMM_WS_TOKENS if m <= t), GEMM_WS_TOKENS[-1]) if tokens is None else tokens
    fm = GEMM_WS_FORM[bool(outliers)] if form is None else form
    if (fm, tn) not in GEMM_WS_BUILT:
        built = sorted(GEMM_WS_BUILT)
        raise ValueError(f"tokens, form: found {tn}, {fm!r}, expected one of {built}")
    return fm, tn


_X_MAPS = tma.MapCache(limit=64)


def gemm_ws(
    x: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tokens: int | None = None,
    split: int | None = None,
    form: str | None = None,
    outliers: str | None = None,
) -> torch.Tensor:
    """y = x . W^T (+ bias) + the outliers with the warp-specialized tensor-core GEMM on the tiled streams
    (kernels/mixed/gemm_ws.cu); the contract of `gemm`: x fp16 [..., K], any number of rows. `tokens` (16 to 128),
    `form` ("regs" or "tile", GEMM_WS_BUILT) and `split` (blocks per output tile along K) override the defaults
    (gemm_ws_plan, plan_split). `outliers`: "tile" (the tile form's default: it adds them into its decoded tiles,
    mixed_spmv those past a block-stage's cap, `tile_outliers`) or "spmv" (mixed_spmv after the GEMM: the regs
    form's only way)."""
    from qtool.cuda import split_k

    reason = gemm_reason(p)
    if reason is not None:
        raise cc.CudaUnavailableError(f"{LAYOUT} GEMM: {reason}")
    lead = x.shape[:-1]
    x2 = cc.f16_rows(x, p.in_features, LAYOUT)  # contiguous, 16-byte aligned: what a tensor map needs
    m, k, n = x2.shape[0], p.in_features, p.out_features
    out = cc.f16_out(out, (m, n), x.device)
    if m == 0:
        return out.reshape(*lead, n)
    fm, tn = gemm_ws_plan(m, tokens, form, outliers=p.nnz > 0 and outliers != "spmv")
    sc, sa, _ = GEMM_WS_BUILT[fm, tn]
    if outliers not in (None, "tile", "spmv"):
        raise ValueError(f"outliers: found {outliers!r}, expected tile or spmv")
    if outliers == "tile" and fm != "tile":
        raise ValueError("outliers: found 'tile' with the regs form, which adds none; expected spmv")
    in_tile = p.otile is not None and fm == "tile" and outliers != "spmv"
    threads = f16_ws.THREADS[fm]
    dev = cc.device_index(x.device)
    fn = cc.load_module(GEMM_WS_SOURCE, device=dev).fn(gemm_ws_entry(fm, tn))
    smem = gemm_ws_smem(tn, sc, sa)
    cc.allow_shared_memory(fn, smem)
    nblk = k // 64
    if split is None:
        blocks = cc.resident_blocks(fn, threads, smem, dev)
        split = plan_split(n, m, k, tn, blocks, cc.sm_count(dev))
    if not 1 <= split <= nblk:
        raise ValueError(f"split: found {split}, expected 1..{nblk} (64-channel blocks)")
    tiles = -(-n // GEMM_ROWS) * -(-m // tn)
    split, ws, cnt = split_k.split_buffers(dev, split, tiles, GEMM_ROWS, tn)
    t = p.tiled
    if p.maps is None:
        p.maps = tma.MapCache(limit=2)
    # token boxes past M read rows the storage holds where it has them (tma.padded_rows): their products land in
    # accumulator columns that are never stored
    mx = _X_MAPS.get(tma.padded_rows(x2, tn), 128, tn, 128)
    mta = p.maps.get(t.ta, 16, GEMM_ROWS, 0)
    olists = ()  # the tile entries' optr and olist (null: no outliers in the tile)
    if fm == "tile":
        olists = (cc.ptr(p.otile.optr), cc.ptr(p.otile.olist)) if in_tile else (cc.ptr(None), cc.ptr(None))
    dependent_launch.launch(
        fn,
        (-(-n // GEMM_ROWS), -(-m // tn), split),
        (threads,),
        (
            mx,
            mta,
            cc.ptr(t.tm),
            cc.ptr(t.tz),
            cc.ptr(t.tt),
            cc.ptr(p.binfo),
            *olists,
            cc.ptr(_bias(bias, p)),
            cc.ptr(out),
            cc.i32(n),
            cc.ptr(ws),
            cc.ptr(cnt),
            cc.i32(m),
            cc.i32(n),
            cc.i32(nblk),
            cc.i32(p.scale_group_size),
        ),
        shared_mem=smem,
        device=dev,
    )
    if not in_tile:
        spmv(x2, p, out)
    elif p.otile.rest is not None:
        spmv(x2, p.otile.rest, out)
    return out.reshape(*lead, n)


PATHS = ("gemv", "gemm", "dequant+cublas", "reference")


def takes_gemm_ws(m: int, p: Prepared) -> bool:
    """Whether the "gemm" path runs gemm_ws (rather than gemm.cu) for M rows of this layer (GEMM_WS_MAX_M)."""
    return bool(GEMM_WS) and (p.nnz > 0 or m <= GEMM_WS_MAX_M)


def choose_path(m: int, dtype: torch.dtype, group_size: int, in_features: int, gemm_ok: bool = False) -> str:
    """The path a layer takes for M tokens: gemv, gemm (where `gemm_ok`: gemm_reason is None), dequant+cublas or
    reference."""
    if unsupported_reason(group_size, in_features) is not None or dtype != torch.float16:
        return "reference"
    if 1 <= m <= (GEMV_BEFORE_GEMM_WS_M if gemm_ok and GEMM_WS else GEMV_MAX_M):
        return "gemv"
    return "gemm" if gemm_ok else "dequant+cublas"


def linear(
    x: torch.Tensor, p: Prepared, bias: torch.Tensor | None = None, path: str | None = None
) -> torch.Tensor:
    m = x.numel() // max(1, x.shape[-1])
    if path is None:
        path = choose_path(m, x.dtype, 16, p.in_features, gemm_reason(p) is None)
    if path == "gemv":
        return gemv(x, p, bias)
    if path == "gemm":
        return gemm_ws(x, p, bias) if takes_gemm_ws(m, p) else gemm(x, p, bias)
    if path == "dequant+cublas":
        return dequant_matmul(x, p, bias)
    raise cc.CudaUnavailableError(
        f"{LAYOUT}: no CUDA path for M={m}, dtype={x.dtype}; use the reference path"
    )


def swiglu_interleaved(gu: torch.Tensor) -> torch.Tensor:
    """SwiGLU of a row-interleaved gate/up output [..., N] (in each run of four: gate 2j, 2j + 1, up 2j, 2j + 1)
    -> [..., N/2], rounded as torch's F.silu and half multiply round it (as kernels/decoder/swiglu.cu)."""
    v = gu.reshape(*gu.shape[:-1], gu.shape[-1] // 4, 2, 2)
    gate = v[..., 0, :].reshape(*gu.shape[:-1], gu.shape[-1] // 2)
    up = v[..., 1, :].reshape(*gu.shape[:-1], gu.shape[-1] // 2)
    return F.silu(gate) * up


def gemv_swiglu(
    x: torch.Tensor,
    p: Prepared,
    out: torch.Tensor | None = None,
    outliers: str | None = None,
) -> torch.Tensor:
    """SwiGLU of a row-interleaved gate/up projection (swiglu_interleaved) for one token, in the tiled GEMV's
    epilogue: [..., K] -> [..., N/2]."""
    if p.tiled is None:
        raise ValueError("layer: found no tiled streams, expected a block4 layer with g2 a multiple of 4")
    if p.out_features % 4:
        raise ValueError(
            f"out_features: found {p.out_features}, expected a multiple of 4 (gate/up in runs of four)"
        )
    lead = x.shape[:-1]
    x2 = cc.f16_rows(x, p.in_features, LAYOUT)
    if x2.shape[0] != 1:
        raise ValueError(f"x: found M={x2.shape[0]} tokens, expected 1 for the SwiGLU GEMV")
    fuse = outlier_mode(outliers) == "fused" and p.nnz > 0
    if not fuse and p.nnz:
        raise ValueError(
            "outliers: found 'spmv', expected 'fused' for the SwiGLU GEMV (it stores no projection)"
        )
    _, w, piped = tiled_config(p.in_features, 1)
    out = cc.f16_out(out, (1, p.out_features // 2), x.device)
    dev = cc.device_index(x.device)
    t = p.tiled
    fn = cc.load_module(SOURCE, device=dev).fn(f"mixed_gemv_tiled_swiglu_m1_f{int(fuse)}_p{int(piped)}")
    dependent_launch.launch(
        fn,
        (p.out_features // 4,),
        (32 * w,),
        (
            cc.ptr(t.ta),
            cc.ptr(t.tm),
            cc.ptr(t.tz),
            cc.ptr(t.tt),
            cc.ptr(p.binfo),
            cc.ptr(p.rowptr),
            cc.ptr(p.ocols),
            cc.ptr(p.ovals),
            cc.ptr(x2),
            cc.ptr(out),
            cc.i32(1),
            cc.i32(p.out_features),
            cc.i32(p.in_features // 64),
            cc.i32(p.scale_group_size),
        ),
        device=dev,
    )
    return out.reshape(*lead, p.out_features // 2)


def _layer_path(layer: torch.nn.Module, x: torch.Tensor) -> tuple[str, Prepared | None]:
    """The path of a MixedLinear's forward on `x`, and its kernel view (None: the caller runs the reference)."""
    if cc.kernel_mode() == "reference":
        return "reference", None
    m = x.numel() // max(1, x.shape[-1])
    path = choose_path(m, x.dtype, layer.group_size, layer.in_features)
    reason = None
    if path == "reference":
        reason = unsupported_reason(layer.group_size, layer.in_features) or f"dtype {x.dtype}"
    if not cc.use_kernels(LAYOUT, reason):
        return "reference", None

    def make() -> Prepared:
        p = prepare(layer, device=x.device)
        if not p.has_checkpoint:
            offload_checkpoint(layer)
            p.source_ptr = layer.qweight_a.data_ptr()
        return p

    p = layer.derived(
        "cuda", make, valid=lambda p: p.source_ptr == layer.qweight_a.data_ptr() and p.device == x.device
    )
    if gemm_reason(p) is None:  # the GEMM runs here: it takes over from the GEMV where it is faster too
        path = choose_path(m, x.dtype, layer.group_size, layer.in_features, gemm_ok=True)
    return path, p


def module_forward(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """CUDA forward of a MixedLinear, or None when the caller should run the reference path (QTOOL_KERNELS=cuda
    turns every fallback into a one-line error instead)."""
    path, p = _layer_path(layer, x)
    if p is None:
        return None
    return linear(x, p, layer.bias, path)


def module_forward_swiglu(layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU of a row-interleaved gate/up MixedLinear (swiglu_interleaved) on CUDA, in the GEMV's epilogue for one
    token of a tiled layer without bias; None when the caller should run the reference path."""
    path, p = _layer_path(layer, x)
    if p is None:
        return None
    m = x.numel() // max(1, x.shape[-1])
    if path == "gemv" and m == 1 and p.tiled is not None and layer.bias is None and p.out_features % 4 == 0:
        return gemv_swiglu(x, p)
    return swiglu_interleaved(linear(x, p, layer.bias, path))
