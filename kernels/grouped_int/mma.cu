// Tensor-core GEMM for the `grouped_int` layout (formats/grouped-int.md) on Hopper: y = x · Wᵀ (+ bias) for
// W4A16 and W8A16, any number of tokens M.
//
// Operands are swapped: the weight rows are wgmma's M dimension (64 per warpgroup, 128 per block) and the tokens
// its N dimension (TN = 8..256 per block). wgmma takes its A operand from registers, so the packed weight is
// dequantized straight into A fragments and never goes back to shared memory; only the fp16 activations (and the
// packed codes, read once by several lanes) pass through shared memory. One kernel therefore covers a few decode
// tokens (TN = 8, weights streamed once, split-K across blocks) as well as a 2048-token prefill (TN = 256).
//
// Compiled at run time by NVRTC for sm_90a (qtool/cuda/compile.py). No CUDA headers: half arithmetic is inline PTX
// (here and in common/ptx_common.cuh).
//
// Runtime contract (qtool/cuda/grouped_int.py guarantees it before launching):
//   * x is fp16 [M, >= Kp], row stride ldx halves (a multiple of 8, 16-byte aligned rows), zeros in columns
//     K..Kp-1; Kp is a multiple of 64 and the kernel runs Kp/64 stages of 64 codes.
//   * qweight rows are ldw words apart (a multiple of 4) and hold at least Kp*BITS/32 words: the checkpoint's bit
//     streams, unchanged (4-bit: code k at nibble k%8 of word k/8; 8-bit: byte k%4 of word k/4).
//   * meta [N, G] int32: fp16 scale bits | zero point << 16. The group of code k is min(k >> gshift, G-1):
//     group sizes are powers of two >= 32 (each half of a 64-code stage lies in one group), gshift 31 for one
//     group per row.
//   * split-K (gridDim.z > 1): ws has room for gridDim.z * gridDim.x * gridDim.y * 128 * TN floats and cnt holds
//     gridDim.x * gridDim.y zeros; the last block of each tile leaves its counter at zero again (so CUDA-graph replays work).
//
// Value of a weight: (c - z) · s with the 0x6400 / 0x5400 exponent tricks (half bits 0x6400|c == 1024 + c,
// 0x5400|c<<4 == 64 + c): subtracting 1024 + z or 64 + z is exact, so the one rounding is the multiply by the fp16
// scale, the same rounding the float32 reference does when it casts to fp16. The GEMM accumulates in float32.

#include "common/ptx_common.cuh"
#include "common/wgmma_epilogue.cuh"

__device__ __forceinline__ u32 lop_and_or(u32 a, u32 mask, u32 bits) {
    u32 r;
    // (a & mask) | bits in one LOP3
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "r"(mask), "r"(bits));
    return r;
}

// Per warp lane: A fragment registers of one k16 step, rows g and g+8 of the warp's 16, codes 2t, 2t+1 and
// 2t+8, 2t+9 (g = lane / 4, t = lane % 4): a[0] = (g, 2t..), a[1] = (g+8, 2t..), a[2] = (g, 2t+8..),
// a[3] = (g+8, 2t+8..).
struct RowMeta {
    u32 s;  // half2 (scale, scale)
    u32 z;  // half2 subtrahends: (1024 + z, 64 + z) for 4-bit, (1024 + z, 1024 + z) for 8-bit
};

template <int BITS>
__device__ __forceinline__ RowMeta row_meta(u32 m) {
    const u32 z = m >> 16;
    RowMeta r;
    r.s = prmt(m, 0, 0x1010);
    r.z = BITS == 4 ? ((0x6400u + z) | ((0x5400u + (z << 4)) << 16)) : (0x6400u + z) * 0x10001u;
    return r;
}

// Weight tile in shared memory, one stage: 128 rows of 64 codes (32 bytes at 4 bits, 64 at 8). 16-byte chunks are
// XOR-swizzled by row so the 8 rows a warp reads at once fall in different banks.
template <int BITS>
__device__ __forceinline__ u32 wrow_chunk(int row, int chunk) {
    return BITS == 4 ? row * 32 + ((chunk ^ ((row >> 2) & 1)) << 4) : row * 64 + ((chunk ^ ((row >> 1) & 3)) << 4);
}

