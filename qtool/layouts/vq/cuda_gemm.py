"""CUDA execution of the `vq` layout for prefill (kernels/vq/gemm.cu): the fused VQ GEMM, its launch plan and the
dispatch rule for more than MIN_M - 1 rows (the decode GEMV serves fewer).

The kernel decodes codes straight into the A operand of Hopper's wgmma (y^T = W . x^T, weight rows as the MMA's M
dimension, tokens as its N); no dequantized weight is written anywhere. It is built per VQ configuration
(vector size d, index bits b, residuals z) from one template; BUILT lists the configurations, their token tiles
and ring depths. The checkpoint's tensors are used in place (16-byte aligned copies only where they are not).
Anything the kernel does not cover runs the torch reference (or is a one-line error under QTOOL_KERNELS=cuda).
"""

from __future__ import annotations

import torch

from qtool.cuda import compile as cc
from qtool.cuda import dependent_launch, f16_ws, split_k, tma
from qtool.layouts.vq.cuda import Prepared, layer_view, view

SOURCE = "vq/gemm.cu"
LAYOUT = "vq"
MIN_M = 17  # the reference path's lookup GEMV (and the decode kernel) take up to 16 rows
ROWS = 128  # weight rows per block (two warpgroups of 64): must match kernels/vq/gemm.cu
STAGE_COLS = 64  # input columns per pipeline stage
# (d, index bits, z) -> {token tile: ring depth}, as kernels/vq/gemm.cu instantiates them. GPTVQ-2's 2 KiB scopes
# ride in the ring; AQLM-3's 128 KiB stay resident beside it, which leaves room for 128-token tiles at most.
BUILT: dict[tuple[int, int, int], dict[int, int]] = {
    (4, 8, 1): {32: 6, 64: 6, 128: 4, 256: 4},
    (8, 12, 2): {32: 6, 64: 4, 128: 3},
}
# Codebooks larger than this are resident (kernels/vq/gemm.cu VqCfg::RESIDENT); smaller ones ride in the ring.
RESIDENT_BYTES = 16384
# How decoded entries reach the A fragments (kernels/vq/gemm.cu F): "shfl", VQ-LLM's register-level fusion (Sec.
# VI-B: a lane looks up whole entries and the quad swaps pairs with shfl_xor); "direct", every lane reading from the
# shared codebook only the 4-byte pairs it consumes; "replica" (d = 4, one residual), "direct" from a codebook
# replicated so that every lane reads its own bank. "direct" is the default: on an H100 (`qtool bench kernels`,
# kernels/NOTES.md) it beat "shfl" by 3-12% with d = 8 and matched or beat it with d = 4, and "replica" was 1.2-2.6x
# slower than "direct" (filling 32 KiB of replicas per column tile costs more than the bank conflicts it removes).
FUSIONS = {"shfl": 1, "direct": 0, "replica": 2}
DEFAULT_FUSION = {(4, 8, 1): "direct", (8, 12, 2): "direct"}


def unsupported_reason(
    vector_size: int,
    entries: int,
    residuals: int,
    in_features: int,
    tile_rows: int | None,
    tile_cols: int | None,
) -> str | None:
    """Why the GEMM cannot run a layer of these parameters (None when it can); the device is checked apart."""
    bits = entries.bit_length() - 1
    if (vector_size, bits, residuals) not in BUILT:
        built = ", ".join(f"VQ<{d},{b},{z}>" for d, b, z in BUILT)
        return f"VQ<{vector_size},{bits},{residuals}> (the GEMM is built for {built})"
    if in_features % STAGE_COLS:
        return f"in_features {in_features} (the GEMM needs a multiple of {STAGE_COLS})"
    if tile_cols is not None and tile_cols % STAGE_COLS:
        return f"tile_cols {tile_cols} (the GEMM switches codebooks at {STAGE_COLS}-column stages: needs a multiple)"
    if tile_rows is not None and tile_rows % ROWS:
        return f"tile_rows {tile_rows} (the GEMM's {ROWS}-row blocks need a multiple)"
    cbytes = residuals * entries * vector_size * 2
    if cbytes > RESIDENT_BYTES and tile_cols is not None and tile_cols < in_features:
        return (
            f"{cbytes // 1024} KiB codebooks switched along K (resident codebooks need one column tile, "
            "tile_cols null)"
        )
    return None


