// QoQ W4A8 decode GEMV (formats/qoq.md; dispatch in qtool/cuda/qoq.py gemv / gemv_codes): 1..4 tokens, one warp
// per weight row on the CUDA cores, `dp4a.u32.s32` on unsigned weight bytes against the INT8 activation codes.
//
// Two forms, the same dot products:
//   * qoq_gemv_<scheme>_m<MT>: takes the float16 rows and quantizes them itself (a separate quantize kernel costs
//     2-4 us at one token, about as much as streaming a 4096 x 4096 layer's 8 MB of codes). Each thread loads all
//     its pieces of the rows at once into registers (one L2 round trip, not one per piece), the block reduces
//     max|x|, and the codes and their sums come from the same registers, bit for bit the quantize kernel's.
//   * qoq_gemv_codes_<scheme>_m<MT>: takes the codes, s_x and code sums that the kernel producing the rows wrote
//     (RMSNorm, SwiGLU: qoq/act.cuh) and copies the codes into shared memory.
// Either way every weight load of a lane's first U chunks is issued before the activations are read: the weights
// do not come from the kernel ahead (dependent launch), the activations do.
//
// Activation codes come in the GEMM's order (qtool/cuda/quik.py act_positions): inside each 32-code chunk the even
// codes first, then the odd ones, so a weight word's low nibbles (codes 8j, 8j+2, ..) meet bytes 4j.. and its high
// nibbles bytes 16 + 4j.. of the chunk. In shared memory each run of 32 chunks keeps their even halves, then their
// odd halves (chunk c at 1024 (c / 32) + 16 (c % 32), + 512 for the odd half; rows kps = kp rounded up to 1024
// bytes apart), so the lanes of a warp, which take consecutive chunks, read consecutive 16 bytes (a 32-byte stride
// costs two shared-memory wavefronts per load) at a constant offset from one address.
// Weights: per channel the codes q themselves (z·rowsum comes off at the end). Progressive groups, by GS:
//   GS = 0: Q8hat + 128 = q·s1 + (128 - z·s1) formed per byte by one IMAD per 4 codes, then dp4a;
//   GS = 1: the chunk's Σ q·qx by dp4a on the raw nibbles, then s1·Σ + (128 - z·s1)·Σqx per chunk (Σqx of each
//           chunk from the activation side, once per block) — the same integer, two IMADs per chunk instead of 8.
// 128·rowsum comes off at the end. The int32 sums are exact in any order.
// Contract (qtool/cuda/qoq.py gemv_reason / gemv_codes_reason): fused form K % 8 == 0, x rows 16-byte aligned;
// codes rows kp bytes (kp = K rounded up to 128, zero past K), 16-byte aligned.
#include "common/ptx_common.cuh"
#include "qoq/act.cuh"

enum : int { QG_PC = 1 };  // the scheme parameter QOQ: QG_PC per channel, else the group size

// One 16-byte weight chunk (32 codes) of row f against chunk c of every token's codes.
__device__ __forceinline__ int qg_at(int c) { return 1024 * (c >> 5) + 16 * (c & 31); }  // chunk c's even half

