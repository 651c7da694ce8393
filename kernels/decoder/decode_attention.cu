// One decode step's attention over a static KV cache: for each sequence b and query head h (one block each),
// softmax(q . K^T / sqrt(D)) . V over the cache positions 0..pos (the positions an `arange(L) <= pos` mask keeps),
// with key/value head h / (H / KVH) (grouped-query attention). Scores, softmax and the weighted sum in float32;
// one rounding to float16 at the end. Written as [B, 1, H, D], the layout the output projection reads, so the
// transposing copy after torch's scaled_dot_product_attention goes away too.
//
// q [B, H, 1, D] float16 (the fused rotary kernel's output), kc/vc [B, KVH, L, D], D even and at most 256
// (qtool/cuda/decode_attention.py checks); dynamic shared memory: L + D + warps * D floats.
//
// A programmatic dependent (qtool/cuda/dependent_launch.py): q, the caches and the position come from the kernels
// ahead, so they are read after the wait through coherent loads.
#include "common/ptx_common.cuh"

__device__ __forceinline__ float warp_sum_f(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max_f(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

constexpr int PPL = 4;    // column pairs per lane: D <= 256
constexpr int ROWS = 8;   // cache rows a warp loads at once
constexpr int ROWS1 = 16; // a warp's rows in the one-pass form (all positions in one round, keys and values together)

// This lane's column pairs (lane + 32 j) of cache rows l0 .. l0 + R - 1, zero past row n or the row's end: all
// loads issued before any is used.
template <int R>
__device__ __forceinline__ void load_rows(u32 (&x)[R][PPL], const u32* __restrict__ rows, int l0, int n, int pairs,
                                          int lane) {
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
            const int l = l0 + r, d2 = lane + 32 * j;
            x[r][j] = l < n && d2 < pairs ? ld_dep_u32(rows + (size_t)l * pairs + d2) : 0u;
        }
}

// The scores of cache rows l0 .. l0 + R - 1 (a warp's, loaded in kv) into s, and their running maximum.
template <int R>
__device__ __forceinline__ void score_rows(const u32 (&kv)[R][PPL], const float* qs, float* s, int l0, int n,
                                           int pairs, int lane, float& mx) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        float acc = 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
            const int d2 = lane + 32 * j;
            if (d2 < pairs)
                acc += qs[2 * d2] * h2f((u16)(kv[r][j] & 0xFFFFu)) + qs[2 * d2 + 1] * h2f((u16)(kv[r][j] >> 16));
        }
        acc = warp_sum_f(acc);
        if (l0 + r < n) {
            if ((threadIdx.x & 31) == 0) s[l0 + r] = acc;
            mx = fmaxf(mx, acc);
        }
    }
}

