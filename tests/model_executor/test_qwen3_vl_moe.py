"""Qwen3-VL-MoE (``models/qwen3_vl_moe.py``: Qwen3-VL with Qwen3-MoE's experts) against
transformers on a tiny random checkpoint of 4 experts, top-2, layer 1 of 3 dense
(``mlp_only_layers``): logits of a prompt holding two images (different grids) under the
interleaved M-RoPE and the deepstack, text logits, and the experts as transformers 5's
save_pretrained stacks them, as the Hub's checkpoints stack them (transposed) and one
tensor per expert. The router is made decisive, so that a wrong top-k, a missing
renormalisation or a misordered expert changes the logits."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from tests.model_executor.test_qwen2_vl import END, IMAGE, START, VIDEO, image_prompt
from tests.model_executor.test_qwen3_vl import (
    GRIDS,
    TEXT,
    VISION,
    image_prompt_logits,
    pixels,
    save,
)
from tests.tiny_models import load_cpu_runner, runner_logits
from vllm.config import ModelConfig
from vllm.model_executor.models.llama import QwenVLForConditionalGeneration
from vllm.model_executor.models.moe import SparseMoeBlock
from vllm.model_executor.models.qwen2_vl_vision import QWEN3_VL, qwen_vl_image_layout
from vllm.model_executor.models.qwen3_vl_moe import Qwen3VLMoeForConditionalGeneration
from vllm.model_executor.models.registry import ModelRegistry

EXPERTS, MOE_WIDTH = 4, 24  # 2 * 24 and 24 differ from the hidden 64: layouts tell apart
MOE_TEXT = dict(num_experts=EXPERTS, num_experts_per_tok=2, moe_intermediate_size=MOE_WIDTH,
                mlp_only_layers=[1])  # fmt: skip
EXPERTS_KEY = "model.language_model.layers.{}.mlp.experts.{}"


def make_config(**text):
    return transformers.Qwen3VLMoeConfig(
        text_config={**copy.deepcopy(TEXT), **MOE_TEXT, **text}, vision_config=VISION,
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END,
    )  # fmt: skip


def make_hf():
    """A random tiny model (torch seed 0), perturbed as test_qwen3_vl's (biases, norms,
    attention, deepstack), its router decisive and its experts as large as the dense MLP's
    weights, so that the routing shows in the logits."""
    torch.manual_seed(0)
    hf = transformers.Qwen3VLMoeForConditionalGeneration(make_config()).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(2.0, 3.0)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("attn.qkv.weight"):
                p.normal_(0.0, 0.5)
            elif "deepstack_merger_list" in name and name.endswith("linear_fc2.weight"):
                p.mul_(4)
            elif name.endswith("mlp.gate.weight"):  # the router
                p.normal_(0.0, 0.2)
            elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                p.normal_(0.0, 0.15)
    return hf


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(transformers' model, its saved folder)."""
    hf = make_hf()
    path = tmp_path_factory.mktemp("qwen3_vl_moe")
    save(hf, path)
    return hf, path


def load(path):
    return load_cpu_runner(ModelConfig(model=str(path), max_model_len=128))


