// The decode of a `vq` layer's stage into wgmma A fragments (formats/vq.md), shared by the block-synchronous GEMM
// (vq/gemm.cu) and the warp-specialized one (vq/gemm_ws.cu): a VQ configuration's sizes (VqCfg), a lane's codes
// from a row's stage words, and the four k16 steps of a lane's fragments looked up in a codebook in shared memory
// (vq_dequant; F as vq/gemm.cu describes).
#pragma once

#include "common/ptx_common.cuh"

template <int D, int B, int Z>
struct VqCfg {
    static constexpr int D_ = D, B_ = B, Z_ = Z;
    static constexpr int E = 1 << B;
    static constexpr int VPS = 64 / D;             // vectors per row in a 64-column stage
    static constexpr int IW = VPS * B / 32;        // index words per row, residual and stage
    static constexpr int NW = (IW + 3) / 4 * 4;    // the same, padded to 16-byte loads
    static constexpr int IROW = Z * NW * 4;        // bytes of one row's indices in a stage
    static constexpr int CBB = Z * E * D * 2;      // one scope's codebooks, bytes
    static constexpr int RSTRIDE = E * D * 2;      // one residual's codebook, bytes
    static constexpr bool RESIDENT = CBB > 16384;  // held for the block's life instead of carried per stage
    static_assert(VPS * B % 32 == 0, "a stage's indices must start on a word");
    static_assert(D == 4 || D == 8, "vector sizes 4 and 8");
};

