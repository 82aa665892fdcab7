// Page selection on the CPU path: Quest scores and fused top-K sets from the MinMax cache, resident page lists.
//
// Why fused: scoring a layer is one pass over its MinMax cache; the torch path then spends as long again on a
// [B, H, W] score tensor, a scatter for the forced last page and torch.topk. Here each (row, head) task scores into
// a per-thread buffer and picks its pages by a branch-free threshold search while the scores are still in L1.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_common.h"
#include "cpu_scoring.h"

namespace {

using kvh::kMaxGroup;
using kvh::to_float;
#ifdef KVH_HAVE_AVX512_BF16
using kvh::sum16;
#endif

#ifdef KVH_HAVE_AVX512_BF16
// bf16 queries on a bf16 cache: vdpbf16ps on the stored rows, 16 pages' dot products reduced at once by sum16,
// the group's query parts held in registers across the 16 pages.
template <int D>
void score_pages_bf16(const uint16_t* qpb, const uint16_t* qnb, const uint16_t* kmin, const uint16_t* kmax,
                      int64_t ps, int64_t n, int G, float* o) {
  constexpr int NB = D / 32;
  for (int64_t m = 0; m < n; m += 16) {
    const int nc = static_cast<int>(std::min<int64_t>(16, n - m));
    __m512 best = _mm512_set1_ps(-INFINITY);
    for (int g = 0; g < G; ++g) {
      __m512bh qp[NB], qn[NB];
      for (int c = 0; c < NB; ++c) {
        qp[c] = (__m512bh)_mm512_loadu_si512(qpb + g * D + c * 32);
        qn[c] = (__m512bh)_mm512_loadu_si512(qnb + g * D + c * 32);
      }
      __m512 acc[16];
      if (nc == 16) {
        for (int t = 0; t < 16; ++t) {
          const uint16_t* lo = kmin + (m + t) * ps;
          const uint16_t* hi = kmax + (m + t) * ps;
          __m512 x = _mm512_setzero_ps();
          for (int c = 0; c < NB; ++c) {
            x = _mm512_dpbf16_ps(x, qp[c], (__m512bh)_mm512_loadu_si512(hi + c * 32));
            x = _mm512_dpbf16_ps(x, qn[c], (__m512bh)_mm512_loadu_si512(lo + c * 32));
          }
          acc[t] = x;
        }
      } else {
        for (int t = 0; t < 16; ++t) {
          __m512 x = _mm512_setzero_ps();
          if (t < nc) {
            const uint16_t* lo = kmin + (m + t) * ps;
            const uint16_t* hi = kmax + (m + t) * ps;
            for (int c = 0; c < NB; ++c) {
              x = _mm512_dpbf16_ps(x, qp[c], (__m512bh)_mm512_loadu_si512(hi + c * 32));
              x = _mm512_dpbf16_ps(x, qn[c], (__m512bh)_mm512_loadu_si512(lo + c * 32));
            }
          }
          acc[t] = x;
        }
      }
      best = _mm512_max_ps(best, sum16(acc));
    }
    _mm512_mask_storeu_ps(o + m, static_cast<__mmask16>(nc == 16 ? 0xFFFFu : (1u << nc) - 1u), best);
  }
}
#endif

// Quest bound of one (row, head)'s first n pages, read in place from a MinMax view with page stride `ps`:
// score = max over the head's query group of q+ . kmax + q- . kmin (equal to sum_d max(q_d kmin_d, q_d kmax_d)
// because kmin <= kmax).
template <typename T>
void score_head(const float* qp, const float* qn, const uint16_t* qpb, const uint16_t* qnb, const T* kmin,
                const T* kmax, int64_t ps, int64_t n, int64_t D, int G, float* o) {
  int64_t m = 0;
#ifdef KVH_HAVE_AVX512_BF16
  if constexpr (std::is_same_v<T, uint16_t>) {
    if (qpb && D == 64) {
      score_pages_bf16<64>(qpb, qnb, kmin, kmax, ps, n, G, o);
      return;
    }
    if (qpb && D == 128) {
      score_pages_bf16<128>(qpb, qnb, kmin, kmax, ps, n, G, o);
      return;
    }
    if (D % 16 == 0 && D <= 256 && G <= kMaxGroup) {
      for (; m < n; ++m) {
        const uint16_t* lo = kmin + m * ps;
        const uint16_t* hi = kmax + m * ps;
        __m512 acc[kMaxGroup];
        for (int g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
        for (int64_t c = 0; c < D; c += 16) {
          const __m512 l = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + c)));
          const __m512 h = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi + c)));
          for (int g = 0; g < G; ++g) {
            acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qp + g * D + c), h, acc[g]);
            acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(qn + g * D + c), l, acc[g]);
          }
        }
        float best = -INFINITY;
        for (int g = 0; g < G; ++g) {
          const float v = _mm512_reduce_add_ps(acc[g]);
          best = v > best ? v : best;
        }
        o[m] = best;
      }
    }
  }
