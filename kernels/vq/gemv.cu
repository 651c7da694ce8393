// VQ GEMV for the `vq` weight layout (formats/vq.md): y[M, N] = x[M, K] · Wᵀ for M = 1..16 tokens, where every
// d consecutive weights of a row are the sum of z codebook entries picked by b-bit indices. VQ-LLM's codebook-
// centric dataflow with its three-tier codebook cache (Sec. V): a block holds ONE codebook (one scope and one
// residual r) and streams the indices of a range of rows through it.
//
// One template, instantiated per VQ configuration by qtool/cuda/vq.py through -D options (one module per
// configuration, form and cache, the token slots MT = 1, 2, 4, 8, 16 inside it). Two forms: the tensor-core form
// (`vq_gemv_mma_m*`, built with VQ_NREP, dispatched; described at its code below) and the CUDA-core form
// (`vq_gemv_m*`, built without it, described here):
//   VQ_D     vector size d (2, 4 or 8: an entry is one 32-, 64- or 128-bit load; the mma form takes 4 or 8)
//   VQ_B     index bits b (8, 12 or 16; the mma form takes 8 or 12)
//   VQ_NREG  CUDA-core form: entries [0, NREG) held in registers, one entry per lane per 32 (read with __shfl_sync)
//   VQ_NREP  mma form: entries [0, NREP) replicated 16 times in shared memory (bank-private copies)
//   VQ_NSH   entries [hot tier, NSH) in shared memory; entries [NSH, 2^b) are read from global memory (L1/L2)
// GC (the paper's all-global baseline) is hot tier = NSH = 0; SC (whole codebook in shared) 0 and NSH = 2^b.
//
// Grid: x = row block (never crossing a row tile), y = split s = r · splits_k + ks: residual r and the ks-th range
// of split_vecs vectors (one column tile for tiled scopes). With more than one split the partial sums go to a
// float32 workspace and the last block of a row block adds them in split order and writes fp16 (explicit global
// reduction, common/ptx_common.cuh's split_k_last); with one split the block writes fp16 itself.
//
// A split covers `tps` consecutive column tiles (codebook switches inside the block: the codebook and activations
// are re-staged per tile), so the number of partial sums follows the traffic balance (qtool/cuda/vq.py).
//
// Inside a block: a row's range is cut into chunks of CH vectors whose CH·b bits are whole 16-byte words (b = 8:
// 16 vectors, b = 12: 32, b = 16: 8); WL = min(32, chunks rounded up to a power of two) adjacent lanes share a row,
// lane c taking chunks c, c + WL, ...; a thread takes RPT rows per pass, and every activation vector it reads from
// shared memory serves those RPT rows' lookups (reuse across rows; every looked-up entry serves the M tokens).
// Activations are staged in shared memory as [MT][CH][chunk][d]: the WL lanes of a row read WL adjacent vectors,
// no bank conflict. Products are taken in fp16x2 (d/2 per half) and each vector's dot is widened to fp32, where
// everything accumulates.

#include "common/ptx_common.cuh"

constexpr int THREADS = 256;
#ifndef VQ_PF
#define VQ_PF 1  // mma form: prefetch the next column tile's codebook and index words (qtool/cuda/vq.py)
#endif
constexpr u32 FULL = 0xffffffffu;

// Indices are read once (ld_stream, common/ptx_common.cuh): kept out of L1 so the activations and codebook stay there.
__device__ __forceinline__ u32 ld_stream32(const u32* p) {
    u32 r;
    asm volatile("ld.global.nc.L1::no_allocate.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

// d halves (d/2 words) at p: one 32-, 64- or 128-bit load from global (read-only path, cached) memory.
template <int D>
__device__ __forceinline__ void ldg_vec(const u16* p, u32 (&e)[D / 2]) {
    if constexpr (D == 2) {
        asm("ld.global.nc.u32 %0, [%1];" : "=r"(e[0]) : "l"(p));
    } else if constexpr (D == 4) {
        asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(e[0]), "=r"(e[1]) : "l"(p));
    } else {
        asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(e[0]), "=r"(e[1]), "=r"(e[2]), "=r"(e[3]) : "l"(p));
    }
}

template <int D>
__device__ __forceinline__ void lds_vec(const u32* p, u32 (&e)[D / 2]) {
    if constexpr (D == 2) {
        e[0] = *p;
    } else if constexpr (D == 4) {
        const uint2 t = *reinterpret_cast<const uint2*>(p);
        e[0] = t.x;
        e[1] = t.y;
    } else {
        const uint4 t = *reinterpret_cast<const uint4*>(p);
        e[0] = t.x;
        e[1] = t.y;
        e[2] = t.z;
        e[3] = t.w;
    }
}

