"""Helpers of the end-to-end and benchmark tests: the real server (the harness lives in
the package), loading a script of benchmarks/ or scripts/ by its path, and the
benchmarks' tokenizer for model folders made in a test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from vllm.benchmarks.server import RemoteServer

__all__ = ["RemoteServer", "copy_benchmark_tokenizer", "load_script", "save_smollm_vocab_llama"]


def load_script(path: Path) -> ModuleType:
    """The script at ``path`` as a module named after it (benchmarks/ is a folder of
    scripts, not a package); registered in ``sys.modules``, where its dataclasses look
    their module up."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def copy_benchmark_tokenizer(path: Path, chat_template: bool = False) -> None:
    """SmolLM2's tokenizer files into the model folder ``path``: the copy ``make
    gpu-wheels`` carries (the GPU machine has no embedded model), else the embedded
    model's; the calling test is skipped when neither exists. ``chat_template``: its
    ``chat_template.jinja`` too."""
    import shutil

    import pytest

    bench = load_script(BENCHMARKS / "benchmark_gpu.py")
    try:
        tokenizer_dir = bench.default_tokenizer_dir()
    except SystemExit as e:
        pytest.skip(str(e))
    names = ["tokenizer.json", "tokenizer_config.json"]
    for name in names + ["chat_template.jinja"] * chat_template:
        shutil.copy(tokenizer_dir / name, path / name)


def save_smollm_vocab_llama(path: Path, **overrides) -> None:
    """A tiny random Llama (``tests.tiny_models``) with SmolLM2's vocabulary and tokenizer
    in ``path``: a model folder ``LLM`` serves on any machine (the tokenizer from
    ``copy_benchmark_tokenizer``); ``overrides``: config fields."""
    from tests.tiny_models import save_tiny_llama

    save_tiny_llama(path, **{"vocab_size": 49152, "max_position_embeddings": 512, **overrides})
    copy_benchmark_tokenizer(path)