def relaid(path, out, layout: str):
    """The checkpoint of ``path`` copied to ``out`` with its experts in ``layout``: "hub"
    (transformers 4's, as the Hub's Qwen3-VL-MoE checkpoints: gate_up_proj (E, H, 2I),
    down_proj (E, I, H)) or "per_expert" (``experts.N.gate_proj.weight`` ...)."""
    shutil.copytree(path, out)
    with safe_open(path / "model.safetensors", "pt") as f:
        sd = {k: f.get_tensor(k) for k in f.keys()}
    relaid = {}
    for key, tensor in sd.items():
        if not key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            relaid[key] = tensor
        elif layout == "hub":
            relaid[key] = tensor.transpose(1, 2).contiguous()
        elif key.endswith("gate_up_proj"):
            prefix = key.removesuffix("gate_up_proj")
            for e, (gate, up) in enumerate(zip(*tensor.chunk(2, dim=1), strict=True)):
                relaid[f"{prefix}{e}.gate_proj.weight"] = gate.clone()
                relaid[f"{prefix}{e}.up_proj.weight"] = up.clone()
        else:
            prefix = key.removesuffix("down_proj")
            for e, down in enumerate(tensor):
                relaid[f"{prefix}{e}.down_proj.weight"] = down.clone()
    save_file(relaid, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_arch_and_registry(checkpoint):
    """The arch from the config: layer 1 dense, the top-2 renormalised (the text config
    has no norm_topk_prob), the head untied (the top-level flag, not text_config's True),
    Qwen3-VL's tower and interleaved M-RoPE; the image layout from config.json's dict."""
    hf, path = checkpoint
    assert hf.config.text_config.tie_word_embeddings and not hf.config.tie_word_embeddings
    cls, _ = ModelRegistry.resolve_model_cls(hf.config)
    assert cls is Qwen3VLMoeForConditionalGeneration
    arch = cls.arch_from_hf(hf.config)
    assert arch.sparse_layers == (0, 2) and arch.num_experts == EXPERTS
    assert arch.num_experts_per_tok == 2 and arch.moe_intermediate_size == MOE_WIDTH
    assert arch.norm_topk_prob and not arch.tie_word_embeddings
    assert arch.mrope_interleaved and arch.mrope_section == (2, 3, 3)
    assert arch.vision.model_type == QWEN3_VL and arch.vision.deepstack_visual_indexes == (2, 0)
    every_second = cls.arch_from_hf(make_config(decoder_sparse_step=2, mlp_only_layers=[]))
    assert every_second.sparse_layers == (1,)
    config = json.loads((path / "config.json").read_text())
    assert cls.takes_images(config) and qwen_vl_image_layout(config) == (IMAGE, 2)
    assert qwen_vl_image_layout({"model_type": "qwen3_vl_moe"}) == (151655, 2)
    with pytest.raises(ValueError, match="qwen3_vl_moe_text"):  # the dense class refuses it
        QwenVLForConditionalGeneration.arch_from_hf(hf.config)


def test_image_prompt_logits_equal_transformers(checkpoint):
    """Text and two images of different grids, at transformers' ``get_rope_index``
    positions: every position's logits equal transformers'; with the top-2 weights not
    renormalised, with the top 1 or 3 experts, or with the experts' order reversed, they do
    not (by 0.29, 0.50, 0.29 and 0.95 at most, of logits up to 0.56)."""
    hf, path = checkpoint
    runner = load(path)
    model = runner.model
    assert type(model) is Qwen3VLMoeForConditionalGeneration
    assert model.supports_images and model.uses_mrope
    assert [type(layer.mlp) for layer in model.layers] == [
        SparseMoeBlock,
        type(None),
        SparseMoeBlock,
    ]
    ids = image_prompt(GRIDS)
    px, grid = pixels(GRIDS)
    types = (ids == IMAGE).int()[None]
    positions = hf.model.get_rope_index(ids[None], types, image_grid_thw=grid)[0][:, 0]
    with torch.inference_mode():
        ref = hf(input_ids=ids[None], pixel_values=px, image_grid_thw=grid,
                 mm_token_type_ids=types).logits[0].float()  # fmt: skip
    ours = image_prompt_logits(runner, ids, px, grid, positions)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()
    experts = [layer.mlp.experts for layer in model.layers if layer.mlp is not None]
    for field, value in (("renormalize", False), ("top_k", 1), ("top_k", 3)):
        kept = getattr(experts[0], field)
        for e in experts:
            setattr(e, field, value)
        wrong = image_prompt_logits(runner, ids, px, grid, positions)
        assert (wrong - ref).abs().max() > 0.1, (field, value)
        for e in experts:
            setattr(e, field, kept)
    with torch.no_grad():
        for e in experts:
            e.w13.copy_(e.w13.flip(0))
            e.w2.copy_(e.w2.flip(0))
    assert (image_prompt_logits(runner, ids, px, grid, positions) - ref).abs().max() > 0.1


@pytest.mark.parametrize("layout", ["saved", "hub", "per_expert"])
def test_each_expert_layout_loads(checkpoint, layout, tmp_path):
    """What save_pretrained writes (stacked, (E, 2I, H) and (E, H, I)), the Hub's transposed
    stacks (which transformers itself reads back to the same model) and one tensor per
    expert: text logits (plain 1-D positions) equal transformers'."""
    hf, path = checkpoint
    with safe_open(path / "model.safetensors", "pt") as f:
        shape = f.get_slice(EXPERTS_KEY.format(0, "gate_up_proj")).get_shape()
        assert shape == [EXPERTS, 2 * MOE_WIDTH, TEXT["hidden_size"]]
        assert EXPERTS_KEY.format(1, "gate_up_proj") not in f.keys()  # the dense layer
    if layout != "saved":
        path = relaid(path, tmp_path / layout, layout)
    ids = torch.randint(0, 190, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(input_ids=ids[None]).logits[0].float()
        if layout == "hub":
            reread = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(path)
            assert torch.allclose(reread(input_ids=ids[None]).logits[0], ref, atol=1e-5)
    ours = runner_logits(load(path), ids)
    assert torch.allclose(ours, ref, atol=1e-4), (ours - ref).abs().max()


def test_refuses_experts_of_another_shape(checkpoint, tmp_path):
    hf, path = checkpoint
    out = relaid(path, tmp_path / "hub", "hub")
    config = json.loads((out / "config.json").read_text())
    config["text_config"]["moe_intermediate_size"] = MOE_WIDTH // 2
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="gate_up_proj of shape"):
        load(out)
