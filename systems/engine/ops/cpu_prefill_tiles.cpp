// Causal prompt (prefill) attention for bf16 on CPUs with AMX tiles: q.k and p.v as tile products, softmax on vectors.
//
// Why a kernel: torch's flash attention on AMX spends most of its time around its small products (head_dim 64), and
// a prompt chunk's attention was about a quarter of a mixed step. The products are laid out so that the softmax needs
// no horizontal reduction: scores come out transposed (a tile row is one key, its 16 lanes are 16 queries), so a
// row's max, exponentials and sum are plain vector operations over keys, and the output accumulates transposed
// (a row per dimension) where the running-max correction is one lane-wise multiply.
//
// As in the vector kernel (cpu_prefill.cpp), a query's numbers depend only on its query, its position and the keys up
// to it: keys are walked in 128-key blocks from key 0 whatever the chunk, lanes never mix, and a lane the block masks
// keeps its max, sum and accumulator bit for bit. Prefilling whole or in chunks, alone or beside others, on any number
// of threads, gives identical numbers.
#include "cpu_prefill_tiles.h"

#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "cpu_common.h"

#ifdef KVH_HAVE_AMX
#include <sys/syscall.h>
#include <unistd.h>

namespace {

constexpr int kKeys = 128;   // keys per softmax update
constexpr int kRows = 16;    // query positions per task, one per lane

// Keys padded to whole blocks ([Hkv][Spad][D], the A operand of q.k as stored) and values transposed block by block
// ([Hkv][block][D][kKeys], the A operand of p.v; a block's rows stay 256 bytes apart, where rows a whole prompt
// apart would fall into one cache set), zero past the prompt.
struct Operands {
  int64_t Spad;
  std::vector<uint16_t> k, vt;
};

template <int D>
Operands operands(const at::Tensor& k, const at::Tensor& v) {
  const int64_t S = k.size(0), Hkv = k.size(1), Spad = (S + kKeys - 1) / kKeys * kKeys;
  Operands op{Spad, std::vector<uint16_t>(static_cast<size_t>(Hkv * Spad * D), 0),
              std::vector<uint16_t>(static_cast<size_t>(Hkv * Spad * D), 0)};
  const uint16_t* kb = reinterpret_cast<const uint16_t*>(k.data_ptr());
  const uint16_t* vb = reinterpret_cast<const uint16_t*>(v.data_ptr());
  const int64_t blocks = Spad / kKeys;
  at::parallel_for(0, Hkv * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t hb = begin; hb < end; ++hb) {
      const int64_t h = hb / blocks, first = hb % blocks * kKeys, n = std::min<int64_t>(kKeys, S - first);
      for (int64_t t = first; t < first + n; ++t)
        std::memcpy(op.k.data() + (h * Spad + t) * D, kb + t * k.stride(0) + h * k.stride(1), 2 * D);
      uint16_t* vt = op.vt.data() + (h * Spad + first) * D;
      for (int64_t t = 0; t < n; ++t) {
        const uint16_t* row = vb + (first + t) * v.stride(0) + h * v.stride(1);
        for (int d = 0; d < D; ++d) vt[d * kKeys + t] = row[d];
      }
    }
  });
  return op;
}

// The softmax state of 16 queries (one per lane) of one query head, and its transposed accumulator.
template <int D>
struct Lanes {
  __m512 m, l;
  alignas(64) float acc[D][16];
};

