// The vector-quantized KV cache of stage `vq_kv` (formats/vq.md "KV cache", CQ-2/CQ-4): the write that fills it
// (rotary embedding of queries and keys fused with the nearest-entry encoding, exactly
// qtool/runtime/vq_kv_cache.py `encode`) and one decode step's attention that reads the codes (VQ-LLM's decode
// attention on a flash-decoding base).
//
// Cache layout, per layer: codes [B, KVH, L / 16, G, 16] u8 for keys and for values: tiles of 16 tokens, group-major
// inside a tile (G = D / DV channel groups of DV channels; L the capacity, a multiple of 32). A lane that owns a
// group loads 16 tokens' codes of it in one 16-byte load, and a warp's load reads G x 16 contiguous bytes. Codebooks in the kernels' layout [KVH, E, G, DV] float16 (entry-major, so that the 32 lanes of a
// warp, each on its own group, read 32 different banks whatever their codes are).
//
// Decode attention (vq_attention_*): one block per (sequence, KV head) and split of the cache along L, holding the
// R query heads that share the KV head. Codebook-centric: the block holds its head's codebooks for the whole pass
// (the switch axes H and C are both inside the block, so the partial q.k over channel groups is reduced in the
// warp, not through global memory). Lane = channel group (`slot`; a lane takes G / 32 groups when G > 32, and two
// token streams share a warp when G = 16). Keys, two forms:
//   lut:    a table T[r][e][g] = q_r[g] . K[e][g] (float32, 256 x G per query head) is built once per block, and a
//           token's partial score in a lane is one table read per group: no conversion, no multiply.
//   direct: the key entries K[e][g] (float16) in shared memory, DV FMAs per group and query head.
// Partial scores of 8 tokens are reduced over the lanes by a butterfly that leaves each lane one token's full
// score (7 shuffles for the reduce-scatter, then the remaining lane bits); the online softmax runs per 8 tokens;
// values: each token's p is broadcast by a shuffle and every lane accumulates p . V[code][g] for its groups.
// Float32 scores and sums (log2 domain, q scaled by log2(e) / sqrt(D)), one rounding to float16 at the end. Splits
// along L (few (sequence, head) pairs) write unnormalized partials with their max and sum, merged by
// vq_attention_combine.
#include "common/ptx_common.cuh"

__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// ---------------------------------------------------------------------------------------------------------------
// The write. Items: the H query vectors of every (sequence, token) (rotated, written to q [B, H, T, D]) and, per
// (sequence, token, KV head, keys|values, group g), the nearest entry of the DV channels of group g. One warp per
// item. Rotary embedding as qtool/cuda/kv_cache.py `rope_half` (rotate-half pairs, every product and sum rounded
// to float16). Nearest entry as `encode`: dot = sum_i x_i c_i and n = sum_i c_i c_i accumulated in channel order,
// each product and sum rounded in float32 (no FMA contraction), distance n - 2 dot, the smallest distance, ties to
// the lower index; lane l scores entries l, l + 32, ... `deq_k`/`deq_v` (nullable, [B, KVH, T, D] float16)
// receive the entries chosen, what prefill attention reads.
__device__ __forceinline__ u16 rope_elem(const u16* src, const u16* cos_t, const u16* sin_t, long long p, int c,
                                         int half, bool rotate) {
    if (!rotate) return ld_dep_u16(src + c);
    const int i = c < half ? c : c - half;
    const u16 x1 = ld_dep_u16(src + i), x2 = ld_dep_u16(src + i + half);
    const u16 cs = cos_t[p * half + i], sn = sin_t[p * half + i];
    if (c < half) {
        const float a1 = h2f(f2h(h2f(x1) * h2f(cs))), b1 = h2f(f2h(h2f(x2) * h2f(sn)));
        return f2h(a1 - b1);
    }
    const float a2 = h2f(f2h(h2f(x2) * h2f(cs))), b2 = h2f(f2h(h2f(x1) * h2f(sn)));
    return f2h(a2 + b2);
}

