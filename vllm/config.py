"""Engine configuration: frozen dataclasses validated in ``__post_init__``.

Each field is the one place its knob is described: default, type, help text and, where
the vLLM flag is not ``--field-name``, the flag (see ``config_field``).
``vllm/engine/arg_utils.py`` generates the CLI flags and ``EngineArgs`` from these fields.
Invalid values raise ``ValueError`` naming the field and the bad value.
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import math
import re
from collections.abc import Sequence
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Literal, get_args

from vllm.model_executor.layers.quantization import Quantization
from vllm_continuum.config import (  # the policies' config lives with the policies
    PolicyConfig,
    bad_value,
    config_field,
)
from vllm_continuum.context_serve.config import ContextServeConfig
from vllm_continuum.tier import auto_tier_bytes, available_host_memory

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
Dtype = Literal["auto", "float32", "bfloat16", "float16"]
LoadFormat = Literal["auto", "safetensors", "dummy"]
Runner = Literal["auto", "generate", "pooling"]
# --convert (vLLM's): what the pooling runner makes of the model; auto follows the
# architecture's name (*ForSequenceClassification: classify; a causal model: embed).
Convert = Literal["auto", "none", "embed", "classify"]
PoolingTask = Literal["embed", "classify"]
# --pooler-config keys: the pooled row, and the activation over it (embed: L2
# normalisation, ``normalize`` its older name; classify: softmax over the labels, or a
# sigmoid for one label, after the affine calibration ``(logit - logit_mean) / logit_sigma``).
POOLER_KEYS = ("pooling_type", "normalize", "use_activation", "logit_mean", "logit_sigma")
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
POOLING_TYPES = ("LAST",)  # the pooled row: a causal model's last (its whole-prompt summary)
TokenizerMode = Literal["auto", "hf", "deepseek_v32", "slow", "mistral", "custom"]
# Why --tokenizer-mode refuses a mode (auto and hf: AutoTokenizer, the one way here;
# deepseek_v32: AutoTokenizer too, chats rendered by transformers_utils/chat_encodings).
_TOKENIZER_MODE_REFUSALS = {
    "slow": "is not available: transformers 5 (this engine's) has no slow (pure-Python) "
    "tokenizers and ignores use_fast=False, so the tokenizer would be the fast one anyway",
    "mistral": "needs mistral_common, which this engine does not use",
    "custom": "names a registered tokenizer class; this engine has no tokenizer registry",
}


# vLLM's loading and multimodal flags taken in part (ModelConfig._check_vllm_loader_flags).
ConfigFormat = Literal["auto", "hf", "mistral"]
SafetensorsLoadStrategy = Literal["eager", "lazy", "prefetch", "torchao"]
MMProcessorCacheType = Literal["lru", "shm"]


def only(name: str, value: Any, accepted: Sequence[Any], why: str) -> None:
    """A vLLM flag taken with the ``accepted`` values only; any other: ValueError saying
    ``why`` (what is accepted, and why no more)."""
    if not any(value == ok and isinstance(value, bool) == isinstance(ok, bool) for ok in accepted):
        raise bad_value(name, value, why)


# --model-impl (vLLM's): auto and vllm are this engine's own model code, the only kind.
ModelImpl = Literal["auto", "vllm", "transformers", "terratorch"]
_MODEL_IMPL_REFUSALS = {
    "transformers": "runs transformers' modeling code as the model; this engine has no "
    "such backend and serves the architectures it implements itself "
    "(vllm/model_executor/models)",
    "terratorch": "runs TerraTorch's geospatial models, which this engine does not implement",
}


def scheduling_policy_names() -> Sequence[str]:
    """The accepted ``--scheduling-policy`` values: the policy registry's names."""
    from vllm_continuum.policy.registry import policy_names  # imports no engine code

    return policy_names()


def attention_backend_names() -> Sequence[str]:
    """The accepted ``--attention-backend`` values: the attention backend registry's."""
    from vllm.v1.attention.backends.registry import backend_names

    return backend_names()


def offloading_backend_names() -> Sequence[str]:
    """The accepted ``--kv-offloading-backend`` values: the offloading backend registry's."""
    from vllm.v1.kv_offload.registry import offloading_backend_names as names

    return names()


def field_default(cls: type, name: str) -> Any:
    """The declared default of ``cls.name`` (so computed defaults never restate it)."""
    f: Field = next(f for f in fields(cls) if f.name == name)
    if f.default is MISSING:
        raise TypeError(f"{cls.__name__}.{name} has no default")
    return f.default


_UNITS = {"": 1, "b": 1} | {
    prefix + suffix: 2 ** (10 * power)
    for power, prefix in enumerate("kmg", start=1)
    for suffix in ("", "b", "ib")
}


def _check_json_config(name: str, spec: Any, keys: Sequence[str]) -> None:
    """A JSON-object flag's value: a dict of only ``keys`` (``ValueError`` naming it)."""
    if not isinstance(spec, dict):
        raise bad_value(name, spec, "must be a JSON object")
    unknown = sorted(set(spec) - set(keys))
    if unknown:
        raise bad_value(name, unknown, f"has keys this engine does not take; it takes {list(keys)}")


