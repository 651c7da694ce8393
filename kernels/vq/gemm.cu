// Tensor-core GEMM for the `vq` layout (formats/vq.md) on Hopper: y = x · Ŵᵀ (+ bias) for prefill, where
// Ŵ[n, j·d + i] = Σ_r C[rt(n), ct(j), r, idx[r, n, j], i] (VQ-LLM's VQ<d, b, z>; GPTVQ-2 = <4, 8, 1> per 256x256
// tile, AQLM-3 = <8, 12, 2> per tensor).
//
// Fused, as VQ-LLM's GeMM (Sec. VI-B): codes are decoded straight into the tensor cores' A operand and no
// dequantized weight exists anywhere in memory. Hopper's wgmma takes only A from registers, so the operands are
// swapped (Yᵀ = Ŵ·Xᵀ): weight rows are wgmma's M dimension (64 per warpgroup, 128 per block), tokens its N
// dimension (TN per block). Per 64-column stage, cp.async brings the activation tile (128-byte swizzle, read by
// wgmma through a descriptor), the 128 rows' packed indices and, for small scopes, the stage's codebooks into a
// ring of ST shared-memory stages.
//
// Codebooks (the paper's codebook-centric dataflow, Sec. VI-A): the switch axes of GPTVQ are N and K, so a block
// (128 rows inside one 256-row tile) switches codebook every tile_cols/64 stages: each stage carries its scope's
// 2 KiB codebook in the ring (the switch is the copy's source pointer). AQLM's 2 x 4096 x 8 entries (128 KiB) are
// one scope per tensor: they are copied once into shared memory and held for the block's life (an H100 block holds
// 227 KiB). Whole scopes sit in shared memory, so the codebook cache's register and global tiers are not used here.
//
// Register-level fusion (Alg. 1, Fig. 12): a lane that looks up one entry holds d consecutive weights of a row,
// while an m64k16 A fragment wants pairs (row g / g + 8, columns 2t, 2t + 1 and 2t + 8, 2t + 9; g = lane / 4,
// t = lane % 4). The four lanes of a quad are the mini-warp that shares consumers, so they swap pairs with
// shfl_xor: d/2 - 1 rounds (1 for d = 4, 3 for d = 8; within the paper's 5). F = 1 builds that. F = 0 has every
// lane read from the shared codebook only the 4-byte pairs it consumes (no shuffles or selects, d/2 times the
// lookup instructions, the same bytes): the codebook already sits in shared memory, so nothing is re-read through
// it, and on an H100 F = 0 was the faster (qtool/cuda/vq_gemm.py dispatches it; kernels/NOTES.md). F = 2 (VqRep)
// removes F = 0's bank conflicts with a replicated codebook and was slower still.
//
// Residual entries are added in f16x2 (one rounding of their exact sum: the reference's float32 sum cast to fp16).
// The GEMM accumulates in float32; the output is fp16.
//
// Runtime contract (qtool/cuda/vq_gemm.py checks it before launching):
//   * x fp16 [M, K], row stride ldx halves (a multiple of 8), K = 64 * nst; 16-byte aligned.
//   * idx int32 [Z, N, ldi] (ldi = nst * 64 / D * B / 32 words per row: the layout's bit streams, unchanged),
//     cb fp16 [R, C, Z, 2^B, D], both 16-byte aligned.
//   * every 128-row block lies in one row tile (trows a multiple of 128, or >= N) and every stage in one column
//     tile (cst = tile_cols / 64 stages per column tile); resident codebooks need C == 1.
//   * split-K (gridDim.z > 1): ws holds gridDim.z * gridDim.x * gridDim.y * 128 * TN floats and cnt
//     gridDim.x * gridDim.y zeros; the last block of each tile resets its counter.

#include "common/ptx_common.cuh"
#include "common/wgmma_epilogue.cuh"
#include "vq/decode.cuh"


// F = 2 (d = 4, one residual): the scope's codebook is held in 32-lane replicas, each entry a 128-byte line of 16
// copies, so lane l reads word l % 2 of an entry at bank l and no lookup of a warp conflicts (F = 0's random
// entries meet in a bank several times per instruction). 32 KiB per 256-entry scope: two buffers beside the ring,
// switched per column tile, filled by the first stage of each tile.
template <class Cfg, int F>
struct VqRep {
    static constexpr bool ON = F == 2;
    static_assert(!ON || (Cfg::D_ == 4 && Cfg::Z_ == 1 && !Cfg::RESIDENT), "replicas: d = 4, one residual");
    static constexpr int BYTES = ON ? Cfg::E * 128 : 0;  // one buffer
};

