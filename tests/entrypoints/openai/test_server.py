"""End-to-end: the real server and model, driven by the official openai client."""

from __future__ import annotations

import json
import signal
import socket
import time

import anthropic
import openai
import psutil
import pytest
import requests

from ...utils import RemoteServer

pytestmark = pytest.mark.slow
API_KEY = "sk-test"
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server():
    # fp32: prompt logprobs are compared with transformers' (the default is the gguf path).
    srv = RemoteServer(
        "--num-gpu-blocks-override",
        "128",
        "--max-model-len",
        "1024",
        "--api-key",
        API_KEY,
        "--quantization",
        "fp32",
    )
    engine = [
        p
        for p in psutil.Process(srv.proc.pid).children()
        if "--multiprocessing-fork" in p.cmdline()
    ]
    try:
        yield srv
        # SIGTERM to the API server alone (as `kill PID` does) stops both processes.
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(20) == 0
        assert len(engine) == 1
        engine[0].wait(5)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=API_KEY)


def chat(client, content="What is the capital of France?", **kw):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw
    )


def test_models_health_version(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert requests.get(server.base + "/health").status_code == 200
    assert requests.get(server.base + "/version").json()["version"]


def test_chat_non_streaming_with_agent_metadata(client):
    resp = chat(
        client,
        max_tokens=24,
        temperature=0,
        extra_body={"job_id": "job_alpha", "is_last_step": False},
    )
    choice = resp.choices[0]
    assert "Paris" in choice.message.content and choice.finish_reason == "stop"
    assert resp.usage.prompt_tokens > 10
    assert 0 < resp.usage.completion_tokens <= 24
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client):
    kw = {"max_tokens": 16, "temperature": 0}
    full = chat(client, "Count from one to ten.", **kw).choices[0].message.content
    stream = chat(
        client, "Count from one to ten.", stream=True, stream_options={"include_usage": True}, **kw
    )
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert "".join(parts) == full
    assert usage is not None and usage.completion_tokens == 16 and finish == "length"


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_continuous_usage_stats_count_every_chunk(client, route):
    # vLLM's stream_options.continuous_usage_stats: each chunk carries the usage so far.
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw = {"max_tokens": 8, "temperature": 0, "stream": True, "stream_options": options}
    if route == "chat":
        stream = chat(client, "Count from one to ten.", **kw)
    else:
        stream = client.completions.create(model=MODEL, prompt="One, two,", **kw)
    chunks = list(stream)
    usages = [c.usage for c in chunks]
    assert all(u is not None for u in usages)
    completion = [u.completion_tokens for u in usages]
    assert completion == sorted(completion) and completion[-1] == 8
    assert len({u.prompt_tokens for u in usages}) == 1 and usages[0].prompt_tokens > 0
    assert all(u.total_tokens == u.prompt_tokens + u.completion_tokens for u in usages)


def test_return_token_ids_on_chat(client, tokenizer):
    # vLLM's return_token_ids: the prompt's ids and each choice's, whole or per chunk.
    kw = {"max_tokens": 8, "temperature": 0, "extra_body": {"return_token_ids": True}}
    reply = chat(client, "Count from one to ten.", **kw)
    prompt_ids, ids = reply.prompt_token_ids, reply.choices[0].token_ids
    assert len(prompt_ids) == reply.usage.prompt_tokens and len(ids) == 8
    assert tokenizer.decode(ids, skip_special_tokens=True) == reply.choices[0].message.content
    assert tokenizer.decode(prompt_ids).endswith("<|im_start|>assistant\n")
    chunks = list(chat(client, "Count from one to ten.", stream=True, **kw))
    assert chunks[0].prompt_token_ids == prompt_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    streamed = [t for c in chunks for ch in c.choices for t in getattr(ch, "token_ids", [])]
    assert streamed == ids
    plain = chat(client, "Count from one to ten.", max_tokens=8, temperature=0)
    assert getattr(plain, "prompt_token_ids", None) is None


