// The warp-specialized fp16 wgmma engine with the weights decoded into shared memory (the "tile" form of
// kernels/mixed/gemm_ws.cu; common/f16_ws_wgmma.cuh is the "regs" form, each MMA lane decoding its own A
// fragments): Yᵀ = W·Xᵀ on Hopper with the operands swapped, 128 weight rows per block as wgmma's M (two MMA
// warpgroups of 64), TN tokens as its N, K in 64-channel stages, A (the decoded weights) and B (the activations)
// both read by the tensor cores from shared memory; split-K and epilogue as there.
//
// Block: 4 warpgroups (512 threads). Warpgroups 0 and 1 decode, 2 and 3 multiply; warp 0 of warpgroup 2 also
// issues the copies.
//   * Decode: warpgroup d decodes stages d, d + 2, d + 4, ... of the block, one weight row per thread
//     (`decode_stage`), into decoded tile s % STA (K-major, 128-byte rows, 128-byte swizzle: the layout a wgmma
//     descriptor reads; STA even, so a tile always has the same decoder), fences its writes into the async proxy
//     and arrives on the tile's barrier, one arrival per warp. Each row is decoded once (the regs form decodes its
//     per-row constants in each of the 4 lanes sharing a row), and every scheduler runs two decode warps, one per
//     warpgroup, each with two stage periods for its row: one stalls (shared-memory loads, the proxy fence, a
//     barrier) while the other issues. The decode warps issue no global loads: a proxy fence behind in-flight
//     copies may wait for them. kernels/mixed/NOTES.md, "Per-stage budget".
//   * Copies: warp 0 of warpgroup 2 (the copy warp) brings each stage into a ring of STC copy slots, as in the regs
//     form (the activation tile by the copy engine, the weight words by the decode's `copy`); the MMA warps are a
//     slot's last readers (their wgmmas of a stage follow its decode), so they release it. Before the waits of
//     each stage the copy warp issues every later stage whose slot is free, without waiting; it waits only to
//     issue the stage it is about to multiply, whose slot's last readers are two stages behind.
//   * MMA: each MMA warpgroup waits for a stage's copies and its decoded tile, issues the four k16 wgmmas of its 64
//     rows, and once the previous stage's wgmmas have completed (wait 1) releases that stage's copy slot and tile.
//     With STA = 4 the MMAs hold two tiles (the stage issued and the one completing) while both decode warpgroups
//     fill the other two.
// Nothing meets at a block barrier inside the loop. The registers are the launch bound's for every role (128, or
// 64 two blocks per SM): ptxas compiles all roles within it, so setmaxnreg would give the MMA warpgroups nothing.
//
// A decode D supplies what common/f16_ws_wgmma.cuh lists, with decode_stage in place of fragments:
//   decode_stage(p, w, a, row)           weight row `row` (0..127, the calling thread) of the words at w into the
//                                        decoded tile at a: fp16, row r at a + 128 r, 16-byte chunk c of the row
//                                        (channels 8c..8c+7 of k16 step c / 2) at ((c ^ (r % 8)) << 4)
#pragma once

#include "common/f16_ws_wgmma.cuh"

