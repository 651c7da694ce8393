// Kernels for the `grouped_int` weight layout (formats/grouped-int.md), 4- and 8-bit codes.
//
// Compiled at run time by NVRTC (qtool/cuda/compile.py). No CUDA headers are included, so the source builds with any
// NVRTC, with or without the CUDA include tree: half-precision arithmetic is inline PTX (here and in
// common/ptx_common.cuh).
//
// Runtime contract (qtool/cuda/grouped_int.py guarantees it before launching):
//   * K is padded to Kp, a multiple of 128 codes. qweight rows have Kp*BITS/32 words (the checkpoint rows when
//     K % 128 == 0, otherwise a zero-padded copy made once at load time), so every 16-byte load is aligned and
//     in bounds.
//   * x is fp16 [M, Kp] with zeros in columns K..Kp-1, so padded codes multiply zero activations.
//   * group_size is a power of two and a multiple of the codes in one 16-byte load (32 for 4-bit, 16 for 8-bit),
//     or >= K (one group per row), so a 16-byte load never straddles two groups. Group indices past G-1 (padding)
//     are clamped.
//
// Value of a weight: W[n,k] = (c - z) * s. Codes become fp16 exactly through the 0x6400 exponent trick
// (half bits 0x6400|c == 1024 + c for c < 1024); subtracting the half 1024 + z is exact, so the one rounding is the
// multiply by the fp16 scale, which is the same rounding the float32 reference does when it casts to fp16.

#include "common/ptx_common.cuh"