def test_return_token_ids_on_completions(client, tokenizer):
    kw = {"max_tokens": 8, "temperature": 0, "extra_body": {"return_token_ids": True}}
    reply = client.completions.create(model=MODEL, prompt="One, two,", **kw)
    choice = reply.choices[0]
    assert choice.prompt_token_ids == tokenizer.encode("One, two,")
    assert len(choice.token_ids) == 8
    stream = client.completions.create(model=MODEL, prompt="One, two,", stream=True, **kw)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].prompt_token_ids == choice.prompt_token_ids
    assert all(c.prompt_token_ids is None for c in chunks[1:])
    assert [t for c in chunks for t in c.token_ids] == choice.token_ids


@pytest.mark.parametrize("route", ["chat", "completion"])
def test_stream_interval_gathers_tokens_into_fewer_chunks(client, route):
    # vLLM's per-request stream_interval: the first token at once, then every 5, then the
    # rest at the end; the same tokens and text as a stream of every step's.
    def stream(interval):
        extra = {"return_token_ids": True, "ignore_eos": True}
        if interval is not None:
            extra["stream_interval"] = interval
        kw = {"max_tokens": 14, "temperature": 0, "stream": True, "extra_body": extra}
        if route == "chat":
            chunks = chat(client, "Count from one to ten.", **kw)
            texts = lambda c: c.delta.content or ""  # noqa: E731
        else:
            chunks = client.completions.create(model=MODEL, prompt="One, two,", **kw)
            texts = lambda c: c.text  # noqa: E731
        choices = [ch for c in chunks for ch in c.choices if getattr(ch, "token_ids", None)]
        return [ch.token_ids for ch in choices], "".join(texts(ch) for ch in choices)

    ids_one, text_one = stream(None)
    ids_five, text_five = stream(5)
    assert [len(ids) for ids in ids_one] == [1] * 14
    assert [len(ids) for ids in ids_five] == [1, 5, 5, 3]
    assert sum(ids_five, []) == sum(ids_one, []) and text_five == text_one


@pytest.mark.parametrize("bad", [0, -1, 2.5, "4"])
def test_bad_stream_interval_is_a_400_naming_it(client, bad):
    with pytest.raises(openai.BadRequestError) as e:
        chat(client, max_tokens=4, stream=True, extra_body={"stream_interval": bad})
    assert "stream_interval" in str(e.value)


@pytest.mark.parametrize(
    "options", [{"include_obfuscation": True}, {"include_usage": True, "bogus": 1}]
)
def test_stream_options_not_served_are_400s(client, options):
    with pytest.raises(openai.BadRequestError, match="stream_options"):
        chat(client, "hi", max_tokens=2, stream=True, stream_options=options)


def test_timing_headers_split_server_and_engine_time(server):
    r = requests.post(
        server.base + "/v1/completions",
        json={"prompt": "Hello", "max_tokens": 3},
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    server_s = float(r.headers["x-vllm-server-latency"])
    engine_s = float(r.headers["x-vllm-engine-latency"])
    assert 0 < engine_s <= server_s < 60
    assert server.metrics()["vllm:request_server_overhead_seconds_count"] >= 1


def test_completion_n_logprobs_stop(client):
    resp = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, logprobs=2, stop=[" 7"]
    )
    c = resp.choices[0]
    assert c.text.strip().startswith("5") and " 7" not in c.text and c.finish_reason == "stop"
    assert len(c.logprobs.token_logprobs) == len(c.logprobs.tokens) > 0
    two = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=8, n=2, seed=1, temperature=1.0
    )
    assert sorted(c.index for c in two.choices) == [0, 1]


def test_prompt_logprobs_in_vllm_s_shape(server, client, tokenizer, hf_model):
    import torch

    prompt = "The capital of France is Paris, and the capital of Italy is"
    ids = tokenizer(prompt).input_ids
    resp = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    plp = resp.choices[0].model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for p in range(1, len(ids)):
        position = plp[p]  # {token_id: {logprob, rank, decoded_token}}: the prompt's first
        first_id, first = next(iter(position.items()))
        assert int(first_id) == ids[p] and 2 <= len(position) <= 3
        assert first["logprob"] == pytest.approx(float(ref[p - 1, ids[p]]), abs=2e-3)
        assert first["decoded_token"] == tokenizer.decode([ids[p]]) and first["rank"] >= 1
        assert {1, 2} <= {v["rank"] for v in position.values()}  # the top 2
    # Chat: at the top level, as vLLM does.
    body = chat(client, max_tokens=1, extra_body={"prompt_logprobs": 0}).model_extra
    assert body["prompt_logprobs"][0] is None and len(body["prompt_logprobs"]) > 10
    # echo + logprobs: the prompt's tokens lead the logprobs (the first with null ones).
    echo = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=1, echo=True
    ).choices[0]
    assert echo.text.startswith(prompt)
    assert echo.logprobs.tokens[: len(ids)] == [tokenizer.decode([t]) for t in ids]
    assert len(echo.logprobs.tokens) == len(echo.logprobs.token_logprobs) > len(ids)
    assert echo.logprobs.token_logprobs[0] is None and echo.logprobs.top_logprobs[0] is None
    first_lp = plp[1][str(ids[1])]["logprob"]
    assert echo.logprobs.token_logprobs[1] == pytest.approx(first_lp, abs=1e-4)
    # Not in a stream (as vLLM): a 400 naming the field.
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt=prompt, stream=True, extra_body={"prompt_logprobs": 1}
        )
    assert "prompt_logprobs" in str(info.value)


