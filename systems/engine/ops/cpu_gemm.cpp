// The skinny decode GEMM of cpu_gemm.h and the ops that expose it (`skinny_pack`, `skinny_linear`), and the
// one-thread-per-tile prompt GEMM of batch-invariant mode (`tile_linear`).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cmath>
#include <cstring>
#include <exception>
#include <vector>

#include <immintrin.h>

#include "cpu_common.h"
#include "cpu_gemm.h"
#include "cpu_skinny.h"

// Every accumulation is an explicit fused multiply-add and nothing else may be contracted: the compiler would
// otherwise be free to fuse in one tile shape and not in another, and a row's bits would depend on its tile.
#pragma GCC optimize("fp-contract=off")

#include "cpu_gemm_core.h"

namespace kvh {
namespace {

// Output j of a panel row is the dot product x[m, :] . w[n0 + j, :] as ONE fused multiply-add chain over k = 0, 1,
// ..., K - 1, starting from zero, then + bias, rounded once to the output dtype. That order is fixed by K alone, so
// an output's bits never depend on M, on the tile of rows it falls in, or on the thread. The panel layout
// [K, kPanel] puts the kPanel weights of one k side by side: a tile reads the panel front to back (one sequential
// stream, a cache line per k), broadcasts x[m, k] and applies each weight vector to all MR rows, so a panel comes
// from memory once per step and the rows of further tiles find it in L2. Vectors [V0, V0 + NV) of the panel: a
// tile of many rows takes the panel in two halves, to keep its MR x NV accumulators in registers.
template <typename TW, typename TO, int MR, int V0, int NV>
inline void panel_tile(const float* x, int64_t K, const TW* panel, const float* bias, TO* y, int64_t ldy, int cols) {
  static_assert(NV % 2 == 0 && V0 % 2 == 0 && V0 + NV <= kVectors, "vectors come in stored pairs");
  gemm_vf acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = gemm_vf{};
  constexpr int64_t kAhead = kPrefetchBytes / (kPanel * static_cast<int64_t>(sizeof(TW)));
  for (int64_t k = 0; k < K; ++k) {
    const TW* row = panel + k * kPanel;
    if (V0 == 0)
      for (int64_t b = 0; b < kPanel * static_cast<int64_t>(sizeof(TW)); b += 64)
        __builtin_prefetch(reinterpret_cast<const char*>(row + kAhead * kPanel) + b, 0, 3);
    gemm_vf wv[NV];
    for (int v = 0; v < NV; v += 2) gemm_load_pair(row + (V0 + v) * kGemmLanes, &wv[v], &wv[v + 1]);
    for (int i = 0; i < MR; ++i) {
      const gemm_vf xb = gemm_broadcast(x[i * K + k]);
      for (int v = 0; v < NV; ++v) acc[i][v] = gemm_fma(xb, wv[v], acc[i][v]);
    }
  }
  const int j0 = V0 * kGemmLanes, j1 = std::min(cols, (V0 + NV) * kGemmLanes);
  for (int i = 0; i < MR; ++i) {
    float out[NV * kGemmLanes];
    for (int v = 0; v < NV; ++v) std::memcpy(out + v * kGemmLanes, &acc[i][v], sizeof(gemm_vf));
    for (int j = j0; j < j1; ++j) gemm_store(y + i * ldy + j, bias ? out[j - j0] + bias[j] : out[j - j0]);
  }
}

// MR rows against one panel: the whole panel at once where its accumulators fit in registers, else in two halves.
template <typename TW, typename TO, int MR>
inline void rows_tile(const float* x, int64_t K, const TW* panel, const float* bias, TO* y, int64_t ldy, int cols) {
  if constexpr (MR * kVectors <= kMaxAcc) {
    panel_tile<TW, TO, MR, 0, kVectors>(x, K, panel, bias, y, ldy, cols);
  } else {
    panel_tile<TW, TO, MR, 0, kVectors / 2>(x, K, panel, bias, y, ldy, cols);
    if (cols > kPanel / 2) panel_tile<TW, TO, MR, kVectors / 2, kVectors / 2>(x, K, panel, bias, y, ldy, cols);
  }
}

// Every row of x against panels [p0, p1).
template <typename TW, typename TO>
void panel_range(const float* x, int64_t M, int64_t K, const TW* packed, const float* bias, int64_t N, TO* y,
                 int64_t p0, int64_t p1) {
  for (int64_t p = p0; p < p1; ++p) {
    const TW* panel = packed + p * K * kPanel;
    const int64_t n0 = p * kPanel;
    const int cols = static_cast<int>(std::min<int64_t>(kPanel, N - n0));
    const float* b = bias ? bias + n0 : nullptr;
    row_tiles(M, [&](auto mr, int64_t m) {
      rows_tile<TW, TO, decltype(mr)::value>(x + m * K, K, panel, b, y + m * N + n0, N, cols);
    });
  }
}

template <typename TW, typename TO>
void gemm_rows_impl(const float* x, int64_t M, int64_t K, const TW* packed, const TW* bias, int64_t N, TO* y) {
  if (M <= 0 || N <= 0) return;
  thread_local std::vector<float> bias_buf;
  const float* b = widened(bias, N, bias_buf);
  const int64_t panels = (N + kPanel - 1) / kPanel, tasks = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
  parallel_tasks(tasks, [&](auto next) {
    for (int64_t t; (t = next()) < tasks;)
      panel_range<TW, TO>(x, M, K, packed, b, N, y, t * kPanelsPerTask, std::min(panels, (t + 1) * kPanelsPerTask));
  });
}

// Where output j of a panel sits in a stored panel row: fp32 in order; bf16 with each pair of vectors interleaved,
// vector 2c's lane l at 2 * (c * lanes + l) and vector 2c + 1's lane l just after it (see gemm_load_pair).
inline int stored_at(int j, bool interleaved) {
  if (!interleaved) return j;
  const int pair = j / (2 * kGemmLanes), v = (j / kGemmLanes) % 2, l = j % kGemmLanes;
  return pair * 2 * kGemmLanes + 2 * l + v;
}

template <typename T>
void pack_impl(const T* w, int64_t N, int64_t K, T* packed) {
  const int64_t panels = (N + kPanel - 1) / kPanel;
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int j = 0; j < kPanel; ++j) {
        const int64_t n = p * kPanel + j;
        packed[(p * K + k) * kPanel + stored_at(j, sizeof(T) == 2)] = n < N ? w[n * K + k] : T{};
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

}  // namespace

namespace kvh {
namespace {

bool holds_pairs(const at::Tensor& packed) {
  return packed.size(2) == 2 * kPanel && packed.scalar_type() == at::kBFloat16;
}

void check_packed(const at::Tensor& packed, const at::Tensor& bias, int64_t N) {
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() &&
              (packed.scalar_type() == at::kBFloat16 || packed.scalar_type() == at::kFloat) &&
              (packed.size(2) == kPanel || holds_pairs(packed)),
              "skinny GEMM: the weight must be packed by skinny_pack on this machine");
  TORCH_CHECK(N > (packed.size(0) - 1) * kPanel && N <= packed.size(0) * kPanel,
              "skinny GEMM: n does not match the packed weight");
  TORCH_CHECK(!bias.defined() || (bias.scalar_type() == packed.scalar_type() && bias.numel() == N &&
                                  bias.is_contiguous()), "skinny GEMM: bias [n] contiguous, in the weight's dtype");
}

// y in the weight's dtype (TY: uint16_t for bf16), x in it or fp32.
template <typename TX, typename TY>
void rows_any(const TX* x, int64_t M, const at::Tensor& packed, const at::Tensor& bias, int64_t N, TY* y) {
  check_packed(packed, bias, N);
  constexpr bool kFloatOut = std::is_same_v<TY, float>;
  TORCH_CHECK(packed.scalar_type() == (kFloatOut ? at::kFloat : at::kBFloat16),
              "skinny GEMM: rows in the weight's dtype (or fp32) and the output in the weight's dtype");
  const int64_t K = skinny_k(packed);
  const TY* b = bias.defined() ? static_cast<const TY*>(bias.data_ptr()) : nullptr;
  if constexpr (!kFloatOut) {
    if (holds_pairs(packed)) {
      gemm_rows_pairs(x, M, K, raw<uint16_t>(packed), b, N, y);
      return;
    }
  }
  const float* xf = nullptr;
  if constexpr (std::is_same_v<TX, float>) {
    xf = x;
  } else {   // the panel layout's chains take fp32 rows
    thread_local std::vector<float> wide;
    xf = widened(x, M * K, wide);
  }
  gemm_rows(xf, M, K, raw<TY>(packed), b, N, y);
}

}  // namespace

int64_t skinny_k(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3, "skinny GEMM: the weight must be packed by skinny_pack on this machine");
  return holds_pairs(packed) ? 2 * packed.size(1) : packed.size(1);
}
void skinny_rows(const uint16_t* x, int64_t M, const at::Tensor& packed, const at::Tensor& bias, int64_t N,
                 uint16_t* y) {
  rows_any(x, M, packed, bias, N, y);
}
void skinny_rows(const float* x, int64_t M, const at::Tensor& packed, const at::Tensor& bias, int64_t N,
                 uint16_t* y) {
  rows_any(x, M, packed, bias, N, y);
}
void skinny_rows(const float* x, int64_t M, const at::Tensor& packed, const at::Tensor& bias, int64_t N, float* y) {
  rows_any(x, M, packed, bias, N, y);
}

}  // namespace kvh

