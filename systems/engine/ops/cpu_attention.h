// Paged decode attention over all or only the selected pages of each (sequence, KV head): the row kernels shared by
// the decode_attention op (cpu_attention.cpp) and the fused decoder step (cpu_decoder.cpp).
//
// Why a kernel: on a CPU the torch path either gathers the pages (an extra copy of every K/V byte) or runs one small
// matmul per (sequence, page run) with ~100 us of framework overhead each. Here every (sequence, KV head) reads its
// pages in place through the block table, converts bf16 to fp32 in registers, and keeps an online softmax (running
// max, sum, fp32 accumulator) per query head, so K and V are each read exactly once. A row's pages go in fixed
// splits to the threads, combined in order (run_splits): a batch-1 step's few rows keep every core reading, and the
// bits depend on neither the batch nor the thread count. Without AVX512-BF16 the split kernel is cpu_attend_split.h.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_attend_split.h"
#include "cpu_common.h"

// Internal linkage (an unnamed namespace): each file that includes this compiles its own copy with its own
// floating-point options, so no copy is ever traded for another's at link time.
namespace kvh {
namespace {

// e^x for x <= 0 (scores minus their running max)
inline float exp_nonpos(float x) { return exp_clamped(x); }

// The tokens of logical page `page` a query reads: from the first one in its window (tokens before `first` are
// skipped) to the last one held. *token: index of the first read token in the pool; *valid: how many (<= 0: none).
inline void page_span(int64_t block, int64_t page, int64_t n, int64_t first, int P, int64_t* token, int* valid) {
  const int64_t lo = std::max<int64_t>(0, first - page * P);
  *token = block * P + lo;
  *valid = static_cast<int>(std::min<int64_t>(P, n - page * P) - lo);
}

// Every page of a head, in table order: page j holds min(P, n - j*P) tokens.
struct AllPages {
  const int32_t* table;
  int64_t n, first;
  int P;
  int64_t count() const { return (n + P - 1) / P; }
  void at(int64_t j, int64_t* token, int* valid) const { page_span(table[j], j, n, first, P, token, valid); }
};

// Only the selected logical pages (any order, entries < 0 are padding): softmax does not care about order, so
// the list is used as it comes; the head's partial last page holds n - last*P tokens.
struct SelectedPages {
  const int64_t* selected;
  int64_t K;
  const int32_t* table;
  int64_t n, first;
  int P;
  int64_t count() const { return K; }
  void at(int64_t j, int64_t* token, int* valid) const {
    const int64_t page = selected[j];
    if (page < 0) {
      *valid = 0;
      return;
    }
    page_span(table[page], page, n, first, P, token, valid);
  }
};

#ifdef KVH_HAVE_AVX512_BF16

// q.k of 16 stored keys kp [16, D] (the first nc live) for each of G query heads qv [G][D / 32]: dots[g][t] holds
// the 16 lane partials of token t (0 past nc), which sum16 reduces together. The decode attention and token_probs
// both take their logits from here, so an eviction scores tokens by the logits the attention used.
template <int D, int GN = 0>
inline void chunk_dots_bf16(const __m512bh (*qv)[D / 32], int G_, const uint16_t* kp, int nc, __m512 (*dots)[16]) {
  constexpr int NB = D / 32;
  const int G = GN > 0 ? GN : G_;
  for (int t = 0; t < 16; ++t) {
    if (t < nc) {
      __m512bh kv[NB];
      for (int c = 0; c < NB; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + t * D + c * 32);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
        for (int c = 1; c < NB; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], kv[c]);
        dots[g][t] = a;
      }
    } else {
      for (int g = 0; g < G; ++g) dots[g][t] = _mm512_setzero_ps();
    }
  }
}

// Rows [t0, t1) of a page's K and V (k, v: its first row) into L2, one cache line (32 bf16) at a time.
template <int D>
inline void prefetch_rows(const uint16_t* k, const uint16_t* v, int t0, int t1) {
  for (int t = t0; t < t1; ++t)
    for (int off = 0; off < D; off += 32) {
      _mm_prefetch(reinterpret_cast<const char*>(k + static_cast<int64_t>(t) * D + off), _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(v + static_cast<int64_t>(t) * D + off), _MM_HINT_T1);
    }
}

