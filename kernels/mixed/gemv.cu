// Kernels for the `mixed-2-4-16` weight layout (formats/mixed-2-4-16.md) with group_size 16: 2-bit and 4-bit
// stripes of 16 input channels in one matrix, second-order 4-bit scales for the 2-bit groups, sparse fp16 outliers.
//
// Compiled at run time by NVRTC (qtool/cuda/compile.py), no CUDA headers (see grouped_int/gemv.cu).
//
// Runtime contract (qtool/cuda/mixed.py checks it before launching):
//   * K is a multiple of 64, so each 64-channel block of a row of qweight_a is one aligned 16-byte load;
//   * binfo[b] describes block b for every row: bits 0-15 the 4-bit rank of its first 4-bit stripe (r4), bits 16-18
//     its number of 4-bit stripes (n4), bits 24-31 the positions (0..3) of its stripes, 2 bits each, the 2-bit
//     stripes first (increasing), then the 4-bit ones; its 2-bit stripes have the 2-bit ranks 4b - r4, ...;
//   * s2f[g, r] = (64·s2, 64·u·s2) in fp32 for second-order group g of 2-bit rank r (one 8-byte load), so the
//     first-order scale times 64 is one exact fma: c·(64·s2) + 64·u·s2 = 64·(c + u)·s2;
//   * x is fp16 [M, K] with 16-byte aligned rows; y is fp16 [M, N].
//
// Value of a weight: 2-bit group (n, r): (q - z) * (c + u) * s2; 4-bit group: (q - z) * s4. Codes become the exact
// fp16 (q - z) / 64 by or-ing them into the mantissa of 16.0 (a code at bits 0-3 of a half: 16 + q/64) or of 1.0
// (at bits 4-7: 1 + q/64) and subtracting the half 16 + z/64 or 1 + z/64: no shift per code, both exact. The fp16
// products with the activations run in chains of 8 per half, and the group scale (times 64, exact in fp32) is
// applied once per group when a chain is widened to fp32. The /64 keeps every product at most |x| / 4.

#include "common/ptx_common.cuh"

