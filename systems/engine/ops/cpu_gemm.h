// Skinny matrix products for decode steps: y[M, N] = x[M, K] . W[N, K]^T (+ b) for a few rows M, weights streamed once.
//
// Why not the GEMM library: a decode step multiplies 1-32 rows by every weight matrix, so its cost is reading the
// weights. oneDNN re-lays out a plain bf16 weight on every call, and where the CPU has no bf16 kernels (AVX2 only)
// torch's fallback streamed them at 4 GB/s at 4 rows against the machine's 30. Here each output is one dot product
// of a weight row with an activation row, accumulated in fp32 lanes in k order and summed in a fixed tree, so its
// bits depend only on those two rows: never on how many rows share the call, the tile it falls in or the thread that
// runs it (batch invariance by construction, no padding to a fixed shape). Weight rows are handed out in chunks to
// whichever thread is free; every weight byte is read once per call whatever M is (tiles of x rows reuse a weight
// tile from L1). Written with GCC vector types, so the same source compiles to 16 lanes on AVX-512 and 8 on AVX2.
#pragma once

#include <cstdint>

namespace kvh {

// y [M, N] = x [M, K] (fp32, contiguous) . w [N, K]^T (+ bias [N]), rounded once to y's dtype. K must be a multiple
// of gemm_lanes(). Defined in cpu_gemm.cpp, compiled with fused multiply-adds (the elementwise kernels are not).
void gemm_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, int64_t N, uint16_t* y);
void gemm_rows(const float* x, int64_t M, int64_t K, const float* w, const float* bias, int64_t N, float* y);
int gemm_lanes();

}  // namespace kvh
