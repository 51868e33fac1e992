// AMX tiles, shared by the AMX kernels (quant_amx.cpp, prefill_attention.cpp); defined in
// quant_amx.cpp.
#pragma once

namespace vllm_cpu {

// AMX-BF16 + AVX512_BF16 on this CPU, and Linux lent this process the tile registers
// (arch_prctl ARCH_REQ_XCOMP_PERM, asked once). Call before any tile instruction.
bool cpu_has_amx_bf16();

// This thread's tile configuration: tiles 0 .. n - 1 of `rows` rows x 64 bytes each.
// Per thread: load it in the thread that runs the tile instructions, release after.
void amx_load_config(int n, int rows);
void amx_release();

}  // namespace vllm_cpu
