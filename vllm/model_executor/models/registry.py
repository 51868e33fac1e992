"""Which model class runs a checkpoint: the HF config's ``architectures`` -> our class.

As vLLM's ``ModelRegistry``: an entry names a module of ``vllm.model_executor.models`` and
a class in it, imported on first use, so a model family is one file plus one line per HF
architecture here (or a ``ModelRegistry.register_model`` call from a plugin or a test). A
config that lists no ``architectures`` is looked up by its ``model_type``. A multimodal
architecture whose language models differ in kind has a class per kind of language model,
chosen by its ``text_config``'s ``model_type`` (``_BY_TEXT_MODEL``: Mistral 3 over Mistral
4's latent attention).

What the runner and the loader need from a model class (``llama.py`` is the example):

- ``arch_from_hf(hf_config)`` (static): the shapes, with at least ``num_layers``,
  ``num_heads``, ``num_kv_heads``, ``head_dim`` and ``vocab_size`` (the KV cache and the
  attention backend are sized from them); the instance keeps it as ``model.arch``;
- ``cls(arch)`` builds on the meta device (the loader casts it there to the target dtype,
  then allocates it on the device); ``load_weights(state_dict)`` then fills every
  parameter and buffer from the HF checkpoint's tensors (CPU, any dtype: ``copy_`` casts),
  making any buffer it computes in the parameters' dtype; ``init_buffers()`` makes those
  computed buffers and ties shared weights alone (``--load-format dummy`` calls it, then
  fills every parameter with random values);
- ``set_attention_backend(backend)``; ``forward(input_ids, positions, meta, kv_caches)``
  -> ``(num_tokens, hidden)``; ``compute_logits(hidden)`` -> fp32 ``(rows, vocab)``;
- optionally ``check_dtype(hf_config, dtype)`` (static): ``ValueError`` before loading for
  a dtype the family cannot run in (Gemma 2/3 in float16);
- optionally ``attention_features`` (``AttentionBackend.supported_features`` its layers
  pass to ``forward``, e.g. a sliding window): the selector installs a backend with them;
- optionally ``gguf_layout`` (``layers/quantization/gguf.py``'s ``GGUFLayout``): where
  its linear layers are in a llama.cpp GGUF, for ``--quantization gguf``.
- optionally ``supports_images = True`` (``llava.py``): ``embed_images(pixel_values)``
  -> each image's placeholder rows, ``embed_input_ids(input_ids)`` -> the token embeddings,
  and ``forward(..., inputs_embeds=...)`` reading those rows in place of the embeddings.
"""

from __future__ import annotations

import importlib
from typing import Any

_PACKAGE = "vllm.model_executor.models"

