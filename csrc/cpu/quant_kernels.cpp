// Weight-only quantized linear layers over GGUF blocks (layouts in quant_blocks.h), fp32
// activations: the scalar and AVX2 paths, the choice of kernel, and the ops' registration.
//
// ggml_linear(x [M, K] fp32, qweight, variant) -> y [M, N] = x @ W^T. Few tokens (bound by
// the bytes of weights streamed from memory): each block is expanded in registers and
// multiplied by every token at once; on AVX-512 CPUs up to 4 tokens, 16 lanes, 4 rows at a
// time with software prefetches of the rows ahead (quant_avx512.cpp), on AVX2 ones up to 8
// tokens, 8 lanes, a row at a time. More tokens (bound by arithmetic): rows are expanded into an fp32
// buffer, then multiplied by the tokens in register tiles, so the expansion is paid once per
// row, not once per token tile. With AVX-512 (quant_avx512.cpp): 4 rows at a time (in L1) x
// up to 6 tokens (24 accumulators, one 16-lane FMA per weight row and token per 16 inputs).
// With AVX2: panels of 48 rows (in L2), token tiles outermost so a tile's 4 token rows stay
// in L1 while the panel's rows pass by 3 at a time (12 accumulators, 7 loads per 12 FMAs);
// these panels beat dequantisation + torch's GEMM at every M up to 2048 on AVX2 CPUs
// (docs/kernels.md), so prefill takes them too there. variant 1 quantises x to int8 per
// 32-value block instead and multiplies bytes with AVX512-VNNI (quant_avx512.cpp); variant
// 2 keeps the AVX2 kernels on AVX-512 CPUs (to measure one against the other). Rows are
// split over torch's intra-op threads (at::parallel_for: the same OpenMP pool and thread
// count as torch's own ops).
//
// The AVX2 + FMA + F16C and AVX-512 paths are compiled with target pragmas and chosen at run
// time, so the library still loads on older CPUs (a portable scalar path runs without AVX2).
// ggml_dequantize computes W in fp32 exactly as the pure-torch fallback in
// vllm/_custom_ops.py does (q * d, then + m: two roundings, no FMA), so both are bit-identical.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"
#include "parallel.h"
#include "quant_blocks.h"

using namespace vllm_cpu::gguf;

namespace {

constexpr int kRows = 3;        // weight rows per AVX2 tile: 3 x 4 accumulators + 3 weights + 1 input
constexpr int kTokens = 4;      // tokens per tile
constexpr int kPanelRows = 48;  // rows expanded at once (AVX2: 48 x K fp32, in L2)
constexpr int kFusedMax = 8;    // the register-fused kernel up to this many tokens (AVX2 CPUs)

// ---- portable scalar path ---------------------------------------------------------------
void dequant_row_scalar(const uint8_t* row, int64_t nb, int64_t qtype, float* out) {
  for (int64_t b = 0; b < nb; ++b, out += kQK) {
    if (qtype == kTypeQ4_1) {
      const uint8_t* blk = row + b * 20;
      const float d = half_at(blk), m = half_at(blk + 2);
      for (int j = 0; j < 16; ++j) {
        out[j] = static_cast<float>(blk[4 + j] & 0x0F) * d + m;
        out[j + 16] = static_cast<float>(blk[4 + j] >> 4) * d + m;
      }
    } else {
      const uint8_t* blk = row + b * 34;
      const float d = half_at(blk);
      const auto* q = reinterpret_cast<const int8_t*>(blk + 2);
      for (int j = 0; j < 32; ++j) out[j] = static_cast<float>(q[j]) * d;
    }
  }
}

void dot_rows_scalar(const float* w, int rows, int64_t K, const float* x, int64_t M,
                     float* y, int64_t ldy) {
  for (int r = 0; r < rows; ++r)
    for (int64_t t = 0; t < M; ++t) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += w[r * K + k] * x[t * K + k];
      y[t * ldy + r] = acc;
    }
}

// ---- AVX2 + FMA + F16C path -------------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline __m256 bcast_half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm256_set1_ps(_cvtsh_ss(bits));
}

