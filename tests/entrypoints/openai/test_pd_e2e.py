"""Disaggregated prefill behind vLLM's router (``vllm-router --vllm-pd-disaggregation``):
one kv_producer and one kv_consumer (``--kv-transfer-config``, TcpConnector). The router
prefills on the producer, the consumer fetches the prompt's blocks over TCP and decodes;
greedy text equals what the producer, a normal server too, answers alone. Without the
router: a streamed prefill request is a 400, and a fetch from a closed port fails its
request within the fetch timeout and leaves the consumer serving."""

from __future__ import annotations

import json
import os
import time

import pytest
import requests

from tests.entrypoints.openai.router_marks import ROUTER_E2E
from vllm.benchmarks.router import PDSet
from vllm.entrypoints.utils import get_open_port

pytestmark = ROUTER_E2E

MODEL = "SmolLM2-135M-Instruct"
FETCH_TIMEOUT_S = 5
# PDSet adds each side's role (and the connector) to this config; its keys reach both.
TRANSFER = json.dumps({"kv_connector_extra_config": {"fetch_timeout_s": FETCH_TIMEOUT_S}})
SERVE = ("--num-gpu-blocks-override", "128", "--kv-transfer-config", TRANSFER)
BLOCK = 16
# 100+ tokens: several full blocks to move.
LONG = "Explain, step by step and with care, why the sky looks blue at noon and red at dusk. " * 6


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    log_dir = os.environ.get("PD_E2E_LOG_DIR") or str(tmp_path_factory.mktemp("pd"))
    with PDSet(1, 1, SERVE, log_dir=log_dir) as pd:
        yield pd


def client(base: str):
    import openai

    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)


def chat(base: str, messages: list, **kw):
    return client(base).chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0, **kw
    )


def external_hits(server) -> float:
    return server.metrics().get("vllm:external_prefix_cache_hits_total", 0.0)


def test_chat_through_the_router_equals_the_producer_alone(fleet):
    (producer,), (consumer,) = fleet.prefills, fleet.decodes
    messages = [{"role": "user", "content": LONG}]
    fetched = external_hits(consumer)
    routed = chat(fleet.base, messages)
    alone = chat(producer.base, messages)  # no kv_transfer_params: a plain request
    assert routed.choices[0].message.content == alone.choices[0].message.content
    assert routed.usage.completion_tokens == 12
    # The consumer took the prompt's full blocks from the producer (its tier hits).
    full = (routed.usage.prompt_tokens - 1) // BLOCK * BLOCK  # the last token is computed
    assert routed.usage.prompt_tokens >= 100
    assert external_hits(consumer) - fetched == full


def test_completion_through_the_router_equals_the_producer_alone(fleet):
    (producer,) = fleet.prefills
    prompt = "A short history of the printing press, told in plain words. " * 8
    kw = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    routed = client(fleet.base).completions.create(**kw)
    alone = client(producer.base).completions.create(**kw)
    assert routed.choices[0].text == alone.choices[0].text
    assert routed.usage.completion_tokens == 12


def test_a_streamed_request_and_a_second_turn_through_the_router(fleet):
    (producer,), (consumer,) = fleet.prefills, fleet.decodes
    messages = [
        {"role": "system", "content": "You are a patient teacher of physics."},
        {"role": "user", "content": LONG.replace("sky", "sea")},
    ]
    stream = chat(fleet.base, messages, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat(producer.base, messages).choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 12
    print(f"streamed usage through the router: {chunks[-1].usage}")
    # Turn 2: the history plus a new message; the consumer fetches only the blocks past
    # what it holds of turn 1, and the text still equals the producer's alone.
    messages += [
        {"role": "assistant", "content": text},
        {"role": "user", "content": "Now say it in one sentence."},
    ]
    before = consumer.metrics()
    routed = chat(fleet.base, messages)
    after = consumer.metrics()
    assert (
        routed.choices[0].message.content
        == chat(producer.base, messages).choices[0].message.content
    )
    cached = after["vllm:prompt_tokens_cached_total"] - before["vllm:prompt_tokens_cached_total"]
    assert cached == (routed.usage.prompt_tokens - 1) // BLOCK * BLOCK


def prefill(producer, body: dict) -> dict:
    """The router's first stage by hand: the producer's answer with its kv_transfer_params."""
    stage = {**body, "max_tokens": 1, "stream": False}
    resp = requests.post(
        producer.base + "/v1/completions",
        json={**stage, "kv_transfer_params": {"do_remote_decode": True}},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    return resp.json()["kv_transfer_params"]


def test_the_consumer_reports_the_fetched_blocks_as_cached(fleet):
    """Direct, without the router (which reports the producer's cache accounting)."""
    (producer,), (consumer,) = fleet.prefills, fleet.decodes
    body = {"model": MODEL, "prompt": "Ten facts about owls. " * 20, "max_tokens": 8,
            "temperature": 0}  # fmt: skip
    params = prefill(producer, body)
    assert params["do_remote_prefill"] is True and params["remote_num_tokens"] >= 96
    resp = requests.post(
        consumer.base + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60
    )
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == params["remote_num_tokens"]
    alone = requests.post(producer.base + "/v1/completions", json=body, timeout=60).json()
    assert resp.json()["choices"][0]["text"] == alone["choices"][0]["text"]


def test_a_streamed_prefill_request_is_refused(fleet):
    (producer,) = fleet.prefills
    resp = requests.post(
        producer.base + "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "stream": True,
            "kv_transfer_params": {"do_remote_decode": True},
        },
        timeout=30,
    )
    assert resp.status_code == 400, resp.text
    assert "kv_transfer_params" in resp.text


def test_a_fetch_from_a_closed_port_fails_the_request_and_the_consumer_goes_on(fleet):
    (consumer,) = fleet.decodes
    prompt = "A list of rivers in Europe, from the longest to the shortest. " * 8
    params = {
        "do_remote_prefill": True, "do_remote_decode": False,
        "remote_engine_id": "gone", "remote_request_id": "cmpl-gone",
        "remote_host": "127.0.0.1", "remote_port": get_open_port(),  # nothing listens
        "remote_block_ids": list(range(6)), "remote_num_tokens": 96, "tp_size": 1,
    }  # fmt: skip
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    start = time.monotonic()
    resp = requests.post(
        consumer.base + "/v1/completions", json={**body, "kv_transfer_params": params}, timeout=60
    )
    elapsed = time.monotonic() - start
    assert resp.status_code == 500, resp.text  # policy "fail", vLLM's default
    assert "fetching the KV failed" in resp.text
    assert "no answer from 127.0.0.1" in resp.text, resp.text
    print(f"failed fetch: {resp.status_code} after {elapsed:.1f} s: {resp.text[:300]}")
    assert elapsed < FETCH_TIMEOUT_S + 10, f"the failed fetch took {elapsed:.1f} s"
    ok = requests.post(consumer.base + "/v1/completions", json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
