// Decode attention over the paged KV cache, read in place through the block table.
//
// paged_decode_attention(out, query, kv_cache, block_table, seq_lens, scale):
//   query, out  [num_seqs, num_heads, head_size] fp32, one query token per sequence (rows
//               may be strided: the q columns of a fused qkv output);
//   kv_cache    [2, num_blocks, block_size, num_kv_heads, head_size] fp32, contiguous: K
//               and V halves; or [1, ...]: a latent cache (MLA), whose values are its keys'
//               rows (the caller keeps the output's first value_size dims);
//   block_table int64 [num_seqs, max_blocks]; seq_lens int64 [num_seqs]: the context
//               length including this step's token, whose K/V are already written.
//
// The torch fallback gathers every sequence's whole context into a padded copy per layer
// and step, then runs SDPA over it: at 2k tokens of context that is ~3 MB copied per layer,
// a step's weight traffic again. Here each (sequence, kv head, chunk of kChunk positions)
// unit reads its K and V rows once, for all query heads of its group (GQA): scores 8
// positions at a time (one horizontal-sum tree for the 8 dot products; the next positions'
// K and V rows prefetched, since a head's row is 1/kv_heads of a slot and the context of a
// step is far larger than the caches), a softmax with an AVX2 exp, then the weighted sum of
// values over tiles of positions that stay in L1. Each unit leaves its running max, sum and
// unnormalised output per query head; they are merged per (sequence, kv head), so one long
// context is split over torch's intra-op threads too (batch-1 decode has only kv_heads
// units otherwise). Results equal SDPA's up to float rounding.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "parallel.h"
#include "vec_math.h"

namespace {

using vllm_cpu::cpu_has_avx2;

constexpr int64_t kTile = 64;    // positions per value tile: 64 rows of K/V stay in L1
constexpr int64_t kChunk = 256;  // positions per unit (a multiple of kTile)

// One (sequence, kv head, chunk): its query heads are G consecutive heads of `q`. Results:
// per query head j, m[j] = max score, sum[j] = sum of exp(score - m[j]), acc[j * D ...] =
// sum of exp(score - m[j]) * v (not yet divided by the sum).
struct Unit {
  const float* q;
  const float* k;      // this kv head's column of the key plane
  const float* v;      // ... of the value plane
  const int64_t* off;  // element offset of the chunk's position p's row, p < len
  int64_t len, head_size;
  const float *pf_k, *pf_v;  // prefetched ahead: pf_len floats from pf_k / pf_v + off[p]
  int64_t pf_len;
  float scale;
  float *acc, *m, *sum;
};

// ---- portable scalar path ---------------------------------------------------------------
void attend_scalar(const Unit& u, int G, float* scores) {
  const int64_t L = u.len, D = u.head_size;
  for (int j = 0; j < G; ++j) {
    const float* q = u.q + j * D;
    float* s = scores + j * L;
    float mx = -INFINITY;
    for (int64_t p = 0; p < L; ++p) {
      const float* k = u.k + u.off[p];
      float acc = 0.f;
      for (int64_t d = 0; d < D; ++d) acc += q[d] * k[d];
      s[p] = acc * u.scale;
      mx = std::max(mx, s[p]);
    }
    float sum = 0.f;
    for (int64_t p = 0; p < L; ++p) sum += (s[p] = std::exp(s[p] - mx));
    float* o = u.acc + j * D;
    std::fill(o, o + D, 0.f);
    for (int64_t p = 0; p < L; ++p) {
      const float* v = u.v + u.off[p];
      for (int64_t d = 0; d < D; ++d) o[d] += s[p] * v[d];
    }
    u.m[j] = mx;
    u.sum[j] = sum;
  }
}

// ---- AVX2 + FMA path (head_size a multiple of 8) -----------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

// Scores of G query heads x P positions at a time: G * P accumulators + G query vectors + 1
// key vector in the 16 ymm registers, so each key row is loaded once for all G heads.
template <int G>
constexpr int score_positions() {
  return G <= 2 ? 4 : (G == 3 ? 4 : (G <= 4 ? 2 : 1));
}

template <int G>
void scores_avx2(const Unit& u, float* scores) {
  constexpr int P = score_positions<G>();
  const int64_t L = u.len, D = u.head_size;
  const __m256 scale = _mm256_set1_ps(u.scale);
  for (int64_t p = 0; p < L; p += P) {
    const int n = static_cast<int>(std::min<int64_t>(P, L - p));
    const float* k[P];
    for (int t = 0; t < P; ++t) k[t] = u.k + u.off[p + std::min(t, n - 1)];
    // 16 positions ahead, into L2: the K and V rows this unit (or, for a chunk's first kv
    // head, every kv head of the chunk) will read.
    for (int64_t t = p + 16; t < std::min(L, p + 16 + P); ++t)
      for (int64_t d = 0; d < u.pf_len; d += 16) {
        _mm_prefetch(reinterpret_cast<const char*>(u.pf_k + u.off[t] + d), _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(u.pf_v + u.off[t] + d), _MM_HINT_T1);
      }
    __m256 acc[G][P];
    for (int j = 0; j < G; ++j)
      for (int t = 0; t < P; ++t) acc[j][t] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 q[G];
      for (int j = 0; j < G; ++j) q[j] = _mm256_loadu_ps(u.q + j * D + d);
      for (int t = 0; t < P; ++t) {
        const __m256 kv = _mm256_loadu_ps(k[t] + d);
        for (int j = 0; j < G; ++j) acc[j][t] = _mm256_fmadd_ps(q[j], kv, acc[j][t]);
      }
    }
    for (int j = 0; j < G; ++j) {
      float* s = scores + j * L + p;
      if constexpr (P == 4) {
        const __m128 r = _mm_mul_ps(vllm_cpu::hsum4_avx2(acc[j][0], acc[j][1], acc[j][2], acc[j][3]),
                                    _mm256_castps256_ps128(scale));
        if (n == 4) {
          _mm_storeu_ps(s, r);
          continue;
        }
        float tmp[4];
        _mm_storeu_ps(tmp, r);
        for (int t = 0; t < n; ++t) s[t] = tmp[t];
      } else {
        for (int t = 0; t < n; ++t) s[t] = vllm_cpu::hsum_avx2(acc[j][t]) * u.scale;
      }
    }
  }
}

