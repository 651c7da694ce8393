// Warp-specialized tensor-core GEMM on the tiled streams of a `mixed-2-4-16` block4 layer for prefill on Hopper:
// y = x · Wᵀ (+ bias) + the outliers, which the tile form adds into its decoded tile (OUT_CAP below) and mixed_spmv
// adds after the regs form (qtool/layouts/mixed/cuda.py `gemm_ws`). Two forms on two engines (roles, rings, wgmma
// loop, split-K, epilogue), this file being their decode (MixedWs):
//   * regs (mixed_gemm_ws_*, common/f16_ws_wgmma.cuh): a copy warp, and MMA lanes decoding their own A fragments
//     (`fragments`, gemm.cu's decode) for wgmmas with A from registers; up to 128 tokens;
//   * tile (mixed_gemm_wst_*, common/f16_ws_tile_wgmma.cuh): two decode warpgroups writing each stage's 128 rows
//     once into an fp16 tile (`decode_stage`) that wgmma reads from shared memory; up to 128 tokens.
// Against kernels/mixed/gemm.cu (block-synchronous, its loads one stage ahead of a wait for all of them): no block
// barrier per stage, a deep ring of copies from warps that do nothing else on the decode's path. Which form where:
// kernels/mixed/NOTES.md, "Per-stage budget".
//
// A stage's copies (the copy warp): ta (16 bytes per row at a stride of K/4 bytes) by the copy engine, a 16 x 128
// box; tm, and per 4-row group tz and tt, by cp.async (8- and 4-byte pieces, below the 16-byte minimum of a bulk
// copy); binfo. The decoded tile and the fragments keep gemm.cu's order: k16 step i is the block's tiled field i
// (the three 2-bit stripes, then the 4-bit one) and its wgmma reads the activation columns of that stripe's
// position (binfo), so no code moves. Weights: MixedRow (mixed/tiled.cuh), the reference's fp16 cast bit for bit,
// as in gemm.cu.
//
// Runtime contract (qtool/layouts/mixed/cuda.py checks it): mx maps x fp16 [M, K] (rows 16-byte aligned) as bytes,
// boxes of 128 bytes x TN rows, 128-byte swizzle; mta maps ta [N, K/16] int32 as bytes, boxes of 16 bytes x 128
// rows, no swizzle; K = 64·nblk; g2 a multiple of 4; split-K as common/f16_ws_wgmma.cuh f16_ws_body.
// tiled.cuh's MixedRow::two and ::pair are both in use: decode_stage takes two fields per shift, a lane's fragments
// two fields of one code word apart (t and t + 4), one shift each.

#include "common/f16_ws_tile_wgmma.cuh"
#include "mixed/tiled.cuh"

// The tile form's outliers, per 128-row block and stage (qtool/layouts/mixed/cuda.py `tile_outliers`): olist holds
// each block-stage's entries from optr[b·nblk + gs] to optr[b·nblk + gs + 1], at most OUT_CAP, an entry being the
// outlier's position in the decoded tile (row·64 + column, the column in the tile's field order) in bits 0-15 and its
// fp16 value in bits 16-31. The copy warp brings a stage's entries into the slot after its words, zero-filled to
// OUT_CAP (an entry of 0, a zero added at position 0, is skipped); once its warpgroup has decoded the stage, decode
// thread t adds entry t into the tile as the dequantize kernel adds it into the dense weight (mixed/gemv.cu
// mixed_outliers_into_dense: the fp16 sum of the two). 128 slots fit in every build's copy slot with no growth.
constexpr int OUT_CAP = 128;

struct MixedWs {
    struct Params {
        const TmaMap* ta;
        const uint2* tm;
        const u32* tz;
        const uint2* tt;
        const u32* binfo;
        const int* optr;   // null: no outliers in the tile (the regs form, layers without them, or spmv asked)
        const u32* olist;
        int N, nblk, g2;
    };
    static constexpr int OL = MixedWords::BYTES;  // the stage's outlier entries in a copy slot's words
    static constexpr int RAW = OL + 4 * OUT_CAP;
    static constexpr int TX = 128 * 16;  // ta

