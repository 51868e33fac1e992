"""The attention Triton kernels lower to CUDA cubins (Ampere sm80, Hopper sm90) on a
machine without a GPU: what Triton's interpreter does not check (types the GPU backend
refuses, bitcasts, constexpr branches that never ran there). Each variant a served model
can launch: windowed or not, soft-capped, with sinks, an FP8 cache of either kind, fp32 /
bf16 / fp16 queries, split-K with its combine kernel. Skipped without triton, or where its
CUDA backend has no ptxas.
"""

from __future__ import annotations

import pytest

from tests.triton_interpreter import compile_for_cuda
from vllm.v1.attention.backends import (
    triton_decode,
    triton_mla_decode,
    triton_mla_prefill,
    triton_prefill,
)

DTYPES = {"fp32": "fp32", "bf16": "bf16", "fp16": "fp16"}


def _strides(names: list[str]) -> dict[str, str]:
    # The cache's strides may pass 2^31 elements on a large card; the others are small.
    return {n: "i64" if n in ("stride_kv_half", "stride_kv_block") else "i32" for n in names}


# (q dtype, KV_FP8, soft cap, sinks, splits, capability)
DECODE_VARIANTS = [
    ("bf16", 0, False, False, 1, 90),
    ("bf16", 1, True, True, 4, 90),
    ("fp16", 2, False, True, 16, 80),
    ("fp32", 1, True, False, 1, 80),
    ("bf16", 2, True, True, 1, 90),
]


@pytest.mark.parametrize("dtype, kv_fp8, soft_cap, sinks, splits, capability", DECODE_VARIANTS)
def test_decode_kernel_compiles(dtype, kv_fp8, soft_cap, sinks, splits, capability):
    kv = "u8" if kv_fp8 else dtype
    pointers = dict(q_ptr=dtype, kv_ptr=kv, block_table_ptr="i32", seq_lens_ptr="i32",
                    rows_ptr="i32", sinks_ptr=dtype if sinks else "i32", out_ptr=dtype,
                    m_ptr="fp32", l_ptr="fp32", acc_ptr="fp32")  # fmt: skip
    scalars = {"qk_scale": "fp32", "window": "i32", "soft_cap2": "fp32"}
    scalars |= _strides(triton_decode._decode_kernel.arg_names[13:22])
    constants = dict(GROUP=8, GROUP_PAD=16, HEAD_DIM=64, HEAD_DIM_PAD=64, BLOCK_SIZE=16,
                     TILE_N=64, NUM_SPLITS=splits, HAS_ROWS=True, HAS_SOFT_CAP=soft_cap,
                     HAS_SINKS=sinks, KV_FP8=kv_fp8,
                     PRECISION="ieee" if dtype == "fp32" else "tf32")  # fmt: skip
    compile_for_cuda(triton_decode._decode_kernel, pointers, scalars, constants, capability)
    if splits > 1:
        pointers = dict(m_ptr="fp32", l_ptr="fp32", acc_ptr="fp32", rows_ptr="i32",
                        sinks_ptr=dtype if sinks else "i32", out_ptr=dtype)  # fmt: skip
        scalars = {"stride_o_tok": "i32", "stride_o_head": "i32"}
        constants = dict(HEAD_DIM=64, HEAD_DIM_PAD=64, NUM_SPLITS=splits, HAS_ROWS=True,
                         HAS_SINKS=sinks)  # fmt: skip
        combine = triton_decode._combine_splits_kernel
        compile_for_cuda(combine, pointers, scalars, constants, capability)


# (q dtype, KV_FP8, splits, capability): DeepSeek's latent (512 + 64), V2-Lite's 16 heads.
MLA_DECODE_VARIANTS = [
    ("bf16", 0, 1, 90),
    ("bf16", 1, 4, 90),
    ("fp16", 2, 16, 80),
    ("fp32", 0, 2, 80),
]


@pytest.mark.parametrize("dtype, kv_fp8, splits, capability", MLA_DECODE_VARIANTS)
def test_mla_decode_kernel_compiles(dtype, kv_fp8, splits, capability):
    kernel = triton_mla_decode._mla_decode_kernel
    kv = "u8" if kv_fp8 else dtype
    pointers = dict(q_ptr=dtype, kv_ptr=kv, block_table_ptr="i32", seq_lens_ptr="i32",
                    out_ptr=dtype, m_ptr="fp32", l_ptr="fp32", acc_ptr="fp32")  # fmt: skip
    scalars = {"qk_scale": "fp32"} | _strides(kernel.arg_names[9:16])
    constants = dict(NUM_HEADS=16, BLOCK_H=16, LATENT=512, LATENT_PAD=512, ROPE=64,
                     ROPE_PAD=64, BLOCK_SIZE=16, TILE_N=16, NUM_SPLITS=splits, KV_FP8=kv_fp8,
                     PRECISION="ieee" if dtype == "fp32" else "tf32")  # fmt: skip
    compile_for_cuda(kernel, pointers, scalars, constants, capability)
    if splits > 1:  # triton_decode's combine over 512-wide partials
        pointers = dict(m_ptr="fp32", l_ptr="fp32", acc_ptr="fp32", rows_ptr="i32",
                        sinks_ptr="i32", out_ptr=dtype)  # fmt: skip
        scalars = {"stride_o_tok": "i32", "stride_o_head": "i32"}
        constants = dict(HEAD_DIM=512, HEAD_DIM_PAD=512, NUM_SPLITS=splits, HAS_ROWS=False,
                         HAS_SINKS=False)  # fmt: skip
        combine = triton_decode._combine_splits_kernel
        compile_for_cuda(combine, pointers, scalars, constants, capability)


