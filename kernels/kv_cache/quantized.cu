// The quantized KV cache of stage `kv_cache` (formats/qoq.md "KV cache"): the write that fills it (rotary embedding
// of queries and keys fused with the per-vector quantization) and one decode step's attention that reads it.
//
// Cache layout, per layer: codes [B, KVH, L, D * BITS / 8] u8 for keys and for values, element d of a vector in
// bits 4 (d % 2) .. of byte d / 2 for 4-bit codes (one byte per element for 8-bit codes); params [B, KVH, L, 2]
// float16: (scale, zero) of that vector, so that its value is (code - zero) * scale. An FP8 (e4m3) cache is the
// baseline: one byte per element, one float scale per tensor, no params.
//
// Decode attention (kv_attention_*): one block per sequence and KV head, holding the G = H / KVH query heads that
// share it, so each cached element is loaded and converted once for all of them (grouped-query attention). One
// pass over the cache with an online softmax: a warp's lanes split a row into WPL 32-bit words each (8 codes of 4
// bits a word), a row's lanes reduce its scores by shuffles, and each lane keeps the running max, sum and output
// columns of the rows it sees; lane groups, then warps, merge at the end. Memory-bound by design (QServe Section
// 5.3), which on sm_90 means few instructions per code: no int-to-float conversion (quarter rate), but a mask that
// makes a float x = 1 + c / f of the code where a shift has put it into the mantissa's top bits (one shift serves
// two codes: f = 2^4 and 2^8 for 4-bit codes, 2^8 for 8-bit ones), and the offsets and zero point subtracted once
// per row, not per element:
//   q . k = s (sum_d (q_d f_d) x_d - sum_d q_d f_d - z sum_d q_d)
//   sum_l p_l v_ld = f_d (sum_l w_l x_ld - sum_l w_l) - sum_l w_l z_l,   w_l = p_l s_l.
// Scores, softmax and sums in float32; one rounding to float16 at the end.
//
// Programmatic dependents (qtool/cuda/dependent_launch.py): what the kernel ahead wrote is read after the wait
// through coherent loads.
#include "common/ptx_common.cuh"

constexpr int KV_INT4 = 0, KV_INT8 = 1, KV_FP8 = 2;

template <int MODE>
struct Fmt {
    static constexpr int BITS = MODE == KV_INT4 ? 4 : 8;
    static constexpr int EPW = 32 / BITS;  // elements per 32-bit word
};

// The factor f of element e of a word: its code is f (x - 1).
template <int MODE>
__device__ __forceinline__ constexpr float factor(int e) {
    return MODE == KV_INT4 ? (e & 1 ? 256.f : 16.f) : MODE == KV_INT8 ? 256.f : 1.f;
}

__device__ __forceinline__ float mant(u32 t, u32 mask) { return __uint_as_float((t & mask) | 0x3F800000u); }

__device__ __forceinline__ u32 rotl(u32 w, int s) { return __funnelshift_l(w, w, s); }

// The EPW elements of word w as floats: x = 1 + c / f(e) for integer codes (exact), the values for e4m3.
template <int MODE>
__device__ __forceinline__ void unpack(u32 w, float* x) {
    if constexpr (MODE == KV_INT4) {
        // codes 2j+1 land in mantissa bits 15-18 (f = 2^8), codes 2j in bits 19-22 (f = 2^4)
        constexpr u32 LO = 0x00078000u, HI = 0x00780000u;
        const u32 r = rotl(w, 19), a = w << 11, b = w << 3, c = w >> 5;
        x[0] = mant(r, HI);
        x[7] = mant(r, LO);
        x[1] = mant(a, LO);
        x[2] = mant(a, HI);
        x[3] = mant(b, LO);
        x[4] = mant(b, HI);
        x[5] = mant(c, LO);
        x[6] = mant(c, HI);
    } else if constexpr (MODE == KV_INT8) {
        constexpr u32 M = 0x007F8000u;  // bits 15-22
        x[0] = mant(w << 15, M);
        x[1] = mant(w << 7, M);
        x[2] = mant(w >> 1, M);
        x[3] = mant(w >> 9, M);
    } else {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            u32 h2 = 0;
#if __CUDA_ARCH__ >= 890  // e4m3 conversions (sm_89+); qtool/cuda/kv_cache.py refuses fp8 below
            const u16 pair = (u16)(w >> (16 * j));
            asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pair));
#endif
            x[2 * j] = h2f((u16)(h2 & 0xFFFFu));
            x[2 * j + 1] = h2f((u16)(h2 >> 16));
        }
    }
}

__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

template <int WPL>
__device__ __forceinline__ void load_words(u32 (&w)[WPL], const u32* p) {
    if constexpr (WPL == 2) {
        u32 a, b;
        asm volatile("ld.global.v2.u32 {%0, %1}, [%2];" : "=r"(a), "=r"(b) : "l"(p));
        w[0] = a;
        w[1] = b;
    } else {
        w[0] = ld_dep_u32(p);
    }
}