// bf16 pools on CPUs with AVX512-BF16, 16 tokens at a time: q.k by vdpbf16ps straight from the stored page (the
// 16 dot products reduced together by sum16), softmax update on one register, p.v by fp32 FMAs. One split of a
// row: its pages [j0, j1) -> part = {running max [G], sum [G], accumulator [G, D] not yet divided by the sum}.
// GN > 0: the group size fixed at compile time (the common ones, see run_bf16), so the loops over query heads
// unroll and the p.v accumulators can stay in registers through the token loop (G x D/16 of them beside D/16
// values: all of them up to G = 6 at D = 64 and G = 3 at D = 128; beyond, some spill). With a runtime G they went
// through memory at every token, and with the next page prefetched all at once the kernel read KV at 11-14 GB/s on
// 2 cores of a 28-33 GB/s machine; both mended, 20-21 GB/s (SmolLM2: G = 3, D = 64; 1k and 4k tokens, batch 1
// and 4). Same operations in the same order either way: the same bits.
template <int D, int GN, typename Pages>
void attend_split_bf16(const uint16_t* q, int G_, float scale, const uint16_t* k_pool, const uint16_t* v_pool,
                       const Pages& list, int64_t j0, int64_t j1, float* part) {
  constexpr int NB = D / 32;  // 32 bf16 per register
  constexpr int NV = D / 16;  // 16 fp32 per register
  constexpr int GM = GN > 0 ? GN : kMaxGroup;
  const int G = GN > 0 ? GN : G_;
  __m512bh qv[GM][NB];
  __m512 acc[GM][NV];
  float m[GM], l[GM];
  alignas(64) float p16[GM][16];
  const __m512 scale_v = _mm512_set1_ps(scale);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NB; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  int64_t token = 0, next_token = 0;
  int valid = 0, next_valid = 0;
  if (j0 < j1) list.at(j0, &next_token, &next_valid);
  for (int64_t j = j0; j < j1; ++j) {
    token = next_token;
    valid = next_valid;
    // the next page is a scattered block, beyond the hardware prefetcher: each token read here prefetches the
    // same token's K and V rows of the next page (its rows past this page's last after them), so the prefetches
    // stay spread over the page's work; issued all at once they filled the miss buffers and stalled this page's
    // loads
    const uint16_t* next_k = nullptr;
    const uint16_t* next_v = nullptr;
    if (j + 1 < j1) {
      list.at(j + 1, &next_token, &next_valid);
      if (next_valid > 0) {
        next_k = k_pool + next_token * D;
        next_v = v_pool + next_token * D;
      }
    }
    if (valid <= 0) {  // nothing to read here (padding, or a page before a window): the next page all at once
      prefetch_rows<D>(next_k, next_v, 0, next_k ? next_valid : 0);
      continue;
    }
    const int64_t base = token * D;
    for (int c0 = 0; c0 < valid; c0 += 16) {
      const int nc = std::min(16, valid - c0);
      const uint16_t* kp = k_pool + base + static_cast<int64_t>(c0) * D;
      const uint16_t* vp = v_pool + base + static_cast<int64_t>(c0) * D;
      const __mmask16 live = static_cast<__mmask16>((1u << nc) - 1u);
      __m512 dots[GM][16];
      chunk_dots_bf16<D, GN>(qv, G, kp, nc, dots);
      for (int g = 0; g < G; ++g) {
        const __m512 sc = _mm512_mask_blend_ps(live, neg_inf, _mm512_mul_ps(sum16(dots[g]), scale_v));
        const float chunk_max = _mm512_reduce_max_ps(sc);
        const float new_max = chunk_max > m[g] ? chunk_max : m[g];
        const float corr = exp_nonpos(m[g] - new_max);  // m = -inf on the first chunk: clamps to ~0
        const __m512 pv = _mm512_maskz_mov_ps(live, exp16(_mm512_sub_ps(sc, _mm512_set1_ps(new_max))));
        l[g] = l[g] * corr + _mm512_reduce_add_ps(pv);
        m[g] = new_max;
        _mm512_store_ps(p16[g], pv);
        const __m512 cv = _mm512_set1_ps(corr);
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], cv);
      }
      __m512 r[GM][NV];  // the accumulators as locals across the token loop: GCC then keeps them in registers
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c) r[g][c] = acc[g][c];
      for (int t = 0; t < nc; ++t) {
        if (next_k != nullptr && c0 + t < next_valid) prefetch_rows<D>(next_k, next_v, c0 + t, c0 + t + 1);
        __m512 vv[NV];
        for (int c = 0; c < NV; ++c)
          vv[c] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp + t * D + c * 16)));
        for (int g = 0; g < G; ++g) {
          const __m512 pb = _mm512_set1_ps(p16[g][t]);
          for (int c = 0; c < NV; ++c) r[g][c] = _mm512_fmadd_ps(pb, vv[c], r[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < NV; ++c) acc[g][c] = r[g][c];
    }
    if (next_k != nullptr) prefetch_rows<D>(next_k, next_v, valid, next_valid);  // rows past this page's last
  }
  for (int g = 0; g < G; ++g) {
    part[g] = m[g];
    part[G + g] = l[g];
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(part + 2 * G + g * D + c * 16, acc[g][c]);
  }
}

