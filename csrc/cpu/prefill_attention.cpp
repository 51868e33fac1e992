// Causal prefill attention, flash style, for AVX-512 and AVX2 CPUs.
//
// prefill_attention(out, q, k, v, scale, causal_offset, bf16) -> bool:
//   q, out [Lq, H, D] fp32; k, v [Lk, KVH, D] fp32. Each may be row-strided (the columns of
//   a fused qkv output); the heads of a row must be contiguous. Query i attends keys
//   j <= i + causal_offset (>= 0, so every query sees key 0); H a multiple of KVH (GQA).
//   Returns false (and writes nothing) when the CPU has neither AVX-512 nor AVX2 + FMA (for
//   bf16: lacks AVX512_BF16) or D is not a multiple of 64: the caller then runs SDPA.
//
// Work unit: one kv head and a tile of kBQ query positions; its G = H / KVH query heads are
// its G * kBQ rows, so each K/V tile is read once for the whole group. For each tile of
// kBK keys (tiles past the unit's last visible key are skipped; masking only in the
// diagonal tiles) and each block of rows: scores (the keys pre-packed transposed once per
// call), an online softmax in fp32 (running max and sum, the accumulators rescaled when the
// max moves), then P V into the rows' fp32 accumulators. Units are split over torch's
// threads in contiguous runs of equal cost (causal units differ in cost by up to Lk / kBK
// times). The driver (run, run_unit) and the K packing are shared; each instruction set
// brings its block step:
//
// AVX-512 (fp32 and bf16): blocks of 6 rows, a row's 64 scores in 4 zmm registers.
// bf16: Q, K, P and V are rounded to bf16 and both products run on vdpbf16ps (pairs of
// bf16 products summed into fp32 lanes); softmax and accumulation stay fp32. K is packed
// as [D / 2][kBK][2] (pairs along the head dim), V as [kBK / 2][D][2] (pairs along keys).
//
// AMX (bf16, where the CPU has AMX-BF16): blocks of 16 rows, scores and P V on the tile
// unit with the same packings (they are the tiles' B layouts), the softmax as AVX-512's;
// rows short of a 16-row block take the AVX-512 bf16 blocks.
//
// AVX2 + FMA (fp32): 16 ymm registers hold a 6 x 16 block (12 accumulators, 2 K or V
// vectors, a broadcast), so a tile's scores go through memory in 16-key slices, and P V
// runs 16 head-dim columns at a time.
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx.h"
#include "vec_math.h"

namespace {

constexpr int kBK = 64;  // keys per tile (4 vectors of 16 lanes, 8 of 8)
constexpr int kBQ = 16;  // query positions per unit (8..64 time the same)
constexpr int kR = 6;    // rows per register block (AVX-512: 6 x 4 zmm accumulators)
constexpr int kR2 = 6;   // AVX2: 6 x 2 ymm accumulators
constexpr int kC2 = 16;  // AVX2: keys (scores) or head-dim columns (P V) per register block

bool cpu_has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") &&
                         __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return ok;
}

bool cpu_has_avx512_bf16() {
  static const bool ok = cpu_has_avx512() && __builtin_cpu_supports("avx512bf16");
  return ok;
}

struct Problem {
  const float *q, *k, *v;
  float* out;
  int64_t q_stride, k_stride, v_stride, o_stride;  // elements between two tokens
  int64_t Lq, Lk, KVH, G, D, off;
  float scale;
  int64_t ntk;  // key tiles
};

// Per-thread buffers of one unit.
struct Scratch {
  std::vector<float> q, o, p, m, l;
  std::vector<uint16_t> qh, ph;  // bf16 copies of q and of one block's probabilities
  std::vector<float> pv;         // AMX: one block's P V (kAmxRows x D)
};

constexpr int kAmxRows = 16;  // rows per AMX block (a tile's rows)

// One key tile as the block steps read it.
struct Tile {
  const float* kt;     // fp32 K^T tile, or nullptr for bf16
  const float* v;      // fp32 V: rows in place (strided), first key; AVX2: the packed tile
  const uint16_t* kb;  // bf16 tiles
  const uint16_t* vb;
  int64_t j0;          // first key
};

