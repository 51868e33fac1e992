"""vLLM flags that launch scripts carry over: ``--tokenizer-mode``, ``--data-parallel-size``,
``--enable-expert-parallel``, ``--structured-outputs-config``,
``--enable-prompt-tokens-details``, ``--middleware``, ``--log-config-file``, the h11
limits, the flags that change nothing on one device (``--distributed-executor-backend``,
``--disable-custom-all-reduce``, ``--max-parallel-loading-workers``, ``--use-tqdm-on-load``,
``--disable-cascade-attn``), ``--model-impl``, ``--cpu-offload-gb``,
``--prefix-caching-hash-algo``, ``--performance-mode``, ``--scheduler-cls`` and vLLM's
multi-node data-parallel flags (``--nnodes``, ``--data-parallel-size-local``, ...,
``--headless``, ``--data-parallel-rank``, external and hybrid load balancing), and a second
batch: the loading, metrics, multimodal, recurrent-state, LoRA, front-end and worker flags
(``--ignore-patterns`` ... ``--worker-extension-cls``). Each is
parsed by the real ``vllm serve`` parser; what this engine cannot honour is refused at
start, naming the flag. (The compilation flags: ``tests/test_compilation_config.py``.)"""

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


# -- flags that change nothing on one device ------------------------------------------------


def test_executor_backends_of_one_process_per_engine_are_accepted():
    assert _engine().parallel_config.distributed_executor_backend is None
    for backend in ("mp", "uni"):
        parallel = _engine("--distributed-executor-backend", backend).parallel_config
        assert parallel.distributed_executor_backend == backend


@pytest.mark.parametrize(
    ("backend", "needle"),
    [
        ("ray", "'ray' is not available: Ray is not a dependency of this engine"),
        ("external_launcher", r"'external_launcher' \(a torchrun SPMD launch.*is not supported"),
    ],
)
def test_executor_backends_this_engine_has_not_are_refused(backend, needle):
    match = f"distributed_executor_backend {needle}: use mp or uni"
    with pytest.raises(ValueError, match=match):
        _engine("--distributed-executor-backend", backend)


def test_all_reduce_loading_workers_and_progress_bar_flags_are_accepted():
    assert not _engine().parallel_config.disable_custom_all_reduce
    assert _engine("--disable-custom-all-reduce").parallel_config.disable_custom_all_reduce
    no = _engine("--no-disable-custom-all-reduce").parallel_config
    assert not no.disable_custom_all_reduce
    assert _engine().parallel_config.max_parallel_loading_workers is None
    workers = _engine("--max-parallel-loading-workers", "4").parallel_config
    assert workers.max_parallel_loading_workers == 4
    with pytest.raises(ValueError, match="max_parallel_loading_workers must be an integer >= 1"):
        _engine("--max-parallel-loading-workers", "0")
    assert _engine().model_config.use_tqdm_on_load
    assert _engine("--use-tqdm-on-load").model_config.use_tqdm_on_load
    assert not _engine("--no-use-tqdm-on-load").model_config.use_tqdm_on_load


def test_cascade_attention_flag_is_accepted_with_a_warning_that_it_does_nothing(caplog):
    with caplog.at_level("WARNING", logger="vllm.config"):
        assert _engine().model_config.disable_cascade_attn is None
    assert "--disable-cascade-attn" not in caplog.text  # unset: nothing to say
    for argv, value in (("--disable-cascade-attn", True), ("--no-disable-cascade-attn", False)):
        caplog.clear()
        with caplog.at_level("WARNING", logger="vllm.config"):
            assert _engine(argv).model_config.disable_cascade_attn is value
        assert "--disable-cascade-attn has no effect" in caplog.text


# -- --model-impl, --cpu-offload-gb -------------------------------------------------------


def test_model_impl_takes_this_engines_own_model_code():
    assert _engine().model_config.model_impl == "auto"
    assert _engine("--model-impl", "vllm").model_config.model_impl == "vllm"


@pytest.mark.parametrize(
    ("impl", "needle"),
    [
        ("transformers", "'transformers' runs transformers' modeling code.*no such backend"),
        ("terratorch", "'terratorch' runs TerraTorch's geospatial models"),
    ],
)
def test_model_impls_this_engine_has_not_are_refused(impl, needle):
    with pytest.raises(ValueError, match=f"model_impl {needle}.*use auto or vllm"):
        _engine("--model-impl", impl)


def test_weights_are_never_offloaded_to_the_cpu():
    assert _engine().model_config.cpu_offload_gb == 0
    assert _engine("--cpu-offload-gb", "0").model_config.cpu_offload_gb == 0
    with pytest.raises(ValueError, match="cpu_offload_gb must be 0: weight offloading .* is not"):
        _engine("--cpu-offload-gb", "4")
    with pytest.raises(ValueError, match="cpu_offload_gb must be a number of GiB >= 0"):
        _engine("--cpu-offload-gb", "-1")


