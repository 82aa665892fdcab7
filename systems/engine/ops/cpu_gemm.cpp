// The skinny decode GEMM of cpu_gemm.h, and the ops that expose it (`skinny_pack`, `skinny_linear`).
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
constexpr int kTileRows = 6;   // 6 x 4 accumulators + 6 broadcast rows + 1 weight vector of 32 registers
#else
constexpr int kGemmLanes = 8;
constexpr int kTileRows = 3;   // 3 x 4 accumulators + 3 broadcast rows + 1 weight vector of 16 registers
#endif
constexpr int kVectors = 4;                        // weight vectors per panel row
constexpr int kPanel = kVectors * kGemmLanes;      // outputs per panel
constexpr int64_t kPanelsPerTask = 4;

typedef float gemm_vf __attribute__((vector_size(kGemmLanes * sizeof(float))));
typedef uint32_t gemm_vu32 __attribute__((vector_size(kGemmLanes * sizeof(uint32_t))));
typedef uint16_t gemm_vu16 __attribute__((vector_size(kGemmLanes * sizeof(uint16_t))));

inline gemm_vf gemm_load(const float* p) {
  gemm_vf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline gemm_vf gemm_load(const uint16_t* p) {  // bf16 -> fp32: the bits move to the high half
#if defined(__AVX512F__)
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return reinterpret_cast<gemm_vf>(_mm512_slli_epi32(wide, 16));
#elif defined(__AVX2__)
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return reinterpret_cast<gemm_vf>(_mm256_slli_epi32(wide, 16));
#else
  gemm_vu16 h;
  std::memcpy(&h, p, sizeof(h));
  return reinterpret_cast<gemm_vf>(__builtin_convertvector(h, gemm_vu32) << 16);
#endif
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

inline void gemm_store(float* p, float x) { *p = x; }
inline void gemm_store(uint16_t* p, float x) {  // round to nearest even (finite values)
  uint32_t u;
  std::memcpy(&u, &x, 4);
  *p = static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// Output j of a panel row is the dot product x[m, :] . w[n0 + j, :] as ONE fused multiply-add chain over k = 0, 1,
// ..., K - 1, starting from zero, then + bias, rounded once to the output dtype. That order is fixed by K alone, so
// an output's bits never depend on M, on the tile of rows it falls in, or on the thread. The panel layout
// [K, kPanel] puts the kPanel weights of one k side by side: a tile reads the panel front to back (one sequential
// stream, a cache line or two per k), broadcasts x[m, k] and runs kVectors x rows independent chains.
constexpr int kPrefetchBytes = 1024;

template <typename TW, typename TO, int MR>
inline void panel_tile(const float* x, int64_t K, const TW* panel, const float* bias, TO* y, int64_t ldy, int cols) {
  gemm_vf acc[MR][kVectors];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < kVectors; ++v) acc[i][v] = gemm_vf{};
  constexpr int64_t kAhead = kPrefetchBytes / (kPanel * static_cast<int64_t>(sizeof(TW)));
  for (int64_t k = 0; k < K; ++k) {
    const TW* row = panel + k * kPanel;
    __builtin_prefetch(reinterpret_cast<const char*>(row + kAhead * kPanel), 0, 3);
    gemm_vf xb[MR];
    for (int i = 0; i < MR; ++i) {
      const float xv = x[i * K + k];
      for (int l = 0; l < kGemmLanes; ++l) xb[i][l] = xv;
    }
    for (int v = 0; v < kVectors; ++v) {
      const gemm_vf wv = gemm_load(row + v * kGemmLanes);
      for (int i = 0; i < MR; ++i) acc[i][v] = gemm_fma(xb[i], wv, acc[i][v]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    float out[kPanel];
    for (int v = 0; v < kVectors; ++v) std::memcpy(out + v * kGemmLanes, &acc[i][v], sizeof(gemm_vf));
    for (int j = 0; j < cols; ++j) gemm_store(y + i * ldy + j, bias ? out[j] + bias[j] : out[j]);
  }
}

// Every row of x against panels [p0, p1): tiles of kTileRows rows, the tail in smaller tiles.
template <typename TW, typename TO>
void panel_range(const float* x, int64_t M, int64_t K, const TW* packed, const float* bias, int64_t N, TO* y,
                 int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const TW* panel = packed + p * K * kPanel;
    const int64_t n0 = p * kPanel;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
    const float* b = bias ? bias + n0 : nullptr;
    int64_t m = 0;
    for (; m + kTileRows <= M; m += kTileRows)
      panel_tile<TW, TO, kTileRows>(x + m * K, K, panel, b, y + m * N + n0, N, cols);
    switch (M - m) {
      case 0: break;
      case 1: panel_tile<TW, TO, 1>(x + m * K, K, panel, b, y + m * N + n0, N, cols); break;
      case 2: panel_tile<TW, TO, 2>(x + m * K, K, panel, b, y + m * N + n0, N, cols); break;
#if defined(__AVX512F__)
      case 3: panel_tile<TW, TO, 3>(x + m * K, K, panel, b, y + m * N + n0, N, cols); break;
      case 4: panel_tile<TW, TO, 4>(x + m * K, K, panel, b, y + m * N + n0, N, cols); break;
      case 5: panel_tile<TW, TO, 5>(x + m * K, K, panel, b, y + m * N + n0, N, cols); break;
#endif
      default: break;
    }
  }
}

template <typename TW, typename TO>
void gemm_rows_impl(const float* x, int64_t M, int64_t K, const TW* packed, const TW* bias, int64_t N, TO* y) {
  if (M <= 0 || N <= 0) return;
  std::vector<float> bias_f(bias ? N : 0);
  for (int64_t n = 0; n < static_cast<int64_t>(bias_f.size()); ++n) bias_f[n] = to_float(bias[n]);
  const float* b = bias ? bias_f.data() : nullptr;
  const int64_t panels = (N + kPanel - 1) / kPanel, tasks = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
  parallel_tasks(tasks, [&](auto next) {
    for (int64_t t; (t = next()) < tasks;)
      panel_range<TW, TO>(x, M, K, packed, b, N, y, t * kPanelsPerTask, std::min(panels, (t + 1) * kPanelsPerTask));
  });
}

template <typename T>
void pack_impl(const T* w, int64_t N, int64_t K, T* packed) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < kPanel; ++j) {
        const int64_t n = p * kPanel + j;
        packed[(p * K + k) * kPanel + j] = n < N ? w[n * K + k] : T{};
      }
}

}  // namespace

