"""Mistral 4 (``Mistral4ForCausalLM``, ``models/deepseek_v2.py``: DeepSeek's latent
attention with a softmax router ranking groups by their two best experts, and Llama 4's
query scale by position) and Mistral Small 4's multimodal model
(``Mistral3MLAForConditionalGeneration``, ``models/mistral3.py``: the Pixtral tower in
front of it), against transformers on tiny random checkpoints.
``original_max_position_embeddings`` is 16, so that most positions pass it and their
queries are scaled (by up to 1 + 0.4 log 7 at position 99); weights at 5x transformers'
initial spread, so that attention and routing are far from uniform. fp32 logits (text,
and a prompt with images), bf16 near them, each arch field live, the router against
transformers', refusals, the engine's greedy tokens (text and images) against
``generate``; on the CPU, decode steps replayed from stand-in CUDA graphs and a decode
step free of host reads (the query scale where CUDA graphs capture it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

from tests.model_executor.test_mistral3 import (
    IMAGE,
    image_prompt,
    image_prompt_logits,
    make_hf,
    padded,
    pixels,
)
from tests.model_executor.test_mistral3 import save as save_with_processor
from tests.tiny_models import (
    check_engine_greedy_matches,
    check_image_logits,
    load_cpu_runner,
    runner_logits,
)
from vllm.config import ModelConfig
from vllm.model_executor.layers.fused_moe import select_experts_grouped
from vllm.model_executor.models.deepseek_v2 import (
    DeepseekV2Arch,
    Mistral4ForCausalLM,
    llama4_query_scale,
)
from vllm.model_executor.models.mistral3 import (
    Mistral3ForConditionalGeneration,
    Mistral3MLAArch,
    Mistral3MLAForConditionalGeneration,
)
from vllm.model_executor.models.registry import ModelRegistry

ORIGINAL = 16  # original_max_position_embeddings: the query scale's step
# yarn over the 16 original positions, mscale_all_dim 1 (the softmax scale grows by
# mscale(8, 1) ** 2), Llama 4's query scale.
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": ORIGINAL, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0, "llama_4_scaling_beta": 0.4}  # fmt: skip
# head_dim 32 (nope 24 + rope 8): transformers' partial_rotary_factor 0.25 rotates the 8.
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=56, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=24, v_head_dim=16, max_position_embeddings=128,
            first_k_dense_replace=1, n_shared_experts=1, n_group=4, topk_group=2,
            routed_scaling_factor=1.5, initializer_range=0.1, tie_word_embeddings=False,
            rope_parameters=ROPE)  # fmt: skip
VARIANTS = {
    # Mistral Small 4's shape: q through its low-rank pair, a dense first layer, a shared
    # expert, yarn; and groups (the released model has one): the best 2 of 4 kept.
    "grouped": {},
    # q straight from the hidden state, one group, every layer sparse, no shared expert,
    # the Neox rotation, linear rope (the query scale still: its fields are
    # rope_parameters'). (The default type transformers' Mistral 4 rotates over all of
    # head_dim: refused below.)
    "plain": dict(q_lora_rank=None, n_group=1, topk_group=1, first_k_dense_replace=0,
                  n_shared_experts=0, rope_interleave=False, norm_topk_prob=False,
                  rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0,
                                   "original_max_position_embeddings": ORIGINAL,
                                   "llama_4_scaling_beta": 0.3}),
}  # fmt: skip
IDS = torch.randint(0, 96, (100,), generator=torch.Generator().manual_seed(1))


def fields(**overrides) -> dict:
    """TINY with ``overrides``, its rotary dict a copy (transformers' config writes
    ``partial_rotary_factor`` into the dict it is given)."""
    out = {**TINY, **overrides}
    return {**out, "rope_parameters": dict(out["rope_parameters"])}


def make(**overrides) -> transformers.Mistral4ForCausalLM:
    """A random tiny model (torch seed 0), its norms away from 1."""
    torch.manual_seed(0)
    hf = transformers.Mistral4ForCausalLM(transformers.Mistral4Config(**fields(**overrides)))
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return hf.eval()


def hf_logits(hf, ids: torch.Tensor = IDS) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


def our_logits(arch: DeepseekV2Arch, hf) -> torch.Tensor:
    """Logits of ``IDS`` from our model of ``arch`` with ``hf``'s tensors (TORCH_SDPA)."""
    from vllm.v1.attention.backends.torch_sdpa import TorchSDPABackend

    model = Mistral4ForCausalLM(arch)
    model.load_weights(hf.state_dict())
    backend = TorchSDPABackend(
        4, 1, arch.head_dim, torch.float32, "cpu", 16, value_size=arch.latent_value_size
    )
    model.set_attention_backend(backend)
    caches = [torch.zeros(backend.kv_cache_shape(9)) for _ in model.layers]
    meta = backend.build_metadata([(0, len(IDS), list(range(1, 9)))])
    with torch.inference_mode():
        return model.compute_logits(model(IDS, torch.arange(len(IDS)), meta, caches))


