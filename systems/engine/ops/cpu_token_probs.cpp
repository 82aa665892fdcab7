// The token_probs op: each row's decode query's attention over every token its KV heads hold, for eviction scores.
//
// Why a kernel: a decode-time eviction (TOVA, H2O, CAKE) scores every stored token by the new query's attention,
// once per (sequence, layer) row and step. In torch each row is a separate gather, widening, matmul and softmax
// (about 14 ops, batched rows would round differently as the batch changes), so at batch 32 over 30 layers the
// scoring took longer than the model. Here every (row, KV head) is one task: its keys are read in place through
// its block table, its group's logits and softmax computed in a fixed order, so a row's probabilities depend on
// neither the other rows, nor the thread count, nor which thread ran it.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"

namespace {

using kvh::to_float;

// One (row, KV head): q [G, D] fp32, its first n tokens through `table` (pool blocks of P tokens) -> out rows
// [G, width] (row g at out + g * width): logit = (q . k) * scale, softmax over the n tokens, 0 past n.
template <typename T>
void head_probs(const float* q, int G, const T* k_pool, const int32_t* table, int64_t n, int P, int64_t D,
                float scale, float* out, int64_t width, float* k_row) {
  for (int64_t t = 0; t < n; ++t) {
    const T* k = k_pool + (static_cast<int64_t>(table[t / P]) * P + t % P) * D;
    for (int64_t d = 0; d < D; ++d) k_row[d] = to_float(k[d]);
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * D;
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qg[d] * k_row[d];
      out[g * width + t] = acc * scale;
    }
  }
  for (int g = 0; g < G; ++g) {
    float* o = out + g * width;
    float mx = -INFINITY;
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, o[t]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < n; ++t) {
      o[t] = kvh::exp_clamped(o[t] - mx);
      sum += o[t];
    }
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < n; ++t) o[t] *= inv;
    std::fill(o + n, o + width, 0.0f);
  }
}

// q [R, Hq, D] (bf16 or fp32), k_pool [blocks, P, D] (bf16 or fp32), tables [R, Hkv, M] int32 (every listed page
// resident), counts [R, Hkv] int32 -> fp32 [R, Hq, width], width >= every count.
at::Tensor token_probs(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& tables,
                       const at::Tensor& counts, double scale, int64_t width) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && tables.dim() == 3 && counts.dim() == 2,
              "token_probs: q [R, Hq, D], k_pool [blocks, P, D], tables [R, Hkv, M], counts [R, Hkv]");
  TORCH_CHECK(k_pool.is_contiguous() && tables.scalar_type() == at::kInt && counts.scalar_type() == at::kInt,
              "token_probs: contiguous pool, int32 tables and counts");
  const int64_t R = q.size(0), Hq = q.size(1), D = q.size(2), Hkv = tables.size(1), M = tables.size(2);
  const int P = static_cast<int>(k_pool.size(1));
  TORCH_CHECK(Hq % Hkv == 0 && k_pool.size(2) == D && counts.size(0) == R && counts.size(1) == Hkv &&
              tables.size(0) == R, "token_probs: shapes disagree");
  const at::Tensor qf = q.to(at::kFloat).contiguous(), tb = tables.contiguous(), cn = counts.contiguous();
  const int32_t* tp = tb.data_ptr<int32_t>();
  const int32_t* cp = cn.data_ptr<int32_t>();
  for (int64_t i = 0; i < R * Hkv; ++i)
    TORCH_CHECK(cp[i] >= 0 && cp[i] <= std::min<int64_t>(width, M * P), "token_probs: a count past the width");
  at::Tensor out = at::empty({R, Hq, width}, q.options().dtype(at::kFloat));
  const float* qp = qf.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int G = static_cast<int>(Hq / Hkv);
  const float sc = static_cast<float>(scale);
  auto run = [&](auto zero) {
    using T = decltype(zero);
    const T* kp = reinterpret_cast<const T*>(k_pool.data_ptr());
    kvh::parallel_tasks(R * Hkv, [&](auto next) {
      std::vector<float> k_row(static_cast<size_t>(D));
      for (int64_t i; (i = next()) < R * Hkv;)
        head_probs<T>(qp + i * G * D, G, kp, tp + i * M, cp[i], P, D, sc, op + i * G * width, width, k_row.data());
    });
  };
  if (k_pool.scalar_type() == at::kBFloat16) {
    run(uint16_t{});
  } else {
    TORCH_CHECK(k_pool.scalar_type() == at::kFloat, "token_probs: pools must be bf16 or fp32");
    run(float{});
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("token_probs(Tensor q, Tensor k_pool, Tensor tables, Tensor counts, float scale, int width) -> Tensor",
        &token_probs);
}
