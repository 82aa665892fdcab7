// A decode step of the decoder layers in one call: no Python, and no torch op, between the pieces of a layer.
//
// Why: a decode step of a small model is ~25 small ops per layer; dispatched one by one from Python they cost as much
// as the arithmetic (a 1k-context step of SmolLM2 took 25-43 ms where its weights stream in 9). Here a layer is
// residual add + RMSNorm, the stacked QKV product, RoPE, the KV append (pages, MinMax bounds, token counts),
// attention over all or the selected pages, the output product, add + RMSNorm, the gate/up product, the SiLU gate
// and the down product, each a kernel called straight from C++ on raw pointers. The elementwise kernels and the
// attention are the same code as the per-op path (cpu_rows.h, cpu_attention.h), so they round where it rounds; the
// products use the skinny GEMM (cpu_gemm.h, through cpu_skinny.h), whose rows never depend on their batch.
//
// A policy that chooses pages or evicts at decode time by its own code runs in Python between two halves of a layer:
// decode_layer_in (up to the KV append, returning q) and decode_layer_attend / decode_layer_mlp (attention over its
// pages and the rest). decode_layers runs whole layers for a policy that reads every page, for one that evicts once
// per step after every layer (handing back each layer's q, so its eviction scores see exactly the queries the
// per-layer hook saw), and for one whose page choice is a rule stated as data (Quest's top pages by the MinMax
// bound): the rule then runs here, with the scoring kernels of cpu_scoring.cpp, between the append and attention.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "cpu_skinny.h"
#include "cpu_page_rule.h"
#include "cpu_paged.h"

// the elementwise kernels round each product and sum on their own, as torch's separate ops do
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#include "cpu_rows.h"
#pragma GCC pop_options

namespace {

using namespace kvh;

// h += delta; q, k, v = rope(norm(h) . Wqkv); K/V appended. Returns q [B, Hq, D].
template <typename T>
at::Tensor layer_in(at::Tensor& h, const T* delta, const at::Tensor& ln1, const at::Tensor& wqkv,
                    const at::Tensor& bqkv, const at::Tensor& cos, const at::Tensor& sin, const Storage& st,
                    int64_t layer, int64_t Hq, double eps) {
  const int64_t B = h.size(0), H = h.size(1), D = st.D, width = (Hq + 2 * st.Hkv) * D;
  at::Tensor x = at::empty_like(h);
  add_rms_norm_rows<T>(ptr<T>(h), delta, ptr<T>(ln1), ptr<T>(x), B, H, static_cast<float>(eps));
  at::Tensor qkv = at::empty({B, width}, h.options());
  skinny_rows(ptr<T>(x), B, wqkv, bqkv, width, ptr<T>(qkv));
  rope_rows<T>(ptr<T>(qkv), ptr<T>(cos), ptr<T>(sin), B, Hq + st.Hkv, D, width);
  append_kv<T>(st, layer, ptr<T>(qkv) + Hq * D, ptr<T>(qkv) + (Hq + st.Hkv) * D, B, width);
  return qkv.narrow(1, 0, Hq * D).contiguous().view({B, Hq, D});
}

// h += attn . Wo; returns the MLP's output (the next layer's delta): down(silu(gate) * up) of norm(h).
template <typename T>
at::Tensor layer_mlp(at::Tensor& h, const at::Tensor& attn, const at::Tensor& wo, const at::Tensor& ln2,
                     const at::Tensor& wgu, const at::Tensor& wdown, int64_t I, double eps) {
  const int64_t B = h.size(0), H = h.size(1);
  at::Tensor o = at::empty_like(h);
  skinny_rows(ptr<T>(attn), B, wo, at::Tensor(), H, ptr<T>(o));
  at::Tensor x = at::empty_like(h);
  add_rms_norm_rows<T>(ptr<T>(h), ptr<T>(o), ptr<T>(ln2), ptr<T>(x), B, H, static_cast<float>(eps));
  at::Tensor gu = at::empty({B, 2 * I}, h.options());
  skinny_rows(ptr<T>(x), B, wgu, at::Tensor(), 2 * I, ptr<T>(gu));
  at::Tensor gated = at::empty({B, I}, h.options());
  silu_mul_rows<T>(ptr<T>(gu), ptr<T>(gated), B, I);
  at::Tensor delta = at::empty_like(h);
  skinny_rows(ptr<T>(gated), B, wdown, at::Tensor(), H, ptr<T>(delta));
  return delta;
}

at::Tensor opt(const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

void check_rows(const at::Tensor& h, const c10::optional<at::Tensor>& delta) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "fused decode: h [B, hidden] contiguous");
  TORCH_CHECK(!delta.has_value() || (delta->sizes() == h.sizes() && delta->is_contiguous() &&
                                     delta->scalar_type() == h.scalar_type()), "fused decode: delta like h");
}