// MODE: cache format; G: query heads per KV head; U: rows a lane loads before it uses them (one memory latency per
// U rows); WPL: words per lane (2 halves the per-row work of shuffles, scale conversions and exponentials per code,
// at twice the registers for the query and the output columns).
template <int MODE, int G, int U, int WPL>
__device__ __forceinline__ void kv_attention(const u16* __restrict__ q, const u32* __restrict__ kc,
                                             const u32* __restrict__ vc, const u32* __restrict__ kp,
                                             const u32* __restrict__ vp, const long long* __restrict__ pos,
                                             u16* __restrict__ out, int H, int KVH, int L, int D, float qscale,
                                             float kscale, float vscale) {
    constexpr int EPW = Fmt<MODE>::EPW, EPL = EPW * WPL;
    constexpr bool INT = MODE != KV_FP8;
    extern __shared__ float sm[];
    launch_dependents();
    grid_dependency_wait();
    const int bk = blockIdx.x, b = bk / KVH, kvh = bk % KVH;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const int W = D / EPW;  // words per row
    int lpr = 1;
    while (lpr * WPL < W) lpr <<= 1;  // lanes per row (a power of two: rows reduce by xor shuffles)
    const int rpi = 32 / lpr, sub = lane % lpr, rw = lane / lpr;
    const bool active = sub * WPL < W;
    const long long p = ld_dep_s64(pos);
    const int n = p + 1 < (long long)L ? (int)(p + 1) : L;

    // this lane's query elements times their factors (scaled: softmax in log2), and per head the sums of the
    // query and of the query times the factors
    float qr[G][EPL], qsum[G], qfsum[G];
    float* qs = sm;                // [G][D] staging, reused for the merge below
    float* sums = sm + G * D;      // [G][2]
    for (int i = tid; i < G * D; i += blockDim.x)
        qs[i] = h2f(ld_dep_u16(q + ((size_t)b * H + (size_t)kvh * G) * D + i)) * qscale;
    __syncthreads();
    for (int g = warp; g < G; g += warps) {
        float s = 0.f, sf = 0.f;
        for (int d = lane; d < D; d += 32) {
            s += qs[g * D + d];
            sf += qs[g * D + d] * factor<MODE>(d % EPW);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            s += __shfl_xor_sync(0xffffffffu, s, o);
            sf += __shfl_xor_sync(0xffffffffu, sf, o);
        }
        if (lane == 0) {
            sums[2 * g] = s;
            sums[2 * g + 1] = sf;
        }
    }
    __syncthreads();
#pragma unroll
    for (int g = 0; g < G; ++g) {
        qsum[g] = sums[2 * g];
        qfsum[g] = sums[2 * g + 1];
#pragma unroll
        for (int e = 0; e < EPL; ++e)
            qr[g][e] = active ? qs[g * D + sub * EPL + e] * factor<MODE>(e % EPW) : 0.f;
    }
    __syncthreads();

    // running state of this lane: max m and sum l (log2 domain), and the weighted sums of x, of w and of w z
    float m[G], l[G], ws[G], wz[G], acc[G][EPL];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = -1.0e30f;  // finite: a masked row's -inf score then gives exp2(-inf) = 0, never NaN
        l[g] = ws[g] = wz[g] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[g][e] = 0.f;
    }
    const size_t row0 = ((size_t)b * KVH + kvh) * L;
    const u32* K = kc + row0 * W + sub * WPL;
    const u32* V = vc + row0 * W + sub * WPL;
    const int step = warps * rpi * U;
    // the loop bound is the warp's, not the lane's: every lane takes part in the row reductions' shuffles
    for (int lb = warp * rpi * U; lb < n; lb += step) {
        const int l0 = lb + rw;
        u32 kw[U][WPL], vw[U][WPL], kpar[U], vpar[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int r = l0 + u * rpi;
            const bool ok = r < n && active;
#pragma unroll
            for (int j = 0; j < WPL; ++j) kw[u][j] = vw[u][j] = 0u;
            if (ok) {
                load_words<WPL>(kw[u], K + (size_t)r * W);
                load_words<WPL>(vw[u], V + (size_t)r * W);
            }
            if constexpr (INT) {
                kpar[u] = r < n ? ld_dep_u32(kp + row0 + r) : 0u;
                vpar[u] = r < n ? ld_dep_u32(vp + row0 + r) : 0u;
            }
        }
        float sc[U][G];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float x[EPL];
#pragma unroll
            for (int j = 0; j < WPL; ++j) unpack<MODE>(kw[u][j], x + j * EPW);
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float a = 0.f;
#pragma unroll
                for (int e = 0; e < EPL; ++e) a = fmaf(qr[g][e], x[e], a);
                for (int o = lpr >> 1; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
                if constexpr (INT) {
                    const float s = h2f((u16)(kpar[u] & 0xFFFFu)), z = h2f((u16)(kpar[u] >> 16));
                    a = s * (a - qfsum[g] - z * qsum[g]);
                } else {
                    a *= kscale;
                }
                sc[u][g] = l0 + u * rpi < n ? a : __uint_as_float(0xFF800000u);  // -inf
            }
        }
#pragma unroll
        for (int g = 0; g < G; ++g) {
            float mn = m[g];
#pragma unroll
            for (int u = 0; u < U; ++u) mn = fmaxf(mn, sc[u][g]);
            const float alpha = fast_exp2(m[g] - mn);
            m[g] = mn;
            l[g] *= alpha;
            ws[g] *= alpha;
            wz[g] *= alpha;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] *= alpha;
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            float x[EPL];
#pragma unroll
            for (int j = 0; j < WPL; ++j) unpack<MODE>(vw[u][j], x + j * EPW);
            float vs = vscale, vz = 0.f;
            if constexpr (INT) {
                vs = h2f((u16)(vpar[u] & 0xFFFFu));
                vz = h2f((u16)(vpar[u] >> 16));
            }
#pragma unroll
            for (int g = 0; g < G; ++g) {
                const float pr = fast_exp2(sc[u][g] - m[g]);
                l[g] += pr;
                const float w = pr * vs;
                if constexpr (INT) {
                    ws[g] += w;
                    wz[g] = fmaf(w, vz, wz[g]);
                }
#pragma unroll
                for (int e = 0; e < EPL; ++e) acc[g][e] = fmaf(w, x[e], acc[g][e]);
            }
        }
    }
    // merge the rpi row groups of the warp (lanes with the same word index)
    for (int o = lpr; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float wso = __shfl_xor_sync(0xffffffffu, ws[g], o);
            const float wzo = __shfl_xor_sync(0xffffffffu, wz[g], o);
            const float mn = fmaxf(m[g], mo), a = fast_exp2(m[g] - mn), c = fast_exp2(mo - mn);
            m[g] = mn;
            l[g] = l[g] * a + lo * c;
            ws[g] = ws[g] * a + wso * c;
            wz[g] = wz[g] * a + wzo * c;
#pragma unroll
            for (int e = 0; e < EPL; ++e) acc[g][e] = acc[g][e] * a + __shfl_xor_sync(0xffffffffu, acc[g][e], o) * c;
        }
    }
    // then the warps, through shared memory: y (the unnormalized output), m and l per head
    float* ys = sm;                  // [warps][G][D]
    float* ml = sm + warps * G * D;  // [warps][G][2]
    if (rw == 0) {
#pragma unroll
        for (int g = 0; g < G; ++g) {
            if (active)
#pragma unroll
                for (int e = 0; e < EPL; ++e)
                    ys[(warp * G + g) * D + sub * EPL + e] =
                        INT ? factor<MODE>(e % EPW) * (acc[g][e] - ws[g]) - wz[g] : acc[g][e];
            if (sub == 0) {
                ml[(warp * G + g) * 2] = m[g];
                ml[(warp * G + g) * 2 + 1] = l[g];
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += blockDim.x) {
        const int g = i / D, d = i % D;
        float mx = -1.0e30f;
        for (int w = 0; w < warps; ++w) mx = fmaxf(mx, ml[(w * G + g) * 2]);
        float y = 0.f, ls = 0.f;
        for (int w = 0; w < warps; ++w) {
            const float c = fast_exp2(ml[(w * G + g) * 2] - mx);
            y += c * ys[(w * G + g) * D + d];
            ls += c * ml[(w * G + g) * 2 + 1];
        }
        out[((size_t)b * H + (size_t)kvh * G + g) * D + d] = f2h(y / ls);
    }
}

#define KV_ATTENTION(NAME, MODE, G, WPL)                                                                            \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                         \
        const u16* __restrict__ q, const u32* __restrict__ kc, const u32* __restrict__ vc,                        \
        const u32* __restrict__ kp, const u32* __restrict__ vp, const long long* __restrict__ pos,                 \
        u16* __restrict__ out, int H, int KVH, int L, int D, float qscale, float kscale, float vscale) {          \
        kv_attention<MODE, G, 4, WPL>(q, kc, vc, kp, vp, pos, out, H, KVH, L, D, qscale, kscale, vscale);          \
    }
