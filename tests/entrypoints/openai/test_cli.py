"""`vllm serve` command line: fast help, one-line errors with the right exit codes."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

from vllm.engine.arg_utils import config_args
from vllm.entrypoints.utils import LOOPBACK


def serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_flags_without_importing_torch():
    out = serve("--help")
    assert out.returncode == 0
    for flag in (
        "--host",
        "--port",
        "--served-model-name",
        "--max-model-len",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--no-enable-prefix-caching",
        "--enable-chunked-prefill",
        "--long-prefill-token-threshold",
        "--gpu-memory-utilization",
        "--kv-cache-memory",
        "--num-gpu-blocks-override",
        "--scheduling-policy",
        "--api-key",
        "--seed",
        "--dtype",
        "--chat-template",
        "--disable-log-requests",
        "--continuum-ttl-mode",
        "--continuum-max-ttl",
        "--continuum-default-ttl",
        "--continuum-min-records",
        "--max-wait-time",
        "--model",
    ):
        assert flag in out.stdout, flag
    # Every generated engine flag, under its config's group.
    for arg in config_args():
        assert re.search(rf"^  {arg.flag}[ ,\n]", out.stdout, re.MULTILINE), arg.flag
    for group in ("ModelConfig:", "CacheConfig:", "SchedulerConfig:", "PolicyConfig:"):
        assert group in out.stdout
    probe = (
        "import sys; from vllm.entrypoints.cli.main import make_parser; make_parser(); "
        "print(sorted(m for m in ('torch', 'transformers', 'fastapi') if m in sys.modules))"
    )
    imported = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert imported.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--max-num-seqs", "abc"), "--max-num-seqs"),
        (("--kv-cache-memory", "lots"), "--kv-cache-memory"),
        (("--dtype", "int3"), "--dtype"),
        (("--enable-chunked-prefill=yes",), "--enable-chunked-prefill"),
        (("--scheduling-policy", "lifo"), "--scheduling-policy"),
        (("--max-num-seqs", "0"), "max_num_seqs"),
        (("--stream-interval", "0"), "stream_interval"),
        (("--api-server-count", "0"), "api_server_count"),
        (("-asc", "-2"), "api_server_count"),
        (("--api-server-count", "two"), "--api-server-count"),
        (("--chat-template", "/no/such/template.jinja"), "chat_template"),
        (("/no/such/model",), "not found"),
        (("--kv-offloading-size", "0.01", "--no-enable-prefix-caching"), "--kv-offloading-size"),
        # The positional model wins over --model, as in vLLM.
        (("/no/such/model", "--model", "/other/model"), "/no/such/model"),
        (("--model", "/other/model"), "/other/model"),
        # vLLM's flags for one device: 1 is what this engine runs; more is refused.
        (("-tp", "2"), "tensor_parallel_size"),
        (("--pipeline-parallel-size", "4"), "pipeline_parallel_size"),
        (("--kv-cache-dtype", "fp8_inc"), "--kv-cache-dtype"),
        (("--load-format", "pt"), "--load-format"),
        (("--generation-config", "/no/such/folder"), "generation_config"),
        (("--override-generation-config", "[1]"), "override_generation_config"),
        (("--reasoning-parser", "o1"), "--reasoning-parser"),
        (("--speculative-config", '{"method": "eagle"}'), "speculative_config"),
        (("--speculative-config", "ngram"), "speculative_config"),
    ],
)
def test_bad_flags_give_one_line_and_exit_2(args, needle):
    out = serve(*args)
    assert out.returncode == 2
    lines = [line for line in out.stderr.splitlines() if line.startswith("vllm serve: error:")]
    assert len(lines) == 1 and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_several_api_servers_refuse_runtime_lora_updating():
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "-asc", "2"]
    env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 2
    assert "--api-server-count > 1 cannot be used with VLLM_ALLOW_RUNTIME_LORA_UPDATING" in (
        out.stderr
    )
    assert "Traceback" not in out.stderr


def test_the_api_server_count_defaults_to_the_data_parallel_size(monkeypatch):
    from types import SimpleNamespace

    from vllm.entrypoints.cli.serve import resolve_api_server_count
    from vllm.entrypoints.openai.cli_args import FrontendArgs

    def config(dp):
        return SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=dp))

    monkeypatch.delenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", raising=False)
    assert resolve_api_server_count(FrontendArgs(), config(1)).api_server_count == 1
    assert resolve_api_server_count(FrontendArgs(), config(3)).api_server_count == 3  # vLLM's
    given = FrontendArgs(api_server_count=1)
    assert resolve_api_server_count(given, config(3)).api_server_count == 1
    # Adapters loaded at run time need one API server: the default stays 1 then.
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    assert resolve_api_server_count(FrontendArgs(), config(3)).api_server_count == 1


def test_vllm_s_one_device_flags_are_accepted():
    from vllm.engine.arg_utils import EngineArgs
    from vllm.entrypoints.cli.main import make_parser

    argv = ["serve", "-tp", "1", "-pp", "1", "--trust-remote-code", "--kv-cache-dtype", "auto"]
    args = make_parser().parse_args(argv)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    assert config.parallel_config.tensor_parallel_size == 1
    assert config.model_config.trust_remote_code is True
    assert config.cache_config.cache_dtype == "auto"
    for kind in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # FP8 KV caches
        args = make_parser().parse_args(["serve", "--kv-cache-dtype", kind])
        assert EngineArgs.from_cli_args(args).create_engine_config().cache_config.cache_dtype == (
            kind
        )


def test_busy_port_fails_before_loading_the_model():
    with socket.socket() as busy:
        busy.bind((LOOPBACK, 0))
        busy.listen()
        out = serve("--port", str(busy.getsockname()[1]))
    assert out.returncode == 1 and "cannot bind" in out.stderr
    assert "Traceback" not in out.stderr and "Engine core ready" not in out.stderr


def test_server_event_loop_is_uvloop_unless_disabled(monkeypatch):
    import uvloop

    from vllm.entrypoints.cli.serve import event_loop_factory

    monkeypatch.delenv("VLLM_USE_UVLOOP", raising=False)
    assert event_loop_factory() is uvloop.new_event_loop
    monkeypatch.setenv("VLLM_USE_UVLOOP", "0")
    assert event_loop_factory() is None