def parse_json_object(text: str | dict, name: str) -> dict[str, Any]:
    """A flag's JSON object (a dict passes through); ValueError naming ``name``."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{name} must be a JSON object, got {text!r}: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {text!r}")
    return value


def _check_mm_limits(limits: Any) -> None:
    """--limit-mm-per-prompt: a dict of modality -> count >= 0; only images served."""
    if not isinstance(limits, dict):
        raise bad_value("limit_mm_per_prompt", limits, "must be a dict")
    for modality, count in limits.items():
        if modality not in ("image", "video", "audio"):
            raise bad_value("limit_mm_per_prompt", limits, f"has an unknown modality {modality!r}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise bad_value("limit_mm_per_prompt", limits, "counts must be integers >= 0")
        if modality != "image" and count:
            raise bad_value(
                "limit_mm_per_prompt",
                limits,
                f"cannot allow {modality} inputs: only images are served",
            )


# --compilation-config's keys this engine honours (vLLM's names; any other is refused).
COMPILATION_KEYS = (
    "level",
    "mode",
    "cudagraph_mode",
    "cudagraph_capture_sizes",
    "max_cudagraph_capture_size",
)
# vLLM's CUDA graph modes this engine runs: full graphs of decode-only steps, or none.
CUDAGRAPH_MODES = ("FULL_DECODE_ONLY", "NONE")
_NO_COMPILATION = (0, "NONE", "NO_COMPILATION")  # vLLM's level / mode 0, by number or name


def parse_compilation_config(text: str | int | dict) -> dict[str, Any]:
    """``--compilation-config`` / ``-O``: a JSON object, or a bare level as vLLM's ``-O3``
    (``{"level": 3}``); ``LLM(compilation_config=0)`` too."""
    if isinstance(text, dict):
        return text
    if isinstance(text, int) and not isinstance(text, bool):
        return {"level": text}
    if isinstance(text, str) and text.strip().isdigit():
        return {"level": int(text)}
    try:
        return parse_json_object(text, "compilation_config")
    except (ValueError, TypeError):
        raise ValueError(
            f"compilation_config (-O) must be a level (-O0) or a JSON object, got {text!r}"
        ) from None


def _capture_sizes(name: str, sizes: Any) -> tuple[int, ...]:
    """Capture sizes as given (a list of integers >= 1) -> ascending, without repeats."""
    if isinstance(sizes, int | str) or not isinstance(sizes, Sequence) or not sizes:
        raise bad_value(name, sizes, "must be a non-empty list of integers >= 1")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in sizes):
        raise bad_value(name, sizes, "must be a non-empty list of integers >= 1")
    return tuple(sorted(set(sizes)))


def parse_bytes(text: str | int) -> int:
    """'512MiB', '1G', '1.5GiB' or an integer -> bytes."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory must be a size like 512MiB or 2GiB, got {text!r}")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class ModelConfig:
    """The model, its tokenizer and numerics."""

    model: str = config_field(
        DEFAULT_MODEL,
        'Model: the embedded "SmolLM2-135M-Instruct", a .gguf file, an HF folder, or a '
        "Hugging Face Hub id (org/name: downloaded into the HF cache unless it is there; "
        "HF_HUB_OFFLINE=1 reads the cache only).",
    )
    tokenizer: str | None = config_field(None, "Tokenizer source; None: the model's own.")
    tokenizer_mode: TokenizerMode = config_field(
        "auto",
        "How the tokenizer is loaded (vLLM's flag). auto and hf: transformers' "
        "AutoTokenizer, a fast (tokenizers-backed) one. slow is refused: transformers 5, "
        "which this engine needs, has no slow tokenizers (it ignores use_fast=False). "
        "deepseek_v32: the same tokenizer, chat messages rendered by DeepSeek-V3.2's own "
        "encoding (its model ships no Jinja template; it takes precedence over "
        "--chat-template, which is then ignored with a warning). "
        "mistral (mistral_common's tokenizer) and custom (a registered class) are refused: "
        "mistral_common is not a dependency, and there is no tokenizer registry.",
    )
    revision: str | None = config_field(
        None,
        "The Hub revision of a model given as a Hugging Face Hub id (a branch, tag or "
        "commit; None: main).",
    )
    tokenizer_revision: str | None = config_field(
        None,
        "The Hub revision of a --tokenizer given as a Hugging Face Hub id (None: main).",
    )
    download_dir: str | None = config_field(
        None,
        "Where a Hub model is downloaded and looked for (None: the Hugging Face cache, "
        "HF_HUB_CACHE).",
    )
    hf_token: str | None = config_field(
        None,
        "The Hugging Face token for Hub downloads (gated or private models; vLLM's flag). "
        "None: huggingface_hub's own, HF_TOKEN or the `hf auth login` token. Never logged.",
        secret=True,
    )
    skip_tokenizer_init: bool = config_field(
        False,
        "Load no tokenizer and detokenize nothing (vLLM's): prompts must be token ids "
        "(prompt_token_ids, or a list of ints in /v1/completions) and outputs carry token "
        "ids with empty text. What needs a tokenizer (text prompts, chat and its template, "
        "stop strings, bad_words, structured outputs, /tokenize and /detokenize, decoded "
        "logprob tokens) is refused. EOS ids come from the model's generation config.",
    )
    enable_prompt_embeds: bool = config_field(
        False,
        "Accept prompt embeddings instead of token ids (vLLM's): LLM.generate("
        '{"prompt_embeds": tensor}) with a (num_tokens, hidden_size) tensor, and '
        "/v1/completions' prompt_embeds (base64 of a torch.save'd tensor, or a list). Those "
        "positions read the tensor in place of the embedding lookup; generated tokens use the "
        "lookup. Not with --speculative-config or --runner pooling; a request with embeddings "
        "takes no LoRA adapter, images, prompt logprobs or repetition penalty.",
    )
    served_model_name: tuple[str, ...] | None = config_field(
        None,
        "Model names the API accepts (one or more, as vLLM); the first is the one responses "
        "and the metrics label report. None: the model.",
    )
    max_model_len: int | None = config_field(
        None, "Maximum prompt + output tokens; None: the model's max_position_embeddings."
    )
    disable_sliding_window: bool = config_field(
        False,
        "Sliding-window layers attend to the whole context instead, and max_model_len is "
        "capped at the window (vLLM's): the same outputs, as far as the window goes.",
    )
    dtype: Dtype = config_field(
        "auto", "Weight/activation dtype; auto: float32 on CPU, bfloat16 on CUDA."
    )
    seed: int = config_field(
        0, "Seed of the global RNG (a request's own seed overrides it for that request)."
    )
    chat_template: str | None = config_field(
        None, "Path of a Jinja chat template overriding the tokenizer's."
    )
    quantization: Quantization | None = config_field(
        None,
        "Weight format of the linear layers. fp32: dense weights in --dtype (a GGUF, an FP8 "
        "or an AWQ/GPTQ/compressed-tensors int4/int8 checkpoint is dequantized at load; the "
        "exactness reference). gguf: keep a GGUF "
        "model's Q4_1/Q8_0 blocks and multiply with the native CPU kernels (float32 only). "
        "fp8: FP8 weights with per-channel scales multiplied in FP8 (an FP8 checkpoint's own, "
        "or a bf16/fp16/fp32 model's quantized at load; CPU or CUDA compute capability >= "
        "8.9). awq / gptq: an AWQ / GPTQ checkpoint (an error for any other), its 4-bit "
        "layers kept packed and multiplied by the Triton W4A16 kernel on CUDA, dequantized "
        "elsewhere. None (auto): fp8 for an FP8 checkpoint on such a GPU, the packed 4-bit "
        "layers of an AWQ/GPTQ/compressed-tensors checkpoint where the kernel runs, gguf for "
        "a .gguf model (the embedded one included) on CPU in float32 when the native kernels "
        "are built, fp32 otherwise.",
    )

    load_format: LoadFormat = config_field(
        "auto",
        "Where the weights come from. auto and safetensors: the model folder's safetensors "
        "files (a .gguf model is converted to one first). dummy: random values in "
        "[-1e-3, 1e-3] drawn from --seed, as vLLM's, for benchmarks; only config.json and "
        "the tokenizer are read.",
    )
    model_impl: ModelImpl = config_field(
        "auto",
        "Which model code runs (vLLM's flag). auto and vllm: this engine's own, the only "
        "kind it has. transformers (transformers' modeling code as a fallback) and "
        "terratorch (geospatial models) are refused: there is no such backend here.",
    )
    use_tqdm_on_load: bool = config_field(
        True,
        "vLLM's progress bar while the weights load. Accepted either way: a display only, "
        "the weights load the same (this engine logs the load instead of drawing a bar).",
    )
    cpu_offload_gb: float = config_field(
        0.0,
        "vLLM's GiB of weights kept in host memory and streamed to the device each step. "
        "Only 0 is accepted: weight offloading is not implemented, the whole model stays "
        "on the device.",
    )
    ignore_patterns: tuple[str, ...] = config_field(
        ("original/**/*",),
        "vLLM's glob patterns of Hub files not to download or load. Only its default, "
        "original/**/*, is accepted: this engine reads the config, tokenizer and weights at "
        "the top of the model's folder, never a subfolder (so never original/), and its Hub "
        "download takes no other patterns.",
    )
    config_format: ConfigFormat = config_field(
        "auto",
        "vLLM's format of the model's config: auto and hf (config.json, the only one read "
        "here). mistral (params.json) is refused.",
    )
    hf_config_path: str | None = config_field(
        None,
        "vLLM's folder or Hub repository whose config.json replaces the model's. Refused "
        "with any value: the config is read from the model's own folder (to change fields "
        "of it, use --hf-overrides).",
    )
    code_revision: str | None = config_field(
        None,
        "vLLM's Hub revision of a model's remote code. Refused with any value: no code from "
        "a model repository is ever run here (see --trust-remote-code).",
    )
    model_loader_extra_config: dict[str, Any] | None = config_field(
        None,
        "vLLM's JSON object of options for its model loader. Only {} (or unset) is "
        "accepted: the one loader here reads safetensors (or pytorch_model*.bin) files and "
        "takes no options.",
        parse=lambda text: parse_json_object(text, "model_loader_extra_config"),
    )
    safetensors_load_strategy: SafetensorsLoadStrategy | None = config_field(
        None,
        "vLLM's way of reading safetensors files: unset, lazy, eager and prefetch change "
        "only how the bytes are read, never what is loaded, and are accepted (each file is "
        "read whole into host memory here, one at a time). torchao (torchao tensor "
        "subclasses) is refused: torchao checkpoints are not supported.",
    )
    pt_load_map_location: str = config_field(
        "cpu",
        "vLLM's torch.load map_location for pytorch_model*.bin checkpoints. Only cpu (the "
        "default) is accepted: that is where they are read before each tensor is copied to "
        "the device.",
    )
    generation_config: str = config_field(
        "auto",
        "Where the default sampling parameters come from (temperature, top_p, top_k, min_p, "
        "repetition_penalty, and max_new_tokens as max_tokens), for requests that leave them "
        "unset: auto, the model folder's generation_config.json; vllm, vLLM's neutral "
        "defaults; or a folder holding a generation_config.json. The model's EOS ids are "
        "read from it in every case.",
    )
    override_generation_config: dict[str, Any] | None = config_field(
        None,
        "JSON object of generation-config fields over --generation-config's, e.g. "
        "'{\"temperature\": 0.5}'.",
        parse=lambda text: parse_json_object(text, "override_generation_config"),
    )
    logits_processors: tuple[str, ...] | None = config_field(
        None,
        "Custom logits processors (vLLM's): fully qualified names of LogitsProcessor "
        "subclasses (package.module:Class), applied in order to every step's logits; "
        "LLM(logits_processors=...) takes the classes too. Not with --speculative-config "
        "or --runner pooling.",
    )
    logprobs_mode: LogprobsMode = config_field(
        "raw_logprobs",
        "What logprobs report (vLLM's): raw_logprobs (the model's, before any processing), "
        "raw_logits (its logits), processed_logprobs / processed_logits (of the logits "
        "the token was drawn from: after logits processors and penalties, and for a "
        "sampled request its temperature, top-k, top-p and min-p). Prompt logprobs are "
        "raw either way.",
    )
    hf_overrides: dict[str, Any] | None = config_field(
        None,
        "JSON object of fields set on the model's HF config before anything reads it "
        "(vLLM's), e.g. '{\"max_position_embeddings\": 4096}' or, with --load-format dummy, "
        "'{\"num_hidden_layers\": 2}'; a nested object updates a sub-config.",
        parse=lambda text: parse_json_object(text, "hf_overrides"),
    )
    limit_mm_per_prompt: dict[str, int] | None = config_field(
        None,
        "JSON object, vLLM's: the most items of each modality a prompt may hold, e.g. "
        "'{\"image\": 4}' (default 999 each). Images only here: a video or audio limit "
        "must be 0.",
        parse=lambda text: parse_json_object(text, "limit_mm_per_prompt"),
    )
    mm_processor_kwargs: dict[str, Any] | None = config_field(
        None,
        "JSON object, vLLM's: arguments every image gets from the model's image processor "
        "(transformers'), e.g. '{\"max_pixels\": 401408}' (Qwen-VL: fewer image tokens) "
        "or '{\"do_image_splitting\": false}' (SmolVLM: no tiles). A chat request's own "
        "mm_processor_kwargs win key by key, and may lower the sizes set here, not raise them.",
        parse=lambda text: parse_json_object(text, "mm_processor_kwargs"),
    )
    mm_processor_cache_gb: float = config_field(
        4.0,
        "vLLM's GiB of cached image-processor outputs, reused when an image comes again. "
        "0 and the default 4 are accepted: no such cache exists here (each request's images "
        "go through the image processor; what is reused is the encoder's output, docs/"
        "design.md); another size is refused, as there is no cache to size.",
    )
    mm_processor_cache_type: MMProcessorCacheType = config_field(
        "lru",
        "vLLM's kind of image-processor cache: lru (the default) is accepted; shm (a cache "
        "in shared memory between API servers and engine) is refused.",
    )
    skip_mm_profiling: bool = config_field(
        False,
        "vLLM's: leave images out of the start-up memory profile. Accepted either way: the "
        "profile run here has no images (the vision encoder's activations are not "
        "profiled), on or off.",
    )
    interleave_mm_strings: bool = config_field(
        False,
        "vLLM's: image placeholders written inside a message's text. Only off is accepted: "
        "images come as content parts, each placed before the message's text (or where the "
        "chat template puts it).",
    )
    language_model_only: bool = config_field(
        False,
        "vLLM's: load a multimodal model's language model only. Only off is accepted: the "
        "vision encoder is always loaded (to refuse images, use --limit-mm-per-prompt "
        "'{\"image\": 0}').",
    )
    enable_mm_embeds: bool = config_field(
        False,
        "vLLM's: take precomputed image embeddings as inputs. Only off is accepted: images "
        "are taken, not their embeddings.",
    )
    media_io_kwargs: dict[str, Any] | None = config_field(
        None,
        "vLLM's JSON object of per-modality media loading arguments (e.g. a video's "
        "num_frames). Only {} (or unset) is accepted: images are decoded with PIL and take none.",
        parse=lambda text: parse_json_object(text, "media_io_kwargs"),
    )
    reasoning_config: dict[str, Any] | None = config_field(
        None,
        "vLLM's JSON object of reasoning strings (reasoning_parser, reasoning_start_str, "
        "reasoning_end_str: what a thinking budget forces). Only unset or {} is accepted: "
        "the reasoning parser is --reasoning-parser, and a thinking budget ends reasoning "
        "with the parser's own end tokens.",
        parse=lambda text: parse_json_object(text, "reasoning_config"),
    )
    trust_remote_code: bool = config_field(
        False,
        "Accepted as in vLLM's launch commands; nothing changes: no code from the model "
        "folder is ever run here (architectures come from this engine's model registry).",
    )
    runner: Runner = config_field(
        "auto",
        "generate: text generation; pooling: one vector per prompt from the model's last "
        "hidden state, as vLLM's pooling runner: embeddings (/v1/embeddings, LLM.embed) of "
        "a causal model converted to embeddings (Qwen3-Embedding, e5-mistral, gte-Qwen2), "
        "or class probabilities (/classify, LLM.classify) of a *ForSequenceClassification "
        "model. auto: pooling for a *ForSequenceClassification architecture or with "
        "--convert embed/classify, generate otherwise.",
    )
    convert: Convert = config_field(
        "auto",
        "What the pooling runner makes of the model (vLLM's flag): embed (the last "
        "token's hidden state), classify (the checkpoint's score head over it, as "
        "transformers' *ForSequenceClassification; a *ForCausalLM checkpoint must hold a "
        "score.weight), none (the architecture's own task: refused for a causal model "
        "under --runner pooling). auto: classify for a *ForSequenceClassification "
        "architecture, embed for any other under --runner pooling.",
    )
    pooler_config: dict[str, Any] | None = config_field(
        None,
        'JSON object, vLLM\'s: {"pooling_type": "LAST", "use_activation": true} (the '
        "defaults for a causal model: the last token's hidden state). The activation: "
        "for embed, L2 normalisation (normalize is its older name); for classify, softmax "
        "over the labels (a sigmoid for one label), after (logit - logit_mean) / "
        "logit_sigma when those are given.",
        parse=lambda text: parse_json_object(text, "pooler_config"),
    )
    max_logprobs: int = config_field(
        20,
        "Most logprobs (and prompt logprobs) a request may ask for per token, vLLM's flag; "
        "-1: the whole vocabulary (a request's -1 asks for all of it).",
    )
    attention_backend: str | None = config_field(
        None,
        "Force this attention backend (vLLM's flag; VLLM_ATTENTION_BACKEND too, the flag "
        "wins): one that cannot run here stops the start instead of falling back. Unset: "
        "the best that can run (torch's FlashAttention on CUDA in fp16/bf16, SDPA "
        "otherwise).",
        choices=attention_backend_names,
    )
    disable_cascade_attn: bool | None = config_field(
        None,
        "Deprecated in vLLM, where it has no effect since cascade attention was removed. "
        "Accepted either way with a warning that it has no effect: this engine has no "
        "cascade attention either.",
    )
    enforce_eager: bool = config_field(
        False,
        "Always run the model eagerly: on CUDA, no CUDA graphs of decode steps (the CPU "
        "always runs eagerly).",
    )
    enable_sleep_mode: bool = config_field(
        False,
        "Allow sleep() and wake_up() (vLLM's; LLM.sleep, POST /sleep with "
        "VLLM_SERVER_DEV_MODE=1): level 1 frees the KV cache and moves the weights to host "
        "memory (on the CPU they stay where they are), level 2 frees the weights too and "
        "wake_up reloads them from the checkpoint. Unlike vLLM's, it works on the CPU.",
    )
    max_cudagraph_capture_size: int | None = config_field(
        None,
        "Largest decode batch (sequences of one new token) replayed from a CUDA graph; "
        "larger ones run eagerly. None: min(max_num_seqs, 512). Batch sizes captured: 1, 2, 4, "
        "multiples of 8 below 256, of 16 from 256, and the largest itself.",
    )
    cudagraph_capture_sizes: tuple[int, ...] | None = config_field(
        None,
        "The decode batch sizes captured in CUDA graphs, instead of the ladder (vLLM's); "
        "a batch replays the graph of the next size up, a batch past the largest runs "
        "eagerly. Sizes above --max-num-seqs are never used and not captured.",
    )
    cuda_graph_sizes: tuple[int, ...] | None = config_field(
        None,
        "Older vLLM's capture sizes flag: one value N is --max-cudagraph-capture-size N "
        "(the ladder up to N), several are --cudagraph-capture-sizes.",
    )
    compilation_config: dict[str, Any] | None = config_field(
        None,
        "JSON object or level, vLLM's CompilationConfig as far as this engine goes. It "
        "never torch.compiles the model: on CUDA it replays decode steps (one new token "
        "per sequence) from full CUDA graphs over a ladder of batch sizes (vLLM's "
        "cudagraph_mode FULL_DECODE_ONLY) and runs every other step eagerly. Keys: "
        "cudagraph_mode (FULL_DECODE_ONLY, or NONE: no graphs, as --enforce-eager), "
        "cudagraph_capture_sizes and max_cudagraph_capture_size (as those flags), "
        "level / mode 0 or NONE (nothing compiled; without a cudagraph_mode no graphs "
        "either, as vLLM). -O0 (a bare level, vLLM's -O) runs eagerly. Compilation "
        "levels, modes and -O 1 to 3 (torch.compile), PIECEWISE / FULL / "
        "FULL_AND_PIECEWISE graphs and other keys are refused.",
        aliases=("-O", "-cc"),
        parse=parse_compilation_config,
    )

    def __post_init__(self) -> None:
        if not self.model:
            raise bad_value("model", self.model, "must be a non-empty name or path")
        if self.hf_token is True:  # vLLM's LLM(hf_token=True): the login's token, the default
            object.__setattr__(self, "hf_token", None)
        token = self.hf_token
        if token is not None and (
            not isinstance(token, str) or not token or token != "".join(token.split())
        ):  # the value is a credential: not echoed
            raise ValueError("hf_token must be a non-empty string without whitespace")
        names = self.served_model_name
        if isinstance(names, str):  # LLM(served_model_name="x"), as vLLM takes it
            names = (names,)
        if names is not None:
            names = tuple(names)
            if not names or not all(isinstance(n, str) and n for n in names):
                raise bad_value("served_model_name", self.served_model_name,
                                "must be one or more non-empty names")  # fmt: skip
            object.__setattr__(self, "served_model_name", names)
        if self.logits_processors is not None:
            from vllm.v1.sample.logits_processor import load_logits_processors

            specs = self.logits_processors
            specs = tuple([specs] if isinstance(specs, str | type) else specs)
            load_logits_processors(specs)  # each must load: a ValueError names it
            object.__setattr__(self, "logits_processors", specs or None)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad_value("max_model_len", self.max_model_len, "must be >= 1")
        if (
            isinstance(self.max_logprobs, bool)
            or not isinstance(self.max_logprobs, int)
            or (self.max_logprobs < -1)
        ):
            raise bad_value("max_logprobs", self.max_logprobs, "must be an integer >= -1")
        if self.dtype not in get_args(Dtype):
            raise bad_value("dtype", self.dtype, "must be auto, float32, bfloat16 or float16")
        if self.quantization not in (None, *get_args(Quantization)):
            raise bad_value(
                "quantization", self.quantization, "must be None, fp32, gguf, fp8, awq or gptq"
            )
        if self.quantization == "gguf" and self.dtype not in ("auto", "float32"):
            raise bad_value("quantization", self.quantization, "gguf needs dtype float32")
        if self.load_format not in get_args(LoadFormat):
            raise bad_value("load_format", self.load_format, "must be auto, safetensors or dummy")
        if (
            self.generation_config not in ("auto", "vllm")
            and not Path(self.generation_config).expanduser().is_dir()
        ):
            raise bad_value(
                "generation_config", self.generation_config, "must be auto, vllm or a folder"
            )
        if self.hf_overrides is not None and not isinstance(self.hf_overrides, dict):
            raise bad_value("hf_overrides", self.hf_overrides, "must be a dict")
        if self.limit_mm_per_prompt is not None:
            _check_mm_limits(self.limit_mm_per_prompt)
        if self.mm_processor_kwargs is not None and not isinstance(self.mm_processor_kwargs, dict):
            raise bad_value("mm_processor_kwargs", self.mm_processor_kwargs, "must be a dict")
        if self.override_generation_config is not None and not isinstance(
            self.override_generation_config, dict
        ):
            raise bad_value(
                "override_generation_config", self.override_generation_config, "must be a dict"
            )
        if self.quantization == "gguf" and self.load_format == "dummy":
            raise bad_value(
                "quantization", self.quantization, "gguf reads the GGUF's weights; dummy has none"
            )
        if self.quantization in ("awq", "gptq") and self.load_format == "dummy":
            raise bad_value(
                "quantization", self.quantization, "names a checkpoint's method; dummy has none"
            )
        if self.runner not in get_args(Runner):
            raise bad_value("runner", self.runner, f"must be one of {get_args(Runner)}")
        backend = self.attention_backend
        if backend is not None and backend not in attention_backend_names():
            raise bad_value(
                "attention_backend", backend, f"must be one of {list(attention_backend_names())}"
            )
        if self.logprobs_mode not in get_args(LogprobsMode):
            raise bad_value(
                "logprobs_mode", self.logprobs_mode, f"must be one of {get_args(LogprobsMode)}"
            )
        if self.convert not in get_args(Convert):
            raise bad_value("convert", self.convert, f"must be one of {get_args(Convert)}")
        if self.runner == "generate" and self.convert in ("embed", "classify"):
            raise bad_value("convert", self.convert, "needs --runner pooling (or auto), "
                            "not --runner generate")  # fmt: skip
        if self.pooler_config is not None:
            self._check_pooler_config(self.pooler_config)
        if self.skip_tokenizer_init:
            for name in ("tokenizer", "chat_template"):  # read by nothing without a tokenizer
                if getattr(self, name) is not None:
                    raise bad_value(name, getattr(self, name), "is never read with "
                                    "skip_tokenizer_init (no tokenizer is loaded)")  # fmt: skip
        if self.tokenizer_mode in _TOKENIZER_MODE_REFUSALS:
            why = _TOKENIZER_MODE_REFUSALS[self.tokenizer_mode]
            mode = self.tokenizer_mode
            raise bad_value("tokenizer_mode", mode, f"{mode!r} {why}: use auto or hf")
        if self.tokenizer_mode not in get_args(TokenizerMode):
            raise bad_value(
                "tokenizer_mode", self.tokenizer_mode, "must be auto, hf or deepseek_v32"
            )
        if self.tokenizer_mode == "deepseek_v32" and self.chat_template is not None:
            # As vLLM: the mode's encoding renders every chat; the template is never read.
            logging.getLogger(__name__).warning(
                "--chat-template is ignored with --tokenizer-mode deepseek_v32: chats are "
                "rendered by DeepSeek-V3.2's encoding, not a Jinja template"
            )
        self._check_vllm_load_flags()
        self._check_vllm_loader_flags()
        self._check_vllm_mm_flags()
        self._fold_graph_flags()

    def _check_vllm_load_flags(self) -> None:
        """vLLM's --model-impl, --cpu-offload-gb, --disable-cascade-attn: what is not
        this engine's own model code, fully on its device, is refused."""
        impl = self.model_impl
        if impl in _MODEL_IMPL_REFUSALS:
            why = _MODEL_IMPL_REFUSALS[impl]
            raise bad_value("model_impl", impl, f"{impl!r} {why}: use auto or vllm")
        if impl not in get_args(ModelImpl):
            raise bad_value("model_impl", impl, "must be auto or vllm")
        gb = self.cpu_offload_gb
        if isinstance(gb, bool) or not isinstance(gb, int | float) or not gb >= 0:
            raise bad_value("cpu_offload_gb", gb, "must be a number of GiB >= 0 (use 0)")
        if gb > 0:
            raise bad_value(
                "cpu_offload_gb", gb,
                "must be 0: weight offloading to host memory is not implemented, the whole "
                "model stays on the device (for a model too large, use a quantized "
                "checkpoint or --quantization, or a larger device)",
            )  # fmt: skip
        if self.disable_cascade_attn is not None:
            # vLLM warns whichever way it is given (its EngineArgs.create_model_config).
            logging.getLogger(__name__).warning(
                "--disable-cascade-attn has no effect: vLLM deprecated it when it removed "
                "cascade attention, and this engine has no cascade attention either"
            )

    def _check_vllm_loader_flags(self) -> None:
        """vLLM's loading flags: the values that ask nothing beyond reading the model's
        own folder, top level, with the one loader here."""
        patterns = self.ignore_patterns
        if isinstance(patterns, list | str):
            patterns = (patterns,) if isinstance(patterns, str) else tuple(patterns)
            object.__setattr__(self, "ignore_patterns", patterns)
        only(
            "ignore_patterns", patterns, [("original/**/*",)],
            "must be original/**/* (vLLM's default): this engine reads the config, tokenizer "
            "and weights at the top of the model's folder, never a subfolder, and its Hub "
            "download is not given other patterns",
        )  # fmt: skip
        only(
            "config_format", self.config_format, ["auto", "hf"],
            "must be auto or hf: the model's config is its config.json (mistral's params.json "
            "is not read)",
        )  # fmt: skip
        only(
            "hf_config_path", self.hf_config_path, [None],
            "is not taken: the config is read from the model's own folder; use --hf-overrides "
            "to change fields of it",
        )  # fmt: skip
        only(
            "code_revision", self.code_revision, [None],
            "is not taken: it is the revision of a model's remote code, and no code from a "
            "model repository is ever run here",
        )  # fmt: skip
        only(
            "model_loader_extra_config", self.model_loader_extra_config, [None, {}],
            "must be unset or {}: the one loader here reads safetensors (or "
            "pytorch_model*.bin) files and takes no options",
        )  # fmt: skip
        only(
            "safetensors_load_strategy", self.safetensors_load_strategy,
            [None, "lazy", "eager", "prefetch"],
            "must be unset, lazy, eager or prefetch (how the bytes are read, the same "
            "weights): torchao builds torchao tensor subclasses, and torchao checkpoints "
            "are not supported",
        )  # fmt: skip
        only(
            "pt_load_map_location", self.pt_load_map_location, ["cpu"],
            "must be cpu: pytorch_model*.bin checkpoints are read onto the CPU, then each "
            "tensor is copied to the device",
        )  # fmt: skip

    def _check_vllm_mm_flags(self) -> None:
        """vLLM's multimodal flags: images as content parts, encoded here."""
        cache_gb = self.mm_processor_cache_gb
        only(
            "mm_processor_cache_gb", cache_gb, [0, 4],
            "must be 0 or 4 (vLLM's default): this engine keeps no cache of image-processor "
            "outputs to size (the vision encoder's outputs are what is reused)",
        )  # fmt: skip
        only(
            "mm_processor_cache_type", self.mm_processor_cache_type, ["lru"],
            "must be lru: there is no shared-memory (shm) cache between API servers and "
            "engine",
        )  # fmt: skip
        if not isinstance(self.skip_mm_profiling, bool):
            raise bad_value("skip_mm_profiling", self.skip_mm_profiling, "must be a bool")
        refusals = {
            "interleave_mm_strings": "image placeholders inside a message's text are not "
            "read: send images as content parts",
            "language_model_only": "a multimodal model's vision encoder is always loaded; "
            "to refuse images, use --limit-mm-per-prompt '{\"image\": 0}'",
            "enable_mm_embeds": "precomputed image embeddings are not taken as inputs: "
            "send the images",
        }
        for name, why in refusals.items():
            only(name, getattr(self, name), [False], f"must be off: {why}")
        only(
            "media_io_kwargs", self.media_io_kwargs, [None, {}],
            "must be unset or {}: images are decoded with PIL and take no loading arguments (video "
            "and audio are not served)",
        )  # fmt: skip
        only(
            "reasoning_config", self.reasoning_config, [None, {}],
            "must be unset or {}: the reasoning parser is --reasoning-parser, and a thinking "
            "budget ends the reasoning with that parser's own end tokens, not configured "
            "strings",
        )  # fmt: skip

    def _check_pooler_config(self, pooler: Any) -> None:
        """--pooler-config: its keys' types; ValueError naming the key."""
        if not isinstance(pooler, dict):
            raise bad_value("pooler_config", pooler, "must be a JSON object")
        unknown = sorted(set(pooler) - set(POOLER_KEYS))
        if unknown:
            raise bad_value("pooler_config", unknown, "has keys this engine does not take; it "
                            f"takes {list(POOLER_KEYS)}")  # fmt: skip
        if pooler.get("pooling_type", "LAST") not in POOLING_TYPES:
            raise bad_value("pooler_config.pooling_type", pooler["pooling_type"],
                            f"must be one of {POOLING_TYPES} (a causal model's)")  # fmt: skip
        for key in ("normalize", "use_activation"):
            if not isinstance(pooler.get(key, True), bool | None):
                raise bad_value(f"pooler_config.{key}", pooler[key], "must be a bool")
        if None not in (pooler.get("normalize"), pooler.get("use_activation")) and (
            pooler["normalize"] != pooler["use_activation"]
        ):
            raise bad_value("pooler_config.normalize", pooler["normalize"],
                            "disagrees with use_activation (its newer name): give one")  # fmt: skip
        for key in ("logit_mean", "logit_sigma"):
            value = pooler.get(key)
            if isinstance(value, bool) or not isinstance(value, int | float | None):
                raise bad_value(f"pooler_config.{key}", value, "must be a number")
        if pooler.get("logit_sigma") == 0:
            raise bad_value("pooler_config.logit_sigma", 0, "must not be 0 (it divides)")
        if self.runner == "generate" or (
            self.runner == "auto" and self.convert in ("auto", "none") and not self.is_pooling
        ):
            raise bad_value("pooler_config", pooler, "needs --runner pooling (a pooling model)")

    def _fold_graph_flags(self) -> None:
        """--compilation-config and --cuda-graph-sizes folded into enforce_eager,
        cudagraph_capture_sizes and max_cudagraph_capture_size (ValueError for a key or
        value this engine cannot honour, or for two settings that disagree).
        --cuda-graph-sizes is cleared once folded, so a ``replace`` does not fold it twice."""
        spec = self.compilation_config
        if spec is not None:
            spec = parse_compilation_config(spec)
            _check_json_config("compilation_config", spec, COMPILATION_KEYS)
            object.__setattr__(self, "compilation_config", spec)
        spec = spec or {}
        sizes = self.cudagraph_capture_sizes
        if sizes is not None:
            sizes = _capture_sizes("cudagraph_capture_sizes", sizes)
            object.__setattr__(self, "cudagraph_capture_sizes", sizes)
        if self.cuda_graph_sizes is not None:
            old = _capture_sizes("cuda_graph_sizes", self.cuda_graph_sizes)
            if len(old) == 1:
                self._set_once("max_cudagraph_capture_size", old[0], "--cuda-graph-sizes")
            else:
                self._set_once("cudagraph_capture_sizes", old, "--cuda-graph-sizes")
            object.__setattr__(self, "cuda_graph_sizes", None)
        for key in ("cudagraph_capture_sizes", "max_cudagraph_capture_size"):
            if key in spec:
                self._set_once(key, spec[key], f"compilation_config.{key}")
        sizes, top = self.cudagraph_capture_sizes, self.max_cudagraph_capture_size
        if top is not None and (isinstance(top, bool) or not isinstance(top, int) or top < 1):
            raise bad_value("max_cudagraph_capture_size", top, "must be >= 1")
        if sizes is not None and top is not None and top != sizes[-1]:
            raise bad_value(
                "max_cudagraph_capture_size",
                top,
                f"must be the largest of cudagraph_capture_sizes {list(sizes)} when both are given",
            )
        for key in ("level", "mode"):
            value = spec.get(key)
            name = value.upper() if isinstance(value, str) else value
            if key in spec and (isinstance(value, bool) or name not in _NO_COMPILATION):
                raise bad_value(
                    f"compilation_config.{key}",
                    value,
                    f"{value!r} asks for torch.compile (vLLM's compilation levels and modes "
                    "1-3, -O1 to -O3), which this engine never does: it runs the model "
                    "uncompiled with CUDA graphs of decode steps; accepted: 0 or NONE (-O0: "
                    "no graphs either), or no -O",
                )
        if "cudagraph_mode" in spec:
            self._cudagraph_mode(spec["cudagraph_mode"])
        elif "level" in spec or "mode" in spec:  # vLLM: uncompiled, no mode named: no graphs
            object.__setattr__(self, "enforce_eager", True)

    def _cudagraph_mode(self, mode: Any) -> None:
        name = mode.upper() if isinstance(mode, str) else mode
        if name not in CUDAGRAPH_MODES:
            raise bad_value(
                "compilation_config.cudagraph_mode",
                mode,
                "must be FULL_DECODE_ONLY (this engine's graphs: decode-only steps, every "
                "other step eager) or NONE (no graphs); PIECEWISE and FULL_AND_PIECEWISE need "
                "torch.compile, and FULL (graphs of mixed prefill-decode steps) is not "
                "captured here",
            )
        if name == "NONE":
            object.__setattr__(self, "enforce_eager", True)
        elif self.enforce_eager:
            raise ValueError(
                "--enforce-eager and compilation_config.cudagraph_mode FULL_DECODE_ONLY "
                "contradict each other: give one"
            )

    def _set_once(self, name: str, value: Any, source: str) -> None:
        """Set the field ``name`` from ``source`` (ValueError if it holds another value)."""
        if name == "cudagraph_capture_sizes":
            value = _capture_sizes(source.removeprefix("--"), value)
        current = getattr(self, name)
        if current is not None and current != value:
            raise ValueError(
                f"{source} ({value!r}) and --{name.replace('_', '-')} ({current!r}) "
                "disagree: give one"
            )
        object.__setattr__(self, name, value)

    @property
    def name(self) -> str:
        """The name responses and metrics report: the first served name, else the model."""
        return self.served_model_name[0] if self.served_model_name else self.model

    @functools.cached_property
    def pooling_task(self) -> PoolingTask | None:
        """What the pooling runner serves: "embed" (LLM.embed, /v1/embeddings) or
        "classify" (LLM.classify, /classify); None: the model generates. --runner auto and
        --convert auto follow the architecture's name, as vLLM's (the HF config is read
        once, and only then). ValueError naming ``convert`` or ``pooler_config`` for a
        combination that cannot be served."""
        runner, convert = self.runner, self.convert
        if runner == "generate":
            return None
        if convert in ("embed", "classify"):
            task = convert
        else:
            from vllm.model_executor.models.registry import is_classify_architecture

            archs = model_architectures(self)
            task = "classify" if any(map(is_classify_architecture, archs)) else None
            if task is None and runner == "pooling":
                if convert == "none":
                    raise bad_value("convert", convert, f"keeps {list(archs)} a generative "
                                    "model: --runner pooling needs --convert embed or "
                                    "classify (or auto)")  # fmt: skip
                task = "embed"
        pooler = self.pooler_config or {}
        if task == "classify" and "normalize" in pooler:
            raise bad_value("pooler_config.normalize", pooler["normalize"], "is an embedding "
                            "model's; a classifier takes use_activation")  # fmt: skip
        if task == "embed" and {"logit_mean", "logit_sigma"} & set(pooler):
            raise bad_value("pooler_config", sorted(pooler), "logit_mean and logit_sigma "
                            "calibrate a classifier's logits, not embeddings")  # fmt: skip
        return task

    @property
    def is_pooling(self) -> bool:
        """Served by the pooling runner (``pooling_task`` is not None)."""
        if self.runner == "pooling":
            return True
        if self.runner == "generate":
            return False
        return self.pooling_task is not None

    @property
    def pooler_use_activation(self) -> bool:
        """--pooler-config's activation (default on): embeddings L2-normalised, class
        logits softmaxed (sigmoid for one label)."""
        pooler = self.pooler_config or {}
        value = pooler.get("use_activation")
        return bool(pooler.get("normalize", True) if value is None else value)

    @property
    def pooler_normalize(self) -> bool:
        return self.pooler_use_activation

    @property
    def logit_calibration(self) -> tuple[float, float]:
        """(logit_mean, logit_sigma) of --pooler-config: (0, 1) unless given."""
        pooler = self.pooler_config or {}
        return float(pooler.get("logit_mean") or 0.0), float(pooler.get("logit_sigma") or 1.0)

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name a request's ``model`` may give for the base model."""
        return self.served_model_name or (self.model,)


