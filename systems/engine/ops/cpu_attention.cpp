// Fused paged decode attention for the CPU: one pass over each KV head's listed pages for its whole GQA group.
//
// Why a kernel: on a CPU the torch path either gathers the pages (an extra copy of every K/V byte) or runs one small
// matmul per (sequence, page run) with ~100 us of framework overhead each. Here every (sequence, KV head) is one
// task; it reads its pages in place through the block table, converts bf16 to fp32 in registers, and keeps an online
// softmax (running max, sum, fp32 accumulator) per query head, so K and V are each read exactly once.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t bits) {  // bf16: the high half of an fp32
  uint32_t u = static_cast<uint32_t>(bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// exp for x <= 0 (scores minus their running max): 2^n * p(r), |rel err| < 2e-7, branch-free so loops vectorize.
inline float exp_nonpos(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float n = std::floor(t + 0.5f);
  const float r = (t - n) * 0.693147180559945309f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return p * scale;
}

constexpr int kMaxGroup = 16;
constexpr int kMaxPage = 256;

// One (sequence, KV head): G query rows q [G, D] (fp32, pre-scaled) over n tokens in the listed blocks.
template <typename T, int D>
void attend_head(const float* q, int G, const T* k_pool, const T* v_pool, const int32_t* blocks, int64_t n,
                 int P, float* out /* [G, D] */) {
  float m[kMaxGroup], l[kMaxGroup];
  alignas(64) float acc[kMaxGroup][D];
  alignas(64) float s[kMaxGroup][kMaxPage];
  alignas(64) float row[D];
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.0f;
    for (int d = 0; d < D; ++d) acc[g][d] = 0.0f;
  }
  const int64_t pages = (n + P - 1) / P;
  for (int64_t j = 0; j < pages; ++j) {
    const int valid = static_cast<int>(std::min<int64_t>(P, n - j * P));
    const int64_t base = static_cast<int64_t>(blocks[j]) * P * D;
    const T* kp = k_pool + base;
    const T* vp = v_pool + base;
    for (int t = 0; t < valid; ++t) {
#pragma omp simd
      for (int d = 0; d < D; ++d) row[d] = to_float(kp[t * D + d]);
      for (int g = 0; g < G; ++g) {
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int d = 0; d < D; ++d) dot += q[g * D + d] * row[d];
        s[g][t] = dot;
      }
    }
    for (int g = 0; g < G; ++g) {
      float page_max = m[g];
      for (int t = 0; t < valid; ++t) page_max = s[g][t] > page_max ? s[g][t] : page_max;
      const float corr = exp_nonpos(m[g] - page_max);  // m = -inf on the first page: exp clamps to ~0
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < valid; ++t) {
        const float e = exp_nonpos(s[g][t] - page_max);
        s[g][t] = e;
        sum += e;
      }
      l[g] = l[g] * corr + sum;
      m[g] = page_max;
#pragma omp simd
      for (int d = 0; d < D; ++d) acc[g][d] *= corr;
    }
    for (int t = 0; t < valid; ++t) {
#pragma omp simd
      for (int d = 0; d < D; ++d) row[d] = to_float(vp[t * D + d]);
      for (int g = 0; g < G; ++g) {
        const float p = s[g][t];
#pragma omp simd
        for (int d = 0; d < D; ++d) acc[g][d] += p * row[d];
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const float inv = 1.0f / l[g];
    for (int d = 0; d < D; ++d) out[g * D + d] = acc[g][d] * inv;
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define KVH_HAVE_AVX512_BF16 1

// bf16 pools on CPUs with AVX512-BF16: q.k by vdpbf16ps straight from the stored pages, p.v by fp32 FMAs.
template <int D>
void attend_head_bf16(const uint16_t* q, int G, float scale, const uint16_t* k_pool, const uint16_t* v_pool,
                      const int32_t* blocks, int64_t n, int P, float* out) {
  constexpr int NB = D / 32;  // 32 bf16 per register
  constexpr int NV = D / 16;  // 16 fp32 per register
  __m512bh qv[kMaxGroup][NB];
  __m512 acc[kMaxGroup][NV];
  float m[kMaxGroup], l[kMaxGroup];
  alignas(64) float s[kMaxGroup][kMaxPage];
  for (int g = 0; g < G; ++g) {
    for (int c = 0; c < NB; ++c) qv[g][c] = (__m512bh)_mm512_loadu_si512(q + g * D + c * 32);
    for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_setzero_ps();
    m[g] = -INFINITY;
    l[g] = 0.0f;
  }
  const int64_t pages = (n + P - 1) / P;
  for (int64_t j = 0; j < pages; ++j) {
    const int valid = static_cast<int>(std::min<int64_t>(P, n - j * P));
    const int64_t base = static_cast<int64_t>(blocks[j]) * P * D;
    const uint16_t* kp = k_pool + base;
    const uint16_t* vp = v_pool + base;
    if (j + 1 < pages) {
      const int64_t next = static_cast<int64_t>(blocks[j + 1]) * P * D;
      for (int off = 0; off < P * D; off += 32) {
        _mm_prefetch(reinterpret_cast<const char*>(k_pool + next + off), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(v_pool + next + off), _MM_HINT_T0);
      }
    }
    for (int t = 0; t < valid; ++t) {
      __m512bh kv[NB];
      for (int c = 0; c < NB; ++c) kv[c] = (__m512bh)_mm512_loadu_si512(kp + t * D + c * 32);
      for (int g = 0; g < G; ++g) {
        __m512 a = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[g][0], kv[0]);
        for (int c = 1; c < NB; ++c) a = _mm512_dpbf16_ps(a, qv[g][c], kv[c]);
        s[g][t] = _mm512_reduce_add_ps(a) * scale;
      }
    }
    for (int g = 0; g < G; ++g) {
      float page_max = m[g];
      for (int t = 0; t < valid; ++t) page_max = s[g][t] > page_max ? s[g][t] : page_max;
      const float corr = exp_nonpos(m[g] - page_max);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int t = 0; t < valid; ++t) {
        const float e = exp_nonpos(s[g][t] - page_max);
        s[g][t] = e;
        sum += e;
      }
      l[g] = l[g] * corr + sum;
      m[g] = page_max;
      const __m512 cv = _mm512_set1_ps(corr);
      for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], cv);
    }
    for (int t = 0; t < valid; ++t) {
      __m512 vv[NV];
      for (int c = 0; c < NV; ++c)
        vv[c] = _mm512_cvtpbh_ps((__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vp + t * D + c * 16)));
      for (int g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(s[g][t]);
        for (int c = 0; c < NV; ++c) acc[g][c] = _mm512_fmadd_ps(p, vv[c], acc[g][c]);
      }
    }
  }
  for (int g = 0; g < G; ++g) {
    const __m512 inv = _mm512_set1_ps(1.0f / l[g]);
    for (int c = 0; c < NV; ++c) _mm512_storeu_ps(out + g * D + c * 16, _mm512_mul_ps(acc[g][c], inv));
  }
}
#endif