// Index j of a chunk's words (LSB-first stream; a 12-bit index may straddle two words: one funnel shift). Called
// with j an unrolled-loop constant, so the word, shift and branch fold away.
template <int B>
__device__ __forceinline__ u32 code_at(const u32* w, int j) {
    const int bit = j * B, q = bit >> 5, s = bit & 31;
    constexpr u32 mask = (1u << B) - 1u;
    if (s + B <= 32) return (w[q] >> s) & mask;
    return __funnelshift_r(w[q], w[q + 1], s) & mask;
}

template <int B>
struct Chunk {
    static constexpr int CH = B == 8 ? 16 : (B == 12 ? 32 : 8);  // vectors per chunk
    static constexpr int NW = CH * B / 32;                       // words per chunk (a multiple of 4)
};

// Entry `id` of the block's codebook through the cache tiers; every lane of the warp must call it (the register
// tier is a warp shuffle).
template <int D, int B, int NREG, int NSH>
__device__ __forceinline__ void lookup(u32 id, const u32 (&reg)[NREG / 32 > 0 ? NREG / 32 : 1][D / 2],
                                       const u32* sbook, const u16* gbook, u32 (&e)[D / 2]) {
    constexpr int E = 1 << B;
    if constexpr (NREG > 0) {
#pragma unroll
        for (int k = 0; k < D / 2; ++k) {
            u32 v = __shfl_sync(FULL, reg[0][k], id & 31);
#pragma unroll
            for (int s = 1; s < NREG / 32; ++s) {
                const u32 t = __shfl_sync(FULL, reg[s][k], id & 31);
                v = (id >> 5) == (u32)s ? t : v;
            }
            e[k] = v;
        }
    }
    if (NREG == 0 || id >= (u32)NREG) {
        if constexpr (NSH >= E) {
            lds_vec<D>(sbook + (id - NREG) * (D / 2), e);
        } else if constexpr (NSH > NREG) {
            if (id < (u32)NSH) {
                lds_vec<D>(sbook + (id - NREG) * (D / 2), e);
            } else {
                ldg_vec<D>(gbook + (size_t)id * D, e);
            }
        } else {
            ldg_vec<D>(gbook + (size_t)id * D, e);
        }
    }
}

// Rows per thread per pass: each staged activation vector serves RPT lookups; fewer where the index words of RPT
// rows (RPT·CH·b/32 registers) would crowd out the rest.
template <int MT, int B>
struct Rows {
    static constexpr int RPT = MT <= 2 ? (Chunk<B>::NW > 4 ? 2 : 4) : (MT <= 4 ? 2 : 1);
};

// The index words of chunk c of RPT rows (zeros outside the rows, the chunk range or the row's words): one
// 16-byte load per 4 words where the rows are 16-byte aligned.
template <int B, int RPT>
__device__ __forceinline__ void load_words(const u32* __restrict__ idx, int W, int w0, int row, int P, int row_end,
                                           bool cval, bool vec_rows, u32 (&wd)[RPT][Chunk<B>::NW]) {
    constexpr int NW = Chunk<B>::NW;
#pragma unroll
    for (int q = 0; q < RPT; ++q) {
        const int rq = row + q * P;
        const bool ok = rq < row_end && cval;
        const u32* p = idx + (size_t)(ok ? rq : 0) * W + w0;
        if (ok && vec_rows && w0 + NW <= W) {
#pragma unroll
            for (int k = 0; k < NW / 4; ++k) {
                const uint4 v = ld_stream(p + 4 * k);
                wd[q][4 * k] = v.x;
                wd[q][4 * k + 1] = v.y;
                wd[q][4 * k + 2] = v.z;
                wd[q][4 * k + 3] = v.w;
            }
        } else {
#pragma unroll
            for (int k = 0; k < NW; ++k) wd[q][k] = ok && w0 + k < W ? ld_stream32(p + k) : 0u;
        }
    }
}

