// The warp-specialized fp16 wgmma engine for weights decoded in shared memory (kernels/mixed/gemm_ws.cu; a layout
// with a decode of its own, a codebook lookup for instance, plugs in the same way): Yᵀ = W·Xᵀ on Hopper with the
// operands swapped, 128 weight rows per block as wgmma's M (two MMA warpgroups of 64), TN tokens as its N, K in
// 64-channel stages, A (the decoded weights) and B (the activations) both read by the tensor cores from shared
// memory, split-K over the stages as the block-synchronous GEMMs do it, and their epilogue (bias, fp16 store;
// common/wgmma_epilogue.cuh).
//
// Block: 3 warpgroups (384 threads). Warpgroup 0 copies and decodes, warpgroups 1 and 2 multiply.
//   * Copies: warp 0 issues each stage's copies into a ring of STC copy slots: the activation tile by the copy engine
//     (tensor map, 128-byte swizzle), the stage's weight words (the decode's `copy`: its own bulk or cp.async
//     copies, its 32 lanes). A slot's "full" barrier completes with the bytes of the bulk copies plus one arrival
//     of lane 0 and one per lane once its cp.asyncs land; its "empty" barrier with one arrival per MMA warp.
//   * Decode: all four warps of warpgroup 0, one weight row per thread (`decode_stage`), write the stage's 128 x 64
//     fp16 weights into one of STA decoded tiles (K-major, 128-byte rows, 128-byte swizzle: the layout a wgmma
//     descriptor reads), fence them into the async proxy and arrive on the tile's barrier, one arrival per warp.
//     The decode is the heaviest work of a stage at the small token tiles (a 16-token stage's MMAs are a few dozen
//     cycles against some 200 instructions per row), so every thread of the copy warpgroup takes a row rather
//     than three warps (128 rows would not divide) or a fourth warpgroup (512 threads, and registers taken from
//     the MMA warpgroups). Warp 0's copies cost it a few dozen instructions per stage: before each of its rows it
//     issues whichever next stages have free slots, without waiting (it waits only for the stage it is about to
//     decode), so the copies run up to STC stages ahead of the decode whatever pace the MMAs keep.
//   * MMA: each MMA warpgroup waits for a stage's copies and its decoded tile, issues the four k16 wgmmas of its 64
//     rows, and once the previous stage's wgmmas have completed (wait 1) releases that stage's copy slot and tile.
//     So with STA = 2 the decode of stage s + 1 runs while the MMAs of stage s do; STA = 3 leaves a stage of slack.
// The MMA warpgroups never meet at a block barrier inside the loop, and neither do the decode warps.
//
// A decode D supplies (all shared-memory addresses are 32-bit shared-window addresses):
//   Params                               what its copies and decode read
//   RAW                                  bytes of a stage's weight words in a copy slot (after the activations)
//   TX                                   bytes of them that the copy engine brings (counted on the full barrier)
//   copy(p, w, full, gs, n0, lane)       warp 0's lanes: global stage gs (64-channel block) of rows n0.. into w;
//                                        bulk copies complete on `full` (the engine adds the lanes' cp.async arrivals)
//   decode_stage(p, w, a, row)           weight row `row` (0..127, the calling thread) of the words at w into the
//                                        decoded tile at a: fp16, row r at a + 128 r, 16-byte chunk c of the row
//                                        (channels 8c..8c+7 of k16 step c / 2) at ((c ^ (r % 8)) << 4)
//   kcols(w, col)                        per k16 step, the byte offset (32 x a column block) of the activation
//                                        columns it multiplies in a 128-byte activation row (a decode may keep its
//                                        fields in any order and point each step at its channels)
// No CUDA headers: everything is inline PTX (here and in common/ptx_common.cuh).
#pragma once

#include "common/ptx_common.cuh"
#include "common/wgmma_epilogue.cuh"

// m64nTNk16 with A and B both from shared memory (K-major descriptors), f32 accumulators; one overload per TN.
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

// Whether the barrier's phase of parity `parity` has completed, without waiting.
__device__ __forceinline__ bool mbar_test(u32 bar, u32 parity) {
    u32 done;
    asm volatile(
        "{ .reg .pred p; mbarrier.test_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
    return done != 0;
}

// One arrival on `bar` once this thread's earlier cp.asyncs have landed (counted among the barrier's arrivals).
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void sts128(u32 addr, u32 a, u32 b, u32 c, u32 d) {
    asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(a), "r"(b), "r"(c), "r"(d) : "memory");
}