// A row's output [G, D] from its splits' parts, combined in split order. A row of one split is its softmax as the
// kernel keeps it (the split's weight exp(0) is exactly 1), so short rows have the bits of an unsplit kernel.
template <int D>
void combine_splits_bf16(const float* parts, int64_t splits, int G, float* out) {
  constexpr int NV = D / 16;
  const int64_t stride = 2 * G + G * D;
  for (int g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, parts[s * stride + g]);
    float lsum = 0.0f;
    __m512 acc[NV];
    for (int c = 0; c < NV; ++c) acc[c] = _mm512_setzero_ps();
    for (int64_t s = 0; s < splits; ++s) {
      const float* ps = parts + s * stride;
      if (ps[g] == -INFINITY) continue;  // nothing read in this split
      const float w = exp_nonpos(ps[g] - mx);
      lsum = lsum + ps[G + g] * w;
      const __m512 wv = _mm512_set1_ps(w);
      for (int c = 0; c < NV; ++c)
        acc[c] = _mm512_fmadd_ps(_mm512_loadu_ps(ps + 2 * G + g * D + c * 16), wv, acc[c]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / lsum);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + g * D + c * 16, _mm512_mul_ps(acc[c], inv));
  }
}
#endif

// The listed pages of row i of a batched call. Rows are (sequence, head) pairs: row i = b * heads + h. By default
// row i reads table row i and counts[i]; with `slots`, the tables are the engine's whole [S, L, Hkv, M] block table
// and [S, L, Hkv] counts, and row i reads entry slots[b] * seq_stride + layer_offset + h / kv_div (kv_div > 1: one
// row per query head, each reading its KV head's table).
struct Listing {
  const int32_t* table;      // [rows, M], or the engine's table (see slots)
  const int32_t* counts;     // [rows], or the engine's counts
  const int64_t* selected;   // [rows, K] or null: all pages
  int64_t M, K;
  int P;
  int64_t window = 0;         // sliding window (keys a query sees, itself included); 0: unbounded
  const int64_t* slots = nullptr;
  int64_t heads = 1, seq_stride = 0, layer_offset = 0, kv_div = 1;
  int64_t first(int64_t n) const { return window > 0 ? std::max<int64_t>(0, n - window) : 0; }
  int64_t entry(int64_t i) const {
    return slots ? slots[i / heads] * seq_stride + layer_offset + (i % heads) / kv_div : i;
  }
  AllPages all(int64_t i) const {
    const int64_t e = entry(i);
    return AllPages{table + e * M, counts[e], first(counts[e]), P};
  }
  SelectedPages chosen(int64_t i) const {
    const int64_t e = entry(i);
    return SelectedPages{selected + i * K, K, table + e * M, counts[e], first(counts[e]), P};
  }
};