// 8 unsigned bytes -> 8 floats, times d, plus m (mul then add: same rounding as torch's).
inline __m256 q4_lanes(__m128i bytes, __m256 d, __m256 m) {
  const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  return _mm256_add_ps(_mm256_mul_ps(q, d), m);
}

void dequant_row_avx2(const uint8_t* row, int64_t nb, int64_t qtype, float* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, out += kQK) {
    if (qtype == kTypeQ4_1) {
      const uint8_t* blk = row + b * 20;
      const __m256 d = bcast_half(blk), m = bcast_half(blk + 2);
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      const __m128i lo = _mm_and_si128(qs, low4);                     // weights 0..15
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);  // weights 16..31
      _mm256_storeu_ps(out + 0, q4_lanes(lo, d, m));
      _mm256_storeu_ps(out + 8, q4_lanes(_mm_srli_si128(lo, 8), d, m));
      _mm256_storeu_ps(out + 16, q4_lanes(hi, d, m));
      _mm256_storeu_ps(out + 24, q4_lanes(_mm_srli_si128(hi, 8), d, m));
    } else {
      const uint8_t* blk = row + b * 34;
      const __m256 d = bcast_half(blk);
      for (int i = 0; i < 4; ++i) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
        _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(q, d));
      }
    }
  }
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[t * ldy + r] = dot(w[r * K ...], x[t * K ...]) for r < R, t < T (K a multiple of 8).
// Per 8 inputs: R weight loads and T activation loads feed R * T FMAs.
template <int R, int T>
void dot_tile_avx2(const float* w, int64_t K, const float* x, float* y, int64_t ldy) {
  __m256 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * K + k);
    for (int t = 0; t < T; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * K + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) y[t * ldy + r] = hsum(acc[r][t]);
}

// One token tile (T of them) against `rows` (<= kRows) rows of the fp32 buffer.
template <int T>
void dot_rows_avx2(const float* w, int rows, int64_t K, const float* x, float* y, int64_t ldy) {
  switch (rows) {
    case 3: dot_tile_avx2<3, T>(w, K, x, y, ldy); break;
    case 2: dot_tile_avx2<2, T>(w, K, x, y, ldy); break;
    default: dot_tile_avx2<1, T>(w, K, x, y, ldy); break;
  }
}

// y[:, n0 .. n0 + rows) for all M tokens from a panel of `rows` dequantised rows (w, in L2):
// token tiles outermost, so a tile's activations (T x K) stay in L1 while every row triple of
// the panel passes by; each row is dequantised once per call whatever M is.
void panel_avx2(const float* w, int64_t rows, int64_t K, const float* x, int64_t M, float* y,
                int64_t ldy) {
  for (int64_t t = 0; t < M; t += kTokens) {
    const float* xt = x + t * K;
    float* yt = y + t * ldy;
    for (int64_t r = 0; r < rows; r += kRows) {
      const int n = static_cast<int>(std::min<int64_t>(kRows, rows - r));
      switch (std::min<int64_t>(kTokens, M - t)) {
        case 4: dot_rows_avx2<4>(w + r * K, n, K, xt, yt + r, ldy); break;
        case 3: dot_rows_avx2<3>(w + r * K, n, K, xt, yt + r, ldy); break;
        case 2: dot_rows_avx2<2>(w + r * K, n, K, xt, yt + r, ldy); break;
        default: dot_rows_avx2<1>(w + r * K, n, K, xt, yt + r, ldy); break;
      }
    }
  }
}

// Dequantise one block (32 weights) into 4 registers; FMA here: for the fused kernel only.
inline void block_lanes_avx2(const uint8_t* blk, int64_t qtype, __m256 w[4]) {
  if (qtype == kTypeQ4_1) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m256 d = bcast_half(blk), m = bcast_half(blk + 2);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    const __m128i lo = _mm_and_si128(qs, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[i])), d, m);
  } else {
    const __m256 d = bcast_half(blk);
    for (int i = 0; i < 4; ++i) {
      const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(blk + 2 + 8 * i));
      w[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
    }
  }
}

