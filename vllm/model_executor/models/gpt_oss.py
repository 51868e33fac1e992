"""gpt-oss (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b) over a flat packed batch.

The Llama layer (``llama.py``) with a mixture of experts in every layer (``moe.py``'s
shape) and gpt-oss's own parts, as transformers computes them:

- attention with q/k/v/o biases, every other layer over a 128-token sliding window, yarn
  rotary scaling, and a learned **sink** per head: a logit that joins each row's softmax
  and is dropped after it, so a row may attend to almost nothing (the ``sinks`` attention
  feature; the torch backend computes it);
- a router with a bias, each token to its top-k experts with the softmax of their logits;
- experts with biases and a clamped SwiGLU (``fused_moe.Activation("swigluoai")``), their
  checkpoint interleaving gate and up columns (de-interleaved here into our [gate; up]).

The released checkpoints hold the experts in MXFP4 (``*_blocks``: two 4-bit E2M1 values a
byte, low nibble first; ``*_scales``: one E8M0 exponent per 32 values). On CUDA with
triton (``VLLM_MXFP4_MOE=auto``) they stay so on the device, only their gate/up rows
de-interleaved, and ``FusedMoE`` runs them with the Triton MXFP4 kernel (the 120B model's
experts: ~61 GB instead of ~234 GB in bf16); elsewhere, or for a checkpoint whose experts
are not MXFP4, they are expanded to the model's dtype as they load (``dequantize_mxfp4``).
The OpenAI "harmony" response format (reasoning and tool calls in channels) is the chat
template's; parsing it out of the output is not built yet.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm import envs
from vllm.model_executor.layers import triton_mxfp4_moe
from vllm.model_executor.layers.fused_moe import Activation, FusedMoE
from vllm.model_executor.models.llama import LlamaArch, attention_features
from vllm.model_executor.models.moe import MoeArch, MoeForCausalLM

# E2M1: the 16 values a 4-bit code stands for (sign bit high).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
# --load-format dummy's packed experts: random codes times 2^-13, so |w| <= 6 * 2^-13, under
# the loader's dense dummy bound (1e-3).
DUMMY_MXFP4_SCALE = 127 - 13

logger = logging.getLogger(__name__)


def keep_mxfp4_packed() -> bool:
    """Whether gpt-oss's MXFP4 experts are built packed: ``VLLM_MXFP4_MOE=auto`` with
    triton and a CUDA device. The model is built on the meta device, before its device is
    known; ``init_buffers`` expands them if it lands elsewhere."""
    return (
        envs.VLLM_MXFP4_MOE == "auto"
        and triton_mxfp4_moe.triton is not None
        and torch.cuda.is_available()
    )


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """MXFP4 ``blocks (..., groups, 16)`` uint8 and ``scales (..., groups)`` uint8 (biased
    by 127) -> ``(..., groups * 32)`` in ``dtype``: byte ``j`` of a group holds values
    ``2j`` (low nibble) and ``2j + 1`` (high), each times ``2 ** (scale - 127)``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(
            f"MXFP4 blocks and scales must be uint8, got {blocks.dtype}, {scales.dtype}"
        )
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)}"
        )
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    low, high = lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # (..., groups, 32)
    values = torch.ldexp(values, (scales.int() - 127).unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)


def deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """gpt-oss's [g0, u0, g1, u1, ...] along ``dim`` -> our [g0, g1, ...; u0, u1, ...]."""
    t = t.movedim(dim, 0)
    return torch.cat((t[0::2], t[1::2])).movedim(0, dim)


@dataclass(frozen=True)
class GptOssArch(MoeArch):
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0

    @classmethod
    def from_hf(cls, config) -> GptOssArch:
        base = LlamaArch.from_hf(config)
        return cls(
            **base.__dict__,
            num_experts=config.num_local_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            moe_intermediate_size=config.intermediate_size,
            norm_topk_prob=True,  # the softmax of the chosen experts' logits
            sparse_layers=tuple(range(base.num_layers)),
            swiglu_alpha=getattr(config, "swiglu_alpha", 1.702),
            swiglu_limit=getattr(config, "swiglu_limit", 7.0),
        )