template <typename T, int D>
void run(const float* q, const T* k_pool, const T* v_pool, const int32_t* table, const int32_t* counts,
         int64_t B, int64_t Hkv, int64_t M, int G, int P, float* out) {
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      attend_head<T, D>(q + i * G * D, G, k_pool, v_pool, table + i * M, counts[i], P, out + i * G * D);
    }
  });
}

template <typename T>
void dispatch_dim(int64_t D, const float* q, const T* k, const T* v, const int32_t* table, const int32_t* counts,
                  int64_t B, int64_t Hkv, int64_t M, int G, int P, float* out) {
  switch (D) {
    case 64: return run<T, 64>(q, k, v, table, counts, B, Hkv, M, G, P, out);
    case 128: return run<T, 128>(q, k, v, table, counts, B, Hkv, M, G, P, out);
    case 96: return run<T, 96>(q, k, v, table, counts, B, Hkv, M, G, P, out);
    case 16: return run<T, 16>(q, k, v, table, counts, B, Hkv, M, G, P, out);
    case 32: return run<T, 32>(q, k, v, table, counts, B, Hkv, M, G, P, out);
    case 256: return run<T, 256>(q, k, v, table, counts, B, Hkv, M, G, P, out);
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim ", D, " not compiled (16, 32, 64, 96, 128, 256)");
  }
}

