"""The model runner in process, without the engine: for model-level benchmarks and evaluations.

One ``ModelRunner`` holds the fp32 weights (the exactness reference); ``quantize`` switches
it to ``--quantization gguf`` in place, so both formats are measured on one load.
``forward`` runs tokens of one sequence through the model the way a step does: their K/V
are written into the sequence's blocks and they attend over everything before them (one
token after a context is a decode; more are a prefill chunk).
"""

from __future__ import annotations

import torch

from vllm.config import CacheConfig, ModelConfig, VllmConfig
from vllm.v1.worker.model_runner import ModelRunner


def load_runner(max_tokens: int, block_size: int = 16) -> ModelRunner:
    """The embedded model in fp32, with KV blocks for one sequence of ``max_tokens``."""
    threads = torch.get_num_threads()
    config = VllmConfig(
        model_config=ModelConfig(quantization="fp32"),  # the default would be gguf
        cache_config=CacheConfig(block_size=block_size),
    )
    runner = ModelRunner(config, "cpu")
    runner.load_model()
    runner.initialize_kv_cache(-(-max_tokens // block_size) + 1)  # + the null block 0
    torch.set_num_threads(threads)  # a JIT build of the kernels may have changed it
    return runner


def quantize(runner: ModelRunner) -> None:
    """Switch the loaded fp32 model to the GGUF blocks (``--quantization gguf``)."""
    from vllm.model_executor.model_loader import apply_quantization

    threads = torch.get_num_threads()
    apply_quantization(runner.model, ModelConfig(quantization="gguf"))
    runner.install_attention_backend()  # the gguf prefill's attention dtype follows its GEMMs
    torch.set_num_threads(threads)


def sequence_blocks(runner: ModelRunner) -> list[int]:
    """Block ids of the one sequence: every block but the null block 0, in order."""
    return list(range(1, runner.kv_caches[0].shape[1]))


@torch.inference_mode()
def forward(runner: ModelRunner, ids: list[int], start: int) -> torch.Tensor:
    """Hidden states (len(ids), hidden) of tokens at positions ``start..``; positions
    ``0..start-1`` must be in the cache already (earlier calls)."""
    meta = runner.attn_backend.build_metadata([(start, len(ids), sequence_blocks(runner))])
    return runner.model(
        torch.tensor(ids), torch.arange(start, start + len(ids)), meta, runner.kv_caches
    )