# --kv-cache-dtype (vllm/v1/attention/kv_cache_dtype.py maps them to torch dtypes).
CacheDtype = Literal["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2"]


# --performance-mode (vLLM's): balanced, its default, leaves the defaults as they are.
PerformanceMode = Literal["balanced", "interactivity", "throughput"]


# --mamba-ssm-cache-dtype (vllm/model_executor/layers/recurrent.py).
MambaSSMCacheDtype = Literal["auto", "float32", "bfloat16", "float16"]

MambaCacheMode = Literal["align", "none"]  # --mamba-cache-mode (vLLM's)

# --prefix-caching-hash-algo (vLLM's): this engine's block hash is sha256 over a pickle of
# (parent hash, token ids, extra keys), vLLM's sha256 (vllm/v1/core/kv_cache_utils.py).
PrefixCachingHashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
_HASH_ALGO_REFUSALS = {
    "sha256_cbor": "serializes with canonical CBOR, and cbor2 is not a dependency",
    "xxhash": "hashes with xxHash, and the xxhash package is not a dependency",
    "xxhash_cbor": "hashes CBOR with xxHash, and neither cbor2 nor xxhash is a dependency",
}


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block size, prefix caching and how much memory it gets."""

    block_size: int = config_field(16, "Tokens per KV block.")
    cache_dtype: CacheDtype = config_field(
        "auto",
        "Data type of the KV cache: auto (the model's, --dtype; fp8 for a checkpoint with an "
        "FP8 kv_cache_scheme), the model's dtype by name (which overrides such a checkpoint), "
        "or fp8 (= fp8_e4m3) / fp8_e5m2: one byte an element, twice the tokens in the same "
        "memory (the checkpoint's k/v scales, else 1.0).",
        flag="--kv-cache-dtype",
    )
    enable_prefix_caching: bool = config_field(
        True, "Reuse KV blocks across requests sharing a prefix (chained block hashes)."
    )
    num_gpu_blocks_override: int | None = config_field(
        None, "Exact number of KV blocks (null block included); overrides the memory sizing."
    )
    kv_cache_memory_bytes: int | None = config_field(
        None,
        "KV cache size, e.g. 512MiB or 2GiB; None: 1GiB on CPU, gpu_memory_utilization on CUDA.",
        flag="--kv-cache-memory",
        parse=parse_bytes,
    )
    gpu_memory_utilization: float = config_field(
        0.9, "Fraction of GPU memory the engine may use (CUDA only)."
    )
    mamba_ssm_cache_dtype: MambaSSMCacheDtype = config_field(
        "auto",
        "Data type of the linear-attention layers' recurrent states (Qwen3-Next, Qwen3.5's "
        "Gated DeltaNet): auto (the model's dtype, as vLLM), float32, bfloat16 or float16. "
        "float32 keeps a long decode's state exact at twice the bytes.",
    )
    mamba_cache_dtype: MambaSSMCacheDtype = config_field(
        "auto",
        "vLLM's dtype of a recurrent layer's convolution and state matrices together. Only "
        "auto (the model's dtype) is accepted: the convolution states keep the model's "
        "dtype here; set the state matrices' with --mamba-ssm-cache-dtype.",
    )
    mamba_block_size: int | None = config_field(
        None,
        "vLLM's tokens between cached recurrent states (its align mode). Unset or "
        "--block-size is accepted: the states are checkpointed at KV block boundaries here "
        '(docs/design.md, "Linear-attention layers"); set --block-size to change that.',
    )
    mamba_cache_mode: MambaCacheMode = config_field(
        "none",
        "vLLM's caching of recurrent states for prefix hits: none (vLLM's default, which it "
        "turns to align with prefix caching) and align (states at block boundaries) are "
        "accepted: here the states are checkpointed at block boundaries whenever prefix "
        "caching is on, in a pool of their own (docs/design.md).",
    )
    prefix_caching_hash_algo: PrefixCachingHashAlgo = config_field(
        "sha256",
        "How KV blocks are hashed for prefix caching (vLLM's flag); the KV cache events "
        "publish these hashes. sha256: SHA-256 over a pickle of (parent hash, token ids, "
        "extra keys), vLLM's sha256 and the only one here. sha256_cbor, xxhash and "
        "xxhash_cbor are refused: cbor2 and xxhash are not dependencies.",
    )

    def __post_init__(self) -> None:
        algo = self.prefix_caching_hash_algo
        if algo in _HASH_ALGO_REFUSALS:
            raise bad_value(
                "prefix_caching_hash_algo", algo,
                f"{algo!r} {_HASH_ALGO_REFUSALS[algo]}: use sha256 (KV blocks are hashed "
                "here with SHA-256 over a pickle, vLLM's sha256)",
            )  # fmt: skip
        if algo not in get_args(PrefixCachingHashAlgo):
            raise bad_value("prefix_caching_hash_algo", algo, "must be sha256")
        self._check_vllm_mamba_flags()
        if self.mamba_ssm_cache_dtype not in get_args(MambaSSMCacheDtype):
            choices = ", ".join(get_args(MambaSSMCacheDtype))
            raise bad_value(
                "mamba_ssm_cache_dtype", self.mamba_ssm_cache_dtype, f"must be one of {choices}"
            )
        if self.cache_dtype not in get_args(CacheDtype):
            choices = ", ".join(get_args(CacheDtype))
            raise bad_value("kv_cache_dtype", self.cache_dtype, f"must be one of {choices}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128, 256):
            raise bad_value("block_size", self.block_size, "must be a power of two in [1, 256]")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise bad_value("num_gpu_blocks_override", self.num_gpu_blocks_override, "must be >= 2")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise bad_value("kv_cache_memory_bytes", self.kv_cache_memory_bytes, "must be > 0")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise bad_value(
                "gpu_memory_utilization", self.gpu_memory_utilization, "must be in (0, 1]"
            )

    def _check_vllm_mamba_flags(self) -> None:
        """vLLM's recurrent-state cache flags: what the state checkpoints here already are."""
        only(
            "mamba_cache_dtype", self.mamba_cache_dtype, ["auto"],
            "must be auto: the convolution states keep the model's dtype here; the state "
            "matrices' dtype is --mamba-ssm-cache-dtype's",
        )  # fmt: skip
        only(
            "mamba_block_size", self.mamba_block_size, [None, self.block_size],
            f"must be unset or the --block-size ({self.block_size}): recurrent states are "
            "checkpointed at KV block boundaries here; set --block-size to move them",
        )  # fmt: skip
        only(
            "mamba_cache_mode", self.mamba_cache_mode, ["none", "align"],
            "must be none or align: recurrent states are checkpointed at block boundaries "
            "with prefix caching",
        )  # fmt: skip