// A row expanded for the panels: the same FMA lanes as the fused kernel (one rounding).
void expand_row_avx2(const uint8_t* row, int64_t nb, int64_t bb, int64_t qtype, float* out) {
  for (int64_t b = 0; b < nb; ++b, out += kQK) {
    __m256 w[4];
    block_lanes_avx2(row + b * bb, qtype, w);
    for (int i = 0; i < 4; ++i) _mm256_storeu_ps(out + 8 * i, w[i]);
  }
}

// Few tokens (T <= 8): each block is expanded in registers and used at once, with no trip
// through the row buffer (at batch 1 the buffer's stores and reloads were ~1/4 of the work).
template <int T>
void fused_row_avx2(const uint8_t* row, int64_t nb, int64_t bb, int64_t qtype, const float* x,
                    int64_t K, float* y, int64_t ldy) {
  __m256 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256 w[4];
    block_lanes_avx2(row + b * bb, qtype, w);
    for (int t = 0; t < T; ++t)
      for (int i = 0; i < 4; ++i)
        acc[t] = _mm256_fmadd_ps(w[i], _mm256_loadu_ps(x + t * K + b * kQK + 8 * i), acc[t]);
  }
  for (int t = 0; t < T; ++t) y[t * ldy] = hsum(acc[t]);
}

void fused_rows_avx2(const uint8_t* wq, int64_t n0, int64_t n1, int64_t nb, int64_t bb,
                     int64_t qtype, const float* x, int64_t M, float* y, int64_t N) {
  const int64_t K = nb * kQK;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = wq + n * nb * bb;
    switch (M) {
      case 1: fused_row_avx2<1>(row, nb, bb, qtype, x, K, y + n, N); break;
      case 2: fused_row_avx2<2>(row, nb, bb, qtype, x, K, y + n, N); break;
      case 3: fused_row_avx2<3>(row, nb, bb, qtype, x, K, y + n, N); break;
      case 4: fused_row_avx2<4>(row, nb, bb, qtype, x, K, y + n, N); break;
      case 5: fused_row_avx2<5>(row, nb, bb, qtype, x, K, y + n, N); break;
      case 6: fused_row_avx2<6>(row, nb, bb, qtype, x, K, y + n, N); break;
      case 7: fused_row_avx2<7>(row, nb, bb, qtype, x, K, y + n, N); break;
      default: fused_row_avx2<8>(row, nb, bb, qtype, x, K, y + n, N); break;
    }
  }
}

#pragma GCC pop_options

bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

bool cpu_has_avx512_vnni() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512vnni");
  return ok;
}

bool cpu_has_avx2() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

void check_qweight(const torch::Tensor& qweight, int64_t qtype) {
  TORCH_CHECK(qweight.device().is_cpu(), "qweight must be on the CPU");
  TORCH_CHECK(qweight.scalar_type() == torch::kUInt8 && qweight.dim() == 2,
              "qweight must be uint8 [N, row_bytes]");
  TORCH_CHECK(qweight.is_contiguous(), "qweight must be contiguous");
  TORCH_CHECK(qweight.size(1) % block_bytes(qtype) == 0, "row bytes ", qweight.size(1),
              " are not whole blocks of ", block_bytes(qtype));
}

// Which kernel a call of 5+ tokens takes (the argument `variant` of ggml_linear).
constexpr int64_t kVariantFp32 = 0;  // fp32 activations: AVX-512 when the CPU has it, else AVX2
constexpr int64_t kVariantInt8 = 1;  // int8 activations (AVX512-VNNI; fp32 on other CPUs)
constexpr int64_t kVariantAvx2 = 2;  // fp32 activations, the AVX2 tile even on AVX-512 CPUs
constexpr int64_t kVariantAmx = 3;   // bf16 products on AMX tiles (fp32 on other CPUs)