// Shared memory of a block: STC copy slots (the activation tile, then the weight words), then STA decoded tiles;
// every part a multiple of 1024 bytes, so the swizzle atoms stay aligned. The barriers are a static array.
template <int TN, int STC, int STA, int RAW>
struct F16WsRing {
    static constexpr int XT = TN * 128;
    static constexpr int CS = (XT + RAW + 1023) / 1024 * 1024;
    static constexpr int AS = 128 * 128;
    static constexpr int AO = STC * CS;
    static constexpr int BYTES = AO + STA * AS;  // the launch adds 1024 for the alignment
    // barrier indices: full and empty per copy slot, decoded and free per tile
    static constexpr int FULL = 0, EMPTY = STC, DFULL = 2 * STC, DFREE = 2 * STC + STA, BARS = 2 * (STC + STA);
};

// Registers per thread of the two roles (setmaxnreg) for MINB blocks per multiprocessor: at launch a thread has
// 65536 / (384 MINB) rounded down to 8 (168, 80); the decode warpgroup gives up what the MMA warpgroups take. The
// decode warpgroup keeps 64, not a copy warpgroup's 40: its rows' words and per-stripe constants beside warp 0's
// copy state spilled at 56 (4-8 bytes, the 64- and 128-token builds).
template <int MINB>
struct F16WsRegs;
template <>
struct F16WsRegs<1> {
    enum : int { DEC = 64, MMA = 216 };  // 128·64 + 256·216 <= 384·168
};
template <>
struct F16WsRegs<2> {
    enum : int { DEC = 64, MMA = 88 };  // 128·64 + 256·88 = 384·80
};

// Warpgroup 0: warp 0's copies, and every thread's row of each stage (tid 0..127). Stages [s0, s0 + ns) of rows n0..
// and tokens m0..
template <class D, int TN, int STC, int STA>
__device__ __forceinline__ void f16_ws_decode_warps(const TmaMap* mx, const typename D::Params& dp, u32 base,
                                                    u32 bars, int m0, int n0, int s0, int ns, int tid) {
    using R = F16WsRing<TN, STC, STA, D::RAW>;
    const int warp = tid >> 5, lane = tid & 31;
    // the weight words of stage p and the full barrier's expectation (activations included)
    auto weights = [&](int p) {
        const int c = p % STC;
        const u32 full = bars + 8u * (R::FULL + c);
        if (lane == 0) mbar_arrive_expect_tx(full, R::XT + D::TX);
        D::copy(dp, base + (u32)c * R::CS + R::XT, full, s0 + p, n0, lane);
        cp_async_mbar_arrive(full);
    };
    auto acts = [&](int p) {
        const int c = p % STC;
        if (lane == 0) tma_load_2d(base + (u32)c * R::CS, mx, bars + 8u * (R::FULL + c), 128 * (s0 + p), m0);
    };
    int next = 0;  // warp 0: the next stage to copy
    if (warp == 0) {
        // the weights do not come from the kernel ahead (a dependent launch starts during its tail): the first
        // slots' weight copies go out before the wait for it, the activations after
        next = min(STC, ns);
        for (int p = 0; p < next; ++p) weights(p);
        grid_dependency_wait();
        for (int p = 0; p < next; ++p) acts(p);
    }
    int c = 0, a = 0;
    u32 cph = 0, aph = 0;  // phase parities of stage s's copy slot and tile
    for (int s = 0; s < ns; ++s) {
        if (warp == 0) {
            while (next < ns) {
                const int slot = next % STC;
                const u32 empty = bars + 8u * (R::EMPTY + slot), par = (u32)(next / STC - 1) & 1u;
                if (next <= s)
                    mbar_wait(empty, par);  // the stage this warp decodes next: its slot was released or soon is
                else if (!__shfl_sync(0xffffffffu, (int)mbar_test(empty, par), 0))
                    break;  // lane 0's answer, so that the warp's lanes agree
                weights(next);
                acts(next);
                ++next;
            }
        }
        mbar_wait(bars + 8u * (R::FULL + c), cph);
        if (s >= STA) mbar_wait(bars + 8u * (R::DFREE + a), aph ^ 1u);  // stage s - STA's wgmmas are done with it
        D::decode_stage(dp, base + (u32)c * R::CS + R::XT, base + (u32)(R::AO + a * R::AS), tid);
        fence_async_smem();  // the tile is read next by the tensor cores (the async proxy)
        __syncwarp();
        if (lane == 0) mbar_arrive(bars + 8u * (R::DFULL + a));
        if (++c == STC) c = 0, cph ^= 1u;
        if (++a == STA) a = 0, aph ^= 1u;
    }
}

