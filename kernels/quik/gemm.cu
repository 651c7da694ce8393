// Kernels for the `quik` layout (formats/quik.md): per-token activation quantization with float16 outlier
// columns, and the integer GEMM with the dequantization epilogue (QUIK, Eq. 1) and the outlier product fused.
//
// Compiled at run time by NVRTC for sm_90a (qtool/cuda/compile.py); `wgmma` needs Hopper. No CUDA headers: float
// and half helpers are inline PTX (here and in common/ptx_common.cuh), so the source builds with any NVRTC.
//
// Hopper has no INT4 tensor cores (mma s4 is emulated), so everything is multiplied by `wgmma ... s32.s8.s8`:
// the activation codes are written as one s8 per code by the quantize kernel (4-bit storage is for weights; an
// activation row lives for one layer call), and the weight codes are turned into s8 in registers, where wgmma
// takes its A operand from.
//
// Runtime contract (qtool/cuda/quik.py guarantees it before launching):
//   * Activation rows (s8, Kp bytes, Kp a multiple of 128) hold the signed code c - 2^(b-1) of base column b at
//     byte pos(b); positions kb..Kp-1 hold 0. At 8 bits pos(b) = b. At 4 bits, inside every group of 32 columns,
//     the even columns come first, then the odd ones: pos(b) = 32*(b/32) + 16*(b%2) + (b%32)/2. That is the order
//     in which a 4-bit weight word unpacks (low nibbles, then high nibbles), so the int32 sums equal step 3 of
//     formats/quik.md exactly.
//   * Weight code rows hold Kp codes: the checkpoint's bit streams (padded only where the base column count is not
//     a multiple of 128). The float16 outlier weights Wo [N, kop] have kop a multiple of 64, zero beyond ko.
//   * Outlier activations Xo [M, kop] float16, zero beyond ko. Row strides are in bytes, multiples of 16.

#include "common/ptx_common.cuh"
#include "qoq/act.cuh"

// Measurement builds only (qtool.cuda.compile extra options): QUIK_TUNING adds variants, QUIK_ABLATE removes a
// part of the GEMM loop (1: the integer wgmmas, 2: the loads after the prologue, 4: the A-fragment loads and
// unpacking) or changes it (3: 8-bit A read by wgmma from shared memory instead of registers; wrong values, timing
// only) to see what bounds it.
#ifndef QUIK_TUNING
#define QUIK_TUNING 0
#endif
#ifndef QUIK_ABLATE
#define QUIK_ABLATE 0
#endif
// QUIK_EPI (measurement only): 1 the persistent epilogue's stores skip the wait for their buffers (a race), 2 it
// stores nothing, 3 neither Eq. 1 nor stores, 4 stmatrix only (no fence, barrier or bulk store), 5 stmatrix, fence
// and barrier but no bulk store (wrong values; timing only)
#ifndef QUIK_EPI
#define QUIK_EPI 0
#endif
// QUIK_TRACE (measurement only): the fused form writes %globaltimer (low 32 bits, ns) at its events into
// ready[64 + 64 * block + slot] (the caller grows the counter buffer): 0 block start, 1..8 the math warps' first
// rows done, 9..32 the copy warps' rows done (8 each), 33..40 tile starts, 41..48 tile ends, 49 first copy.
#ifndef QUIK_TRACE
#define QUIK_TRACE 0
#endif
__device__ __forceinline__ void trace_at(int* ready, int slot) {
#if QUIK_TRACE
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    ready[64 + 64 * blockIdx.x + slot] = (int)(u32)t;
#endif
}

__device__ __forceinline__ float div_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
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

__device__ __forceinline__ void st_global16(void* p, uint4 v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
                 : "memory");
}

// ---------------------------------------------------------------------------------------------------------------
// Fused split + quantize, block-per-row form: a block of NT threads per token row (rows row, row + grid, ...; the
// launch gives every row its own block, since a persistent grid that prefetched the next row was slower,
// kernels/NOTES.md). Every thread holds PPT pieces of 8 columns of the row in registers. Per row: min/max over
// the base columns (outlier flags: one bit per column), a block reduction, then each code is computed (step 2 of
// formats/quik.md: y = RN(1/s) once per row, then one fused multiply-add per code, ties to even: the codes equal
// the reference's) and dropped at its position in a shared-memory copy of the output row, outlier values at their
// slot; the finished row leaves with 16-byte stores.
//
// dest [K]: position of the column's code in the activation row, or -(1 + slot) for an outlier column.
// oflag [ceil(K/8)]: bit i of byte p is set when column 8p + i is an outlier.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float sub_rn(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ u32 hmin2(u32 a, u32 b) {
    u32 r;
    asm("min.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 hmax2(u32 a, u32 b) {
    u32 r;
    asm("max.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// The s8 code rint(d·y) - 2^(AB-1), ties to even, for 0 <= d·y <= 2^AB - 1 (plus rounding), in the low byte of
// the result: d·y + (1.5 * 2^23 - 2^(AB-1)) lies in [2^23, 2^24), where floats are the integers, so the one
// rounding of the fused multiply-add is the exact product's rounding to an integer, ties to even (the added
// constant is even, so ties go the same way), and the low mantissa bits hold the integer minus 2^(AB-1) modulo 256.
// One instruction for the product, the rounding and the offset (step 2 of formats/quik.md rounds the exact product
// for this reason).
template <int AB>
__device__ __forceinline__ u32 code_of(float d, float y) {
    u32 r;
    asm("{ .reg .f32 t; fma.rn.f32 t, %1, %2, %3; mov.b32 %0, t; }"
        : "=r"(r) : "f"(d), "f"(y), "f"(12582912.0f - (float)(1 << (AB - 1))));
    return r;
}

template <int NT, int PPT>
__device__ __forceinline__ void load_row(uint4 (&v)[PPT], u32 (&fl)[PPT], const u16* __restrict__ src, int K,
                                         int vec, const u8* __restrict__ oflag, int tid) {
    const int np = (K + 7) >> 3;
#pragma unroll
    for (int u = 0; u < PPT; ++u) {
        const int p = tid + NT * u;
        v[u] = make_uint4(0, 0, 0, 0);
        fl[u] = 0xFF;
        if (p < np) {
            if (vec) {
                v[u] = ld_dep_v4(src + 8 * p);
            } else {
                u32 w[4] = {0, 0, 0, 0};
#pragma unroll
                for (int i = 0; i < 8; ++i)
                    if (8 * p + i < K) w[i >> 1] |= (u32)ld_dep_u16(src + 8 * p + i) << (16 * (i & 1));
                v[u] = make_uint4(w[0], w[1], w[2], w[3]);
            }
            // columns past K count as outliers here (never base) and are skipped below
            const int past = 8 * p + 8 - K;
            fl[u] = (u32)oflag[p] | (past > 0 ? (0xFFu << (8 - past)) & 0xFFu : 0u);
        }
    }
}

// QoQ's symmetric codes (AB = SYM_A8): clamp(rint(x·r), -127, 127) with r = 127 / max|x| and x·r one rounded
// product (then rint: the fma trick of code_of would round the exact product instead, which differs at ties).
constexpr int SYM_A8 = 0;

__device__ __forceinline__ int sym_code(float x, float r) { return qa_code(x, r); }

// AB = SYM_A8: QoQ's per-token symmetric 8-bit codes (no outlier columns), s_x = max|x| / 127 into sx and the row's
// code sum into rsum instead of the asymmetric z_x.
template <int AB, int NT, int PPT>
__device__ __forceinline__ void quantize_one(const uint4 (&v)[PPT], const u32 (&fl)[PPT], int row, int K, int vec,
                                             const int* __restrict__ dest, int kp, int kop, char* cs, u16* os,
                                             float* red, char* __restrict__ aq, u16* __restrict__ xo,
                                             float* __restrict__ sx, float* __restrict__ zx, int tid,
                                             int* rsred = nullptr, int* __restrict__ rsum = nullptr) {
    constexpr bool SYM = AB == SYM_A8;
    constexpr int MAXQ = SYM ? 127 : (1 << AB) - 1, W = NT / 32;
    const int lane = tid & 31, warp = tid >> 5, np = (K + 7) >> 3;
    float inf;
    asm("mov.b32 %0, 0x7f800000;" : "=f"(inf));
    // min/max of fp16 values is exact in fp16: whole pieces without outliers take f16x2 min/max (2 ops per 2
    // columns), the few pieces with outlier (or past-K) columns go column by column
    float lo = inf, hi = -inf;
    u32 lo2 = 0x7C007C00u, hi2 = 0xFC00FC00u;
#pragma unroll
    for (int u = 0; u < PPT; ++u) {
        if (fl[u] == 0) {
            lo2 = hmin2(hmin2(lo2, v[u].x), hmin2(v[u].y, hmin2(v[u].z, v[u].w)));
            hi2 = hmax2(hmax2(hi2, v[u].x), hmax2(v[u].y, hmax2(v[u].z, v[u].w)));
        } else {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (!((fl[u] >> i) & 1)) {
                    const float f = h2f(half_of(v[u], i));
                    lo = fmin_(lo, f);
                    hi = fmax_(hi, f);
                }
            }
        }
    }
    lo = fmin_(lo, fmin_(h2f((u16)(lo2 & 0xFFFF)), h2f((u16)(lo2 >> 16))));
    hi = fmax_(hi, fmax_(h2f((u16)(hi2 & 0xFFFF)), h2f((u16)(hi2 >> 16))));
    lo = warp_min(lo);
    hi = warp_max(hi);
    if (lane == 0) {
        red[warp] = lo;
        red[W + warp] = hi;
    }
    __syncthreads();  // also: the previous row's copy-out is done with cs and os
    lo = red[0];
    hi = red[W];
#pragma unroll
    for (int w = 1; w < W; ++w) {
        lo = fmin_(lo, red[w]);
        hi = fmax_(hi, red[W + w]);
    }
    float s, y;
    if (SYM) {
        // hi >= lo, so max|x| = max(hi, -lo); y is r = 127 / max|x|
        const float amax = fmax_(hi, -lo);
        s = amax > 0.f ? div_rn(amax, (float)MAXQ) : 1.0f;
        y = amax > 0.f ? div_rn((float)MAXQ, amax) : 1.0f;
    } else {
        s = hi > lo ? div_rn(hi - lo, (float)MAXQ) : 1.0f;
        y = div_rn(1.0f, s);
    }
    int csum = 0;
#pragma unroll
    for (int u = 0; u < PPT; ++u) {
        const int p = tid + NT * u;
        if (p < np) {
            int d[8];
            if (vec) {
                const uint4 d0 = ld_nc_v4(reinterpret_cast<const u32*>(dest + 8 * p));
                const uint4 d1 = ld_nc_v4(reinterpret_cast<const u32*>(dest + 8 * p + 4));
                d[0] = (int)d0.x, d[1] = (int)d0.y, d[2] = (int)d0.z, d[3] = (int)d0.w;
                d[4] = (int)d1.x, d[5] = (int)d1.y, d[6] = (int)d1.z, d[7] = (int)d1.w;
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) d[i] = 8 * p + i < K ? __ldg(dest + 8 * p + i) : 0;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (8 * p + i < K) {
                    const u16 h = half_of(v[u], i);
                    if constexpr (SYM) {
                        const int q = sym_code(h2f(h), y);
                        cs[d[i]] = (char)q;
                        csum += q;
                    } else if (d[i] >= 0) {
                        // no clamp needed: 0 <= x - lo <= hi - lo, and (hi - lo)·y <= MAXQ (1 + 2^-23)
                        cs[d[i]] = (char)code_of<AB>(sub_rn(h2f(h), lo), y);
                    } else {
                        os[-1 - d[i]] = h;
                    }
                }
            }
        }
    }
    if (SYM) {
        // the previous row's partial sums were read by thread 0 before it reached this row's first barrier
        csum = warp_sum_i32(csum);
        if ((tid & 31) == 0) rsred[tid >> 5] = csum;
    }
    __syncthreads();
    char* arow = aq + (size_t)row * kp;
    for (int c = tid; c < kp / 16; c += NT) st_global16(arow + 16 * c, *reinterpret_cast<const uint4*>(cs + 16 * c));
    u16* orow = xo + (size_t)row * kop;
    for (int c = tid; c < kop / 8; c += NT)
        st_global16(orow + 8 * c, *reinterpret_cast<const uint4*>(os + 8 * c));
    if (tid == 0) {
        sx[row] = s;
        if (SYM) {
            int t = 0;
#pragma unroll
            for (int w = 0; w < W; ++w) t += rsred[w];
            rsum[row] = t;
        } else {
            zx[row] = lo;
        }
    }
}

template <int AB, int NT, int PPT>
__device__ __forceinline__ void quantize_rows(const u16* __restrict__ x, int ldx, int M, int K, int vec,
                                              const int* __restrict__ dest, const u8* __restrict__ oflag, int kb,
                                              int kp, int ko, int kop, char* __restrict__ aq, u16* __restrict__ xo,
                                              float* __restrict__ sx, float* __restrict__ zx,
                                              int* __restrict__ rsum = nullptr) {
    extern __shared__ __align__(16) char qsm[];
    __shared__ float red[2 * (NT / 32)];
    __shared__ int rsred[AB == SYM_A8 ? NT / 32 : 1];
    const int tid = threadIdx.x, G = gridDim.x;
    launch_dependents();  // the GEMM that reads these rows waits for this whole grid anyway
    char* cs = qsm;                              // kp code bytes
    u16* os = reinterpret_cast<u16*>(qsm + kp);  // kop outlier halves
    // Padding: the positions no column maps to (from the last partial group of 32 on) and the outlier slots past
    // ko hold zeros for every row; the rows' scatters never touch them.
    for (int j = (kb & ~31) + tid; j < kp; j += NT) cs[j] = 0;
    for (int j = ko + tid; j < kop; j += NT) os[j] = 0;
    __syncthreads();  // the zeros land before the first row's codes in the last partial group
    grid_dependency_wait();  // the rows (and the buffers written below) belong to the kernel ahead until it completes
    uint4 v[PPT];
    u32 fl[PPT];
    for (int row = blockIdx.x; row < M; row += G) {
        load_row<NT, PPT>(v, fl, x + (size_t)row * ldx, K, vec, oflag, tid);
        quantize_one<AB, NT, PPT>(v, fl, row, K, vec, dest, kp, kop, cs, os, red, aq, xo, sx, zx, tid, rsred, rsum);
    }
}

// MINB: blocks per SM the registers must allow. The kernel is latency-bound (a row's loads, a block reduction,
// the scatter, the stores), so a register cap that keeps ~48 warps per SM beats the extra registers.
#define QUANT_ENTRY(AB, NT, PPT, MINB)                                                                           \
    extern "C" __global__ void __launch_bounds__(NT, MINB) quik_quantize_a##AB##_t##NT##_p##PPT(                 \
        const u16* x, int ldx, int M, int K, int vec, const int* dest, const u8* oflag, int kb, int kp, int ko,   \
        int kop, char* aq, u16* xo, float* sx, float* zx) {                                                       \
        quantize_rows<AB, NT, PPT>(x, ldx, M, K, vec, dest, oflag, kb, kp, ko, kop, aq, xo, sx, zx);             \
    }