// Dequantize the 4 k16 steps of one stage into A fragments. `mt` holds the stage's scale/zero words: the tile's
// ROWS rows for codes 0..31 of the stage, then for codes 32..63 (the same group unless groups have 32 codes).
// ma / mb: rows r0 and r0 + 8 for codes 0..31 / 32..63 of the stage.
template <int BITS>
__device__ __forceinline__ void dequant_frags(u32 (&af)[4][4], u32 wt, const RowMeta (&ma)[2], const RowMeta (&mb)[2],
                                              int r0, int t) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const RowMeta(&m)[2] = j < 2 ? ma : mb;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = r0 + 8 * h;
            u32 lo, hi;
            if (BITS == 4) {
                // words 2j (codes 0..7 of the step) and 2j+1 (8..15); byte t of each holds codes 2t, 2t+1.
                const uint2 w = lds64(wt + wrow_chunk<4>(r, j >> 1) + 8 * (j & 1));
                const u32 rep = prmt(w.x, w.y, (u32)(t | ((4 + t) << 4) | (t << 8) | ((4 + t) << 12)));
                lo = lop_and_or(rep, 0x00F0000Fu, 0x54006400u);
                hi = lop_and_or(rep >> 8, 0x00F0000Fu, 0x54006400u);
            } else {
                // word 4j + t/2 holds codes 2t, 2t+1 (bytes 2(t%2), +1); word 4j+2+t/2 codes 2t+8, 2t+9.
                const u32 base = wt + wrow_chunk<8>(r, j) + 4 * (t >> 1);
                const u32 a = 2 * (t & 1);
                const u32 sel = a | (4u << 4) | ((a + 1) << 8) | (4u << 12);
                lo = prmt(lds32(base), 0x64u, sel);
                hi = prmt(lds32(base + 8), 0x64u, sel);
            }
            af[j][h] = f16x2_mul(f16x2_sub(lo, m[h].z), m[h].s);
            af[j][2 + h] = f16x2_mul(f16x2_sub(hi, m[h].z), m[h].s);
        }
    }
}

template <int BITS, int ROWS>
__device__ __forceinline__ void dequant_stage(u32 (&af)[4][4], u32 wt, u32 mt, int r0, int t) {
    RowMeta ma[2], mb[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        ma[h] = row_meta<BITS>(lds32(mt + (r0 + 8 * h) * 4));
        mb[h] = row_meta<BITS>(lds32(mt + (ROWS + r0 + 8 * h) * 4));
    }
    dequant_frags<BITS>(af, wt, ma, mb, r0, t);
}

// A block holds 128 * RB weight rows: each warpgroup RB row blocks of 64 (RB accumulator sets). RB = 2 halves the
// activation bytes each block reads from L2 per multiply-add, at twice the registers.
template <int BITS, int TN, int RB>
struct Tile {
    static constexpr int ROWS = 128 * RB;
    static constexpr int XT = TN * 128;              // activation bytes per stage: TN rows of 64 halves
    static constexpr int WT = ROWS * 64 * BITS / 8;  // weight bytes per stage
    static constexpr int MT = 2 * ROWS * 4;          // scale/zero words: 2 halves of the stage x ROWS rows
    static constexpr int SB = XT + WT + MT;          // all multiples of 1024: the swizzle atoms stay aligned
};

struct Args {
    const u16* x;
    int ldx;
    const u32* qw;
    int ldw;
    const u32* meta;
    int G, gshift;
    int M, N;
    int m0, n0;
};

// This thread's copies, planned once: 32-bit element offsets of its chunks at stage 0, their shared-memory offsets
// within a stage, and which are in bounds (rows past M or N read nothing and zero-fill). Recomputing the addresses
// every stage cost more instructions than the dequantization (the loop is bound by each warp's instruction stream).
template <int BITS, int TN, int RB>
struct Loader {
    using T = Tile<BITS, TN, RB>;
    static constexpr int XC = (TN * 8 + 255) / 256;  // activation chunks per thread
    static constexpr int CPR = BITS * 64 / 128;      // weight chunks per row and stage
    static constexpr int WC = T::ROWS * CPR / 256;   // weight chunks per thread
    u32 xoff, xstep, xdst, xmask;
    u32 woff[WC], wdst[WC], wmask;
    u32 moff[RB], mdst[RB], mh[RB], mmask;

    __device__ __forceinline__ Loader(const Args& a, int tid) {
        const int r = tid >> 3, ch = tid & 7;
        xoff = (u32)((a.m0 + r) * a.ldx + ch * 8);
        xstep = (u32)(32 * a.ldx);
        xdst = (u32)(r * 128 + ((ch ^ (r & 7)) << 4));
        xmask = 0;
#pragma unroll
        for (int i = 0; i < XC; ++i) {
            const bool active = TN * 8 % 256 == 0 || tid + 256 * i < TN * 8;
            if (active && a.m0 + r + 32 * i < a.M) xmask |= 1u << i;
        }
        wmask = 0;
#pragma unroll
        for (int i = 0; i < WC; ++i) {
            const int c = tid + 256 * i, row = c / CPR, cw = c % CPR;
            const bool ok = a.n0 + row < a.N;
            woff[i] = ok ? (u32)((a.n0 + row) * a.ldw + cw * 4) : 0u;
            wdst[i] = T::XT + wrow_chunk<BITS>(row, cw);
            if (ok) wmask |= 1u << i;
        }
        mmask = 0;
#pragma unroll
        for (int i = 0; i < RB; ++i) {
            const int c = tid + 256 * i, h = c / T::ROWS, row = c % T::ROWS;
            const bool ok = a.n0 + row < a.N;
            moff[i] = ok ? (u32)((a.n0 + row) * a.G) : 0u;
            mdst[i] = T::XT + T::WT + (h * T::ROWS + row) * 4;
            mh[i] = 32 * h;
            if (ok) mmask |= 1u << i;
        }
    }

