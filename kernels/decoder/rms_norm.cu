// Residual add fused with RMSNorm, one block per row: hs = h + y (float16, rounded as torch's half add), then
// out = hs * rsqrt(mean(hs^2) + eps) * w with the mean and the products in float32 and one rounding to float16 (as
// torch's rms_norm kernel computes; the sum of squares is added in another order, so results agree to float16
// rounding, not bit for bit). Without y (null) the row is normalized as it is and hs is not written. One kernel
// instead of torch's add and its normalization kernel (about 6 us for one 4096-wide row on an H200, most of it
// fixed cost).
//
// Rows of D float16 (D % 8 == 0, 16-byte aligned rows: qtool/cuda/rms_norm.py checks).
//
// Launched as a programmatic dependent (qtool/cuda/dependent_launch.py): h and y come from the kernels ahead, so
// they are read after the wait, through coherent loads; w is a weight and never written by a kernel.
#include "common/ptx_common.cuh"
#include "qoq/act.cuh"

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ u32 add_h2(u32 a, u32 b) {
    u32 r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// Q8: the normalized row is also staged in shared memory (D halves, then kp code bytes) and turned into QoQ's INT8
// codes for the W4A8 projection that follows (qoq/act.cuh); `out` may then be null (no float16 rows written).
template <bool Q8>
__device__ __forceinline__ void add_rms_norm_body(const u16* __restrict__ h, const u16* __restrict__ y,
                                                  const u16* __restrict__ w, u16* __restrict__ hs,
                                                  u16* __restrict__ out, int D, float eps,
                                                  const int* __restrict__ dest = nullptr, int kp = 0,
                                                  char* __restrict__ codes = nullptr, float* __restrict__ sx = nullptr,
                                                  int* __restrict__ rsum = nullptr) {
    extern __shared__ __align__(16) char qsm[];
    __shared__ float part[8];
    __shared__ int ipart[8];
    u16* row = reinterpret_cast<u16*>(qsm);
    // The projection after this normalization streams its weights before it waits for it: let it start now.
    launch_dependents();
    grid_dependency_wait();
    const size_t base = (size_t)blockIdx.x * D;
    const uint4* hp = reinterpret_cast<const uint4*>(h + base);
    const uint4* yp = reinterpret_cast<const uint4*>(y + (y ? base : 0));
    uint4* sp = reinterpret_cast<uint4*>(hs + (y ? base : 0));
    const int pieces = D >> 3;
    float ss = 0.f;
    for (int p = threadIdx.x; p < pieces; p += blockDim.x) {
        uint4 v = ld_dep_v4(hp + p);
        if (y) {
            const uint4 b = ld_dep_v4(yp + p);
            v = make_uint4(add_h2(v.x, b.x), add_h2(v.y, b.y), add_h2(v.z, b.z), add_h2(v.w, b.w));
            sp[p] = v;
        }
        if (Q8) reinterpret_cast<uint4*>(row)[p] = v;
        const u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float lo = h2f((u16)(a[j] & 0xFFFFu)), hi = h2f((u16)(a[j] >> 16));
            ss += lo * lo + hi * hi;
        }
    }
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) tot += part[i];
    const float r = rsqrtf(tot / (float)D + eps);
    // this thread's own pieces again (it wrote hs / the staged row itself, so program order makes them visible)
    const uint4* src = Q8 ? reinterpret_cast<const uint4*>(row) : y ? reinterpret_cast<const uint4*>(hs + base) : hp;
    const uint4* wp = reinterpret_cast<const uint4*>(w);
    uint4* op = reinterpret_cast<uint4*>(out + (out ? base : 0));
    for (int p = threadIdx.x; p < pieces; p += blockDim.x) {
        const uint4 v = Q8 ? src[p] : ld_dep_v4(src + p), g = wp[p];
        const u32 a[4] = {v.x, v.y, v.z, v.w}, b[4] = {g.x, g.y, g.z, g.w};
        u32 o[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float lo = h2f((u16)(a[j] & 0xFFFFu)) * r * h2f((u16)(b[j] & 0xFFFFu));
            const float hi = h2f((u16)(a[j] >> 16)) * r * h2f((u16)(b[j] >> 16));
            o[j] = (u32)f2h(lo) | ((u32)f2h(hi) << 16);
        }
        const uint4 ov = make_uint4(o[0], o[1], o[2], o[3]);
        if (Q8) reinterpret_cast<uint4*>(row)[p] = ov;
        if (out) op[p] = ov;
    }
    if constexpr (Q8) {
        __syncthreads();
        qoq_codes_of_row<256>(row, D, dest, kp, qsm + ((2 * D + 15) & ~15), part, ipart, codes, sx, rsum,
                              blockIdx.x);
    }
}

extern "C" __global__ void __launch_bounds__(256) add_rms_norm_f16(const u16* __restrict__ h,
                                                                  const u16* __restrict__ y,
                                                                  const u16* __restrict__ w, u16* __restrict__ hs,
                                                                  u16* __restrict__ out, int D, float eps) {
    add_rms_norm_body<false>(h, y, w, hs, out, D, eps);
}

extern "C" __global__ void __launch_bounds__(256) add_rms_norm_q8(const u16* __restrict__ h, const u16* __restrict__ y,
                                                                 const u16* __restrict__ w, u16* __restrict__ hs,
                                                                 u16* __restrict__ out, int D, float eps,
                                                                 const int* __restrict__ dest, int kp,
                                                                 char* __restrict__ codes, float* __restrict__ sx,
                                                                 int* __restrict__ rsum) {
    add_rms_norm_body<true>(h, y, w, hs, out, D, eps, dest, kp, codes, sx, rsum);
}
