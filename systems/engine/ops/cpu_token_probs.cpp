// The token_probs op: each row's decode query's attention over every token its KV heads hold, for eviction scores.
//
// Why a kernel: a decode-time eviction (TOVA, H2O, CAKE) scores every stored token by the new query's attention,
// once per (sequence, layer) row and step. In torch each row is a separate gather, widening, matmul and softmax
// (about 14 ops, batched rows would round differently as the batch changes), so at batch 32 over 30 layers the
// scoring took longer than the model. Here every (row, KV head) is one task: its keys are read in place through
// its block table, its group's logits and softmax computed in a fixed order, so a row's probabilities depend on
// neither the other rows, nor the thread count, nor which thread ran it. With AVX512-BF16, bf16 queries and keys,
// head_dim 64 or 128 and groups of at most 16, the logits are the decode attention kernel's own (its
// chunk_dots_bf16: vdpbf16ps over 16 tokens, their lanes reduced together): reducing each token's dot product across its lanes on its own,
// with a scalar exp per logit, cost as much as the attention that had read those keys.
//
// The pooled_victims op is the rest of such an eviction where the scores are pooled along an order of the tokens
// (CAKE's decode rule): in torch two argsorts, a gather and the pooling over every (row, KV head) cost more per step
// than all of a short context's attention; here each (row, KV head) is one task, sorting and pooling in place.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <tuple>
#include <vector>

#include "cpu_attention.h"
#include "cpu_common.h"

namespace {

using kvh::to_float;

// Each of the G rows [0, n) of out (stride width) -> its softmax; 0 from n to width.
void softmax_rows(float* out, int G, int64_t n, int64_t width) {
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
  softmax_rows(out, G, n, width);
}

#ifdef KVH_HAVE_AVX512_BF16
// The first min(left, 16) lanes.
inline __mmask16 tail_mask(int64_t left) {
  return left >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << left) - 1u);
}

// softmax_rows 16 lanes at a time: it need not round as the attention's online softmax does, only the same way for
// a row wherever it runs.
void softmax_rows16(float* out, int G, int64_t n, int64_t width) {
  for (int g = 0; g < G; ++g) {
    float* o = out + g * width;
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < n; t += 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(mx, tail_mask(n - t), o + t));
    const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 m = tail_mask(n - t);
      const __m512 e = _mm512_maskz_mov_ps(m, kvh::exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, o + t), top)));
      _mm512_mask_storeu_ps(o + t, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
    for (int64_t t = 0; t < n; t += 16) {
      const __mmask16 m = tail_mask(n - t);
      _mm512_mask_storeu_ps(o + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, o + t), inv));
    }
    std::fill(o + n, o + width, 0.0f);
  }
}

// head_probs for bf16 q [G, D] and keys (G <= kMaxGroup): 16 tokens of a page at a time, the logits the decode
// attention computes (kvh::chunk_dots_bf16, reduced by sum16, then scaled).
template <int D>
void head_probs_bf16(const uint16_t* q, int G, const uint16_t* k_pool, const int32_t* table, int64_t n, int P,
                     float scale, float* out, int64_t width) {
  constexpr int NB = D / 32;
  __m512bh qv[kvh::kMaxGroup][NB];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < NB; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
  const __m512 scale_v = _mm512_set1_ps(scale);
  __m512 dots[kvh::kMaxGroup][16];
  for (int64_t page = 0; page * P < n; ++page) {
    const int valid = static_cast<int>(std::min<int64_t>(P, n - page * P));
    const uint16_t* base = k_pool + static_cast<int64_t>(table[page]) * P * D;
    for (int c0 = 0; c0 < valid; c0 += 16) {
      const int nc = std::min(16, valid - c0);
      kvh::chunk_dots_bf16<D>(qv, G, base + static_cast<int64_t>(c0) * D, nc, dots);
      for (int g = 0; g < G; ++g)
        _mm512_mask_storeu_ps(out + g * width + page * P + c0, tail_mask(nc),
                              _mm512_mul_ps(kvh::sum16(dots[g]), scale_v));
    }
  }
  softmax_rows16(out, G, n, width);
}
#endif

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
  const at::Tensor tb = tables.contiguous(), cn = counts.contiguous();
  const int32_t* tp = tb.data_ptr<int32_t>();
  const int32_t* cp = cn.data_ptr<int32_t>();
  for (int64_t i = 0; i < R * Hkv; ++i)
    TORCH_CHECK(cp[i] >= 0 && cp[i] <= std::min<int64_t>(width, M * P), "token_probs: a count past the width");
  at::Tensor out = at::empty({R, Hq, width}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int G = static_cast<int>(Hq / Hkv);
  const float sc = static_cast<float>(scale);
#ifdef KVH_HAVE_AVX512_BF16
  // the shapes the decode attention runs on its vdpbf16ps kernel (cpu_attention.h, attend_rows); dots holds
  // at most kMaxGroup query heads
  if (k_pool.scalar_type() == at::kBFloat16 && q.scalar_type() == at::kBFloat16 && (D == 64 || D == 128) &&
      G <= kvh::kMaxGroup) {
    const at::Tensor qb = q.contiguous();
    const uint16_t* qh = reinterpret_cast<const uint16_t*>(qb.data_ptr());
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_pool.data_ptr());
    kvh::parallel_tasks(R * Hkv, [&](auto next) {
      for (int64_t i; (i = next()) < R * Hkv;) {
        if (D == 64) head_probs_bf16<64>(qh + i * G * D, G, kp, tp + i * M, cp[i], P, sc, op + i * G * width, width);
        else head_probs_bf16<128>(qh + i * G * D, G, kp, tp + i * M, cp[i], P, sc, op + i * G * width, width);
      }
    });
    return out;
  }