    // Issue the copies of global stage gs into the shared-memory stage at `st`.
    __device__ __forceinline__ void stage(const Args& a, u32 st, int gs) const {
        // activations: TN rows x 8 chunks, 128-byte swizzle (chunk c of row r at c ^ (r % 8)); chunk i of this
        // thread is 32 rows below chunk i-1, same swizzle
#pragma unroll
        for (int i = 0; i < XC; ++i) {
            const bool ok = (xmask >> i) & 1;
            const u32 off = ok ? xoff + i * xstep + (u32)gs * 64 : 0u;
            // with fewer chunks than threads, threads past the tile's rows (xdst beyond it) copy nothing
            if (TN * 8 % 256 == 0 || xdst + i * 4096 < T::XT)
                cp_async16(st + xdst + i * 4096, a.x + off, ok ? 16 : 0);
        }
#pragma unroll
        for (int i = 0; i < WC; ++i) {
            const bool ok = (wmask >> i) & 1;
            cp_async16(st + wdst[i], a.qw + woff[i] + (ok ? (u32)gs * (2 * BITS) : 0u), ok ? 16 : 0);
        }
        // scale/zero words of the groups of codes 0 and 32 of the stage, one 4-byte copy per row and half
#pragma unroll
        for (int i = 0; i < RB; ++i) {
            const bool ok = (mmask >> i) & 1;
            const u32 gi = (u32)min((gs * 64 + (int)mh[i]) >> a.gshift, a.G - 1);
            cp_async4(st + mdst[i], a.meta + moff[i] + (ok ? gi : 0u), ok ? 4 : 0);
        }
    }
};

template <int BITS, int TN, int STAGES, int RB>
__device__ __forceinline__ void stage_step(float (&acc)[RB][TN / 2], u32 (&af)[RB][4][4], const Args& a,
                                           const Loader<BITS, TN, RB>& ld, u32 base, int s, int s0, int ns, int r0,
                                           int t) {
    using T = Tile<BITS, TN, RB>;
    cp_async_wait<STAGES - 3>();  // this thread's copies of stage s are done
    fence_async_smem();           // they are read next by the tensor cores
    __syncthreads();              // everyone's copies; everyone's wgmma of stage s-2 is finished (wait 1 below)
    if (s + STAGES - 2 < ns)
        ld.stage(a, base + (u32)((s + STAGES - 2) % STAGES) * T::SB, s0 + s + STAGES - 2);
    cp_async_commit();
    const u32 st = base + (u32)(s % STAGES) * T::SB;
#pragma unroll
    for (int b = 0; b < RB; ++b) dequant_stage<BITS, T::ROWS>(af[b], st + T::XT, st + T::XT + T::WT, r0 + 64 * b, t);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) {
#pragma unroll
        for (int b = 0; b < RB; ++b) wgmma_acc(acc[b], af[b][j], desc_sw128(st + 32 * j));
    }
    wgmma_commit();
    wgmma_wait1();
}

template <int BITS, int TN, int STAGES, int RB>
__device__ __forceinline__ void mma_body(const u16* __restrict__ x, int ldx, const u32* __restrict__ qw, int ldw,
                                         const u32* __restrict__ meta, int G, int gshift,
                                         const u16* __restrict__ bias, u16* __restrict__ out, int ldc,
                                         float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int nst) {
    using T = Tile<BITS, TN, RB>;
    extern __shared__ char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const Args a{x, ldx, qw, ldw, meta, G, gshift, M, N, (int)blockIdx.y * TN, (int)blockIdx.x * T::ROWS};
    const int S = gridDim.z, z = blockIdx.z;
    const int s0 = (int)((long long)z * nst / S), ns = (int)((long long)(z + 1) * nst / S) - s0;
    // this lane's first weight row in the tile (then r0 + 8, and + 64 per further row block)
    const int r0 = 64 * RB * wg + 16 * warp + g;

    float acc[RB][TN / 2];
#pragma unroll
    for (int b = 0; b < RB; ++b) {
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) acc[b][i] = 0.f;
    }

    const Loader<BITS, TN, RB> ld(a, tid);
