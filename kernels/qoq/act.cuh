// QoQ's per-token symmetric INT8 activation codes (formats/qoq.md, steps 1-2) for the kernels that produce the
// float16 row anyway (RMSNorm, SwiGLU: decoder/rms_norm.cu, decoder/swiglu.cu), so the row is not written in float16
// and read back by a quantize kernel: the codes at the GEMM's positions, s_x and the code sum, bit for bit what the
// quantize kernel (qoq/gemm.cu, ActCodes<SYM_A8>) writes for the same row.
//
// The row is handled in pieces of 8 consecutive columns (16 bytes of float16), each thread of the producing kernel
// keeping its own pieces: it folds their |x| into a running maximum while it produces them (qoq_absmax8), the
// maximum of the row comes from the warps' partials (qoq_slots_max), and the thread writes each piece's 8 codes
// straight to the code row at the positions the GEMM reads them from (qoq_codes8, qoq_store8; zero words for the
// padding past K). The maximum and the code sum are exact in any order, so how a kernel splits the row does not
// change them.
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

// max(am, |x|) over the 8 float16 values of a piece (am starts at 0: every |x| is at least that)
__device__ __forceinline__ float qoq_absmax8(const uint4& v, float am) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        float a;
        asm("abs.f32 %0, %1;" : "=f"(a) : "f"(h2f(half_of(v, j))));
        am = qa_max(am, a);
    }
    return am;
}

__device__ __forceinline__ float qoq_warp_max(float am) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) am = qa_max(am, __shfl_xor_sync(0xffffffffu, am, o));
    return am;
}

// The maximum of the n <= 64 warp partials at `slots` (shared memory, complete after a barrier), in every lane of
// the calling warp.
__device__ __forceinline__ float qoq_slots_max(const float* slots, int n) {
    const int lane = threadIdx.x & 31;
    float am = lane < n ? slots[lane] : 0.f;
    if (lane + 32 < n) am = qa_max(am, slots[lane + 32]);
    return qoq_warp_max(am);
}

// The sum of the n <= 64 warp partials at `slots`, in every lane of the calling warp.
__device__ __forceinline__ int qoq_slots_sum(const int* slots, int n) {
    const int lane = threadIdx.x & 31;
    int t = lane < n ? slots[lane] : 0;
    if (lane + 32 < n) t += slots[lane + 32];
    return warp_sum_i32(t);
}

// r = 127 / am and s_x = am / 127 (IEEE division), both 1 for an all-zero row
__device__ __forceinline__ float qoq_ratio(float am) { return am > 0.f ? qa_div_rn(127.f, am) : 1.0f; }
__device__ __forceinline__ float qoq_scale(float am) { return am > 0.f ? qa_div_rn(am, 127.f) : 1.0f; }

__device__ __forceinline__ u32 qoq_pack4(int a, int b, int c, int d) {
    return (u32)(a & 0xFF) | (u32)(b & 0xFF) << 8 | (u32)(c & 0xFF) << 16 | (u32)d << 24;
}

// Piece p of the row (columns 8p..8p+7, values v) -> its 8 codes as the two words qoq_store8 writes, their sum
// added to `sum`.
__device__ __forceinline__ uint2 qoq_codes8(const uint4& v, float rr, int perm, int& sum) {
    int q[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        q[j] = qa_code(h2f(half_of(v, j)), rr);
        sum += q[j];
    }
    if (perm) return make_uint2(qoq_pack4(q[0], q[2], q[4], q[6]), qoq_pack4(q[1], q[3], q[5], q[7]));
    return make_uint2(qoq_pack4(q[0], q[1], q[2], q[3]), qoq_pack4(q[4], q[5], q[6], q[7]));
}

// Piece p's codes `w` (qoq_codes8) into the code row. perm 1 (4-bit layers): column b sits at byte 32 (b / 32) +
// 16 (b % 2) + (b % 32) / 2 (the order a 4-bit weight word unpacks in: qtool/layouts/quik/cuda.py act_positions),
// so the piece's even columns fill one aligned word and its odd columns the word 16 bytes further; perm 0 (8-bit
// layers): column order, the piece's 8 bytes at 8p. Pieces past the row's K columns (K <= 8p < kp) take zeros,
// which meet the weights' padding in the GEMM.
__device__ __forceinline__ void qoq_store8(char* crow, int p, int perm, uint2 w) {
    if (perm) {
        u32* e = reinterpret_cast<u32*>(crow + 32 * (p >> 2) + 4 * (p & 3));
        e[0] = w.x;
        e[4] = w.y;
    } else {
        reinterpret_cast<uint2*>(crow)[p] = w;
    }
}
