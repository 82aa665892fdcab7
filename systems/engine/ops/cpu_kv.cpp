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

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("store_prompt(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor(c!) kmin, Tensor(d!) kmax, Tensor table, "
        "Tensor k, Tensor v, int start) -> ()", &store_prompt);
}