__device__ __forceinline__ u32 ld_meta(const u32* p) {
    u32 r;
    asm("ld.global.nc.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ float2 ld_meta64(const float2* p) {
    float2 r;
    asm("ld.global.nc.v2.f32 {%0, %1}, [%2];" : "=f"(r.x), "=f"(r.y) : "l"(p));
    return r;
}

__device__ __forceinline__ u16 ld_meta16(const u16* p) {
    u16 r;
    asm("ld.global.nc.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

// (hi:lo) >> s for 0 <= s < 32: codes that straddle two words of a packed stream.
__device__ __forceinline__ u32 shr64(u32 lo, u32 hi, u32 s) {
    u32 r;
    asm("shf.r.wrap.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(lo), "r"(hi), "r"(s));
    return r;
}

__device__ __forceinline__ u32 pick(const uint4& v, int p) {
    return p == 0 ? v.x : (p == 1 ? v.y : (p == 2 ? v.z : v.w));
}

constexpr u32 MAG0 = 0x4C004C00u;  // 16.0 twice: a code at bits 0-3 of a half reads 16 + c/64
constexpr u32 MAG4 = 0x3C003C00u;  // 1.0 twice: a code at bits 4-7 of a half reads 1 + c/64

// (a & MASK) | mag in one instruction: written as two C operations, the compiler emits two LOP3s when both
// constants are immediates (LOP3 takes one immediate operand); here mag stays in a register.
template <u32 MASK>
__device__ __forceinline__ u32 andor(u32 a, u32 mag) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(MASK), "r"(mag));
    return r;
}

// The halves 16 + z/64 and 1 + z/64, twice (z < 16, so adding is or-ing: one integer multiply-add each).
__device__ __forceinline__ u32 zero0(u32 z) { return z * 0x10001u + MAG0; }
__device__ __forceinline__ u32 zero4(u32 z) { return z * 0x100010u + MAG4; }

// A 2-bit stripe (one word, code i at bits 2i) -> v[j] = ((c_j - z)/64, (c_{j+8} - z)/64), j = 0..7, exact.
// Only bits 0-1 and 4-5 of each half are taken, so three shifts serve all 16 codes.
__device__ __forceinline__ void unpack2(u32 w, u32 k0, u32 k4, u32 (&v)[8]) {
    const u32 sb = w >> 2, sc = w >> 8, sd = w >> 10;
    v[0] = f16x2_sub(andor<0x00030003u>(w, MAG0), k0);
    v[1] = f16x2_sub(andor<0x00030003u>(sb, MAG0), k0);
    v[2] = f16x2_sub(andor<0x00300030u>(w, MAG4), k4);
    v[3] = f16x2_sub(andor<0x00300030u>(sb, MAG4), k4);
    v[4] = f16x2_sub(andor<0x00030003u>(sc, MAG0), k0);
    v[5] = f16x2_sub(andor<0x00030003u>(sd, MAG0), k0);
    v[6] = f16x2_sub(andor<0x00300030u>(sc, MAG4), k4);
    v[7] = f16x2_sub(andor<0x00300030u>(sd, MAG4), k4);
}

// A 4-bit stripe (codes 0-7 in its qweight_a word a, 8-15 in its qweight_b word b, code i at bits 4(i mod 8)) ->
// the same pairs as unpack2: byte permutes put codes 0-3 beside 8-11 and 4-7 beside 12-15.
__device__ __forceinline__ void unpack4(u32 a, u32 b, u32 k0, u32 k4, u32 (&v)[8]) {
    const u32 t0 = __byte_perm(a, b, 0x5410), t1 = __byte_perm(a, b, 0x7632);
    const u32 u0 = t0 >> 8, u1 = t1 >> 8;
    v[0] = f16x2_sub(andor<0x000F000Fu>(t0, MAG0), k0);
    v[1] = f16x2_sub(andor<0x00F000F0u>(t0, MAG4), k4);
    v[2] = f16x2_sub(andor<0x000F000Fu>(u0, MAG0), k0);
    v[3] = f16x2_sub(andor<0x00F000F0u>(u0, MAG4), k4);
    v[4] = f16x2_sub(andor<0x000F000Fu>(t1, MAG0), k0);
    v[5] = f16x2_sub(andor<0x00F000F0u>(t1, MAG4), k4);
    v[6] = f16x2_sub(andor<0x000F000Fu>(u1, MAG0), k0);
    v[7] = f16x2_sub(andor<0x00F000F0u>(u1, MAG4), k4);
}

// 16 activations (lo = x0..x7, hi = x8..x15) -> p[j] = (x_j, x_{j+8}), the order of the weight pairs.
__device__ __forceinline__ void xpairs(const uint4& lo, const uint4& hi, u32 (&p)[8]) {
    p[0] = __byte_perm(lo.x, hi.x, 0x5410);
    p[1] = __byte_perm(lo.x, hi.x, 0x7632);
    p[2] = __byte_perm(lo.y, hi.y, 0x5410);
    p[3] = __byte_perm(lo.y, hi.y, 0x7632);
    p[4] = __byte_perm(lo.z, hi.z, 0x5410);
    p[5] = __byte_perm(lo.z, hi.z, 0x7632);
    p[6] = __byte_perm(lo.w, hi.w, 0x5410);
    p[7] = __byte_perm(lo.w, hi.w, 0x7632);
}

struct Layer {
    const u32* qa;     // [N, K/16]
    const u32* qb;     // [N, S4]
    const u32* sc;     // [N, wsc]: 4-bit scale codes by 2-bit rank
    const u32* z2;     // [N, wz2]: 2-bit zeros by 2-bit rank
    const float2* s2f; // [N/g2, S2]
    const u16* s4;     // [N, S4]
    const u32* z4;     // [N, wz4]: 4-bit zeros by 4-bit rank
    const u32* binfo;  // [K/64]
    int N, K, S2, S4, wsc, wz2, wz4, g2;
};

// Everything one row needs for one 64-channel block. With B4 (one 4-bit stripe per block, the paper's packing) all
// of it is loaded before any arithmetic: the second-order dequantization of the scales (c + u) * s2 only needs the
// small metadata, which comes back from L1/L2 while the streamed weight words are still in flight (the paper's
// asynchronous dequantization, Algorithm 1, as instruction-level overlap).
template <bool B4>
struct RowBlock {
    uint4 a;
    u32 sc, z2;
    float2 s2[3];
    u32 b, z4;
    u16 s4;
};

template <bool B4>
__device__ __forceinline__ void load_row(const Layer& L, int row, int b, int r2, int r4, int n2, RowBlock<B4>& rb) {
    rb.a = ld_stream(L.qa + (long long)row * (L.K >> 4) + 4 * b);
    if (B4 || n2 > 0) {
        const int sw = r2 >> 3, zw = r2 >> 4;
        const u32* ps = L.sc + (long long)row * L.wsc;
        const u32* pz = L.z2 + (long long)row * L.wz2;
        rb.sc = shr64(ld_meta(ps + sw), ld_meta(ps + min(sw + 1, L.wsc - 1)), 4 * (r2 & 7));
        rb.z2 = shr64(ld_meta(pz + zw), ld_meta(pz + min(zw + 1, L.wz2 - 1)), 2 * (r2 & 15));
    }
    if (B4) {
        const float2* pu = L.s2f + (long long)(row / L.g2) * L.S2 + r2;
#pragma unroll
        for (int i = 0; i < 3; ++i) rb.s2[i] = ld_meta64(pu + i);
        const long long base = (long long)row * L.S4 + r4;
        rb.b = ld_meta(L.qb + base);
        rb.s4 = ld_meta16(L.s4 + base);
        rb.z4 = ld_meta(L.z4 + (long long)row * L.wz4 + (r4 >> 3));
    }
}

// Stripe i (in binfo order) of one row: its 8 weight pairs and its scale times 64.
template <bool B4>
__device__ __forceinline__ void decode_stripe(const Layer& L, const RowBlock<B4>& rb, int row, int i, int p, int n2,
                                              int r2, int r4, u32 (&v)[8], float& f) {
    if (i < n2) {
        const float2 s2 = B4 ? rb.s2[i < 3 ? i : 0] : ld_meta64(L.s2f + (long long)(row / L.g2) * L.S2 + r2 + i);
        const u32 c = (rb.sc >> (4 * i)) & 15u, z = (rb.z2 >> (2 * i)) & 3u;
        f = fmaf((float)c, s2.x, s2.y);  // exact: 64·(c + u)·s2 with c + u <= 30 and s2 an fp16
        unpack2(pick(rb.a, p), zero0(z), zero4(z), v);
    } else {
        const int q = r4 + (i - n2);
        u32 bw, zw;
        u16 s;
        if (B4) {
            bw = rb.b, zw = rb.z4, s = rb.s4;
        } else {
            const long long base = (long long)row * L.S4 + q;
            bw = ld_meta(L.qb + base);
            s = ld_meta16(L.s4 + base);
            zw = ld_meta(L.z4 + (long long)row * L.wz4 + (q >> 3));
        }
        const u32 z = (zw >> (4 * (q & 7))) & 15u;
        f = h2f(s) * 64.f;
        unpack4(pick(rb.a, p), bw, zero0(z), zero4(z), v);
    }
}

constexpr int MAX_WARPS = 8;

template <int ROWS, bool B4>
__device__ __forceinline__ void load_block(const Layer& L, const int (&rows)[ROWS], int b, u32 info,
                                           RowBlock<B4> (&rb)[ROWS]) {
    const int r4 = (int)(info & 0xFFFFu);
    const int n2 = B4 ? 3 : 4 - (int)((info >> 16) & 7u);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) load_row<B4>(L, rows[r], b, 4 * b - r4, r4, n2, rb[r]);
}

// One 64-channel block of ROWS rows: each stripe decoded for every row, then multiplied by each token's 16
// activations (permuted once into the weights' pair order).
template <int ROWS, int MT, bool B4>
__device__ __forceinline__ void compute_block(const Layer& L, const int (&rows)[ROWS], int b, u32 info,
                                              const RowBlock<B4> (&rb)[ROWS], const u16* __restrict__ x, int M,
                                              float (&acc)[ROWS][MT]) {
    const int r4 = (int)(info & 0xFFFFu);
    const int n2 = B4 ? 3 : 4 - (int)((info >> 16) & 7u);
    const int r2 = 4 * b - r4;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int p = (int)((info >> (24 + 2 * i)) & 3u);
        if constexpr (MT <= 2) {
            // few tokens: the activations first, then one row at a time (8 weight registers live, not 8 per row)
            u32 X[MT][8];
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                const u16* xp = x + (long long)min(t, M - 1) * L.K + 64 * b + 16 * p;
                xpairs(ld_dep_v4(xp), ld_dep_v4(xp + 8), X[t]);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                u32 v[8];
                float f;
                decode_stripe<B4>(L, rb[r], rows[r], i, p, n2, r2, r4, v, f);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    u32 h = f16x2_mul(v[0], X[t][0]);
#pragma unroll
                    for (int j = 1; j < 8; ++j) h = h2fma(v[j], X[t][j], h);
                    acc[r][t] += h2sum(h) * f;
                }
            }
            continue;
        }
        u32 v[ROWS][8];
        float f[ROWS];
