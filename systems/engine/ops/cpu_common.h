// Shared by the CPU kernels: bf16 loads, exp, the AVX512-BF16 switch, the 16-lane transposing sum and task sharing.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVH_HAVE_AVX512_BF16 1
#endif

namespace kvh {

constexpr int kMaxGroup = 16;
constexpr int kMaxPage = 256;

// Runs body(next) once on each of up to get_num_threads() threads; next() hands out task indices 0, 1, 2, ... in
// order, one per call, and returns n or more once all are taken. Tasks go to whichever thread is free: on a shared
// host a thread that loses its core takes fewer of them, where equal static ranges would make every other thread
// wait for it at the end of the region. A task's result must not depend on which thread runs it.
template <typename Body>
inline void parallel_tasks(int64_t n, const Body& body) {
  if (n <= 0) return;
  std::atomic<int64_t> counter{0};
  auto next = [&counter] { return counter.fetch_add(1, std::memory_order_relaxed); };
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { body(next); });
}

// e^x for x in [-87, 88] (clamped outside): 2^n * p(r), |rel err| < 1e-6, branch-free so loops vectorize.
inline float exp_clamped(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float r = (t - n) * 0.693147180559945309f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {  // bf16: the high half of an fp32
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#ifdef KVH_HAVE_AVX512_BF16
// exp_clamped on 16 lanes, with scalef.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.693147180559945309f));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 bf16 values widened to fp32, and fp32 rounded to the nearest bf16 (kept in fp32 lanes).
inline __m512 load_bf16x16(const uint16_t* p) {
  return _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 round_bf16x16(__m512 x) { return _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(x)); }

// Lane t of the result = the sum of the 16 lanes of a[t] (a transposing add tree: 46 ops instead of 16 reductions).
inline __m512 sum16(const __m512* a) {
  // lane 4k + j of the tree's output holds token {0,2,1,3}[j] + {0,8,4,12}[k]; this puts token t in lane t
  const __m512i order = _mm512_setr_epi32(0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15);
  __m512 b[8], c[4], d[2];
  for (int t = 0; t < 8; ++t)
    b[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[t], a[t + 8], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_f32x4(a[t], a[t + 8], _MM_SHUFFLE(3, 2, 3, 2)));
  for (int t = 0; t < 4; ++t)
    c[t] = _mm512_add_ps(_mm512_shuffle_f32x4(b[t], b[t + 4], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[t], b[t + 4], _MM_SHUFFLE(3, 1, 3, 1)));
  for (int t = 0; t < 2; ++t)
    d[t] = _mm512_add_ps(_mm512_shuffle_ps(c[t], c[t + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(c[t], c[t + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(order, e);
}
#endif

}  // namespace kvh