#pragma unroll
    for (int p = 0; p < STAGES - 2; ++p) {
        if (p < ns) ld.stage(a, base + (u32)p * T::SB, s0 + p);
        cp_async_commit();
    }
    // Two sets of A fragments: a stage's wgmmas may still read one set while the next stage fills the other.
    u32 af0[RB][4][4], af1[RB][4][4];
    int s = 0;
    for (; s + 1 < ns; s += 2) {
        stage_step<BITS, TN, STAGES, RB>(acc, af0, a, ld, base, s, s0, ns, r0, t);
        stage_step<BITS, TN, STAGES, RB>(acc, af1, a, ld, base, s + 1, s0, ns, r0, t);
    }
    if (s < ns) stage_step<BITS, TN, STAGES, RB>(acc, af0, a, ld, base, s, s0, ns, r0, t);
    wgmma_wait0();
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory is free from here on

    if (S > 1 && !split_k_sum<TN, RB, 0, 256>(acc, ws, cnt, tid, z, S, gridDim.x * gridDim.y,
                                                blockIdx.x + gridDim.x * blockIdx.y))
        return;
    store_out<TN, RB, 0>(acc, a.m0, a.n0, M, N, r0, t, tid, smem_raw, base, bias, out, ldc);
}

// MINB: blocks per SM the registers must allow (2 caps them at 128 per thread, so two blocks' warps hide each
// other's latencies).
#define MMA_ENTRY(BITS, TN, ST, RB, MINB)                                                                       \
    extern "C" __global__ void __launch_bounds__(256, MINB) grouped_int_mma_b##BITS##_n##TN##_s##ST##_r##RB(    \
        const u16* x, int ldx, const u32* qw, int ldw, const u32* meta, int G, int gshift, const u16* bias,     \
        u16* out, int ldc, float* ws, int* cnt, int M, int N, int nst) {                                        \
        mma_body<BITS, TN, ST, RB>(x, ldx, qw, ldw, meta, G, gshift, bias, out, ldc, ws, cnt, M, N, nst);      \
    }
#define MMA_ENTRIES(TN, ST, RB, MINB) MMA_ENTRY(4, TN, ST, RB, MINB) MMA_ENTRY(8, TN, ST, RB, MINB)
MMA_ENTRIES(8, 8, 1, 1)
MMA_ENTRIES(16, 8, 1, 1)
MMA_ENTRIES(32, 8, 1, 1)
MMA_ENTRIES(64, 6, 1, 1)
MMA_ENTRIES(64, 8, 1, 1)
MMA_ENTRIES(128, 4, 1, 2)
MMA_ENTRIES(128, 6, 1, 1)
MMA_ENTRIES(256, 4, 1, 1)
MMA_ENTRIES(256, 5, 1, 1)
MMA_ENTRIES(64, 6, 2, 1)
MMA_ENTRIES(128, 4, 2, 1)
MMA_ENTRIES(128, 5, 2, 1)

// ---------------------------------------------------------------------------------------------------------------
// Warp-specialized form (same result as mma_body at the same TN and split, RB = 1): 384 threads. Warpgroup 0
// copies: one thread issues the bulk tensor copies (TMA) of each 64-code stage, the activation tile (TN tokens x
// 128 bytes, 128-byte swizzle) and the code tile (128 rows x 8*BITS bytes, 32/64-byte swizzle: the layouts of
// wrow_chunk), into an ST-deep ring with a "full" and an "empty" mbarrier per stage. Warpgroups 1-2
// compute: each waits for a stage, issues its wgmmas, and while they run releases the previous stage, waits for
// the next and dequantizes it into the other fragment set. The scale/zero words come straight from global memory
// (L1/L2: one 4-byte word per row and half stage), fetched one stage ahead of their use. No block barrier in the
// loop. Tensor maps (qtool/cuda/tma.py): mx = x [M, K] as bytes, box 128 x TN; mq = qweight [N, Kp*BITS/32
// words] as bytes, box 8*BITS x 128; columns and tokens past the tensor arrive as zeros. With split-K (gridDim.z
// shares of the stages) the blocks of a tile add their partials as mma_body's do, through `ws` and `cnt`.
// ---------------------------------------------------------------------------------------------------------------
// A ring slot of the one-tile-per-block form: TN tokens' activation tile, then the code tile XO bytes in (slots of
// the 8-bit size, multiples of 1024).
template <int TN>
struct WsSlot {
    static constexpr int XO = TN * 128;
    static constexpr int SB = XO + 128 * 64;
};
// The persistent form's slot: a 256-token activation tile and the code tile's own size.
template <int BITS>
struct WsStage {
    static constexpr int SBP = 256 * 128 + 128 * 8 * BITS;
};