#define QUANT_ENTRIES(NT, PPT, MINB) QUANT_ENTRY(4, NT, PPT, MINB) QUANT_ENTRY(8, NT, PPT, MINB)
QUANT_ENTRIES(128, 1, 12)
QUANT_ENTRIES(128, 2, 12)
QUANT_ENTRIES(256, 2, 6)
QUANT_ENTRIES(512, 4, 3)
QUANT_ENTRIES(512, 8, 2)

// QoQ (formats/qoq.md): per-token symmetric 8-bit codes, s_x and the code sums; no outlier columns (oflag all zero,
// ko = kop = 0). dest: each column's byte position (the order the GEMM's weights unpack in, qtool/cuda/qoq.py).
#define QOQ_QUANT_ENTRY(NT, PPT, MINB)                                                                           \
    extern "C" __global__ void __launch_bounds__(NT, MINB) qoq_quantize_t##NT##_p##PPT(                          \
        const u16* x, int ldx, int M, int K, int vec, const int* dest, const u8* oflag, int kp, char* aq,         \
        float* sx, int* rsum) {                                                                                   \
        quantize_rows<SYM_A8, NT, PPT>(x, ldx, M, K, vec, dest, oflag, K, kp, 0, 0, aq, nullptr, sx, nullptr,     \
                                       rsum);                                                                     \
    }
QOQ_QUANT_ENTRY(128, 1, 12)
QOQ_QUANT_ENTRY(128, 2, 12)
QOQ_QUANT_ENTRY(256, 2, 6)
QOQ_QUANT_ENTRY(512, 4, 3)
QOQ_QUANT_ENTRY(512, 8, 2)

// ---------------------------------------------------------------------------------------------------------------
// Fused split + quantize, warp-per-row form (rows of 16-byte aligned, whole 16-byte pieces): a warp quantizes a
// token row alone, persistent over rows (row, row + warps in the grid, ...), so the min/max needs no block barrier,
// only shuffles. Each warp owns NB row buffers in shared memory, filled by 1-D bulk copies that lane 0 issues and
// that complete on the buffer's mbarrier: the next NB - 1 rows stream in while a row is quantized, with no
// registers holding them (the block-per-row kernel above keeps its row in registers, and the register cap that
// keeps enough rows in flight there left no room to prefetch).
//
// Per row, two passes over the staged copy:
//   1. min/max over 16-byte pieces in f16x2; mask (0xFFFF per outlier column) turns outlier columns into NaN,
//      which min.f16x2 / max.f16x2 skip (the accumulators start at +-inf, never NaN);
//   2. each lane takes 4 consecutive code positions, gathers their columns through src (the byte offset in the
//      row of the base column whose code sits at each position), computes the codes as above and writes them
//      with one 4-byte store (a warp writes 128 contiguous bytes). Positions from (kb & ~31) on may be holes
//      (src 0xFFFF): code 0.
// The outlier columns are gathered by index into the dense float16 row. A buffer is refilled once the warp has
// read it (its lanes meet at __syncwarp first).
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// `row`: the staged row's shared-memory address; `off`: the column's byte offset in it. 32-bit shared addresses
// keep the gather at one add per code (a generic pointer costs a 64-bit add and a conversion).
template <int AB>
__device__ __forceinline__ u32 gather_code(u32 row, u32 off, float lo, float y) {
    u16 h;
    asm volatile("ld.shared.b16 %0, [%1];" : "=h"(h) : "r"(row + off));
    return code_of<AB>(sub_rn(h2f(h), lo), y);
}

// Outlier mask words for 2 columns from 2 bits of p.oflag (bit j of byte i: column 8i + j): 0xFFFF per outlier.
__device__ __forceinline__ u32 mask2(u32 b) { return ((b & 1u) ? 0xFFFFu : 0u) | ((b & 2u) ? 0xFFFF0000u : 0u); }

// One staged row (shared memory at `buf`) into its codes, outliers, s_x and z_x, as described above, by a team of
// TW warps (`member` of team `team`; qred is the block's min/max exchange). `mapa`: the position -> offset map in
// shared memory; `msk`: the outlier mask in shared memory, a 16-bit word per column (BITMASK false) or a bit per
// column (true: p.oflag, the fused GEMM's smaller copy, which also has the outlier columns' byte offsets in shared
// memory at `omapa`, p.osrc; otherwise they are gathered through oidx). UNR: the unroll of the two passes (the
// fused GEMM's copy warps run this with 40 registers).
template <int AB, int TW, bool BITMASK, int UNR>
__device__ __forceinline__ void quantize_staged(const char* buf, const char* msk, u32 mapa,
                                                const int* __restrict__ oidx, int row, int K, int kb, int kp, int ko,
                                                int kop, int team, int member, int lane, float (*qred)[2],
                                                char* __restrict__ aq, u16* __restrict__ xo, float* __restrict__ sx,
                                                float* __restrict__ zx, u32 omapa = 0) {
    constexpr int MAXQ = (1 << AB) - 1;
    const int warp = team * TW + member;
    const u16* xs = reinterpret_cast<const u16*>(buf);
    const int np = K >> 3, nc = kp >> 2, whole = (kb & ~31) >> 2;  // pieces; 4-code chunks; chunks with no hole
    const int first = 32 * member + lane, step = 32 * TW;
    u32 lo2 = 0x7C007C00u, hi2 = 0xFC00FC00u;
#pragma unroll UNR
    for (int p = first; p < np; p += step) {
        uint4 v = reinterpret_cast<const uint4*>(buf)[p];
        uint4 m;
        if (BITMASK) {
            const u32 b = reinterpret_cast<const u8*>(msk)[p];
            m = make_uint4(mask2(b), mask2(b >> 2), mask2(b >> 4), mask2(b >> 6));
        } else {
            m = reinterpret_cast<const uint4*>(msk)[p];
        }
        v.x |= m.x, v.y |= m.y, v.z |= m.z, v.w |= m.w;
        lo2 = hmin2(hmin2(lo2, v.x), hmin2(v.y, hmin2(v.z, v.w)));
        hi2 = hmax2(hmax2(hi2, v.x), hmax2(v.y, hmax2(v.z, v.w)));
    }
    float lo = fmin_(h2f((u16)(lo2 & 0xFFFF)), h2f((u16)(lo2 >> 16)));
    float hi = fmax_(h2f((u16)(hi2 & 0xFFFF)), h2f((u16)(hi2 >> 16)));
    lo = warp_min(lo);
    hi = warp_max(hi);
    if (TW > 1) {
        if (lane == 0) qred[warp][0] = lo, qred[warp][1] = hi;
        asm volatile("bar.sync %0, %1;" ::"r"(team), "n"(32 * TW) : "memory");
#pragma unroll
        for (int w = 0; w < TW; ++w) lo = fmin_(lo, qred[team * TW + w][0]), hi = fmax_(hi, qred[team * TW + w][1]);
    }
    const float s = hi > lo ? div_rn(hi - lo, (float)MAXQ) : 1.0f;
    const float y = div_rn(1.0f, s);
    u32* arow = reinterpret_cast<u32*>(aq + (size_t)row * kp);
    const u32 bufa = smem_addr(buf);
    // the chunks with no hole first, in a loop without branches, so the unrolled chunks interleave
    int c = first;
#pragma unroll UNR
    for (; c < whole; c += step) {
        const uint2 sj = lds64(mapa + 8u * (u32)c);
        const u32 t0 = gather_code<AB>(bufa, sj.x & 0xFFFF, lo, y), t1 = gather_code<AB>(bufa, sj.x >> 16, lo, y);
        const u32 t2 = gather_code<AB>(bufa, sj.y & 0xFFFF, lo, y), t3 = gather_code<AB>(bufa, sj.y >> 16, lo, y);
        arow[c] = prmt(prmt(t0, t1, 0x0040), prmt(t2, t3, 0x0040), 0x5410);
    }
    for (; c < nc; c += step) {
        const uint2 sj = lds64(mapa + 8u * (u32)c);
        const u32 j[4] = {sj.x & 0xFFFF, sj.x >> 16, sj.y & 0xFFFF, sj.y >> 16};
        u32 t[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) t[e] = j[e] == 0xFFFF ? 0u : gather_code<AB>(bufa, j[e], lo, y);
        arow[c] = prmt(prmt(t[0], t[1], 0x0040), prmt(t[2], t[3], 0x0040), 0x5410);
    }
    u16* orow = xo + (size_t)row * kop;
    if (BITMASK) {
        // the offsets from shared memory: a global gather per outlier (L2 latency each) made a row take ~3 us more
#pragma unroll 4
        for (int o = first; o < kop; o += step) {
            u16 off, h;
            asm volatile("ld.shared.u16 %0, [%1];" : "=h"(off) : "r"(omapa + 2u * (u32)o));
            asm volatile("ld.shared.b16 %0, [%1];" : "=h"(h) : "r"(bufa + off));
            orow[o] = o < ko ? h : (u16)0;
        }
    } else {
        for (int o = first; o < kop; o += step) orow[o] = o < ko ? xs[__ldg(oidx + o)] : (u16)0;
    }
    if (member == 0 && lane == 0) {
        sx[row] = s;
        zx[row] = lo;
    }
}

// TW warps (a team) share a row: each takes every TW-th piece and chunk, and the team meets at a named barrier
// twice per row (partial min/max; buffer released). TW = 1 needs no barrier at all. Team t uses barrier t (0..15:
// up to 16 teams of 2 warps; barrier 0 is the block's own only at the __syncthreads before any team uses it).
template <int AB, int NB, int TW>
__device__ __forceinline__ void quantize_warp_rows(const u16* __restrict__ x, int ldx, int M, int K,
                                                   const u16* __restrict__ src, const u16* __restrict__ mask,
                                                   const int* __restrict__ oidx, int kb, int kp, int ko, int kop,
                                                   char* __restrict__ aq, u16* __restrict__ xo,
                                                   float* __restrict__ sx, float* __restrict__ zx) {
    extern __shared__ __align__(128) char qsm[];
    __shared__ __align__(8) u64 qbars[1 + 32 * NB];
    launch_dependents();  // the GEMM that reads these rows waits for this whole grid anyway
    __shared__ float qred[32][2];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    const int team = warp / TW, member = warp % TW, teams = W / TW, G = gridDim.x * teams;
    const u32 bytes = 2u * (u32)K, rb = (bytes + 127u) & ~127u, sb = (2u * (u32)kp + 127u) & ~127u;
    // the column maps (src, then mask) once per block, then each team's row buffers
    const u16* smap = reinterpret_cast<const u16*>(qsm);
    const u16* smask = reinterpret_cast<const u16*>(qsm + sb);
    const u32 mapbar = smem_addr(&qbars[0]), bar0 = smem_addr(&qbars[1 + team * NB]);
    char* const buf0 = qsm + sb + rb + (size_t)(team * NB) * rb;
    int row = blockIdx.x * teams + team;
    if (threadIdx.x == 0) {
        mbar_init(mapbar, 1);
        mbar_init_fence();
        mbar_arrive_expect_tx(mapbar, 2u * (u32)kp + bytes);
        bulk_load(smem_addr(smap), src, 2u * (u32)kp, mapbar);
        bulk_load(smem_addr(smask), mask, bytes, mapbar);
    }
    if (member == 0 && lane == 0) {
#pragma unroll
        for (int b = 0; b < NB; ++b) mbar_init(bar0 + 8 * b, 1);
        mbar_init_fence();
    }
    __syncthreads();  // the barriers are initialized before any warp waits on them
    // The maps are the layer's own; the rows (and the buffers written below) belong to the kernel ahead until it
    // completes (a dependent launch starts during its tail).
    grid_dependency_wait();
    if (member == 0 && lane == 0) {
#pragma unroll
        for (int b = 0; b < NB; ++b) {
            if (row + b * G < M) {
                mbar_arrive_expect_tx(bar0 + 8 * b, bytes);
                bulk_load(smem_addr(buf0 + b * rb), x + (size_t)(row + b * G) * ldx, bytes, bar0 + 8 * b);
            }
        }
    }
    mbar_wait(mapbar, 0);
    for (int i = 0; row < M; ++i, row += G) {
        const int b = i % NB;
        char* const buf = buf0 + b * rb;
        mbar_wait(bar0 + 8 * b, (u32)(i / NB) & 1u);
        quantize_staged<AB, TW, false, 4>(buf, reinterpret_cast<const char*>(smask), smem_addr(smap), oidx, row, K,
                                          kb, kp, ko, kop, team, member, lane, qred, aq, xo, sx, zx);
        // every lane of the team is done reading the buffer (and qred) before the copy engine refills it
        if (TW > 1) {
            asm volatile("bar.sync %0, %1;" ::"r"(team), "n"(32 * TW) : "memory");
        } else {
            __syncwarp();
        }
        if (member == 0 && lane == 0 && row + NB * G < M) {
            mbar_arrive_expect_tx(bar0 + 8 * b, bytes);
            bulk_load(smem_addr(buf), x + (size_t)(row + NB * G) * ldx, bytes, bar0 + 8 * b);
        }
    }
}

#define QUANT_WARP_ENTRY(AB, NB, TW)                                                                              \
    extern "C" __global__ void __launch_bounds__(1024, 1) quik_quantize_warp_a##AB##_s##NB##_t##TW(              \
        const u16* x, int ldx, int M, int K, const u16* src, const u16* mask, const int* oidx, int kb, int kp,   \
        int ko, int kop, char* aq, u16* xo, float* sx, float* zx) {                                               \
        quantize_warp_rows<AB, NB, TW>(x, ldx, M, K, src, mask, oidx, kb, kp, ko, kop, aq, xo, sx, zx);          \
    }
#define QUANT_WARP_ENTRIES(NB, TW) QUANT_WARP_ENTRY(4, NB, TW) QUANT_WARP_ENTRY(8, NB, TW)
QUANT_WARP_ENTRIES(1, 1)
QUANT_WARP_ENTRIES(2, 1)
QUANT_WARP_ENTRIES(3, 1)
QUANT_WARP_ENTRIES(1, 2)
QUANT_WARP_ENTRIES(2, 2)
QUANT_WARP_ENTRIES(3, 2)
QUANT_WARP_ENTRIES(1, 4)
QUANT_WARP_ENTRIES(2, 4)
QUANT_WARP_ENTRIES(3, 4)

