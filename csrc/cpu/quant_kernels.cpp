// Weight-only quantized linear layers over GGUF blocks, fp32 activations.
//
// Weights stay in the GGUF file's own block layout, one matrix row after another
// (qweight: uint8 [N, (K / 32) * block_bytes], K = input features, N = output features):
//   Q4_1 (type 3, 20 bytes / 32 weights): fp16 d, fp16 m, 16 bytes of nibbles; byte j holds
//        weight j in its low nibble and weight j + 16 in its high nibble; w = q * d + m.
//   Q8_0 (type 8, 34 bytes / 32 weights): fp16 d, 32 int8 q; w = q * d.
//
// ggml_linear(x [M, K] fp32, qweight, variant) -> y [M, N] = x @ W^T. Decode steps (small M)
// read each weight once per call. Up to 4 tokens (bound by the bytes of weights streamed from
// memory), each block is expanded into 4 registers (8 lanes each) and multiplied by every
// token at once. From 5 tokens on (bound by arithmetic), rows are dequantised into a small
// fp32 buffer that stays in L1, then multiplied by the tokens in tiles, so the expansion is
// paid once per row, not once per token tile: with AVX-512, 4 rows x 6 tokens (24 accumulator
// registers, one 16-lane FMA per weight row and token per 16 inputs); with AVX2, 2 rows x 4
// tokens, 8 lanes. variant 1 quantises x to int8 per 32-value block instead and multiplies
// bytes with AVX512-VNNI (see QuantizedX); variant 2 keeps the AVX2 tile on AVX-512 CPUs (to
// measure one against the other). Rows are split over torch's intra-op threads
// (at::parallel_for: the same OpenMP pool and thread count as torch's own ops).
//
// The AVX2 + FMA + F16C and AVX-512 paths are compiled with target pragmas and chosen at run
// time, so the library still loads on older CPUs (a portable scalar path runs without AVX2).
// ggml_dequantize computes W in fp32 exactly as the pure-torch fallback in
// vllm/_custom_ops.py does (q * d, then + m: two roundings, no FMA), so both are bit-identical.
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kQK = 32;  // weights per block, both types
constexpr int64_t kTypeQ4_1 = 3;
constexpr int64_t kTypeQ8_0 = 8;
constexpr int kRows = 2;    // weight rows per tile
constexpr int kTokens = 4;  // tokens per tile

int64_t block_bytes(int64_t qtype) {
  if (qtype == kTypeQ4_1) return 20;
  if (qtype == kTypeQ8_0) return 34;
  TORCH_CHECK(false, "unsupported GGML type ", qtype, " (supported: Q4_1=3, Q8_0=8)");
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);  // blocks are 20 / 34 bytes: fp16 fields are unaligned
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

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

template <int R>
void dot_rows_avx2_r(const float* w, int64_t K, const float* x, int64_t M, float* y,
                     int64_t ldy) {
  int64_t t = 0;
  for (; t + kTokens <= M; t += kTokens) dot_tile_avx2<R, kTokens>(w, K, x + t * K, y + t * ldy, ldy);
  switch (M - t) {  // the last, partial token tile
    case 3: dot_tile_avx2<R, 3>(w, K, x + t * K, y + t * ldy, ldy); break;
    case 2: dot_tile_avx2<R, 2>(w, K, x + t * K, y + t * ldy, ldy); break;
    case 1: dot_tile_avx2<R, 1>(w, K, x + t * K, y + t * ldy, ldy); break;
    default: break;
  }
}

void dot_rows_avx2(const float* w, int rows, int64_t K, const float* x, int64_t M, float* y,
                   int64_t ldy) {
  if (rows == 2)
    dot_rows_avx2_r<2>(w, K, x, M, y, ldy);
  else
    dot_rows_avx2_r<1>(w, K, x, M, y, ldy);
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

// Few tokens (T <= 4): each block is expanded in registers and used at once, with no trip
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
      default: fused_row_avx2<4>(row, nb, bb, qtype, x, K, y + n, N); break;
    }
  }
}

#pragma GCC pop_options

// ---- AVX-512 paths (5 to 47 tokens) -------------------------------------------------------
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

constexpr int kRows512 = 4;    // weight rows per tile, both AVX-512 paths
constexpr int kTokens512 = 6;  // tokens per fp32 tile: 4 x 6 accumulators + 4 weights < 32
constexpr int kLanes = 16;     // tokens per int8 tile: one per 32-bit lane

inline __m512 bcast_half512(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _mm512_set1_ps(_cvtsh_ss(bits));
}

