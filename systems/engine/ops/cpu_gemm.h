// Skinny matrix products for decode steps: y[M, N] = x[M, K] . W[N, K]^T (+ b) for a few rows M, weights streamed once.
//
// Why not the GEMM library: a decode step multiplies 1-32 rows by every weight matrix, so its cost is reading the
// weights. oneDNN re-lays out a plain bf16 weight on every call, and where the CPU has no bf16 kernels (AVX2 only)
// torch's fallback streamed them at 4 GB/s at 4 rows against the machine's 30. Here the weights are packed once
// into panels (the weights of 32 outputs, or 64 on AVX-512, side by side for each k), and each output is one fp32
// fused multiply-add chain over k in order, so its bits depend only on its activation row and its weights: never on
// how many rows share the call, the tile it falls in or the thread that runs it (batch invariance by construction,
// no padding to a fixed shape). Panels go one at a time to whichever thread is free (both cores stream weights at
// batch 1); a panel is read from memory once per call and each loaded weight vector is applied to up to 6 rows in
// registers, further tiles of rows finding it in L2. GCC vector types: 16 lanes on AVX-512, 8 on AVX2. On CPUs
// with AVX512-BF16, bf16 weights take vdpbf16ps over pairs of k, which computes the same chains (gemm_pack_pairs).
#pragma once

#include <cstdint>

namespace kvh {

// y [M, N] = x [M, K] (fp32, contiguous) . w^T (+ bias [N]), rounded once to y's dtype, w in the panel layout of
// gemm_pack. Defined in cpu_gemm.cpp, compiled with fused multiply-adds (the elementwise kernels are not).
void gemm_rows(const float* x, int64_t M, int64_t K, const uint16_t* packed, const uint16_t* bias, int64_t N,
               uint16_t* y);
void gemm_rows(const float* x, int64_t M, int64_t K, const float* packed, const float* bias, int64_t N, float* y);
// w [N, K] row-major -> packed [ceil(N / gemm_panel()), K, gemm_panel()], zero-padded; in bf16 each pair of
// weight vectors of a panel row is stored interleaved, so one load and a shift and a mask widen both.
void gemm_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed);
void gemm_pack(const float* w, int64_t N, int64_t K, float* packed);
int64_t gemm_panel();

// bf16 weights on CPUs with AVX512-BF16: the same chains by vdpbf16ps over pairs of k (see cpu_gemm.cpp), for an
// even K and weights that are each 0 or at least 2^-56 in magnitude (gemm_pairs_fit). w [N, K] -> packed
// [ceil(N / gemm_panel()), K / 2, 2 * gemm_panel()]: the last dimension tells a pair-packed weight.
bool gemm_pairs_fit(const uint16_t* w, int64_t N, int64_t K);
void gemm_pack_pairs(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed);
// y [M, N] = x [M, K] (bf16, or fp32 holding bf16 values) . w^T (+ bias), w packed by gemm_pack_pairs.
void gemm_rows_pairs(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, const uint16_t* bias, int64_t N,
                     uint16_t* y);
void gemm_rows_pairs(const float* x, int64_t M, int64_t K, const uint16_t* packed, const uint16_t* bias, int64_t N,
                     uint16_t* y);

}  // namespace kvh
