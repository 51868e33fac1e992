"""Tiny FP8 checkpoints in the three formats ``fp8_checkpoint.py`` reads, written from a
transformers model's saved weights, and the same model with the dequantized weights (the
reference). The quantization here is written independently of the package's."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
BLOCK = (64, 64)  # 96-wide weights end in a partial block

# Per scheme: the quantization_config written, the weight scale's name, its granularity
# ("block", "tensor", "row") and whether each layer gets a static input scale.
SCHEMES = {
    "fp8_block": ({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                   "weight_block_size": list(BLOCK)}, "weight_scale_inv", "block", False),
    "fp8_tensor_static": ({"quant_method": "fp8", "activation_scheme": "static",
                           "weight_block_size": None, "modules_to_not_convert": ["lm_head"]},
                          "weight_scale_inv", "tensor", True),
    "ct_channel_dynamic": (
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "quantization_status": "compressed", "ignore": ["lm_head"],
         "config_groups": {"group_0": {
             "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "channel",
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                   "symmetric": True, "dynamic": True}}}},
        "weight_scale", "row", False),
    "ct_tensor_static": (
        {"quant_method": "compressed-tensors", "format": "float-quantized",
         "quantization_status": "compressed", "ignore": ["lm_head"],
         "config_groups": {"group_0": {
             "targets": ["Linear"],
             "weights": {"num_bits": 8, "type": "float", "strategy": "tensor",
                         "symmetric": True, "dynamic": False},
             "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor",
                                   "symmetric": True, "dynamic": False}}}},
        "weight_scale", "tensor", True),
    "fbgemm": ({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0,
                "modules_to_not_convert": ["lm_head"]}, "weight_scale", "row", False),
}  # fmt: skip


def is_quantized(name: str, w: torch.Tensor) -> bool:
    """The tensors real FP8 checkpoints quantize: the decoder layers' linear weights, not
    the norms nor the MoE routers."""
    leaf = name.removesuffix(".weight").rpartition(".")[2]
    return (
        name.endswith(".weight")
        and ".layers." in name
        and w.dim() == 2
        and "norm" not in leaf
        and leaf not in ("gate", "shared_expert_gate")
    )


def quantize(
    w: torch.Tensor, granularity: str, block: tuple[int, int] = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 values, scale as the checkpoint stores it) with w ~ values * scale."""
    w = w.float()
    if granularity == "tensor":
        scale = (w.abs().amax() / 448).reshape(())
        return (w / scale).to(FP8), scale
    if granularity == "row":
        scale = w.abs().amax(dim=1, keepdim=True) / 448  # (out, 1)
        return (w / scale).to(FP8), scale
    b0, b1 = block
    rows, cols = math.ceil(w.shape[0] / b0), math.ceil(w.shape[1] / b1)
    scale = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=FP8)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1]
            scale[i, j] = blk.abs().amax() / 448
            q[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1] = (blk / scale[i, j]).to(FP8)
    return q, scale


def dequantize(
    q: torch.Tensor, scale: torch.Tensor, granularity: str, block: tuple[int, int] = BLOCK
) -> torch.Tensor:
    if granularity != "block":
        return q.float() * scale
    out = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows = slice(i * block[0], (i + 1) * block[0])
            cols = slice(j * block[1], (j + 1) * block[1])
            out[rows, cols] = q[rows, cols].float() * scale[i, j]
    return out


def write_fp8_checkpoint(
    hf: torch.nn.Module, path: Path, scheme: str, block: tuple[int, int] = BLOCK
) -> torch.nn.Module:
    """``hf``'s weights saved into ``path`` as an FP8 checkpoint of ``scheme`` (config.json
    with its quantization_config; ``block``: the blocks of a block-scaled one); returns
    transformers' model of the dequantized weights."""
    config, scale_name, granularity, static = SCHEMES[scheme]
    if granularity == "block":
        config = {**config, "weight_block_size": list(block)}
    path = Path(path)
    hf.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(5)
    stored, dense = {}, {}
    for name, w in state.items():
        if not is_quantized(name, w):
            stored[name] = dense[name] = w
            continue
        q, scale = quantize(w, granularity, block)
        prefix = name.removesuffix("weight")
        stored[name], stored[prefix + scale_name] = q, scale
        if static:  # per layer, so fused layers take the largest
            name_in = "activation_scale" if scheme.startswith("fp8") else "input_scale"
            stored[prefix + name_in] = (0.01 + 0.01 * torch.rand((), generator=g)).reshape(())
        dense[name] = dequantize(q, scale, granularity, block)
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    with open(path / "config.json") as f:
        saved = json.load(f)
    saved["quantization_config"] = config
    with open(path / "config.json", "w") as f:
        json.dump(saved, f)
    reference = path / "dequantized"
    hf.save_pretrained(reference)
    save_file(dense, reference / "model.safetensors", metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