extern "C" __global__ void __launch_bounds__(256) vq_write(
    const u16* __restrict__ qkv, const u16* __restrict__ cos_t, const u16* __restrict__ sin_t,
    const long long* __restrict__ pos, const u16* __restrict__ kbook, const u16* __restrict__ vbook,
    u16* __restrict__ q, u8* __restrict__ kc, u8* __restrict__ vc, u16* __restrict__ deq_k, u16* __restrict__ deq_v,
    int B, int T, int H, int KVH, int D, int DV, int E, int L) {
    launch_dependents();
    grid_dependency_wait();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int half = D >> 1, G = D / DV, heads = H + 2 * KVH;
    const long long qitems = (long long)B * T * H, items = qitems + (long long)B * T * 2 * KVH * G;
    for (long long it = (long long)blockIdx.x * warps + warp; it < items; it += (long long)gridDim.x * warps) {
        if (it < qitems) {  // a query vector: rotated only
            const int hh = (int)(it % H);
            const long long bt = it / H;
            const int t = (int)(bt % T), b = (int)(bt / T);
            const long long p = ld_dep_s64(pos + t);
            const u16* src = qkv + (bt * heads + hh) * D;
            u16* dst = q + (((size_t)b * H + hh) * T + t) * D;
            for (int c = lane; c < D; c += 32) dst[c] = rope_elem(src, cos_t, sin_t, p, c, half, true);
            continue;
        }
        long long r = it - qitems;
        const int g = (int)(r % G);
        r /= G;
        const int kv = (int)(r % KVH);
        r /= KVH;
        const bool value = (r & 1) != 0;
        const long long bt = r >> 1;
        const int t = (int)(bt % T), b = (int)(bt / T);
        const long long p = ld_dep_s64(pos + t);
        const u16* src = qkv + (bt * heads + H + (value ? KVH : 0) + kv) * D;
        float x[16];
#pragma unroll
        for (int i = 0; i < 16; ++i)
            x[i] = i < DV ? h2f(rope_elem(src, cos_t, sin_t, p, g * DV + i, half, !value)) : 0.f;
        const u16* book = (value ? vbook : kbook) + (size_t)kv * E * G * DV;
        float best = __int_as_float(0x7f800000);  // +inf
        int bi = 0x7fffffff;
        for (int e = lane; e < E; e += 32) {
            const u16* c = book + ((size_t)e * G + g) * DV;
            float dot = 0.f, n = 0.f;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                if (i < DV) {
                    const float ci = h2f(c[i]);
                    dot = i == 0 ? __fmul_rn(x[0], ci) : __fadd_rn(dot, __fmul_rn(x[i], ci));
                    n = i == 0 ? __fmul_rn(ci, ci) : __fadd_rn(n, __fmul_rn(ci, ci));
                }
            }
            const float dist = __fsub_rn(n, __fmul_rn(2.f, dot));
            if (dist < best) best = dist, bi = e;  // e increases in a lane: a tie keeps the lower index
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ob = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ob < best || (ob == best && oi < bi)) best = ob, bi = oi;
        }
        if (bi >= E) bi = 0;  // every distance NaN (a non-finite input): entry 0, as a defined code
        if (lane == 0)
            (value ? vc : kc)[((((size_t)b * KVH + kv) * (L >> 4) + (p >> 4)) * G + g) * 16 + (p & 15)] = (u8)bi;
        u16* deq = value ? deq_v : deq_k;
        if (deq && lane < DV) deq[(((size_t)b * KVH + kv) * T + t) * D + g * DV + lane] = book[((size_t)bi * G + g) * DV + lane];
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode attention.
constexpr int NT = 8;  // tokens per softmax step

template <int DV>
__device__ __forceinline__ void entry(const u16* tab, int idx, float (&v)[DV]) {
    // entry idx (= code * G + g) of a [E][G][DV] float16 table in shared memory
    if constexpr (DV == 4) {
        const uint2 w = *reinterpret_cast<const uint2*>(tab + (size_t)idx * 4);
        v[0] = h2f((u16)(w.x & 0xFFFFu));
        v[1] = h2f((u16)(w.x >> 16));
        v[2] = h2f((u16)(w.y & 0xFFFFu));
        v[3] = h2f((u16)(w.y >> 16));
    } else {
        const u32 w = *reinterpret_cast<const u32*>(tab + (size_t)idx * 2);
        v[0] = h2f((u16)(w & 0xFFFFu));
        v[1] = h2f((u16)(w >> 16));
    }
}

