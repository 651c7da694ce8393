// The wgmma GEMMs' shared pieces (kernels/grouped_int/mma.cu, kernels/vq/gemm.cu, kernels/mixed/gemm.cu): the
// m64nTNk16 multiply-add with A from registers, the transposing fp16 epilogue and the deterministic split-K sum.
#pragma once

#include "common/ptx_common.cuh"

// m64nTNk16, A (16 rows x 16 codes per warp) from registers, B (TN tokens x 16) from shared memory; one overload
// per TN (the accumulator array's size picks it).
__device__ __forceinline__ void wgmma_acc(float (&d)[4], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %9, 0; "
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_acc(float (&d)[8], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %13, 0; "
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_acc(float (&d)[16], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %21, 0; "
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_acc(float (&d)[32], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %37, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_acc(float (&d)[64], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %69, 0; "
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_acc(float (&d)[128], const u32 (&a)[4], u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %133, 0; "
        "wgmma.mma_async.sync.aligned.m64n256k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127}, {%128, %129, %130, %131}, %132, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

// fp16 output tile + bias, transposed through shared memory at `tbase` (tokens x ROWS features) for 16-byte
// row-contiguous stores. The 256 threads holding the accumulators call it (`tid` among them); BAR is the barrier
// that spans exactly them.
template <int TN, int RB, int BAR>
__device__ __forceinline__ void store_out(const float (&acc)[RB][TN / 2], int m0, int n0, int M, int N, int r0, int t,
                                          int tid, char* smem_raw, u32 tbase, const u16* __restrict__ bias,
                                          u16* __restrict__ out, int ldc) {
    constexpr int ROWS = 128 * RB;
    const int mt = min(TN, M - m0);  // valid tokens in this tile
    constexpr int PITCH = ROWS + 8;  // halves: 16-byte aligned rows, shifted by 4 banks
    u16* tile = reinterpret_cast<u16*>(smem_raw + (tbase - smem_addr(smem_raw)));
#pragma unroll
    for (int b = 0; b < RB; ++b) {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int f = r0 + 64 * b + 8 * h;
            const float bv = (bias != nullptr && n0 + f < N) ? h2f(bias[n0 + f]) : 0.f;
#pragma unroll
            for (int i = 0; i < TN / 8; ++i) {
                tile[(8 * i + 2 * t) * PITCH + f] = f2h(acc[b][4 * i + 2 * h] + bv);
                tile[(8 * i + 2 * t + 1) * PITCH + f] = f2h(acc[b][4 * i + 2 * h + 1] + bv);
            }
        }
    }
    bar_sync<BAR, 256>();
    constexpr int CH = ROWS / 8;  // 16-byte chunks per token row
    const bool vec = n0 + ROWS <= N && (ldc & 7) == 0 && ((size_t)out & 15) == 0;
    if (vec) {
        for (int c = tid; c < mt * CH; c += 256) {
            const int row = c / CH, ch = c % CH;
            *reinterpret_cast<uint4*>(out + (size_t)(m0 + row) * ldc + n0 + ch * 8) =
                *reinterpret_cast<const uint4*>(tile + row * PITCH + ch * 8);
        }
    } else {
        for (int c = tid; c < mt * ROWS; c += 256) {
            const int row = c / ROWS, f = c % ROWS;
            if (n0 + f < N) out[(size_t)(m0 + row) * ldc + n0 + f] = tile[row * PITCH + f];
        }
    }
}

// Split-K across the S blocks of a tile (this one is share z): each writes its float32 partial in the accumulator
// layout (one float4 per thread and step, coalesced); the last to arrive adds the partials in split order
// (deterministic), leaves the sum in `acc`, resets the tile's counter and returns true; the others return false.
// The THREADS threads of barrier BAR hold the tile (tid among them; BAR 0: the whole block).
template <int TN, int RB, int BAR, int THREADS>
__device__ __forceinline__ bool split_k_sum(float (&acc)[RB][TN / 2], float* __restrict__ ws, int* __restrict__ cnt,
                                            int tid, int z, int S, int tiles, int tile_id) {
    float4* w4 = reinterpret_cast<float4*>(ws);
    constexpr int F4 = RB * TN / 8;  // float4s per thread
#pragma unroll
    for (int b = 0; b < RB; ++b) {
#pragma unroll
        for (int q = 0; q < TN / 8; ++q)
            w4[((size_t)(z * tiles + tile_id) * F4 + b * (TN / 8) + q) * 256 + tid] =
                make_float4(acc[b][4 * q], acc[b][4 * q + 1], acc[b][4 * q + 2], acc[b][4 * q + 3]);
    }
    if (!split_k_last<BAR, THREADS>(cnt, tile_id, S, tid)) return false;
#pragma unroll
    for (int b = 0; b < RB; ++b) {
#pragma unroll
        for (int i = 0; i < TN / 2; ++i) acc[b][i] = 0.f;
    }
    for (int q2 = 0; q2 < S; ++q2) {
#pragma unroll
        for (int b = 0; b < RB; ++b) {
#pragma unroll
            for (int q = 0; q < TN / 8; ++q) {
                const float4 v = __ldcg(w4 + ((size_t)(q2 * tiles + tile_id) * F4 + b * (TN / 8) + q) * 256 + tid);
                acc[b][4 * q] += v.x;
                acc[b][4 * q + 1] += v.y;
                acc[b][4 * q + 2] += v.z;
                acc[b][4 * q + 3] += v.w;
            }
        }
    }
    if (tid == 0) cnt[tile_id] = 0;
    return true;
}