// two words a lane where the query and output registers allow it (G <= 2), one otherwise
#define KV_ATTENTION_ALL_G(PREFIX, MODE)                                                                            \
    KV_ATTENTION(PREFIX##_g1, MODE, 1, 1)                                                                           \
    KV_ATTENTION(PREFIX##_g2, MODE, 2, 1)                                                                           \
    KV_ATTENTION(PREFIX##_g3, MODE, 3, 1)                                                                           \
    KV_ATTENTION(PREFIX##_g4, MODE, 4, 1)                                                                           \
    KV_ATTENTION(PREFIX##_g5, MODE, 5, 1)                                                                           \
    KV_ATTENTION(PREFIX##_g6, MODE, 6, 1)                                                                           \
    KV_ATTENTION(PREFIX##_g7, MODE, 7, 1)                                                                           \
    KV_ATTENTION(PREFIX##_g8, MODE, 8, 1)                                                                           \
    KV_ATTENTION(PREFIX##_g1_w2, MODE, 1, 2)                                                                        \
    KV_ATTENTION(PREFIX##_g2_w2, MODE, 2, 2)

KV_ATTENTION_ALL_G(kv_attention_int4, KV_INT4)
KV_ATTENTION_ALL_G(kv_attention_int8, KV_INT8)
KV_ATTENTION_ALL_G(kv_attention_fp8, KV_FP8)

// ---------------------------------------------------------------------------------------------------------------
// The write: rotary embedding of queries and keys (rotate-half pairing, each product and sum rounded to float16
// as torch's half arithmetic does, like kernels/decoder/rope_cache.cu) and the quantization of each key and value
// vector of one token and one KV head, bit-identical to qtool/runtime/kv_cache.py `quantize_kv`:
//   scale = f16((max - min) / (2^b - 1)) (1 for a constant vector, 2^-24 if it rounds to 0),
//   zero = f16(-min / scale) (f16(-min) for a constant vector), code = clamp(rint(x / scale + zero), 0, 2^b - 1),
// in float32 with IEEE division. One warp per vector (queries, keys, values of a token), lanes over the
// rotate-half pairs; qkv [B, T, H + 2 KVH, D] float16, positions pos [T]; queries go to q [B, H, T, D].
// `deq_k`/`deq_v` (nullable, [B, KVH, T, D] float16) receive the dequantized keys and values of these tokens, what
// prefill attention reads so that it sees what later decode steps see. FP8: code = e4m3(x / scale), satfinite.
template <int MODE>
__device__ __forceinline__ void kv_write(const u16* __restrict__ qkv, const u16* __restrict__ cos_t,
                                         const u16* __restrict__ sin_t, const long long* __restrict__ pos,
                                         u16* __restrict__ q, u8* __restrict__ kc, u8* __restrict__ vc,
                                         u16* __restrict__ kp, u16* __restrict__ vp, u16* __restrict__ deq_k,
                                         u16* __restrict__ deq_v, int B, int T, int H, int KVH, int D, int L,
                                         float kscale, float vscale) {
    constexpr int BITS = Fmt<MODE>::BITS;
    constexpr int MAXQ = (1 << BITS) - 1;
    constexpr int PPL = 4;  // rotate-half pairs per lane: D <= 256
    extern __shared__ u8 codes_sm[];  // [warps][D] codes of each warp's vector
    launch_dependents();
    grid_dependency_wait();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    u8* my = codes_sm + warp * D;
    const int half = D >> 1, heads = H + 2 * KVH;
    const long long vectors = (long long)B * T * heads;
    for (long long vec = (long long)blockIdx.x * warps + warp; vec < vectors; vec += (long long)gridDim.x * warps) {
        const int hh = (int)(vec % heads);
        const long long bt = vec / heads;
        const int t = (int)(bt % T), b = (int)(bt / T);
        const u16* src = qkv + vec * D;
        const long long p = ld_dep_s64(pos + t);
        const bool value = hh >= H + KVH;
        u16 o[PPL][2];
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
            const int i = lane + 32 * j;
            if (i >= half) continue;
            const u16 x1 = ld_dep_u16(src + i), x2 = ld_dep_u16(src + i + half);
            if (value) {
                o[j][0] = x1;
                o[j][1] = x2;
            } else {
                const u16 c = cos_t[p * half + i], s = sin_t[p * half + i];
                const float a1 = h2f(f2h(h2f(x1) * h2f(c))), b1 = h2f(f2h(h2f(x2) * h2f(s)));
                const float a2 = h2f(f2h(h2f(x2) * h2f(c))), b2 = h2f(f2h(h2f(x1) * h2f(s)));
                o[j][0] = f2h(a1 - b1);
                o[j][1] = f2h(a2 + b2);
            }
        }
        if (hh < H) {  // a query: rotated, not quantized
            u16* dst = q + (((size_t)b * H + hh) * T + t) * D;
#pragma unroll
            for (int j = 0; j < PPL; ++j) {
                const int i = lane + 32 * j;
                if (i < half) {
                    dst[i] = o[j][0];
                    dst[i + half] = o[j][1];
                }
            }
            continue;
        }
        const int kv = value ? hh - H - KVH : hh - H;
        const size_t row = ((size_t)b * KVH + kv) * L + p;
        float s = value ? vscale : kscale, z = 0.f;
        if constexpr (MODE != KV_FP8) {
            float lo = 3.0e38f, hi = -3.0e38f;
#pragma unroll
            for (int j = 0; j < PPL; ++j)
                if (lane + 32 * j < half)
#pragma unroll
                    for (int k = 0; k < 2; ++k) {
                        lo = fminf(lo, h2f(o[j][k]));
                        hi = fmaxf(hi, h2f(o[j][k]));
                    }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) {
                lo = fminf(lo, __shfl_xor_sync(0xffffffffu, lo, off));
                hi = fmaxf(hi, __shfl_xor_sync(0xffffffffu, hi, off));
            }
            u16 sh, zh;
            if (hi <= lo) {
                sh = f2h(1.f);
                zh = f2h(-lo);
            } else {
                sh = f2h(__fdiv_rn(__fsub_rn(hi, lo), (float)MAXQ));
                if (sh == 0) sh = 1;  // the smallest subnormal: 2^-24
                zh = f2h(__fdiv_rn(-lo, h2f(sh)));
            }
            s = h2f(sh);
            z = h2f(zh);
            if (lane == 0) {
                u16* par = value ? vp : kp;
                par[row * 2] = sh;
                par[row * 2 + 1] = zh;
            }
        }
        u16* deq = value ? deq_v : deq_k;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
            const int i = lane + 32 * j;
            if (i >= half) continue;
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const float x = h2f(o[j][k]);
                u8 c;
                float back;
                if constexpr (MODE != KV_FP8) {
                    const float qf = fminf(fmaxf(rintf(__fadd_rn(__fdiv_rn(x, s), z)), 0.f), (float)MAXQ);
                    c = (u8)qf;
                    back = (qf - z) * s;
                } else {
                    u16 pr = 0;
                    u32 h2 = 0;
#if __CUDA_ARCH__ >= 890
                    const float y = __fdiv_rn(x, s);
                    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(pr) : "f"(0.f), "f"(y));
                    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(pr));
#endif
                    c = (u8)(pr & 0xFFu);
                    back = h2f((u16)(h2 & 0xFFFFu)) * s;
                }
                my[i + k * half] = c;
                if (deq) deq[(((size_t)b * KVH + kv) * T + t) * D + i + k * half] = f2h(back);
            }
        }
        __syncwarp();
        u8* dst = (value ? vc : kc) + row * (D * BITS / 8);
        if constexpr (BITS == 4) {
            for (int i = lane; i < half; i += 32) dst[i] = (u8)(my[2 * i] | (my[2 * i + 1] << 4));
        } else {
            for (int i = lane; i < D; i += 32) dst[i] = my[i];
        }
        __syncwarp();
    }
}

#define KV_WRITE(NAME, MODE)                                                                                        \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                                         \
        const u16* __restrict__ qkv, const u16* __restrict__ cos_t, const u16* __restrict__ sin_t,                \
        const long long* __restrict__ pos, u16* __restrict__ q, u8* __restrict__ kc, u8* __restrict__ vc,         \
        u16* __restrict__ kp, u16* __restrict__ vp, u16* __restrict__ deq_k, u16* __restrict__ deq_v, int B,      \
        int T, int H, int KVH, int D, int L, float kscale, float vscale) {                                          \
        kv_write<MODE>(qkv, cos_t, sin_t, pos, q, kc, vc, kp, vp, deq_k, deq_v, B, T, H, KVH, D, L, kscale,         \
                       vscale);                                                                                     \
    }

KV_WRITE(kv_write_int4, KV_INT4)
KV_WRITE(kv_write_int8, KV_INT8)
KV_WRITE(kv_write_fp8, KV_FP8)

// ---------------------------------------------------------------------------------------------------------------
// Decode attention over a KV4 cache on the tensor cores (kv_attention_tc_int4_d*), for 1..8 query heads per KV
// head: the CUDA-core kernel above spends 2G float32 FMAs per code, more than the FMA pipe delivers at DRAM rate
// once G >= 4 (Llama-3-8B: 0.41x SDPA at batch 64). Here `mma.sync.m16n8k16` (float16 in, float32 accumulate) does
// both products with the codes as the A operand (16 tokens, or 16 channels, as its rows) and the G heads as the 8
// columns of B, so every register of A is cache data and a code costs a fraction of an instruction whatever G is.
// The kernel is bound by the instructions a code costs (conversion, MMA, softmax): they are what to cut.
//   Scores, transposed (per warp, 16 tokens a step): Sᵀ = C·Qᵀ with A = the key codes as exact float16
//   (0x6400 | nibble, minus 1024, four nibbles of a word per LOP3): a thread (group g = lane / 4, t = lane % 4)
//   holds words t·D/32 .. of tokens g and g + 8 (one 16-byte read each at D = 128); the channels a conversion puts
//   in a register pair are not the MMA's consecutive k, so the query's B fragments are gathered in the same order
//   (channels 8w, 8w+4 | 8w+1, 8w+5 for word w's first k-step, 8w+2, 8w+6 | 8w+3, 8w+7 for its second). Then
//   s = qscale · s_n (S - z_n Σq) for tokens g, g + 8 and heads 2t, 2t + 1; the softmax runs per head over the
//   step's 16 tokens (a max across the 8 groups by three shuffles).
//   Output, transposed: Oᵀ = Cᵥᵀ·(P·diag(s))ᵀ - Σ_n p_n s_n z_n: B is P·diag(s) rounded to float16 and transposed
//   in registers (movmatrix: the scores' C fragment of tokens x heads becomes B's heads x tokens), A the value
//   codes: a thread holds words g·D/64 .. of tokens 2t, 2t+1, 2t+8, 2t+9 and pairs tokens per register by PRMT, so
//   for word i and byte j, rows g and g + 8 of the m-tile are channels 8 (g·D/64 + i) + 2j and + 1, and the
//   accumulator's columns are heads 2t, 2t + 1, the same heads as the thread's scores (its rescaling needs no
//   exchange).
// One block of NW warps (4, or 8 where the pairs alone do not fill the GPU) per (sequence, KV head); each warp
// streams its 16-token steps (every NW-th)
// through a ring of TC_STAGES shared-memory stages filled by bulk copies, which one lane issues TC_STAGES steps
// ahead, and the warps merge through shared memory at the end. Where those blocks are too few to fill the GPU
// (batch 1: Llama-3-8B has 8 KV heads), a grid of S blocks per pair splits the cache along L; each writes its
// unnormalized output with its max and sum, and kv_attention_tc_combine merges the S parts the same way.
// The _c{CS} entries fill a stage with CS consecutive steps, four copies in all (key rows, value rows, each
// parameter run), where the one-step form issues four a step: a warp then takes a contiguous run of steps.
// stages of each warp's ring of bulk copies (qtool/kv_cache/cuda.py TC_STAGES)
#ifndef TC_STAGES
#define TC_STAGES 2
#endif
// where the rings start in shared memory: after the query rows, their sums and the barriers of NW warps (128-byte
// aligned)
#define TC_RING_OFFSET(D, NW) ((16 * (D) + 64 + 8 * TC_STAGES * (NW) + 127) / 128 * 128)

__device__ __forceinline__ void mma16816(float (&d)[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// An 8x8 float16 matrix held as an MMA fragment (lane g·4 + t: row g, columns 2t, 2t + 1), transposed.
__device__ __forceinline__ u32 movmatrix_t(u32 x) {
    u32 r;
    asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
    return r;
}

// The nibbles at bits 0-3 and 16-19 of w as float16 1024 + c (exact), and those at bits 4-7 and 20-23 as
// 1024 + 16 c (exact: the spacing of float16 in [1024, 2048) is 1): one LOP3 a pair, no shift. For keys the 1024 is
// subtracted once per token (with the zero point, through the query's sum), for values by a HSUB2; the factor 16 of
// the odd channels is divided out of the query (keys) or the output (values), both exactly (powers of two).
__device__ __forceinline__ u32 nib_lo(u32 w) {
    u32 r;
    asm("lop3.b32 %0, %1, 0x000F000F, 0x64006400, 0xEA;" : "=r"(r) : "r"(w));
    return r;
}

__device__ __forceinline__ u32 nib_hi(u32 w) {
    u32 r;
    asm("lop3.b32 %0, %1, 0x00F000F0, 0x64006400, 0xEA;" : "=r"(r) : "r"(w));
    return r;
}

__device__ __forceinline__ u32 pack_h2(float lo, float hi) { return (u32)f2h(lo) | ((u32)f2h(hi) << 16); }

// One warp's 16-token step of the cache as a thread takes it from the warp's shared-memory stage: key words of
// tokens t0 + g and t0 + 8 + g with their (scale, zero) pairs, value words of tokens t0 + 2t, +1, +8, +9 and the
// (scale, zero) pairs of values of tokens t0 + g, t0 + 8 + g.
template <int D>
struct TcStep {
    u32 kw[2][D / 32];
    u32 vw[4][D / 64];
    u32 kp[2], vp[2];
};

// A stage of a warp's ring: CS consecutive steps' key rows, value rows, and (scale, zero) words of keys and of
// values, each run of 16 CS copied from the 16-byte boundary at or below its first token (up to 3 words ahead of it,
// 16 CS + 4 slots).
template <int D, int CS = 1>
struct TcStage {
    static constexpr int ROW = D / 2;                 // bytes per cached row
    static constexpr int PW = 4 * (16 * CS + 4);      // bytes of one parameter run
    static constexpr int K = 0, V = 16 * CS * ROW, KP = 32 * CS * ROW, VP = KP + PW;
    static constexpr int BYTES = KP + 2 * PW;
};

// The CS steps from t0 (their tokens below `hi`) into stage `dst`, completing on `bar`: one thread, four bulk
// copies (keys and values, and their parameters, are four tensors).
template <int D, int CS = 1>
__device__ __forceinline__ void tc_issue(u32 dst, u32 bar, const u32* __restrict__ kc, const u32* __restrict__ vc,
                                         const u32* __restrict__ kp, const u32* __restrict__ vp, size_t row0,
                                         int t0, int hi) {
    using St = TcStage<D, CS>;
    const u32 nt = (u32)min(16 * CS, hi - t0);
    const size_t a = row0 + t0, a0 = a & ~(size_t)3;
    const u32 pbytes = (((u32)(a - a0) + nt) * 4 + 15) & ~15u;
    mbar_arrive_expect_tx(bar, 2 * nt * St::ROW + 2 * pbytes);
    const char* kb = reinterpret_cast<const char*>(kc) + a * St::ROW;
    const char* vb = reinterpret_cast<const char*>(vc) + a * St::ROW;
    bulk_load(dst + St::K, kb, nt * St::ROW, bar);
    bulk_load(dst + St::V, vb, nt * St::ROW, bar);
    bulk_load(dst + St::KP, kp + a0, pbytes, bar);
    bulk_load(dst + St::VP, vp + a0, pbytes, bar);
}

template <int N>
__device__ __forceinline__ void lds_words(u32 (&w)[N], u32 addr) {
    if constexpr (N == 4) {
        const uint4 v = lds128(addr);
        w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
    } else if constexpr (N == 2) {
        const uint2 v = lds64(addr);
        w[0] = v.x, w[1] = v.y;
    } else {
        w[0] = lds32(addr);
    }
}

// This thread's part of step j of the stage at `src` (the stage's first token at word `o` of its parameter runs)
template <int D, int CS = 1>
__device__ __forceinline__ void tc_read(TcStep<D>& s, u32 src, u32 o, int j, int g, int t) {
    using St = TcStage<D, CS>;
    constexpr int KW = D / 32, VW = D / 64;
    const u32 r0 = 16 * j;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        lds_words<KW>(s.kw[h], src + St::K + (r0 + 8 * h + g) * St::ROW + 4 * KW * t);
        s.kp[h] = lds32(src + St::KP + 4 * (o + r0 + 8 * h + g));
        s.vp[h] = lds32(src + St::VP + 4 * (o + r0 + 8 * h + g));
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const u32 r = r0 + 2 * t + (i & 1) + 8 * (i >> 1);
        lds_words<VW>(s.vw[i], src + St::V + r * St::ROW + 4 * VW * g);
    }
}

// The running softmax state of one thread for heads 2t and 2t + 1: max, its tokens' share of the sum and of Σ p s z
// (summed over the groups at the end), and the output fragments (m-tile 4i + j: channels 8 (g·D/64 + i) + 2j and,
// times 16, + 1).
template <int D>
struct TcAcc {
    float mrun[2], lrun[2], wz[2];
    float o[D / 16][4];
};

template <int D>
__device__ __forceinline__ void tc_compute(TcAcc<D>& a, const TcStep<D>& s, const u32 (&qb)[D / 16][2],
                                           const float (&qsum)[2], const float (&qbias)[2], float qscale, int t0,
                                           int hi, int g, int t) {
    constexpr int KW = D / 32, VW = D / 64;
    float sc[4] = {0.f, 0.f, 0.f, 0.f};  // tokens g (0, 1) and g + 8 (2, 3) x heads 2t, 2t + 1
#pragma unroll
    for (int i = 0; i < KW; ++i) {
        const u32 w0 = s.kw[0][i], w1 = s.kw[1][i], u0 = w0 >> 8, u1 = w1 >> 8;
        mma16816(sc, nib_lo(w0), nib_lo(w1), nib_hi(w0), nib_hi(w1), qb[2 * i][0], qb[2 * i][1]);
        mma16816(sc, nib_lo(u0), nib_lo(u1), nib_hi(u0), nib_hi(u1), qb[2 * i + 1][0], qb[2 * i + 1][1]);
    }
    // tokens past the range get no weight: a stage's slots there hold what an earlier step (or nothing) left
    float x[4], mx[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const bool in = t0 + 8 * h + g < hi;
        const float ks = h2f((u16)(s.kp[h] & 0xFFFFu)), kz = h2f((u16)(s.kp[h] >> 16));
#pragma unroll
        for (int e = 0; e < 2; ++e)
            x[2 * h + e] = in ? qscale * (ks * (sc[2 * h + e] - fmaf(kz, qsum[e], qbias[e])))
                              : __uint_as_float(0xFF800000u);
    }
    float alpha[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float m = fmaxf(x[e], x[2 + e]);
#pragma unroll
        for (int sh = 4; sh < 32; sh <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, sh));
        mx[e] = fmaxf(a.mrun[e], m);
        alpha[e] = fast_exp2(a.mrun[e] - mx[e]);
        a.mrun[e] = mx[e];
        a.lrun[e] *= alpha[e];
        a.wz[e] *= alpha[e];
    }
    // the output is rescaled only when some head's max grew in this step (after the first steps, seldom)
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
        for (int m4 = 0; m4 < D / 16; ++m4) {
#pragma unroll
            for (int e = 0; e < 2; ++e) a.o[m4][e] *= alpha[e], a.o[m4][2 + e] *= alpha[e];
        }
    }
    float pw[4];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const bool in = t0 + 8 * h + g < hi;
        const float vs = in ? h2f((u16)(s.vp[h] & 0xFFFFu)) : 0.f, vz = in ? h2f((u16)(s.vp[h] >> 16)) : 0.f;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const float pr = fast_exp2(x[2 * h + e] - mx[e]);
            a.lrun[e] += pr;
            pw[2 * h + e] = pr * vs;
            a.wz[e] = fmaf(pw[2 * h + e], vz, a.wz[e]);
        }
    }
    // B of the output: heads x tokens (2t, 2t + 1 | 2t + 8, 2t + 9), the transposes of the scores' two 8x8 halves
    const u32 pb0 = movmatrix_t(pack_h2(pw[0], pw[1])), pb1 = movmatrix_t(pack_h2(pw[2], pw[3]));
#pragma unroll
    for (int i = 0; i < VW; ++i) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const u32 sel = (u32)j | ((u32)(4 + j) << 8);
            u32 y01, y23;
            asm("prmt.b32 %0, %1, %2, %3;" : "=r"(y01) : "r"(s.vw[0][i]), "r"(s.vw[1][i]), "r"(sel));
            asm("prmt.b32 %0, %1, %2, %3;" : "=r"(y23) : "r"(s.vw[2][i]), "r"(s.vw[3][i]), "r"(sel));
            // values exact (c and 16c): with the 1024 left in, the accumulator's rounding at 1024 Σ p s came
            // through the subtraction above float16 rounding of the output
            mma16816(a.o[4 * i + j], f16x2_sub(nib_lo(y01), 0x64006400u), f16x2_sub(nib_hi(y01), 0x64006400u),
                     f16x2_sub(nib_lo(y23), 0x64006400u), f16x2_sub(nib_hi(y23), 0x64006400u), pb0, pb1);
        }
    }
}