// The accumulator operands of an m64nN wgmma (N/2 registers a thread) and their places in its asm string.
#define WG_ACC32 "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
#define WG_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_ACC64 "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
#define WG_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WG_ACC128 "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]), "+r"(d[64]), "+r"(d[65]), "+r"(d[66]), "+r"(d[67]), "+r"(d[68]), "+r"(d[69]), "+r"(d[70]), "+r"(d[71]), "+r"(d[72]), "+r"(d[73]), "+r"(d[74]), "+r"(d[75]), "+r"(d[76]), "+r"(d[77]), "+r"(d[78]), "+r"(d[79]), "+r"(d[80]), "+r"(d[81]), "+r"(d[82]), "+r"(d[83]), "+r"(d[84]), "+r"(d[85]), "+r"(d[86]), "+r"(d[87]), "+r"(d[88]), "+r"(d[89]), "+r"(d[90]), "+r"(d[91]), "+r"(d[92]), "+r"(d[93]), "+r"(d[94]), "+r"(d[95]), "+r"(d[96]), "+r"(d[97]), "+r"(d[98]), "+r"(d[99]), "+r"(d[100]), "+r"(d[101]), "+r"(d[102]), "+r"(d[103]), "+r"(d[104]), "+r"(d[105]), "+r"(d[106]), "+r"(d[107]), "+r"(d[108]), "+r"(d[109]), "+r"(d[110]), "+r"(d[111]), "+r"(d[112]), "+r"(d[113]), "+r"(d[114]), "+r"(d[115]), "+r"(d[116]), "+r"(d[117]), "+r"(d[118]), "+r"(d[119]), "+r"(d[120]), "+r"(d[121]), "+r"(d[122]), "+r"(d[123]), "+r"(d[124]), "+r"(d[125]), "+r"(d[126]), "+r"(d[127])
#define WG_REGS128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

// One wgmma, A from registers and B from shared memory by descriptor, accumulating (the predicate is scale-d):
// integer (A s8, or u8 where UA: QoQ's weights as unsigned bytes; B s8, k = 32) or float16 (k = 16).
#define WG_INT(N, R, TY, A, DB, P)                                                                              \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %" P ", 0; wgmma.mma_async.sync.aligned.m64n" #N "k32.s32." TY \
                 ".s8 " WG_REGS##R ", {" A "}, %" DB ", p; }"                                                     \
                 : WG_ACC##R                                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))
#define WG_F16(N, R, A, DB, P)                                                                                  \
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %" P ", 0; wgmma.mma_async.sync.aligned.m64n" #N               \
                 "k16.f32.f16.f16 " WG_REGS##R ", {" A "}, %" DB ", p, 1, 1, 0; }"                               \
                 : WG_ACC##R                                                                                    \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))
#define WG_WRAPPERS(N, R, A, DB, P)                                                      \
    template <bool UA = false>                                                           \
    __device__ __forceinline__ void wgmma_s8(int (&d)[R], const u32 (&a)[4], u64 db) {   \
        if constexpr (UA)                                                                \
            WG_INT(N, R, "u8", A, DB, P);                                                \
        else                                                                             \
            WG_INT(N, R, "s8", A, DB, P);                                                \
    }                                                                                    \
    __device__ __forceinline__ void wgmma_f16(int (&d)[R], const u32 (&a)[4], u64 db) { \
        WG_F16(N, R, A, DB, P);                                                          \
    }
WG_WRAPPERS(64, 32, "%32, %33, %34, %35", "36", "37")
WG_WRAPPERS(128, 64, "%64, %65, %66, %67", "68", "69")
WG_WRAPPERS(256, 128, "%128, %129, %130, %131", "132", "133")

#if QUIK_ABLATE == 3
// Measurement only: A from shared memory (the 8-bit weight tile is already in the 128-byte-swizzled K-major layout).
__device__ __forceinline__ void wgmma_s8_ss(int (&d)[128], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %130, 0; "
        "wgmma.mma_async.sync.aligned.m64n256k32.s32.s8.s8 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, %128, %129, p; }"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]), "+r"(d[64]), "+r"(d[65]), "+r"(d[66]), "+r"(d[67]), "+r"(d[68]), "+r"(d[69]), "+r"(d[70]), "+r"(d[71]), "+r"(d[72]), "+r"(d[73]), "+r"(d[74]), "+r"(d[75]), "+r"(d[76]), "+r"(d[77]), "+r"(d[78]), "+r"(d[79]), "+r"(d[80]), "+r"(d[81]), "+r"(d[82]), "+r"(d[83]), "+r"(d[84]), "+r"(d[85]), "+r"(d[86]), "+r"(d[87]), "+r"(d[88]), "+r"(d[89]), "+r"(d[90]), "+r"(d[91]), "+r"(d[92]), "+r"(d[93]), "+r"(d[94]), "+r"(d[95]), "+r"(d[96]), "+r"(d[97]), "+r"(d[98]), "+r"(d[99]), "+r"(d[100]), "+r"(d[101]), "+r"(d[102]), "+r"(d[103]), "+r"(d[104]), "+r"(d[105]), "+r"(d[106]), "+r"(d[107]), "+r"(d[108]), "+r"(d[109]), "+r"(d[110]), "+r"(d[111]), "+r"(d[112]), "+r"(d[113]), "+r"(d[114]), "+r"(d[115]), "+r"(d[116]), "+r"(d[117]), "+r"(d[118]), "+r"(d[119]), "+r"(d[120]), "+r"(d[121]), "+r"(d[122]), "+r"(d[123]), "+r"(d[124]), "+r"(d[125]), "+r"(d[126]), "+r"(d[127])
        : "l"(da), "l"(db), "r"(1));
}
#endif

// ---------------------------------------------------------------------------------------------------------------
// GEMM: C[M, N] = Eq. 1 (A[M, Kp] · W[N, Kp]^T) + Xo · Wo^T + bias, with the operands swapped for wgmma: weight
// rows are its M dimension (64 per warpgroup, 128 per block of two warpgroups) and the tokens its N dimension
// (TN per block). wgmma reads A from registers, so the weight codes go from shared memory through 4-byte loads
// and a few logic ops straight into A fragments; only B (activation s8 rows, or the float16 outlier
// activations) is read by the tensor cores from shared memory. Every stage is 128 codes (or 64 outlier columns):
// 128 bytes per activation row, 128-byte swizzle (16-byte chunk c of row r at c ^ (r % 8)), all by cp.async,
// ST stages deep, one wgmma group left in flight while the next stage's fragments are built.
//
// 4-bit weights become 16x their s8 value with two or three integer ops per 4 codes ((w << 4) & 0xF0F0F0F0 ^
// 0x80808080 for the low nibbles, w & 0xF0F0F0F0 ^ 0x80808080 for the high ones), so the accumulators hold 16x the integer sums:
// exact, and the 1/16 goes into the weight scale (a power of two: the float products round exactly as before).
//
// After the integer stages the accumulators become float32 in place (Eq. 1), the outlier stages accumulate on top
// with wgmma f32.f16.f16, and the tile is transposed through shared memory for 16-byte row stores with the bias.
// ---------------------------------------------------------------------------------------------------------------
// QoQ's 4-bit schemes in the GEMM's QOQ parameter (qtool/cuda/qoq.py, formats/qoq.md): QOQ_NONE is quik, QOQ_PC
// per-channel u4 weights (the u8 codes q straight into `wgmma ... u8.s8`; z[n]·rowsum[t] comes off in the epilogue),
// any larger value the progressive group size g (32, 64, 128): per group, Q8hat + 128 = q·s1 + (128 - z·s1) as u8,
// by one IMAD per 4 codes (products <= 240 and sums <= 255: no carries between bytes), and 128·rowsum[t] comes off
// in the epilogue. The group words (byte 0: 128 - z·s1, byte 1: s1) of a stage sit in its weight area from
// QOQ_GW_OFFSET, 128 / g per row: they reach the kernel as GemmArgs::Wo (row stride ldwo bytes), free since QoQ
// has no outlier stages.
enum : int { QOQ_NONE = 0, QOQ_PC = 1 };
constexpr int QOQ_GW_OFFSET = 128 * 64;  // past the 4-bit codes of a stage

template <int TN>
struct QTile {
    static constexpr int XT = TN * 128;      // activation bytes per stage
    static constexpr int WT = 128 * 128;     // weight bytes per stage (4-bit stages use half)
    static constexpr int SB = XT + WT;       // multiples of 1024: the swizzle atoms stay aligned
};

struct GemmArgs {
    const char* A;   // activation codes, s8 [M, lda]
    int lda;
    const char* W;   // weight codes, reordered (bytes per row: ldw)
    int ldw;
    const char* Xo;  // outlier activations, float16 [M, ldxo / 2]
    int ldxo;
    const char* Wo;  // outlier weights, reordered float16 [N, ldwo / 2]
    int ldwo;
    int M, N, kt, steps;  // steps: this block's stages (all of them, or its split-K share)
    int m0, n0;
    int s0;  // this block's first stage (split-K)
};

// Issue this thread's copies of global stage gs into the shared-memory stage at st: the activations (X), the
// weights (W) or both (the weights do not come from the kernel ahead, so a dependent launch may copy them first).
enum : int { STAGE_X = 1, STAGE_W = 2, STAGE_ALL = 3 };
template <int BITS, int TN, int PART = STAGE_ALL, int QOQ = QOQ_NONE>
__device__ __forceinline__ void load_stage(const GemmArgs& g, u32 st, int gs, int tid) {
    const bool outl = gs >= g.kt;
    const int s = outl ? gs - g.kt : gs;
    const char* B = outl ? g.Xo : g.A;
    const size_t ldb = (size_t)(outl ? g.ldxo : g.lda);
    if (PART & STAGE_X) {
        const int r = tid >> 3, ch = tid & 7;
#pragma unroll
        for (int i = 0; i < TN / 32; ++i) {
            const int row = r + 32 * i, tok = g.m0 + row;
            const bool ok = tok < g.M;
            cp_async16(st + row * 128 + ((ch ^ (row & 7)) << 4), B + (ok ? tok * ldb + s * 128 + ch * 16 : 0),
                       ok ? 16 : 0);
        }
    }
    const u32 wt = st + QTile<TN>::XT;
    if (!(PART & STAGE_W)) return;
    if constexpr (QOQ > QOQ_PC) {
        // the stage's group words (128 / QOQ per row) into the half of the weight area 4-bit codes leave free
        constexpr int GPS = 128 / QOQ;
#pragma unroll
        for (int i = 0; i < (128 * GPS + 255) / 256; ++i) {
            const int e = tid + 256 * i, row = e / GPS, f = g.n0 + row;
            const bool ok = f < g.N;
            if (e < 128 * GPS)
                cp_async4(wt + QOQ_GW_OFFSET + 4 * e, g.Wo + (ok ? (size_t)f * g.ldwo + 4 * (s * GPS + e % GPS) : 0),
                          ok ? 4 : 0);
        }
    }
    if (BITS == 4 && !outl) {
        // 128 rows x 4 chunks of 16 bytes; chunk c of row r at c ^ ((r / 2) % 4), so that the 8 rows of a warp's
        // fragment loads (word 4j + t of rows g = 0..7) fall in 32 different banks
        const int r = tid >> 2, ch = tid & 3;
#pragma unroll
        for (int i = 0; i < 2; ++i) {
            const int row = r + 64 * i, f = g.n0 + row;
            const bool ok = f < g.N;
            cp_async16(wt + row * 64 + ((ch ^ ((row >> 1) & 3)) << 4),
                       g.W + (ok ? (size_t)f * g.ldw + s * 64 + ch * 16 : 0), ok ? 16 : 0);
        }
    } else {
        // 128 rows x 8 chunks with the 128-byte swizzle (chunk c of row r at c ^ (r % 8)): conflict-free for the
        // fragment loads (words 8j + t and 8j + 4 + t of rows g = 0..7)
        const char* Wp = outl ? g.Wo : g.W;
        const size_t ldw = (size_t)(outl ? g.ldwo : g.ldw);
        const int r = tid >> 3, ch = tid & 7;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const int row = r + 32 * i, f = g.n0 + row;
            const bool ok = f < g.N;
            cp_async16(wt + row * 128 + ((ch ^ (row & 7)) << 4), Wp + (ok ? f * ldw + s * 128 + ch * 16 : 0),
                       ok ? 16 : 0);
        }
    }
}

// A fragments of the stage's 4 k-steps j for rows r0 and r0 + 8: a0/a1 hold k = 4t..4t+3 of rows r0/r0+8, a2/a3
// k = 16+4t..16+4t+3 (s8; float16: k = 2t, 2t+1 and 8+2t, 8+2t+1). 4-bit: word 4j+t of the stage row, low
// nibbles -> a0/a1, high nibbles -> a2/a3 (hence the activation order of the contract). 8-bit and float16: words
// 8j+t -> a0/a1 and 8j+4+t -> a2/a3.
// QoQ (QOQ != QOQ_NONE): the same words, unsigned: low nibbles w & 0x0F0F0F0F, high (w >> 4) & 0x0F0F0F0F, then
// for progressive groups one IMAD each with the group of k-step j (32 codes lie in one group: g >= 32).
template <int QOQ>
__device__ __forceinline__ void qoq_frags(u32 (&af)[4][4], u32 wt, int r0, int t) {
    const int x = (r0 >> 1) & 3;
    const u32 p = wt + r0 * 64 + 4 * t, q = p + 8 * 64;
    constexpr int GPS = QOQ > QOQ_PC ? 128 / QOQ : 1;
    u32 cp = 0, sp = 0, cq = 0, sq = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 pw = lds32(p + ((j ^ x) << 4)), qw = lds32(q + ((j ^ x) << 4));
        const u32 pl = pw & 0x0F0F0F0Fu, ql = qw & 0x0F0F0F0Fu;
        const u32 ph = (pw >> 4) & 0x0F0F0F0Fu, qh = (qw >> 4) & 0x0F0F0F0Fu;
        if constexpr (QOQ == QOQ_PC) {
            af[j][0] = pl, af[j][1] = ql, af[j][2] = ph, af[j][3] = qh;
        } else {
            if ((32 * j) % QOQ == 0) {
                const u32 ga = wt + QOQ_GW_OFFSET + 4u * (u32)(r0 * GPS + 32 * j / QOQ);
                const u32 gp = lds32(ga), gq = lds32(ga + 4u * 8u * GPS);
                // byte 0 of the group word (128 - z·s1) to all four bytes; byte 1 (s1) alone
                cp = prmt(gp, 0u, 0x0000u), sp = prmt(gp, 0u, 0x4441u);
                cq = prmt(gq, 0u, 0x0000u), sq = prmt(gq, 0u, 0x4441u);
            }
            af[j][0] = imad(pl, sp, cp), af[j][1] = imad(ql, sq, cq);
            af[j][2] = imad(ph, sp, cp), af[j][3] = imad(qh, sq, cq);
        }
    }
}

