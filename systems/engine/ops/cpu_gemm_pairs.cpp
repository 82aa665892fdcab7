// bf16 weights on CPUs with AVX512-BF16: the skinny GEMM's chains by vdpbf16ps over pairs of k (cpu_gemm.h).
#include <cstdint>
#include <cstring>
#include <vector>

#include <immintrin.h>

#include "cpu_common.h"
#include "cpu_gemm.h"

// the fallback chain takes explicit fused multiply-adds only, as cpu_gemm.cpp's does
#pragma GCC optimize("fp-contract=off")
#include "cpu_gemm_core.h"

namespace kvh {
namespace {

// vdpbf16ps adds two bf16 products to an fp32 lane, the high halves' product first and then the low halves', each
// addition rounded once to nearest even, with subnormal inputs and results flushed to zero. A bf16 product is exact
// in fp32, so with k in the high half and k + 1 in the low half one instruction takes two steps of the FMA chain
// above, bit for bit, unless a subnormal appears. None can where every nonzero factor is at least 2^-56 in
// magnitude: every product is then a multiple of 2^-126 (8-bit significands, exponents >= -56 each), so is every
// rounded partial sum, and a nonzero multiple of 2^-126 is a normal number. The weights are checked once, at
// packing (gemm_pairs_fit), a step's activations on every call; a call whose activations fail the check (or are
// not bf16 values) runs the FMA chain over the same layout. Half the instructions of the FMA chain per weight:
// where a decode step's rows make the product compute-bound (4 rows and more), up to twice as fast.
constexpr uint32_t kMinPairExponent = 127 - 56;   // biased exponent of 2^-56

// 1 where a bf16 is 0 (either sign) or finite and at least 2^-56 in magnitude, else 0; branch-free so the loops
// over a call's activations vectorize (done on the calling thread before the product, per call).
inline uint32_t pair_factor(uint32_t b) {
  const uint32_t mag = b & 0x7FFFu, e = mag >> 7;
  return static_cast<uint32_t>(mag == 0) |
         (static_cast<uint32_t>(e >= kMinPairExponent) & static_cast<uint32_t>(e != 0xFFu));
}

// Panel row k2 of a pair panel: output j's weights for k = 2 k2 (high half) and 2 k2 + 1 (low half) in dword j.
void pack_pairs_impl(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed) {
  const int64_t panels = (N + kPanel - 1) / kPanel, K2 = K / 2;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t k2 = 0; k2 < K2; ++k2)
      for (int j = 0; j < kPanel; ++j) {
        const int64_t n = p * kPanel + j;
        uint16_t* dst = packed + ((p * K2 + k2) * kPanel + j) * 2;
        dst[0] = n < N ? w[n * K + 2 * k2 + 1] : uint16_t{0};
        dst[1] = n < N ? w[n * K + 2 * k2] : uint16_t{0};
      }
}

// x's rows as dwords of bf16 pairs in the weights' order (k high, k + 1 low); false where a value is not a bf16 that
// pair_factor accepts. A little-endian dword of x holds k low and k + 1 high: the halves swap.
inline bool pair_rows(const uint16_t* x, int64_t count, uint32_t* pairs) {
  uint32_t fits = 1;
  for (int64_t i = 0; i < 2 * count; ++i) fits &= pair_factor(x[i]);
  for (int64_t i = 0; i < count; ++i) {
    uint32_t d;
    std::memcpy(&d, x + 2 * i, 4);
    pairs[i] = (d << 16) | (d >> 16);
  }
  return fits != 0;
}
inline bool pair_rows(const float* x, int64_t count, uint32_t* pairs) {
  uint32_t fits = 1;
  for (int64_t i = 0; i < 2 * count; ++i) {
    uint32_t u;
    std::memcpy(&u, x + i, 4);
    fits &= static_cast<uint32_t>((u & 0xFFFFu) == 0) & pair_factor(u >> 16);
  }
  for (int64_t i = 0; i < count; ++i) {
    uint32_t a, b;
    std::memcpy(&a, x + 2 * i, 4);
    std::memcpy(&b, x + 2 * i + 1, 4);
    pairs[i] = (a & 0xFFFF0000u) | (b >> 16);
  }
  return fits != 0;
}

// The FMA chain over a pair panel, for calls whose activations pair_rows refused (rare: no need to be fast).
template <typename TO>
void pair_chain_tile(const float* x, int64_t K, const uint16_t* panel, const float* bias, TO* y, int cols) {
  for (int v = 0; v < kVectors; ++v) {
    gemm_vf acc{};
    for (int64_t k2 = 0; k2 < K / 2; ++k2) {
      gemm_vu32 bits;
      std::memcpy(&bits, panel + (k2 * kPanel + v * kGemmLanes) * 2, sizeof(bits));
      acc = gemm_fma(gemm_broadcast(x[2 * k2]), reinterpret_cast<gemm_vf>(bits & 0xFFFF0000u), acc);
      acc = gemm_fma(gemm_broadcast(x[2 * k2 + 1]), reinterpret_cast<gemm_vf>(bits << 16), acc);
    }
    float out[kGemmLanes];
    std::memcpy(out, &acc, sizeof(acc));
    for (int l = 0; l < kGemmLanes && v * kGemmLanes + l < cols; ++l) {
      const int j = v * kGemmLanes + l;
      gemm_store(y + j, bias ? out[l] + bias[j] : out[l]);
    }
  }
}

#if defined(__AVX512BF16__)
constexpr bool kPairs = true;

template <typename TO, int MR, int V0, int NV>
inline void pair_tile(const uint32_t* xp, int64_t K2, const uint16_t* panel, const float* bias, TO* y, int64_t ldy,
                      int cols) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  constexpr int64_t kRow = 2 * kPanel;       // bf16 values per panel row of pairs
  constexpr int64_t kAhead = kPrefetchBytes / (kRow * 2);
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    const uint16_t* row = panel + k2 * kRow;
    if (V0 == 0)
      for (int64_t b = 0; b < kRow * 2; b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row + kAhead * kRow) + b, 0, 3);
    __m512bh wv[NV];
    for (int v = 0; v < NV; ++v) wv[v] = (__m512bh)_mm512_loadu_si512(row + (V0 + v) * 2 * kGemmLanes);
    for (int i = 0; i < MR; ++i) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[i * K2 + k2]));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], xb, wv[v]);
    }
  }
  const int j0 = V0 * kGemmLanes, j1 = std::min(cols, (V0 + NV) * kGemmLanes);
  for (int i = 0; i < MR; ++i) {
    float out[NV * kGemmLanes];
    for (int v = 0; v < NV; ++v) _mm512_storeu_ps(out + v * kGemmLanes, acc[i][v]);
    for (int j = j0; j < j1; ++j) gemm_store(y + i * ldy + j, bias ? out[j - j0] + bias[j] : out[j - j0]);
  }
}

