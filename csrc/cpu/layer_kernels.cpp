// Per-layer elementwise kernels of the Llama family, each one op where torch needs several
// (at batch 1 a decode step is dominated by per-op overhead, not by these FLOPs):
//
//   fused_add_rms_norm(input, residual, weight, eps): residual += input, then
//       input = weight * (residual * rsqrt(mean(residual^2) + eps)); both in place (vLLM's).
//   rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox): neox-style
//       rotation of every head of query and key, in place; cos_sin_cache is
//       [max_position, head_size] = [cos | sin] halves (vLLM's layout). query / key may be
//       row-strided views (the q and k columns of a fused qkv output).
//   silu_and_mul(out, input): out = silu(input[:, :d]) * input[:, d:] (vLLM's); fp32, or
//       bf16 in and out (the gguf path's bf16 prefill): computed in fp32 exactly as the fp32
//       kernel does, then rounded to bf16 once (to nearest even, as torch's conversion).
//
// The rotation is compiled without FMA contraction, so it is bit-identical to torch's
// (x1 * cos - x2 * sin, x2 * cos + x1 * sin: each product rounded). The norm sums squares
// in 8 lanes (another order than torch) and silu uses an AVX2 exp: both differ from torch
// by float rounding only.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <cmath>
#include <cstring>

#include "vec_math.h"

namespace {

using vllm_cpu::cpu_has_avx2;

// ---- RMSNorm ------------------------------------------------------------------------------
float sum_squares_scalar(const float* x, int64_t n) {
  float acc = 0.f;
  for (int64_t i = 0; i < n; ++i) acc += x[i] * x[i];
  return acc;
}

void add_rows_scalar(float* res, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) res[i] += in[i];
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// res += in (rounded like torch's add), returns sum(res^2).
float add_and_sum_squares_avx2(float* res, const float* in, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 r = _mm256_add_ps(_mm256_loadu_ps(res + i), _mm256_loadu_ps(in + i));
    _mm256_storeu_ps(res + i, r);
    acc = _mm256_fmadd_ps(r, r, acc);
  }
  float s = vllm_cpu::hsum_avx2(acc);
  for (; i < n; ++i) {
    res[i] += in[i];
    s += res[i] * res[i];
  }
  return s;
}
#pragma GCC pop_options

// out = w * (x * inv): the product order of HF's LlamaRMSNorm.
void scale_row(float* out, const float* x, const float* w, float inv, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * inv);
}

void check_rows(const torch::Tensor& t, const char* name,
                at::ScalarType dtype = torch::kFloat) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype, name, " must be a CPU ",
              c10::toString(dtype), " tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void fused_add_rms_norm(torch::Tensor& input, torch::Tensor& residual,
                        const torch::Tensor& weight, double eps) {
  check_rows(input, "input");
  check_rows(residual, "residual");
  check_rows(weight, "weight");
  const int64_t hidden = weight.numel();
  TORCH_CHECK(input.numel() == residual.numel() && input.numel() % hidden == 0,
              "input / residual / weight shapes do not match");
  const int64_t rows = input.numel() / hidden;
  float* in = input.data_ptr<float>();
  float* res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const bool avx2 = cpu_has_avx2();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 64, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* x = in + r * hidden;
      float* y = res + r * hidden;
      float ss;
      if (avx2) {
        ss = add_and_sum_squares_avx2(y, x, hidden);
      } else {
        add_rows_scalar(y, x, hidden);
        ss = sum_squares_scalar(y, hidden);
      }
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(hidden) + e);
      scale_row(x, y, w, inv, hidden);
    }
  });
}

// ---- rotary embedding (neox) -----------------------------------------------------------------
// No FMA contraction, whatever the build flags: each product is rounded, as in torch.
__attribute__((optimize("fp-contract=off"))) void rotate_heads(float* x, int64_t heads, int64_t head_size, const float* cos,
                  const float* sin) {
  const int64_t half = head_size / 2;
  for (int64_t h = 0; h < heads; ++h, x += head_size) {
    for (int64_t j = 0; j < half; ++j) {
      const float x1 = x[j], x2 = x[j + half];
      x[j] = x1 * cos[j] - x2 * sin[j];
      x[j + half] = x2 * cos[j] + x1 * sin[j];
    }
  }
}

void check_heads(const torch::Tensor& t, int64_t tokens, int64_t head_size, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat, name,
              " must be a CPU float32 tensor");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == tokens, name, " must be [num_tokens, heads * size]");
  TORCH_CHECK(t.stride(1) == 1 && t.size(1) % head_size == 0, name,
              " rows must be contiguous whole heads");
}

