// ggml_linear's AMX path (variant 3: bf16 products on the tile unit, 5 to 47 tokens;
// dispatch in quant_kernels.cpp, block layouts in quant_blocks.h).
//
// With 16 tokens the AVX-512 fp32 kernel is bound by arithmetic (~190 GFLOP/s on 2 cores,
// ~75% of the FMA ports' peak with the expansion of the blocks on the same ports). AMX's
// TDPBF16PS multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 fp32 sums in one
// instruction, so the arithmetic is nearly free and what remains is the expansion of the
// weights to bf16 (one pass over the blocks, as the fp32 kernel's) and the memory.
//
// Roles: the weight rows are the tiles' "rows" (A: 16 weight rows x 32 inputs, row-major as
// the rows are stored, no transpose), the tokens are the columns (B: the tokens' inputs in
// pairs, B[i][2 * t + j] = x[t][2 * i + j] within a 32-input block, built once per call), so
// C[r][t] = y[t][n0 + r]. A group of 16 rows is expanded whole into a bf16 buffer (the rows
// are contiguous: one sequential read), then each 32-input block adds A x B into up to three
// C tiles (48 tokens): tiles 0-2 C, 3 A, 4-6 B.
//
// Products are bf16 x bf16 summed in fp32 (the weights q * d + m and the inputs are rounded
// to bf16 to nearest even: 8 bits of mantissa), as the bf16 dense GEMM of longer batches.
// Linux lends the tile registers to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM), once.
#include <c10/util/BFloat16.h>
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "amx.h"
#include "quant_blocks.h"
#include "quant_lanes512.h"

namespace vllm_cpu::gguf {

namespace {

constexpr int kTileRows = kRowsAmx;  // weight rows per A tile and tokens per B / C tile
constexpr int kMaxTiles = 3;    // token tiles per pass: up to 48 tokens
constexpr long kArchReqXcompPerm = 0x1023;
constexpr long kXfeatureXtiledata = 18;

bool cpuid_amx_bf16() {
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  const bool amx = (d >> 22 & 1) && (d >> 24 & 1);       // AMX-BF16, AMX-TILE
  const bool avx512 = (b >> 16 & 1) && (b >> 30 & 1);    // AVX512F, AVX512BW
  if (!__get_cpuid_count(7, 1, &a, &b, &c, &d)) return false;
  return amx && avx512 && (a >> 5 & 1);                  // AVX512_BF16
}


#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16,avx2,fma,f16c")

// One row's blocks -> bf16 (the AVX-512 kernel's lanes, then rounded to nearest even).
template <bool kQ4>
void row_bf16(const uint8_t* row, int64_t nb, uint16_t* out) {
  constexpr int64_t bb = kQ4 ? 20 : 34;
  for (int64_t b = 0; b < nb; ++b, out += kQK) {
    __m512 w[2];
    block_lanes_avx512<kQ4>(row + b * bb, w);
    _mm512_storeu_si512(out, (__m512i)_mm512_cvtne2ps_pbh(w[1], w[0]));
  }
}

// C tiles 0 .. TT-1 += A (the group's rows, block b) x B (token tile t, block b), all blocks.
template <int TT>
void group_products(const uint16_t* abuf, int64_t K, const uint32_t* xb, int64_t nb,
                    float* cbuf) {
  _tile_zero(0);
  if constexpr (TT > 1) _tile_zero(1);
  if constexpr (TT > 2) _tile_zero(2);
  for (int64_t b = 0; b < nb; ++b) {
    _tile_loadd(3, abuf + b * kQK, K * 2);
    _tile_loadd(4, xb + (0 * nb + b) * 256, 64);
    _tile_dpbf16ps(0, 3, 4);
    if constexpr (TT > 1) {
      _tile_loadd(5, xb + (1 * nb + b) * 256, 64);
      _tile_dpbf16ps(1, 3, 5);
    }
    if constexpr (TT > 2) {
      _tile_loadd(6, xb + (2 * nb + b) * 256, 64);
      _tile_dpbf16ps(2, 3, 6);
    }
  }
  _tile_stored(0, cbuf, 64);
  if constexpr (TT > 1) _tile_stored(1, cbuf + 256, 64);
  if constexpr (TT > 2) _tile_stored(2, cbuf + 512, 64);
}

template <bool kQ4>
void linear_groups_amx(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                       const uint32_t* xb, int64_t M, float* y) {
  constexpr int64_t bb = kQ4 ? 20 : 34;
  const int64_t K = nb * kQK, row_bytes = nb * bb, tiles = (M + kTileRows - 1) / kTileRows;
  const uint8_t* end = wq + N * row_bytes;
  std::vector<uint16_t> abuf(kTileRows * K, 0);
  alignas(64) float cbuf[kMaxTiles * kTileRows * kTileRows];
  vllm_cpu::amx_load_config(7, kTileRows);
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t n0 = g * kTileRows, rows = std::min<int64_t>(kTileRows, N - n0);
    for (int64_t r = 0; r < rows; ++r) {
      // The same row of the next group, while this one is expanded: without the prefetches
      // the expansion waits on memory (measured 4.1 GB/s).
      const uint8_t* pf = wq + (n0 + kTileRows + r) * row_bytes;
      for (int64_t off = 0; off < row_bytes && pf + off < end; off += 64)
        _mm_prefetch(reinterpret_cast<const char*>(pf + off), _MM_HINT_T0);
      row_bf16<kQ4>(wq + (n0 + r) * row_bytes, nb, abuf.data() + r * K);
    }
    if (rows < kTileRows) std::fill(abuf.begin() + rows * K, abuf.end(), 0);
    switch (tiles) {
      case 1: group_products<1>(abuf.data(), K, xb, nb, cbuf); break;
      case 2: group_products<2>(abuf.data(), K, xb, nb, cbuf); break;
      default: group_products<3>(abuf.data(), K, xb, nb, cbuf); break;
    }
    for (int64_t t = 0; t < M; ++t) {
      const float* c = cbuf + (t / kTileRows) * kTileRows * kTileRows + t % kTileRows;
      float* yt = y + t * N + n0;
      for (int64_t r = 0; r < rows; ++r) yt[r] = c[r * kTileRows];
    }
  }
  vllm_cpu::amx_release();
}

#pragma GCC pop_options

}  // namespace