__device__ __forceinline__ u16 f32_to_bf16(float f) {
    u16 h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Weights are read exactly once: keep them out of L1 so the activations stay resident there. Volatile so loads
// issued ahead of the arithmetic (the next spans / row group) stay where they are written.
__device__ __forceinline__ uint4 load_stream(const u32* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Activations of the tensor-core kernel, issued in program order (volatile) like its MMAs: left to the compiler's
// order, loads and MMAs measured no faster (kernels/grouped_int/NOTES.md).
__device__ __forceinline__ uint4 load_cached(const u16* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// An activation load of the tensor-core kernel. In a dependent launch (DEP) the activations were written by the
// kernel ahead, so the load is coherent (ld_dep_v4, common/ptx_common.cuh; also volatile).
template <bool DEP>
__device__ __forceinline__ uint4 load_x(const u16* p) {
    if (DEP) return ld_dep_v4(p);
    return load_cached(p);
}

__device__ __forceinline__ uint4 u4(u32 a, u32 b, u32 c, u32 d) {
    uint4 r;
    r.x = a;
    r.y = b;
    r.z = c;
    r.w = d;
    return r;
}

__device__ __forceinline__ u32 word_of(const uint4& v, int j) {
    return j == 0 ? v.x : (j == 1 ? v.y : (j == 2 ? v.z : v.w));
}

__device__ __forceinline__ void mma_16816(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One packed word -> the fp16 values (c - z) of its codes, two per register, in mma operand order.
// 4-bit: the mask-and-or trick turns nibbles 0 and 4 of a word into the halves 1024 + c in one instruction, and
// nibbles 1 and 5 (bits 4-7, 20-23) into 64 + c against the exponent of 64 (whose mantissa step is 1/16), so no
// shift is needed for them. Register order: (c0,c4), (c1,c5), (c2,c6), (c3,c7); the activations are permuted to
// match (any permutation of k inside an mma is allowed as long as A and B agree).
// 8-bit: a byte permute against 0x64 gives 1024 + c for (c0,c1) and (c2,c3).
// The subtraction of the half 1024 + z (or 64 + z) is exact; with SCALE the fp16 multiply by the scale is the
// only rounding, the same one the float32 reference makes when it casts the weight to fp16.
template <int BITS, bool SCALE>
__device__ __forceinline__ void dequant_word(u32 w, u32 z1024, u32 z64, u32 s, u32* p) {
    if (BITS == 4) {
        const u32 w8 = w >> 8;
        p[0] = f16x2_sub((w & 0x000F000Fu) | 0x64006400u, z1024);
        p[1] = f16x2_sub((w & 0x00F000F0u) | 0x54005400u, z64);
        p[2] = f16x2_sub((w8 & 0x000F000Fu) | 0x64006400u, z1024);
        p[3] = f16x2_sub((w8 & 0x00F000F0u) | 0x54005400u, z64);
        if (SCALE) {
#pragma unroll
            for (int i = 0; i < 4; ++i) p[i] = f16x2_mul(p[i], s);
        }
    } else {
        p[0] = f16x2_sub(__byte_perm(w, 0x64646464u, 0x4140), z1024);
        p[1] = f16x2_sub(__byte_perm(w, 0x64646464u, 0x4342), z1024);
        if (SCALE) {
            p[0] = f16x2_mul(p[0], s);
            p[1] = f16x2_mul(p[1], s);
        }
    }
}

// Two fp16 "1024 + code" pairs of one mma step, taken from a packed word.
// 4-bit: step h of a word holds the pairs (c[2h], c[2h+4]) and (c[2h+1], c[2h+5]): the mask-and-or trick yields
// codes four apart in one instruction; the activations are permuted to match (any permutation of k inside an
// mma is allowed as long as A and B agree).
// 8-bit: a word is one step, pairs (c0, c1) and (c2, c3) via byte permute.
template <int BITS>
__device__ __forceinline__ void code_pairs(u32 w, int h, u32& lo, u32& hi) {
    if (BITS == 4) {
        lo = ((w >> (8 * h)) & 0x000F000Fu) | 0x64006400u;
        hi = ((w >> (8 * h + 4)) & 0x000F000Fu) | 0x64006400u;
    } else {
        lo = __byte_perm(w, 0x64646464u, 0x4140);
        hi = __byte_perm(w, 0x64646464u, 0x4342);
    }
}

template <int BITS, int NT, bool DEP>
__device__ __forceinline__ void gemv_span(float (&acc)[NT][4], int span, const uint4& wa, const uint4& wb,
                                          const u16* __restrict__ scales, const u8* __restrict__ zeros,
                                          const u16* __restrict__ x, int M, int Kp, int G, int gs, int sym_zero,
                                          int ra, int rb, int g, int q) {
    constexpr int CPL = 128 / BITS;
    constexpr int SPAN = 4 * CPL;
    const int k0 = span * SPAN + q * CPL;
    const int grp = min(k0 / gs, G - 1);
    const u32 sa = scales[(long long)ra * G + grp], sb = scales[(long long)rb * G + grp];
    const u32 za = zeros ? (u32)zeros[(long long)ra * G + grp] : (u32)sym_zero;
    const u32 zb = zeros ? (u32)zeros[(long long)rb * G + grp] : (u32)sym_zero;
    const u32 Sa = sa | (sa << 16), Sb = sb | (sb << 16);
    const u32 Za = (0x6400u + za) * 0x10001u, Zb = (0x6400u + zb) * 0x10001u;
#pragma unroll
    for (int jj = 0; jj < CPL / 8; ++jj) {  // 8 codes (one 16-byte activation load) per iteration
        uint4 X[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const int tok = t * 8 + g;
            if (tok < M) {
                X[t] = load_x<DEP>(x + (long long)tok * Kp + k0 + 8 * jj);
            } else {
                X[t] = u4(0u, 0u, 0u, 0u);
            }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) {  // two mma k-steps per 8 codes
            u32 wa_w, wb_w;
            int hh;
            if (BITS == 4) {
                wa_w = word_of(wa, jj);
                wb_w = word_of(wb, jj);
                hh = h;
            } else {
                wa_w = word_of(wa, 2 * jj + h);
                wb_w = word_of(wb, 2 * jj + h);
                hh = 0;
            }
            u32 alo, ahi, blo, bhi;
            code_pairs<BITS>(wa_w, hh, alo, ahi);
            code_pairs<BITS>(wb_w, hh, blo, bhi);
            const u32 a0 = f16x2_mul(f16x2_sub(alo, Za), Sa);
            const u32 a2 = f16x2_mul(f16x2_sub(ahi, Za), Sa);
            const u32 a1 = f16x2_mul(f16x2_sub(blo, Zb), Sb);
            const u32 a3 = f16x2_mul(f16x2_sub(bhi, Zb), Sb);
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                u32 b0, b1;
                if (BITS == 4) {
                    // codes (2h, 2h+4) and (2h+1, 2h+5) of the 8 -> activations in the same order
                    const u32 xl = h ? X[t].y : X[t].x, xh = h ? X[t].w : X[t].z;
                    b0 = __byte_perm(xl, xh, 0x5410);
                    b1 = __byte_perm(xl, xh, 0x7632);
                } else {
                    b0 = h ? X[t].z : X[t].x;
                    b1 = h ? X[t].w : X[t].y;
                }
                mma_16816(acc[t], a0, a1, a2, a3, b0, b1);
            }
        }
    }
}

// Skinny GEMM y[M,N] = x[M,K] . W[N,K]^T for M <= 8*NT, on tensor cores with the weight as the 16-row A operand
// and the tokens as the 8-column B operand (so M = 1 wastes MMA lanes, not memory bandwidth).
// One block owns 16 output rows; its warps split K (span s goes to warp s % warps) and reduce through shared
// memory at the end. A quad of lanes reads 64 contiguous bytes of a row per span with one 16-byte load each.
// DEP (a programmatic dependent launch): each warp's first two spans of weights are loaded before the wait for the
// kernel ahead, whose outputs (the activations) are read after it through coherent loads.
template <int BITS, int NT, bool DEP>
__device__ __forceinline__ void gemv_body(const u32* __restrict__ qw, const u16* __restrict__ scales,
                                          const u8* __restrict__ zeros, const u16* __restrict__ x,
                                          const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int Kp,
                                          int G, int gs, int sym_zero) {
    constexpr int CPL = 128 / BITS;  // codes per 16-byte lane load
    constexpr int SPAN = 4 * CPL;    // codes of one row covered by a quad per span
    extern __shared__ float red[];

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const int g = lane >> 2, q = lane & 3;
    const int row0 = blockIdx.x * 16;
    // Rows past N re-read row N-1 (valid memory); their results are never stored.
    const int ra = min(row0 + g, N - 1), rb = min(row0 + g + 8, N - 1);
    const long long wpr = (long long)Kp * BITS / 32;
    const u32* qa = qw + ra * wpr + q * 4;
    const u32* qb = qw + rb * wpr + q * 4;
    const int nspans = Kp / SPAN;

    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[t][c] = 0.f;

    // Two spans in flight per warp before any arithmetic: the loads, not the math, set the pace.
    uint4 wa0, wb0, wa1, wb1;
    auto load = [&](int s0) {
        const int s1 = s0 + nwarps;
        wa0 = load_stream(qa + (long long)s0 * 16);
        wb0 = load_stream(qb + (long long)s0 * 16);
        wa1 = u4(0u, 0u, 0u, 0u), wb1 = wa1;
        if (s1 < nspans) {
            wa1 = load_stream(qa + (long long)s1 * 16);
            wb1 = load_stream(qb + (long long)s1 * 16);
        }
    };
    if (DEP) {
        launch_dependents();
        if (warp < nspans) load(warp);
        grid_dependency_wait();
    }
    for (int s0 = warp; s0 < nspans; s0 += 2 * nwarps) {
        const int s1 = s0 + nwarps;
        if (!DEP || s0 != warp) load(s0);
        gemv_span<BITS, NT, DEP>(acc, s0, wa0, wb0, scales, zeros, x, M, Kp, G, gs, sym_zero, ra, rb, g, q);
        if (s1 < nspans)
            gemv_span<BITS, NT, DEP>(acc, s1, wa1, wb1, scales, zeros, x, M, Kp, G, gs, sym_zero, ra, rb, g, q);
    }

    // Accumulator fragment: c0,c1 -> row g, tokens 2q, 2q+1; c2,c3 -> row g+8.
#pragma unroll
    for (int t = 0; t < NT; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) red[(warp * NT * 4 + t * 4 + c) * 32 + lane] = acc[t][c];
    __syncthreads();
    for (int i = threadIdx.x; i < NT * 4 * 32; i += blockDim.x) {
        float s = 0.f;
        for (int w = 0; w < nwarps; ++w) s += red[w * NT * 4 * 32 + i];
        const int l = i & 31, reg = i >> 5;
        const int t = reg >> 2, c = reg & 3;
        const int row = row0 + (l >> 2) + ((c & 2) ? 8 : 0);
        const int tok = t * 8 + (l & 3) * 2 + (c & 1);
        if (row < N && tok < M) {
            if (bias) s += h2f(bias[row]);
            y[(long long)tok * N + row] = f2h(s);
        }
    }
}

// Entry points: grouped_int_gemv_b{bits}_nt{token tiles}_v1 (v1: activation loads and MMAs in program order), and
// _dep: the same as a dependent launch, held to 64 registers so that two blocks of 512 threads fit an SM (the
// dispatch takes it where the grid is one such wave).
#define GEMV_ENTRY(BITS, NT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(512) grouped_int_gemv_b##BITS##_nt##NT##_v1(                    \
        const u32* __restrict__ qw, const u16* __restrict__ scales, const u8* __restrict__ zeros,                \
        const u16* __restrict__ x, const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int Kp,      \
        int G, int gs, int sym_zero) {                                                                           \
        gemv_body<BITS, NT, false>(qw, scales, zeros, x, bias, y, M, N, Kp, G, gs, sym_zero);                    \
    }
#define GEMV_DEP_ENTRY(BITS, NT)                                                                                 \
    extern "C" __global__ void __launch_bounds__(512, 2) grouped_int_gemv_b##BITS##_nt##NT##_dep(                \
        const u32* __restrict__ qw, const u16* __restrict__ scales, const u8* __restrict__ zeros,                \
        const u16* __restrict__ x, const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int Kp,      \
        int G, int gs, int sym_zero) {                                                                           \
        gemv_body<BITS, NT, true>(qw, scales, zeros, x, bias, y, M, N, Kp, G, gs, sym_zero);                     \
    }

#define GEMV_ENTRIES(BITS) \
    GEMV_ENTRY(BITS, 1)    \
    GEMV_ENTRY(BITS, 2)    \
    GEMV_ENTRY(BITS, 4)    \
    GEMV_ENTRY(BITS, 8)
// Up to 16 tokens: at 32 and 64 the 64-register cap spills (176-1856 bytes).
#define GEMV_DEP_ENTRIES(BITS) \
    GEMV_DEP_ENTRY(BITS, 1)    \
    GEMV_DEP_ENTRY(BITS, 2)

GEMV_ENTRIES(4)
GEMV_ENTRIES(8)
GEMV_DEP_ENTRIES(4)
GEMV_DEP_ENTRIES(8)

__device__ __forceinline__ u32 f16x2_fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ float f16x2_sum_f32(u32 h) {
    return h2f((u16)(h & 0xFFFFu)) + h2f((u16)(h >> 16));
}

// Few-token GEMV without tensor cores, for M <= 2: a warp reads 512 contiguous bytes of one row per instruction
// (the DRAM-friendliest pattern), every lane one 16-byte piece of FMA_ROWS rows, and the block's threads split K.
// Weights enter the fp16 products as the exact (c - z) / 64 (/ 256 at 8 bits) with the scale applied in fp32 after
// the chain (see fma_piece); each fp16 product chain covers two words (8 products per half at 4 bits, 4 at 8 bits)
// before it is widened to fp32.
// PIPE: the grid is persistent, a block walks row groups rg, rg + gridDim.x, ... and, when each thread owns at
// most one piece of K, keeps the next row group's weights in flight while it computes the current one and loads
// its activations only once. Without PIPE one block takes one row group (more blocks resident, fewer registers).
constexpr int FMA_ROWS = 4;
constexpr int FMA_MAX_WARPS = 16;

template <int BITS, int MT>
__device__ __forceinline__ void fma_load(const u32* __restrict__ qw, const u32* __restrict__ meta, long long wpr,
                                         int G, int N, int rg, int p, int grp, uint4 (&w)[FMA_ROWS],
                                         u32 (&m)[FMA_ROWS]) {
#pragma unroll
    for (int r = 0; r < FMA_ROWS; ++r) {
        const int row = min(rg * FMA_ROWS + r, N - 1);  // rows past N re-read row N-1 and are never stored
        w[r] = load_stream(qw + row * wpr + p * 4);
        m[r] = meta[(long long)row * G + grp];
    }
}

// Unscaled variant of dequant_word for the CUDA-core kernel, which scales after the chain: the exact value
// (c - z) / 64 (4-bit) or (c - z) / 256 (8-bit) in fp16, with no multiply. The codes are or-ed into the mantissa of
// a power of two whose mantissa step is 1/64 at the code's bit position (16 = 0x4C00 for bits 0-3, 1 = 0x3C00 for
// bits 4-7; 4 = 0x4400 for a whole byte at 8 bits), and the half 16 + z/64 (1 + z/64, 4 + z/256) is subtracted:
// both exact. The 1/64 (1/256) keeps every product |c - z| * x / 64 at most |x| / 4 (|x|), as far from fp16
// overflow as x itself.
template <int BITS>
__device__ __forceinline__ void dequant_word_unscaled(u32 w, u32 zlo, u32 zhi, u32* p) {
    if (BITS == 4) {
        const u32 w8 = w >> 8;
        p[0] = f16x2_sub((w & 0x000F000Fu) | 0x4C004C00u, zlo);
        p[1] = f16x2_sub((w & 0x00F000F0u) | 0x3C003C00u, zhi);
        p[2] = f16x2_sub((w8 & 0x000F000Fu) | 0x4C004C00u, zlo);
        p[3] = f16x2_sub((w8 & 0x00F000F0u) | 0x3C003C00u, zhi);
    } else {
        p[0] = f16x2_sub(__byte_perm(w, 0x44444444u, 0x4140), zlo);
        p[1] = f16x2_sub(__byte_perm(w, 0x44444444u, 0x4342), zlo);
    }
}

// Scale after: the chains multiply the exact (c - z) / 64 (or / 256) by the activations and the fp16 scale (times
// 64 or 256, exact in fp32) is applied once per chain when it is widened to fp32. A 16-byte piece lies inside one
// group (group sizes are multiples of its codes), so one scale covers every chain of a piece. Against weights
// formed as the reference rounds them ((c - z) * s in fp16, then the products) it saves the 4 (4-bit) or 2 (8-bit)
// f16x2 multiplies per word (17 -> 13 instructions per 8 codes at 4 bits), and the weight is not rounded to fp16
// before the product, so the result is at least as close to the exact one.
template <int BITS, int MT>
__device__ __forceinline__ void fma_piece(const uint4 (&w)[FMA_ROWS], const u32 (&m)[FMA_ROWS],
                                          const uint4 (&X)[MT][16 / BITS], float (&acc)[FMA_ROWS][MT]) {
#pragma unroll
    for (int r = 0; r < FMA_ROWS; ++r) {
        const u32 z = m[r] >> 16;
        const u32 zlo = (BITS == 4 ? 0x4C00u + z : 0x4400u + z) * 0x10001u;
        const u32 zhi = (0x3C00u + 16u * z) * 0x10001u;
        const float sf = h2f((u16)(m[r] & 0xFFFFu)) * (BITS == 4 ? 64.f : 256.f);
#pragma unroll
        for (int wp = 0; wp < 4; wp += 2) {  // two words per fp16 chain, then widen to fp32
            u32 h[MT];
#pragma unroll
            for (int wi = wp; wi < wp + 2; ++wi) {
                u32 v[4];
                dequant_word_unscaled<BITS>(word_of(w[r], wi), zlo, zhi, v);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    u32 a = wi == wp ? 0u : h[t];
                    if (BITS == 4) {
                        // v = (c0,c4), (c1,c5), (c2,c6), (c3,c7) of the word's 8 codes
                        const uint4 xv = X[t][wi];
                        a = f16x2_fma(v[0], __byte_perm(xv.x, xv.z, 0x5410), a);
                        a = f16x2_fma(v[1], __byte_perm(xv.x, xv.z, 0x7632), a);
                        a = f16x2_fma(v[2], __byte_perm(xv.y, xv.w, 0x5410), a);
                        a = f16x2_fma(v[3], __byte_perm(xv.y, xv.w, 0x7632), a);
                    } else {
                        // v = (c0,c1), (c2,c3) of the word's 4 codes, natural order
                        const uint4 xv = X[t][wi >> 1];
                        a = f16x2_fma(v[0], (wi & 1) ? xv.z : xv.x, a);
                        a = f16x2_fma(v[1], (wi & 1) ? xv.w : xv.y, a);
                    }
                    h[t] = a;
                }
            }
#pragma unroll
            for (int t = 0; t < MT; ++t) acc[r][t] += f16x2_sum_f32(h[t]) * sf;  // contracted to one fp32 fma
        }
    }
}