// With S > 1 splits: once every block of this row block has written its partials, the last one adds the S partials
// of its rows: g adjacent lanes share an output (each takes every g-th split, up to 16 loads in flight), then a
// shuffle tree adds their sums. The order is fixed: the result is the same on every run.
__device__ __forceinline__ void finish_splits(const u16* __restrict__ bias, u16* __restrict__ out,
                                              const float* __restrict__ ws, int* __restrict__ counters, int M, int N,
                                              int row0, int nrows, int S) {
    if (!split_k_last(counters, blockIdx.x, S)) return;
    const int t = threadIdx.x;
    const int items = M * nrows;
    int g = 1;
    while (g < 32 && g * 2 * items <= THREADS) g <<= 1;
    const int per = THREADS / g, sub = t % g;
    for (int base = 0; base < items; base += per) {
        const int i = base + t / g;
        const bool ok = i < items;
        const int m = ok ? i / nrows : 0, row = row0 + (ok ? i % nrows : 0);
        const float* src = ws + (size_t)m * N + row;
        const size_t stride = (size_t)M * N;
        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
        int q = sub;
        for (; ok && q + 15 * g < S; q += 16 * g) {  // 16 loads in flight
            float v[16];
#pragma unroll
            for (int u = 0; u < 16; ++u) v[u] = __ldcg(src + (size_t)(q + u * g) * stride);
#pragma unroll
            for (int u = 0; u < 16; u += 4) {
                a0 += v[u];
                a1 += v[u + 1];
                a2 += v[u + 2];
                a3 += v[u + 3];
            }
        }
        for (; ok && q + 3 * g < S; q += 4 * g) {
            a0 += __ldcg(src + (size_t)q * stride);
            a1 += __ldcg(src + (size_t)(q + g) * stride);
            a2 += __ldcg(src + (size_t)(q + 2 * g) * stride);
            a3 += __ldcg(src + (size_t)(q + 3 * g) * stride);
        }
        for (; ok && q < S; q += g) a0 += __ldcg(src + (size_t)q * stride);
        float sum = (a0 + a1) + (a2 + a3);
        for (int o = g >> 1; o > 0; o >>= 1) sum += __shfl_xor_sync(FULL, sum, o);
        if (ok && sub == 0) out[(size_t)m * N + row] = f2h(sum + (bias ? h2f(bias[row]) : 0.f));
    }
    if (t == 0) counters[blockIdx.x] = 0;
}