template <int BITS, bool OUTL>
__device__ __forceinline__ void load_frags(u32 (&af)[4][4], u32 wt, int r0, int t) {
    if (BITS == 4 && !OUTL) {
        const int x = (r0 >> 1) & 3;  // (r0 + 8) has the same swizzle
        const u32 p = wt + r0 * 64 + 4 * t, q = p + 8 * 64;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 pw = lds32(p + ((j ^ x) << 4)), qw = lds32(q + ((j ^ x) << 4));
            af[j][0] = ((pw << 4) & 0xF0F0F0F0u) ^ 0x80808080u;
            af[j][1] = ((qw << 4) & 0xF0F0F0F0u) ^ 0x80808080u;
            af[j][2] = (pw & 0xF0F0F0F0u) ^ 0x80808080u;
            af[j][3] = (qw & 0xF0F0F0F0u) ^ 0x80808080u;
        }
    } else {
        const int x = r0 & 7;
        const u32 p = wt + r0 * 128 + 4 * t, q = p + 8 * 128;
        const u32 f = OUTL ? 0u : 0x80808080u;  // 8-bit codes: u - 128 is u with the top bit flipped
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            af[j][0] = lds32(p + (((2 * j) ^ x) << 4)) ^ f;
            af[j][1] = lds32(q + (((2 * j) ^ x) << 4)) ^ f;
            af[j][2] = lds32(p + (((2 * j + 1) ^ x) << 4)) ^ f;
            af[j][3] = lds32(q + (((2 * j + 1) ^ x) << 4)) ^ f;
        }
    }
}

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

// Eq. 1 on this thread's accumulators, in place: acc·s_x·s_w + (z_x + h·s_x)·wReduced, as float bits (wred null:
// the first term only, for split-K shares after the first). Rows (features) f0, f0 + 8; tokens 8i + 2t + e of the
// tile, whose s_x and z_x + h·s_x wait in shared memory.
template <int BITS, int TN>
__device__ __forceinline__ void eq1_in_place(int (&acc)[TN / 2], int f0, int N, int t, const float* tsx,
                                             const float* tax, const u16* __restrict__ sw,
                                             const float* __restrict__ wred) {
    const float ws = BITS == 4 ? 0.0625f : 1.0f;  // 4-bit accumulators hold 16x the sums
    const float sw0 = f0 < N ? h2f(sw[f0]) * ws : 0.f, wr0 = f0 < N && wred ? wred[f0] : 0.f;
    const float sw1 = f0 + 8 < N ? h2f(sw[f0 + 8]) * ws : 0.f, wr1 = f0 + 8 < N && wred ? wred[f0 + 8] : 0.f;
#pragma unroll
    for (int i = 0; i < TN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int k = 8 * i + 2 * t + e;
            const float sxv = tsx[k], axv = tax[k];
            acc[4 * i + e] = f2bits((float)acc[4 * i + e] * sxv * sw0 + axv * wr0);
            acc[4 * i + 2 + e] = f2bits((float)acc[4 * i + 2 + e] * sxv * sw1 + axv * wr1);
        }
    }
}

// QoQ's epilogue, integer part: the accumulators become the exact products Σ qx·Wint by subtracting zc[f]·rowsum[t]
// (zc: z[f] per-channel, from `zeros` as int32; 128 for progressive groups). Rows f0, f0 + 8; the token's rowsum
// waits in shared memory (tax, as int bits).
template <int QOQ, int TN>
__device__ __forceinline__ void qoq_correct(int (&acc)[TN / 2], int f0, int N, int t, const float* tax,
                                            const int* __restrict__ zeros) {
    const int z0 = QOQ == QOQ_PC ? (f0 < N ? zeros[f0] : 0) : 128;
    const int z1 = QOQ == QOQ_PC ? (f0 + 8 < N ? zeros[f0 + 8] : 0) : 128;
#pragma unroll
    for (int i = 0; i < TN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int rs = f2bits(tax[8 * i + 2 * t + e]);
            acc[4 * i + e] -= z0 * rs;
            acc[4 * i + 2 + e] -= z1 * rs;
        }
    }
}

// ... and the scaling, in place as float bits: float(acc) · (s_x[t] · s0[f]) (the scale product first, as the
// reference rounds it).
template <int TN>
__device__ __forceinline__ void qoq_scale(int (&acc)[TN / 2], int f0, int N, int t, const float* tsx,
                                          const u16* __restrict__ sw) {
    const float s0 = f0 < N ? h2f(sw[f0]) : 0.f, s1 = f0 + 8 < N ? h2f(sw[f0 + 8]) : 0.f;
#pragma unroll
    for (int i = 0; i < TN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float sxv = tsx[8 * i + 2 * t + e];
            acc[4 * i + e] = f2bits((float)acc[4 * i + e] * (sxv * s0));
            acc[4 * i + 2 + e] = f2bits((float)acc[4 * i + 2 + e] * (sxv * s1));
        }
    }
}

template <int BITS, int TN, int ST, int QOQ = QOQ_NONE>
__device__ __forceinline__ void gemm_step(int (&acc)[TN / 2], u32 (&af)[4][4], const GemmArgs& g, u32 base, int s,
                                          int tid, int r0, int t, int f0, const float* tsx, const float* tax,
                                          const u16* __restrict__ sw, const float* __restrict__ wred) {
    using T = QTile<TN>;
    cp_async_wait<ST - 3>();  // this thread's copies of stage s are done
    fence_async_smem();       // they are read next by the tensor cores
    __syncthreads();          // everyone's copies; everyone's wgmma of stage s-2 is finished (wait 1 below)
    if (s + ST - 2 < g.steps && QUIK_ABLATE != 2)
        load_stage<BITS, TN, STAGE_ALL, QOQ>(g, base + (u32)((s + ST - 2) % ST) * T::SB, g.s0 + s + ST - 2, tid);
    cp_async_commit();
    const u32 st = base + (u32)(s % ST) * T::SB;
    const int gs = g.s0 + s;  // the stage in the layer's list: integer stages, then outlier stages
    if (gs < g.kt) {
#if QUIK_ABLATE == 3
        if constexpr (BITS == 8 && TN == 256) {
            wgmma_fence();
            const u32 wa = st + T::XT + (u32)((r0 / 64) * 64 * 128);
#pragma unroll
            for (int j = 0; j < 4; ++j) wgmma_s8_ss(acc, desc_sw128(wa + 32 * j), desc_sw128(st + 32 * j));
            wgmma_commit();
            wgmma_wait1();
            return;
        }
#endif
        if constexpr (QOQ != QOQ_NONE) {
            qoq_frags<QOQ>(af, st + T::XT, r0, t);
        } else if (QUIK_ABLATE != 4) {
            load_frags<BITS, false>(af, st + T::XT, r0, t);
        }
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (QUIK_ABLATE != 1) wgmma_s8<QOQ != QOQ_NONE>(acc, af[j], desc_sw128(st + 32 * j));
    } else if constexpr (QOQ == QOQ_NONE) {
        if (gs == g.kt && g.s0 < g.kt) {  // this block ran integer stages
            wgmma_wait0();
            eq1_in_place<BITS, TN>(acc, f0, g.N, t, tsx, tax, sw, g.s0 == 0 ? wred : nullptr);
        }
        load_frags<BITS, true>(af, st + T::XT, r0, t);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_f16(acc, af[j], desc_sw128(st + 32 * j));
    }
    wgmma_commit();
    wgmma_wait1();
}

// The raw int32 sums of this thread's accumulators (rows f0, f0 + 8; tokens 8i + 2t + e).
template <int BITS, int TN, int QOQ = QOQ_NONE>
__device__ __forceinline__ void store_raw(const int (&acc)[TN / 2], int m0, int f0, int M, int N, int t,
                                          void* __restrict__ out, int ldc) {
    int* o = reinterpret_cast<int*>(out);
#pragma unroll
    for (int i = 0; i < TN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int tok = m0 + 8 * i + 2 * t + (e & 1), f = f0 + 8 * (e >> 1);
            if (tok < M && f < N)
                o[(size_t)tok * ldc + f] = BITS == 4 && QOQ == QOQ_NONE ? acc[4 * i + e] >> 4 : acc[4 * i + e];
        }
    }
}

// Tokens C*CH .. C*CH + CH - 1 of the tile: into the transpose buffer, then out with 16-byte row stores (the chunk
// index is a template parameter so that every accumulator index stays a compile-time constant).
template <int TN, int BAR, int CH, int C>
__device__ __forceinline__ void store_chunk(const int (&acc)[TN / 2], int m0, int n0, int N, int mt, int r0, int t,
                                            int tid, u16* tile, const float (&bv)[2], void* __restrict__ out,
                                            int ldc) {
    constexpr int PITCH = 128 + 8;  // halves: 16-byte aligned rows, shifted by 4 banks
    if (C > 0) bar_sync<BAR, 256>();  // the previous chunk is read out
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int fr = r0 + 8 * hh;
#pragma unroll
        for (int i = C * CH / 8; i < (C + 1) * CH / 8; ++i) {
            const int row = 8 * i + 2 * t - C * CH;
            tile[row * PITCH + fr] = f2h(bits2f(acc[4 * i + 2 * hh]) + bv[hh]);
            tile[(row + 1) * PITCH + fr] = f2h(bits2f(acc[4 * i + 2 * hh + 1]) + bv[hh]);
        }
    }
    bar_sync<BAR, 256>();
    u16* o = reinterpret_cast<u16*>(out);
    const bool vec = n0 + 128 <= N && (ldc & 7) == 0 && ((size_t)out & 15) == 0;
    const int m1 = m0 + C * CH, rows = min(CH, mt - C * CH);
    if (vec) {
        for (int q = tid; q < rows * 16; q += 256) {
            const int row = q >> 4, ch = q & 15;
            *reinterpret_cast<uint4*>(o + (size_t)(m1 + row) * ldc + n0 + ch * 8) =
                *reinterpret_cast<const uint4*>(tile + row * PITCH + ch * 8);
        }
    } else {
        for (int q = tid; q < rows * 128; q += 256) {
            const int row = q >> 7, f = q & 127;
            if (n0 + f < N) o[(size_t)(m1 + row) * ldc + n0 + f] = tile[row * PITCH + f];
        }
    }
    if constexpr (C + 1 < TN / CH) store_chunk<TN, BAR, CH, C + 1>(acc, m0, n0, N, mt, r0, t, tid, tile, bv, out, ldc);
}

// The block's result: raw int32 sums, or (fused) Eq. 1 when no outlier stage applied it yet, bias, and a transpose
// through shared memory at `tbase` for 16-byte row stores, CH tokens at a time (CH = TN: one pass through the free
// pipeline buffers; the persistent kernel passes a small buffer of its own). The 256 threads that hold the
// accumulators call it (thread index `tid` among them); BAR is the barrier that spans exactly them.
template <int BITS, int TN, int BAR, int CH, int QOQ = QOQ_NONE>
__device__ __forceinline__ void store_tile(int (&acc)[TN / 2], int m0, int n0, int M, int N, bool eq1_pending,
                                           int r0, int t, int tid, char* smem_raw, u32 tbase, const float* tsx,
                                           const float* tax, const u16* __restrict__ sw,
                                           const float* __restrict__ wred, const u16* __restrict__ bias,
                                           void* __restrict__ out, int ldc, int raw) {
    const int f0 = n0 + r0;
    if constexpr (QOQ != QOQ_NONE) {
        // QoQ's integer correction is pending here (split-K shares add raw sums), wred is its int32 zeros
        if (eq1_pending) qoq_correct<QOQ, TN>(acc, f0, N, t, tax, reinterpret_cast<const int*>(wred));
        if (raw) {
            store_raw<BITS, TN, QOQ>(acc, m0, f0, M, N, t, out, ldc);
            return;
        }
        if (eq1_pending) qoq_scale<TN>(acc, f0, N, t, tsx, sw);
    } else {
        if (raw) {
            store_raw<BITS, TN>(acc, m0, f0, M, N, t, out, ldc);
            return;
        }
        if (eq1_pending) eq1_in_place<BITS, TN>(acc, f0, N, t, tsx, tax, sw, wred);
    }
    const int mt = min(TN, M - m0);  // valid tokens in this tile
    u16* tile = reinterpret_cast<u16*>(smem_raw + (tbase - smem_addr(smem_raw)));
    float bv[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int f = f0 + 8 * hh;
        bv[hh] = (bias != nullptr && f < N) ? h2f(bias[f]) : 0.f;
    }
    store_chunk<TN, BAR, CH, 0>(acc, m0, n0, N, mt, r0, t, tid, tile, bv, out, ldc);
}

// The persistent kernel's epilogue: Eq. 1 if still pending, bias, then out through the copy engine (tma_store_tile,
// common/ptx_common.cuh; `mo`: the float16 output as bytes, boxes of 128 bytes x 32 tokens, 128-byte swizzle).
template <int BITS, int TN, int EB, int QOQ = QOQ_NONE>
__device__ __forceinline__ void store_tile_tma(int (&acc)[TN / 2], int m0, int n0, int M, int N, bool eq1_pending,
                                               int r0, int t, int tid, u32 ebuf, int& eb, const float* tsx,
                                               const float* tax, const u16* __restrict__ sw,
                                               const float* __restrict__ wred, const u16* __restrict__ bias,
                                               const TmaMap* mo) {
    const int f0 = n0 + r0;
    if constexpr (QOQ != QOQ_NONE) {
        if (eq1_pending) {
            qoq_correct<QOQ, TN>(acc, f0, N, t, tax, reinterpret_cast<const int*>(wred));
            qoq_scale<TN>(acc, f0, N, t, tsx, sw);
        }
    } else if (QUIK_EPI < 3 && eq1_pending) {
        eq1_in_place<BITS, TN>(acc, f0, N, t, tsx, tax, sw, wred);
    }
    if (QUIK_EPI == 2 || QUIK_EPI == 3) {
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) asm volatile("" ::"r"(acc[i]));  // keep the accumulators' producers
        return;
    }
    float bv[2];
#pragma unroll
    for (int hh = 0; hh < 2; ++hh) {
        const int f = f0 + 8 * hh;
        bv[hh] = (bias != nullptr && f < N) ? h2f(bias[f]) : 0.f;
    }
    // accumulator i is row r0 + 8 ((i / 2) % 2)'s
    tma_store_tile<TN, EB, QUIK_EPI>([&](int i) { return bits2f(acc[i]) + bv[(i >> 1) & 1]; }, m0, n0, M, tid, ebuf,
                                     eb, mo);
}

// raw: write the int32 sums (the caller passes no outlier stages and no split; the unfused ladder rungs). Otherwise
// the float16 output of the fused epilogue, outliers and bias included. Split-K (gridDim.z = S > 1, few tiles:
// decode): ws has room for S x tiles x 128 x TN floats and cnt one zero int per tile.
constexpr int SPLIT_MAX_TOKENS = 128;  // split-K is built for the decode tiles only (qtool/cuda/quik.py)