// s[p] = exp(s[p] - max s); returns the sum, the max in *max.
float softmax_numerators_avx2(float* s, int64_t L, float* max) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 8 <= L; p += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + p));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float mx = _mm_cvtss_f32(m4);
  for (; p < L; ++p) mx = std::max(mx, s[p]);
  *max = mx;
  const __m256 mxv = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (p = 0; p + 8 <= L; p += 8) {
    const __m256 e = vllm_cpu::exp_avx2(_mm256_sub_ps(_mm256_loadu_ps(s + p), mxv));
    _mm256_storeu_ps(s + p, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = vllm_cpu::hsum_avx2(sum);
  for (; p < L; ++p) total += (s[p] = std::exp(s[p] - mx));
  return total;
}

// acc_j = sum_p s_j[p] v_p for all G heads, CB vectors of 8 columns at a time (G * CB
// accumulators + G broadcast scores + 1 value vector in the 16 ymm registers), over tiles
// of kTile positions whose value rows stay in L1 while the column blocks pass.
template <int G>
constexpr int value_blocks() {
  return G == 1 ? 8 : (G <= 3 ? 4 : (G <= 6 ? 2 : 1));
}

template <int G>
void values_avx2(const Unit& u, const float* scores) {
  constexpr int CB = value_blocks<G>();
  const int64_t L = u.len, D = u.head_size;
  float* acc = u.acc;
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t p0 = 0; p0 < L; p0 += kTile) {
    const int64_t p1 = std::min(L, p0 + kTile);
    for (int64_t c = 0; c < D; c += 8 * CB) {
      const int nb = static_cast<int>(std::min<int64_t>(CB, (D - c) / 8));
      __m256 a[G][CB];
      for (int j = 0; j < G; ++j)
        for (int b = 0; b < CB; ++b)
          a[j][b] = b < nb ? _mm256_loadu_ps(acc + j * D + c + 8 * b) : _mm256_setzero_ps();
      for (int64_t p = p0; p < p1; ++p) {
        const float* v = u.v + u.off[p] + c;
        __m256 sc[G];
        for (int j = 0; j < G; ++j) sc[j] = _mm256_broadcast_ss(scores + j * L + p);
        for (int b = 0; b < CB; ++b) {
          if (b >= nb) break;
          const __m256 vv = _mm256_loadu_ps(v + 8 * b);
          for (int j = 0; j < G; ++j) a[j][b] = _mm256_fmadd_ps(sc[j], vv, a[j][b]);
        }
      }
      for (int j = 0; j < G; ++j)
        for (int b = 0; b < nb; ++b) _mm256_storeu_ps(acc + j * D + c + 8 * b, a[j][b]);
    }
  }
}

