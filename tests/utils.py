"""Starting the real server for end-to-end tests (the harness lives in the package)."""

from __future__ import annotations

from vllm.benchmarks.server import RemoteServer

__all__ = ["RemoteServer"]
