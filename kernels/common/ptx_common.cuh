// Helpers shared by the kernels in this folder: half conversions and arithmetic, shared-memory addresses, cp.async
// and shared-memory loads, the wgmma descriptor/fence wrappers, as inline PTX (no CUDA headers, so any NVRTC builds
// them). qtool/cuda/compile.py hands NVRTC this file's text with each kernel source (and keys the binary cache on
// it).
#pragma once

typedef unsigned int u32;
typedef unsigned short u16;
typedef unsigned long long u64;
typedef unsigned char u8;

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ u32 f16x2_sub(u32 a, u32 b) {
    u32 r;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 f16x2_mul(u32 a, u32 b) {
    u32 r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

__device__ __forceinline__ u32 h2fma(u32 a, u32 b, u32 c) {
    u32 r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// The two halves of a chain added in fp16 (one more rounding of the chain's sum), widened once.
__device__ __forceinline__ float h2sum(u32 h) {
    u16 r;
    asm("{.reg .b16 lo, hi; mov.b32 {lo, hi}, %1; add.rn.f16 %0, lo, hi;}" : "=h"(r) : "r"(h));
    return h2f(r);
}

// Weights and indices are read once: keep them out of L1 so the activations and small tables stay there. Volatile,
// so the loads stay ahead of the arithmetic where they are written.
__device__ __forceinline__ uint4 ld_stream(const u32* p) {
    uint4 r;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// 16 bytes through the read-only path, allocating in L1 (unlike ld_stream): only for what no kernel ahead in a
// dependent launch writes (that takes ld_dep_v4). Volatile, as ld_stream, so loads issued ahead of the arithmetic
// stay where they are written. A template, not a void* parameter: the conversion to void* reorders the callers'
// address arithmetic in the generated PTX.
template <typename T>
__device__ __forceinline__ uint4 ld_nc_v4(const T* p) {
    uint4 r;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w)
                 : "l"(p));
    return r;
}

// Half i (0..7) of 8 packed float16 values.
__device__ __forceinline__ u16 half_of(const uint4& v, int i) {
    const u32 w = i < 2 ? v.x : i < 4 ? v.y : i < 6 ? v.z : v.w;
    return (u16)(i & 1 ? w >> 16 : w & 0xFFFF);
}

// c + the dot product of the four bytes of a and b: a unsigned, b signed (dp4a_us), or both signed (dp4a_ss).
__device__ __forceinline__ int dp4a_us(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

__device__ __forceinline__ int dp4a_ss(u32 a, u32 b, int c) {
    int d;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Bytes of {b, a} picked by the four selector nibbles of sel (byte permute).
__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

// a·b + c, low 32 bits: with codes in the bytes of a, a scale b and offsets in the bytes of c, one IMAD scales and
// offsets four codes at once as long as no byte carries.
__device__ __forceinline__ u32 imad(u32 a, u32 b, u32 c) {
    u32 r;
    asm("mad.lo.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// Sum over the 32 lanes of a warp, in every lane (all lanes must call it).
__device__ __forceinline__ int warp_sum_i32(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Programmatic dependent launch (sm_90; qtool/cuda/dependent_launch.py). A kernel launched with the
// programmatic-serialization attribute may start before the kernel ahead of it in the stream has finished:
// grid_dependency_wait() returns once that kernel has completed and its writes are visible (at once for an
// ordinary launch), so nothing it writes may be read before. launch_dependents() lets the next such kernel start
// once every block of this one has called it or exited.
__device__ __forceinline__ void grid_dependency_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void launch_dependents() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Loads of what the kernel ahead wrote, after grid_dependency_wait(). Coherent: a dependent launch starts before
// that kernel has finished, and the non-coherent (read-only) path may then answer from a line it cached from the
// same address before the write (measured: a reused activation buffer read back stale); volatile, so they are
// not hoisted above the wait.
__device__ __forceinline__ uint4 ld_dep_v4(const void* p) {
    uint4 r;
    asm volatile("ld.global.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ float ld_dep_f32(const float* p) {
    float r;
    asm volatile("ld.global.f32 %0, [%1];" : "=f"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ u16 ld_dep_u16(const u16* p) {
    u16 r;
    asm volatile("ld.global.u16 %0, [%1];" : "=h"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ u32 ld_dep_u32(const u32* p) {
    u32 r;
    asm volatile("ld.global.u32 %0, [%1];" : "=r"(r) : "l"(p));
    return r;
}

__device__ __forceinline__ long long ld_dep_s64(const long long* p) {
    long long r;
    asm volatile("ld.global.s64 %0, [%1];" : "=l"(r) : "l"(p));
    return r;
}

// Thread-block clusters (sm_90; qtool/cuda/dependent_launch.py launches them). Launched without a cluster, a block
// is a cluster of one (and below sm_90 always): cluster_dim gives 1 and cluster_pos 0, and a kernel that checks
// them takes a path that needs no other block.
__device__ __forceinline__ u32 cluster_dim(int axis) {
    u32 r = 1;
#if __CUDA_ARCH__ >= 900
    if (axis == 0) asm("mov.u32 %0, %%cluster_nctaid.x;" : "=r"(r));
    else asm("mov.u32 %0, %%cluster_nctaid.y;" : "=r"(r));
#endif
    return r;
}

__device__ __forceinline__ u32 cluster_pos(int axis) {
    u32 r = 0;
#if __CUDA_ARCH__ >= 900
    if (axis == 0) asm("mov.u32 %0, %%cluster_ctaid.x;" : "=r"(r));
    else asm("mov.u32 %0, %%cluster_ctaid.y;" : "=r"(r));
#endif
    return r;
}

// Every thread of every block of the cluster: writes before it (shared memory included) are visible to the
// cluster's blocks after it.
__device__ __forceinline__ void cluster_sync() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// cluster_sync in halves, so work that needs no barrier runs between them. The release of an arrival waits for
// every earlier write of the thread, global stores included (a GPU-scope fence in the generated code): writes that
// no other block reads go after it. A kernel that writes into other blocks' shared memory may do so only once
// every block of the cluster has started: all its threads arrive relaxed (publishing nothing) at the top and wait
// just before the first such write, which costs next to nothing.
__device__ __forceinline__ void cluster_arrive() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}

__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
#endif
}

// The float at this block's shared address `addr` in block `rank` of the cluster (distributed shared memory).
__device__ __forceinline__ float ld_cluster_f32(u32 addr, u32 rank) {
    float v = 0.f;
#if __CUDA_ARCH__ >= 900
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];" : "=f"(v) : "r"(remote) : "memory");
#endif
    return v;
}

// Store v at this block's shared address `addr` in block `rank` of the cluster (distributed shared memory): the
// push side of an exchange where each block reads only its own shared memory, so no block reads from one that
// may have exited. Visible to that block after the next cluster_sync. Below sm_90 there are no clusters: rank
// must be 0, the block itself.
__device__ __forceinline__ void st_cluster_u32(u32 addr, u32 rank, u32 v) {
#if __CUDA_ARCH__ >= 900
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(addr), "r"(rank));
    asm volatile("st.shared::cluster.u32 [%0], %1;" ::"r"(remote), "r"(v) : "memory");
#else
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(addr), "r"(v) : "memory");
#endif
}

// Named barrier `ID` for THREADS threads (bar.sync 0 over the whole block is __syncthreads).
template <int ID, int THREADS>
__device__ __forceinline__ void bar_sync() {
    asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(THREADS) : "memory");
}

// Split-K arrival: once every thread holding the tile has written its share of the tile's partials, count the block
// on the tile's counter. True in the tile's last block, which then sees every share's writes (and must reset the
// counter to zero when it is done). BAR 0: the whole block holds the tile; else the THREADS threads of named
// barrier BAR do (warp-specialized kernels, whose copy warps have left), `tid` counting among them.
template <int BAR = 0, int THREADS = 0>
__device__ __forceinline__ bool split_k_last(int* cnt, int tile_id, int shares, int tid = threadIdx.x) {
    __shared__ int last;
    __threadfence();
    if constexpr (BAR == 0) __syncthreads(); else bar_sync<BAR, THREADS>();
    if (tid == 0) last = atomicAdd(cnt + tile_id, 1) == shares - 1;
    if constexpr (BAR == 0) __syncthreads(); else bar_sync<BAR, THREADS>();
    if (last) __threadfence();
    return last;
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    u32 a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// wgmma shared-memory matrix descriptor for a K-major tile of 128-byte rows with the 128-byte swizzle.
__device__ __forceinline__ u64 desc_sw128(u32 addr) {
    // start address >> 4 | leading byte offset 1 (unused with swizzle) | stride 1024 B (8 rows) >> 4 | 128B swizzle
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

// The same for a K-major tile of 64-byte rows with the 64-byte swizzle: 8 rows (one swizzle atom) are 512 bytes.
__device__ __forceinline__ u64 desc_sw64(u32 addr) {
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(512 >> 4) << 32) | ((u64)2 << 62);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait1() { asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory"); }
__device__ __forceinline__ void fence_async_smem() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

__device__ __forceinline__ void cp_async16(u32 dst, const void* src, int bytes) {
    // bytes 0: the 16 bytes are zero-filled (rows past M or N)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async4(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }

template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint2 lds64(u32 addr) {
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(addr));
    return v;
}

__device__ __forceinline__ u32 lds32(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

__device__ __forceinline__ uint4 lds128(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// ---------------------------------------------------------------------------------------------------------------
// Bulk tensor copies (TMA) completing on mbarriers, for warp-specialized kernels: one thread issues a stage's
// copies, the consumer warps wait on the stage's "full" barrier and hand it back through its "empty" barrier.
// Tensor maps are encoded on the host (qtool/cuda/tma.py) and passed by value as __grid_constant__ parameters.
// ---------------------------------------------------------------------------------------------------------------
struct __align__(64) TmaMap {
    u64 opaque[16];
};

__device__ __forceinline__ void mbar_init(u32 bar, u32 count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}

// Makes the initialized barriers visible to the copy engine before any copy names them.
__device__ __forceinline__ void mbar_init_fence() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

// The barriers of an ST-stage ring at `bars` (8 bytes each): full[i] at bars + 8i, completed by the copy thread's
// arrival plus the stage's bytes; empty[i] at bars + 8(ST + i), by one arrival from each of the 8 math warps.
// One thread initializes; the block synchronizes before any copy names them.
template <int ST>
__device__ __forceinline__ void ring_init(u32 bars) {
#pragma unroll
    for (int i = 0; i < ST; ++i) {
        mbar_init(bars + 8 * i, 1);
        mbar_init(bars + 8 * (ST + i), 8);
    }
    mbar_init_fence();
}

__device__ __forceinline__ void mbar_arrive_expect_tx(u32 bar, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(u32 bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}

// Wait until the barrier's phase of parity `parity` has completed.
__device__ __forceinline__ void mbar_wait(u32 bar, u32 parity) {
    u32 done;
    do {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}

// Copy the box at (c0 = inner coordinate, c1 = row) of `map` to shared memory at dst; completes on `bar`.
__device__ __forceinline__ void tma_load_2d(u32 dst, const TmaMap* map, u32 bar, int c0, int c1) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%3, %4}], [%2];"
        ::"r"(dst), "l"(reinterpret_cast<u64>(map)), "r"(bar), "r"(c0), "r"(c1)
        : "memory");
}

// Copy `bytes` contiguous bytes (a multiple of 16; both addresses 16-byte aligned) from global memory to shared
// memory at dst; completes on `bar` (1-D bulk copy, no tensor map).
__device__ __forceinline__ void bulk_load(u32 dst, const void* src, u32 bytes, u32 bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar)
                 : "memory");
}

// Copy the box at (c0, c1) of `map` from shared memory at src to global memory (clipped at the tensor's edges), in
// this thread's current bulk group. Shared-memory writes of other threads must be fenced (fence_async_smem) and
// synchronized before it is issued.
__device__ __forceinline__ void tma_store_2d(const TmaMap* map, u32 src, int c0, int c1) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];"
                 ::"l"(reinterpret_cast<u64>(map)), "r"(src), "r"(c0), "r"(c1)
                 : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Until this thread's bulk groups but the newest N have read their shared-memory sources.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Until this thread's bulk groups have completed (their global writes done).
__device__ __forceinline__ void bulk_wait_all() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Four 8x8 float16 matrices, transposed, into shared memory: register i of a lane holds row lane / 4, columns
// 2 (lane % 4) and + 1 of matrix i (an mma accumulator fragment), and lanes 8i..8i+7 give the addresses of the
// 16-byte rows of stored matrix i (its columns before the transpose).
__device__ __forceinline__ void stmatrix_x4_trans(u32 addr, u32 r0, u32 r1, u32 r2, u32 r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};"
                 ::"r"(addr), "r"(r0), "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

// Two floats to float16 (round to nearest even), lo in the low half.
__device__ __forceinline__ u32 f2h2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ void tma_prefetch_map(const TmaMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<u64>(map)) : "memory");
}

// Register reallocation between warpgroups (sm_90a): the copy warpgroup gives registers to the math warpgroups.
template <int R>
__device__ __forceinline__ void regs_increase() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(R));
}

template <int R>
__device__ __forceinline__ void regs_decrease() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(R));
}


