// GGUF weight blocks, shared by the quantized linear kernels: quant_kernels.cpp (scalar and
// AVX2 paths, dispatch, op registration) and quant_avx512.cpp (AVX-512 fp32 and AVX512-VNNI
// int8 paths, 5 to 47 tokens).
//
// Weights stay in the GGUF file's own block layout, one matrix row after another
// (qweight: uint8 [N, (K / 32) * block_bytes], K = input features, N = output features):
//   Q4_1 (type 3, 20 bytes / 32 weights): fp16 d, fp16 m, 16 bytes of nibbles; byte j holds
//        weight j in its low nibble and weight j + 16 in its high nibble; w = q * d + m.
//   Q8_0 (type 8, 34 bytes / 32 weights): fp16 d, 32 int8 q; w = q * d.
//
// Included before any target pragma: what is defined here is portable code.
#pragma once

#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace vllm_cpu::gguf {

constexpr int64_t kQK = 32;  // weights per block, both types
constexpr int64_t kTypeQ4_1 = 3;
constexpr int64_t kTypeQ8_0 = 8;
constexpr int kRows512 = 4;  // weight rows per tile, both AVX-512 paths
constexpr int kRowsAmx = 16;  // weight rows per AMX tile (a tile's 16 rows)

inline int64_t block_bytes(int64_t qtype) {
  if (qtype == kTypeQ4_1) return 20;
  if (qtype == kTypeQ8_0) return 34;
  TORCH_CHECK(false, "unsupported GGML type ", qtype, " (supported: Q4_1=3, Q8_0=8)");
}

inline float half_at(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);  // blocks are 20 / 34 bytes: fp16 fields are unaligned
  return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

// ---- AVX-512 kernels (quant_avx512.cpp) --------------------------------------------------
// Call only after the run-time checks: cpu_has_avx512() for the fp32 kernel,
// cpu_has_avx512_vnni() for the int8 ones. Each handles the row groups [g0, g1) of kRows512
// rows (the last group may be partial) and writes y [M, N] for those rows only, so the
// groups can be split over threads.

// Rows dequantised into an fp32 buffer that stays in L1, multiplied by x [M, K] in tiles.
void linear_rows_avx512(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                        int64_t bb, int64_t qtype, const float* x, int64_t M, float* y);

// 1 to 4 tokens (bound by the bytes of weights read): each block of 4 rows is expanded in
// registers and used at once by every token, with software prefetches of the rows ahead.
void fused_rows_avx512(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                       int64_t qtype, const float* x, int64_t M, float* y);

// x quantised to int8 per 32-value block, laid out for VPDPBUSD (16 tokens a tile).
struct QuantizedX {
  int64_t tiles = 0, nb = 0;
  std::vector<uint8_t> q;  // [tile][block][group of 4 inputs][lane][4]: q + 128
  std::vector<float> d;    // [tile][block][lane]: dx (0 for padding lanes)
  std::vector<float> s;    // [tile][block][lane]: dx * sum(q)
};

// Fills qx from x [M, K] (once per call, before the row groups are split over threads).
void quantize_x_avx512(const float* x, int64_t M, int64_t K, QuantizedX& qx);

void linear_rows_int8_avx512(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                             int64_t bb, int64_t qtype, const QuantizedX& qx, int64_t M,
                             float* y);

// ---- AMX kernel (quant_amx.cpp): bf16 tiles, up to amx_max_tokens() tokens -------------
// (Call only after vllm_cpu::cpu_has_amx_bf16(), amx.h.)
int64_t amx_max_tokens();

// x [M, K] fp32 -> bf16 pairs laid out as the B tiles (once per call).
void pack_x_amx(const float* x, int64_t M, int64_t K, std::vector<uint32_t>& xb);

// Row groups [g0, g1) of 16 rows (the last may be partial); writes y [M, N] for those rows.
void linear_rows_amx(const uint8_t* wq, int64_t g0, int64_t g1, int64_t N, int64_t nb,
                     int64_t qtype, const uint32_t* xb, int64_t M, float* y);

}  // namespace vllm_cpu::gguf