    // The copy warp's lanes: rows n0 + 32j + lane (tm) and the 4-row group n0 + 4 lane (tz, tt) as element offsets
    // of their stage 0, and which of them lie before N (bits 0-3 the rows, 4 the group). Built once, so a stage's
    // copies are an add and a cp.async each.
    struct Cursor {
        int tm[4];
        int tz, tt;
        u32 ok;  // bits 8-31: the outlier window's first stage + 32 (a register fewer: the 32-token build spills)
        int n0;
        int wv;  // the outlier window: lane l holds optr of stage (ok >> 8) - 32 + l (31 stages a load)
    };

    __device__ static __forceinline__ Cursor cursor(const Params& p, int n0, int lane) {
        Cursor c;
        c.ok = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int f = n0 + 32 * j + lane;
            const bool in = f < p.N;
            c.tm[j] = in ? f * p.nblk : 0;
            c.ok |= (u32)in << j;
        }
        const int row = n0 + 4 * lane;
        const bool in = row < p.N;
        c.tz = in ? (row >> 2) * p.nblk : 0;
        c.tt = in ? row / p.g2 * p.nblk : 0;
        c.ok |= (u32)in << 4;
        c.n0 = n0;
        c.wv = 0;
        return c;
    }

    // Rows past N are zero-filled (their outputs are never stored); their sources stay in bounds (offset 0). Stages
    // come in increasing order: the outlier window moves forward only.
    __device__ static __forceinline__ void copy(const Params& p, Cursor& c, u32 w, u32 full, int gs, int lane) {
        if (p.olist) {
            int o = gs + 32 - (int)(c.ok >> 8);
            if (o >= 31) {  // one load of 32 stage starts for the next 31 stages
                c.ok = (c.ok & 255u) | ((u32)(gs + 32) << 8);
                c.wv = p.optr[(c.n0 >> 7) * p.nblk + min(gs + lane, p.nblk)];
                o = 0;
            }
            const int st = __shfl_sync(0xffffffffu, c.wv, o), en = __shfl_sync(0xffffffffu, c.wv, o + 1);
#pragma unroll
            for (int j = 0; j < OUT_CAP / 32; ++j) {
                const int e = st + 32 * j + lane;
                cp_async4(w + OL + 4 * (32 * j + lane), p.olist + (e < en ? e : st), e < en ? 4 : 0);
            }
        }
        if (lane == 0) tma_load_2d(w + MixedWords::TA, p.ta, full, 16 * gs, c.n0);
#pragma unroll
        for (int j = 0; j < 4; ++j)
            cp_async8(w + MixedWords::TM + 8 * (32 * j + lane), p.tm + c.tm[j] + gs, (c.ok >> j) & 1u ? 8 : 0);
        const int g = (c.ok >> 4) & 1u ? 4 : 0;
        cp_async4(w + MixedWords::TZ + 4 * lane, p.tz + c.tz + gs, g);
        cp_async8(w + MixedWords::TT + 8 * lane, p.tt + c.tt + gs, 2 * g);
        if (lane == 0) cp_async4(w + MixedWords::BI, p.binfo + gs, 4);
    }

    // gemm.cu's fragments (mg_dequant): fields t and t + 4 of each stripe of rows r0 and r0 + 8.
    __device__ static __forceinline__ void fragments(u32 w, u32 (&af)[4][4], int r0, int t) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            MixedRow r;
            r.load(w, r0 + 8 * h);
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                af[i][h] = r.pair(i, t);
                af[i][2 + h] = r.pair(i, t + 4);
            }
        }
    }

    // The tile form's row `row`: 8 fields per stripe, two per shift (MixedRow::two), in 16-byte chunks 2i (fields
    // 0-3) and 2i + 1 (fields 4-7) of k16 step i. The 8 rows of a quarter warp hit 8 different chunk positions: no bank conflicts.
    __device__ static __forceinline__ void decode_stage(const Params& p, u32 w, u32 a, int row) {
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
        if (p.olist) {
            // an entry may fall in any row of the tile: the warpgroup's rows are all written first (named
            // barrier 2 or 3, one per decode warpgroup; the engine's MMA warpgroups use 1)
            if (threadIdx.x < 128)
                bar_sync<2, 128>();
            else
                bar_sync<3, 128>();
            const u32 e = lds32(w + OL + 4u * (u32)row);
            if (e) {
                const u32 r = (e >> 6) & 127u, col = e & 63u;
                const u32 at = a + r * 128u + ((((col >> 3) ^ (r & 7u)) << 4) | ((col & 7u) << 1));
                u16 h;
                asm volatile("ld.shared.u16 %0, [%1];" : "=h"(h) : "r"(at));
                h = f2h(h2f(h) + h2f((u16)(e >> 16)));
                asm volatile("st.shared.u16 [%0], %1;" ::"r"(at), "h"(h) : "memory");
            }
        }
    }

    __device__ static __forceinline__ void kcols(u32 w, u32 (&col)[4]) {
        const u32 info = lds32(w + MixedWords::BI);
#pragma unroll
        for (int i = 0; i < 4; ++i) col[i] = 32u * ((info >> (24 + 2 * i)) & 3u);
    }
};