// q [B, Hq, D]; pools [blocks, P, D] (bf16 or fp32); block_table [B, Hkv, M] int32; num_tokens [B, Hkv] int32.
at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& k_pool, const at::Tensor& v_pool,
                                  const at::Tensor& block_table, const at::Tensor& num_tokens, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_pool.dim() == 3 && block_table.dim() == 3, "paged_decode_attention: bad ranks");
  TORCH_CHECK(k_pool.is_contiguous() && v_pool.is_contiguous(), "paged_decode_attention: pools must be contiguous");
  TORCH_CHECK(k_pool.scalar_type() == v_pool.scalar_type(), "paged_decode_attention: K/V dtypes differ");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && num_tokens.scalar_type() == at::kInt,
              "paged_decode_attention: block_table and num_tokens must be int32");
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t Hkv = block_table.size(1), M = block_table.size(2);
  const int P = static_cast<int>(k_pool.size(1));
  const int G = static_cast<int>(Hq / Hkv);
  TORCH_CHECK(Hq % Hkv == 0 && G <= kMaxGroup && P <= kMaxPage && k_pool.size(2) == D,
              "paged_decode_attention: unsupported shapes");
  TORCH_CHECK(num_tokens.min().item<int>() >= 1, "paged_decode_attention: every head needs at least one token");
  at::Tensor table = block_table.contiguous(), counts = num_tokens.contiguous();
  at::Tensor out = at::empty({B, Hq, D}, q.options().dtype(at::kFloat));
#ifdef KVH_HAVE_AVX512_BF16
  if (k_pool.scalar_type() == at::kBFloat16 && (D == 64 || D == 128)) {
    at::Tensor qb = q.to(at::kBFloat16).contiguous();
    const uint16_t* qp = reinterpret_cast<const uint16_t*>(qb.data_ptr());
    const uint16_t* kp = reinterpret_cast<const uint16_t*>(k_pool.data_ptr());
    const uint16_t* vp = reinterpret_cast<const uint16_t*>(v_pool.data_ptr());
    const int32_t* tp = table.data_ptr<int32_t>();
    const int32_t* cp = counts.data_ptr<int32_t>();
    float* op = out.data_ptr<float>();
    const float sc = static_cast<float>(scale);
    at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        if (D == 64)
          attend_head_bf16<64>(qp + i * G * D, G, sc, kp, vp, tp + i * M, cp[i], P, op + i * G * D);
        else
          attend_head_bf16<128>(qp + i * G * D, G, sc, kp, vp, tp + i * M, cp[i], P, op + i * G * D);
      }
    });
    return out.to(q.scalar_type());
  }
#endif
  at::Tensor qs = (q.to(at::kFloat) * scale).contiguous();
  if (k_pool.scalar_type() == at::kBFloat16) {
    dispatch_dim<uint16_t>(D, qs.data_ptr<float>(), reinterpret_cast<const uint16_t*>(k_pool.data_ptr()),
                           reinterpret_cast<const uint16_t*>(v_pool.data_ptr()), table.data_ptr<int32_t>(),
                           counts.data_ptr<int32_t>(), B, Hkv, M, G, P, out.data_ptr<float>());
  } else {
    TORCH_CHECK(k_pool.scalar_type() == at::kFloat, "paged_decode_attention: pools must be bf16 or fp32");
    dispatch_dim<float>(D, qs.data_ptr<float>(), k_pool.data_ptr<float>(), v_pool.data_ptr<float>(),
                        table.data_ptr<int32_t>(), counts.data_ptr<int32_t>(), B, Hkv, M, G, P,
                        out.data_ptr<float>());
  }
  return out.to(q.scalar_type());
}

}  // namespace

TORCH_LIBRARY(kvharness_cpu, m) {
  m.def("paged_decode_attention(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor num_tokens, "
        "float scale) -> Tensor", &paged_decode_attention);
}