// qa: the chunk's even half in token 0's row (qs + qg_at(c))
template <int QOQ, int MT, int GS>
__device__ __forceinline__ void qg_chunk(int (&acc)[MT], const uint4& w, u32 gw, const char* qa, const int* es,
                                         int kp, int kps, int c) {
    const u32 wv[4] = {w.x, w.y, w.z, w.w};
    u32 lo[4], hi[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) lo[j] = wv[j] & 0x0F0F0F0Fu, hi[j] = (wv[j] >> 4) & 0x0F0F0F0Fu;
    if constexpr (QOQ != QG_PC && GS == 0) {
        const u32 cw = __byte_perm(gw, 0u, 0x0000u), s1 = (gw >> 8) & 0xFFu;
#pragma unroll
        for (int j = 0; j < 4; ++j) lo[j] = imad(lo[j], s1, cw), hi[j] = imad(hi[j], s1, cw);
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        const char* at = qa + (size_t)m * kps;
        const uint4 a0 = *reinterpret_cast<const uint4*>(at);
        const uint4 a1 = *reinterpret_cast<const uint4*>(at + 512);
        const u32 al[4] = {a0.x, a0.y, a0.z, a0.w}, ah[4] = {a1.x, a1.y, a1.z, a1.w};
        if constexpr (QOQ != QG_PC && GS == 1) {
            int d = 0;
#pragma unroll
            for (int j = 0; j < 4; ++j) d = dp4a_us(lo[j], al[j], d), d = dp4a_us(hi[j], ah[j], d);
            const int e = es[m * (kp >> 5) + c];
            acc[m] = (int)imad((u32)d, (gw >> 8) & 0xFFu, (u32)acc[m]);
            acc[m] = (int)imad((u32)e, gw & 0xFFu, (u32)acc[m]);
        } else {
#pragma unroll
            for (int j = 0; j < 4; ++j)
                acc[m] = dp4a_us(lo[j], al[j], acc[m]), acc[m] = dp4a_us(hi[j], ah[j], acc[m]);
        }
    }
}

// Sum of the 8 codes of a piece (GS chunk sums) over the 4 pieces of a chunk: threads t, t^1, t^2, t^3 hold them.
__device__ __forceinline__ int qg_chunk_sum4(int s) {
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    return s + __shfl_xor_sync(0xffffffffu, s, 2);
}

// Fused form: the MT float16 rows -> codes (GEMM positions) in qs, chunk sums in es (GS), s_x and code sums.
// XR pieces of 8 columns per thread and token are loaded at once; rows longer than QG_NT·XR pieces take more rounds
// (later rounds are read again for the codes).
template <int NW, int MT, int XR, int GS>
__device__ __forceinline__ void qg_quantize(const u16* __restrict__ x, int ldx, int M, int K, int kp, int kps,
                                            char* qs, int* es, float (*fred)[NW], int (*ired)[NW], float (&sxv)[MT],
                                            int (&rsv)[MT]) {
    constexpr int QG_NT = 32 * NW;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int pieces = K >> 3, kpieces = kp >> 3;
    auto load = [&](uint4 (&v)[MT][XR], int base) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int i = 0; i < XR; ++i) {
                const int p = base + tid + QG_NT * i;
                v[m][i] = m < M && p < pieces ? ld_dep_v4(x + (size_t)m * ldx + 8 * p) : make_uint4(0u, 0u, 0u, 0u);
            }
    };
    auto amax = [&](const uint4 (&v)[MT][XR], float (&am)[MT]) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int i = 0; i < XR; ++i)