// Last key of tile T that row r of the unit starting at query q0 sees, relative to the
// tile: below 0 when it sees none of it, nk - 1 when it sees all of its valid keys.
inline int64_t last_visible(const Problem& P, int64_t q0, int64_t r, const Tile& T, int nk) {
  return std::min<int64_t>(q0 + r / P.G + P.off - T.j0, nk - 1);
}

// Key tile t of kv head h, fp32, zero past Lk: K^T in slices of `width` keys,
// kt[j / width][d][j % width] = k[t * kBK + j][d] (AVX-512: one slice, kt[d][j]).
void pack_k_f32(const Problem& P, int64_t h, int64_t t, int width, float* kt) {
  const int64_t j0 = t * kBK, nk = std::min<int64_t>(kBK, P.Lk - j0), D = P.D;
  for (int64_t j = 0; j < kBK; ++j) {
    const float* src = P.k + (j0 + j) * P.k_stride + h * D;
    float* dst = kt + (j / width) * D * width + j % width;
    for (int64_t d = 0; d < D; ++d) dst[d * width] = j < nk ? src[d] : 0.f;
  }
}

// V of the same tile in slices of `width` head-dim columns, each contiguous over the keys:
// vt[d / width][j][d % width] = v[t * kBK + j][d] (AVX2; AVX-512 reads V rows in place).
void pack_v_f32(const Problem& P, int64_t h, int64_t t, int width, float* vt) {
  const int64_t j0 = t * kBK, nk = std::min<int64_t>(kBK, P.Lk - j0), D = P.D;
  for (int64_t j = 0; j < kBK; ++j) {
    const float* src = P.v + (j0 + j) * P.v_stride + h * D;
    for (int64_t d0 = 0; d0 < D; d0 += width)  // slice d0 / width starts at vt + d0 * kBK
      for (int w = 0; w < width; ++w) vt[d0 * kBK + j * width + w] = j < nk ? src[d0 + w] : 0.f;
  }
}

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

