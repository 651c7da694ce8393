// The INT8 tensor-core engine that the W4A4/W8A8 GEMMs (quik/gemm.cu) and the W4A8 GEMMs (qoq/gemm.cu) instantiate:
// per-token s8 activation rows times weight codes by `wgmma ... s32.{s8,u8}.s8` (Hopper), with the per-token
// quantize kernel that writes those rows. Hopper has no INT4 tensor cores (mma s4 is emulated), so 4-bit weights
// are widened to 8 bits in registers, where wgmma takes its A operand from; activations are one byte per code (an
// activation row lives for one layer call, so its storage size does not matter).
//
// A source built on the engine supplies, before its entries instantiate it:
//   * Int8Scheme<BITS, SCH>: its weight scheme (SCH: the scheme's number; an int rather than a type, so the
//     engine's symbols, such as its shared arrays' names in the PTX, do not depend on the source): how an integer
//     stage's weight words become A fragments, whether they are unsigned, the side words a stage carries, whether
//     float16 stages may follow the integer ones, and the epilogue that turns the int32 sums into floats (the
//     members are listed at Int8Scheme below);
//   * ActCodes<AB> where it instantiates quantize_rows (the per-token code, scale and row statistics);
//   * FusedProducer<BITS, TN, ST, EBF> where it instantiates the fused warp-specialized form (ws_body's FUSED).
// No CUDA headers: everything is inline PTX (here and in common/ptx_common.cuh), so the source builds with any NVRTC.
#pragma once

#include "common/ptx_common.cuh"

// Measurement builds only (qtool.cuda.compile extra options). INT8_ABLATE removes a part of the block-synchronous
// GEMM's loop (1: the integer wgmmas, 2: the loads after the prologue, 4: the A-fragment loads and unpacking) or
// changes it (3: 8-bit A read by wgmma from shared memory instead of registers; wrong values, timing only) to see
// what bounds it. INT8_EPI: 1 the persistent epilogue's stores skip the wait for their buffers (a race), 2 it
// stores nothing, 3 neither the scheme's epilogue nor stores, 4 stmatrix only (no fence, barrier or bulk store), 5
// stmatrix, fence and barrier but no bulk store (wrong values; timing only).
#ifndef INT8_ABLATE
#define INT8_ABLATE 0
#endif
#ifndef INT8_EPI
#define INT8_EPI 0
#endif

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

// The accumulators travel as int bits once the epilogue has made them floats: wgmma's f32 accumulation of the
// float16 stages continues on the same registers.
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

// ---------------------------------------------------------------------------------------------------------------
// Per-token quantize, block-per-row form: a block of NT threads per token row (rows row, row + grid, ...; the
// launch gives every row its own block, since a persistent grid that prefetched the next row was slower,
// kernels/NOTES.md). Every thread holds PPT pieces of 8 columns of the row in registers. Per row: min/max over
// the columns that get codes (flags: one bit per column kept out, e.g. QUIK's outliers), a block reduction, then
// the scale, and each code is dropped at its position in a shared-memory copy of the output row (the order the
// weights unpack in), kept-out values at their slot; the finished row leaves with 16-byte stores.
//
// ActCodes<AB> (AB: the codes' scheme, an int template argument) supplies:
//   SUMS                                    the row's code sum is written (rsum)
//   scale(lo, hi, s, y)                     s: the row's scale (written to sx), y: what put multiplies by
//   put(h, d, lo, y, cs, os, csum)          column value h whose destination is d
//   row_sums(csum, rsred, tid)              (SUMS) this thread's share of the row sum, before the barrier
//   row_stats<W>(row, lo, rsred, zx, rsum)  thread 0's per-row values beside s
//
// dest [K]: position of the column's code in the activation row, or -(1 + slot) for a kept-out column.
// oflag [ceil(K/8)]: bit i of byte p is set when column 8p + i is kept out.
// ---------------------------------------------------------------------------------------------------------------
template <int AB>
struct ActCodes;

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
            // columns past K count as kept out here (never coded) and are skipped below
            const int past = 8 * p + 8 - K;
            fl[u] = (u32)oflag[p] | (past > 0 ? (0xFFu << (8 - past)) & 0xFFu : 0u);
        }
    }
}

template <int AB, int NT, int PPT>
__device__ __forceinline__ void quantize_one(const uint4 (&v)[PPT], const u32 (&fl)[PPT], int row, int K, int vec,
                                             const int* __restrict__ dest, int kp, int kop, char* cs, u16* os,
                                             float* red, char* __restrict__ aq, u16* __restrict__ xo,
                                             float* __restrict__ sx, float* __restrict__ zx, int tid,
                                             int* rsred = nullptr, int* __restrict__ rsum = nullptr) {
    using C = ActCodes<AB>;
    constexpr int W = NT / 32;
    const int lane = tid & 31, warp = tid >> 5, np = (K + 7) >> 3;
    float inf;
    asm("mov.b32 %0, 0x7f800000;" : "=f"(inf));
    // min/max of fp16 values is exact in fp16: whole pieces without kept-out columns take f16x2 min/max (2 ops per
    // 2 columns), the few pieces with kept-out (or past-K) columns go column by column
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
    C::scale(lo, hi, s, y);
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
                    C::put(h, d[i], lo, y, cs, os, csum);
                }
            }
        }
    }
    // the previous row's partial sums were read by thread 0 before it reached this row's first barrier
    if constexpr (C::SUMS) C::row_sums(csum, rsred, tid);
    __syncthreads();
    char* arow = aq + (size_t)row * kp;
    for (int c = tid; c < kp / 16; c += NT) st_global16(arow + 16 * c, *reinterpret_cast<const uint4*>(cs + 16 * c));
    u16* orow = xo + (size_t)row * kop;
    for (int c = tid; c < kop / 8; c += NT)
        st_global16(orow + 8 * c, *reinterpret_cast<const uint4*>(os + 8 * c));
    if (tid == 0) {
        sx[row] = s;
        C::template row_stats<W>(row, lo, rsred, zx, rsum);
    }
}

