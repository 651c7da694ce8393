// The W4A8 GEMMs of the `qoq` layout (formats/qoq.md) and the quantize kernel that writes their activation rows:
// per-token symmetric INT8 activation codes with their code sums, times 4-bit weights on the INT8 tensor cores
// (`wgmma ... s32.u8.s8`, Hopper), with the zero-point correction and the per-token x per-channel scaling in the
// epilogue. The decode GEMV for 1-4 tokens is qoq/gemv.cu.
//
// Compiled at run time by NVRTC for sm_90a (qtool/cuda/compile.py). The kernels instantiate the INT8 wgmma engine
// (common/int8_wgmma.cuh) with QoQ's weight scheme (Int8Scheme<4, G> below) and its activation codes
// (ActCodes<SYM_A8>). Dispatch: qtool/layouts/qoq/cuda.py.

#include "common/int8_wgmma.cuh"
#include "qoq/act.cuh"

// ---------------------------------------------------------------------------------------------------------------
// Per-token symmetric 8-bit codes (the engine's quantize_rows): clamp(rint(x·r), -127, 127) with r = 127 / max|x|
// and x·r one rounded product (qa_code, qoq/act.cuh: the producing kernels' codes are the same bit for bit),
// s_x = max|x| / 127 into sx and the row's code sum into rsum; no outlier columns (oflag all zero, ko = kop = 0).
// dest: each column's byte position (the order the GEMM's weights unpack in, qtool/layouts/qoq/cuda.py).
// ---------------------------------------------------------------------------------------------------------------
constexpr int SYM_A8 = 0;

template <>
struct ActCodes<SYM_A8> {
    static constexpr bool SUMS = true;
    __device__ static __forceinline__ void scale(float lo, float hi, float& s, float& y) {
        // hi >= lo, so max|x| = max(hi, -lo); y is r = 127 / max|x|
        const float amax = fmax_(hi, -lo);
        s = amax > 0.f ? div_rn(amax, 127.0f) : 1.0f;
        y = amax > 0.f ? div_rn(127.0f, amax) : 1.0f;
    }
    __device__ static __forceinline__ void put(u16 h, int d, float, float y, char* cs, u16*, int& csum) {
        const int q = qa_code(h2f(h), y);
        cs[d] = (char)q;
        csum += q;
    }
    __device__ static __forceinline__ void row_sums(int csum, int* rsred, int tid) {
        csum = warp_sum_i32(csum);
        if ((tid & 31) == 0) rsred[tid >> 5] = csum;
    }
    template <int W>
    __device__ static __forceinline__ void row_stats(int row, float, const int* rsred, float*, int* rsum) {
        int t = 0;
#pragma unroll
        for (int w = 0; w < W; ++w) t += rsred[w];
        rsum[row] = t;
    }
};

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
// QoQ's 4-bit weight schemes for the engine (qtool/layouts/qoq/cuda.py, formats/qoq.md), by G: QOQ_PC per-channel
// u4 weights (the u8 codes q straight into `wgmma ... u8.s8`; z[n]·rowsum[t] comes off in the epilogue), any larger
// value the progressive group size g (32, 64, 128): per group, Q8hat + 128 = q·s1 + (128 - z·s1) as u8, by one
// IMAD per 4 codes (products <= 240 and sums <= 255: no carries between bytes), and 128·rowsum[t] comes off in the
// epilogue. The group words (byte 0: 128 - z·s1, byte 1: s1) of a stage are the engine's side words, 128 / g per
// row: they reach the kernel as GemmArgs::Wo (row stride ldwo bytes) or stage-major (`gst`). The epilogue works on
// the exact int32 products Σ qx·Wint, so split-K shares add as integers.
// ---------------------------------------------------------------------------------------------------------------
enum : int { QOQ_PC = 1 };

