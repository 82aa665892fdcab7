// The store_prompt op: a prompt chunk's keys and values written into one layer's head-pages, with the MinMax key
// bounds of every page it touched recomputed, in one call.
//
// Why: a prefill (or mixed) step stores each chunk in every layer. In torch that was a dozen small ops per layer
// (page arithmetic, two transposed copies, index_copy_, then the bounds: a gather of the pages, masks and two
// reductions), about a millisecond per layer for a 256-token chunk on 2 cores, a sixth of a mixed step. The values
// are those of the torch path exactly: the copies are copies, and a min or max is exact in any order.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_common.h"

namespace {

using kvh::to_float;

template <typename T>
void store_pages(T* k_pool, T* v_pool, T* kmin, T* kmax, const at::Tensor& table, const T* k, const T* v, int64_t n,
                 int64_t H, int64_t D, int64_t P, int64_t start, const int64_t mm[2]) {
  const int32_t* tp = table.data_ptr<int32_t>();
  const int64_t ts0 = table.stride(0), ts1 = table.stride(1);
  const int64_t first = start / P, end = (start + n + P - 1) / P;
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t t = 0; t < n; ++t) {
      const int64_t pos = start + t;
      const int64_t row = static_cast<int64_t>(tp[h * ts0 + (pos / P) * ts1]) * P + pos % P;
      std::memcpy(k_pool + row * D, k + (t * H + h) * D, D * sizeof(T));
      std::memcpy(v_pool + row * D, v + (t * H + h) * D, D * sizeof(T));
    }
    for (int64_t page = first; page < end; ++page) {
      const T* rows = k_pool + static_cast<int64_t>(tp[h * ts0 + page * ts1]) * P * D;
      const int64_t fill = std::min<int64_t>(P, start + n - page * P);
      T* lo = kmin + h * mm[0] + page * mm[1];
      T* hi = kmax + h * mm[0] + page * mm[1];
      std::memcpy(lo, rows, D * sizeof(T));
      std::memcpy(hi, rows, D * sizeof(T));
      for (int64_t r = 1; r < fill; ++r) {
        const T* x = rows + r * D;
        for (int64_t d = 0; d < D; ++d) {
          const float fx = to_float(x[d]);
          if (fx < to_float(lo[d])) lo[d] = x[d];
          if (fx > to_float(hi[d])) hi[d] = x[d];
        }
      }
    }
  }
}

// k_pool, v_pool [blocks, P, D]; kmin, kmax [H, M, D] (one (slot, layer)'s bounds, last dim contiguous); table
// [H, >= pages through the chunk's end] int32 blocks (any strides), every one resident; k, v [n, H, D] in the pool
// dtype; the chunk holds positions start .. start + n - 1.
void store_prompt(at::Tensor k_pool, at::Tensor v_pool, at::Tensor kmin, at::Tensor kmax, const at::Tensor& table,
                  const at::Tensor& k, const at::Tensor& v, int64_t start) {
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous() && k_pool.dim() == 3,
              "store_prompt: contiguous pools [blocks, P, D]");
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.scalar_type() == k_pool.scalar_type() &&
              v.scalar_type() == k_pool.scalar_type() && v_pool.scalar_type() == k_pool.scalar_type(),
              "store_prompt: k, v [n, H, D] in the pools' dtype");
  TORCH_CHECK(kmin.dim() == 3 && kmin.strides() == kmax.strides() && kmin.stride(2) == 1 &&
              kmin.scalar_type() == k_pool.scalar_type(), "store_prompt: kmin, kmax [H, M, D] like the pools");
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kInt, "store_prompt: table [H, pages] int32");
  const int64_t n = k.size(0), H = k.size(1), D = k.size(2), P = k_pool.size(1);
  TORCH_CHECK(k_pool.size(2) == D && kmin.size(0) == H && kmin.size(2) == D && table.size(0) == H &&
              table.size(1) * P >= start + n && kmin.size(1) * P >= start + n, "store_prompt: shapes disagree");
  if (n == 0) return;
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  const int64_t mm[2] = {kmin.stride(0), kmin.stride(1)};
  if (k_pool.scalar_type() == at::kBFloat16) {
    auto p = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
    store_pages<uint16_t>(p(k_pool), p(v_pool), p(kmin), p(kmax), table, p(kc), p(vc), n, H, D, P, start, mm);
  } else {
    TORCH_CHECK(k_pool.scalar_type() == at::kFloat, "store_prompt: pools must be bf16 or fp32");
    store_pages<float>(k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), kmin.data_ptr<float>(),
                       kmax.data_ptr<float>(), table, kc.data_ptr<float>(), vc.data_ptr<float>(), n, H, D, P, start,
                       mm);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("store_prompt(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) kmin, Tensor(d!) kmax, Tensor table, "
        "Tensor k, Tensor v, int start) -> ()", &store_prompt);
}
