// The engine's paged KV storage as the C++ steps write and read it (append, store a chunk, attend over pages).
//
// A decode token is appended per sequence, a prompt chunk stored in position order, decode queries attend over a
// head's pages. Shared by the per-op KV op (cpu_kv.cpp), the fused decode step (cpu_decoder.cpp) and the fused mixed
// step (cpu_mixed.cpp), so each writes the cache and reads it exactly as the others do. The writes are copies and
// the MinMax bounds exact mins and maxes, the same values in any order.
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "cpu_attention.h"
#include "cpu_common.h"

// Internal linkage: each including file compiles its own copy (as cpu_attention.h).
namespace kvh {
namespace {

template <typename T>
T* ptr(const at::Tensor& t) { return reinterpret_cast<T*>(t.data_ptr()); }

// f(uint16_t{}) for a bf16 tensor, f(float{}) for fp32: the element type the kernels run on.
template <typename F>
void by_dtype(const at::Tensor& t, F&& f) {
  if (t.scalar_type() == at::kBFloat16) {
    f(uint16_t{});
  } else {
    TORCH_CHECK(t.scalar_type() == at::kFloat, "the CPU kernels take bf16 or fp32 only");
    f(float{});
  }
}

// The engine's paged KV storage for one call.
struct Storage {
  at::Tensor k_pool, v_pool, block_table, num_tokens, kmin, kmax;
  const int64_t* slots;
  int64_t L, Hkv, M, P, D;

  Storage(const at::Tensor& k, const at::Tensor& v, const at::Tensor& table, const at::Tensor& counts,
          const at::Tensor& lo, const at::Tensor& hi, const at::Tensor& slot_ids)
      : k_pool(k), v_pool(v), block_table(table), num_tokens(counts), kmin(lo), kmax(hi),
        slots(slot_ids.data_ptr<int64_t>()), L(table.size(1)), Hkv(table.size(2)), M(table.size(3)),
        P(k.size(1)), D(k.size(2)) {
    TORCH_CHECK(k.is_contiguous() && v.is_contiguous() && table.is_contiguous() && counts.is_contiguous() &&
                lo.is_contiguous() && hi.is_contiguous(), "paged KV: storage must be contiguous");
    TORCH_CHECK(table.scalar_type() == at::kInt && counts.scalar_type() == at::kInt &&
                slot_ids.scalar_type() == at::kLong && slot_ids.is_contiguous(),
                "paged KV: int32 tables and counts, int64 slots");
  }
  int64_t head_row(int64_t b, int64_t layer, int64_t h) const { return (slots[b] * L + layer) * Hkv + h; }
};

// Append each sequence's new K/V to its heads' last pages, keeping the pages' MinMax bounds exact and counting the
// token, as torch_kv.append_decode does: head h of sequence b reads k_rows + b * stride + h * D (and v_rows).
template <typename T>
void append_kv(const Storage& st, int64_t layer, const T* k_rows, const T* v_rows, int64_t B, int64_t stride) {
  const int64_t D = st.D;
  T* kp = ptr<T>(st.k_pool);
  T* vp = ptr<T>(st.v_pool);
  T* lo = ptr<T>(st.kmin);
  T* hi = ptr<T>(st.kmax);
  int32_t* counts = st.num_tokens.data_ptr<int32_t>();
  const int32_t* table = st.block_table.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < st.Hkv; ++h) {
      const int64_t row = st.head_row(b, layer, h);
      const int64_t n = counts[row], page = n / st.P, off = n % st.P;
      TORCH_CHECK(page < st.M, "paged KV: a head is full (max_model_len)");
      const int64_t block = table[row * st.M + page];
      TORCH_CHECK(block != 0, "paged KV: the next page of a head has no device block");
      const T* k = k_rows + b * stride + h * D;
      const T* v = v_rows + b * stride + h * D;
      std::memcpy(kp + (block * st.P + off) * D, k, D * sizeof(T));
      std::memcpy(vp + (block * st.P + off) * D, v, D * sizeof(T));
      T* mn = lo + (row * st.M + page) * D;
      T* mx = hi + (row * st.M + page) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float x = to_float(k[d]);
        if (off == 0 || x < to_float(mn[d])) mn[d] = k[d];
        if (off == 0 || x > to_float(mx[d])) mx[d] = k[d];
      }
      counts[row] = static_cast<int32_t>(n + 1);
    }
  }
}

// The MinMax bounds lo, hi [D] of a page's first `fill` (>= 1) rows [fill, D].
template <typename T>
void page_bounds(const T* rows, int64_t fill, int64_t D, T* lo, T* hi) {
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
      page_bounds(rows, fill, D, kmin + h * mm[0] + page * mm[1], kmax + h * mm[0] + page * mm[1]);
    }
  }
}

// Attention of q [B, Hq, D] over each head's pages (all, or `selected` [B, Hkv or Hq, K]) -> [B, Hq * D], dtype T.
template <typename T>
at::Tensor attend_pages(const at::Tensor& q, const at::Tensor& selected, const Storage& st, int64_t layer, double scale,
                  int64_t window) {
  const int64_t B = q.size(0), Hq = q.size(1), D = st.D;
  const int G = static_cast<int>(Hq / st.Hkv);
  Listing ls{ptr<int32_t>(st.block_table), ptr<int32_t>(st.num_tokens), nullptr, st.M, 0, static_cast<int>(st.P)};
  ls.slots = st.slots;
  ls.seq_stride = st.L * st.Hkv;
  ls.layer_offset = layer * st.Hkv;
  ls.heads = st.Hkv;
  ls.window = window;
  int64_t rows = B * st.Hkv;
  int group = G;
  at::Tensor sel;
  if (selected.defined()) {
    sel = selected.to(at::kLong).contiguous();
    TORCH_CHECK(sel.dim() == 3 && sel.size(0) == B && (sel.size(1) == st.Hkv || sel.size(1) == Hq),
                "paged KV: selected pages [B, Hkv or Hq, K]");
    ls.selected = sel.data_ptr<int64_t>();
    ls.K = sel.size(2);
    if (sel.size(1) == Hq && G > 1) {  // one page set per query head: each is a group of one over its KV head
      ls.heads = Hq;
      ls.kv_div = G;
      rows = B * Hq;
      group = 1;
    }
  }
  at::Tensor out = at::empty({B, Hq, D}, q.options().dtype(at::kFloat));
  attend_rows<T>(ptr<T>(q), rows, group, D, static_cast<float>(scale), ptr<T>(st.k_pool), ptr<T>(st.v_pool), ls,
                 out.data_ptr<float>());
  return out.to(q.scalar_type()).view({B, Hq * D});
}

}  // namespace
}  // namespace kvh
