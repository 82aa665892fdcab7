// The skinny decode GEMM of cpu_gemm.h, and the `skinny_linear` op that exposes it (tests, the LM head).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <immintrin.h>

#include "cpu_common.h"
#include "cpu_gemm.h"

// Every accumulation is an explicit fused multiply-add and nothing else may be contracted: the compiler would
// otherwise be free to fuse in one tile shape and not in another, and a row's bits would depend on its tile.
#pragma GCC optimize("fp-contract=off")

namespace kvh {
namespace {


#if defined(__AVX512F__)
constexpr int kGemmLanes = 16;
#else
constexpr int kGemmLanes = 8;
#endif

typedef float gemm_vf __attribute__((vector_size(kGemmLanes * sizeof(float))));
typedef uint32_t gemm_vu32 __attribute__((vector_size(kGemmLanes * sizeof(uint32_t))));
typedef uint16_t gemm_vu16 __attribute__((vector_size(kGemmLanes * sizeof(uint16_t))));

inline gemm_vf gemm_load(const float* p) {
  gemm_vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline gemm_vf gemm_load(const uint16_t* p) {  // bf16 -> fp32: the bits move to the high half
  gemm_vu16 h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<gemm_vf>(__builtin_convertvector(h, gemm_vu32) << 16);
}

inline gemm_vf gemm_fma(gemm_vf a, gemm_vf b, gemm_vf c) {  // a * b + c, rounded once
#if defined(__AVX512F__)
  return reinterpret_cast<gemm_vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                                   reinterpret_cast<__m512>(c)));
#elif defined(__FMA__)
  return reinterpret_cast<gemm_vf>(_mm256_fmadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b),
                                                   reinterpret_cast<__m256>(c)));
#else
  return a * b + c;
#endif
}

// The lanes of v summed in a fixed pairwise tree (the same order on every call).
inline float gemm_hsum(gemm_vf v) {
  float t[kGemmLanes];
  std::memcpy(t, &v, sizeof(v));
  for (int w = kGemmLanes / 2; w >= 1; w /= 2)
    for (int i = 0; i < w; ++i) t[i] = t[i] + t[i + w];
  return t[0];
}

