"""The plugin's seams into upstream: the CLI (``--scheduling-policy continuum``), the
settings, the version check, the pin metrics and the job-fields middleware."""

from __future__ import annotations

import asyncio
import json

import pytest
from conftest import make_request
from harness import make_scheduler, run_until_done, upstream_parser

from vllm_continuum.upstream import cli, compat
from vllm_continuum.upstream.middleware import JobFieldsMiddleware, move_fields
from vllm_continuum.upstream.settings import policy_config_from


def test_general_plugin_is_registered_and_offers_our_policy():
    from importlib.metadata import entry_points

    assert "continuum" in {e.name for e in entry_points(group="vllm.general_plugins")}
    args = upstream_parser().parse_args(
        ["--scheduling-policy", "continuum", "--additional-config", '{"continuum": {}}']
    )
    assert args.scheduling_policy == "continuum"


def test_our_policy_maps_to_our_scheduler_class(vllm_config):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm_continuum.upstream.scheduler import PolicyScheduler, policy_name_from

    args = upstream_parser().parse_args(
        ["--scheduling-policy", "continuum", "--additional-config",
         '{"continuum": {"max_ttl_s": 5}}']
    )  # fmt: skip
    engine_args = AsyncEngineArgs.from_cli_args(args)
    cli.apply_policy(engine_args)
    assert engine_args.scheduler_cls == cli.SCHEDULER
    assert policy_name_from(engine_args.additional_config) == "continuum"
    assert engine_args.scheduling_policy == "fcfs"
    assert engine_args.async_scheduling is None  # upstream decides; cli picks the variant
    from vllm.config import SchedulerConfig

    config = SchedulerConfig(
        scheduler_cls=engine_args.scheduler_cls, max_model_len=512, is_encoder_decoder=False
    )
    assert config.get_scheduler_cls() is PolicyScheduler
    assert policy_config_from(engine_args.additional_config).max_ttl_s == 5


def test_bad_settings_fail_before_start_naming_the_field():
    with pytest.raises(ValueError, match="max_ttl_s"):
        policy_config_from({"continuum": {"max_ttl_s": -1}})
    with pytest.raises(ValueError, match="unknown keys"):
        policy_config_from({"continuum": {"max_tll_s": 1}})


def test_version_check_passes_here_and_fails_clearly_without_a_seam(monkeypatch):
    assert compat.check_upstream().startswith("0.32.")
    from vllm.v1.core.sched.scheduler import Scheduler

    monkeypatch.delattr(Scheduler, "_free_blocks")
    with pytest.raises(compat.UnsupportedUpstreamError, match="tested with upstream vLLM"):
        compat.check_upstream()


def test_pin_metrics_reach_prometheus_and_leave_upstreams_fields_clean(vllm_config):
    from prometheus_client import REGISTRY

    from vllm_continuum.pins import PIN_METRICS
    from vllm_continuum.upstream.metrics import PinStatLogger

    s = make_scheduler(vllm_config)
    s.add_request(make_request(range(31), job="m"))
    run_until_done(s)
    stats = s.make_stats()
    logger = PinStatLogger(vllm_config, 0)
    logger.record(stats, None, engine_idx=0)
    assert not any(k.startswith("continuum:") for k in stats.num_kv_fetch_reqs_by_stage)
    labels = {"model_name": vllm_config.model_config.served_model_name, "engine": "0"}
    assert REGISTRY.get_sample_value("vllm:num_pinned_requests", labels) == 1
    assert REGISTRY.get_sample_value("vllm:pinned_kv_blocks", labels) == 2
    before = REGISTRY.get_sample_value("vllm:pins_total", labels)
    logger.record(s.make_stats(), None, engine_idx=0)  # same totals: no double count
    assert REGISTRY.get_sample_value("vllm:pins_total", labels) == before
    # The series our engine exports, from the same declarations: every one is here.
    for spec in PIN_METRICS:
        suffix = "_total" if spec.kind == "counter" else ""
        assert REGISTRY.get_sample_value(spec.name + suffix, labels) is not None, spec.name


def test_middleware_moves_top_level_job_fields_into_vllm_xargs():
    body = json.dumps({"model": "m", "job_id": "j1", "is_last_step": True}).encode()
    moved = json.loads(move_fields(body))
    assert moved == {"model": "m", "vllm_xargs": {"job_id": "j1", "is_last_step": 1}}
    assert move_fields(b'{"model": "m"}') is None
    seen = {}

    async def app(scope, receive, send):
        message = await receive()
        seen["body"] = json.loads(message["body"])
        seen["length"] = dict(scope["headers"])[b"content-length"]

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "headers": [(b"content-length", b"1")]}
    asyncio.run(JobFieldsMiddleware(app)(scope, receive, None))
    assert seen["body"]["vllm_xargs"]["job_id"] == "j1"
    assert int(seen["length"]) == len(json.dumps(seen["body"]))


