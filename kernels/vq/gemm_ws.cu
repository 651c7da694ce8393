// Warp-specialized tensor-core GEMM for the `vq` layout's ring-carried codebooks (GPTVQ-2: VQ<4, 8, 1>, a 2 KiB
// scope per 256x256 tile) on Hopper: y = x · Ŵᵀ (+ bias) on common/f16_ws_wgmma.cuh's engine, the one the
// mixed-2-4-16 GEMM's regs form runs on (mixed/gemm_ws.cu), this file being its VQ decode (VqWs). A copy warp
// brings each 64-column stage into a ring of STC slots: the activation tile by the copy engine, the 128 rows'
// index words by cp.async, the stage's codebook scope by one bulk copy (the codebook switch is its source
// address). Each MMA lane decodes its own A fragments from the slot (vq/decode.cuh vq_dequant, F as vq/gemm.cu:
// 0 each lane reading the pairs it consumes, 1 whole entries swapped in the quad) for wgmmas with A from registers.
// Against vq/gemm.cu (block-synchronous: every thread copies, one __syncthreads a stage, a ring of 4-6 stages):
// no block barrier, a deeper ring, and copies from a warp that does nothing else.
//
// Runtime contract (qtool/layouts/vq/cuda_gemm.py `gemm_ws` checks it): mx maps x fp16 [M, K] (rows 16-byte aligned)
// as bytes, boxes of 128 bytes x TN rows, 128-byte swizzle; idx int32 [1, N, ldi] and cb fp16 [R, C, 1, 256, 4],
// both 16-byte aligned; K = 64·nst; every 128-row block lies in one row tile (trows a multiple of 128, or >= N) and
// every stage in one column tile (cst stages a tile); split-K as common/f16_ws_wgmma.cuh f16_ws_body.

#include "common/f16_ws_tile_wgmma.cuh"
#include "vq/decode.cuh"

template <class Cfg, int F>
struct VqWs {
    static_assert(!Cfg::RESIDENT && Cfg::Z_ == 1 && Cfg::IROW == 16,
                  "a codebook scope carried in the ring, one residual, 16 bytes of a row's indices a stage");
    struct Params {
        const u32* idx;
        const u16* cb;
        int ldi, N, C, trows, cst;
    };
    static constexpr int IT = 128 * Cfg::IROW;  // the block's index words in a slot, then the scope's codebook
    static constexpr int RAW = IT + Cfg::CBB;
    static constexpr int TX = Cfg::CBB;  // the bulk copy of the scope; the index words are cp.asyncs

    // The copy warp's lanes: rows n0 + 32j + lane as element offsets of idx (0 past N, with bit j of ok clear) and
    // the row tile's scopes. Built once, so a stage's copies are an add and a cp.async each.
    struct Cursor {
        int row[4];
        u32 ok;
        const char* cb;
    };

    __device__ static __forceinline__ Cursor cursor(const Params& p, int n0, int lane) {
        Cursor c;
        c.ok = 0;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int f = n0 + 32 * j + lane;
            const bool in = f < p.N;
            c.row[j] = in ? f * p.ldi : 0;
            c.ok |= (u32)in << j;
        }
        c.cb = reinterpret_cast<const char*>(p.cb) + (size_t)(n0 / p.trows) * p.C * Cfg::CBB;
        return c;
    }

    // Rows past N are zero-filled (index 0 is a valid entry; their outputs are never stored).
    __device__ static __forceinline__ void copy(const Params& p, Cursor& c, u32 w, u32 full, int gs, int lane) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            cp_async16(w + 16u * (u32)(32 * j + lane), p.idx + c.row[j] + gs * Cfg::IW, (c.ok >> j) & 1u ? 16 : 0);
        if (lane == 0) bulk_load(w + IT, c.cb + (size_t)(gs / p.cst) * Cfg::CBB, Cfg::CBB, full);
    }

    __device__ static __forceinline__ void fragments(u32 w, u32 (&af)[4][4], int r0, int t) {
        vq_dequant<Cfg, F>(af, w, w + IT, r0, t);
    }

    // The tile form's row `row` (0..127) of the stage: its 16 vectors' entries in the stage's column order, two
    // vectors (16 bytes) a chunk, chunk c of the row at ((c ^ (row % 8)) << 4) (the 128-byte swizzle wgmma reads).
    // The 8 rows of a quarter warp store to 8 different chunk positions.
    __device__ static __forceinline__ void decode_stage(const Params&, u32 w, u32 a, int row) {
        const uint4 I = lds128(w + 16u * (u32)row);
        const u32 words[4] = {I.x, I.y, I.z, I.w};
        const u32 cb = w + IT, dst = a + 128u * (u32)row;
        const u32 x = (u32)row & 7u;
#pragma unroll
        for (int c = 0; c < 8; ++c) {
            const u32 wd = words[c >> 1], sh = 16u * (u32)(c & 1);
            const uint2 e0 = lds64(cb + 8u * ((wd >> sh) & 255u));
            const uint2 e1 = lds64(cb + 8u * ((wd >> (sh + 8u)) & 255u));
            sts128(dst + (((u32)c ^ x) << 4), e0.x, e0.y, e1.x, e1.y);
        }
    }

    // The fragments keep the stage's column order: k16 step i reads activation columns 16i..16i + 15.
    __device__ static __forceinline__ void kcols(u32, u32 (&col)[4]) {
#pragma unroll
        for (int i = 0; i < 4; ++i) col[i] = 32u * (u32)i;
    }
};

