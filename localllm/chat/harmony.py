"""gpt-oss's harmony format: a reply is a run of messages on channels.

After the generation prompt ``<|start|>assistant`` the model writes messages
``<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>TYPE]<|message|>TEXT<|end|>``, each next one
opening with ``<|start|>assistant`` (the recipient may also sit there:
``<|start|>assistant to=functions.N<|channel|>commentary json<|message|>``). The ``analysis``
channel is reasoning, ``final`` the answer, ``commentary`` to ``functions.N`` a tool call
whose text is its JSON arguments (ended by the ``<|call|>`` end-of-generation token), and
``commentary`` without a recipient a preamble shown as content. OpenAI's harmony
documentation and llama.cpp's ``common/parsers/gpt-oss.cpp`` describe the same; names and
shapes only.

The special tokens must reach the parser as text: they are the format's *preserved tokens*
(:data:`PRESERVED`), which the decode loop renders.
"""

from __future__ import annotations

import re

from .events import Event, new_call_id
from .jsonstream import JsonStream

PRESERVED = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>")
_MARKERS = ("<|end|>", "<|start|>", "<|channel|>", "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
MAX_HEADER = 512


class HarmonyParser:
    """Harmony reply text -> events (reasoning, content, tool calls).

    Args:
        names: the request's tool names (calls to others are dropped, as built-in tools).
        reasoning: put the ``analysis`` channel in ``reasoning`` events (False: in content,
            with its markers, as ``--reasoning-format none`` leaves text unparsed).
        parallel: several calls allowed (harmony ends the reply at the first ``<|call|>``).
    """

    def __init__(self, names: set[str], *, reasoning: bool = True,
                 parallel: bool = True) -> None:
        self.names = names
        self.reasoning = reasoning
        self.parallel = parallel
        self.n_calls = 0
        self.closed = False  # the analysis message has ended (reasoning is over)
        self._buf = ""
        self._state = "header"
        self._route: str = "content"  # where the body goes: reasoning, content, call, skip
        self._call: int = -1
        self._json: JsonStream | None = None
        self._started = False  # something was emitted for this message

    @property
    def thinking(self) -> bool:
        """The text now being read is reasoning (an analysis message's)."""
        return self._state == "body" and self._route == "reasoning"

    def push(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while self._buf:
            before = (self._state, len(self._buf))
            if self._state == "header":
                self._header(out)
            elif self._state == "body":
                self._body(out)
            elif self._state == "between":
                self._between(out)
            else:  # not harmony after all: the rest is content
                self._emit(self._buf, out)
                self._buf = ""
            if (self._state, len(self._buf)) == before:
                break
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "body":
            self._emit(self._buf, out)
            if self._route == "call" and self._json is not None:
                self._json.finish()
                if not self._json.done:
                    out.append(Event("drop", "", self._call))
        elif self._buf.strip() and self._state == "header" and "<|message|>" not in self._buf:
            out.append(Event("content", self._buf))
        self._buf = ""
        return out

    def _header(self, out: list[Event]) -> None:
        end = self._buf.find("<|message|>")
        if end < 0:
            if len(self._buf) > MAX_HEADER:  # not harmony: plain text
                self._state = "text"
            return
        header = self._buf[:end]
        self._buf = self._buf[end + len("<|message|>"):]
        self._state = "body"
        self._started = False
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        name = channel.group(1) if channel else "final"
        self._json = None
        if recipient is not None:
            target = recipient.group(1)
            fn = target.removeprefix("functions.")
            if target.startswith("functions.") and fn in self.names and (
                    self.parallel or self.n_calls == 0):
                self._route = "call"
                self._call = self.n_calls
                self.n_calls += 1
                self._json = JsonStream()
                out.append(Event("call", index=self._call, id=new_call_id(), name=fn))
            else:
                self._route = "skip"
        elif name == "analysis":
            self._route = "reasoning" if self.reasoning else "content"
            if not self.reasoning:
                out.append(Event("content", header + "<|message|>"))
        else:
            self._route = "content"

    def _body(self, out: list[Event]) -> None:
        cut, marker = len(self._buf), None
        for m in _MARKERS:
            at = self._buf.find(m)
            if 0 <= at < cut:
                cut, marker = at, m
        if marker is None:
            keep = max((_partial(self._buf, m) for m in _MARKERS), default=0)
            cut = len(self._buf) - keep
            self._emit(self._buf[:cut], out)
            self._buf = self._buf[cut:]
            return
        self._emit(self._buf[:cut], out)
        if self._route == "reasoning":
            self.closed = True
        elif self._route == "call" and self._json is not None and not self._json.done:
            out.append(Event("drop", "", self._call))
        if self._route == "content" and not self.reasoning and marker == "<|end|>":
            out.append(Event("content", marker))
        self._buf = self._buf[cut + (len(marker) if marker == "<|end|>" else 0):]
        self._state = "between"

    def _between(self, out: list[Event]) -> None:
        if self._buf.startswith("<|start|>"):
            role_end = self._buf.find("<|", len("<|start|>"))
            if role_end < 0:
                if len(self._buf) > MAX_HEADER:
                    self._state = "text"
                return
            # "<|start|>assistant" and, maybe, " to=functions.N" before "<|channel|>":
            # the header keeps it.
            self._buf = self._buf[len("<|start|>"):]
            self._state = "header"
        elif self._buf.startswith("<|channel|>"):
            self._state = "header"
        elif any(m.startswith(self._buf) for m in ("<|start|>", "<|channel|>")):
            return
        else:
            self._state = "text"

    def _emit(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._state == "text" or self._route == "content":
            if not self._started:
                text = text.lstrip() if self._route != "content" or self.reasoning else text
            if text:
                self._started = True
                out.append(Event("content", text))
        elif self._route == "reasoning":
            if not self._started:
                text = text.lstrip()
            if text:
                self._started = True
                out.append(Event("reasoning", text))
        elif self._route == "call" and self._json is not None and not self._json.done:
            piece, _ = self._json.feed(text)
            if self._json.broken:
                out.append(Event("drop", "", self._call))
                self._json = None
            elif piece:
                out.append(Event("arguments", piece, self._call))


def _partial(buf: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(buf)), 0, -1):
        if buf.endswith(marker[:k]):
            return k
    return 0


__all__ = ["PRESERVED", "HarmonyParser"]