// As dequant_row_avx2 (q * d, then + m), 16 lanes at a time: a nibble half is 16 weights.
void dequant_row_avx512(const uint8_t* row, int64_t nb, int64_t qtype, float* out) {
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b, out += kQK) {
    if (qtype == kTypeQ4_1) {
      const uint8_t* blk = row + b * 20;
      const __m512 d = bcast_half512(blk), m = bcast_half512(blk + 2);
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      const __m128i halves[2] = {_mm_and_si128(qs, low4),
                                 _mm_and_si128(_mm_srli_epi16(qs, 4), low4)};
      for (int h = 0; h < 2; ++h) {
        const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(halves[h]));
        _mm512_storeu_ps(out + 16 * h, _mm512_add_ps(_mm512_mul_ps(q, d), m));
      }
    } else {
      const uint8_t* blk = row + b * 34;
      const __m512 d = bcast_half512(blk);
      for (int h = 0; h < 2; ++h) {
        const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * h));
        _mm512_storeu_ps(out + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), d));
      }
    }
  }
}

// y[t * ldy + r] = dot(w row r, x row t) for r < rows (of kRows512 in w), t < T.
template <int T>
void dot_tile_avx512(const float* w, int rows, int64_t K, const float* x, float* y, int64_t ldy) {
  constexpr int R = kRows512;
  __m512 acc[R][T];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + r * K + k);
    for (int t = 0; t < T; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * K + k);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int t = 0; t < T; ++t) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

// The last, partial token tile (n < T tokens left).
template <int T>
void dot_tail_avx512(int64_t n, const float* w, int rows, int64_t K, const float* x, float* y,
                     int64_t ldy) {
  if constexpr (T > 1) {
    if (n == T - 1)
      dot_tile_avx512<T - 1>(w, rows, K, x, y, ldy);
    else
      dot_tail_avx512<T - 1>(n, w, rows, K, x, y, ldy);
  }
}

void dot_rows_avx512(const float* w, int rows, int64_t K, const float* x, int64_t M, float* y,
                     int64_t ldy) {
  int64_t t = 0;
  for (; t + kTokens512 <= M; t += kTokens512)
    dot_tile_avx512<kTokens512>(w, rows, K, x + t * K, y + t * ldy, ldy);
  if (t < M) dot_tail_avx512<kTokens512>(M - t, w, rows, K, x + t * K, y + t * ldy, ldy);
}

// Rows [g0, g1) groups of kRows512: dequantised into an fp32 buffer that stays in L1
// (the last group's missing rows are zeros, computed and not written).
void linear_rows_avx512(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                        int64_t bb, int64_t qtype, const float* x, int64_t M, float* y) {
  const int64_t K = nb * kQK;
  std::vector<float> wbuf(kRows512 * K, 0.f);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * kRows512;
    const int rows = static_cast<int>(std::min<int64_t>(kRows512, N - n0));
    for (int r = 0; r < rows; ++r)
      dequant_row_avx512(wq + (n0 + r) * nb * bb, nb, qtype, wbuf.data() + r * K);
    std::fill(wbuf.begin() + rows * K, wbuf.end(), 0.f);
    dot_rows_avx512(wbuf.data(), rows, K, x, M, y + n0, N);
  }
}

// int8 activations. Each 32-value block of a token is quantised as Q8_1 does: dx = amax / 127,
// q = round(x / dx) (x times 1 / dx, ties to even), and dx * sum(q) kept for Q4_1's m term:
//   y = sum over blocks of dw * dx * sum(qw * qx) + m * dx * sum(qx).
// Tokens sit in the 32-bit lanes (16 a tile), so one VPDPBUSD multiplies 4 weights of one row,
// broadcast, by 4 inputs of 16 tokens and adds each lane's 4 products: a block of one row
// costs 8 of them for 16 tokens, and its scales are applied once per block and row.
// VPDPBUSD takes unsigned x signed bytes: weights go in signed (nibbles 0..15; Q8_0 as is),
// activations in as q + 128, and 128 * sum(qw) is taken off each block's sum.
struct QuantizedX {
  int64_t tiles = 0, nb = 0;
  std::vector<uint8_t> q;  // [tile][block][group of 4 inputs][lane][4]: q + 128
  std::vector<float> d;    // [tile][block][lane]: dx (0 for padding lanes)
  std::vector<float> s;    // [tile][block][lane]: dx * sum(q)
};