template <int D, int B, int MT, int NREG, int NSH>
__device__ __forceinline__ void vq_gemv(const u32* __restrict__ indices, const u16* __restrict__ books,
                                        const u16* __restrict__ x, const u16* __restrict__ bias,
                                        u16* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters,
                                        int M, int N, int K, int W, int z, int C, int tile_rows, int tile_vecs,
                                        int rows_per_block, int rbpt, int split_vecs, int splits_k, int tps) {
    constexpr int CH = Chunk<B>::CH, NW = Chunk<B>::NW, H = D / 2, E = 1 << B;
    constexpr int RPT = Rows<MT, B>::RPT, NRS = NREG / 32 > 0 ? NREG / 32 : 1;
    extern __shared__ uint4 smem_v4[];
    u32* smem = reinterpret_cast<u32*>(smem_v4);

    const int t = threadIdx.x, V = K / D;
    const int rt = blockIdx.x / rbpt;
    const int row0 = rt * tile_rows + (blockIdx.x % rbpt) * rows_per_block;
    const int row_end = min(min(row0 + rows_per_block, rt * tile_rows + tile_rows), N);
    const int nrows = row_end - row0;
    const int S = gridDim.y, s = blockIdx.y, r = s / splits_k, ks = s % splits_k;
    const u32* idx_r = indices + (size_t)r * N * W;

    // The lane mapping is fixed by the full range (split_vecs): a ragged last range has zero activations beyond
    // its end, so chunks past it add nothing.
    const int nch_full = (split_vecs + CH - 1) / CH;
    int wl = 1;
    while (wl < nch_full && wl < 32) wl <<= 1;
    const int citer = (nch_full + wl - 1) / wl, npad = citer * wl;
    const int lane_c = t % wl, slot = t / wl, P = THREADS / wl;
    const bool vec_rows = (W & 3) == 0;
    const int rows_per_pass = P * RPT;

    // Shared memory: the shared tier [NREG, NSH) of the codebook, then the staged activations.
    constexpr int NSHARED = NSH > NREG ? NSH - NREG : 0;
    u32* sbook = smem;
    u32* xs = smem + NSHARED * H;

    // The first chunk's indices are requested before the codebook and activations are staged (their latencies
    // overlap).
    u32 wd[RPT][NW];
    load_words<B, RPT>(idx_r, W, (ks * tps * split_vecs + lane_c * CH) * B / 32, row0 + slot, P, row_end,
                       lane_c < (min(V - ks * tps * split_vecs, split_vecs) + CH - 1) / CH, vec_rows, wd);
    bool preloaded = true;
    int staged = -1;  // the range whose codebook and activations shared memory holds
    u32 reg[NRS][H];

    for (int pass = 0; pass < nrows; pass += rows_per_pass) {
        float acc[RPT][MT];
#pragma unroll
        for (int q = 0; q < RPT; ++q)
#pragma unroll
            for (int m = 0; m < MT; ++m) acc[q][m] = 0.f;
        for (int tt = 0; tt < tps; ++tt) {  // the codebook switches: column tiles of this split, in order
            const int v0 = (ks * tps + tt) * split_vecs;
            if (v0 >= V) break;
            const int nv = min(V - v0, split_vecs), nch = (nv + CH - 1) / CH;
            const u16* gbook = books + (((size_t)rt * C + v0 / tile_vecs) * z + r) * (size_t)(E * D);
            if (v0 != staged) {  // a codebook switch (one range per split: staged once for every pass)
                staged = v0;
                __syncthreads();  // the previous range's reads of the shared codebook and activations are done
                if constexpr (NSHARED > 0) {
                    const uint4* src = reinterpret_cast<const uint4*>(gbook + (size_t)NREG * D);
                    for (int i = t; i < NSHARED * D / 8; i += THREADS) smem_v4[i] = src[i];
                }
                for (int i = t; i < MT * CH * npad; i += THREADS) {
                    const int m = i / (CH * npad), rem = i % (CH * npad), j = rem / npad, c = rem % npad;
                    const int v = c * CH + j;
                    u32 e[H];
#pragma unroll
                    for (int k = 0; k < H; ++k) e[k] = 0u;
                    if (m < M && v < nv) ldg_vec<D>(x + (size_t)m * K + (size_t)(v0 + v) * D, e);
#pragma unroll
                    for (int k = 0; k < H; ++k) xs[(size_t)i * H + k] = e[k];
                }
#pragma unroll
                for (int q = 0; q < NRS; ++q) {
                    if constexpr (NREG > 0) {
                        ldg_vec<D>(gbook + (size_t)(q * 32 + (t & 31)) * D, reg[q]);
                    } else {
#pragma unroll
                        for (int k = 0; k < H; ++k) reg[q][k] = 0u;
                    }
                }
                __syncthreads();
            }
            for (int it = 0; it < citer; ++it) {
                const int c = lane_c + it * wl;
                if (!preloaded)
                    load_words<B, RPT>(idx_r, W, (v0 + c * CH) * B / 32, row0 + pass + slot, P, row_end, c < nch,
                                       vec_rows, wd);
                preloaded = false;
                const u32* xc = xs + (size_t)c * H;
#pragma unroll
                for (int j = 0; j < CH; ++j) {
                    u32 e[RPT][H];
#pragma unroll
                    for (int q = 0; q < RPT; ++q) lookup<D, B, NREG, NSH>(code_at<B>(wd[q], j), reg, sbook, gbook, e[q]);
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        u32 xv[H];
                        lds_vec<D>(xc + (size_t)((m * CH + j) * npad) * H, xv);
#pragma unroll
                        for (int q = 0; q < RPT; ++q) {
                            u32 h = f16x2_mul(xv[0], e[q][0]);
#pragma unroll
                            for (int k = 1; k < H; ++k) h = h2fma(xv[k], e[q][k], h);
                            acc[q][m] += h2sum(h);
                        }
                    }
                }
            }
        }
        // The wl lanes of a row hold its partial dots: sum them (wl is uniform over the block).
        for (int o = wl >> 1; o > 0; o >>= 1)
#pragma unroll
            for (int q = 0; q < RPT; ++q)
#pragma unroll
                for (int m = 0; m < MT; ++m) acc[q][m] += __shfl_xor_sync(FULL, acc[q][m], o);
        if (lane_c == 0) {
#pragma unroll
            for (int q = 0; q < RPT; ++q) {
                const int row = row0 + pass + slot + q * P;
                if (row >= row_end) continue;
#pragma unroll
                for (int m = 0; m < MT; ++m) {
                    if (m >= M) break;
                    if (S == 1) {
                        const float b = bias ? h2f(bias[row]) : 0.f;
                        out[(size_t)m * N + row] = f2h(acc[q][m] + b);
                    } else {
                        ws[((size_t)s * M + m) * N + row] = acc[q][m];
                    }
                }
            }
        }
    }
    if (S > 1) finish_splits(bias, out, ws, counters, M, N, row0, nrows, S);
}

// ---- Tensor-core form (`mma` entries) -------------------------------------------------------------------------
// The same grid, splits and reduction; inside a block every looked-up entry goes straight into the A operand of
// mma.sync m16n8k16 (weight rows as M, tokens as N, fp32 accumulation), so a code costs its extraction, one address
// and one 8-byte shared load: no per-code multiply, horizontal add or widening. The reduction order inside a k16
// step is free, so its 16 columns are not 16 adjacent ones: lane (g, t) of a warp holds A columns {2t, 2t+1, 2t+8,
// 2t+9} of rows g and g + 8, and those four columns are made one 4-element half-entry (d = 4: a whole entry, d = 8:
// half hh = t % 2 of one). Lane group p = t / (d/4) walks S consecutive vectors of a 64-vector chunk, one per step,
// so a lane's codes are S·b/32 consecutive index words (one or three 16-byte loads) and every code's bit position is
// a compile-time constant. The activations are staged in the same permuted order, one 8-byte B half per lane and
// step, a warp's 32 lanes on 32 consecutive 8-byte slots (no bank conflict).
//
// Codebook tiers: entries [0, NREP) are replicated 16 times in shared memory, copy c of each 4-element half in bank
// pair c, and lane l reads copy l % 16, so the 16 lanes of a half-warp never share a bank whatever they look up (a
// random 8-byte lookup otherwise costs ~3 times the conflict-free shared-memory cycles); [NREP, NSH) are single
// copies in shared memory; [NSH, 2^b) are read from global memory (L1/L2).
//
// A warp holds RG = 2 row groups (32 rows) and takes chunks kw, kw + WK, ... of the block's range (WK = 1, 2, 4 or 8
// warps along K: fewer rows per block where a range has several chunks); partial sums of the WK warps of a row go
// through shared memory and are added in warp order.

