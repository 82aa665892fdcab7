// A mixed step (decode rows beside prompt chunks) or a prefill step of the whole layer stack in one call.
//
// Why: under load most of an online server's steps are mixed, and layer by layer from Python such a step is ~40
// torch calls per layer whose dispatch cost a quarter of it on a small model. The call makes the per-op path's kernel
// calls (models/llama.py forward with model_runner's attend) in its order and on the same tensors, so its numbers
// are that path's bit for bit: a product is the GEMM call Linear._mm makes, the elementwise steps are cpu_rows.h, the
// decode rows' append and attention and each chunk's store are cpu_paged.h, and a chunk's attention is the kernel
// cpu_kernels.prompt_attention picks (this project's bf16 kernel where it runs, else torch's SDPA).
//
// The decode rows read the pages a policy's page rule chooses (cpu_page_rule.h, as the fused decode step runs it), and
// each layer's q can be handed back for what a policy does after the step: its deferred eviction or its page rule's
// after-work for the decode rows, its after-prefill hook for the chunks. A step whose chunks finish a prompt under
// such a hook runs one layer per call (first, last), the hook between the calls, as the per-op path orders them.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "cpu_page_rule.h"
#include "cpu_paged.h"

// the elementwise kernels round each product and sum on their own, as torch's separate ops do
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
#include "cpu_rows.h"
#pragma GCC pop_options

namespace {

using namespace kvh;

// How Linear._mm multiplies (models/linear.py): 0 oneDNN's prepacked bf16 kernel, 1 an fp32 GEMM of the bf16
// values rounded back (CPUs without bf16 GEMMs), 2 at::linear on the weight as stored.
enum GemmKind : int64_t { kPrepacked = 0, kWidened = 1, kPlain = 2 };

at::Tensor gemm(const at::Tensor& x, int64_t kind, const at::Tensor& w, const at::Tensor& bias) {
  const c10::optional<at::Tensor> b = bias.numel() ? c10::optional<at::Tensor>(bias) : c10::nullopt;
  if (kind == kPrepacked) {
    static const c10::OperatorHandle op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
    std::vector<c10::IValue> stack{x, w, b, std::string("none"), c10::List<c10::optional<at::Scalar>>(),
                                   std::string("")};
    op.callBoxed(&stack);
    return stack[0].toTensor();
  }
  if (kind == kWidened) return at::linear(x.to(at::kFloat), w, b).to(x.scalar_type());
  return at::linear(x, w, b);
}

// One prompt chunk of the step: positions start .. end - 1 of the sequence in `slot`, rows row .. row + end - start.
struct Chunk {
  int64_t slot, start, end, row;
  int64_t size() const { return end - start; }
};

// The chunk's prompt so far, K or V [end, Hkv, D]: the first `start` tokens read back from its pages (stored by
// earlier chunks, all resident), then the chunk's own rows, as prompt_kv followed by torch.cat.
at::Tensor prompt_so_far(const at::Tensor& pool, const at::Tensor& table, const at::Tensor& chunk_rows,
                         const Chunk& c) {
  const int64_t H = chunk_rows.size(1), D = chunk_rows.size(2), P = pool.size(1);
  at::Tensor out = at::empty({c.end, H, D}, chunk_rows.options());
  const int64_t bytes = D * static_cast<int64_t>(pool.element_size());
  const auto* src = static_cast<const char*>(pool.data_ptr());
  auto* dst = static_cast<char*>(out.data_ptr());
  const int32_t* tp = table.data_ptr<int32_t>();
  for (int64_t h = 0; h < H; ++h)
    for (int64_t t = 0; t < c.start; ++t) {
      const int64_t row = static_cast<int64_t>(tp[h * table.stride(0) + (t / P) * table.stride(1)]) * P + t % P;
      std::memcpy(dst + (t * H + h) * bytes, src + row * bytes, bytes);
    }
  out.narrow(0, c.start, c.size()).copy_(chunk_rows);
  return out;
}

// The project's bf16 prompt kernel (cpu_prefill.cpp), for CPUs where torch's flash attention widens bf16 to fp32.
at::Tensor bf16_prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("kvharness_cpu::prompt_attention", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, double, bool)>();
  return op.call(q, k, v, scale, true);
}