#pragma unroll
        for (int r = 0; r < ROWS; ++r) decode_stripe<B4>(L, rb[r], rows[r], i, p, n2, r2, r4, v[r], f[r]);
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            const u16* xp = x + (long long)min(t, M - 1) * L.K + 64 * b + 16 * p;
            u32 X[8];
            xpairs(ld_dep_v4(xp), ld_dep_v4(xp + 8), X);
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                u32 h = f16x2_mul(v[r][0], X[0]);
#pragma unroll
                for (int j = 1; j < 8; ++j) h = h2fma(v[r][j], X[j], h);
                acc[r][t] += h2sum(h) * f[r];
            }
        }
    }
}

// Fused outliers, part 1 (before the main loop): each thread's first outlier of each of the block's rows (column
// and value in one word), which rows it has one for, and which rows have more outliers than the block has threads.
template <int ROWS>
__device__ __forceinline__ void outliers_first(const int* __restrict__ rowptr, const u16* __restrict__ ocols,
                                               const u16* __restrict__ ovals, int row0, int N, u32 (&ocv)[ROWS],
                                               u32& omask, u32& omore) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        ocv[r] = 0;
        if (row0 + r < N) {
            const int e0 = rowptr[row0 + r], e1 = rowptr[row0 + r + 1];
            const int e = e0 + threadIdx.x;
            if (e < e1) {
                ocv[r] = (u32)ocols[e] | ((u32)ovals[e] << 16);
                omask |= 1u << r;
            }
            if (e1 - e0 > (int)blockDim.x) omore |= 1u << r;
        }
    }
}

// Fused outliers, part 2 (after the main loop, so after the dependency wait): their products with x.
template <int ROWS, int MT>
__device__ __forceinline__ void outliers_add(const int* __restrict__ rowptr, const u16* __restrict__ ocols,
                                             const u16* __restrict__ ovals, const u16* __restrict__ x, int row0,
                                             int K, int M, const u32 (&ocv)[ROWS], u32 omask, u32 omore,
                                             float (&acc)[ROWS][MT]) {
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        if (!((omask >> r) & 1u)) continue;
        const int col = (int)(ocv[r] & 0xFFFFu);
        const float val = h2f((u16)(ocv[r] >> 16));
#pragma unroll
        for (int t = 0; t < MT; ++t) acc[r][t] += val * h2f(ld_dep_u16(x + (long long)min(t, M - 1) * K + col));
    }
    if (omore) {  // rows with more outliers than threads
#pragma unroll
        for (int r = 0; r < ROWS; ++r) {
            if (!((omore >> r) & 1u)) continue;
            const int e1 = rowptr[row0 + r + 1];
            for (int e = rowptr[row0 + r] + threadIdx.x + blockDim.x; e < e1; e += blockDim.x) {
                const int col = ocols[e];
                const float val = h2f(ovals[e]);
#pragma unroll
                for (int t = 0; t < MT; ++t) acc[r][t] += val * h2f(ld_dep_u16(x + (long long)min(t, M - 1) * K + col));
            }
        }
    }
}

