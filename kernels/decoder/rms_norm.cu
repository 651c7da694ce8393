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

// h + y, a piece (8 float16 values) at a time
__device__ __forceinline__ uint4 add_piece(const uint4& v, const uint4& b) {
    return make_uint4(add_h2(v.x, b.x), add_h2(v.y, b.y), add_h2(v.z, b.z), add_h2(v.w, b.w));
}

// ss plus the squares of a piece's values, in column order (both kernels: the codes of add_rms_norm_q8 equal those
// of add_rms_norm_f16's rows bit for bit only while the sum of squares is added in the same order)
__device__ __forceinline__ float add_squares(const uint4& v, float ss) {
    const u32 a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float lo = h2f((u16)(a[j] & 0xFFFFu)), hi = h2f((u16)(a[j] >> 16));
        ss += lo * lo + hi * hi;
    }
    return ss;
}

// rsqrt(mean(hs^2) + eps) from each thread's sum over its pieces: the warps' xor trees, then their partials in
// warp order (one block barrier)
__device__ __forceinline__ float rms_factor(float ss, float* part, int D, float eps) {
    ss = warp_sum(ss);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int i = 0; i < (int)(blockDim.x >> 5); ++i) tot += part[i];
    return rsqrtf(tot / (float)D + eps);
}

// A piece of hs times r times the weight's piece g, rounded once to float16
__device__ __forceinline__ uint4 norm_piece(const uint4& v, const uint4& g, float r) {
    const u32 a[4] = {v.x, v.y, v.z, v.w}, b[4] = {g.x, g.y, g.z, g.w};
    u32 o[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        const float lo = h2f((u16)(a[j] & 0xFFFFu)) * r * h2f((u16)(b[j] & 0xFFFFu));
        const float hi = h2f((u16)(a[j] >> 16)) * r * h2f((u16)(b[j] >> 16));
        o[j] = (u32)f2h(lo) | ((u32)f2h(hi) << 16);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

extern "C" __global__ void __launch_bounds__(256) add_rms_norm_f16(const u16* __restrict__ h,
                                                                  const u16* __restrict__ y,
                                                                  const u16* __restrict__ w, u16* __restrict__ hs,
                                                                  u16* __restrict__ out, int D, float eps) {
    __shared__ float part[8];
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
            v = add_piece(v, ld_dep_v4(yp + p));
            sp[p] = v;
        }
        ss = add_squares(v, ss);
    }
    const float r = rms_factor(ss, part, D, eps);
    // this thread's own pieces again (it wrote hs itself, so program order makes them visible)
    const uint4* src = y ? reinterpret_cast<const uint4*>(hs + base) : hp;
    const uint4* wp = reinterpret_cast<const uint4*>(w);
    uint4* op = reinterpret_cast<uint4*>(out + (out ? base : 0));
    for (int p = threadIdx.x; p < pieces; p += blockDim.x) {
        const uint4 ov = norm_piece(ld_dep_v4(src + p), wp[p], r);
        if (out) op[p] = ov;
    }
}

// 16 bytes into this thread's slot of shared memory, as an asynchronous copy where there is one (sm_80), which
// copy16_wait completes; the module also builds for older cards, for add_rms_norm_f16
__device__ __forceinline__ void copy16(uint4* dst, const uint4* src) {
#if __CUDA_ARCH__ >= 800
    cp_async16(smem_addr(dst), src, 16);
#else
    *dst = ld_nc_v4(src);
#endif
}

__device__ __forceinline__ void copy16_wait() {
#if __CUDA_ARCH__ >= 800
    cp_async_commit();
    cp_async_wait<0>();
#endif
}

// Q8_PIECES pieces of a thread (p = tid + j·256) stay in registers from the load to their codes; a thread's further
// pieces (rows wider than 8192) wait in shared memory at their own slots, which only the thread itself reads back.
constexpr int Q8_PIECES = 4;