#endif
  const at::Tensor qf = q.to(at::kFloat).contiguous();
  const float* qp = qf.data_ptr<float>();
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

// A float's order as an unsigned key (-0 folded into +0, so equal floats stay equal keys).
inline uint64_t order_bits(float x) {
  uint32_t b;
  x += 0.0f;
  std::memcpy(&b, &x, sizeof b);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// idx[0 .. n) sorted by value ascending (descending when `desc`), ties to the lower index: a stable sort's order.
// An LSD radix sort of the 32-bit order keys, a byte per pass (skipped where every key shares it): stable, so equal
// values keep index order, and free of the data-dependent branches that made std::sort the kernel's main cost.
void sort_by(const float* value, int64_t n, bool desc, std::vector<uint64_t>& words, std::vector<uint64_t>& spare,
             int64_t* idx) {
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t k = order_bits(value[i]);
    words[i] = ((desc ? 0xFFFFFFFFull - k : k) << 32) | static_cast<uint64_t>(i);
  }
  uint64_t* from = words.data();
  uint64_t* to = spare.data();
  for (int shift = 32; shift < 64; shift += 8) {
    int64_t start[257] = {0};
    for (int64_t i = 0; i < n; ++i) ++start[((from[i] >> shift) & 255) + 1];
    if (std::find(start + 1, start + 257, n) != start + 257) continue;      // one byte value: nothing moves
    for (int d = 0; d < 256; ++d) start[d + 1] += start[d];
    for (int64_t i = 0; i < n; ++i) to[start[(from[i] >> shift) & 255]++] = from[i];
    std::swap(from, to);
  }
  for (int64_t i = 0; i < n; ++i) idx[i] = static_cast<int64_t>(from[i] & 0xFFFFFFFFull);
}

// One (row, KV head) of pooled_victims: probs [G rows of stride N], keys [N], count tokens of which the first
// `inside` ranks may be evicted. Returns the victim's storage index; fills next_keys [N] when given. pooling: 0
// none, 1 average (zeros counted, divided by the kernel), 2 max; window of output m: ranks [m - kernel / 2, + kernel).
int64_t head_victim(const float* probs, int G, int64_t N, const float* key, int64_t count, int64_t inside,
                    int64_t kernel, int pooling, float* next_keys, std::vector<int64_t>& order,
                    std::vector<float>& ranked, std::vector<float>& pool, std::vector<float>& score,
                    std::vector<int64_t>& by_score, std::vector<uint64_t>& words,
                    std::vector<uint64_t>& spare) {
  sort_by(key, count, false, words, spare, order.data());
  std::iota(order.begin() + count, order.end(), count);  // padding (storage index >= count) keeps its place, last
  const int64_t pad = kernel / 2;
  const bool pooled = pooling != 0 && kernel > 1;
  // pooling windows read `ranked` through pad entries on each side: 0 for the average (adding +0 to
  // a sum of non-negative terms changes no bit, so each sum equals the clipped window's), -inf for the maximum;
  // each output's sum runs over its window in order, vectorised across outputs
  const float fill = pooling == 2 ? -INFINITY : 0.0f;
  std::fill(ranked.begin(), ranked.end(), fill);
  float* x = ranked.data() + pad;
  for (int g = 0; g < G; ++g) {
    const float* row = probs + g * N;
    for (int64_t m = 0; m < N; ++m) x[m] = m < inside ? row[order[m]] : 0.0f;
    const float* v = x;
    if (pooled) {
      float* acc = pool.data();
      if (pooling == 1) {
        std::fill(acc, acc + N, 0.0f);
        for (int64_t d = 0; d < kernel; ++d) {
          const float* in = x - pad + d;
          for (int64_t m = 0; m < N; ++m) acc[m] += in[m];
        }
        const float k = static_cast<float>(kernel);
        for (int64_t m = 0; m < N; ++m) acc[m] /= k;
      } else {
        std::fill(acc, acc + N, -INFINITY);
        for (int64_t d = 0; d < kernel; ++d) {
          const float* in = x - pad + d;
          for (int64_t m = 0; m < N; ++m) acc[m] = in[m] > acc[m] ? in[m] : acc[m];
        }
      }
      v = acc;
    }
    for (int64_t m = 0; m < N; ++m) score[m] = g == 0 ? v[m] : score[m] + v[m];   // the group's sum, head order
  }
  int64_t victim = 0;
  for (int64_t m = 0; m < inside; ++m) {
    score[m] /= static_cast<float>(G);
    if (score[m] < score[victim]) victim = m;             // the first lowest
  }
  if (next_keys != nullptr) {
    sort_by(score.data(), inside, true, words, spare, by_score.data());
    for (int64_t j = 0; j < inside; ++j) next_keys[order[by_score[j]]] = static_cast<float>(j);
    for (int64_t m = inside; m < N; ++m) next_keys[order[m]] = static_cast<float>(m);
  }
  return order[victim];
}

