// Causal prompt (prefill) attention for bf16 on CPUs with AVX512-BF16: q.k and p.v both by vdpbf16ps, or on AMX
// tiles where the CPU has them (cpu_prefill_tiles.cpp).
//
// Why a kernel: torch's CPU flash attention widens bf16 to fp32 and multiplies in fp32 unless the CPU has AMX tiles,
// which on an AVX512-BF16 CPU (AMD Zen 4) leaves it at about half the speed of bf16 dot products; on 4k-token prompts
// attention is two thirds of the prefill time. K and V of each KV head are first repacked so that one register holds
// the same dimension pair of 16 keys (q.k) or one key pair of 16 dimensions (p.v); every dot product then lands in its
// own lane and needs no horizontal sum.
//
// A query row's result depends only on its own query, its position and the keys up to it: keys are walked in
// 64-key blocks from key 0 whatever the chunk or the other rows of a task, and a block masked for a row leaves its
// running max, sum and accumulator bit-for-bit unchanged. So prefilling a prompt whole or in chunks, alone or beside
// others, gives identical numbers.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_common.h"
#include "cpu_prefill_tiles.h"

#ifdef KVH_HAVE_AVX512_BF16
namespace {

constexpr int kKeyBlock = 64;   // keys per softmax update: four 16-lane score registers
constexpr int kQueryBlock = 16; // query positions per task (times the group's query heads = rows)

using kvh::exp16;

inline __m512bh bcast_pair(const uint16_t* pair) {  // the same two bf16 values in every 32-bit lane
  uint32_t bits;
  std::memcpy(&bits, pair, 4);
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(bits));
}

// One query row's running softmax state: max, sum and the fp32 output accumulator.
template <int D>
struct RowState {
  float m = -INFINITY, l = 0.0f;
  alignas(64) float acc[D] = {};
};

// Scores of one row against one 64-key block (kp: the block's packed keys), scaled and masked past `pos`;
// updates the row's max and sum and writes its bf16 probabilities to `p` (64 values, key order).
template <int D>
inline float softmax_block(const __m512 s[4], float scale, int64_t k0, int64_t pos, RowState<D>& st, uint16_t* p) {
  __m512 sc[4];
  for (int c = 0; c < 4; ++c) {
    const int64_t live = std::clamp<int64_t>(pos - (k0 + 16 * c) + 1, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
    sc[c] = _mm512_mask_blend_ps(mask, _mm512_set1_ps(-INFINITY), _mm512_mul_ps(s[c], _mm512_set1_ps(scale)));
  }
  const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(sc[0], sc[1]),
                                                              _mm512_max_ps(sc[2], sc[3])));
  const float new_max = std::max(st.m, block_max);
  const float corr = st.m == new_max ? 1.0f : std::exp(st.m - new_max);  // m = -inf on the first block: 0
  __m512 sum = _mm512_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    const int64_t live = std::clamp<int64_t>(pos - (k0 + 16 * c) + 1, 0, 16);
    const __mmask16 mask = static_cast<__mmask16>((1u << live) - 1u);
    sc[c] = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(sc[c], _mm512_set1_ps(new_max))));
    sum = _mm512_add_ps(sum, sc[c]);
  }
  st.l = st.l * corr + _mm512_reduce_add_ps(sum);
  st.m = new_max;
  _mm512_storeu_si512(p, (__m512i)_mm512_cvtne2ps_pbh(sc[1], sc[0]));
  _mm512_storeu_si512(p + 32, (__m512i)_mm512_cvtne2ps_pbh(sc[3], sc[2]));
  return corr;
}