inline uint32_t pair_bits(const uint16_t* p) {
  uint32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

// Round-to-nearest-even bf16 of 32 floats (a then b) into dst.
inline void store_bf16x32(uint16_t* dst, __m512 a, __m512 b) {
  _mm512_storeu_si512(dst, (__m512i)_mm512_cvtne2ps_pbh(b, a));
}

// bf16 K: kb[d / 2][j][d % 2]; V: vb[j / 2][d][j % 2] (zero past Lk).
void pack_kv_bf16(const Problem& P, int64_t h, int64_t t, uint16_t* kb, uint16_t* vb) {
  const int64_t j0 = t * kBK, nk = std::min<int64_t>(kBK, P.Lk - j0), D = P.D;
  std::vector<uint16_t> row(D);
  for (int64_t j = 0; j < kBK; ++j) {
    for (int which = 0; which < 2; ++which) {
      if (j < nk) {
        const float* src = (which ? P.v + (j0 + j) * P.v_stride : P.k + (j0 + j) * P.k_stride) +
                           h * D;
        for (int64_t d = 0; d < D; d += 32)
          store_bf16x32(row.data() + d, _mm512_loadu_ps(src + d), _mm512_loadu_ps(src + d + 16));
      } else {
        std::fill(row.begin(), row.end(), uint16_t{0});
      }
      if (which == 0)
        for (int64_t d = 0; d < D; ++d) kb[((d >> 1) * kBK + j) * 2 + (d & 1)] = row[d];
      else
        for (int64_t d = 0; d < D; ++d) vb[((j >> 1) * D + d) * 2 + (j & 1)] = row[d];
    }
  }
}

// ---- one block of R rows against one key tile -------------------------------------------
// The two micro-kernels are not inlined: inlined into block_step, GCC kept the exp's
// constants in registers through them and, short of registers, reloaded K / V for every
// FMA (load-bound: 1.3x slower at 6 rows, and the 4-row blocks it forced lost ~5%).
template <int R, bool BF16>
__attribute__((noinline)) void scores(const Problem& P, const Scratch& s, int64_t r0, const Tile& T,
                   __m512 (&out)[R][4]) {
  __m512 acc[R][4];  // local, so that it lives in registers through the loop
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
  const int64_t D = P.D;
  if constexpr (BF16) {
    const uint16_t* q = s.qh.data() + r0 * D;
    for (int64_t d2 = 0; d2 < D / 2; ++d2) {
      const uint16_t* kd = T.kb + d2 * kBK * 2;
      __m512bh k[4];
      for (int c = 0; c < 4; ++c) k[c] = (__m512bh)_mm512_loadu_si512(kd + 32 * c);
      for (int r = 0; r < R; ++r) {
        const __m512bh qb = (__m512bh)_mm512_set1_epi32(pair_bits(q + r * D + 2 * d2));
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], qb, k[c]);
      }
    }
  } else {
    const float* q = s.q.data() + r0 * D;
    for (int64_t d = 0; d < D; ++d) {
      const float* kd = T.kt + d * kBK;
      __m512 k[4];
      for (int c = 0; c < 4; ++c) k[c] = _mm512_loadu_ps(kd + 16 * c);
      for (int r = 0; r < R; ++r) {
        const __m512 qb = _mm512_set1_ps(q[r * D + d]);
        for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(qb, k[c], acc[r][c]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < 4; ++c) out[r][c] = acc[r][c];
}

// o[r] = alpha[r] o[r] + sum_j p[r][j] v[j], 64 columns at a time.
template <int R, bool BF16>
__attribute__((noinline)) void accumulate(const Problem& P, Scratch& s, int64_t r0, const Tile& T, int nk,
                       const float* alpha) {
  const int64_t D = P.D;
  for (int64_t c0 = 0; c0 < D; c0 += 64) {
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(alpha[r]);
      for (int c = 0; c < 4; ++c)
        acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(s.o.data() + (r0 + r) * D + c0 + 16 * c), a);
    }
    if constexpr (BF16) {
      for (int j2 = 0; j2 < (nk + 1) / 2; ++j2) {  // p is zero past nk
        const uint16_t* vj = T.vb + (j2 * D + c0) * 2;
        __m512bh v[4];
        for (int c = 0; c < 4; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vj + 32 * c);
        for (int r = 0; r < R; ++r) {
          const __m512bh pb = (__m512bh)_mm512_set1_epi32(pair_bits(s.ph.data() + r * kBK + 2 * j2));
          for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], pb, v[c]);
        }
      }
    } else {
      for (int j = 0; j < nk; ++j) {
        const float* vj = T.v + j * P.v_stride + c0;
        __m512 v[4];
        for (int c = 0; c < 4; ++c) v[c] = _mm512_loadu_ps(vj + 16 * c);
        for (int r = 0; r < R; ++r) {
          const __m512 pb = _mm512_set1_ps(s.p[r * kBK + j]);
          for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_fmadd_ps(pb, v[c], acc[r][c]);
        }
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 4; ++c)
        _mm512_storeu_ps(s.o.data() + (r0 + r) * D + c0 + 16 * c, acc[r][c]);
  }
}

// Online softmax of row `row` of the unit whose first query is q0, against key tile T (nk
// valid keys): its 64 scores in `x` become exp(score - new max), the keys past its last
// visible one masked to 0; its running max and sum move on. Returns alpha = exp(old max -
// new max), the factor for its accumulated output.
inline float softmax_row(const Problem& P, Scratch& s, int64_t q0, int64_t row, const Tile& T,
                         int nk, __m512 (&x)[4]) {
  const int64_t last = last_visible(P, q0, row, T, nk);  // relative to the tile
  if (last < kBK - 1) {
    const __m512i iota = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i lim = _mm512_set1_epi32(static_cast<int>(std::max<int64_t>(last, -1)));
    for (int c = 0; c < 4; ++c) {
      const __mmask16 keep =
          _mm512_cmple_epi32_mask(_mm512_add_epi32(iota, _mm512_set1_epi32(16 * c)), lim);
      x[c] = _mm512_mask_blend_ps(keep, _mm512_set1_ps(-INFINITY), x[c]);
    }
  }
  const __m512 mx4 = _mm512_max_ps(_mm512_max_ps(x[0], x[1]), _mm512_max_ps(x[2], x[3]));
  const float m_old = s.m[row];
  const float m_new = std::max(m_old, _mm512_reduce_max_ps(mx4));  // finite: key 0 seen first
  const float alpha = std::exp(m_old - m_new);
  const __m512 mn = _mm512_set1_ps(m_new);
  for (int c = 0; c < 4; ++c) x[c] = vllm_cpu::exp512(_mm512_sub_ps(x[c], mn));
  const __m512 sum = _mm512_add_ps(_mm512_add_ps(x[0], x[1]), _mm512_add_ps(x[2], x[3]));
  s.l[row] = s.l[row] * alpha + _mm512_reduce_add_ps(sum);
  s.m[row] = m_new;
  return alpha;
}