// a += the softmax weights s[l] times the value rows l0 .. l0 + R - 1 (loaded in vv), this lane's column pairs.
template <int R>
__device__ __forceinline__ void add_rows(float (&a)[PPL][2], const u32 (&vv)[R][PPL], const float* s, int l0, int n) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const float pl = l0 + r < n ? s[l0 + r] : 0.f;
#pragma unroll
        for (int j = 0; j < PPL; ++j) {
            a[j][0] += pl * h2f((u16)(vv[r][j] & 0xFFFFu));
            a[j][1] += pl * h2f((u16)(vv[r][j] >> 16));
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) decode_attention_f16(const u16* __restrict__ q,
                                                                      const u16* __restrict__ kc,
                                                                      const u16* __restrict__ vc,
                                                                      const long long* __restrict__ pos,
                                                                      u16* __restrict__ out, int H, int KVH, int L,
                                                                      int D, float scale) {
    extern __shared__ float sm[];
    float* s = sm;       // scores [L]
    float* qs = sm + L;  // the scaled query [D]
    __shared__ float red[8];
    launch_dependents();  // the output projection after it loads its weights before its own wait
    grid_dependency_wait();
    const int bh = blockIdx.x, b = bh / H, h = bh % H, kvh = h / (H / KVH);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;
    const long long p = ld_dep_s64(pos);
    const int n = p + 1 < (long long)L ? (int)(p + 1) : L;  // cache positions 0..pos
    const u16* K = kc + ((size_t)b * KVH + kvh) * L * D;
    const u16* V = vc + ((size_t)b * KVH + kvh) * L * D;
    const int pairs = D >> 1;
    const u32* K32 = reinterpret_cast<const u32*>(K);
    const u32* V32 = reinterpret_cast<const u32*>(V);
    // One pass where the warps' ROWS1-row blocks cover every position: a warp's key and value rows are requested
    // together, before the query, so the step waits for one memory latency after the position instead of one per
    // phase and round.
    const bool one = n <= warps * ROWS1;
    u32 kv1[ROWS1][PPL], vv1[ROWS1][PPL];
    if (one) {
        load_rows<ROWS1>(kv1, K32, warp * ROWS1, n, pairs, lane);
        load_rows<ROWS1>(vv1, V32, warp * ROWS1, n, pairs, lane);
    }
    const u16* qp = q + (size_t)bh * D;
    for (int d = tid; d < D; d += blockDim.x) qs[d] = h2f(ld_dep_u16(qp + d)) * scale;
    __syncthreads();
    // scores: a warp per cache row, lanes over D in pairs; otherwise each warp first loads ROWS rows (independent
    // loads in flight together: one memory latency per ROWS rows, not per row), then reduces them
    float mx = -3.0e38f;
    if (one) {
        score_rows<ROWS1>(kv1, qs, s, warp * ROWS1, n, pairs, lane, mx);
    } else {
        for (int l0 = warp * ROWS; l0 < n; l0 += warps * ROWS) {
            u32 kv[ROWS][PPL];
            load_rows<ROWS>(kv, K32, l0, n, pairs, lane);
            score_rows<ROWS>(kv, qs, s, l0, n, pairs, lane, mx);
        }
    }
    mx = warp_max_f(mx);
    if (lane == 0) red[warp] = mx;
    __syncthreads();
    mx = red[0];
    for (int w = 1; w < warps; ++w) mx = fmaxf(mx, red[w]);
    __syncthreads();  // every thread has read red before it is reused for the sum
    float sum = 0.f;
    for (int l = tid; l < n; l += blockDim.x) {
        const float e = __expf(s[l] - mx);
        s[l] = e;
        sum += e;
    }
    sum = warp_sum_f(sum);
    if (lane == 0) red[warp] = sum;
    __syncthreads();
    sum = 0.f;
    for (int w = 0; w < warps; ++w) sum += red[w];
    const float inv = 1.0f / sum;
    // output: warp w adds its rows (loaded together, as above), lane j the column pairs j, j + 32, ...; the warps'
    // partial rows then meet in shared memory
    float a[PPL][2];
#pragma unroll
    for (int j = 0; j < PPL; ++j) a[j][0] = a[j][1] = 0.f;
    if (one) {
        add_rows<ROWS1>(a, vv1, s, warp * ROWS1, n);
    } else {
        for (int l0 = warp * ROWS; l0 < n; l0 += warps * ROWS) {
            u32 vv[ROWS][PPL];
            load_rows<ROWS>(vv, V32, l0, n, pairs, lane);
            add_rows<ROWS>(a, vv, s, l0, n);
        }
    }
    float* part = qs + D;  // warps x D floats
#pragma unroll
    for (int j = 0; j < PPL; ++j) {
        const int d2 = lane + 32 * j;
        if (d2 < pairs) {
            part[warp * D + 2 * d2] = a[j][0];
            part[warp * D + 2 * d2 + 1] = a[j][1];
        }
    }
    __syncthreads();
    u16* o = out + (size_t)bh * D;
    for (int d = tid; d < D; d += blockDim.x) {
        float acc = 0.f;
        for (int w = 0; w < warps; ++w) acc += part[w * D + d];
        o[d] = f2h(acc * inv);
    }
}
