// Decode attention over the paged KV cache, read in place through the block table.
//
// paged_decode_attention(out, query, kv_cache, block_table, seq_lens, scale):
//   query, out  [num_seqs, num_heads, head_size] fp32, one query token per sequence (rows
//               may be strided: the q columns of a fused qkv output);
//   kv_cache    [2, num_blocks, block_size, num_kv_heads, head_size] fp32, contiguous;
//   block_table int64 [num_seqs, max_blocks]; seq_lens int64 [num_seqs]: the context
//               length including this step's token, whose K/V are already written.
//
// The torch fallback gathers every sequence's whole context into a padded copy per layer
// and step, then runs SDPA over it: at 2k tokens of context that is ~3 MB copied per layer,
// a step's weight traffic again. Here each (sequence, kv head) unit reads its K and V rows
// once, for all query heads of its group (GQA): scores 8 positions at a time (one
// horizontal-sum tree for the 8 dot products), a softmax with an AVX2 exp, then the
// weighted sum of values over tiles of positions that stay in L1. Units are split over
// torch's intra-op threads. Results equal SDPA's up to float rounding.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec_math.h"

namespace {

using vllm_cpu::cpu_has_avx2;

constexpr int64_t kTile = 64;  // positions per value tile: 64 rows of K/V stay in L1

// One (sequence, kv head): its query heads are G consecutive heads of `q` / `out`.
struct Unit {
  const float* q;
  float* out;
  const float* k;     // this kv head's column of the key plane
  const float* v;     // ... of the value plane
  const int64_t* off;  // element offset of position p's row, p < len
  int64_t len, head_size;
  float scale;
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
    float* o = u.out + j * D;
    std::fill(o, o + D, 0.f);
    for (int64_t p = 0; p < L; ++p) {
      const float* v = u.v + u.off[p];
      for (int64_t d = 0; d < D; ++d) o[d] += s[p] * v[d];
    }
    for (int64_t d = 0; d < D; ++d) o[d] /= sum;
  }
}

// ---- AVX2 + FMA path (head_size a multiple of 8) -----------------------------------------
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

void scores_avx2(const Unit& u, int G, float* scores) {
  const int64_t L = u.len, D = u.head_size;
  const __m256 scale = _mm256_set1_ps(u.scale);
  int64_t p = 0;
  for (; p + 8 <= L; p += 8) {
    const float* k[8];
    for (int t = 0; t < 8; ++t) k[t] = u.k + u.off[p + t];
    for (int j = 0; j < G; ++j) {
      const float* q = u.q + j * D;
      __m256 acc[8];
      for (int t = 0; t < 8; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qv = _mm256_loadu_ps(q + d);
        for (int t = 0; t < 8; ++t)
          acc[t] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[t] + d), acc[t]);
      }
      _mm256_storeu_ps(scores + j * L + p, _mm256_mul_ps(vllm_cpu::hsum8_avx2(acc), scale));
    }
  }
  for (; p < L; ++p) {
    const float* k = u.k + u.off[p];
    for (int j = 0; j < G; ++j) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(u.q + j * D + d), _mm256_loadu_ps(k + d), acc);
      scores[j * L + p] = vllm_cpu::hsum_avx2(acc) * u.scale;
    }
  }
}