// Rows r0..r0+R-1 of the unit whose first query is q0, against key tile T (nk valid keys).
template <int R, bool BF16>
void block_step(const Problem& P, Scratch& s, int64_t q0, int64_t r0, const Tile& T, int nk) {
  __m512 acc[R][4];
  scores<R, BF16>(P, s, r0, T, acc);
  alignas(64) float alpha[R];
  for (int r = 0; r < R; ++r) {
    alpha[r] = softmax_row(P, s, q0, r0 + r, T, nk, acc[r]);
    if constexpr (BF16) {
      store_bf16x32(s.ph.data() + r * kBK, acc[r][0], acc[r][1]);
      store_bf16x32(s.ph.data() + r * kBK + 32, acc[r][2], acc[r][3]);
    } else {
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(s.p.data() + r * kBK + 16 * c, acc[r][c]);
    }
  }
  accumulate<R, BF16>(P, s, r0, T, nk, alpha);
}

template <bool BF16>
void block_step_n(int R, const Problem& P, Scratch& s, int64_t q0, int64_t r0, const Tile& T,
                  int nk) {
  switch (R) {
    case 6: return block_step<6, BF16>(P, s, q0, r0, T, nk);
    case 5: return block_step<5, BF16>(P, s, q0, r0, T, nk);
    case 4: return block_step<4, BF16>(P, s, q0, r0, T, nk);
    case 3: return block_step<3, BF16>(P, s, q0, r0, T, nk);
    case 2: return block_step<2, BF16>(P, s, q0, r0, T, nk);
    default: return block_step<1, BF16>(P, s, q0, r0, T, nk);
  }
}

// bf16 copy of n floats (n a multiple of 32): a unit's scaled queries.
void to_bf16(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t x = 0; x < n; x += 32)
    store_bf16x32(dst + x, _mm512_loadu_ps(src + x), _mm512_loadu_ps(src + x + 16));
}

#pragma GCC pop_options

// ---- AMX (bf16 tiles): 16 rows a block ---------------------------------------------------
// The bf16 packings above are already the tiles' B layouts: K as [D / 2][kBK][2] gives
// B[i][2 key + j] = K[key][2 i + j], V as [kBK / 2][D][2] gives B[i][2 d + j] = V[2 i + j][d];
// the queries (qh) and probabilities (ph) are row-major A tiles. Scores: 4 C tiles of
// 16 rows x 16 keys over the head dim in steps of 32; the online softmax in AVX-512 as
// above; P V: 4 C tiles of 16 rows x 16 head-dim columns over the keys in steps of 32, a
// 64-column slice of the head dim at a time.
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma")

// C tiles 0-3 = sum over `steps` of A (tile 4: 16 rows x 32 bf16 at a + i * a_step, rows
// a_stride bytes apart) x B (tile 5: the four 16-column tiles at b + i * b_step + 32 c, rows
// b_stride bytes apart), then stored to c (16 fp32 columns a tile, rows c_stride bytes apart).
void products_amx(const uint16_t* a, int64_t a_step, int64_t a_stride, const uint16_t* b,
                  int64_t b_step, int64_t b_stride, int64_t steps, float* c, int64_t c_stride) {
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t i = 0; i < steps; ++i, a += a_step, b += b_step) {
    _tile_loadd(4, a, a_stride);
    _tile_loadd(5, b + 0, b_stride);
    _tile_dpbf16ps(0, 4, 5);
    _tile_loadd(5, b + 32, b_stride);
    _tile_dpbf16ps(1, 4, 5);
    _tile_loadd(5, b + 64, b_stride);
    _tile_dpbf16ps(2, 4, 5);
    _tile_loadd(5, b + 96, b_stride);
    _tile_dpbf16ps(3, 4, 5);
  }
  _tile_stored(0, c + 0, c_stride);
  _tile_stored(1, c + 16, c_stride);
  _tile_stored(2, c + 32, c_stride);
  _tile_stored(3, c + 48, c_stride);
}

