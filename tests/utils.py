"""Helpers of the end-to-end and benchmark tests: the real server (the harness lives in
the package) and loading a script of benchmarks/ or scripts/ by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from vllm.benchmarks.server import RemoteServer

__all__ = ["RemoteServer", "load_script"]


def load_script(path: Path) -> ModuleType:
    """The script at ``path`` as a module named after it (benchmarks/ is a folder of
    scripts, not a package); registered in ``sys.modules``, where its dataclasses look
    their module up."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