template <int D, int B>
struct MmaChunk {
    static constexpr int VPS = 16 / D;                // vectors per k16 step
    static constexpr int LPV = D / 4;                 // lanes per vector (4-element halves)
    static constexpr int S = B == 8 ? 16 : 32;        // steps per chunk: S·b bits are whole 16-byte words
    static constexpr int NWL = S * B / 32;            // index words a lane holds per row
    static constexpr int CV = VPS * S;                // vectors per chunk (64)
};

__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint2 ldg64(const u16* p) {
    uint2 r;
    asm("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// An activation load after the grid-dependency wait: coherent (the kernel ahead may have written x) and volatile
// (not hoisted above the wait); see common/ptx_common.cuh's ld_dep_*.
__device__ __forceinline__ uint2 ld_dep64(const u16* p) {
    uint2 r;
    asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(r.x), "=r"(r.y) : "l"(p));
    return r;
}

// Half hh of entry `id` through the tiers (rep: this lane's copy of half 0 of entry 0; sh: half hh of entry NREP).
template <int D, int B, int NREP, int NSH>
__device__ __forceinline__ uint2 lookup_half(u32 id, const uint2* rep, const uint2* sh, const u16* gbook, int hh) {
    constexpr int E = 1 << B, H4 = D / 4;
    if constexpr (NSH == 0) {
        return ldg64(gbook + (size_t)id * D + hh * 4);
    } else {
        uint2 e;
        if (NSH >= E || id < (u32)NSH) {
            if constexpr (NREP >= E) {
                e = rep[id * (H4 * 16)];
            } else if constexpr (NREP > 0) {
                e = id < (u32)NREP ? rep[id * (H4 * 16)] : sh[(id - NREP) * H4];
            } else {
                e = sh[id * H4];
            }
        } else {
            e = ldg64(gbook + (size_t)id * D + hh * 4);
        }
        return e;
    }
}

template <int D, int B, int MT, int NREP, int NSH>
__device__ __forceinline__ void vq_gemv_mma(const u32* __restrict__ indices, const u16* __restrict__ books,
                                            const u16* __restrict__ x, const u16* __restrict__ bias,
                                            u16* __restrict__ out, float* __restrict__ ws, int* __restrict__ counters,
                                            int M, int N, int K, int W, int z, int C, int tile_rows, int tile_vecs,
                                            int rows_per_block, int rbpt, int split_vecs, int splits_k, int tps,
                                            int wk) {
    using Q = MmaChunk<D, B>;
    constexpr int S = Q::S, NWL = Q::NWL, CV = Q::CV, H4 = D / 4, E = 1 << B;
    constexpr int RG = 2, NT = MT > 8 ? 2 : 1, GT = MT < 8 ? MT : 8;  // row groups, n-tiles, tokens per n-tile
    constexpr int NSHARED = NSH > NREP ? NSH - NREP : 0;
    constexpr int REPB = NREP * H4 * 128, SHB = NSHARED * D * 2;  // bytes (multiples of 16)
    // Codebook fill per thread: replicated entry halves (one 8-byte load each, stored as 16 copies) and 16-byte
    // pieces of the single-copy tier.
    constexpr int RF = NREP > 0 ? (NREP * H4 + THREADS - 1) / THREADS : 0;
    constexpr int SF = NSHARED > 0 ? (NSHARED * D / 8 + THREADS - 1) / THREADS : 0;
    // Small codebooks (GPTVQ's per-tile ones): the next column tile's codebook and first index words are loaded
    // into registers while the current tile is computed, so a codebook switch inside a block waits on shared
    // memory only. AQLM's 64 KiB codebook never switches inside a block.
    constexpr bool PF = VQ_PF && 2 * RF + 4 * SF <= 16 && NWL <= 4;
    constexpr int RFN = PF && RF > 0 ? RF : 1, SFN = PF && SF > 0 ? SF : 1;
    extern __shared__ uint4 smem_v4[];
    char* smem = reinterpret_cast<char*>(smem_v4);
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5, g = lane >> 2, tq = lane & 3;
    const int p = tq / H4, hh = tq % H4;
    const int V = K / D;
    const int rt = blockIdx.x / rbpt;
    const int row0 = rt * tile_rows + (blockIdx.x % rbpt) * rows_per_block;
    const int row_end = min(min(row0 + rows_per_block, rt * tile_rows + tile_rows), N);
    const int nrows = row_end - row0;
    const int S_ = gridDim.y, s = blockIdx.y, r = s / splits_k, ks = s % splits_k;
    const u32* idx_r = indices + (size_t)r * N * W;
    const int kw = warp % wk, rw = warp / wk;
    const int nchp = (split_vecs + CV - 1) / CV;  // chunks of the full range (the staging's shape)
    const bool vec_rows = (W & 3) == 0;
    // Clusters: along y the blocks of one row block's splits add their partials through distributed shared memory
    // (when the cluster holds all of them).
    const int cx = (int)cluster_dim(0), cy = (int)cluster_dim(1);
    const bool dsm = S_ > 1 && cy == S_;

    launch_dependents();  // the next kernel may start loading its weights while this one runs

    const uint2* rep = reinterpret_cast<const uint2*>(smem) + hh * 16 + (lane & 15);
    const uint2* sh = reinterpret_cast<const uint2*>(smem + REPB) + hh;
    uint2* xs = reinterpret_cast<uint2*>(smem + REPB + SHB);
    float* red = reinterpret_cast<float*>(smem + REPB + SHB);  // after the last range: reuses the staging
    float* part = red + 256 * MT;  // the block's row sums for the cluster's reduction (after `red`)

    float acc[RG][NT][4];
#pragma unroll
    for (int q = 0; q < RG; ++q)
#pragma unroll
        for (int j = 0; j < NT; ++j)
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[q][j][i] = 0.f;

    // Rows of this lane: row group q, half h (rows g and g + 8).
    int rows[RG][2];
#pragma unroll
    for (int q = 0; q < RG; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) rows[q][h] = row0 + rw * (16 * RG) + q * 16 + g + 8 * h;

    u32 wd[RG][2][NWL], wdn[RG][2][NWL];  // wdn: the next range's first words (PF; unused, so dropped, without)
    auto load = [&](u32 (&dst)[RG][2][NWL], int v0, int c, int nv) {
        const int vl = c * CV + p * S;  // the lane group's first vector in the range
        const int w0 = (v0 + vl) * B / 32;
#pragma unroll
        for (int q = 0; q < RG; ++q)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const bool ok = rows[q][h] < row_end && vl < nv;
                const u32* src = idx_r + (size_t)(ok ? rows[q][h] : 0) * W + w0;
                if (ok && vec_rows && w0 + NWL <= W) {
#pragma unroll
                    for (int k = 0; k < NWL / 4; ++k) {
                        const uint4 v = ld_stream(src + 4 * k);
                        dst[q][h][4 * k] = v.x;
                        dst[q][h][4 * k + 1] = v.y;
                        dst[q][h][4 * k + 2] = v.z;
                        dst[q][h][4 * k + 3] = v.w;
                    }
                } else {
#pragma unroll
                    for (int k = 0; k < NWL; ++k) dst[q][h][k] = ok && w0 + k < W ? ld_stream32(src + k) : 0u;
                }
            }
    };
    auto book_of = [&](int v0) { return books + (((size_t)rt * C + v0 / tile_vecs) * z + r) * (size_t)(E * D); };

    uint2 rf[RFN];
    uint4 sf[SFN];
    auto fetch = [&](const u16* gbook) {  // the fill's global loads, into registers (PF)
        if constexpr (PF && RF > 0) {
#pragma unroll
            for (int j = 0; j < RF; ++j) {
                const int i = t + j * THREADS;
                rf[j] = i < NREP * H4 ? ldg64(gbook + (size_t)i * 4) : make_uint2(0u, 0u);
            }
        }
        if constexpr (PF && SF > 0) {
            const uint4* src = reinterpret_cast<const uint4*>(gbook + (size_t)NREP * D);
#pragma unroll
            for (int j = 0; j < SF; ++j) {
                const int i = t + j * THREADS;
                if (i < NSHARED * D / 8) sf[j] = src[i];
            }
        }
    };
    auto fill = [&](const u16* gbook) {
        if constexpr (NREP > 0) {
            // Entry half i's 16 copies are the 8 16-byte slots [8i, 8i + 8); a thread stores them rotated by i, so
            // the 8 lanes of a store phase hit 8 different bank quads.
#pragma unroll
            for (int j = 0; j < RF; ++j) {
                const int i = t + j * THREADS;
                if (i < NREP * H4) {
                    uint2 e;
                    if constexpr (PF) e = rf[j]; else e = ldg64(gbook + (size_t)i * 4);
#pragma unroll
                    for (int c = 0; c < 8; ++c) smem_v4[i * 8 + ((c + i) & 7)] = make_uint4(e.x, e.y, e.x, e.y);
                }
            }
        }
        if constexpr (NSHARED > 0) {
            uint4* dst = reinterpret_cast<uint4*>(smem + REPB);
            if constexpr (PF) {
#pragma unroll
                for (int j = 0; j < SF; ++j) {
                    const int i = t + j * THREADS;
                    if (i < NSHARED * D / 8) dst[i] = sf[j];
                }
            } else {
                const uint4* src = reinterpret_cast<const uint4*>(gbook + (size_t)NREP * D);
                for (int i = t; i < NSHARED * D / 8; i += THREADS) dst[i] = src[i];
            }
        }
    };

    // Weights first (they do not depend on the kernel ahead): the first range's index words and, with the prefetch,
    // its codebook into registers.
    {
        const int v0 = ks * tps * split_vecs;
        if (v0 < V && kw < (min(V - v0, split_vecs) + CV - 1) / CV) load(wd, v0, kw, min(V - v0, split_vecs));
        if (v0 < V) fetch(book_of(v0));
    }

    for (int tt = 0; tt < tps; ++tt) {  // the codebook switches: column tiles of this split, in order
        const int v0 = (ks * tps + tt) * split_vecs;
        if (v0 >= V) break;
        const int nv = min(V - v0, split_vecs), nch = (nv + CV - 1) / CV;
        const u16* gbook = book_of(v0);
        if (tt > 0) {
            if constexpr (PF) {
#pragma unroll
                for (int q = 0; q < RG; ++q)
#pragma unroll
                    for (int h = 0; h < 2; ++h)
#pragma unroll
                        for (int k = 0; k < NWL; ++k) wd[q][h][k] = wdn[q][h][k];
            } else if (kw < nch) {
                load(wd, v0, kw, nv);  // requested before the staging: the latencies overlap
            }
            __syncthreads();  // the previous range's reads of the staged codebook and activations
        }
        fill(gbook);
        if (tt == 0) grid_dependency_wait();  // x may be the kernel ahead's output
        // Activations in fragment order: token j·8 + g of lane (g, tl) at step st of chunk c in slot
        // (((c·S + st)·NT + j)·4 + tl)·GT + g, so a warp's B loads are consecutive 8-byte slots.
        for (int i = t; i < nchp * S * 4 * MT; i += THREADS) {
            const int q = i / GT, tl = q % 4, q2 = q / 4, cs = q2 / NT, st = cs % S, c = cs / S;
            const int m = (q2 % NT) * 8 + i % GT;
            const int v = c * CV + (tl / H4) * S + st;
            uint2 e = make_uint2(0u, 0u);
            if (m < M && v < nv) e = ld_dep64(x + (size_t)m * K + (size_t)(v0 + v) * D + (tl % H4) * 4);
            xs[i] = e;
        }
        __syncthreads();
        if constexpr (PF) {
            const int v1 = v0 + split_vecs;
            if (tt + 1 < tps && v1 < V) {
                const int nv1 = min(V - v1, split_vecs);
                if (kw < (nv1 + CV - 1) / CV) load(wdn, v1, kw, nv1);
                fetch(book_of(v1));
            }
        }
        for (int c = kw; c < nch; c += wk) {
            if (c != kw) load(wd, v0, c, nv);
            const uint2* xc = xs + (size_t)c * S * 4 * MT + tq * GT + g;
#pragma unroll
            for (int st = 0; st < S; ++st) {
                uint2 b[NT];
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    b[j] = make_uint2(0u, 0u);
                    if (g < GT) b[j] = xc[(st * NT + j) * 4 * GT];
                }
#pragma unroll
                for (int q = 0; q < RG; ++q) {
                    const uint2 e0 = lookup_half<D, B, NREP, NSH>(code_at<B>(wd[q][0], st), rep, sh, gbook, hh);
                    const uint2 e1 = lookup_half<D, B, NREP, NSH>(code_at<B>(wd[q][1], st), rep, sh, gbook, hh);
#pragma unroll
                    for (int j = 0; j < NT; ++j) mma16816(acc[q][j], e0.x, e1.x, e0.y, e1.y, b[j].x, b[j].y);
                }
            }
        }
    }
    // Row sums: the WK warps of a row leave their partials in shared memory (the staging is free once every warp
    // is done), added in warp order.
    const int R = rows_per_block;
    grid_dependency_wait();  // (a no-op after the first; here for a block without ranges)
    __syncthreads();