@dataclass(frozen=True)
class SchedulerConfig:
    """Step budgets and the scheduling policy."""

    max_num_seqs: int = config_field(128, "Maximum number of running requests in one step.")
    max_num_batched_tokens: int = config_field(
        2048,
        "Token budget of one step, shared by prefill chunks and decodes; unset: 2048 (on "
        "CUDA, vLLM's default for the GPU: vllm serve 8192 and LLM 16384 on H100/H200, "
        "16384 from 160 GiB, 2048 and 8192 on smaller GPUs and A100), or at least "
        "max_model_len without chunked prefill.",
        derived=True,
    )
    max_model_len: int = config_field(
        8192, "Maximum prompt + output length (filled from ModelConfig).", cli=False
    )
    enable_chunked_prefill: bool = config_field(
        True, "Split long prefills across steps when the budget is short."
    )
    long_prefill_token_threshold: int = config_field(
        0, "A prefill chunk is at most this many tokens (0: no limit beyond the budget)."
    )
    disable_chunked_mm_input: bool = config_field(
        False,
        "vLLM's: a prefill chunk never ends inside an image; it stops before the image "
        "and the next step takes the image whole (or the image starts a step of its own "
        "when it is longer than the budget); a chunk a prefix hit starts inside an image "
        "waits for room for the rest. Always on for Gemma 3 (its image tokens attend to "
        "each other both ways).",
    )
    async_scheduling: bool = config_field(
        False,
        "Schedule the next step while the device runs this one (vLLM's async scheduling): "
        "each step samples on the device and keeps its tokens there (penalties, logits "
        "processors, logprobs, prompt logprobs and grammars included), the next step reads "
        "them there, and the host's scheduling and input building overlap the forward. "
        "Off by default here (vLLM turns it on for GPUs); refused with speculative decoding.",
    )
    stream_interval: int = config_field(
        1,
        "Tokens a streamed request gathers before its next output (vLLM's): 1 sends each "
        "step's tokens at once; N > 1 sends the first token at once, then every N new "
        "tokens, and the last output when the request ends, which cuts the API server's "
        "work per token (one SSE chunk per N tokens). A request's own stream_interval may "
        "raise it, never lower it.",
    )
    policy: str = config_field(
        "fcfs",
        "Which policy orders waiting requests, picks victims, and decides pins.",
        flag="--scheduling-policy",
        choices=scheduling_policy_names,
    )
    max_num_queued_reqs: int | None = config_field(
        None,
        "Maximum requests in flight (waiting or running; n > 1 counts n) at once, None for "
        "no limit (vLLM's). A request past it is refused at the API server with HTTP 503 "
        "before it reaches the engine, so a client can retry elsewhere. Counted across all "
        "API servers of one engine (--api-server-count).",
    )
    max_num_queued_tokens: int | None = config_field(
        None,
        "Maximum total prompt tokens of requests still in prefill (no output yet), None for "
        "no limit (vLLM's TTFT valve: about target TTFT x prefill throughput). Once the "
        "backlog reaches it, new requests are refused with HTTP 503. Counts a request's "
        "whole prompt until its first output (chunked progress and prefix-cache hits are "
        "not subtracted), per API server.",
    )
    disable_hybrid_kv_cache_manager: bool = config_field(
        False,
        "Keep every KV block of every layer (vLLM's flag). By default a model with "
        "sliding-window layers (gpt-oss, Gemma 2/3, Cohere 2, Mistral v0.1) gets the hybrid "
        "KV cache: its sliding layers hold only their window's blocks, so a long context "
        "takes a fraction of the memory.",
    )
    scheduler_cls: str | None = config_field(
        None,
        "vLLM's import path of a scheduler class. Refused with any value: this engine "
        "has one scheduler, and what it runs, evicts and keeps is its policy's: choose "
        "one with --scheduling-policy.",
    )
    performance_mode: PerformanceMode = config_field(
        "balanced",
        "vLLM's preset of defaults. balanced (vLLM's default) is accepted: the defaults "
        "stay as they are. interactivity and throughput are refused: they retune vLLM's "
        "defaults, which this engine does not; set the knobs themselves instead.",
    )

    @property
    def max_chunk_tokens(self) -> int:
        """The longest prefill chunk a step can take: the step's budget, or the long-prefill
        threshold when it is set and lower."""
        threshold = self.long_prefill_token_threshold
        return min(self.max_num_batched_tokens, threshold or self.max_num_batched_tokens)

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise bad_value(name, getattr(self, name), "must be >= 1")
        for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
            limit = getattr(self, name)
            if limit is not None and (isinstance(limit, bool) or limit < 0):
                raise bad_value(name, limit, "must be >= 0 or None")
        interval = self.stream_interval
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise bad_value("stream_interval", interval, "must be an integer >= 1")
        if self.long_prefill_token_threshold < 0:
            raise bad_value(
                "long_prefill_token_threshold", self.long_prefill_token_threshold, "must be >= 0"
            )
        policies = tuple(scheduling_policy_names())
        if self.policy not in policies:
            raise bad_value("scheduling_policy", self.policy, f"must be one of {policies}")
        if self.scheduler_cls is not None:
            names = ",".join(policies)
            raise bad_value(
                "scheduler_cls", self.scheduler_cls,
                "is not taken: this engine has one scheduler, whose decisions (admission, "
                f"preemption, pins) are its policy's: use --scheduling-policy {{{names}}}",
            )  # fmt: skip
        mode = self.performance_mode
        if mode != "balanced":
            why = (
                f"{mode!r} retunes vLLM's defaults (CUDA graph sizes, batching, kernels), "
                "which this engine does not do"
                if mode in get_args(PerformanceMode)
                else "must be balanced"
            )
            raise bad_value(
                "performance_mode", mode,
                f"{why}: use balanced, and set --max-num-seqs, --max-num-batched-tokens or "
                "--cudagraph-capture-sizes for what you want tuned",
            )  # fmt: skip
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise bad_value(
                "max_num_batched_tokens",
                self.max_num_batched_tokens,
                f"must be >= max_model_len={self.max_model_len} without chunked prefill",
            )


