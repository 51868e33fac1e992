"""``vllm run-batch``: OpenAI's batch file format through the server's app, offline."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from vllm.entrypoints.openai.run_batch import parse_line

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "temperature": 0}


def line(custom_id="a", url="/v1/chat/completions", body=None, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": CHAT if body is None else body, **extra})  # fmt: skip


@pytest.mark.parametrize(
    "text,why",
    [
        ("{nope", "not JSON"),
        ("[1]", "JSON object"),
        (line(custom_id=5), "custom_id"),
        (line(method="GET"), "method"),
        (line(url="/v1/tokenize"), "url"),
        (line(body=[1]), "body"),
        (line(body={**CHAT, "stream": True}), "stream"),
    ],
)
def test_lines_that_are_not_requests(text, why):
    item, reason = parse_line(text)
    assert item is None and why in reason


@pytest.mark.slow
def test_run_batch_answers_each_line_in_order(tmp_path):
    from tests.entrypoints.test_generation_config import tiny_model

    model = tiny_model(tmp_path / "tiny")
    requests = [
        line("chat"),
        line("text", "/v1/completions", {"prompt": "One, two,", "max_tokens": 4}),
        line("refused", "/v1/completions", {"prompt": "x", "temperature": -1}),
        "not a request",
        "",
        line("ids", "/v1/completions", {"prompt": [[1, 2], [3]], "max_tokens": 2, "n": 2}),
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(requests) + "\n")
    out = tmp_path / "out.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "run-batch", "-i",
         str(tmp_path / "in.jsonl"), "-o", str(out), "--model", model,
         "--max-model-len", "128", "--num-gpu-blocks-override", "64"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(r) for r in out.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["chat", "text", "refused", None, "ids"]
    chat, text, refused, bad, ids = records
    assert chat["response"]["status_code"] == 200 and chat["error"] is None
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert text["response"]["body"]["usage"]["completion_tokens"] == 4
    assert refused["response"]["status_code"] == 400
    assert refused["response"]["body"]["error"]["param"] == "temperature"
    assert bad["response"] is None and bad["error"]["code"] == "invalid_request"
    assert [c["index"] for c in ids["response"]["body"]["choices"]] == [0, 1, 2, 3]
    assert len({r["id"] for r in records}) == 5
    missing = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.cli.main", "run-batch", "-i",
         str(tmp_path / "none.jsonl"), "-o", str(out), "--model", model],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert missing.returncode == 1 and "vllm run-batch: error:" in missing.stderr