// Lane i of the result: the bf16 pair (a[i], b[i]), a in the low half (AMX's pair layout for B operands).
inline __m512i pair_lanes(__m512 a, __m512 b) {
  const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                         23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// Tiles 0-3 += four A tiles (16 rows of 32 bf16 each, `next` elements apart, rows `stride` bytes apart) times one B
// tile (16 rows of 64 bytes, packed). Tiles 4 and 5 take turns as A so that a load never waits for the product before.
inline void accumulate4(const uint16_t* a, int64_t next, int stride, const void* b) {
  _tile_loadd(6, b, 64);
  _tile_loadd(4, a, stride);
  _tile_loadd(5, a + next, stride);
  _tile_dpbf16ps(0, 4, 6);
  _tile_loadd(4, a + 2 * next, stride);
  _tile_dpbf16ps(1, 5, 6);
  _tile_loadd(5, a + 3 * next, stride);
  _tile_dpbf16ps(2, 4, 6);
  _tile_dpbf16ps(3, 5, 6);
}

template <int D>
void task(int64_t h, int64_t t0, int64_t nt, int64_t offset, int G, const uint16_t* qbits, int64_t qs0,
          int64_t qs1, const Operands& op, float scale, uint16_t* ob, int64_t Hq) {
  alignas(64) uint32_t qt[D / 32][16][16];   // B of q.k: [dim step][dim pair][query]
  alignas(64) float sbuf[kKeys][16];          // scores, a row per key
  alignas(64) uint32_t pbuf[kKeys / 2][16];   // B of p.v: [key pair][query]
  alignas(64) float pv[D][16];
  int32_t position[16];
  for (int r = 0; r < 16; ++r) position[r] = r < nt ? static_cast<int32_t>(offset + t0 + r) : -1;  // -1: no query
  const __m512i pos = _mm512_loadu_si512(position);
  const int64_t last = offset + t0 + nt - 1;
  const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
  for (int g = 0; g < G; ++g) {
    const int64_t head = h * G + g;
    std::memset(qt, 0, sizeof(qt));
    for (int64_t r = 0; r < nt; ++r) {
      const uint32_t* qr = reinterpret_cast<const uint32_t*>(qbits + (t0 + r) * qs0 + head * qs1);
      for (int p = 0; p < D / 2; ++p) qt[p / 16][p % 16][r] = qr[p];
    }
    Lanes<D> st;
    st.m = ninf;
    st.l = _mm512_setzero_ps();
    std::memset(st.acc, 0, sizeof(st.acc));
    const uint16_t* kh = op.k.data() + h * op.Spad * D;
    const uint16_t* vh = op.vt.data() + h * op.Spad * D;
    for (int64_t k0 = 0; k0 <= last; k0 += kKeys) {
      // q.k, transposed: four 16-key tiles at a time (A: keys), 32 dims per step (B: the queries)
      for (int quarter = 0; quarter < kKeys / 64; ++quarter) {
        const uint16_t* kq = kh + (k0 + 64 * quarter) * D;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int ks = 0; ks < D / 32; ++ks) accumulate4(kq + 32 * ks, 16 * D, 2 * D, qt[ks]);
        float* sq = sbuf[64 * quarter];
        _tile_stored(0, sq, 64); _tile_stored(1, sq + 16 * 16, 64);
        _tile_stored(2, sq + 32 * 16, 64); _tile_stored(3, sq + 48 * 16, 64);
      }
      // softmax over the block's keys, lane by lane; key k0 + i is seen by a lane whose position is >= it. Four
      // running maxima and two sums: one chain each would wait on its own latency at every key
      __m512 top[4] = {ninf, ninf, ninf, ninf};
      for (int i = 0; i < kKeys; ++i) {
        const __mmask16 see = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(k0 + i)));
        top[i % 4] = _mm512_mask_max_ps(top[i % 4], see, top[i % 4], _mm512_load_ps(sbuf[i]));
      }
      const __mmask16 live = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(k0)));
      const __m512 top_all = _mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3]));
      const __m512 m = _mm512_max_ps(st.m, _mm512_mul_ps(top_all, sc));
      const __m512 corr = kvh::exp16(_mm512_sub_ps(st.m, m));   // 1 where the max holds; ~0 times a zero state first
      __m512 sum0 = _mm512_setzero_ps(), sum1 = _mm512_setzero_ps();
      for (int i = 0; i < kKeys; i += 2) {
        const __mmask16 see0 = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(k0 + i)));
        const __mmask16 see1 = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(k0 + i + 1)));
        const __m512 e0 = _mm512_maskz_mov_ps(see0, kvh::exp16(_mm512_fmsub_ps(_mm512_load_ps(sbuf[i]), sc, m)));
        const __m512 e1 = _mm512_maskz_mov_ps(see1, kvh::exp16(_mm512_fmsub_ps(_mm512_load_ps(sbuf[i + 1]), sc, m)));
        sum0 = _mm512_add_ps(sum0, e0);
        sum1 = _mm512_add_ps(sum1, e1);
        _mm512_store_si512(pbuf[i / 2], pair_lanes(e0, e1));
      }
      st.l = _mm512_mask_fmadd_ps(st.l, live, corr, _mm512_add_ps(sum0, sum1));
      st.m = _mm512_mask_mov_ps(st.m, live, m);
      // p.v, transposed: a tile per 16 dims (A: values), 32 keys per step (B: the probabilities)
      for (int dg = 0; dg < D / 64; ++dg) {
        const uint16_t* vd = vh + k0 * D + 64 * dg * kKeys;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int js = 0; js < kKeys / 32; ++js) accumulate4(vd + 32 * js, 16 * kKeys, 2 * kKeys, pbuf[16 * js]);
        _tile_stored(0, pv[64 * dg], 64); _tile_stored(1, pv[64 * dg + 16], 64);
        _tile_stored(2, pv[64 * dg + 32], 64); _tile_stored(3, pv[64 * dg + 48], 64);
      }
      for (int d = 0; d < D; ++d)
        _mm512_store_ps(st.acc[d], _mm512_mask_fmadd_ps(_mm512_load_ps(st.acc[d]), live, corr,
                                                        _mm512_load_ps(pv[d])));
    }
    alignas(64) float inv[16];
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), st.l));
    for (int64_t r = 0; r < nt; ++r) {
      uint16_t* o = ob + ((t0 + r) * Hq + head) * D;
      alignas(64) float row[D];
      for (int d = 0; d < D; ++d) row[d] = st.acc[d][r] * inv[r];
      for (int c = 0; c < D / 16; ++c)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * c),
                            (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(row + 16 * c)));
    }
  }
}

