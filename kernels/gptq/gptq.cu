// GPTQ's column loop over one lazy batch (qtool/quant/gptq.py), one thread per weight row.
//
// The torch loop issues ~10 kernels per column (round, clamp, error, the rank-1 update of the batch's later
// columns); on a GPU those launches, not the arithmetic, set the solve's time (about 4 s per Llama-2-7B block on an
// H200, the same whatever the rows, so splitting rows over GPUs did not shorten it). Every row's work is independent
// of the other rows given the batch's inverse-Hessian block, so one thread walks its row through the columns.
//
// Bit-identical to the torch loop: every operation is one IEEE float32 operation rounded to nearest in the order
// torch performs it (div, rint (half to even, as torch.round), add, clamp, sub, mul, sub, div; the update is a
// rounded product then a rounded difference), written with the _rn intrinsics so the compiler cannot contract a
// multiply and an add into an fma.
//
// Layout: w1, q1, err1 are [n, bs] with row stride ld (the batch's clones); hinv1 [bs, bs] with row stride ldh (a
// view into the full inverse); scales/zeros [n, G] with row stride lds; group_of[bs] the group of each batch column.
// The kernel quantizes columns [c0, c1) and updates the row's columns [c1, bs) in w1, so the caller can compute the
// next dynamic group's range from them; columns [c0, c1) of q1 and err1 are written, nothing else of them.
//
// A block stages its ROWS rows' columns [c0, bs) in shared memory, transposed and padded (column-major, pitch
// ROWS + 1) so the walk's accesses are conflict-free; codes and errors are staged too and written back coalesced.

#define ROWS 32
#define PITCH (ROWS + 1)

extern "C" __global__ void __launch_bounds__(ROWS)
gptq_columns_f32(float* __restrict__ w1, float* __restrict__ q1, float* __restrict__ err1, int ld,
                 const float* __restrict__ hinv1, int ldh,
                 const float* __restrict__ scales, const float* __restrict__ zeros, int lds,
                 const int* __restrict__ group_of, int n, int bs, int c0, int c1, float maxq) {
    extern __shared__ float sm[];
    float* sw = sm;                          // [bs - c0][PITCH]: weights, then codes in the quantized columns
    float* se = sm + (size_t)(bs - c0) * PITCH;  // [c1 - c0][PITCH]: errors
    const int r0 = blockIdx.x * ROWS;
    const int rows = min(ROWS, n - r0);
    const int cols = bs - c0;
    const int t = threadIdx.x;
    for (int rr = 0; rr < rows; ++rr) {
        const float* src = w1 + (size_t)(r0 + rr) * ld + c0;
        for (int c = t; c < cols; c += ROWS) sw[c * PITCH + rr] = src[c];
    }
    __syncthreads();
    if (t < rows) {
        const int r = r0 + t;
        const float* srow = scales + (size_t)r * lds;
        const float* zrow = zeros + (size_t)r * lds;
        for (int i = c0; i < c1; ++i) {
            const int li = i - c0;
            const float w = sw[li * PITCH + t];
            const int g = group_of[i];
            const float s = srow[g], z = zrow[g];
            float q = __fadd_rn(rintf(__fdiv_rn(w, s)), z);
            q = q < 0.f ? 0.f : (q > maxq ? maxq : q);  // torch.clamp: NaN stays NaN
            const float deq = __fmul_rn(s, __fsub_rn(q, z));
            const float* hrow = hinv1 + (size_t)i * ldh;
            const float e = __fdiv_rn(__fsub_rn(w, deq), hrow[i]);
            sw[li * PITCH + t] = q;
            se[li * PITCH + t] = e;
            // The later columns' updates are independent of each other: unrolled so their loads overlap.
#pragma unroll 4
            for (int j = i + 1; j < bs; ++j) {
                float* p = &sw[(j - c0) * PITCH + t];
                *p = __fsub_rn(*p, __fmul_rn(e, __ldg(hrow + j)));
            }
        }
    }
    __syncthreads();
    const int qc = c1 - c0;
    for (int rr = 0; rr < rows; ++rr) {
        const size_t base = (size_t)(r0 + rr) * ld + c0;
        for (int c = t; c < cols; c += ROWS) {
            if (c < qc) {
                q1[base + c] = sw[c * PITCH + rr];
                err1[base + c] = se[c * PITCH + rr];
            } else {
                w1[base + c] = sw[c * PITCH + rr];
            }
        }
    }
}
