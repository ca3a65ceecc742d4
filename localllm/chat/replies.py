"""A chat template's reply format, and the parser that reads a reply in it as it streams.

:func:`chat_format` reads what a template's source shows of its family (as llama.cpp's
``common_chat_templates_apply`` picks a format from markers in the template): the reasoning
markers (:mod:`localllm.chat.reasoning`), the tool-call syntax (:mod:`localllm.chat.toolparse`)
and whether it is gpt-oss's harmony (:mod:`localllm.chat.harmony`). :class:`ReplyParser`
turns the reply's text pieces into :class:`~localllm.chat.events.Event` s: reasoning, content,
tool calls with their argument pieces.
"""

from __future__ import annotations

from dataclasses import dataclass

from .events import Event, ReplyMessage
from .harmony import PRESERVED as HARMONY_TOKENS
from .harmony import HarmonyParser
from .reasoning import ReasoningSplitter, ThinkingTags, opens_thinking, thinking_tags
from .toolparse import DS_CALL_BEGIN, DS_CALL_END, DS_CALLS_BEGIN, DS_CALLS_END, DS_SEP, ToolScanner

# Tool-call syntaxes (the lazy grammars of localllm.grammar.toolcalls follow them).
TOOL_SYNTAXES = ("hermes", "qwen-xml", "glm", "llama3", "mistral", "mistral-args",
                 "deepseek-r1", "deepseek-v3", "harmony", "fenced")


@dataclass(frozen=True)
class ChatFormat:
    """What a chat template's family writes in a reply.

    Attributes:
        thinking: the reasoning markers, or None (harmony: its analysis channel's).
        harmony: gpt-oss's channel format.
        tool_syntax: how calls are written (:data:`TOOL_SYNTAXES`); ``fenced`` for our
            built-in fallback (templates that know nothing of tools).
        preserved: special-token texts the reply must carry as text for the parser (their
            tokens are rendered in the generated text, as llama.cpp's preserved tokens).
    """

    thinking: ThinkingTags | None
    harmony: bool
    tool_syntax: str
    preserved: tuple[str, ...]


def chat_format(source: str, *, native_tools: bool = True) -> ChatFormat:
    """The reply format of a chat template, from its source text.

    Args:
        native_tools: the template renders tools itself (else the built-in ``fenced``
            fallback describes them and that is how calls come back).
    """
    if "<|channel|>" in source:
        return ChatFormat(ThinkingTags("<|channel|>analysis<|message|>", "<|end|>"), True,
                          "harmony", HARMONY_TOKENS)
    tags = thinking_tags(source)
    syntax = _tool_syntax(source) if native_tools else "fenced"
    preserved: list[str] = []
    if tags is not None:
        preserved += [tags.start, tags.end]
    preserved += {
        "hermes": ["<tool_call>", "</tool_call>"], "qwen-xml": ["<tool_call>", "</tool_call>"],
        "glm": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>"],
        "llama3": ["<|python_tag|>"], "mistral": ["[TOOL_CALLS]"],
        "mistral-args": ["[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"],
        "deepseek-r1": [DS_CALLS_BEGIN, DS_CALL_BEGIN, DS_SEP, DS_CALL_END, DS_CALLS_END],
        "deepseek-v3": [DS_CALLS_BEGIN, DS_CALL_BEGIN, DS_SEP, DS_CALL_END, DS_CALLS_END],
    }.get(syntax, [])
    return ChatFormat(tags, False, syntax, tuple(preserved))


def _tool_syntax(source: str) -> str:
    if "<tool_call>" in source and "<function=" in source and "<parameter=" in source:
        return "qwen-xml"
    if "<arg_key>" in source:
        return "glm"
    if DS_CALL_BEGIN in source:
        return "deepseek-r1" if "```json" in source else "deepseek-v3"
    if "[TOOL_CALLS]" in source:
        return "mistral-args" if "[ARGS]" in source else "mistral"
    if "<tool_call>" in source:
        return "hermes"
    if "<|start_header_id|>" in source and ('"parameters"' in source
                                            or "<|python_tag|>" in source):
        return "llama3"
    return "fenced"


class ReplyParser:
    """A reply's text -> events, as it streams (``push`` pieces, then ``finish``).

    Args:
        fmt: the template's :class:`ChatFormat`.
        reasoning: separate the reasoning (``--reasoning-format`` other than ``none``).
        inside: the generation prompt left a thinking block open (see
            :func:`~localllm.chat.reasoning.opens_thinking`).
        tools: the request's tools when calls are to be read (None: none are).
        parallel: several calls may be read (``parallel_tool_calls``).
    Attributes:
        reasoning_closed: the reasoning block has ended (the answer has begun).
    """

    def __init__(self, fmt: ChatFormat, *, reasoning: bool = True, inside: bool = False,
                 tools: list[dict] | None = None, parallel: bool = True) -> None:
        self.fmt = fmt
        self._harmony = None
        self._splitter = None
        self._scanner = None
        if fmt.harmony:
            names = {t["function"]["name"] for t in tools or ()}
            self._harmony = HarmonyParser(names, reasoning=reasoning, parallel=parallel)
            return
        if reasoning and fmt.thinking is not None:
            self._splitter = ReasoningSplitter(fmt.thinking, inside=inside)
        if tools:
            self._scanner = ToolScanner(tools, parallel=parallel)

    @property
    def thinking(self) -> bool:
        """The text now being read is reasoning."""
        if self._harmony is not None:
            return self._harmony.thinking
        return self._splitter is not None and self._splitter.state == "thinking"

    @property
    def reasoning_closed(self) -> bool:
        if self._harmony is not None:
            return self._harmony.closed
        return self._splitter is not None and self._splitter.closed

    def push(self, text: str) -> list[Event]:
        if self._harmony is not None:
            return self._harmony.push(text)
        events = self._splitter.push(text) if self._splitter is not None else [
            Event("content", text)] if text else []
        return self._content(events)

    def finish(self) -> list[Event]:
        if self._harmony is not None:
            return self._harmony.finish()
        events = self._splitter.finish() if self._splitter is not None else []
        out = self._content(events)
        if self._scanner is not None:
            out += self._scanner.finish()
        return out

    def _content(self, events: list[Event]) -> list[Event]:
        if self._scanner is None:
            return events
        out: list[Event] = []
        for e in events:
            out += self._scanner.push(e.text) if e.kind == "content" else [e]
        return out


def parse_reply(text: str, fmt: ChatFormat, **kwargs) -> ReplyMessage:
    """The message of a whole reply (:class:`ReplyParser`'s keywords)."""
    parser = ReplyParser(fmt, **kwargs)
    message = ReplyMessage()
    for event in [*parser.push(text), *parser.finish()]:
        message.add(event)
    return message


__all__ = [
    "TOOL_SYNTAXES",
    "ChatFormat",
    "ReplyParser",
    "chat_format",
    "opens_thinking",
    "parse_reply",
]
