"""Host side of the warp-specialized fp16 wgmma engine the non-uniform layouts' prefill GEMMs share
(kernels/common/f16_ws_wgmma.cuh, the "regs" form: a copy warp and two MMA warpgroups decoding their own A
fragments; kernels/common/f16_ws_tile_wgmma.cuh, the "tile" form: two decode warpgroups writing an fp16 tile
beside two MMA warpgroups): threads per block, a block's shared memory and whether a build fits its blocks per
multiprocessor. A layout brings its decode's bytes per stage (`words`); kernels/mixed/gemm_ws.cu and
kernels/vq/gemm_ws.cu instantiate the engine."""

from __future__ import annotations

THREADS = {"regs": 288, "tile": 512}
ROWS = 128  # weight rows per block: wgmma's M over the two MMA warpgroups
STATIC_SMEM = 512  # the engine's barriers and split-K flag: at most this (ptxas, sm_90a: 112-272 bytes)
SMEM_PER_SM = 228 * 1024  # an H100's or H200's shared memory per multiprocessor
SMEM_RESERVED = 1024  # per block, taken by the system
SMEM_BLOCK_MAX = 227 * 1024  # the most one block may have
MAX_SLOTS = 12  # the deepest copy ring built


def smem(tokens: int, words: int, copy_stages: int, tile_stages: int = 0) -> int:
    """Dynamic shared memory of a block: the copy slots (the activation tile of `tokens` rows of 64 fp16, then the
    decode's `words` bytes, each slot a multiple of 1024 bytes), the tile form's decoded tiles (128 rows x 64 fp16)
    and slack to align the swizzle atoms (F16WsRing, F16WstRing)."""
    slot = -(-(tokens * 128 + words) // 1024) * 1024
    return copy_stages * slot + tile_stages * ROWS * 128 + 1024


def fits(tokens: int, words: int, copy_stages: int, tile_stages: int, blocks: int) -> bool:
    """Whether `blocks` blocks of the build fit a multiprocessor's shared memory, one block within its own limit,
    and the epilogue's transpose tile (TN x 136 halves) within the ring."""
    size = smem(tokens, words, copy_stages, tile_stages)
    return (
        size + STATIC_SMEM <= SMEM_BLOCK_MAX
        and blocks * (size + STATIC_SMEM + SMEM_RESERVED) <= SMEM_PER_SM
        and tokens * 272 <= size - 1024
    )


def deepest(tokens: int, words: int, copy_stages: int, tile_stages: int, blocks: int) -> bool:
    """Whether `copy_stages` is the deepest ring that fits (or the most built, MAX_SLOTS)."""
    more = not fits(tokens, words, copy_stages + 1, tile_stages, blocks)
    return fits(tokens, words, copy_stages, tile_stages, blocks) and (more or copy_stages == MAX_SLOTS)
