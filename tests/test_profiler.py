"""--profiler-config (vLLM's): the engine core's steps recorded by torch.profiler between
/start_profile and /stop_profile (or LLM.start_profile / stop_profile), a Chrome trace
written into the configured folder; bad configs refused naming the key."""

from __future__ import annotations

import gzip
import json

import pytest

from vllm.config import ProfilerConfig


def config(tmp_path, **extra) -> dict:
    return {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "traces"), **extra}


@pytest.mark.parametrize(
    "spec, name",
    [
        ({"profiler": "cuda", "torch_profiler_dir": "/tmp/x"}, "profiler_config.profiler"),
        ({"profiler": "torch"}, "profiler_config.torch_profiler_dir"),
        ({"profiler": "torch", "torch_profiler_dir": "rel/dir"},
         "profiler_config.torch_profiler_dir"),
        ({"profiler": "torch", "torch_profiler_dir": "/tmp/x", "torch_profiler_use_gzip": "no"},
         "profiler_config.torch_profiler_use_gzip"),
        ({"profiler": "torch", "torch_profiler_dir": "/tmp/x", "delay_iterations": 2},
         "profiler_config"),
    ],
)  # fmt: skip
def test_bad_configs_are_refused_naming_the_key(spec, name):
    with pytest.raises(ValueError, match=name):
        ProfilerConfig(spec)
    assert not ProfilerConfig().enabled and not ProfilerConfig({"profiler": None}).enabled


def read_trace(path) -> dict:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def ops(trace: dict) -> set[str]:
    return {e.get("name", "") for e in trace["traceEvents"]}


@pytest.mark.slow
def test_offline_start_and_stop_write_a_trace_of_the_steps(tmp_path):
    from tests.entrypoints.test_generation_config import tiny_model
    from vllm import LLM, SamplingParams

    model = tiny_model(tmp_path / "tiny")
    llm = LLM(model=model, kv_cache_memory="16MiB",
              profiler_config=config(tmp_path, torch_profiler_use_gzip=False))  # fmt: skip
    try:
        llm.start_profile()
        llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4))
        llm.stop_profile()
        llm.stop_profile()  # nothing recording: a warning, no second trace
    finally:
        llm.shutdown()
    (trace,) = (tmp_path / "traces").iterdir()
    assert trace.name.startswith("engine_core-") and trace.name.endswith(".pt.trace.json")
    assert any(name.startswith("aten::") for name in ops(read_trace(trace)))
    plain = LLM(model=model, kv_cache_memory="16MiB")
    try:
        with pytest.raises(ValueError, match="--profiler-config"):
            plain.start_profile()
    finally:
        plain.shutdown()


@pytest.mark.slow
def test_the_server_routes_behind_the_key(tmp_path):
    import requests

    from tests.entrypoints.test_generation_config import tiny_model
    from tests.utils import RemoteServer

    model = tiny_model(tmp_path / "tiny")
    server = RemoteServer(
        "--model", model, "--api-key", "k", "--profiler-config", json.dumps(config(tmp_path)),
        log_path=str(tmp_path / "server.log"),
    )  # fmt: skip
    key = {"Authorization": "Bearer k"}
    try:
        assert requests.post(server.base + "/start_profile", timeout=30).status_code == 401
        assert requests.post(server.base + "/start_profile", headers=key, timeout=30).ok
        body = {"model": model, "prompt": "One, two,", "max_tokens": 4}
        assert requests.post(server.base + "/v1/completions", json=body, headers=key).ok
        assert requests.post(server.base + "/stop_profile", headers=key, timeout=60).ok
        (trace,) = (tmp_path / "traces").glob("*.gz")  # written when the route answers
        assert any(name.startswith("aten::") for name in ops(read_trace(trace)))
    finally:
        server.stop()
    plain = RemoteServer("--model", model, log_path=str(tmp_path / "plain.log"))
    try:  # without a profiler (or dev mode) the routes do not exist, as in vLLM
        assert requests.post(plain.base + "/start_profile", timeout=30).status_code == 404
        assert requests.post(plain.base + "/reset_prefix_cache", timeout=30).status_code == 404
        for route in ("/sleep", "/wake_up"):  # sleep mode's, dev mode's too
            assert requests.post(plain.base + route, timeout=30).status_code == 404
        assert requests.get(plain.base + "/is_sleeping", timeout=30).status_code == 404
        # Nor vLLM's other opt-in route (--enable-tokenizer-info-endpoint).
        assert requests.get(plain.base + "/tokenizer_info", timeout=30).status_code == 404
    finally:
        plain.stop()


@pytest.mark.slow
def test_dev_mode_resets_the_prefix_cache(tmp_path):
    import requests

    from tests.entrypoints.test_generation_config import tiny_model
    from tests.utils import RemoteServer

    model = tiny_model(tmp_path / "tiny")
    server = RemoteServer("--model", model, log_path=str(tmp_path / "server.log"),
                          env={"VLLM_SERVER_DEV_MODE": "1"})  # fmt: skip
    prompt = "The tide came in over the flats while the gulls argued about the light. " * 4
    try:

        def cached() -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": 1}
            usage = requests.post(server.base + "/v1/completions", json=body).json()["usage"]
            return usage["prompt_tokens_details"]["cached_tokens"]

        cached()
        assert cached() >= 16
        reset = requests.post(server.base + "/reset_prefix_cache", timeout=30)
        assert reset.json() == {"success": True}
        assert cached() == 0
    finally:
        server.stop()