// Rows `r` and `r + 1` (or `r` alone when `two` is false) of a task over one key block.
template <int D>
inline void rows_block(const uint16_t* qa, const uint16_t* qb, bool two, const uint32_t* kp, const uint32_t* vp,
                       float scale, int64_t k0, int64_t pos_a, int64_t pos_b, RowState<D>& sa, RowState<D>& sb) {
  constexpr int NV = D / 16;
  __m512 s0[4], s1[4];
  for (int c = 0; c < 4; ++c) s0[c] = s1[c] = _mm512_setzero_ps();
  for (int p = 0; p < D / 2; ++p) {       // q.k: dimension pair p of 64 keys, 16 keys per register
    const __m512bh b0 = bcast_pair(qa + 2 * p);
    const __m512bh b1 = bcast_pair(qb + 2 * p);
    for (int c = 0; c < 4; ++c) {
      const __m512bh kr = (__m512bh)_mm512_loadu_si512(kp + (static_cast<int64_t>(c) * (D / 2) + p) * 16);
      s0[c] = _mm512_dpbf16_ps(s0[c], b0, kr);
      if (two) s1[c] = _mm512_dpbf16_ps(s1[c], b1, kr);
    }
  }
  alignas(64) uint16_t pa[kKeyBlock], pb[kKeyBlock];
  const __m512 ca = _mm512_set1_ps(softmax_block<D>(s0, scale, k0, pos_a, sa, pa));
  const __m512 cb = _mm512_set1_ps(two ? softmax_block<D>(s1, scale, k0, pos_b, sb, pb) : 1.0f);
  __m512 a0[NV], a1[NV];
  for (int c = 0; c < NV; ++c) {
    a0[c] = _mm512_mul_ps(_mm512_load_ps(sa.acc + 16 * c), ca);
    a1[c] = two ? _mm512_mul_ps(_mm512_load_ps(sb.acc + 16 * c), cb) : _mm512_setzero_ps();
  }
  for (int j = 0; j < kKeyBlock / 2; ++j) {  // p.v: key pair j of 16 dimensions per register
    const __m512bh p0 = bcast_pair(pa + 2 * j);
    const __m512bh p1 = bcast_pair(pb + 2 * j);
    for (int c = 0; c < NV; ++c) {
      const __m512bh vr = (__m512bh)_mm512_loadu_si512(vp + static_cast<int64_t>(j) * D + 16 * c);
      a0[c] = _mm512_dpbf16_ps(a0[c], p0, vr);
      if (two) a1[c] = _mm512_dpbf16_ps(a1[c], p1, vr);
    }
  }
  for (int c = 0; c < NV; ++c) {
    _mm512_store_ps(sa.acc + 16 * c, a0[c]);
    if (two) _mm512_store_ps(sb.acc + 16 * c, a1[c]);
  }
}

inline uint32_t pair_bits(uint16_t lo, uint16_t hi) { return static_cast<uint32_t>(lo) | (uint32_t(hi) << 16); }

