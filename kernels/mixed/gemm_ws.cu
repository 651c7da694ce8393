// Warp-specialized tensor-core GEMM on the tiled streams of a `mixed-2-4-16` block4 layer for prefill on Hopper:
// y = x · Wᵀ (+ bias), the outliers left to mixed_spmv after it (qtool/layouts/mixed/cuda.py `gemm_ws`). The
// engine (roles, rings, wgmma loop, split-K, epilogue) is common/f16_ws_wgmma.cuh; this file is its decode: the
// copies of a stage's tiled words and the decode of a weight row into the fp16 A tile.
//
// Against kernels/mixed/gemm.cu (block-synchronous, each MMA lane decoding its own A fragments into registers): the
// weights are decoded once per stage by the copy warpgroup into shared memory, and the MMA warpgroups only wait and
// issue wgmmas with both operands from shared memory, so the decode overlaps the tensor cores without a block
// barrier per stage, and the MMA warpgroups need only their accumulators (the register budget that kept gemm.cu at
// one block per SM, and the small token tiles, 16 and 32, two blocks per SM).
//
// A stage's copies (warp 0): ta (16 bytes per row at a stride of K/4 bytes) by the copy engine, a 16 x 128 box;
// tm, and per 4-row group tz and tt, by cp.async (8- and 4-byte pieces, below the 16-byte minimum of a bulk copy);
// binfo. The decoded tile keeps gemm.cu's order: k16 step i is the block's tiled field i (the three 2-bit stripes,
// then the 4-bit one) and its wgmma reads the activation columns of that stripe's position (binfo), so no code
// moves. Weights: MixedRow (mixed/tiled.cuh), the reference's fp16 cast bit for bit, as in gemm.cu.
//
// Runtime contract (qtool/layouts/mixed/cuda.py checks it): mx maps x fp16 [M, K] (rows 16-byte aligned) as bytes,
// boxes of 128 bytes x TN rows, 128-byte swizzle; mta maps ta [N, K/16] int32 as bytes, boxes of 16 bytes x 128
// rows, no swizzle; K = 64·nblk; g2 a multiple of 4; split-K as common/f16_ws_wgmma.cuh f16_ws_body.

#include "common/f16_ws_wgmma.cuh"
#include "mixed/tiled.cuh"

struct MixedWs {
    struct Params {
        const TmaMap* ta;
        const uint2* tm;
        const u32* tz;
        const uint2* tt;
        const u32* binfo;
        int N, nblk, g2;
    };
    static constexpr int RAW = MixedWords::BYTES;
    static constexpr int TX = 128 * 16;  // ta

    // Rows past N are zero-filled (their outputs are never stored).
    __device__ static __forceinline__ void copy(const Params& p, u32 w, u32 full, int gs, int n0, int lane) {
        if (lane == 0) tma_load_2d(w + MixedWords::TA, p.ta, full, 16 * gs, n0);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int r = 32 * j + lane, f = n0 + r;
            const bool ok = f < p.N;
            cp_async8(w + MixedWords::TM + 8 * r, p.tm + (ok ? (size_t)f * p.nblk + gs : 0), ok ? 8 : 0);
        }
        const int row = n0 + 4 * lane;  // this lane's 4-row group
        const bool ok = row < p.N;
        cp_async4(w + MixedWords::TZ + 4 * lane, p.tz + (ok ? (size_t)(row >> 2) * p.nblk + gs : 0), ok ? 4 : 0);
        cp_async8(w + MixedWords::TT + 8 * lane, p.tt + (ok ? (size_t)(row / p.g2) * p.nblk + gs : 0), ok ? 8 : 0);
        if (lane == 0) cp_async4(w + MixedWords::BI, p.binfo + gs, 4);
    }

    // Row `row`: 8 fields per stripe, two per shift (MixedRow::two), in 16-byte chunks 2i (fields 0-3) and 2i + 1
    // (fields 4-7) of k16 step i. The 8 rows of a quarter warp hit 8 different chunk positions: no bank conflicts.
    __device__ static __forceinline__ void decode_stage(const Params&, u32 w, u32 a, int row) {
        MixedRow r;
        r.load(w, row);
        const u32 dst = a + (u32)row * 128u;
        const int x = row & 7;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 v[8];
            if (i < 3) {
                r.two(i, 0, v[0], v[2]);
                r.two(i, 1, v[1], v[3]);
                r.two(i, 4, v[4], v[6]);
                r.two(i, 5, v[5], v[7]);
            } else {
                r.two(3, 0, v[0], v[1]);
                r.two(3, 2, v[2], v[3]);
                r.two(3, 4, v[4], v[5]);
                r.two(3, 6, v[6], v[7]);
            }
            sts128(dst + (u32)(((2 * i) ^ x) << 4), v[0], v[1], v[2], v[3]);
            sts128(dst + (u32)(((2 * i + 1) ^ x) << 4), v[4], v[5], v[6], v[7]);
        }
    }

    __device__ static __forceinline__ void kcols(u32 w, u32 (&col)[4]) {
        const u32 info = lds32(w + MixedWords::BI);
#pragma unroll
        for (int i = 0; i < 4; ++i) col[i] = 32u * ((info >> (24 + 2 * i)) & 3u);
    }
};

// mixed_gemm_ws_n{TN}_s{STC}_a{STA}: TN tokens per block, STC copy slots, STA decoded tiles; MINB blocks per SM
// the registers are budgeted for (qtool/layouts/mixed/cuda.py GEMM_WS_BUILT lists the same).
#define MIXED_GEMM_WS_ENTRY(TN, STC, STA, MINB)                                                                  \
    extern "C" __global__ void __launch_bounds__(384, MINB) mixed_gemm_ws_n##TN##_s##STC##_a##STA(              \
        const __grid_constant__ TmaMap mx, const __grid_constant__ TmaMap mta, const uint2* tm, const u32* tz,   \
        const uint2* tt, const u32* binfo, const u16* bias, u16* out, int ldc, float* ws, int* cnt, int M, int N, \
        int nblk, int g2) {                                                                                      \
        const MixedWs::Params p{&mta, tm, tz, tt, binfo, N, nblk, g2};                                           \
        f16_ws_body<MixedWs, TN, STC, STA, MINB>(&mx, p, M, N, nblk, bias, out, ldc, ws, cnt);                   \
    }

MIXED_GEMM_WS_ENTRY(16, 12, 2, 2)
MIXED_GEMM_WS_ENTRY(32, 9, 2, 2)
MIXED_GEMM_WS_ENTRY(64, 12, 3, 1)
MIXED_GEMM_WS_ENTRY(128, 8, 3, 1)