// The block's partial sums reduced over its warps (shuffles, then shared memory) and stored (+ bias).
template <int ROWS, int MT>
__device__ __forceinline__ void reduce_store(float (&acc)[ROWS][MT], float (*red)[ROWS * MT], int row0, int N, int M,
                                             const u16* __restrict__ bias, u16* __restrict__ y) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            float s = acc[r][t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) red[warp][r * MT + t] = s;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < ROWS * MT; i += blockDim.x) {
        const int r = i / MT, t = i % MT;
        float s = 0.f;
        for (int w = 0; w < nwarps; ++w) s += red[w][i];
        const int row = row0 + r;
        if (row < N && t < M) {
            if (bias) s += h2f(bias[row]);
            y[(long long)t * N + row] = f2h(s);
        }
    }
}

// silu(g)·u as kernels/decoder/swiglu.cu rounds it (the gate and up outputs first rounded to fp16, as the projection
// writes them).
__device__ __forceinline__ u16 swiglu1(u16 g, u16 u) {
    const float x = h2f(g);
    const u16 s = f2h(x / (1.0f + expf(-x)));
    return f2h(h2f(s) * h2f(u));
}

// reduce_store for a row-interleaved gate/up projection (4-row blocks: gate rows 2j, 2j + 1, then up rows 2j,
// 2j + 1, for block j): instead of the four projections it stores the two SwiGLU activations y[t, 2j + r] of an
// [M, N/2] output (the SwiGLU kernel after the projection is not needed).
template <int MT>
__device__ __forceinline__ void reduce_store_swiglu(float (&acc)[4][MT], float (*red)[4 * MT], int row0, int N, int M,
                                                    u16* __restrict__ y) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t) {
            float s = acc[r][t];
#pragma unroll
            for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
            if (lane == 0) red[warp][r * MT + t] = s;
        }
    __syncthreads();
    for (int i = threadIdx.x; i < 2 * MT; i += blockDim.x) {
        const int r = i / MT, t = i % MT;
        float g = 0.f, u = 0.f;
        for (int w = 0; w < nwarps; ++w) {
            g += red[w][r * MT + t];
            u += red[w][(r + 2) * MT + t];
        }
        if (row0 + 3 < N && t < M) y[(long long)t * (N >> 1) + (row0 >> 1) + r] = swiglu1(f2h(g), f2h(u));
    }
}

// y[M, N] = x[M, K] . W^T (+ bias) for M <= MT tokens on CUDA cores. A block owns ROWS output rows; its threads
// split K in 64-channel blocks (thread t takes blocks t, t + blockDim.x, ...) and reduce through shared memory.
// A warp's 16-byte loads of one row cover 512 contiguous bytes of qweight_a. A block's loads are issued right before
// its arithmetic: issuing the next block's loads ahead of it (register double buffering) helped 1-warp blocks but
// never beat 2-warp blocks without it (kernels/mixed/NOTES.md).
// FUSE adds the rows' CSR outliers before the reduction (else mixed_spmv adds them to y): each thread's first
// outlier of each row (column and value) is loaded before the main loop, so only its activation is read after.
// Dependent launch: the weights of a thread's first block and its outliers are requested before the wait for the
// kernel ahead, whose output (x) is read after it, through coherent loads.
template <int ROWS, int MT, bool B4, bool FUSE>
__device__ __forceinline__ void gemv_body(const Layer& L, const int* __restrict__ rowptr,
                                          const u16* __restrict__ ocols, const u16* __restrict__ ovals,
                                          const u16* __restrict__ x, const u16* __restrict__ bias,
                                          u16* __restrict__ y, int M) {
    __shared__ float red[MAX_WARPS][ROWS * MT];
    const int N = L.N, K = L.K;
    const int nblk = K >> 6;
    const int row0 = blockIdx.x * ROWS;
    int rows[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) rows[r] = min(row0 + r, N - 1);  // rows past N are computed, never stored
    float acc[ROWS][MT];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t) acc[r][t] = 0.f;

    launch_dependents();
    u32 ocv[ROWS];  // column | value << 16 of this thread's first outlier of each row
    u32 omask = 0, omore = 0;
    if (FUSE) outliers_first<ROWS>(rowptr, ocols, ovals, row0, N, ocv, omask, omore);

    bool waited = false;
    for (int b = threadIdx.x; b < nblk; b += blockDim.x) {
        const u32 info = ld_meta(L.binfo + b);
        RowBlock<B4> rb[ROWS];
        load_block<ROWS, B4>(L, rows, b, info, rb);
        if (!waited) {
            grid_dependency_wait();
            waited = true;
        }
        compute_block<ROWS, MT, B4>(L, rows, b, info, rb, x, M, acc);
    }
    if (!waited) grid_dependency_wait();
    if (FUSE) outliers_add<ROWS, MT>(rowptr, ocols, ovals, x, row0, K, M, ocv, omask, omore, acc);
    reduce_store<ROWS, MT>(acc, red, row0, N, M, bias, y);
}