// m64nTNk16 with A and B both from shared memory (K-major descriptors), f32 accumulators; one overload per TN (at
// most 128: 64 accumulators beside a 128-register launch bound).
__device__ __forceinline__ void wgmma_ss(float (&d)[8], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %10, 0; "
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1, 0, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_ss(float (&d)[16], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %18, 0; "
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_ss(float (&d)[32], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0; "
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ void wgmma_ss(float (&d)[64], u64 da, u64 db) {
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %66, 0; "
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "l"(da), "l"(db), "r"(1));
}

__device__ __forceinline__ void sts128(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Shared memory of a block: STC copy slots (the activation tile, then the weight words), then STA decoded tiles;
// every part a multiple of 1024 bytes. The barriers are a static array.
template <int TN, int STC, int STA, int RAW>
struct F16WstRing {
    static constexpr int XT = TN * 128;
    static constexpr int CS = (XT + RAW + 1023) / 1024 * 1024;
    static constexpr int AS = 128 * 128;
    static constexpr int AO = STC * CS;
    static constexpr int BYTES = AO + STA * AS;  // the launch adds 1024 for the alignment
    // barrier indices: full and empty per copy slot, decoded and free per tile
    static constexpr int FULL = 0, EMPTY = STC, DFULL = 2 * STC, DFREE = 2 * STC + STA, BARS = 2 * (STC + STA);
};

// Decode warpgroup dwg (0 or 1): stages dwg, dwg + 2, ... of the block's ns, row `tid` (0..127) of each.
template <class D, int TN, int STC, int STA>
__device__ __forceinline__ void f16_wst_decode(const typename D::Params& dp, u32 base, u32 bars, int ns, int dwg,
                                               int tid) {
    using R = F16WstRing<TN, STC, STA, D::RAW>;
    static_assert(STA % 2 == 0 && STC >= 2, "each decoded tile has one decoder; a stage steps the ring by 2");
    const int lane = tid & 31;
    int c = dwg, a = dwg;  // stage s's copy slot and tile, and their phase parities
    u32 cph = 0, aph = 0;
    for (int s = dwg; s < ns; s += 2) {
        mbar_wait(bars + 8u * (R::FULL + c), cph);
        if (s >= STA) mbar_wait(bars + 8u * (R::DFREE + a), aph ^ 1u);  // stage s - STA's wgmmas are done with it
        D::decode_stage(dp, base + (u32)c * R::CS + R::XT, base + (u32)(R::AO + a * R::AS), tid);
        fence_async_smem();  // the tile is read next by the tensor cores (the async proxy)
        __syncwarp();
        if (lane == 0) mbar_arrive(bars + 8u * (R::DFULL + a));
        c += 2;
        if (c >= STC) c -= STC, cph ^= 1u;
        a += 2;
        if (a >= STA) a -= STA, aph ^= 1u;
    }
}

// An MMA warpgroup (wg 0 or 1: rows 64 wg..64 wg + 63 of the block) over the block's ns stages from s0; warp 0 of
// wg 0 also issues the copies (rows n0.., tokens m0..).
template <class D, int TN, int STC, int STA>
__device__ __forceinline__ void f16_wst_mma(float (&acc)[TN / 2], const TmaMap* mx, const typename D::Params& dp,
                                            u32 base, u32 bars, int m0, int n0, int s0, int ns, int wg, int warp,
                                            int lane) {
    using R = F16WstRing<TN, STC, STA, D::RAW>;
    const bool copier = wg == 0 && warp == 0;
    typename D::Cursor cur;
    auto weights = [&](int p) {
        const int c = p % STC;
        const u32 full = bars + 8u * (R::FULL + c);
        if (lane == 0) mbar_arrive_expect_tx(full, R::XT + D::TX);
        D::copy(dp, cur, base + (u32)c * R::CS + R::XT, full, s0 + p, lane);
        cp_async_mbar_arrive(full);
    };
    auto acts = [&](int p) {
        const int c = p % STC;
        if (lane == 0) tma_load_2d(base + (u32)c * R::CS, mx, bars + 8u * (R::FULL + c), 128 * (s0 + p), m0);
    };
    int next = 0;  // the copy warp: the next stage to copy
    if (copier) {
        cur = D::cursor(dp, n0, lane);
        // the weights do not come from the kernel ahead (a dependent launch starts during its tail): the first
        // slots' weight copies go out before the wait for it, the activations after
        next = min(STC, ns);
        for (int p = 0; p < next; ++p) weights(p);
    }
    grid_dependency_wait();  // the activations, and out, ws and cnt may be the kernel ahead's until it completes
    if (copier)
        for (int p = 0; p < next; ++p) acts(p);
    int c = 0, a = 0, pc = 0, pa = 0;
    u32 cph = 0, aph = 0;
    for (int s = 0; s < ns; ++s) {
        if (copier) {
            while (next < ns) {
                const int slot = next % STC;
                const u32 empty = bars + 8u * (R::EMPTY + slot), par = (u32)(next / STC - 1) & 1u;
                if (next <= s)
                    mbar_wait(empty, par);  // the stage multiplied next: its slot was released or soon is
                else if (!__shfl_sync(0xffffffffu, (int)mbar_test(empty, par), 0))
                    break;  // lane 0's answer, so that the warp's lanes agree
                weights(next);
                acts(next);
                ++next;
            }
        }
        mbar_wait(bars + 8u * (R::FULL + c), cph);   // the activations (the copy engine's writes)
        mbar_wait(bars + 8u * (R::DFULL + a), aph);  // the decoded tile
        const u32 xs = base + (u32)c * R::CS, at = base + (u32)(R::AO + a * R::AS) + (u32)wg * 64u * 128u;
        u32 col[4];
        D::kcols(xs + R::XT, col);
        wgmma_fence();
#pragma unroll
        for (int i = 0; i < 4; ++i) wgmma_ss(acc, desc_sw128(at + 32u * i), desc_sw128(xs + col[i]));
        wgmma_commit();
        wgmma_wait1();  // stage s - 1's wgmmas have read their operands: hand its slot and tile back
        if (s > 0 && lane == 0) {
            mbar_arrive(bars + 8u * (R::EMPTY + pc));
            mbar_arrive(bars + 8u * (R::DFREE + pa));
        }
        pc = c, pa = a;
        if (++c == STC) c = 0, cph ^= 1u;
        if (++a == STA) a = 0, aph ^= 1u;
    }
    wgmma_wait0();
}

// The block (grid as f16_ws_body's, 512 threads, R::BYTES + 1024 bytes of dynamic shared memory).
template <class D, int TN, int STC, int STA>
__device__ __forceinline__ void f16_wst_body(const TmaMap* mx, const typename D::Params& dp, int M, int N, int nblk,
                                             const u16* __restrict__ bias, u16* __restrict__ out, int ldc,
                                             float* __restrict__ ws, int* __restrict__ cnt) {
    using R = F16WstRing<TN, STC, STA, D::RAW>;
    static_assert(TN * (128 + 8) * 2 <= R::BYTES, "the epilogue's transpose tile fits in the ring");
    extern __shared__ char smem_raw[];
    __shared__ __align__(8) u64 bar_mem[R::BARS];
    const int tid = threadIdx.x;
    if (tid == 0) {
        const u32 bars = smem_addr(bar_mem);
#pragma unroll 1
        for (int i = 0; i < STC; ++i) {
            mbar_init(bars + 8u * (R::FULL + i), 1 + 32);  // lane 0's expectation, each lane's cp.asyncs
            mbar_init(bars + 8u * (R::EMPTY + i), 8);      // the MMA warps
        }
#pragma unroll 1
        for (int i = 0; i < STA; ++i) {
            mbar_init(bars + 8u * (R::DFULL + i), 4);  // the warps of the tile's decode warpgroup
            mbar_init(bars + 8u * (R::DFREE + i), 8);  // the MMA warps
        }
        mbar_init_fence();
    }
    __syncthreads();
    const int S = gridDim.z, z = blockIdx.z;
    const int s0 = (int)((long long)z * nblk / S), ns = (int)((long long)(z + 1) * nblk / S) - s0;
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u, bars = smem_addr(bar_mem);
    if (tid < 256) {
        f16_wst_decode<D, TN, STC, STA>(dp, base, bars, ns, tid >> 7, tid & 127);
        launch_dependents();
        return;
    }
    const int n0 = (int)blockIdx.x * 128, m0 = (int)blockIdx.y * TN;
    const int ctid = tid - 256, wg = ctid >> 7, warp = (ctid >> 5) & 3, lane = tid & 31, t = lane & 3;
    const int r0 = 64 * wg + 16 * warp + (lane >> 2);  // this lane's rows in the tile: r0, r0 + 8
    float acc[1][TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[0][i] = 0.f;
    f16_wst_mma<D, TN, STC, STA>(acc[0], mx, dp, base, bars, m0, n0, s0, ns, wg, warp, lane);
    launch_dependents();
    bar_sync<1, 256>();  // both MMA warpgroups are done with the ring (the decode is too): now the transpose tile
    if (S > 1 && !split_k_sum<TN, 1, 1, 256>(acc, ws, cnt, ctid, z, S, gridDim.x * gridDim.y,
                                             blockIdx.x + gridDim.x * blockIdx.y))
        return;
    store_out<TN, 1, 1>(acc, m0, n0, M, N, r0, t, ctid, smem_raw, base, bias, out, ldc);
}