// Scale/zero words of rows r0, r0 + 8 for codes 0 and 32 of global stage gs (rows past N read row 0's: unused).
template <int BITS>
__device__ __forceinline__ void fetch_meta(u32 (&w)[4], const u32* __restrict__ meta, int f0, int N, int G,
                                           int gshift, int gs) {
    const int g0 = min((gs * 64) >> gshift, G - 1), g1 = min((gs * 64 + 32) >> gshift, G - 1);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int f = f0 + 8 * h < N ? f0 + 8 * h : 0;
        w[h] = __ldg(meta + (size_t)f * G + g0);
        w[2 + h] = __ldg(meta + (size_t)f * G + g1);
    }
}

// Stage gs's words into w, which holds stage gs - 1's: loaded only where stage gs starts a new group (every other
// stage at 128-code groups, every fourth at 256), and one word per row where both halves of the stage share a group.
// Fewer loads on the math warps' path; a build that skipped every load ran 1-13% faster (kernels/NOTES.md).
template <int BITS>
__device__ __forceinline__ void next_meta(u32 (&w)[4], const u32* __restrict__ meta, int f0, int N, int G, int gshift,
                                          int gs) {
    const int ga = min((gs * 64) >> gshift, G - 1), gb = min((gs * 64 + 32) >> gshift, G - 1);
    const int pa = min((gs * 64 - 64) >> gshift, G - 1), pb = min((gs * 64 - 32) >> gshift, G - 1);
    if (ga == pa && gb == pb) return;
    if (ga != gb) {
        fetch_meta<BITS>(w, meta, f0, N, G, gshift, gs);
        return;
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int f = f0 + 8 * h < N ? f0 + 8 * h : 0;
        w[h] = w[2 + h] = __ldg(meta + (size_t)f * G + ga);
    }
}

template <int BITS>
__device__ __forceinline__ void ws_dequant(u32 (&af)[4][4], u32 wt, const u32 (&w)[4], int r0, int t) {
    RowMeta ma[2], mb[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        ma[h] = row_meta<BITS>(w[h]);
        mb[h] = row_meta<BITS>(w[2 + h]);
    }
    dequant_frags<BITS>(af, wt, ma, mb, r0, t);
}

// Stage s of a tile whose stage 0 sits at ring position g0 (SB bytes per slot, the code tile XO bytes into it) and
// is stage s0 of the rows, on fragments `cur`; then release stage s - 1, and dequantize stage s + 1 into `nxt` with
// the words in `wn` (fetched a stage ago), then turning `wn` into stage s + 2's.
template <int BITS, int ST, int SB, int XO, int TN>
__device__ __forceinline__ void gi_ws_step(float (&acc)[TN / 2], u32 (&cur)[4][4], u32 (&nxt)[4][4], u32 (&wn)[4],
                                           u32 base, u32 bars, int g0, int s, int ns, int s0,
                                           const u32* __restrict__ meta, int f0, int N, int G, int gshift, int r0,
                                           int t, int lane) {
    const int g = g0 + s;
    const u32 st = base + (u32)(g % ST) * SB;
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < 4; ++j) wgmma_acc(acc, cur[j], desc_sw128(st + 32 * j));
    wgmma_commit();
    wgmma_wait1();  // stage s - 1 is read: hand it back
    if (s > 0 && lane == 0) mbar_arrive(bars + 8 * (ST + (g - 1) % ST));
    if (s + 1 < ns) {
        mbar_wait(bars + 8 * ((g + 1) % ST), (u32)((g + 1) / ST) & 1);
        ws_dequant<BITS>(nxt, base + (u32)((g + 1) % ST) * SB + XO, wn, r0, t);
        if (s + 2 < ns) next_meta<BITS>(wn, meta, f0, N, G, gshift, s0 + s + 2);
    }
}

// A tile's main loop (TN tokens, ns stages from the rows' stage s0) from ring position g0: `w0` / `wn` hold the
// scale/zero words of its stages 0, 1.
template <int BITS, int ST, int SB, int XO, int TN>
__device__ __forceinline__ void gi_ws_tile(float (&acc)[TN / 2], const u32 (&w0)[4], u32 (&wn)[4], u32 base, u32 bars,
                                           int g0, int ns, int s0, const u32* __restrict__ meta, int f0, int N, int G,
                                           int gshift, int r0, int t, int lane) {
    u32 af0[4][4], af1[4][4];  // a stage's wgmmas may still read one set while the next stage fills the other
    if (ns > 0) {
        mbar_wait(bars + 8 * (g0 % ST), (u32)(g0 / ST) & 1);
        ws_dequant<BITS>(af0, base + (u32)(g0 % ST) * SB + XO, w0, r0, t);
    }
    int s = 0;
    for (; s + 1 < ns; s += 2) {
        gi_ws_step<BITS, ST, SB, XO, TN>(acc, af0, af1, wn, base, bars, g0, s, ns, s0, meta, f0, N, G, gshift, r0, t,
                                         lane);
        gi_ws_step<BITS, ST, SB, XO, TN>(acc, af1, af0, wn, base, bars, g0, s + 1, ns, s0, meta, f0, N, G, gshift, r0,
                                         t, lane);
    }
    if (s < ns)
        gi_ws_step<BITS, ST, SB, XO, TN>(acc, af0, af1, wn, base, bars, g0, s, ns, s0, meta, f0, N, G, gshift, r0, t,
                                         lane);
    wgmma_wait0();
}