def device_reason(device: int | None = None) -> str | None:
    arch = cc.target_arch(device)
    return None if arch == "sm_90a" else f"the VQ GEMM needs a Hopper GPU (wgmma; found {arch})"


def prepare(
    indices: torch.Tensor,
    codebooks: torch.Tensor,
    vector_size: int,
    entries: int,
    residuals: int,
    in_features: int,
    out_features: int,
    tile_rows: int | None,
    tile_cols: int | None,
) -> Prepared:
    """Check the layout's tensors against its parameters and build the kernel view (qtool/layouts/vq/cuda.py's, which the
    decode GEMV takes too)."""
    reason = unsupported_reason(vector_size, entries, residuals, in_features, tile_rows, tile_cols)
    if reason is not None:
        raise cc.CudaUnavailableError(f"{LAYOUT} GEMM: {reason}; use the reference path")
    return view(
        indices, codebooks, vector_size, entries, residuals, in_features, out_features, tile_rows, tile_cols
    )


def prepare_layer(layer: torch.nn.Module) -> Prepared:
    """The kernel view of a VQLinear (its buffers, used in place), kept on the layer as the GEMV keeps it."""
    reason = unsupported_reason(
        layer.vector_size, layer.entries, layer.residuals, layer.in_features, layer.tile_rows, layer.tile_cols
    )
    if reason is not None:
        raise cc.CudaUnavailableError(f"{LAYOUT} GEMM: {reason}; use the reference path")
    return layer_view(layer, layer.indices.device)