template <int MT>
__device__ __forceinline__ void fma_reduce_store(float (&acc)[FMA_ROWS][MT], float (*red)[FMA_ROWS * MT], int rg,
                                                 const u16* __restrict__ bias, u16* __restrict__ y, int M, int N) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < FMA_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            float v = acc[r][t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) red[warp][r * MT + t] = v;
            acc[r][t] = 0.f;
        }
    __syncthreads();
    if (threadIdx.x < FMA_ROWS * MT) {
        const int r = threadIdx.x / MT, t = threadIdx.x % MT;
        float sum = 0.f;
        for (int wi = 0; wi < nwarps; ++wi) sum += red[wi][threadIdx.x];
        const int row = rg * FMA_ROWS + r;
        if (row < N && t < M) {
            if (bias) sum += h2f(bias[row]);
            y[(long long)t * N + row] = f2h(sum);
        }
    }
}

template <int BITS, int MT, bool PIPE>
__device__ __forceinline__ void gemv_fma_body(const u32* __restrict__ qw, const u32* __restrict__ meta,
                                              const u16* __restrict__ x, const u16* __restrict__ bias,
                                              u16* __restrict__ y, int M, int N, int Kp, int G, int gs_shift) {
    constexpr int CPL = 128 / BITS;  // codes per 16-byte piece
    constexpr int XV = CPL / 8;      // 16-byte activation loads per piece and token
    // Two reduction buffers, alternated per row group, so one barrier per row group suffices.
    __shared__ float red[2][FMA_MAX_WARPS][FMA_ROWS * MT];
    const long long wpr = (long long)Kp * BITS / 32;
    const int pieces = Kp / CPL;
    const int ngroups = (N + FMA_ROWS - 1) / FMA_ROWS;
    float acc[FMA_ROWS][MT];
#pragma unroll
    for (int r = 0; r < FMA_ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t) acc[r][t] = 0.f;

    // Dependent launch: x comes from the kernel ahead and y may still be read by it, so both wait for it; the
    // weights do not. Without PIPE (one row group per block, all blocks resident at once) each thread's first piece
    // is loaded before the wait, so this kernel streams its weights during the tail of the kernel ahead. The
    // persistent grid waits first: there, loading early measured slower (kernels/NOTES.md).
    launch_dependents();
    bool waited = PIPE;
    if (PIPE) grid_dependency_wait();

    if (PIPE && pieces <= (int)blockDim.x) {
        const int p = threadIdx.x;
        const bool has = p < pieces;
        const int pc = has ? p : 0;  // idle threads compute on piece 0 and contribute nothing
        const int grp = min((pc * CPL) >> gs_shift, G - 1);
        uint4 X[MT][XV];
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
            for (int j = 0; j < XV; ++j) X[t][j] = ld_dep_v4(x + (long long)min(t, M - 1) * Kp + pc * CPL + 8 * j);
        uint4 w[FMA_ROWS];
        u32 m[FMA_ROWS];
        int rg = blockIdx.x;
        if (has && rg < ngroups) fma_load<BITS, MT>(qw, meta, wpr, G, N, rg, pc, grp, w, m);
        for (int it = 0; rg < ngroups; rg += gridDim.x, ++it) {
            uint4 wn[FMA_ROWS];
            u32 mn[FMA_ROWS];
            const int rn = rg + gridDim.x;
            if (has && rn < ngroups) fma_load<BITS, MT>(qw, meta, wpr, G, N, rn, pc, grp, wn, mn);
            if (has) fma_piece<BITS, MT>(w, m, X, acc);
            fma_reduce_store<MT>(acc, red[it & 1], rg, bias, y, M, N);
#pragma unroll
            for (int r = 0; r < FMA_ROWS; ++r) {
                w[r] = wn[r];
                m[r] = mn[r];
            }
        }
    } else {
        for (int rg = blockIdx.x, it = 0; rg < ngroups; rg += gridDim.x, ++it) {
            for (int p = threadIdx.x; p < pieces; p += blockDim.x) {
                const int grp = min((p * CPL) >> gs_shift, G - 1);
                uint4 w[FMA_ROWS];
                u32 m[FMA_ROWS];
                fma_load<BITS, MT>(qw, meta, wpr, G, N, rg, p, grp, w, m);
                if (!waited) {
                    grid_dependency_wait();
                    waited = true;
                }
                uint4 X[MT][XV];
#pragma unroll
                for (int t = 0; t < MT; ++t)
#pragma unroll
                    for (int j = 0; j < XV; ++j)
                        X[t][j] = ld_dep_v4(x + (long long)min(t, M - 1) * Kp + p * CPL + 8 * j);
                fma_piece<BITS, MT>(w, m, X, acc);
            }
            if (!waited) {  // a thread without a piece still writes outputs
                grid_dependency_wait();
                waited = true;
            }
            fma_reduce_store<MT>(acc, red[it & 1], rg, bias, y, M, N);
        }
    }
}

