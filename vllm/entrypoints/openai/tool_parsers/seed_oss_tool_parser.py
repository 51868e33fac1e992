"""Seed-OSS's calls (vLLM's ``seed_oss``): Qwen3-Coder's XML in Seed's wrapper::

    <seed:tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </seed:tool_call>

Read as ``qwen3_coder`` reads its calls (vLLM's Seed-OSS parser is its Qwen3 one with
these tags): each value typed by the tool's JSON schema, a ``<function=...>`` block
without the wrapper is a call too, the text outside the calls is the content, and the
arguments stream a whole parameter at a time. The markers are special tokens in Seed's
tokenizer, kept in these requests' text.
"""

from __future__ import annotations

from vllm.entrypoints.openai.tool_parsers.abstract_tool_parser import register_tool_parser
from vllm.entrypoints.openai.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser


@register_tool_parser("seed_oss")
class SeedOssToolParser(Qwen3CoderToolParser):
    keeps_special_tokens = True
    tool_open = "<seed:tool_call>"
    tool_close = "</seed:tool_call>"
