// Kernels for the `quik` layout (formats/quik.md): per-token activation quantization with float16 outlier
// columns, and the integer GEMM with the dequantization epilogue (QUIK, Eq. 1) and the outlier product fused.
//
// Compiled at run time by NVRTC for sm_90a (qtool/cuda/compile.py); `wgmma` needs Hopper. No CUDA headers: float
// and half helpers are inline PTX (here and in ptx_common.cuh), so the source builds with any NVRTC.
//
// Hopper has no INT4 tensor cores (mma s4 is emulated), so 4-bit codes are unpacked to s8 in registers on their
// way to shared memory and multiplied by `wgmma ... s32.s8.s8`; 8-bit codes only flip their offset bit.
//
// Runtime contract (qtool/cuda/quik.py guarantees it before launching):
//   * A (activation codes) rows hold Kp base columns, Kp a multiple of 128; columns Kb..Kp-1 hold the signed-zero
//     code 2^(b-1), so whatever B holds there multiplies zero. B (weight codes) rows hold at least Kp columns.
//   * Code words are the bit streams of formats/quik.md: unsigned u = c + 2^(b-1), code j of a row at bits
//     b*(j mod 32/b) of word j*b/32. Row strides are in 32-bit words and multiples of 4 (16-byte loads).
//   * The outlier operands Xo [M, ldo] and Wo [N, ldo] are float16 with ldo a multiple of 32, zero beyond k.
//   * Both operands have the same code width (W4A4 or W8A8).
//
// Unpacking 4-bit codes permutes K inside every group of 32 codes (even codes first, then odd); A and B are
// unpacked the same way, so every dot product sums the same pairs and the int32 result is exact. For that reason
// both operands have the same bit width (W4A4, W8A8); mixed widths run on the reference path.

#include "ptx_common.cuh"

__device__ __forceinline__ float div_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// Round to the nearest integer, ties to even (torch.round).
__device__ __forceinline__ float rint_even(float a) {
    float r;
    asm("cvt.rni.f32.f32 %0, %1;" : "=f"(r) : "f"(a));
    return r;
}

