"""JSON read as it is generated: the canonical text of a value, released piece by piece.

A tool call's arguments reach an OpenAI client as JSON text in pieces
(``delta.tool_calls[i].function.arguments``) whose concatenation must be the whole value.
:class:`JsonStream` reads the model's JSON one character at a time and releases the
*canonical* text of what is certain so far: ``json.dumps(value, ensure_ascii=False)`` with
``", "`` and ``": "`` separators. Strings are released as their characters arrive (an escape
sequence once complete; a high surrogate once it is known whether a low one follows),
numbers and ``true``/``false``/``null`` once they end, so every piece released is a prefix of
the final canonical text, whatever the model's own spacing. llama.cpp gets the same property
by healing the partial JSON and cutting its dump at the healing marker
(``common/json-partial.cpp``, ``common_chat_msg_diff``); this reads the text once instead of
re-parsing it per token.

Strict JSON only: ``NaN``, ``Infinity``, control characters in strings, nesting deeper than
:data:`MAX_DEPTH` and numbers longer than :data:`MAX_NUMBER_CHARS` make the value
:attr:`JsonStream.broken` (the caller treats the text as no call).
"""

from __future__ import annotations

import json
import re

MAX_DEPTH = 128  # the JSON-schema compiler's and the request checker's limit too
MAX_NUMBER_CHARS = 400  # Python's int() refuses 4,300 digits; no argument needs 400

_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
_ESCAPES = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r",
            "t": "\t"}
_LITERALS = ("true", "false", "null")
_WS = " \t\n\r"


def canonical_char(c: str) -> str:
    """One decoded string character as ``json.dumps(..., ensure_ascii=False)`` writes it
    (lone surrogates escaped, so that the text stays valid UTF-8)."""
    if c == '"' or c == "\\" or c < " " or "\ud800" <= c <= "\udfff":
        return json.dumps(c)[1:-1]
    return c


def canonical_dumps(value: object) -> str:
    """``value`` as canonical JSON text (see the module docstring); lone surrogates escaped.

    Raises:
        ValueError: NaN or infinity. RecursionError: nesting too deep.
    """
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # lone surrogates: escape them, keep the rest as it is
        text = re.sub("[\ud800-\udfff]", lambda m: json.dumps(m.group(0))[1:-1], text)
    return text


