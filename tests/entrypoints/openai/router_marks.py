"""The marks of the tests that start vLLM's router in front of servers."""

from __future__ import annotations

import pytest

from vllm.benchmarks.router import router_installed

NEEDS_ROUTER = pytest.mark.skipif(
    not router_installed(), reason="vllm-router is not installed (pip install vllm-router==0.1.17)"
)
ROUTER_E2E = [pytest.mark.slow, NEEDS_ROUTER]
