// Kernels for the `quik` layout (formats/quik.md): per-token activation quantization with float16 outlier
// columns, and the integer GEMM with the dequantization epilogue (QUIK, Eq. 1) and the outlier product fused.
//
// Compiled at run time by NVRTC for sm_90a (qtool/cuda/compile.py); `wgmma` needs Hopper. The GEMMs instantiate the
// INT8 wgmma engine (common/int8_wgmma.cuh) with QUIK's weight scheme (Int8Scheme<BITS, QUIK> below): signed
// codes, the outlier columns as the engine's float16 stages after the integer ones, Eq. 1 as the epilogue; this
// file also holds the quantize kernels that write the activation rows, the form that fuses them into the GEMM, and
// the decode GEMV.
//
// Runtime contract (qtool/layouts/quik/cuda.py guarantees it before launching):
//   * Activation rows (s8, Kp bytes, Kp a multiple of 128) hold the signed code c - 2^(b-1) of base column b at
//     byte pos(b); positions kb..Kp-1 hold 0. At 8 bits pos(b) = b. At 4 bits, inside every group of 32 columns,
//     the even columns come first, then the odd ones: pos(b) = 32*(b/32) + 16*(b%2) + (b%32)/2. That is the order
//     in which a 4-bit weight word unpacks (low nibbles, then high nibbles), so the int32 sums equal step 3 of
//     formats/quik.md exactly.
//   * Weight code rows hold Kp codes: the checkpoint's bit streams (padded only where the base column count is not
//     a multiple of 128). The float16 outlier weights Wo [N, kop] have kop a multiple of 64, zero beyond ko.
//   * Outlier activations Xo [M, kop] float16, zero beyond ko. Row strides are in bytes, multiples of 16.

#include "common/int8_wgmma.cuh"

// Measurement builds only (qtool.cuda.compile extra options; the engine's are INT8_ABLATE and INT8_EPI):
// QUIK_TUNING adds variants.
#ifndef QUIK_TUNING
#define QUIK_TUNING 0
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

// ---------------------------------------------------------------------------------------------------------------
// Fused split + quantize, block-per-row form (the engine's quantize_rows, common/int8_wgmma.cuh): the base columns
// get asymmetric codes (step 2 of formats/quik.md: y = RN(1/s) once per row, then one fused multiply-add per code,
// ties to even: the codes equal the reference's), the outlier columns (oflag) keep their float16 values in their
// slot of xo; z_x is the row's minimum.
// ---------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float sub_rn(float a, float b) {
    float r;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
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

template <int AB>
struct ActCodes {
    static_assert(AB == 4 || AB == 8, "4- or 8-bit activation codes");
    static constexpr bool SUMS = false;
    __device__ static __forceinline__ void scale(float lo, float hi, float& s, float& y) {
        s = hi > lo ? div_rn(hi - lo, (float)((1 << AB) - 1)) : 1.0f;
        y = div_rn(1.0f, s);
    }
    __device__ static __forceinline__ void put(u16 h, int d, float lo, float y, char* cs, u16* os, int&) {
        if (d >= 0) {
            // no clamp needed: 0 <= x - lo <= hi - lo, and (hi - lo)·y <= (2^AB - 1) (1 + 2^-23)
            cs[d] = (char)code_of<AB>(sub_rn(h2f(h), lo), y);
        } else {
            os[-1 - d] = h;
        }
    }
    __device__ static __forceinline__ void row_sums(int, int*, int) {}
    template <int W>
    __device__ static __forceinline__ void row_stats(int row, float lo, const int*, float* zx, int*) {
        zx[row] = lo;
    }
};

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

// ---------------------------------------------------------------------------------------------------------------
// Fused split + quantize, warp-per-row form (rows of 16-byte aligned, whole 16-byte pieces): a warp quantizes a
// token row alone, persistent over rows (row, row + warps in the grid, ...), so the min/max needs no block barrier,
// only shuffles. Each warp owns NB row buffers in shared memory, filled by 1-D bulk copies that lane 0 issues and
// that complete on the buffer's mbarrier: the next NB - 1 rows stream in while a row is quantized, with no
// registers holding them (the block-per-row kernel above, quantize_rows, keeps its row in registers, and the
// register cap that keeps enough rows in flight there left no room to prefetch).
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

