// Tensor-core GEMM on the tiled streams of a `mixed-2-4-16` block4 layer (qtool/cuda/mixed.py `tiled_streams`,
// kernels/mixed/gemv.cu "The tiled GEMV") for prefill on Hopper: y = x · Wᵀ (+ bias) (+ the CSR outliers), with no
// dequantized weight anywhere in memory, so the checkpoint-layout tensors need not stay on the GPU.
//
// The structure is grouped_int's / vq/gemm.cu's block-synchronous wgmma kernel: operands swapped (Yᵀ = W·Xᵀ),
// 128 weight rows per block (two warpgroups of 64) as wgmma's M dimension, TN tokens as its N; per 64-column stage
// (one 64-channel block of the layout) cp.async brings the activation tile (128-byte swizzle) and the 128 rows'
// tiled words (ta, tm, and per 4-row group tz and tt) into a ring of ST shared-memory stages; each lane decodes
// its A fragments from shared memory; two fragment sets alternate so a stage's wgmmas overlap the next decode.
//
// A fragment of k16 step i is the block's tiled field i (the three 2-bit stripes, then the 4-bit one) and its
// wgmma reads the activation columns of that stripe's position (binfo), so no field is moved. A lane holds rows
// g and g + 8 (g = lane / 4) and the column pairs 2t, 2t + 1 and 2t + 8, 2t + 9 (t = lane % 4): in the tiled
// order these are fields t and t + 4 of a code word (pair n = codes 2n, 2n + 1 in the two halves), one shift and
// one mask each. The weight is exactly the reference's fp16 cast, the exact (q - z)·ŝ rounded once (MixedRow,
// mixed/tiled.cuh, which kernels/mixed/gemm_ws.cu decodes with too).
//
// Outliers (CSR, only in 2-bit stripes) are added to the float32 accumulators before the store: each lane walks
// the CSR segments of its two rows and multiplies the values by its tokens' activations at those columns.
//
// Runtime contract (qtool/cuda/mixed.py checks it): x fp16 [M, K] with row stride ldx (a multiple of 8), 16-byte
// aligned; K = 64·nblk; g2 a multiple of 4; split-K (gridDim.z > 1): ws holds gridDim.z·gridDim.x·gridDim.y·128·TN
// floats and cnt gridDim.x·gridDim.y zeros (qtool/cuda/split_k.py).

#include "common/ptx_common.cuh"
#include "common/wgmma_epilogue.cuh"
#include "mixed/tiled.cuh"

// One ring stage: TN activation rows (128 bytes each, swizzled), then the 128 rows' tiled words (MixedWords).
template <int TN>
struct MTile {
    static constexpr int XT = TN * 128;
    static constexpr int WO = XT;                          // MixedWords
    static constexpr int AO = WO + MixedWords::TA;         // ta [128]
    static constexpr int MO = WO + MixedWords::TM;         // tm [128]
    static constexpr int ZO = WO + MixedWords::TZ;         // tz [32]
    static constexpr int TO = WO + MixedWords::TT;         // tt [32]
    static constexpr int IO = WO + MixedWords::BI;         // binfo
    static constexpr int SB = (WO + MixedWords::BYTES + 1023) / 1024 * 1024;
};

struct MArgs {
    const u16* x;
    int ldx;
    const uint4* ta;
    const uint2* tm;
    const u32* tz;
    const uint2* tt;
    const u32* binfo;
    int M, N, nblk, g2;
    int m0, n0;
};

// Copies of global stage (64-channel block) gs into the shared stage at st; rows past M or N are zero-filled (their
// outputs are never stored).
template <int TN>
__device__ __forceinline__ void mg_load_stage(const MArgs& a, u32 st, int gs, int tid) {
    using T = MTile<TN>;
#pragma unroll
    for (int c0 = 0; c0 < TN * 8; c0 += 256) {
        const int c = c0 + tid;
        if (TN * 8 % 256 == 0 || c < TN * 8) {
            const int r = c >> 3, ch = c & 7;
            const bool ok = a.m0 + r < a.M;
            const u16* src = a.x + (ok ? (size_t)(a.m0 + r) * a.ldx + gs * 64 + ch * 8 : 0);
            cp_async16(st + r * 128 + ((ch ^ (r & 7)) << 4), src, ok ? 16 : 0);
        }
    }
    if (tid < 128) {
        const int row = a.n0 + tid;
        const bool ok = row < a.N;
        const size_t i = ok ? (size_t)row * a.nblk + gs : 0;
        cp_async16(st + T::AO + tid * 16, a.ta + i, ok ? 16 : 0);
        cp_async8(st + T::MO + tid * 8, a.tm + i, ok ? 8 : 0);
    } else if (tid < 160) {
        const int q = tid - 128, row = a.n0 + 4 * q;
        const bool ok = row < a.N;
        cp_async4(st + T::ZO + q * 4, a.tz + (ok ? (size_t)(row >> 2) * a.nblk + gs : 0), ok ? 4 : 0);
        cp_async8(st + T::TO + q * 8, a.tt + (ok ? (size_t)(row / a.g2) * a.nblk + gs : 0), ok ? 8 : 0);
    } else if (tid == 160) {
        cp_async4(st + T::IO, a.binfo + gs, 4);
    }
}

