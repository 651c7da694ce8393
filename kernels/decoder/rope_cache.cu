// Rotary position embedding of queries and keys, fused with the KV-cache write: one kernel instead of the slices,
// products, concatenation and two index copies that the torch form launches per layer (each a graph node costing
// about 2 us at one token, more than its arithmetic).
//
// qkv [B, T, H + 2 KVH, D] float16 (the fused projection's output), rotate-half pairing as in Llama: for pair i
// (0 <= i < D/2) with x1 = x[i], x2 = x[i + D/2], c = cos[pos[t], i], s = sin[pos[t], i]:
//     out[i] = x1 c - x2 s,   out[i + D/2] = x2 c + x1 s,
// each product and the sum rounded to float16 as torch's half arithmetic does (qtool/bench/e2e.py rope), so the
// results are bit-identical to it. Queries go to q [B, H, T, D]; rotated keys to kc[b, h, pos[t], :] and values,
// unrotated, to vc[b, h, pos[t], :] (caches [B, KVH, L, D]).
//
// A programmatic dependent (qtool/cuda/dependent_launch.py): qkv and the positions are read after the wait through
// coherent loads, and the caches written after it (the attention kernel of the step ahead may still read them
// until then); the cos/sin tables are constants.
#include "common/ptx_common.cuh"

__device__ __forceinline__ u16 mul_h(u16 a, u16 b) { return f2h(h2f(a) * h2f(b)); }

extern "C" __global__ void __launch_bounds__(256) rope_cache_f16(const u16* __restrict__ qkv,
                                                                const u16* __restrict__ cos_t,
                                                                const u16* __restrict__ sin_t,
                                                                const long long* __restrict__ pos, u16* __restrict__ q,
                                                                u16* __restrict__ kc, u16* __restrict__ vc, int B,
                                                                int T, int H, int KVH, int D, int L) {
    launch_dependents();
    grid_dependency_wait();
    const int half = D >> 1, heads = H + 2 * KVH;
    const long long total = (long long)B * T * heads * half;
    for (long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x; e < total;
         e += (long long)gridDim.x * blockDim.x) {
        const int i = (int)(e % half);
        long long r = e / half;
        const int hh = (int)(r % heads);
        r /= heads;
        const int t = (int)(r % T), b = (int)(r / T);
        const u16* src = qkv + (((long long)b * T + t) * heads + hh) * D;
        const u16 x1 = ld_dep_u16(src + i), x2 = ld_dep_u16(src + i + half);
        const long long p = ld_dep_s64(pos + t);
        if (hh >= H + KVH) {  // values: copied into the cache as they are
            u16* dst = vc + (((long long)b * KVH + (hh - H - KVH)) * L + p) * D;
            dst[i] = x1;
            dst[i + half] = x2;
            continue;
        }
        const u16 c = cos_t[p * half + i], s = sin_t[p * half + i];
        const u16 o1 = f2h(h2f(mul_h(x1, c)) - h2f(mul_h(x2, s)));
        const u16 o2 = f2h(h2f(mul_h(x2, c)) + h2f(mul_h(x1, s)));
        u16* dst = hh < H ? q + (((long long)b * H + hh) * T + t) * D
                          : kc + (((long long)b * KVH + (hh - H)) * L + p) * D;
        dst[i] = o1;
        dst[i + half] = o2;
    }
}