// vq_gemm_ws_d4_b8_z1_n{TN}_s{STC}_f{F}: TN tokens per block, STC copy slots, fusion F; MINB blocks per SM its
// registers are capped for (qtool/layouts/vq/cuda_gemm.py WS_BUILT lists the same).
#define VQ_GEMM_WS_ENTRY(TN, STC, MINB, F)                                                                         \
    extern "C" __global__ void __maxnreg__(f16_ws_regs<MINB>) vq_gemm_ws_d4_b8_z1_n##TN##_s##STC##_f##F(          \
        const __grid_constant__ TmaMap mx, const u32* idx, int ldi, const u16* cb, int C, int trows, int cst,     \
        const u16* bias, u16* out, int ldc, float* ws, int* cnt, int M, int N, int nst) {                          \
        using D = VqWs<VqCfg<4, 8, 1>, F>;                                                                         \
        const D::Params p{idx, cb, ldi, N, C, trows, cst};                                                         \
        f16_ws_body<D, TN, STC>(&mx, p, M, N, nst, bias, out, ldc, ws, cnt);                                       \
    }
#define VQ_GEMM_WS_ENTRIES(TN, STC, MINB) VQ_GEMM_WS_ENTRY(TN, STC, MINB, 0) VQ_GEMM_WS_ENTRY(TN, STC, MINB, 1)

VQ_GEMM_WS_ENTRIES(16, 12, 2)
VQ_GEMM_WS_ENTRIES(32, 12, 2)
VQ_GEMM_WS_ENTRIES(64, 9, 2)
VQ_GEMM_WS_ENTRIES(128, 11, 1)

// vq_gemm_wst_d4_b8_z1_n{TN}_s{STC}_a{STA}: the tile form (common/f16_ws_tile_wgmma.cuh: two decode warpgroups
// writing each stage's 128 rows once into an fp16 tile that wgmma reads from shared memory), STA decoded tiles.
#define VQ_GEMM_WST_ENTRY(TN, STC, STA, MINB)                                                                     \
    extern "C" __global__ void __launch_bounds__(512, MINB) vq_gemm_wst_d4_b8_z1_n##TN##_s##STC##_a##STA(         \
        const __grid_constant__ TmaMap mx, const u32* idx, int ldi, const u16* cb, int C, int trows, int cst,     \
        const u16* bias, u16* out, int ldc, float* ws, int* cnt, int M, int N, int nst) {                          \
        using D = VqWs<VqCfg<4, 8, 1>, 0>;                                                                         \
        const D::Params p{idx, cb, ldi, N, C, trows, cst};                                                         \
        f16_wst_body<D, TN, STC, STA>(&mx, p, M, N, nst, bias, out, ldc, ws, cnt);                                 \
    }

VQ_GEMM_WST_ENTRY(16, 7, 4, 2)
VQ_GEMM_WST_ENTRY(32, 5, 4, 2)
VQ_GEMM_WST_ENTRY(64, 12, 4, 1)
VQ_GEMM_WST_ENTRY(128, 8, 4, 1)