#pragma unroll
    for (int q = 0; q < RG; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int rl = rows[q][h] - row0;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int u = 0; u < 2; ++u) {
                    const int m = j * 8 + 2 * tq + u;
                    if (m < MT) red[((size_t)kw * R + rl) * MT + m] = acc[q][j][2 * h + u];
                }
        }
    __syncthreads();
    for (int i = t; i < M * nrows; i += THREADS) {
        const int m = i / nrows, rl = i % nrows, row = row0 + rl;
        float sum = 0.f;
        for (int k = 0; k < wk; ++k) sum += red[((size_t)k * R + rl) * MT + m];
        if (S_ == 1) {
            out[(size_t)m * N + row] = f2h(sum + (bias ? h2f(bias[row]) : 0.f));
        } else if (dsm) {
            part[m * R + rl] = sum;
        } else {
            ws[((size_t)s * M + m) * N + row] = sum;
        }
    }
    if (S_ > 1) {
        if (dsm) {
            // The cluster's blocks of this row block are its S splits (y rank = split): block s adds the S partials
            // of the s-th slice of the row block's outputs, in split order, from the blocks' shared memory.
            cluster_sync();
            const int items = M * nrows, per = (items + S_ - 1) / S_, xr = (int)cluster_pos(0);
            const u32 pa = smem_addr(part);
            for (int i = s * per + t; i < min(items, (s + 1) * per); i += THREADS) {
                const int m = i / nrows, rl = i % nrows, row = row0 + rl;
                const u32 a = pa + (u32)(m * R + rl) * 4u;
                float v[16];
#pragma unroll
                for (int q = 0; q < 16; ++q) v[q] = q < S_ ? ld_cluster_f32(a, (u32)(xr + q * cx)) : 0.f;
                float sum = 0.f;
#pragma unroll
                for (int q = 0; q < 16; ++q) sum += v[q];
                out[(size_t)m * N + row] = f2h(sum + (bias ? h2f(bias[row]) : 0.f));
            }
            cluster_sync();  // no block leaves while another still reads its partials
        } else {
            finish_splits(bias, out, ws, counters, M, N, row0, nrows, S_);
        }
    }
}