at::Tensor decode_layer_in(at::Tensor h, const c10::optional<at::Tensor>& delta, const at::Tensor& ln1,
                           const at::Tensor& wqkv, const c10::optional<at::Tensor>& bqkv, const at::Tensor& cos,
                           const at::Tensor& sin, const at::Tensor& k_pool, const at::Tensor& v_pool,
                           const at::Tensor& block_table, const at::Tensor& num_tokens, const at::Tensor& kmin,
                           const at::Tensor& kmax, const at::Tensor& slots, int64_t layer, int64_t num_q_heads,
                           double eps) {
  check_rows(h, delta);
  Storage st(k_pool, v_pool, block_table, num_tokens, kmin, kmax, slots);
  at::Tensor q;
  by_dtype(h, [&](auto tag) {
    using T = decltype(tag);
    q = layer_in<T>(h, delta.has_value() ? ptr<T>(*delta) : nullptr, ln1, wqkv, opt(bqkv), cos, sin, st, layer,
                    num_q_heads, eps);
  });
  return q;
}

// The per-op path's append (a mixed step's decode rows): k, v [B, Hkv, D] in the pools' dtype.
void append_decode_kv(const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_table,
                      const at::Tensor& num_tokens, const at::Tensor& kmin, const at::Tensor& kmax,
                      const at::Tensor& slots, int64_t layer, const at::Tensor& k, const at::Tensor& v) {
  Storage st(k_pool, v_pool, block_table, num_tokens, kmin, kmax, slots);
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.size(1) == st.Hkv && k.size(2) == st.D &&
              k.scalar_type() == k_pool.scalar_type() && v.scalar_type() == k_pool.scalar_type(),
              "append_decode: k, v [B, Hkv, D] in the pools' dtype");
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  by_dtype(k_pool, [&](auto tag) {
    using T = decltype(tag);
    append_kv<T>(st, layer, ptr<T>(kc), ptr<T>(vc), k.size(0), st.Hkv * st.D);
  });
}

at::Tensor decode_layer_attend(const at::Tensor& q, const c10::optional<at::Tensor>& selected,
                               const at::Tensor& k_pool, const at::Tensor& v_pool, const at::Tensor& block_table,
                               const at::Tensor& num_tokens, const at::Tensor& kmin, const at::Tensor& kmax,
                               const at::Tensor& slots, int64_t layer, double scale, int64_t window) {
  Storage st(k_pool, v_pool, block_table, num_tokens, kmin, kmax, slots);
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous() && q.size(2) == st.D, "fused decode: q [B, Hq, D] contiguous");
  at::Tensor out;
  by_dtype(q, [&](auto tag) { out = attend_pages<decltype(tag)>(q, opt(selected), st, layer, scale, window); });
  return out;
}

at::Tensor decode_layer_mlp(at::Tensor h, const at::Tensor& attn, const at::Tensor& wo, const at::Tensor& ln2,
                            const at::Tensor& wgu, const at::Tensor& wdown, int64_t intermediate, double eps) {
  check_rows(h, c10::nullopt);
  at::Tensor delta;
  by_dtype(h, [&](auto tag) {
    delta = layer_mlp<decltype(tag)>(h, attn.contiguous(), wo, ln2, wgu, wdown, intermediate, eps);
  });
  return delta;
}

// Layers [first, last) of a decode step for a policy that reads every page. weights: 7 per layer from `first`
// (ln1, qkv, qkv bias or an empty tensor, o, ln2, gate_up, down; the products packed by skinny_pack); windows: each
// layer's sliding window (0: none). queries: [L, B, Hq, D] in the model dtype, or none; row `layer` receives that
// layer's post-RoPE q (a deferred eviction scores with it after the step). A page rule (cpu_page_rule.h) is given by
// chosen [L, B, sets, K] int64, rule_layers (1 per layer it covers, empty: none), rule_heads [sets], rule_k [B]
// int64, rule_width, rule_ranked and keep_last, and for a rule beside held sets rule_held [L, B, Hkv, W],
// rule_held_widths (per layer from `first`) and rule_scored [L, Hkv]; the covered layers attend over exactly the
// sets it wrote.
// Returns the last layer's delta (h updated).
at::Tensor decode_layers(at::Tensor h, const c10::optional<at::Tensor>& delta, at::TensorList weights,
                         const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                         const at::Tensor& v_pool, const at::Tensor& block_table, const at::Tensor& num_tokens,
                         const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& slots, int64_t first,
                         int64_t last, int64_t num_q_heads, int64_t intermediate, double eps, double scale,
                         at::IntArrayRef windows, const c10::optional<at::Tensor>& queries,
                         const c10::optional<at::Tensor>& chosen, at::IntArrayRef rule_layers,
                         const c10::optional<at::Tensor>& rule_heads, const c10::optional<at::Tensor>& rule_k,
                         int64_t rule_width, bool rule_ranked, bool keep_last,
                         const c10::optional<at::Tensor>& rule_held, at::IntArrayRef rule_held_widths,
                         const c10::optional<at::Tensor>& rule_scored) {
  check_rows(h, delta);
  TORCH_CHECK(!queries.has_value() || (queries->dim() == 4 && queries->size(0) >= last &&
                                       queries->scalar_type() == h.scalar_type()),
              "decode_layers: queries [L, B, Hq, D] in the model dtype");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 7 * (last - first) &&
              static_cast<int64_t>(windows.size()) == last - first, "decode_layers: 7 weights and a window per layer");
  Storage st(k_pool, v_pool, block_table, num_tokens, kmin, kmax, slots);
  // every check before the first layer changes the cache: a bad rule fails with nothing appended
  const PageRule rule = page_rule(st, h.size(0), num_q_heads, first, last, chosen, rule_layers, rule_heads, rule_k,
                                  rule_width, rule_ranked, keep_last, rule_held, rule_held_widths, rule_scored, slots);
  at::Tensor d = delta.has_value() ? *delta : at::Tensor();
  by_dtype(h, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t layer = first; layer < last; ++layer) {
      const at::Tensor* w = weights.data() + 7 * (layer - first);
      const at::Tensor bias = w[2].numel() ? w[2] : at::Tensor();
      at::Tensor q = layer_in<T>(h, d.defined() ? ptr<T>(d) : nullptr, w[0], w[1], bias, cos, sin, st, layer,
                                 num_q_heads, eps);
      if (queries.has_value()) queries->select(0, layer).copy_(q);
      const at::Tensor sel = rule.covers(layer, first) ? rule.choose(q, st, layer, first) : at::Tensor();
      d = layer_mlp<T>(h, attend_pages<T>(q, sel, st, layer, scale, windows[layer - first]), w[3], w[4], w[5], w[6],
                       intermediate, eps);
    }
  });
  return d;
}