// QOQ != QOQ_NONE: QoQ's W4A8 (see QOQ_PC above): zx is the int32 row sums, wred the int32 zeros (per-channel),
// Wo / ldwo the group words; no outlier stages (kto = 0), no 16x scaling.
template <int BITS, int TN, int ST, int QOQ = QOQ_NONE>
__device__ __forceinline__ void gemm_body(const GemmArgs& g0, const float* __restrict__ sx,
                                          const float* __restrict__ zx, const u16* __restrict__ sw,
                                          const float* __restrict__ wred, const u16* __restrict__ bias,
                                          void* __restrict__ out, int ldc, int raw, float* __restrict__ ws,
                                          int* __restrict__ cnt) {
    using T = QTile<TN>;
    extern __shared__ char smem_raw[];
    __shared__ float tsx[TN], tax[TN];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, gq = lane >> 2, t = lane & 3;
    GemmArgs g = g0;
    g.m0 = (int)blockIdx.y * TN;
    g.n0 = (int)blockIdx.x * 128;
    // split-K (gridDim.z > 1): block z takes stages [s0, s0 + steps) of the layer's list
    const int S = gridDim.z, z = blockIdx.z;
    g.s0 = (int)((long long)z * g0.steps / S);
    g.steps = (int)((long long)(z + 1) * g0.steps / S) - g.s0;
    const int r0 = 64 * wg + 16 * warp + gq;  // this lane's rows in the tile: r0, r0 + 8
    const int f0 = g.n0 + r0;
    const float h = (float)(1 << (BITS - 1));
    // The first stages' weight copies go out before the wait for the kernel ahead (the quantize kernel, whose
    // activations, s_x and z_x the rest reads); they join the first stage's copy group.
#pragma unroll
    for (int p = 0; p < ST - 2; ++p)
        if (p < g.steps) load_stage<BITS, TN, STAGE_W, QOQ>(g, base + (u32)p * T::SB, g.s0 + p, tid);
    grid_dependency_wait();
    for (int k = tid; k < TN; k += 256) {
        const int m = g.m0 + k;
        const float sv = m < g.M ? ld_dep_f32(sx + m) : 0.f;
        tsx[k] = sv;
        if (QOQ != QOQ_NONE)  // the row sum, as int bits
            tax[k] = bits2f(m < g.M ? (int)ld_dep_u32(reinterpret_cast<const u32*>(zx) + m) : 0);
        else
            tax[k] = m < g.M ? ld_dep_f32(zx + m) + h * sv : 0.f;
    }

    int acc[TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[i] = 0;
#pragma unroll
    for (int p = 0; p < ST - 2; ++p) {
        if (p < g.steps) load_stage<BITS, TN, STAGE_X, QOQ>(g, base + (u32)p * T::SB, g.s0 + p, tid);
        cp_async_commit();
    }
    u32 af0[4][4], af1[4][4];  // a stage's wgmmas may still read one set while the next stage fills the other
#if QUIK_ABLATE == 4
#pragma unroll
    for (int j = 0; j < 16; ++j) af0[j / 4][j % 4] = af1[j / 4][j % 4] = 0x01010101u * (u32)(tid & 7);
#endif
    int s = 0;
    for (; s + 1 < g.steps; s += 2) {
        gemm_step<BITS, TN, ST, QOQ>(acc, af0, g, base, s, tid, r0, t, f0, tsx, tax, sw, wred);
        gemm_step<BITS, TN, ST, QOQ>(acc, af1, g, base, s + 1, tid, r0, t, f0, tsx, tax, sw, wred);
    }
    if (s < g.steps) gemm_step<BITS, TN, ST, QOQ>(acc, af0, g, base, s, tid, r0, t, f0, tsx, tax, sw, wred);
    launch_dependents();  // the next layer's quantize kernel may start its prologue during this epilogue
    wgmma_wait0();
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory is free from here on (and tsx/tax are visible)
    bool eq1_pending = g.steps > 0 && g.s0 + g.steps <= g.kt;  // integer stages only: Eq. 1 not applied yet
    if (TN <= SPLIT_MAX_TOKENS && S > 1) {
        // Split-K (fused output only): every block writes its float32 share of the tile (Eq. 1 applied, the
        // zero-point term by the first share only) in the accumulator layout, one float4 per thread and step; the
        // last of the tile's blocks adds the shares in split order (deterministic), then takes the epilogue. It
        // leaves the tile's counter at zero. QoQ: the shares are the raw int32 sums (as float bits), added exactly;
        // the epilogue follows on the total.
        if constexpr (QOQ == QOQ_NONE) {
            if (eq1_pending) eq1_in_place<BITS, TN>(acc, f0, g.N, t, tsx, tax, sw, g.s0 == 0 ? wred : nullptr);
            eq1_pending = false;
        } else {
            eq1_pending = g.kt > 0;
        }
        const int tiles = gridDim.x * gridDim.y, tile_id = blockIdx.x + gridDim.x * blockIdx.y;
        constexpr int F4 = TN / 8;  // float4s per thread: tokens 8q + 2t, + 1 of rows r0, r0 + 8
        const int mt = min(TN, g.M - g.m0);  // only the tile's valid tokens travel (decode: one or a few)
        float4* w4 = reinterpret_cast<float4*>(ws) + (size_t)tile_id * F4 * 256 + tid;
#pragma unroll
        for (int q = 0; q < F4; ++q)
            if (8 * q + 2 * t < mt)
                w4[((size_t)z * tiles * F4 + q) * 256] = make_float4(bits2f(acc[4 * q]), bits2f(acc[4 * q + 1]),
                                                                     bits2f(acc[4 * q + 2]), bits2f(acc[4 * q + 3]));
        if (!split_k_last(cnt, tile_id, S)) return;
        float sum[TN / 2];
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) sum[i] = 0.f;
        for (int q2 = 0; q2 < S; ++q2) {
#pragma unroll
            for (int q = 0; q < F4; ++q) {
                if (8 * q + 2 * t >= mt) continue;
                const float4 v = __ldcg(w4 + ((size_t)q2 * tiles * F4 + q) * 256);
                if constexpr (QOQ == QOQ_NONE) {
                    sum[4 * q] += v.x;
                    sum[4 * q + 1] += v.y;
                    sum[4 * q + 2] += v.z;
                    sum[4 * q + 3] += v.w;
                } else {
                    sum[4 * q] = bits2f(f2bits(sum[4 * q]) + f2bits(v.x));
                    sum[4 * q + 1] = bits2f(f2bits(sum[4 * q + 1]) + f2bits(v.y));
                    sum[4 * q + 2] = bits2f(f2bits(sum[4 * q + 2]) + f2bits(v.z));
                    sum[4 * q + 3] = bits2f(f2bits(sum[4 * q + 3]) + f2bits(v.w));
                }
            }
        }
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) acc[i] = f2bits(sum[i]);
        if (tid == 0) cnt[tile_id] = 0;
    }
    store_tile<BITS, TN, 0, TN, QOQ>(acc, g.m0, g.n0, g.M, g.N, eq1_pending, r0, t, tid, smem_raw, base, tsx, tax, sw,
                                     wred, bias, out, ldc, raw);
}

// MINB: blocks per SM the registers must allow.
#define GEMM_ENTRY(BITS, TN, ST, MINB)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, MINB) quik_gemm_w##BITS##_n##TN##_s##ST(                 \
        const char* A, int lda, const char* W, int ldw, const char* Xo, int ldxo, const char* Wo, int ldwo,    \
        int M, int N, int kt, int kto, const float* sx, const float* zx, const u16* sw, const float* wred,     \
        const u16* bias, void* out, int ldc, int raw, float* ws, int* cnt) {                                   \
        const GemmArgs g{A, lda, W, ldw, Xo, ldxo, Wo, ldwo, M, N, kt, kt + kto, 0, 0, 0};                     \
        gemm_body<BITS, TN, ST>(g, sx, zx, sw, wred, bias, out, ldc, raw, ws, cnt);                            \
    }
#define GEMM_ENTRIES(TN, ST, MINB) GEMM_ENTRY(4, TN, ST, MINB) GEMM_ENTRY(8, TN, ST, MINB)
GEMM_ENTRIES(64, 4, 2)
GEMM_ENTRIES(128, 4, 1)
GEMM_ENTRIES(256, 3, 1)
#if QUIK_TUNING
GEMM_ENTRIES(256, 4, 1)
#endif

// QoQ W4A8 (formats/qoq.md), block-synchronous: A = the activation codes at quik's 4-bit positions (pos(b) =
// 32 (b / 32) + 16 (b % 2) + (b % 32) / 2, the order the nibbles unpack in), W = the checkpoint's nibble streams
// padded to whole stages, G = the group words [N, ldg / 4] (progressive; unused per-channel), rsum = the
// activation code sums, zeros = z[n] as int32 (per-channel). raw: the exact int32 products Σ qx·Wint.
#define QOQ_GEMM_ENTRY(NAME, QOQ, TN, ST, MINB)                                                                \
    extern "C" __global__ void __launch_bounds__(256, MINB) qoq_gemm_##NAME##_n##TN##_s##ST(                   \
        const char* A, int lda, const char* W, int ldw, const char* G, int ldg, int M, int N, int kt,          \
        const float* sx, const int* rsum, const u16* sw, const int* zeros, const u16* bias, void* out, int ldc, \
        int raw, float* ws, int* cnt) {                                                                        \
        const GemmArgs g{A, lda, W, ldw, nullptr, 0, G, ldg, M, N, kt, kt, 0, 0, 0};                           \
        gemm_body<4, TN, ST, QOQ>(g, sx, reinterpret_cast<const float*>(rsum), sw,                             \
                                  reinterpret_cast<const float*>(zeros), bias, out, ldc, raw, ws, cnt);        \
    }
#define QOQ_GEMM_ENTRIES(TN, ST, MINB)             \
    QOQ_GEMM_ENTRY(pc, QOQ_PC, TN, ST, MINB)       \
    QOQ_GEMM_ENTRY(g32, 32, TN, ST, MINB)          \
    QOQ_GEMM_ENTRY(g64, 64, TN, ST, MINB)          \
    QOQ_GEMM_ENTRY(g128, 128, TN, ST, MINB)
QOQ_GEMM_ENTRIES(64, 4, 2)
QOQ_GEMM_ENTRIES(128, 4, 1)
QOQ_GEMM_ENTRIES(256, 3, 1)

// ---------------------------------------------------------------------------------------------------------------
// Warp-specialized GEMM (same result as above): 384 threads. Warpgroup 0 is the copy warpgroup: one thread issues
// the bulk tensor copies (TMA) of every stage into an ST-deep ring and the rest idle; it gives most of its
// registers to the two math warpgroups (setmaxnreg). Each stage has a "full" barrier (the copy engine completes it
// with the byte count) and an "empty" one (every math warp arrives once its wgmmas have read the stage). The math
// warpgroups never meet at a block barrier inside the loop: while a stage's wgmmas run they wait for the next
// stage and build its A fragments, so the fragment loads overlap the tensor cores instead of following a barrier.
// The copy engine writes shared memory in the async proxy, so no proxy fence is needed before wgmma reads it, and
// its 64/128-byte swizzles are the layouts the fragment loads and the B descriptors above expect.
//
// Tensor maps (qtool/cuda/tma.py), all over bytes: ma = activation codes [M, Kp] box 128 x TN, 128-byte swizzle;
// mw = weight code rows [N, Kp*BITS/8] box 16*BITS x 128, swizzle 16*BITS bytes; mxo = outlier activations
// [M, 2*kop] box OB x TN; mwo = outlier weights [N, 2*kop] box OB x 128, both with an OB-byte swizzle, where OB
// (WsTile::OB) is 64 for 4-bit weights (32 outlier columns per stage: kto counts those stages) and 128 for 8-bit
// (64 columns). Rows past M or N arrive as zeros. mo = the float16 output [M, 2N] box 128 x 32, 128-byte swizzle:
// the persistent kernel's epilogue stores through it where `tmo` is set (else, and for raw sums, 16-byte stores
// from the threads).
// ---------------------------------------------------------------------------------------------------------------
template <int TN, int BITS, int QOQ = QOQ_NONE>
struct WsTile {
    static constexpr int XT = TN * 128;               // activation tile of an integer stage
    static constexpr int WB = 128 * 16 * BITS;        // weight tile of an integer stage
    // QoQ's progressive groups: the stage's group words (128 rows x 128 / g words, what qoq_frags reads at
    // QOQ_GW_OFFSET = WB) arrive by a 1-D bulk copy from the stage-major copy (qtool/cuda/qoq.py stage_words),
    // padded so the stage stays a multiple of 1024 bytes
    static constexpr int GWS = QOQ > QOQ_PC ? 128 * (128 / (QOQ > QOQ_PC ? QOQ : 128)) * 4 : 0;
    static constexpr int GWB = (GWS + 1023) / 1024 * 1024;
    // float16 outlier bytes per row and stage: 4-bit stages take 32 columns (64-byte rows, 64-byte swizzle), so
    // that their weight tile fits the integer stages' 8 KB and a stage stays at XT + 8 KB: the ring then leaves
    // room for a fifth stage. 8-bit stages take 64 columns (128-byte rows) as the block-synchronous kernel does.
    static constexpr int OB = BITS == 4 ? 64 : 128;
    static constexpr int SB = XT + WB + GWB;          // a stage; a multiple of 1024: the swizzle atoms stay aligned
    enum : int { EPI_TOKENS = 32 };  // the persistent kernel's epilogue chunk (thread stores: 32 x 136 halves)
    // store_tile_tma's 8 KB buffers beside a ring of ST stages: what fits in the 227 KB a block may have, less
    // the alignment slack and the static arrays (s_x, z_x + h s_x, barriers), at most 8
    __device__ static constexpr int epi_fit(int st) { return (232448 - st * SB - 1024 - 5 * 1024) / 8192; }
    template <int ST>
    __device__ static constexpr int epi_buffers() {
        return epi_fit(ST) > 8 ? 8 : epi_fit(ST);
    }
};

// Tile t of the output: 128 weight rows (fastest) x TN tokens.
__device__ __forceinline__ void ws_tile(int t, int N, int TN_, int& m0, int& n0) {
    const int ntn = (N + 127) >> 7;
    n0 = (t % ntn) * 128;
    m0 = (t / ntn) * TN_;
}

// ---------------------------------------------------------------------------------------------------------------
// The fused form (quik_gemm_wsq_*): the persistent GEMM quantizes its own activation rows, so the quantize
// kernel's DRAM time (about 9 us of a 4096 x 4096 layer at M = 2048 on an H100) runs under the GEMM instead of
// before it. Rows 0..r1-1 (the token tiles of the grid's first tiles) are quantized first by the math warps in
// teams (fused_team_rows), staged in the ring's activation areas; the copy warpgroup's idle warps quantize the rest
// while the first tiles run, each through its own row buffer beside the epilogue buffers. A row is counted in
// ready[row / TN] once its codes, outliers, s_x and z_x are written; the copy thread waits for a tile's count
// before copying its activations, and each math thread before loading its token's s_x / z_x. One block per SM, all
// resident at once (grid <= SMs), so these waits between blocks cannot deadlock. The last block to finish resets
// the counts (the counter after them counts the finished blocks), so they are zero between launches as the split-K
// counters are.
// ---------------------------------------------------------------------------------------------------------------
struct FusedQuant {
    const u16* x;  // float16 activations [M, K], row stride ldx (halves)
    int ldx, K, kb, kp, ko, kop, r1, q2;  // q2: copy warps that quantize (1..3)
    const u16* src;   // p.src: the position -> offset map
    const u8* oflag;  // p.oflag, padded to 128 bytes: a bit per column, set for outliers
    const u16* osrc;  // p.osrc: byte offsets of the outlier columns (kop entries, 0 past ko)
    const int* oidx;
    char* aq;
    u16* xo;
    int* ready;  // ceil(M / TN) row counts, then the finished-block count
};