// Same contract as torch_attention.pooled_victims: probs [R, Hq, N] fp32, counts [R, Hkv], key [R, Hkv, N] fp32.
std::tuple<at::Tensor, at::Tensor> pooled_victims(const at::Tensor& probs, const at::Tensor& counts,
                                                  const at::Tensor& key, int64_t window, int64_t kernel,
                                                  int64_t pooling, bool new_keys) {
  TORCH_CHECK(probs.dim() == 3 && probs.scalar_type() == at::kFloat, "pooled_victims: probs [R, Hq, N] fp32");
  const int64_t R = probs.size(0), Hq = probs.size(1), N = probs.size(2), Hkv = counts.size(1);
  TORCH_CHECK(counts.dim() == 2 && counts.size(0) == R && Hkv > 0 && Hq % Hkv == 0,
              "pooled_victims: counts [R, Hkv] of probs' rows and heads");
  TORCH_CHECK(key.dim() == 3 && key.size(0) == R && key.size(1) == Hkv && key.size(2) == N &&
              key.scalar_type() == at::kFloat, "pooled_victims: key [R, Hkv, N] fp32");
  TORCH_CHECK(pooling >= 0 && pooling <= 2 && kernel >= 1 && window >= 0,
              "pooled_victims: pooling 0 (none), 1 (avg), 2 (max), kernel >= 1, window >= 0");
  // the group's sum is added head by head, which is torch's order for its mean over up to 4 heads only
  TORCH_CHECK(Hq / Hkv <= 4, "pooled_victims: query groups of at most 4 heads (larger ones take the torch path)");
  const at::Tensor p = probs.contiguous(), c = counts.to(at::kLong).contiguous(), k = key.contiguous();
  const int64_t* cp = c.data_ptr<int64_t>();
  for (int64_t i = 0; i < R * Hkv; ++i)
    TORCH_CHECK(cp[i] <= N && cp[i] - window >= 1, "pooled_victims: every head needs a token outside its window");
  at::Tensor index = at::empty({R, Hkv}, c.options());
  at::Tensor keys = new_keys ? at::empty({R, Hkv, N}, k.options()) : at::Tensor();
  const float* pp = p.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  int64_t* ip = index.data_ptr<int64_t>();
  float* out = new_keys ? keys.data_ptr<float>() : nullptr;
  const int G = static_cast<int>(Hq / Hkv);
  kvh::parallel_tasks(R * Hkv, [&](auto next) {
    std::vector<int64_t> order(N), by_score(N);
    std::vector<float> ranked(N + 2 * kernel), pool(N), score(N);
    std::vector<uint64_t> words(N), spare(N);
    for (int64_t i; (i = next()) < R * Hkv;) {
      const int64_t r = i / Hkv, h = i % Hkv;
      ip[i] = head_victim(pp + (r * Hq + h * G) * N, G, N, kp + i * N, cp[i], cp[i] - window, kernel,
                          static_cast<int>(pooling), out ? out + i * N : nullptr, order, ranked, pool, score, by_score,
                          words, spare);
    }
  });
  return {index, keys};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("token_probs(Tensor q, Tensor k_pool, Tensor tables, Tensor counts, float scale, int width) -> Tensor",
        &token_probs);
  m.def("pooled_victims(Tensor probs, Tensor counts, Tensor key, int window, int kernel, int pooling, bool new_keys) "
        "-> (Tensor, Tensor)", &pooled_victims);
}