__device__ __forceinline__ float fmin_(float a, float b) {
    float r;
    asm("min.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float fmax_(float a, float b) {
    float r;
    asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float shfl_xor(float v, int m) {
    float r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=f"(r) : "f"(v), "r"(m));
    return r;
}

__device__ __forceinline__ u32 shfl_xor_u32(u32 v, int m) {
    u32 r;
    asm volatile("shfl.sync.bfly.b32 %0, %1, %2, 0x1f, 0xffffffff;" : "=r"(r) : "r"(v), "r"(m));
    return r;
}

__device__ __forceinline__ uint4 ld16(const u32* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

__device__ __forceinline__ void st_shared16(u32 addr, uint4 v) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

// ---------------------------------------------------------------------------------------------------------------
// Fused split + quantize: a persistent grid; R token rows at a time per block of 256 threads, T = 256/R per row. The row is read once
// (16-byte loads) into shared memory; min/max over the base columns, then the codes are computed and packed, and
// the outlier columns gathered into a dense float16 buffer. Step 2 of formats/quik.md in float32 with an IEEE
// division, so the codes equal the reference's. Threads take consecutive base columns (coalesced index reads,
// conflict-free shared-memory gathers) and neighbouring lanes OR their codes into one word.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float warp_min(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v = fmin_(v, shfl_xor(v, m));
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) v = fmax_(v, shfl_xor(v, m));
    return v;
}

template <int AB, int R>
__device__ __forceinline__ void quantize_rows(const u16* __restrict__ x, int ldx, int M, int K,
                                              const int* __restrict__ base_idx, int kb,
                                              const int* __restrict__ out_idx, int ko,
                                              u32* __restrict__ aq, int lda, u16* __restrict__ xo, int ldo,
                                              float* __restrict__ sx, float* __restrict__ zx) {
    // Shared memory: the layer's base column indices (kb ints), then R rows of K halves.
    extern __shared__ int qsm[];
    __shared__ float red_lo[8], red_hi[8];
    constexpr int T = 256 / R;  // threads per row
    constexpr int WPR = T / 32;  // warps per row
    constexpr int MAXQ = (1 << AB) - 1;
    constexpr int PER = 32 / AB;  // codes per word
    const int tid = threadIdx.x, g = tid / T, lt = tid % T, lane = tid & 31;
    int* bidx = qsm;
    u16* xr = reinterpret_cast<u16*>(qsm + ((kb + 3) & ~3)) + (size_t)g * K;
    // The layer's column map is staged once per (persistent) block: 16-byte loads, several in flight.
    if ((kb & 3) == 0) {
        const int4* src4 = reinterpret_cast<const int4*>(base_idx);
        int4* dst4 = reinterpret_cast<int4*>(bidx);
        int i = tid;
        for (; i + 768 < kb / 4; i += 1024) {
            const int4 v0 = src4[i], v1 = src4[i + 256], v2 = src4[i + 512], v3 = src4[i + 768];
            dst4[i] = v0;
            dst4[i + 256] = v1;
            dst4[i + 512] = v2;
            dst4[i + 768] = v3;
        }
        for (; i < kb / 4; i += 256) dst4[i] = src4[i];
    } else {
        for (int j = tid; j < kb; j += 256) bidx[j] = base_idx[j];
    }
    float inf;
    asm("mov.b32 %0, 0x7f800000;" : "=f"(inf));
    const int groups = (M + R - 1) / R;
    for (int rg = blockIdx.x; rg < groups; rg += gridDim.x) {
        const int row = rg * R + g;
        const bool valid = row < M;
        __syncthreads();  // the previous rows' shared-memory reads are done (and the column map is staged)
        if (valid) {
            const u16* src = x + (size_t)row * ldx;
            if ((K & 7) == 0 && (ldx & 7) == 0) {
                const u32* s32 = reinterpret_cast<const u32*>(src);
                const int pieces = K / 8;
                int i = lt;
                for (; i + 3 * T < pieces; i += 4 * T) {  // four 16-byte loads in flight per thread
                    const uint4 v0 = ld16(s32 + 4 * i), v1 = ld16(s32 + 4 * (i + T));
                    const uint4 v2 = ld16(s32 + 4 * (i + 2 * T)), v3 = ld16(s32 + 4 * (i + 3 * T));
                    *reinterpret_cast<uint4*>(xr + 8 * i) = v0;
                    *reinterpret_cast<uint4*>(xr + 8 * (i + T)) = v1;
                    *reinterpret_cast<uint4*>(xr + 8 * (i + 2 * T)) = v2;
                    *reinterpret_cast<uint4*>(xr + 8 * (i + 3 * T)) = v3;
                }
                for (; i < pieces; i += T) *reinterpret_cast<uint4*>(xr + 8 * i) = ld16(s32 + 4 * i);
            } else {
                for (int i = lt; i < K; i += T) xr[i] = src[i];
            }
        }
        __syncthreads();
        float lo = inf, hi = -inf;
        if (valid) {
            float l4[4] = {inf, inf, inf, inf}, h4[4] = {-inf, -inf, -inf, -inf};
            int j = lt;
            for (; j + 3 * T < kb; j += 4 * T) {
#pragma unroll
                for (int u = 0; u < 4; ++u) {
                    const float v = h2f(xr[bidx[j + u * T]]);
                    l4[u] = fmin_(l4[u], v);
                    h4[u] = fmax_(h4[u], v);
                }
            }
            for (; j < kb; j += T) {
                const float v = h2f(xr[bidx[j]]);
                l4[0] = fmin_(l4[0], v);
                h4[0] = fmax_(h4[0], v);
            }
            lo = fmin_(fmin_(l4[0], l4[1]), fmin_(l4[2], l4[3]));
            hi = fmax_(fmax_(h4[0], h4[1]), fmax_(h4[2], h4[3]));
        }
        lo = warp_min(lo);
        hi = warp_max(hi);
        const int warp = tid / 32;
        if (lane == 0) {
            red_lo[warp] = lo;
            red_hi[warp] = hi;
        }
        __syncthreads();
        lo = red_lo[g * WPR];
        hi = red_hi[g * WPR];
#pragma unroll
        for (int w = 1; w < WPR; ++w) {
            lo = fmin_(lo, red_lo[g * WPR + w]);
            hi = fmax_(hi, red_hi[g * WPR + w]);
        }
        if (!valid) continue;  // (the next iteration's barriers are reached by every thread)
        const float s = hi > lo ? div_rn(hi - lo, (float)MAXQ) : 1.0f;
        u32* dst = aq + (size_t)row * lda;
        const int kp = lda * PER;  // a multiple of 128: `j < kp` is the same for a whole warp
        for (int j0 = 0; j0 < kp; j0 += 4 * T) {
            u32 v[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int j = j0 + u * T + lt;
                u32 code = 1u << (AB - 1);  // signed zero beyond the base columns
                if (j < kb) {
                    float q = rint_even(div_rn(h2f(xr[bidx[j]]) - lo, s));
                    q = fmin_(fmax_(q, 0.0f), (float)MAXQ);
                    code = (u32)q;
                }
                v[u] = code << (AB * (lane % PER));
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const int j = j0 + u * T + lt;
                if (j < kp) {
#pragma unroll
                    for (int m = 1; m < PER; m <<= 1) v[u] |= shfl_xor_u32(v[u], m);
                    if (lane % PER == 0) dst[j / PER] = v[u];
                }
            }
        }
        u16* orow = xo + (size_t)row * ldo;
        for (int i = lt; i < ldo; i += T) orow[i] = i < ko ? xr[out_idx[i]] : (u16)0;
        if (lt == 0) {
            sx[row] = s;
            zx[row] = lo;
        }
    }
}

#define QUANT_ENTRY(AB, R)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) quik_quantize_a##AB##_r##R(                               \
        const u16* x, int ldx, int M, int K, const int* base_idx, int kb, const int* out_idx, int ko, u32* aq,    \
        int lda, u16* xo, int ldo, float* sx, float* zx) {                                                        \
        quantize_rows<AB, R>(x, ldx, M, K, base_idx, kb, out_idx, ko, aq, lda, xo, ldo, sx, zx);                 \
    }