// The final norm of h + delta and the LM head's logits [B, V] in the model dtype.
at::Tensor decode_logits(at::Tensor h, const c10::optional<at::Tensor>& delta, const at::Tensor& norm,
                         const at::Tensor& lm_head, int64_t vocab, double eps) {
  check_rows(h, delta);
  at::Tensor logits = at::empty({h.size(0), vocab}, h.options());
  by_dtype(h, [&](auto tag) {
    using T = decltype(tag);
    at::Tensor x = at::empty_like(h);
    add_rms_norm_rows<T>(ptr<T>(h), delta.has_value() ? ptr<T>(*delta) : nullptr, ptr<T>(norm), ptr<T>(x),
                         h.size(0), h.size(1), static_cast<float>(eps));
    skinny_rows(ptr<T>(x), h.size(0), lm_head, at::Tensor(), vocab, ptr<T>(logits));
  });
  return logits;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("decode_layer_in(Tensor(a!) h, Tensor? delta, Tensor ln1, Tensor qkv, Tensor? qkv_bias, Tensor cos, "
        "Tensor sin, Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor block_table, Tensor(d!) num_tokens, "
        "Tensor(e!) kmin, Tensor(f!) kmax, Tensor slots, int layer, int num_q_heads, float eps) -> Tensor",
        &decode_layer_in);
  m.def("append_decode_kv(Tensor(a!) k_pool, Tensor(b!) v_pool, Tensor block_table, Tensor(c!) num_tokens, "
        "Tensor(d!) kmin, Tensor(e!) kmax, Tensor slots, int layer, Tensor k, Tensor v) -> ()", &append_decode_kv);
  m.def("decode_layer_attend(Tensor q, Tensor? selected, Tensor k_pool, Tensor v_pool, Tensor block_table, "
        "Tensor num_tokens, Tensor kmin, Tensor kmax, Tensor slots, int layer, float scale, int window) -> Tensor",
        &decode_layer_attend);
  m.def("decode_layer_mlp(Tensor(a!) h, Tensor attn, Tensor o, Tensor ln2, Tensor gate_up, Tensor down, "
        "int intermediate, float eps) -> Tensor", &decode_layer_mlp);
  m.def("decode_layers(Tensor(a!) h, Tensor? delta, Tensor[] weights, Tensor cos, Tensor sin, Tensor(b!) k_pool, "
        "Tensor(c!) v_pool, Tensor block_table, Tensor(d!) num_tokens, Tensor(e!) kmin, Tensor(f!) kmax, "
        "Tensor slots, int first, int last, int num_q_heads, int intermediate, float eps, float scale, int[] windows, "
        "Tensor(g!)? queries=None, Tensor(h!)? chosen=None, int[] rule_layers=[], Tensor? rule_heads=None, "
        "Tensor? rule_k=None, int rule_width=0, bool rule_ranked=True, bool keep_last=False, Tensor? rule_held=None, "
        "int[] rule_held_widths=[], Tensor? rule_scored=None) -> Tensor",
        &decode_layers);
  m.def("decode_logits(Tensor(a!) h, Tensor? delta, Tensor norm, Tensor lm_head, int vocab, float eps) -> Tensor",
        &decode_logits);
}