void rotary_embedding(const torch::Tensor& positions, torch::Tensor& query, torch::Tensor& key,
                      int64_t head_size, const torch::Tensor& cos_sin_cache, bool is_neox) {
  TORCH_CHECK(is_neox, "only neox-style rotary embedding is implemented");
  TORCH_CHECK(head_size % 2 == 0, "head_size must be even");
  TORCH_CHECK(positions.scalar_type() == torch::kLong && positions.dim() == 1,
              "positions must be int64 [num_tokens]");
  TORCH_CHECK(cos_sin_cache.scalar_type() == torch::kFloat && cos_sin_cache.is_contiguous() &&
                  cos_sin_cache.dim() == 2 && cos_sin_cache.size(1) == head_size,
              "cos_sin_cache must be contiguous float32 [max_position, head_size]");
  const int64_t tokens = positions.size(0);
  check_heads(query, tokens, head_size, "query");
  check_heads(key, tokens, head_size, "key");
  const auto pos = positions.contiguous();
  const int64_t* p = pos.data_ptr<int64_t>();
  const int64_t max_pos = cos_sin_cache.size(0);
  const float* cache = cos_sin_cache.data_ptr<float>();
  float* q = query.data_ptr<float>();
  float* k = key.data_ptr<float>();
  const int64_t q_heads = query.size(1) / head_size, k_heads = key.size(1) / head_size;
  const int64_t qs = query.stride(0), ks = key.stride(0), half = head_size / 2;
  at::parallel_for(0, tokens, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      TORCH_CHECK(p[t] >= 0 && p[t] < max_pos, "position ", p[t], " out of range");
      const float* cos = cache + p[t] * head_size;
      rotate_heads(q + t * qs, q_heads, head_size, cos, cos + half);
      rotate_heads(k + t * ks, k_heads, head_size, cos, cos + half);
    }
  });
}

// ---- SiLU and multiply -----------------------------------------------------------------------
void silu_mul_scalar(float* out, const float* g, const float* u, int64_t d) {
  for (int64_t i = 0; i < d; ++i) out[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

// bf16 <-> fp32 by bits: bf16 is the high half of an fp32. Rounding to nearest even (NaN
// inputs are not special-cased: silu * u of finite activations is finite).
inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

void silu_mul_bf16_scalar(uint16_t* out, const uint16_t* g, const uint16_t* u, int64_t d) {
  for (int64_t i = 0; i < d; ++i) {
    const float x = bf16_to_float(g[i]);
    out[i] = float_to_bf16(x / (1.0f + std::exp(-x)) * bf16_to_float(u[i]));
  }
}

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
// silu(x) * u over 8 lanes: the one formula of the fp32 and bf16 kernels.
inline __m256 silu_mul8(__m256 x, __m256 u) {
  const __m256 e = vllm_cpu::exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), x));
  return _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

void silu_mul_avx2(float* out, const float* g, const float* u, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    _mm256_storeu_ps(out + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
  silu_mul_scalar(out + i, g + i, u + i, d - i);
}

__m256 load_bf16_avx2(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

void store_bf16_avx2(uint16_t* p, __m256 v) {
  __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  bits = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  bits = _mm256_srli_epi32(bits, 16);
  const __m128i packed =
      _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

void silu_mul_bf16_avx2(uint16_t* out, const uint16_t* g, const uint16_t* u, int64_t d) {
  int64_t i = 0;
  for (; i + 8 <= d; i += 8)
    store_bf16_avx2(out + i, silu_mul8(load_bf16_avx2(g + i), load_bf16_avx2(u + i)));
  silu_mul_bf16_scalar(out + i, g + i, u + i, d - i);
}
#pragma GCC pop_options

// Rows [g | u] of `in` -> rows of `out`, split over threads; `fast` needs AVX2.
template <typename T>
void silu_rows(T* out, const T* in, int64_t rows, int64_t d,
               void (*fast)(T*, const T*, const T*, int64_t),
               void (*slow)(T*, const T*, const T*, int64_t)) {
  const auto row_fn = cpu_has_avx2() ? fast : slow;
  at::parallel_for(0, rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* g = in + r * 2 * d;
      row_fn(out + r * d, g, g + d, d);
    }
  });
}

void silu_and_mul(torch::Tensor& out, const torch::Tensor& input) {
  const bool bf16 = input.scalar_type() == at::kBFloat16;
  TORCH_CHECK(out.scalar_type() == input.scalar_type(), "out and input must have one dtype");
  const auto dtype = bf16 ? at::kBFloat16 : at::kFloat;  // the two the kernel computes
  check_rows(out, "out", dtype);
  check_rows(input, "input", dtype);
  const int64_t d = out.size(-1);
  TORCH_CHECK(input.size(-1) == 2 * d && input.numel() == 2 * out.numel(),
              "input must be [..., 2 * d] for out [..., d]");
  const int64_t rows = out.numel() / std::max<int64_t>(d, 1);
  if (bf16) {
    silu_rows(reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>()),
              reinterpret_cast<const uint16_t*>(input.data_ptr<at::BFloat16>()), rows, d,
              silu_mul_bf16_avx2, silu_mul_bf16_scalar);
  } else {
    silu_rows(out.data_ptr<float>(), input.data_ptr<float>(), rows, d, silu_mul_avx2,
              silu_mul_scalar);
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_continuum_C, m) {
  m.def(
      "fused_add_rms_norm(Tensor(a!) input, Tensor(b!) residual, Tensor weight, float epsilon)"
      " -> ()");
  m.def(
      "rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
      "Tensor cos_sin_cache, bool is_neox) -> ()");
  m.def("silu_and_mul(Tensor(a!) out, Tensor input) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_continuum_C, CPU, m) {
  m.impl("fused_add_rms_norm", &fused_add_rms_norm);
  m.impl("rotary_embedding", &rotary_embedding);
  m.impl("silu_and_mul", &silu_and_mul);
}
