"""What the engine-level tests of the host-side draft methods (n-gram lookup, suffix
decoding) share: a text to copy, a chat through an ``LLM``, and the limits a request keeps
with drafts."""

from __future__ import annotations

from vllm import SamplingParams

CODE = """def area(width, height):
    return width * height


def perimeter(width, height):
    return 2 * (width + height)
"""


def chat(llm, params, *texts):
    """Each text as a one-message chat: (token ids, text, finish reason) per text."""
    out = llm.chat([[{"role": "user", "content": t}] for t in texts], params)
    return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in out]


def check_limits_hold(plain, fast) -> None:
    """max_tokens, a stop string and ignore_eos end a request with drafts (``fast``)
    where they end it without (``plain``)."""
    text = "Repeat this code exactly:\n" + CODE
    for params in (
        SamplingParams(temperature=0, max_tokens=9),
        SamplingParams(temperature=0, max_tokens=60, stop=["height)"]),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    ):
        got, want = chat(fast, params, text), chat(plain, params, text)
        assert got == want, params
        assert len(got[0][0]) <= params.max_tokens
