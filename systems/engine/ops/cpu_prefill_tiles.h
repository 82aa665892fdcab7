// The AMX tile prompt-attention kernel (cpu_prefill_tiles.cpp), called by the prompt_attention op (cpu_prefill.cpp).
#pragma once

#include <ATen/ATen.h>

#include "cpu_common.h"

#if defined(KVH_HAVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define KVH_HAVE_AMX 1
#endif

namespace kvh {

// Whether this process may use AMX tiles: built with them, and Linux granted the tile state.
bool tiles_permitted();

// Causal prompt attention as cpu_prefill.cpp's prompt_attention, for bf16 with head_dim 64 or 128, on tiles.
at::Tensor tile_prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale);

}  // namespace kvh
