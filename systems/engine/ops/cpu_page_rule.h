// A decode step's page rule (Policy.decode_page_rule) as the fused steps run it between a layer's append and its
// attention: the fused decode step (cpu_decoder.cpp) for a whole batch, the fused mixed step (cpu_mixed.cpp) for the
// decode rows beside prompt chunks. Stated once so both choose exactly the same pages.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <vector>

#include "cpu_paged.h"
#include "cpu_scoring.h"

// Internal linkage: each including file compiles its own copy (as cpu_paged.h).
namespace kvh {
namespace {

// At each layer it covers, every listed page set (`heads`: the KV head each set scores, one set per KV head or one
// per query head) reads the pages the Quest bound of its query chooses over the first `width` pages: ranked, the k[b]
// best best-first (ranked_pages); otherwise the top k[0] ascending, the last page kept when keep_last (top_pages).
// With `held` (top pages only): every KV head reads its row of held[layer] [B, Hkv, widths[layer]], except the heads
// scored[layer] marks, whose top pages fill the front of their (padded) rows; FlexiCache's stable heads read the
// pages they hold while its unstable heads rerank. The sets go to chosen[layer], where the caller reads them after
// the step.
struct PageRule {
  at::Tensor chosen, heads, k, slots;
  std::vector<int64_t> layers;     // 1 where the rule chooses, per layer from `first`
  int64_t width = 0;
  bool ranked = true, keep_last = false;
  at::Tensor held;                    // [L, B, Hkv, W] int64, or undefined
  std::vector<int64_t> held_widths;   // per layer from `first`
  std::vector<at::Tensor> scored;     // per layer from `first`: the KV heads whose top pages replace their held rows

  bool covers(int64_t layer, int64_t first) const {
    return !layers.empty() && layers[static_cast<size_t>(layer - first)] != 0;
  }