#pragma unroll
                for (int h = 0; h < 8; ++h) {
                    float a;
                    asm("abs.f32 %0, %1;" : "=f"(a) : "f"(h2f(half_of(v[m][i], h))));
                    am[m] = qa_max(am[m], a);
                }
    };
    float r[MT];
    auto codes = [&](const uint4 (&v)[MT][XR], int base, int (&cs)[MT]) {
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int i = 0; i < XR; ++i) {
                const int p = base + tid + QG_NT * i;
                int q[8], s = 0;
#pragma unroll
                for (int h = 0; h < 8; ++h) q[h] = qa_code(h2f(half_of(v[m][i], h)), r[m]), s += q[h];
                cs[m] += s;
                if (GS) s = qg_chunk_sum4(s);  // every lane: the loop bounds are the same for the whole block
                if (p < kpieces) {
                    const u32 ev = (u32)(q[0] & 0xFF) | (u32)(q[2] & 0xFF) << 8 | (u32)(q[4] & 0xFF) << 16 |
                                   (u32)(q[6] & 0xFF) << 24;
                    const u32 od = (u32)(q[1] & 0xFF) | (u32)(q[3] & 0xFF) << 8 | (u32)(q[5] & 0xFF) << 16 |
                                   (u32)(q[7] & 0xFF) << 24;
                    char* dst = qs + (size_t)m * kps + qg_at(p >> 2) + 4 * (p & 3);
                    *reinterpret_cast<u32*>(dst) = ev;
                    *reinterpret_cast<u32*>(dst + 512) = od;
                    if (GS && (p & 3) == 0) es[m * (kp >> 5) + (p >> 2)] = s;
                }
            }
    };
    uint4 v[MT][XR];
    float am[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) am[m] = 0.f;
    load(v, 0);
    amax(v, am);
    for (int base = QG_NT * XR; base < pieces; base += QG_NT * XR) {
        uint4 t[MT][XR];
        load(t, base);
        amax(t, am);
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) am[m] = qa_max(am[m], __shfl_xor_sync(0xffffffffu, am[m], o));
        if (lane == 0) fred[m][warp] = am[m];
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        float a = fred[m][0];
#pragma unroll
        for (int i = 1; i < NW; ++i) a = qa_max(a, fred[m][i]);
        r[m] = a > 0.f ? qa_div_rn(127.f, a) : 1.0f;
        sxv[m] = a > 0.f ? qa_div_rn(a, 127.f) : 1.0f;
    }
    int cs[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) cs[m] = 0;
    codes(v, 0, cs);  // round 0 also writes the zero codes of pieces K/8 .. kp/8 when they fall in it
    for (int base = QG_NT * XR; base < kpieces; base += QG_NT * XR) {
        uint4 t[MT][XR];
        load(t, base);
        codes(t, base, cs);
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        cs[m] = warp_sum_i32(cs[m]);
        if (lane == 0) ired[m][warp] = cs[m];
    }
    __syncthreads();
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        int t = 0;
#pragma unroll
        for (int i = 0; i < NW; ++i) t += ired[m][i];
        rsv[m] = t;
    }
}

