"""LoRA adapters (``vllm/lora``): a PEFT checkpoint written here for a tiny Llama gives the
logits and greedy tokens of transformers' model with the adapter merged into its weights
(W + scaling * B @ A), alone or mixed with other adapters and the base model in one batch;
slots are reused as adapters come and go; the prefix cache never shares blocks between
adapters; what cannot be applied is refused with the reason."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from tests.tiny_models import TINY_LLAMA, load_cpu_runner
from tests.utils import copy_benchmark_tokenizer
from vllm.config import (
    CacheConfig,
    LoRAConfig,
    ModelConfig,
    VllmConfig,
)
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest

VOCAB = 49152  # the embedded model's tokenizer, for the engine tests
ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SHAPES = {  # (out, in) of each target in TINY_LLAMA
    "q_proj": (64, 64), "k_proj": (32, 64), "v_proj": (32, 64), "o_proj": (64, 64),
    "gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96),
    "qkv_proj": (128, 64), "gate_up_proj": (192, 64),
}  # fmt: skip


def write_adapter(path, seed: int, targets=ALL, r=4, alpha=8, layers=(0, 1), **config):
    """A PEFT checkpoint: random A (r, in) and B (out, r) for each target of each layer."""
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in layers:
        for t in targets:
            out, inp = SHAPES[t]
            attention = ("q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj")
            block = "self_attn" if t in attention else "mlp"
            key = f"base_model.model.model.layers.{i}.{block}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, inp, generator=g) * 0.2
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.2
    save_file(tensors, path / "adapter_model.safetensors")
    meta = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none",
            "target_modules": list(targets), **config}  # fmt: skip
    (path / "adapter_config.json").write_text(json.dumps(meta))
    return path


def merged(hf, adapter_dir) -> torch.nn.Module:
    """transformers' model with the adapter merged into its weights, as PEFT merges."""
    from safetensors.torch import load_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    model = copy.deepcopy(hf)
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    params = dict(model.named_parameters())
    for key, a in tensors.items():
        if ".lora_A." not in key:
            continue
        b = tensors[key.replace("lora_A", "lora_B")]
        module = key.removeprefix("base_model.model.").split(".lora_A")[0]
        r = a.shape[0]
        scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r)
        with torch.no_grad():
            params[f"{module}.weight"] += scale * (b @ a)
    return model


def greedy_reference(hf, prompts, loras, max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, with its adapter (a ``LoRARequest`` or
    None) merged into ``hf``'s weights."""
    models = {None: hf}
    out = []
    with torch.inference_mode():
        for prompt, lora in zip(prompts, loras, strict=True):
            name = lora.lora_name if lora else None
            if name not in models:
                models[name] = merged(hf, Path(lora.lora_path))
            ids = models[name].generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                                        do_sample=False)  # fmt: skip
            out.append(ids[0, len(prompt) :].tolist())
    return out


def save_base(path):
    """A tiny Llama (seed 0) with the embedded model's vocabulary, tokenizer and chat
    template, saved in ``path``; returns transformers' model."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**TINY_LLAMA, "vocab_size": VOCAB,
                                         "max_position_embeddings": 256})  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    hf.save_pretrained(path)
    copy_benchmark_tokenizer(path, chat_template=True)  # the GPU machine has no embedded model
    return hf


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """``save_base``'s folder and model: (folder, hf)."""
    path = tmp_path_factory.mktemp("lora-base")
    return path, save_base(path)


def lora_runner(path, max_loras=2, max_rank=8):
    config = VllmConfig(
        model_config=ModelConfig(model=str(path), max_model_len=256),
        cache_config=CacheConfig(block_size=16),
        lora_config=LoRAConfig(enable_lora=True, max_loras=max_loras, max_lora_rank=max_rank),
    )
    runner = load_cpu_runner(config)
    runner.initialize_kv_cache(20)
    return runner


