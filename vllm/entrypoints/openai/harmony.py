"""Reading gpt-oss output: OpenAI's harmony format, from the decoded text with its special
tokens kept.

After the prompt's final ``<|start|>assistant`` the model writes messages::

    <|channel|>analysis<|message|>...reasoning...<|end|>
    <|start|>assistant<|channel|>final<|message|>...answer...<|return|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{}<|call|>

A header (up to ``<|message|>``) names the channel, the recipient (``to=...``, before or
after the channel) and the content type; the body runs to ``<|end|>``, ``<|return|>`` or
``<|call|>`` (the last two are stop tokens: the engine leaves them out of the text, so an
output usually ends inside its last body). Messages are sorted as vLLM sorts them: a
recipient that is a function (``functions.NAME``, or a bare name that is not one of the
built-in tools) makes a tool call; else the ``analysis`` channel is reasoning, ``final``
and a ``commentary`` without a recipient (a preamble) are content; anything else (another
role, an unknown channel, a built-in tool's call) is not shown.

The reader works on text, not token ids, as every parser here does: the streamed,
non-streamed, ``n`` and beam-search paths all hand it text, and each marker is a single
special token whose text is exactly its name. It never raises: where the structure breaks
(plain text with no header, text between messages, a terminator inside a header, a header
past ``MAX_HEADER_CHARS``) the rest of the output is plain content, its markers removed.
No special token's text ever reaches the client.

Streaming (``final=False``) the text may stop at any character: a possible start of a
marker at its end is held back, a message appears once its header is complete, and every
message's text only grows (each reading's is a prefix of the next one's, and of the final
one's), so the streamed pieces add up to the whole-output reading.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
TERMINATORS = frozenset((END, RETURN, CALL))
# Longer "headers" are not headers: the model is writing text, not harmony.
MAX_HEADER_CHARS = 256
# The o200k_harmony vocabulary's other special tokens: removed wherever they occur.
_OTHER_SPECIAL = re.compile(r"<\|(?:endoftext|startoftext|endofprompt|reserved_\d+)\|>")
_SPLIT = re.compile("(" + "|".join(re.escape(m) for m in MARKERS) + ")")
_PARTIAL_MARKER = re.compile(r"<(?:\|[a-z0-9_]*\|?)?\Z")  # "<", "<|", "<|chan", "<|end|"
_BUILTIN_TOOLS = frozenset(("python", "browser", "container"))  # vLLM's built-in tools
_HEADER_STARTS = (CHANNEL, "to=", "assistant")  # the first header, the role already given

REASONING, CONTENT, TOOL = "reasoning", "content", "tool"


def is_function_recipient(recipient: str | None) -> bool:
    """vLLM's rule: ``functions.NAME``, or any bare recipient but ``assistant``, a marker or
    a built-in tool (``python``, ``browser.search``, ``container.exec``)."""
    if not recipient or recipient.startswith("<|") or recipient == "assistant":
        return False
    if recipient.startswith("functions."):
        return len(recipient) > len("functions.")
    return recipient.split(".", 1)[0] not in _BUILTIN_TOOLS


@dataclass
class HarmonyMessage:
    """One message of the output; ``complete``: its terminator was read (an output's last
    message usually has none: the stop token is not in the text)."""

    role: str
    channel: str | None
    recipient: str | None
    content_type: str | None
    text: str = ""
    complete: bool = False

    @property
    def kind(self) -> str | None:
        """``TOOL``, ``REASONING``, ``CONTENT`` or None (not shown), as vLLM sorts them."""
        if self.role != "assistant":
            return None
        if is_function_recipient(self.recipient):
            return TOOL
        if self.channel == "analysis":
            return REASONING
        if self.channel == "final" or (self.channel == "commentary" and not self.recipient):
            return CONTENT
        return None

    @property
    def function_name(self) -> str:
        return (self.recipient or "").removeprefix("functions.")


@dataclass
class HarmonyReading:
    """The messages read so far, and ``raw``: the text past the point where the structure
    broke (markers removed), which is content."""

    messages: list[HarmonyMessage] = field(default_factory=list)
    raw: str = ""

    def text_of(self, *kinds: str) -> str | None:
        """The texts of the messages of ``kinds`` joined by newlines (as vLLM joins them),
        the raw rest last if ``CONTENT`` is asked for; None if there is none."""
        parts = [m.text for m in self.messages if m.kind in kinds and m.text]
        if CONTENT in kinds and self.raw:
            parts.append(self.raw)
        return "\n".join(parts) or None

    @property
    def reasoning(self) -> str | None:
        return self.text_of(REASONING)

    @property
    def content(self) -> str | None:
        return self.text_of(CONTENT)

    @property
    def calls(self) -> list[HarmonyMessage]:
        return [m for m in self.messages if m.kind == TOOL]

    @property
    def reasoning_ended(self) -> bool:
        """A reasoning message has been closed, or something else came first."""
        for m in self.messages:
            if m.kind == REASONING and m.complete:
                return True
            if m.kind is not None and m.kind != REASONING:
                return True
        return bool(self.raw)


def read_harmony(text: str, final: bool) -> HarmonyReading:
    """The messages of ``text`` (an assistant's output after ``<|start|>assistant``);
    ``final``: the whole output (nothing is held back; a header cut off is dropped)."""
    if not final:
        partial = _PARTIAL_MARKER.search(text)
        if partial is not None:
            text = text[: partial.start()]
    return _Reader().read(text)


@dataclass
class _Reader:
    reading: HarmonyReading = field(default_factory=HarmonyReading)
    state: str = "header"  # "header" | "body" | "between"
    header: str = ""
    role_given: bool = True  # the prompt's <|start|>assistant opened the first message
    header_at: int = 0  # where the current header starts in the text
    current: HarmonyMessage | None = None

    def read(self, text: str) -> HarmonyReading:
        at = 0
        for piece in _SPLIT.split(text):
            broke = self._take(piece, at) if piece else None
            if broke is not None:
                self.reading.raw = _visible(text[broke:])
                break
            at += len(piece)
        return self.reading

    def _take(self, piece: str, at: int) -> int | None:
        """Advance by one marker or text piece at ``at``; where the structure broke (the
        raw rest starts there), or None."""
        if self.state == "body":
            assert self.current is not None
            if piece in TERMINATORS:
                self.current.complete, self.current, self.state = True, None, "between"
            elif piece == START:  # a new message without its terminator: read on
                self.current = None
                self._open_header(at + len(piece), role_given=False)
            elif piece == CHANNEL:  # ... nor its <|start|>: the role stays
                self.current = None
                self._open_header(at, role_given=True)
                return self._header_piece(piece)
            elif piece not in (MESSAGE, CONSTRAIN):  # stray markers are dropped
                self.current.text += _visible(piece)
            return None
        if self.state == "between":
            if piece == START:
                self._open_header(at + len(piece), role_given=False)
                return None
            return at if piece in MARKERS or piece.strip() else None
        if piece == START and not self.header.strip():
            self._open_header(at + len(piece), role_given=False)
            return None
        if piece == MESSAGE:
            self.current = _message(self.header, self.role_given)
            self.reading.messages.append(self.current)
            self.state = "body"
            return None
        return self._header_piece(piece)

    def _header_piece(self, piece: str) -> int | None:
        if piece in TERMINATORS or piece == START:
            return self.header_at
        self.header += _OTHER_SPECIAL.sub("", piece)
        if len(self.header) > MAX_HEADER_CHARS or "\n" in self.header:
            return self.header_at
        s = self.header.lstrip()
        if self.role_given and not any(s.startswith(p) or p.startswith(s) for p in _HEADER_STARTS):
            return self.header_at
        return None

    def _open_header(self, at: int, role_given: bool) -> None:
        self.state, self.header, self.role_given, self.header_at = "header", "", role_given, at


def _message(header: str, role_given: bool) -> HarmonyMessage:
    """The message a complete header opens: ``[role] [to=R] <|channel|>C [to=R] [type]``."""
    rest = header.strip()
    role = "assistant"
    word = re.match(r"[^\s<]+", rest)
    if word and (not role_given or word.group() == "assistant") and "=" not in word.group():
        role, rest = word.group(), rest[word.end() :]
    channel = re.search(r"<\|channel\|>\s*([^\s<]*)", rest)
    if channel:
        rest = rest[: channel.start()] + " " + rest[channel.end() :]
    recipient = re.search(r"(?:^|\s)to=([^\s<]+)", rest)
    if recipient:
        rest = rest[: recipient.start()] + " " + rest[recipient.end() :]
    content_type = rest.replace(CONSTRAIN, " ").strip() or None
    return HarmonyMessage(
        role,
        channel.group(1) or None if channel else None,
        recipient.group(1) if recipient else None,
        content_type,
    )


def _visible(text: str) -> str:
    """``text`` without any special token's text."""
    return _OTHER_SPECIAL.sub("", _SPLIT.sub("", text))