// Codes form: MT rows of kp code bytes (row stride lda) into qs; chunk sums into es (GS); s_x and sums from sxa/rsa.
template <int NW, int MT, int GS>
__device__ __forceinline__ void qg_copy_codes(const char* __restrict__ A, int lda, const float* __restrict__ sxa,
                                              const int* __restrict__ rsa, int M, int kp, int kps, char* qs,
                                              int* es,
                                              float (&sxv)[MT], int (&rsv)[MT]) {
    constexpr int R = 4, QG_NT = 32 * NW;  // R: 16-byte pieces per thread loaded at once
    const int tid = threadIdx.x;
    const int rp = kp >> 4, total = MT * rp;  // both even: a chunk's two pieces sit in threads t, t^1
    for (int base = 0; base < total; base += QG_NT * R) {
        uint4 v[R];
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int q = base + tid + QG_NT * i, m = q / rp;
            v[i] = q < total && m < M ? ld_dep_v4(A + (size_t)m * lda + 16 * (q - m * rp)) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int i = 0; i < R; ++i) {
            const int q = base + tid + QG_NT * i, m = q / rp;
            int s = 0;
            if (GS) {
                s = dp4a_ss(v[i].x, 0x01010101u, dp4a_ss(v[i].y, 0x01010101u, 0));
                s = dp4a_ss(v[i].z, 0x01010101u, dp4a_ss(v[i].w, 0x01010101u, s));
                s += __shfl_xor_sync(0xffffffffu, s, 1);
            }
            if (q < total) {
                const int h = q - m * rp;  // piece of the row: half h & 1 of chunk h / 2
                *reinterpret_cast<uint4*>(qs + (size_t)m * kps + qg_at(h >> 1) + 512 * (h & 1)) = v[i];
                if (GS && (h & 1) == 0) es[m * (kp >> 5) + (h >> 1)] = s;
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
        sxv[m] = m < M ? ld_dep_f32(sxa + m) : 1.f;
        rsv[m] = m < M ? (int)ld_dep_u32(reinterpret_cast<const u32*>(rsa + m)) : 0;
    }
    __syncthreads();
}

template <int NW, int QOQ, int MT, int U, bool CODES, int GS>
__device__ __forceinline__ void qg_body(const u16* __restrict__ x, int ldx, const char* __restrict__ A, int lda,
                                        const float* __restrict__ sxa, const int* __restrict__ rsa, int M, int K,
                                        int kp, const u32* __restrict__ W, int ldw, const int* __restrict__ G,
                                        int ldg, int N, const u16* __restrict__ sw, const int* __restrict__ zeros,
                                        const u16* __restrict__ bias, void* __restrict__ out, int ldc, int raw) {
    extern __shared__ __align__(16) char qs[];  // MT rows of kps code bytes, then (GS) MT x kp / 32 chunk sums
    __shared__ float fred[MT][NW];
    __shared__ int ired[MT][NW];
    constexpr int GSX = QOQ != QG_PC ? GS : 0;
    const int kps = (kp + 1023) & ~1023;
    int* es = reinterpret_cast<int*>(qs + (size_t)MT * kps);
    launch_dependents();
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int f = (int)blockIdx.x * NW + warp;
    const bool valid = f < N;
    const int chunks = kp >> 5;  // 16-byte weight chunks of a row (32 codes each)
    const uint4* wrow = reinterpret_cast<const uint4*>(W + (size_t)(valid ? f : 0) * ldw);
    const int* grow = G + (size_t)(valid ? f : 0) * ldg;
    // Group words: the 32·U chunks of one pass span GW words of the row; the warp loads them coalesced (GW / 32 a
    // lane) and each chunk takes its word by a shuffle, instead of a 4-byte load per chunk.
    constexpr int GQ = QOQ != QG_PC ? QOQ : 128;
    constexpr int GW = QOQ != QG_PC ? (32 * U * 32 / GQ > 32 ? 32 * U * 32 / GQ : 32) : 32;
    const int groups = kp / GQ;
    u32 gwl[GW / 32];
    auto load_groups = [&](int c0) {
#pragma unroll
        for (int v = 0; v < GW / 32; ++v) {
            const int i = 32 * c0 / GQ + 32 * v + lane;
            gwl[v] = QOQ != QG_PC && valid && i < groups ? (u32)__ldg(grow + i) : 0u;
        }
    };
    // the weight side first: it does not come from the kernel ahead
    uint4 w[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        const int c = lane + 32 * u;
        w[u] = valid && c < chunks ? ld_nc_v4(wrow + c) : make_uint4(0u, 0u, 0u, 0u);
    }
    load_groups(0);
    float s0 = 0.f, bf = 0.f;
    int zc = 128;
    if (valid && lane < MT) {
        s0 = h2f(sw[f]);
        bf = bias != nullptr ? h2f(bias[f]) : 0.f;
        if (QOQ == QG_PC) zc = zeros[f];
    }
    grid_dependency_wait();  // the activations come from the kernel ahead
    float sxv[MT];
    int rsv[MT];
    if constexpr (CODES) {
        qg_copy_codes<NW, MT, GSX>(A, lda, sxa, rsa, M, kp, kps, qs, es, sxv, rsv);
    } else {
        // pieces of 8 columns per thread and token held in registers: rows of up to 16384 columns in one round
        constexpr int XR = (NW >= 16 ? 4 : 8) / MT > 0 ? (NW >= 16 ? 4 : 8) / MT : 1;
        qg_quantize<NW, MT, XR, GSX>(x, ldx, M, K, kp, kps, qs, es, fred, ired, sxv, rsv);
    }
    int acc[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m] = 0;
    if (valid) {
        for (int c0 = 0; c0 < chunks; c0 += 32 * U) {
            const char* qa = qs + qg_at(c0 + lane);  // chunk c0 + lane + 32u: + 1024u
            if (c0 > 0) {
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    const int c = c0 + lane + 32 * u;
                    if (c < chunks) w[u] = ld_nc_v4(wrow + c);
                }
                load_groups(c0);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int c = c0 + lane + 32 * u;
                // chunk c's group, (c - c0)·32 / g of this pass: register u·32 / g, lane ((lane + 32u)·32 / g) % 32
                const u32 gw = QOQ != QG_PC
                                   ? __shfl_sync(0xffffffffu, gwl[(32 * u) / GQ], ((lane + 32 * u) * 32 / GQ) & 31)
                                   : 0u;
                if (c < chunks) qg_chunk<QOQ, MT, GSX>(acc, w[u], gw, qa + 1024 * u, es, kp, kps, c);
            }
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[m] = warp_sum_i32(acc[m]);
    if (!valid || lane >= MT || lane >= M) return;
    const int m = lane;  // lane m writes token m (values picked with constant indices)
    int a = acc[0], rs = rsv[0];
    float sx1 = sxv[0];
#pragma unroll
    for (int i = 1; i < MT; ++i)
        if (m == i) a = acc[i], sx1 = sxv[i], rs = rsv[i];
    a -= zc * rs;
    if (raw) {
        reinterpret_cast<int*>(out)[(size_t)m * ldc + f] = a;
        return;
    }
    // the layout's order with one rounding per operation (no contraction into an fma)
    float sc, y;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(sc) : "f"(sx1), "f"(s0));
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(y) : "f"((float)a), "f"(sc));
    asm("add.rn.f32 %0, %1, %2;" : "=f"(y) : "f"(y), "f"(bf));
    reinterpret_cast<u16*>(out)[(size_t)m * ldc + f] = f2h(y);
}

