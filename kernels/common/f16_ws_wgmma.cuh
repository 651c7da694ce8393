// The warp-specialized fp16 wgmma engine for quantized weights decoded in registers (kernels/mixed/gemm_ws.cu; a
// layout with a decode of its own, a codebook lookup for instance, plugs in the same way): Yᵀ = W·Xᵀ on Hopper with
// the operands swapped, 128 weight rows per block as wgmma's M (two MMA warpgroups of 64), TN tokens as its N, K in
// 64-channel stages; A (the weights) from registers, each lane decoding its own fragments from the stage's words in
// shared memory, B (the activations) from shared memory; split-K over the stages as the block-synchronous GEMMs do
// it, and their epilogue (bias, fp16 store; common/wgmma_epilogue.cuh). It is kernels/mixed/gemm.cu's arithmetic
// with grouped_int's warp-specialized copies (kernels/grouped_int/mma.cu `ws`).
//
// Block: 9 warps (288 threads). Warps 0-7 (two warpgroups) multiply, warp 8 copies.
//   * Copies: warp 8 brings each stage into a ring of STC copy slots: the activation tile by the copy engine (tensor
//     map, 128-byte swizzle), the stage's weight words by the decode's `copy` (its bulk or cp.async copies, its 32
//     lanes). A slot's "full" barrier completes with the bytes of the bulk copies plus one arrival of lane 0 and one
//     per lane once its cp.asyncs land; its "empty" barrier with one arrival per MMA warp. The copy warp does
//     nothing else, so it waits on each slot as it frees and the ring runs STC stages ahead of the MMAs.
//   * MMA: each MMA warp waits for a stage's slot, decodes its A fragments from the words (`fragments`: rows r0 and
//     r0 + 8, 16 weights of each per k16 step) into one of two register sets, and its warpgroup issues the four
//     k16 wgmmas; the decode of stage s + 1 runs while stage s's wgmmas do (wait 1 then releases stage s - 1's
//     slot, and with it the register set stage s + 1 decodes into).
// Nothing meets at a block barrier inside the loop. Against the tile form (common/f16_ws_tile_wgmma.cuh: decode
// warps write an fp16 tile for wgmmas with both operands in shared memory) this reads no decoded tile and reaches
// 256 tokens, but the four lanes sharing a row each decode its per-row constants: kernels/mixed/NOTES.md,
// "Per-stage budget". Needs NVRTC 12.4 or newer (__maxnreg__).
//
// A decode D supplies (all shared-memory addresses are 32-bit shared-window addresses):
//   Params                               what its copies and decode read
//   RAW                                  bytes of a stage's weight words in a copy slot (after the activations)
//   TX                                   bytes of them that the copy engine brings (counted on the full barrier)
//   Cursor, cursor(p, n0, lane)          the copy warp's per-lane state for the block's rows n0.. (built once)
//   copy(p, cur, w, full, gs, lane)      the copy warp's lanes: global stage gs (64-channel block) into w; bulk
//                                        copies complete on `full` (the engine adds the lanes' cp.async arrivals);
//                                        stages come in increasing order, and copy may advance cur
//   fragments(w, af, r0, t)              a lane's A fragments of the stage's words at w: af[i] for k16 step i, rows
//                                        r0 and r0 + 8 of the block, columns 2t, 2t + 1 and 2t + 8, 2t + 9 (wgmma's
//                                        register A layout: af[i][h] row r0 + 8h, af[i][2 + h] its columns + 8)
//   kcols(w, col)                        per k16 step, the byte offset (32 x a column block) of the activation
//                                        columns it multiplies in a 128-byte activation row (a decode may keep its
//                                        fields in any order and point each step at its channels)
// No CUDA headers: everything is inline PTX (here and in common/ptx_common.cuh).
#pragma once

#include "common/ptx_common.cuh"
#include "common/wgmma_epilogue.cuh"

constexpr int F16_WS_THREADS = 288;

// The register cap of an entry built for MINB blocks per multiprocessor (its __maxnreg__): 224 and 112, so the
// blocks' 9 warps fit the 65536 registers. A launch bound cannot say it: ptxas sizes 288 threads as if 384.
template <int MINB>
constexpr int f16_ws_regs = 65536 / (F16_WS_THREADS * MINB) / 8 * 8;

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


// Shared memory of a block: STC copy slots (the activation tile, then the weight words), each a multiple of 1024
// bytes, so the swizzle atoms stay aligned. The barriers are a static array.
template <int TN, int STC, int RAW>
struct F16WsRing {
    static constexpr int XT = TN * 128;
    static constexpr int CS = (XT + RAW + 1023) / 1024 * 1024;
    static constexpr int BYTES = STC * CS;  // the launch adds 1024 for the alignment
    static constexpr int FULL = 0, EMPTY = STC, BARS = 2 * STC;
};