def test_arch_and_resolution():
    """The registry: Mistral4ForCausalLM, and Mistral 3 by its text model's kind; the arch
    read from transformers' config (its rotated part of head_dim, mscale, query scale)."""
    hf = make()
    assert ModelRegistry.resolve_model_cls(hf.config)[0] is Mistral4ForCausalLM
    mm = transformers.Mistral3Config(text_config=fields(model_type="mistral4"))
    assert ModelRegistry.resolve_model_cls(mm) == (
        Mistral3MLAForConditionalGeneration,
        "Mistral3ForConditionalGeneration",
    )
    assert ModelRegistry.resolve_model_cls(transformers.Mistral3Config())[0] is (
        Mistral3ForConditionalGeneration
    )
    a = DeepseekV2Arch.from_hf(hf.config)
    assert hf.config.rope_parameters["partial_rotary_factor"] == 0.25
    assert a.rope_parameters["partial_rotary_factor"] == 1.0 and a.rope_interleave
    assert (a.num_kv_heads, a.head_dim, a.latent_value_size) == (1, 64, 56)
    assert (a.query_scale_beta, a.query_scale_original) == (0.4, ORIGINAL)
    assert a.sparse_layers == (1, 2) and (a.num_groups, a.topk_groups) == (4, 2)
    assert not a.router_fp32 and a.norm_topk_prob and a.routed_scaling_factor == 1.5
    assert hf.model.layers[0].self_attn.scaling == pytest.approx(a.softmax_scale, rel=1e-12)
    assert a.softmax_scale > 32**-0.5 * 1.4  # mscale(8, 1) ** 2 = 1.46
    scale = llama4_query_scale(torch.tensor([0, 15, 16, 47, 48, 99]), 0.4, ORIGINAL)
    want = 1 + 0.4 * torch.log(torch.tensor([1.0, 1, 2, 3, 4, 7]))
    assert torch.allclose(scale, want)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_logits_equal_transformers(name, tmp_path):
    hf = make(**VARIANTS[name])
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    assert type(runner.model) is Mistral4ForCausalLM
    first_sparse = VARIANTS[name].get("first_k_dense_replace", 1)
    assert [layer.mlp.__class__.__name__ for layer in runner.model.layers] == [
        "DeepseekMoE" if i >= first_sparse else "DenseMLP" for i in range(3)
    ]
    ours, ref = runner_logits(runner, IDS), hf_logits(hf)
    assert runner.kv_caches[0].shape == (1, 9, 16, 1, 64)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_bfloat16_logits_near_transformers(tmp_path):
    hf = make()
    hf.save_pretrained(tmp_path)
    config = ModelConfig(model=str(tmp_path), max_model_len=128, dtype="bfloat16")
    runner = load_cpu_runner(config)
    ours = runner_logits(runner, IDS)
    ref = hf_logits(
        transformers.Mistral4ForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    )
    fp32 = hf_logits(hf)
    # bf16 rounding (a token whose rounding flips a close routing choice moves more)
    assert (ours - ref).abs().mean() <= 0.05 * ref.abs().mean()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.9
    assert (ours - fp32).abs().mean() <= 0.05 * fp32.abs().mean()


