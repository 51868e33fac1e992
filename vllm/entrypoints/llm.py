"""The offline API: ``LLM(model).generate(prompts, sampling_params)`` as in vLLM."""

from __future__ import annotations

import dataclasses
import logging
import weakref
from collections.abc import Sequence
from typing import Any

from vllm.engine.arg_utils import EngineArgs, UsageContext
from vllm.entrypoints.openai.protocol import NO_IMAGES, validate_messages
from vllm.entrypoints.score_utils import (
    ScoringModel,
    check_pairing,
    pair_scores,
    pair_token_ids,
    pairs,
    read_template,
)
from vllm.exceptions import VLLMValidationError
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.recurrent import has_recurrent_layers
from vllm.model_executor.model_loader import (
    default_sampling_params,
    get_model_config,
    model_max_len,
)
from vllm.multimodal.media import template_reads_parts
from vllm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    ClassificationOutput,
    ClassificationRequestOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from vllm.transformers_utils.chat_encodings import images_refused
from vllm.utils.gc_utils import freeze_gc_heap, maybe_attach_gc_debug_callback
from vllm.v1.engine import (
    EngineCoreOutput,
    EngineCoreRequest,
    EngineCoreRequestError,
    FinishReason,
)
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.processor import Processor
from vllm.v1.metrics.reader import EngineTotals, Metric

logger = logging.getLogger(__name__)

# A prompt: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids} /
# {"prompt_embeds": tensor} (--enable-prompt-embeds).
Prompt = str | list[int] | dict
Conversation = Sequence[dict]
_ENGINE_ARGS = {f.name for f in dataclasses.fields(EngineArgs)}