template <int D, int NW, int CS>
__device__ __forceinline__ void kv_attention_tc(const u16* __restrict__ q, const u32* __restrict__ kc,
                                                const u32* __restrict__ vc, const u32* __restrict__ kp,
                                                const u32* __restrict__ vp, const long long* __restrict__ pos,
                                                u16* __restrict__ out, int H, int KVH, int L, int G, float qscale,
                                                int S, float* __restrict__ part, int early) {
    constexpr int KW = D / 32;  // key words per thread and token: k-steps 2i, 2i + 1 per word
    constexpr int VW = D / 64;  // value words per thread and token
    extern __shared__ float sm[];
    launch_dependents();
    grid_dependency_wait();
    const int bk = blockIdx.x, b = bk / KVH, kvh = bk % KVH;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const long long p = ld_dep_s64(pos);
    const int n = p + 1 < (long long)L ? (int)(p + 1) : L;
    // this block's tokens lo .. hi - 1: all of them, or split S of the cache in 16-token multiples (the split is
    // known at graph capture, the length only on the device; trailing splits may be empty)
    int lo = 0, hi = n;
    if (S > 1) {
        const int chunk = ((n + S - 1) / S + 15) & ~15;
        lo = min(n, (int)blockIdx.y * chunk);
        hi = min(n, lo + chunk);
    }
    const size_t row0 = ((size_t)b * KVH + kvh) * L;
    // shared memory: the query rows [8][D] u16, their sums [8], each warp's TC_STAGES barriers, then each warp's
    // ring of TC_STAGES stages (which the merge at the end reuses)
    using St = TcStage<D, CS>;
    const u32 base = smem_addr(sm);
    const u32 bars = base + 16 * D + 64 + 8 * TC_STAGES * warp;
    const u32 ring = base + TC_RING_OFFSET(D, NW) + St::BYTES * TC_STAGES * warp;
    // This warp's tokens: from first, below end, in stages STRIDE apart. One step a stage (CS = 1): every NW-th step
    // of the block's range. CS steps a stage: a stage is one copy from each tensor, so its steps must be consecutive
    // tokens, and the warp takes a contiguous run of the block's steps (the last warps' runs may be shorter or
    // empty; the merge at the end does not depend on which warp saw which token).
    int first, end;
    constexpr int STRIDE = CS == 1 ? 16 * NW : 16 * CS;
    if constexpr (CS == 1) {
        first = lo + 16 * warp;
        end = hi;
    } else {
        const int per = ((hi - lo + 15) / 16 + NW - 1) / NW;  // steps a warp
        first = min(hi, lo + 16 * per * warp);
        end = min(hi, first + 16 * per);
    }
    const int stages = first < end ? (end - first + STRIDE - 1) / STRIDE : 0;
    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < TC_STAGES; ++i) mbar_init(bars + 8 * i, 1);
        mbar_init_fence();
        // the first stages' copies go out before the query is staged: their latency overlaps the staging. With CS
        // steps a stage, `early` of them (the rest once the query is staged): the first stage alone holds CS steps
        // of work, and the copies lane 0 issues here delay its warp's share of the staging
        for (int k = 0; k < min(stages, CS == 1 ? TC_STAGES : early); ++k)
            tc_issue<D, CS>(ring + St::BYTES * k, bars + 8 * k, kc, vc, kp, vp, row0, first + k * STRIDE, end);
    }
    // the query rows staged with the odd channels divided by 16 (exactly: they meet key codes times 16), the
    // sum of each row and 1024 times the sum of its staged form (the 1024 in every key code), the warps taking the
    // rows in turn
    u16* qs = reinterpret_cast<u16*>(sm);  // [8][D]
    float* qsum_s = sm + 4 * D;           // [8]
    float* qbias_s = qsum_s + 8;          // [8]
    // 16 bytes a thread (D / 8 pieces a row, at most one round trip to memory per thread): staged one half at a
    // time, a block-wide loop of 2-byte loads took 1.5-5 us of an H200 block's 6-33
    for (int i = tid; i < D; i += blockDim.x) {
        const int r = i / (D / 8), c = 8 * (i % (D / 8));
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (r < G) v = ld_dep_v4(q + ((size_t)b * H + (size_t)kvh * G + r) * D + c);
        u32 w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j)
            w[j] = (w[j] & 0xFFFFu) | ((u32)f2h(h2f((u16)(w[j] >> 16)) * 0.0625f) << 16);
        *reinterpret_cast<uint4*>(qs + r * D + c) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    __syncthreads();
    for (int r = warp; r < 8; r += NW) {
        float sum = 0.f, staged = 0.f;
        for (int d = lane; d < D; d += 32) {
            const float v = h2f(qs[r * D + d]);
            staged += v;
            sum += (d & 1) ? 16.f * v : v;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            sum += __shfl_xor_sync(0xffffffffu, sum, o);
            staged += __shfl_xor_sync(0xffffffffu, staged, o);
        }
        if (lane == 0) qsum_s[r] = sum, qbias_s[r] = 1024.f * staged;
    }
    // B fragments of the scores (head g): k-step 2i (word w = KW t + i) and 2i + 1
    u32 qb[2 * KW][2];
