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

// The activation row as QoQ's INT8 codes for the W4A8 down projection (qoq/act.cuh); the float16 row is written
// only where `out` is given. perm: 1 for a 4-bit layer's code order, 0 for column order (qoq_store8).
//
// A row is spread over a cluster of `cl` blocks (blocks r cl .. r cl + cl - 1 of a one-dimensional grid for row r,
// cluster (cl, 1, 1); qtool/layouts/qoq/producers.py picks cl): block c of the cluster takes the units
// [cU/cl, (c+1)U/cl) of the row's U = kp / 32 units of 32 columns, whose codes are 32 bytes of the code row in either
// order. Each thread keeps its pieces in registers (SW_PIECES of them; any further ones at their own slots in shared
// memory) and folds their maximum |x| in as it produces them. The exchange goes through distributed shared memory,
// always pushed to the block that reads it, so no block reads another's shared memory and none can exit while another
// still writes into it: each warp writes its maximum into slot (c, warp) of every block's `mx`, a cluster barrier,
// each block takes the maximum of its own slots; each warp writes its code sum into slot (c, warp) of block 0's
// `sums`, a cluster barrier, block 0 adds them and writes s_x and the sum. Both are exact in any order, so the codes
// equal those of one block per row. The first push waits on a barrier every block arrived at on its top (the pushes
// need every block of the cluster started). Launched without the cluster (the driver refused it:
// qtool/cuda/dependent_launch.py), block 0 of each row's cl takes the whole row and the others return; the two
// barriers are then block barriers. Dynamic shared memory: 16 bytes a piece of the row (2 kp), since one block may
// take it all.
constexpr int SW_PIECES = 4;

extern "C" __global__ void __launch_bounds__(256) swiglu_q8(const u16* __restrict__ gu, u16* __restrict__ out, int I,
                                                           int perm, int kp, int cl, char* __restrict__ codes,
                                                           float* __restrict__ sx, int* __restrict__ rsum) {
    constexpr int NT = 256, W = NT / 32, B = SW_PIECES;
    extern __shared__ __align__(16) uint4 stage[];
    __shared__ float mx[8 * W];
    __shared__ int sums[8 * W];
    launch_dependents();
    const int C = (int)cluster_dim(0);
    if (C == 1 && blockIdx.x % cl) return;
    const int c = (int)cluster_pos(0);  // 0 without a cluster
    if (C > 1) cluster_arrive_relaxed();
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const size_t r = blockIdx.x / cl;
    const int U = kp >> 5, p0 = 4 * (c * U / C), p1 = 4 * ((c + 1) * U / C), re = min(p1, I >> 3);
    const uint4* gp = reinterpret_cast<const uint4*>(gu + r * 2 * I);
    const uint4* up = gp + (I >> 3);
    uint4* op = reinterpret_cast<uint4*>(out + (out ? r * I : 0));
    char* crow = codes + r * (size_t)kp;
    grid_dependency_wait();
    // the activations of this thread's pieces and their maximum |x|, B pieces at a time with all their loads issued
    // before any use; the first B stay in registers
    float am = 0.f;
    uint4 v[B];
    for (int q = p0 + tid; q < re; q += B * NT) {
        uint4 a[B], b[B];
#pragma unroll
        for (int j = 0; j < B; ++j) {
            if (q + j * NT < re) {
                a[j] = ld_dep_v4(gp + q + j * NT);
                b[j] = ld_dep_v4(up + q + j * NT);
            }
        }
#pragma unroll
        for (int j = 0; j < B; ++j) {
            const int p = q + j * NT;
            if (p < re) {
                const uint4 o = swiglu8(a[j], b[j]);
                if (q == p0 + tid) v[j] = o;
                else stage[p - p0] = o;
                if (out) op[p] = o;
                am = qoq_absmax8(o, am);
            }
        }
    }
    am = qoq_warp_max(am);
    if (C > 1) {
        cluster_wait();  // every block of the cluster has started: its shared memory takes the pushes
        if (lane < C) st_cluster_u32(smem_addr(mx + c * W + warp), (u32)lane, __float_as_uint(am));
        cluster_sync();
    } else {
        if (lane == 0) mx[warp] = am;
        __syncthreads();
    }
    am = qoq_slots_max(mx, C * W);
    const float rr = qoq_ratio(am);
    // the codes and their sum; the codes of the register pieces and the zeros past I leave after the cluster
    // arrival, whose release then waits only for the push
    int sum = 0;
    uint2 cw[B];
#pragma unroll
    for (int j = 0; j < B; ++j)
        if (p0 + tid + j * NT < re) cw[j] = qoq_codes8(v[j], rr, perm, sum);
    for (int p = p0 + tid + B * NT; p < re; p += NT)
        qoq_store8(crow, p, perm, qoq_codes8(stage[p - p0], rr, perm, sum));
    sum = warp_sum_i32(sum);
    if (C > 1) {
        if (lane == 0) st_cluster_u32(smem_addr(sums + c * W + warp), 0u, (u32)sum);
        cluster_arrive();
    } else if (lane == 0) {
        sums[warp] = sum;
    }
#pragma unroll
    for (int j = 0; j < B; ++j)
        if (p0 + tid + j * NT < re) qoq_store8(crow, p0 + tid + j * NT, perm, cw[j]);
#pragma unroll 1
    for (int p = max(re, p0) + tid; p < p1; p += NT) qoq_store8(crow, p, perm, make_uint2(0u, 0u));
    if (C > 1) cluster_wait();
    else __syncthreads();
    if (c == 0 && warp == 0) {
        const int t = qoq_slots_sum(sums, C * W);
        if (lane == 0) {
            sx[r] = qoq_scale(am);
            rsum[r] = t;
        }
    }
}
