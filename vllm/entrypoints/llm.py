"""The offline API: ``LLM(model).generate(prompts, sampling_params)`` as in vLLM."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_eos_token_id, get_model_config
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.v1.engine.core import EngineCore
from vllm.v1.engine.output_processor import OutputProcessor
from vllm.v1.engine.processor import Processor

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict


class LLM:
    """Runs the engine core in process. Keyword arguments are ``EngineArgs`` fields."""

    def __init__(self, model: str = EngineArgs.model, **kwargs: Any) -> None:
        args = EngineArgs(model=model, **kwargs)
        hf_config = get_model_config(model)
        self.config = args.create_engine_config(hf_config.max_position_embeddings)
        self.engine_core = EngineCore(self.config)
        self.tokenizer = self.engine_core.tokenizer
        self.processor = Processor(self.config, self.tokenizer, get_eos_token_id(model))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._counter = 0

    def get_tokenizer(self):
        return self.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for each prompt (text, token ids, or {"prompt_token_ids": [...]})."""
        if isinstance(prompts, str | dict) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        return self._run([(p, True) for p in prompts], sampling_params, use_tqdm)

    def chat(
        self,
        messages: Sequence[dict] | Sequence[Sequence[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Chat with one conversation (a list of messages) or a list of conversations."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        texts = [
            self.processor.apply_chat_template(c, chat_template, add_generation_prompt)
            for c in conversations
        ]
        return self._run([(t, False) for t in texts], sampling_params, use_tqdm)

    def _run(self, prompts, sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError("sampling_params must be one, or one per prompt")
        # Validate everything before queueing anything: bad input loses nothing.
        batch = []
        for (prompt, special), params in zip(prompts, sampling_params, strict=True):
            if isinstance(prompt, dict):
                prompt = prompt.get("prompt_token_ids") or prompt.get("prompt")
            request_id = str(self._counter)
            self._counter += 1
            _, core_reqs = self.processor.process(
                prompt, params, request_id, add_special_tokens=special
            )
            batch.append((request_id, prompt if isinstance(prompt, str) else None, core_reqs))
        for request_id, text, core_reqs in batch:
            self.output_processor.add_request(request_id, text, core_reqs)
            for r in core_reqs:
                self.engine_core.add_request(r)
        return self._run_engine([b[0] for b in batch], use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Processed prompts")
        while self.output_processor.has_unfinished_requests():
            outputs = self.engine_core.step()
            results, to_abort = self.output_processor.process_outputs(outputs.outputs)
            if to_abort:
                self.engine_core.abort_requests(to_abort)
            for out in results:
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [finished[r] for r in request_ids]
