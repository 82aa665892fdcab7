// The portable decode attention kernel (every CPU without AVX512-BF16): one (sequence, KV head) row's pages cut
// into fixed splits, each split's online softmax in 8-lane vectors, the splits combined in order.
//
// Why splits: a row's pages used to be one task, so a batch-1 step had 3 tasks per layer for 2 cores and one core
// read 2/3 of the KV; a split is kSplitTokens tokens' worth of pages, fixed by the page size alone, so the sums
// (and the bits of every output) depend on neither the batch, nor the thread count, nor which thread ran a split.
// Why vectors of 8 tokens: the per-token horizontal sums of the scalar loop cost more than reading K and V. A bf16
// page row is read as 16-value loads split into even and odd lanes (a shift and a mask, no shuffle), with q and the
// accumulators kept in that lane order; every sum has one fixed order, written out below, the same on every x86
// CPU with or without AVX (the fallbacks compute lane by lane in the order the intrinsics do).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_common.h"

#if defined(__AVX__)
#include <immintrin.h>
#endif

// no multiply-add may be contracted: the bits must not depend on what the compiler fuses where this is inlined
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")

namespace kvh {
namespace {

typedef float attn_vf __attribute__((vector_size(32)));
typedef uint32_t attn_vu __attribute__((vector_size(32)));
typedef int32_t attn_vi __attribute__((vector_size(32)));
constexpr int kSplitTokens = 256;   // tokens of pages per split (at least one page)

inline attn_vf attn_fma(attn_vf a, attn_vf b, attn_vf c) {  // a * b + c, rounded once
#if defined(__FMA__)
  return reinterpret_cast<attn_vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                   reinterpret_cast<__m256>(c)));
#else
  attn_vf r;
  for (int l = 0; l < 8; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}

inline attn_vf attn_splat(float x) { return attn_vf{x, x, x, x, x, x, x, x}; }
constexpr attn_vf kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7};

// exp_clamped (cpu_common.h) op for op on 8 lanes, here so that it inlines with this file's options.
inline attn_vf attn_exp(attn_vf x) {
  x = x < attn_splat(-87.0f) ? attn_splat(-87.0f) : x;
  x = x > attn_splat(88.0f) ? attn_splat(88.0f) : x;
  const attn_vf t = x * attn_splat(1.44269504088896341f), h = t + attn_splat(0.5f);
#if defined(__AVX__)
  const attn_vf n = reinterpret_cast<attn_vf>(_mm256_floor_ps(reinterpret_cast<__m256>(h)));
#else
  attn_vf n;
  for (int l = 0; l < 8; ++l) n[l] = std::floor(h[l]);
#endif
  const attn_vf r = (t - n) * attn_splat(0.693147180559945309f);
  attn_vf p = attn_splat(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f}) p = p * r + attn_splat(c);
  const attn_vi e = (__builtin_convertvector(n, attn_vi) + 127) << 23;
  return p * reinterpret_cast<attn_vf>(e);
}
inline float attn_exp1(float x) { return attn_exp(attn_splat(x))[0]; }
inline float attn_sum(attn_vf a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// 16 values of a page row as two vectors: bf16 even lanes / odd lanes, fp32 first / second half.
inline void attn_pair(const uint16_t* p, attn_vf* a, attn_vf* b) {
  attn_vu bits;
  std::memcpy(&bits, p, sizeof(bits));
  *a = reinterpret_cast<attn_vf>(bits << 16);
  *b = reinterpret_cast<attn_vf>(bits & 0xFFFF0000u);
}
inline void attn_pair(const float* p, attn_vf* a, attn_vf* b) {
  std::memcpy(a, p, sizeof(attn_vf));
  std::memcpy(b, p + 8, sizeof(attn_vf));
}
// Where value i of a 16-value chunk lands in the pair attn_pair makes (vector * 8 + lane).
template <typename T>
inline int pair_slot(int i) { return std::is_same_v<T, uint16_t> ? (i % 2) * 8 + i / 2 : i; }

// Lane t = the sum of a[t]'s lanes as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)): the hadd tree's order.
inline attn_vf attn_sum8x8(const attn_vf* a) {
#if defined(__AVX__)
  auto h = [](attn_vf x, attn_vf y) {
    return reinterpret_cast<attn_vf>(_mm256_hadd_ps(reinterpret_cast<__m256>(x), reinterpret_cast<__m256>(y)));
  };
  const __m256 lo4 = reinterpret_cast<__m256>(h(h(a[0], a[1]), h(a[2], a[3])));
  const __m256 hi4 = reinterpret_cast<__m256>(h(h(a[4], a[5]), h(a[6], a[7])));
  return reinterpret_cast<attn_vf>(_mm256_add_ps(_mm256_permute2f128_ps(lo4, hi4, 0x20),
                                                 _mm256_permute2f128_ps(lo4, hi4, 0x31)));
#else
  attn_vf r;
  for (int t = 0; t < 8; ++t)
    r[t] = ((a[t][0] + a[t][1]) + (a[t][2] + a[t][3])) + ((a[t][4] + a[t][5]) + (a[t][6] + a[t][7]));
  return r;
#endif
}

// s[g][t0 .. t0 + NT) = q[g] . k[t] for NG query heads (q in pair order, pre-scaled), tokens past `valid` read
// token valid - 1 (inside the page) and are masked by the caller. Each dot: one FMA chain over the chunks into 8
// lanes, then attn_sum8x8.
template <typename T, int D, int NG, int NT>
inline void score_block(const attn_vf* q, const T* kp, int t0, int valid, attn_vf (*dots)[8]) {
  constexpr int C = D / 16;
  attn_vf acc[NT][NG];
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) acc[t][g] = attn_vf{};
  const T* rows[NT];
  for (int t = 0; t < NT; ++t) rows[t] = kp + static_cast<int64_t>(std::min(t0 + t, valid - 1)) * D;
  for (int c = 0; c < C; ++c) {
    for (int t = 0; t < NT; ++t) {
      attn_vf k0, k1;
      attn_pair(rows[t] + c * 16, &k0, &k1);
      for (int g = 0; g < NG; ++g) {
        acc[t][g] = attn_fma(q[g * 2 * C + 2 * c], k0, acc[t][g]);
        acc[t][g] = attn_fma(q[g * 2 * C + 2 * c + 1], k1, acc[t][g]);
      }
    }
  }
  for (int t = 0; t < NT; ++t)
    for (int g = 0; g < NG; ++g) dots[g][(t0 + t) % 8] = acc[t][g];
}