#define QG_ARGS                                                                                                  \
    const u16 *x, int ldx, const char *A, int lda, const float *sxa, const int *rsa, int M, int K, int kp,        \
        const u32 *W, int ldw, const int *G, int ldg, int N, const u16 *sw, const int *zeros, const u16 *bias,    \
        void *out, int ldc, int raw
#define QG_PASS x, ldx, A, lda, sxa, rsa, M, K, kp, W, ldw, G, ldg, N, sw, zeros, bias, out, ldc, raw

// The dispatched forms, per form (F fused, C codes) and token slots MT: QG_<form><MT>_W warps (= weight rows) per
// block, _U 16-byte weight chunks in flight per lane, _GS group sums, _B minimum blocks per multiprocessor; set by
// qtool/cuda/qoq.py GEMV_CONFIG (the defaults here are for a direct build), chosen by the sweep in kernels/NOTES.md.
#ifndef QG_F1_W
#define QG_F1_W 16
#endif
#ifndef QG_F1_U
#define QG_F1_U 4
#endif
#ifndef QG_F1_GS
#define QG_F1_GS 0
#endif
#ifndef QG_F1_B
#define QG_F1_B 2
#endif
#ifndef QG_F2_W
#define QG_F2_W 16
#endif
#ifndef QG_F2_U
#define QG_F2_U 4
#endif
#ifndef QG_F2_GS
#define QG_F2_GS 0
#endif
#ifndef QG_F2_B
#define QG_F2_B 2
#endif
#ifndef QG_F4_W
#define QG_F4_W 16
#endif
#ifndef QG_F4_U
#define QG_F4_U 4
#endif
#ifndef QG_F4_GS
#define QG_F4_GS 0
#endif
#ifndef QG_F4_B
#define QG_F4_B 1
#endif
#ifndef QG_C1_W
#define QG_C1_W 8
#endif
#ifndef QG_C1_U
#define QG_C1_U 4
#endif
#ifndef QG_C1_GS
#define QG_C1_GS 1
#endif
#ifndef QG_C1_B
#define QG_C1_B 5
#endif
#ifndef QG_C2_W
#define QG_C2_W 8
#endif
#ifndef QG_C2_U
#define QG_C2_U 4
#endif
#ifndef QG_C2_GS
#define QG_C2_GS 0
#endif
#ifndef QG_C2_B
#define QG_C2_B 4
#endif
#ifndef QG_C4_W
#define QG_C4_W 8
#endif
#ifndef QG_C4_U
#define QG_C4_U 8
#endif
#ifndef QG_C4_GS
#define QG_C4_GS 0
#endif
#ifndef QG_C4_B
#define QG_C4_B 1
#endif
#define QG_ENTRY(NAME, QOQ, MT, FORM, PRE, CODES)                                                                \
    extern "C" __global__ void __launch_bounds__(32 * QG_##FORM##MT##_W, QG_##FORM##MT##_B)                       \
        qoq_gemv_##PRE##NAME##_m##MT(QG_ARGS) {                                                                  \
        qg_body<QG_##FORM##MT##_W, QOQ, MT, QG_##FORM##MT##_U, CODES, QG_##FORM##MT##_GS>(QG_PASS);              \
    }
