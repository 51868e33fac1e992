"""vLLM flags that launch scripts carry over: ``--tokenizer-mode``, ``--data-parallel-size``,
``--enable-expert-parallel``, ``--structured-outputs-config``,
``--enable-prompt-tokens-details``, ``--middleware``, ``--log-config-file`` and the h11
limits. Each is parsed by the real ``vllm serve`` parser; what this engine cannot honour is
refused at start, naming the flag. (The compilation flags: ``tests/test_compilation_config.py``.)"""

from __future__ import annotations

import asyncio
import json
import logging
from types import SimpleNamespace

import pytest

from tests.entrypoints.openai.test_frontend_flags import _app, _call
from tests.utils import copy_benchmark_tokenizer
from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints import launcher
from vllm.entrypoints.cli.main import make_parser
from vllm.entrypoints.openai.cli_args import FrontendArgs

MODULE = __name__  # the import path --middleware names this file's middleware by


def _args(*argv: str):
    return make_parser().parse_args(["serve", *argv])


def _front(*argv: str) -> FrontendArgs:
    return FrontendArgs.from_cli_args(_args(*argv))


def _engine(*argv: str):
    return EngineArgs.from_cli_args(_args(*argv)).create_engine_config()


# -- --tokenizer-mode -------------------------------------------------------------------


def test_tokenizer_modes_auto_and_hf_are_the_fast_tokenizer():
    assert _engine().model_config.tokenizer_mode == "auto"
    assert _engine("--tokenizer-mode", "hf").model_config.tokenizer_mode == "hf"


@pytest.mark.parametrize(
    ("mode", "needle"),
    [
        ("slow", "'slow' is not available: transformers 5"),
        ("mistral", "'mistral' needs mistral_common"),
        ("custom", "'custom' names a registered tokenizer class"),
    ],
)
def test_tokenizer_modes_this_engine_cannot_load_are_refused(mode, needle):
    with pytest.raises(ValueError, match=f"tokenizer_mode {needle}.*use auto or hf"):
        _engine("--tokenizer-mode", mode)


def test_an_unknown_tokenizer_mode_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        _args("--tokenizer-mode", "sentencepiece")
    assert "--tokenizer-mode" in capsys.readouterr().err


def test_transformers_has_no_slow_tokenizer_to_load(tmp_path):
    # Why "slow" is refused: AutoTokenizer drops use_fast=False and loads the fast one.
    # Should transformers bring slow tokenizers back, this fails: implement the mode.
    from transformers import AutoTokenizer

    copy_benchmark_tokenizer(tmp_path)
    fast = AutoTokenizer.from_pretrained(tmp_path)
    slow = AutoTokenizer.from_pretrained(tmp_path, use_fast=False)
    assert fast.is_fast and slow.is_fast and type(slow) is type(fast)


# -- --data-parallel-size, --enable-expert-parallel ---------------------------------------


def test_one_replica_and_expert_parallel_on_one_device_are_accepted():
    parallel = _engine("--data-parallel-size", "1").parallel_config
    assert parallel.data_parallel_size == 1 and not parallel.enable_expert_parallel
    assert _engine("-dp", "1", "-ep").parallel_config.enable_expert_parallel
    assert _engine("--enable-expert-parallel").parallel_config.enable_expert_parallel
    assert not _engine("--no-enable-expert-parallel").parallel_config.enable_expert_parallel


def test_more_replicas_are_engines_of_their_own():
    assert _engine("--data-parallel-size", "2").parallel_config.data_parallel_size == 2
    assert _engine("-dp", "4", "-ep").parallel_config.data_parallel_size == 4
    with pytest.raises(ValueError, match="data_parallel_size must be an integer >= 1"):
        _engine("-dp", "0")
    events = '{"enable_kv_cache_events": true, "endpoint": "inproc://kv"}'
    with pytest.raises(ValueError, match="must be tcp:// or ipc://"):
        _engine("-dp", "2", "--kv-events-config", events)


# -- --structured-outputs-config ----------------------------------------------------------