// The normalized row as QoQ's INT8 codes for the W4A8 projection that follows (qoq/act.cuh): the sum of squares as
// add_rms_norm_f16 adds it, the row maximum taken in the normalizing pass, each piece's codes written straight to the
// code row, the positions past D zeroed a piece a thread; three block barriers (the sum of squares, the maximum, the
// code sum). `out` may be null (no float16 rows written). perm: 1 for a 4-bit layer's code order, 0 for column order
// (qoq_store8). Dynamic shared memory: 2D bytes.
extern "C" __global__ void __launch_bounds__(256) add_rms_norm_q8(const u16* __restrict__ h, const u16* __restrict__ y,
                                                                 const u16* __restrict__ w, u16* __restrict__ hs,
                                                                 u16* __restrict__ out, int D, float eps, int perm,
                                                                 int kp, char* __restrict__ codes,
                                                                 float* __restrict__ sx, int* __restrict__ rsum) {
    constexpr int NT = 256, W = NT / 32, B = Q8_PIECES;
    extern __shared__ __align__(16) uint4 stage[];
    __shared__ float part[W], mx[W];
    __shared__ int sums[W];
    launch_dependents();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, pieces = D >> 3;
    const size_t base = (size_t)blockIdx.x * D;
    const uint4* hp = reinterpret_cast<const uint4*>(h + base);
    const uint4* yp = reinterpret_cast<const uint4*>(y + (y ? base : 0));
    uint4* sp = reinterpret_cast<uint4*>(hs + (y ? base : 0));
    uint4* op = reinterpret_cast<uint4*>(out + (out ? base : 0));
    const uint4* wp = reinterpret_cast<const uint4*>(w);
    char* crow = codes + blockIdx.x * (size_t)kp;
    // The weight is no kernel's output: the pieces of the register batch are copied to shared memory while the
    // kernel ahead finishes. Copies, not loads: ptxas schedules griddepcontrol.wait above non-coherent loads
    // written before it, not above cp.async.
    __shared__ __align__(16) uint4 wst[B * NT];
#pragma unroll
    for (int j = 0; j < B; ++j)
        if (tid + j * NT < pieces) copy16(wst + tid + j * NT, wp + tid + j * NT);
    grid_dependency_wait();
    uint4 v[B];
    // h + y and the sum of squares, this thread's pieces in order (as add_rms_norm_f16 adds them), B pieces at a
    // time with all their loads issued before any use; the first B stay in registers
    float ss = 0.f;
    for (int q = tid; q < pieces; q += B * NT) {
        uint4 a[B], b[B];
#pragma unroll
        for (int j = 0; j < B; ++j) {
            if (q + j * NT < pieces) {
                a[j] = ld_dep_v4(hp + q + j * NT);
                if (y) b[j] = ld_dep_v4(yp + q + j * NT);
            }
        }
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const int p = q + j * NT;
            if (p < pieces) {
                if (y) {
                    a[j] = add_piece(a[j], b[j]);
                    sp[p] = a[j];
                }
                if (q == tid) v[j] = a[j];
                else stage[p] = a[j];
                ss = add_squares(a[j], ss);
            }
        }
    }
    const float r = rms_factor(ss, part, D, eps);
    copy16_wait();  // this thread's own copies of the weight, which only it reads
    // the normalized pieces (written to out where given) and their maximum |x|
    float am = 0.f;
    for (int q = tid; q < pieces; q += B * NT) {
        uint4 gq[B];
#pragma unroll
        for (int j = 0; j < B; ++j)
            if (q + j * NT < pieces) gq[j] = q == tid ? wst[q + j * NT] : ld_nc_v4(wp + q + j * NT);
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const int p = q + j * NT;
            if (p < pieces) {
                // the staged piece read through lds128: a plain load in the select puts v in local memory
                const uint4 n = norm_piece(q == tid ? v[j] : lds128(smem_addr(stage + p)), gq[j], r);
                if (q == tid) v[j] = n;
                else stage[p] = n;
                if (out) op[p] = n;
                am = qoq_absmax8(n, am);
            }
        }
    }
    am = qoq_warp_max(am);
    if (lane == 0) mx[warp] = am;
    __syncthreads();
    am = qoq_slots_max(mx, W);
    const float rr = qoq_ratio(am);
    // the codes and their sum
    int sum = 0;
#pragma unroll
    for (int j = 0; j < B; ++j)
        if (tid + j * NT < pieces) qoq_store8(crow, tid + j * NT, perm, qoq_codes8(v[j], rr, perm, sum));
    for (int p = tid + B * NT; p < pieces; p += NT) qoq_store8(crow, p, perm, qoq_codes8(stage[p], rr, perm, sum));
#pragma unroll 1
    for (int p = pieces + tid; p < (kp >> 3); p += NT) qoq_store8(crow, p, perm, make_uint2(0u, 0u));
    sum = warp_sum_i32(sum);
    if (lane == 0) sums[warp] = sum;
    __syncthreads();
    if (warp == 0) {
        const int t = qoq_slots_sum(sums, W);
        if (lane == 0) {
            sx[blockIdx.x] = qoq_scale(am);
            rsum[blockIdx.x] = t;
        }
    }
}
