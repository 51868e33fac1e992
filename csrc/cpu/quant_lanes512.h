// AVX-512 expansion of GGUF blocks (layouts in quant_blocks.h), shared by the AVX-512 and
// AMX kernels (quant_avx512.cpp, quant_amx.cpp). Compiled for AVX-512 by a target attribute:
// call only from code compiled for (a superset of) it, after the run-time CPU checks.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "quant_blocks.h"

#define VLLM_AVX512_LANES __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma,f16c")))

namespace vllm_cpu::gguf {

// fp16 -> fp32 in one instruction (half_at's portable conversion costs as much as the rest
// of an int8 block's preparation); exact, as half_at.
VLLM_AVX512_LANES inline float half_f16c(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

VLLM_AVX512_LANES inline __m512 bcast_half512(const uint8_t* p) {
  return _mm512_set1_ps(half_f16c(p));
}

// One block (32 weights) of a row as two 16-lane registers, w = q * d + m in one FMA (the
// rounding of the AVX2 fused kernel).
template <bool kQ4>
VLLM_AVX512_LANES inline void block_lanes_avx512(const uint8_t* blk, __m512 w[2]) {
  if constexpr (kQ4) {
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m512 d = bcast_half512(blk), m = bcast_half512(blk + 2);
    const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 4));
    const __m128i lo = _mm_and_si128(qs, low4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
    w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d, m);
    w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d, m);
  } else {
    const __m512 d = bcast_half512(blk);
    for (int h = 0; h < 2; ++h) {
      const __m128i q8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2 + 16 * h));
      w[h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q8)), d);
    }
  }
}

}  // namespace vllm_cpu::gguf

#undef VLLM_AVX512_LANES