def test_structured_outputs_config_takes_what_llguidance_does():
    spec = {
        "backend": "guidance",
        "disable_fallback": True,
        "disable_any_whitespace": False,
        "disable_additional_properties": True,
        "enable_in_reasoning": False,
        "reasoning_parser": "qwen3",
    }
    front = _front("--structured-outputs-config", json.dumps(spec))
    assert front.structured_outputs_config == spec
    assert front.reasoning_parser == "qwen3"  # as --reasoning-parser
    same = _front("--reasoning-parser", "qwen3", "--structured-outputs-config", json.dumps(spec))
    assert same.reasoning_parser == "qwen3"
    assert _front("--structured-outputs-config", '{"backend": "auto"}').reasoning_parser is None
    vllm_default = '{"backend": "auto", "reasoning_parser": ""}'  # vLLM's "" is unset
    assert _front("--structured-outputs-config", vllm_default).reasoning_parser is None


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"backend": "xgrammar"}, "backend must be auto or guidance: structured outputs here"),
        ({"backend": "outlines"}, "backend must be auto or guidance"),
        ({"backend": "lm-format-enforcer"}, "backend must be auto or guidance"),
        ({"disable_any_whitespace": True}, "disable_any_whitespace must be false"),
        ({"disable_additional_properties": False}, "disable_additional_properties must be true"),
        ({"enable_in_reasoning": True}, "enable_in_reasoning must be false"),
        ({"disable_fallback": 1}, "disable_fallback must be true or false"),
        ({"backend": "auto", "whitespace_pattern": " "}, r"keys this server does not take"),
        ({"reasoning_parser": "nope"}, "reasoning_parser must be one of"),
    ],
)
def test_structured_outputs_config_refuses_what_it_cannot_honour(spec, needle):
    with pytest.raises(ValueError, match=f"structured_outputs_config.*{needle}"):
        _front("--structured-outputs-config", json.dumps(spec))


def test_two_reasoning_parsers_are_refused():
    with pytest.raises(ValueError, match="disagree"):
        _front(
            "--reasoning-parser",
            "deepseek_r1",
            "--structured-outputs-config",
            '{"reasoning_parser": "qwen3"}',
        )


# -- --enable-prompt-tokens-details, h11 limits ------------------------------------------


def test_prompt_tokens_details_flag_is_accepted():
    assert not _front().enable_prompt_tokens_details
    assert _front("--enable-prompt-tokens-details").enable_prompt_tokens_details


def test_h11_limits_set_the_request_head_limits():
    front = _front("--h11-max-incomplete-event-size", "4194304", "--h11-max-header-count", "100")
    assert front.max_request_header_size == 4 << 20 and front.max_request_header_count == 100
    protocol = launcher.http_protocol(front)  # what uvicorn serves with
    assert protocol.max_head_bytes == 4 << 20 and protocol.max_header_count == 100
    with pytest.raises(ValueError, match="max_request_header_count must be at least 1"):
        _front("--h11-max-header-count", "0")


# -- --middleware ---------------------------------------------------------------------------

CALLS: list[str] = []


