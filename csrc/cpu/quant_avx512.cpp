// The AVX-512 paths of ggml_linear (up to 47 tokens; dispatch in quant_kernels.cpp, block
// layouts in quant_blocks.h). All take rows in groups of kRows512 = 4:
//   fused (1 to 4 tokens, fp32): each block of the group's rows is expanded in registers and
//         used at once by every token, with software prefetches of the groups ahead (at
//         batch 1 the hardware prefetcher alone left the kernel waiting on memory).
//   fp32: the group's rows are dequantised into a small fp32 buffer that stays in L1, then
//         multiplied by the tokens in tiles of up to 6 (4 x 6 accumulator registers, one
//         16-lane FMA per weight row and token per 16 inputs), so the expansion is paid once
//         per row, not once per token tile. The tokens are split into tiles of near-equal
//         size (8: 4 + 4, not 6 + 2).
//   int8 (variant 1): x is quantised to int8 per 32-value block and the bytes multiplied with
//         AVX512-VNNI, 16 tokens a tile (see quantize_x_avx512).
// Compiled with a target pragma: only called after the dispatcher's run-time CPU checks.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant_blocks.h"
#include "quant_lanes512.h"

namespace vllm_cpu::gguf {
namespace {

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

constexpr int kTokens512 = 6;  // tokens per fp32 tile: 4 x 6 accumulators + 4 weights < 32
constexpr int kLanes = 16;     // tokens per int8 tile: one per 32-bit lane


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

// A tile of n <= T tokens (its size a template argument: the accumulators stay in registers).
template <int T>
void dot_tile_n_avx512(int64_t n, const float* w, int rows, int64_t K, const float* x, float* y,
                       int64_t ldy) {
  if constexpr (T > 1) {
    if (n < T) return dot_tile_n_avx512<T - 1>(n, w, rows, K, x, y, ldy);
  }
  dot_tile_avx512<T>(w, rows, K, x, y, ldy);
}

void dot_rows_avx512(const float* w, int rows, int64_t K, const float* x, int64_t M, float* y,
                     int64_t ldy) {
  // Tiles of near-equal size (8 tokens: 4 + 4, not 6 + 2; 16: 6 + 5 + 5): a tile of few
  // tokens pays the rows' loads for little arithmetic.
  const int64_t tiles = (M + kTokens512 - 1) / kTokens512;
  for (int64_t i = 0, t = 0; i < tiles; ++i) {
    const int64_t n = (M - t + (tiles - i) - 1) / (tiles - i);
    dot_tile_n_avx512<kTokens512>(n, w, rows, K, x + t * K, y + t * ldy, ldy);
    t += n;
  }
}

// ---- few tokens (1 to kFused512): the expansion fused with the products ----------------
constexpr int kFused512 = 4;     // tokens per call of the fused kernel, at most
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead the software prefetches read

// R rows (contiguous, from `rows`) x T tokens. Each block of the R rows is expanded in
// registers and multiplied by every token at once; the x loads of a block are shared by the R
// rows, and R independent accumulator chains (two per row and token when T <= 2) hide the
// FMA latency. `pf` .. `pf_end`: bytes of a later group, prefetched a slice per block so that
// the loads from memory overlap the arithmetic (at batch 1 the kernel is otherwise waiting on
// memory: measured 4.5 GB/s from DRAM against 12.6 GB/s from cache on a 25 GB/s machine).
template <bool kQ4, int R, int T>
void fused_group_avx512(const uint8_t* rows, int64_t nb, const float* x, int64_t K, float* y,
                        int64_t ldy, const uint8_t* pf, const uint8_t* pf_end) {
  constexpr int64_t bb = kQ4 ? 20 : 34;
  constexpr int A = T <= 2 ? 2 : 1;
  const int64_t row_bytes = nb * bb;
  __m512 acc[R][T][A];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      for (int a = 0; a < A; ++a) acc[r][t][a] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    for (const uint8_t* p = pf + b * R * bb; p < pf + (b + 1) * R * bb && p < pf_end; p += 64)
      _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
    __m512 xv[T][2];
    for (int t = 0; t < T; ++t)
      for (int h = 0; h < 2; ++h) xv[t][h] = _mm512_loadu_ps(x + t * K + b * kQK + 16 * h);
    for (int r = 0; r < R; ++r) {
      __m512 w[2];
      block_lanes_avx512<kQ4>(rows + r * row_bytes + b * bb, w);
      for (int t = 0; t < T; ++t)
        for (int h = 0; h < 2; ++h)
          acc[r][t][h % A] = _mm512_fmadd_ps(w[h], xv[t][h], acc[r][t][h % A]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t) {
      __m512 s = acc[r][t][0];
      if constexpr (A == 2) s = _mm512_add_ps(s, acc[r][t][1]);
      y[t * ldy + r] = _mm512_reduce_add_ps(s);
    }
}

template <bool kQ4, int T>
void fused_rows_t_avx512(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                         const float* x, float* y) {
  constexpr int R = kRows512;
  constexpr int64_t bb = kQ4 ? 20 : 34;
  const int64_t K = nb * kQK, row_bytes = nb * bb;
  const uint8_t* end = wq + N * row_bytes;
  // whole groups ahead: the prefetch of a block's slice lines up with the block read
  const int64_t ahead = std::max<int64_t>(1, kPrefetchBytes / (R * row_bytes)) * R * row_bytes;
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * R;
    const uint8_t* rows = wq + n0 * row_bytes;
    const uint8_t* pf = std::min(rows + ahead, end);
    switch (std::min<int64_t>(R, N - n0)) {
      case 4: fused_group_avx512<kQ4, 4, T>(rows, nb, x, K, y + n0, N, pf, end); break;
      case 3: fused_group_avx512<kQ4, 3, T>(rows, nb, x, K, y + n0, N, pf, end); break;
      case 2: fused_group_avx512<kQ4, 2, T>(rows, nb, x, K, y + n0, N, pf, end); break;
      default: fused_group_avx512<kQ4, 1, T>(rows, nb, x, K, y + n0, N, pf, end); break;
    }
  }
}

template <bool kQ4>
void fused_rows_q_avx512(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                         const float* x, int64_t M, float* y) {
  switch (M) {
    case 1: fused_rows_t_avx512<kQ4, 1>(wq, g0, g1, N, nb, x, y); break;
    case 2: fused_rows_t_avx512<kQ4, 2>(wq, g0, g1, N, nb, x, y); break;
    case 3: fused_rows_t_avx512<kQ4, 3>(wq, g0, g1, N, nb, x, y); break;
    default: fused_rows_t_avx512<kQ4, 4>(wq, g0, g1, N, nb, x, y); break;
  }
}

}  // namespace

void fused_rows_avx512(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                       int64_t qtype, const float* x, int64_t M, float* y) {
  TORCH_CHECK(M >= 1 && M <= kFused512, "the fused AVX-512 kernel takes 1 to ", kFused512,
              " tokens, not ", M);
  if (qtype == kTypeQ4_1)
    fused_rows_q_avx512<true>(wq, g0, g1, N, nb, x, M, y);
  else
    fused_rows_q_avx512<false>(wq, g0, g1, N, nb, x, M, y);
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

namespace {

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
      out.d[b] = half_f16c(blk);
      out.m[b] = half_f16c(blk + 2);
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
      h0 = _mm_and_si128(qs, low4);
      h1 = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    } else {
      const uint8_t* blk = row + b * 34;
      out.d[b] = half_f16c(blk);
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

}  // namespace

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

}  // namespace vllm_cpu::gguf