template <typename TO, int MR>
inline void pair_rows_tile(const uint32_t* xp, int64_t K2, const uint16_t* panel, const float* bias, TO* y,
                           int64_t ldy, int cols) {
  if constexpr (MR * kVectors <= kMaxAcc) {
    pair_tile<TO, MR, 0, kVectors>(xp, K2, panel, bias, y, ldy, cols);
  } else {
    pair_tile<TO, MR, 0, kVectors / 2>(xp, K2, panel, bias, y, ldy, cols);
    if (cols > kPanel / 2) pair_tile<TO, MR, kVectors / 2, kVectors / 2>(xp, K2, panel, bias, y, ldy, cols);
  }
}
#else
constexpr bool kPairs = false;
#endif

// y = x . w^T (+ bias) over a pair-packed weight: vdpbf16ps on the pairs, or the FMA chain where they do not fit.
template <typename TX>
void pairs_impl(const TX* x, int64_t M, int64_t K, const uint16_t* packed, const uint16_t* bias, int64_t N,
                uint16_t* y) {
  if (M <= 0 || N <= 0) return;
  // The calling thread's buffers, kept across calls. The workers below reach them through these pointers only: a
  // thread_local named inside the parallel region would be each worker's own (empty) copy.
  thread_local std::vector<float> bias_buf, wide_buf;
  thread_local std::vector<uint32_t> pairs_buf;
  const float* b = widened(bias, N, bias_buf);
  const int64_t K2 = K / 2, panels = (N + kPanel - 1) / kPanel;
  pairs_buf.resize(static_cast<size_t>(M * K2));
  const uint32_t* pairs = pairs_buf.data();
  const bool chain = !pair_rows(x, M * K2, pairs_buf.data());
  const float* wide = chain ? widened(x, M * K, wide_buf) : nullptr;
  parallel_tasks(panels, [&](auto next) {
    for (int64_t p; (p = next()) < panels;) {
      const uint16_t* panel = packed + p * K * kPanel;
      const int64_t n0 = p * kPanel;
      const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
      const float* bp = b ? b + n0 : nullptr;
      if (chain) {
        for (int64_t m = 0; m < M; ++m) pair_chain_tile(wide + m * K, K, panel, bp, y + m * N + n0, cols);
        continue;
      }
#if defined(__AVX512BF16__)
      row_tiles(M, [&](auto mr, int64_t m) {
        pair_rows_tile<uint16_t, decltype(mr)::value>(pairs + m * K2, K2, panel, bp, y + m * N + n0, N, cols);
      });
#endif
    }
  });
}

}  // namespace

bool gemm_pairs_fit(const uint16_t* w, int64_t N, int64_t K) {
  if (!kPairs || K % 2 != 0) return false;
  for (int64_t i = 0; i < N * K; ++i)
    if (!pair_factor(w[i])) return false;
  return true;
}
void gemm_pack_pairs(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed) { pack_pairs_impl(w, N, K, packed); }
void gemm_rows_pairs(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, const uint16_t* bias, int64_t N,
                     uint16_t* y) {
  pairs_impl(x, M, K, packed, bias, N, y);
}
void gemm_rows_pairs(const float* x, int64_t M, int64_t K, const uint16_t* packed, const uint16_t* bias, int64_t N,
                     uint16_t* y) {
  pairs_impl(x, M, K, packed, bias, N, y);
}

}  // namespace kvh
