"""Disaggregated prefill on CUDA: a bf16 producer and consumer on one GPU (their tiers in
page-locked host memory, the copies on side streams, the consumer with CUDA graphs) give
the consumer the greedy tokens of a plain engine, and a job's next turn fetches only its
new blocks. The CPU tests are in tests/distributed/test_kv_transfer.py.

Run with ``pytest -m cuda tests`` on a CUDA machine; skipped without one.
"""

from __future__ import annotations

import pytest
import torch

from vllm import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TCP = "TcpConnector"
PROMPT = [3 + i % 80 for i in range(90)]  # 5 full blocks and a partial one (vocab 96)
MORE = list(range(10, 30))


def cuda_llm(path, role: str | None):
    from vllm import LLM

    transfer = {"kv_connector": TCP, "kv_role": role} if role else None
    return LLM(model=str(path), dtype="bfloat16", skip_tokenizer_init=True, max_model_len=128,
               num_gpu_blocks_override=64, kv_offloading_size=0.05, gpu_memory_utilization=0.2,
               kv_transfer_config=transfer)  # fmt: skip


def greedy(n: int = 8, **transfer) -> SamplingParams:
    extra = {"kv_transfer_params": transfer} if transfer else None
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, extra_args=extra)


def test_consumer_decodes_from_fetched_blocks_on_cuda(tmp_path):
    from tests.tiny_models import save_tiny_llama

    save_tiny_llama(tmp_path)
    plain = cuda_llm(tmp_path, None)
    expected = [
        plain.generate({"prompt_token_ids": p}, greedy())[0].outputs[0].token_ids
        for p in (PROMPT, PROMPT + MORE)
    ]
    plain.shutdown()
    producer, consumer = cuda_llm(tmp_path, "kv_producer"), cuda_llm(tmp_path, "kv_consumer")
    try:
        connector = consumer.engine_core.kv_connector
        for prompt, want, fetched in ((PROMPT, expected[0], 5), (PROMPT + MORE, expected[1], 1)):
            ids = {"prompt_token_ids": prompt}
            params = producer.generate(ids, greedy(1, do_remote_decode=True))[0].kv_transfer_params
            before = connector.totals().blocks_received
            out = consumer.generate(ids, greedy(**params))[0]
            assert out.outputs[0].token_ids == want
            assert connector.totals().blocks_received - before == fetched
            producer.engine_core.step()
        assert producer.engine_core.scheduler.kv_cache_manager.offload.pool.num_held_blocks == 0
    finally:
        producer.shutdown()
        consumer.shutdown()