# -- --prefix-caching-hash-algo -----------------------------------------------------------


def test_prefix_caching_hash_algo_sha256_names_the_block_hash():
    import hashlib
    import pickle

    from vllm.v1.core.kv_cache_utils import NONE_HASH, hash_block_tokens

    assert _engine().cache_config.prefix_caching_hash_algo == "sha256"
    algo = _engine("--prefix-caching-hash-algo", "sha256").cache_config.prefix_caching_hash_algo
    assert algo == "sha256"
    # vLLM's sha256: SHA-256 over a pickle of (parent hash, token ids, extra keys).
    first = hash_block_tokens(None, [1, 2, 3], ("salt", None))
    payload = (NONE_HASH, (1, 2, 3), ("salt", None))
    assert first == hashlib.sha256(pickle.dumps(payload, protocol=5)).digest()
    second = hash_block_tokens(first, [4, 5, 6])
    assert second == hashlib.sha256(pickle.dumps((first, (4, 5, 6), None), protocol=5)).digest()


@pytest.mark.parametrize(
    ("algo", "needle"),
    [
        ("sha256_cbor", "'sha256_cbor' serializes with canonical CBOR, and cbor2 is not"),
        ("xxhash", "'xxhash' hashes with xxHash, and the xxhash package is not"),
        ("xxhash_cbor", "'xxhash_cbor' hashes CBOR with xxHash"),
    ],
)
def test_hash_algorithms_this_engine_does_not_use_are_refused(algo, needle):
    with pytest.raises(ValueError, match=f"prefix_caching_hash_algo {needle}.*use sha256"):
        _engine("--prefix-caching-hash-algo", algo)


# -- --performance-mode, --scheduler-cls --------------------------------------------------


def test_performance_mode_balanced_keeps_the_defaults():
    assert _engine().scheduler_config.performance_mode == "balanced"
    balanced = _engine("--performance-mode", "balanced").scheduler_config
    assert balanced.performance_mode == "balanced"
    assert balanced.max_num_seqs == _engine().scheduler_config.max_num_seqs


@pytest.mark.parametrize("mode", ["interactivity", "throughput"])
def test_performance_modes_that_retune_defaults_are_refused(mode):
    match = f"performance_mode '{mode}' retunes vLLM's defaults.*use balanced"
    with pytest.raises(ValueError, match=match):
        _engine("--performance-mode", mode)


def test_a_scheduler_class_is_refused_pointing_to_the_policy_flag():
    assert _engine().scheduler_config.scheduler_cls is None
    match = r"scheduler_cls is not taken.*--scheduling-policy \{fcfs,priority,continuum"
    with pytest.raises(ValueError, match=match):
        _engine("--scheduler-cls", "my_pkg.MyScheduler")


# -- vLLM's multi-node data-parallel flags: the values of one node ---------------------------


def test_one_node_data_parallel_flags_are_accepted():
    parallel = _engine(
        *("-dp", "2", "--data-parallel-size-local", "2", "--data-parallel-start-rank", "0"),
        *("--data-parallel-backend", "mp", "--nnodes", "1", "--node-rank", "0"),
        *("--data-parallel-address", "10.0.0.5", "--data-parallel-rpc-port", "13345"),
        *("--master-addr", "10.0.0.5", "--master-port", "29600"),
        *("--no-data-parallel-external-lb", "--no-data-parallel-hybrid-lb"),
    ).parallel_config
    assert parallel.data_parallel_size == parallel.data_parallel_size_local == 2
    assert (parallel.nnodes, parallel.node_rank, parallel.data_parallel_start_rank) == (1, 0, 0)
    assert parallel.data_parallel_address == "10.0.0.5" and parallel.master_port == 29600
    short = _engine(*"-dp 2 -dpl 2 -dpr 0 -dpb mp -n 1 -r 0 -dpa 127.0.0.1 -dpp 1".split())
    assert short.parallel_config.data_parallel_rpc_port == 1
    default = _engine().parallel_config
    assert (default.data_parallel_size_local, default.data_parallel_backend) == (None, "mp")
    assert (default.master_addr, default.master_port) == ("127.0.0.1", 29501)  # vLLM's


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ("-dp 2 -dpl 1", r"data_parallel_size_local must be data_parallel_size \(2\) or unset"),
        ("--data-parallel-start-rank 1", "data_parallel_start_rank must be 0 or unset"),
        ("--data-parallel-backend ray", "data_parallel_backend must be mp.*Ray is not"),
        ("--nnodes 2", "nnodes must be 1: this engine runs on one node"),
        ("--node-rank 1", "node_rank must be 0, the only node"),
        ("--headless", "headless is not supported: it starts engines without an API server"),
        ("--data-parallel-rpc-port 70000", "data_parallel_rpc_port must be a port in 1-65535"),
        ("--master-port 0", "master_port must be a port in 1-65535"),
    ],
)
def test_multi_node_values_are_refused(argv, needle):
    with pytest.raises(ValueError, match=needle):
        _engine(*argv.split())


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ("--data-parallel-rank 0", "data_parallel_rank is not taken"),
        ("-dpn 1", "data_parallel_rank is not taken"),
        ("--data-parallel-external-lb", "data_parallel_external_lb must be off"),
        ("-dph", "data_parallel_hybrid_lb must be off"),
    ],
)
def test_external_and_hybrid_load_balancing_are_refused_for_the_router(argv, needle):
    with pytest.raises(ValueError, match=f"{needle}.*behind the router \\(docs/router.md\\)"):
        _engine(*argv.split())


