from __future__ import annotations

import itertools

import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.request import Request

_ids = itertools.count()


def make_request(
    prompt: list[int],
    block_size: int = 4,
    max_tokens: int = 16,
    job_id: str | None = None,
    is_last_step: bool = False,
    arrival_time: float = 0.0,
    priority: int = 0,
    cache_salt: str | None = None,
    request_id: str | None = None,
    lora_request=None,
    **sampling,
) -> Request:
    extra = {"job_id": job_id, "is_last_step": is_last_step} if job_id is not None else None
    params = SamplingParams(max_tokens=max_tokens, extra_args=extra, **sampling)
    return Request(
        request_id or f"req-{next(_ids)}",
        prompt,
        params,
        eos_token_id=None,
        arrival_time=arrival_time,
        priority=priority,
        cache_salt=cache_salt,
        block_hasher=get_request_block_hasher(block_size),
        lora_request=lora_request,
    )


@pytest.fixture
def req_factory():
    return make_request
