"""Tiny integer-weight checkpoints (AWQ, GPTQ, compressed-tensors pack-quantized), written
from a transformers model's saved weights, and the same model with the dequantized weights
(the reference). Quantization and packing here are written independently of the package's,
from the formats' published conventions."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from safetensors.torch import load_file, save_file

from tests.tiny_models import TINY_LLAMA

FAMILIES = {
    "llama": ("LlamaForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(moe_intermediate_size=32, num_experts=8,
                                              num_experts_per_tok=2, norm_topk_prob=True)),
}  # fmt: skip
IDS = torch.randint(0, TINY_LLAMA["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))


def save_model(family: str, **overrides) -> torch.nn.Module:
    """A random tiny transformers model of ``family`` (torch seed 0)."""
    arch, fields = FAMILIES[family]
    config_cls = getattr(transformers, arch.replace("ForCausalLM", "Config"))
    torch.manual_seed(0)
    return getattr(transformers, arch)(config_cls(**{**TINY_LLAMA, **fields, **overrides})).eval()


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


def is_quantized(name: str, w: torch.Tensor) -> bool:
    """The tensors real checkpoints quantize: the decoder layers' linear weights, not the
    norms nor the MoE routers."""
    leaf = name.removesuffix(".weight").rpartition(".")[2]
    return (
        name.endswith(".weight")
        and ".layers." in name
        and w.dim() == 2
        and "norm" not in leaf
        and leaf not in ("gate", "shared_expert_gate")
    )


AWQ_INTERLEAVE = [0, 2, 4, 6, 1, 3, 5, 7]  # word nibble j holds output 8c + this[j]


def _ct(bits: int, strategy: str, group: int | None, symmetric: bool, actorder=None) -> dict:
    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group, "dynamic": False, "actorder": actorder,
               "observer": "minmax"}  # fmt: skip
    return {"quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None}}}  # fmt: skip


# Per scheme: the quantization_config, and how the values were made: (bits, group size (-1:
# one group), asymmetric, act-order (a random g_idx)).
SCHEMES = {
    "awq_g32": ({"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                 "version": "gemm", "modules_to_not_convert": None}, (4, 32, True, False)),
    "gptq4_sym_g32": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True,
                       "desc_act": False, "damp_percent": 0.01, "static_groups": False,
                       "true_sequential": True, "model_name_or_path": None,
                       "model_file_base_name": "model"}, (4, 32, False, False)),
    "gptq4_asym_act_order": ({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False,
                              "desc_act": True, "checkpoint_format": "gptq"},
                             (4, 32, True, True)),
    "gptq8_channel_v2": ({"quant_method": "gptq", "bits": 8, "group_size": -1, "sym": False,
                          "desc_act": False, "checkpoint_format": "gptq_v2"},
                         (8, -1, True, False)),
    "ct_w4_g64_sym": (_ct(4, "group", 64, True), (4, 64, False, False)),  # 96 = 64 + 32
    "ct_w4_channel_asym": (_ct(4, "channel", None, False), (4, -1, True, False)),
    "ct_w8_g32_act_order": (_ct(8, "group", 32, True, "group"), (8, 32, False, True)),
}  # fmt: skip


def quantize(w: torch.Tensor, bits: int, group: int, asym: bool, g_idx: torch.Tensor):
    """(q (out, in) unsigned, zeros (out, groups), fp16 scales (out, groups)) with
    ``w ~ (q - zeros[:, g_idx]) * scales[:, g_idx]``."""
    top = (1 << bits) - 1
    groups = int(g_idx.max()) + 1
    out = w.shape[0]
    scales = torch.empty(out, groups, dtype=torch.float16)
    zeros = torch.empty(out, groups, dtype=torch.int64)
    for g in range(groups):
        cols = w[:, g_idx == g].float()
        if asym:
            lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
            s = ((hi - lo) / top).clamp(min=1e-6).half()
            # Zero 0 is kept out: GPTQ v1 cannot store it (stored zero - 1 would wrap).
            zeros[:, g] = (-lo / s.float()).round().clamp(1, top).long()
        else:
            s = (cols.abs().amax(1) / (top // 2)).clamp(min=1e-6).half()
            zeros[:, g] = 1 << (bits - 1)
        scales[:, g] = s
    z, s = zeros[:, g_idx], scales[:, g_idx].float()
    q = (w.float() / s).round().add(z).clamp(0, top).long()
    return q, zeros, scales


def pack(values: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unsigned ``values`` packed into int32 words along ``dim``, the first value lowest
    (padded with zeros to whole words)."""
    v = values.long().movedim(dim, -1).numpy().astype(np.uint64)
    per = 32 // bits
    pad = -v.shape[-1] % per
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
    v = v.reshape(*v.shape[:-1], -1, per)
    words = np.zeros(v.shape[:-1], dtype=np.uint64)
    for j in range(per):
        words |= v[..., j] << np.uint64(bits * j)
    words = torch.from_numpy(words.astype(np.uint32).view(np.int32))
    return words.movedim(-1, dim).contiguous()


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """(rows, out) 4-bit values -> (rows, out/8) words in AWQ's interleaved order."""
    rows, cols = values.shape
    order = torch.tensor(AWQ_INTERLEAVE)
    shuffled = values.reshape(rows, cols // 8, 8)[:, :, order].reshape(rows, cols)
    return pack(shuffled, 4, 1)


def store(method: str, cfg: dict, q, zeros, scales, g_idx) -> dict[str, torch.Tensor]:
    """The tensors (by leaf name) a checkpoint of ``method`` stores for one weight."""
    bits = cfg.get("bits") or cfg["config_groups"]["group_0"]["weights"]["num_bits"]
    if method == "awq":
        return {"qweight": awq_pack(q.t()), "qzeros": awq_pack(zeros.t()),
                "scales": scales.t().contiguous()}  # fmt: skip
    if method == "gptq":
        v1 = int(cfg.get("checkpoint_format", "gptq") == "gptq")
        return {"qweight": pack(q.t(), bits, 0), "qzeros": pack(zeros.t() - v1, bits, 1),
                "scales": scales.t().contiguous(), "g_idx": g_idx.int()}  # fmt: skip
    offset = 1 << (bits - 1)  # compressed-tensors stores signed values plus this offset
    out = {"weight_packed": pack(q, bits, 1), "weight_scale": scales,
           "weight_shape": torch.tensor(list(q.shape))}  # fmt: skip
    weights = cfg["config_groups"]["group_0"]["weights"]
    if not weights["symmetric"]:
        out["weight_zero_point"] = pack(zeros, bits, 0)
    else:
        assert bool((zeros == offset).all())
    if weights.get("actorder") == "group":
        out["weight_g_idx"] = g_idx.int()
    return out


def make_g_idx(n_in: int, group: int, act_order: bool, gen: torch.Generator) -> torch.Tensor:
    size = n_in if group == -1 else group
    if not act_order:
        return torch.arange(n_in) // size
    g_idx = torch.empty(n_in, dtype=torch.long)
    g_idx[torch.randperm(n_in, generator=gen)] = torch.arange(n_in) // size
    return g_idx


SAME_INPUT = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up",
              "up_proj": "gate_up"}  # fmt: skip


