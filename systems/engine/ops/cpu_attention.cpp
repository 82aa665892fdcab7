// The decode_attention op: paged decode attention of a batch (the kernels are in cpu_attention.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu_attention.h"

namespace {

using namespace kvh;

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                            const at::Tensor& block_table, const at::Tensor& num_tokens,
                            const c10::optional<at::Tensor>& selected, double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && block_table.dim() == 3, "decode attention: bad ranks");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "decode attention: pools must be contiguous");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "decode attention: K/V dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && num_tokens.scalar_type() == at::kInt,
              "decode attention: block_table and num_tokens must be int32");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = block_table.size(1);
  const int P = static_cast<int>(k_pool.size(1));
  const int G = static_cast<int>(Hq / Hkv);
  TORCH_CHECK(Hq % Hkv == 0 && G <= kMaxGroup && P <= kMaxPage && k_pool.size(2) == D,
              "decode attention: unsupported shapes");
  TORCH_CHECK(num_tokens.min().item<int>() >= 1, "decode attention: every head needs at least one token");
  at::Tensor table = block_table.contiguous(), counts = num_tokens.contiguous();
  at::Tensor sel;
  Listing ls{table.data_ptr<int32_t>(), counts.data_ptr<int32_t>(), nullptr, table.size(2), 0, P, window};
  if (selected.has_value()) {
    sel = selected->to(at::kLong).contiguous();
    TORCH_CHECK(sel.dim() == 3 && sel.size(0) == B && sel.size(1) == Hkv, "decode attention: selected [B, Hkv, K]");
    ls.selected = sel.data_ptr<int64_t>();
    ls.K = sel.size(2);
  }
  at::Tensor out = at::empty({B, Hq, D}, q.options().dtype(at::kFloat));
  float* op = out.data_ptr<float>();
  const int64_t rows = B * Hkv;
#ifdef KVH_HAVE_AVX512_BF16
  if (k_pool.scalar_type() == at::kBFloat16 && (D == 64 || D == 128)) {
    at::Tensor qb = q.to(at::kBFloat16).contiguous();
    const uint16_t* qp = reinterpret_cast<const uint16_t*>(qb.data_ptr());
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_pool.data_ptr());
    const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_pool.data_ptr());
    const float sc = static_cast<float>(scale);
    if (D == 64) run_bf16<64>(qp, G, sc, kp, vp, ls, rows, op);
    else run_bf16<128>(qp, G, sc, kp, vp, ls, rows, op);
    return out.to(q.scalar_type());
  }
#endif
  at::Tensor qs = (q.to(at::kFloat) * scale).contiguous();
  if (k_pool.scalar_type() == at::kBFloat16) {
    dispatch_generic<uint16_t>(D, qs.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_pool.data_ptr()),
                               reinterpret_cast<const uint16_t*>(v_pool.data_ptr()), ls, rows, G, op);
  } else {
    TORCH_CHECK(k_pool.scalar_type() == at::kFloat, "decode attention: pools must be bf16 or fp32");
    dispatch_generic<float>(D, qs.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(), ls, rows,
                            G, op);
  }
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY(kvharness_cpu, m) {
  m.def("decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor num_tokens, "
        "Tensor? selected, float scale, int window=0) -> Tensor", &decode_attention);
}