def parse_gib(text: str | float) -> float:
    """'4', '0.5' or a number -> GiB (a float), as vLLM's ``--kv-offloading-size``."""
    if isinstance(text, int | float):
        return float(text)
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"--kv-offloading-size must be a number of GiB, got {text!r}") from None


@dataclass(frozen=True)
class OffloadConfig:
    """A second KV tier in host memory (vLLM's native KV offloading)."""

    kv_offloading_size: float | None = config_field(
        None,
        "Size of the host-memory KV tier in GiB; 0: no tier; unset: a tier sized from free "
        "host memory for policies that keep jobs' contexts (continuum, context_serve: the "
        "smaller of 16x the KV cache and half the available host memory), none otherwise. "
        "Blocks evicted from the KV cache (or offloaded by the policy) are copied there and "
        "loaded back on a hit.",
        parse=parse_gib,
    )
    kv_offloading_backend: str = config_field(
        "native",
        "KV offloading backend (native: a block pool in host memory, copied by the runner).",
        choices=offloading_backend_names,
    )

    def __post_init__(self) -> None:
        backends = tuple(offloading_backend_names())
        if self.kv_offloading_backend not in backends:
            raise bad_value(
                "--kv-offloading-backend", self.kv_offloading_backend, f"must be one of {backends}"
            )
        size = self.kv_offloading_size
        if size is None or size == 0:
            return
        if not isinstance(size, int | float) or not size > 0:
            raise bad_value("--kv-offloading-size", size, "must be a number of GiB >= 0")
        available = available_host_memory()
        if self.size_bytes > available:
            raise bad_value(
                "--kv-offloading-size",
                size,
                f"is more than the host memory available ({available / 2**30:.1f} GiB)",
            )

    @property
    def enabled(self) -> bool:
        """A tier of the size asked (``--kv-offloading-size`` > 0)."""
        return bool(self.kv_offloading_size)

    @property
    def auto(self) -> bool:
        """No size given: the engine sizes a tier for policies that want one."""
        return self.kv_offloading_size is None

    def auto_size_bytes(self, pool_bytes: int) -> int:
        """The tier an unset ``--kv-offloading-size`` gets (``vllm_continuum.tier``: 16x the
        KV cache, at most half the host memory available now)."""
        return auto_tier_bytes(pool_bytes, available_host_memory())

    @property
    def size_bytes(self) -> int:
        return int((self.kv_offloading_size or 0) * 2**30)

    def num_blocks(self, bytes_per_block: int, size_bytes: int | None = None) -> int:
        """Blocks the tier holds (0 when off); ValueError if on but under one block.
        ``size_bytes``: the automatic size, for a tier the engine sized itself."""
        if size_bytes is not None:
            return size_bytes // bytes_per_block
        if not self.enabled:
            return 0
        n = self.size_bytes // bytes_per_block
        if n < 1:
            raise bad_value(
                "--kv-offloading-size",
                self.kv_offloading_size,
                f"holds no KV block of {bytes_per_block} bytes",
            )
        return n


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model", "eagle", "eagle3", "mtp")
# The methods whose drafts come from a model in the runner (its KV in the target's blocks).
DRAFT_MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# vLLM's older names of methods, still taken (with a warning, as vLLM does).
_SPECULATIVE_METHOD_ALIASES = {"deepseek_mtp": "mtp", "qwen3_next_mtp": "mtp"}
_DRAFT_KEYS = ("model", "quantization", "max_model_len", "draft_tensor_parallel_size")
# Suffix decoding's keys with vLLM's defaults: the trees' depth (the longest match plus
# draft), the past responses the global tree keeps (0: none, only each request's own
# tree), the draft's cap per matched token, and the least frequency a drafted token needs.
SUFFIX_DECODING_DEFAULTS: dict[str, int | float] = {
    "suffix_decoding_max_tree_depth": 24,
    "suffix_decoding_max_cached_requests": 10000,
    "suffix_decoding_max_spec_factor": 1.0,
    "suffix_decoding_min_token_prob": 0.1,
}
# Keys per method (vLLM's names), beyond "method", "num_speculative_tokens" and
# "disable_by_batch_size", which every method takes. A key of another method only is
# refused rather than ignored.
_SPECULATIVE_METHOD_KEYS = {
    "ngram": ("prompt_lookup_min", "prompt_lookup_max"),
    "suffix": tuple(SUFFIX_DECODING_DEFAULTS),
    **{method: _DRAFT_KEYS for method in DRAFT_MODEL_METHODS},
}
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")  # vLLM's "model" values that name n-gram lookup
_SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "disable_by_batch_size",
    *(key for keys in _SPECULATIVE_METHOD_KEYS.values() for key in keys),
)


def _speculative_method(spec: dict[str, Any]) -> str:
    """The method ``spec`` names, or vLLM's inference: ``model`` without a method is a draft
    model (``"ngram"`` as the model names n-gram lookup)."""
    method = spec.get("method")
    if method is None and spec.get("model") is not None:
        method = "ngram" if spec["model"] in _NGRAM_MODEL_NAMES else "draft_model"
    if method in _SPECULATIVE_METHOD_ALIASES:
        new = _SPECULATIVE_METHOD_ALIASES[method]
        logging.getLogger(__name__).warning(
            "speculative_config.method %r is deprecated: it is %r", method, new
        )
        method = new
    if method not in SPECULATIVE_METHODS:
        raise bad_value(
            "speculative_config.method", method, f"must be one of {SPECULATIVE_METHODS}"
        )
    return method


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's --speculative-config): n-gram prompt lookup proposes
    the tokens that followed the sequence's last n-gram where it occurred before; suffix
    decoding, the likeliest continuation of the sequence's end in suffix trees over the
    prompt and over past responses; a draft
    model (a small model of the same vocabulary) proposes its greedy continuation; an EAGLE
    head proposes from the target's own hidden states; one forward of the target checks
    them all (docs/spec_decode.md)."""

    speculative_config: dict[str, Any] | None = config_field(
        None,
        'JSON object, vLLM\'s: {"method": "ngram", "num_speculative_tokens": K} and '
        "optionally prompt_lookup_min / prompt_lookup_max (n-gram sizes; both 5 when "
        'neither is given); or {"method": "suffix"} (suffix decoding: drafts from suffix '
        "trees over the prompt and over past requests' responses; optionally "
        "suffix_decoding_max_tree_depth (24; also num_speculative_tokens' default), "
        "suffix_decoding_max_cached_requests (10000 responses kept; 0: none), "
        "suffix_decoding_max_spec_factor (1.0: at most that many drafts per matched token) "
        "and suffix_decoding_min_token_prob (0.1)); "
        'or {"model": DRAFT, "num_speculative_tokens": K} (method '
        "draft_model: a model of the target's vocabulary, loaded like --model, with "
        "optionally quantization, max_model_len and draft_tensor_parallel_size 1); or "
        '{"method": "eagle" or "eagle3", "model": HEAD, "num_speculative_tokens": K} (an '
        "EAGLE-1 / EAGLE-3 head trained on the target's hidden states, same keys as "
        'draft_model); or {"method": "mtp", "num_speculative_tokens": K} (the model\'s own '
        "multi-token-prediction layer, DeepSeek-V3's or GLM-4.5's, read from the target's "
        "checkpoint unless model names another). All take disable_by_batch_size (no "
        "drafts in a step with more running requests). "
        "Requests without penalties, logit controls, min_tokens or a grammar get drafts "
        "(greedy: checked exactly; sampled: rejection sampling); every other request "
        "decodes as without it.",
        parse=lambda text: parse_json_object(text, "speculative_config"),
    )
    # vLLM's shortcuts for three of its keys (each folded into speculative_config, where
    # the same key given twice is an error, as in vLLM).
    spec_method: str | None = config_field(
        None, "speculative_config's method (vLLM's shortcut), e.g. mtp, eagle3, ngram, suffix."
    )
    spec_model: str | None = config_field(
        None, "speculative_config's model (vLLM's shortcut): the draft model or head."
    )
    spec_tokens: int | None = config_field(
        None, "speculative_config's num_speculative_tokens (vLLM's shortcut)."
    )

    def __post_init__(self) -> None:
        spec = self._with_shortcuts()
        if spec is None:
            return
        _check_json_config("speculative_config", spec, _SPECULATIVE_KEYS)
        method = _speculative_method(spec)
        if method == "ngram" and spec.get("model") in _NGRAM_MODEL_NAMES:
            spec = {key: value for key, value in spec.items() if key != "model"}
        own = _SPECULATIVE_METHOD_KEYS[method]
        for other, keys in _SPECULATIVE_METHOD_KEYS.items():
            for key in keys:
                if key not in own and key in spec:
                    raise bad_value(
                        f"speculative_config.{key}", spec[key], f"is a key of method {other}"
                    )
        if method == "suffix":
            spec = _suffix_decoding_keys(spec)
        k = spec.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= 32:
            raise bad_value(
                "speculative_config.num_speculative_tokens", k, "must be an integer in [1, 32]"
            )
        _check_positive("disable_by_batch_size", spec.get("disable_by_batch_size"))
        if method == "ngram":
            spec = _ngram_sizes(spec)
        elif method in DRAFT_MODEL_METHODS:
            _check_draft_keys(spec, method)
        object.__setattr__(self, "speculative_config", {**spec, "method": method})

    def _with_shortcuts(self) -> dict[str, Any] | None:
        """``speculative_config`` with the ``--spec-*`` flags folded in (and cleared, so a
        ``replace`` does not fold them twice); ValueError for a key given both ways."""
        spec = self.speculative_config
        for flag, key, value in (
            ("--spec-method", "method", self.spec_method),
            ("--spec-model", "model", self.spec_model),
            ("--spec-tokens", "num_speculative_tokens", self.spec_tokens),
        ):
            if value is None:
                continue
            spec = dict(spec or {})
            if key in spec:
                raise ValueError(
                    f"{flag} and speculative_config.{key} are mutually exclusive (given "
                    f"{value!r} and {spec[key]!r})"
                )
            spec[key] = value
            object.__setattr__(self, flag.removeprefix("--").replace("-", "_"), None)
        return spec

    @property
    def enabled(self) -> bool:
        return self.speculative_config is not None

    @property
    def method(self) -> str | None:
        """``ngram``, ``suffix``, ``draft_model``, ``eagle``, ``eagle3`` or ``mtp``; None
        without speculative decoding."""
        return self.speculative_config["method"] if self.enabled else None

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative_config["num_speculative_tokens"] if self.enabled else 0

    @property
    def prompt_lookup_min(self) -> int:
        return self.speculative_config.get("prompt_lookup_min", 0) if self.enabled else 0

    @property
    def prompt_lookup_max(self) -> int:
        return self.speculative_config.get("prompt_lookup_max", 0) if self.enabled else 0

    @property
    def suffix_decoding_max_tree_depth(self) -> int:
        return self._suffix_decoding("suffix_decoding_max_tree_depth")

    @property
    def suffix_decoding_max_cached_requests(self) -> int:
        return self._suffix_decoding("suffix_decoding_max_cached_requests")

    @property
    def suffix_decoding_max_spec_factor(self) -> float:
        return self._suffix_decoding("suffix_decoding_max_spec_factor")

    @property
    def suffix_decoding_min_token_prob(self) -> float:
        return self._suffix_decoding("suffix_decoding_min_token_prob")

    def _suffix_decoding(self, key: str) -> int | float:
        """A suffix decoding key: its value for method suffix, vLLM's default otherwise."""
        spec = self.speculative_config or {}
        return spec.get(key, SUFFIX_DECODING_DEFAULTS[key])

    @property
    def disable_by_batch_size(self) -> int | None:
        """No drafts in a step with more running requests than this (None: any)."""
        return self.speculative_config.get("disable_by_batch_size") if self.enabled else None

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots a request needs past the tokens the target computes in a step (vLLM's
        ``num_lookahead_tokens``): a draft model writes its KV ahead, up to k positions
        past them (``vllm/v1/spec_decode/draft_model.py``); n-gram lookup and suffix
        decoding write none."""
        return self.num_speculative_tokens if self.uses_draft_model else 0

    @property
    def uses_draft_model(self) -> bool:
        """Whether a model in the runner proposes the drafts (a draft model, an EAGLE
        head), rather than n-gram lookup or suffix decoding in the scheduler."""
        return self.method in DRAFT_MODEL_METHODS

    def draft_model_name(self, target: ModelConfig) -> str:
        """The model the drafts come from: the ``model`` key; for ``mtp`` without one, the
        target (its checkpoint holds the MTP layer)."""
        return self.speculative_config.get("model") or target.model

    def draft_model_config(self, target: ModelConfig) -> ModelConfig:
        """The draft's ``ModelConfig``: the target's device, dtype, seed, load format and
        attention backend, with the draft's model, quantization (None: auto, as
        --quantization's default) and length, and no tokenizer or HF overrides of its own
        (vLLM's: a dict of --hf-overrides is the target's alone)."""
        spec = self.speculative_config
        quantization = spec.get("quantization")
        if self.method == "mtp" and quantization is None:  # the target's own layer
            quantization = target.quantization
        try:
            return replace(
                target,
                model=self.draft_model_name(target),
                # the target's revision is its own; mtp reads the target's files
                revision=target.revision if self.method == "mtp" else None,
                quantization=quantization,
                max_model_len=spec.get("max_model_len"),
                tokenizer=None,
                tokenizer_revision=None,
                served_model_name=None,
                hf_overrides=None,
                chat_template=None,
                logits_processors=None,
            )
        except ValueError as e:  # the pair is wrong, e.g. gguf with --load-format dummy
            raise bad_value("speculative_config.quantization", spec.get("quantization"),
                            f"does not fit the draft model ({e})") from None  # fmt: skip


def _check_positive(key: str, value: Any) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise bad_value(f"speculative_config.{key}", value, "must be an integer >= 1")


def _ngram_sizes(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with both n-gram sizes (vLLM's defaults: 5 and 5; one given, both it)."""
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    _check_positive("prompt_lookup_min", lo)
    _check_positive("prompt_lookup_max", hi)
    if lo is None and hi is None:
        lo = hi = 5
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    if lo > hi:
        raise bad_value(
            "speculative_config.prompt_lookup_min", lo, f"must be <= prompt_lookup_max={hi}"
        )
    return {**spec, "prompt_lookup_min": lo, "prompt_lookup_max": hi}