def test_a_mixed_batch_gives_each_row_its_adapters_logits(base, tmp_path):
    """One forward: adapter a (rank 4, every target), the base model, adapter b (rank 8,
    attention only, rsLoRA): each request's logits equal its merged model's."""
    path, hf = base
    a = write_adapter(tmp_path / "a", seed=1)
    b = write_adapter(tmp_path / "b", seed=2, targets=ALL[:4], r=8, alpha=4, use_rslora=True)
    runner = lora_runner(path)
    slot_a = runner.lora.activate(LoRARequest("a", 1, str(a)), set())
    slot_b = runner.lora.activate(LoRARequest("b", 2, str(b)), set())
    assert {slot_a, slot_b} == {1, 2}
    g = torch.Generator().manual_seed(3)
    lengths = (12, 7, 20)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]
    ids = torch.cat(prompts)
    positions = torch.cat([torch.arange(n) for n in lengths])
    blocks = [[1, 2], [3, 4], [5, 6]]
    meta = runner.attn_backend.build_metadata(
        [(0, n, blk) for n, blk in zip(lengths, blocks, strict=True)]
    )
    slots = [slot_a] * 12 + [0] * 7 + [slot_b] * 20
    runner.lora.set_token_slots(slots, "cpu")
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(ids, positions, meta, runner.kv_caches))
        refs = [merged(hf, a), hf, merged(hf, b)]
        start = 0
        for prompt, ref_model in zip(prompts, refs, strict=True):
            ref = ref_model(prompt[None]).logits[0].float()
            ours = logits[start : start + len(prompt)]
            assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
            start += len(prompt)
        base_logits = hf(prompts[0][None]).logits[0]
    assert (logits[:12] - base_logits).abs().max() > 1e-2  # the adapter changes something


def test_engine_greedy_tokens_follow_each_requests_adapter(base, tmp_path):
    """Through the engine (one slot for two adapters: they take turns), prefix caching on:
    every request's greedy tokens equal its merged model's; a prompt cached under one
    adapter is recomputed under another."""
    from vllm import LLM, SamplingParams

    path, hf = base
    a = write_adapter(tmp_path / "a", seed=1)
    b = write_adapter(tmp_path / "b", seed=2, targets=("q_proj", "v_proj", "down_proj"))
    lora_a, lora_b = LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(0, VOCAB, (40,), generator=g).tolist()
    prompts = [shared + torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (3, 9, 5, 2)]
    loras = [lora_a, lora_b, None, lora_a]
    expected = greedy_reference(hf, prompts, loras, 6)
    llm = LLM(model=str(path), enable_lora=True, max_loras=1, max_lora_rank=8,
              kv_cache_memory="16MiB", enable_prefix_caching=True)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        # A new prompt cached under a: a hit for a, none for b nor the base model.
        fresh = {"prompt_token_ids": torch.randint(0, VOCAB, (40,), generator=g).tolist()}
        llm.generate(fresh, params, lora_request=lora_a)
        hits = [llm.generate(fresh, params, lora_request=lora)[0].num_cached_tokens
                for lora in (lora_a, lora_b, None)]  # fmt: skip
        assert hits == [32, 0, 0]
    finally:
        llm.shutdown()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(r=32), "rank 32 is greater than max_lora_rank 8"),
        (dict(bias="all"), "adapter biases are not supported"),
        (dict(use_dora=True), "DoRA"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="IA3"), "peft_type is 'IA3'"),
    ],
)
def test_an_adapter_config_the_engine_cannot_apply_is_refused(base, tmp_path, change, match):
    from vllm.v1.engine.processor import Processor

    adapter = write_adapter(tmp_path / "x", seed=1, targets=("q_proj",))
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **change}))
    vllm_config = VllmConfig(lora_config=LoRAConfig(enable_lora=True, max_lora_rank=8))
    processor = Processor(vllm_config, transformers.AutoTokenizer.from_pretrained(base[0]), 2)
    from vllm import SamplingParams

    with pytest.raises(VLLMValidationError, match=match) as e:
        processor.process(
            [1, 2, 3], SamplingParams(), lora_request=LoRARequest("x", 1, str(adapter))
        )
    assert e.value.param == "lora_request"


def test_lora_requests_need_enable_lora_and_a_real_adapter(base, tmp_path):
    from vllm import SamplingParams
    from vllm.v1.engine.processor import Processor

    tokenizer = transformers.AutoTokenizer.from_pretrained(base[0])
    lora = LoRARequest("x", 1, str(tmp_path / "nowhere"))
    off = Processor(VllmConfig(), tokenizer, 2)
    with pytest.raises(VLLMValidationError, match="LoRA is not enabled"):
        off.process([1, 2], SamplingParams(), lora_request=lora)
    on = Processor(VllmConfig(lora_config=LoRAConfig(enable_lora=True)), tokenizer, 2)
    with pytest.raises(VLLMValidationError, match="has no adapter_config.json"):
        on.process([1, 2], SamplingParams(), lora_request=lora)
    with pytest.raises(ValueError, match="lora_int_id must be >= 1"):
        LoRARequest("x", 0, "/p")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("x", 1, "")
    assert LoRARequest("x", 1, "/p") == LoRARequest("x", 2, "/q")  # by name, as vLLM


