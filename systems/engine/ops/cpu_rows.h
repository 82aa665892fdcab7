// The decoder's elementwise row kernels (residual add + RMSNorm, RoPE, SiLU gate), bf16 or fp32, shared by the
// per-op kernels (cpu_model.cpp) and the fused decoder step (cpu_decoder.cpp).
//
// Every output is rounded exactly where the torch expressions in models/llama.py round (bf16 after each op), and
// each row is computed alone, so results do not depend on the batch or the thread count. Products and sums must be
// rounded one at a time, as torch's separate ops are: include this only in files compiled with
// `#pragma GCC optimize("fp-contract=off")` (no fused multiply-add) before it.
#pragma once

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu_common.h"

#if defined(__AVX2__)
#include <immintrin.h>
#endif

// Internal linkage: each including file compiles its own copy with its own floating-point options.
namespace kvh {
namespace {

inline void store(float* p, float x) { *p = x; }
inline void store(uint16_t* p, float x) {  // fp32 -> bf16, round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  *p = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
template <typename T>
inline float rounded(float x) {  // x as the model dtype holds it
  T t;
  store(&t, x);
  return to_float(t);
}

// Rows per task: enough work to be worth a thread, so small decode batches run on the calling thread.
inline int64_t grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// h += delta (rounded to the dtype, as `h + delta` is); out = weight * dtype(h * rsqrt(mean(h^2) + eps)).
template <typename T>
void add_rms_norm_rows(T* h, const T* delta, const T* weight, T* out, int64_t rows, int64_t H, float eps) {
  at::parallel_for(0, rows, grain(H), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      T* hr = h + r * H;
      if (delta) {
        const T* dr = delta + r * H;
        for (int64_t i = 0; i < H; ++i) store(hr + i, to_float(hr[i]) + to_float(dr[i]));
      }
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += to_float(hr[i]) * to_float(hr[i]);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* orow = out + r * H;
      for (int64_t i = 0; i < H; ++i) store(orow + i, to_float(weight[i]) * rounded<T>(to_float(hr[i]) * inv));
    }
  });
}

#if defined(__AVX2__) && !defined(KVH_HAVE_AVX512_BF16)
#define KVH_HAVE_AVX2_GATE 1
// 8-lane twins of exp_clamped, to_float and store, op for op (no fused multiply-add), so the gate computes on AVX2
// exactly what the scalar loop computes, 8 values at a time.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), x);
  const __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
  const __m256 n = _mm256_floor_ps(_mm256_add_ps(t, _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_mul_ps(_mm256_sub_ps(t, n), _mm256_set1_ps(0.693147180559945309f));
  __m256 p = _mm256_set1_ps(1.0f / 720.0f);
  for (const float c : {1.0f / 120.0f, 1.0f / 24.0f, 1.0f / 6.0f, 0.5f, 1.0f, 1.0f})
    p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(c));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
inline __m256i bf16_bits8(__m256 x) {  // round to nearest even, in the low half of each 32-bit lane
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
}
template <typename T>
inline __m256 rounded8(__m256 x) {
  if constexpr (std::is_same_v<T, float>) return x;
  else return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(x), 16));
}
inline void store8(float* p, __m256 x) { _mm256_storeu_ps(p, x); }
inline void store8(uint16_t* p, __m256 x) {
  const __m256i b = bf16_bits8(x);   // pack the eight 16-bit halves in order (the values fit, so no saturation)
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif

// out[i] = dtype(dtype(silu(g[i])) * u[i]) for i < n.
template <typename T>
inline void silu_mul_span(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
#ifdef KVH_HAVE_AVX2_GATE
  for (; i + 8 <= n; i += 8) {
    const __m256 gv = load8(g + i);
    const __m256 s = _mm256_div_ps(gv, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8(_mm256_xor_ps(gv, _mm256_set1_ps(-0.0f)))));
    store8(o + i, _mm256_mul_ps(rounded8<T>(s), load8(u + i)));
  }
#endif
#ifdef KVH_HAVE_AVX512_BF16
  if constexpr (std::is_same_v<T, uint16_t>) {
    for (; i + 16 <= n; i += 16) {
      const __m512 gv = kvh::load_bf16x16(g + i);
      const __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.0f), kvh::exp16(_mm512_sub_ps(
                                                                          _mm512_setzero_ps(), gv))));
      const __m512 y = _mm512_mul_ps(kvh::round_bf16x16(s), kvh::load_bf16x16(u + i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), (__m256i)_mm512_cvtneps_pbh(y));
    }
  }
#endif
  for (; i < n; ++i) {
    const float gv = to_float(g[i]);
    store(o + i, rounded<T>(gv / (1.0f + kvh::exp_clamped(-gv))) * to_float(u[i]));
  }
}

// out[r, :] = silu_mul(gate = x[r, :I], up = x[r, I:]).
template <typename T>
void silu_mul_rows(const T* x, T* out, int64_t rows, int64_t I) {
  at::parallel_for(0, rows, grain(2 * I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_mul_span<T>(x + r * 2 * I, x + r * 2 * I + I, out + r * I, I);
  });
}

// In place over [T, H, D] heads: x = dtype(dtype(x * cos) + dtype(rotate_half(x) * sin)), cos/sin [T, D].
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t rows, int64_t H, int64_t D, int64_t stride0) {
  const int64_t half = D / 2;
  at::parallel_for(0, rows, grain(H * D), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* c = cos + r * D;
      const T* s = sin + r * D;
      for (int64_t h = 0; h < H; ++h) {
        T* v = x + r * stride0 + h * D;
        for (int64_t i = 0; i < half; ++i) {
          const float a = to_float(v[i]), b = to_float(v[i + half]);
          const float lo = rounded<T>(a * to_float(c[i])) + rounded<T>(-b * to_float(s[i]));
          const float hi = rounded<T>(b * to_float(c[i + half])) + rounded<T>(a * to_float(s[i + half]));
          store(v + i, lo);
          store(v + i + half, hi);
        }
      }
    }
  });
}

}  // namespace
}  // namespace kvh