void block_step_amx(const Problem& P, Scratch& s, int64_t q0, int64_t r0, const Tile& T,
                    int nk) {
  const int64_t D = P.D;
  float* S = s.p.data();  // kAmxRows x kBK scores: the head dim in steps of 32 (16 K pairs)
  products_amx(s.qh.data() + r0 * D, 32, D * 2, T.kb, 16 * kBK * 2, kBK * 4, D / 32, S, kBK * 4);

  alignas(64) float alpha[kAmxRows];
  for (int r = 0; r < kAmxRows; ++r) {
    __m512 x[4];
    for (int c = 0; c < 4; ++c) x[c] = _mm512_loadu_ps(S + r * kBK + 16 * c);
    alpha[r] = softmax_row(P, s, q0, r0 + r, T, nk, x);
    store_bf16x32(s.ph.data() + r * kBK, x[0], x[1]);
    store_bf16x32(s.ph.data() + r * kBK + 32, x[2], x[3]);
  }

  for (int64_t c0 = 0; c0 < D; c0 += 64)  // P V, 64 columns at a time: keys in steps of 32
    products_amx(s.ph.data(), 32, kBK * 2, T.vb + c0 * 2, 16 * D * 2, D * 4, kBK / 32,
                 s.pv.data() + c0, D * 4);
  for (int r = 0; r < kAmxRows; ++r) {
    const __m512 a = _mm512_set1_ps(alpha[r]);
    float* o = s.o.data() + (r0 + r) * D;
    const float* pv = s.pv.data() + r * D;
    for (int64_t d = 0; d < D; d += 16)
      _mm512_storeu_ps(o + d, _mm512_fmadd_ps(_mm512_loadu_ps(o + d), a, _mm512_loadu_ps(pv + d)));
  }
}

#pragma GCC pop_options