def test_agent_metadata_in_three_places_and_type_errors(server, client):
    ok = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    url = server.base + "/v1/chat/completions"
    for extra in (
        {"job_id": "j1", "is_last_step": True},
        {"vllm_xargs": {"job_id": "j2", "is_last_step": False}},
        {"extra_body": {"job_id": "j3", "is_last_step": True}},
    ):
        assert requests.post(url, json={**ok, **extra}, headers=headers).status_code == 200
    for extra, field in (
        ({"job_id": 5}, "job_id"),
        ({"extra_body": {"is_last_step": "no"}}, "is_last_step"),
        ({"vllm_xargs": {"job_id": ["x"]}}, "job_id"),
    ):
        r = requests.post(url, json={**ok, **extra}, headers=headers)
        assert r.status_code == 400, extra
        assert r.json()["error"]["param"] == field


def test_a_max_tokens_past_the_context_is_capped_as_vllm_does(server, client):
    # max_model_len 1024: 100000 asks for more than is left; vLLM caps it, so do we.
    r = chat(client, "Write a long story about a dragon.", max_tokens=100000, stream=True)
    chunks = list(r)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "nope"}, "model"),
        ({"temperature": -1}, "temperature"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "word " * 1500}]}, "messages"),  # too long
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, "messages"),
    ],
)
def test_bad_requests_get_openai_errors(server, body, param):
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    r = requests.post(
        server.base + "/v1/chat/completions",
        json=payload,
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    # An unknown model is a 404, as in vLLM (a LoRA adapter's name is a model too).
    assert r.status_code == (404 if param == "model" else 400)
    err = r.json()["error"]
    assert err["param"] == param and err["message"] and err["type"]


def test_invalid_json_long_prompt_and_api_key(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    r = requests.post(server.base + "/v1/chat/completions", data="{not json", headers=headers)
    assert r.status_code == 400 and "error" in r.json()
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        chat(client, "word " * 1500)
    bad = server.client(api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        chat(bad, max_tokens=2)


def test_anthropic_clients_send_the_key_as_x_api_key(server):
    messages = [{"role": "user", "content": "Hi"}]
    good = anthropic.Anthropic(base_url=server.base, api_key=API_KEY, max_retries=0)
    assert good.messages.create(model=MODEL, max_tokens=2, messages=messages).content
    bad = anthropic.Anthropic(base_url=server.base, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=2, messages=messages)
    assert e.value.body["error"]["type"] == "authentication_error"
    # The bearer form works on every route, x-api-key too.
    r = requests.post(
        server.base + "/v1/completions",
        json={"model": MODEL, "prompt": "Hi", "max_tokens": 2},
        headers={"x-api-key": API_KEY},
    )
    assert r.status_code == 200


def test_disconnect_mid_stream_aborts_and_frees_blocks(server, client):
    stream = chat(
        client,
        "Write a very long story about dragons.",
        max_tokens=400,
        stream=True,
        temperature=0.8,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    stream.close()
    assert server.wait_metric("vllm:num_requests_running", 0.0) == 0.0
    assert server.wait_metric("vllm:kv_cache_usage_perc", 0.0) == 0.0


def _raw_chat(server, stream: bool) -> socket.socket:
    """A chat request on a bare socket (nothing read back): 900 tokens, EOS ignored, so
    only an abort frees the engine before the test times out."""
    story = [{"role": "user", "content": "Write a very long story about dragons."}]
    return _raw_post(server, "/v1/chat/completions", {"messages": story, "stream": stream})


def _raw_post(server, path: str, fields: dict) -> socket.socket:
    """``fields`` posted to ``path`` on a bare socket, 900 tokens and EOS ignored."""
    body = json.dumps({"max_tokens": 900, "ignore_eos": True, **fields}).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(head + body)
    return sock


def _assert_engine_idle(server) -> None:
    assert server.wait_metric("vllm:num_requests_running", 0.0) == 0.0
    assert server.wait_metric("vllm:kv_cache_usage_perc", 0.0) == 0.0
    generated = server.metrics()["vllm:generation_tokens_total"]
    time.sleep(1.0)  # still idle a moment later: nothing generates for the lost client
    m = server.metrics()
    assert m["vllm:num_requests_running"] == 0.0 and m["vllm:kv_cache_usage_perc"] == 0.0
    assert m["vllm:generation_tokens_total"] == generated


def test_disconnect_during_non_streaming_request_aborts(server):
    sock = _raw_chat(server, stream=False)
    try:
        # Running and holding blocks while the client waits for its JSON.
        assert server.wait_metric("vllm:num_requests_running", 1.0) == 1.0
        assert server.metrics()["vllm:kv_cache_usage_perc"] > 0.0
    finally:
        sock.close()
    _assert_engine_idle(server)


def test_disconnect_before_stream_starts_aborts(server):
    before = server.metrics()["vllm:generation_tokens_total"]
    _raw_chat(server, stream=True).close()  # gone before the first SSE chunk
    # The request reaches the engine a moment after the close. Unaborted, it would run
    # 900 tokens (a minute here), so after 2 s it would still show as running.
    time.sleep(2.0)
    _assert_engine_idle(server)
    assert server.metrics()["vllm:generation_tokens_total"] - before < 900


def test_metrics_names_and_text_format(server, client):
    chat(client, max_tokens=4)
    r = requests.get(
        server.base + "/metrics", headers={"Accept": "application/openmetrics-text; version=1.0.0"}
    )
    assert r.headers["content-type"].startswith("text/plain")
    assert "vllm:kv_cache_usage_perc{" in r.text  # not escaped to vllm_kv_...
    m = server.metrics()
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:time_to_first_token_seconds_count",
        "vllm:time_per_output_token_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:request_queue_time_seconds_count",
        "vllm:num_pinned_requests",
        "vllm:pinned_kv_blocks",
        "vllm:inter_token_latency_seconds_count",
        "vllm:request_prefill_time_seconds_count",
        "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_count",
        "vllm:request_max_num_generation_tokens_count",
        "vllm:request_params_n_count",
        "vllm:request_params_max_tokens_count",
        "vllm:iteration_tokens_total_count",
        "vllm:prompt_tokens_cached_total",
    ):
        assert name in m, name
    assert m["vllm:generation_tokens_total"] > 0 and m["vllm:prompt_tokens_total"] > 0
    assert m["vllm:e2e_request_latency_seconds_count"] >= 1
    # 4 tokens a request: 3 intervals each, and at least a prefill and a decode step.
    assert m["vllm:inter_token_latency_seconds_count"] >= 3
    assert m["vllm:iteration_tokens_total_count"] >= 2
    assert m["vllm:request_params_max_tokens_count"] >= 1


BATCH = ["One, two, three,", "The capital of France is", "def add(a, b):"]


def _completion(client, prompt, **kw):
    return client.completions.create(model=MODEL, prompt=prompt, temperature=0, **kw)


def test_batched_prompts_answer_as_their_single_prompts_do(client, tokenizer):
    # vLLM's numbering: prompt i's choice j is choice i * n + j; the usage counts them all.
    singles = [_completion(client, p, max_tokens=6, echo=True) for p in BATCH]
    batch = _completion(client, BATCH, max_tokens=6, n=2, echo=True)
    assert [c.index for c in batch.choices] == list(range(6))
    for i, single in enumerate(singles):
        for c in batch.choices[2 * i : 2 * i + 2]:
            assert c.text == single.choices[0].text and c.text.startswith(BATCH[i])
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 2 * sum(s.usage.completion_tokens for s in singles)
    # Token-id prompts batch too; each choice carries its own prompt's ids.
    ids = [tokenizer.encode(p) for p in BATCH[:2]]
    by_ids = _completion(client, ids, max_tokens=6, extra_body={"return_token_ids": True})
    assert [c.prompt_token_ids for c in by_ids.choices] == ids
    assert [c.text for c in by_ids.choices] == [
        s.choices[0].text[len(p) :] for s, p in zip(singles[:2], BATCH[:2], strict=True)
    ]


def test_a_batch_streams_each_choice_under_its_index(client):
    options = {"include_usage": True}
    plain = _completion(client, BATCH, max_tokens=8, n=2)
    stream = _completion(
        client, BATCH, max_tokens=8, n=2, stream=True, stream_options=options,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    firsts: dict[int, list[int] | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            firsts.setdefault(c.index, c.prompt_token_ids)
    assert texts == {c.index: c.text for c in plain.choices}
    assert usage.prompt_tokens == plain.usage.prompt_tokens
    assert usage.completion_tokens == plain.usage.completion_tokens
    # Each choice's first chunk names its own prompt's ids.
    assert firsts[0] == firsts[1] != firsts[2] == firsts[3] != firsts[4]


def test_bad_batches_are_400s_and_leave_nothing_queued(server, client):
    headers = {"Authorization": f"Bearer {API_KEY}"}

    def post(prompt, **kw):
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, **kw}
        return requests.post(server.base + "/v1/completions", json=body, headers=headers)

    r = post(["a"] * 65, n=2)  # 130 sequences, past --max-n-sequences (128)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert "--max-n-sequences" in r.json()["error"]["message"]
    # The last prompt is past the context: the batch fails before any of it runs.
    before = server.metrics()["vllm:prompt_tokens_total"]
    r = post(["Hello", "Hi there", "word " * 1500], max_tokens=900, ignore_eos=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    assert r.json()["error"]["message"].startswith("prompt 2: ")
    _assert_engine_idle(server)
    assert server.metrics()["vllm:prompt_tokens_total"] == before
    r = post(["Hello", [1, 2]])  # text and token ids in one batch
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_a_batch_aborts_every_prompt(server, stream):
    sock = _raw_post(server, "/v1/completions", {"prompt": BATCH, "stream": stream})
    try:
        assert server.wait_metric("vllm:num_requests_running", 3.0) == 3.0
    finally:
        sock.close()
    _assert_engine_idle(server)


PREFILL = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is"},
]


def test_continue_final_message_goes_on_with_the_assistant_turn(server, client, tokenizer):
    # vLLM's continue_final_message: the model continues the turn the client began; the
    # prompt is the template's text up to that turn's content (no end of turn).
    kw = {"max_tokens": 6, "temperature": 0}
    cont = {"add_generation_prompt": False, "continue_final_message": True}
    rendered = requests.post(
        server.base + "/v1/chat/completions/render",
        json={"messages": PREFILL, **cont},
        headers={"Authorization": f"Bearer {API_KEY}"},
    ).json()
    text = tokenizer.decode(rendered["token_ids"])
    assert text.endswith("assistant\nThe capital of France is")
    plain = client.completions.create(model=MODEL, prompt=rendered["token_ids"], **kw)
    reply = client.chat.completions.create(model=MODEL, messages=PREFILL, extra_body=cont, **kw)
    assert reply.choices[0].message.content == plain.choices[0].text
    assert reply.usage.prompt_tokens == len(rendered["token_ids"])
    # echo: the reply leads with the turn's given start, streamed or not.
    echoed = client.chat.completions.create(
        model=MODEL, messages=PREFILL, extra_body={**cont, "echo": True}, **kw
    )
    whole = PREFILL[-1]["content"] + plain.choices[0].text
    assert echoed.choices[0].message.content == whole
    stream = client.chat.completions.create(
        model=MODEL, messages=PREFILL, stream=True, extra_body={**cont, "echo": True}, **kw
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    # echo after a user message has nothing of the assistant's to repeat.
    asked = chat(client, max_tokens=6, temperature=0, extra_body={"echo": True})
    assert (
        asked.choices[0].message.content
        == chat(client, max_tokens=6, temperature=0).choices[0].message.content
    )


def test_continue_final_message_needs_add_generation_prompt_off(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=MODEL, messages=PREFILL, extra_body={"continue_final_message": True}
        )
    assert e.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as e:  # still a chat field only
        client.completions.create(
            model=MODEL, prompt="Hi", extra_body={"continue_final_message": True}
        )
    assert e.value.body["param"] == "continue_final_message"


def test_beam_search_on_completions_and_chat(client):
    # vLLM's use_beam_search: n beams, best first. One beam with EOS ignored is greedy.
    beam = {"use_beam_search": True, "ignore_eos": True}
    greedy = _completion(client, BATCH[1], max_tokens=6, extra_body={"ignore_eos": True})
    one = client.completions.create(
        model=MODEL, prompt=BATCH[1], max_tokens=6, n=1, extra_body=beam
    )
    assert one.choices[0].text == greedy.choices[0].text
    three = client.completions.create(
        model=MODEL, prompt=BATCH[:2], max_tokens=6, n=3, extra_body={"use_beam_search": True}
    )
    assert [c.index for c in three.choices] == list(range(6))
    for i in (0, 1):
        texts = [c.text for c in three.choices[3 * i : 3 * i + 3]]
        assert len(set(texts)) == 3 and all(texts)
    assert three.usage.prompt_tokens == sum(
        _completion(client, p, max_tokens=1).usage.prompt_tokens for p in BATCH[:2]
    )
    reply = chat(client, max_tokens=8, n=2, extra_body={"use_beam_search": True})
    assert len({c.message.content for c in reply.choices}) == 2
    assert all(c.message.role == "assistant" for c in reply.choices)
    # A stream gets the whole response as one chunk, as vLLM sends it.
    chunks = list(
        chat(client, max_tokens=4, n=2, stream=True, extra_body={"use_beam_search": True})
    )
    assert len(chunks) == 1 and [c.index for c in chunks[0].choices] == [0, 1]
    assert chunks[0].choices[0].delta.content


@pytest.mark.parametrize(
    "fields,param",
    [
        ({"temperature": 0.7}, "temperature"),
        ({"logprobs": 2}, "logprobs"),
        ({"stop": ["x"]}, "stop"),
        ({"n": 11}, "n"),  # 22 logprobs a step, past --max-logprobs
        ({"job_id": "j"}, "job_id"),
        ({"structured_outputs": {"choice": ["a"]}}, "structured_outputs"),
        ({"use_beam_search": False, "length_penalty": 0.5}, "length_penalty"),
    ],
)
def test_beam_search_refuses_what_it_does_not_do(server, fields, param):
    body = {"model": MODEL, "prompt": "Hi", "use_beam_search": True, **fields}
    r = requests.post(
        server.base + "/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_a_client_leaving_a_beam_search_stops_it(server):
    # 900 steps of one-token requests, 3 at a time; the search is under way after 3 steps.
    before = server.metrics()["vllm:generation_tokens_total"]
    body = {"prompt": "Once upon a time", "use_beam_search": True, "n": 3}
    sock = _raw_post(server, "/v1/completions", body)
    try:
        deadline = time.monotonic() + 30
        while server.metrics()["vllm:generation_tokens_total"] < before + 9:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        sock.close()
    # Between two steps the engine looks idle; the search notices the client at its next
    # step (tens of ms): look once that is surely past.
    time.sleep(1.0)
    _assert_engine_idle(server)
    assert server.metrics()["vllm:generation_tokens_total"] - before < 3 * 100


def test_completion_logprobs_carry_text_offsets(client):
    # OpenAI's legacy text_offset, as vLLM counts it: each token's start in the choice's
    # text, its decoded tokens' lengths added up; streamed, continued across chunks.
    kw = {"max_tokens": 8, "logprobs": 1}  # greedy (_completion)
    plain = _completion(client, "One, two,", **kw).choices[0].logprobs
    starts = [0]
    for token in plain.tokens[:-1]:
        starts.append(starts[-1] + len(token))
    assert plain.text_offset == starts and len(starts) == 8
    chunks = [c.choices[0].logprobs for c in _completion(client, "One, two,", stream=True, **kw)]
    assert [o for lp in chunks if lp for o in lp.text_offset] == starts
    echoed = _completion(client, "One, two,", echo=True, **kw).choices[0].logprobs
    assert echoed.text_offset[0] == 0 and echoed.text_offset[-8:] == [
        o + len("One, two,") for o in starts
    ]