def _suffix_decoding_keys(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec`` with suffix decoding's keys checked, vLLM's defaults for those not given, and
    ``num_speculative_tokens`` the tree depth when not given (as vLLM: the method drafts as
    many tokens as the match allows, that key only caps them)."""
    spec = {**SUFFIX_DECODING_DEFAULTS, **spec}
    depth = spec["suffix_decoding_max_tree_depth"]
    _check_positive("suffix_decoding_max_tree_depth", depth)
    for key, ok, why in (
        ("suffix_decoding_max_cached_requests", lambda v: isinstance(v, int) and v >= 0,
         "must be an integer >= 0 (0: no global tree of past responses)"),
        ("suffix_decoding_max_spec_factor", lambda v: 0 <= v < float("inf"),
         "must be a finite number >= 0"),
        ("suffix_decoding_min_token_prob", lambda v: 0 <= v <= 1, "must be a number in [0, 1]"),
    ):  # fmt: skip
        value = spec[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or not ok(value):
            raise bad_value(f"speculative_config.{key}", value, why)
    for key in ("suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob"):
        spec[key] = float(spec[key])
    if spec.get("num_speculative_tokens") is None:
        if depth > 32:
            raise bad_value(
                "speculative_config.num_speculative_tokens",
                None,
                "must be given (an integer in [1, 32]) with suffix_decoding_max_tree_depth "
                f"{depth}: it defaults to the tree depth, here more than 32",
            )
        logging.getLogger(__name__).warning(
            "speculative_config.num_speculative_tokens defaults to %d for suffix decoding "
            "(suffix_decoding_max_tree_depth; it caps the drafts a step)",
            depth,
        )
        spec["num_speculative_tokens"] = depth
    return spec


def _check_draft_keys(spec: dict[str, Any], method: str) -> None:
    """A draft model's own keys, as far as they can be checked without its files (the
    vocabulary and the lengths are checked with the target's: ``check_draft_model``).
    ``mtp`` needs no ``model``: the target holds its layer."""
    model = spec.get("model")
    optional = method == "mtp" and model is None
    if not optional and (not isinstance(model, str) or not model):
        raise bad_value("speculative_config.model", model, "must be a non-empty name or path")
    quantization = spec.get("quantization")
    if quantization not in (None, *get_args(Quantization)):
        raise bad_value("speculative_config.quantization", quantization,
                        f"must be None or one of {get_args(Quantization)}")  # fmt: skip
    _check_positive("max_model_len", spec.get("max_model_len"))
    tp = spec.get("draft_tensor_parallel_size", 1)
    if tp != 1 or isinstance(tp, bool):
        raise bad_value(
            "speculative_config.draft_tensor_parallel_size", tp, "must be 1: one device"
        )


# --distributed-executor-backend (vLLM's): mp and uni are what an engine here is.
DistributedExecutorBackend = Literal["mp", "uni", "ray", "external_launcher"]
_EXECUTOR_REFUSALS = {
    "ray": "is not available: Ray is not a dependency of this engine",
    "external_launcher": "(a torchrun SPMD launch, one engine per torchrun rank) is not supported",
}
DataParallelBackend = Literal["mp", "ray"]  # --data-parallel-backend (vLLM's)


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is spread over devices: one device here (vLLM's flags, so launch
    commands that name the default run unchanged)."""

    tensor_parallel_size: int = config_field(
        1, "Devices a layer is split over: 1 (this engine runs on one device).", aliases=("-tp",)
    )
    pipeline_parallel_size: int = config_field(
        1, "Devices the layers are split over: 1 (this engine runs on one device).",
        aliases=("-pp",),
    )  # fmt: skip
    data_parallel_size: int = config_field(
        1, "Replicas of the model, each its own engine on its own device (vLLM's): on "
        "CUDA one GPU each; on the CPU each engine gets its share of the cores. A job's "
        "requests all go to the engine that holds its KV (vllm/v1/engine/dp_client.py).",
        aliases=("-dp",),
    )  # fmt: skip
    enable_expert_parallel: bool = config_field(
        False,
        "vLLM's: split a mixture of experts' experts over the tensor x data parallel "
        "devices instead of splitting each expert. Accepted either way: that group is one "
        "device here, so every expert stays on it, as vLLM does on one device.",
        aliases=("-ep",),
    )
    distributed_executor_backend: DistributedExecutorBackend | None = config_field(
        None,
        "vLLM's: how an engine runs its model's workers. mp and uni are accepted: an "
        "engine here is one process with its model on one device, what both are with one "
        "device. ray (not a dependency) and external_launcher (a torchrun SPMD launch) "
        "are refused.",
    )
    disable_custom_all_reduce: bool = config_field(
        False,
        "vLLM's: NCCL instead of its own all-reduce kernel between tensor-parallel devices. "
        "Accepted either way: with one device there is no all-reduce (as in vLLM on one GPU).",
    )
    max_parallel_loading_workers: int | None = config_field(
        None,
        "vLLM's: load the weights in batches of this many tensor-parallel workers. "
        "Accepted (an integer >= 1): one device here, so it changes nothing.",
    )
    data_parallel_size_local: int | None = config_field(
        None,
        "vLLM's: data-parallel engines on this node. Unset or --data-parallel-size: every "
        "engine runs here (this engine runs on one node).",
        aliases=("-dpl",),
    )
    data_parallel_start_rank: int | None = config_field(
        None, "vLLM's: this node's first data-parallel rank: 0 (or unset), the only node.",
        aliases=("-dpr",),
    )  # fmt: skip
    data_parallel_backend: DataParallelBackend = config_field(
        "mp",
        "vLLM's: how data-parallel engines are started: mp, processes on this node. ray is "
        "refused (not a dependency).",
        aliases=("-dpb",),
    )
    nnodes: int = config_field(1, "vLLM's: nodes of the deployment: 1.", aliases=("-n",))
    node_rank: int = config_field(0, "vLLM's: this node's index: 0.", aliases=("-r",))
    data_parallel_address: str | None = config_field(
        None,
        "vLLM's: the address other nodes reach the data-parallel head node at. Accepted "
        "and unused: every engine runs here and reaches the API servers over local IPC.",
        aliases=("-dpa",),
    )
    data_parallel_rpc_port: int | None = config_field(
        None,
        "vLLM's: the port engines on other nodes reach the head node at (1-65535). "
        "Accepted and unused: every engine runs here.",
        aliases=("-dpp",),
    )
    master_addr: str = config_field(
        "127.0.0.1",
        "vLLM's: torch.distributed's rendezvous address for --nnodes > 1. Accepted and "
        "unused: one node, and no process group between engines.",
    )
    master_port: int = config_field(
        29501,
        "vLLM's: torch.distributed's rendezvous port for --nnodes > 1 (1-65535). Accepted "
        "and unused: one node, and no process group between engines.",
    )
    headless: bool = config_field(
        False,
        "vLLM's: engines without an API server, for the other nodes of a multi-node "
        "deployment. Refused: this engine runs on one node, with its API servers.",
    )
    data_parallel_rank: int | None = config_field(
        None,
        "vLLM's: run one rank of an externally load-balanced deployment. Refused: run one "
        "server per replica behind the router (docs/router.md) instead.",
        aliases=("-dpn",),
    )
    data_parallel_external_lb: bool = config_field(
        False,
        "vLLM's: external load balancing over data-parallel ranks. Refused when on: run "
        "one server per replica behind the router (docs/router.md) instead.",
        aliases=("-dpe",),
    )
    data_parallel_hybrid_lb: bool = config_field(
        False,
        "vLLM's: one load balancer per node over its local ranks. Refused when on: run one "
        "server per replica behind the router (docs/router.md) instead.",
        aliases=("-dph",),
    )
    worker_cls: str = config_field(
        "auto",
        "vLLM's import path of the worker class that runs the model. Only auto is accepted: "
        "an engine here runs its model itself, with no worker class to replace.",
    )
    worker_extension_cls: str = config_field(
        "",
        "vLLM's import path of a class mixed into its workers (often RL weight syncing). "
        "Only empty is accepted: there is no worker class to extend; the weight sync has its "
        'own API (docs/serving.md, "RL weight sync").',
    )

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) != 1:
                raise bad_value(name, getattr(self, name), "must be 1: one device is supported")
        dp = self.data_parallel_size
        if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
            raise bad_value("data_parallel_size", dp, "must be an integer >= 1")
        for name in ("enable_expert_parallel", "disable_custom_all_reduce"):
            if not isinstance(getattr(self, name), bool):
                raise bad_value(name, getattr(self, name), "must be a bool")
        self._check_executor()
        self._check_one_node()
        self._check_no_external_lb()
        only(
            "worker_cls", self.worker_cls, ["auto"],
            "must be auto: an engine here runs its model itself, with no worker class to "
            "replace",
        )  # fmt: skip
        only(
            "worker_extension_cls", self.worker_extension_cls, [""],
            "must be empty: there is no worker class to extend; for RL weight syncing use "
            "the weight transfer API (docs/serving.md, \"RL weight sync\")",
        )  # fmt: skip

    def _check_executor(self) -> None:
        """--distributed-executor-backend, --max-parallel-loading-workers."""
        backend = self.distributed_executor_backend
        if backend in _EXECUTOR_REFUSALS:
            why = _EXECUTOR_REFUSALS[backend]
            raise bad_value(
                "distributed_executor_backend", backend,
                f"{backend!r} {why}: use mp or uni (an engine here is one process with its "
                "model on one device), or leave it unset",
            )  # fmt: skip
        if backend is not None and backend not in get_args(DistributedExecutorBackend):
            raise bad_value("distributed_executor_backend", backend, "must be mp or uni")
        workers = self.max_parallel_loading_workers
        if workers is not None and (
            isinstance(workers, bool) or not isinstance(workers, int) or workers < 1
        ):
            raise bad_value("max_parallel_loading_workers", workers, "must be an integer >= 1")

    def _check_one_node(self) -> None:
        """vLLM's multi-node data-parallel flags: only the values of one node, all of
        whose engines run here. The addresses and ports other nodes would connect to are
        then unused, so any (valid) value is accepted."""
        one_node = "this engine runs on one node, every data-parallel engine on it (-dp N)"
        if self.nnodes != 1:
            raise bad_value("nnodes", self.nnodes, f"must be 1: {one_node}")
        if self.node_rank != 0:
            raise bad_value("node_rank", self.node_rank, f"must be 0, the only node: {one_node}")
        local = self.data_parallel_size_local
        if local is not None and local != self.data_parallel_size:
            raise bad_value(
                "data_parallel_size_local", local,
                f"must be data_parallel_size ({self.data_parallel_size}) or unset: {one_node}; "
                "fewer here means the others run on other nodes",
            )  # fmt: skip
        if self.data_parallel_start_rank not in (None, 0):
            raise bad_value(
                "data_parallel_start_rank", self.data_parallel_start_rank,
                f"must be 0 or unset: {one_node}; a later start rank is another node's",
            )  # fmt: skip
        if self.data_parallel_backend != "mp":
            raise bad_value(
                "data_parallel_backend", self.data_parallel_backend,
                "must be mp: the engines are processes started on this node (Ray is not a "
                "dependency)",
            )  # fmt: skip
        if self.headless:
            raise bad_value(
                "headless", self.headless,
                "is not supported: it starts engines without an API server, for the other "
                f"nodes of a multi-node deployment; {one_node}, behind its API servers",
            )  # fmt: skip
        for name in ("data_parallel_rpc_port", "master_port"):
            port = getattr(self, name)
            if port is not None and (isinstance(port, bool) or not 1 <= port <= 65535):
                raise bad_value(name, port, "must be a port in 1-65535")

    def _check_no_external_lb(self) -> None:
        """vLLM's external and hybrid load balancing: refused, the router does that."""
        instead = (
            "run one server per replica behind the router (docs/router.md), or -dp N "
            "engines behind one server"
        )
        if self.data_parallel_rank is not None:
            raise bad_value(
                "data_parallel_rank", self.data_parallel_rank,
                "is not taken: it makes this server one rank of an externally load-balanced "
                f"deployment, which is not supported; {instead}",
            )  # fmt: skip
        for name in ("data_parallel_external_lb", "data_parallel_hybrid_lb"):
            if getattr(self, name):
                raise bad_value(
                    name, True,
                    f"must be off: external and hybrid load balancing are not supported; {instead}",
                )  # fmt: skip