#pragma unroll
    for (int i = 0; i < KW; ++i) {
        const u16* qr = qs + g * D + 8 * (KW * t + i);
        qb[2 * i][0] = (u32)qr[0] | ((u32)qr[4] << 16);
        qb[2 * i][1] = (u32)qr[1] | ((u32)qr[5] << 16);
        qb[2 * i + 1][0] = (u32)qr[2] | ((u32)qr[6] << 16);
        qb[2 * i + 1][1] = (u32)qr[3] | ((u32)qr[7] << 16);
    }
    __syncthreads();
    if constexpr (CS > 1) {
        if (lane == 0)
            for (int k = early; k < min(stages, TC_STAGES); ++k)
                tc_issue<D, CS>(ring + St::BYTES * k, bars + 8 * k, kc, vc, kp, vp, row0, first + k * STRIDE, end);
    }
    const float qsum[2] = {qsum_s[2 * t], qsum_s[2 * t + 1]}, qbias[2] = {qbias_s[2 * t], qbias_s[2 * t + 1]};
    TcAcc<D> acc;
#pragma unroll
    for (int e = 0; e < 2; ++e) acc.mrun[e] = -1.0e30f, acc.lrun[e] = acc.wz[e] = 0.f;
#pragma unroll
    for (int m = 0; m < D / 16; ++m) acc.o[m][0] = acc.o[m][1] = acc.o[m][2] = acc.o[m][3] = 0.f;
    TcStep<D> st;
    if constexpr (CS == 1) {
        // each step: wait for its stage, take this thread's part into registers, hand the stage to the copy of the
        // step TC_STAGES later, compute
        for (int k = 0; k < stages; ++k) {
            const int stage = k % TC_STAGES, t0 = first + k * STRIDE;
            const u32 src = ring + St::BYTES * stage, bar = bars + 8 * stage;
            mbar_wait(bar, (u32)(k / TC_STAGES) & 1u);
            tc_read<D>(st, src, (u32)((row0 + t0) & 3), 0, g, t);
            __syncwarp();
            if (lane == 0 && k + TC_STAGES < stages)
                tc_issue<D>(src, bar, kc, vc, kp, vp, row0, t0 + TC_STAGES * STRIDE, end);
            tc_compute<D>(acc, st, qb, qsum, qbias, qscale, t0, end, g, t);
        }
    } else {
        const int steps = first < end ? (end - first + 15) / 16 : 0;
        const u32 o = (u32)((row0 + first) & 3);  // every stage starts a multiple of 16 tokens after the first
        // per step: wait for its stage at the stage's first step, take this thread's part into registers, after the
        // stage's last step is read hand the stage to the copies of the stage TC_STAGES later, compute
        for (int k = 0; k < steps; ++k) {
            const int c = k / CS, j = k % CS, stage = c % TC_STAGES, t0 = first + 16 * k;
            const u32 src = ring + St::BYTES * stage, bar = bars + 8 * stage;
            if (j == 0) mbar_wait(bar, (u32)(c / TC_STAGES) & 1u);
            tc_read<D, CS>(st, src, o, j, g, t);
            if (j == CS - 1 || k == steps - 1) {
                __syncwarp();
                if (lane == 0 && (c + TC_STAGES) * CS < steps)
                    tc_issue<D, CS>(src, bar, kc, vc, kp, vp, row0, first + (c + TC_STAGES) * STRIDE, end);
            }
            tc_compute<D>(acc, st, qb, qsum, qbias, qscale, t0, end, g, t);
        }
    }
    // each head's sums over the eight groups