// The entry's body: rows blockIdx.x, + gridDim.x, ... of x [M, K] into aq [M, kp] (codes), xo [M, kop] (kept-out
// values), sx, and the scheme's zx or rsum.
template <int AB, int NT, int PPT>
__device__ __forceinline__ void quantize_rows(const u16* __restrict__ x, int ldx, int M, int K, int vec,
                                              const int* __restrict__ dest, const u8* __restrict__ oflag, int kb,
                                              int kp, int ko, int kop, char* __restrict__ aq, u16* __restrict__ xo,
                                              float* __restrict__ sx, float* __restrict__ zx,
                                              int* __restrict__ rsum = nullptr) {
    // 128: QUIK's warp-per-row quantize (quik/gemm.cu) declares the same symbol 128-byte aligned for its bulk
    // copies; alike here, this kernel's shared memory is laid out the same in every module that builds it
    extern __shared__ __align__(128) char qsm[];
    __shared__ float red[2 * (NT / 32)];
    __shared__ int rsred[ActCodes<AB>::SUMS ? NT / 32 : 1];
    const int tid = threadIdx.x, G = gridDim.x;
    launch_dependents();  // the GEMM that reads these rows waits for this whole grid anyway
    char* cs = qsm;                              // kp code bytes
    u16* os = reinterpret_cast<u16*>(qsm + kp);  // kop kept-out halves
    // Padding: the positions no column maps to (from the last partial group of 32 on) and the kept-out slots past
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

// ---------------------------------------------------------------------------------------------------------------
// wgmma with A from registers and B from shared memory by descriptor, accumulating (the predicate is scale-d):
// integer (A s8, or u8 where UA; B s8, k = 32) or float16 (k = 16) on int accumulators (float bits, see f2bits).
// ---------------------------------------------------------------------------------------------------------------
// The accumulator operands of an m64nN wgmma (N/2 registers a thread) and their places in its asm string.
#define WG_ACC8 "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7])
#define WG_REGS8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define WG_ACC16 "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15])
#define WG_REGS16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define WG_ACC32 "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31])
#define WG_REGS32 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_ACC64 "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63])
#define WG_REGS64 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}"
#define WG_ACC128 "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3]), "+r"(d[4]), "+r"(d[5]), "+r"(d[6]), "+r"(d[7]), "+r"(d[8]), "+r"(d[9]), "+r"(d[10]), "+r"(d[11]), "+r"(d[12]), "+r"(d[13]), "+r"(d[14]), "+r"(d[15]), "+r"(d[16]), "+r"(d[17]), "+r"(d[18]), "+r"(d[19]), "+r"(d[20]), "+r"(d[21]), "+r"(d[22]), "+r"(d[23]), "+r"(d[24]), "+r"(d[25]), "+r"(d[26]), "+r"(d[27]), "+r"(d[28]), "+r"(d[29]), "+r"(d[30]), "+r"(d[31]), "+r"(d[32]), "+r"(d[33]), "+r"(d[34]), "+r"(d[35]), "+r"(d[36]), "+r"(d[37]), "+r"(d[38]), "+r"(d[39]), "+r"(d[40]), "+r"(d[41]), "+r"(d[42]), "+r"(d[43]), "+r"(d[44]), "+r"(d[45]), "+r"(d[46]), "+r"(d[47]), "+r"(d[48]), "+r"(d[49]), "+r"(d[50]), "+r"(d[51]), "+r"(d[52]), "+r"(d[53]), "+r"(d[54]), "+r"(d[55]), "+r"(d[56]), "+r"(d[57]), "+r"(d[58]), "+r"(d[59]), "+r"(d[60]), "+r"(d[61]), "+r"(d[62]), "+r"(d[63]), "+r"(d[64]), "+r"(d[65]), "+r"(d[66]), "+r"(d[67]), "+r"(d[68]), "+r"(d[69]), "+r"(d[70]), "+r"(d[71]), "+r"(d[72]), "+r"(d[73]), "+r"(d[74]), "+r"(d[75]), "+r"(d[76]), "+r"(d[77]), "+r"(d[78]), "+r"(d[79]), "+r"(d[80]), "+r"(d[81]), "+r"(d[82]), "+r"(d[83]), "+r"(d[84]), "+r"(d[85]), "+r"(d[86]), "+r"(d[87]), "+r"(d[88]), "+r"(d[89]), "+r"(d[90]), "+r"(d[91]), "+r"(d[92]), "+r"(d[93]), "+r"(d[94]), "+r"(d[95]), "+r"(d[96]), "+r"(d[97]), "+r"(d[98]), "+r"(d[99]), "+r"(d[100]), "+r"(d[101]), "+r"(d[102]), "+r"(d[103]), "+r"(d[104]), "+r"(d[105]), "+r"(d[106]), "+r"(d[107]), "+r"(d[108]), "+r"(d[109]), "+r"(d[110]), "+r"(d[111]), "+r"(d[112]), "+r"(d[113]), "+r"(d[114]), "+r"(d[115]), "+r"(d[116]), "+r"(d[117]), "+r"(d[118]), "+r"(d[119]), "+r"(d[120]), "+r"(d[121]), "+r"(d[122]), "+r"(d[123]), "+r"(d[124]), "+r"(d[125]), "+r"(d[126]), "+r"(d[127])
#define WG_REGS128 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}"

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
WG_WRAPPERS(16, 8, "%8, %9, %10, %11", "12", "13")
WG_WRAPPERS(32, 16, "%16, %17, %18, %19", "20", "21")
WG_WRAPPERS(64, 32, "%32, %33, %34, %35", "36", "37")
WG_WRAPPERS(128, 64, "%64, %65, %66, %67", "68", "69")
WG_WRAPPERS(256, 128, "%128, %129, %130, %131", "132", "133")

#if INT8_ABLATE == 3
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
// The GEMM: C[M, N] = epilogue(A[M, Kp] · W[N, Kp]^T) (+ Xo · Wo^T) + bias, with the operands swapped for wgmma:
// weight rows are its M dimension (64 per warpgroup, 128 per block of two warpgroups) and the tokens its N
// dimension (TN per block). wgmma reads A from registers, so the weight codes go from shared memory through 4-byte
// loads and a few logic ops straight into A fragments (Int8Scheme::frags); only B (activation s8 rows, or float16
// rows of a float16 stage) is read by the tensor cores from shared memory. Every stage is 128 codes (or 64
// float16 columns, 32 in the warp-specialized 4-bit form): 128 bytes per activation row, 128-byte swizzle (16-byte
// chunk c of row r at c ^ (r % 8)).
//
// The stage list of a layer: kt integer stages, then (where the scheme has them) float16 stages, whose products
// accumulate in float32 on the same registers once the scheme's epilogue has made the integer sums floats (QUIK's
// outlier columns: Xo [M, ldxo / 2] and Wo [N, ldwo / 2]). A 4-bit integer stage's weight area is half free; a
// scheme's side words (Int8Scheme::SIDE per weight row and stage) travel there, from SIDE_OFFSET (QoQ's group
// words), read from GemmArgs::Wo / ldwo, which then carries no float16 weights.
//
// Int8Scheme<BITS, SCH> supplies:
//   UA                      the weight codes enter wgmma as u8 (else s8)
//   SIDE                    side words (4 bytes each) per weight row and 4-bit stage, 0 for none
//   F16_STAGES              float16 stages may follow the integer ones (else their code is left out)
//   RAW_SHIFT               the raw int32 sums written are acc >> RAW_SHIFT
//   CORRECTS                the epilogue has an integer part (correct), which the raw sums include
//   INT_SHARES              split-K shares are the int32 sums, added exactly, and the epilogue runs once on their
//                           total; otherwise each share runs the epilogue (wred null for every share but the
//                           first: terms to add once per row) and the shares are added in float32, in split order
//   frags(af, wt, r0, t)    the A fragments of an integer stage's 4 k-steps for rows r0, r0 + 8 (weight area wt)
//   token_load(zx, m, sx)   what the epilogue needs of token m beside its s_x (zx: the per-token input), and
//   token_value(v)          that as the float (bits) it waits in shared memory as (tax); tokens past M have 0
//   correct<TN>(acc, f0, N, t, tax, wred)           (CORRECTS) the epilogue's integer part
//   scale<TN>(acc, f0, N, t, tsx, tax, sw, wred)    the accumulators into float bits (rows f0, f0 + 8)
// ---------------------------------------------------------------------------------------------------------------
template <int BITS, int SCH>
struct Int8Scheme;

constexpr int SIDE_OFFSET = 128 * 64;  // past the 4-bit codes of a stage

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
    const char* Xo;  // float16 stages' activations [M, ldxo / 2]
    int ldxo;
    const char* Wo;  // float16 stages' weights, reordered [N, ldwo / 2], or the side words (ldwo bytes per row)
    int ldwo;
    int M, N, kt, steps;  // steps: this block's stages (all of them, or its split-K share)
    int m0, n0;
    int s0;  // this block's first stage (split-K)
};