// This lane's A fragments of one stage: af[i] = field i (2-bit stripes 0-2, the 4-bit stripe 3) of rows r0, r0 + 8:
// fields t (columns 2t, 2t + 1) and t + 4 (2t + 8, 2t + 9) of each stripe.
template <int TN>
__device__ __forceinline__ void mg_dequant(u32 (&af)[4][4], u32 st, int r0, int t) {
    using T = MTile<TN>;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        MixedRow w;
        w.load(st + T::WO, r0 + 8 * h);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            af[i][h] = w.pair(i, t);
            af[i][2 + h] = w.pair(i, t + 4);
        }
    }
}

template <int TN, int ST>
__device__ __forceinline__ void mg_stage_step(float (&acc)[TN / 2], u32 (&af)[4][4], const MArgs& a, u32 base, int s,
                                              int s0, int ns, int r0, int t, int tid) {
    using T = MTile<TN>;
    cp_async_wait<ST - 3>();  // this thread's copies of stage s are done
    fence_async_smem();       // the activations are read next by the tensor cores
    __syncthreads();          // everyone's copies; everyone's wgmma of stage s-2 is finished (wait 1 below)
    if (s + ST - 2 < ns) mg_load_stage<TN>(a, base + (u32)((s + ST - 2) % ST) * T::SB, s0 + s + ST - 2, tid);
    cp_async_commit();
    const u32 st = base + (u32)(s % ST) * T::SB;
    const u32 info = lds32(st + T::IO);
    mg_dequant<TN>(af, st, r0, t);
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < 4; ++i) wgmma_acc(acc, af[i], desc_sw128(st + 32 * ((info >> (24 + 2 * i)) & 3u)));
    wgmma_commit();
    wgmma_wait1();
}

template <int TN, int ST>
__device__ __forceinline__ void mg_body(const MArgs& a0, const int* __restrict__ rowptr, const u16* __restrict__ ocols,
                                        const u16* __restrict__ ovals, const u16* __restrict__ bias,
                                        u16* __restrict__ out, int ldc, float* __restrict__ ws, int* __restrict__ cnt) {
    using T = MTile<TN>;
    static_assert(ST >= 3, "two stages in flight behind the one being decoded");
    extern __shared__ char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    MArgs a = a0;
    a.n0 = (int)blockIdx.x * 128;
    a.m0 = (int)blockIdx.y * TN;
    const int S = gridDim.z, z = blockIdx.z;
    const int s0 = (int)((long long)z * a.nblk / S), ns = (int)((long long)(z + 1) * a.nblk / S) - s0;
    const int r0 = 64 * wg + 16 * warp + g;

    float acc[TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[i] = 0.f;
#pragma unroll
    for (int p = 0; p < ST - 2; ++p) {
        if (p < ns) mg_load_stage<TN>(a, base + (u32)p * T::SB, s0 + p, tid);
        cp_async_commit();
    }
    u32 af0[4][4], af1[4][4];
    int s = 0;
    for (; s + 1 < ns; s += 2) {
        mg_stage_step<TN, ST>(acc, af0, a, base, s, s0, ns, r0, t, tid);
        mg_stage_step<TN, ST>(acc, af1, a, base, s + 1, s0, ns, r0, t, tid);
    }
    if (s < ns) mg_stage_step<TN, ST>(acc, af0, a, base, s, s0, ns, r0, t, tid);
    wgmma_wait0();
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory is free from here on

    float (&acc1)[1][TN / 2] = *reinterpret_cast<float (*)[1][TN / 2]>(&acc);
    if (S > 1 && !split_k_sum<TN, 1, 0, 256>(acc1, ws, cnt, tid, z, S, gridDim.x * gridDim.y,
                                               blockIdx.x + gridDim.x * blockIdx.y))
        return;
    if (rowptr != nullptr) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int row = a.n0 + r0 + 8 * h;
            if (row >= a.N) continue;
            const int e1 = rowptr[row + 1];
            for (int e = rowptr[row]; e < e1; ++e) {
                const int col = ocols[e];
                const float v = h2f(ovals[e]);
#pragma unroll
                for (int i = 0; i < TN / 8; ++i) {
#pragma unroll
                    for (int j = 0; j < 2; ++j) {
                        const int tok = a.m0 + 8 * i + 2 * t + j;
                        if (tok < a.M) acc[4 * i + 2 * h + j] += v * h2f(a.x[(size_t)tok * a.ldx + col]);
                    }
                }
            }
        }
    }
    store_out<TN, 1, 0>(acc1, a.m0, a.n0, a.M, a.N, r0, t, tid, smem_raw, base, bias, out, ldc);
}

// mixed_gemm_n{TN}_s{ST}: TN tokens per block, ST ring stages. MINB: blocks per SM the registers must allow.
#define MIXED_GEMM_ENTRY(TN, ST, MINB)                                                                              \
    extern "C" __global__ void __launch_bounds__(256, MINB) mixed_gemm_n##TN##_s##ST(                              \
        const u16* x, int ldx, const uint4* ta, const uint2* tm, const u32* tz, const uint2* tt, const u32* binfo,  \
        const int* rowptr, const u16* ocols, const u16* ovals, const u16* bias, u16* out, int ldc, float* ws,       \
        int* cnt, int M, int N, int nblk, int g2) {                                                                 \
        const MArgs a{x, ldx, ta, tm, tz, tt, binfo, M, N, nblk, g2, 0, 0};                                         \
        mg_body<TN, ST>(a, rowptr, ocols, ovals, bias, out, ldc, ws, cnt);                                         \
    }

MIXED_GEMM_ENTRY(64, 6, 1)
MIXED_GEMM_ENTRY(128, 4, 1)
MIXED_GEMM_ENTRY(256, 3, 1)