#pragma unroll
    for (int e = 0; e < 2; ++e) {
#pragma unroll
        for (int sh = 4; sh < 32; sh <<= 1) {
            acc.lrun[e] += __shfl_xor_sync(0xffffffffu, acc.lrun[e], sh);
            acc.wz[e] += __shfl_xor_sync(0xffffffffu, acc.wz[e], sh);
        }
    }
    __syncthreads();  // every ring's copies are consumed: the rings are free
    float* ys = sm + TC_RING_OFFSET(D, NW) / 4;  // [NW][8][D]
    float* ml = ys + NW * 8 * D;       // [NW][8][2]
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        const int head = 2 * t + e;
        if (head < G) {
#pragma unroll
            for (int i = 0; i < VW; ++i) {
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const int ch = 8 * (VW * g + i) + 2 * j;
                    ys[(warp * 8 + head) * D + ch] = acc.o[4 * i + j][e] - acc.wz[e];
                    ys[(warp * 8 + head) * D + ch + 1] = acc.o[4 * i + j][2 + e] * 0.0625f - acc.wz[e];
                }
            }
            if (g == 0) {
                ml[(warp * 8 + head) * 2] = acc.mrun[e];
                ml[(warp * 8 + head) * 2 + 1] = acc.lrun[e];
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < G * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        float mxx = -1.0e30f;
        for (int w = 0; w < NW; ++w) mxx = fmaxf(mxx, ml[(w * 8 + r) * 2]);
        float y = 0.f, ls = 0.f;
        for (int w = 0; w < NW; ++w) {
            const float c = fast_exp2(ml[(w * 8 + r) * 2] - mxx);
            y += c * ys[(w * 8 + r) * D + d];
            ls += c * ml[(w * 8 + r) * 2 + 1];
        }
        if (S == 1) {
            // H = KVH G, so row b H + kvh G is bk G: the _c entries then hold no quotient across the loop (D = 64
            // at 4 warps spilled b at 72 registers)
            const size_t row = CS == 1 ? (size_t)b * H + (size_t)kvh * G : (size_t)bk * G;
            out[(row + r) * D + d] = f2h(y / ls);
        } else {  // unnormalized, with its max and sum, for kv_attention_tc_combine
            float* pr = part + (((size_t)bk * S + blockIdx.y) * 8 + r) * (D + 2);
            pr[d] = y;
            if (d == 0) pr[D] = mxx, pr[D + 1] = ls;
        }
    }
}