template <int G>
void attend_avx2(const Unit& u, float* scores) {
  scores_avx2<G>(u, scores);
  for (int j = 0; j < G; ++j)
    u.sum[j] = softmax_numerators_avx2(scores + j * u.len, u.len, u.m + j);
  values_avx2<G>(u, scores);
}

#pragma GCC pop_options

// True when the AVX2 path ran (G in 1..8 and head_size a multiple of 8).
bool attend_fast(const Unit& u, int G, float* scores) {
  if (!cpu_has_avx2() || u.head_size % 8 != 0) return false;
  switch (G) {
    case 1: attend_avx2<1>(u, scores); return true;
    case 2: attend_avx2<2>(u, scores); return true;
    case 3: attend_avx2<3>(u, scores); return true;
    case 4: attend_avx2<4>(u, scores); return true;
    case 5: attend_avx2<5>(u, scores); return true;
    case 6: attend_avx2<6>(u, scores); return true;
    case 7: attend_avx2<7>(u, scores); return true;
    case 8: attend_avx2<8>(u, scores); return true;
    default: return false;
  }
}

void check_heads(const torch::Tensor& t, int64_t n, int64_t heads, int64_t D, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.dim() == 3, name,
              " must be float32 [num_seqs, num_heads, head_size]");
  TORCH_CHECK(t.size(0) == n && t.size(1) == heads && t.size(2) == D, name, " has shape ",
              t.sizes(), ", expected [", n, ", ", heads, ", ", D, "]");
  TORCH_CHECK(t.stride(2) == 1 && t.stride(1) == D, name, " heads must be contiguous");
}