// Entry points: mixed_gemv_r{rows per block}_m{token slots}_b{1: one 4-bit stripe per block}_f{fused outliers}_p0
// (p0: no loads ahead of the arithmetic).
#define MIXED_GEMV_ENTRY(ROWS, MT, B4, FUSE)                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * MAX_WARPS)                                                 \
        mixed_gemv_r##ROWS##_m##MT##_b##B4##_f##FUSE##_p0(                                                       \
            const u32* qa, const u32* qb, const u32* sc, const u32* z2, const float2* s2f, const u16* s4,        \
            const u32* z4, const u32* binfo, const int* rowptr, const u16* ocols, const u16* ovals, const u16* x, \
            const u16* bias, u16* y, int M, int N, int K, int S2, int S4, int wsc, int wz2, int wz4, int g2) {    \
        const Layer L{qa, qb, sc, z2, s2f, s4, z4, binfo, N, K, S2, S4, wsc, wz2, wz4, g2};                      \
        gemv_body<ROWS, MT, (B4 != 0), (FUSE != 0)>(L, rowptr, ocols, ovals, x, bias, y, M);                      \
    }

#define MIXED_GEMV_FOUR(MT)             \
    MIXED_GEMV_ENTRY(4, MT, 1, 1)       \
    MIXED_GEMV_ENTRY(4, MT, 1, 0)       \
    MIXED_GEMV_ENTRY(4, MT, 0, 1)       \
    MIXED_GEMV_ENTRY(4, MT, 0, 0)

MIXED_GEMV_FOUR(1)
MIXED_GEMV_FOUR(2)
MIXED_GEMV_FOUR(4)
MIXED_GEMV_FOUR(8)
MIXED_GEMV_FOUR(16)

// ---------------------------------------------------------------------------------------------------------------
// The tiled GEMV: block4 layers re-laid at load time (qtool/cuda/mixed.py `tiled_streams`) so that a thread's
// share of one row and 64-channel block is one 16-byte word and one 8-byte word, plus one word per 4 rows and one
// 8-byte word per second-order group for the whole block (25.5 bytes per 64 weights at g2 = 16; the
// checkpoint layout needs 11 loads per row and block and the fp32 second-order table):
//   ta [N, K/64] uint4   the block's three 2-bit stripes in column order, then the first half of its 4-bit stripe;
//   tm [N, K/64] uint2   x: the second half of the 4-bit stripe; y: its fp16 scale (bits 0-15), the scale codes c
//                        of the three 2-bit stripes (bits 16-19, 20-23, 24-27) and the 4-bit zero (28-31);
//   tz [ceil(N/4), K/64] the 2-bit zeros of rows 4g..4g+3: row 4g+r, stripe i at bits 8r + 2i;
//   tt [N/g2, K/64] uint2 the three 2-bit stripes' s2 (fp16: x low, x high, y low) and u (y bits 16, 20, 24).
// Each code word holds its 2n-th codes in the low half and its (2n+1)-th in the high half (field n of each), so the
// unpacked pairs are (w_2n, w_2n+1), the order of the activations' own 32-bit words: no permutes of x.
// Needs g2 a multiple of 4, so the rows of a 4-row group share their second-order scales.
// ---------------------------------------------------------------------------------------------------------------