// Rows q [rows, G, D] (fp32, pre-scaled) over their listed pages -> out [rows, G, D]: every row cut into splits of
// kSplitTokens / P pages (at least one; fixed by its page count), the splits shared by the threads, then each row's
// splits combined in order (cpu_attend_split.h).
// Every row cut into splits of split_tokens / P pages (at least one; fixed by its page count), the splits shared
// by the threads: attend(i, j0, j1, part) runs pages [j0, j1) of row i into its part (`stride` floats), and whoever
// ends a row's last split runs combine(i, parts, splits) over them all, in split order (one parallel region).
template <typename Attend, typename Combine>
void run_splits(const Listing& ls, int64_t rows, int64_t stride, int split_tokens, const Attend& attend,
                const Combine& combine) {
  const int64_t per_split = std::max<int64_t>(1, split_tokens / ls.P);
  std::vector<int64_t> first(static_cast<size_t>(rows + 1), 0);  // row i's splits: [first[i], first[i + 1])
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t pages = ls.selected ? ls.K : ls.all(i).count();
    first[i + 1] = first[i] + std::max<int64_t>(1, (pages + per_split - 1) / per_split);
  }
  std::vector<float> parts(static_cast<size_t>(first[rows] * stride));
  std::vector<std::atomic<int64_t>> left(static_cast<size_t>(rows));  // splits of each row still running
  for (int64_t i = 0; i < rows; ++i) left[i].store(first[i + 1] - first[i], std::memory_order_relaxed);
  const int64_t tasks = first[rows];
  parallel_tasks(tasks, [&](auto next) {
    for (int64_t t; (t = next()) < tasks;) {
      const int64_t i = std::upper_bound(first.begin(), first.end(), t) - first.begin() - 1;
      const int64_t j0 = (t - first[i]) * per_split;
      attend(i, j0, j0 + per_split, parts.data() + t * stride);
      if (left[i].fetch_sub(1, std::memory_order_acq_rel) == 1)
        combine(i, parts.data() + first[i] * stride, first[i + 1] - first[i]);
    }
  });
}

template <typename T, int D>
void run_generic(const float* q, const T* k, const T* v, const Listing& ls, int64_t rows, int G, float* out) {
  constexpr int V = D / 8;
  std::vector<attn_vf> qv(static_cast<size_t>(rows * G * V));   // q in the pair order of the pool's chunks
  for (int64_t r = 0; r < rows * G; ++r)
    for (int c = 0; c < D / 16; ++c)
      for (int i = 0; i < 16; ++i) {
        const int slot = pair_slot<T>(i);
        qv[r * V + 2 * c + slot / 8][slot % 8] = q[r * D + c * 16 + i];
      }
  run_splits(
      ls, rows, 2 * G + G * D, kSplitTokens,
      [&](int64_t i, int64_t j0, int64_t j1, float* part) {
        const attn_vf* qi = qv.data() + i * G * V;
        if (ls.selected) {
          attend_split<T, D>(qi, G, k, v, ls.chosen(i), j0, std::min(ls.K, j1), part);
        } else {
          const AllPages all = ls.all(i);
          attend_split<T, D>(qi, G, k, v, all, j0, std::min(all.count(), j1), part);
        }
      },
      [&](int64_t i, const float* parts, int64_t splits) {
        combine_splits<T, D>(parts, splits, G, out + i * G * D);
      });
}

