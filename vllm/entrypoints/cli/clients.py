"""``vllm chat`` and ``vllm complete``: vLLM's small terminal clients of a running server.

``vllm chat`` keeps the conversation (an optional ``--system-prompt`` first) and streams
each reply; ``vllm complete`` streams a completion of each line typed. ``--quick TEXT``
sends one message or prompt, prints the answer and exits. End with Ctrl-D (or Ctrl-C).
Only argparse is imported at parse time.
"""

from __future__ import annotations

import argparse
import os
import sys

DEFAULT_URL = "http://localhost:8000/v1"


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL, help="The server's OpenAI base URL.")
    p.add_argument(
        "--model-name", default=None, help="The model to ask (default: the first /v1/models lists)."
    )
    p.add_argument(
        "--api-key", default=None, help="The server's key (default: OPENAI_API_KEY, if set)."
    )
    p.add_argument("-q", "--quick", default=None, metavar="TEXT", help="Send TEXT once and exit.")


def add_client_parsers(sub) -> None:
    chat = sub.add_parser(
        "chat", help="Chat with a running server.", description=__doc__.splitlines()[0]
    )
    _common(chat)
    chat.add_argument("--system-prompt", default=None, help="A system message to start with.")
    chat.set_defaults(func=run_chat)
    complete = sub.add_parser(
        "complete",
        help="Complete prompts on a running server.",
        description=__doc__.splitlines()[0],
    )
    _common(complete)
    complete.add_argument("--max-tokens", type=int, default=None, help="Tokens per completion.")
    complete.set_defaults(func=run_complete)


def _client(args):
    import openai

    key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    client = openai.OpenAI(base_url=args.url, api_key=key, max_retries=0)
    model = args.model_name or client.models.list().data[0].id
    return client, model


def _lines(quick: str | None):
    """The user's inputs: the one ``--quick`` text, or lines typed until end of input."""
    if quick is not None:
        yield quick
        return
    while True:
        try:
            yield input("> ")
        except EOFError:
            print()
            return


def _stream(parts) -> str:
    text = []
    for piece in parts:
        if piece:
            print(piece, end="", flush=True)
            text.append(piece)
    print()
    return "".join(text)


def run_chat(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    sys.exit(_run(_chat, args))


def run_complete(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    if args.max_tokens is not None and args.max_tokens < 1:
        parser.error("--max-tokens must be at least 1")
    sys.exit(_run(_complete, args))


def _run(loop, args) -> int:
    import openai

    try:
        loop(args)
    except KeyboardInterrupt:
        print()
    except openai.APIError as e:  # the server's refusal, or no server: one line
        message = getattr(e, "message", None) or str(e)
        print(f"vllm {args.command}: error: {message}", file=sys.stderr)
        return 1
    return 0


def _chat(args) -> None:
    client, model = _client(args)
    messages = []
    if args.system_prompt:
        messages.append({"role": "system", "content": args.system_prompt})
    for line in _lines(args.quick):
        messages.append({"role": "user", "content": line})
        stream = client.chat.completions.create(model=model, messages=messages, stream=True)
        reply = _stream(c.choices[0].delta.content for c in stream if c.choices)
        messages.append({"role": "assistant", "content": reply})


def _complete(args) -> None:
    client, model = _client(args)
    for line in _lines(args.quick):
        stream = client.completions.create(
            model=model, prompt=line, max_tokens=args.max_tokens, stream=True
        )
        _stream(c.choices[0].text for c in stream if c.choices)