def test_adapter_weights_the_model_cannot_take_fail_the_request_alone(base, tmp_path):
    """Checked when a slot loads them: a target the engine does not apply, a shape that is
    not the model's. The runner fails that request (400) and the batch goes on."""
    from vllm.lora.peft import load_adapter

    embed = write_adapter(tmp_path / "e", seed=1, targets=("q_proj",))
    tensors = {"base_model.model.model.embed_tokens.lora_A.weight": torch.zeros(4, 10)}
    save_file(tensors, embed / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="embed_tokens.*does not apply"):
        load_adapter("e", str(embed), 8)
    runner = lora_runner(base[0], max_loras=1)
    wide = write_adapter(tmp_path / "w", seed=1, targets=("q_proj",), layers=(0,))
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    bad = {f"{key}.lora_A.weight": torch.zeros(4, 65), f"{key}.lora_B.weight": torch.zeros(64, 4)}
    save_file(bad, wide / "adapter_model.safetensors")
    with pytest.raises(ValueError, match="layer 0's q_proj is \\(64, 65\\)"):
        runner.lora.activate(LoRARequest("w", 1, str(wide)), set())
    deep = write_adapter(tmp_path / "d", seed=1, targets=("q_proj",), layers=(5,))
    with pytest.raises(ValueError, match="layer 5's q_proj"):
        runner.lora.activate(LoRARequest("d", 2, str(deep)), set())
    good = write_adapter(tmp_path / "g", seed=1, targets=("q_proj",))
    assert runner.lora.activate(LoRARequest("g", 3, str(good)), set()) == 1
    other = write_adapter(tmp_path / "o", seed=2, targets=("q_proj",))
    with pytest.raises(RuntimeError, match="no LoRA slot free"):
        runner.lora.activate(LoRARequest("o", 4, str(other)), in_use={3})
    assert runner.lora.activate(LoRARequest("o", 4, str(other)), in_use=set()) == 1


def test_without_lora_tokens_the_layers_add_nothing(base):
    """A step with no adapter token adds no LoRA work (token_slots None) and matches the
    base model exactly."""
    path, hf = base
    runner = lora_runner(path)
    runner.lora.set_token_slots([0, 0, 0], "cpu")
    assert runner.lora.batch.token_slots is None
    ids = torch.tensor([5, 6, 7])
    meta = runner.attn_backend.build_metadata([(0, 3, [1])])
    with torch.inference_mode():
        ours = runner.model.compute_logits(
            runner.model(ids, torch.arange(3), meta, runner.kv_caches)
        )
        ref = hf(ids[None]).logits[0]
    assert torch.allclose(ours, ref, atol=1e-5)


def test_a_layer_that_keeps_bf16_products_gets_its_update_in_bf16():
    """The gguf path's bf16 prefill: gate_up_proj returns bf16 and down_proj takes it; the
    LoRA update (kept in the model's fp32) is added in the base layer's dtype."""
    from vllm.lora.layers import LoRABatch, LoRALinear

    g = torch.Generator().manual_seed(0)
    w, a, b = (torch.randn(*shape, generator=g) for shape in ((6, 8), (2, 8), (6, 2)))

    class Bf16Linear(torch.nn.Module):
        def forward(self, x):
            return (x.float() @ w.t()).bfloat16()

    batch = LoRABatch()
    layer = LoRALinear(Bf16Linear(), 8, [6], 1, 2, batch, torch.float32, torch.device("cpu"))
    layer.set_slot(1, [(a, b)])
    x = torch.randn(3, 8, generator=g).bfloat16()
    batch.set([1, 0, 1], "cpu")
    out = layer(x)
    assert out.dtype == torch.bfloat16
    delta = (x.float() @ a.t() @ b.t()) * torch.tensor([[1.0], [0.0], [1.0]])
    torch.testing.assert_close(out.float(), x.float() @ w.t() + delta, atol=0.1, rtol=0.02)


def test_adapters_with_speculative_decoding_and_a_bad_adapter_among_good_ones(base, tmp_path):
    """n-gram drafts check an adapter's own tokens (greedy: the merged model's); an adapter
    whose config reads but whose weights do not fit fails its request alone
    (finish_reason error) while the others in the batch finish."""
    from vllm import LLM, SamplingParams

    path, hf = base
    a = write_adapter(tmp_path / "a", seed=1)
    bad = write_adapter(tmp_path / "bad", seed=2, targets=("q_proj",), layers=(7,))  # no layer 7
    pattern = [300 + t for t in range(10)]
    prompts = [pattern * 3, [5, 6, 7] * 9]
    expected = greedy_reference(hf, prompts, [LoRARequest("a", 1, str(a))] * 2, 12)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
    llm = LLM(model=str(path), enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_memory="16MiB", speculative_config=spec)  # fmt: skip
    try:
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        lora_a, lora_bad = LoRARequest("a", 1, str(a)), LoRARequest("bad", 2, str(bad))
        outs = llm.generate([{"prompt_token_ids": p} for p in [*prompts, prompts[0]]], params,
                            lora_request=[lora_a, lora_a, lora_bad])  # fmt: skip
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs[:2]] == expected
    assert outs[2].outputs[0].finish_reason == "error" and not outs[2].outputs[0].token_ids