__device__ __forceinline__ uint2 ld_na64(const void* p) {
    uint2 r;
    asm volatile("ld.global.nc.L1::no_allocate.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

__device__ __forceinline__ u32 ld_na32(const void* p) {
    u32 r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ uint2 ld_meta_v2(const void* p) {
    uint2 r;
    asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// A 4-bit word pair in the tiled order (codes 2n, 2n+1 of a word at bits 4n and 16 + 4n) -> (w_2n, w_2n+1) - z,
// divided by 64, for n = 0..7 (a: codes 0-7, b: codes 8-15).
__device__ __forceinline__ void unpack4_tiled(u32 a, u32 b, u32 k0, u32 k4, u32 (&v)[8]) {
    const u32 a8 = a >> 8, b8 = b >> 8;
    v[0] = f16x2_sub(andor<0x000F000Fu>(a, MAG0), k0);
    v[1] = f16x2_sub(andor<0x00F000F0u>(a, MAG4), k4);
    v[2] = f16x2_sub(andor<0x000F000Fu>(a8, MAG0), k0);
    v[3] = f16x2_sub(andor<0x00F000F0u>(a8, MAG4), k4);
    v[4] = f16x2_sub(andor<0x000F000Fu>(b, MAG0), k0);
    v[5] = f16x2_sub(andor<0x00F000F0u>(b, MAG4), k4);
    v[6] = f16x2_sub(andor<0x000F000Fu>(b8, MAG0), k0);
    v[7] = f16x2_sub(andor<0x00F000F0u>(b8, MAG4), k4);
}

struct Tiled {
    const uint4* ta;
    const uint2* tm;
    const u32* tz;
    const uint2* tt;
    const u32* binfo;
    int N, nblk;
};

// One 64-channel block of ROWS rows (ROWS a multiple of 4): everything loaded before any arithmetic.
template <int ROWS>
struct TBlock {
    uint4 a[ROWS];
    uint2 m[ROWS];
    u32 z[ROWS / 4];
    uint2 t[ROWS / 4];
    u32 info;
};

template <int ROWS>
__device__ __forceinline__ void tiled_load(const Tiled& T, const int (&rows)[ROWS], const int (&grp)[ROWS / 4],
                                           const int (&h)[ROWS / 4], int b, TBlock<ROWS>& s) {
    s.info = ld_meta(T.binfo + b);
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const long long i = (long long)rows[r] * T.nblk + b;
        s.a[r] = ld_stream(reinterpret_cast<const u32*>(T.ta + i));
        s.m[r] = ld_na64(T.tm + i);
    }
#pragma unroll
    for (int q = 0; q < ROWS / 4; ++q) {
        s.z[q] = ld_na32(T.tz + (long long)grp[q] * T.nblk + b);
        s.t[q] = ld_meta_v2(T.tt + (long long)h[q] * T.nblk + b);
    }
}

// Stripe i (0-2: the 2-bit ones in column order, 3: the 4-bit one) of row r: its 8 pairs and its scale times 64.
template <int ROWS>
__device__ __forceinline__ void tiled_stripe(const TBlock<ROWS>& s, int r, int i, const float (&S)[ROWS / 4][3],
                                             const float (&U)[ROWS / 4][3], u32 (&v)[8], float& f) {
    const uint4& a = s.a[r];
    const u32 my = s.m[r].y;
    if (i < 3) {
        const int q = r >> 2;
        const u32 c = (my >> (16 + 4 * i)) & 15u;
        f = fmaf((float)c, S[q][i], U[q][i]);  // exact: 64·(c + u)·s2
        // the row's zero byte (three 2-bit zeros, bits 6-7 zero) in both halves: one byte permute
        const u32 zz = __byte_perm(s.z[q], 0u, 0x4040u | (0x0101u * (u32)(r & 3)));
        const u32 k0 = andor<0x00030003u>(zz >> (2 * i), MAG0);
        const u32 k4 = andor<0x00300030u>(i == 2 ? zz : zz << (4 - 2 * i), MAG4);
        unpack2(i == 0 ? a.x : (i == 1 ? a.y : a.z), k0, k4, v);
    } else {
        const u32 z = my >> 28;
        f = h2f((u16)(my & 0xFFFFu)) * 64.f;
        unpack4_tiled(a.w, s.m[r].x, zero0(z), zero4(z), v);
    }
}

template <int ROWS, int MT>
__device__ __forceinline__ void tiled_compute(const TBlock<ROWS>& s, int b, const u16* __restrict__ x, int K, int M,
                                              float (&acc)[ROWS][MT]) {
    float S[ROWS / 4][3], U[ROWS / 4][3];  // per 4-row group: 64·s2 and 64·u·s2 of the three 2-bit stripes
#pragma unroll
    for (int q = 0; q < ROWS / 4; ++q) {
        const u32 tx = s.t[q].x, ty = s.t[q].y;
        S[q][0] = h2f((u16)(tx & 0xFFFFu)) * 64.f;
        S[q][1] = h2f((u16)(tx >> 16)) * 64.f;
        S[q][2] = h2f((u16)(ty & 0xFFFFu)) * 64.f;
#pragma unroll
        for (int i = 0; i < 3; ++i) U[q][i] = (float)((ty >> (16 + 4 * i)) & 15u) * S[q][i];
    }
    const u16* xb = x + 64 * b;
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int p = (int)((s.info >> (24 + 2 * i)) & 3u);
        if constexpr (MT <= 2) {
            uint4 X[MT][2];
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                const u16* xp = xb + (long long)min(t, M - 1) * K + 16 * p;
                X[t][0] = ld_dep_v4(xp);
                X[t][1] = ld_dep_v4(xp + 8);
            }
#pragma unroll
            for (int r = 0; r < ROWS; ++r) {
                u32 v[8];
                float f;
                tiled_stripe<ROWS>(s, r, i, S, U, v, f);
#pragma unroll
                for (int t = 0; t < MT; ++t) {
                    u32 hh = f16x2_mul(v[0], X[t][0].x);
                    hh = h2fma(v[1], X[t][0].y, hh);
                    hh = h2fma(v[2], X[t][0].z, hh);
                    hh = h2fma(v[3], X[t][0].w, hh);
                    hh = h2fma(v[4], X[t][1].x, hh);
                    hh = h2fma(v[5], X[t][1].y, hh);
                    hh = h2fma(v[6], X[t][1].z, hh);
                    hh = h2fma(v[7], X[t][1].w, hh);
                    acc[r][t] += h2sum(hh) * f;
                }
            }
        } else {
            u32 v[ROWS][8];
            float f[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) tiled_stripe<ROWS>(s, r, i, S, U, v[r], f[r]);
#pragma unroll
            for (int t = 0; t < MT; ++t) {
                const u16* xp = xb + (long long)min(t, M - 1) * K + 16 * p;
                const uint4 lo = ld_dep_v4(xp), hi = ld_dep_v4(xp + 8);
#pragma unroll
                for (int r = 0; r < ROWS; ++r) {
                    u32 hh = f16x2_mul(v[r][0], lo.x);
                    hh = h2fma(v[r][1], lo.y, hh);
                    hh = h2fma(v[r][2], lo.z, hh);
                    hh = h2fma(v[r][3], lo.w, hh);
                    hh = h2fma(v[r][4], hi.x, hh);
                    hh = h2fma(v[r][5], hi.y, hh);
                    hh = h2fma(v[r][6], hi.z, hh);
                    hh = h2fma(v[r][7], hi.w, hh);
                    acc[r][t] += h2sum(hh) * f[r];
                }
            }
        }
    }
}

// y[M, N] = x[M, K] . W^T (+ bias) from the tiled streams; grid, split of K, outliers and dependent launch as
// gemv_body. PIPE: the next block's loads are issued before the current block's arithmetic (register double
// buffering), so a thread with several blocks always has weights in flight.
template <int ROWS, int MT, bool FUSE, bool PIPE, bool SWIGLU = false>
__device__ __forceinline__ void tiled_body(const Tiled& T, int g2, const int* __restrict__ rowptr,
                                           const u16* __restrict__ ocols, const u16* __restrict__ ovals,
                                           const u16* __restrict__ x, const u16* __restrict__ bias,
                                           u16* __restrict__ y, int M) {
    __shared__ float red[MAX_WARPS][ROWS * MT];
    const int N = T.N, nblk = T.nblk, K = nblk << 6;
    const int row0 = blockIdx.x * ROWS;
    int rows[ROWS], grp[ROWS / 4], h[ROWS / 4];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) rows[r] = min(row0 + r, N - 1);  // rows past N are computed, never stored
#pragma unroll
    for (int q = 0; q < ROWS / 4; ++q) {
        grp[q] = rows[4 * q] >> 2;
        h[q] = rows[4 * q] / g2;
    }
    float acc[ROWS][MT];
#pragma unroll
    for (int r = 0; r < ROWS; ++r)
#pragma unroll
        for (int t = 0; t < MT; ++t) acc[r][t] = 0.f;

    launch_dependents();
    // The first block's weights are requested before the outliers' row pointers: the CSR entries wait for their
    // row pointers (two dependent loads), and issued first they held the weight stream back by one memory latency.
    int b = threadIdx.x;
    TBlock<ROWS> cur;
    if (b < nblk) tiled_load<ROWS>(T, rows, grp, h, b, cur);
    u32 ocv[ROWS];
    u32 omask = 0, omore = 0;
    if (FUSE) outliers_first<ROWS>(rowptr, ocols, ovals, row0, N, ocv, omask, omore);
    grid_dependency_wait();
    if (PIPE) {
        for (; b < nblk; b += blockDim.x) {
            const int bn = b + blockDim.x;
            TBlock<ROWS> nxt;
            if (bn < nblk) tiled_load<ROWS>(T, rows, grp, h, bn, nxt);
            tiled_compute<ROWS, MT>(cur, b, x, K, M, acc);
            cur = nxt;
        }
    } else if (b < nblk) {
        tiled_compute<ROWS, MT>(cur, b, x, K, M, acc);
        for (b += blockDim.x; b < nblk; b += blockDim.x) {
            tiled_load<ROWS>(T, rows, grp, h, b, cur);
            tiled_compute<ROWS, MT>(cur, b, x, K, M, acc);
        }
    }
    if (FUSE) outliers_add<ROWS, MT>(rowptr, ocols, ovals, x, row0, K, M, ocv, omask, omore, acc);
    if constexpr (SWIGLU)
        reduce_store_swiglu<MT>(acc, red, row0, N, M, y);
    else
        reduce_store<ROWS, MT>(acc, red, row0, N, M, bias, y);
}