// Rows n0.., tokens m0.. and token count (256 or 64; 0: skipped) of work item `item`.
__device__ __forceinline__ int gi_wsp_item(int item, int full, int ntn, int M, int& n0, int& m0) {
    if (item < full) {
        n0 = (item % ntn) * 128;
        m0 = (item / ntn) * 256;
        return 256;
    }
    const int q = item - full, tile = full + (q >> 2);
    n0 = (tile % ntn) * 128;
    m0 = (tile / ntn) * 256 + 64 * (q & 3);
    return m0 < M ? 64 : 0;
}

// The copy thread's stages s0 .. s0 + ns - 1 of the tile at rows n0, tokens m0 (tn of them: mx's box) into the
// ST-slot ring from ring position g, SB bytes per slot: the activation tile, and the code tile XO bytes after it.
// Returns the ring position after them.
template <int BITS, int ST, int SB, int XO>
__device__ __forceinline__ int gi_ws_stages(const TmaMap* mx, const TmaMap* mq, u32 base, u32 bars, int g, int m0,
                                           int n0, int s0, int ns, int tn) {
    for (int s = s0; s < s0 + ns; ++s, ++g) {
        const int slot = g % ST, use = g / ST;
        const u32 full_bar = bars + 8 * slot, st = base + (u32)slot * SB;
        if (use > 0) mbar_wait(bars + 8 * (ST + slot), (use - 1) & 1);
        mbar_arrive_expect_tx(full_bar, tn * 128 + 128 * 8 * BITS);
        tma_load_2d(st, mx, full_bar, 128 * s, m0);
        tma_load_2d(st + XO, mq, full_bar, 8 * BITS * s, n0);
    }
    return g;
}

// The persistent kernel's copy thread: the stages of this block's work items (item, item + grid, ...; gi_wsp_item)
// into the ring: the activation tile (mx, or mx64 for 64-token items) and the code tile 32 KB after it.
template <int BITS, int ST, int SB>
__device__ __forceinline__ void gi_ws_copies(const TmaMap* mx, const TmaMap* mx64, const TmaMap* mq, u32 base,
                                             u32 bars, int M, int N, int ns, int full) {
    const int ntn = (N + 127) >> 7, tiles = ntn * ((M + 255) >> 8), items = full + 4 * (tiles - full);
    tma_prefetch_map(mx);
    tma_prefetch_map(mx64);
    tma_prefetch_map(mq);
    int g = 0;
    for (int item = blockIdx.x; item < items; item += gridDim.x) {
        int n0, m0;
        const int tn = gi_wsp_item(item, full, ntn, M, n0, m0);
        if (tn == 0) continue;
        g = gi_ws_stages<BITS, ST, SB, 256 * 128>(tn == 256 ? mx : mx64, mq, base, bars, g, m0, n0, 0, ns, tn);
    }
}