def test_decode_steps_with_adapters_replay_in_cuda_graphs(tmp_path, monkeypatch):
    """With LoRA, the captured decode steps compute every slot, masked by a fixed buffer of
    row slots: steps mixing two adapters and the base model replay (stand-in graphs on the
    CPU, tests/v1/worker/test_cuda_graph.py) and give the eager runner's tokens, which
    differ from the base model's."""
    from tests.tiny_models import save_tiny_llama
    from tests.v1.worker.test_cuda_graph import ReplayingGraph, make_runner, run_steps

    save_tiny_llama(tmp_path / "m")
    a = write_adapter(tmp_path / "a", seed=1, r=4)
    b = write_adapter(tmp_path / "b", seed=2, targets=("q_proj", "down_proj"), r=2)
    loras = {"a": LoRARequest("a", 1, str(a)), "c": LoRARequest("b", 2, str(b))}
    config = LoRAConfig(enable_lora=True, max_loras=2, max_lora_rank=4)
    eager = make_runner(tmp_path / "m", monkeypatch, lora=config, enforce_eager=True)
    expected = run_steps(eager, loras)
    assert expected != run_steps(make_runner(tmp_path / "m", monkeypatch))  # adapters matter
    runner = make_runner(tmp_path / "m", monkeypatch, lora=config)
    runner.capture_model(graph_factory=ReplayingGraph)
    assert run_steps(runner, loras) == expected
    assert runner.decode_graphs.num_replays == 6  # every decode step, adapters and all


def test_preempted_adapter_requests_resume_with_their_adapter(base, tmp_path):
    """A pool too small for every request preempts some (recompute); resumed, each takes
    its adapter's slot again, and every request's tokens are its merged model's."""
    from vllm import LLM, SamplingParams

    path, hf = base
    a = write_adapter(tmp_path / "a", seed=1)
    b = write_adapter(tmp_path / "b", seed=2, targets=("o_proj", "up_proj"))
    loras = [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b))] * 2
    g = torch.Generator().manual_seed(8)
    prompts = [torch.randint(0, VOCAB, (40,), generator=g).tolist() for _ in loras]
    expected = greedy_reference(hf, prompts, loras, 40)
    llm = LLM(model=str(path), enable_lora=True, max_loras=2, max_lora_rank=8,
              num_gpu_blocks_override=14, enable_prefix_caching=False)  # fmt: skip
    preemptions = []
    step = llm.engine_core.step

    def counting():
        out = step()
        if out.scheduler_stats is not None:
            preemptions.append(out.scheduler_stats.num_preemptions)
        return out

    llm.engine_core.step = counting
    try:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras)
    finally:
        llm.shutdown()
    assert sum(preemptions) > 0  # 4 requests of 80 tokens in 13 blocks of 16
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_fused_targets_of_a_phi3_adapter_give_the_merged_models_logits(tmp_path):
    """Phi-3's checkpoints fuse q/k/v and gate/up, and so do its adapters (qkv_proj,
    gate_up_proj): their B is split over our slices."""
    torch.manual_seed(0)
    hf = transformers.Phi3ForCausalLM(transformers.Phi3Config(**TINY_LLAMA, pad_token_id=0))
    hf.eval().save_pretrained(tmp_path / "phi3")
    adapter = write_adapter(tmp_path / "a", seed=3, targets=("qkv_proj", "o_proj", "gate_up_proj"))
    runner = lora_runner(tmp_path / "phi3", max_loras=1)
    assert type(runner.model).__name__ == "Phi3ForCausalLM"
    slot = runner.lora.activate(LoRARequest("a", 1, str(adapter)), set())
    ids = torch.randint(
        0, TINY_LLAMA["vocab_size"], (30,), generator=torch.Generator().manual_seed(2)
    )
    runner.lora.set_token_slots([slot] * 30, "cpu")
    meta = runner.attn_backend.build_metadata([(0, 30, [1, 2])])
    with torch.inference_mode():
        ours = runner.model.compute_logits(
            runner.model(ids, torch.arange(30), meta, runner.kv_caches)
        )
        ref = merged(hf, adapter)(ids[None]).logits[0].float()
        base = hf(ids[None]).logits[0].float()
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    assert (ref - base).abs().max() > 1e-2