// mixed_gemm_ws_n{TN}_s{STC}: TN tokens per block, STC copy slots; MINB blocks per SM its registers are capped
// for (qtool/layouts/mixed/cuda.py GEMM_WS_BUILT lists the same).
#define MIXED_GEMM_WS_ENTRY(TN, STC, MINB)                                                                       \
    extern "C" __global__ void __maxnreg__(f16_ws_regs<MINB>) mixed_gemm_ws_n##TN##_s##STC(                      \
        const __grid_constant__ TmaMap mx, const __grid_constant__ TmaMap mta, const uint2* tm, const u32* tz,   \
        const uint2* tt, const u32* binfo, const u16* bias, u16* out, int ldc, float* ws, int* cnt, int M, int N, \
        int nblk, int g2) {                                                                                      \
        const MixedWs::Params p{&mta, tm, tz, tt, binfo, nullptr, nullptr, N, nblk, g2};                         \
        f16_ws_body<MixedWs, TN, STC>(&mx, p, M, N, nblk, bias, out, ldc, ws, cnt);                              \
    }

MIXED_GEMM_WS_ENTRY(16, 12, 2)
MIXED_GEMM_WS_ENTRY(32, 12, 2)
MIXED_GEMM_WS_ENTRY(64, 9, 2)
MIXED_GEMM_WS_ENTRY(128, 11, 1)

// mixed_gemm_wst_n{TN}_s{STC}_a{STA}: the tile form (common/f16_ws_tile_wgmma.cuh), STA decoded tiles.
#define MIXED_GEMM_WST_ENTRY(TN, STC, STA, MINB)                                                                  \
    extern "C" __global__ void __launch_bounds__(512, MINB) mixed_gemm_wst_n##TN##_s##STC##_a##STA(             \
        const __grid_constant__ TmaMap mx, const __grid_constant__ TmaMap mta, const uint2* tm, const u32* tz,   \
        const uint2* tt, const u32* binfo, const int* optr, const u32* olist, const u16* bias, u16* out, int ldc, \
        float* ws, int* cnt, int M, int N, int nblk, int g2) {                                                   \
        const MixedWs::Params p{&mta, tm, tz, tt, binfo, optr, olist, N, nblk, g2};                              \
        f16_wst_body<MixedWs, TN, STC, STA>(&mx, p, M, N, nblk, bias, out, ldc, ws, cnt);                        \
    }

MIXED_GEMM_WST_ENTRY(16, 7, 4, 2)
MIXED_GEMM_WST_ENTRY(32, 5, 4, 2)
MIXED_GEMM_WST_ENTRY(64, 12, 4, 1)
MIXED_GEMM_WST_ENTRY(128, 8, 4, 1)