// Issue this thread's copies of global stage gs into the shared-memory stage at st: the activations (X), the
// weights (W) or both (the weights do not come from the kernel ahead, so a dependent launch may copy them first).
enum : int { STAGE_X = 1, STAGE_W = 2, STAGE_ALL = 3 };
template <int BITS, int TN, int PART, int SCH>
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
    if constexpr (Int8Scheme<BITS, SCH>::SIDE > 0) {
        // the stage's side words (SIDE per row) into the half of the weight area 4-bit codes leave free
        constexpr int GPS = Int8Scheme<BITS, SCH>::SIDE;
        static_assert(BITS == 4, "side words ride in a 4-bit stage's weight area");
#pragma unroll
        for (int i = 0; i < (128 * GPS + 255) / 256; ++i) {
            const int e = tid + 256 * i, row = e / GPS, f = g.n0 + row;
            const bool ok = f < g.N;
            if (e < 128 * GPS)
                cp_async4(wt + SIDE_OFFSET + 4 * e, g.Wo + (ok ? (size_t)f * g.ldwo + 4 * (s * GPS + e % GPS) : 0),
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

// A fragments of a float16 stage of 128-byte rows (64 columns, 128-byte swizzle): k-step j (16 columns) takes words
// 8j+t (a0/a1: columns 2t, 2t+1 of rows r0/r0+8) and 8j+4+t (a2/a3: columns 8+2t, 8+2t+1).
__device__ __forceinline__ void f16_frags(u32 (&af)[4][4], u32 wt, int r0, int t) {
    const int x = r0 & 7;
    const u32 p = wt + r0 * 128 + 4 * t, q = p + 8 * 128;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        af[j][0] = lds32(p + (((2 * j) ^ x) << 4));
        af[j][1] = lds32(q + (((2 * j) ^ x) << 4));
        af[j][2] = lds32(p + (((2 * j + 1) ^ x) << 4));
        af[j][3] = lds32(q + (((2 * j + 1) ^ x) << 4));
    }
}

// ... and of 64-byte rows (the 4-bit warp-specialized stages: 32 columns, 64-byte swizzle, chunk c of row r at
// c ^ ((r / 2) % 4) as in the 4-bit weight tiles): k-step j takes words t of chunks 2j (a0/a1) and 2j+1 (a2/a3).
__device__ __forceinline__ void f16_frags_o64(u32 (&af)[4][4], u32 wt, int r0, int t) {
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

// The scheme's epilogue on accumulators whose integer stages are done: its integer part, then the scaling into
// float bits.
template <int BITS, int SCH, int TN>
__device__ __forceinline__ void epilogue(int (&acc)[TN / 2], int f0, int N, int t, const float* tsx, const float* tax,
                                         const u16* sw, const float* wred) {
    using S = Int8Scheme<BITS, SCH>;
    if constexpr (S::CORRECTS) S::template correct<TN>(acc, f0, N, t, tax, wred);
    S::template scale<TN>(acc, f0, N, t, tsx, tax, sw, wred);
}

// One stage of the block-synchronous form: ST stages deep by cp.async, one wgmma group left in flight while the
// next stage's fragments are built.
template <int BITS, int TN, int ST, int SCH>
__device__ __forceinline__ void gemm_step(int (&acc)[TN / 2], u32 (&af)[4][4], const GemmArgs& g, u32 base, int s,
                                          int tid, int r0, int t, int f0, const float* tsx, const float* tax,
                                          const u16* __restrict__ sw, const float* __restrict__ wred) {
    using T = QTile<TN>;
    using S = Int8Scheme<BITS, SCH>;
    cp_async_wait<ST - 3>();  // this thread's copies of stage s are done
    fence_async_smem();       // they are read next by the tensor cores
    __syncthreads();          // everyone's copies; everyone's wgmma of stage s-2 is finished (wait 1 below)
    if (s + ST - 2 < g.steps && INT8_ABLATE != 2)
        load_stage<BITS, TN, STAGE_ALL, SCH>(g, base + (u32)((s + ST - 2) % ST) * T::SB, g.s0 + s + ST - 2, tid);
    cp_async_commit();
    const u32 st = base + (u32)(s % ST) * T::SB;
    const int gs = g.s0 + s;  // the stage in the layer's list: integer stages, then float16 stages
    if (gs < g.kt) {
#if INT8_ABLATE == 3
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
        if (INT8_ABLATE != 4) S::frags(af, st + T::XT, r0, t);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j)
            if (INT8_ABLATE != 1) wgmma_s8<S::UA>(acc, af[j], desc_sw128(st + 32 * j));
    } else if constexpr (S::F16_STAGES) {
        if (gs == g.kt && g.s0 < g.kt) {  // this block ran integer stages
            wgmma_wait0();
            epilogue<BITS, SCH, TN>(acc, f0, g.N, t, tsx, tax, sw, g.s0 == 0 ? wred : nullptr);
        }
        f16_frags(af, st + T::XT, r0, t);
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_f16(acc, af[j], desc_sw128(st + 32 * j));
    }
    wgmma_commit();
    wgmma_wait1();
}

// The raw int32 sums of this thread's accumulators (rows f0, f0 + 8; tokens 8i + 2t + e).
template <int BITS, int TN, int SCH>
__device__ __forceinline__ void store_raw(const int (&acc)[TN / 2], int m0, int f0, int M, int N, int t,
                                          void* __restrict__ out, int ldc) {
    int* o = reinterpret_cast<int*>(out);
#pragma unroll
    for (int i = 0; i < TN / 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int tok = m0 + 8 * i + 2 * t + (e & 1), f = f0 + 8 * (e >> 1);
            if (tok < M && f < N) o[(size_t)tok * ldc + f] = acc[4 * i + e] >> Int8Scheme<BITS, SCH>::RAW_SHIFT;
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

// The block's result: raw int32 sums (after the scheme's integer correction), or the scheme's epilogue where no
// float16 stage applied it yet, bias, and a transpose through shared memory at `tbase` for 16-byte row stores, CH
// tokens at a time (CH = TN: one pass through the free pipeline buffers; the persistent kernel passes a small
// buffer of its own). The 256 threads that hold the accumulators call it (thread index `tid` among them); BAR is
// the barrier that spans exactly them.
template <int BITS, int TN, int BAR, int CH, int SCH>
__device__ __forceinline__ void store_tile(int (&acc)[TN / 2], int m0, int n0, int M, int N, bool epi_pending,
                                           int r0, int t, int tid, char* smem_raw, u32 tbase, const float* tsx,
                                           const float* tax, const u16* __restrict__ sw,
                                           const float* __restrict__ wred, const u16* __restrict__ bias,
                                           void* __restrict__ out, int ldc, int raw) {
    using S = Int8Scheme<BITS, SCH>;
    const int f0 = n0 + r0;
    if constexpr (S::CORRECTS) {
        if (epi_pending) S::template correct<TN>(acc, f0, N, t, tax, wred);
    }
    if (raw) {
        store_raw<BITS, TN, SCH>(acc, m0, f0, M, N, t, out, ldc);
        return;
    }
    if (epi_pending) S::template scale<TN>(acc, f0, N, t, tsx, tax, sw, wred);
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

// The persistent kernel's epilogue: the scheme's epilogue if still pending, bias, then out through the copy engine
// (tma_store_tile, common/ptx_common.cuh; `mo`: the float16 output as bytes, boxes of 128 bytes x 32 tokens,
// 128-byte swizzle).
template <int BITS, int TN, int EB, int SCH>
__device__ __forceinline__ void store_tile_tma(int (&acc)[TN / 2], int m0, int n0, int M, int N, bool epi_pending,
                                               int r0, int t, int tid, u32 ebuf, int& eb, const float* tsx,
                                               const float* tax, const u16* __restrict__ sw,
                                               const float* __restrict__ wred, const u16* __restrict__ bias,
                                               const TmaMap* mo) {
    using S = Int8Scheme<BITS, SCH>;
    const int f0 = n0 + r0;
    if (INT8_EPI < 3 && epi_pending) epilogue<BITS, SCH, TN>(acc, f0, N, t, tsx, tax, sw, wred);
    if (INT8_EPI == 2 || INT8_EPI == 3) {
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
    tma_store_tile<TN, EB, INT8_EPI>([&](int i) { return bits2f(acc[i]) + bv[(i >> 1) & 1]; }, m0, n0, M, tid, ebuf,
                                     eb, mo);
}

// Split-K (gridDim.z = S > 1, few tiles: decode) is built for the decode tiles only (qtool/layouts/quik/cuda.py).
constexpr int SPLIT_MAX_TOKENS = 128;

// The block-synchronous form, a tile per block (blockIdx.x: 128 weight rows, blockIdx.y: TN tokens), every stage
// by cp.async. raw: write the int32 sums (no float16 stages, no split). Otherwise the float16 output, the scheme's
// epilogue and bias applied. Split-K: ws has room for S x tiles x 128 x TN floats and cnt one zero int per tile.
template <int BITS, int TN, int ST, int SCH>
__device__ __forceinline__ void gemm_body(const GemmArgs& g0, const float* __restrict__ sx,
                                          const float* __restrict__ zx, const u16* __restrict__ sw,
                                          const float* __restrict__ wred, const u16* __restrict__ bias,
                                          void* __restrict__ out, int ldc, int raw, float* __restrict__ ws,
                                          int* __restrict__ cnt) {
    using T = QTile<TN>;
    using Sch = Int8Scheme<BITS, SCH>;
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
    // The first stages' weight copies go out before the wait for the kernel ahead (the quantize kernel, whose
    // activations, s_x and the per-token values the rest reads); they join the first stage's copy group.
#pragma unroll
    for (int p = 0; p < ST - 2; ++p)
        if (p < g.steps) load_stage<BITS, TN, STAGE_W, SCH>(g, base + (u32)p * T::SB, g.s0 + p, tid);
    grid_dependency_wait();
    for (int k = tid; k < TN; k += 256) {
        const int m = g.m0 + k;
        const float sv = m < g.M ? ld_dep_f32(sx + m) : 0.f;
        tsx[k] = sv;
        tax[k] = Sch::token_value(m < g.M ? Sch::token_load(zx, m, sv) : 0);
    }

    int acc[TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[i] = 0;
#pragma unroll
    for (int p = 0; p < ST - 2; ++p) {
        if (p < g.steps) load_stage<BITS, TN, STAGE_X, SCH>(g, base + (u32)p * T::SB, g.s0 + p, tid);
        cp_async_commit();
    }
    u32 af0[4][4], af1[4][4];  // a stage's wgmmas may still read one set while the next stage fills the other
#if INT8_ABLATE == 4
#pragma unroll
    for (int j = 0; j < 16; ++j) af0[j / 4][j % 4] = af1[j / 4][j % 4] = 0x01010101u * (u32)(tid & 7);
#endif
    int s = 0;
    for (; s + 1 < g.steps; s += 2) {
        gemm_step<BITS, TN, ST, SCH>(acc, af0, g, base, s, tid, r0, t, f0, tsx, tax, sw, wred);
        gemm_step<BITS, TN, ST, SCH>(acc, af1, g, base, s + 1, tid, r0, t, f0, tsx, tax, sw, wred);
    }
    if (s < g.steps) gemm_step<BITS, TN, ST, SCH>(acc, af0, g, base, s, tid, r0, t, f0, tsx, tax, sw, wred);
    launch_dependents();  // the next layer's quantize kernel may start its prologue during this epilogue
    wgmma_wait0();
    cp_async_wait<0>();
    __syncthreads();  // the pipeline's shared memory is free from here on (and tsx/tax are visible)
    bool epi_pending = g.steps > 0 && g.s0 + g.steps <= g.kt;  // integer stages only: the epilogue not applied yet
    if (TN <= SPLIT_MAX_TOKENS && S > 1) {
        // Split-K (fused output only): every block writes its share of the tile in the accumulator layout, one
        // float4 per thread and step; the last of the tile's blocks adds the shares, then takes the epilogue. It
        // leaves the tile's counter at zero. Float shares (the scheme's epilogue applied, its once-per-row terms by
        // the first share only) are added in split order (deterministic); int32 shares (as float bits) exactly.
        if constexpr (!Sch::INT_SHARES) {
            if (epi_pending) epilogue<BITS, SCH, TN>(acc, f0, g.N, t, tsx, tax, sw, g.s0 == 0 ? wred : nullptr);
            epi_pending = false;
        } else {
            epi_pending = g.kt > 0;
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
                if constexpr (!Sch::INT_SHARES) {
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
    store_tile<BITS, TN, 0, TN, SCH>(acc, g.m0, g.n0, g.M, g.N, epi_pending, r0, t, tid, smem_raw, base, tsx, tax, sw,
                                     wred, bias, out, ldc, raw);
}

// ---------------------------------------------------------------------------------------------------------------
// Warp-specialized form (same result as above): 384 threads. Warpgroup 0 is the copy warpgroup: one thread issues
// the bulk tensor copies (TMA) of every stage into an ST-deep ring and the rest idle (or produce activation rows,
// FUSED); it gives most of its registers to the two math warpgroups (setmaxnreg). Each stage has a "full" barrier
// (the copy engine completes it with the byte count) and an "empty" one (every math warp arrives once its wgmmas
// have read the stage). The math warpgroups never meet at a block barrier inside the loop: while a stage's wgmmas
// run they wait for the next stage and build its A fragments, so the fragment loads overlap the tensor cores
// instead of following a barrier. The copy engine writes shared memory in the async proxy, so no proxy fence is
// needed before wgmma reads it, and its 64/128-byte swizzles are the layouts the fragment loads and the B
// descriptors above expect.
//
// Tensor maps (qtool/cuda/tma.py), all over bytes: ma = activation codes [M, Kp] box 128 x TN, 128-byte swizzle;
// mw = weight code rows [N, Kp*BITS/8] box 16*BITS x 128, swizzle 16*BITS bytes; mxo = float16 stages'
// activations [M, 2*kop] box OB x TN; mwo = their weights [N, 2*kop] box OB x 128, both with an OB-byte swizzle,
// where OB (WsTile::OB) is 64 for 4-bit weights (32 columns per float16 stage) and 128 for 8-bit (64 columns). Rows
// past M or N arrive as zeros. mo = the float16 output [M, 2N] box 128 x 32, 128-byte swizzle: the persistent
// kernel's epilogue stores through it where `tmo` is set (else, and for raw sums, 16-byte stores from the threads).
// Side words arrive by a 1-D bulk copy per stage from a stage-major copy (`gst`: per 128-row block, kt stages of
// WsTile::SWS bytes).
// ---------------------------------------------------------------------------------------------------------------
template <int TN, int BITS, int SIDE>
struct WsTile {
    static constexpr int XT = TN * 128;               // activation tile of an integer stage
    static constexpr int WB = 128 * 16 * BITS;        // weight tile of an integer stage
    // the stage's side words (128 rows x SIDE words, read at SIDE_OFFSET = WB), padded so the stage stays a multiple
    // of 1024 bytes
    static constexpr int SWS = 128 * SIDE * 4;
    static constexpr int SWB = (SWS + 1023) / 1024 * 1024;
    // float16 bytes per row and stage: 4-bit stages take 32 columns (64-byte rows, 64-byte swizzle), so that their
    // weight tile fits the integer stages' 8 KB and a stage stays at XT + 8 KB: the ring then leaves room for a
    // fifth stage. 8-bit stages take 64 columns (128-byte rows) as the block-synchronous kernel does.
    static constexpr int OB = BITS == 4 ? 64 : 128;
    static constexpr int SB = XT + WB + SWB;          // a stage; a multiple of 1024: the swizzle atoms stay aligned
    enum : int { EPI_TOKENS = 32 };  // the persistent kernel's epilogue chunk (thread stores: 32 x 136 halves)
    // store_tile_tma's 8 KB buffers beside a ring of ST stages: what fits in the 227 KB a block may have, less
    // the alignment slack and the static arrays (s_x, the per-token values, barriers), at most 8
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

// FUSED: the persistent form produces its own activation rows (codes, s_x and the per-token values) in its idle
// copy warps and, before the first tiles, in its math warps. The source that instantiates it defines
// FusedProducer<BITS, TN, ST, EBF> over its FusedQuant arguments (the members NoProducer lists: ws_body calls them
// where the rows' life crosses the pipeline's), and gets EBF epilogue buffers beside the ring, its own shared
// memory after them.
struct FusedQuant;
template <int BITS, int TN, int ST, int EBF>
struct FusedProducer;

// The forms without a producer: the rows come from the kernel ahead. Its members are what ws_body asks of a
// producer, in the order it asks.
struct NoProducer {
    enum : int { BARRIERS = 1, COUNTS = 1 };  // ws_body's shared arrays for the producer: mbarriers, counters,
    using Exchange = float[1][1][2];          // and its warps' min/max exchange
    // where ws_body's shared values are known (M tokens; the ring at `base`)
    __device__ __forceinline__ NoProducer(const FusedQuant*, int, u32, u64*, u32*) {}
    __device__ __forceinline__ void init() const {}               // thread 0, before the block's first barrier
    // measurement builds: a timestamp (slot 0 block start, 33 + j / 41 + j tile j's start / end for j < 8, 49 the
    // first activation copy)
    __device__ __forceinline__ void trace(int) const {}
    __device__ __forceinline__ void locate(char*) {}              // after the barrier, every thread
    __device__ __forceinline__ void before_copies() const {}      // the copy thread, before any activation copy
    __device__ __forceinline__ void rows_ready(int, int) const {}  // tile m0's rows are written (copy and math)
    __device__ __forceinline__ void copy_warps(int, int, const float*, const float*) const {}  // the idle ones
    // the math warps, before their first tile
    __device__ __forceinline__ void math_warps(int, int, const float*, const float*, char*, u32, float (*)[1][2]) {}
    __device__ __forceinline__ void finish(int, int) const {}     // every thread, at the block's end
};

template <bool C, typename A, typename B>
struct Pick {
    using type = A;
};
template <typename A, typename B>
struct Pick<false, A, B> {
    using type = B;
};

// The copy thread. A producer's rows are waited for before each tile's activation copies.
// Split-K (tile-per-block form): the block's tile `first` (else blockIdx.x) from stage s0 on (s0 .. s0 + steps - 1
// of kt).
template <int BITS, int TN, int ST, int SCH, typename P>
__device__ __forceinline__ void ws_copies(const TmaMap* ma, const TmaMap* mw, const TmaMap* mxo, const TmaMap* mwo,
                                          u32 base, u32 bars, int M, int N, int kt, int steps, const P& prod,
                                          const char* gst = nullptr, int s0 = 0, int first = -1) {
    using T = WsTile<TN, BITS, Int8Scheme<BITS, SCH>::SIDE>;
    const int tiles = ((N + 127) >> 7) * ((M + TN - 1) / TN);
    // A stage's byte count on its full barrier, then its weight copy (the activation copy is issued separately).
    auto weights = [&](int gs, int slot, int n0) {
        const bool outl = gs >= kt;
        const int s = outl ? gs - kt : s0 + gs;
        const u32 full = bars + 8 * slot;
        mbar_arrive_expect_tx(full, outl ? (TN + 128) * T::OB : T::XT + T::WB + T::SWS);
        tma_load_2d(base + (u32)slot * T::SB + T::XT, outl ? mwo : mw, full, outl ? T::OB * s : 16 * BITS * s, n0);
        if constexpr (T::SWS > 0)
            bulk_load(base + (u32)slot * T::SB + T::XT + T::WB,
                      gst + ((size_t)(n0 >> 7) * (size_t)kt + (size_t)s) * T::SWS, T::SWS, full);
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
    prod.before_copies();
    int g = 0;  // position in the ring over all of this block's tiles
    for (int tile = t0; tile < tiles; tile += gridDim.x) {
        int m0, n0;
        ws_tile(tile, N, TN, m0, n0);
        prod.rows_ready(m0, M);
        if (g == 0) prod.trace(49);
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

// The A fragments of a warp-specialized stage: integer (`intg`) or float16, in the stage layout of WsTile.
template <int BITS, int TN, int SCH>
__device__ __forceinline__ void ws_frags(u32 (&af)[4][4], u32 wt, int r0, int t, bool intg) {
    using S = Int8Scheme<BITS, SCH>;
    if constexpr (!S::F16_STAGES)
        S::frags(af, wt, r0, t);
    else if (intg)
        S::frags(af, wt, r0, t);
    else if (WsTile<TN, BITS, 0>::OB == 64)
        f16_frags_o64(af, wt, r0, t);
    else
        f16_frags(af, wt, r0, t);
}

// One stage of a math warpgroup: the wgmmas of the tile's stage gs (ring position g) on fragments `cur`, then
// (while they run) the release of the previous stage and the fragments of the next one into `nxt`.
template <int BITS, int TN, int ST, int SCH>
__device__ __forceinline__ void ws_step(int (&acc)[TN / 2], u32 (&cur)[4][4], u32 (&nxt)[4][4], u32 base, u32 bars,
                                        int gs, int g, int kt, int steps, int N, int f0, int r0, int t, int lane,
                                        const float* tsx, const float* tax, const u16* __restrict__ sw,
                                        const float* __restrict__ wred) {
    using S = Int8Scheme<BITS, SCH>;
    using T = WsTile<TN, BITS, S::SIDE>;
    const u32 st = base + (u32)(g % ST) * T::SB;
    if (gs < kt) {
        wgmma_fence();
#pragma unroll
        for (int j = 0; j < 4; ++j) wgmma_s8<S::UA>(acc, cur[j], desc_sw128(st + 32 * j));
    } else if constexpr (S::F16_STAGES) {
        if (gs == kt && kt > 0) {
            wgmma_wait0();
            if (INT8_EPI < 3) epilogue<BITS, SCH, TN>(acc, f0, N, t, tsx, tax, sw, wred);
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
        ws_frags<BITS, TN, SCH>(nxt, wt, r0, t, gs + 1 < kt);
    }
}

// Split-K of the tile-per-block warp-specialized form (share z of S of split tile `tile` of `tiles`; int32 shares
// only): the 256 math threads write their share in the accumulator layout (one int4 per thread and 8 tokens, the
// tile's valid tokens only); the tile's last block adds the other shares to its own (integer sums: exact in any
// order), resets the tile's counter and takes the epilogue. False in the other blocks, which are done.
template <int TN>
__device__ __forceinline__ bool ws_split_add(int (&acc)[TN / 2], int* __restrict__ wsk, int* __restrict__ cnt,
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
// buffers of its own (WsTile::epi_buffers, 32 tokens at a time); each thread loads the next tile's s_x and
// per-token value during the current tile (two shared-memory copies, by tile parity). Otherwise every block has one
// tile and the epilogue transposes through the ring in one pass.
// FUSED: a producer writes the activation rows (FusedProducer above; PERSIST and the copy-engine epilogue only),
// with EBF epilogue buffers: s_x and the per-token values are written by this kernel, not by a kernel ahead.
// Int32 split-K (Int8Scheme::INT_SHARES; the tile-per-block form without a producer): blocks 0..dp-1 take tiles
// 0..dp-1 whole, and each later tile is split over `nsplit` blocks (ws_split_add; `wsk` and `cnt` as split_k.py's
// workspace), so that a layer with few tiles (4096 rows: 32 tiles of 128) keeps every multiprocessor streaming
// weights, and a layer with a wave and a fraction of tiles spreads that fraction over the whole GPU (dp = whole
// waves: a Stream-K-like remainder).
template <int BITS, int TN, int ST, bool PERSIST, bool FUSED, int EBF, int SCH>
__device__ __forceinline__ void ws_body(const TmaMap* ma, const TmaMap* mw, const TmaMap* mxo, const TmaMap* mwo,
                                        const TmaMap* mo, int M, int N, int kt, int steps,
                                        const float* __restrict__ sx, const float* __restrict__ zx,
                                        const u16* __restrict__ sw, const float* __restrict__ wred,
                                        const u16* __restrict__ bias, void* __restrict__ out, int ldc, int raw,
                                        int tmo, const FusedQuant* fq = nullptr, const char* gst = nullptr,
                                        int dp = 0, int nsplit = 1, int* __restrict__ wsk = nullptr,
                                        int* __restrict__ cnt = nullptr) {
    using S = Int8Scheme<BITS, SCH>;
    using T = WsTile<TN, BITS, S::SIDE>;
    using P = typename Pick<FUSED, FusedProducer<BITS, TN, ST, EBF>, NoProducer>::type;
    constexpr bool SPLIT = !PERSIST && !FUSED && S::INT_SHARES;
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
    __shared__ __align__(8) u64 qbar_mem[P::BARRIERS];
    __shared__ typename P::Exchange fqred;
    __shared__ u32 qdone[P::COUNTS];
    static_assert(!FUSED || S::SIDE == 0, "a producer's shared memory follows the epilogue buffers of a plain ring");
    P prod(fq, M, base, qbar_mem, qdone);
    if (tid == 0) {
        ring_init<ST>(bars);
        prod.init();
    }
    __syncthreads();
    if (tid == 0) prod.trace(0);
    prod.locate(smem_raw);
    if (tid < 128) {
        regs_decrease<40>();
        if (tid == 0) {
            tma_prefetch_map(ma);
            tma_prefetch_map(mw);
            ws_copies<BITS, TN, ST, SCH>(ma, mw, mxo, mwo, base, bars, M, N, kt, steps, prod, gst, s0, t0);
        }
        if (!FUSED) return;
        prod.copy_warps(tid, M, sx, zx);
        launch_dependents();
    } else {
    regs_increase<232>();
    grid_dependency_wait();  // s_x and the per-token values come from the kernel ahead, or (FUSED) x does
    const int ctid = tid - 128, warp = (ctid >> 5) & 3, lane = tid & 31, gq = lane >> 2, t = lane & 3;
    if (FUSED) prod.math_warps(ctid, lane, sx, zx, smem_raw, base, fqred);
    const int r0 = 64 * (ctid >> 7) + 16 * warp + gq;  // this lane's rows in the tile: r0, r0 + 8
    const int tiles = ((N + 127) >> 7) * ((M + TN - 1) / TN);
    float nsx = 0.f, nax = 0.f;  // token ctid of the next tile
    auto fetch = [&](int tl) {
        int m0_, n0_;
        ws_tile(tl, N, TN, m0_, n0_);
        const int m = m0_ + ctid;
        const bool ok = tl < tiles && ctid < TN && m < M;
        if (FUSED && ok) prod.rows_ready(m0_, M);
        nsx = ok ? ld_dep_f32(sx + m) : 0.f;
        nax = S::token_value(ok ? S::token_load(zx, m, nsx) : 0);
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
        if (ctid == 0 && j < 8) prod.trace(33 + j);
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
            ws_frags<BITS, TN, SCH>(af0, wt, r0, t, kt > 0);
        }
        int gs = 0;
        for (; gs + 1 < steps; gs += 2) {
            ws_step<BITS, TN, ST, SCH>(acc, af0, af1, base, bars, gs, g + gs, kt, steps, N, n0 + r0, r0, t, lane,
                                       csx, cax, sw, wred);
            ws_step<BITS, TN, ST, SCH>(acc, af1, af0, base, bars, gs + 1, g + gs + 1, kt, steps, N, n0 + r0, r0, t,
                                       lane, csx, cax, sw, wred);
        }
        if (gs < steps)
            ws_step<BITS, TN, ST, SCH>(acc, af0, af1, base, bars, gs, g + gs, kt, steps, N, n0 + r0, r0, t, lane,
                                       csx, cax, sw, wred);
        wgmma_wait0();
        if (steps > 0 && lane == 0) mbar_arrive(bars + 8 * (ST + (g + steps - 1) % ST));  // the tile's last stage
        // FUSED: the next tile's rows may be produced by now (they are during the first tiles): waited for here,
        // after this tile's wgmmas, so the wait and the loads overlap the epilogue
        if (FUSED) fetch(tile + (int)gridDim.x);
        bool epi_pending = steps == kt && kt > 0;
        if constexpr (SPLIT) {
            if (split) {
                if (!ws_split_add<TN>(acc, wsk, cnt, tile - dp, tiles - dp, z, nsplit, min(TN, M - m0), ctid, t))
                    return;
                epi_pending = kt > 0;  // the once-per-row terms, once, on the total
            }
        }
        if (PERSIST && tmo && !raw) {
            constexpr int EB = FUSED ? EBF : T::template epi_buffers<ST>();
            static_assert(EB >= 2, "the ring leaves room for two epilogue buffers");
            store_tile_tma<BITS, TN, EB, SCH>(acc, m0, n0, M, N, epi_pending, r0, t, ctid, base + (u32)(ST * T::SB),
                                              eb, csx, cax, sw, wred, bias, mo);
            if (ctid == 0 && j < 8) prod.trace(41 + j);
        } else if (PERSIST) {
            // the buffer's last reads (previous tile) finished before this tile's first barrier
            store_tile<BITS, TN, 1, T::EPI_TOKENS, SCH>(acc, m0, n0, M, N, epi_pending, r0, t, ctid, smem_raw,
                                                        base + (u32)(ST * T::SB), csx, cax, sw, wred, bias, out,
                                                        ldc, raw);
        } else {
            bar_sync<1, 256>();  // every math warp is done with the ring: it becomes the transpose tile
            store_tile<BITS, TN, 1, TN, SCH>(acc, m0, n0, M, N, epi_pending, r0, t, ctid, smem_raw, base, csx, cax,
                                             sw, wred, bias, out, ldc, raw);
        }
    }
    if (PERSIST && tmo && ctid == 0) bulk_wait_all();  // the output is written before the block exits
    }
    prod.finish(tid, M);
}