#define VQ_MMA_ENTRY(MT)                                                                                           \
    extern "C" __global__ void __launch_bounds__(THREADS) vq_gemv_mma_m##MT(                                     \
        const u32* indices, const u16* books, const u16* x, const u16* bias, u16* out, float* ws, int* counters,  \
        int M, int N, int K, int W, int z, int C, int tile_rows, int tile_vecs, int rows_per_block, int rbpt,    \
        int split_vecs, int splits_k, int tps, int wk) {                                                         \
        vq_gemv_mma<VQ_D, VQ_B, MT, VQ_NREP, VQ_NSH>(indices, books, x, bias, out, ws, counters, M, N, K, W, z,  \
                                                     C, tile_rows, tile_vecs, rows_per_block, rbpt, split_vecs,  \
                                                     splits_k, tps, wk);                                         \
    }

#define VQ_ENTRY(MT)                                                                                               \
    extern "C" __global__ void __launch_bounds__(THREADS) vq_gemv_m##MT(                                         \
        const u32* indices, const u16* books, const u16* x, const u16* bias, u16* out, float* ws, int* counters,  \
        int M, int N, int K, int W, int z, int C, int tile_rows, int tile_vecs, int rows_per_block, int rbpt,    \
        int split_vecs, int splits_k, int tps) {                                                                 \
        vq_gemv<VQ_D, VQ_B, MT, VQ_NREG, VQ_NSH>(indices, books, x, bias, out, ws, counters, M, N, K, W, z, C,   \
                                                 tile_rows, tile_vecs, rows_per_block, rbpt, split_vecs,         \
                                                 splits_k, tps);                                                 \
    }