#endif
  for (; m < n; ++m) {
    const T* lo = kmin + m * ps;
    const T* hi = kmax + m * ps;
    float best = -INFINITY;
    for (int g = 0; g < G; ++g) {
      float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
      for (int64_t d = 0; d < D; ++d) acc += qp[g * D + d] * to_float(hi[d]) + qn[g * D + d] * to_float(lo[d]);
      best = acc > best ? acc : best;
    }
    o[m] = best;
  }
}

// Scores as unsigned keys with the same order (-0 folded into +0, so equal floats stay equal keys).
inline uint32_t order_key(float x) {
  uint32_t b;
  x += 0.0f;
  std::memcpy(&b, &x, sizeof b);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

inline int64_t count_at_least(const uint32_t* key, int64_t n, uint32_t t) {
  int32_t c = 0;                               // 32-bit lanes, as wide as the keys, so the loop vectorises
#pragma omp simd reduction(+ : c)
  for (int64_t m = 0; m < n; ++m) c += key[m] >= t ? 1 : 0;
  return c;
}

// The k best of the first n pages into out[0 .. width), ascending, padded with -1. keep_last: the last page is
// always taken and k - 1 others chosen (all pages when n <= k); otherwise the k best excluding the last page.
// The threshold (the want-th largest score) is found bit by bit on the keys, 32 vectorised counting passes over
// the scores in L1: branch-free, unlike nth_element, whose data-dependent branches cost more than the scoring.
// Pages above it are taken in index order, then pages equal to it, lowest index first, until `want` are taken.
void pick_top(const float* score, int64_t n, int64_t k, bool keep_last, int64_t width, uint32_t* key,
              int64_t* out) {
  const int64_t others = n > 0 ? n - 1 : 0;
  const int64_t want = std::max<int64_t>(std::min<int64_t>(keep_last ? k - 1 : k, others), 0);
  int64_t c = 0;
  if (want == others) {
    for (; c < others; ++c) out[c] = c;
  } else if (want > 0) {
    for (int64_t m = 0; m < others; ++m) key[m] = order_key(score[m]);
    uint32_t thr = 0;
    for (int bit = 31; bit >= 0; --bit) {
      const uint32_t cand = thr | (1u << bit);
      if (count_at_least(key, others, cand) >= want) thr = cand;
    }
    const int64_t above = thr == UINT32_MAX ? 0 : count_at_least(key, others, thr + 1);
    int64_t ties = want - above;
    for (int64_t m = 0; m < others; ++m) {
      if (key[m] > thr || (key[m] == thr && ties-- > 0)) out[c++] = m;
    }
  }
  if (keep_last && n > 0 && k > 0) out[c++] = n - 1;
  for (; c < width; ++c) out[c] = -1;
}

struct ScoreArgs {
  const void* q;              // [B, H*G, D] contiguous, fp32 or bf16
  bool q_bf16;
  const int64_t* rows;
  const int64_t* heads;
  const int64_t* n_pages;
  int64_t B, H, W, D;
  int G;
  int64_t st[3];
};

ScoreArgs score_args(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& rows,
                     const at::Tensor& heads, const at::Tensor& num_pages, std::vector<at::Tensor>& keep) {
  TORCH_CHECK(kmin.dim() == 4 && kmin.strides() == kmax.strides() && kmin.stride(3) == 1,
              "page scores: kmin/kmax [S, Hkv, W, D] with equal strides and a contiguous last dim");
  TORCH_CHECK(kmin.scalar_type() == kmax.scalar_type(), "page scores: kmin/kmax dtypes differ");
  TORCH_CHECK(kmin.scalar_type() == at::kBFloat16 || kmin.scalar_type() == at::kFloat,
              "page scores: MinMax cache must be bf16 or fp32");
  const int64_t B = rows.size(0), H = heads.size(0), W = kmin.size(2), D = kmin.size(3);
  TORCH_CHECK(q.dim() == 3 && q.size(0) == B && q.size(1) % H == 0 && q.size(2) == D, "page scores: q [B, H*G, D]");
  TORCH_CHECK(num_pages.numel() == B * H, "page scores: num_pages [B, H]");
  const bool q_bf16 = q.scalar_type() == at::kBFloat16;
  keep = {q_bf16 ? q.contiguous() : q.to(at::kFloat).contiguous(), rows.to(at::kLong).contiguous(),
          heads.to(at::kLong).contiguous(), num_pages.to(at::kLong).contiguous()};
  return ScoreArgs{keep[0].data_ptr(), q_bf16, keep[1].data_ptr<int64_t>(), keep[2].data_ptr<int64_t>(),
                   keep[3].data_ptr<int64_t>(), B, H, W, D, static_cast<int>(q.size(1) / H),
                   {kmin.stride(0), kmin.stride(1), kmin.stride(2)}};
}

// Run fn(i, n, scores of task i) for every (row, head) task, the scores computed in a per-thread buffer. The
// query's positive and negative parts are split per task (exact in the query's own dtype).
template <typename T, typename Fn>
void for_scored_heads(const ScoreArgs& a, const T* kmin, const T* kmax, Fn fn) {
  kvh::parallel_tasks(a.B * a.H, [&](auto next) {
    const int64_t GD = a.G * a.D;
    std::vector<float> buf(a.W), qp(GD), qn(GD);
    std::vector<uint16_t> qpb(a.q_bf16 ? GD : 0), qnb(a.q_bf16 ? GD : 0);
    const bool bf16_dots = a.q_bf16 && std::is_same_v<T, uint16_t>;
    for (int64_t i; (i = next()) < a.B * a.H;) {
      const int64_t b = i / a.H, hi = i % a.H;
      for (int64_t e = 0; e < GD; ++e) {
        float x;
        if (a.q_bf16) {
          const uint16_t bits = static_cast<const uint16_t*>(a.q)[i * GD + e];
          x = to_float(bits);
          const bool pos = x > 0.0f;
          qpb[e] = pos ? bits : 0;
          qnb[e] = pos ? 0 : bits;
        } else {
          x = static_cast<const float*>(a.q)[i * GD + e];
        }
        qp[e] = x > 0.0f ? x : 0.0f;
        qn[e] = x > 0.0f ? 0.0f : x;
      }
      const int64_t off = a.rows[b] * a.st[0] + a.heads[hi] * a.st[1];
      const int64_t n = std::min<int64_t>(a.n_pages[i], a.W);
      score_head<T>(qp.data(), qn.data(), bf16_dots ? qpb.data() : nullptr, bf16_dots ? qnb.data() : nullptr,
                    kmin + off, kmax + off, a.st[2], n, a.D, a.G, buf.data());
      fn(i, n, buf.data());
    }
  });
}

template <typename Fn>
void dispatch_scored(const ScoreArgs& a, const at::Tensor& kmin, const at::Tensor& kmax, Fn fn) {
  if (kmin.scalar_type() == at::kBFloat16)
    for_scored_heads<uint16_t>(a, reinterpret_cast<const uint16_t*>(kmin.data_ptr()),
                               reinterpret_cast<const uint16_t*>(kmax.data_ptr()), fn);
  else
    for_scored_heads<float>(a, kmin.data_ptr<float>(), kmax.data_ptr<float>(), fn);
}

// Quest bounds [B, H, W] for (row, head) pairs read in place from one layer's MinMax cache, -inf from num_pages on.
at::Tensor page_scores(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                       const at::Tensor& num_pages, const at::Tensor& rows, const at::Tensor& heads) {
  std::vector<at::Tensor> keep;
  const ScoreArgs a = score_args(q, kmin, kmax, rows, heads, num_pages, keep);
  at::Tensor out = at::empty({a.B, a.H, a.W}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t W = a.W;
  dispatch_scored(a, kmin, kmax, [op, W](int64_t i, int64_t n, const float* s) {
    float* o = op + i * W;
    std::memcpy(o, s, n * sizeof(float));
    for (int64_t m = n; m < W; ++m) o[m] = -INFINITY;
  });
  return out;
}

}  // namespace

namespace kvh {

// Pages each (rows[b], heads[j]) holds, from a [S, H'] token-count table of any strides (int32 or int64).
at::Tensor pages_from_tokens(const at::Tensor& num_tokens, int64_t page_size, const at::Tensor& rows,
                             const at::Tensor& heads) {
  TORCH_CHECK(num_tokens.dim() == 2 && page_size >= 1, "top_pages: num_tokens [S, H], page_size >= 1");
  const at::Tensor r = rows.to(at::kLong).contiguous(), h = heads.to(at::kLong).contiguous();
  const at::Tensor t = num_tokens.to(at::kLong);
  const int64_t B = r.size(0), H = h.size(0), s0 = t.stride(0), s1 = t.stride(1);
  const int64_t *rp = r.data_ptr<int64_t>(), *hp = h.data_ptr<int64_t>(), *tp = t.data_ptr<int64_t>();
  at::Tensor out = at::empty({B, H}, r.options());
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < H; ++j) o[b * H + j] = (tp[rp[b] * s0 + hp[j] * s1] + page_size - 1) / page_size;
  return out;
}

// Scores and the top-k page set in one pass, no [B, H, W] score tensor: int64 [B, H, min(k, W)], ascending pages,
// padded with -1 (see pick_top for keep_last). The page counts come from the layer's token counts, read through
// rows and heads like the MinMax cache, so the caller runs no torch op before this one.
at::Tensor top_pages(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& num_tokens,
                     int64_t page_size, int64_t k, bool keep_last, const at::Tensor& rows, const at::Tensor& heads) {
  TORCH_CHECK(k >= 1, "top_pages: k must be >= 1");
  const at::Tensor num_pages = pages_from_tokens(num_tokens, page_size, rows, heads);
  std::vector<at::Tensor> keep;
  const ScoreArgs a = score_args(q, kmin, kmax, rows, heads, num_pages, keep);
  const int64_t width = std::min<int64_t>(k, a.W);
  at::Tensor out = at::empty({a.B, a.H, width}, q.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  dispatch_scored(a, kmin, kmax, [op, width, k, keep_last](int64_t i, int64_t n, const float* s) {
    thread_local std::vector<uint32_t> keys;
    keys.resize(std::max<int64_t>(n, 1));
    pick_top(s, n, std::min(k, width), keep_last, width, keys.data(), op + i * width);
  });
  return out;
}

// The k[b] best pages of each (rows[b], heads[j]) by the bound, best first, ties to the lower page (a stable
// descending sort's order): int64 [B, H, min(max k, W)], -1 past k[b] and past a head's pages. The order is the
// one the attention reads them in, so it is the torch path's exactly, not just the same set.
at::Tensor ranked_pages(const at::Tensor& q, const at::Tensor& kmin, const at::Tensor& kmax,
                        const at::Tensor& num_pages, const at::Tensor& rows, const at::Tensor& heads,
                        const at::Tensor& k) {
  std::vector<at::Tensor> keep;
  const ScoreArgs a = score_args(q, kmin, kmax, rows, heads, num_pages, keep);
  const at::Tensor kk = k.to(at::kLong).contiguous();
  TORCH_CHECK(kk.numel() == a.B, "ranked_pages: k [B]");
  const int64_t* kp = kk.data_ptr<int64_t>();
  const int64_t width = std::min<int64_t>(a.B ? *std::max_element(kp, kp + a.B) : 1, a.W);
  at::Tensor out = at::empty({a.B, a.H, width}, q.options().dtype(at::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t H = a.H;
  dispatch_scored(a, kmin, kmax, [op, width, kp, H](int64_t i, int64_t n, const float* s) {
    thread_local std::vector<int64_t> order;
    const int64_t want = std::max<int64_t>(0, std::min({kp[i / H], n, width}));
    order.resize(n);
    for (int64_t m = 0; m < n; ++m) order[m] = m;
    std::partial_sort(order.begin(), order.begin() + want, order.end(), [s](int64_t x, int64_t y) {
      return s[x] > s[y] || (s[x] == s[y] && x < y);
    });
    int64_t* o = op + i * width;
    std::copy(order.begin(), order.begin() + want, o);
    std::fill(o + want, o + width, -1);
  });
  return out;
}

}  // namespace kvh

namespace {

// The device-resident logical pages of each (row, head), ascending, -1-padded to the longest list: table
// [B, H, W] int32 block ids (0 = not resident, any strides), num_pages [B, H]; pages >= num_pages are ignored.
at::Tensor resident_pages(const at::Tensor& table, const at::Tensor& num_pages) {
  TORCH_CHECK(table.dim() == 3 && table.scalar_type() == at::kInt, "resident_pages: table [B, H, W] int32");
  const int64_t B = table.size(0), H = table.size(1), W = table.size(2);
  TORCH_CHECK(num_pages.numel() == B * H, "resident_pages: num_pages [B, H]");
  const at::Tensor np = num_pages.to(at::kLong).contiguous();
  const int64_t* n = np.data_ptr<int64_t>();
  const int32_t* t = table.data_ptr<int32_t>();
  const int64_t s0 = table.stride(0), s1 = table.stride(1), s2 = table.stride(2);
  std::vector<int64_t> count(B * H);
  int64_t width = 1;
  for (int64_t i = 0; i < B * H; ++i) {
    const int32_t* row = t + (i / H) * s0 + (i % H) * s1;
    int64_t c = 0;
    for (int64_t m = 0, end = std::min<int64_t>(n[i], W); m < end; ++m) c += row[m * s2] != 0;
    count[i] = c;
    width = std::max(width, c);
  }
  at::Tensor out = at::full({B, H, width}, -1, table.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  for (int64_t i = 0; i < B * H; ++i) {
    const int32_t* row = t + (i / H) * s0 + (i % H) * s1;
    int64_t* dst = o + i * width;
    for (int64_t m = 0, end = std::min<int64_t>(n[i], W); m < end; ++m)
      if (row[m * s2] != 0) *dst++ = m;
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("page_scores(Tensor q, Tensor kmin, Tensor kmax, Tensor num_pages, Tensor rows, Tensor heads) -> Tensor",
        &page_scores);
  m.def("top_pages(Tensor q, Tensor kmin, Tensor kmax, Tensor num_tokens, int page_size, int k, bool keep_last, "
        "Tensor rows, Tensor heads) -> Tensor", &kvh::top_pages);
  m.def("ranked_pages(Tensor q, Tensor kmin, Tensor kmax, Tensor num_pages, Tensor rows, Tensor heads, Tensor k) "
        "-> Tensor", &kvh::ranked_pages);
  m.def("resident_pages(Tensor table, Tensor num_pages) -> Tensor", &resident_pages);
}