template <int D, int DV, int R, bool LUT>
__device__ __forceinline__ void vq_attention(const u16* __restrict__ q, const u8* __restrict__ kc,
                                             const u8* __restrict__ vc, const u16* __restrict__ kbook,
                                             const u16* __restrict__ vbook, const long long* __restrict__ pos,
                                             u16* __restrict__ out, int H, int KVH, int L, int E, float qscale,
                                             int S, float* __restrict__ part) {
    constexpr int G = D / DV;
    constexpr int LPT = G < 32 ? G : 32;  // lanes per token stream
    constexpr int GPL = G / LPT;          // groups per lane
    constexpr int TS = 32 / LPT;          // token streams per warp
    constexpr int REP = LPT / NT;         // lanes holding the same token's score after the reduction
    static_assert(LPT >= NT && G % LPT == 0, "G: 16, 32 or 64 groups");
    extern __shared__ __align__(16) unsigned char smraw[];
    launch_dependents();
    grid_dependency_wait();
    const int bk = blockIdx.x, b = bk / KVH, kvh = bk % KVH;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int stream = lane / LPT, slot = lane % LPT;
    const long long p = ld_dep_s64(pos);
    const int n = p + 1 < (long long)L ? (int)(p + 1) : L;
    int lo = 0, hi = n;
    if (S > 1) {  // 32-token multiples: a stream's codes start 16-byte aligned
        const int chunk = ((n + S - 1) / S + 31) & ~31;
        lo = min(n, (int)blockIdx.y * chunk);
        hi = min(n, lo + chunk);
    }
    const u16* qrow = q + ((size_t)b * H + (size_t)kvh * R) * D;
    __shared__ float qs[R * D];  // the query rows, scaled
    // the tables: [R][E][G] float32 scores (lut) or the key entries [E][G][DV] float16 (direct); then the values
    float* lut = reinterpret_cast<float*>(smraw);
    u16* ktab = reinterpret_cast<u16*>(smraw);
    const size_t kbytes = LUT ? (size_t)R * E * G * 4 : (size_t)E * G * DV * 2;
    u16* vtab = reinterpret_cast<u16*>(smraw + kbytes);
    const u16* kb = kbook + (size_t)kvh * E * G * DV;
    const u16* vb = vbook + (size_t)kvh * E * G * DV;
    {
        const uint4* src = reinterpret_cast<const uint4*>(vb);
        uint4* dst = reinterpret_cast<uint4*>(vtab);
        for (int i = tid; i < E * G * DV / 8; i += blockDim.x) dst[i] = src[i];
    }
    float qr[R][GPL][DV];
    if constexpr (LUT) {
        for (int i = tid; i < R * D; i += blockDim.x) qs[i] = h2f(ld_dep_u16(qrow + i)) * qscale;
        __syncthreads();
        for (int i = tid; i < R * E * G; i += blockDim.x) {
            const int g = i % G, e = (i / G) % E, r = i / (E * G);
            float c[DV];
            entry<DV>(kb, e * G + g, c);  // consecutive threads: consecutive entries of the table
            float s = 0.f;
#pragma unroll
            for (int j = 0; j < DV; ++j) s = fmaf(qs[r * D + g * DV + j], c[j], s);
            lut[i] = s;
        }
    } else {
        const uint4* src = reinterpret_cast<const uint4*>(kb);
        uint4* dst = reinterpret_cast<uint4*>(ktab);
        for (int i = tid; i < E * G * DV / 8; i += blockDim.x) dst[i] = src[i];
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
            for (int gi = 0; gi < GPL; ++gi)
#pragma unroll
                for (int j = 0; j < DV; ++j)
                    qr[r][gi][j] = h2f(ld_dep_u16(qrow + (size_t)r * D + (slot + LPT * gi) * DV + j)) * qscale;
    }
    __syncthreads();

    float m[R], l[R], acc[R][GPL][DV];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        m[r] = -1.0e30f;  // finite: a masked token's -inf score then gives exp2(-inf) = 0, never NaN
        l[r] = 0.f;
#pragma unroll
        for (int gi = 0; gi < GPL; ++gi)
#pragma unroll
            for (int j = 0; j < DV; ++j) acc[r][gi][j] = 0.f;
    }
    const size_t tiles0 = ((size_t)b * KVH + kvh) * (L >> 4);
    const int step = warps * 32 * TS;
    // codes of this lane's groups for 32 tokens of its stream: 8 words per group, keys then values
    auto load = [&](int t0, u32 (&kw)[GPL][8], u32 (&vw)[GPL][8]) {
        const int ts = t0 + 32 * stream;
        const int nv = hi - ts;  // valid tokens of the 32
#pragma unroll
        for (int gi = 0; gi < GPL; ++gi) {
            if (nv > 0) {
                const size_t off = ((tiles0 + (ts >> 4)) * G + slot + LPT * gi) * 16, o2 = off + (size_t)G * 16;
                const uint4 k0 = ld_dep_v4(kc + off), k1 = ld_dep_v4(kc + o2);
                const uint4 v0 = ld_dep_v4(vc + off), v1 = ld_dep_v4(vc + o2);
                kw[gi][0] = k0.x, kw[gi][1] = k0.y, kw[gi][2] = k0.z, kw[gi][3] = k0.w;
                kw[gi][4] = k1.x, kw[gi][5] = k1.y, kw[gi][6] = k1.z, kw[gi][7] = k1.w;
                vw[gi][0] = v0.x, vw[gi][1] = v0.y, vw[gi][2] = v0.z, vw[gi][3] = v0.w;
                vw[gi][4] = v1.x, vw[gi][5] = v1.y, vw[gi][6] = v1.z, vw[gi][7] = v1.w;
            } else {
#pragma unroll
                for (int w = 0; w < 8; ++w) kw[gi][w] = vw[gi][w] = 0u;
            }
            if (nv < 32) {  // codes past the end are whatever the cache holds: code 0 stands in (score masked)
#pragma unroll
                for (int w = 0; w < 8; ++w) {
                    const int keep = nv - 4 * w;  // valid bytes of this word
                    const u32 mask = keep >= 4 ? 0xFFFFFFFFu : keep <= 0 ? 0u : (1u << (8 * keep)) - 1u;
                    kw[gi][w] &= mask;
                    vw[gi][w] &= mask;
                }
            }
        }
    };
    u32 kw[GPL][8], vw[GPL][8];
    int t0 = lo + warp * 32 * TS;
    if (t0 < hi) load(t0, kw, vw);
    for (; t0 < hi; t0 += step) {
        u32 nkw[GPL][8], nvw[GPL][8];
        if (t0 + step < hi) load(t0 + step, nkw, nvw);  // the next step's codes in flight during this one
        const int ts = t0 + 32 * stream;
#pragma unroll
        for (int sc = 0; sc < 32 / NT; ++sc) {
            float part[R][NT];
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int tok = sc * NT + j;
#pragma unroll
                for (int r = 0; r < R; ++r) part[r][j] = 0.f;
#pragma unroll
                for (int gi = 0; gi < GPL; ++gi) {
                    const int code = (kw[gi][tok >> 2] >> (8 * (tok & 3))) & 0xFF;
                    const int idx = code * G + slot + LPT * gi;
                    if constexpr (LUT) {
#pragma unroll
                        for (int r = 0; r < R; ++r) part[r][j] += lut[r * E * G + idx];
                    } else {
                        float kv[DV];
                        entry<DV>(ktab, idx, kv);
#pragma unroll
                        for (int r = 0; r < R; ++r)
#pragma unroll
                            for (int i = 0; i < DV; ++i) part[r][j] = fmaf(qr[r][gi][i], kv[i], part[r][j]);
                    }
                }
            }
            // butterfly: after the halving steps lane `slot` holds token slot / REP of the 8, then the rest sum
            float s[R], pr[R];
#pragma unroll
            for (int r = 0; r < R; ++r) {
#pragma unroll
                for (int h = NT / 2, o = LPT / 2; h >= 1; h >>= 1, o >>= 1) {
                    const bool up = (slot & o) != 0;
#pragma unroll
                    for (int i = 0; i < h; ++i) {
                        const float send = up ? part[r][i] : part[r][i + h];
                        const float keep = up ? part[r][i + h] : part[r][i];
                        part[r][i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
                    }
                }
                float a = part[r][0];
#pragma unroll
                for (int o = REP / 2; o >= 1; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                s[r] = ts + sc * NT + slot / REP < hi ? a : __int_as_float(0xff800000);  // -inf
                float mx = fmaxf(m[r], s[r]);
#pragma unroll
                for (int o = REP; o < LPT; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
                // uniform in the stream; without a branch, so that the sub-steps' work can overlap
                const float alpha = fast_exp2(m[r] - mx);
                m[r] = mx;
                pr[r] = fast_exp2(s[r] - mx);
                l[r] = fmaf(l[r], alpha, pr[r]);  // this lane's token only: summed over the lanes at the end
#pragma unroll
                for (int gi = 0; gi < GPL; ++gi)
#pragma unroll
                    for (int i = 0; i < DV; ++i) acc[r][gi][i] *= alpha;
            }
#pragma unroll
            for (int j = 0; j < NT; ++j) {
                const int tok = sc * NT + j;
                float pj[R];
#pragma unroll
                for (int r = 0; r < R; ++r) {
                    pj[r] = __shfl_sync(0xffffffffu, pr[r], j * REP, LPT);
                }
#pragma unroll
                for (int gi = 0; gi < GPL; ++gi) {
                    const int code = (vw[gi][tok >> 2] >> (8 * (tok & 3))) & 0xFF;
                    float vv[DV];
                    entry<DV>(vtab, code * G + slot + LPT * gi, vv);
#pragma unroll
                    for (int r = 0; r < R; ++r)
#pragma unroll
                        for (int i = 0; i < DV; ++i) acc[r][gi][i] = fmaf(pj[r], vv[i], acc[r][gi][i]);
                }
            }
        }
#pragma unroll
        for (int gi = 0; gi < GPL; ++gi)
#pragma unroll
            for (int w = 0; w < 8; ++w) kw[gi][w] = nkw[gi][w], vw[gi][w] = nvw[gi][w];
    }
    // each token's p was added by the REP lanes that hold it
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int o = 1; o < LPT; o <<= 1) l[r] += __shfl_xor_sync(0xffffffffu, l[r], o);
        l[r] *= 1.f / REP;
    }
    // merge the warps' streams through shared memory: y (unnormalized), m and l per query head
    __syncthreads();  // the tables are free
    const int P = warps * TS, part_id = warp * TS + stream;
    float* ys = reinterpret_cast<float*>(smraw);  // [P][R][D]
    float* ml = ys + (size_t)P * R * D;            // [P][R][2]
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int gi = 0; gi < GPL; ++gi)
#pragma unroll
            for (int i = 0; i < DV; ++i) ys[((size_t)part_id * R + r) * D + (slot + LPT * gi) * DV + i] = acc[r][gi][i];
        if (slot == 0) {
            ml[(part_id * R + r) * 2] = m[r];
            ml[(part_id * R + r) * 2 + 1] = l[r];
        }
    }
    __syncthreads();
    for (int i = tid; i < R * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        float mx = -1.0e30f;
        for (int w = 0; w < P; ++w) mx = fmaxf(mx, ml[(w * R + r) * 2]);
        float y = 0.f, ls = 0.f;
        for (int w = 0; w < P; ++w) {
            const float c = fast_exp2(ml[(w * R + r) * 2] - mx);
            y += c * ys[((size_t)w * R + r) * D + d];
            ls += c * ml[(w * R + r) * 2 + 1];
        }
        if (S == 1) {
            out[((size_t)b * H + (size_t)kvh * R + r) * D + d] = f2h(y / ls);
        } else {  // unnormalized, with its max and sum, for vq_attention_combine
            float* pp = part + (((size_t)bk * S + blockIdx.y) * R + r) * (D + 2);
            pp[d] = y;
            if (d == 0) pp[D] = mx, pp[D + 1] = ls;
        }
    }
}