class GptOssMoeBlock(nn.Module):
    """``(num_tokens, hidden) -> (num_tokens, hidden)``: the router (with its bias) and the
    experts (with theirs, through the clamped SwiGLU)."""

    def __init__(self, a: GptOssArch) -> None:
        super().__init__()
        self.router = nn.Linear(a.hidden_size, a.num_experts, bias=True)
        self.experts = FusedMoE(
            a.num_experts,
            a.num_experts_per_tok,
            a.hidden_size,
            a.moe_intermediate_size,
            renormalize=True,
            activation=Activation("swigluoai", a.swiglu_alpha, a.swiglu_limit),
            has_bias=True,
            # MXFP4 rows are whole groups of 32: other sizes cannot come packed
            mxfp4=keep_mxfp4_packed() and a.hidden_size % 32 == a.moe_intermediate_size % 32 == 0,
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))


class GptOssForCausalLM(MoeForCausalLM):
    def __init__(self, arch: GptOssArch) -> None:
        super().__init__(arch)
        for layer in self.layers:  # each head's sink logit
            layer.sinks = nn.Parameter(torch.zeros(arch.num_heads))

    @staticmethod
    def arch_from_hf(hf_config: Any) -> GptOssArch:
        return GptOssArch.from_hf(hf_config)

    def make_mlp(self, layer: int) -> nn.Module:
        return GptOssMoeBlock(self.arch)

    @property
    def attention_features(self) -> frozenset[str]:
        return attention_features(self.arch.sliding_windows) | {"sinks"}

    def layer_attention_features(self, layer: nn.Module) -> dict[str, Any]:
        return {"sinks": layer.sinks}

    def init_buffers(self) -> None:
        """Also the packed experts (``keep_mxfp4_packed``): expanded to empty ``w13`` /
        ``w2`` off CUDA, else given random codes (``--load-format dummy`` serves them; a
        checkpoint's load overwrites them)."""
        super().init_buffers()
        weight = self.embed_tokens.weight
        packed = 0
        for layer in self.layers:
            experts = layer.mlp.experts
            if not experts.mxfp4:
                continue
            if triton_mxfp4_moe.triton_unavailable_reason(weight.device) is not None:
                experts.use_dense_weights(weight.dtype)
                continue
            for name in ("w13", "w2"):
                getattr(experts, name + "_blocks").random_(0, 256)
                getattr(experts, name + "_scales").fill_(DUMMY_MXFP4_SCALE)
                packed += sum(b.nbytes for n, b in experts.named_buffers() if n.startswith(name))
        if packed:
            logger.info(
                "gpt-oss experts kept in MXFP4 on %s: %.2f GiB (VLLM_MXFP4_MOE=dequantize "
                "expands them)", weight.device, packed / 2**30,
            )  # fmt: skip

    def load_weights(self, sd: dict[str, torch.Tensor]) -> None:
        super().load_weights(sd)
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        with torch.no_grad():
            for i, layer in enumerate(self.layers):
                layer.sinks.copy_(sd[f"layers.{i}.self_attn.sinks"])

    def load_mlp(self, mlp: nn.Module, sd: dict[str, torch.Tensor], prefix: str) -> None:
        p = f"{prefix}mlp."
        mlp.router.weight.copy_(sd[p + "router.weight"])
        mlp.router.bias.copy_(sd[p + "router.bias"])
        e = p + "experts."
        experts = mlp.experts
        packed = e + "gate_up_proj_blocks" in sd  # MXFP4: (E, 2I, H) and (E, H, I) rows
        if experts.mxfp4 and not packed:
            experts.use_dense_weights(experts.w13_bias.dtype)
        if experts.mxfp4:  # kept packed; only the gate/up rows de-interleaved
            for ours, theirs in (("w13", "gate_up_proj"), ("w2", "down_proj")):
                for part in ("blocks", "scales"):
                    t = sd[f"{e}{theirs}_{part}"]
                    getattr(experts, f"{ours}_{part}").copy_(
                        deinterleave(t, 1) if ours == "w13" else t
                    )
        else:
            if packed:
                gate_up = dequantize_mxfp4(
                    sd[e + "gate_up_proj_blocks"], sd[e + "gate_up_proj_scales"]
                )
                down = dequantize_mxfp4(sd[e + "down_proj_blocks"], sd[e + "down_proj_scales"])
            else:  # transformers' layout: (E, H, 2I) and (E, I, H)
                gate_up = sd[e + "gate_up_proj"].transpose(1, 2)
                down = sd[e + "down_proj"].transpose(1, 2)
            experts.w13.copy_(deinterleave(gate_up, 1))
            experts.w2.copy_(down)
        experts.w13_bias.copy_(deinterleave(sd[e + "gate_up_proj_bias"], 1))
        experts.w2_bias.copy_(sd[e + "down_proj_bias"])