template <class Cfg, int TN, int F>
struct VqTile {
    static constexpr int XT = TN * 128;                                          // activations: TN rows of 64 halves
    static constexpr int IT = 128 * Cfg::IROW;                                   // indices of the block's 128 rows
    static constexpr int CT = Cfg::RESIDENT || VqRep<Cfg, F>::ON ? 0 : Cfg::CBB;  // the stage's codebooks (ring mode)
    static constexpr int SB = (XT + IT + CT + 1023) / 1024 * 1024;
};

struct VqArgs {
    const u16* x;
    int ldx;
    const u32* idx;
    int ldi;
    const u16* cb;
    int C, cst, rt;
    int M, N;
    int m0, n0;
};

__device__ __forceinline__ void cp_async8(u32 dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, 8;" ::"r"(dst), "l"(src) : "memory");
}

// Issue the copies of global stage gs into the shared-memory stage at `st`; rows past M or N are zero-filled (a
// zero index is a valid entry; those outputs are never stored). With replicas (F = 2), the first stage of a column
// tile (or of this block's share) also fills the tile's replica buffer at rep.
template <class Cfg, int TN, int F>
__device__ __forceinline__ void vq_load_stage(const VqArgs& a, u32 st, int gs, int tid, int s0, u32 rep) {
    using T = VqTile<Cfg, TN, F>;
    constexpr int Z = Cfg::Z_, IW = Cfg::IW, NW = Cfg::NW;
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
    constexpr int UNIT = IW % 4 == 0 ? 4 : 1;  // words per copy: 16-byte copies where the stage's words allow
    constexpr int CPR = IW / UNIT;            // copies per row and residual
    constexpr int NCP = 128 * Z * CPR;
#pragma unroll
    for (int c0 = 0; c0 < NCP; c0 += 256) {
        const int c = c0 + tid;
        if (NCP % 256 == 0 || c < NCP) {
            const int row = c / (Z * CPR), rem = c % (Z * CPR), res = rem / CPR, cw = rem % CPR;
            const bool ok = a.n0 + row < a.N;
            const u32* src = a.idx + (ok ? ((size_t)res * a.N + a.n0 + row) * a.ldi + gs * IW + cw * UNIT : 0);
            const u32 dst = st + T::XT + row * Cfg::IROW + res * NW * 4 + cw * UNIT * 4;
            if (UNIT == 4)
                cp_async16(dst, src, ok ? 16 : 0);
            else
                cp_async4(dst, src, ok ? 4 : 0);
        }
    }
    if constexpr (VqRep<Cfg, F>::ON) {
        if (gs % a.cst == 0 || gs == s0) {
            const int ct = gs / a.cst;
            const char* src = reinterpret_cast<const char*>(a.cb) + (size_t)(a.rt * a.C + ct) * Cfg::CBB;
            const u32 dst = rep + (u32)(ct & 1) * VqRep<Cfg, F>::BYTES;
#pragma unroll 4
            for (int c = tid; c < Cfg::E * 16; c += 256) cp_async8(dst + (c >> 4) * 128 + (c & 15) * 8, src + (c >> 4) * 8);
        }
    } else if constexpr (!Cfg::RESIDENT) {
        // the codebook switch: this stage's column tile picks the scope
        const char* src = reinterpret_cast<const char*>(a.cb) + (size_t)(a.rt * a.C + gs / a.cst) * Cfg::CBB;
#pragma unroll
        for (int c0 = 0; c0 < Cfg::CBB / 16; c0 += 256) {
            const int c = c0 + tid;
            if (Cfg::CBB / 16 % 256 == 0 || c < Cfg::CBB / 16) cp_async16(st + T::XT + T::IT + c * 16, src + c * 16, 16);
        }
    }
}

template <class Cfg, int TN, int ST, int F>
__device__ __forceinline__ void vq_stage_step(float (&acc)[TN / 2], u32 (&af)[4][4], const VqArgs& a, u32 base,
                                              u32 cbres, int s, int s0, int ns, int r0, int t, int tid) {
    using T = VqTile<Cfg, TN, F>;
    cp_async_wait<ST - 3>();  // this thread's copies of stage s are done
    fence_async_smem();       // the activations are read next by the tensor cores
    __syncthreads();          // everyone's copies; everyone's wgmma of stage s-2 is finished (wait 1 below)
    if (s + ST - 2 < ns)
        vq_load_stage<Cfg, TN, F>(a, base + (u32)((s + ST - 2) % ST) * T::SB, s0 + s + ST - 2, tid, s0, cbres);
    cp_async_commit();
    const u32 st = base + (u32)(s % ST) * T::SB;
    const u32 cbs = Cfg::RESIDENT ? cbres
                    : VqRep<Cfg, F>::ON ? cbres + (u32)(((s0 + s) / a.cst) & 1) * VqRep<Cfg, F>::BYTES
                                        : st + T::XT + T::IT;
    vq_dequant<Cfg, F>(af, st + T::XT, cbs, r0, t);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_acc(acc, af[j], desc_sw128(st + 32 * j));
    wgmma_commit();
    wgmma_wait1();
}