void quantize_x_avx512(const float* x, int64_t M, int64_t K, QuantizedX& qx) {
  qx.tiles = (M + kLanes - 1) / kLanes;
  qx.nb = K / kQK;
  qx.q.assign(qx.tiles * qx.nb * kQK * kLanes, 0x80);
  qx.d.assign(qx.tiles * qx.nb * kLanes, 0.f);
  qx.s.assign(qx.tiles * qx.nb * kLanes, 0.f);
  const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t t = 0; t < M; ++t) {
    const int64_t tile = t / kLanes, lane = t % kLanes;
    for (int64_t b = 0; b < qx.nb; ++b) {
      const float* xb = x + t * K + b * kQK;
      const __m512 v0 = _mm512_loadu_ps(xb), v1 = _mm512_loadu_ps(xb + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      const float dx = amax / 127.f;
      const __m512 inv = _mm512_set1_ps(dx > 0.f ? 1.f / dx : 0.f);
      const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, inv));  // ties to even
      const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, inv));
      const int64_t at = (tile * qx.nb + b) * kLanes + lane;
      qx.d[at] = dx;
      qx.s[at] = dx * static_cast<float>(_mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1)));
      alignas(16) uint32_t groups[8];
      _mm_store_si128(reinterpret_cast<__m128i*>(groups), _mm_xor_si128(_mm512_cvtepi32_epi8(i0), flip));
      _mm_store_si128(reinterpret_cast<__m128i*>(groups + 4), _mm_xor_si128(_mm512_cvtepi32_epi8(i1), flip));
      uint8_t* dst = qx.q.data() + (tile * qx.nb + b) * kQK * kLanes + lane * 4;
      for (int gi = 0; gi < 8; ++gi) std::memcpy(dst + gi * kLanes * 4, &groups[gi], 4);
    }
  }
}

// One weight row as VPDPBUSD's signed operand: 32 bytes a block, 128 * sum(q), dw, m.
struct RowS8 {
  int8_t* q;
  int32_t* corr;
  float* d;
  float* m;
};

void prep_row_s8(const uint8_t* row, int64_t nb, int64_t qtype, RowS8 out) {
  const __m128i low4 = _mm_set1_epi8(0x0F), flip = _mm_set1_epi8(static_cast<char>(0x80));
  for (int64_t b = 0; b < nb; ++b) {
    __m128i h0, h1;
    int32_t bias = 0;  // what the byte sums below count on top of sum(q)
    if (qtype == kTypeQ4_1) {
      const uint8_t* blk = row + b * 20;
      out.d[b] = half_at(blk);
      out.m[b] = half_at(blk + 2);
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      h0 = _mm_and_si128(qs, low4);
      h1 = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    } else {
      const uint8_t* blk = row + b * 34;
      out.d[b] = half_at(blk);
      out.m[b] = 0.f;
      h0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
      h1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 18));
      bias = 32 * 128;  // the unsigned byte sum of q ^ 0x80 is sum(q) + 32 * 128
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + b * kQK), h0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out.q + b * kQK + 16), h1);
    const __m128i u0 = bias ? _mm_xor_si128(h0, flip) : h0, u1 = bias ? _mm_xor_si128(h1, flip) : h1;
    const __m128i sad = _mm_add_epi64(_mm_sad_epu8(u0, _mm_setzero_si128()),
                                      _mm_sad_epu8(u1, _mm_setzero_si128()));
    const int32_t sum = _mm_cvtsi128_si32(sad) + _mm_extract_epi32(sad, 2) - bias;
    out.corr[b] = 128 * sum;
  }
}

// acc[r] lane l = row r's output for token l of the tile (kRows512 rows of prepared weights).
template <bool kMin>
void int8_tile_avx512(const int8_t* wq, const int32_t* corr, const float* dw, const float* mw,
                      int64_t nb, const uint8_t* xq, const float* xd, const float* xs,
                      __m512 acc[kRows512]) {
  constexpr int R = kRows512;
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i xv[8];
    for (int g = 0; g < 8; ++g)
      xv[g] = _mm512_loadu_si512(xq + (b * 8 + g) * kLanes * 4);
    const __m512 dx = _mm512_loadu_ps(xd + b * kLanes);
    for (int r = 0; r < R; ++r) {
      const int64_t rb = r * nb + b;
      int32_t w4[8];
      std::memcpy(w4, wq + rb * kQK, sizeof(w4));
      __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
      for (int g = 0; g < 8; g += 2) {  // two chains: VPDPBUSD's latency
        s0 = _mm512_dpbusd_epi32(s0, xv[g], _mm512_set1_epi32(w4[g]));
        s1 = _mm512_dpbusd_epi32(s1, xv[g + 1], _mm512_set1_epi32(w4[g + 1]));
      }
      const __m512i isum = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(corr[rb]));
      const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(dw[rb]), dx);
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), scale, acc[r]);
      if (kMin)
        acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(mw[rb]), _mm512_loadu_ps(xs + b * kLanes), acc[r]);
    }
  }
}