def test_query_scale_applies_past_the_original_length():
    """Without the query scale, the logits of the first 16 positions (scale 1 there) still
    equal transformers', every later position's differ: the scale is by position, and
    positions past original_max_position_embeddings take it."""
    hf = make()
    arch = DeepseekV2Arch.from_hf(hf.config)
    ref = hf_logits(hf)
    assert torch.allclose(our_logits(arch, hf), ref, atol=1e-4)
    ours = our_logits(dataclasses.replace(arch, query_scale_beta=0.0), hf)
    assert torch.allclose(ours[:ORIGINAL], ref[:ORIGINAL], atol=1e-4)
    gaps = (ours[ORIGINAL:] - ref[ORIGINAL:]).abs().amax(-1)
    assert gaps.min() > 1e-3, gaps.min()


@pytest.mark.parametrize(
    "change", ["group_max", "routed_scaling_factor", "softmax_scale", "rope_interleave"]
)
def test_each_arch_field_is_live(change):
    """Changing one field of our arch moves the logits away from transformers': the groups
    ranked by their best expert (DeepSeek-V2's) instead of their two best, the routing
    unscaled, the softmax scale without yarn's mscale, the Neox rotation."""
    hf = make()
    arch = DeepseekV2Arch.from_hf(hf.config)
    value = {"group_max": {"topk_method": "group_limited_greedy"},
             "routed_scaling_factor": {"routed_scaling_factor": 1.0},
             "softmax_scale": {"softmax_scale": arch.qk_head_dim**-0.5},
             "rope_interleave": {"rope_interleave": False}}[change]  # fmt: skip
    assert (our_logits(dataclasses.replace(arch, **value), hf) - hf_logits(hf)).abs().max() > 1e-3


def test_router_equals_transformers():
    """Our routing against transformers' Mistral4TopkRouter on random tokens (the experts
    chosen and their weights), and a case its group rank decides: 4 experts in 2 groups,
    probabilities (0.4, 0.05 | 0.25, 0.3): group 1's two best sum 0.55 > 0.45, so with
    one group kept the experts are 3 and 2, though group 0 holds the best expert (which
    DeepSeek-V2's rank by the best expert would keep)."""
    from transformers.models.mistral4.modeling_mistral4 import Mistral4TopkRouter

    router = Mistral4TopkRouter(transformers.Mistral4Config(**fields(num_experts_per_tok=3)))
    torch.nn.init.normal_(router.weight, std=1.0)
    x = torch.randn(200, 64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, ref_weights, ref_ids = router(x)
    weights, ids = select_experts_grouped(logits, None, 3, 4, 2, True, 1.5, scoring="softmax")
    order, ref_order = ids.argsort(-1), ref_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order), ref_weights.gather(1, ref_order), atol=1e-6)
    probs = torch.tensor([[0.4, 0.05, 0.25, 0.3]])
    weights, ids = select_experts_grouped(probs.log(), None, 2, 2, 1, False, 2.0, "softmax")
    assert ids.tolist() == [[3, 2]] and torch.allclose(weights, torch.tensor([[0.6, 0.5]]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(num_key_value_heads=2), "num_key_value_heads 2"),
        (dict(rope_parameters={**ROPE, "llama_4_scaling_beta": None}), "llama_4_scaling_beta"),
        (dict(n_group=3), "n_group 3"),
        (dict(n_group=8, topk_group=1), "n_group 8"),  # groups of one expert
        (dict(num_experts_per_tok=5), "num_experts_per_tok 5"),  # 2 groups of 2 kept
        (dict(rope_parameters={**ROPE, "partial_rotary_factor": 0.5}), "rotates 16 dims"),
        (dict(rope_parameters={**ROPE, "rope_type": "default"}), "rotates 32 dims"),
        (dict(hidden_act="gelu"), "hidden_act"),
        (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    ],
)
def test_unsupported_configs_are_refused(overrides, message):
    config = transformers.Mistral4Config(**fields(**overrides))
    with pytest.raises(ValueError, match=message):
        DeepseekV2Arch.from_hf(config)