// One block per (128-row, TN-token) tile and share z of its K stages (gridDim.z shares; split-K as in mma_body).
// MINB blocks per SM: at 2 the math warps get 96 registers (the copy warpgroup gives back all but 40 of the 80
// each thread starts with), enough for a 64-token tile.
template <int BITS, int ST, int TN, int MINB>
__device__ __forceinline__ void gi_ws_body(const TmaMap* mx, const TmaMap* mq, const u32* __restrict__ meta, int G,
                                           int gshift, const u16* __restrict__ bias, u16* __restrict__ out, int ldc,
                                           float* __restrict__ ws, int* __restrict__ cnt, int M, int N, int nst) {
    using T = WsSlot<TN>;
    extern __shared__ char smem_raw[];
    __shared__ __align__(8) u64 bar_mem[2 * ST];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const u32 bars = smem_addr(bar_mem);
    const int tid = threadIdx.x;
    const int n0 = (int)blockIdx.x * 128, m0 = (int)blockIdx.y * TN;
    const int S = gridDim.z, z = blockIdx.z;
    const int s0 = (int)((long long)z * nst / S), ns = (int)((long long)(z + 1) * nst / S) - s0;
    if (tid == 0) ring_init<ST>(bars);
    __syncthreads();
    if (tid < 128) {
        regs_decrease<40>();
        if (tid == 0) {
            tma_prefetch_map(mx);
            tma_prefetch_map(mq);
            gi_ws_stages<BITS, ST, T::SB, T::XO>(mx, mq, base, bars, 0, m0, n0, s0, ns, TN);
        }
        return;
    }
    regs_increase<MINB == 2 ? 96 : 232>();
    const int ctid = tid - 128, warp = (ctid >> 5) & 3, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0 = 64 * (ctid >> 7) + 16 * warp + g, f0 = n0 + r0;
    float acc[1][TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[0][i] = 0.f;
    u32 w0[4], wn[4];
    fetch_meta<BITS>(w0, meta, f0, N, G, gshift, s0);
    if (ns > 1) fetch_meta<BITS>(wn, meta, f0, N, G, gshift, s0 + 1);
    gi_ws_tile<BITS, ST, T::SB, T::XO, TN>(acc[0], w0, wn, base, bars, 0, ns, s0, meta, f0, N, G, gshift, r0, t, lane);
    bar_sync<1, 256>();  // every math warp is done with the ring: it becomes the transpose tile
    if (S > 1 && !split_k_sum<TN, 1, 1, 256>(acc, ws, cnt, ctid, z, S, gridDim.x * gridDim.y,
                                             blockIdx.x + gridDim.x * blockIdx.y))
        return;
    store_out<TN, 1, 1>(acc, m0, n0, M, N, r0, t, ctid, smem_raw, base, bias, out, ldc);
}

#define GI_WS_ENTRY(BITS, TN, ST, MINB, SUFFIX)                                                                   \
    extern "C" __global__ void __launch_bounds__(384, MINB) grouped_int_ws_b##BITS##_n##TN##_s##ST##SUFFIX(      \
        const __grid_constant__ TmaMap mx, const __grid_constant__ TmaMap mq, const u32* meta, int G, int gshift, \
        const u16* bias, u16* out, int ldc, float* ws, int* cnt, int M, int N, int nst) {                         \
        gi_ws_body<BITS, ST, TN, MINB>(&mx, &mq, meta, G, gshift, bias, out, ldc, ws, cnt, M, N, nst);            \
    }
#define GI_WS_ENTRIES(TN, ST) GI_WS_ENTRY(4, TN, ST, 1, ) GI_WS_ENTRY(8, TN, ST, 1, )
GI_WS_ENTRIES(256, 5)
GI_WS_ENTRIES(256, 4)
GI_WS_ENTRIES(128, 6)
GI_WS_ENTRIES(64, 8)
// two blocks per SM (ring of 6: 97 KB of shared memory each)
GI_WS_ENTRY(4, 64, 6, 2, _x2)
GI_WS_ENTRY(8, 64, 6, 2, _x2)

// ---------------------------------------------------------------------------------------------------------------
// Persistent form (`grouped_int_wsp_*`): one block per multiprocessor walks the work items (item, item + grid,
// ...) through one ring, so the copy thread fills it with the next item's stages while the math warpgroups finish
// the current one; their epilogue adds the bias and leaves through the copy engine (tma_store_tile: EB buffers of
// 8 KB beside the ring; mo = the float16 output [M, 2N bytes], boxes of 128 bytes x 32 tokens, 128-byte swizzle),
// so no math thread waits for its stores. Slots hold the code tile's own size (36 KB at 4 bits). The scale/zero
// words of an item's first two stages are fetched during the item before.
// Items: the first `full` tiles of 128 rows x 256 tokens (rows fastest), then each remaining tile as four items of
// 64 tokens (mx64: x with boxes of 64 rows), those past M skipped. The host makes `full` whole rounds of the grid
// when the quarters of the rest fit in one round: a last, partial round of whole tiles (688 tiles on 132 SMs at
// 4096 x 11008, M = 2048) would take a whole tile's time on a few SMs. Same values as the one-tile-per-block form
// (same fragments, same wgmma order per output: token tiles only change which wgmma instruction holds a token).
// ---------------------------------------------------------------------------------------------------------------
constexpr int GI_WSP_EB = 3;