namespace {

// w [N, K] in the panel layout [ceil(N / panel), K, panel] (zero-padded) that skinny_linear reads, or in bf16 pairs
// [ceil(N / panel), K / 2, 2 x panel] where they fit (kvh::gemm_pairs_fit).
at::Tensor skinny_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && (w.scalar_type() == at::kBFloat16 || w.scalar_type() == at::kFloat),
              "skinny_pack: w [N, K] bf16 or fp32");
  const at::Tensor wc = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), P = kvh::gemm_panel();
  if (w.scalar_type() == at::kBFloat16 && kvh::gemm_pairs_fit(raw<uint16_t>(wc), N, K)) {
    at::Tensor packed = at::empty({(N + P - 1) / P, K / 2, 2 * P}, w.options());
    kvh::gemm_pack_pairs(raw<uint16_t>(wc), N, K, raw<uint16_t>(packed));
    return packed;
  }
  at::Tensor packed = at::empty({(N + P - 1) / P, K, P}, w.options());
  if (w.scalar_type() == at::kBFloat16) kvh::gemm_pack(raw<uint16_t>(wc), N, K, raw<uint16_t>(packed));
  else kvh::gemm_pack(raw<float>(wc), N, K, raw<float>(packed));
  return packed;
}

// y [M, n] = x . w^T (+ bias) in w's dtype, w packed by skinny_pack; every row computed alone (see cpu_gemm.h).
at::Tensor skinny_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         int64_t n) {
  const int64_t K = kvh::skinny_k(packed);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "skinny_linear: x [M, K] with the packed weight's K");
  const at::Tensor b = bias.has_value() ? bias->contiguous() : at::Tensor();
  at::Tensor y = at::empty({x.size(0), n}, packed.options());
  if (packed.scalar_type() != at::kBFloat16) {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    kvh::skinny_rows(xf.data_ptr<float>(), x.size(0), packed, b, n, y.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    const at::Tensor xc = x.contiguous();
    kvh::skinny_rows(raw<uint16_t>(xc), x.size(0), packed, b, n, raw<uint16_t>(y));
  } else {
    const at::Tensor xf = x.to(at::kFloat).contiguous();
    kvh::skinny_rows(xf.data_ptr<float>(), x.size(0), packed, b, n, raw<uint16_t>(y));
  }
  return y;
}