// The AVX2 panels (and the scalar path on CPUs without AVX2): each task dequantises
// kPanelRows rows into an fp32 buffer, then multiplies them by every token.
void linear_panels(const uint8_t* wq, int64_t N, int64_t nb, int64_t bb, int64_t qtype,
                   const float* xp, int64_t M, float* yp, bool avx2) {
  const int64_t K = nb * kQK, panels = (N + kPanelRows - 1) / kPanelRows;
  vllm_cpu::parallel_chunks(panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<float> wbuf(kPanelRows * K);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kPanelRows, rows = std::min<int64_t>(kPanelRows, N - n0);
      for (int64_t r = 0; r < rows; ++r) {
        const uint8_t* row = wq + (n0 + r) * nb * bb;
        if (avx2)
          expand_row_avx2(row, nb, bb, qtype, wbuf.data() + r * K);
        else
          dequant_row_scalar(row, nb, qtype, wbuf.data() + r * K);
      }
      if (avx2)
        panel_avx2(wbuf.data(), rows, K, xp, M, yp + n0, N);
      else
        dot_rows_scalar(wbuf.data(), static_cast<int>(rows), K, xp, M, yp + n0, N);
    }
  });
}

}  // namespace

// x: [M, K] fp32; qweight: uint8 [N, (K / 32) * block_bytes] -> [M, N] fp32.
torch::Tensor ggml_linear(const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype,
                          int64_t variant) {
  check_qweight(qweight, qtype);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "x must be fp32 [M, K]");
  TORCH_CHECK(variant >= kVariantFp32 && variant <= kVariantAmx, "unknown variant ", variant);
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), N = qweight.size(0);
  const int64_t bb = block_bytes(qtype), nb = qweight.size(1) / bb, K = nb * kQK;
  TORCH_CHECK(xc.size(1) == K, "x has ", xc.size(1), " features, the weight ", K);
  auto y = torch::empty({M, N}, xc.options());
  if (M == 0 || N == 0) return y;
  const uint8_t* wq = qweight.data_ptr<uint8_t>();
  const float* xp = xc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool avx2 = cpu_has_avx2();
  // On AVX-512 CPUs their tile takes over from 5 tokens (measured there); on AVX2 CPUs the
  // fused kernel stays ahead of the panels up to 8.
  const bool avx512 = variant != kVariantAvx2 && cpu_has_avx512();
  const int64_t groups = (N + kRows512 - 1) / kRows512;
  if (avx512 && M <= kTokens) {
    const int64_t grain = std::max<int64_t>(1, 16384 / (K * M * kRows512));
    vllm_cpu::parallel_chunks(groups, grain, [&](int64_t g0, int64_t g1) {
      fused_rows_avx512(wq, g0, g1, N, nb, qtype, xp, M, yp);
    });
    return y;
  }
  if (avx2 && M <= (avx512 ? kTokens : kFusedMax)) {
    const int64_t grain = std::max<int64_t>(1, 16384 / (K * M));
    vllm_cpu::parallel_chunks(N, grain, [&](int64_t n0, int64_t n1) {
      fused_rows_avx2(wq, n0, n1, nb, bb, qtype, xp, M, yp, N);
    });
    return y;
  }
  if (variant == kVariantAmx && M <= amx_max_tokens() && vllm_cpu::cpu_has_amx_bf16()) {
    std::vector<uint32_t> xb;
    pack_x_amx(xp, M, K, xb);
    vllm_cpu::parallel_chunks((N + kRowsAmx - 1) / kRowsAmx, 1, [&](int64_t g0, int64_t g1) {
      linear_rows_amx(wq, g0, g1, N, nb, qtype, xb.data(), M, yp);
    });
    return y;
  }
  const int64_t grain = std::max<int64_t>(1, 16384 / (K * M * kRows512));
  if (variant == kVariantInt8 && cpu_has_avx512_vnni()) {
    QuantizedX qx;
    quantize_x_avx512(xp, M, K, qx);
    vllm_cpu::parallel_chunks(groups, grain, [&](int64_t g0, int64_t g1) {
      linear_rows_int8_avx512(wq, g0, g1, N, nb, bb, qtype, qx, M, yp);
    });
  } else if (variant != kVariantAvx2 && cpu_has_avx512()) {
    vllm_cpu::parallel_chunks(groups, grain, [&](int64_t g0, int64_t g1) {
      linear_rows_avx512(wq, g0, g1, N, nb, bb, qtype, xp, M, yp);
    });
  } else {
    linear_panels(wq, N, nb, bb, qtype, xp, M, yp, avx2);
  }
  return y;
}