QUANT_ENTRY(4, 1)
QUANT_ENTRY(4, 2)
QUANT_ENTRY(4, 4)
QUANT_ENTRY(8, 1)
QUANT_ENTRY(8, 2)
QUANT_ENTRY(8, 4)

// ---------------------------------------------------------------------------------------------------------------
// GEMM: C[M,N] = epilogue(A[M,Kp] · B[N,Kp]^T) (+ Xo · Wo^T), tile 128 x 128, 256 threads = 2 warpgroups, each
// computing 64 rows x 128 columns with wgmma m64n128k32 (s8) and, for the outlier columns, m64n128k16 (f16).
//
// Every k-step moves 64 bytes of each operand row from global memory: 128 four-bit codes (unpacked to 128 bytes
// of s8), 64 eight-bit codes or 32 float16 outlier columns. Shared memory holds each row's step in a 128-byte
// row with the 128-byte swizzle of the wgmma canonical K-major layout (16-byte chunk j of row r at chunk
// j ^ (r mod 8)). Three shared-memory stages; the global loads run two steps ahead in two register sets, and one
// wgmma group stays in flight across the block barrier.
//
// The integer accumulators turn into float32 in place (same registers, float bits) when the integer steps end:
// Eq. 1 is applied there and the float16 outlier steps accumulate on top.
// ---------------------------------------------------------------------------------------------------------------
constexpr int BM = 128, BN = 128;
constexpr int TILE_BYTES = 128 * 128;  // one operand, one stage
constexpr int STAGE_BYTES = 2 * TILE_BYTES;
constexpr int STAGES = 3;

__device__ __forceinline__ int f2bits(float f) {
    int r;
    asm("mov.b32 %0, %1;" : "=r"(r) : "f"(f));
    return r;
}

__device__ __forceinline__ float bits2f(int b) {
    float r;
    asm("mov.b32 %0, %1;" : "=f"(r) : "r"(b));
    return r;
}

#define R8(a, i) "+r"(a[i]), "+r"(a[i + 1]), "+r"(a[i + 2]), "+r"(a[i + 3]), "+r"(a[i + 4]), "+r"(a[i + 5]), \
                 "+r"(a[i + 6]), "+r"(a[i + 7])

__device__ __forceinline__ void wgmma_s8(int (&d)[64], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0; "
        "wgmma.mma_async.sync.aligned.m64n128k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p; }"
        : R8(d, 0), R8(d, 8), R8(d, 16), R8(d, 24), R8(d, 32), R8(d, 40), R8(d, 48), R8(d, 56)
        : "l"(da), "l"(db), "r"(1));
}