LoRADtype = Literal["auto", "bfloat16", "float16"]  # --lora-dtype (vLLM's)


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's flags): each request may name one; a batch mixes adapters and
    the base model, every token's rows getting its own adapter's update
    (docs/lora.md)."""

    enable_lora: bool = config_field(
        False,
        "Serve LoRA adapters: offline a request's lora_request names one; the server serves "
        "each --lora-modules adapter under its own model name.",
    )
    max_loras: int = config_field(
        1, "Most distinct adapters in one batch: each holds a slot of device memory."
    )
    max_lora_rank: int = config_field(
        16, "Largest adapter rank accepted; every slot is sized for it."
    )
    max_cpu_loras: int | None = config_field(
        None,
        "Adapters kept read in host memory (default: max_loras), so a slot reloads them "
        "without reading their files again.",
    )

    lora_dtype: LoRADtype = config_field(
        "auto",
        "vLLM's dtype of the adapters' weights. Only auto (the model's dtype) is accepted: "
        "adapters always take the model's dtype here.",
    )
    fully_sharded_loras: bool = config_field(
        False,
        "vLLM's: shard the adapters' computation across tensor-parallel devices. Accepted "
        "either way: one device here, nothing to shard (vLLM's own behaviour with one GPU).",
    )
    default_mm_loras: dict[str, str] | None = config_field(
        None,
        "vLLM's JSON object of an adapter per modality, applied to requests with such "
        "inputs. Only unset or {} is accepted: a request gets an adapter only by naming it.",
        parse=lambda text: parse_json_object(text, "default_mm_loras"),
    )

    def __post_init__(self) -> None:
        only(
            "lora_dtype", self.lora_dtype, ["auto"],
            "must be auto: adapters take the model's dtype here",
        )  # fmt: skip
        if not isinstance(self.fully_sharded_loras, bool):
            raise bad_value("fully_sharded_loras", self.fully_sharded_loras, "must be a bool")
        only(
            "default_mm_loras", self.default_mm_loras, [None, {}],
            "must be unset or {}: there is no adapter by modality; a request gets an adapter "
            "only by naming it (docs/lora.md)",
        )  # fmt: skip
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise bad_value(name, value, "must be an integer >= 1")
        if self.max_lora_rank > 512:
            raise bad_value("max_lora_rank", self.max_lora_rank, "must be <= 512")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise bad_value(
                "max_cpu_loras", self.max_cpu_loras, f"must be >= max_loras={self.max_loras}"
            )

    @property
    def num_cpu_loras(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras


# --profiler-config's keys (vLLM's names), with their defaults.
PROFILER_DEFAULTS: dict[str, Any] = {
    "profiler": None,
    "torch_profiler_dir": "",
    "torch_profiler_with_stack": True,
    "torch_profiler_with_flops": False,
    "torch_profiler_use_gzip": True,
    "torch_profiler_record_shapes": False,
    "torch_profiler_with_memory": False,
}


@dataclass(frozen=True)
class ProfilerConfig:
    """torch.profiler traces on demand (vLLM's --profiler-config): POST /start_profile and
    /stop_profile (or LLM.start_profile / stop_profile) record the engine core's steps
    (CPU, and CUDA kernels on a GPU) and write a Chrome trace of them."""

    profiler_config: dict[str, Any] | None = config_field(
        None,
        'JSON object, vLLM\'s: {"profiler": "torch", "torch_profiler_dir": "/abs/dir"} and '
        "optionally torch_profiler_with_stack (true), torch_profiler_with_flops (false), "
        "torch_profiler_use_gzip (true), torch_profiler_record_shapes (false), "
        "torch_profiler_with_memory (false). Unset: no profiler and no profiling routes.",
        parse=lambda text: parse_json_object(text, "profiler_config"),
    )

    def __post_init__(self) -> None:
        spec = self.profiler_config
        if spec is None:
            return
        _check_json_config("profiler_config", spec, tuple(PROFILER_DEFAULTS))
        options = self.options
        if options["profiler"] not in (None, "torch"):
            raise bad_value(
                "profiler_config.profiler", options["profiler"], "must be 'torch' (or null)"
            )
        for key, default in PROFILER_DEFAULTS.items():
            if isinstance(default, bool) and not isinstance(options[key], bool):
                raise bad_value(f"profiler_config.{key}", options[key], "must be true or false")
        path = options["torch_profiler_dir"]
        if options["profiler"] == "torch" and (not isinstance(path, str) or not path):
            raise bad_value(
                "profiler_config.torch_profiler_dir", path, "is needed with profiler 'torch'"
            )
        if path and not Path(path).is_absolute():
            raise bad_value("profiler_config.torch_profiler_dir", path, "must be an absolute path")

    @property
    def options(self) -> dict[str, Any]:
        """Every key, the unset ones at their defaults."""
        return {**PROFILER_DEFAULTS, **(self.profiler_config or {})}

    @property
    def enabled(self) -> bool:
        return self.options["profiler"] == "torch"


HISTOGRAM_FAMILIES = (
    "request_latency", "time_to_first_token", "inter_token_latency", "iteration_tokens",
    "request_params_n", "request_tokens", "kv_cache_residency",
)  # fmt: skip


def _check_histogram_buckets(custom: Any) -> None:
    """--custom-histogram-buckets: ValueError naming the family and the bound at fault."""
    if custom is None:
        return
    name = "custom_histogram_buckets"
    if not isinstance(custom, dict):
        raise bad_value(name, custom, "must be a JSON object of bucket lists")
    for family, bounds in custom.items():
        if family == "request_num_preemptions":
            raise bad_value(
                f"{name}[{family!r}]", bounds, "is not supported: this server has no "
                "vllm:request_num_preemptions histogram",
            )  # fmt: skip
        if family not in HISTOGRAM_FAMILIES:
            raise bad_value(
                name, family, f"is not a bucket family; they are {list(HISTOGRAM_FAMILIES)}"
            )
        if not isinstance(bounds, list) or not bounds:
            raise bad_value(f"{name}[{family!r}]", bounds, "must be a non-empty list of bounds")
        for bound in bounds:
            if isinstance(bound, bool) or not isinstance(bound, int | float):
                raise bad_value(f"{name}[{family!r}]", bound, "must be a number")
            if not math.isfinite(bound) or bound <= 0:  # (inf and nan fail here)
                raise bad_value(f"{name}[{family!r}]", bound, "must be finite and greater than 0")
        if any(a >= b for a, b in itertools.pairwise(bounds)):
            raise bad_value(f"{name}[{family!r}]", bounds, "must be strictly increasing")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Optional engine metrics beyond the default Prometheus series (vLLM's
    ObservabilityConfig)."""

    kv_cache_metrics: bool = config_field(
        False,
        "Enable KV cache residency metrics (vLLM's): the histograms "
        "vllm:kv_block_lifetime_seconds, vllm:kv_block_idle_before_evict_seconds and "
        "vllm:kv_block_reuse_gap_seconds, from a sample of the KV cache's blocks "
        "(--kv-cache-metrics-sample). Needs prefix caching to see evictions.",
    )
    kv_cache_metrics_sample: float = config_field(
        0.01,
        "Fraction of KV cache blocks whose residency --kv-cache-metrics tracks, in (0, 1] "
        "(0.01: 1 percent of the blocks allocated).",
    )

    custom_histogram_buckets: dict[str, list[float]] | None = config_field(
        None,
        "JSON object, vLLM's: bucket bounds by family, e.g. '{\"request_latency\": [0.1, 1, "
        "10]}': strictly increasing, finite, positive; they replace the defaults of every "
        "histogram of the family (request_latency, time_to_first_token, "
        "inter_token_latency, iteration_tokens, request_params_n, request_tokens, "
        "kv_cache_residency). Each bucket is one more series per histogram.",
        parse=lambda text: parse_json_object(text, "custom_histogram_buckets"),
    )
    otlp_traces_endpoint: str | None = config_field(
        None,
        "Where OpenTelemetry traces go (vLLM's): an OTLP endpoint, gRPC unless "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf. Each finished request is one "
        "span, in the trace its traceparent header names (vllm/tracing.py). Needs "
        "pip install 'vllm-continuum[otel]'.",
    )
    collect_detailed_traces: str | None = config_field(
        None,
        "vLLM's per-module timings in each request's span (model, worker, all): not "
        "recorded by this engine, so any value is refused; the span carries the queue, "
        "prefill, decode and end-to-end latencies.",
    )

    show_hidden_metrics_for_version: str | None = config_field(
        None,
        "vLLM's: bring back the metrics it hid after deprecating them in the version after "
        "this one (e.g. 0.31). Any version is accepted and changes nothing: vLLM 0.32 hides "
        "none (its flag is read by no metric either), and this engine has none hidden.",
    )
    enable_mfu_metrics: bool = config_field(
        False,
        "vLLM's model FLOPs utilization metrics. Only off is accepted: this engine does not "
        "count a step's FLOPs.",
    )
    cudagraph_metrics: bool = config_field(
        False,
        "vLLM's CUDA graph metrics (padded tokens, dispatch modes). Only off is accepted: "
        "they are not collected here.",
    )
    enable_logging_iteration_details: bool = config_field(
        False,
        "vLLM's log line per engine step (its requests, tokens and CPU time). Only off is "
        "accepted: the engine logs no line per step (the throughput line: --disable-log-stats).",
    )

    def __post_init__(self) -> None:
        sample = self.kv_cache_metrics_sample
        if isinstance(sample, bool) or not isinstance(sample, int | float) or not 0 < sample <= 1:
            raise bad_value("kv_cache_metrics_sample", sample, "must be in (0, 1]")
        _check_histogram_buckets(self.custom_histogram_buckets)
        self._check_vllm_metrics_flags()
        endpoint = self.otlp_traces_endpoint
        if endpoint is not None:
            from vllm.tracing import is_otel_available

            if not isinstance(endpoint, str) or not endpoint:
                raise bad_value("otlp_traces_endpoint", endpoint, "must be a URL")
            if not is_otel_available():
                raise ValueError(
                    "--otlp-traces-endpoint needs OpenTelemetry's SDK and OTLP exporters: "
                    "pip install 'vllm-continuum[otel]'"
                )
        if self.collect_detailed_traces is not None:
            raise bad_value(
                "collect_detailed_traces",
                self.collect_detailed_traces,
                "is not supported: this engine records no per-module timings (each "
                "request's span has its queue, prefill, decode and end-to-end latencies)",
            )

    def _check_vllm_metrics_flags(self) -> None:
        """vLLM's metrics it hides or adds: none hidden here, the additions not collected."""
        version = self.show_hidden_metrics_for_version
        if version is not None:
            from packaging.version import InvalidVersion, Version

            try:
                Version(version)
            except (InvalidVersion, TypeError):
                raise bad_value(
                    "show_hidden_metrics_for_version", version, "must be a version, e.g. 0.31"
                ) from None
        refusals = {
            "enable_mfu_metrics": "model FLOPs utilization is not measured here (no FLOPs "
            "are counted per step)",
            "cudagraph_metrics": "CUDA graph metrics (padded tokens, dispatch modes) are not "
            "collected here",
            "enable_logging_iteration_details": "the engine logs no line per step; the "
            "throughput line is logged every VLLM_LOG_STATS_INTERVAL seconds",
        }
        for name, why in refusals.items():
            only(name, getattr(self, name), [False], f"must be off: {why}")


# --kv-events-config's keys (vLLM's names), with their defaults; "publisher" defaults to
# "zmq" when events are on, "null" otherwise.
KV_EVENTS_DEFAULTS: dict[str, Any] = {
    "enable_kv_cache_events": False,
    "publisher": None,
    "endpoint": "tcp://*:5557",
    "replay_endpoint": None,
    "buffer_steps": 10_000,
    "hwm": 100_000,
    "max_queue_size": 100_000,
    "topic": "",
}
_ZMQ_TRANSPORTS = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsConfig:
    """KV cache events (vLLM's --kv-events-config): each step's changes to the set of
    prefix-cache blocks the engine holds (stored, removed, all cleared; in the KV cache
    and in the host-memory tier) published on a ZeroMQ PUB socket in vLLM's msgpack
    format, for KV-aware routers."""

    kv_events_config: dict[str, Any] | None = config_field(
        None,
        'JSON object, vLLM\'s: {"enable_kv_cache_events": true} publishes on tcp://*:5557; '
        'optionally "publisher" ("zmq" or "null"), "endpoint" (a ZeroMQ address: bound when '
        'it has * or is ipc/inproc, else connected to), "replay_endpoint" (a ROUTER socket '
        'that resends missed batches), "buffer_steps" (10000 batches kept for replay), '
        '"hwm" (100000), "max_queue_size" (100000), "topic" (""). Unset: no events.',
        parse=lambda text: parse_json_object(text, "kv_events_config"),
    )

    def __post_init__(self) -> None:
        spec = self.kv_events_config
        if spec is None:
            return
        _check_json_config("kv_events_config", spec, tuple(KV_EVENTS_DEFAULTS))
        options = self.options
        if not isinstance(options["enable_kv_cache_events"], bool):
            raise bad_value(
                "kv_events_config.enable_kv_cache_events",
                options["enable_kv_cache_events"],
                "must be true or false",
            )
        if options["publisher"] not in ("zmq", "null"):
            raise bad_value(
                "kv_events_config.publisher", options["publisher"], "must be 'zmq' or 'null'"
            )
        for key in ("endpoint", "replay_endpoint"):
            value = options[key]
            if value is None and key == "replay_endpoint":
                continue
            if not isinstance(value, str) or not value.startswith(_ZMQ_TRANSPORTS):
                raise bad_value(
                    f"kv_events_config.{key}", value, f"must be a ZeroMQ address {_ZMQ_TRANSPORTS}"
                )
        for key, low in (("buffer_steps", 1), ("hwm", 0), ("max_queue_size", 1)):
            value = options[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise bad_value(f"kv_events_config.{key}", value, f"must be an integer >= {low}")
        if not isinstance(options["topic"], str):
            raise bad_value("kv_events_config.topic", options["topic"], "must be a string")

    @property
    def options(self) -> dict[str, Any]:
        """Every key, the unset ones at their defaults (the publisher resolved)."""
        options = {**KV_EVENTS_DEFAULTS, **(self.kv_events_config or {})}
        if options["publisher"] is None:
            options["publisher"] = "zmq" if options["enable_kv_cache_events"] is True else "null"
        return options

    @property
    def enabled(self) -> bool:
        """Events are recorded and published (vLLM: both the switch and a real publisher)."""
        options = self.options
        return options["enable_kv_cache_events"] is True and options["publisher"] == "zmq"


# --weight-transfer-config's backends: torch.distributed process groups between a trainer
# (rank 0) and the engine. gloo moves CPU tensors (any machine), nccl CUDA tensors.
WEIGHT_TRANSFER_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class WeightTransferConfig:
    """RL weight sync (vLLM's --weight-transfer-config): a trainer process pushes new weights
    into the running engine over a process group it opens with the engine
    (``vllm.distributed.weight_transfer``); the engine swaps them in between two steps."""

    weight_transfer_config: dict[str, Any] | None = config_field(
        None,
        'JSON object, vLLM\'s: {"backend": "gloo"} (CPU tensors, any machine) or '
        '{"backend": "nccl"} (CUDA tensors); no backend: nccl on a GPU, gloo on the CPU. '
        "Unset: no weight transfer (the update routes and methods answer 400).",
        parse=lambda text: parse_json_object(text, "weight_transfer_config"),
    )

    def __post_init__(self) -> None:
        spec = self.weight_transfer_config
        if spec is None:
            return
        _check_json_config("weight_transfer_config", spec, ("backend",))
        backend = spec.get("backend")
        if backend is not None and backend not in WEIGHT_TRANSFER_BACKENDS:
            raise bad_value(
                "weight_transfer_config.backend",
                backend,
                f"must be one of {list(WEIGHT_TRANSFER_BACKENDS)} (vLLM's ipc, sparse_nccl and "
                "the sharded backends are not built here)",
            )

    @property
    def enabled(self) -> bool:
        return self.weight_transfer_config is not None

    def backend_for(self, device_type: str) -> str:
        """The backend named, or the device's: nccl on CUDA, gloo elsewhere."""
        named = (self.weight_transfer_config or {}).get("backend")
        return named or ("nccl" if device_type == "cuda" else "gloo")


# --kv-transfer-config's connectors. Each moves a finished prefill's KV blocks from the
# instance that computed them (the producer) to the one that decodes (the consumer), over
# this engine's TCP transport (vllm/distributed/kv_transfer/). "NixlConnector" is vLLM's
# name for its P/D connector, taken so that vLLM's launch commands and its routers'
# kv_transfer_params protocol run unchanged; NIXL itself is not used.
KV_CONNECTORS = ("TcpConnector", "NixlConnector")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_TRANSFER_KEYS = (
    "kv_connector", "kv_role", "engine_id", "kv_ip", "kv_port", "kv_buffer_device",
    "kv_connector_extra_config", "kv_connector_module_path", "enable_permute_local_kv",
    "kv_load_failure_policy",
)  # fmt: skip
KV_TRANSFER_EXTRA_KEYS = ("abort_timeout_s", "fetch_timeout_s")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated prefill (vLLM's --kv-transfer-config): a producer instance computes a
    prompt's KV and holds it; a consumer instance fetches the blocks it lacks and decodes.
    A router or proxy carries ``kv_transfer_params`` between them (docs/serving.md)."""

    kv_transfer_config: dict[str, Any] | None = config_field(
        None,
        'JSON object, vLLM\'s: {"kv_connector": "TcpConnector", "kv_role": "kv_both"} (or '
        "\"NixlConnector\", vLLM's name: the same protocol, this engine's TCP transport); "
        'kv_role "kv_producer" (prefills), "kv_consumer" (decodes) or "kv_both"; optionally '
        '"kv_ip" (the address the block server binds and advertises, 127.0.0.1), "kv_port" '
        '(its port; unset: a free one), "engine_id", "kv_load_failure_policy" ("fail", '
        'vLLM\'s default, or "recompute"), "kv_connector_extra_config" ({"abort_timeout_s": '
        '480, "fetch_timeout_s": 60}). Unset: requests\' kv_transfer_params are a 400.',
        parse=lambda text: parse_json_object(text, "kv_transfer_config"),
    )

    def __post_init__(self) -> None:
        spec = self.kv_transfer_config
        if spec is None:
            return
        _check_json_config("kv_transfer_config", spec, KV_TRANSFER_KEYS)
        name = spec.get("kv_connector")
        if name not in KV_CONNECTORS:
            raise bad_value(
                "kv_transfer_config.kv_connector",
                name,
                f"must be one of {list(KV_CONNECTORS)} (vLLM's LMCache, Mooncake, P2pNccl, "
                "Offloading and Multi connectors are not built here; --kv-offloading-size is "
                "the host-memory tier)",
            )
        if spec.get("kv_role") not in KV_ROLES:
            role = spec.get("kv_role")
            raise bad_value("kv_transfer_config.kv_role", role, f"must be one of {list(KV_ROLES)}")
        policy = spec.get("kv_load_failure_policy", "fail")
        if policy not in ("fail", "recompute"):
            raise bad_value(
                "kv_transfer_config.kv_load_failure_policy", policy, "must be 'fail' or 'recompute'"
            )
        port = spec.get("kv_port")
        if port is not None and (
            isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
        ):
            raise bad_value("kv_transfer_config.kv_port", port, "must be a port number (0: any)")
        for key in ("kv_ip", "engine_id"):
            value = spec.get(key)
            if value is not None and (not isinstance(value, str) or not value):
                raise bad_value(f"kv_transfer_config.{key}", value, "must be a non-empty string")
        if spec.get("kv_buffer_device", "cpu") not in ("cpu", "cuda"):
            raise bad_value(
                "kv_transfer_config.kv_buffer_device", spec["kv_buffer_device"],
                "must be 'cpu' or 'cuda' (blocks travel through host memory either way)",
            )  # fmt: skip
        if spec.get("kv_connector_module_path") is not None:
            raise bad_value(
                "kv_transfer_config.kv_connector_module_path",
                spec["kv_connector_module_path"],
                "is not supported: connectors are built in",
            )
        if spec.get("enable_permute_local_kv", False) is not False:
            raise bad_value(
                "kv_transfer_config.enable_permute_local_kv",
                spec["enable_permute_local_kv"],
                "must be false (both sides share one KV layout)",
            )
        extra = spec.get("kv_connector_extra_config", {})
        _check_json_config("kv_transfer_config.kv_connector_extra_config", extra,
                           KV_TRANSFER_EXTRA_KEYS)  # fmt: skip
        for key in KV_TRANSFER_EXTRA_KEYS:
            value = extra.get(key)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int | float) or not value > 0
            ):
                raise bad_value(
                    f"kv_transfer_config.kv_connector_extra_config.{key}", value,
                    "must be a positive number of seconds",
                )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.kv_transfer_config is not None

    @property
    def options(self) -> dict[str, Any]:
        """Every key, the unset ones at their defaults."""
        spec = self.kv_transfer_config or {}
        extra = spec.get("kv_connector_extra_config") or {}
        return {
            "kv_connector": spec.get("kv_connector"),
            "kv_role": spec.get("kv_role"),
            "engine_id": spec.get("engine_id"),
            "kv_ip": spec.get("kv_ip") or "127.0.0.1",
            "kv_port": spec.get("kv_port") or 0,
            "kv_load_failure_policy": spec.get("kv_load_failure_policy", "fail"),
            # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT: a producer frees held blocks no
            # consumer fetched after this long.
            "abort_timeout_s": float(extra.get("abort_timeout_s", 480.0)),
            "fetch_timeout_s": float(extra.get("fetch_timeout_s", 60.0)),
        }

    @property
    def is_producer(self) -> bool:
        return self.enabled and self.options["kv_role"] in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.enabled and self.options["kv_role"] in ("kv_consumer", "kv_both")


@dataclass(frozen=True)
class VllmConfig:
    """All engine configs; each field's type is one group of CLI flags."""

    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    context_serve_config: ContextServeConfig = field(default_factory=ContextServeConfig)
    offload_config: OffloadConfig = field(default_factory=OffloadConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    speculative_config: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    profiler_config: ProfilerConfig = field(default_factory=ProfilerConfig)
    kv_events_config: KVEventsConfig = field(default_factory=KVEventsConfig)
    observability_config: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    weight_transfer_config: WeightTransferConfig = field(default_factory=WeightTransferConfig)
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)

    def __post_init__(self) -> None:
        if self.speculative_config.uses_draft_model:
            self.draft_model_config  # noqa: B018 - checked (and cached) now, not at load
        sizes, max_seqs = (
            self.model_config.cudagraph_capture_sizes,
            self.scheduler_config.max_num_seqs,
        )
        if sizes and not self.model_config.enforce_eager and sizes[0] > max_seqs:
            raise bad_value(
                "cudagraph_capture_sizes",
                list(sizes),
                f"has no size <= max_num_seqs={max_seqs} (a decode batch holds at most "
                "max_num_seqs sequences): nothing would be captured",
            )
        if self.speculative_config.enabled and self.model_config.is_pooling:
            raise ValueError("--speculative-config drafts tokens; --runner pooling makes none")
        if self.model_config.enable_prompt_embeds and (
            self.speculative_config.enabled or self.model_config.is_pooling
        ):
            raise ValueError(
                "--enable-prompt-embeds cannot be combined with --speculative-config or "
                "--runner pooling (drafts and poolers read token ids): drop one"
            )
        if self.model_config.logits_processors and self.model_config.is_pooling:
            raise ValueError("--logits-processors: a pooling model (--runner pooling) has none")
        if self.model_config.logprobs_mode.startswith("processed") and (
            self.speculative_config.enabled
        ):
            raise ValueError(
                "--logprobs-mode processed_* cannot be combined with --speculative-config "
                "(drafts are verified on the raw logits): use raw_logprobs or raw_logits"
            )
        if self.model_config.logits_processors and self.speculative_config.enabled:
            raise ValueError(  # vLLM refuses the pair too
                "--logits-processors cannot be combined with --speculative-config: drop one"
            )
        if self.scheduler_config.async_scheduling and self.speculative_config.enabled:
            # A draft is proposed from the tokens so far, which a step scheduled ahead of
            # the device's result does not have yet.
            raise ValueError(
                "--async-scheduling cannot be combined with --speculative-config: drop one"
            )
        if self.offload_config.enabled and not self.cache_config.enable_prefix_caching:
            # The tier finds blocks by their prefix hash: without one it would hold nothing,
            # and a policy would offload into nothing.
            raise ValueError(
                "--kv-offloading-size needs prefix caching (the tier finds blocks by their "
                "prefix hash): drop --no-enable-prefix-caching or --kv-offloading-size "
                "(--enable-prefix-caching is the default)"
            )
        if self.kv_transfer_config.enabled and not self.cache_config.enable_prefix_caching:
            # Blocks travel by their prefix hash, through the host-memory tier.
            raise ValueError(
                "--kv-transfer-config needs prefix caching (blocks travel by their prefix "
                "hash): drop --no-enable-prefix-caching"
            )
        if self.parallel_config.data_parallel_size > 1:
            if self.kv_events_config.enabled:
                endpoint = self.kv_events_config.options["endpoint"]
                if not endpoint.startswith(("tcp://", "ipc://")):
                    raise bad_value(
                        "kv_events_config.endpoint", endpoint,
                        "must be tcp:// or ipc:// with --data-parallel-size > 1 (rank i "
                        "publishes on the port plus i, or the path plus _i)",
                    )  # fmt: skip
        if self.kv_events_config.enabled and not self.cache_config.enable_prefix_caching:
            # The events name prefix-cache blocks: without prefix caching there are none.
            # (vLLM only warns and publishes nothing.)
            raise ValueError(
                "--kv-events-config needs prefix caching (its events name prefix-cache "
                "blocks): drop --no-enable-prefix-caching or the events"
            )

    @functools.cached_property
    def draft_model_config(self) -> ModelConfig | None:
        """The draft model's config (``--speculative-config``'s method draft_model), its
        files read once: ValueError naming ``speculative_config.model`` for a model not
        found or of another vocabulary (vLLM's rule: the target checks token ids of the
        draft's vocabulary), ``speculative_config.max_model_len`` for a length past the
        draft's or the target's. Its max_model_len is resolved: the key, else the shorter
        of the draft's own limit and the target's max_model_len. None for other methods."""
        spec = self.speculative_config
        if not spec.uses_draft_model:
            return None
        from vllm.model_executor.model_loader import get_model_config, hf_config_of
        from vllm.model_executor.model_loader import model_max_len as limit_of

        draft_config = spec.draft_model_config(self.model_config)
        draft = draft_config.model
        try:
            draft_hf = get_model_config(
                draft,
                None,
                draft_config.revision,
                draft_config.download_dir,
                draft_config.hf_token,
            )
        except (OSError, ValueError) as e:
            raise bad_value("speculative_config.model", draft, f"cannot be read: {e}") from None
        if spec.method == "mtp":
            from vllm.model_executor.models.mtp import mtp_head_class

            mtp_head_class(draft_hf).arch_from_hf(draft_hf)  # no MTP layer: ValueError
        target_vocab = _vocab_size(hf_config_of(self.model_config))
        draft_vocab = _vocab_size(draft_hf)
        if draft_vocab != target_vocab:
            raise bad_value(
                "speculative_config.model",
                draft,
                f"must have the target's vocabulary ({target_vocab} tokens), not {draft_vocab}",
            )
        target_len = self.scheduler_config.max_model_len
        # An EAGLE head drafts at any of the target's positions (vLLM raises its
        # max_position_embeddings to the target's length): no limit of its own.
        own = limit_of(draft_hf) if spec.method == "draft_model" else None
        asked = spec.speculative_config.get("max_model_len")
        if asked is None:
            length = target_len if own is None else min(own, target_len)
        elif asked > target_len or (own is not None and asked > own):
            raise bad_value(
                "speculative_config.max_model_len",
                asked,
                f"must be <= the target's max_model_len ({target_len}) and the draft's "
                f"longest context ({own})",
            )
        else:
            length = asked
        return replace(draft_config, max_model_len=length)


def model_architectures(model_config: ModelConfig) -> tuple[str, ...]:
    """The model's HF ``architectures`` (() when its config cannot be read: the loader
    says why). A .gguf model, the embedded one included, is a causal model: not read."""
    if model_config.model == DEFAULT_MODEL or model_config.model.endswith(".gguf"):
        return tuple((model_config.hf_overrides or {}).get("architectures") or ())
    from vllm.model_executor.model_loader import hf_config_of

    try:
        config = hf_config_of(model_config)
    except Exception:  # noqa: BLE001 - any unreadable config: loading reports it
        return ()
    return tuple(getattr(config, "architectures", None) or ())


def _vocab_size(hf_config) -> int | None:
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    return getattr(text, "vocab_size", None)
