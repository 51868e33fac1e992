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


def perturbed(hf):
    """``hf`` (an HF model, seeded by the caller) with its biases drawn away from 0 and its
    norms' weights from 1, so that a misplaced one shows; in eval mode."""
    import torch

    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf.eval()


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


def cache_layout(runner, blocks: int = 8):
    """A fresh KV cache for one sequence of ``blocks`` blocks, and its block table: blocks
    1..``blocks``, or with the hybrid KV cache's groups (``runner.kv_groups``) a table per
    group, each over its own blocks (groups share the cache tensors)."""
    groups = runner.kv_groups.num_groups
    runner.initialize_kv_cache(1 + blocks * groups)
    tables = tuple(list(range(1 + blocks * g, 1 + blocks * (g + 1))) for g in range(groups))
    return tables[0] if groups == 1 else tables


def runner_logits(runner, ids):
    """fp32 logits of one whole prompt ``ids`` through ``runner``'s model (its KV cache
    made here: ``cache_layout``, the prompt in 8 blocks), as the engine's forward computes
    them."""
    import torch

    table = cache_layout(runner)
    meta = runner.metadata_builder.build_metadata([(0, len(ids), table)])
    with torch.inference_mode():
        positions = torch.arange(len(ids), device=ids.device)
        hidden = runner.model(ids, positions, meta, runner.kv_caches)
        return runner.model.compute_logits(hidden)


def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy ``generate`` of each prompt alone: its new tokens."""
    import torch

    with torch.inference_mode():
        return [
            hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in prompts
        ]


def check_engine_greedy_matches(hf, path, max_tokens: int = 10, prefix_hit: bool = True):
    """The engine on the checkpoint in ``path`` (written from ``hf``, vocab 49,152; the
    SmolLM2 tokenizer copied in): three prompts sharing a 40-token prefix, in
    16-token chunks, decoded together, then the last again (a prefix hit): each one's
    greedy tokens equal transformers' ``generate``."""
    import torch

    from tests.utils import copy_benchmark_tokenizer
    from vllm import LLM, SamplingParams

    copy_benchmark_tokenizer(Path(path))  # the GPU kit's copy where there is no embedded model
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 49152, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, 49152, (n,), generator=g).tolist() for n in (3, 17, 30)]
    expected = hf_greedy(hf, prompts, max_tokens)
    llm = LLM(model=str(path), kv_cache_memory="16MiB", max_num_batched_tokens=16,
              enable_prefix_caching=True)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        again = llm.generate({"prompt_token_ids": prompts[2]}, params)[0] if prefix_hit else None
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    if again is not None:
        assert list(again.outputs[0].token_ids) == expected[2] and again.num_cached_tokens >= 32


def check_tile_embeddings(model, px, ref, rows: int) -> None:
    """``model.embed_images`` of the tiles ``px`` (given in float64: cast inside) is
    ``ref`` (transformers' rows of them) within 1e-5 in fp32, ``rows`` a tile; a tile alone
    gives its own rows."""
    import torch

    ours = model.embed_images(px.double())
    assert ours.shape == (px.shape[0], rows, model.arch.hidden_size)
    assert ours.dtype == torch.float32
    assert ref.abs().mean() > 0.1
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    assert torch.allclose(model.embed_images(px[1:2]), ref[1:2], atol=1e-5)


def check_image_logits(runner, hf, ids, ours, **inputs) -> None:
    """``ours``, the runner's logits of ``ids`` with their images, equal transformers'
    (``hf`` given ``inputs``: its pixel values...) within 1e-4, and the text's own logits
    differ from them (the images were read)."""
    import torch

    with torch.inference_mode():
        ref = hf(input_ids=ids[None], **inputs).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    assert (runner_logits(runner, ids) - ref).abs().max() > 1e-2