// Float32 accumulators held as their bits in the same registers as the integer ones.
__device__ __forceinline__ void wgmma_f16(int (&d)[64], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0; "
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0; }"
        : R8(d, 0), R8(d, 8), R8(d, 16), R8(d, 24), R8(d, 32), R8(d, 40), R8(d, 48), R8(d, 56)
        : "l"(da), "l"(db), "r"(1));
}

// One operand's 64 bytes per row of one step for 128 rows: 512 pieces of 16 bytes, two per thread.
__device__ __forceinline__ void tile_load(uint4 (&r)[2], const u32* __restrict__ base, int ld, int row0, int rows,
                                          int word_off, int tid) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int p = tid + 256 * i, row = p / 4, q = p % 4;
        if (row0 + row < rows) {
            r[i] = ld16(base + (size_t)(row0 + row) * ld + word_off + 4 * q);
        } else {
            r[i] = make_uint4(0, 0, 0, 0);
        }
    }
}

__device__ __forceinline__ u32 nib_s8(u32 w) {
    // bytes holding u in 0..15 -> u - 8 as s8: u + 120 stays below 256 (no carry), then flip the sign bit.
    return ((w & 0x0F0F0F0Fu) + 0x78787878u) ^ 0x80808080u;
}

// KIND 4: four-bit codes, each 16-byte piece becomes two chunks (even codes, odd codes). KIND 8: eight-bit codes,
// offset bit flipped. KIND 16: float16, stored as is.
template <int KIND>
__device__ __forceinline__ void tile_store(const uint4 (&r)[2], u32 tile, int tid) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int p = tid + 256 * i, row = p / 4, q = p % 4;
        const u32 rowa = tile + row * 128;
        const int sw = row & 7;
        const uint4 v = r[i];
        if (KIND == 4) {
            uint4 lo = make_uint4(nib_s8(v.x), nib_s8(v.y), nib_s8(v.z), nib_s8(v.w));
            uint4 hi = make_uint4(nib_s8(v.x >> 4), nib_s8(v.y >> 4), nib_s8(v.z >> 4), nib_s8(v.w >> 4));
            st_shared16(rowa + (((2 * q) ^ sw) << 4), lo);
            st_shared16(rowa + (((2 * q + 1) ^ sw) << 4), hi);
        } else if (KIND == 8) {
            const u32 f = 0x80808080u;
            st_shared16(rowa + ((q ^ sw) << 4), make_uint4(v.x ^ f, v.y ^ f, v.z ^ f, v.w ^ f));
        } else {
            st_shared16(rowa + ((q ^ sw) << 4), v);
        }
    }
}

struct GemmArgs {
    const u32* A;
    int lda;
    const u32* B;
    int ldb;
    int M, N, kt;
    const u32* Xo;
    const u32* Wo;
    int ldo_w;
    int m0, n0;
};

template <int BITS>
__device__ __forceinline__ void step_load(uint4 (&ra)[2], uint4 (&rb)[2], int step, const GemmArgs& g, int tid) {
    if (step < g.kt) {
        tile_load(ra, g.A, g.lda, g.m0, g.M, step * 16, tid);  // 64 bytes = 16 words per step
        tile_load(rb, g.B, g.ldb, g.n0, g.N, step * 16, tid);
    } else {
        tile_load(ra, g.Xo, g.ldo_w, g.m0, g.M, (step - g.kt) * 16, tid);
        tile_load(rb, g.Wo, g.ldo_w, g.n0, g.N, (step - g.kt) * 16, tid);
    }
}

template <int BITS>
__device__ __forceinline__ void step_store(const uint4 (&ra)[2], const uint4 (&rb)[2], int step, int kt, u32 stage,
                                           int tid) {
    if (step < kt) {
        tile_store<BITS>(ra, stage, tid);
        tile_store<BITS>(rb, stage + TILE_BYTES, tid);
    } else {
        tile_store<16>(ra, stage, tid);
        tile_store<16>(rb, stage + TILE_BYTES, tid);
    }
    fence_async_smem();  // ordinary stores, read next by the tensor cores (async proxy)
}