// The S splits of one (sequence, KV head) merged as the warps of one block are: rescaled to the largest max.
template <int D>
__device__ __forceinline__ void kv_attention_tc_combine(const float* __restrict__ part, u16* __restrict__ out,
                                                        int H, int KVH, int G, int S) {
    launch_dependents();
    grid_dependency_wait();
    const int bk = blockIdx.x, b = bk / KVH, kvh = bk % KVH;
    for (int i = threadIdx.x; i < G * D; i += blockDim.x) {
        const int r = i / D, d = i % D;
        const u32* pr = reinterpret_cast<const u32*>(part) + ((size_t)bk * S * 8 + r) * (D + 2);
        const size_t step = 8 * (size_t)(D + 2);
        float mxx = -1.0e30f;
        for (int s = 0; s < S; ++s) mxx = fmaxf(mxx, __uint_as_float(ld_dep_u32(pr + s * step + D)));
        float y = 0.f, ls = 0.f;
        for (int s = 0; s < S; ++s) {
            const float c = fast_exp2(__uint_as_float(ld_dep_u32(pr + s * step + D)) - mxx);
            y += c * __uint_as_float(ld_dep_u32(pr + s * step + d));
            ls += c * __uint_as_float(ld_dep_u32(pr + s * step + D + 1));
        }
        out[((size_t)b * H + (size_t)kvh * G + r) * D + d] = f2h(y / ls);
    }
}