// A fragments of the stage's 4 k-steps j for rows r0 and r0 + 8: a0/a1 hold k = 4t..4t+3 of rows r0/r0+8, a2/a3
// k = 16+4t..16+4t+3: word 4j+t of the stage row, unsigned: low nibbles w & 0x0F0F0F0F -> a0/a1, high
// (w >> 4) & 0x0F0F0F0F -> a2/a3 (the order the activation codes sit in), then for progressive groups one IMAD
// each with the group of k-step j (32 codes lie in one group: g >= 32).
template <int G>
__device__ __forceinline__ void qoq_frags(u32 (&af)[4][4], u32 wt, int r0, int t) {
    const int x = (r0 >> 1) & 3;
    const u32 p = wt + r0 * 64 + 4 * t, q = p + 8 * 64;
    constexpr int GPS = G > QOQ_PC ? 128 / G : 1;
    u32 cp = 0, sp = 0, cq = 0, sq = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const u32 pw = lds32(p + ((j ^ x) << 4)), qw = lds32(q + ((j ^ x) << 4));
        const u32 pl = pw & 0x0F0F0F0Fu, ql = qw & 0x0F0F0F0Fu;
        const u32 ph = (pw >> 4) & 0x0F0F0F0Fu, qh = (qw >> 4) & 0x0F0F0F0Fu;
        if constexpr (G == QOQ_PC) {
            af[j][0] = pl, af[j][1] = ql, af[j][2] = ph, af[j][3] = qh;
        } else {
            if ((32 * j) % G == 0) {
                const u32 ga = wt + SIDE_OFFSET + 4u * (u32)(r0 * GPS + 32 * j / G);
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

// The epilogue, integer part: the accumulators become the exact products Σ qx·Wint by subtracting zc[f]·rowsum[t]
// (zc: z[f] per-channel, from `zeros` as int32; 128 for progressive groups). Rows f0, f0 + 8; the token's rowsum
// waits in shared memory (tax, as int bits).
template <int G, int TN>
__device__ __forceinline__ void qoq_correct(int (&acc)[TN / 2], int f0, int N, int t, const float* tax,
                                            const int* __restrict__ zeros) {
    const int z0 = G == QOQ_PC ? (f0 < N ? zeros[f0] : 0) : 128;
    const int z1 = G == QOQ_PC ? (f0 + 8 < N ? zeros[f0 + 8] : 0) : 128;
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

template <int G>
struct Int8Scheme<4, G> {
    static_assert(G == QOQ_PC || G == 32 || G == 64 || G == 128, "per-channel, or groups of 32, 64 or 128");
    static constexpr bool UA = true;
    static constexpr int SIDE = G > QOQ_PC ? 128 / G : 0;
    static constexpr bool F16_STAGES = false;
    static constexpr int RAW_SHIFT = 0;
    static constexpr bool INT_SHARES = true;
    static constexpr bool CORRECTS = true;
    __device__ static __forceinline__ void frags(u32 (&af)[4][4], u32 wt, int r0, int t) {
        qoq_frags<G>(af, wt, r0, t);
    }
    // the row sum (zx: rsum), as int bits
    __device__ static __forceinline__ int token_load(const float* zx, int m, float) {
        return (int)ld_dep_u32(reinterpret_cast<const u32*>(zx) + m);
    }
    __device__ static __forceinline__ float token_value(int v) { return bits2f(v); }
    // wred: the int32 zeros (per channel)
    template <int TN>
    __device__ static __forceinline__ void correct(int (&acc)[TN / 2], int f0, int N, int t, const float* tax,
                                                   const float* wred) {
        qoq_correct<G, TN>(acc, f0, N, t, tax, reinterpret_cast<const int*>(wred));
    }
    template <int TN>
    __device__ static __forceinline__ void scale(int (&acc)[TN / 2], int f0, int N, int t, const float* tsx,
                                                 const float*, const u16* sw, const float*) {
        qoq_scale<TN>(acc, f0, N, t, tsx, sw);
    }
};

// Block-synchronous (the engine's gemm_body): A = the activation codes at quik's 4-bit positions (pos(b) =
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

// Warp-specialized (the engine's ws_body: the `ws` tile per block, and the persistent `wsp`): ma / mw / mo as
// there (the weight codes as 4-bit rows), G the stage-major group words (progressive; unused per channel), rsum the
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
QOQ_WS_ENTRIES(ws, false, 16, 16)  // 16- and 32-token tiles: a quarter / half of the 64-token
QOQ_WS_ENTRIES(ws, false, 32, 12)  // tile's activation bytes per stage, twice the weight stages in flight
QOQ_WS_ENTRIES(ws, false, 64, 8)
QOQ_WS_ENTRIES(ws, false, 128, 6)
QOQ_WS_ENTRIES(ws, false, 256, 4)
QOQ_WS_ENTRIES(wsp, true, 128, 6)
QOQ_WS_ENTRIES(wsp, true, 256, 4)
