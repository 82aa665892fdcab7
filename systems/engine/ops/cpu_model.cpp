// The decoder's elementwise steps as ops, one pass each (residual add + RMSNorm, RoPE, SiLU gate), bf16 or fp32.
//
// Why: on a 135M-parameter model a prefill or mixed step is a few matmuls and ~20 elementwise torch ops per layer,
// each a separate pass over memory plus framework overhead; fused, each step reads and writes its tensor once. The
// row kernels (cpu_rows.h) round exactly where the torch expressions in models/llama.py round.
#include <ATen/ATen.h>
#include <torch/library.h>

// each product and sum is rounded on its own, as torch's separate ops do (no fused multiply-add)
#pragma GCC optimize("fp-contract=off")

#include "cpu_rows.h"

namespace {

using namespace kvh;

template <typename F>
void by_dtype(const at::Tensor& t, const char* what, F&& f) {
  if (t.scalar_type() == at::kBFloat16) {
    f(uint16_t{});
  } else {
    TORCH_CHECK(t.scalar_type() == at::kFloat, what, ": bf16 or fp32 only");
    f(float{});
  }
}

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// Returns norm(h + delta) and writes h + delta into h (delta may be absent: a plain RMSNorm of h, h unchanged).
at::Tensor add_rms_norm(at::Tensor h, const c10::optional<at::Tensor>& delta, const at::Tensor& weight, double eps) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous() && weight.is_contiguous() && weight.numel() == h.size(1) &&
              weight.scalar_type() == h.scalar_type(), "add_rms_norm: h [T, H] contiguous, weight [H] same dtype");
  at::Tensor d;
  if (delta.has_value()) {
    d = delta->contiguous();
    TORCH_CHECK(d.sizes() == h.sizes() && d.scalar_type() == h.scalar_type(), "add_rms_norm: delta like h");
  }
  at::Tensor out = at::empty_like(h);
  by_dtype(h, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows<T>(ptr<T>(h), d.defined() ? ptr<T>(d) : nullptr, ptr<T>(weight), ptr<T>(out), h.size(0),
                         h.size(1), static_cast<float>(eps));
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) % 2 == 0, "silu_mul: x [T, 2I]");
  at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty({x.size(0), x.size(1) / 2}, x.options());
  by_dtype(x, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(ptr<T>(xc), ptr<T>(out), x.size(0), x.size(1) / 2);
  });
  return out;
}

void rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && x.size(2) % 2 == 0,
              "rope_: x [T, H, D] with dense heads");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
              sin.sizes() == cos.sizes() && cos.scalar_type() == x.scalar_type(), "rope_: cos, sin [T, D] like x");
  by_dtype(x, "rope_", [&](auto tag) {
    using T = decltype(tag);
    rope_rows<T>(ptr<T>(x), ptr<T>(cos), ptr<T>(sin), x.size(0), x.size(1), x.size(2), x.stride(0));
  });
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("add_rms_norm(Tensor(a!) h, Tensor? delta, Tensor weight, float eps) -> Tensor", &add_rms_norm);
  m.def("silu_mul(Tensor x) -> Tensor", &silu_mul);
  m.def("rope_(Tensor(a!) x, Tensor cos, Tensor sin) -> ()", &rope_);
}
