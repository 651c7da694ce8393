// QoQ's per-token symmetric INT8 activation codes (formats/qoq.md, steps 1-2) of one float16 row staged in shared
// memory, by a whole block: the codes at the GEMM's positions, s_x and the code sum, bit for bit what the quantize
// kernel (qoq/gemm.cu, ActCodes<SYM_A8>) writes for the same row. For the kernels that produce the row anyway
// (RMSNorm, SwiGLU: decoder/rms_norm.cu, decoder/swiglu.cu), so the row is not written in float16 and read back by a
// quantize kernel.
#pragma once
#include "common/ptx_common.cuh"

__device__ __forceinline__ float qa_div_rn(float a, float b) {
    float r;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

__device__ __forceinline__ float qa_max(float a, float b) {
    float r;
    asm("max.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
    return r;
}

// clamp(rint(x·r), -127, 127) with x·r one rounded product
__device__ __forceinline__ int qa_code(float x, float r) {
    float p;
    int q;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(p) : "f"(x), "f"(r));
    asm("cvt.rni.s32.f32 %0, %1;" : "=r"(q) : "f"(p));
    return max(-127, min(127, q));
}

// Row `row` (K halves in shared memory) -> codes[row, 0:kp] at positions dest[0:K] (zeros elsewhere), sx[row],
// rsum[row]. cs: kp bytes of shared scratch (16-byte aligned); fred / ired: NT / 32 entries each. Every thread of
// the block (NT of them) calls it; the row must be complete and visible (after a barrier).
template <int NT>
__device__ __forceinline__ void qoq_codes_of_row(const u16* row, int K, const int* __restrict__ dest, int kp,
                                                 char* cs, float* fred, int* ired, char* __restrict__ codes,
                                                 float* __restrict__ sx, int* __restrict__ rsum, size_t r) {
    constexpr int W = NT / 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    // positions from the last partial group of 32 on may be holes: zero them before the scatter
    for (int j = (K & ~31) + tid; j < kp; j += NT) cs[j] = 0;
    float am = 0.f;
    for (int i = tid; i < K; i += NT) {
        float v;
        asm("abs.f32 %0, %1;" : "=f"(v) : "f"(h2f(row[i])));
        am = qa_max(am, v);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) am = qa_max(am, __shfl_xor_sync(0xffffffffu, am, o));
    if (lane == 0) fred[warp] = am;
    __syncthreads();
    am = fred[0];
#pragma unroll
    for (int w = 1; w < W; ++w) am = qa_max(am, fred[w]);
    const float rr = am > 0.f ? qa_div_rn(127.f, am) : 1.0f;
    const float s = am > 0.f ? qa_div_rn(am, 127.f) : 1.0f;
    int sum = 0;
    for (int i = tid; i < K; i += NT) {
        const int q = qa_code(h2f(row[i]), rr);
        cs[__ldg(dest + i)] = (char)q;
        sum += q;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (lane == 0) ired[warp] = sum;
    __syncthreads();
    uint4* crow = reinterpret_cast<uint4*>(codes + r * (size_t)kp);
    for (int c = tid; c < kp / 16; c += NT) crow[c] = *reinterpret_cast<const uint4*>(cs + 16 * c);
    if (tid == 0) {
        int t = 0;
#pragma unroll
        for (int w = 0; w < W; ++w) t += ired[w];
        sx[r] = s;
        rsum[r] = t;
    }
}
