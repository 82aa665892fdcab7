// Shared by the CPU kernels: bf16 loads, the AVX512-BF16 switch and the 16-lane transposing sum.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVH_HAVE_AVX512_BF16 1
#endif

namespace kvh {

constexpr int kMaxGroup = 16;
constexpr int kMaxPage = 256;

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {  // bf16: the high half of an fp32
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

#ifdef KVH_HAVE_AVX512_BF16
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