#ifdef KVH_HAVE_AVX512_BF16
// Tokens of pages per split of the bf16 kernel: a split's first page is read without a prefetch, so splits of the
// portable kernel's 256 tokens made batch >= 4 steps 5-40 % slower; at 512, batch 1 at 4k was 20 % faster than
// unsplit rows and larger batches unchanged (2 AVX512-BF16 cores, measured before the kernel's prefetch went row
// by row). Rows up to 512 tokens are one split.
constexpr int kSplitTokensBf16 = 512;
template <int D, int GN>
void run_bf16_group(const uint16_t* q, int G, float scale, const uint16_t* k, const uint16_t* v, const Listing& ls,
                    int64_t rows, float* out) {
  run_splits(
      ls, rows, 2 * G + G * D, kSplitTokensBf16,
      [&](int64_t i, int64_t j0, int64_t j1, float* part) {
        const uint16_t* qi = q + i * G * D;
        if (ls.selected) {
          attend_split_bf16<D, GN>(qi, G, scale, k, v, ls.chosen(i), j0, std::min(ls.K, j1), part);
        } else {
          const AllPages all = ls.all(i);
          attend_split_bf16<D, GN>(qi, G, scale, k, v, all, j0, std::min(all.count(), j1), part);
        }
      },
      [&](int64_t i, const float* parts, int64_t splits) {
        combine_splits_bf16<D>(parts, splits, G, out + i * G * D);
      });
}
// Query heads per KV head of the usual GQA models get their own compiled kernel; any other G the runtime one.
template <int D>
void run_bf16(const uint16_t* q, int G, float scale, const uint16_t* k, const uint16_t* v, const Listing& ls,
              int64_t rows, float* out) {
  switch (G) {
    case 1: return run_bf16_group<D, 1>(q, G, scale, k, v, ls, rows, out);
    case 2: return run_bf16_group<D, 2>(q, G, scale, k, v, ls, rows, out);
    case 3: return run_bf16_group<D, 3>(q, G, scale, k, v, ls, rows, out);
    case 4: return run_bf16_group<D, 4>(q, G, scale, k, v, ls, rows, out);
    case 5: return run_bf16_group<D, 5>(q, G, scale, k, v, ls, rows, out);
    case 6: return run_bf16_group<D, 6>(q, G, scale, k, v, ls, rows, out);
    case 7: return run_bf16_group<D, 7>(q, G, scale, k, v, ls, rows, out);
    case 8: return run_bf16_group<D, 8>(q, G, scale, k, v, ls, rows, out);
    default: return run_bf16_group<D, 0>(q, G, scale, k, v, ls, rows, out);
  }
}
#endif

template <typename T>
void dispatch_generic(int64_t D, const float* q, const T* k, const T* v, const Listing& ls, int64_t rows, int G,
                      float* out) {
  switch (D) {
    case 16: return run_generic<T, 16>(q, k, v, ls, rows, G, out);
    case 32: return run_generic<T, 32>(q, k, v, ls, rows, G, out);
    case 64: return run_generic<T, 64>(q, k, v, ls, rows, G, out);
    case 96: return run_generic<T, 96>(q, k, v, ls, rows, G, out);
    case 128: return run_generic<T, 128>(q, k, v, ls, rows, G, out);
    case 256: return run_generic<T, 256>(q, k, v, ls, rows, G, out);
    default: TORCH_CHECK(false, "decode attention: head_dim ", D, " not compiled (16, 32, 64, 96, 128, 256)");
  }
}

// Attention of `rows` listed rows, G query rows each: q [rows, G, D] in the model dtype, out [rows, G, D] fp32.
// bf16 pools on CPUs with AVX512-BF16 take the vdpbf16ps kernel (q stays bf16, scaled after the dot product), all
// else the generic one (q widened and pre-scaled in fp32), as the op always has.
template <typename T>
void attend_rows(const T* q, int64_t rows, int G, int64_t D, float scale, const T* k_pool, const T* v_pool,
                 const Listing& ls, float* out) {
#ifdef KVH_HAVE_AVX512_BF16
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (D == 64 || D == 128) {
      if (D == 64) run_bf16<64>(q, G, scale, k_pool, v_pool, ls, rows, out);
      else run_bf16<128>(q, G, scale, k_pool, v_pool, ls, rows, out);
      return;
    }
  }
#endif
  std::vector<float> qs(static_cast<size_t>(rows * G * D));
  for (size_t i = 0; i < qs.size(); ++i) qs[i] = to_float(q[i]) * scale;
  dispatch_generic<T>(D, qs.data(), k_pool, v_pool, ls, rows, G, out);
}

}  // namespace
}  // namespace kvh