// ---------------------------------------------------------------------------------------------------------------
// QUIK's weight scheme for the engine: the weight codes as s8 (W4A4, W8A8), the outlier columns as float16 stages,
// Eq. 1 as the epilogue.
//
// 4-bit weights become 16x their s8 value with two or three integer ops per 4 codes ((w << 4) & 0xF0F0F0F0 ^
// 0x80808080 for the low nibbles, w & 0xF0F0F0F0 ^ 0x80808080 for the high ones), so the accumulators hold 16x the
// integer sums: exact, and the 1/16 goes into the weight scale (a power of two: the float products round exactly as
// before).
//
// After the integer stages the accumulators become float32 in place (Eq. 1), the outlier stages accumulate on top
// with wgmma f32.f16.f16, and the tile is transposed through shared memory for 16-byte row stores with the bias.
// ---------------------------------------------------------------------------------------------------------------
enum : int { QUIK = 0 };  // the scheme's number in the engine's instantiations

// A fragments of the stage's 4 k-steps j for rows r0 and r0 + 8: a0/a1 hold k = 4t..4t+3 of rows r0/r0+8, a2/a3
// k = 16+4t..16+4t+3. 4-bit: word 4j+t of the stage row, low nibbles -> a0/a1, high nibbles -> a2/a3 (hence the
// activation order of the contract). 8-bit: words 8j+t -> a0/a1 and 8j+4+t -> a2/a3.
template <int BITS>
__device__ __forceinline__ void load_frags(u32 (&af)[4][4], u32 wt, int r0, int t) {
    if (BITS == 4) {
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
        const u32 f = 0x80808080u;  // 8-bit codes: u - 128 is u with the top bit flipped
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            af[j][0] = lds32(p + (((2 * j) ^ x) << 4)) ^ f;
            af[j][1] = lds32(q + (((2 * j) ^ x) << 4)) ^ f;
            af[j][2] = lds32(p + (((2 * j + 1) ^ x) << 4)) ^ f;
            af[j][3] = lds32(q + (((2 * j + 1) ^ x) << 4)) ^ f;
        }
    }
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

template <int BITS>
struct Int8Scheme<BITS, QUIK> {
    static constexpr bool UA = false;
    static constexpr int SIDE = 0;
    static constexpr bool F16_STAGES = true;
    static constexpr int RAW_SHIFT = BITS == 4 ? 4 : 0;  // 4-bit sums are 16x
    static constexpr bool INT_SHARES = false;
    static constexpr bool CORRECTS = false;  // the zero-point term is part of Eq. 1
    __device__ static __forceinline__ void frags(u32 (&af)[4][4], u32 wt, int r0, int t) {
        load_frags<BITS>(af, wt, r0, t);
    }
    // z_x + h·s_x of Eq. 1
    __device__ static __forceinline__ float token_load(const float* zx, int m, float sv) {
        return ld_dep_f32(zx + m) + (float)(1 << (BITS - 1)) * sv;
    }
    __device__ static __forceinline__ float token_value(float v) { return v; }
    template <int TN>
    __device__ static __forceinline__ void scale(int (&acc)[TN / 2], int f0, int N, int t, const float* tsx,
                                                 const float* tax, const u16* sw, const float* wred) {
        eq1_in_place<BITS, TN>(acc, f0, N, t, tsx, tax, sw, wred);
    }
};

// MINB: blocks per SM the registers must allow.
#define GEMM_ENTRY(BITS, TN, ST, MINB)                                                                         \
    extern "C" __global__ void __launch_bounds__(256, MINB) quik_gemm_w##BITS##_n##TN##_s##ST(                 \
        const char* A, int lda, const char* W, int ldw, const char* Xo, int ldxo, const char* Wo, int ldwo,    \
        int M, int N, int kt, int kto, const float* sx, const float* zx, const u16* sw, const float* wred,     \
        const u16* bias, void* out, int ldc, int raw, float* ws, int* cnt) {                                   \
        const GemmArgs g{A, lda, W, ldw, Xo, ldxo, Wo, ldwo, M, N, kt, kt + kto, 0, 0, 0};                     \
        gemm_body<BITS, TN, ST, QUIK>(g, sx, zx, sw, wred, bias, out, ldc, raw, ws, cnt);                      \
    }
#define GEMM_ENTRIES(TN, ST, MINB) GEMM_ENTRY(4, TN, ST, MINB) GEMM_ENTRY(8, TN, ST, MINB)
GEMM_ENTRIES(64, 4, 2)
GEMM_ENTRIES(128, 4, 1)
GEMM_ENTRIES(256, 3, 1)
#if QUIK_TUNING
GEMM_ENTRIES(256, 4, 1)
#endif

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