  at::Tensor choose(const at::Tensor& q, const Storage& st, int64_t layer, int64_t first) const {
    const at::Tensor lo = st.kmin.select(1, layer).narrow(2, 0, width);
    const at::Tensor hi = st.kmax.select(1, layer).narrow(2, 0, width);
    const at::Tensor counts = st.num_tokens.select(1, layer);
    at::Tensor out = chosen.select(0, layer);
    if (held.defined()) {
      at::Tensor sel = held.select(0, layer).narrow(2, 0, held_widths[static_cast<size_t>(layer - first)]).clone();
      const at::Tensor& own = scored[static_cast<size_t>(layer - first)];
      if (own.numel()) {
        const int64_t B = q.size(0), G = q.size(1) / st.Hkv;
        const at::Tensor q_own = q.reshape({B, st.Hkv, G, -1}).index_select(1, own).reshape({B, own.numel() * G, -1});
        const at::Tensor top =
            top_pages(q_own, lo, hi, counts, st.P, k.data_ptr<int64_t>()[0], keep_last, slots, own);
        TORCH_CHECK(top.size(2) <= sel.size(2), "page rule: a held row is narrower than its head's top pages");
        const int64_t* hp = own.data_ptr<int64_t>();
        for (int64_t j = 0; j < own.numel(); ++j)
          sel.select(1, hp[j]).narrow(1, 0, top.size(2)).copy_(top.select(1, j));
      }
      out.narrow(2, 0, sel.size(2)).copy_(sel);
      return sel;
    }
    at::Tensor sel = ranked ? ranked_pages(q, lo, hi, pages_from_tokens(counts, st.P, slots, heads), slots, heads, k)
                            : top_pages(q, lo, hi, counts, st.P, k.data_ptr<int64_t>()[0], keep_last, slots, heads);
    TORCH_CHECK(sel.sizes() == out.sizes(), "page rule: chosen [L, B, sets, K] must fit the rule's page sets");
    out.copy_(sel);
    return sel;
  }
};

// The rule the arguments state for B decode rows over layers [first, last) (no rule when rule_layers is empty),
// checked over those layers before the call changes the cache: a bad rule fails with nothing of the call appended
// (a step run one layer per call has appended its earlier layers). The arguments are decode_layers' (cpu_decoder.cpp
// says what each holds).
PageRule page_rule(const Storage& st, int64_t B, int64_t num_q_heads, int64_t first, int64_t last,
                   const c10::optional<at::Tensor>& chosen, at::IntArrayRef rule_layers,
                   const c10::optional<at::Tensor>& rule_heads, const c10::optional<at::Tensor>& rule_k,
                   int64_t rule_width, bool rule_ranked, bool keep_last, const c10::optional<at::Tensor>& rule_held,
                   at::IntArrayRef rule_held_widths, const c10::optional<at::Tensor>& rule_scored,
                   const at::Tensor& slots) {
  PageRule rule;
  if (rule_layers.empty()) return rule;
  TORCH_CHECK(static_cast<int64_t>(rule_layers.size()) == last - first && chosen.has_value() &&
              rule_heads.has_value() && rule_k.has_value() && rule_width >= 1,
              "page rule: a rule needs chosen, a flag per layer, heads, k and its width");
  TORCH_CHECK(chosen->dim() == 4 && chosen->scalar_type() == at::kLong && chosen->size(0) >= last &&
              rule_k->scalar_type() == at::kLong && rule_k->is_contiguous() && rule_k->numel() == B,
              "page rule: chosen [L, B, sets, K] int64, k [B] int64");
  TORCH_CHECK(rule_width <= st.M, "page rule: the rule's width exceeds the pages a head can hold");
  const at::Tensor heads = rule_heads->to(at::kLong).contiguous();
  const int64_t* hp = heads.data_ptr<int64_t>();
  const int64_t* kp = rule_k->data_ptr<int64_t>();
  int64_t k_most = 0;
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(kp[b] >= 1, "page rule: a rule reads at least one page per head");
    k_most = std::max(k_most, kp[b]);
  }
  for (int64_t j = 0; j < heads.numel(); ++j)
    TORCH_CHECK(hp[j] >= 0 && hp[j] < st.Hkv, "page rule: a rule's head is not a KV head");
  TORCH_CHECK(heads.numel() > 0 && num_q_heads % heads.numel() == 0 && chosen->size(1) == B &&
              chosen->size(2) == heads.numel(), "page rule: chosen must be [L, B, sets, K] for the rule's sets");
  rule = PageRule{*chosen, heads, *rule_k, slots,
                  std::vector<int64_t>(rule_layers.begin(), rule_layers.end()), rule_width, rule_ranked, keep_last};
  if (!rule_held.has_value()) {
    TORCH_CHECK(chosen->size(3) == std::min(rule_ranked ? k_most : kp[0], rule_width),
                "page rule: chosen must be [L, B, sets, min(K, width)] for the rule's sets");
    return rule;
  }
  const at::Tensor& held = *rule_held;
  TORCH_CHECK(!rule_ranked && heads.numel() == st.Hkv && rule_scored.has_value() &&
                  static_cast<int64_t>(rule_held_widths.size()) == last - first,
              "page rule: held sets are top pages, one set per KV head, with widths and scored heads");
  TORCH_CHECK(held.scalar_type() == at::kLong && held.dim() == 4 && held.size(0) >= last && held.size(1) == B &&
                  held.size(2) == st.Hkv && held.size(3) <= chosen->size(3) &&
                  rule_scored->scalar_type() == at::kBool && rule_scored->dim() == 2 &&
                  rule_scored->size(0) >= last && rule_scored->size(1) == st.Hkv,
              "page rule: held [L, B, Hkv, W] int64 (W within chosen), scored [L, Hkv] bool");
  // only the call's layers: a step run one layer per call checks each layer once, not the whole stack per call
  const at::Tensor held_here = held.narrow(0, first, last - first);
  TORCH_CHECK(held_here.numel() == 0 ||
                  (held_here.min().item<int64_t>() >= -1 && held_here.max().item<int64_t>() < st.M),
              "page rule: a held page outside [0, the pages a head can hold) and PAD (-1)");
  const int64_t top = std::min(kp[0], rule_width);
  for (int64_t i = 0; i < last - first; ++i) {
    const int64_t w = rule_held_widths[static_cast<size_t>(i)];
    rule.scored.push_back(rule_scored->select(0, first + i).nonzero().view(-1));
    TORCH_CHECK(!rule.covers(first + i, first) || (w >= (rule.scored.back().numel() ? top : 1) && w <= held.size(3)),
                "page rule: a held width below its scored heads' top pages or beyond held");
  }
  rule.held = held.contiguous();
  rule.held_widths.assign(rule_held_widths.begin(), rule_held_widths.end());
  return rule;
}

}  // namespace
}  // namespace kvh
