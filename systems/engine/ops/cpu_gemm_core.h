// What the skinny GEMM's two kernels share (cpu_gemm.cpp: the FMA chain; cpu_gemm_pairs.cpp: vdpbf16ps over pairs
// of k): the panel shape, the GCC vector helpers and the row tiling. Included after a source's fp-contract=off.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

namespace kvh {
namespace {

#if defined(__AVX512F__)
constexpr int kGemmLanes = 16;
constexpr int kMaxAcc = 24;    // accumulators a tile may hold, of 32 registers (the rest: weights, broadcasts)
#else
constexpr int kGemmLanes = 8;
constexpr int kMaxAcc = 12;    // of 16 registers
#endif
constexpr int kMaxRows = 6;                        // rows of x a tile applies each loaded weight vector to
constexpr int kVectors = 4;                        // weight vectors per panel row
constexpr int kPanel = kVectors * kGemmLanes;      // outputs per panel
constexpr int64_t kPanelsPerTask = 1;              // o and down have 18 panels: 9 + 9 on two threads

typedef float gemm_vf __attribute__((vector_size(kGemmLanes * sizeof(float))));
typedef uint32_t gemm_vu32 __attribute__((vector_size(kGemmLanes * sizeof(uint32_t))));

inline gemm_vf gemm_load(const float* p) {
  gemm_vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// Weight vectors v and v + 1 of a panel row. bf16 panels store each pair of vectors interleaved (gemm_pack): one
// load of 2 x lanes values, the even ones (low halves) widened by a shift and the odd ones (high halves) by a mask,
// where a per-vector zero-extend costs two loads and twice the shuffles.
inline void gemm_load_pair(const float* row, gemm_vf* a, gemm_vf* b) {
  *a = gemm_load(row);
  *b = gemm_load(row + kGemmLanes);
}
inline void gemm_load_pair(const uint16_t* row, gemm_vf* a, gemm_vf* b) {
  gemm_vu32 bits;
  std::memcpy(&bits, row, sizeof(bits));
  *a = reinterpret_cast<gemm_vf>(bits << 16);
  *b = reinterpret_cast<gemm_vf>(bits & 0xFFFF0000u);
}

inline gemm_vf gemm_fma(gemm_vf a, gemm_vf b, gemm_vf c) {  // a * b + c, rounded once
#if defined(__AVX512F__)
  return reinterpret_cast<gemm_vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                   reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<gemm_vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                   reinterpret_cast<__m256>(c)));
#else
  gemm_vf r;
  for (int l = 0; l < kGemmLanes; ++l) r[l] = std::fma(a[l], b[l], c[l]);
  return r;
#endif
}

// x in every lane. Written as a loop of lane stores, GCC emitted one masked broadcast per lane (16 per row and k on
// AVX-512), which capped the product at a fifth of the FMA units' rate.
inline gemm_vf gemm_broadcast(float x) {
#if defined(__AVX512F__)
  return reinterpret_cast<gemm_vf>(_mm512_set1_ps(x));
#elif defined(__AVX__)
  return reinterpret_cast<gemm_vf>(_mm256_set1_ps(x));
#else
  gemm_vf r;
  for (int l = 0; l < kGemmLanes; ++l) r[l] = x;
  return r;
#endif
}

inline void gemm_store(float* p, float x) { *p = x; }
inline void gemm_store(uint16_t* p, float x) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  *p = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Every cache line of a panel row is prefetched this far ahead: the hardware prefetcher alone, or one line per
// 128-byte bf16 row, streamed a 3072-row gate/up product at 23 GB/s on a 33 GB/s machine (both lines, 2 KiB: 31).
constexpr int kPrefetchBytes = 2048;

// values[0, count) widened to fp32 in buf (a bias, or activation rows for an FMA chain), which each caller keeps per
// thread so a decode step's ~200 products allocate nothing; nullptr for no values. Needs cpu_common.h's to_float,
// included before this header.
template <typename T>
inline const float* widened(const T* values, int64_t count, std::vector<float>& buf) {
  if (!values) return nullptr;
  buf.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) buf[i] = to_float(values[i]);
  return buf.data();
}

// Rows [0, M) in tiles of kMaxRows, the tail in one smaller tile: tile(std::integral_constant<int, MR>{}, m).
template <typename Tile>
inline void row_tiles(int64_t M, const Tile& tile) {
  for (int64_t m = 0; m < M; m += kMaxRows) {
    switch (std::min<int64_t>(kMaxRows, M - m)) {
      case 1: tile(std::integral_constant<int, 1>{}, m); break;
      case 2: tile(std::integral_constant<int, 2>{}, m); break;
      case 3: tile(std::integral_constant<int, 3>{}, m); break;
      case 4: tile(std::integral_constant<int, 4>{}, m); break;
      case 5: tile(std::integral_constant<int, 5>{}, m); break;
      default: tile(std::integral_constant<int, kMaxRows>{}, m); break;
    }
  }
}

}  // namespace
}  // namespace kvh