// The fused form's producer (ws_body's FUSED, the members NoProducer lists in common/int8_wgmma.cuh). Shared memory
// beyond the ring and its EBF epilogue buffers (qreg): the column maps (src, oflag, osrc), then the copy warps'
// row buffers; barriers: the maps', the 8 math warps' and 3 copy warps' row buffers', and `staged` (every math warp
// is done with its ring row buffer); qdone: the teams' counts of row shares (fused_team_rows).
template <int BITS, int TN, int ST, int EBF>
struct FusedProducer {
    using T = WsTile<TN, BITS, 0>;
    enum : int { BARRIERS = 13, COUNTS = 8 };
    using Exchange = float[2][24][2];  // the teams' min/max exchange (two sets)
    const FusedQuant* fq;
    u32* qdone;
    u32 qbars, mapbar, staged, qreg, rb, sbm, fb, ob, rows_at;
    int per_slot, q1, r1;
    char* qgen;  // qreg as a generic pointer

    __device__ __forceinline__ FusedProducer(const FusedQuant* fq_, int M, u32 base, u64* qbar_mem, u32* qdone_)
        : fq(fq_), qdone(qdone_) {
        qbars = smem_addr(qbar_mem), mapbar = qbars, staged = qbars + 8 * 12;
        qreg = base + (u32)(ST * T::SB + EBF * 8192);
        rb = (2u * (u32)fq->K + 127u) & ~127u;  // a row, padded to 128 bytes
        sbm = (2u * (u32)fq->kp + 127u) & ~127u, fb = ((u32)fq->K / 8u + 127u) & ~127u;
        ob = (2u * (u32)fq->kop + 127u) & ~127u;  // the outlier offsets (kop is a multiple of 64)
        rows_at = sbm + fb + ob;                  // the copy warps' row buffers, from qreg
        per_slot = T::XT / (int)rb, q1 = min(8, ST * per_slot);
        r1 = q1 > 0 ? (fq->q2 > 0 ? fq->r1 : M) : 0;
    }

    __device__ __forceinline__ void init() const {
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

    __device__ __forceinline__ void trace(int slot) const {
        if (QUIK_TRACE) trace_at(fq->ready, slot);
    }

    __device__ __forceinline__ void locate(char* smem_raw) { qgen = smem_raw + (qreg - smem_addr(smem_raw)); }

    __device__ __forceinline__ void before_copies() const {
        mbar_wait(staged, 0);
        fence_async_smem();  // the staged rows were read by the generic proxy; the copy engine now overwrites them
    }

    __device__ __forceinline__ void rows_ready(int m0, int M) const {
        rows_wait(fq->ready + m0 / TN, min(TN, M - m0));
    }

    __device__ __forceinline__ void copy_warps(int tid, int M, const float* sx, const float* zx) const {
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
    }

    // rows 0..r1-1 first, by the math warps in teams, staged in the activation areas of the ring slots (free until
    // the copy thread passes `staged`); copy warp 1 publishes them
    __device__ __forceinline__ void math_warps(int ctid, int lane, const float* sx, const float* zx, char* smem_raw,
                                               u32 base, float (*fqred)[24][2]) {
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

    // The last block to finish resets the counts (see the fused form above).
    __device__ __forceinline__ void finish(int tid, int M) const {
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
};

// The warp-specialized entries (common/int8_wgmma.cuh ws_body): `ws` a tile per block, `wsp` persistent.
#define WS_ENTRY(BITS, TN, ST, PERSIST, NAME)                                                                     \
    extern "C" __global__ void __launch_bounds__(384, 1) NAME(                                                    \
        const __grid_constant__ TmaMap ma, const __grid_constant__ TmaMap mw, const __grid_constant__ TmaMap mxo, \
        const __grid_constant__ TmaMap mwo, const __grid_constant__ TmaMap mo, int M, int N, int kt, int kto,      \
        const float* sx, const float* zx, const u16* sw, const float* wred, const u16* bias, void* out, int ldc,   \
        int raw, int tmo) {                                                                                       \
        ws_body<BITS, TN, ST, PERSIST, false, 0, QUIK>(&ma, &mw, &mxo, &mwo, &mo, M, N, kt, kt + kto, sx, zx, sw,   \
                                                       wred, bias, out, ldc, raw, tmo);                           \
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
        ws_body<BITS, TN, ST, true, true, 2, QUIK>(&ma, &mw, &mxo, &mwo, &mo, M, N, kt, kt + kto, sx, zx, sw, wred,  \
                                                   bias, out, ldc, 0, 1, &fq);                                    \
    }
WSQ_ENTRY(4, 256, 4)

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
