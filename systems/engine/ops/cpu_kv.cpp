// The store_prompt op: a prompt chunk's keys and values written into one layer's head-pages, with the MinMax key
// bounds of every page it touched recomputed, in one call. The page_minmax op: listed pages' bounds recomputed
// (a decode-time eviction moves a token into a hole and shortens the last page, in every layer of every step: in
// torch the gather, masks and two bf16 reductions cost an evicting policy more per step than its attention saved).
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
#include <tuple>

#include "cpu_paged.h"

namespace {

using kvh::store_pages;

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
  kvh::by_dtype(k_pool, [&](auto tag) {
    using T = decltype(tag);
    using kvh::ptr;
    store_pages<T>(ptr<T>(k_pool), ptr<T>(v_pool), ptr<T>(kmin), ptr<T>(kmax), table, ptr<T>(kc), ptr<T>(vc), n, H,
                   D, P, start, mm);
  });
}

// k_pool [blocks, P, D]; block_ids, n_tokens [N] int (1 <= n_tokens[i] <= P) -> (kmin, kmax) [N, D] in the pool
// dtype: the bounds of each listed block's first n_tokens[i] keys.
std::tuple<at::Tensor, at::Tensor> page_minmax(const at::Tensor& k_pool, const at::Tensor& block_ids,
                                               const at::Tensor& n_tokens) {
  TORCH_CHECK(k_pool.is_contiguous() && k_pool.dim() == 3, "page_minmax: a contiguous pool [blocks, P, D]");
  const at::Tensor ids = block_ids.reshape(-1).to(at::kLong).contiguous();
  const at::Tensor fill = n_tokens.reshape(-1).to(at::kLong).contiguous();
  const int64_t N = ids.size(0), P = k_pool.size(1), D = k_pool.size(2), blocks = k_pool.size(0);
  TORCH_CHECK(fill.size(0) == N, "page_minmax: one token count per listed block");
  const int64_t* ip = ids.data_ptr<int64_t>();
  const int64_t* fp = fill.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i)
    TORCH_CHECK(ip[i] >= 0 && ip[i] < blocks && fp[i] >= 1 && fp[i] <= P,
                "page_minmax: block ids inside the pool and 1..P tokens per page");
  at::Tensor lo = at::empty({N, D}, k_pool.options()), hi = at::empty({N, D}, k_pool.options());
  kvh::by_dtype(k_pool, [&](auto tag) {
    using T = decltype(tag);
    using kvh::ptr;
    const T* pool = ptr<T>(k_pool);
    T* lp = ptr<T>(lo);
    T* hp = ptr<T>(hi);
    at::parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {     // pages are independent: any split
      for (int64_t i = begin; i < end; ++i)
        kvh::page_bounds(pool + ip[i] * P * D, fp[i], D, lp + i * D, hp + i * D);
    });
  });
  return {lo, hi};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("store_prompt(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) kmin, Tensor(d!) kmax, Tensor table, "
        "Tensor k, Tensor v, int start) -> ()", &store_prompt);
  m.def("page_minmax(Tensor k_pool, Tensor block_ids, Tensor n_tokens) -> (Tensor, Tensor)", &page_minmax);
}