void linear_rows_int8_avx512(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                             int64_t bb, int64_t qtype, const QuantizedX& qx, int64_t M,
                             float* y) {
  constexpr int R = kRows512;
  std::vector<int8_t> q(R * nb * kQK, 0);
  std::vector<int32_t> corr(R * nb, 0);
  std::vector<float> dw(R * nb, 0.f), mw(R * nb, 0.f);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * R;
    const int rows = static_cast<int>(std::min<int64_t>(R, N - n0));
    for (int r = 0; r < rows; ++r)
      prep_row_s8(wq + (n0 + r) * nb * bb, nb, qtype,
                  {q.data() + r * nb * kQK, corr.data() + r * nb, dw.data() + r * nb, mw.data() + r * nb});
    if (rows < R) {  // the last group: zero weights for the missing rows
      std::fill(dw.begin() + rows * nb, dw.end(), 0.f);
      std::fill(mw.begin() + rows * nb, mw.end(), 0.f);
    }
    for (int64_t tile = 0; tile < qx.tiles; ++tile) {
      __m512 acc[R];
      const uint8_t* xq = qx.q.data() + tile * nb * kQK * kLanes;
      const float* xd = qx.d.data() + tile * nb * kLanes;
      const float* xs = qx.s.data() + tile * nb * kLanes;
      if (qtype == kTypeQ4_1)
        int8_tile_avx512<true>(q.data(), corr.data(), dw.data(), mw.data(), nb, xq, xd, xs, acc);
      else
        int8_tile_avx512<false>(q.data(), corr.data(), dw.data(), mw.data(), nb, xq, xd, xs, acc);
      const int64_t lanes = std::min<int64_t>(kLanes, M - tile * kLanes);
      for (int r = 0; r < rows; ++r) {
        alignas(64) float out[kLanes];
        _mm512_store_ps(out, acc[r]);
        for (int64_t l = 0; l < lanes; ++l) y[(tile * kLanes + l) * N + n0 + r] = out[l];
      }
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

// The AVX2 pair-of-rows tile (and the scalar path on CPUs without AVX2).
void linear_pairs(const uint8_t* wq, int64_t N, int64_t nb, int64_t bb, int64_t qtype,
                  const float* xp, int64_t M, float* yp, bool avx2) {
  const int64_t K = nb * kQK, pairs = (N + kRows - 1) / kRows;
  // A grain of ~16k MACs per task keeps tiny layers on one thread (no wake-up cost).
  const int64_t grain = std::max<int64_t>(1, 16384 / (K * M));
  at::parallel_for(0, pairs, grain, [&](int64_t p0, int64_t p1) {
    std::vector<float> wbuf(kRows * K);  // the tile's rows in fp32, reused: stays in L1
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, N - n0));
      for (int r = 0; r < rows; ++r) {
        const uint8_t* row = wq + (n0 + r) * nb * bb;
        if (avx2)
          dequant_row_avx2(row, nb, qtype, wbuf.data() + r * K);
        else
          dequant_row_scalar(row, nb, qtype, wbuf.data() + r * K);
      }
      if (avx2)
        dot_rows_avx2(wbuf.data(), rows, K, xp, M, yp + n0, N);
      else
        dot_rows_scalar(wbuf.data(), rows, K, xp, M, yp + n0, N);
    }
  });
}

}  // namespace

// x: [M, K] fp32; qweight: uint8 [N, (K / 32) * block_bytes] -> [M, N] fp32.
torch::Tensor ggml_linear(const torch::Tensor& x, const torch::Tensor& qweight, int64_t qtype,
                          int64_t variant) {
  check_qweight(qweight, qtype);
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.dim() == 2, "x must be fp32 [M, K]");
  TORCH_CHECK(variant >= kVariantFp32 && variant <= kVariantAvx2, "unknown variant ", variant);
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
  if (avx2 && M <= kTokens) {
    const int64_t grain = std::max<int64_t>(1, 16384 / (K * M));
    at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
      fused_rows_avx2(wq, n0, n1, nb, bb, qtype, xp, M, yp, N);
    });
    return y;
  }
  const int64_t groups = (N + kRows512 - 1) / kRows512;
  const int64_t grain = std::max<int64_t>(1, 16384 / (K * M * kRows512));
  if (variant == kVariantInt8 && cpu_has_avx512_vnni()) {
    QuantizedX qx;
    quantize_x_avx512(xp, M, K, qx);
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      linear_rows_int8_avx512(wq, g0, g1, N, nb, bb, qtype, qx, M, yp);
    });
  } else if (variant != kVariantAvx2 && cpu_has_avx512()) {
    at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      linear_rows_avx512(wq, g0, g1, N, nb, bb, qtype, xp, M, yp);
    });
  } else {
    linear_pairs(wq, N, nb, bb, qtype, xp, M, yp, avx2);
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

TORCH_LIBRARY_FRAGMENT(vllm_continuum_C, m) {
  m.def("ggml_linear(Tensor x, Tensor qweight, int qtype, int variant=0) -> Tensor");
  m.def("ggml_dequantize(Tensor qweight, int qtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(vllm_continuum_C, CPU, m) {
  m.impl("ggml_linear", &ggml_linear);
  m.impl("ggml_dequantize", &ggml_dequantize);
}