#define KV_ATTENTION_TC(D, NW)                                                                                      \
    extern "C" __global__ void __launch_bounds__(32 * NW) kv_attention_tc_int4_d##D##_w##NW(                      \
        const u16* __restrict__ q, const u32* __restrict__ kc, const u32* __restrict__ vc,                        \
        const u32* __restrict__ kp, const u32* __restrict__ vp, const long long* __restrict__ pos,                 \
        u16* __restrict__ out, int H, int KVH, int L, int G, float qscale, int S, float* __restrict__ part) {    \
        kv_attention_tc<D, NW, 1>(q, kc, vc, kp, vp, pos, out, H, KVH, L, G, qscale, S, part, TC_STAGES);         \
    }
// CS steps a stage: half (CS = 2) or a quarter (CS = 4) of the copies a step, CS times the shared memory in a
// warp's ring; `early`: the stages (1 .. TC_STAGES) whose copies go out before the query is staged. MINB: the blocks
// a multiprocessor that the one-step entry's registers allow (NVRTC 12.9, sm_90a: 108 at D = 128, 72 / 77 at D = 64
// with 4 / 8 warps), so that the registers cost no block (the shared memory may: kv_cache/NOTES.md).
#define KV_ATTENTION_TC_C(D, NW, CS, MINB)                                                                          \
    extern "C" __global__ void __launch_bounds__(32 * NW, MINB) kv_attention_tc_int4_d##D##_w##NW##_c##CS(        \
        const u16* __restrict__ q, const u32* __restrict__ kc, const u32* __restrict__ vc,                        \
        const u32* __restrict__ kp, const u32* __restrict__ vp, const long long* __restrict__ pos,                 \
        u16* __restrict__ out, int H, int KVH, int L, int G, float qscale, int S, float* __restrict__ part,      \
        int early) {                                                                                                \
        kv_attention_tc<D, NW, CS>(q, kc, vc, kp, vp, pos, out, H, KVH, L, G, qscale, S, part, early);             \
    }
#define KV_ATTENTION_TC_COMBINE(D)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256) kv_attention_tc_combine_d##D(                                \
        const float* __restrict__ part, u16* __restrict__ out, int H, int KVH, int G, int S) {                     \
        kv_attention_tc_combine<D>(part, out, H, KVH, G, S);                                                       \
    }
KV_ATTENTION_TC(64, 4)
KV_ATTENTION_TC(64, 8)
KV_ATTENTION_TC(128, 4)
KV_ATTENTION_TC(128, 8)
KV_ATTENTION_TC_C(64, 4, 2, 7)
KV_ATTENTION_TC_C(64, 8, 2, 3)
KV_ATTENTION_TC_C(128, 4, 2, 4)
KV_ATTENTION_TC_C(128, 8, 2, 2)
KV_ATTENTION_TC_C(64, 4, 4, 7)
KV_ATTENTION_TC_C(64, 8, 4, 3)
KV_ATTENTION_TC_C(128, 4, 4, 4)
KV_ATTENTION_TC_C(128, 8, 4, 2)
KV_ATTENTION_TC_COMBINE(64)
KV_ATTENTION_TC_COMBINE(128)