int64_t amx_max_tokens() { return kMaxTiles * kTileRows; }

void pack_x_amx(const float* x, int64_t M, int64_t K, std::vector<uint32_t>& xb) {
  TORCH_CHECK(M >= 1 && M <= amx_max_tokens(), "the AMX kernel takes 1 to ", amx_max_tokens(),
              " tokens, not ", M);
  const int64_t nb = K / kQK, tiles = (M + kTileRows - 1) / kTileRows;
  xb.assign(tiles * nb * 256, 0);
  std::vector<uint16_t> row(K);
  for (int64_t t = 0; t < M; ++t) {
    for (int64_t k = 0; k < K; ++k)  // to bf16, nearest even (inputs are finite)
      row[k] = c10::BFloat16(x[t * K + k]).x;
    for (int64_t b = 0; b < nb; ++b) {
      uint32_t* dst = xb.data() + ((t / kTileRows) * nb + b) * 256 + t % kTileRows;
      for (int64_t i = 0; i < 16; ++i)
        dst[i * kTileRows] = row[b * kQK + 2 * i] | uint32_t(row[b * kQK + 2 * i + 1]) << 16;
    }
  }
}

void linear_rows_amx(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                     int64_t qtype, const uint32_t* xb, int64_t M, float* y) {
  if (qtype == kTypeQ4_1)
    linear_groups_amx<true>(wq, g0, g1, N, nb, xb, M, y);
  else
    linear_groups_amx<false>(wq, g0, g1, N, nb, xb, M, y);
}

}  // namespace vllm_cpu::gguf

namespace vllm_cpu {

bool cpu_has_amx_bf16() {
  static const bool ok =
      gguf::cpuid_amx_bf16() &&
      syscall(SYS_arch_prctl, gguf::kArchReqXcompPerm, gguf::kXfeatureXtiledata) == 0;
  return ok;
}

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

void amx_load_config(int n, int rows) {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < n; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = static_cast<uint8_t>(rows);
  }
  // GCC 12 drops the stores above as dead before LDTILECFG (seen: only the palette byte was
  // written, and the first tile instruction faulted): make them visible first.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

void amx_release() { _tile_release(); }

#pragma GCC pop_options

}  // namespace vllm_cpu
