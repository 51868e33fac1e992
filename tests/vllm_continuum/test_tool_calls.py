"""Tool-call parsing from real-looking agent outputs, and tool-time estimation."""

from __future__ import annotations

import json

import pytest

from vllm_continuum.estimator import ToolCallEstimator
from vllm_continuum.tool_calls import ToolCallParser

FENCE = "```"

CASES = [
    # (agent output, expected normalised tool name)
    (f"{FENCE}bash\nls\n{FENCE}", "ls"),
    (f"{FENCE}bash\nls -la /testbed\n{FENCE}", "ls"),
    (f"Let me look at the file.\n{FENCE}bash\ncat main.py\n{FENCE}", "cat"),
    (f"{FENCE}bash\ngrep -r 'TODO' .\n{FENCE}", "grep"),
    (f"{FENCE}bash\ngit status\n{FENCE}", "git status"),
    (f"{FENCE}bash\ngit diff HEAD~1 -- src/\n{FENCE}", "git diff"),
    (f"{FENCE}bash\npytest\n{FENCE}", "pytest"),
    (f"{FENCE}bash\npython -m pytest tests/test_api.py -x -q\n{FENCE}", "pytest"),
    (f"{FENCE}bash\npython3 reproduce.py\n{FENCE}", "python3"),
    (f"{FENCE}bash\ncd /testbed && python -m pytest -k regression\n{FENCE}", "pytest"),
    (f"{FENCE}bash\ncd /repo; make test\n{FENCE}", "make test"),
    (f"{FENCE}bash\nsudo apt-get install -y libxml2\n{FENCE}", "apt-get install"),
    (f"{FENCE}bash\nPYTHONPATH=src DEBUG=1 python -m pytest\n{FENCE}", "pytest"),
    (f"{FENCE}bash\ntimeout 60 npm test\n{FENCE}", "npm test"),
    (f"{FENCE}bash\ntime cargo build --release\n{FENCE}", "cargo build"),
    (f"{FENCE}sh\nfind . -name '*.py' | xargs wc -l\n{FENCE}", "find"),
    (f"{FENCE}bash\nsed -i 's/foo/bar/g' src/app.py\n{FENCE}", "sed"),
    (f"{FENCE}bash\npip install -e .\n{FENCE}", "pip install"),
    (f"{FENCE}bash\ndocker build -t app .\n{FENCE}", "docker build"),
    (f"{FENCE}shell\necho 'hello' > out.txt\n{FENCE}", "echo"),
    (f"{FENCE}bash\ncd src\n{FENCE}", "cd"),
    (f"{FENCE}bash\n/usr/bin/env python setup.py test\n{FENCE}", "python"),
    (f"First:\n{FENCE}bash\nls\n{FENCE}\nthen:\n{FENCE}bash\ncat setup.py\n{FENCE}", "cat"),
    (f"{FENCE}bash\nhead -n 50 django/db/models/query.py\n{FENCE}", "head"),
    (
        f"<think>I should run ls first.\n{FENCE}bash\nls\n{FENCE}</think>\n{FENCE}bash\n"
        f"pytest -x\n{FENCE}",
        "pytest",
    ),
    ("<think>maybe ```bash\nrm -rf /\n``` no.</think>The answer is 42.", None),
    ('<tool_call>{"name": "bash", "arguments": {"command": "ls -la"}}</tool_call>', "ls"),
    (
        '<tool_call>\n{"name": "run_tests", "arguments": {"path": "tests/"}}\n</tool_call>',
        "run_tests",
    ),
    (
        json.dumps(
            {
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {
                            "name": "execute_bash",
                            "arguments": json.dumps({"command": "git log -5"}),
                        },
                    }
                ]
            }
        ),
        "git log",
    ),
    (
        json.dumps(
            {
                "tool_calls": [
                    {
                        "function": {
                            "name": "str_replace_editor",
                            "arguments": json.dumps({"path": "a.py"}),
                        }
                    }
                ]
            }
        ),
        "str_replace_editor",
    ),
    (json.dumps({"name": "bash", "arguments": {"cmd": "pwd"}}), "pwd"),
    # Qwen3-Coder's XML calls (--tool-call-parser qwen3_coder).
    (
        "I'll run the tests.\n<tool_call>\n<function=execute_bash>\n<parameter=command>\n"
        "cd /testbed && python -m pytest -x\n</parameter>\n</function>\n</tool_call>",
        "pytest",
    ),
    (
        "<tool_call>\n<function=str_replace_editor>\n<parameter=path>\na.py\n</parameter>\n"
        "</function>\n</tool_call>",
        "str_replace_editor",
    ),
    # Granite 3.x (--tool-call-parser granite) and Llama 3.1 tag their JSON calls.
    ('<|tool_call|>[{"name": "bash", "arguments": {"command": "make test"}}]', "make test"),
    ('<tool_call>[{"name": "str_replace_editor", "arguments": {}}]', "str_replace_editor"),
    ('<|python_tag|>{"name": "bash", "arguments": {"command": "ls"}}', "ls"),
    # Mistral (--tool-call-parser mistral keeps its special tokens in the text).
    ('Checking.[TOOL_CALLS]bash[ARGS]{"command": "git status"}', "git status"),
    ('[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]bash[CALL_ID]x1[ARGS]{"command": "ls"}', "ls"),
    ('[TOOL_CALLS][{"name": "bash", "arguments": {"command": "pytest -x"}}]', "pytest"),
    ("<function=bash>\n<parameter=command>\ngit status", "git status"),  # cut by max_tokens
    ("<think>plan</think>\n<function=bash><parameter=command>ls</parameter></function>", "ls"),
    ("I think the bug is in the parser. No command needed.", None),
    ("", None),
    (f"{FENCE}python\nprint('not a shell block')\n{FENCE}", None),
    (f"{FENCE}bash\n\n{FENCE}", None),
    (f"Let me check.\n{FENCE}bash\ngrep -rn 'def handle' src/", "grep"),  # cut by max_tokens
]