// Store one chunk's K/V of one layer (store_prompt), count its tokens, and return its attention [n, Hq, D]: causal
// over the prompt so far, through the kernel and the call cpu_kernels.prompt_attention makes (own_kernel: its bf16
// kernel; else torch's SDPA, called as torch_attention.prompt_attention calls it).
template <typename T>
at::Tensor chunk_attention(const Storage& st, int64_t layer, const Chunk& c, const at::Tensor& q, const at::Tensor& k,
                           const at::Tensor& v, const at::Tensor& mask, double scale, bool own_kernel) {
  const at::Tensor table = st.block_table.select(0, c.slot).select(0, layer);       // [Hkv, M]
  const at::Tensor lo = st.kmin.select(0, c.slot).select(0, layer);
  const at::Tensor hi = st.kmax.select(0, c.slot).select(0, layer);
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  const int64_t mm[2] = {lo.stride(0), lo.stride(1)};
  store_pages<T>(ptr<T>(st.k_pool), ptr<T>(st.v_pool), ptr<T>(lo), ptr<T>(hi), table, ptr<T>(kc), ptr<T>(vc),
                 c.size(), st.Hkv, st.D, st.P, c.start, mm);
  st.num_tokens.select(0, c.slot).select(0, layer).fill_(static_cast<int32_t>(c.end));
  const bool later = c.start > 0;
  const at::Tensor keys = later ? prompt_so_far(st.k_pool, table, k, c) : k;
  const at::Tensor values = later ? prompt_so_far(st.v_pool, table, v, c) : v;
  if (own_kernel) return bf16_prompt_attention(q, keys, values, scale);
  const at::Tensor out = at::scaled_dot_product_attention(
      q.transpose(0, 1).unsqueeze(0), keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
      later ? c10::optional<at::Tensor>(mask) : c10::nullopt, 0.0, !later, scale, q.size(1) != k.size(1));
  return out.select(0, 0).transpose(0, 1);
}

// Every page a chunk writes has a device block in every layer of the call: checked before the first layer changes
// the cache.
void check_pages(const Storage& st, const std::vector<Chunk>& chunks, int64_t first, int64_t last) {
  const int32_t* table = st.block_table.data_ptr<int32_t>();
  for (const Chunk& c : chunks) {
    TORCH_CHECK(c.slot >= 0 && c.slot < st.block_table.size(0), "mixed_layers: a chunk's slot is not a slot");
    TORCH_CHECK(c.start >= 0 && c.end > c.start && (c.end + st.P - 1) / st.P <= st.M,
                "mixed_layers: a chunk's positions do not fit a head's pages");
    for (int64_t layer = first; layer < last; ++layer)
      for (int64_t h = 0; h < st.Hkv; ++h)
        for (int64_t page = 0; page < (c.end + st.P - 1) / st.P; ++page)
          TORCH_CHECK(table[((c.slot * st.L + layer) * st.Hkv + h) * st.M + page] != 0,
                      "mixed_layers: a page of a chunk has no device block (reserve its pages first)");
  }
}