inline void gemm_store(float* p, float x) { *p = x; }
inline void gemm_store(uint16_t* p, float x) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  *p = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// MR activation rows times NR weight rows over all K. Each accumulator is one chain acc = fma(x, w, acc) in k order,
// whatever MR and NR are, so every tile shape gives the same bits for the same (row, weight row) pair. With
// `prefetch`, the NR weight rows after this tile are requested a cache line at a time while it computes: rows of a
// few hundred elements are too short for the hardware prefetcher to ramp up on its own.
template <typename TW, typename TO, int MR, int NR, bool prefetch>
inline void gemm_tile(const float* x, int64_t ldx, const TW* w, int64_t ldw, int64_t K, const TW* bias,
                      TO* y, int64_t ldy) {
  constexpr int64_t kLine = 64 / sizeof(TW);
  gemm_vf acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = gemm_vf{};
  for (int64_t k = 0; k < K; k += kGemmLanes) {
    if (prefetch && k % kLine == 0)
      for (int j = 0; j < NR; ++j) __builtin_prefetch(w + (NR + j) * ldw + k, 0, 0);
    gemm_vf wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = gemm_load(w + j * ldw + k);
    for (int i = 0; i < MR; ++i) {
      const gemm_vf xv = gemm_load(x + i * ldx + k);
      for (int j = 0; j < NR; ++j) acc[i][j] = gemm_fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = gemm_hsum(acc[i][j]);
      if (bias) s += to_float(bias[j]);
      gemm_store(y + i * ldy + j, s);
    }
}

// Weight rows per tile for MR activation rows: accumulators + weight registers + one activation register fit the
// register file (16 vector registers on AVX2, 32 on AVX-512), and one row streams 8 weight rows at once.
template <int MR>
constexpr int cols_for_rows() {
  if (kGemmLanes == 16) return MR == 1 ? 8 : MR == 2 ? 8 : MR == 3 ? 6 : 5;
  return MR == 1 ? 8 : MR == 2 ? 4 : MR == 3 ? 3 : 3;
}
constexpr int64_t kGemmChunk = 120;  // weight rows per task: a multiple of every tile width above

// Few rows (M <= 4): one tile of all M rows per weight block, weights read straight from memory.
template <typename TW, typename TO, int MR>
void gemm_few_rows(const float* x, int64_t K, const TW* w, const TW* bias, TO* y, int64_t N, int64_t n0,
                   int64_t n1) {
  constexpr int NR = cols_for_rows<MR>();
  int64_t n = n0;
  for (; n + NR <= n1; n += NR)
    gemm_tile<TW, TO, MR, NR, true>(x, K, w + n * K, K, K, bias ? bias + n : nullptr, y + n, N);
  for (; n < n1; ++n) gemm_tile<TW, TO, MR, 1, false>(x, K, w + n * K, K, K, bias ? bias + n : nullptr, y + n, N);
}

// Many rows: each block of NR weight rows is widened to fp32 once into `scratch` and reused by every tile of 4
// activation rows (widening is exact, so the bits are those of the few-rows path).
template <typename TW, typename TO>
void gemm_many_rows(const float* x, int64_t M, int64_t K, const TW* w, const TW* bias, TO* y, int64_t N, int64_t n0,
                    int64_t n1, float* scratch) {
  constexpr int NR = cols_for_rows<4>();
  for (int64_t n = n0; n < n1; n += NR) {
    const int64_t nr = std::min<int64_t>(NR, n1 - n);
    for (int64_t i = 0; i < nr * K; ++i) scratch[i] = to_float(w[n * K + i]);
    float bias_f[NR];
    for (int64_t j = 0; j < nr; ++j) bias_f[j] = bias ? to_float(bias[n + j]) : 0.0f;
    const float* b = bias ? bias_f : nullptr;
    int64_t m = 0;
    if (nr == NR) {
      for (; m + 4 <= M; m += 4) gemm_tile<float, TO, 4, NR, false>(x + m * K, K, scratch, K, K, b, y + m * N + n, N);
      for (; m < M; ++m) gemm_tile<float, TO, 1, NR, false>(x + m * K, K, scratch, K, K, b, y + m * N + n, N);
    } else {
      for (int64_t j = 0; j < nr; ++j)
        for (m = 0; m < M; ++m)
          gemm_tile<float, TO, 1, 1, false>(x + m * K, K, scratch + j * K, K, K, b ? b + j : nullptr,
                                            y + m * N + n + j, N);
    }
  }
}

template <typename TW, typename TO>
void gemm_rows_impl(const float* x, int64_t M, int64_t K, const TW* w, const TW* bias, int64_t N, TO* y) {
  if (M <= 0 || N <= 0) return;
  const int64_t chunks = (N + kGemmChunk - 1) / kGemmChunk;
  parallel_tasks(chunks, [&](auto next) {
    std::vector<float> scratch(M > 4 ? cols_for_rows<4>() * K : 0);
    for (int64_t c; (c = next()) < chunks;) {
      const int64_t n0 = c * kGemmChunk, n1 = std::min(N, n0 + kGemmChunk);
      switch (M) {
        case 1: gemm_few_rows<TW, TO, 1>(x, K, w, bias, y, N, n0, n1); break;
        case 2: gemm_few_rows<TW, TO, 2>(x, K, w, bias, y, N, n0, n1); break;
        case 3: gemm_few_rows<TW, TO, 3>(x, K, w, bias, y, N, n0, n1); break;
        case 4: gemm_few_rows<TW, TO, 4>(x, K, w, bias, y, N, n0, n1); break;
        default: gemm_many_rows<TW, TO>(x, M, K, w, bias, y, N, n0, n1, scratch.data());
      }
    }
  });
}

}  // namespace

void gemm_rows(const float* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, int64_t N, uint16_t* y) {
  gemm_rows_impl<uint16_t, uint16_t>(x, M, K, w, bias, N, y);
}
void gemm_rows(const float* x, int64_t M, int64_t K, const float* w, const float* bias, int64_t N, float* y) {
  gemm_rows_impl<float, float>(x, M, K, w, bias, N, y);
}
int gemm_lanes() { return kGemmLanes; }

}  // namespace kvh

namespace {

// y = x . w^T (+ bias) in w's dtype (bf16 or fp32), every row computed alone (see cpu_gemm.h).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "skinny_linear: x [M, K], w [N, K]");
  TORCH_CHECK(w.is_contiguous() && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "skinny_linear: w contiguous bf16 or fp32");
  TORCH_CHECK(w.size(1) % kvh::gemm_lanes() == 0, "skinny_linear: K must be a multiple of ", kvh::gemm_lanes());
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == w.scalar_type() && b.numel() == w.size(0), "skinny_linear: bias [N] like w");
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), w.size(0)}, w.options());
  if (w.scalar_type() == at::kBFloat16) {
    auto u16 = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    kvh::gemm_rows(xf.data_ptr<float>(), x.size(0), w.size(1), u16(w), b.defined() ? u16(b) : nullptr, w.size(0),
                   u16(y));
  } else {
    kvh::gemm_rows(xf.data_ptr<float>(), x.size(0), w.size(1), w.data_ptr<float>(),
                   b.defined() ? b.data_ptr<float>() : nullptr, w.size(0), y.data_ptr<float>());
  }
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("skinny_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor", &skinny_linear);
  m.def("gemm_lanes() -> int", []() -> int64_t { return kvh::gemm_lanes(); });
}