def write_wna16_checkpoint(hf: torch.nn.Module, path: Path, scheme: str) -> torch.nn.Module:
    """``hf``'s weights saved into ``path`` as a checkpoint of ``scheme`` (config.json with
    its quantization_config); returns transformers' model of the dequantized weights."""
    cfg, (bits, group, asym, act_order) = SCHEMES[scheme]
    method = cfg["quant_method"]
    path = Path(path)
    hf.save_pretrained(path)
    state = load_file(path / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    stored, dense, orders = {}, {}, {}
    for name, w in state.items():
        if not is_quantized(name, w):
            stored[name] = dense[name] = w
            continue
        # Layers reading the same input (q/k/v, gate/up) share GPTQ's act-order, as real
        # checkpoints do: it sorts the inputs by their Hessian's diagonal.
        module, _, leaf = name.removesuffix(".weight").rpartition(".")
        key = (module, SAME_INPUT.get(leaf, leaf))
        if key not in orders:
            orders[key] = make_g_idx(w.shape[1], group, act_order, gen)
        g_idx = orders[key]
        q, zeros, scales = quantize(w, bits, group, asym, g_idx)
        prefix = name.removesuffix("weight")
        for leaf, t in store(method, cfg, q, zeros, scales, g_idx).items():
            stored[prefix + leaf] = t
        dense[name] = (q - zeros[:, g_idx]).float() * scales[:, g_idx].float()
    save_file(stored, path / "model.safetensors", metadata={"format": "pt"})
    with open(path / "config.json") as f:
        saved = json.load(f)
    saved["quantization_config"] = cfg
    with open(path / "config.json", "w") as f:
        json.dump(saved, f)
    reference = path / "dequantized"
    hf.save_pretrained(reference)
    save_file(dense, reference / "model.safetensors", metadata={"format": "pt"})
    return transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