void gemm_rows(const float* x, int64_t M, int64_t K, const uint16_t* packed, const uint16_t* bias, int64_t N,
               uint16_t* y) {
  gemm_rows_impl<uint16_t, uint16_t>(x, M, K, packed, bias, N, y);
}
void gemm_rows(const float* x, int64_t M, int64_t K, const float* packed, const float* bias, int64_t N, float* y) {
  gemm_rows_impl<float, float>(x, M, K, packed, bias, N, y);
}
void gemm_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed) { pack_impl(w, N, K, packed); }
void gemm_pack(const float* w, int64_t N, int64_t K, float* packed) { pack_impl(w, N, K, packed); }
int64_t gemm_panel() { return kPanel; }

}  // namespace kvh

namespace {

template <typename T>
T* raw(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// w [N, K] in the panel layout [ceil(N / panel), K, panel] (zero-padded) that skinny_linear reads.
at::Tensor skinny_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "skinny_pack: w [N, K] bf16 or fp32");
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = kvh::gemm_panel();
  at::Tensor packed = at::empty({(N + P - 1) / P, K, P}, w.options());
  if (w.scalar_type() == at::kBFloat16) kvh::gemm_pack(raw<uint16_t>(wc), N, K, raw<uint16_t>(packed));
  else kvh::gemm_pack(raw<float>(wc), N, K, raw<float>(packed));
  return packed;
}

// y [M, n] = x . w^T (+ bias) in w's dtype, w packed by skinny_pack; every row computed alone (see cpu_gemm.h).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kvh::gemm_panel() && packed.is_contiguous() &&
              (packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kFloat),
              "skinny_linear: w packed by skinny_pack on this machine");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == packed.size(1), "skinny_linear: x [M, K] with the packed weight's K");
  TORCH_CHECK(n > (packed.size(0) - 1) * packed.size(2) && n <= packed.size(0) * packed.size(2),
              "skinny_linear: n does not match the packed weight");
  at::Tensor b;
  if (bias.has_value()) {
    b = bias->contiguous();
    TORCH_CHECK(b.scalar_type() == packed.scalar_type() && b.numel() == n, "skinny_linear: bias [n] like w");
  }
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor y = at::empty({x.size(0), n}, packed.options());
  if (packed.scalar_type() == at::kBFloat16)
    kvh::gemm_rows(xf.data_ptr<float>(), x.size(0), x.size(1), raw<uint16_t>(packed),
                   b.defined() ? raw<uint16_t>(b) : nullptr, n, raw<uint16_t>(y));
  else
    kvh::gemm_rows(xf.data_ptr<float>(), x.size(0), x.size(1), raw<float>(packed),
                   b.defined() ? raw<float>(b) : nullptr, n, raw<float>(y));
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("skinny_pack(Tensor w) -> Tensor", &skinny_pack);
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &skinny_linear);
}