// The tile shapes, loaded by each thread before its first product (the configuration is per thread).
struct TileConfig {
  TileConfig() {
    alignas(64) uint8_t cfg[64] = {};
    cfg[0] = 1;                                              // palette 1
    for (int t = 0; t < 7; ++t) {
      reinterpret_cast<uint16_t*>(cfg + 16)[t] = 64;         // bytes per row
      cfg[48 + t] = 16;                                      // rows
    }
    _tile_loadconfig(cfg);
  }
  ~TileConfig() { _tile_release(); }
};

template <int D>
at::Tensor run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  const int64_t T = q.size(0), Hq = q.size(1), S = k.size(0), Hkv = k.size(1);
  const int G = static_cast<int>(Hq / Hkv);
  const Operands op = operands<D>(k, v);
  at::Tensor out = at::empty({T, Hq, D}, q.options());
  uint16_t* ob = reinterpret_cast<uint16_t*>(out.data_ptr());
  const uint16_t* qbits = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const int64_t blocks = (T + kRows - 1) / kRows;
  // causal work grows with the block index: the dearest blocks go first, the cheap ones even out the threads' ends
  kvh::parallel_tasks(Hkv * blocks, [&](auto next) {
    const TileConfig config;
    for (int64_t i; (i = next()) < Hkv * blocks;) {
      const int64_t t0 = (blocks - 1 - i / Hkv) * kRows;
      task<D>(i % Hkv, t0, std::min<int64_t>(kRows, T - t0), S - T, G, qbits, q.stride(0), q.stride(1), op,
              static_cast<float>(scale), ob, Hq);
    }
  });
  return out;
}

}  // namespace

namespace kvh {

bool tiles_permitted() {
  // Linux hands a process the tile state only on request, before its first tile instruction
  static const bool ok = syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0;
  return ok;
}

at::Tensor tile_prompt_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  switch (q.size(2)) {
    case 64: return run<64>(q, k, v, scale);
    case 128: return run<128>(q, k, v, scale);
    default: TORCH_CHECK(false, "prompt attention: head_dim ", q.size(2), " not compiled (64, 128)");
  }
}

}  // namespace kvh
#else
namespace kvh {
bool tiles_permitted() { return false; }
at::Tensor tile_prompt_attention(const at::Tensor&, const at::Tensor&, const at::Tensor&, double) {
  TORCH_CHECK(false, "prompt attention: this build has no AMX tiles");
}
}  // namespace kvh
#endif