// Until *c >= target (acquire, GPU scope), then a proxy fence: the caller's copy-engine reads that follow see the
// rows other blocks wrote with ordinary stores. (No bound on the wait: a spin counter made the math warps, which
// wait here with a tile's accumulators live, spill 240 bytes.)
__device__ __forceinline__ void rows_wait(const int* c, int target) {
    for (;;) {
        int v;
        asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(c) : "memory");
        if (v >= target) break;
        asm volatile("nanosleep.u32 64;");
    }
    asm volatile("fence.proxy.async.global;" ::: "memory");
}

// Rows row0, row0 + stride, ... below row_end, one at a time through the row buffer `buf` (bulk copy completing
// on `bar`), by one warp; each row is counted in ready[row / TN] once written.
// The first row's copy is issued before the wait for the column maps (`mapbar`), which the block loads meanwhile.
template <int AB, int TN, int UNR>
__device__ __forceinline__ void fused_rows(const FusedQuant& q, float* __restrict__ sx, float* __restrict__ zx,
                                           int row0, int row_end, int stride, char* buf, u32 bar, u32 mapbar,
                                           const char* msk, u32 mapa, u32 omapa, int lane, int tslot = -1) {
    const u32 bytes = 2u * (u32)q.K;
    auto fetch_row = [&](int row) {
        if (lane == 0 && row < row_end) {
            mbar_arrive_expect_tx(bar, bytes);
            bulk_load(smem_addr(buf), q.x + (size_t)row * q.ldx, bytes, bar);
        }
    };
    fetch_row(row0);
    mbar_wait(mapbar, 0);
    u32 phase = 0;
    for (int row = row0, i = 0; row < row_end; row += stride, phase ^= 1u, ++i) {
        if (i > 0) fetch_row(row);
        mbar_wait(bar, phase);
        quantize_staged<AB, 1, true, UNR>(buf, msk, mapa, q.oidx, row, q.K, q.kb, q.kp, q.ko, q.kop, 0, 0, lane,
                                          nullptr, q.aq, q.xo, sx, zx, omapa);
        asm volatile("fence.proxy.async.global;" ::: "memory");  // other blocks' copy engines read these codes
        __syncwarp();  // every lane's writes, and its reads of the buffer, come before the count and the refill
        if (lane == 0) {
            // release: the warp's writes (ordered before it by __syncwarp) are visible before the count
            asm volatile("red.release.gpu.global.add.s32 [%0], 1;" ::"l"(q.ready + row / TN) : "memory");
            if (QUIK_TRACE && tslot >= 0 && i < 8) trace_at(q.ready, tslot + i);
        }
    }
}

// The fused form's teams (fused_team_rows): 2 warps per row. On the H100 at 4096 x 4096, M = 2048, teams of 2 and 4
// took 66.4-67.7 us, teams of 1 and 8 68.4-71.2 and the row per warp before them 67.4-70.3 (kernels/NOTES.md).
#ifndef QUIK_WSQ_TW
#define QUIK_WSQ_TW 2
#endif
// Rows row0 + i * stride below row_end (i = 0, 1, ...), by the 8 math warps in teams of TW warps: team k of the
// `active` ones takes the rows i = k mod active, in order, each as soon as its copy lands, so the rows' DRAM time and
// their arithmetic overlap. Team k owns nb / active of the nb row buffers (`buf(b)`, ring slots' activation areas,
// barrier bar + 8 b), filled ahead by its first lane; it meets at named barrier 2 + k. Each warp counts its share of
// a row in done[k] (release, CTA scope); the publisher (publish_rows) turns whole rows into the `ready` counts, so
// no math warp waits on a GPU-scope release between rows.
template <int AB, int TN, int TW, typename Buf>
__device__ __forceinline__ void fused_team_rows(const FusedQuant& q, float* __restrict__ sx, float* __restrict__ zx,
                                                int row0, int row_end, int stride, int nb, Buf buf, u32 bar,
                                                u32 mapbar, const char* msk, u32 mapa, u32 omapa, int mw,
                                                int lane, float (*qred)[24][2], u32 done) {
    const u32 bytes = 2u * (u32)q.K;
    const int active = min(8 / TW, nb), k = mw / TW, member = mw % TW, nbt = nb / active;
    const int nr = row0 < row_end ? (row_end - row0 + stride - 1) / stride : 0;
    if (k >= active) return;
    const int mine = nr > k ? (nr - k + active - 1) / active : 0;  // this team's rows: i = k + active * j
    auto fetch_row = [&](int j) {
        if (member == 0 && lane == 0 && j < mine) {
            const u32 bj = bar + 8u * (u32)(k * nbt + j % nbt);
            mbar_arrive_expect_tx(bj, bytes);
            bulk_load(smem_addr(buf(k * nbt + j % nbt)), q.x + (size_t)(row0 + (k + active * j) * stride) * q.ldx,
                      bytes, bj);
        }
    };
    for (int j = 0; j < nbt; ++j) fetch_row(j);
    mbar_wait(mapbar, 0);
    for (int j = 0; j < mine; ++j) {
        mbar_wait(bar + 8u * (u32)(k * nbt + j % nbt), (u32)(j / nbt) & 1u);
        // qred alternates: a warp writes row j + 2's set only after the team's barrier of row j + 1, which every
        // member reaches after its reads of row j's set
        quantize_staged<AB, TW, true, 2>(buf(k * nbt + j % nbt), msk, mapa, q.oidx, row0 + (k + active * j) * stride,
                                         q.K, q.kb, q.kp, q.ko, q.kop, 2 + k, member, lane, qred[j & 1], q.aq, q.xo,
                                         sx, zx, omapa);
        asm volatile("fence.proxy.async.global;" ::: "memory");  // other blocks' copy engines read these codes
        __syncwarp();
        if (lane == 0)
            asm volatile("red.release.cta.shared::cta.add.u32 [%0], 1;" ::"r"(done + 4u * (u32)k) : "memory");
        if (j + nbt < mine) {
            // every member is done reading the buffer before the copy engine refills it
            if (TW > 1) asm volatile("bar.sync %0, %1;" ::"r"(2 + k), "n"(32 * TW) : "memory");
            if (member == 0 && lane == 0) fence_async_smem();
            fetch_row(j + nbt);
        }
    }
}

// The publisher of fused_team_rows (one lane): once row i's team (i mod active) has counted it in done[team] from
// all TW warps, adds it to ready[row / TN] (release, GPU scope), the finished rows of one token tile together. The
// team's writes come before their counts (release), the counts before this add (acquire), so the add publishes them.
template <int TN, int TW>
__device__ __forceinline__ void publish_rows(int* ready, int row0, int row_end, int stride, int nb, u32 done) {
    const int active = min(8 / TW, nb);
    const int nr = row0 < row_end ? (row_end - row0 + stride - 1) / stride : 0;
    int pend = 0, pt = 0;
    auto flush = [&]() {
        if (pend) asm volatile("red.release.gpu.global.add.s32 [%0], %1;" ::"l"(ready + pt), "r"(pend) : "memory");
        pend = 0;
    };
    for (int i = 0; i < nr;) {
        u32 d;
        asm volatile("ld.acquire.cta.shared::cta.u32 %0, [%1];"
                     : "=r"(d)
                     : "r"(done + 4u * (u32)(i % active))
                     : "memory");
        if ((int)d >= TW * (i / active + 1)) {
            const int t = (row0 + i * stride) / TN;
            if (t != pt) flush();
            pt = t;
            ++pend, ++i;
        } else if (pend) {
            flush();
        } else {
            asm volatile("nanosleep.u32 32;");
        }
    }
    flush();
}

// FUSED (quik_gemm_wsq_*): the activation rows are quantized by this kernel's own warps. Before the first
// activation copy the block's math warps must have released the ring slots they staged rows in (`staged`); before
// each tile's copies, every row of its tokens must be counted in `ready` (rows_wait).
// QoQ's split-K form: the block's tile `first` (else blockIdx.x) from stage s0 on (s0 .. s0 + steps - 1 of kt).
template <int BITS, int TN, int ST, bool FUSED = false, int QOQ = QOQ_NONE>
__device__ __forceinline__ void ws_copies(const TmaMap* ma, const TmaMap* mw, const TmaMap* mxo, const TmaMap* mwo,
                                          u32 base, u32 bars, int M, int N, int kt, int steps,
                                          const int* ready = nullptr, u32 staged = 0, const char* gst = nullptr,
                                          int s0 = 0, int first = -1) {
    using T = WsTile<TN, BITS, QOQ>;
    const int tiles = ((N + 127) >> 7) * ((M + TN - 1) / TN);
    // A stage's byte count on its full barrier, then its weight copy (the activation copy is issued separately).
    auto weights = [&](int gs, int slot, int n0) {
        const bool outl = gs >= kt;
        const int s = outl ? gs - kt : s0 + gs;
        const u32 full = bars + 8 * slot;
        mbar_arrive_expect_tx(full, outl ? (TN + 128) * T::OB : T::XT + T::WB + T::GWS);
        tma_load_2d(base + (u32)slot * T::SB + T::XT, outl ? mwo : mw, full, outl ? T::OB * s : 16 * BITS * s, n0);
        if constexpr (T::GWS > 0)
            bulk_load(base + (u32)slot * T::SB + T::XT + T::WB,
                      gst + ((size_t)(n0 >> 7) * (size_t)kt + (size_t)s) * T::GWS, T::GWS, full);
    };
    // The weights do not come from the kernel ahead: the first tile's first ST stages get their weight copies
    // before the wait for that kernel (a dependent launch starts during its tail), their activations after it.
    int early = 0;
    const int t0 = first < 0 ? (int)blockIdx.x : first;
    if (t0 < tiles) {
        int m0, n0;
        ws_tile(t0, N, TN, m0, n0);
        early = min(ST, steps);
        for (int gs = 0; gs < early; ++gs) weights(gs, gs, n0);
    }
    grid_dependency_wait();
    if (FUSED) {
        mbar_wait(staged, 0);
        fence_async_smem();  // the staged rows were read by the generic proxy; the copy engine now overwrites them
    }
    int g = 0;  // position in the ring over all of this block's tiles
    for (int tile = t0; tile < tiles; tile += gridDim.x) {
        int m0, n0;
        ws_tile(tile, N, TN, m0, n0);
        if (FUSED) rows_wait(ready + m0 / TN, min(TN, M - m0));
        if (QUIK_TRACE && FUSED && g == 0) trace_at(const_cast<int*>(ready), 49);
        for (int gs = 0; gs < steps; ++gs, ++g) {
            const int slot = g % ST, use = g / ST;
            if (use > 0) mbar_wait(bars + 8 * (ST + slot), (use - 1) & 1);
            if (g >= early) weights(gs, slot, n0);
            const bool outl = gs >= kt;
            tma_load_2d(base + (u32)slot * T::SB, outl ? mxo : ma, bars + 8 * slot,
                        outl ? T::OB * (gs - kt) : 128 * (s0 + gs), m0);
        }
    }
    launch_dependents();
}

// A fragments of a float16 outlier stage of 64-byte rows (4-bit warp-specialized kernels: 32 columns, 64-byte
// swizzle, chunk c of row r at c ^ ((r / 2) % 4) as in the 4-bit weight tiles): k-step j (16 columns) takes
// words t of chunks 2j (a0/a1: columns 2t, 2t+1 of rows r0/r0+8) and 2j+1 (a2/a3: columns 8+2t, 8+2t+1).
__device__ __forceinline__ void load_frags_o64(u32 (&af)[4][4], u32 wt, int r0, int t) {
    const int x = (r0 >> 1) & 3;
    const u32 p = wt + r0 * 64 + 4 * t, q = p + 8 * 64;
#pragma unroll
    for (int j = 0; j < 2; ++j) {
        af[j][0] = lds32(p + (((2 * j) ^ x) << 4));
        af[j][1] = lds32(q + (((2 * j) ^ x) << 4));
        af[j][2] = lds32(p + (((2 * j + 1) ^ x) << 4));
        af[j][3] = lds32(q + (((2 * j + 1) ^ x) << 4));
    }
}

// The A fragments of a warp-specialized stage: integer (`intg`) or outlier, in the stage layout of WsTile.
template <int BITS, int TN, int QOQ = QOQ_NONE>
__device__ __forceinline__ void ws_frags(u32 (&af)[4][4], u32 wt, int r0, int t, bool intg) {
    if constexpr (QOQ != QOQ_NONE)
        qoq_frags<QOQ>(af, wt, r0, t);
    else if (intg)
        load_frags<BITS, false>(af, wt, r0, t);
    else if (WsTile<TN, BITS>::OB == 64)
        load_frags_o64(af, wt, r0, t);
    else
        load_frags<BITS, true>(af, wt, r0, t);
}

// One stage of a math warpgroup: the wgmmas of the tile's stage gs (ring position g) on fragments `cur`, then
// (while they run) the release of the previous stage and the fragments of the next one into `nxt`.
template <int BITS, int TN, int ST, int QOQ = QOQ_NONE>
__device__ __forceinline__ void ws_step(int (&acc)[TN / 2], u32 (&cur)[4][4], u32 (&nxt)[4][4], u32 base, u32 bars,
                                        int gs, int g, int kt, int steps, int N, int f0, int r0, int t, int lane,
                                        const float* tsx, const float* tax, const u16* __restrict__ sw,
                                        const float* __restrict__ wred) {
    using T = WsTile<TN, BITS, QOQ>;
    const u32 st = base + (u32)(g % ST) * T::SB;
    if (gs < kt) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_s8<QOQ != QOQ_NONE>(acc, cur[j], desc_sw128(st + 32 * j));
    } else if constexpr (QOQ == QOQ_NONE) {
        if (gs == kt && kt > 0) {
            wgmma_wait0();
            if (QUIK_EPI < 3) eq1_in_place<BITS, TN>(acc, f0, N, t, tsx, tax, sw, wred);
        }
        wgmma_fence();
        if (T::OB == 64) {
#pragma unroll
            for (int j = 0; j < 2; ++j) wgmma_f16(acc, cur[j], desc_sw64(st + 32 * j));
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j) wgmma_f16(acc, cur[j], desc_sw128(st + 32 * j));
        }
    }
    wgmma_commit();
    wgmma_wait1();  // the previous stage is read: hand it back
    if (gs > 0 && lane == 0) mbar_arrive(bars + 8 * (ST + (g - 1) % ST));
    if (gs + 1 < steps) {
        mbar_wait(bars + 8 * ((g + 1) % ST), (u32)((g + 1) / ST) & 1);
        const u32 wt = base + (u32)((g + 1) % ST) * T::SB + T::XT;
        ws_frags<BITS, TN, QOQ>(nxt, wt, r0, t, gs + 1 < kt);
    }
}