@pytest.mark.parametrize(
    "argv",
    [
        "--distributed-executor-backend torchrun",
        "--model-impl sglang",
        "--prefix-caching-hash-algo md5",
        "--performance-mode fast",
        "--data-parallel-backend nccl",
        "--nnodes two",
    ],
)
def test_values_outside_vllms_choices_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        _args(*argv.split())
    assert argv.split()[0] in capsys.readouterr().err


# -- second batch: loading, metrics, multimodal, recurrent, LoRA, front end, workers --------

_OBS = "observability_config."
# (flags, field path): vLLM's values that ask nothing beyond what this engine does.
_ACCEPTED = [
    ("--ignore-patterns original/**/*", "model_config.ignore_patterns", ("original/**/*",)),
    ("--config-format hf", "model_config.config_format", "hf"),
    ("--config-format auto", "model_config.config_format", "auto"),
    ("--model-loader-extra-config {}", "model_config.model_loader_extra_config", {}),
    ("--safetensors-load-strategy lazy", "model_config.safetensors_load_strategy", "lazy"),
    ("--safetensors-load-strategy eager", "model_config.safetensors_load_strategy", "eager"),
    ("--safetensors-load-strategy prefetch", "model_config.safetensors_load_strategy", "prefetch"),
    ("--pt-load-map-location cpu", "model_config.pt_load_map_location", "cpu"),
    ("--show-hidden-metrics-for-version 0.31", _OBS + "show_hidden_metrics_for_version", "0.31"),
    ("--no-enable-mfu-metrics", "observability_config.enable_mfu_metrics", False),
    ("--no-cudagraph-metrics", "observability_config.cudagraph_metrics", False),
    ("--no-enable-logging-iteration-details", _OBS + "enable_logging_iteration_details", False),
    ("--mm-processor-cache-gb 0", "model_config.mm_processor_cache_gb", 0),
    ("--mm-processor-cache-gb 4", "model_config.mm_processor_cache_gb", 4),
    ("--mm-processor-cache-type lru", "model_config.mm_processor_cache_type", "lru"),
    ("--skip-mm-profiling", "model_config.skip_mm_profiling", True),
    ("--no-skip-mm-profiling", "model_config.skip_mm_profiling", False),
    ("--no-interleave-mm-strings", "model_config.interleave_mm_strings", False),
    ("--no-language-model-only", "model_config.language_model_only", False),
    ("--no-enable-mm-embeds", "model_config.enable_mm_embeds", False),
    ("--media-io-kwargs {}", "model_config.media_io_kwargs", {}),
    ("--reasoning-config {}", "model_config.reasoning_config", {}),
    ("--mamba-cache-dtype auto", "cache_config.mamba_cache_dtype", "auto"),
    ("--block-size 32 --mamba-block-size 32", "cache_config.mamba_block_size", 32),
    ("--mamba-cache-mode align", "cache_config.mamba_cache_mode", "align"),
    ("--mamba-cache-mode none", "cache_config.mamba_cache_mode", "none"),
    ("--lora-dtype auto", "lora_config.lora_dtype", "auto"),
    ("--fully-sharded-loras", "lora_config.fully_sharded_loras", True),
    ("--no-fully-sharded-loras", "lora_config.fully_sharded_loras", False),
    ("--default-mm-loras {}", "lora_config.default_mm_loras", {}),
    ("--worker-cls auto", "parallel_config.worker_cls", "auto"),
    ("--worker-extension-cls=", "parallel_config.worker_extension_cls", ""),
]  # fmt: skip