template <int D, int B, int Z, int TN, int ST, int F>
__device__ __forceinline__ void vq_body(const u16* __restrict__ x, int ldx, const u32* __restrict__ idx, int ldi,
                                        const u16* __restrict__ cb, int C, int trows, int cst,
                                        const u16* __restrict__ bias, u16* __restrict__ out, int ldc,
                                        float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int nst) {
    using Cfg = VqCfg<D, B, Z>;
    using T = VqTile<Cfg, TN, F>;
    static_assert(ST >= 3, "two stages in flight behind the one being decoded");
    extern __shared__ char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const u32 cbres = base + (u32)ST * T::SB;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int n0 = (int)blockIdx.x * 128;
    const VqArgs a{x, ldx, idx, ldi, cb, C, cst, n0 / trows, M, N, (int)blockIdx.y * TN, n0};
    const int S = gridDim.z, z = blockIdx.z;
    const int s0 = (int)((long long)z * nst / S), ns = (int)((long long)(z + 1) * nst / S) - s0;
    const int r0 = 64 * wg + 16 * warp + g;

    float acc[TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[i] = 0.f;

    if constexpr (Cfg::RESIDENT) {
        // the row tile's codebooks, once; they complete with stage 0's copies
        const char* src = reinterpret_cast<const char*>(cb) + (size_t)a.rt * C * Cfg::CBB;
        for (int c = tid; c < Cfg::CBB / 16; c += 256) cp_async16(cbres + c * 16, src + c * 16, 16);
    }
#pragma unroll
    for (int p = 0; p < ST - 2; ++p) {
        if (p < ns) vq_load_stage<Cfg, TN, F>(a, base + (u32)p * T::SB, s0 + p, tid, s0, cbres);
        cp_async_commit();
    }
    // Two sets of A fragments: a stage's wgmmas may still read one set while the next stage fills the other.
    u32 af0[4][4], af1[4][4];
    int s = 0;
    for (; s + 1 < ns; s += 2) {
        vq_stage_step<Cfg, TN, ST, F>(acc, af0, a, base, cbres, s, s0, ns, r0, t, tid);
        vq_stage_step<Cfg, TN, ST, F>(acc, af1, a, base, cbres, s + 1, s0, ns, r0, t, tid);
    }
    if (s < ns) vq_stage_step<Cfg, TN, ST, F>(acc, af0, a, base, cbres, s, s0, ns, r0, t, tid);
    wgmma_wait0();
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory is free from here on

    float (&acc1)[1][TN / 2] = *reinterpret_cast<float (*)[1][TN / 2]>(&acc);
    if (S > 1 && !split_k_sum<TN, 1, 0, 256>(acc1, ws, cnt, tid, z, S, gridDim.x * gridDim.y,
                                               blockIdx.x + gridDim.x * blockIdx.y))
        return;
    store_out<TN, 1, 0>(acc1, a.m0, a.n0, M, N, r0, t, tid, smem_raw, base, bias, out, ldc);
}

// MINB: blocks per SM the registers must allow.
#define VQ_ENTRY(D, B, Z, TN, ST, F, MINB)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, MINB) vq_gemm_d##D##_b##B##_z##Z##_n##TN##_s##ST##_f##F(     \
        const u16* x, int ldx, const u32* idx, int ldi, const u16* cb, int C, int trows, int cst, const u16* bias, \
        u16* out, int ldc, float* ws, int* cnt, int M, int N, int nst) {                                           \
        vq_body<D, B, Z, TN, ST, F>(x, ldx, idx, ldi, cb, C, trows, cst, bias, out, ldc, ws, cnt, M, N, nst);      \
    }
#define VQ_ENTRIES(D, B, Z, TN, ST, MINB) VQ_ENTRY(D, B, Z, TN, ST, 1, MINB) VQ_ENTRY(D, B, Z, TN, ST, 0, MINB)
// GPTVQ-2: 2 KiB scopes carried in the ring, or replicated beside it (F = 2)
VQ_ENTRIES(4, 8, 1, 32, 6, 1)
VQ_ENTRIES(4, 8, 1, 64, 6, 1)
VQ_ENTRIES(4, 8, 1, 128, 4, 1)
VQ_ENTRIES(4, 8, 1, 256, 4, 1)
VQ_ENTRY(4, 8, 1, 32, 6, 2, 1)
VQ_ENTRY(4, 8, 1, 64, 6, 2, 1)
VQ_ENTRY(4, 8, 1, 128, 4, 2, 1)
VQ_ENTRY(4, 8, 1, 256, 4, 2, 1)
// AQLM-3: 128 KiB of resident codebooks beside the ring
VQ_ENTRIES(8, 12, 2, 32, 6, 1)
VQ_ENTRIES(8, 12, 2, 64, 4, 1)
VQ_ENTRIES(8, 12, 2, 128, 3, 1)