// Split-K of QoQ's tile-per-block warp-specialized form (share z of S of split tile `tile` of `tiles`): the 256 math
// threads write their int32 share in the accumulator layout (one int4 per thread and 8 tokens, the tile's valid
// tokens only); the tile's last block adds the other shares to its own (integer sums: exact in any order), resets
// the tile's counter and takes the epilogue. False in the other blocks, which are done.
template <int TN>
__device__ __forceinline__ bool qoq_split_add(int (&acc)[TN / 2], int* __restrict__ wsk, int* __restrict__ cnt,
                                              int tile, int tiles, int z, int S, int mt, int ctid, int t) {
    constexpr int F4 = TN / 8;  // int4s per thread: tokens 8q + 2t, + 1 of rows r0, r0 + 8
    int4* w4 = reinterpret_cast<int4*>(wsk) + (size_t)tile * F4 * 256 + ctid;
#pragma unroll
    for (int q = 0; q < F4; ++q)
        if (8 * q + 2 * t < mt)
            w4[((size_t)z * tiles * F4 + q) * 256] = make_int4(acc[4 * q], acc[4 * q + 1], acc[4 * q + 2],
                                                               acc[4 * q + 3]);
    if (!split_k_last<1, 256>(cnt, tile, S, ctid)) return false;
    for (int z2 = 0; z2 < S; ++z2) {
        if (z2 == z) continue;
#pragma unroll
        for (int q = 0; q < F4; ++q) {
            if (8 * q + 2 * t >= mt) continue;
            const int4 v = __ldcg(w4 + ((size_t)z2 * tiles * F4 + q) * 256);
            acc[4 * q] += v.x;
            acc[4 * q + 1] += v.y;
            acc[4 * q + 2] += v.z;
            acc[4 * q + 3] += v.w;
        }
    }
    if (ctid == 0) cnt[tile] = 0;
    return true;
}

// PERSIST: one block per multiprocessor walks the tiles (tile, tile + grid, ...) through one ring, so the copy
// warpgroup fills it with the next tile's stages during this tile's epilogue, which transposes through small
// buffers of its own (WsTile::epi_buffers, 32 tokens at a time); each thread loads the next tile's s_x/z_x during
// the current tile (two shared-memory copies, by tile parity). Otherwise every block has one tile and the epilogue
// transposes through the ring in one pass.
// FUSED: the fused form (FusedQuant above; PERSIST and the copy-engine epilogue only) with EBF epilogue buffers,
// then the column maps and the copy warps' row buffers: s_x and z_x are written here, not by a kernel ahead.
// QOQ != QOQ_NONE: QoQ's W4A8 (as in gemm_body): zx is the int32 row sums, wred the int32 zeros (per channel), gst
// the stage-major group words (progressive groups); no outlier stages. Its tile-per-block form may split K: blocks
// 0..dp-1 take tiles 0..dp-1 whole, and each later tile is split over `nsplit` blocks (qoq_split_add; `wsk` and
// `cnt` as split_k.py's workspace), so that a layer with few tiles (4096 rows: 32 tiles of 128) keeps every
// multiprocessor streaming weights, and a layer with a wave and a fraction of tiles spreads that fraction over
// the whole GPU (dp = whole waves: a Stream-K-like remainder).
template <int BITS, int TN, int ST, bool PERSIST, bool FUSED = false, int EBF = 0, int QOQ = QOQ_NONE>
__device__ __forceinline__ void ws_body(const TmaMap* ma, const TmaMap* mw, const TmaMap* mxo, const TmaMap* mwo,
                                        const TmaMap* mo, int M, int N, int kt, int steps,
                                        const float* __restrict__ sx, const float* __restrict__ zx,
                                        const u16* __restrict__ sw, const float* __restrict__ wred,
                                        const u16* __restrict__ bias, void* __restrict__ out, int ldc, int raw,
                                        int tmo, const FusedQuant* fq = nullptr, const char* gst = nullptr,
                                        int dp = 0, int nsplit = 1, int* __restrict__ wsk = nullptr,
                                        int* __restrict__ cnt = nullptr) {
    using T = WsTile<TN, BITS, QOQ>;
    constexpr bool SPLIT = !PERSIST && !FUSED && QOQ != QOQ_NONE;
    // split-K: share z of tile t0 takes stages [s0, s0 + steps) of the layer's kt (none where z >= kt)
    int t0 = blockIdx.x, s0 = 0, z = 0;
    bool split = false;
    if constexpr (SPLIT) {
        if ((int)blockIdx.x >= dp) {
            const int r = (int)blockIdx.x - dp;
            split = true;
            t0 = dp + r / nsplit;
            z = r % nsplit;
            s0 = (int)((long long)z * kt / nsplit);
            steps = (int)((long long)(z + 1) * kt / nsplit) - s0;
        }
    }
    extern __shared__ char smem_raw[];
    __shared__ float tsx[2][TN], tax[2][TN];
    __shared__ __align__(8) u64 bar_mem[2 * ST];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const u32 bars = smem_addr(bar_mem);
    const int tid = threadIdx.x;
    // FUSED: the maps' barrier, the 8 math warps' and 3 copy warps' row buffers', and `staged` (every math warp
    // is done with its ring row buffer)
    __shared__ __align__(8) u64 qbar_mem[FUSED ? 13 : 1];
    // FUSED: the teams' min/max exchange (two sets) and their counts of row shares (fused_team_rows)
    __shared__ float fqred[FUSED ? 2 : 1][24][2];
    __shared__ u32 qdone[FUSED ? 8 : 1];
    const u32 qbars = smem_addr(qbar_mem), mapbar = qbars, staged = qbars + 8 * 12;
    const u32 qreg = base + (u32)(ST * T::SB + EBF * 8192);  // FUSED: src map, oflag, osrc, then row buffers
    const u32 rb = FUSED ? (2u * (u32)fq->K + 127u) & ~127u : 128u;  // a row, padded to 128 bytes
    const u32 sbm = FUSED ? (2u * (u32)fq->kp + 127u) & ~127u : 0u, fb = FUSED ? ((u32)fq->K / 8u + 127u) & ~127u : 0u;
    const u32 ob = FUSED ? (2u * (u32)fq->kop + 127u) & ~127u : 0u;  // the outlier offsets (kop is a multiple of 64)
    const u32 rows_at = sbm + fb + ob;  // the copy warps' row buffers, from qreg
    const int per_slot = FUSED ? T::XT / (int)rb : 0, q1 = min(8, ST * per_slot);
    const int r1 = FUSED ? (q1 > 0 ? (fq->q2 > 0 ? fq->r1 : M) : 0) : 0;
    if (tid == 0) {
        ring_init<ST>(bars);
        if (FUSED) {
            for (int i = 0; i < 12; ++i) mbar_init(qbars + 8 * i, 1);
            for (int i = 0; i < 8; ++i) qdone[i] = 0;
            mbar_init(staged, 8);
            mbar_init_fence();
            // the maps are the layer's own: no wait for the kernel ahead
            mbar_arrive_expect_tx(mapbar, sbm + fb + 2u * (u32)fq->kop);
            bulk_load(qreg, fq->src, 2u * (u32)fq->kp, mapbar);
            bulk_load(qreg + sbm, fq->oflag, fb, mapbar);
            if (fq->kop > 0) bulk_load(qreg + sbm + fb, fq->osrc, 2u * (u32)fq->kop, mapbar);
        }
    }
    __syncthreads();
    if (QUIK_TRACE && FUSED && tid == 0) trace_at(fq->ready, 0);
    char* const qgen = smem_raw + (qreg - smem_addr(smem_raw));  // the same bytes as a generic pointer
    if (tid < 128) {
        regs_decrease<40>();
        if (tid == 0) {
            tma_prefetch_map(ma);
            tma_prefetch_map(mw);
            ws_copies<BITS, TN, ST, FUSED, QOQ>(ma, mw, mxo, mwo, base, bars, M, N, kt, steps,
                                                FUSED ? fq->ready : nullptr, staged, gst, s0, t0);
        }
        if (!FUSED) return;
        const int cw = (tid >> 5) - 1;  // the copy warps after the first quantize rows r1.. while the tiles run
        if (cw == 0 && q1 > 0) {
            // the counts belong to the kernel ahead until it completes (its last block resets them)
            grid_dependency_wait();
            if ((tid & 31) == 0)
                publish_rows<TN, QUIK_WSQ_TW>(fq->ready, (int)blockIdx.x, r1, (int)gridDim.x, q1, smem_addr(qdone));
            __syncwarp();
        }
        if (cw >= 0 && cw < fq->q2) {
            grid_dependency_wait();  // the rows come from the kernel ahead
            // not before the block's first rows are done: their copies have the DRAM to themselves (measured:
            // 4096 x 11008, M = 2048, 189 -> 181 us)
            mbar_wait(staged, 0);
            fused_rows<BITS, TN, 1>(*fq, const_cast<float*>(sx), const_cast<float*>(zx),
                                    r1 + (int)blockIdx.x + (int)gridDim.x * cw, M, (int)gridDim.x * fq->q2,
                                    qgen + rows_at + (u32)cw * rb, qbars + 8 * (9 + cw), mapbar, qgen + sbm, qreg,
                                    qreg + sbm + fb, tid & 31, 9 + 8 * cw);
        }
        launch_dependents();
    } else {
    regs_increase<232>();
    grid_dependency_wait();  // s_x and z_x come from the kernel ahead (the quantize kernel), or (FUSED) x does
    const int ctid = tid - 128, warp = (ctid >> 5) & 3, lane = tid & 31, gq = lane >> 2, t = lane & 3;
    if (FUSED) {
        // rows 0..r1-1 first, by the math warps in teams, staged in the activation areas of the ring slots (free
        // until the copy thread passes `staged`); copy warp 1 publishes them
        const int mw = ctid >> 5;
        if (q1 > 0) {
            char* const ring = smem_raw + (base - smem_addr(smem_raw));
            auto buf = [&](int b) { return ring + (b / per_slot) * T::SB + (b % per_slot) * rb; };
            fused_team_rows<BITS, TN, QUIK_WSQ_TW>(*fq, const_cast<float*>(sx), const_cast<float*>(zx),
                                                   (int)blockIdx.x, r1, (int)gridDim.x, q1, buf, qbars + 8, mapbar,
                                                   qgen + sbm, qreg, qreg + sbm + fb, mw, lane, fqred,
                                                   smem_addr(qdone));
        }
        if (lane == 0) mbar_arrive(staged);
        if (QUIK_TRACE && lane == 0) trace_at(fq->ready, 1 + mw);
    }
    const int r0 = 64 * (ctid >> 7) + 16 * warp + gq;  // this lane's rows in the tile: r0, r0 + 8
    const float h = (float)(1 << (BITS - 1));
    const int tiles = ((N + 127) >> 7) * ((M + TN - 1) / TN);
    float nsx = 0.f, nax = 0.f;  // token ctid of the next tile
    auto fetch = [&](int tl) {
        int m0_, n0_;
        ws_tile(tl, N, TN, m0_, n0_);
        const int m = m0_ + ctid;
        const bool ok = tl < tiles && ctid < TN && m < M;
        if (FUSED && ok) rows_wait(fq->ready + m0_ / TN, min(TN, M - m0_));
        nsx = ok ? ld_dep_f32(sx + m) : 0.f;
        if constexpr (QOQ != QOQ_NONE)  // the row sum, as int bits
            nax = bits2f(ok ? (int)ld_dep_u32(reinterpret_cast<const u32*>(zx) + m) : 0);
        else
            nax = ok ? ld_dep_f32(zx + m) + h * nsx : 0.f;
    };
    fetch(t0);
    int g = 0, j = 0, eb = 0;  // eb: the next epilogue buffer (store_tile_tma)
    for (int tile = t0; tile < tiles; tile += gridDim.x, g += steps, ++j) {
        int m0, n0;
        ws_tile(tile, N, TN, m0, n0);
        // copy j & 1 was last read in tile j - 2, before every math thread passed tile j - 1's barrier
        float* csx = tsx[j & 1];
        float* cax = tax[j & 1];
        if (ctid < TN) {
            csx[ctid] = nsx;
            cax[ctid] = nax;
        }
        bar_sync<1, 256>();
        if (QUIK_TRACE && FUSED && ctid == 0 && j < 8) trace_at(fq->ready, 33 + j);
        // the next layer's quantize kernel may start its prologue during this block's last tile
        if (tile + (int)gridDim.x >= tiles) launch_dependents();
        if (PERSIST && !FUSED) fetch(tile + (int)gridDim.x);
        int acc[TN / 2];
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) acc[i] = 0;
        u32 af0[4][4], af1[4][4];  // a stage's wgmmas may still read one set while the next stage fills the other
        if (steps > 0) {
            mbar_wait(bars + 8 * (g % ST), (u32)(g / ST) & 1);
            const u32 wt = base + (u32)(g % ST) * T::SB + T::XT;
            ws_frags<BITS, TN, QOQ>(af0, wt, r0, t, kt > 0);
        }
        int gs = 0;
        for (; gs + 1 < steps; gs += 2) {
            ws_step<BITS, TN, ST, QOQ>(acc, af0, af1, base, bars, gs, g + gs, kt, steps, N, n0 + r0, r0, t, lane,
                                       csx, cax, sw, wred);
            ws_step<BITS, TN, ST, QOQ>(acc, af1, af0, base, bars, gs + 1, g + gs + 1, kt, steps, N, n0 + r0, r0, t,
                                       lane, csx, cax, sw, wred);
        }
        if (gs < steps)
            ws_step<BITS, TN, ST, QOQ>(acc, af0, af1, base, bars, gs, g + gs, kt, steps, N, n0 + r0, r0, t, lane,
                                       csx, cax, sw, wred);
        wgmma_wait0();
        if (steps > 0 && lane == 0) mbar_arrive(bars + 8 * (ST + (g + steps - 1) % ST));  // the tile's last stage
        // FUSED: the next tile's rows may be quantized by now (they are during the first tiles): waited for here,
        // after this tile's wgmmas, so the wait and the loads overlap the epilogue
        if (FUSED) fetch(tile + (int)gridDim.x);
        bool eq1_pending = steps == kt && kt > 0;
        if constexpr (SPLIT) {
            if (split) {
                if (!qoq_split_add<TN>(acc, wsk, cnt, tile - dp, tiles - dp, z, nsplit, min(TN, M - m0), ctid, t))
                    return;
                eq1_pending = kt > 0;  // the zero-point term, once, on the total
            }
        }
        if (PERSIST && tmo && !raw) {
            constexpr int EB = FUSED ? EBF : T::template epi_buffers<ST>();
            static_assert(EB >= 2, "the ring leaves room for two epilogue buffers");
            store_tile_tma<BITS, TN, EB, QOQ>(acc, m0, n0, M, N, eq1_pending, r0, t, ctid, base + (u32)(ST * T::SB),
                                              eb, csx, cax, sw, wred, bias, mo);
            if (QUIK_TRACE && FUSED && ctid == 0 && j < 8) trace_at(fq->ready, 41 + j);
        } else if (PERSIST) {
            // the buffer's last reads (previous tile) finished before this tile's first barrier
            store_tile<BITS, TN, 1, T::EPI_TOKENS, QOQ>(acc, m0, n0, M, N, eq1_pending, r0, t, ctid, smem_raw,
                                                        base + (u32)(ST * T::SB), csx, cax, sw, wred, bias, out,
                                                        ldc, raw);
        } else {
            bar_sync<1, 256>();  // every math warp is done with the ring: it becomes the transpose tile
            store_tile<BITS, TN, 1, TN, QOQ>(acc, m0, n0, M, N, eq1_pending, r0, t, ctid, smem_raw, base, csx, cax,
                                             sw, wred, bias, out, ldc, raw);
        }
    }
    if (PERSIST && tmo && ctid == 0) bulk_wait_all();  // the output is written before the block exits
    }
    if (FUSED) {
        __syncthreads();  // this block's waits on the counts are over
        if (tid == 0) {
            const int ntt = (M + TN - 1) / TN;
            __threadfence();
            if (atomicAdd(fq->ready + ntt, 1) == (int)gridDim.x - 1) {
                for (int i = 0; i <= ntt; ++i) fq->ready[i] = 0;
                __threadfence();
            }
        }
    }
}