// Entry points: grouped_int_gemv_fma_b{bits}_m{token slots}_p{persistent, prefetching grid}_s1 (s1: scale after).
#define GEMV_FMA_ENTRY(BITS, MT, PIPE)                                                                           \
    extern "C" __global__ void __launch_bounds__(512) grouped_int_gemv_fma_b##BITS##_m##MT##_p##PIPE##_s1(       \
        const u32* __restrict__ qw, const u32* __restrict__ meta, const u16* __restrict__ x,                     \
        const u16* __restrict__ bias, u16* __restrict__ y, int M, int N, int Kp, int G, int gs_shift) {          \
        gemv_fma_body<BITS, MT, (PIPE != 0)>(qw, meta, x, bias, y, M, N, Kp, G, gs_shift);                       \
    }

// One token: 4-bit rows on the one-row-group grid, 8-bit rows on the persistent one (the other grid lost at every
// measured shape). Two tokens: both grids (not measured).
GEMV_FMA_ENTRY(4, 1, 0)
GEMV_FMA_ENTRY(4, 2, 0)
GEMV_FMA_ENTRY(4, 2, 1)
GEMV_FMA_ENTRY(8, 1, 1)
GEMV_FMA_ENTRY(8, 2, 0)
GEMV_FMA_ENTRY(8, 2, 1)

