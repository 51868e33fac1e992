"""The research fork's pin verification, automated against the real server and model.

A 5-turn agent job with growing context: after turns 1-4 the KV usage stays constant
through a ~1 s tool gap (pinned), after the last turn it drops to 0, and each next turn's
prefix hit covers the pinned context. Under FCFS with a tiny pool and a competing job,
the hit is lost.
"""

from __future__ import annotations

import time

import pytest

from ...utils import RemoteServer

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
SYSTEM = (
    "You are a coding agent. Reply with exactly one ```bash``` block holding one "
    "command.\nExample:\n```bash\nls\n```"
)
TASKS = [
    "List the files in the project.",
    "Show main.py.",
    "Search for TODO comments.",
    "Check git status.",
    "Run the tests.",
]
TOOL_OUTPUTS = [
    "main.py\nutils.py\nREADME.md\ntests/\nsetup.py",
    "import sys\nfrom utils import helper\n\n\ndef main():\n    # TODO: parse args\n"
    "    print(helper(sys.argv))\n\n\nif __name__ == '__main__':\n    main()\n",
    "./main.py:6:    # TODO: parse args\n./utils.py:12:    # TODO: handle None\n",
    "On branch main\nChanges not staged for commit:\n\tmodified:   main.py\n",
]
USAGE = "vllm:kv_cache_usage_perc"


def run_turn(client, messages, job, last):
    resp = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=24,
        temperature=0,
        extra_body={"job_id": job, "is_last_step": last},
    )
    return resp, resp.choices[0].message.content


def test_continuum_pins_between_turns_and_frees_after_last():
    server = RemoteServer(
        "--scheduling-policy",
        "continuum",
        "--continuum-default-ttl",
        "5",
        "--num-gpu-blocks-override",
        "256",
    )
    try:
        client = server.client()
        messages = [{"role": "system", "content": SYSTEM}]
        assert server.metrics()[USAGE] == 0.0
        prev_prompt = 0
        for i, task in enumerate(TASKS):
            last = i == len(TASKS) - 1
            messages.append({"role": "user", "content": task})
            resp, text = run_turn(client, messages, "job_alpha", last)
            cached = resp.usage.prompt_tokens_details.cached_tokens
            if i > 0:  # the pinned context of the previous turn was a prefix hit
                assert cached >= (prev_prompt // 16 - 1) * 16 and cached > 0
            prev_prompt = resp.usage.prompt_tokens
            usage = server.metrics()[USAGE]
            if last:
                assert usage == 0.0
                break
            assert usage > 0.0
            for _ in range(3):  # the tool runs for ~1 s: the blocks stay pinned
                time.sleep(0.33)
                assert server.metrics()[USAGE] == usage
            messages.append({"role": "assistant", "content": text})
            messages.append({"role": "user", "content": f"Output:\n{TOOL_OUTPUTS[i]}"})
        m = server.metrics()
        assert m["vllm:pin_hits_total"] == 4 and m["vllm:pins_total"] == 4
        assert m["vllm:num_pinned_requests"] == 0
    finally:
        server.stop()


def test_fcfs_tiny_pool_loses_the_hit_to_a_competing_job():
    # 24 usable blocks (384 tokens). The job's first turn is freed at once under FCFS;
    # a competing job's long prompt then evicts those cached blocks.
    server = RemoteServer("--num-gpu-blocks-override", "25", "--max-model-len", "384")
    try:
        client = server.client()
        messages = [
            {"role": "system", "content": SYSTEM + "\n" + TOOL_OUTPUTS[1] * 2},
            {"role": "user", "content": TASKS[0]},
        ]
        first, text = run_turn(client, messages, "job_a", False)
        assert server.metrics()[USAGE] == 0.0  # freed at once: nothing pinned
        # 362 prompt tokens + 8 outputs = 24 blocks: every block of the pool.
        competitor = [{"role": "user", "content": "Summarise: " + TOOL_OUTPUTS[1] * 8}]
        client.chat.completions.create(
            model=MODEL,
            messages=competitor,
            max_tokens=8,
            extra_body={"job_id": "job_b", "is_last_step": True},
        )
        messages += [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "Output:\n" + TOOL_OUTPUTS[0]},
        ]
        second, _ = run_turn(client, messages, "job_a", True)
        assert second.usage.prompt_tokens_details.cached_tokens < first.usage.prompt_tokens // 2
    finally:
        server.stop()