@pytest.mark.parametrize(
    "body", [{"model": "m", "job_id": ""}, {"model": "m", "vllm_xargs": {"job_id": ""}}]
)
def test_middleware_refuses_an_empty_job_id_with_a_400_as_our_server(body):
    sent = []

    async def app(scope, receive, send):
        raise AssertionError("an empty job_id must not reach upstream")

    async def receive():
        return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "headers": []}
    asyncio.run(JobFieldsMiddleware(app)(scope, receive, send))
    assert sent[0]["status"] == 400
    error = json.loads(sent[1]["body"])["error"]
    assert error["param"] == "job_id" and "must not be empty" in error["message"]


def test_request_info_keys_jobs_by_the_shared_rule():
    from types import SimpleNamespace

    from vllm_continuum.jobs import job_key
    from vllm_continuum.upstream.request_info import request_info

    def req(request_id, extra):
        params = SimpleNamespace(extra_args=extra)
        return SimpleNamespace(request_id=request_id, sampling_params=params)

    assert request_info(req("r1", {"job_id": "j"}), 0.0).job_key == job_key("j", "r1")
    assert request_info(req("r2", {"job_id": 42}), 0.0).job_key == "42"  # vllm_xargs numbers
    unnamed = request_info(req("r3", {"job_id": ""}), 0.0)  # sent without the middleware
    assert (unnamed.job_key, unnamed.named) == (job_key(None, "r3"), False)


def test_middleware_names_the_job_by_prompt_cache_key_unless_a_job_id_is_given():
    def moved(body):
        out = move_fields(json.dumps(body).encode())
        return None if out is None else json.loads(out)

    got = moved({"model": "m", "prompt_cache_key": "conv-1"})
    assert got["vllm_xargs"] == {"job_id": "conv-1"} and got["prompt_cache_key"] == "conv-1"
    assert moved({"model": "m", "prompt_cache_key": "k", "job_id": "j"})["vllm_xargs"] == {
        "job_id": "j"
    }
    assert moved({"model": "m", "prompt_cache_key": "k", "vllm_xargs": {"job_id": "x"}}) is None
    assert moved({"model": "m", "prompt_cache_key": ""}) is None


def test_request_info_reads_last_step_unless_tool_call_from_vllm_xargs():
    from types import SimpleNamespace

    from vllm_continuum.upstream.request_info import request_info

    params = SimpleNamespace(extra_args={"job_id": "j", "last_step_unless_tool_call": 1})
    info = request_info(SimpleNamespace(request_id="r", sampling_params=params), 0.0)
    assert info.last_unless_tool_call and not info.is_last_step


def test_middleware_names_a_claude_code_turn_on_upstreams_messages_route():
    import hashlib

    sid = "3960bc4c-2743-42f6-b94e-6150c2bacf35"
    system = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328; cch=7;"},
        {"type": "text", "text": "You are an agent.", "cache_control": {"type": "ephemeral"}},
    ]
    body = {"model": "m", "max_tokens": 8, "system": system, "messages": []}
    digest = hashlib.sha256(b"\0You are an agent.").hexdigest()[:12]  # no agent id: main

    def moved(payload, headers, path="/v1/messages"):
        out = move_fields(json.dumps(payload).encode(), path, headers)
        return None if out is None else json.loads(out)["vllm_xargs"]

    header = {"x-claude-code-session-id": sid}
    assert moved(body, header) == {
        "job_id": f"{sid}/{digest}",
        "last_step_unless_tool_call": 1,
    }
    user_id = json.dumps({"device_id": "d", "account_uuid": "", "session_id": sid})
    assert moved({**body, "metadata": {"user_id": user_id}}, {})["job_id"] == f"{sid}/{digest}"
    # The client's own job and last-step flag win; other routes and session-less turns
    # are left alone.
    assert moved({**body, "job_id": "j"}, header) == {"job_id": "j"}
    assert moved({**body, "is_last_step": False}, header) == {
        "job_id": f"{sid}/{digest}",
        "is_last_step": 0,
    }
    assert moved(body, header, "/v1/chat/completions") is None
    assert moved(body, {}) is None