// Dequantize to a dense [N, Kp] fp16/bf16 matrix for the prefill path (dequantize, then cuBLAS).
// One thread per 8 codes, so each thread stores 16 contiguous bytes and a warp's store covers 512 contiguous
// bytes. fp16: the exact integer (c - z) times the fp16 scale, rounded once (the same rounding as the float32
// reference's cast), two at a time in f16x2. bf16: formed in float32 (exact: an integer below 2^9 times an fp16
// scale) and rounded once to bf16.
template <int BITS, bool BF16>
__device__ __forceinline__ void dequant_body(const u32* __restrict__ qw, const u16* __restrict__ scales,
                                             const u8* __restrict__ zeros, u16* __restrict__ out, int N, int Kp,
                                             int G, int gs, int sym_zero) {
    const long long octs_per_row = (long long)Kp / 8;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= octs_per_row * N) return;
    const int row = (int)(idx / octs_per_row);
    const int k0 = (int)(idx % octs_per_row) * 8;
    const int grp = min(k0 / gs, G - 1);
    const u32 sbits = scales[(long long)row * G + grp];
    const u32 zi = zeros ? (u32)zeros[(long long)row * G + grp] : (u32)sym_zero;
    // 8 codes are one word at 4 bits, two words at 8 bits; rows hold Kp*BITS/32 words, so word index = idx*BITS/4.
    u32 wd[BITS / 4];
    if (BITS == 4) {
        wd[0] = qw[idx];
    } else {
        const uint2 v = *reinterpret_cast<const uint2*>(qw + idx * 2);
        wd[0] = v.x;
        wd[BITS / 4 - 1] = v.y;
    }
    u32 packed[4];
    if (!BF16) {
        const u32 s2 = sbits * 0x10001u, z1024 = (0x6400u + zi) * 0x10001u, z64 = (0x5400u + 16u * zi) * 0x10001u;
        if (BITS == 4) {  // (c0,c4), (c1,c5), (c2,c6), (c3,c7) -> natural order
            u32 v[4];
            dequant_word<4, true>(wd[0], z1024, z64, s2, v);
            packed[0] = __byte_perm(v[0], v[1], 0x5410);
            packed[1] = __byte_perm(v[2], v[3], 0x5410);
            packed[2] = __byte_perm(v[0], v[1], 0x7632);
            packed[3] = __byte_perm(v[2], v[3], 0x7632);
        } else {
            dequant_word<8, true>(wd[0], z1024, z64, s2, packed);
            dequant_word<8, true>(wd[BITS / 4 - 1], z1024, z64, s2, packed + 2);
        }
    } else {
        const float s = h2f((u16)sbits);
        const float z = (float)zi;
#pragma unroll
        for (int i = 0; i < 8; i += 2) {
            constexpr int PER_WORD = 32 / BITS;
            constexpr u32 MASK = (1u << BITS) - 1u;
            const u32 w0 = wd[i / PER_WORD], w1 = wd[(i + 1) / PER_WORD];
            const float c0 = (float)((w0 >> (BITS * (i % PER_WORD))) & MASK);
            const float c1 = (float)((w1 >> (BITS * ((i + 1) % PER_WORD))) & MASK);
            packed[i / 2] = (u32)f32_to_bf16((c0 - z) * s) | ((u32)f32_to_bf16((c1 - z) * s) << 16);
        }
    }
    *reinterpret_cast<uint4*>(out + (long long)row * Kp + k0) = u4(packed[0], packed[1], packed[2], packed[3]);
}

#define DEQUANT_ENTRY(BITS, BF16, NAME)                                                                          \
    extern "C" __global__ void __launch_bounds__(256) grouped_int_dequant_b##BITS##_##NAME(                      \
        const u32* __restrict__ qw, const u16* __restrict__ scales, const u8* __restrict__ zeros,                \
        u16* __restrict__ out, int N, int Kp, int G, int gs, int sym_zero) {                                     \
        dequant_body<BITS, BF16>(qw, scales, zeros, out, N, Kp, G, gs, sym_zero);                                \
    }

DEQUANT_ENTRY(4, false, f16)
DEQUANT_ENTRY(4, true, bf16)
DEQUANT_ENTRY(8, false, f16)
DEQUANT_ENTRY(8, true, bf16)
