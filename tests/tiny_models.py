"""A tiny Llama's HF config, shared by the tests that build random checkpoints, and a CPU
runner loaded with a model."""

from __future__ import annotations

from pathlib import Path

TINY_LLAMA = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=False,
)


def save_tiny_llama(path: str | Path, **overrides):
    """A random tiny Llama (torch seed 0) saved by transformers (fp32) into ``path``;
    returns its ``LlamaConfig``."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_LLAMA, **overrides})
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return config


def load_cpu_runner(config, block_size: int = 16):
    """A ``ModelRunner`` on the CPU with its model loaded, the test process's torch thread
    count kept (the runner sets its own). ``config``: a ``VllmConfig``, or a
    ``ModelConfig`` with blocks of ``block_size``."""
    import torch

    from vllm.config import CacheConfig, ModelConfig, VllmConfig
    from vllm.v1.worker.model_runner import ModelRunner

    threads = torch.get_num_threads()
    if isinstance(config, ModelConfig):
        config = VllmConfig(model_config=config, cache_config=CacheConfig(block_size=block_size))
    runner = ModelRunner(config, device="cpu")
    try:
        runner.load_model()
    finally:
        torch.set_num_threads(threads)
    return runner