# (q dtype, KV_FP8, DOT16, heads, capability): the MLA prefill kernel as the backend
# launches it on CUDA (16-bit queries multiply in their type, fp32 widened), V2-Lite's
# 16 heads and V3's 128.
MLA_PREFILL_VARIANTS = [
    ("bf16", 0, True, 16, 90),
    ("bf16", 1, True, 128, 90),
    ("fp16", 2, True, 16, 80),
    ("bf16", 0, True, 128, 80),
    ("fp32", 0, False, 16, 80),
    ("fp32", 1, False, 16, 90),
]


@pytest.mark.parametrize("dtype, kv_fp8, dot16, heads, capability", MLA_PREFILL_VARIANTS)
def test_mla_prefill_kernel_compiles(dtype, kv_fp8, dot16, heads, capability):
    kernel = triton_mla_prefill._mla_prefill_kernel
    kv = "u8" if kv_fp8 else dtype
    pointers = dict(q_ptr=dtype, kv_ptr=kv, block_table_ptr="i32", seq_lens_ptr="i32",
                    cu_q_ptr="i32", out_ptr=dtype)  # fmt: skip
    scalars = {"qk_scale": "fp32"} | _strides(kernel.arg_names[7:14])
    block_q, block_h = triton_mla_prefill.tile_shape(heads)
    constants = dict(NUM_HEADS=heads, BLOCK_Q=block_q, BLOCK_H=block_h, LATENT=512,
                     LATENT_PAD=512, ROPE=64, ROPE_PAD=64, BLOCK_SIZE=16,
                     TILE_N=triton_mla_prefill.TILE_N, KV_FP8=kv_fp8, DOT16=dot16,
                     PRECISION="ieee" if dtype == "fp32" else "tf32")  # fmt: skip
    compile_for_cuda(kernel, pointers, scalars, constants, capability,
                     num_warps=triton_mla_prefill.NUM_WARPS,
                     num_stages=triton_mla_prefill.NUM_STAGES[dot16])  # fmt: skip


# (q dtype, KV_FP8, soft cap, sinks, head dim, capability)
PREFILL_VARIANTS = [
    ("bf16", 0, True, False, 256, 90),  # Gemma 2
    ("bf16", 0, False, True, 64, 90),  # gpt-oss without varlen_attn's log-sum-exp
    ("fp16", 1, True, True, 128, 80),
    ("fp32", 2, False, False, 64, 80),
]


@pytest.mark.parametrize("dtype, kv_fp8, soft_cap, sinks, dim, capability", PREFILL_VARIANTS)
def test_prefill_kernel_compiles(dtype, kv_fp8, soft_cap, sinks, dim, capability):
    kv = "u8" if kv_fp8 else dtype
    pointers = dict(q_ptr=dtype, kv_ptr=kv, block_table_ptr="i32", seq_lens_ptr="i32",
                    cu_q_ptr="i32", sinks_ptr=dtype if sinks else "i32", out_ptr=dtype)  # fmt: skip
    scalars = {"qk_scale": "fp32", "window": "i32", "soft_cap2": "fp32"}
    scalars |= _strides(triton_prefill._prefill_kernel.arg_names[10:19])
    block = max(16, min(64, triton_prefill.TILE_ELEMENTS // dim))
    constants = dict(GROUP=2, HEAD_DIM=dim, HEAD_DIM_PAD=dim, BLOCK_SIZE=16, BLOCK_M=block,
                     TILE_N=block, HAS_SOFT_CAP=soft_cap, HAS_SINKS=sinks, KV_FP8=kv_fp8,
                     PRECISION="ieee" if dtype == "fp32" else "tf32")  # fmt: skip
    compile_for_cuda(triton_prefill._prefill_kernel, pointers, scalars, constants, capability)


@pytest.mark.parametrize("capability", [80, 90])
def test_top_p_kernels_compile(capability):
    # The sampler's Triton top-p search (vllm/v1/sample/triton_top_p.py), never run on a
    # GPU yet: its first and a later pass, and the edge.
    from vllm.v1.sample import triton_top_p as t

    scalars = {"vocab": "i32", "chunk": "i32", "num_rows": "i32", "splits": "i32"}
    for p in (0, t.PASSES - 1):
        pointers = dict(probs_ptr="fp32")
        compile_for_cuda(
            t._top_p_pass,
            pointers,
            {"stride": "i32", "top_p_ptr": "*fp64", "state_ptr": "*i32", "parts_ptr": "*fp64"}
            | scalars,
            dict(PASS=p, T=t.THRESHOLDS, BLOCK=t.BLOCK),
            capability,
        )
    pointers = dict(top_p_ptr="fp64", state_ptr="i32", parts_ptr="fp64", edge_ptr="fp32")
    compile_for_cuda(t._top_p_edge, pointers, {"num_rows": "i32", "splits": "i32"},
             dict(PASS=t.PASSES, T=t.THRESHOLDS), capability)  # fmt: skip