// y [M, n] = x . w^T (+ bias) by oneDNN's kernel for a weight prepacked by torch.ops.mkldnn._reorder_linear_weight,
// `tile` rows per call (M a multiple of it), each call on ONE thread, the tiles shared by the threads.
//
// Why: oneDNN chooses how to split a product among threads by the thread count, and on AMX CPUs it splits the sum
// over K for narrow outputs (SmolLM2's MLP down projection, 576 outputs of a 1536-long sum), so a row's bits
// depended on torch's thread count even with fixed tiles. On one thread a tile's arithmetic is fixed by its shape
// alone. Each worker sets its own OpenMP thread count to 1 inside the region (the setting is the region's and ends
// with it), which oneDNN reads when it creates and runs its kernel; with one tile the region has one thread and the
// same setting, so a single tile never runs on two threads either.
at::Tensor tile_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n, int64_t tile) {
  TORCH_CHECK(x.dim() == 2 && tile > 0 && x.size(0) % tile == 0, "tile_linear: x [M, K] with M a multiple of tile");
  static auto linear = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<
      at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, c10::string_view,
                 c10::List<c10::optional<at::Scalar>>, c10::optional<c10::string_view>)>();
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({x.size(0), n}, x.options());
  const int64_t tiles = x.size(0) / tile;
  const int workers = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tiles)));
  std::atomic<int64_t> next{0};
  std::exception_ptr failed;
  const at::ThreadLocalState caller;   // inference mode and the rest of the caller's state, in every worker
#pragma omp parallel num_threads(workers)
  {
    omp_set_num_threads(1);
    const at::ThreadLocalStateGuard state(caller);
    try {
      for (int64_t t; (t = next.fetch_add(1)) < tiles;) {
        const at::Tensor out = linear.call(xc.narrow(0, t * tile, tile), packed, bias, "none",
                                           c10::List<c10::optional<at::Scalar>>(), "");
        TORCH_CHECK(out.size(1) == n, "tile_linear: n does not match the packed weight");
        y.narrow(0, t * tile, tile).copy_(out);
      }
    } catch (...) {  // an exception may not cross the parallel region: the first one is raised after it
#pragma omp critical
      if (!failed) failed = std::current_exception();
      next.store(tiles);
    }
  }
  if (failed) std::rethrow_exception(failed);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("skinny_pack(Tensor w) -> Tensor", &skinny_pack);
  m.def("skinny_linear(Tensor x, Tensor packed, Tensor? bias, int n) -> Tensor", &skinny_linear);
  m.def("tile_linear(Tensor x, Tensor packed, Tensor? bias, int n, int tile) -> Tensor", &tile_linear);
}