def smem_bytes(p: Prepared | tuple[int, int, int], tokens: int, stages: int, fusion: str = "direct") -> int:
    """Dynamic shared memory of one block: the ring (activations, 128 rows' indices and, for small scopes without
    replicas, the stage's codebooks), resident codebooks or two replica buffers (128 bytes per entry), and slack to
    align the 1024-byte swizzle atoms."""
    d, b, z = p.config if isinstance(p, Prepared) else p
    cbytes = z * (1 << b) * d * 2
    iw = STAGE_COLS // d * b // 32
    resident, replica = cbytes > RESIDENT_BYTES, fusion == "replica"
    slot = tokens * 128 + ROWS * z * (-(-iw // 4) * 16) + (0 if resident or replica else cbytes)
    slot = -(-slot // 1024) * 1024
    extra = cbytes if resident else 2 * (1 << b) * 128 if replica else 0
    return stages * slot + extra + 1024


def fusion_reason(p: Prepared, fusion: str, tokens: int) -> str | None:
    """Why `fusion` cannot run this layer at this token tile (None when it can)."""
    if fusion not in FUSIONS:
        return f"fusion {fusion!r} (expected one of {', '.join(FUSIONS)})"
    if fusion != "replica":
        return None
    if p.config != (4, 8, 1):
        return f"fusion replica for VQ<{p.vector_size},{p.index_bits},{p.residuals}> (built for VQ<4,8,1>)"
    cst = p.tile_vecs * p.vector_size // STAGE_COLS
    stages = BUILT[p.config][tokens]
    if cst < stages - 2:
        # a tile's replica buffer is refilled ST - 2 stages ahead: the tile before the last must be done by then
        return f"fusion replica with {STAGE_COLS * cst}-column tiles at {tokens} tokens (needs {stages - 2} stages)"
    return None


def tokens_for(config: tuple[int, int, int], m: int) -> int:
    """Token tile for M rows: the smallest built tile holding them all, else the largest."""
    tiles = sorted(BUILT[config])
    return next((tn for tn in tiles if m <= tn), tiles[-1])


def plan_split(n: int, m: int, k: int, tokens: int, blocks_per_sm: int, sms: int) -> int:
    """Blocks splitting K per output tile: as many as keep every block in one wave, at most 16, at least 4 stages
    each (grouped_int's rule for its wgmma kernel)."""
    tiles = -(-n // ROWS) * -(-m // tokens)
    return max(1, min(blocks_per_sm * sms // tiles, k // STAGE_COLS // 4, 16))


def gemm(
    x: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tokens: int | None = None,
    split: int | None = None,
    fusion: str | None = None,
) -> torch.Tensor:
    """y = x . W^T (+ bias) with the fused VQ GEMM; x fp16 [..., K], any number of rows. `tokens` (token tile),
    `split` (blocks per output tile along K) and `fusion` ("shfl" or "direct") override the defaults."""
    if x.dtype != torch.float16 or not x.is_cuda:
        raise ValueError(f"x: found {x.dtype} on {x.device}, expected torch.float16 on CUDA")
    k, n = p.in_features, p.out_features
    if x.shape[-1] != k:
        raise ValueError(f"x: found last dim {x.shape[-1]}, expected in_features={k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    x2 = x2.contiguous()
    if x2.data_ptr() % 16:
        x2 = x2.clone()
    dev = cc.device_index(x.device)
    reason = device_reason(dev)
    if reason is not None:
        raise cc.CudaUnavailableError(f"{LAYOUT} GEMM: {reason}; use the reference path")
    if bias is not None and (bias.dtype != torch.float16 or bias.numel() != n or not bias.is_cuda):
        raise ValueError(f"bias: found {bias.dtype} {list(bias.shape)}, expected torch.float16 [{n}] on CUDA")
    out = cc.f16_out(out, (m, n), x.device)
    if m == 0:
        return out.reshape(*lead, n)
    built = BUILT[p.config]
    tn = tokens_for(p.config, m) if tokens is None else tokens
    if tn not in built:
        raise ValueError(f"tokens: found {tn}, expected one of {tuple(built)} for {p.config}")
    if fusion is None:
        fusion = DEFAULT_FUSION[p.config]
        if fusion_reason(p, fusion, tn) is not None:
            fusion = "direct"
    reason = fusion_reason(p, fusion, tn)
    if reason is not None:
        raise ValueError(f"fusion: {reason}")
    st = built[tn]
    d, b, z = p.config
    fn = cc.load_module(SOURCE, device=dev).fn(f"vq_gemm_d{d}_b{b}_z{z}_n{tn}_s{st}_f{FUSIONS[fusion]}")
    smem = smem_bytes(p, tn, st, fusion)
    cc.allow_shared_memory(fn, smem)
    nst = k // STAGE_COLS
    if split is None:
        split = plan_split(n, m, k, tn, cc.resident_blocks(fn, 256, smem, dev), cc.sm_count(dev))
    if not 1 <= split <= nst:
        raise ValueError(f"split: found {split}, expected 1..{nst} (stages of {STAGE_COLS} columns)")
    tiles = -(-n // ROWS) * -(-m // tn)
    split, ws, cnt = split_k.split_buffers(dev, split, tiles, ROWS, tn)
    trows = max(p.tile_rows, 1)
    cst = p.tile_vecs * p.vector_size // STAGE_COLS
    c_tiles = p.codebooks.shape[1]
    cc.launch(
        fn,
        (-(-n // ROWS), -(-m // tn), split),
        (256,),
        (
            cc.ptr(x2),
            cc.i32(x2.stride(0)),
            cc.ptr(p.indices),
            cc.i32(p.indices.shape[-1]),
            cc.ptr(p.codebooks),
            cc.i32(c_tiles),
            cc.i32(trows),
            cc.i32(cst),
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


WS_SOURCE = "vq/gemm_ws.cu"
# The warp-specialized GEMM (kernels/vq/gemm_ws.cu on the engine the mixed-2-4-16 GEMM runs on, qtool/cuda/f16_ws.py),
# built for VQ<4, 8, 1> (GPTVQ-2: 2 KiB scopes carried in the ring) in both of the engine's forms: "regs" (each MMA
# lane looks up its own A fragments, as gemm.cu's lanes do) and "tile" (two decode warpgroups write each stage's
# rows once into an fp16 tile that wgmma reads). (form, token tile) -> (copy-ring slots, decoded tiles, blocks per SM
# its registers are capped for): each ring as deep as fits those blocks, at most 12 slots; up to 128 tokens in both
# forms (the mixed layout's GEMM_WS_BUILT says why). A slot holds the
# activation tile, 128 rows' index words and the scope, rounded up to 1 KiB: 6 KiB at 16 tokens.
WS_CONFIGS = ((4, 8, 1),)
WS_BUILT = {
    ("regs", 16): (12, 0, 2),
    ("regs", 32): (12, 0, 2),
    ("regs", 64): (9, 0, 2),
    ("regs", 128): (11, 0, 1),
    ("tile", 16): (7, 4, 2),
    ("tile", 32): (5, 4, 2),
    ("tile", 64): (12, 4, 1),
    ("tile", 128): (8, 4, 1),
}
# The default form: "regs", which moves no decoded tile through shared memory (a GPTVQ-2 row's decode is 16 lookups
# either way, against the mixed layout's ~245 instructions, where the tile form decodes each row once); ahead of
# "tile" at 11 of the 12 cells timed (kernels/vq/NOTES.md).
WS_FORM = "regs"
WS_SCOPE_BYTES = 256 * 4 * 2  # one VQ<4, 8, 1> codebook scope (fp16)
WS_WORDS = ROWS * 16 + WS_SCOPE_BYTES  # a slot's bytes after the activations: index words, then the scope
# 0 (default): more than MIN_M - 1 rows take `gemm`; 1: `gemm_ws` where it is built (kernels/vq/NOTES.md: ahead of
# `gemm` at 5 of 12 cells of the Llama-2-7B shapes and 8192x28672, behind by up to 14% at the others).
GEMM_WS = cc.env_int("QTOOL_VQ_GEMM_WS", 0)


def ws_smem(form: str, tokens: int) -> int:
    """Dynamic shared memory of a warp-specialized build (qtool/cuda/f16_ws.py `smem` with this decode's words)."""
    sc, sa, _ = WS_BUILT[form, tokens]
    return f16_ws.smem(tokens, WS_WORDS, sc, sa)


def ws_fits(form: str, tokens: int) -> bool:
    """Whether the build fits its blocks per SM in shared memory (qtool/cuda/f16_ws.py `fits`)."""
    sc, sa, blocks = WS_BUILT[form, tokens]
    return f16_ws.fits(tokens, WS_WORDS, sc, sa, blocks)


def ws_entry(form: str, tokens: int, fusion: str) -> str:
    """The kernel name of a build (kernels/vq/gemm_ws.cu's entry macros; the tile form decodes whole entries)."""
    sc, sa, _ = WS_BUILT[form, tokens]
    if form == "tile":
        return f"vq_gemm_wst_d4_b8_z1_n{tokens}_s{sc}_a{sa}"
    return f"vq_gemm_ws_d4_b8_z1_n{tokens}_s{sc}_f{FUSIONS[fusion]}"


def ws_plan(m: int, tokens: int | None = None, form: str | None = None) -> tuple[str, int]:
    """(form, token tile) for M rows: the smallest tile of the form holding them all, else its largest; WS_FORM
    unless `form` is given, a given `tokens` kept."""
    fm = WS_FORM if form is None else form
    tiles = [tn for f, tn in sorted(WS_BUILT) if f == fm]
    if not tiles:
        raise ValueError(f"form: found {fm!r}, expected regs or tile")
    tn = next((t for t in tiles if m <= t), tiles[-1]) if tokens is None else tokens
    if (fm, tn) not in WS_BUILT:
        raise ValueError(f"tokens, form: found {tn}, {fm!r}, expected one of {sorted(WS_BUILT)}")
    return fm, tn


_X_MAPS = tma.MapCache(limit=64)


def gemm_ws(
    x: torch.Tensor,
    p: Prepared,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    tokens: int | None = None,
    split: int | None = None,
    fusion: str | None = None,
    form: str | None = None,
) -> torch.Tensor:
    """y = x . W^T (+ bias) with the warp-specialized VQ GEMM (kernels/vq/gemm_ws.cu); the contract of `gemm`: x
    fp16 [..., K], any number of rows. `form` ("regs" or "tile"), `tokens` (WS_BUILT), `split` (blocks per output
    tile along K) and `fusion` (the regs form's: "direct" or "shfl") override the defaults (ws_plan,
    plan_split)."""
    if p.config not in WS_CONFIGS:
        built = ", ".join(f"VQ<{d},{b},{z}>" for d, b, z in WS_CONFIGS)
        raise cc.CudaUnavailableError(
            f"{LAYOUT} GEMM (warp-specialized): VQ<{p.vector_size},{p.index_bits},"
            f"{p.residuals}> (built for {built}); use gemm"
        )
    k, n = p.in_features, p.out_features
    x2 = cc.f16_rows(x, k, LAYOUT)  # contiguous, 16-byte aligned: what a tensor map needs
    lead = x.shape[:-1]
    dev = cc.device_index(x.device)
    reason = device_reason(dev)
    if reason is not None:
        raise cc.CudaUnavailableError(f"{LAYOUT} GEMM: {reason}; use the reference path")
    if bias is not None and (bias.dtype != torch.float16 or bias.numel() != n or not bias.is_cuda):
        raise ValueError(f"bias: found {bias.dtype} {list(bias.shape)}, expected torch.float16 [{n}] on CUDA")
    m = x2.shape[0]
    out = cc.f16_out(out, (m, n), x.device)
    if m == 0:
        return out.reshape(*lead, n)
    fm, tn = ws_plan(m, tokens, form)
    if fusion not in (None, "direct", "shfl") or (fm == "tile" and fusion == "shfl"):
        expected = "direct (the tile form decodes whole entries)" if fm == "tile" else "direct or shfl"
        raise ValueError(f"fusion: found {fusion!r}, expected {expected}")
    fn = cc.load_module(WS_SOURCE, device=dev).fn(ws_entry(fm, tn, fusion or "direct"))
    smem = ws_smem(fm, tn)
    cc.allow_shared_memory(fn, smem)
    threads = f16_ws.THREADS[fm]
    nst = k // STAGE_COLS
    if split is None:
        split = plan_split(n, m, k, tn, cc.resident_blocks(fn, threads, smem, dev), cc.sm_count(dev))
    if not 1 <= split <= nst:
        raise ValueError(f"split: found {split}, expected 1..{nst} (stages of {STAGE_COLS} columns)")
    tiles = -(-n // ROWS) * -(-m // tn)
    split, ws, cnt = split_k.split_buffers(dev, split, tiles, ROWS, tn)
    # token boxes past M read rows the storage holds where it has them (tma.padded_rows): their products land in
    # accumulator columns that are never stored
    mx = _X_MAPS.get(tma.padded_rows(x2, tn), 128, tn, 128)
    dependent_launch.launch(
        fn,
        (-(-n // ROWS), -(-m // tn), split),
        (threads,),
        (
            mx,
            cc.ptr(p.indices),
            cc.i32(p.indices.shape[-1]),
            cc.ptr(p.codebooks),
            cc.i32(p.codebooks.shape[1]),
            cc.i32(max(p.tile_rows, 1)),
            cc.i32(p.tile_vecs * p.vector_size // STAGE_COLS),
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


def layer_reason(layer: torch.nn.Module, x: torch.Tensor) -> str | None:
    """Why a VQLinear's forward on `x` cannot take the GEMM (None when it can)."""
    if x.dtype != torch.float16:
        return f"dtype {x.dtype} (the VQ GEMM takes float16 activations)"
    return unsupported_reason(
        layer.vector_size, layer.entries, layer.residuals, layer.in_features, layer.tile_rows, layer.tile_cols
    ) or device_reason(cc.device_index(x.device))


def module_forward(layer: torch.nn.Module, x2: torch.Tensor) -> torch.Tensor | None:
    """The GEMM's y [M, N] (no bias) for a VQLinear's rows x2 [M, K] on CUDA, or None when the caller should run
    the reference path. QTOOL_KERNELS=cuda turns every fallback into a one-line error instead."""
    if cc.kernel_mode() == "reference":
        return None
    if not cc.use_kernels(LAYOUT, layer_reason(layer, x2)):
        return None
    p = prepare_layer(layer)
    return gemm_ws(x2, p) if GEMM_WS and p.config in WS_CONFIGS else gemm(x2, p)