// s[p] = exp(s[p] - max s); returns the sum.
float softmax_numerators_avx2(float* s, int64_t L) {
  __m256 mv = _mm256_set1_ps(-INFINITY);
  int64_t p = 0;
  for (; p + 8 <= L; p += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + p));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mv), _mm256_extractf128_ps(mv, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float mx = _mm_cvtss_f32(m4);
  for (; p < L; ++p) mx = std::max(mx, s[p]);
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

// out_j = sum_p s_j[p] v_p / sums[j], 8 lanes of head_size at a time for all G heads.
template <int G>
void values_avx2(const Unit& u, const float* scores, const float* sums, float* acc) {
  const int64_t L = u.len, D = u.head_size;
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t p0 = 0; p0 < L; p0 += kTile) {
    const int64_t p1 = std::min(L, p0 + kTile);
    for (int64_t c = 0; c < D; c += 8) {
      __m256 a[G];
      for (int j = 0; j < G; ++j) a[j] = _mm256_loadu_ps(acc + j * D + c);
      for (int64_t p = p0; p < p1; ++p) {
        const __m256 v = _mm256_loadu_ps(u.v + u.off[p] + c);
        for (int j = 0; j < G; ++j)
          a[j] = _mm256_fmadd_ps(_mm256_set1_ps(scores[j * L + p]), v, a[j]);
      }
      for (int j = 0; j < G; ++j) _mm256_storeu_ps(acc + j * D + c, a[j]);
    }
  }
  for (int j = 0; j < G; ++j) {
    const __m256 inv = _mm256_set1_ps(1.0f / sums[j]);
    for (int64_t c = 0; c < D; c += 8)
      _mm256_storeu_ps(u.out + j * D + c, _mm256_mul_ps(_mm256_loadu_ps(acc + j * D + c), inv));
  }
}

template <int G>
void attend_avx2(const Unit& u, float* scores, float* acc) {
  scores_avx2(u, G, scores);
  float sums[G];
  for (int j = 0; j < G; ++j) sums[j] = softmax_numerators_avx2(scores + j * u.len, u.len);
  values_avx2<G>(u, scores, sums, acc);
}

#pragma GCC pop_options

// True when the AVX2 path ran (G in 1..8 and head_size a multiple of 8).
bool attend_fast(const Unit& u, int G, float* scores, float* acc) {
  if (!cpu_has_avx2() || u.head_size % 8 != 0) return false;
  switch (G) {
    case 1: attend_avx2<1>(u, scores, acc); return true;
    case 2: attend_avx2<2>(u, scores, acc); return true;
    case 3: attend_avx2<3>(u, scores, acc); return true;
    case 4: attend_avx2<4>(u, scores, acc); return true;
    case 5: attend_avx2<5>(u, scores, acc); return true;
    case 6: attend_avx2<6>(u, scores, acc); return true;
    case 7: attend_avx2<7>(u, scores, acc); return true;
    case 8: attend_avx2<8>(u, scores, acc); return true;
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
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous() &&
                  kv_cache.scalar_type() == torch::kFloat,
              "kv_cache must be contiguous float32 [2, num_blocks, block_size, kv_heads, size]");
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
  // ~16k query-head x position scores per task: short contexts stay on one thread (a
  // parallel region costs more than their work, and much more when a core is busy).
  const int64_t grain = std::max<int64_t>(1, 16384 / (longest * G));
  const float* k_plane = kv_cache.data_ptr<float>();
  const float* v_plane = k_plane + num_blocks * bs * kv_heads * D;
  const float* qp = query.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t q_stride = query.stride(0), o_stride = out.stride(0);
  const int64_t row = kv_heads * D;  // elements between two slots
  at::parallel_for(0, n * kv_heads, grain, [&](int64_t u0, int64_t u1) {
    std::vector<int64_t> off;
    std::vector<float> scores, acc(G * D);
    for (int64_t w = u0; w < u1; ++w) {
      const int64_t i = w / kv_heads, g = w % kv_heads, L = lp[i];
      off.resize(L);
      for (int64_t p = 0; p < L; p += bs) {  // block by block: no division per position
        const int64_t block = btp[i * max_blocks + p / bs];
        TORCH_CHECK(block >= 0 && block < num_blocks, "block id ", block, " out of range");
        for (int64_t t = p; t < std::min(L, p + bs); ++t) off[t] = (block * bs + t - p) * row;
      }
      scores.resize(G * L);
      const Unit u{qp + i * q_stride + g * G * D, op + i * o_stride + g * G * D,
                   k_plane + g * D, v_plane + g * D, off.data(), L, D,
                   static_cast<float>(scale)};
      if (!attend_fast(u, static_cast<int>(G), scores.data(), acc.data()))
        attend_scalar(u, static_cast<int>(G), scores.data());
    }
  });
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
