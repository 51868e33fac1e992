// Native KV-cache kernels for the CPU backend.
//
// reshape_and_cache: scatter the K/V of this step's tokens into their paged slots.
// Layout per layer (vLLM's): kv_cache[2, num_blocks, block_size, num_kv_heads, head_size];
// slot = block_id * block_size + offset; a negative slot marks a padding token (skipped).
// The pure-torch fallback in vllm/_custom_ops.py computes the same thing with index_copy_.
// key / value rows may be strided (the k and v columns of a fused qkv output): no copy.
#include <torch/extension.h>

#include <cstring>

namespace {

// src rows are `src_stride` elements apart (a view of a fused qkv output is not contiguous).
template <typename scalar_t>
void scatter_tokens(const scalar_t* src, int64_t src_stride, scalar_t* dst,
                    const int64_t* slots, int64_t num_tokens, int64_t token_elems,
                    int64_t num_slots) {
#pragma omp parallel for if (num_tokens > 64)
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    TORCH_CHECK(slot < num_slots, "slot ", slot, " out of range (", num_slots, " slots)");
    std::memcpy(dst + slot * token_elems, src + i * src_stride,
                sizeof(scalar_t) * token_elems);
  }
}

// The tensor itself when each token's elements are contiguous (rows may be strided, as
// views of a fused qkv output are), else a contiguous copy.
torch::Tensor token_rows(const torch::Tensor& t) {
  bool ok = t.dim() >= 1;
  int64_t expected = 1;
  for (int64_t d = t.dim() - 1; ok && d >= 1; --d) {
    ok = t.size(d) == 1 || t.stride(d) == expected;
    expected *= t.size(d);
  }
  return ok ? t : t.contiguous();
}

}  // namespace

// key, value: [num_tokens, num_kv_heads, head_size]; kv_cache: [2, blocks, bs, heads, size].
void reshape_and_cache(const torch::Tensor& key, const torch::Tensor& value,
                       torch::Tensor& kv_cache, const torch::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2, "kv_cache must be [2, N, B, H, D]");
  TORCH_CHECK(kv_cache.is_contiguous(), "kv_cache must be contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kLong, "slot_mapping must be int64");
  TORCH_CHECK(key.scalar_type() == kv_cache.scalar_type(), "dtype mismatch");
  auto k = token_rows(key);
  auto v = token_rows(value);
  auto slots = slot_mapping.contiguous();
  const int64_t num_tokens = k.size(0);
  const int64_t token_elems = k.numel() / std::max<int64_t>(num_tokens, 1);
  const int64_t num_slots = kv_cache.size(1) * kv_cache.size(2);
  TORCH_CHECK(token_elems == kv_cache.size(3) * kv_cache.size(4), "head shape mismatch");
  TORCH_CHECK(slots.numel() == num_tokens, "slot_mapping length != num_tokens");
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::ScalarType::BFloat16, at::ScalarType::Half, kv_cache.scalar_type(),
      "reshape_and_cache", [&] {
        auto* base = kv_cache.data_ptr<scalar_t>();
        const int64_t plane = num_slots * token_elems;
        scatter_tokens(k.data_ptr<scalar_t>(), k.stride(0), base, slots.data_ptr<int64_t>(),
                       num_tokens, token_elems, num_slots);
        scatter_tokens(v.data_ptr<scalar_t>(), v.stride(0), base + plane,
                       slots.data_ptr<int64_t>(), num_tokens, token_elems, num_slots);
      });
}

TORCH_LIBRARY(vllm_continuum_C, m) {
  m.def("reshape_and_cache(Tensor key, Tensor value, Tensor(a!) kv_cache, Tensor slot_mapping) -> ()");
}

TORCH_LIBRARY_IMPL(vllm_continuum_C, CPU, m) { m.impl("reshape_and_cache", &reshape_and_cache); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {}