class JsonStream:
    """Incremental reader of one JSON value (``object_only``: it must be an object).

    :meth:`feed` takes text and returns the canonical text now certain; it stops at the end
    of the value and says how much of its input it used. After the value: :attr:`done`.
    On invalid JSON: :attr:`broken` (nothing more is released).

    Attributes:
        done: the value is complete.
        broken: the text is not valid JSON (or exceeds the limits).
        text: all canonical text released so far.
    """

    def __init__(self, *, object_only: bool = True) -> None:
        self.object_only = object_only
        self.done = False
        self.broken = False
        self.text = ""
        self._stack: list[str] = []  # "{" or "["
        # What comes next: "value", "key" (or "}" of an empty object), "colon", "comma",
        # "string" (inside a string), "atom" (a number or a literal).
        self._expect = "value"
        self._first = True  # right after "{" or "[" (a closing bracket may come)
        self._atom = ""
        self._escape: str | None = None  # a pending escape sequence (after the backslash)
        self._high: str | None = None  # a decoded high surrogate waiting for its low half

    def feed(self, text: str) -> tuple[str, int]:
        """Read ``text``; returns (canonical text released, characters used). Fewer than
        ``len(text)`` are used only when the value ends (or breaks) inside ``text``."""
        out: list[str] = []
        i = 0
        n = len(text)
        while i < n and not (self.done or self.broken):
            if self._expect == "string":
                i = self._string(text, i, out)
                continue
            c = text[i]
            if self._expect == "atom":
                if c.isalnum() or c in "+-.":
                    self._atom += c
                    if len(self._atom) > MAX_NUMBER_CHARS:
                        self.broken = True
                        break
                    i += 1
                    continue
                if not self._end_atom(out):
                    break
                continue  # the character after the atom is read in the new state
            i += 1
            if c in _WS:
                continue
            self._token(c, out)
        released = "".join(out)
        self.text += released
        return released, i

    def finish(self) -> None:
        """The text has ended: a pending number or literal at the top level completes."""
        if self._expect == "atom" and not self._stack and not self.broken:
            out: list[str] = []
            if self._end_atom(out):
                self.text += "".join(out)

    # ---- the states ---------------------------------------------------------------------------
    def _token(self, c: str, out: list[str]) -> None:
        expect = self._expect
        if expect in ("value", "key"):
            if c in "]}" and self._first and self._stack and c == _CLOSE[self._stack[-1]]:
                self._close(out)
            elif expect == "key":
                if c != '"':
                    self.broken = True
                    return
                self._open_string(out)
            elif c in "{[":
                if (self.object_only and not self._stack and c != "{") or \
                        len(self._stack) >= MAX_DEPTH:
                    self.broken = True
                    return
                self._stack.append(c)
                out.append(c)
                self._first = True
                self._expect = "key" if c == "{" else "value"
            elif c == '"':
                if self.object_only and not self._stack:
                    self.broken = True
                    return
                self._open_string(out)
            elif c == "-" or c.isdigit() or c in "tfn":
                if self.object_only and not self._stack:
                    self.broken = True
                    return
                self._atom = c
                self._expect = "atom"
            else:
                self.broken = True
        elif expect == "colon":
            if c != ":":
                self.broken = True
                return
            out.append(": ")
            self._expect = "value"
            self._first = False
        elif expect == "comma":
            if c == ",":
                out.append(", ")
                top = self._stack[-1]
                self._expect = "key" if top == "{" else "value"
                self._first = False
            elif self._stack and c == _CLOSE[self._stack[-1]]:
                self._close(out)
            else:
                self.broken = True

    def _close(self, out: list[str]) -> None:
        out.append(_CLOSE[self._stack.pop()])
        self._after_value()

    def _after_value(self) -> None:
        self._first = False
        if not self._stack:
            self.done = True
        else:
            self._expect = "comma"

    def _open_string(self, out: list[str]) -> None:
        self._key = self._expect == "key"
        out.append('"')
        self._expect = "string"

    def _string(self, text: str, i: int, out: list[str]) -> int:
        """Read string characters from ``text[i:]``; returns the next index."""
        n = len(text)
        while i < n:
            if self._escape is not None:
                self._escape += text[i]
                i += 1
                if not self._finish_escape(out):
                    if self.broken:
                        return i
                    continue
                continue
            c = text[i]
            if c == "\\":
                self._escape = ""
                i += 1
                continue
            if self._high is not None:  # a high surrogate not followed by an escaped low one
                out.append(canonical_char(self._high))
                self._high = None
            if c == '"':
                out.append('"')
                i += 1
                if self._key:
                    self._expect = "colon"
                else:
                    self._after_value()
                return i
            if c < " ":
                self.broken = True  # raw control characters are not JSON
                return i
            # A run of plain characters at once.
            j = i + 1
            while j < n and text[j] not in '"\\' and text[j] >= " ":
                j += 1
            out.append("".join(canonical_char(ch) for ch in text[i:j]))
            i = j
        return i

    def _finish_escape(self, out: list[str]) -> bool:
        """Handle the pending escape; True when it was complete."""
        esc = self._escape
        assert esc is not None
        if esc[0] != "u":
            self._escape = None
            decoded = _ESCAPES.get(esc[0])
            if decoded is None:
                self.broken = True
                return False
            self._put(decoded, out)
            return True
        if len(esc) < 5:
            if not all(ch in "0123456789abcdefABCDEF" for ch in esc[1:]):
                self.broken = True
                return False
            return False
        self._escape = None
        try:
            code = int(esc[1:], 16)
        except ValueError:
            self.broken = True
            return False
        self._put(chr(code), out)
        return True

    def _put(self, c: str, out: list[str]) -> None:
        if self._high is not None:
            high, self._high = self._high, None
            if "\udc00" <= c <= "\udfff":  # a surrogate pair: one character
                code = 0x10000 + ((ord(high) - 0xD800) << 10) + (ord(c) - 0xDC00)
                out.append(canonical_char(chr(code)))
                return
            out.append(canonical_char(high))
        if "\ud800" <= c <= "\udbff":
            self._high = c  # wait: a low surrogate may follow
            return
        out.append(canonical_char(c))

    def _end_atom(self, out: list[str]) -> bool:
        atom, self._atom = self._atom, ""
        if atom in _LITERALS:
            out.append(atom)
        elif _NUMBER.fullmatch(atom):
            try:
                out.append(canonical_dumps(json.loads(atom)))
            except ValueError:  # an integer beyond Python's digit limit, a float overflow
                self.broken = True
                return False
        else:
            self.broken = True
            return False
        self._after_value()
        return True


_CLOSE = {"{": "}", "[": "]"}


def value_end(text: str, start: int = 0, depth: int = 0) -> int | None:
    """The index just past the JSON object or array that opens at ``text[start]`` (with
    ``depth`` > 0: just past the bracket that closes ``depth`` levels already open), or None
    while it is incomplete. Only brackets and strings are tracked (linear time, no
    recursion); the value's validity is for ``json`` to judge afterwards."""
    i = start
    n = len(text)
    in_string = False
    while i < n:
        c = text[i]
        if in_string:
            if c == "\\":
                i += 2
                continue
            if c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth <= 0:
                return i + 1
        i += 1
    return None


__all__ = ["MAX_DEPTH", "JsonStream", "canonical_char", "canonical_dumps", "value_end"]