@pytest.mark.parametrize(("argv", "path", "value"), _ACCEPTED)
def test_second_batch_values_this_engine_honours_are_accepted(argv, path, value):
    group, name = path.split(".")
    assert getattr(getattr(_engine(*argv.split()), group), name) == value


def test_second_batch_defaults_are_vllms():
    config = _engine()
    model, cache = config.model_config, config.cache_config
    assert model.ignore_patterns == ("original/**/*",) and model.config_format == "auto"
    assert model.pt_load_map_location == "cpu" and model.mm_processor_cache_gb == 4
    assert (model.mm_processor_cache_type, cache.mamba_cache_mode) == ("lru", "none")
    assert config.parallel_config.worker_cls == "auto"
    assert config.parallel_config.worker_extension_cls == ""
    assert config.lora_config.lora_dtype == "auto"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ("--ignore-patterns *.pt", "ignore_patterns must be original/.*never a subfolder"),
        ("--config-format mistral", "config_format must be auto or hf.*params.json is not"),
        ("--hf-config-path org/other", "hf_config_path is not taken.*--hf-overrides"),
        ("--code-revision v1", "code_revision is not taken.*no code from a model repository"),
        ('--model-loader-extra-config {"a":1}', "model_loader_extra_config must be unset or"),
        ("--safetensors-load-strategy torchao", "safetensors_load_strategy must be .*torchao"),
        ("--pt-load-map-location cuda:0", "pt_load_map_location must be cpu"),
        ("--enable-mfu-metrics", "enable_mfu_metrics must be off: model FLOPs utilization"),
        ("--cudagraph-metrics", "cudagraph_metrics must be off: CUDA graph metrics"),
        ("--enable-logging-iteration-details", "enable_logging_iteration_details must be off"),
        ("--show-hidden-metrics-for-version x.y", "show_hidden_metrics_for_version must be a"),
        ("--mm-processor-cache-gb 8", "mm_processor_cache_gb must be 0 or 4.*no cache"),
        ("--mm-processor-cache-type shm", "mm_processor_cache_type must be lru.*shm"),
        ("--interleave-mm-strings", "interleave_mm_strings must be off: image placeholders"),
        ("--language-model-only", "language_model_only must be off:.*vision encoder"),
        ("--enable-mm-embeds", "enable_mm_embeds must be off: precomputed image embeddings"),
        ('--media-io-kwargs {"video":{"num_frames":8}}', "media_io_kwargs must be unset or"),
        ('--reasoning-config {"reasoning_end_str":"x"}', "reasoning_config must be unset or"),
        ("--mamba-cache-dtype float32", "mamba_cache_dtype must be auto.*--mamba-ssm-cache"),
        ("--mamba-block-size 64", r"mamba_block_size must be unset or the --block-size \(16\)"),
        ("--lora-dtype bfloat16", "lora_dtype must be auto: adapters take the model's dtype"),
        ('--default-mm-loras {"image":"/a"}', "default_mm_loras must be unset or.*naming it"),
        ("--worker-cls my.Worker", "worker_cls must be auto: .*no worker class"),
        ("--worker-extension-cls my.Ext", "worker_extension_cls must be empty.*RL weight sync"),
    ],
)
def test_second_batch_values_asking_for_more_are_refused(argv, needle):
    with pytest.raises(ValueError, match=needle):
        _engine(*argv.split())


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ("--enable-offline-docs", "enable_offline_docs must be off: .*CDN"),
        ("--enable-ssl-refresh", "enable_ssl_refresh must be off: .*read once"),
        ("--enable-per-request-metrics", "enable_per_request_metrics must be off"),
        ("--grpc", "grpc must be off: this engine has no gRPC server"),
    ],
)
def test_front_end_flags_asking_for_more_are_refused(argv, needle):
    with pytest.raises(ValueError, match=needle):
        _front(argv)
    off = _front("--no-" + argv.removeprefix("--"))
    assert getattr(off, argv.removeprefix("--").replace("-", "_")) is False


def test_no_metric_of_vllm_032_is_hidden():
    # Why any --show-hidden-metrics-for-version is a no-op: this engine's metrics have no
    # hidden (deprecated) ones; vLLM 0.32 reads its flag in no metric either.
    config = _engine("--show-hidden-metrics-for-version", "0.31")
    assert config.observability_config.show_hidden_metrics_for_version == "0.31"


@pytest.mark.parametrize(
    "argv",
    [
        "--mamba-cache-mode all",
        "--lora-dtype float32",
        "--mm-processor-cache-type disk",
        "--safetensors-load-strategy mmap",
    ],
)
def test_second_batch_values_outside_vllms_choices_are_argparse_errors(argv, capsys):
    with pytest.raises(SystemExit):
        _args(*argv.split())
    assert argv.split()[0] in capsys.readouterr().err