// The copy warp: the block's ns stages from s0 of rows n0.., tokens m0.., in ring order.
template <class D, int TN, int STC>
__device__ __forceinline__ void f16_ws_copies(const TmaMap* mx, const typename D::Params& dp, u32 base, u32 bars,
                                              int m0, int n0, int s0, int ns, int lane) {
    using R = F16WsRing<TN, STC, D::RAW>;
    typename D::Cursor cur = D::cursor(dp, n0, lane);
    auto weights = [&](int p, int c) {
        const u32 full = bars + 8u * (R::FULL + c);
        if (lane == 0) mbar_arrive_expect_tx(full, R::XT + D::TX);
        D::copy(dp, cur, base + (u32)c * R::CS + R::XT, full, s0 + p, lane);
        cp_async_mbar_arrive(full);
    };
    auto acts = [&](int p, int c) {
        if (lane == 0) tma_load_2d(base + (u32)c * R::CS, mx, bars + 8u * (R::FULL + c), 128 * (s0 + p), m0);
    };
    // the weights do not come from the kernel ahead (a dependent launch starts during its tail): the first slots'
    // weight copies go out before the wait for it, the activations after
    const int first = min(STC, ns);
    for (int p = 0; p < first; ++p) weights(p, p);
    grid_dependency_wait();
    for (int p = 0; p < first; ++p) acts(p, p);
    int c = 0;
    u32 eph = 0;  // parity of the empty phase that frees slot c for stage p
    for (int p = first; p < ns; ++p) {
        mbar_wait(bars + 8u * (R::EMPTY + c), eph);
        weights(p, c);
        acts(p, c);
        if (++c == STC) c = 0, eph ^= 1u;
    }
    cp_async_commit();
    cp_async_wait<0>();  // its cp.asyncs land before the warp exits
}

// One stage of an MMA warp: wait for slot c, decode into af, issue the warpgroup's wgmmas, release the slot of the
// stage before (pc) once they have completed.
template <class D, int TN, int STC>
__device__ __forceinline__ void f16_ws_stage(float (&acc)[TN / 2], u32 (&af)[4][4], u32 base, u32 bars, int s,
                                             int& c, int& pc, u32& cph, int r0, int t, int lane) {
    using R = F16WsRing<TN, STC, D::RAW>;
    mbar_wait(bars + 8u * (R::FULL + c), cph);
    const u32 xs = base + (u32)c * R::CS;
    D::fragments(xs + R::XT, af, r0, t);
    u32 col[4];
    D::kcols(xs + R::XT, col);
    wgmma_fence();
#pragma unroll
    for (int i = 0; i < 4; ++i) wgmma_acc(acc, af[i], desc_sw128(xs + col[i]));
    wgmma_commit();
    wgmma_wait1();  // stage s - 1's wgmmas have read their operands: hand its slot back
    if (s > 0 && lane == 0) mbar_arrive(bars + 8u * (R::EMPTY + pc));
    pc = c;
    if (++c == STC) c = 0, cph ^= 1u;
}

// The block (grid: ceil(N / 128) x ceil(M / TN) x S, F16_WS_THREADS threads, R::BYTES + 1024 bytes of dynamic
// shared memory): output rows n0 = 128 blockIdx.x.., tokens m0 = TN blockIdx.y.., share z = blockIdx.z of S of the
// nblk stages. mx: the activations [M, K] fp16 as bytes, boxes of 128 bytes x TN rows, 128-byte swizzle. Split-K
// (S > 1): ws holds S·gridDim.x·gridDim.y·128·TN floats and cnt gridDim.x·gridDim.y zeros (qtool/cuda/split_k.py).
template <class D, int TN, int STC>
__device__ __forceinline__ void f16_ws_body(const TmaMap* mx, const typename D::Params& dp, int M, int N, int nblk,
                                            const u16* __restrict__ bias, u16* __restrict__ out, int ldc,
                                            float* __restrict__ ws, int* __restrict__ cnt) {
    using R = F16WsRing<TN, STC, D::RAW>;
    static_assert(STC >= 2, "a stage in use and the next one");
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
        mbar_init_fence();
    }
    __syncthreads();
    const int S = gridDim.z, z = blockIdx.z;
    const int s0 = (int)((long long)z * nblk / S), ns = (int)((long long)(z + 1) * nblk / S) - s0;
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u, bars = smem_addr(bar_mem);
    const int n0 = (int)blockIdx.x * 128, m0 = (int)blockIdx.y * TN, lane = tid & 31;
    if (tid >= 256) {
        f16_ws_copies<D, TN, STC>(mx, dp, base, bars, m0, n0, s0, ns, lane);
        launch_dependents();
        return;
    }
    grid_dependency_wait();  // out, ws and cnt may be the kernel ahead's until it completes
    const int wg = tid >> 7, warp = (tid >> 5) & 3, t = lane & 3;
    const int r0 = 64 * wg + 16 * warp + (lane >> 2);  // this lane's rows in the tile: r0, r0 + 8
    float acc[1][TN / 2];
#pragma unroll
    for (int i = 0; i < TN / 2; ++i) acc[0][i] = 0.f;
    u32 af0[4][4], af1[4][4];  // two register sets, alternating stages, so the indices stay static
    int c = 0, pc = 0, s = 0;
    u32 cph = 0;
    for (; s + 1 < ns; s += 2) {
        f16_ws_stage<D, TN, STC>(acc[0], af0, base, bars, s, c, pc, cph, r0, t, lane);
        f16_ws_stage<D, TN, STC>(acc[0], af1, base, bars, s + 1, c, pc, cph, r0, t, lane);
    }
    if (s < ns) f16_ws_stage<D, TN, STC>(acc[0], af0, base, bars, s, c, pc, cph, r0, t, lane);
    wgmma_wait0();
    launch_dependents();
    bar_sync<1, 256>();  // every MMA warp is done with the ring (the copies landed: each was waited for): it becomes
                         // the transpose tile
    if (S > 1 && !split_k_sum<TN, 1, 1, 256>(acc, ws, cnt, tid, z, S, gridDim.x * gridDim.y,
                                             blockIdx.x + gridDim.x * blockIdx.y))
        return;
    store_out<TN, 1, 1>(acc, m0, n0, M, N, r0, t, tid, smem_raw, base, bias, out, ldc);
}
