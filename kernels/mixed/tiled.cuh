// The tiled streams of a `mixed-2-4-16` block4 layer (qtool/layouts/mixed/cuda.py `tiled_streams`) as the Hopper
// GEMMs hold them in shared memory, and the decode of one weight row of a 64-channel block into fp16 weights. Both
// GEMMs take it from here: kernels/mixed/gemm.cu decodes the A fragments of its lanes (two fields of each stripe),
// kernels/mixed/gemm_ws.cu whole rows into the A tile wgmma reads from shared memory.
//
// A weight is the reference's fp16 cast of (q - z)·(c + u)·s2 (2-bit stripes) or (q - z)·s4 (the 4-bit one): the
// exact value rounded once. A code or-ed into the mantissa of 16.0 (bits 0-3 of a half: 16 + q/64) or of 1.0 (bits
// 4-7: 1 + q/64) is exact, so one shift serves two fields; 64 times it less 1024 + z (or 64 + z) is the integer
// q - z, exact in one fma. For a 2-bit stripe, (q - z)·(c + u) is an integer of at most 90 (exact in fp16) and one
// multiply by s2 rounds it once; for the 4-bit stripe the multiply by s4 does. Every intermediate is exact, so the
// result is the correctly rounded product: the same bits as (q - z)/64 times 64·ŝ in fp32 rounded to fp16 (the
// reference, and this GEMM's earlier fp32 form), with no fp32 work and no 64·s in fp16 that could overflow.
#pragma once

#include "common/ptx_common.cuh"

constexpr u32 MAG0 = 0x4C004C00u;  // 16.0 twice: a code at bits 0-3 of a half reads 16 + q/64
constexpr u32 MAG4 = 0x3C003C00u;  // 1.0 twice: a code at bits 4-7 of a half reads 1 + q/64
constexpr u32 MAGI = 0x64006400u;  // 1024.0 twice: an integer below 1024 in the mantissa reads 1024 + n
constexpr u32 H64 = 0x54005400u;   // 64.0 twice

// (a & MASK) | mag in one LOP3 (kernels/mixed/gemv.cu andor: written in C it compiles to two, since an
// instruction takes one immediate).
template <u32 MASK>
__device__ __forceinline__ u32 andor(u32 a, u32 mag) {
    u32 r;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(a), "n"(MASK), "r"(mag));
    return r;
}

__device__ __forceinline__ void cp_async8(u32 dst, const void* src, int bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}

// A stage's words of 128 weight rows (one 64-channel block) in shared memory: per row its ta (16 bytes) and tm (8)
// words, per 4-row group its tz (4) and tt (8) words, then the block's binfo word.
struct MixedWords {
    static constexpr int TA = 0;
    static constexpr int TM = TA + 128 * 16;
    static constexpr int TZ = TM + 128 * 8;
    static constexpr int TT = TZ + 32 * 4;
    static constexpr int BI = TT + 32 * 8;
    static constexpr int BYTES = BI + 16;
};

// An integer 0..1023 in both halves, exact.
__device__ __forceinline__ u32 int_h2(u32 n) { return f16x2_sub((n * 0x10001u) | MAGI, MAGI); }

// One weight row of a stage, ready to decode: its code words, and per stripe the halves that turn a code pair into
// weights. Fields n = 0..7 of a stripe are its column pairs (2n, 2n + 1), codes 2n and 2n + 1 in the two halves of
// field n of the tiled word (the 4-bit stripe: fields 0-3 in ta's last word, 4-7 in tm's first).
struct MixedRow {
    u32 w[5];   // the three 2-bit words, the 4-bit stripe's two words
    u32 nz[4];  // -(1024 + z) in both halves, per stripe (the 16.0 magic; the 1.0 one takes nz4)
    u32 nz4[4];  // -(64 + z)
    u32 cu[3];  // c + u of the 2-bit stripes
    u32 sc[4];  // s2 of the 2-bit stripes, s4: both halves

    // Row `row` (0..127) of the stage's words at `words` (MixedWords).
    __device__ __forceinline__ void load(u32 words, int row) {
        const uint4 A = lds128(words + MixedWords::TA + row * 16);
        const uint2 W = lds64(words + MixedWords::TM + row * 8);
        const u32 zb = lds32(words + MixedWords::TZ + (row >> 2) * 4) >> (8 * (row & 3));
        const uint2 S = lds64(words + MixedWords::TT + (row >> 2) * 8);
        w[0] = A.x, w[1] = A.y, w[2] = A.z, w[3] = A.w, w[4] = W.x;
#pragma unroll
        for (int i = 0; i < 3; ++i) {
            const u32 z = (zb >> (2 * i)) & 3u;
            nz[i] = z * 0x10001u + 0xE400E400u;
            nz4[i] = (z << 4) * 0x10001u + 0xD400D400u;
            cu[i] = int_h2(((W.y >> (16 + 4 * i)) & 15u) + ((S.y >> (16 + 4 * i)) & 15u));
        }
        const u32 z4 = W.y >> 28;
        nz[3] = z4 * 0x10001u + 0xE400E400u;
        nz4[3] = (z4 << 4) * 0x10001u + 0xD400D400u;
        sc[0] = prmt(S.x, 0, 0x1010u);
        sc[1] = prmt(S.x, 0, 0x3232u);
        sc[2] = prmt(S.y, 0, 0x1010u);
        sc[3] = prmt(W.y, 0, 0x1010u);
    }

    // The weights of a magic pair m (MAG0 form unless HI4) of stripe i.
    template <bool HI4>
    __device__ __forceinline__ u32 finish(int i, u32 m) const {
        const u32 d = h2fma(m, H64, HI4 ? nz4[i] : nz[i]);  // q - z, exact
        return i < 3 ? f16x2_mul(f16x2_mul(d, cu[i]), sc[i]) : f16x2_mul(d, sc[3]);
    }

    // Field n (any, even a run-time value) of stripe i: one shift.
    __device__ __forceinline__ u32 pair(int i, int n) const {
        if (i < 3) return finish<false>(i, andor<0x00030003u>(w[i] >> (2 * n), MAG0));
        return finish<false>(3, andor<0x000F000Fu>((n < 4 ? w[3] : w[4]) >> (4 * (n & 3)), MAG0));
    }

    // Fields n and n + 2 of 2-bit stripe i (n = 0, 1, 4, 5), or n and n + 1 of the 4-bit one (n = 0, 2, 4, 6),
    // from one shift: the first at bits 0-1 (0-3) of each half, the second at bits 4-5 (4-7).
    __device__ __forceinline__ void two(int i, int n, u32& a, u32& b) const {
        if (i < 3) {
            const u32 v = w[i] >> (2 * n);
            a = finish<false>(i, andor<0x00030003u>(v, MAG0));
            b = finish<true>(i, andor<0x00300030u>(v, MAG4));
        } else {
            const u32 v = (n < 4 ? w[3] : w[4]) >> (4 * (n & 3));
            a = finish<false>(3, andor<0x000F000Fu>(v, MAG0));
            b = finish<true>(3, andor<0x00F000F0u>(v, MAG4));
        }
    }
};
