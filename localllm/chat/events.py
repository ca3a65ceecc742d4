"""What a reply is made of, as it streams: :class:`Event` pieces, and the message they add
up to (:class:`ReplyMessage`).

The reply parsers (:mod:`localllm.chat.replies`) turn generated text into events; the API
shapes them as OpenAI chunks (``delta.content``, ``delta.reasoning_content``,
``delta.tool_calls``), Anthropic content blocks or Responses output items, and a
non-streamed reply is the events collected.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal

EventKind = Literal["content", "reasoning", "call", "arguments", "drop"]


def new_call_id() -> str:
    """A tool-call id in OpenAI's form (``call_`` and 24 hex digits)."""
    return "call_" + secrets.token_hex(12)


@dataclass
class Event:
    """One piece of a reply.

    Attributes:
        kind: ``content`` / ``reasoning`` (text), ``call`` (a tool call begins: ``index``,
            ``id``, ``name``), ``arguments`` (the next piece of call ``index``'s arguments,
            JSON text), ``drop`` (call ``index`` turned out not to be a call: its ``text``,
            the raw reply text, is content after all).
        text: the text of content, reasoning, arguments and drop events.
        index: the call's position among the reply's calls (0, 1, ...).
        id / name: the call's id and function name (``call`` events).
    """

    kind: EventKind
    text: str = ""
    index: int = -1
    id: str = ""
    name: str = ""


@dataclass
class ReplyMessage:
    """The message a reply's events add up to.

    Attributes:
        content: the content text (calls and reasoning apart).
        reasoning: the reasoning text ('' when none).
        calls: ``[{"id", "type": "function", "function": {"name", "arguments"}}]``.
    """

    content: str = ""
    reasoning: str = ""
    calls: list[dict] = field(default_factory=list)
    _by_index: dict[int, dict] = field(default_factory=dict, repr=False)

    @property
    def text(self) -> str:
        """The content to show: trimmed where calls follow it (the whitespace a model writes
        before a call is no answer), as it came otherwise."""
        return self.content.strip() if self.calls else self.content

    def add(self, event: Event) -> None:
        if event.kind == "content":
            self.content += event.text
        elif event.kind == "reasoning":
            self.reasoning += event.text
        elif event.kind == "call":
            call = {"id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
            self._by_index[event.index] = call
            self.calls.append(call)
        elif event.kind == "arguments":
            self._by_index[event.index]["function"]["arguments"] += event.text
        elif event.kind == "drop":
            call = self._by_index.pop(event.index, None)
            if call is not None:
                self.calls.remove(call)
            self.content += event.text


__all__ = ["Event", "EventKind", "ReplyMessage", "new_call_id"]