class LLM:
    """Runs the engine core in process. Keyword arguments are ``EngineArgs`` fields.

    ``generate`` and ``chat`` block until every request finished and return one
    ``RequestOutput`` per prompt, in input order.
    """

    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - _ENGINE_ARGS)
        if unknown:
            raise ValueError(f"unknown engine arguments {unknown}; see EngineArgs")
        args = EngineArgs(model=model, **kwargs)
        args.serve_speculators_head()
        hf_config = get_model_config(
            args.model, args.parsed("hf_overrides"), args.revision, args.download_dir,
            args.hf_token,
        )  # fmt: skip
        self.vllm_config = args.create_engine_config(
            model_max_len(hf_config, args.disable_sliding_window),
            UsageContext.LLM_CLASS,
            recurrent=has_recurrent_layers(hf_config),
        )
        if self.vllm_config.parallel_config.data_parallel_size > 1:
            raise ValueError(
                "data_parallel_size > 1: the offline LLM runs one engine in this process; "
                "`vllm serve -dp N` runs N engines behind one server"
            )
        maybe_attach_gc_debug_callback()  # before the engine: a bad VLLM_GC_DEBUG fails fast
        self.engine_core = EngineCore(self.vllm_config)
        # generate() steps the engine in this process: keep start-up's heap out of the
        # collections it would pause for (vllm/utils/gc_utils.py). Given back at shutdown,
        # or when this object is dropped without one.
        self._gc_freeze = freeze_gc_heap("LLM engine")
        self._thaw = weakref.finalize(self, self._gc_freeze.release)
        self.tokenizer = self.engine_core.tokenizer
        try:  # checks what the model folder must hold (a bad --mm-processor-kwargs)
            self.processor = Processor(
                self.vllm_config, self.tokenizer, self.engine_core.eos_token_id
            )
        except BaseException:
            self.shutdown()
            raise
        self.processor.set_kv_capacity(self.engine_core.num_gpu_blocks)
        from vllm.tracing import make_tracer

        self.tracer = make_tracer(self.vllm_config)  # --otlp-traces-endpoint: spans, no parent
        self.output_processor = OutputProcessor(
            self.tokenizer, self.vllm_config.scheduler_config.stream_interval, self.tracer
        )
        self._default_sampling = default_sampling_params(self.vllm_config.model_config)
        self._request_counter = 0
        self._totals = EngineTotals()  # get_metrics()
        self._scoring: ScoringModel | None = None  # score(): how the model scores

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges since this ``LLM`` was made, as vLLM's
        ``LLM.get_metrics``: ``Counter`` / ``Gauge`` / ``Vector`` objects named as on
        /metrics (without ``_total``), e.g. ``vllm:spec_decode_num_accepted_tokens`` and,
        per draft position, ``vllm:spec_decode_num_accepted_tokens_per_pos``."""
        labels = {"model_name": self.vllm_config.model_config.served_model_name
                  or self.vllm_config.model_config.model}  # fmt: skip
        k = self.vllm_config.speculative_config.num_speculative_tokens
        return self._totals.metrics(labels, k)

    def get_tokenizer(self):
        """The tokenizer; ``ValueError`` with ``skip_tokenizer_init=True`` (vLLM's)."""
        self.processor.require_tokenizer("get_tokenizer()", "skip_tokenizer_init")
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What ``generate`` and ``chat`` use when given no sampling params: vLLM's
        defaults under the model's generation config (``--generation-config``)."""
        return SamplingParams(**self._default_sampling)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for one prompt or a list (text, token ids, or a prompt dict).
        ``lora_request``: the LoRA adapter of every prompt, or one per prompt (None: the
        base model); needs ``enable_lora=True``."""
        if _is_single_prompt(prompts):
            prompts = [prompts]
        items = [(*_unpack_prompt(p), True, _cache_salt(p), _mm_data(p)) for p in prompts]
        return self._run(items, sampling_params, use_tqdm, lora_request)

    def embed(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of each prompt (needs ``runner="pooling"``, as vLLM's)."""
        results = self._pool(prompts, use_tqdm, lora_request, pooling_params, "embed")
        return [
            EmbeddingRequestOutput(r.request_id, r.prompt_token_ids, EmbeddingOutput(r.pooled))
            for r in results
        ]

    def classify(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[ClassificationRequestOutput]:
        """Each prompt's class probabilities (vLLM's): a classifier's (a
        ``*ForSequenceClassification`` model, or ``convert="classify"``) score head over
        the last token, softmaxed over the labels unless ``pooling_params`` turns the
        activation off (``use_activation=False``: the logits)."""
        results = self._pool(prompts, use_tqdm, lora_request, pooling_params, "classify")
        return [
            ClassificationRequestOutput(
                r.request_id, r.prompt_token_ids, ClassificationOutput(r.pooled)
            )
            for r in results
        ]

    def encode(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool = False,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_params: PoolingParams | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt pooled by the model's own task (vLLM's ``LLM.encode``): an
        embedding model's embeddings, a classifier's probabilities."""
        task = self.processor.pooling_task
        if task is None:
            raise VLLMValidationError(
                "encode needs a pooling model (--runner pooling): this one generates", "model"
            )
        results = self._pool(prompts, use_tqdm, lora_request, pooling_params, task)
        return [
            PoolingRequestOutput(r.request_id, r.prompt_token_ids, PoolingOutput(r.pooled))
            for r in results
        ]

    def _pool(
        self,
        prompts: Prompt | Sequence[Prompt],
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
        pooling_params: PoolingParams | None,
        task: str,
    ) -> list[RequestOutput]:
        """Run ``prompts`` through the pooling runner for ``task`` (the model's, else a
        ``VLLMValidationError`` naming ``model``)."""
        pooling_params = pooling_params or PoolingParams()
        if not isinstance(pooling_params, PoolingParams):
            raise VLLMValidationError(
                f"pooling_params must be a PoolingParams, got {pooling_params!r}",
                "pooling_params",
            )
        if pooling_params.task not in (None, task):
            raise VLLMValidationError(
                f"pooling_params.task is {pooling_params.task!r}; this call pools for {task!r}",
                "task",
            )
        if _is_single_prompt(prompts):
            prompts = [prompts]
        items = [(*_unpack_prompt(p), True, _cache_salt(p), _mm_data(p)) for p in prompts]
        params = pooling_params.to_sampling_params()
        return self._run(items, params, use_tqdm, lora_request, pooling=task)

    def start_profile(self) -> None:
        """--profiler-config (``LLM(profiler_config=...)``): record the engine's steps
        (vLLM's); ``ValueError`` without a profiler."""
        self.engine_core.profile(True)

    def stop_profile(self) -> None:
        """Stop recording and write the trace into the configured folder."""
        self.engine_core.profile(False)

    def score(
        self,
        data_1: Prompt | Sequence[Prompt],
        data_2: Prompt | Sequence[Prompt],
        use_tqdm: bool = False,
        lora_request: LoRARequest | None = None,
        pooling_params: PoolingParams | None = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's ``LLM.score``: ``data_1`` paired with ``data_2`` 1:1, 1:N or N:N, each
        pair scored as the server's ``/score`` does (``score_utils``). An embedding model
        gives the cosine similarity of the pair's embeddings; a classifier with one label
        (a cross-encoder) its output for the pair as one prompt (the sigmoid of the
        logit; ``pooling_params.use_activation=False``: the logit), the prompt rendered
        by ``chat_template`` (a path or the text; else ``LLM(chat_template=...)``'s) when
        there is one. ``VLLMValidationError`` for any other model."""
        model = self._scoring_model()
        first = [data_1] if _is_single_prompt(data_1) else list(data_1)
        second = [data_2] if _is_single_prompt(data_2) else list(data_2)
        check_pairing(first, second, ("data_1", "data_2"))
        if model.require() == "cross-encoder":
            return self._cross_encode(model, first, second, use_tqdm, lora_request,
                                      pooling_params, chat_template)  # fmt: skip
        if chat_template is not None:
            raise VLLMValidationError(
                "chat_template is a cross-encoder's: an embedding model embeds each text "
                "on its own",
                "chat_template",
            )
        embedded = self.embed([*first, *second], use_tqdm, lora_request, pooling_params)
        vectors = [e.outputs.embedding for e in embedded]
        scores = pair_scores(vectors[: len(first)], vectors[len(first) :])
        return [
            ScoringRequestOutput(
                f"{a.request_id}_{b.request_id}",
                a.prompt_token_ids + b.prompt_token_ids,
                ScoringOutput(score),
            )
            for (a, b), score in zip(
                pairs(embedded[: len(first)], embedded[len(first) :]), scores, strict=True
            )
        ]

    def _scoring_model(self) -> ScoringModel:
        if self._scoring is None:
            self._scoring = ScoringModel.of(self.vllm_config.model_config)
        return self._scoring

    def _cross_encode(
        self,
        model: ScoringModel,
        first: list[Prompt],
        second: list[Prompt],
        use_tqdm: bool,
        lora_request: LoRARequest | None,
        pooling_params: PoolingParams | None,
        chat_template: str | None,
    ) -> list[ScoringRequestOutput]:
        """Each pair as one prompt through the classifier, one engine batch."""
        for side, name in ((first, "data_1"), (second, "data_2")):
            if not all(isinstance(text, str) for text in side):
                raise VLLMValidationError(
                    f"{name}: a cross-encoder pairs texts (strings), not token ids or dicts",
                    name,
                )
        self.processor.require_tokenizer("score() with a cross-encoder", "skip_tokenizer_init")
        template = read_template(chat_template) if chat_template is not None else model.template
        prompts = [
            {"prompt_token_ids": pair_token_ids(self.tokenizer, a, b, template, None,
                                                 model.sep_token)}
            for a, b in pairs(first, second)
        ]  # fmt: skip
        results = self._pool(prompts, use_tqdm, lora_request, pooling_params, "classify")
        return [
            ScoringRequestOutput(r.request_id, r.prompt_token_ids, ScoringOutput(r.pooled[0]))
            for r in results
        ]

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
        tools: list | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        continue_final_message: bool = False,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Chat with one conversation (a list of messages) or a list of conversations;
        ``lora_request`` as ``generate``'s. ``continue_final_message`` (vLLM's): the
        model goes on with the last message (with ``add_generation_prompt=False``).
        ``mm_processor_kwargs``: the image processor's arguments for the messages'
        images, over the engine's (``LLM(mm_processor_kwargs=...)``).

        Messages are validated as the server validates them (``VLLMValidationError``)."""
        if not messages:
            raise VLLMValidationError("messages must not be empty", "messages")
        single = isinstance(messages[0], dict)
        conversations = [messages] if single else messages
        items = []
        for conversation in conversations:
            messages = validate_messages(conversation)
            urls = [url for m in messages for url in m.image_urls]
            # As the server: a template that reads a message's parts gets them typed
            # (it writes the images' placeholders); any other, text with placeholders.
            template = chat_template or getattr(self.processor.tokenizer, "chat_template", None)
            typed = bool(urls) and isinstance(template, str) and template_reads_parts(template)
            placeholder = self.processor.image_placeholder
            if urls and self.processor.chat_encoding is not None:
                raise VLLMValidationError(
                    images_refused(self.processor.chat_encoding_mode), "messages"
                )
            if urls and placeholder is None:
                raise VLLMValidationError(NO_IMAGES, "messages")
            text = self.processor.apply_chat_template(
                [m.for_template(placeholder, typed) for m in messages],
                chat_template,
                add_generation_prompt,
                tools,
                chat_template_kwargs,
                continue_final_message,
            )
            mm = {"mm_processor_kwargs": mm_processor_kwargs} if mm_processor_kwargs else {}
            if urls:
                mm["multi_modal_data"] = {
                    "image": [_load_chat_image(i, url) for i, url in enumerate(urls)]
                }
            # The template already wrote the special tokens (BOS etc.): add none.
            items.append((text, text, False, None, mm))
        return self._run(items, sampling_params, use_tqdm, lora_request)

    def beam_search(
        self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams, use_tqdm: bool = False
    ) -> list[BeamSearchOutput]:
        """vLLM's offline beam search (the server's ``use_beam_search``): each step runs
        every live beam of every prompt as one batch of one-token requests with the
        ``2 * beam_width`` top logprobs (``openai/beam_search.py``). Prompts as
        ``generate`` takes them; each output's sequences are best first."""
        from vllm.entrypoints.openai.beam_search import BeamSet

        if not isinstance(params, BeamSearchParams):
            raise VLLMValidationError(
                f"params must be a BeamSearchParams, got {params!r}", "params"
            )
        if _is_single_prompt(prompts):
            prompts = [prompts]
        eos = [self.processor.eos_token_id]
        searches = []
        for prompt in prompts:
            source = _unpack_prompt(prompt)[0]
            if _is_tensor(source):
                raise VLLMValidationError("beam search takes no prompt_embeds", "prompt_embeds")
            ids = self.processor.tokenize(source) if isinstance(source, str) else list(source)
            searches.append(
                BeamSet(ids, params.beam_width, eos, params.ignore_eos, params.length_penalty)
            )
        limit = self.processor.context_limit
        for step in range(params.max_tokens):
            live = [s for s in searches if s.beams and len(s.prompt_ids) + step < limit]
            if not live:
                break
            batch = [p for s in live for p in s.prompts()]
            step_params = [s.params() for s in live for _ in s.beams]
            outputs = iter(self.generate([{"prompt_token_ids": p} for p in batch], step_params,
                                         use_tqdm=use_tqdm))  # fmt: skip
            for s in live:
                s.grow([next(outputs).outputs[0].logprobs[0].top for _ in s.beams])
        results = []
        for s in searches:
            sequences = []
            for beam in s.best():
                keep = beam.text_tokens(params.include_stop_str_in_output)
                text = ""  # no text without a tokenizer (skip_tokenizer_init), as generate's
                if self.tokenizer is not None:
                    text = self.tokenizer.decode(s.prompt_ids + keep, skip_special_tokens=True)
                tokens = s.prompt_ids + beam.tokens
                sequences.append(BeamSearchSequence(tokens, beam.logprob, text, beam.finish_reason))
            results.append(BeamSearchOutput(sequences))
        return results

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode (``LLM(enable_sleep_mode=True)``, else ``ValueError``): level 1
        frees the KV cache and moves the weights to host memory (on the CPU they stay
        where they are); level 2 frees the weights too. The prefix cache is emptied.
        ``generate`` refuses (``ValueError``) until ``wake_up``."""
        self.engine_core.sleep(level)  # nothing runs between generate calls: none aborted

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Bring back ``tags`` ("weights", "kv_cache"; None: all): the weights from host
        memory or, after level 2, from the checkpoint; a KV cache of as many blocks as
        before. Returns whether the engine is fully awake."""
        return self.engine_core.wake_up(tags)

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    # -- RL weight sync (vLLM's RLOfflineMixin; docs/serving.md) --------------------------
    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        """Join the trainer's group: ``request`` is ``{"init_info": {...}}`` (vLLM's);
        blocks until the trainer joins (it runs in another thread or process)."""
        self.engine_core.init_weight_transfer_engine(_field(request, "init_info"))

    def shutdown_weight_transfer_engine(self) -> None:
        self.engine_core.shutdown_weight_transfer_engine()

    def start_weight_update(self) -> None:
        self.engine_core.start_weight_update()

    def update_weights(self, request: dict[str, Any]) -> None:
        """Receive a chunk of the round: ``request`` is ``{"update_info": {...}}``."""
        self.engine_core.update_weights(_field(request, "update_info"))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.engine_core.finish_weight_update(weight_version)

    def update_weight_version(self, new_version: str) -> None:
        self.engine_core.set_weight_version(new_version)

    def get_weight_version(self) -> str:
        return self.engine_core.get_weight_version()

    def compute_weight_checksums(self) -> dict[str, str]:
        return self.engine_core.compute_weight_checksums()

    def shutdown(self) -> None:
        self._gc_freeze.release()  # first: the engine's cycles can then be collected
        self.engine_core.shutdown()
        if getattr(self, "tracer", None) is not None:
            self.tracer.shutdown()

    def _run(
        self,
        items: list[tuple[str | list[int], str | None, bool, str | None, dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling: bool | str = False,
    ) -> list[RequestOutput]:
        """items: (prompt, prompt text for the output, add_special_tokens, cache_salt,
        the multimodal fields: ``_mm_data``); ``pooling``: the pooling task asked for
        (``Processor.process``'s), False to generate."""
        if lora_request is None or isinstance(lora_request, LoRARequest):
            lora_request = [lora_request] * len(items)
        if len(lora_request) != len(items):
            raise VLLMValidationError(
                f"lora_request must be one, or one per prompt ({len(items)}), "
                f"got {len(lora_request)}",
                "lora_request",
            )
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(items)
        if len(sampling_params) != len(items):
            raise ValueError(
                f"sampling_params must be one, or one per prompt ({len(items)}), "
                f"got {len(sampling_params)}"
            )
        # Validate everything before queueing anything: bad input loses nothing.
        batch: list[tuple[str, str | None, list[EngineCoreRequest]]] = []
        for (prompt, text, special, salt, mm), params, lora in zip(
            items, sampling_params, lora_request, strict=True
        ):
            # A tensor (prompt_embeds): Processor.process checks it; len() is its tokens.
            ids = prompt if _is_tensor(prompt) else self.processor.tokenize(prompt, special)
            if isinstance(params, SamplingParams):
                num = ids.shape[-2] if _is_tensor(ids) and ids.dim() > 1 else len(ids)
                params = self._offline_params(params, num)
            request_id = str(self._request_counter)
            self._request_counter += 1
            _, core_reqs = self.processor.process(
                ids, params, request_id, cache_salt=salt, lora_request=lora, pooling=pooling,
                **mm,
            )  # fmt: skip
            batch.append((request_id, text, core_reqs))
        self._add_to_engine(batch)
        return self._run_engine([request_id for request_id, _, _ in batch], use_tqdm)

    def _offline_params(self, params: SamplingParams, num_prompt_tokens: int) -> SamplingParams:
        params = params.clone()
        # Only final results are returned, so as in vLLM only those are built.
        params.output_kind = RequestOutputKind.FINAL_ONLY
        # Offline, max_tokens is a cap, not a promise (as in vLLM): one that does not fit
        # beside this prompt means "until the context limit". The server rejects it instead.
        max_tokens = params.max_tokens
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.processor.context_limit:
            params.max_tokens = None
        return params

    def _add_to_engine(self, batch: list[tuple[str, str | None, list[EngineCoreRequest]]]) -> None:
        if self.engine_core.is_sleeping():  # offline nothing could wake it: the run would hang
            raise ValueError("the engine is sleeping: call LLM.wake_up() first")
        added: list[str] = []
        try:
            for request_id, text, core_reqs in batch:
                self.output_processor.add_request(request_id, text, core_reqs)
                added.append(request_id)
                for r in core_reqs:
                    self.engine_core.add_request(r)
        except ValueError:
            # E.g. a prompt larger than the whole KV cache: withdraw the batch.
            for request_id in added:
                self.engine_core.abort_requests(self.output_processor.abort_request(request_id))
            raise

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(request_ids)) if use_tqdm else None
        try:
            while self.output_processor.has_unfinished_requests():
                if not self.engine_core.has_unfinished_requests():
                    raise RuntimeError("the engine core lost track of unfinished requests")
                outputs = self.engine_core.step()
                generated = sum(len(o.new_token_ids) for o in outputs.outputs)
                self._totals.record(outputs.scheduler_stats, generated)
                results, reqs_to_stop = self.output_processor.process_outputs(
                    outputs.outputs + _failed_outputs(outputs.errors), outputs.weight_version
                )
                if reqs_to_stop:  # ended on a stop string: the engine finishes them as stopped
                    self.engine_core.stop_requests(reqs_to_stop)
                for out in results:
                    if out.finished:
                        finished[out.request_id] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            # Interrupted (Ctrl-C) or failed: leave no request behind in the engine.
            for request_id in request_ids:
                self.engine_core.abort_requests(self.output_processor.abort_request(request_id))
            raise
        finally:
            if bar is not None:
                bar.close()
        return [finished[request_id] for request_id in request_ids]


def _failed_outputs(errors: list[EngineCoreRequestError]) -> list[EngineCoreOutput]:
    """Requests that failed inside a step finish with ``finish_reason == "error"`` (as in
    vLLM); the other prompts' results are kept."""
    for error in errors:
        logger.error("request %s failed: %s", error.request_id, error.message)
    return [EngineCoreOutput(e.request_id, [], finish_reason=FinishReason.ERROR) for e in errors]


def _is_single_prompt(prompts: Any) -> bool:
    if isinstance(prompts, str | dict):
        return True
    return isinstance(prompts, Sequence) and bool(prompts) and isinstance(prompts[0], int)


def _unpack_prompt(prompt: Prompt) -> tuple[str | list[int], str | None]:
    """(what to tokenize, the prompt text reported back)."""
    if isinstance(prompt, dict):
        if prompt.get("prompt_embeds") is not None:  # --enable-prompt-embeds: no text
            if prompt.get("prompt_token_ids") is not None or prompt.get("prompt") is not None:
                raise VLLMValidationError(
                    "a prompt dict takes prompt_embeds or prompt/prompt_token_ids, not both",
                    "prompt_embeds",
                )
            return prompt["prompt_embeds"], None
        if prompt.get("prompt_token_ids") is not None:
            return prompt["prompt_token_ids"], prompt.get("prompt")
        if prompt.get("prompt") is None:
            raise ValueError(f"prompt dict needs 'prompt' or 'prompt_token_ids', got {prompt!r}")
        prompt = prompt["prompt"]
    return prompt, prompt if isinstance(prompt, str) else None


def _is_tensor(prompt: Any) -> bool:
    """A prompt given as embeddings (``{"prompt_embeds": tensor}``), without importing
    torch here for the other prompts."""
    return type(prompt).__module__.startswith("torch") and hasattr(prompt, "shape")


def _load_chat_image(i: int, url: str):
    """Image ``i`` of a conversation (``load_image``: data and http(s) URLs; local files
    only through the server's --allowed-local-media-path)."""
    from vllm.multimodal.media import load_image

    try:
        return load_image(url)
    except ValueError as e:
        raise VLLMValidationError(
            f"image {i} of the messages could not be loaded: {e}", "messages"
        ) from e


def _mm_data(prompt: Prompt) -> dict[str, Any]:
    """A prompt dict's multimodal fields, vLLM's: ``multi_modal_data`` (``{"image": image
    or [images]}``) and ``mm_processor_kwargs`` (its image processor's arguments)."""
    if not isinstance(prompt, dict):
        return {}
    return {k: prompt[k] for k in ("multi_modal_data", "mm_processor_kwargs") if k in prompt}


def _cache_salt(prompt: Prompt) -> str | None:
    """A prompt dict's ``cache_salt`` (vLLM's): its blocks are shared only with prompts of
    the same salt."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise VLLMValidationError(
            f"cache_salt must be a non-empty string, got {salt!r}", "cache_salt"
        )
    return salt


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts")


def _field(request: Any, key: str) -> Any:
    """``request[key]`` of a weight-sync call's ``{key: ...}`` (vLLM's request shape), or
    its ``key`` attribute; ``ValueError`` naming ``key`` when it has none."""
    if isinstance(request, dict):
        if key not in request:
            raise ValueError(f"the request must be {{{key!r}: {{...}}}}, got keys {list(request)}")
        return request[key]
    if hasattr(request, key):
        return getattr(request, key)
    raise ValueError(f"the request must be {{{key!r}: {{...}}}}, got {type(request).__name__}")
