"""Shared by the native kernel tests: build the kernels once when they are missing."""

from __future__ import annotations

import shutil
from collections.abc import Callable

import pytest

from vllm import _custom_ops as ops


def require_native(available: Callable[[], bool]) -> None:
    """Skip without a C++ compiler; else JIT-build the kernels if ``available()`` is False,
    and fail if it still is (a kernel that does not build is a failure, not a skip)."""
    if shutil.which("c++") is None:
        pytest.skip("no C++ compiler")
    if not available():
        ops.build()
    assert available()
