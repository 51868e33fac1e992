"""ContextServe against the real server and model: a two-turn agent job whose first turn
runs a fast command is pinned (visible in /metrics), its second turn takes the hit, and
the decision is logged with its class and layer."""

from __future__ import annotations

import re

import pytest

from ...utils import RemoteServer

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are a coding agent. Answer with exactly one ```bash``` block holding one command."
    "\nExample:\n```bash\nls\n```"
)


def ask(client, messages, last: bool):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=16,
        temperature=0,
        extra_body={"job_id": "agent-1", "is_last_step": last},
    )
    return resp, resp.choices[0].message.content or ""


def test_context_serve_pins_a_turn_and_serves_the_next_from_it(tmp_path):
    log = tmp_path / "server.log"
    server = RemoteServer(
        "--scheduling-policy", "context_serve", "--num-gpu-blocks-override", "256",
        log_path=str(log),
    )  # fmt: skip
    try:
        client = server.client()
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "List the files in the project."},
        ]
        first, text = ask(client, messages, last=False)
        # FAST (the rule table's 3 s pin) or UNCERTAIN (Continuum's 2 s cold-start TTL):
        # either way the context stays pinned while the "tool" runs.
        m = server.metrics()
        assert m["vllm:pins_total"] == 1 and m["vllm:num_pinned_requests"] == 1
        assert m["vllm:kv_cache_usage_perc"] > 0
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Output:\nmain.py\nutils.py\nREADME.md"},
        ]
        second, _ = ask(client, messages, last=True)
        assert second.usage.prompt_tokens_details.cached_tokens >= 16
        m = server.metrics()
        assert m["vllm:pin_hits_total"] == 1 and m["vllm:num_pinned_requests"] == 0
        assert server.wait_metric("vllm:kv_cache_usage_perc", 0.0) == 0.0  # last step frees
    finally:
        server.stop()
    decisions = re.findall(
        r"job 'agent-1': func_call=.* -> (FAST|SLOW|UNCERTAIN) \((\w+)", log.read_text()
    )
    assert decisions and decisions[0][0] in ("FAST", "UNCERTAIN")