class HeaderMiddleware:
    """A pure ASGI middleware class: records its call, marks the response."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        CALLS.append("class")

        async def marked(message):
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), (b"x-class", b"1")]
            await send(message)

        await self.app(scope, receive, marked)


async def header_function(request, call_next):
    """A middleware function, as @app.middleware("http") takes it."""
    CALLS.append("function")
    response = await call_next(request)
    response.headers["x-function"] = "1"
    return response


def not_async(request, call_next):
    return call_next(request)


def test_middleware_runs_on_requests_last_given_outermost():
    front = _front(
        "--middleware", f"{MODULE}.HeaderMiddleware", "--middleware", f"{MODULE}:header_function"
    )
    assert front.middleware == [f"{MODULE}.HeaderMiddleware", f"{MODULE}:header_function"]
    CALLS.clear()
    status, _, headers = _call(_app(middleware=front.middleware), "/health")
    assert status == 200
    assert headers["x-class"] == "1" and headers["x-function"] == "1"
    assert CALLS == ["function", "class"]
    CALLS.clear()
    assert _call(_app(), "/health")[0] == 200 and CALLS == []  # none without the flag
    several = _front("--middleware", f"{MODULE}.HeaderMiddleware", f"{MODULE}.header_function")
    assert several.middleware == [f"{MODULE}.HeaderMiddleware", f"{MODULE}.header_function"]


@pytest.mark.parametrize(
    ("path", "needle"),
    [
        ("HeaderMiddleware", "must be an import path"),
        ("no_such_package_xyz.Middleware", "cannot be imported"),
        (f"{MODULE}.NoSuchMiddleware", "cannot be imported"),
        (f"{MODULE}.not_async", "must be an ASGI middleware class or an async function"),
    ],
)
def test_middleware_that_cannot_be_added_is_refused_at_start(path, needle):
    with pytest.raises(ValueError, match=f"--middleware .*{needle}"):
        _front("--middleware", path)


# -- --log-config-file -------------------------------------------------------------------

LOGGER = "vllm.test_flag_compat"


def _log_config(tmp_path):
    config = {
        "version": 1,
        "disable_existing_loggers": False,  # the test process's other loggers stay
        "formatters": {"plain": {"format": "%(name)s %(message)s"}},
        "handlers": {"mem": {"class": "logging.StreamHandler", "formatter": "plain"}},
        "loggers": {LOGGER: {"handlers": ["mem"], "level": "DEBUG", "propagate": False}},
    }
    path = tmp_path / "logging.json"
    path.write_text(json.dumps(config))
    return path


def test_log_config_file_configures_logging_when_uvicorn_starts(tmp_path, monkeypatch):
    front = _front("--log-config-file", str(_log_config(tmp_path)))
    seen = {}

    class Server:  # uvicorn's server, stopped before it serves
        def __init__(self, config) -> None:
            seen["config"] = config
            self.should_exit = False

        async def serve(self, sockets) -> None:
            seen["level"] = logging.getLogger(LOGGER).level

    monkeypatch.setattr(launcher, "_Server", Server)
    logger = logging.getLogger(LOGGER)
    try:
        engine = SimpleNamespace(is_alive=True)
        asyncio.run(launcher.serve_http(object(), None, engine, front, launcher.ServerState()))
        assert seen["config"].log_config["loggers"][LOGGER]["level"] == "DEBUG"
        assert seen["level"] == logging.DEBUG  # configured by uvicorn.Config
        assert [type(h) for h in logger.handlers] == [logging.StreamHandler]
    finally:
        logger.handlers.clear()
        logger.setLevel(logging.NOTSET)
        logger.propagate = True


def test_without_the_flag_uvicorn_keeps_its_own_logging_config():
    from uvicorn.config import LOGGING_CONFIG

    assert launcher.uvicorn_log_config(_front()) is LOGGING_CONFIG


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        (None, "cannot be read"),
        ("{nope", "is not JSON"),
        ('{"loggers": {}}', r'"version": 1'),
        ("[1]", r'"version": 1'),
    ],
)
def test_a_log_config_file_that_is_not_one_is_refused_at_start(tmp_path, text, needle):
    path = tmp_path / "log.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match=f"--log-config-file .*{needle}"):
        _front("--log-config-file", str(path))


def test_a_config_file_gives_these_flags_too(tmp_path):
    from vllm.entrypoints.cli.config_file import expand

    path = tmp_path / "serve.yaml"
    path.write_text(
        f"middleware: [{MODULE}.HeaderMiddleware, {MODULE}.header_function]\n"
        "compilation_config: {cudagraph_mode: NONE}\n"
        "structured_outputs_config: {backend: guidance}\n"
    )
    parser = make_parser()
    args = parser.parse_args(["serve", *expand(["--config", str(path)], parser.serve_parser)])
    front = FrontendArgs.from_cli_args(args)
    assert front.middleware == [f"{MODULE}.HeaderMiddleware", f"{MODULE}.header_function"]
    assert front.structured_outputs_config == {"backend": "guidance"}
    assert EngineArgs.from_cli_args(args).create_engine_config().model_config.enforce_eager


# -- --custom-histogram-buckets, --otlp-traces-endpoint ------------------------------------


def test_custom_histogram_buckets_flag_is_a_json_object():
    config = _engine("--custom-histogram-buckets", '{"time_to_first_token": [0.1, 1, 10]}')
    assert config.observability_config.custom_histogram_buckets == {
        "time_to_first_token": [0.1, 1, 10]
    }
    with pytest.raises(ValueError, match="custom_histogram_buckets"):
        _engine("--custom-histogram-buckets", '{"time_to_first_token": [10, 1]}')
