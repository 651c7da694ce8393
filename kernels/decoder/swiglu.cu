// SwiGLU activation of the fused gate/up projection: out[r, i] = silu(gu[r, i]) * gu[r, I + i], with silu(g) =
// g / (1 + exp(-g)) in float32 rounded to float16 and the product rounded to float16, as torch's F.silu and half
// multiply compute them (qtool/bench/e2e.py): one kernel instead of two. Rows of 2I float16, I % 8 == 0
// (qtool/cuda/swiglu.py checks). A programmatic dependent: gu is the projection's output, read after the wait
// through coherent loads.
#include "common/ptx_common.cuh"
#include "qoq/act.cuh"

__device__ __forceinline__ u16 swiglu1(u16 g, u16 u) {
    const float x = h2f(g);
    const u16 s = f2h(x / (1.0f + expf(-x)));
    return f2h(h2f(s) * h2f(u));
}

// Eight activations from eight gate and eight up values (16-byte pieces).
__device__ __forceinline__ uint4 swiglu8(const uint4& g, const uint4& u) {
    const u32 a[4] = {g.x, g.y, g.z, g.w}, b[4] = {u.x, u.y, u.z, u.w};
    u32 o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j)
        o[j] = (u32)swiglu1((u16)(a[j] & 0xFFFFu), (u16)(b[j] & 0xFFFFu)) |
               ((u32)swiglu1((u16)(a[j] >> 16), (u16)(b[j] >> 16)) << 16);
    return make_uint4(o[0], o[1], o[2], o[3]);
}

extern "C" __global__ void __launch_bounds__(256) swiglu_f16(const u16* __restrict__ gu, u16* __restrict__ out,
                                                            int R, int I) {
    launch_dependents();  // the down projection after it loads its weights before its own wait
    grid_dependency_wait();
    const int pieces = I >> 3;
    const long long total = (long long)R * pieces;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const long long r = e / pieces;
        const int p = (int)(e % pieces);
        const uint4 g = ld_dep_v4(reinterpret_cast<const uint4*>(gu + r * 2 * I) + p);
        const uint4 u = ld_dep_v4(reinterpret_cast<const uint4*>(gu + r * 2 * I + I) + p);
        reinterpret_cast<uint4*>(out + r * I)[p] = swiglu8(g, u);
    }
}

// A block per row, the activation row staged in shared memory (I halves, then kp code bytes) and turned into QoQ's
// INT8 codes for the W4A8 down projection (qoq/act.cuh); the float16 row is written only where `out` is given.
extern "C" __global__ void __launch_bounds__(256) swiglu_q8(const u16* __restrict__ gu, u16* __restrict__ out, int I,
                                                           const int* __restrict__ dest, int kp,
                                                           char* __restrict__ codes, float* __restrict__ sx,
                                                           int* __restrict__ rsum) {
    extern __shared__ __align__(16) char qsm[];
    __shared__ float fred[8];
    __shared__ int ired[8];
    u16* row = reinterpret_cast<u16*>(qsm);
    char* cs = qsm + ((2 * I + 15) & ~15);
    launch_dependents();
    grid_dependency_wait();
    const size_t r = blockIdx.x;
    const int pieces = I >> 3;
    for (int p = threadIdx.x; p < pieces; p += blockDim.x) {
        const uint4 g = ld_dep_v4(reinterpret_cast<const uint4*>(gu + r * 2 * I) + p);
        const uint4 u = ld_dep_v4(reinterpret_cast<const uint4*>(gu + r * 2 * I + I) + p);
        const uint4 ov = swiglu8(g, u);
        reinterpret_cast<uint4*>(row)[p] = ov;
        if (out) reinterpret_cast<uint4*>(out + r * I)[p] = ov;
    }
    __syncthreads();
    qoq_codes_of_row<256>(row, I, dest, kp, cs, fred, ired, codes, sx, rsum, r);
}