// An MMA warpgroup (wg 0 or 1: rows 64 wg..64 wg + 63 of the block) over the block's ns stages.
template <class D, int TN, int STC, int STA>
__device__ __forceinline__ void f16_ws_mma(float (&acc)[TN / 2], u32 base, u32 bars, int ns, int wg, int lane) {
    using R = F16WsRing<TN, STC, STA, D::RAW>;
    int c = 0, a = 0, pc = 0, pa = 0;
    u32 cph = 0, aph = 0;
    for (int s = 0; s < ns; ++s) {
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

// The block (grid: ceil(N / 128) x ceil(M / TN) x S, 384 threads, R::BYTES + 1024 bytes of dynamic shared memory):
// output rows n0 = 128 blockIdx.x.., tokens m0 = TN blockIdx.y.., share z = blockIdx.z of S of the nblk stages.
// mx: the activations [M, K] fp16 as bytes, boxes of 128 bytes x TN rows, 128-byte swizzle. Split-K (S > 1): ws holds
// S·gridDim.x·gridDim.y·128·TN floats and cnt gridDim.x·gridDim.y zeros (qtool/cuda/split_k.py).
template <class D, int TN, int STC, int STA, int MINB>
__device__ __forceinline__ void f16_ws_body(const TmaMap* mx, const typename D::Params& dp, int M, int N, int nblk,
                                            const u16* __restrict__ bias, u16* __restrict__ out, int ldc,
                                            float* __restrict__ ws, int* __restrict__ cnt) {
    using R = F16WsRing<TN, STC, STA, D::RAW>;
    static_assert(STC >= 2 && STA >= 2, "a stage in use and the next one, in both rings");
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
            mbar_init(bars + 8u * (R::DFULL + i), 4);  // the decode warps
            mbar_init(bars + 8u * (R::DFREE + i), 8);  // the MMA warps
        }
        mbar_init_fence();
    }
    __syncthreads();
    // Each role derives the block's geometry after its setmaxnreg: values live across it would have to fit the
    // decode warpgroup's smaller register budget.
    const int S = gridDim.z, z = blockIdx.z;
    auto stages = [&](int& s0, int& ns) {
        s0 = (int)((long long)z * nblk / S);
        ns = (int)((long long)(z + 1) * nblk / S) - s0;
    };
    if (tid < 128) {
        regs_decrease<F16WsRegs<MINB>::DEC>();
        int s0, ns;
        stages(s0, ns);
        f16_ws_decode_warps<D, TN, STC, STA>(mx, dp, (smem_addr(smem_raw) + 1023) & ~1023u, smem_addr(bar_mem),
                                             (int)blockIdx.y * TN, (int)blockIdx.x * 128, s0, ns, tid);
        launch_dependents();
        return;
    }
    regs_increase<F16WsRegs<MINB>::MMA>();
    grid_dependency_wait();  // out, ws and cnt may be the kernel ahead's until it completes
    int s0, ns;
    stages(s0, ns);
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u, bars = smem_addr(bar_mem);
    const int n0 = (int)blockIdx.x * 128, m0 = (int)blockIdx.y * TN;
    const int ctid = tid - 128, wg = ctid >> 7, warp = (ctid >> 5) & 3, lane = tid & 31, t = lane & 3;
    const int r0 = 64 * wg + 16 * warp + (lane >> 2);  // this lane's rows in the tile: r0, r0 + 8
    float acc[1][TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[0][i] = 0.f;
    f16_ws_mma<D, TN, STC, STA>(acc[0], base, bars, ns, wg, lane);
    launch_dependents();
    bar_sync<1, 256>();  // both MMA warpgroups are done with the ring (the decode is too): it becomes the transpose tile
    if (S > 1 && !split_k_sum<TN, 1, 1, 256>(acc, ws, cnt, ctid, z, S, gridDim.x * gridDim.y,
                                             blockIdx.x + gridDim.x * blockIdx.y))
        return;
    store_out<TN, 1, 1>(acc, m0, n0, M, N, r0, t, ctid, smem_raw, base, bias, out, ldc);
}