// Entry points: mixed_gemv_tiled_r{rows per block}_m{token slots}_f{fused outliers}_p{next block's loads ahead}.
#define MIXED_TILED_ENTRY(ROWS, MT, FUSE, PIPE)                                                                   \
    extern "C" __global__ void __launch_bounds__(32 * MAX_WARPS) mixed_gemv_tiled_r##ROWS##_m##MT##_f##FUSE##_p##PIPE( \
        const uint4* ta, const uint2* tm, const u32* tz, const uint2* tt, const u32* binfo, const int* rowptr,    \
        const u16* ocols, const u16* ovals, const u16* x, const u16* bias, u16* y, int M, int N, int nblk,         \
        int g2) {                                                                                                   \
        const Tiled T{ta, tm, tz, tt, binfo, N, nblk};                                                             \
        tiled_body<ROWS, MT, (FUSE != 0), (PIPE != 0)>(T, g2, rowptr, ocols, ovals, x, bias, y, M);               \
    }

#define MIXED_TILED_PAIR(ROWS, MT, PIPE)   \
    MIXED_TILED_ENTRY(ROWS, MT, 0, PIPE)   \
    MIXED_TILED_ENTRY(ROWS, MT, 1, PIPE)

// The same GEMV for a row-interleaved gate/up projection, storing SwiGLU of it (reduce_store_swiglu; no bias).
#define MIXED_TILED_SWIGLU_ENTRY(MT, FUSE, PIPE)                                                                  \
    extern "C" __global__ void __launch_bounds__(32 * MAX_WARPS) mixed_gemv_tiled_swiglu_m##MT##_f##FUSE##_p##PIPE( \
        const uint4* ta, const uint2* tm, const u32* tz, const uint2* tt, const u32* binfo, const int* rowptr,    \
        const u16* ocols, const u16* ovals, const u16* x, u16* y, int M, int N, int nblk, int g2) {               \
        const Tiled T{ta, tm, tz, tt, binfo, N, nblk};                                                             \
        tiled_body<4, MT, (FUSE != 0), (PIPE != 0), true>(T, g2, rowptr, ocols, ovals, x, nullptr, y, M);          \
    }

