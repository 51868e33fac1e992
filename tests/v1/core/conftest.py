from __future__ import annotations

import itertools

import pytest

from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheManager
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
    mm_features=None,
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
        mm_features=mm_features,
    )


@pytest.fixture
def req_factory():
    return make_request


# Shared prefixes, so that later requests hit blocks of earlier (live or freed) ones.
RANDOM_OP_PROMPTS = [list(range(n)) for n in (3, 9, 13, 17, 22)] + [list(range(50, 61))]


def _random_step(m: KVCacheManager, req, arg: int) -> bool:
    """One scheduled step of a live request (prefill chunk or decode); False if short."""
    if req.num_computed_tokens < req.num_tokens:
        num_new = min(1 + arg % 6, req.num_tokens - req.num_computed_tokens)
    else:
        req.append_output_token_ids(arg)
        num_new = 1
    if m.allocate_slots(req, num_new, num_lookahead_tokens=arg % 3) is None:
        return False
    req.num_computed_tokens += num_new
    return True


def _random_add(m: KVCacheManager, arg: int, block_size: int):
    """Admit a request as the scheduler does: its KV cache hit, then its tier hit."""
    req = make_request(list(RANDOM_OP_PROMPTS[arg % len(RANDOM_OP_PROMPTS)]), block_size)
    hit, n_hit = m.get_computed_blocks(req)
    assert n_hit < req.num_tokens  # never the whole prompt
    n_ext = m.get_num_offloaded_tokens(req, n_hit)
    remaining = req.num_tokens - n_hit - n_ext
    # Half the time the whole rest of the prompt at once (memory pressure), else a chunk.
    chunk = remaining if (arg // len(RANDOM_OP_PROMPTS)) % 2 else min(1 + arg % 8, remaining)
    before = (m.num_free_blocks, m.num_requests)
    if m.allocate_slots(req, chunk, hit, n_hit, num_external_computed_tokens=n_ext) is None:
        assert (m.num_free_blocks, m.num_requests) == before  # refused: nothing changed
        return None
    req.num_computed_tokens = n_hit + n_ext + chunk
    return req


def apply_random_op(m: KVCacheManager, live: list, op: str, arg: int, block_size: int = 4):
    """One operation of a random workload (tests/v1/core/test_kv_properties.py,
    test_kv_events.py): "add" a request, "step" one (a failed step frees it, as a
    recompute preemption does), "free" or "offload" one, "reset" the prefix cache. The
    reset's result: whether it succeeded (None for the other operations)."""
    if op == "add":
        req = _random_add(m, arg, block_size)
        if req is not None:
            live.append(req)
    elif op == "step" and live:
        req = live[arg % len(live)]
        if not _random_step(m, req, arg):
            m.free(req)
            live.remove(req)
    elif op in ("free", "offload") and live:
        m.free(live.pop(arg % len(live)), offload=op == "offload")
    elif op == "reset":
        return m.reset_prefix_cache()
    return None