at::Tensor mixed_layers(at::Tensor h, const c10::optional<at::Tensor>& delta, at::TensorList weights,
                        int64_t gemm_kind, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& k_pool,
                        const at::Tensor& v_pool, const at::Tensor& block_table, const at::Tensor& num_tokens,
                        const at::Tensor& kmin, const at::Tensor& kmax, const at::Tensor& slots,
                        at::IntArrayRef chunk_slots, at::IntArrayRef chunk_starts, at::IntArrayRef chunk_ends,
                        int64_t num_q_heads, int64_t intermediate, double eps, double scale,
                        bool own_prompt_kernel, int64_t first, int64_t last,
                        const c10::optional<at::Tensor>& queries, const c10::optional<at::Tensor>& chosen,
                        at::IntArrayRef rule_layers, const c10::optional<at::Tensor>& rule_heads,
                        const c10::optional<at::Tensor>& rule_k, int64_t rule_width, bool rule_ranked,
                        bool keep_last, const c10::optional<at::Tensor>& rule_held,
                        at::IntArrayRef rule_held_widths, const c10::optional<at::Tensor>& rule_scored) {
  TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "mixed_layers: h [T, hidden] contiguous");
  TORCH_CHECK(!delta.has_value() || (delta->sizes() == h.sizes() && delta->is_contiguous() &&
                                     delta->scalar_type() == h.scalar_type()), "mixed_layers: delta like h");
  TORCH_CHECK(gemm_kind >= kPrepacked && gemm_kind <= kPlain, "mixed_layers: gemm_kind 0, 1 or 2");
  TORCH_CHECK(chunk_starts.size() == chunk_slots.size() && chunk_ends.size() == chunk_slots.size(),
              "mixed_layers: a slot, start and end per chunk");
  Storage st(k_pool, v_pool, block_table, num_tokens, kmin, kmax, slots);
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == 7 * st.L, "mixed_layers: 7 weights per layer");
  const int64_t T = h.size(0), H = h.size(1), Hq = num_q_heads, D = st.D, nd = slots.numel();
  const int64_t width = (Hq + 2 * st.Hkv) * D;
  const auto dtype = h.scalar_type();
  TORCH_CHECK(k_pool.scalar_type() == dtype && kmin.scalar_type() == dtype && cos.scalar_type() == dtype &&
              sin.scalar_type() == dtype && cos.is_contiguous() && sin.is_contiguous() && cos.numel() == T * D &&
              sin.numel() == T * D, "mixed_layers: pools, bounds and cos, sin [T, D] in h's dtype");
  for (int64_t layer = 0; layer < st.L; ++layer)
    for (int norm : {0, 4})
      TORCH_CHECK(weights[7 * layer + norm].scalar_type() == dtype && weights[7 * layer + norm].is_contiguous() &&
                  weights[7 * layer + norm].numel() == H, "mixed_layers: the norms' weights [hidden] in h's dtype");
  TORCH_CHECK(nd <= T && Hq % st.Hkv == 0, "mixed_layers: query heads a multiple of the KV heads");
  std::vector<Chunk> chunks;
  int64_t row = nd;
  for (size_t i = 0; i < chunk_slots.size(); ++i) {
    chunks.push_back(Chunk{chunk_slots[i], chunk_starts[i], chunk_ends[i], row});
    row += chunk_ends[i] - chunk_starts[i];
  }
  TORCH_CHECK(row == T, "mixed_layers: h must hold the decode rows, then every chunk's rows");
  if (last < 0) last = st.L;
  TORCH_CHECK(0 <= first && first < last && last <= st.L, "mixed_layers: layers first .. last - 1 of the stack");
  TORCH_CHECK(!queries.has_value() || (queries->dim() == 4 && queries->size(0) == last - first &&
                                       queries->size(1) == T && queries->size(2) == Hq && queries->size(3) == D &&
                                       queries->scalar_type() == dtype),
              "mixed_layers: queries [last - first, T, Hq, D] in h's dtype");
  check_pages(st, chunks, first, last);
  // the decode rows' page rule over the call's layers (flags and held widths per layer from `first`)
  const PageRule rule = page_rule(st, nd, Hq, first, last, chosen, rule_layers, rule_heads, rule_k, rule_width,
                                  rule_ranked, keep_last, rule_held, rule_held_widths, rule_scored, slots);
  // built once per step, not per layer as the per-op path does: a later chunk's causal mask (SDPA's causal flag
  // puts the diagonal top-left, where the chunk's queries sit bottom-right of its keys); none for a first chunk
  std::vector<at::Tensor> masks;
  for (const Chunk& c : chunks) {
    const at::Tensor pos = at::arange(c.end, at::TensorOptions().dtype(at::kLong));
    masks.push_back(c.start > 0 ? pos.view({1, -1}) <= pos.narrow(0, c.start, c.size()).view({-1, 1})
                                : at::Tensor());
  }
  const bool own_kernel = own_prompt_kernel && dtype == at::kBFloat16 && (D == 64 || D == 128);
  // the products' outputs are read through raw pointers: their shapes are checked, not assumed
  auto product = [&](const at::Tensor& x, const at::Tensor& w, const at::Tensor& bias, int64_t n) {
    at::Tensor y = gemm(x, gemm_kind, w, bias);
    TORCH_CHECK(y.is_contiguous() && y.dim() == 2 && y.size(0) == T && y.size(1) == n && y.scalar_type() == dtype,
                "mixed_layers: a product's weight does not give [T, ", n, "]");
    return y;
  };
  at::Tensor d = delta.has_value() ? *delta : at::Tensor();
  by_dtype(h, [&](auto tag) {
    using Elem = decltype(tag);
    for (int64_t layer = first; layer < last; ++layer) {
      const at::Tensor* w = weights.data() + 7 * layer;
      at::Tensor x = at::empty_like(h);
      add_rms_norm_rows<Elem>(ptr<Elem>(h), d.defined() ? ptr<Elem>(d) : nullptr, ptr<Elem>(w[0]), ptr<Elem>(x), T,
                              H, static_cast<float>(eps));
      const at::Tensor qkv = product(x, w[1], w[2], width);
      rope_rows<Elem>(ptr<Elem>(qkv), ptr<Elem>(cos), ptr<Elem>(sin), T, Hq + st.Hkv, D, width);
      const at::Tensor qk = qkv.narrow(1, 0, (Hq + st.Hkv) * D).view({T, Hq + st.Hkv, D});
      const at::Tensor q = qk.narrow(1, 0, Hq), k = qk.narrow(1, Hq, st.Hkv);
      const at::Tensor v = qkv.narrow(1, (Hq + st.Hkv) * D, st.Hkv * D).view({T, st.Hkv, D});
      if (queries.has_value()) queries->select(0, layer - first).copy_(q);
      at::Tensor attn = at::empty({T, Hq, D}, h.options());
      if (nd > 0) {
        append_kv<Elem>(st, layer, ptr<Elem>(qkv) + Hq * D, ptr<Elem>(qkv) + (Hq + st.Hkv) * D, nd, width);
        const at::Tensor q_dec = q.narrow(0, 0, nd).contiguous();
        const at::Tensor sel = rule.covers(layer, first) ? rule.choose(q_dec, st, layer, first) : at::Tensor();
        attn.narrow(0, 0, nd).copy_(attend_pages<Elem>(q_dec, sel, st, layer, scale, 0).view({nd, Hq, D}));
      }
      for (size_t i = 0; i < chunks.size(); ++i) {
        const Chunk& c = chunks[i];
        attn.narrow(0, c.row, c.size()).copy_(chunk_attention<Elem>(
            st, layer, c, q.narrow(0, c.row, c.size()), k.narrow(0, c.row, c.size()), v.narrow(0, c.row, c.size()),
            masks[i], scale, own_kernel));
      }
      const at::Tensor o = product(attn.view({T, Hq * D}), w[3], at::Tensor(), H);
      add_rms_norm_rows<Elem>(ptr<Elem>(h), ptr<Elem>(o), ptr<Elem>(w[4]), ptr<Elem>(x), T, H,
                              static_cast<float>(eps));
      const at::Tensor gate_up = product(x, w[5], at::Tensor(), 2 * intermediate);
      at::Tensor gated = at::empty({T, intermediate}, h.options());
      silu_mul_rows<Elem>(ptr<Elem>(gate_up), ptr<Elem>(gated), T, intermediate);
      d = product(gated, w[6], at::Tensor(), H);
    }
  });
  return d;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("mixed_layers(Tensor(a!) h, Tensor? delta, Tensor[] weights, int gemm_kind, Tensor cos, Tensor sin, "
        "Tensor(b!) k_pool, Tensor(c!) v_pool, Tensor block_table, Tensor(d!) num_tokens, Tensor(e!) kmin, "
        "Tensor(f!) kmax, Tensor slots, int[] chunk_slots, int[] chunk_starts, int[] chunk_ends, int num_q_heads, "
        "int intermediate, float eps, float scale, bool own_prompt_kernel, int first=0, int last=-1, "
        "Tensor(g!)? queries=None, Tensor(h!)? chosen=None, int[] rule_layers=[], Tensor? rule_heads=None, "
        "Tensor? rule_k=None, int rule_width=0, bool rule_ranked=True, bool keep_last=False, Tensor? rule_held=None, "
        "int[] rule_held_widths=[], Tensor? rule_scored=None) -> Tensor", &mixed_layers);
}