// The S splits of one (sequence, KV head) merged as the warps of one block are: rescaled to the largest max.
extern "C" __global__ void __launch_bounds__(256) vq_attention_combine(const float* __restrict__ part,
                                                                       u16* __restrict__ out, int H, int KVH,
                                                                       int R, int D, int S) {
    launch_dependents();
    grid_dependency_wait();
    const int bk = blockIdx.x, b = bk / KVH, kvh = bk % KVH;
    for (int i = threadIdx.x; i < R * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        const float* pr = part + ((size_t)bk * S * R + r) * (D + 2);
        const size_t st = (size_t)R * (D + 2);
        float mx = -1.0e30f;
        for (int s = 0; s < S; ++s) mx = fmaxf(mx, ld_dep_f32(pr + s * st + D));
        float y = 0.f, ls = 0.f;
        for (int s = 0; s < S; ++s) {
            const float c = fast_exp2(ld_dep_f32(pr + s * st + D) - mx);
            y += c * ld_dep_f32(pr + s * st + d);
            ls += c * ld_dep_f32(pr + s * st + D + 1);
        }
        out[((size_t)b * H + (size_t)kvh * R + r) * D + d] = f2h(y / ls);
    }
}

// 16 warps a block for R <= 2 (the tables of one head fit twice an SM: 32 warps to hide the shuffle and load
// latencies), 8 above (registers); qtool/cuda/vq_attention.py `threads`
#define VQ_ATTENTION(FORM, LUTF, D, DV, R)                                                                          \
    extern "C" __global__ void __launch_bounds__(R <= 2 ? 512 : 256) vq_attention_##FORM##_d##D##_v##DV##_r##R(     \
        const u16* __restrict__ q, const u8* __restrict__ kc, const u8* __restrict__ vc,                          \
        const u16* __restrict__ kbook, const u16* __restrict__ vbook, const long long* __restrict__ pos,          \
        u16* __restrict__ out, int H, int KVH, int L, int E, float qscale, int S, float* __restrict__ part) {     \
        vq_attention<D, DV, R, LUTF>(q, kc, vc, kbook, vbook, pos, out, H, KVH, L, E, qscale, S, part);            \
    }