void paged_decode_attention(torch::Tensor& out, const torch::Tensor& query,
                            const torch::Tensor& kv_cache, const torch::Tensor& block_table,
                            const torch::Tensor& seq_lens, double scale) {
  TORCH_CHECK(kv_cache.dim() == 5 && (kv_cache.size(0) == 2 || kv_cache.size(0) == 1) &&
                  kv_cache.is_contiguous() && kv_cache.scalar_type() == torch::kFloat,
              "kv_cache must be contiguous float32 [2 or 1, num_blocks, block_size, kv_heads, "
              "size]");
  const int64_t num_blocks = kv_cache.size(1), bs = kv_cache.size(2);
  const int64_t kv_heads = kv_cache.size(3), D = kv_cache.size(4);
  const int64_t n = query.size(0), heads = query.size(1);
  check_heads(query, n, heads, D, "query");
  check_heads(out, n, heads, D, "out");
  TORCH_CHECK(heads % kv_heads == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(block_table.scalar_type() == torch::kLong && block_table.dim() == 2 &&
                  block_table.size(0) == n,
              "block_table must be int64 [num_seqs, max_blocks]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kLong && seq_lens.numel() == n,
              "seq_lens must be int64 [num_seqs]");
  const auto bt = block_table.contiguous();
  const auto lens = seq_lens.contiguous();
  const int64_t max_blocks = bt.size(1), G = heads / kv_heads;
  const int64_t* btp = bt.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  int64_t longest = 1;
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(lp[i] >= 1 && lp[i] <= max_blocks * bs, "seq_lens[", i, "] = ", lp[i],
                " outside 1..", max_blocks * bs);
    longest = std::max(longest, lp[i]);
  }
  // Chunks of kChunk positions of a sequence, all kv heads in turn: a slot row holds every
  // kv head, so the first head's pass prefetches whole rows and the others read them from
  // L2 (one head's column alone, a quarter of each row's lines, streamed at a quarter of
  // the read bandwidth here). first[i] = index of sequence i's first chunk.
  std::vector<int64_t> first(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) first[i + 1] = first[i] + (lp[i] + kChunk - 1) / kChunk;
  const int64_t part = G * (D + 2);  // acc, m, sum per (chunk, kv head)
  std::vector<float> partial(first[n] * kv_heads * part);
  // ~2k query-head x position scores per task: short contexts stay on one thread (a
  // parallel region costs more than their work, and much more when a core is busy).
  const int64_t grain = std::max<int64_t>(1, 2048 / (std::min(longest, kChunk) * heads));
  const float* k_plane = kv_cache.data_ptr<float>();
  // A latent cache (one plane): the values are the keys' own rows.
  const float* v_plane = kv_cache.size(0) == 2 ? k_plane + num_blocks * bs * kv_heads * D
                                               : k_plane;
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
  const int64_t row = kv_heads * D;  // elements between two slots
  vllm_cpu::parallel_chunks(first[n], grain, [&](int64_t c0, int64_t c1) {
    std::vector<int64_t> off(kChunk);
    std::vector<float> scores(G * kChunk);
    int64_t i = 0;
    for (int64_t c = c0; c < c1; ++c) {
      while (first[i + 1] <= c) ++i;
      const int64_t p0 = (c - first[i]) * kChunk, L = std::min(lp[i], p0 + kChunk) - p0;
      for (int64_t t = 0; t < L;) {  // block by block: no division per position
        const int64_t p = p0 + t, block = btp[i * max_blocks + p / bs];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
        const int64_t stop = std::min(L, t + bs - p % bs);
        for (; t < stop; ++t) off[t] = (block * bs + (p0 + t) % bs) * row;
      }
      for (int64_t g = 0; g < kv_heads; ++g) {
        float* res = partial.data() + (c * kv_heads + g) * part;
        const Unit u{qp + i * q_stride + g * G * D, k_plane + g * D, v_plane + g * D,
                     off.data(), L, D,
                     g == 0 ? k_plane : k_plane + g * D, g == 0 ? v_plane : v_plane + g * D,
                     g == 0 ? row : D, static_cast<float>(scale), res, res + G * D,
                     res + G * D + G};
        if (!attend_fast(u, static_cast<int>(G), scores.data()))
          attend_scalar(u, static_cast<int>(G), scores.data());
      }
    }
  });
  // Merge each (sequence, kv head)'s chunks: out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M)
  // sum_c with M = max_c m_c (one chunk: acc / sum).
  for (int64_t i = 0; i < n; ++i)
    for (int64_t g = 0; g < kv_heads; ++g)
      for (int64_t j = 0; j < G; ++j) {
        float M = -INFINITY;
        for (int64_t c = first[i]; c < first[i + 1]; ++c)
          M = std::max(M, partial[(c * kv_heads + g) * part + G * D + j]);
        float* o = op + i * o_stride + (g * G + j) * D;
        std::fill(o, o + D, 0.f);
        float total = 0.f;
        for (int64_t c = first[i]; c < first[i + 1]; ++c) {
          const float* res = partial.data() + (c * kv_heads + g) * part;
          const float wgt = first[i + 1] - first[i] == 1 ? 1.f : std::exp(res[G * D + j] - M);
          total += wgt * res[G * D + G + j];
          for (int64_t d = 0; d < D; ++d) o[d] += wgt * res[j * D + d];
        }
        const float inv = 1.0f / total;
        for (int64_t d = 0; d < D; ++d) o[d] *= inv;
      }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vllm_continuum_C, m) {
  m.def(
      "paged_decode_attention(Tensor(a!) out, Tensor query, Tensor kv_cache, "
      "Tensor block_table, Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_continuum_C, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
