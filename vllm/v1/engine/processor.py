"""Front-end validation and tokenization: user input -> ``EngineCoreRequest``s."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.lora.peft import read_adapter_config
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.pooler import USE_ACTIVATION
from vllm.multimodal.processing import ImageInputProcessor, images_of
from vllm.sampling_params import SamplingParams
from vllm.transformers_utils.chat_encodings import auto_chat_encoding, get_chat_encoding
from vllm.transformers_utils.tokenizer import NO_TOKENIZER
from vllm.v1.engine import EngineCoreRequest
from vllm.v1.sample.logits_processor import (
    load_logits_processors,
    validate_logits_processors_parameters,
)


class Processor:
    """Turns prompts into validated engine-core requests; never truncates a prompt unless
    ``truncate_prompt_tokens`` asks.

    The one owner of the checks that need the model config (prompt token ids against the
    vocabulary, lengths against ``max_model_len``), for the server and ``LLM`` alike. Bad
    input raises ``VLLMValidationError`` naming the argument, before anything reaches the
    engine core; the chat messages themselves are validated by their caller (protocol.py).

    ``tokenizer`` None (``skip_tokenizer_init``): prompts must be token ids, and whatever
    needs text (chat templates, stop strings, bad words, grammars) is refused here.
    """

    def __init__(self, vllm_config: VllmConfig, tokenizer, eos_token_id: int | None) -> None:
        self.max_model_len = vllm_config.scheduler_config.max_model_len
        self.block_size = vllm_config.cache_config.block_size
        # The longest request (prompt plus output) served: max_model_len, or less when the
        # KV pool holds fewer tokens (set_kv_capacity, once the engine has sized it).
        self.context_limit = self.max_model_len
        self.tokenizer = tokenizer
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id = eos_token_id
        self.vocab_size = _vocab_size(vllm_config, tokenizer)
        max_logprobs = vllm_config.model_config.max_logprobs
        self.max_logprobs = self.vocab_size if max_logprobs == -1 else max_logprobs
        self._structured_outputs = None  # its validator, built by the first request using it
        # max_tokens for a request that sets none (the model's max_new_tokens, served by
        # the API server), cut to what the context leaves; None: until the context limit.
        self.default_max_tokens: int | None = None
        self.lora_config = vllm_config.lora_config
        # --runner pooling: what the model pools ("embed" or "classify"; None: it generates)
        self.pooling_task = vllm_config.model_config.pooling_task
        self.is_pooling = self.pooling_task is not None
        # --logits-processors: each class's validate_params judges every request here.
        self.logits_processor_classes = load_logits_processors(
            vllm_config.model_config.logits_processors
        )
        self._checked_adapters: set[tuple[int, str]] = set()  # configs read and accepted
        # A model that takes images: its processor (None: text only).
        self.images = ImageInputProcessor.for_model(vllm_config.model_config, tokenizer)
        self.speculative = vllm_config.speculative_config.enabled
        # --enable-prompt-embeds: the hidden size a prompt's embeddings must have (None:
        # the flag is off, and a prompt of embeddings is refused).
        self.embeds_hidden_size = (
            _hidden_size(vllm_config) if vllm_config.model_config.enable_prompt_embeds else None
        )
        # --tokenizer-mode deepseek_v32: chats rendered by the model's own Python encoding
        # (transformers_utils/chat_encodings), not the Jinja template; None: the template.
        # auto: the architecture's own encoding where it ships no template (DeepSeek-V3.2).
        self.chat_encoding_mode = vllm_config.model_config.tokenizer_mode
        if self.chat_encoding_mode == "auto" and tokenizer is not None:
            has_template = vllm_config.model_config.chat_template is not None or bool(
                getattr(tokenizer, "chat_template", None)
            )
            if not has_template:  # the config read only then
                self.chat_encoding_mode = auto_chat_encoding(_architectures(vllm_config)) or "auto"
        self.chat_encoding = get_chat_encoding(self.chat_encoding_mode)

    @property
    def image_placeholder(self) -> str | None:
        """The text that stands for one image in a prompt (LLaVA's ``<image>``); None when
        the model takes no images."""
        return None if self.images is None else self.images.placeholder

    def set_kv_capacity(self, num_gpu_blocks: int) -> None:
        """The engine's KV pool: a request that cannot fit it is refused (a 400 naming the
        field), never cut at the pool's size (the null block holds no tokens)."""
        capacity = (num_gpu_blocks - 1) * self.block_size
        self.context_limit = min(self.max_model_len, capacity)

    @property
    def structured_outputs(self):
        """The ``StructuredOutputValidator`` (checks grammars with this tokenizer)."""
        if self._structured_outputs is None:
            from vllm.v1.structured_output import StructuredOutputValidator

            self._structured_outputs = StructuredOutputValidator(
                self.tokenizer, self.vocab_size, self.eos_token_id
            )
        return self._structured_outputs

    async def check_structured_outputs(self, params: SamplingParams) -> None:
        """The grammar check of ``process``, awaitable: it compiles in the grammar thread
        (the event loop goes on) within a time budget. Then pass
        ``structured_outputs_checked=True`` to ``process``."""
        so = getattr(params, "structured_outputs", None)
        if so is not None:
            self.require_tokenizer("structured outputs", "structured_outputs")
            await self.structured_outputs.validate_async(so)

    def require_tokenizer(self, what: str, param: str) -> None:
        """``VLLMValidationError`` naming ``param`` when no tokenizer is loaded."""
        if self.tokenizer is None:
            raise VLLMValidationError(f"{what} cannot be used: {NO_TOKENIZER}", param)

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list | None = None,
        template_kwargs: dict[str, Any] | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The conversation (validated messages) as prompt text, holding its own special
        tokens; ``template_kwargs``: more variables for the template (vLLM's
        ``chat_template_kwargs``). ``continue_final_message`` (vLLM's): the text ends
        inside the last message, left open for the model to go on with (an assistant
        turn's start given by the client); it excludes ``add_generation_prompt``."""
        if continue_final_message and add_generation_prompt:
            raise VLLMValidationError(
                "continue_final_message and add_generation_prompt cannot both be true: set "
                "add_generation_prompt to false to continue the last message",
                "continue_final_message",
            )
        self.require_tokenizer("chat messages (the chat template)", "messages")
        if self.chat_encoding is not None:
            if chat_template is not None:
                raise VLLMValidationError(
                    f"chat_template cannot be used with --tokenizer-mode "
                    f"{self.chat_encoding_mode}: its chats are rendered by the model's own "
                    "encoding, not a Jinja template",
                    "chat_template",
                )
            return self.chat_encoding(
                list(messages), tools, add_generation_prompt, continue_final_message,
                template_kwargs,
            )  # fmt: skip
        if chat_template is None and not getattr(self.tokenizer, "chat_template", None):
            raise VLLMValidationError(
                "chat_template is required: the tokenizer has none", "chat_template"
            )
        return self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
            continue_final_message=continue_final_message,
            **(template_kwargs or {}),
        )

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``prompt`` (text, or token ids checked against the vocabulary)."""
        if isinstance(prompt, str):
            if not prompt:
                raise VLLMValidationError("prompt must not be empty", "prompt")
            if self.tokenizer is None:
                raise VLLMValidationError(
                    f"text prompts cannot be used: {NO_TOKENIZER}; pass token ids "
                    "(prompt_token_ids, or a list of ints as the prompt)",
                    "prompt",
                )
            # Chat-templated text already holds its special tokens: pass False for it.
            return self._encode(prompt, add_special_tokens)
        if not isinstance(prompt, Sequence):
            raise VLLMValidationError(
                f"prompt must be a string or a list of token ids, got {prompt!r}", "prompt"
            )
        ids = list(prompt)
        if not ids:
            raise VLLMValidationError("prompt must not be empty", "prompt")
        if any(isinstance(t, bool) or not isinstance(t, int) for t in ids) or not all(
            0 <= t < self.vocab_size for t in ids
        ):
            raise VLLMValidationError(
                f"prompt token ids must be integers in [0, {self.vocab_size})", "prompt"
            )
        return ids

    def check_prompt_embeds(self, embeds: Any) -> torch.Tensor:
        """A prompt's embeddings as the engine takes them: (num_tokens, hidden_size) on the
        CPU, floating point (a leading batch dimension of 1 is dropped, as vLLM does);
        ``VLLMValidationError`` naming ``prompt_embeds`` otherwise, or without
        ``--enable-prompt-embeds``."""
        if self.embeds_hidden_size is None:
            raise VLLMValidationError(
                "prompt_embeds cannot be used: the server was not started with "
                "--enable-prompt-embeds (LLM(enable_prompt_embeds=True) offline)",
                "prompt_embeds",
            )
        if not isinstance(embeds, torch.Tensor):
            raise VLLMValidationError(
                f"prompt_embeds must be a torch.Tensor, got {type(embeds).__name__}",
                "prompt_embeds",
            )
        if embeds.is_sparse or embeds.layout != torch.strided:
            raise VLLMValidationError("prompt_embeds must be a dense tensor", "prompt_embeds")
        if embeds.dim() == 3 and embeds.shape[0] == 1:
            embeds = embeds.squeeze(0)
        if embeds.dim() != 2 or embeds.shape[0] == 0:
            raise VLLMValidationError(
                "prompt_embeds must be of shape (num_tokens, hidden_size) with num_tokens "
                f">= 1, got {tuple(embeds.shape)}",
                "prompt_embeds",
            )
        if embeds.shape[1] != self.embeds_hidden_size:
            raise VLLMValidationError(
                f"prompt_embeds hidden size {embeds.shape[1]} does not match the model's "
                f"hidden_size {self.embeds_hidden_size}",
                "prompt_embeds",
            )
        if not embeds.is_floating_point() or embeds.dtype == torch.float64:
            # float64 is no model's dtype; an integer tensor is token ids sent by mistake.
            if embeds.is_floating_point():
                embeds = embeds.float()
            else:
                raise VLLMValidationError(
                    f"prompt_embeds must be floating point, got {embeds.dtype}", "prompt_embeds"
                )
        if not bool(torch.isfinite(embeds).all()):
            raise VLLMValidationError("prompt_embeds holds NaN or infinity", "prompt_embeds")
        # On the CPU and contiguous: pickled to the engine, hashed for the prefix cache.
        return embeds.detach().to("cpu").contiguous()

    def _check_embeds_request(
        self, params: SamplingParams, lora_request: LoRARequest | None, mm: Any, pooling: Any
    ) -> None:
        """What a prompt of embeddings cannot be combined with (its token ids are
        unknown: placeholders stand in for them)."""
        refusals = (
            (lora_request is not None, "lora_request", "a LoRA adapter"),
            (bool(mm), "multi_modal_data", "images"),
            (bool(pooling), "prompt_embeds", "pooling"),
            (params.prompt_logprobs is not None, "prompt_logprobs", "prompt logprobs"),
            (params.repetition_penalty != 1.0, "repetition_penalty", "a repetition penalty "
             "(it reads the prompt's token ids)"),
        )  # fmt: skip
        for refused, param, what in refusals:
            if refused:
                raise VLLMValidationError(f"prompt_embeds cannot be combined with {what}", param)

    def _truncate(self, ids: list[int], params: SamplingParams) -> list[int]:
        """``truncate_prompt_tokens`` of the prompt's tokens (-1: ``max_model_len``): its
        last ones, or its first with ``truncation_side`` "right" (vLLM's)."""
        k = params.truncate_prompt_tokens
        if k is None:
            return ids
        if k == -1:
            k = self.max_model_len
        if k > self.max_model_len:
            raise VLLMValidationError(
                f"truncate_prompt_tokens value ({k}) is greater than max_model_len "
                f"({self.max_model_len}). Please request a smaller truncation size.",
                "truncate_prompt_tokens",
                k,
            )
        return ids[:k] if params.truncation_side == "right" else ids[-k:]

    def bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as vLLM derives them: the word without its leading
        whitespace, and with one leading space where that tokenizes to another first token
        of the same length (the word in the middle of a text)."""
        out: list[list[int]] = []
        for word in words:
            bare = self._encode(word.lstrip(), add_special_tokens=False)
            out.append(bare)
            spaced = self._encode(" " + word.lstrip(), add_special_tokens=False)
            if spaced and spaced[0] != bare[0] and len(spaced) == len(bare):
                out.append(spaced)
        return out

    def _encode(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except TypeError:
            # The fast tokenizer's opaque TypeError for text that is not valid Unicode (a
            # lone UTF-16 surrogate, as JSON's "\ud800" decodes): say what is wrong.
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:
                raise VLLMValidationError(
                    f"prompt is not valid Unicode text: {e.reason} at position {e.start}",
                    "prompt",
                ) from e
            raise

    def process(
        self,
        prompt: str | list[int] | torch.Tensor,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
        arrival_wall_time: float | None = None,
        structured_outputs_checked: bool = False,
        lora_request: LoRARequest | None = None,
        pooling: bool | str = False,
        multi_modal_data: dict[str, Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> tuple[str, list[EngineCoreRequest]]:
        """Validate and fan out: ``(request_id, [EngineCoreRequest, ...])``.

        n > 1 gives n requests ``f"{i}_{request_id}"``, each with n = 1 and, when the
        request is seeded, seed + i (as vLLM does), so every sample differs but the set
        is reproducible. The grammar of ``structured_outputs`` is checked here (compiled
        with the tokenizer, synchronously) unless ``check_structured_outputs`` did it.
        ``prompt`` a tensor: the prompt's embeddings (``check_prompt_embeds``; needs
        --enable-prompt-embeds).
        """
        if not isinstance(params, SamplingParams):
            raise VLLMValidationError(
                f"sampling_params must be a SamplingParams, got {params!r}", "sampling_params"
            )
        self._check_lora(lora_request)
        self._check_pooling_task(pooling, params)
        self._check_logprobs(params)
        validate_logits_processors_parameters(self.logits_processor_classes, params)
        self._check_needs_tokenizer(params)
        if params.structured_outputs is not None and not structured_outputs_checked:
            # A bad grammar is a 400 here, never an engine error or unconstrained output.
            self.structured_outputs.validate(params.structured_outputs)
        images = images_of(multi_modal_data)
        if mm_processor_kwargs is not None:
            if self.images is None:
                raise VLLMValidationError("this model takes no images", "mm_processor_kwargs")
            mm_processor_kwargs = self.images.request_kwargs(mm_processor_kwargs)
        embeds = None
        if isinstance(prompt, torch.Tensor):  # --enable-prompt-embeds
            self._check_embeds_request(params, lora_request, multi_modal_data, pooling)
            embeds = self._truncate(self.check_prompt_embeds(prompt), params)
            ids = [0] * embeds.shape[0]  # placeholders, as vLLM's
        else:
            ids = self.tokenize(prompt, add_special_tokens)
        features = None
        if images:
            ids, features = self._expand_images(ids, images, params, mm_processor_kwargs)
        ids = self._truncate(ids, params) if embeds is None else ids
        self._check_length(ids, params)
        if params.bad_words:
            params.bad_words_token_ids = self.bad_words_token_ids(params.bad_words)
        if params.thinking_token_budget is not None and not params.thinking_end_token_ids:
            raise VLLMValidationError(
                "thinking_token_budget needs the token ids that end the reasoning: the server "
                "fills them from --reasoning-parser; offline, set thinking_end_token_ids",
                "thinking_token_budget",
            )
        if params.max_tokens is None and self.default_max_tokens is not None:
            left = self.context_limit - len(ids)
            params.max_tokens = max(min(self.default_max_tokens, left), params.min_tokens)
        request_id = request_id or uuid.uuid4().hex
        arrival_wall_time = time.time() if arrival_wall_time is None else arrival_wall_time
        children = []
        for i in range(params.n):
            if params.n == 1:
                # Nothing here mutates it, and the engine core gets its own copy (pickled
                # to its process, or cloned by LLM): a deepcopy per request is waste.
                child = params
            else:
                child = params.clone()
                child.n = 1
                if params.seed is not None:
                    child.seed = params.seed + i
                if i > 0:  # the prompt is the same: the first sample computes its logprobs
                    child.prompt_logprobs = None
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(
                EngineCoreRequest(
                    child_id,
                    ids,
                    child,
                    self.eos_token_id,
                    arrival_wall_time,
                    priority,
                    cache_salt,
                    lora_request,
                    mm_features=features,
                    prompt_embeds=embeds,
                )  # fmt: skip
            )
        return request_id, children

    def _expand_images(
        self, ids: list[int], images: list, params: SamplingParams, kwargs: dict | None
    ) -> tuple[list[int], list]:
        """The prompt with each image's placeholder expanded, and its images' features;
        ``kwargs``: the request's image-processor arguments (checked), over the server's."""
        if self.images is None:
            raise VLLMValidationError("this model takes no images", "multi_modal_data")
        if self.speculative:
            raise VLLMValidationError(
                "images are not served with speculative decoding (--speculative-config)",
                "multi_modal_data",
            )
        if params.truncate_prompt_tokens is not None:
            raise VLLMValidationError(
                "truncate_prompt_tokens cannot be used with images (it could cut one)",
                "truncate_prompt_tokens",
            )
        try:
            return self.images.process(ids, images, kwargs)
        except VLLMValidationError:
            raise
        except Exception as e:  # the image processor's own failures on this image
            raise VLLMValidationError(
                f"the image could not be processed: {e}", "multi_modal_data"
            ) from e

    def _check_needs_tokenizer(self, params: SamplingParams) -> None:
        """Without a tokenizer, the parameters that only work on text are refused (vLLM
        ignores stop strings then; a request that relies on them must not run unbounded)."""
        if self.tokenizer is None:
            if params.stop:
                raise VLLMValidationError(
                    f"stop strings cannot be used: {NO_TOKENIZER}; stop_token_ids can", "stop"
                )
            if params.bad_words:
                self.require_tokenizer("bad_words", "bad_words")
            if params.structured_outputs is not None:
                self.require_tokenizer("structured outputs", "structured_outputs")

    def _check_logprobs(self, params: SamplingParams) -> None:
        """Logprobs within ``--max-logprobs``; -1 (the whole vocabulary, vLLM's) becomes
        the vocabulary's size in ``params``."""
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value == -1:
                value = self.vocab_size
                setattr(params, name, value)
            if value is not None and value > self.max_logprobs:
                raise VLLMValidationError(
                    f"{name} must be at most {self.max_logprobs} (the server's "
                    f"--max-logprobs), got {value}",
                    name,
                )

    def _check_pooling_task(self, pooling: bool | str, params: SamplingParams) -> None:
        """The request's task (``pooling``: False to generate, "embed" or True, or
        "classify") is the model's; a pooling request's ``use_activation`` a bool."""
        wanted = "embed" if pooling is True else (pooling or None)
        if wanted not in (None, "embed", "classify"):
            raise ValueError(f"pooling must be a bool, 'embed' or 'classify', got {pooling!r}")
        if wanted != self.pooling_task:
            raise VLLMValidationError(_POOLING_REFUSALS[self.pooling_task, wanted], "model")
        value = (params.extra_args or {}).get(USE_ACTIVATION)
        if wanted is not None and value is not None and not isinstance(value, bool):
            raise VLLMValidationError(
                f"use_activation must be a bool, got {value!r}", "use_activation", value
            )

    def _check_lora(self, lora_request: LoRARequest | None) -> None:
        """A LoRA request needs --enable-lora and an adapter the engine can apply (its
        config is read here; its weights when a slot loads them)."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise VLLMValidationError(
                f"lora_request must be a LoRARequest, got {lora_request!r}", "lora_request"
            )
        if not self.lora_config.enable_lora:
            raise VLLMValidationError(
                f"LoRA adapter {lora_request.lora_name!r} requested but LoRA is not enabled "
                "(--enable-lora)",
                "lora_request",
            )
        key = (lora_request.lora_int_id, lora_request.lora_path)
        if key in self._checked_adapters:
            return
        try:
            read_adapter_config(lora_request.lora_path, self.lora_config.max_lora_rank)
        except ValueError as e:
            raise VLLMValidationError(str(e), "lora_request") from e
        if len(self._checked_adapters) >= 1024:  # bounded: ids are the caller's to invent
            self._checked_adapters.clear()
        self._checked_adapters.add(key)

    @property
    def _limit_text(self) -> str:
        """vLLM's wording for max_model_len; the pool's when it is the tighter bound."""
        if self.context_limit == self.max_model_len:
            limit = self.max_model_len
            return f"This model's maximum context length (max_model_len) is {limit} tokens."
        return (
            f"The KV cache holds at most {self.context_limit} tokens a request (less than "
            f"max_model_len {self.max_model_len})."
        )

    def _check_length(self, ids: list[int], params: SamplingParams) -> None:
        # The prompt plus at least one generated token must fit. A max_tokens past the
        # context is capped at what is left, as vLLM does (its get_max_tokens): the output
        # ends with finish_reason "length" there (agents such as Claude Code ask for 32k
        # tokens whatever the model's context). The limit is max_model_len, or the KV pool
        # when it holds less.
        limit, num_prompt = self.context_limit, len(ids)
        if num_prompt + 1 > limit:
            raise VLLMValidationError(
                f"{self._limit_text} However, the prompt has {num_prompt} tokens, which "
                "leaves no room for a generated token. Please reduce the length of the prompt.",
                "prompt",
            )
        if params.min_tokens and num_prompt + params.min_tokens > limit:
            raise VLLMValidationError(
                f"min_tokens {params.min_tokens} plus the {num_prompt}-token prompt exceed "
                f"the limit of {limit} tokens a request",
                "min_tokens",
                params.min_tokens,
            )
        if params.max_tokens is not None and num_prompt + params.max_tokens > limit:
            params.max_tokens = limit - num_prompt
        for name, ids in (
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", params.logit_bias or ()),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ):
            over = {t for t in ids if t >= self.vocab_size}
            if over:
                raise VLLMValidationError(
                    f"{name}: token ids {sorted(over)} are outside the vocabulary "
                    f"(size {self.vocab_size})",
                    name,
                )


_EMBEDS = "this model serves embeddings (--runner pooling): /v1/embeddings, /score, /rerank, "
_CLASSIFIES = (
    "this model is a classifier (--runner pooling, --convert classify): /classify, /score "
    "and /rerank (one label), "
)
# (the model's task, the request's) -> why it is refused (None: generation).
_POOLING_REFUSALS = {
    ("embed", None): _EMBEDS + "/pooling, LLM.embed",
    ("classify", None): _CLASSIFIES + "/pooling, LLM.classify; it generates no text",
    (None, "embed"): "embeddings and scores need a model served with --runner pooling",
    ("classify", "embed"): _CLASSIFIES + "/pooling, LLM.classify; embeddings need an "
    "embedding model (--convert embed)",
    (None, "classify"): "classification needs a classifier: a *ForSequenceClassification "
    "model, or --convert classify (its checkpoint holding a score head)",
    ("embed", "classify"): _EMBEDS + "LLM.embed; classification needs a classifier "
    "(a *ForSequenceClassification model, or --convert classify)",
}


def _architectures(vllm_config: VllmConfig) -> list[str]:
    """The served checkpoint's HF ``architectures`` ([] when its config cannot be read)."""
    from vllm.model_executor.model_loader import hf_config_of

    try:
        config = hf_config_of(vllm_config.model_config)
    except Exception:  # noqa: BLE001 (only auto's choice of encoding reads it: none then)
        return []
    return list(getattr(config, "architectures", None) or [])


def _vocab_size(vllm_config: VllmConfig, tokenizer) -> int:
    """The ids a prompt may hold: the tokenizer's, else (no tokenizer) the model's."""
    if tokenizer is not None:
        return len(tokenizer)
    from vllm.model_executor.model_loader import hf_config_of

    config = hf_config_of(vllm_config.model_config)  # a multimodal one's: its text model's
    return (config.get_text_config() if hasattr(config, "get_text_config") else config).vocab_size


def _hidden_size(vllm_config: VllmConfig) -> int:
    """The model's hidden size: the width of the embeddings its first layer reads."""
    from vllm.model_executor.model_loader import hf_config_of

    config = hf_config_of(vllm_config.model_config)
    return (config.get_text_config() if hasattr(config, "get_text_config") else config).hidden_size