template <int D>
at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  const int64_t T = q.size(0), Hq = q.size(1), S = k.size(0), Hkv = k.size(1);
  const int G = static_cast<int>(Hq / Hkv);
  const int64_t Spad = (S + kKeyBlock - 1) / kKeyBlock * kKeyBlock;
  const int64_t chunks = Spad / 16, pairs = Spad / 2;
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1), vs0 = v.stride(0), vs1 = v.stride(1);
  // kpack[h][chunk][pair][16 keys]: dims (2p, 2p+1) of 16 keys; vpack[h][key pair][D]: keys (2j, 2j+1) of a dim
  std::vector<uint32_t> kpack(static_cast<size_t>(Hkv * chunks * (D / 2) * 16), 0u);
  std::vector<uint32_t> vpack(static_cast<size_t>(Hkv * pairs * D), 0u);
  at::parallel_for(0, Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t hc = begin; hc < end; ++hc) {
      const int64_t h = hc / chunks, c = hc % chunks;
      uint32_t* kd = kpack.data() + hc * (D / 2) * 16;
      for (int t = 0; t < 16 && c * 16 + t < S; ++t) {
        const uint16_t* kr = kb + (c * 16 + t) * ks0 + h * ks1;
        for (int p = 0; p < D / 2; ++p) kd[p * 16 + t] = pair_bits(kr[2 * p], kr[2 * p + 1]);
      }
      for (int64_t j = c * 8; j < c * 8 + 8 && 2 * j < S; ++j) {
        uint32_t* vd = vpack.data() + (h * pairs + j) * D;
        const uint16_t* v0 = vb + 2 * j * vs0 + h * vs1;
        const uint16_t* v1 = 2 * j + 1 < S ? v0 + vs0 : nullptr;
        for (int d = 0; d < D; ++d) vd[d] = pair_bits(v0[d], v1 ? v1[d] : uint16_t(0));
      }
    }
  });

  at::Tensor out = at::empty({T, Hq, D}, q.options());
  uint16_t* ob = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint16_t* qbits = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t qblocks = (T + kQueryBlock - 1) / kQueryBlock, offset = S - T;
  const float sc = static_cast<float>(scale);
  // causal work grows with the block index: the dearest blocks are handed out first, so the cheap ones at the end
  // even out the threads' finishing times
  kvh::parallel_tasks(Hkv * qblocks, [&](auto next) {
    std::vector<RowState<D>> state(static_cast<size_t>(G * kQueryBlock));
    for (int64_t task; (task = next()) < Hkv * qblocks;) {
      const int64_t h = task % Hkv, qblock = qblocks - 1 - task / Hkv;
      const int64_t t0 = qblock * kQueryBlock, nt = std::min<int64_t>(kQueryBlock, T - t0);
      const int rows = static_cast<int>(G * nt);
      for (int r = 0; r < rows; ++r) state[r] = RowState<D>();
      auto qrow = [&](int r) { return qbits + (t0 + r % nt) * qs0 + (h * G + r / nt) * qs1; };
      auto pos = [&](int r) { return offset + t0 + r % nt; };
      const int64_t last = offset + t0 + nt - 1;
      for (int64_t k0 = 0; k0 <= last; k0 += kKeyBlock) {
        const uint32_t* kp = kpack.data() + (h * chunks + k0 / 16) * (D / 2) * 16;
        const uint32_t* vp = vpack.data() + (h * pairs + k0 / 2) * D;
        for (int r = 0; r < rows; r += 2) {
          const bool two = r + 1 < rows;
          const int rb = two ? r + 1 : r;
          if (pos(r) < k0 && pos(rb) < k0) continue;  // masked for both rows: would leave them unchanged
          rows_block<D>(qrow(r), qrow(rb), two, kp, vp, sc, k0, pos(r), pos(rb), state[r], state[rb]);
        }
      }
      for (int r = 0; r < rows; ++r) {
        uint16_t* o = ob + ((t0 + r % nt) * Hq + h * G + r / nt) * D;
        const __m512 inv = _mm512_set1_ps(1.0f / state[r].l);
        for (int c = 0; c < D / 16; ++c)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c),
                              (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_load_ps(state[r].acc + 16 * c), inv)));
      }
    }
  });
  return out;
}

at::Tensor prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool tiles) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prompt attention: q [T, Hq, D], k and v [S, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 &&
              v.scalar_type() == at::kBFloat16, "prompt attention: bf16 only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prompt attention: head dim must be dense");
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(0) >= q.size(0) && q.size(1) % k.size(1) == 0 &&
              q.size(2) == k.size(2), "prompt attention: shapes do not match");
  TORCH_CHECK(q.size(2) == 64 || q.size(2) == 128, "prompt attention: head_dim ", q.size(2), " not compiled (64, 128)");
  if (tiles && kvh::tiles_permitted()) return kvh::tile_prompt_attention(q, k, v, scale);
  return q.size(2) == 64 ? run<64>(q, k, v, scale) : run<128>(q, k, v, scale);
}

}  // namespace

// tiles: multiply on AMX tiles where the build and the CPU have them (prompt_tiles() says whether they do), else on
// AVX512-BF16 vectors. The two round differently, so the engine uses one of them throughout.
TORCH_LIBRARY_FRAGMENT(kvharness_cpu, m) {
  m.def("prompt_attention(Tensor q, Tensor k, Tensor v, float scale, bool tiles=True) -> Tensor", &prompt_attention);
  m.def("prompt_tiles() -> bool", &kvh::tiles_permitted);
}
#endif