// ---- AVX2 + FMA fp32 ---------------------------------------------------------------------
// vec_math.h's exp is compiled for avx2,fma,f16c: the same target here, so that it inlines.
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline float hmax_avx2(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

// sc[r][j] = q[r0 + r] . k[j] for the tile's first nv keys, a slice of kC2 keys at a time
// (sc rows are kBK long; columns from the slice past nv on are left as they were).
template <int R>
__attribute__((noinline)) void scores_avx2(const Problem& P, const Scratch& s, int64_t r0,
                                           const float* kt, int nv, float* sc) {
  const int64_t D = P.D;
  const float* q = s.q.data() + r0 * D;
  for (int c0 = 0; c0 < nv; c0 += kC2) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    const float* slice = kt + c0 * D;
    for (int64_t d = 0; d < D; ++d) {
      const float* kd = slice + d * kC2;
      const __m256 k0 = _mm256_loadu_ps(kd), k1 = _mm256_loadu_ps(kd + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 qb = _mm256_broadcast_ss(q + r * D + d);
        acc[r][0] = _mm256_fmadd_ps(qb, k0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(qb, k1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) {
      _mm256_storeu_ps(sc + r * kBK + c0, acc[r][0]);
      _mm256_storeu_ps(sc + r * kBK + c0 + 8, acc[r][1]);
    }
  }
}

// o[r] = alpha[r] o[r] + sum_{j < nv} p[r][j] v[j], a slice of kC2 columns at a time.
template <int R>
__attribute__((noinline)) void accumulate_avx2(const Problem& P, Scratch& s, int64_t r0,
                                               const float* vt, int nv, const float* alpha) {
  const int64_t D = P.D;
  for (int64_t c0 = 0; c0 < D; c0 += kC2) {
    __m256 acc[R][2];
    for (int r = 0; r < R; ++r) {
      const __m256 a = _mm256_broadcast_ss(alpha + r);
      for (int c = 0; c < 2; ++c)
        acc[r][c] = _mm256_mul_ps(_mm256_loadu_ps(s.o.data() + (r0 + r) * D + c0 + 8 * c), a);
    }
    const float* slice = vt + c0 * kBK;
    for (int j = 0; j < nv; ++j) {
      const float* vj = slice + j * kC2;
      const __m256 v0 = _mm256_loadu_ps(vj), v1 = _mm256_loadu_ps(vj + 8);
      for (int r = 0; r < R; ++r) {
        const __m256 pb = _mm256_broadcast_ss(s.p.data() + r * kBK + j);
        acc[r][0] = _mm256_fmadd_ps(pb, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pb, v1, acc[r][1]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < 2; ++c)
        _mm256_storeu_ps(s.o.data() + (r0 + r) * D + c0 + 8 * c, acc[r][c]);
  }
}

// Rows r0..r0+R-1 of the unit whose first query is q0, against key tile T (nk valid keys).
template <int R>
void block_step_avx2(const Problem& P, Scratch& s, int64_t q0, int64_t r0, const Tile& T,
                     int nk) {
  // Keys past the block's last row's last visible key are seen by no row of the block.
  const int nv = static_cast<int>(last_visible(P, q0, r0 + R - 1, T, nk) + 1);
  if (nv <= 0) return;  // the tile is all in the block's future: its rows stay as they are
  float* sc = s.p.data();
  scores_avx2<R>(P, s, r0, T.kt, nv, sc);
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256 ninf = _mm256_set1_ps(-INFINITY);
  alignas(32) float m_old[8] = {0}, m_new[8] = {0}, alpha[8];
  int seen[R];  // keys of the tile row r sees
  for (int r = 0; r < R; ++r) {
    seen[r] = static_cast<int>(std::max<int64_t>(last_visible(P, q0, r0 + r, T, nk) + 1, 0));
    __m256 mx = ninf;
    for (int c = 0; c < seen[r]; c += 8) {
      __m256 x = _mm256_loadu_ps(sc + r * kBK + c);
      if (c + 8 > seen[r]) {  // the last visible key's vector: -inf past it
        const __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(seen[r] - c), iota);
        x = _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(keep));
        _mm256_storeu_ps(sc + r * kBK + c, x);
      }
      mx = _mm256_max_ps(mx, x);
    }
    m_old[r] = s.m[r0 + r];
    m_new[r] = std::max(m_old[r], hmax_avx2(mx));  // finite: key 0 seen first
  }
  _mm256_store_ps(alpha, vllm_cpu::exp_avx2(_mm256_sub_ps(_mm256_load_ps(m_old),
                                                          _mm256_load_ps(m_new))));
  for (int r = 0; r < R; ++r) {
    const __m256 mn = _mm256_set1_ps(m_new[r]);
    __m256 sum = _mm256_setzero_ps();
    int c = 0;
    for (; c < seen[r]; c += 8) {
      const __m256 x = _mm256_loadu_ps(sc + r * kBK + c);
      __m256 e = vllm_cpu::exp_avx2(_mm256_sub_ps(x, mn));
      // The exp bottoms out at 2^-126, not 0: zero the masked keys exactly.
      if (c + 8 > seen[r]) e = _mm256_and_ps(e, _mm256_cmp_ps(x, ninf, _CMP_GT_OQ));
      sum = _mm256_add_ps(sum, e);
      _mm256_storeu_ps(sc + r * kBK + c, e);
    }
    for (; c < nv; c += 8) _mm256_storeu_ps(sc + r * kBK + c, _mm256_setzero_ps());
    s.l[r0 + r] = s.l[r0 + r] * alpha[r] + vllm_cpu::hsum_avx2(sum);
    s.m[r0 + r] = m_new[r];
  }
  accumulate_avx2<R>(P, s, r0, T.v, nv, alpha);
}

void block_step_avx2_n(int R, const Problem& P, Scratch& s, int64_t q0, int64_t r0,
                       const Tile& T, int nk) {
  switch (R) {
    case 6: return block_step_avx2<6>(P, s, q0, r0, T, nk);
    case 5: return block_step_avx2<5>(P, s, q0, r0, T, nk);
    case 4: return block_step_avx2<4>(P, s, q0, r0, T, nk);
    case 3: return block_step_avx2<3>(P, s, q0, r0, T, nk);
    case 2: return block_step_avx2<2>(P, s, q0, r0, T, nk);
    default: return block_step_avx2<1>(P, s, q0, r0, T, nk);
  }
}

#pragma GCC pop_options

// ---- shared driver -----------------------------------------------------------------------
enum class Isa { kAvx512, kAvx512Bf16, kAmx, kAvx2 };

// One unit: kv head h, queries q0 .. q0 + nq - 1.
template <Isa I>
void run_unit(const Problem& P, int64_t h, int64_t q0, int64_t nq, const float* kpack,
              const float* vpack, const uint16_t* kbpack, const uint16_t* vbpack, Scratch& s) {
  const int64_t G = P.G, D = P.D, rows = nq * G;
  for (int64_t i = 0; i < nq; ++i) {  // rows in memory order: position-major, then head
    const float* src = P.q + (q0 + i) * P.q_stride + h * G * D;
    for (int64_t x = 0; x < G * D; ++x) s.q[i * G * D + x] = src[x] * P.scale;
  }
  constexpr bool kBf16 = I == Isa::kAvx512Bf16 || I == Isa::kAmx;
  if constexpr (kBf16) to_bf16(s.q.data(), s.qh.data(), rows * D);
  std::fill(s.o.begin(), s.o.begin() + rows * D, 0.f);
  std::fill(s.m.begin(), s.m.begin() + rows, -INFINITY);
  std::fill(s.l.begin(), s.l.begin() + rows, 0.f);
  const int64_t kend = std::min(P.Lk, q0 + nq + P.off);  // keys past it are seen by none
  for (int64_t t = 0; t * kBK < kend; ++t) {
    const int64_t tile = h * P.ntk + t;
    Tile T{nullptr, P.v + t * kBK * P.v_stride + h * D, nullptr, nullptr, t * kBK};
    if constexpr (kBf16) {
      T.kb = kbpack + tile * D * kBK;
      T.vb = vbpack + tile * D * kBK;
    } else {
      T.kt = kpack + tile * D * kBK;
      if constexpr (I == Isa::kAvx2) T.v = vpack + tile * D * kBK;
    }
    const int nk = static_cast<int>(std::min<int64_t>(kBK, kend - t * kBK));
    constexpr int64_t block = I == Isa::kAvx2 ? kR2 : kR;
    int64_t r0 = 0;
    if constexpr (I == Isa::kAmx)  // whole 16-row blocks on the tiles, the rest as bf16
      for (; r0 + kAmxRows <= rows; r0 += kAmxRows) block_step_amx(P, s, q0, r0, T, nk);
    for (; r0 < rows; r0 += block) {
      const int R = static_cast<int>(std::min<int64_t>(block, rows - r0));
      if constexpr (I == Isa::kAvx2)
        block_step_avx2_n(R, P, s, q0, r0, T, nk);
      else
        block_step_n<kBf16>(R, P, s, q0, r0, T, nk);
    }
  }
  for (int64_t i = 0; i < nq; ++i) {
    float* dst = P.out + (q0 + i) * P.o_stride + h * G * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* o = s.o.data() + (i * G + g) * D;
      const float inv = 1.f / s.l[i * G + g];
      for (int64_t d = 0; d < D; ++d) dst[g * D + d] = o[d] * inv;
    }
  }
}

template <Isa I>
void run(const Problem& P) {
  constexpr bool kBf16 = I == Isa::kAvx512Bf16 || I == Isa::kAmx;
  const int64_t nqt = (P.Lq + kBQ - 1) / kBQ, units = P.KVH * nqt, D = P.D;
  std::vector<float> kpack, vpack;
  std::vector<uint16_t> kbpack, vbpack;
  if constexpr (kBf16) {
    kbpack.resize(P.KVH * P.ntk * D * kBK);
    vbpack.resize(P.KVH * P.ntk * D * kBK);
  } else {
    kpack.resize(P.KVH * P.ntk * D * kBK);
    if constexpr (I == Isa::kAvx2) vpack.resize(P.KVH * P.ntk * D * kBK);
  }
  at::parallel_for(0, P.KVH * P.ntk, 4, [&](int64_t a, int64_t b) {
    for (int64_t w = a; w < b; ++w) {
      const int64_t h = w / P.ntk, t = w % P.ntk, at = w * D * kBK;
      if constexpr (kBf16) {
        pack_kv_bf16(P, h, t, kbpack.data() + at, vbpack.data() + at);
      } else if constexpr (I == Isa::kAvx2) {
        pack_k_f32(P, h, t, kC2, kpack.data() + at);
        pack_v_f32(P, h, t, kC2, vpack.data() + at);
      } else {
        pack_k_f32(P, h, t, kBK, kpack.data() + at);
      }
    }
  });
  // Cost of unit u (its key tiles x rows), prefix sums, then contiguous equal-cost parts.
  std::vector<double> cum(units + 1, 0.0);
  for (int64_t u = 0; u < units; ++u) {
    const int64_t q0 = (u % nqt) * kBQ, nq = std::min<int64_t>(kBQ, P.Lq - q0);
    const int64_t kend = std::min(P.Lk, q0 + nq + P.off);
    cum[u + 1] = cum[u] + static_cast<double>(nq) * ((kend + kBK - 1) / kBK + 1);
  }
  const int64_t parts = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), units));
  at::parallel_for(0, parts, 1, [&](int64_t a, int64_t b) {
    Scratch s;
    const int64_t rows = kBQ * P.G;
    s.q.resize(rows * D);
    s.o.resize(rows * D);
    s.m.resize(rows);
    s.l.resize(rows);
    s.p.resize(std::max({kR, kR2, kAmxRows}) * kBK);
    if constexpr (kBf16) {
      s.qh.resize(rows * D);
      s.ph.resize(std::max(kR, kAmxRows) * kBK);
    }
    if constexpr (I == Isa::kAmx) {
      s.pv.resize(kAmxRows * D);
      vllm_cpu::amx_load_config(6, kAmxRows);
    }
    for (int64_t part = a; part < b; ++part) {
      const double lo = cum[units] * part / parts, hi = cum[units] * (part + 1) / parts;
      for (int64_t u = 0; u < units; ++u) {
        const double mid = 0.5 * (cum[u] + cum[u + 1]);
        if (mid < lo || mid >= hi) continue;
        const int64_t q0 = (u % nqt) * kBQ;
        run_unit<I>(P, u / nqt, q0, std::min<int64_t>(kBQ, P.Lq - q0), kpack.data(),
                    vpack.data(), kbpack.data(), vbpack.data(), s);
      }
    }
    if constexpr (I == Isa::kAmx) vllm_cpu::amx_release();
  });
}