def test_engine_greedy_tokens_equal_transformers_generate(tmp_path):
    """Chunked prefill (16-token chunks), batched decodes and a prefix hit through the
    latent cache, every prompt past the original length (43 to 70 tokens): the decode
    steps' queries scaled too."""
    hf = make(vocab_size=49152, max_position_embeddings=256)
    hf.save_pretrained(tmp_path)
    check_engine_greedy_matches(hf, tmp_path)


# -- Mistral Small 4's multimodal model: Mistral 3 over Mistral 4 ---------------------------
TEXT4 = fields(model_type="mistral4", num_hidden_layers=2, head_dim=32)


def test_image_prompt_logits_equal_transformers(tmp_path):
    """Text, two images of different sizes as transformers' processor expands them, text:
    through the checkpoint as transformers saves it (the Hub's ``language_model.model.``
    names, experts stacked), every position's logits equal transformers', and the images
    move them; text alone too."""
    hf = make_hf(text=TEXT4)
    assert hf.config.text_config.model_type == "mistral4"
    save_with_processor(hf, tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    model = runner.model
    assert type(model) is Mistral3MLAForConditionalGeneration
    assert isinstance(model.arch, Mistral3MLAArch) and model.arch.query_scale_beta == 0.4
    assert model.supports_images and model.image_layout == "rows" and model.images_at_own_size
    ids = image_prompt()
    assert len(ids) > 2 * ORIGINAL
    images = pixels()
    px, sizes = padded(images)
    ours = image_prompt_logits(runner, ids, images)
    check_image_logits(runner, hf, ids, ours, pixel_values=px, image_sizes=sizes)
    text = IDS[IDS != IMAGE][:60]
    with torch.inference_mode():
        ref = hf(input_ids=text[None]).logits[0].float()
    assert torch.allclose(runner_logits(runner, text), ref, atol=1e-4)


def test_multimodal_in_memory_names_and_refusals():
    """transformers 5's in-memory names (``model.language_model.``, ``lm_head``) load
    too: the images' rows equal transformers'; a text model of another kind is refused."""
    hf = make_hf(text=TEXT4)
    model = Mistral3MLAForConditionalGeneration(
        Mistral3MLAForConditionalGeneration.arch_from_hf(hf.config)
    )
    model.load_weights(hf.state_dict())
    images = pixels()
    px, sizes = padded(images)
    with torch.inference_mode():
        ref = torch.cat(hf.model.get_image_features(px, sizes).pooler_output)
    ours = torch.cat(model.embed_images(images))
    assert torch.allclose(ours, ref, atol=1e-5), (ours - ref).abs().max()
    with pytest.raises(ValueError, match="mistral4"):
        Mistral3MLAArch.from_hf(transformers.Mistral3Config())
    with pytest.raises(ValueError, match="Mistral 4's"):  # the Llama class's refusal
        Mistral3ForConditionalGeneration.arch_from_hf(hf.config)


def test_engine_images_greedy_tokens_equal_transformers(tmp_path):
    """Through the engine (the front end's Mistral 3 "rows" layout, the image processor,
    prefill chunks of 5, the prefix cache): a prompt with two images of different sizes
    gives transformers' greedy tokens and logprobs; other images change them."""
    from tests.multimodal.test_mistral3_engine import MARKERS, PROMPT, image, reference
    from tests.multimodal.utils import check_engine_images
    from tests.utils import copy_benchmark_tokenizer

    copy_benchmark_tokenizer(tmp_path, chat_template=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tokenizer.add_special_tokens({"additional_special_tokens": MARKERS})
    tokenizer.save_pretrained(tmp_path)
    image_id = tokenizer.convert_tokens_to_ids("[IMG]")
    hf = make_hf(text={**TEXT4, "vocab_size": len(tokenizer)}, image_token_index=image_id)
    with torch.no_grad():  # so that the images move the logprobs
        hf.model.multi_modal_projector.linear_2.weight.mul_(20)
    save_with_processor(hf, tmp_path)
    processor = transformers.AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    model = (tmp_path, hf, tokenizer, processor)
    images = [image(0, (30, 50)), image(1, (50, 20))]
    other = [image(2, (30, 50)), image(3, (50, 20))]
    ids, *want = reference(model, images)
    assert len(ids) > ORIGINAL
    request = {"prompt": PROMPT, "multi_modal_data": {"image": images}}
    check_engine_images(tmp_path, request, other, ids, want, reference(model, other)[1:])


# -- the CUDA paths' contracts, on the CPU ---------------------------------------------------
def test_replayed_decode_steps_scale_their_queries(monkeypatch, tmp_path):
    """tests/v1/attention/test_triton_mla.py's flow for DeepSeek: TRITON_MLA (its kernels
    emulated), a prompt whole and in chunks, then decode steps replayed from stand-in CUDA
    graphs at positions 60 to 99 (scale 1 + 0.4 log 4 to log 7): the logits equal
    transformers'."""
    from tests.v1.attention.test_triton_mla import (
        chunked_logits,
        emulated_kernel,
        emulated_prefill_kernel,
        replayed_logits,
    )
    from tests.v1.worker.test_cuda_graph import ReplayingGraph
    from vllm.v1.attention.backends import triton_mla_decode, triton_mla_prefill
    from vllm.v1.attention.backends.triton_mla import TritonMLABackend

    monkeypatch.setattr(triton_mla_decode, "mla_decode_attention", emulated_kernel([]))
    monkeypatch.setattr(triton_mla_prefill, "mla_prefill_attention", emulated_prefill_kernel([]))
    hf = make()
    hf.save_pretrained(tmp_path)
    runner = load_cpu_runner(ModelConfig(model=str(tmp_path), max_model_len=128))
    a = runner.arch
    runner.attn_backend = TritonMLABackend(
        a.num_heads, 1, a.head_dim, runner.dtype, "cpu", 16, value_size=a.latent_value_size
    )
    runner.attn_backend.prefill_kernel = True  # as on CUDA
    runner.install_attention_backend()
    ref = hf_logits(hf)
    ours = runner_logits(runner, IDS)
    chunked = chunked_logits(runner, IDS, [30, 33, 37])
    runner.capture_model(graph_factory=ReplayingGraph)
    decoded = replayed_logits(runner, IDS, 60)
    for got, want in ((ours, ref), (chunked, ref), (decoded, ref[60:])):
        assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_a_decode_step_reads_nothing_back_to_the_host(monkeypatch):
    """What a CUDA graph needs of the forward: a dense Mistral 4's decode step over
    TRITON_MLA with its query scale (positions past ``original_max_position_embeddings``),
    and the softmax group routing, read nothing back to the host
    (tests/v1/attention/test_triton_mla.py's ``decode_step_without_host_reads``)."""
    from tests.v1.attention.test_triton_mla import decode_step_without_host_reads

    arch = DeepseekV2Arch.from_hf(transformers.Mistral4Config(**fields(first_k_dense_replace=3)))
    assert not arch.sparse_layers and arch.query_scale_beta
    logits = torch.randn(4, 8)
    decode_step_without_host_reads(
        monkeypatch, Mistral4ForCausalLM, arch, [5, 40, 9, 100],
        also=lambda: select_experts_grouped(logits, None, 2, 4, 2, True, 1.5, scoring="softmax"),
    )  # fmt: skip