// The persistent GEMMs' epilogue through the copy engine. The 256 math threads of two warpgroups hold a tile of 128
// output features (warpgroup w: features 64w..64w+63, a thread's rows r0 and r0 + 8 as in a wgmma m64 accumulator)
// x TN tokens; `val(i)` is this thread's accumulator i as a float, bias included. 32 tokens at a time go into
// shared memory by stmatrix, transposed into the 128-byte-swizzled layout of `mo` (the float16 output as bytes,
// boxes of 128 bytes x 32 tokens: one box per warpgroup), and leave by bulk tensor stores, clipped at M and N,
// that no math thread waits for. EB >= 2 buffers of 8 KB at `ebuf` take the chunks in turn (`eb`: the next one,
// carried from tile to tile): before each chunk's barrier thread 0 waits until all but its latest EB - 2 stores
// have read their buffers, so the chunk after it may overwrite the oldest one's. Thread 0 waits for all its stores
// (bulk_wait_all) before the block exits.
// MODE (measurement builds only): 1 skips that wait (a race), 4 stores by stmatrix only, 5 skips the bulk stores.
template <int TN, int EB, int MODE = 0, typename V>
__device__ __forceinline__ void tma_store_tile(const V& val, int m0, int n0, int M, int tid, u32 ebuf, int& eb,
                                               const TmaMap* mo) {
    static_assert(EB >= 2, "two epilogue buffers at least");
    const int lane = tid & 31, mi = lane >> 3, j = lane & 7;
    // this lane's stmatrix row: token 8 (2q + mi / 2) + j of the chunk, features 8 (2 warp + mi % 2) .. + 7 of
    // its warpgroup's box, at 16-byte position (2 warp + mi % 2) ^ j of the swizzled 128-byte row
    const u32 lrow = (u32)(tid >> 7) * 4096u + (u32)(8 * (mi >> 1) + j) * 128u +
                     (u32)(((2 * ((tid >> 5) & 3) + (mi & 1)) ^ j) << 4);
#pragma unroll
    for (int c = 0; c < TN / 32; ++c) {
        const u32 buf = ebuf + (u32)eb * 8192u;
        eb = eb == EB - 1 ? 0 : eb + 1;
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            const int i = 4 * (4 * c + 2 * q);  // accumulators of token blocks 4c + 2q and + 1
            stmatrix_x4_trans(buf + lrow + (u32)q * 2048u, f2h2(val(i), val(i + 1)), f2h2(val(i + 2), val(i + 3)),
                              f2h2(val(i + 4), val(i + 5)), f2h2(val(i + 6), val(i + 7)));
        }
        if (MODE == 4) continue;
        fence_async_smem();  // the copy engine reads what these generic stores wrote
        if (tid == 0 && MODE != 1) bulk_wait_read<EB - 2>();
        bar_sync<1, 256>();
        if (tid == 0 && MODE != 5) {
            const int m1 = m0 + 32 * c;
            if (m1 < M) {
                tma_store_2d(mo, buf, 2 * n0, m1);
                tma_store_2d(mo, buf + 4096u, 2 * n0 + 128, m1);
            }
            bulk_commit();
        }
    }
}