void check_rows(const torch::Tensor& t, int64_t heads, int64_t D, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 3 && t.device().is_cpu(), name,
              " must be a CPU float32 [tokens, heads, head_dim] tensor");
  TORCH_CHECK(t.size(1) == heads && t.size(2) == D, name, " has shape ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == D, name, " heads must be contiguous");
}

bool prefill_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k,
                       const torch::Tensor& v, double scale, int64_t causal_offset, bool bf16) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3, "q, k must be [tokens, heads, head_dim]");
  const int64_t Lq = q.size(0), H = q.size(1), D = q.size(2);
  const int64_t Lk = k.size(0), KVH = k.size(1);
  check_rows(q, H, D, "q");
  check_rows(out, H, D, "out");
  check_rows(k, KVH, D, "k");
  check_rows(v, KVH, D, "v");
  TORCH_CHECK(out.size(0) == Lq && v.size(0) == Lk, "out / v lengths differ from q / k");
  TORCH_CHECK(KVH > 0 && H % KVH == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(causal_offset >= 0, "causal_offset must be >= 0 (every query sees key 0)");
  const bool avx2 = !bf16 && !cpu_has_avx512() && vllm_cpu::cpu_has_avx2();
  if (D % 64 != 0 || !(bf16 ? cpu_has_avx512_bf16() : cpu_has_avx512() || avx2)) return false;
  if (Lq == 0) return true;
  TORCH_CHECK(Lk > 0, "no keys");
  const Problem P{q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(),
                  out.data_ptr<float>(), q.stride(0), k.stride(0), v.stride(0), out.stride(0),
                  Lq, Lk, KVH, H / KVH, D, causal_offset, static_cast<float>(scale),
                  (Lk + kBK - 1) / kBK};
  if (bf16 && vllm_cpu::cpu_has_amx_bf16())
    run<Isa::kAmx>(P);
  else if (bf16)
    run<Isa::kAvx512Bf16>(P);
  else if (avx2)
    run<Isa::kAvx2>(P);
  else
    run<Isa::kAvx512>(P);
  return true;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_continuum_C, m) {
  m.def(
      "prefill_attention(Tensor(a!) out, Tensor q, Tensor k, Tensor v, float scale, "
      "int causal_offset, bool bf16=False) -> bool");
}

TORCH_LIBRARY_IMPL(vllm_continuum_C, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
}