#define WS_ENTRY(BITS, TN, ST, PERSIST, NAME)                                                                     \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                                    \
        const __grid_constant__ TmaMap ma, const __grid_constant__ TmaMap mw, const __grid_constant__ TmaMap mxo, \
        const __grid_constant__ TmaMap mwo, const __grid_constant__ TmaMap mo, int M, int N, int kt, int kto,      \
        const float* sx, const float* zx, const u16* sw, const float* wred, const u16* bias, void* out, int ldc,   \
        int raw, int tmo) {                                                                                       \
        ws_body<BITS, TN, ST, PERSIST>(&ma, &mw, &mxo, &mwo, &mo, M, N, kt, kt + kto, sx, zx, sw, wred, bias, out, \
                                       ldc, raw, tmo);                                                            \
    }
#define WS_ENTRIES(TN, ST)                                   \
    WS_ENTRY(4, TN, ST, false, quik_gemm_ws_w4_n##TN##_s##ST) \
    WS_ENTRY(8, TN, ST, false, quik_gemm_ws_w8_n##TN##_s##ST)
#define WSP_ENTRIES(TN, ST)                                  \
    WS_ENTRY(4, TN, ST, true, quik_gemm_wsp_w4_n##TN##_s##ST) \
    WS_ENTRY(8, TN, ST, true, quik_gemm_wsp_w8_n##TN##_s##ST)
WS_ENTRIES(64, 8)
WS_ENTRIES(128, 6)
WS_ENTRIES(256, 4)
WSP_ENTRIES(128, 6)
WSP_ENTRIES(256, 4)
WS_ENTRY(4, 256, 5, true, quik_gemm_wsp_w4_n256_s5)

// The fused form (FusedQuant): W4A4 and W8A8, fused output through the copy engine only (tmo), two epilogue buffers.
#define WSQ_ENTRY(BITS, TN, ST)                                                                                   \
    extern "C" __global__ void __launch_bounds__(384, 1) quik_gemm_wsq_w##BITS##_n##TN##_s##ST(                  \
        const __grid_constant__ TmaMap ma, const __grid_constant__ TmaMap mw, const __grid_constant__ TmaMap mxo, \
        const __grid_constant__ TmaMap mwo, const __grid_constant__ TmaMap mo, int M, int N, int kt, int kto,      \
        float* sx, float* zx, const u16* sw, const float* wred, const u16* bias, void* out, int ldc,              \
        const u16* x, int ldx, int K, const u16* src, const u8* oflag, const u16* osrc, const int* oidx, int kb,   \
        int kp, int ko, int kop, char* aq, u16* xo, int* ready, int r1, int q2) {                                 \
        const FusedQuant fq{x, ldx, K, kb, kp, ko, kop, r1, q2, src, oflag, osrc, oidx, aq, xo, ready};           \
        ws_body<BITS, TN, ST, true, true, 2>(&ma, &mw, &mxo, &mwo, &mo, M, N, kt, kt + kto, sx, zx, sw, wred, bias, \
                                             out, ldc, 0, 1, &fq);                                                \
    }
WSQ_ENTRY(4, 256, 4)

// QoQ W4A8 in the warp-specialized forms (the `ws` tile per block, and the persistent `wsp`): ma / mw / mo as
// above (the weight codes as 4-bit rows), G the stage-major group words (progressive; unused per channel), rsum the
// activation code sums, zeros z[n] as int32 (per channel). raw: the exact int32 products. `ws`: tiles dp.. are split
// over nsplit blocks each (grid dp + (tiles - dp) x nsplit), their shares in `wsk` (nsplit x (tiles - dp) x 128 x
// TN ints) with one zero counter per split tile in `cnt`.
#define QOQ_WS_ENTRY(KIND, PERSIST, NAME, QOQ, TN, ST)                                                           \
    extern "C" __global__ void __launch_bounds__(384, 1) qoq_gemm_##KIND##_##NAME##_n##TN##_s##ST(              \
        const __grid_constant__ TmaMap ma, const __grid_constant__ TmaMap mw, const __grid_constant__ TmaMap mo, \
        const char* G, int M, int N, int kt, const float* sx, const int* rsum, const u16* sw, const int* zeros,  \
        const u16* bias, void* out, int ldc, int raw, int tmo, int dp, int nsplit, int* wsk, int* cnt) {         \
        ws_body<4, TN, ST, PERSIST, false, 0, QOQ>(&ma, &mw, &ma, &mw, &mo, M, N, kt, kt, sx,                      \
                                                   reinterpret_cast<const float*>(rsum), sw,                     \
                                                   reinterpret_cast<const float*>(zeros), bias, out, ldc, raw,   \
                                                   tmo, nullptr, G, dp, nsplit, wsk, cnt);                       \
    }
#define QOQ_WS_ENTRIES(KIND, PERSIST, TN, ST)              \
    QOQ_WS_ENTRY(KIND, PERSIST, pc, QOQ_PC, TN, ST)        \
    QOQ_WS_ENTRY(KIND, PERSIST, g32, 32, TN, ST)           \
    QOQ_WS_ENTRY(KIND, PERSIST, g64, 64, TN, ST)           \
    QOQ_WS_ENTRY(KIND, PERSIST, g128, 128, TN, ST)
QOQ_WS_ENTRIES(ws, false, 64, 8)
QOQ_WS_ENTRIES(ws, false, 128, 6)
QOQ_WS_ENTRIES(ws, false, 256, 4)
QOQ_WS_ENTRIES(wsp, true, 128, 6)
QOQ_WS_ENTRIES(wsp, true, 256, 4)

// ---------------------------------------------------------------------------------------------------------------
// Decode GEMV (MT = 1 or 2 tokens, fused output or raw sums): one warp per weight row on the CUDA cores. The lanes
// read the row's code bytes once, 16 at a time (512 contiguous bytes per warp and step), and multiply them with
// the activation codes by dp4a: a 4-bit word's low nibbles, shifted up, are 16x the codes of activation bytes
// 4j..4j+3 of its 32-code group and its high nibbles those of bytes 16 + 4j.. (the order of the runtime contract),
// an 8-bit word's bytes those of the same four positions. The int32 sums are exact (16x at 4 bits, as in the
// GEMMs); the outlier columns are float32 dot products of the float16 rows; lane 0 applies Eq. 1 and the bias.
// Each lane's first GEMV_U weight chunks are loaded before the wait for the kernel ahead.
// ---------------------------------------------------------------------------------------------------------------
constexpr int GEMV_WARPS = 8;
constexpr int GEMV_U = 4;  // weight chunks per lane in flight

template <int BITS, int MT>
__device__ __forceinline__ void gemv_chunk(int (&acc)[MT], const uint4& w, const char* __restrict__ A, int lda,
                                           int c) {
    const u32 wv[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        if (BITS == 4) {
            const uint4 a0 = ld_dep_v4(A + (size_t)m * lda + 32 * c);
            const uint4 a1 = ld_dep_v4(A + (size_t)m * lda + 32 * c + 16);
            const u32 lo[4] = {a0.x, a0.y, a0.z, a0.w}, hi[4] = {a1.x, a1.y, a1.z, a1.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                acc[m] = dp4a_ss(((wv[j] << 4) & 0xF0F0F0F0u) ^ 0x80808080u, lo[j], acc[m]);
                acc[m] = dp4a_ss((wv[j] & 0xF0F0F0F0u) ^ 0x80808080u, hi[j], acc[m]);
            }
        } else {
            const uint4 a0 = ld_dep_v4(A + (size_t)m * lda + 16 * c);
            const u32 av[4] = {a0.x, a0.y, a0.z, a0.w};
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[m] = dp4a_ss(wv[j] ^ 0x80808080u, av[j], acc[m]);
        }
    }
}

template <int BITS, int MT>
__device__ __forceinline__ void gemv_body(const char* __restrict__ A, int lda, const char* __restrict__ W, int ldw,
                                          const char* __restrict__ Xo, int ldxo, const char* __restrict__ Wo,
                                          int ldwo, int M, int N, int kt, int kto, const float* __restrict__ sx,
                                          const float* __restrict__ zx, const u16* __restrict__ sw,
                                          const float* __restrict__ wred, const u16* __restrict__ bias,
                                          void* __restrict__ out, int ldc, int raw) {
    launch_dependents();  // the next kernel may start its own setup; it waits for this one before reading
    const int lane = threadIdx.x & 31;
    const int f = (int)blockIdx.x * GEMV_WARPS + (threadIdx.x >> 5);
    if (f >= N) return;
    // Everything on the weight side first: it does not come from the kernel ahead.
    const int wchunks = kt * BITS;  // 16-byte chunks per code row: 128 codes per stage, BITS / 8 bytes each
    const int ochunks = kto * 8;    // 8 float16 outlier columns per chunk
    const char* wrow = W + (size_t)f * ldw;
    const u16* worow = reinterpret_cast<const u16*>(Wo + (size_t)f * ldwo);
    uint4 w[GEMV_U];
#pragma unroll
    for (int u = 0; u < GEMV_U; ++u)
        if (lane + 32 * u < wchunks) w[u] = ld_nc_v4(reinterpret_cast<const u32*>(wrow + 16 * (lane + 32 * u)));
    uint4 wo = make_uint4(0u, 0u, 0u, 0u);
    if (lane < ochunks) wo = ld_nc_v4(reinterpret_cast<const u32*>(worow + 8 * lane));
    float swf = 0.f, wrf = 0.f, bf = 0.f;
    if (lane < MT && !raw) {
        swf = h2f(sw[f]) * (BITS == 4 ? 0.0625f : 1.0f);  // 4-bit sums are 16x
        wrf = kt > 0 ? wred[f] : 0.f;
        bf = bias != nullptr ? h2f(bias[f]) : 0.f;
    }
    grid_dependency_wait();  // the activation codes, outliers, s_x and z_x come from the kernel ahead
    float sxv = 0.f, zxv = 0.f;
    if (lane < MT && lane < M && !raw) sxv = ld_dep_f32(sx + lane), zxv = ld_dep_f32(zx + lane);
    uint4 xo[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m)
        xo[m] = lane < ochunks ? ld_dep_v4(Xo + (size_t)m * ldxo + 16 * lane)
                               : make_uint4(0u, 0u, 0u, 0u);
    int acc[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m] = 0;
    for (int c0 = 0; c0 < wchunks; c0 += 32 * GEMV_U) {
        if (c0 > 0) {
#pragma unroll
            for (int u = 0; u < GEMV_U; ++u) {
                const int c = c0 + lane + 32 * u;
                if (c < wchunks) w[u] = ld_nc_v4(reinterpret_cast<const u32*>(wrow + 16 * c));
            }
        }
#pragma unroll
        for (int u = 0; u < GEMV_U; ++u) {
            const int c = c0 + lane + 32 * u;
            if (c < wchunks) gemv_chunk<BITS, MT>(acc, w[u], A, lda, c);
        }
    }
    float oacc[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) oacc[m] = 0.f;
    for (int c = lane; c < ochunks; c += 32) {
        if (c >= 32) {
            wo = ld_nc_v4(reinterpret_cast<const u32*>(worow + 8 * c));
#pragma unroll
            for (int m = 0; m < MT; ++m) xo[m] = ld_dep_v4(Xo + (size_t)m * ldxo + 16 * c);
        }
        const u32 wp[4] = {wo.x, wo.y, wo.z, wo.w};
#pragma unroll
        for (int m = 0; m < MT; ++m) {
            const u32 xp[4] = {xo[m].x, xo[m].y, xo[m].z, xo[m].w};
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                oacc[m] += h2f((u16)(wp[j] & 0xFFFF)) * h2f((u16)(xp[j] & 0xFFFF));
                oacc[m] += h2f((u16)(wp[j] >> 16)) * h2f((u16)(xp[j] >> 16));
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
            oacc[m] += __shfl_xor_sync(0xffffffffu, oacc[m], o);
        }
    }
    const int m = lane;  // lane m writes token m (acc[m] picked with constant indices below)
    if (m >= MT || m >= M) return;
    int a = acc[0];
    float oa = oacc[0];
#pragma unroll
    for (int i = 1; i < MT; ++i)
        if (m == i) a = acc[i], oa = oacc[i];
    if (raw) {
        reinterpret_cast<int*>(out)[(size_t)m * ldc + f] = BITS == 4 ? a >> 4 : a;
        return;
    }
    float y = oa;
    if (kt > 0) y = (float)a * sxv * swf + (zxv + (float)(1 << (BITS - 1)) * sxv) * wrf + oa;
    reinterpret_cast<u16*>(out)[(size_t)m * ldc + f] = f2h(y + bf);
}

#define GEMV_ENTRY(BITS, MT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) quik_gemv_w##BITS##_m##MT(                      \
        const char* A, int lda, const char* W, int ldw, const char* Xo, int ldxo, const char* Wo, int ldwo,      \
        int M, int N, int kt, int kto, const float* sx, const float* zx, const u16* sw, const float* wred,       \
        const u16* bias, void* out, int ldc, int raw) {                                                          \
        gemv_body<BITS, MT>(A, lda, W, ldw, Xo, ldxo, Wo, ldwo, M, N, kt, kto, sx, zx, sw, wred, bias, out, ldc, \
                            raw);                                                                                \
    }
GEMV_ENTRY(4, 1)
GEMV_ENTRY(4, 2)
GEMV_ENTRY(8, 1)
GEMV_ENTRY(8, 2)