# HF architecture: (HF model_type, module under vllm.model_executor.models, class).
# Mistral, Ministral, Qwen2, Qwen3, SmolLM3, OLMo 2/3, Seed-OSS, Phi-3, GLM-4 and ERNIE 4.5
# share the Llama implementation (Qwen2's q/k/v biases, Qwen3's and OLMo's q/k norms,
# OLMo's post-norms, SmolLM3's unrotated layers, GLM-4's sandwich norms and GLM-4's and
# ERNIE's GPT-J-style rotation are flags of its LlamaArch; Phi-3's class reads fused
# checkpoints); the mixtures of experts (ERNIE-4.5-MoE's softmax routing with a correction
# bias among them) add their experts to it (moe.py). The Gemma
# family has its own (gemma.py: scaled embeddings, 1 + weight norms, sandwich norms, soft
# caps, two rotations), and DeepSeek-V2/V3 theirs (deepseek_v2.py: latent attention
# cached as one latent head, DeepSeek's routings). LLaVA (llava.py) is the Llama language
# model with a CLIP vision tower (clip.py) and a projector: it takes images. Idefics3 and
# SmolVLM (idefics3.py) are the Llama language model with a SigLIP-style encoder of image
# tiles (idefics3_vision.py) and a pixel-shuffle connector; InternVL3/3.5 (internvl.py) with
# InternViT (internvl_vision.py) and a pixel-shuffle projector; Mistral 3 (mistral3.py) with
# the Pixtral tower (pixtral_vision.py); Qwen2-VL, Qwen2.5-VL and Qwen3-VL the Qwen
# language model with their towers (qwen2_vl_vision.py, qwen3_vl_vision.py) and M-RoPE;
# Qwen3-VL-MoE (qwen3_vl_moe.py) Qwen3-VL's with Qwen3-MoE's experts. Mistral 4 is DeepSeek's
# latent attention with its own routing and query scale (deepseek_v2.py). Qwen3-Next and
# Qwen3.5 (qwen3_next.py) mix Gated DeltaNet linear-attention layers, whose states live in
# recurrent pools (layers/recurrent.py), with gated full attention; Qwen3.5's multimodal
# checkpoints take images through Qwen3-VL's tower without DeepStack (qwen3_vl_vision.py)
# and interleaved M-RoPE on the full-attention layers.
# Granite 4.0-H, Nemotron-H and Bamba (mamba_hybrid.py) mix Mamba2 layers (layers/mamba2.py),
# their states in those recurrent pools too, with attention; Falcon-H1 (falcon_h1.py) runs
# both side by side in every layer.
# LFM2 and LFM2-MoE (lfm2.py) mix gated short convolutions (states in those pools) with attention.
# Mamba, FalconMamba, Mamba2 (mamba.py: no attention) and Jamba (Mamba1 + attention + experts).
# Kimi-Linear (kimi_linear.py) mixes Kimi Delta Attention (layers/kda.py) with unrotated MLA.
# Kimi K2.5 (kimi_k25.py) is DeepSeek-V3's language model behind a MoonViT-style tower.
# Gemma 4 (gemma4.py) is Gemma 3's layer with per-layer inputs, shared KV, an MoE beside the MLP;
# its multimodal checkpoints take images through its own tower (gemma4_vision.py).
# DeepSeek-V3.2 and GLM-5 (deepseek_dsa.py) add DSA's lightning indexer and top-k to V3's MLA.
# GLM-4.7-Flash (deepseek_v2.py) is V3's MLA and routing, its MoE layers by mlp_layer_types.
# MiMo-V2-Flash (mimo_v2_flash.py): sliding (sinks) / full Llama attention, GLM-4.5's routing.
_MODELS: dict[str, tuple[str, str, str]] = {
    "LlamaForCausalLM": ("llama", "llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "llama", "LlamaForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "llama", "Phi3ForCausalLM"),
    "GraniteForCausalLM": ("granite", "llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("mixtral", "moe", "MoeForCausalLM"),
    "Qwen2MoeForCausalLM": ("qwen2_moe", "moe", "MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "moe", "MoeForCausalLM"),
    "OlmoeForCausalLM": ("olmoe", "moe", "MoeForCausalLM"),
    "GraniteMoeForCausalLM": ("granitemoe", "moe", "MoeForCausalLM"),
    "Glm4MoeForCausalLM": ("glm4_moe", "moe", "MoeForCausalLM"),
    "Glm4ForCausalLM": ("glm4", "llama", "LlamaForCausalLM"),
    "Ernie4_5ForCausalLM": ("ernie4_5", "llama", "LlamaForCausalLM"),
    "Ernie4_5_MoeForCausalLM": ("ernie4_5_moe", "moe", "MoeForCausalLM"),
    "MiniMaxM2ForCausalLM": ("minimax_m2", "moe", "MoeForCausalLM"),
    "MinistralForCausalLM": ("ministral", "llama", "LlamaForCausalLM"),
    "Mistral3ForConditionalGeneration": (
        "mistral3",
        "mistral3",
        "Mistral3ForConditionalGeneration",
    ),
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "llama", "QwenVLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": (
        "qwen2_5_vl",
        "llama",
        "QwenVLForConditionalGeneration",
    ),
    "Qwen3VLForConditionalGeneration": ("qwen3_vl", "llama", "QwenVLForConditionalGeneration"),
    "Qwen3VLMoeForConditionalGeneration": (
        "qwen3_vl_moe",
        "qwen3_vl_moe",
        "Qwen3VLMoeForConditionalGeneration",
    ),
    "LlavaForConditionalGeneration": ("llava", "llava", "LlavaForConditionalGeneration"),
    "Idefics3ForConditionalGeneration": (
        "idefics3",
        "idefics3",
        "Idefics3ForConditionalGeneration",
    ),
    "SmolVLMForConditionalGeneration": ("smolvlm", "idefics3", "Idefics3ForConditionalGeneration"),
    "InternVLForConditionalGeneration": (
        "internvl",
        "internvl",
        "InternVLForConditionalGeneration",
    ),
    "SmolLM3ForCausalLM": ("smollm3", "llama", "LlamaForCausalLM"),
    "Olmo2ForCausalLM": ("olmo2", "llama", "LlamaForCausalLM"),
    "Olmo3ForCausalLM": ("olmo3", "llama", "LlamaForCausalLM"),
    "Exaone4ForCausalLM": ("exaone4", "llama", "LlamaForCausalLM"),
    "SeedOssForCausalLM": ("seed_oss", "llama", "LlamaForCausalLM"),
    "GptOssForCausalLM": ("gpt_oss", "gpt_oss", "GptOssForCausalLM"),
    "MiMoV2FlashForCausalLM": ("mimo_v2_flash", "mimo_v2_flash", "MiMoV2FlashForCausalLM"),
    "DeepseekV2ForCausalLM": ("deepseek_v2", "deepseek_v2", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("deepseek_v3", "deepseek_v2", "DeepseekV3ForCausalLM"),
    "DeepseekV32ForCausalLM": ("deepseek_v32", "deepseek_dsa", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("glm_moe_dsa", "deepseek_dsa", "GlmMoeDsaForCausalLM"),
    "Glm4MoeLiteForCausalLM": ("glm4_moe_lite", "deepseek_v2", "Glm4MoeLiteForCausalLM"),
    "Mistral4ForCausalLM": ("mistral4", "deepseek_v2", "Mistral4ForCausalLM"),
    "CohereForCausalLM": ("cohere", "cohere", "CohereForCausalLM"),
    "Cohere2ForCausalLM": ("cohere2", "cohere", "CohereForCausalLM"),
    "GemmaForCausalLM": ("gemma", "gemma", "GemmaForCausalLM"),
    "Gemma2ForCausalLM": ("gemma2", "gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3_text", "gemma", "GemmaForCausalLM"),
    "Gemma3ForConditionalGeneration": ("gemma3", "gemma", "Gemma3ForConditionalGeneration"),
    "Gemma4ForCausalLM": ("gemma4_text", "gemma4", "Gemma4ForCausalLM"),
    "Gemma4ForConditionalGeneration": ("gemma4", "gemma4", "Gemma4ForConditionalGeneration"),
    "Qwen3NextForCausalLM": ("qwen3_next", "qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("qwen3_5_text", "qwen3_next", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("qwen3_5_moe_text", "qwen3_next", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": (
        "qwen3_5",
        "qwen3_next",
        "Qwen3_5ForConditionalGeneration",
    ),
    "Qwen3_5MoeForConditionalGeneration": (
        "qwen3_5_moe",
        "qwen3_next",
        "Qwen3_5MoeForConditionalGeneration",
    ),
    "GraniteMoeHybridForCausalLM": (
        "granitemoehybrid",
        "mamba_hybrid",
        "GraniteMoeHybridForCausalLM",
    ),
    "NemotronHForCausalLM": ("nemotron_h", "mamba_hybrid", "NemotronHForCausalLM"),
    "BambaForCausalLM": ("bamba", "mamba_hybrid", "BambaForCausalLM"),
    "FalconH1ForCausalLM": ("falcon_h1", "falcon_h1", "FalconH1ForCausalLM"),
    "MambaForCausalLM": ("mamba", "mamba", "MambaForCausalLM"),
    "FalconMambaForCausalLM": ("falcon_mamba", "mamba", "FalconMambaForCausalLM"),
    "Mamba2ForCausalLM": ("mamba2", "mamba", "Mamba2ForCausalLM"),
    "JambaForCausalLM": ("jamba", "mamba", "JambaForCausalLM"),
    "Lfm2ForCausalLM": ("lfm2", "lfm2", "Lfm2ForCausalLM"),
    "Lfm2MoeForCausalLM": ("lfm2_moe", "lfm2", "Lfm2MoeForCausalLM"),
    "KimiLinearForCausalLM": ("kimi_linear", "kimi_linear", "KimiLinearForCausalLM"),
    "KimiK25ForConditionalGeneration": ("kimi_k25", "kimi_k25", "KimiK25ForConditionalGeneration"),
    "Kimi_K25ForConditionalGeneration": (
        "kimi_k25",
        "kimi_k25",
        "KimiK25ForConditionalGeneration",
    ),
    # transformers' sequence classifiers (adapters.py): the causal model plus a score head,
    # served by the pooling runner (--runner auto picks it, --convert auto classify).
    **{
        f"{family}ForSequenceClassification": (model_type, "adapters", cls)
        for family, model_type, cls in (
            ("Llama", "llama", "LlamaForSequenceClassification"),
            ("Mistral", "mistral", "LlamaForSequenceClassification"),
            ("Ministral", "ministral", "LlamaForSequenceClassification"),
            ("Qwen2", "qwen2", "LlamaForSequenceClassification"),
            ("Qwen3", "qwen3", "LlamaForSequenceClassification"),
            ("Gemma", "gemma", "GemmaForSequenceClassification"),
            ("Gemma2", "gemma2", "GemmaForSequenceClassification"),
            ("Gemma3Text", "gemma3_text", "GemmaForSequenceClassification"),
            ("Qwen2Moe", "qwen2_moe", "MoeForSequenceClassification"),
            ("Qwen3Moe", "qwen3_moe", "MoeForSequenceClassification"),
        )
    },
}

# Architecture name endings that make a pooling model of the classify task (vLLM's
# _SUFFIX_TO_DEFAULTS): --runner auto serves them with the pooling runner.
CLASSIFY_SUFFIXES = ("ForSequenceClassification", "ClassificationModel")


def is_classify_architecture(architecture: str) -> bool:
    return architecture.endswith(CLASSIFY_SUFFIXES)


# (multimodal architecture, its text_config's model_type): (module, class) where that
# language model takes another class than the architecture's own entry.
_BY_TEXT_MODEL: dict[tuple[str, str], tuple[str, str]] = {
    ("Mistral3ForConditionalGeneration", "mistral4"): (
        "mistral3",
        "Mistral3MLAForConditionalGeneration",
    ),
}


def text_model_type(hf_config: Any) -> str | None:
    """The ``model_type`` of a multimodal config's ``text_config`` (transformers' config
    or any object with one), None without one."""
    text = getattr(hf_config, "text_config", None)
    return getattr(text, "model_type", None)


class _ModelRegistry:
    def __init__(self, models: dict[str, tuple[str, str, str]]) -> None:
        # architecture -> (model_type, full module path, class name)
        self.models = {
            arch: (model_type, f"{_PACKAGE}.{module}", class_name)
            for arch, (model_type, module, class_name) in models.items()
        }
        # (architecture, text model_type) -> (full module path, class name)
        self.by_text_model = {
            key: (f"{_PACKAGE}.{module}", class_name)
            for key, (module, class_name) in _BY_TEXT_MODEL.items()
        }

    def register_model(self, architecture: str, target: str, model_type: str = "") -> None:
        """Run checkpoints of HF ``architecture`` (and, when the config lists none, of
        ``model_type``) with ``target``: ``"module:Class"``, the module a full dotted
        path; imported on first use. Replaces an existing entry."""
        module, _, class_name = target.partition(":")
        if not module or not class_name:
            raise ValueError(f"model target {target!r} must be 'module:Class'")
        self.models[architecture] = (model_type, module, class_name)

    def get_supported_archs(self) -> list[str]:
        return sorted(self.models)

    def _load(self, architecture: str) -> type:
        _, module, class_name = self.models[architecture]
        return getattr(importlib.import_module(module), class_name)

    def _load_for(self, architecture: str, hf_config: Any) -> type:
        """The class of ``architecture``, or the one its text model's kind takes."""
        entry = self.by_text_model.get((architecture, text_model_type(hf_config)))
        if entry is not None:
            return getattr(importlib.import_module(entry[0]), entry[1])
        return self._load(architecture)

    def resolve_model_cls(self, hf_config: Any) -> tuple[type, str]:
        """(model class, the architecture it was chosen for) for an HF config: its first
        registered ``architectures`` entry, or its ``model_type`` when it lists none; a
        multimodal architecture's class for its ``text_config``'s ``model_type`` where
        that takes its own (``_BY_TEXT_MODEL``). ValueError naming the architecture and
        the supported ones otherwise."""
        architectures = list(getattr(hf_config, "architectures", None) or [])
        for arch in architectures:
            if arch in self.models:
                return self._load_for(arch, hf_config), arch
        model_type = getattr(hf_config, "model_type", None)
        if not architectures:
            for arch, (arch_type, _, _) in self.models.items():
                if model_type and arch_type == model_type:
                    return self._load_for(arch, hf_config), arch
        named = ", ".join(architectures) or f"(none listed; model_type {model_type!r})"
        raise ValueError(
            f"model architecture {named} is not supported; "
            f"supported architectures: {', '.join(self.get_supported_archs())}"
        )


ModelRegistry = _ModelRegistry(_MODELS)


def model_class_for_task(model_cls: type, architecture: str, task: str | None) -> type:
    """The class that serves ``task`` (``ModelConfig.pooling_task``): a classifier's for
    classify (``--convert classify`` wraps a causal class: ``adapters.as_seq_cls_model``),
    the class itself otherwise. ValueError for a classifier asked to generate."""
    classifier = getattr(model_cls, "is_classifier", False)
    if task == "classify" and not classifier:
        from vllm.model_executor.models.adapters import as_seq_cls_model

        return as_seq_cls_model(model_cls)
    if task is None and classifier:
        raise ValueError(
            f"{architecture} is a classification model (a score head, no language-model "
            "head): serve it with --runner pooling (or auto), not --runner generate"
        )
    return model_cls
