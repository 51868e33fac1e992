"""Front-end validation and tokenization: user input -> ``EngineCoreRequest``s."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence

from vllm.config import VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.v1.engine import EngineCoreRequest


class Processor:
    def __init__(self, vllm_config: VllmConfig, tokenizer, eos_token_id: int | None) -> None:
        self.max_model_len = vllm_config.scheduler_config.max_model_len
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id

    def apply_chat_template(
        self,
        messages: Sequence[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list | None = None,
    ) -> str:
        if not messages:
            raise ValueError("messages must not be empty")
        return self.tokenizer.apply_chat_template(
            list(messages),
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=chat_template,
            tools=tools,
        )

    def tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            # Chat-templated text already holds its special tokens: pass False for it.
            return self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids
        ids = list(prompt)
        if not ids:
            raise ValueError("prompt must not be empty")
        vocab = len(self.tokenizer)
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        return ids

    def process(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        add_special_tokens: bool = True,
    ) -> tuple[str, list[EngineCoreRequest]]:
        """Validate and fan out (n > 1 gives n child requests with their own seeds)."""
        ids = self.tokenize(prompt, add_special_tokens)
        if len(ids) + 1 > self.max_model_len:
            raise ValueError(
                f"prompt is {len(ids)} tokens long; max_model_len is {self.max_model_len} "
                "(the prompt plus at least one generated token must fit)"
            )
        request_id = request_id or uuid.uuid4().hex
        now = time.time()
        children = []
        for i in range(params.n):
            child = params.clone()
            child.n = 1
            if params.seed is not None:
                child.seed = params.seed + i
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(
                EngineCoreRequest(
                    child_id, ids, child, self.eos_token_id, now, priority, cache_salt
                )
            )
        return request_id, children