// 4-row blocks (8-row ones lost at every measured shape); at one token with the prefetch (without it: no better).
MIXED_TILED_PAIR(4, 1, 1)
MIXED_TILED_PAIR(4, 2, 0)
MIXED_TILED_PAIR(4, 4, 0)
MIXED_TILED_PAIR(4, 8, 0)
MIXED_TILED_PAIR(4, 16, 0)
MIXED_TILED_SWIGLU_ENTRY(1, 0, 1)
MIXED_TILED_SWIGLU_ENTRY(1, 1, 1)

// y[t, n] += Σ outliers of row n · x[t, col], for the unfused GEMV (and the paper's separate SpMV): one warp per
// row. It reads y, written by the kernel ahead, after the dependency wait, through coherent loads.
extern "C" __global__ void __launch_bounds__(256) mixed_spmv(const int* __restrict__ rowptr,
                                                             const u16* __restrict__ ocols,
                                                             const u16* __restrict__ ovals, const u16* x, u16* y,
                                                             int M, int N, int K) {
    grid_dependency_wait();
    launch_dependents();
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    const int e0 = rowptr[row], e1 = rowptr[row + 1];
    if (e0 == e1) return;
    for (int t = 0; t < M; ++t) {
        float s = 0.f;
        for (int e = e0 + lane; e < e1; e += 32) s += h2f(ovals[e]) * h2f(ld_dep_u16(x + (long long)t * K + ocols[e]));
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) {
            u16* yp = y + (long long)t * N + row;
            *yp = f2h(h2f(ld_dep_u16(yp)) + s);
        }
    }
}

// The dense part (without outliers) as fp16 [N, K] for the prefill path: one thread per (row, 64-channel block).
// (q - z)/64 times the scale times 64 is exact in fp32, so the one rounding is the reference's cast to fp16.
template <bool B4>
__device__ __forceinline__ void dequant_body(const Layer& L, u16* __restrict__ out) {
    const int nblk = L.K >> 6;
    const long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (long long)nblk * L.N) return;
    const int row = (int)(idx / nblk), b = (int)(idx % nblk);
    const u32 info = ld_meta(L.binfo + b);
    const int r4 = (int)(info & 0xFFFFu);
    const int n2 = B4 ? 3 : 4 - (int)((info >> 16) & 7u);
    const int r2 = 4 * b - r4;
    RowBlock<B4> rb;
    load_row<B4>(L, row, b, r2, r4, n2, rb);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int p = (int)((info >> (24 + 2 * i)) & 3u);
        u32 v[8];
        float f;
        decode_stripe<B4>(L, rb, row, i, p, n2, r2, r4, v, f);
        u32 o[8];
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
            // v[j] = (w_j, w_{j+8}): channels j, j+1 go to word j/2 of the first 8, j+8, j+9 to the second 8
            const u16 a0 = f2h(h2f((u16)(v[j] & 0xFFFFu)) * f), a1 = f2h(h2f((u16)(v[j + 1] & 0xFFFFu)) * f);
            const u16 b0 = f2h(h2f((u16)(v[j] >> 16)) * f), b1 = f2h(h2f((u16)(v[j + 1] >> 16)) * f);
            o[j / 2] = (u32)a0 | ((u32)a1 << 16);
            o[4 + j / 2] = (u32)b0 | ((u32)b1 << 16);
        }
        uint4* dst = reinterpret_cast<uint4*>(out + (long long)row * L.K + 64 * b + 16 * p);
        uint4 lo, hi;
        lo.x = o[0], lo.y = o[1], lo.z = o[2], lo.w = o[3];
        hi.x = o[4], hi.y = o[5], hi.z = o[6], hi.w = o[7];
        dst[0] = lo;
        dst[1] = hi;
    }
}

#define MIXED_DEQUANT_ENTRY(B4)                                                                                    \
    extern "C" __global__ void __launch_bounds__(256) mixed_dequant_b##B4(                                       \
        const u32* qa, const u32* qb, const u32* sc, const u32* z2, const float2* s2f, const u16* s4, const u32* z4,  \
        const u32* binfo, u16* out, int N, int K, int S2, int S4, int wsc, int wz2, int wz4, int g2) {             \
        const Layer L{qa, qb, sc, z2, s2f, s4, z4, binfo, N, K, S2, S4, wsc, wz2, wz4, g2};                      \
        dequant_body<(B4 != 0)>(L, out);                                                                           \
    }

MIXED_DEQUANT_ENTRY(1)
MIXED_DEQUANT_ENTRY(0)

// w[n, col] += outlier value, for the dense fp16 weight of the prefill path: one warp per row (positions are
// unique, so no two threads touch one element).
extern "C" __global__ void __launch_bounds__(256) mixed_outliers_into_dense(const int* __restrict__ rowptr,
                                                                           const u16* __restrict__ ocols,
                                                                           const u16* __restrict__ ovals, u16* w,
                                                                           int N, int K) {
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (row >= N) return;
    for (int e = rowptr[row] + lane; e < rowptr[row + 1]; e += 32) {
        u16* p = w + (long long)row * K + ocols[e];
        *p = f2h(h2f(*p) + h2f(ovals[e]));
    }
}