// Eq. 1 on this thread's accumulators, in place: acc·s_x·s_w + (z_x + h·s_x)·wReduced, as float bits.
template <int BITS>
__device__ __forceinline__ void eq1_in_place(int (&acc)[64], int r0, int cbase, int M, int N,
                                             const float* __restrict__ sx, const float* __restrict__ zx,
                                             const u16* __restrict__ sw, const float* __restrict__ wred) {
    const float h = (float)(1 << (BITS - 1));
    const int r1 = r0 + 8;
    const float sx0 = r0 < M ? sx[r0] : 0.f, sx1 = r1 < M ? sx[r1] : 0.f;
    const float a0 = r0 < M ? zx[r0] + h * sx0 : 0.f, a1 = r1 < M ? zx[r1] + h * sx1 : 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int c = cbase + 8 * i + e;
            const float swc = c < N ? h2f(sw[c]) : 0.f, wr = c < N ? wred[c] : 0.f;
            acc[4 * i + e] = f2bits((float)acc[4 * i + e] * sx0 * swc + a0 * wr);
            acc[4 * i + 2 + e] = f2bits((float)acc[4 * i + 2 + e] * sx1 * swc + a1 * wr);
        }
    }
}

template <int BITS>
__device__ __forceinline__ void gemm_step(int (&acc)[64], uint4 (&xa)[2], uint4 (&xb)[2], uint4 (&ya)[2],
                                          uint4 (&yb)[2], int s, int steps, const GemmArgs& g, u32 base, int tid,
                                          int wg, int r0, int cbase, const float* sx, const float* zx, const u16* sw,
                                          const float* wred) {
    // X holds step s+1 (loads in flight); Y receives step s+2, loaded after this step's shared-memory fence: the
    // fence compiles to MEMBAR.ALL.CTA, which would otherwise wait for those loads too.
    if (s == g.kt && g.kt > 0) {
        wgmma_wait0();
        eq1_in_place<BITS>(acc, r0, cbase, g.M, g.N, sx, zx, sw, wred);
    }
    const u32 stage = base + (u32)(s % STAGES) * STAGE_BYTES;
    const u32 ta = stage + wg * (64 * 128), tb = stage + TILE_BYTES;
    wgmma_fence();
    if (s < g.kt) {
        constexpr int CH = BITS == 4 ? 4 : 2;  // 32-byte k-chunks per step
#pragma unroll
        for (int c = 0; c < CH; ++c) wgmma_s8(acc, desc_sw128(ta + 32 * c), desc_sw128(tb + 32 * c));
    } else {
#pragma unroll
        for (int c = 0; c < 2; ++c) wgmma_f16(acc, desc_sw128(ta + 32 * c), desc_sw128(tb + 32 * c));
    }
    wgmma_commit();
    // Stage (s+1) mod 3 was last read by step s-2's wgmma, finished at the previous step's wait.
    if (s + 1 < steps) step_store<BITS>(xa, xb, s + 1, g.kt, base + (u32)((s + 1) % STAGES) * STAGE_BYTES, tid);
    if (s + 2 < steps) step_load<BITS>(ya, yb, s + 2, g, tid);
    wgmma_wait1();
    __syncthreads();
}

template <int BITS>
__device__ __forceinline__ void epilogue_f16(int (&acc)[64], int r0, int cbase, int M, int N, int kt, int steps,
                                             const float* __restrict__ sx, const float* __restrict__ zx,
                                             const u16* __restrict__ sw, const float* __restrict__ wred,
                                             const u16* __restrict__ bias, void* __restrict__ out, int ldc) {
    const int r1 = r0 + 8;
    if (steps == kt && kt > 0) eq1_in_place<BITS>(acc, r0, cbase, M, N, sx, zx, sw, wred);
    u16* o = reinterpret_cast<u16*>(out);
    const bool pairs = (ldc & 1) == 0;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
        const int c = cbase + 8 * i;
        const float b0 = (bias && c < N) ? h2f(bias[c]) : 0.f, b1 = (bias && c + 1 < N) ? h2f(bias[c + 1]) : 0.f;
#pragma unroll
        for (int hrow = 0; hrow < 2; ++hrow) {
            const int r = hrow ? r1 : r0;
            if (r >= M) continue;
            const u16 v0 = f2h(bits2f(acc[4 * i + 2 * hrow]) + b0), v1 = f2h(bits2f(acc[4 * i + 2 * hrow + 1]) + b1);
            u16* p = o + (size_t)r * ldc + c;
            if (pairs && c + 1 < N) {
                *reinterpret_cast<u32*>(p) = (u32)v0 | ((u32)v1 << 16);
            } else {
                if (c < N) p[0] = v0;
                if (c + 1 < N) p[1] = v1;
            }
        }
    }
}