// acc[g] += p[g][t] * v[t] for t < valid, in order of t, NG heads and NV vectors (from vector v0) at a time.
template <typename T, int D, int NG, int NV>
inline void value_block(const float (*p)[kMaxPage], const T* vp, int valid, int v0, attn_vf* acc /* [G][D/8] */) {
  attn_vf a[NG][NV];
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < NV; ++v) a[g][v] = acc[g * (D / 8) + v0 + v];
  for (int t = 0; t < valid; ++t) {
    attn_vf w[NV];
    for (int v = 0; v < NV; v += 2) attn_pair(vp + static_cast<int64_t>(t) * D + (v0 + v) * 8, &w[v], &w[v + 1]);
    for (int g = 0; g < NG; ++g) {
      const attn_vf pb = attn_splat(p[g][t]);
      for (int v = 0; v < NV; ++v) a[g][v] = attn_fma(pb, w[v], a[g][v]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int v = 0; v < NV; ++v) acc[g * (D / 8) + v0 + v] = a[g][v];
}

// One split: pages [j0, j1) of `list` for G query heads q [G, D/8] (pair order, pre-scaled). part: m [G], l [G],
// then acc [G, D] in pair order (the unnormalized output of the split's softmax).
template <typename T, int D, typename Pages>
void attend_split(const attn_vf* q, int G, const T* k_pool, const T* v_pool, const Pages& list, int64_t j0,
                  int64_t j1, float* part) {
  constexpr int V = D / 8;
  float* m = part;
  float* l = part + G;
  attn_vf acc[kMaxGroup * V];
  alignas(32) float s[kMaxGroup][kMaxPage];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int v = 0; v < V; ++v) acc[g * V + v] = attn_vf{};
  }
  for (int64_t j = j0; j < j1; ++j) {
    int64_t token = 0;
    int valid = 0;
    list.at(j, &token, &valid);
    if (j + 1 < j1) {  // the next page is a scattered block, beyond the hardware prefetcher
      int64_t nt = 0;
      int nv = 0;
      list.at(j + 1, &nt, &nv);
      for (int off = 0; off < nv * D; off += 64 / static_cast<int>(sizeof(T))) {
        __builtin_prefetch(k_pool + nt * D + off, 0, 3);
        __builtin_prefetch(v_pool + nt * D + off, 0, 3);
      }
    }
    if (valid <= 0) continue;
    const T* kp = k_pool + token * D;
    const T* vp = v_pool + token * D;
    for (int g0 = 0; g0 < G; g0 += 3) {
      const int ng = std::min(3, G - g0);
      for (int t0 = 0; t0 < valid; t0 += 8) {
        attn_vf dots[3][8];
        if (ng == 1) {
          score_block<T, D, 1, 8>(q + g0 * V, kp, t0, valid, dots);
        } else {
          for (int h = 0; h < 8; h += 4) {
            if (ng == 2) score_block<T, D, 2, 4>(q + g0 * V, kp, t0 + h, valid, dots);
            else score_block<T, D, 3, 4>(q + g0 * V, kp, t0 + h, valid, dots);
          }
        }
        for (int g = 0; g < ng; ++g) {
          const attn_vf sums = attn_sum8x8(dots[g]);
          std::memcpy(s[g0 + g] + t0, &sums, sizeof(sums));
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      attn_vf mx = attn_splat(m[g]);
      for (int t0 = 0; t0 < valid; t0 += 8) {   // a max is exact in any order
        attn_vf x;
        std::memcpy(&x, s[g] + t0, sizeof(x));
        const attn_vf live = kLaneIndex + attn_splat(static_cast<float>(t0));   // token of each lane
        x = live < attn_splat(static_cast<float>(valid)) ? x : attn_splat(-INFINITY);
        mx = x > mx ? x : mx;
      }
      float page_max = mx[0];
      for (int i = 1; i < 8; ++i) page_max = mx[i] > page_max ? mx[i] : page_max;
      // m = -inf on the first page: exp clamps to ~0. A page that does not raise the max (most, past the first
      // few) skips the exp and the rescale: exp(0) is exactly 1 here, so the bits are those of doing both.
      const bool grew = page_max != m[g];
      const float corr = grew ? attn_exp1(m[g] - page_max) : 1.0f;
      attn_vf lanes{};
      for (int t0 = 0; t0 < valid; t0 += 8) {   // s holds 8 written lanes past every block start
        attn_vf e;
        std::memcpy(&e, s[g] + t0, sizeof(e));
        e = attn_exp(e - attn_splat(page_max));
        const attn_vf live = kLaneIndex + attn_splat(static_cast<float>(t0));   // token of each lane
        e = live < attn_splat(static_cast<float>(valid)) ? e : attn_vf{};
        std::memcpy(s[g] + t0, &e, sizeof(e));
        lanes += e;
      }
      const float sum = attn_sum(lanes);
      l[g] = l[g] * corr + sum;
      m[g] = page_max;
      if (grew)
        for (int v = 0; v < V; ++v) acc[g * V + v] *= attn_splat(corr);
    }
    for (int g0 = 0; g0 < G; g0 += 3) {
      const int ng = std::min(3, G - g0);
      for (int v0 = 0; v0 < V; v0 += 4) {
        attn_vf* a = acc + g0 * V;
        const float (*p)[kMaxPage] = s + g0;
        if (V - v0 >= 4) {
          if (ng == 1) value_block<T, D, 1, 4>(p, vp, valid, v0, a);
          else if (ng == 2) value_block<T, D, 2, 4>(p, vp, valid, v0, a);
          else value_block<T, D, 3, 4>(p, vp, valid, v0, a);
        } else {
          if (ng == 1) value_block<T, D, 1, 2>(p, vp, valid, v0, a);
          else if (ng == 2) value_block<T, D, 2, 2>(p, vp, valid, v0, a);
          else value_block<T, D, 3, 2>(p, vp, valid, v0, a);
        }
      }
    }
  }
  std::memcpy(part + 2 * G, acc, sizeof(attn_vf) * G * V);
}

// A row's output [G, D] from its splits' parts, combined in split order; pair order undone.
template <typename T, int D>
void combine_splits(const float* parts, int64_t splits, int G, float* out) {
  const int64_t stride = 2 * G + G * D;
  for (int g = 0; g < G; ++g) {
    float mx = -INFINITY;
    for (int64_t s = 0; s < splits; ++s) mx = std::max(mx, parts[s * stride + g]);
    float lsum = 0.0f;
    alignas(32) float acc[256];
    std::fill(acc, acc + D, 0.0f);
    for (int64_t s = 0; s < splits; ++s) {
      const float* ps = parts + s * stride;
      if (ps[g] == -INFINITY) continue;   // nothing read in this split
      const float w = attn_exp1(ps[g] - mx);
      lsum = lsum + ps[G + g] * w;
      const float* a = ps + 2 * G + g * D;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[d] = acc[d] + a[d] * w;
    }
    const float inv = 1.0f / lsum;
    for (int c = 0; c < D / 16; ++c)
      for (int i = 0; i < 16; ++i) out[g * D + c * 16 + i] = acc[c * 16 + pair_slot<T>(i)] * inv;
  }
}

}  // namespace
}  // namespace kvh

#pragma GCC pop_options
