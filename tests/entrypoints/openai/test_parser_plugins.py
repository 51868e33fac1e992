"""--tool-parser-plugin and --reasoning-parser-plugin (vLLM's): a Python file that registers
parsers under new names, which --tool-call-parser / --reasoning-parser then select; an
unknown name still fails at start-up with the list of names."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import openai
import pytest

from vllm.entrypoints.openai.parser_plugins import import_parser_plugin, plugin_paths

from ...utils import RemoteServer
from .test_tool_calling_e2e import TEMPLATE, WEATHER

TOOL_PLUGIN = '''
import json

from vllm.entrypoints.openai.tool_parsers import (
    ExtractedToolCalls, ParsedToolCall, ToolParser, register_tool_parser,
)


@register_tool_parser("plugin_weather")
class PluginWeatherParser(ToolParser):
    """Reads any final output as one call of get_weather (Paris), whatever the model wrote."""

    def extract_tool_calls(self, text, final):
        if not final:
            return ExtractedToolCalls(None, [])
        arguments = json.dumps({"city": "Paris"})
        return ExtractedToolCalls(None, [ParsedToolCall("get_weather", arguments, True)])
'''

REASONING_PLUGIN = '''
from vllm.reasoning import ReasoningParser, register_reasoning_parser
from vllm.reasoning.abs_reasoning_parsers import ExtractedReasoning


@register_reasoning_parser("plugin_prefix")
class PrefixReasoningParser(ReasoningParser):
    """The first 3 characters are the reasoning, the rest the content."""

    def extract(self, text, final):
        return ExtractedReasoning(text[:3], text[3:], len(text) >= 3 or final)
'''


@pytest.fixture
def plugins(tmp_path) -> tuple[str, str]:
    tool, reasoning = tmp_path / "my_tool_plugin.py", tmp_path / "my_reasoning_plugin.py"
    tool.write_text(textwrap.dedent(TOOL_PLUGIN))
    reasoning.write_text(textwrap.dedent(REASONING_PLUGIN))
    return str(tool), str(reasoning)


def serve_check(*args: str) -> subprocess.CompletedProcess:
    """``vllm serve --help``-free check of the flags: the parser alone, in a subprocess
    (the registries are per process)."""
    code = (
        "import sys; from vllm.entrypoints.cli import main as m; "
        "m.main(['serve', *sys.argv[1:], '--help'])"
    )
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120
    )


def test_plugin_paths_and_a_bad_plugin(tmp_path):
    argv = ["--tool-parser-plugin", "a.py", "--reasoning-parser-plugin=b.py", "--port", "1"]
    assert plugin_paths(argv) == ["a.py", "b.py"]
    with pytest.raises(ValueError, match="no such module or file"):
        import_parser_plugin(str(tmp_path / "missing.py"))
    broken = tmp_path / "broken_plugin.py"
    broken.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="boom"):
        import_parser_plugin(str(broken))


def test_names_are_validated_at_start_up(plugins):
    tool, reasoning = plugins
    unknown = serve_check("--tool-call-parser", "plugin_weather")
    assert unknown.returncode == 2
    assert "invalid choice: 'plugin_weather'" in unknown.stderr and "hermes" in unknown.stderr
    ok = serve_check(
        "--tool-parser-plugin", tool, "--tool-call-parser", "plugin_weather",
        "--reasoning-parser-plugin", reasoning, "--reasoning-parser", "plugin_prefix",
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    still_unknown = serve_check("--tool-parser-plugin", tool, "--tool-call-parser", "nope")
    assert still_unknown.returncode == 2 and "plugin_weather" in still_unknown.stderr
    missing = serve_check("--tool-parser-plugin", "/nonexistent/p.py")
    assert missing.returncode == 2 and "no such module or file" in missing.stderr


@pytest.mark.slow
def test_a_plugin_parser_serves_a_chat_tool_call(plugins, tmp_path):
    tool, reasoning = plugins
    args = (
        "--enable-auto-tool-choice", "--chat-template", TEMPLATE,
        "--tool-parser-plugin", tool, "--tool-call-parser", "plugin_weather",
        "--reasoning-parser-plugin", reasoning, "--reasoning-parser", "plugin_prefix",
    )  # fmt: skip
    with RemoteServer(*args, log_path=str(tmp_path / "server.log")) as server:
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="x")
        reply = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "What is the weather in Paris?"}],
            tools=[WEATHER],
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert len(choice.message.model_extra["reasoning"]) == 3