// qweight -> W [N, K] fp32 (for large batches, where a dense GEMM beats the tile kernel).
torch::Tensor ggml_dequantize(const torch::Tensor& qweight, int64_t qtype) {
  check_qweight(qweight, qtype);
  const int64_t N = qweight.size(0), bb = block_bytes(qtype), nb = qweight.size(1) / bb;
  auto w = torch::empty({N, nb * kQK}, torch::dtype(torch::kFloat));
  const uint8_t* wq = qweight.data_ptr<uint8_t>();
  float* wp = w.data_ptr<float>();
  const bool avx2 = cpu_has_avx2();
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      if (avx2)
        dequant_row_avx2(wq + n * nb * bb, nb, qtype, wp + n * nb * kQK);
      else
        dequant_row_scalar(wq + n * nb * bb, nb, qtype, wp + n * nb * kQK);
    }
  });
  return w;
}

namespace {

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// fp32 -> bf16, rounded to nearest even as c10::BFloat16 (and torch's .to(bfloat16)) do:
// add 0x7FFF plus the kept part's lowest bit, keep the high half; NaN -> 0x7FC0.
void to_bf16_avx2(const float* x, int64_t n, uint16_t* out) {
  const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7FFF);
  const __m256i nan = _mm256_set1_epi32(0x7FC0);
  auto round = [&](__m256 v) {
    const __m256i b = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), one);
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, bias)), 16);
    return _mm256_blendv_epi8(r, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i lo = round(_mm256_loadu_ps(x + i)), hi = round(_mm256_loadu_ps(x + i + 8));
    // packus works within 128-bit lanes: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> reorder.
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(lo, hi), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), packed);
  }
  for (; i < n; ++i) out[i] = c10::BFloat16(x[i]).x;
}

#pragma GCC pop_options

}  // namespace

// qweight -> W [N, K] bf16: the fp32 weights of ggml_dequantize rounded to bf16 (the same
// bits as ggml_dequantize(...).to(torch.bfloat16)) in one pass, for the bf16 prefill GEMM;
// the fp32 matrix is never written (it was half of a 2k-token prefill's GEMM time).
torch::Tensor ggml_dequantize_bf16(const torch::Tensor& qweight, int64_t qtype) {
  check_qweight(qweight, qtype);
  const int64_t N = qweight.size(0), bb = block_bytes(qtype), nb = qweight.size(1) / bb;
  const int64_t K = nb * kQK;
  auto w = torch::empty({N, K}, torch::dtype(torch::kBFloat16));
  const uint8_t* wq = qweight.data_ptr<uint8_t>();
  auto* wp = reinterpret_cast<uint16_t*>(w.data_ptr<at::BFloat16>());
  const bool avx2 = cpu_has_avx2();
  vllm_cpu::parallel_chunks(N, 16, [&](int64_t n0, int64_t n1) {
    std::vector<float> row(K);
    for (int64_t n = n0; n < n1; ++n) {
      if (avx2) {
        dequant_row_avx2(wq + n * nb * bb, nb, qtype, row.data());
        to_bf16_avx2(row.data(), K, wp + n * K);
      } else {
        dequant_row_scalar(wq + n * nb * bb, nb, qtype, row.data());
        for (int64_t k = 0; k < K; ++k) wp[n * K + k] = c10::BFloat16(row[k]).x;
      }
    }
  });
  return w;
}

TORCH_LIBRARY_FRAGMENT(vllm_continuum_C, m) {
  m.def("ggml_linear(Tensor x, Tensor qweight, int qtype, int variant=0) -> Tensor");
  m.def("ggml_dequantize(Tensor qweight, int qtype) -> Tensor");
  m.def("ggml_dequantize_bf16(Tensor qweight, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_continuum_C, CPU, m) {
  m.impl("ggml_linear", &ggml_linear);
  m.impl("ggml_dequantize", &ggml_dequantize);
  m.impl("ggml_dequantize_bf16", &ggml_dequantize_bf16);
}