// One work item of TN tokens for the math warpgroups: main loop, release of its last stage, the next item's first
// scale/zero words, epilogue.
template <int BITS, int ST, int SB, int TN>
__device__ __forceinline__ void gi_wsp_run(u32 (&w0)[4], u32 (&wn)[4], u32 base, u32 bars, int g0, int ns,
                                           const u32* __restrict__ meta, int n0, int m0, int next_n0, int M, int N,
                                           int G, int gshift, const u16* __restrict__ bias, int r0, int t, int lane,
                                           int ctid, int& eb, const TmaMap* mo) {
    const int f0 = n0 + r0;
    float acc[TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[i] = 0.f;
    gi_ws_tile<BITS, ST, SB, 256 * 128, TN>(acc, w0, wn, base, bars, g0, ns, 0, meta, f0, N, G, gshift, r0, t, lane);
    if (ns > 0 && lane == 0) mbar_arrive(bars + 8 * (ST + (g0 + ns - 1) % ST));  // the item's last stage
    if (next_n0 >= 0) {
        fetch_meta<BITS>(w0, meta, next_n0 + r0, N, G, gshift, 0);
        if (ns > 1) fetch_meta<BITS>(wn, meta, next_n0 + r0, N, G, gshift, 1);
    }
    float bv[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int f = f0 + 8 * h;
        bv[h] = (bias != nullptr && f < N) ? h2f(bias[f]) : 0.f;
    }
    // accumulator i is row r0 + 8 ((i / 2) % 2)'s
    tma_store_tile<TN, GI_WSP_EB>([&](int i) { return acc[i] + bv[(i >> 1) & 1]; }, m0, n0, M, ctid,
                                  base + (u32)(ST * SB), eb, mo);
}

template <int BITS, int ST>
__device__ __forceinline__ void gi_wsp_body(const TmaMap* mx, const TmaMap* mx64, const TmaMap* mq,
                                            const TmaMap* mo, const u32* __restrict__ meta, int G, int gshift,
                                            const u16* __restrict__ bias, int M, int N, int ns, int full) {
    constexpr int SB = WsStage<BITS>::SBP;
    extern __shared__ char smem_raw[];
    __shared__ __align__(8) u64 bar_mem[2 * ST];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const u32 bars = smem_addr(bar_mem);
    const int tid = threadIdx.x;
    const int ntn = (N + 127) >> 7, tiles = ntn * ((M + 255) >> 8), items = full + 4 * (tiles - full);
    if (tid == 0) ring_init<ST>(bars);
    __syncthreads();
    if (tid < 128) {
        regs_decrease<40>();
        if (tid == 0) gi_ws_copies<BITS, ST, SB>(mx, mx64, mq, base, bars, M, N, ns, full);
        return;
    }
    regs_increase<232>();
    const int ctid = tid - 128, warp = (ctid >> 5) & 3, lane = tid & 31, t = lane & 3;
    const int r0 = 64 * (ctid >> 7) + 16 * warp + (lane >> 2);
    // the next item this block runs after `item` (its rows in n0; -1 when none)
    auto next_rows = [&](int item) {
        for (int it = item + (int)gridDim.x; it < items; it += gridDim.x) {
            int n0, m0;
            if (gi_wsp_item(it, full, ntn, M, n0, m0) != 0) return n0;
        }
        return -1;
    };
    u32 w0[4], wn[4];
    int item = blockIdx.x, n0 = 0, m0 = 0;
    while (item < items && gi_wsp_item(item, full, ntn, M, n0, m0) == 0) item += gridDim.x;
    if (item < items) {
        fetch_meta<BITS>(w0, meta, n0 + r0, N, G, gshift, 0);
        if (ns > 1) fetch_meta<BITS>(wn, meta, n0 + r0, N, G, gshift, 1);
    }
    int g0 = 0, eb = 0;
    for (; item < items; item += gridDim.x) {
        const int tn = gi_wsp_item(item, full, ntn, M, n0, m0);
        if (tn == 0) continue;
        const int next_n0 = next_rows(item);
        if (tn == 256)
            gi_wsp_run<BITS, ST, SB, 256>(w0, wn, base, bars, g0, ns, meta, n0, m0, next_n0, M, N, G, gshift, bias,
                                          r0, t, lane, ctid, eb, mo);
        else
            gi_wsp_run<BITS, ST, SB, 64>(w0, wn, base, bars, g0, ns, meta, n0, m0, next_n0, M, N, G, gshift, bias,
                                         r0, t, lane, ctid, eb, mo);
        g0 += ns;
    }
    if (ctid == 0) bulk_wait_all();  // the output is written before the block exits
}

#define GI_WSP_ENTRY(BITS, ST)                                                                                    \
    extern "C" __global__ void __launch_bounds__(384, 1) grouped_int_wsp_b##BITS##_n256_s##ST(                    \
        const __grid_constant__ TmaMap mx, const __grid_constant__ TmaMap mx64, const __grid_constant__ TmaMap mq, \
        const __grid_constant__ TmaMap mo, const u32* meta, int G, int gshift, const u16* bias, int M, int N,     \
        int nst, int full) {                                                                                      \
        gi_wsp_body<BITS, ST>(&mx, &mx64, &mq, &mo, meta, G, gshift, bias, M, N, nst, full);                     \
    }
GI_WSP_ENTRY(4, 5)
GI_WSP_ENTRY(8, 5)
GI_WSP_ENTRY(4, 4)
GI_WSP_ENTRY(8, 4)