// One module per (D, DV), chosen by -DVQ_D and -DVQ_DV (qtool/cuda/vq_attention.py): a process compiles the
// shapes it runs. Query heads per KV head R: 1, 2, 3, 4 and 8 (qtool/cuda/vq_attention.py GROUPS).
#define VQ_DIRECT(D, DV)                                                                                            \
    VQ_ATTENTION(direct, false, D, DV, 1)                                                                           \
    VQ_ATTENTION(direct, false, D, DV, 2)                                                                           \
    VQ_ATTENTION(direct, false, D, DV, 3)                                                                           \
    VQ_ATTENTION(direct, false, D, DV, 4)                                                                           \
    VQ_ATTENTION(direct, false, D, DV, 8)
// the score tables where they fit one block's shared memory beside the value entries (R x 256 x G x 4 bytes;
// qtool/cuda/vq_attention.py LUT_GROUPS)
#define VQ_LUT(D, DV)                                                                                               \
    VQ_ATTENTION(lut, true, D, DV, 1)                                                                               \
    VQ_ATTENTION(lut, true, D, DV, 2)
#define VQ_LUT4(D, DV) VQ_ATTENTION(lut, true, D, DV, 4)
#if defined(VQ_D) && defined(VQ_DV)
VQ_DIRECT(VQ_D, VQ_DV)
VQ_LUT(VQ_D, VQ_DV)
#if !(VQ_D == 128 && VQ_DV == 2)
VQ_LUT4(VQ_D, VQ_DV)
#endif
#endif
