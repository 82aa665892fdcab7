// Page choice by the Quest bound, for the fused decode step to call between a layer's KV append and its attention.
#pragma once

#include <ATen/ATen.h>

namespace kvh {

// Both read one layer's MinMax cache in place (kmin/kmax [S, Hkv, W, D] views) through rows (slots) and heads (the
// KV head each listed set scores, one per set); q [B, H * G, D]. Defined in cpu_scoring.cpp, where their contracts
// are stated. ranked_pages: num_pages [B, H], k [B]; top_pages: num_tokens [S, Hkv] of the layer.
at::Tensor ranked_pages(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                        const at::Tensor& num_pages, const at::Tensor& rows, const at::Tensor& heads,
                        const at::Tensor& k);
at::Tensor top_pages(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& num_tokens,
                     int64_t page_size, int64_t k, bool keep_last, const at::Tensor& rows, const at::Tensor& heads);
// Pages each (rows[b], heads[j]) holds [B, H] int64, from a [S, H'] token-count table of any strides.
at::Tensor pages_from_tokens(const at::Tensor& num_tokens, int64_t page_size, const at::Tensor& rows,
                             const at::Tensor& heads);

}  // namespace kvh
