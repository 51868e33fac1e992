"""What strict tools under tool_choice "auto" cost a request, in each tool-call format
that has a structural tag (docs/tool_calling.md): the grammar's compile to its first
mask (what admission pays, once in the front end's check and once in the engine), and
the mask of each later token while the model writes free text and then a call.

The baseline, measured in the same run on the same tools: tool_choice "required", the
JSON schema of a list of calls that vLLM and this engine guide today. Formats whose
markers are special tokens in their models' tokenizers get them added to a copy of
SmolLM2's, so the grammar is the one such a model would get.

    .venv/bin/python benchmarks/benchmark_strict_tools.py [--tools 1 10 40] [--repeat 5]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchmark_gpu import cpu_model, vector_extensions  # noqa: E402

from vllm.entrypoints.openai.protocol import ChatCompletionRequest  # noqa: E402
from vllm.entrypoints.openai.tool_calling import (  # noqa: E402
    ToolCallingConfig,
    plan_tool_calls,
    special_tokens_of,
)
from vllm.transformers_utils.tokenizer import get_tokenizer  # noqa: E402
from vllm.v1.structured_output.grammar import compile_grammar, new_matcher  # noqa: E402
from vllm.v1.structured_output.validator import build_ll_tokenizer  # noqa: E402

FREE_TEXT = "I will look at the repository first, then run the tests. "
ARGS = {"command": "pytest -x tests/unit", "timeout": 120, "mode": "fast"}


def tool(i: int) -> dict:
    return {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": "Run a shell command in the repository",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string"},
                    "timeout": {"type": "integer"},
                    "mode": {"enum": ["fast", "slow"]},
                    "env": {
                        "type": "object",
                        "properties": {"HOME": {"type": "string"}},
                        "required": ["HOME"],
                    },
                },
                "required": ["command"],
            },
        },
    }


def _xml(name: str) -> str:
    params = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in ARGS.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


def _glm(name: str) -> str:
    pairs = "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in ARGS.items())
    return f"<tool_call>{name}{pairs}</tool_call>"


def _minimax(name: str) -> str:
    params = "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in ARGS.items())
    return f'<minimax:tool_call>\n<invoke name="{name}">\n{params}</invoke>\n</minimax:tool_call>'


ARGS_JSON = json.dumps(ARGS)
# parser -> (special tokens its models' tokenizers have, the text of one call)
FORMATS = {
    "hermes": (
        [], lambda n: f'<tool_call>\n{{"name": "{n}", "arguments": {ARGS_JSON}}}\n</tool_call>'
    ),
    "llama3_json": ([], lambda n: f'{{"name": "{n}", "parameters": {ARGS_JSON}}}'),
    "qwen3_coder": ([], _xml),
    "mistral": (["[TOOL_CALLS]", "[ARGS]"], lambda n: f"[TOOL_CALLS]{n}[ARGS]{ARGS_JSON}"),
    "deepseek_v31": (
        ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
         "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"],
        lambda n: f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{ARGS_JSON}"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    ),
    "kimi_k2": (
        ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
         "<|tool_call_end|>", "<|tool_call_argument_begin|>"],
        lambda n: f"<|tool_calls_section_begin|><|tool_call_begin|>functions.{n}:0"
        f"<|tool_call_argument_begin|>{ARGS_JSON}<|tool_call_end|><|tool_calls_section_end|>",
    ),
    "glm47": (["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
               "</arg_value>"], _glm),
    "minimax_m2": (["<minimax:tool_call>", "</minimax:tool_call>"], _minimax),
}  # fmt: skip
REQUIRED_CALL = json.dumps([{"name": "tool_0", "arguments": ARGS}])


def measure(tokenizer, grammar_of, text: str, repeat: int) -> tuple[float, float]:
    """Median ms from the request to the grammar's first mask, and median us a token of
    mask + advance over ``text``."""
    ll = build_ll_tokenizer(tokenizer, len(tokenizer), tokenizer.eos_token_id)
    ids = tokenizer.encode(text)
    compiles, per_token = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        matcher = new_matcher(ll, compile_grammar(grammar_of()))
        compiles.append((time.perf_counter() - start) * 1e3)
        assert not matcher.is_error(), matcher.get_error()
        start = time.perf_counter()
        for token in ids:
            if not matcher.consume_token(token):
                raise AssertionError(f"the grammar refused {tokenizer.decode([token])!r}")
            matcher.compute_bitmask()
        per_token.append((time.perf_counter() - start) * 1e6 / len(ids))
    return statistics.median(compiles), statistics.median(per_token)


def plan(parser: str, tokenizer, tools: list[dict], **fields):
    config = ToolCallingConfig(
        True, parser, tool_strict_level="parameter", special_tokens=special_tokens_of(tokenizer)
    )
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": tools, **fields}
    return plan_tool_calls(ChatCompletionRequest(**body), config).structured_outputs


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tools", type=int, nargs="+", default=[1, 10, 40])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    base = get_tokenizer("SmolLM2-135M-Instruct")
    print(f"# {cpu_model()} ({vector_extensions()}), one thread; SmolLM2's 49k-token vocabulary")
    print("# compile: request -> first mask (ms); mask: a token's mask + advance (us);")
    print("# ratio: against tool_choice 'required' on the same tools, measured here")
    print(f"{'format':<14}{'tools':>6}{'compile ms':>12}{'x req':>7}{'mask us':>10}{'x req':>7}")
    for n in args.tools:
        tools = [tool(i) for i in range(n)]
        req_compile, req_mask = measure(
            base, lambda tools=tools: plan("hermes", base, tools, tool_choice="required"),
            REQUIRED_CALL, args.repeat,
        )  # fmt: skip
        print(f"{'required':<14}{n:>6}{req_compile:>12.2f}{'1.00':>7}{req_mask:>10.1f}{'1.00':>7}")
        for parser, (special, call) in FORMATS.items():
            tokenizer = base
            if special:
                tokenizer = copy.deepcopy(base)
                tokenizer.add_special_tokens({"additional_special_tokens": special})
            compile_ms, mask_us = measure(
                tokenizer, lambda p=parser, t=tokenizer, tools=tools: plan(p, t, tools),
                FREE_TEXT + call(f"tool_{n - 1}"), args.repeat,
            )  # fmt: skip
            print(
                f"{parser:<14}{n:>6}{compile_ms:>12.2f}{compile_ms / req_compile:>7.2f}"
                f"{mask_us:>10.1f}{mask_us / req_mask:>7.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
