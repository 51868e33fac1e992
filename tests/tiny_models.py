"""A tiny Llama's HF config, shared by the tests that build random checkpoints."""

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
