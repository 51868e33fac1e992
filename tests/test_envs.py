"""vllm/envs.py: variables read when accessed, and importing vllm changes no variable."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vllm import envs


def test_variables_are_read_when_accessed(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_THREADS", "3")
    assert envs.VLLM_CPU_THREADS == 3
    monkeypatch.setenv("VLLM_CPU_THREADS", "5")  # set after import: still seen
    assert envs.VLLM_CPU_THREADS == 5
    monkeypatch.delenv("VLLM_CPU_THREADS")
    assert envs.VLLM_CPU_THREADS == (os.cpu_count() or 1)
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", " torch_sdpa ")
    assert envs.VLLM_ATTENTION_BACKEND == "TORCH_SDPA"
    monkeypatch.setenv("VLLM_USE_UVLOOP", "0")
    assert envs.VLLM_USE_UVLOOP is False
    monkeypatch.setenv("VLLM_CPU_ENGINE_NICE", "0")
    assert envs.VLLM_CPU_ENGINE_NICE == 0
    with pytest.raises(AttributeError):
        _ = envs.VLLM_NO_SUCH_VARIABLE


def test_cache_root_is_shared_by_models_and_kernels(monkeypatch, tmp_path):
    from vllm import _custom_ops

    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert envs.VLLM_CACHE_ROOT == str(tmp_path / "vllm-continuum")
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "root"))
    assert _custom_ops._cache_dir() == Path(tmp_path / "root" / "kernels")


def test_importing_vllm_leaves_the_environment_unchanged():
    probe = (
        "import json, os; before = dict(os.environ); "
        "import vllm, vllm.envs, vllm.config, vllm.engine.arg_utils, "
        "vllm.model_executor.model_loader, vllm.entrypoints.cli.main, "
        "vllm.entrypoints.cli.serve, vllm.entrypoints.llm; "
        "after = dict(os.environ); "
        "print(json.dumps(sorted(k for k in before.keys() | after.keys() "
        "if before.get(k) != after.get(k))))"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_model_loading_stays_offline():
    # No HF_HUB_OFFLINE in the environment: the loader itself must not reach the network.
    probe = (
        "import socket\n"
        "def refuse(*a, **k): raise SystemExit('network access: %r' % (a,))\n"
        "socket.socket.connect = refuse\n"
        "socket.create_connection = refuse\n"
        "from vllm.config import ModelConfig\n"
        "from vllm.model_executor import model_loader as m\n"
        "from vllm.transformers_utils.tokenizer import get_tokenizer\n"
        "tok = get_tokenizer('SmolLM2-135M-Instruct')\n"
        "m.get_model_config('SmolLM2-135M-Instruct'); m.eos_token_ids(ModelConfig(), tok)\n"
        "m.default_sampling_params(ModelConfig())\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.stdout.strip().endswith("ok"), out.stderr[-2000:]