// raw: write the int32 accumulators (the caller passes kto = 0; the unfused ladder rungs). Otherwise the float16
// output of the fused epilogue, outliers and bias included. A run-time flag, not a template parameter: NVRTC 12.9's
// assembler crashed on separate raw instantiations.
template <int BITS>
__device__ __forceinline__ void gemm_body(const u32* __restrict__ A, int lda, const u32* __restrict__ B, int ldb,
                                          int M, int N, int kt, const u16* __restrict__ Xo,
                                          const u16* __restrict__ Wo, int ldo, int kto,
                                          const float* __restrict__ sx, const float* __restrict__ zx,
                                          const u16* __restrict__ sw, const float* __restrict__ wred,
                                          const u16* __restrict__ bias, void* __restrict__ out, int ldc, int raw) {
    extern __shared__ char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const int tid = threadIdx.x, wg = tid / 128, lane = tid & 31, warp_in_wg = (tid / 32) & 3;
    GemmArgs g{A, lda, B, ldb, M, N, kt, reinterpret_cast<const u32*>(Xo), reinterpret_cast<const u32*>(Wo),
               ldo / 2, (int)blockIdx.y * BM, (int)blockIdx.x * BN};
    const int steps = kt + kto;

    int acc[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) acc[i] = 0;
    // Rows and columns this thread's accumulators hold (the wgmma D layout).
    const int r0 = g.m0 + wg * 64 + warp_in_wg * 16 + lane / 4, r1 = r0 + 8;
    const int cbase = g.n0 + 2 * (lane & 3);

    uint4 pa[2], pb[2], qa[2], qb[2];
    if (steps > 0) {
        step_load<BITS>(pa, pb, 0, g, tid);
        step_store<BITS>(pa, pb, 0, kt, base, tid);
    }
    if (steps > 1) step_load<BITS>(qa, qb, 1, g, tid);
    __syncthreads();
    int s = 0;
    for (; s + 1 < steps; s += 2) {
        gemm_step<BITS>(acc, qa, qb, pa, pb, s, steps, g, base, tid, wg, r0, cbase, sx, zx, sw, wred);
        gemm_step<BITS>(acc, pa, pb, qa, qb, s + 1, steps, g, base, tid, wg, r0, cbase, sx, zx, sw, wred);
    }
    if (s < steps) gemm_step<BITS>(acc, qa, qb, pa, pb, s, steps, g, base, tid, wg, r0, cbase, sx, zx, sw, wred);
    wgmma_wait0();

    if (raw) {
        int* o = reinterpret_cast<int*>(out);
#pragma unroll
        for (int i = 0; i < 16; ++i) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int c = cbase + 8 * i + e;
                if (c < N) {
                    if (r0 < M) o[(size_t)r0 * ldc + c] = acc[4 * i + e];
                    if (r1 < M) o[(size_t)r1 * ldc + c] = acc[4 * i + 2 + e];
                }
            }
        }
    } else {
        epilogue_f16<BITS>(acc, r0, cbase, M, N, kt, steps, sx, zx, sw, wred, bias, out, ldc);
    }
}

// Two resident blocks per SM (128 registers each) hide each other's barriers.
#define GEMM_ENTRY(BITS)                                                                                       \
    extern "C" __global__ void __launch_bounds__(256, 2) quik_gemm_w##BITS(                                    \
        const u32* A, int lda, const u32* B, int ldb, int M, int N, int kt, const u16* Xo, const u16* Wo, int ldo, \
        int kto, const float* sx, const float* zx, const u16* sw, const float* wred, const u16* bias, void* out,    \
        int ldc, int raw) {                                                                                       \
        gemm_body<BITS>(A, lda, B, ldb, M, N, kt, Xo, Wo, ldo, kto, sx, zx, sw, wred, bias, out, ldc, raw);       \
    }
GEMM_ENTRY(4)
GEMM_ENTRY(8)

