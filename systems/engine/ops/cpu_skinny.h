// The skinny GEMM (cpu_gemm.h) on a weight packed by skinny_pack, in whichever layout the packing chose: the one
// place that reads the layout from the packed tensor's shape. Defined in cpu_gemm.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>

namespace kvh {

// y [M, N] = x [M, K] . w^T (+ bias [N], or an undefined tensor), w packed by skinny_pack: its panel layout
// [panels, K, panel] or bf16 pairs [panels, K / 2, 2 x panel]. y is in w's dtype (uint16_t: bf16), x in it or fp32;
// a weight of another dtype than y's is refused.
void skinny_rows(const uint16_t* x, int64_t M, const at::Tensor& packed, const at::Tensor& bias, int64_t N,
                 uint16_t* y);
void skinny_rows(const float* x, int64_t M, const at::Tensor& packed, const at::Tensor& bias, int64_t N, uint16_t* y);
void skinny_rows(const float* x, int64_t M, const at::Tensor& packed, const at::Tensor& bias, int64_t N, float* y);
// K of a weight packed by skinny_pack (checked as skinny_rows checks it).
int64_t skinny_k(const at::Tensor& packed);

}  // namespace kvh