@pytest.mark.parametrize(("text", "tool"), CASES)
def test_parser_table(text, tool):
    call = ToolCallParser().parse(text)
    assert (call.name if call else None) == tool


def test_parser_keeps_full_command():
    call = ToolCallParser().parse(f"{FENCE}bash\ncd /r && pytest -x tests/a.py\n{FENCE}")
    assert call.command == "cd /r && pytest -x tests/a.py"


def test_estimator_tool_time_is_next_arrival_minus_departure():
    est = ToolCallEstimator()
    est.on_arrival("job", 0.0)
    est.on_departure("job", 1.0, "ls")
    assert est.on_arrival("job", 1.25) == "ls"  # the tool that ran in between
    est.on_departure("job", 2.0, "pytest")
    est.on_arrival("job", 5.0)
    assert est.durations("ls") == [0.25] and est.durations("pytest") == [3.0]
    assert est.mean("pytest") == 3.0 and est.num_records == 2


def test_estimator_concurrent_turns_and_jobless_requests_never_crash():
    # The research fork raised KeyError 'func_call' here: two arrivals of one job before
    # any departure, and requests without a job id.
    est = ToolCallEstimator()
    est.on_arrival("job", 0.0)
    est.on_arrival("job", 0.1)
    est.on_departure("job", 1.0, None)
    est.on_departure("job", 1.1, "ls")
    est.on_arrival("job", 1.5)
    est.on_arrival("job", 1.6)  # the departure was already matched: no second record
    assert est.durations("ls") == [pytest.approx(0.4)]
    est.on_departure("request:x", 2.0, "ls")  # a job-less request departing
    est.on_job_end("unknown-job")


def test_estimator_turn_pairs_for_eta():
    est = ToolCallEstimator()
    for t in range(3):
        est.on_arrival("j", float(t))
        est.on_departure("j", t + 0.5, "ls")
    est.on_job_end("j")
    assert est.turn_pairs() == [(1, 2), (2, 1), (3, 0)]