#ifdef VQ_D
static_assert(VQ_D == 2 || VQ_D == 4 || VQ_D == 8, "vector size");
static_assert(VQ_B == 8 || VQ_B == 12 || VQ_B == 16, "index bits");
static_assert(VQ_NSH == 0 || (VQ_NSH % 32 == 0 && VQ_NSH <= (1 << VQ_B)), "shared tier");
#ifdef VQ_NREP  // the tensor-core form
static_assert((VQ_D == 4 || VQ_D == 8) && (VQ_B == 8 || VQ_B == 12), "mma form: d 4 or 8, 8- or 12-bit indices");
static_assert(VQ_NREP % 32 == 0 && VQ_NREP <= VQ_NSH, "replicated tier");
VQ_MMA_ENTRY(1)
VQ_MMA_ENTRY(2)
VQ_MMA_ENTRY(4)
VQ_MMA_ENTRY(8)
VQ_MMA_ENTRY(16)
#else
static_assert(VQ_NREG % 32 == 0 && VQ_NREG <= 64 && VQ_NREG <= (1 << VQ_B), "register tier");
static_assert(VQ_NSH == 0 || VQ_NSH >= VQ_NREG, "shared tier");
VQ_ENTRY(1)
VQ_ENTRY(2)
VQ_ENTRY(4)
VQ_ENTRY(8)
VQ_ENTRY(16)
#endif
#endif