__device__ __forceinline__ u32 hadd2(u32 a, u32 b) {
    u32 r;
    asm("add.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// a[i] for a run-time i in 0..3 without indexing a register array (which would move it to local memory)
__device__ __forceinline__ u32 sel4(u32 a0, u32 a1, u32 a2, u32 a3, int i) {
    return (i & 2) ? ((i & 1) ? a3 : a2) : ((i & 1) ? a1 : a0);
}

// The B-bit code at bit bit0 + extra of a row's stage words: bit0 is a compile-time constant once unrolled (so w
// stays in registers), extra a per-lane offset with (bit0 % 32) + extra + B <= 64.
template <int B, int NW>
__device__ __forceinline__ u32 code_at(const u32 (&w)[NW], int bit0, u32 extra) {
    const int wi = bit0 >> 5;
    const u32 lo = w[wi], hi = wi + 1 < NW ? w[wi + 1] : 0u;
    const u64 win = ((u64)hi << 32) | lo;
    return (u32)(win >> ((u32)(bit0 & 31) + extra)) & ((1u << B) - 1u);
}

template <class Cfg>
__device__ __forceinline__ void load_idx(u32 (&w)[Cfg::Z_][Cfg::NW], u32 row) {
#pragma unroll
    for (int r = 0; r < Cfg::Z_; ++r) {
#pragma unroll
        for (int q = 0; q < Cfg::NW / 4; ++q) {
            const uint4 v = lds128(row + r * Cfg::NW * 4 + 16 * q);
            w[r][4 * q] = v.x;
            w[r][4 * q + 1] = v.y;
            w[r][4 * q + 2] = v.z;
            w[r][4 * q + 3] = v.w;
        }
    }
}

// Decode one stage (4 k16 steps) of this lane's A fragments: af[j] = rows r0, r0 + 8 of step j. `it`: the stage's
// index tile; `cbs`: the scope's codebooks.
template <class Cfg, int F>
__device__ __forceinline__ void vq_dequant(u32 (&af)[4][4], u32 it, u32 cbs, int r0, int t) {
    constexpr int D = Cfg::D_, B = Cfg::B_, Z = Cfg::Z_, NW = Cfg::NW, RS = Cfg::RSTRIDE;
    if constexpr (D == 4 && F == 1) {
        // Lane t looks up vector p of each step (quad lanes 0, 1, 2, 3: vectors 0, 2, 1, 3), i.e. columns
        // 4p..4p+3; lanes t and t^1 then swap one pair: an even lane keeps its first pair (columns 2t, 2t + 1)
        // and gets its partner's first (2t + 8, 2t + 9), an odd lane the other way round.
        const u32 p = (u32)(((t & 1) << 1) | (t >> 1));
        const bool odd = t & 1;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 w[Z][NW];
            load_idx<Cfg>(w, it + (u32)(r0 + 8 * h) * Cfg::IROW);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 q0 = 0, q1 = 0;
#pragma unroll
                for (int r = 0; r < Z; ++r) {
                    const u32 code = code_at<B>(w[r], 4 * j * B, p * B);
                    const uint2 e = lds64(cbs + r * RS + code * 8);
                    q0 = r == 0 ? e.x : hadd2(q0, e.x);
                    q1 = r == 0 ? e.y : hadd2(q1, e.y);
                }
                const u32 recv = __shfl_xor_sync(0xffffffffu, odd ? q0 : q1, 1);
                af[j][h] = odd ? recv : q0;
                af[j][2 + h] = odd ? q1 : recv;
            }
        }
    } else if constexpr (D == 8 && F == 1) {
        // Lane t looks up vector c = t % 2 of row r0 + 8h (h = t / 2) in each step: pair i of it (columns 2i,
        // 2i + 1) belongs to lane i, in A register h + 2c. Three shfl_xor rounds (Fig. 12): in round o a lane
        // sends the pair its partner t^o needs and receives its own pair of the partner's vector.
        const int h = t >> 1, c = t & 1;
        u32 w[Z][NW];
        load_idx<Cfg>(w, it + (u32)(r0 + 8 * h) * Cfg::IROW);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            u32 q[4];
#pragma unroll
            for (int r = 0; r < Z; ++r) {
                const u32 code = code_at<B>(w[r], 2 * j * B, (u32)(c * B));
                const uint4 e = lds128(cbs + r * RS + code * 16);
                q[0] = r == 0 ? e.x : hadd2(q[0], e.x);
                q[1] = r == 0 ? e.y : hadd2(q[1], e.y);
                q[2] = r == 0 ? e.z : hadd2(q[2], e.z);
                q[3] = r == 0 ? e.w : hadd2(q[3], e.w);
            }
            u32 R[4];
            R[0] = sel4(q[0], q[1], q[2], q[3], t);
#pragma unroll
            for (int o = 1; o < 4; ++o)
                R[o] = __shfl_xor_sync(0xffffffffu, sel4(q[0], q[1], q[2], q[3], t ^ o), o);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                const int src = ((k & 1) << 1) | (k >> 1);  // the lane whose vector fills A register k
                af[j][k] = sel4(R[0], R[1], R[2], R[3], t ^ src);
            }
        }
    } else if constexpr (F == 2) {
        // As F = 0 with d = 4, each lane reading from its own bank of the replicated entries.
        const u32 extra = (u32)((t >> 1) * B);
        const u32 lane4 = (threadIdx.x & 31) * 4;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 w[Z][NW];
            load_idx<Cfg>(w, it + (u32)(r0 + 8 * h) * Cfg::IROW);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                af[j][h] = lds32(cbs + code_at<B>(w[0], 4 * j * B, extra) * 128 + lane4);
                af[j][2 + h] = lds32(cbs + code_at<B>(w[0], (4 * j + 2) * B, extra) * 128 + lane4);
            }
        }
    } else {
        // No fusion: each lane reads the two pairs it consumes per row and step from the shared codebook.
        constexpr int VPK = 16 / D;  // vectors per k16 step
        const u32 extra = D == 4 ? (u32)((t >> 1) * B) : 0u;
        const u32 off = D == 4 ? (u32)(4 * (t & 1)) : (u32)(4 * t);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            u32 w[Z][NW];
            load_idx<Cfg>(w, it + (u32)(r0 + 8 * h) * Cfg::IROW);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                u32 lo = 0, hi = 0;
#pragma unroll
                for (int r = 0; r < Z; ++r) {
                    // columns 2t.. of the step: vector t/2 (d = 4) or 0 (d = 8); 2t + 8..: the one 8 columns on
                    const u32 ca = code_at<B>(w[r], VPK * j * B, extra);
                    const u32 cb2 = code_at<B>(w[r], (VPK * j + VPK / 2) * B, extra);
                    const u32 a = lds32(cbs + r * RS + ca * (2 * D) + off);
                    const u32 b = lds32(cbs + r * RS + cb2 * (2 * D) + off);
                    lo = r == 0 ? a : hadd2(lo, a);
                    hi = r == 0 ? b : hadd2(hi, b);
                }
                af[j][h] = lo;
                af[j][2 + h] = hi;
            }
        }
    }
}