#define QG_ENTRIES(NAME, QOQ)                      \
    QG_ENTRY(NAME, QOQ, 1, F, , false)             \
    QG_ENTRY(NAME, QOQ, 2, F, , false)             \
    QG_ENTRY(NAME, QOQ, 4, F, , false)             \
    QG_ENTRY(NAME, QOQ, 1, C, codes_, true)        \
    QG_ENTRY(NAME, QOQ, 2, C, codes_, true)        \
    QG_ENTRY(NAME, QOQ, 4, C, codes_, true)
QG_ENTRIES(pc, QG_PC)
QG_ENTRIES(g32, 32)
QG_ENTRIES(g64, 64)
QG_ENTRIES(g128, 128)

// Measurement builds (QOQ_GEMV_TUNING, qtool/bench/qoq_gemv_variants.py): (warps, form, U, GS) for the A/B sweep.
#ifndef QOQ_GEMV_TUNING
#define QOQ_GEMV_TUNING 0
#endif
#if QOQ_GEMV_TUNING
#define QG_TUNE(NAME, QOQ, MT, NW, CODES, U, GS)                                                                 \
    extern "C" __global__ void __launch_bounds__(32 * NW)                                                        \
        qoq_gemv_tune_##NAME##_m##MT##_w##NW##_c##CODES##_u##U##_gs##GS(QG_ARGS) {                               \
        qg_body<NW, QOQ, MT, U, (CODES != 0), GS>(QG_PASS);                                                      \
    }
#define QG_TUNES(NAME, QOQ, MT, NW, CODES) \
    QG_TUNE(NAME, QOQ, MT, NW, CODES, 4, 0) \
    QG_TUNE(NAME, QOQ, MT, NW, CODES, 8, 0) \
    QG_TUNE(NAME, QOQ, MT, NW, CODES, 4, 1) \
    QG_TUNE(NAME, QOQ, MT, NW, CODES, 8, 1)
#define QG_TUNES_PC(MT, NW, CODES) \
    QG_TUNE(pc, QG_PC, MT, NW, CODES, 4, 0) \
    QG_TUNE(pc, QG_PC, MT, NW, CODES, 8, 0)
QG_TUNES_PC(1, 8, 0)
QG_TUNES_PC(1, 16, 0)
QG_TUNES_PC(1, 8, 1)
QG_TUNES(g128, 128, 1, 8, 0)
QG_TUNES(g128, 128, 1, 16, 0)
QG_TUNES(g128, 128, 1, 8, 1)
QG_TUNES_PC(2, 8, 0)
QG_TUNES_PC(2, 16, 0)
QG_TUNES_PC(2, 8, 1)
QG_TUNES(g128, 128, 2, 8, 0)
QG_TUNES(g128, 128, 2, 16, 0)
QG_TUNES(g128, 128, 2, 8, 1)
QG_TUNES_PC(4, 8, 0)
QG_TUNES_PC(4, 16, 0)
QG_TUNES_PC(4, 8, 1)
QG_TUNES(g128, 128, 4, 8, 0)
QG_TUNES(g128, 128, 4, 16, 0)
QG_TUNES(g128, 128, 4, 8, 1)
#endif
