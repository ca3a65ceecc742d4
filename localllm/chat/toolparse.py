"""Tool calls read out of a reply as it streams, in every family's format.

:class:`ToolScanner` takes the reply's content text piece by piece and returns
:class:`~localllm.chat.events.Event` s: content, then for each call a ``call`` event (a
stable id and the function name) and ``arguments`` pieces that add up to the canonical JSON
text of its arguments (:mod:`localllm.chat.jsonstream`), as OpenAI's streamed
``delta.tool_calls`` need them. The formats, as the families' chat templates write them
(llama.cpp's ``common/chat.cpp`` and ``common/parsers/`` read the same; names and shapes
only, no code):

* Hermes / Qwen 2.5 / Qwen3: ``<tool_call>{"name": N, "arguments": {...}}</tool_call>``;
* Qwen3-Coder / Qwen3.5 (XML): ``<tool_call>\\n<function=N>\\n<parameter=P>\\nV\\n</parameter>
  \\n</function>\\n</tool_call>``, values typed by the tool's parameter schema;
* GLM 4.5/4.6: ``<tool_call>N\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n</tool_call>``;
* Llama 3.x: the reply is ``{"name": N, "parameters": {...}}`` (``;``-separated for several),
  optionally after ``<|python_tag|>``;
* Mistral: ``[TOOL_CALLS][{"name": N, "arguments": {...}}, ...]`` (Nemo) or
  ``[TOOL_CALLS]N[CALL_ID]ID[ARGS]{...}`` / ``[TOOL_CALLS]N[ARGS]{...}`` (Small 3.2, Devstral,
  Ministral);
* DeepSeek R1: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}
  \\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``; V3.1: ``...<｜tool▁call▁begin｜>N<｜tool▁sep｜>
  {...}<｜tool▁call▁end｜>...``;
* our built-in templates' fallback: ```` ```tool_call\\n{"name": N, "arguments": {...}}\\n``` ````.

gpt-oss's harmony calls are channels, read by :mod:`localllm.chat.harmony`.

Only names of the request's tools count as calls. A call whose arguments turn out not to be
JSON (``NaN``, nesting beyond :data:`~localllm.chat.jsonstream.MAX_DEPTH`) is dropped: a
``drop`` event gives its raw text back as content (a stream has already sent its start).
The text is read once, in linear time.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Generator
from typing import Any

from .events import Event, new_call_id
from .jsonstream import JsonStream, canonical_char, canonical_dumps, value_end

_WS = " \t\n\r"
DS_CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
DS_CALLS_END = "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN = "<｜tool▁call▁begin｜>"
DS_CALL_END = "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
OPENERS = ("<tool_call>", "```tool_call", "[TOOL_CALLS]", "<|python_tag|>", DS_CALLS_BEGIN)
_MAX_NAME = 256  # a function name longer than this is not one
_DECODER = json.JSONDecoder(parse_constant=lambda name: (_ for _ in ()).throw(
    ValueError(f"{name} is not JSON")))

Parse = Generator[None, None, Any]  # a parser step: yields while it needs more text


class _Broken(Exception):
    """The text is not a call after all."""


class ToolScanner:
    """Splits content text into content and tool-call events (see the module docstring).

    Args:
        tools: the request's tools (OpenAI's shape: ``{"type": "function", "function":
            {"name", "parameters"}}``).
        parallel: whether several calls may be read (``parallel_tool_calls``); after the
            first call, further calls are dropped as content when False.
    """

    def __init__(self, tools: list[dict], *, parallel: bool = True) -> None:
        self.params = {t["function"]["name"]: (t["function"].get("parameters") or {})
                       for t in tools}
        self.parallel = parallel
        self.n_calls = 0
        self._events: list[Event] = []
        self._buf = ""
        self._pos = 0
        self._eof = False
        self._held_ws = ""  # whitespace not yet released as content
        self._started = False  # content (other than whitespace) or a call has been seen
        self._parser: Parse | None = None
        self._call_start = 0  # where the current container began in _buf
        self._open: list[int] = []  # calls begun in the current container
        self._after_call = False  # whitespace after a call is not content

    # ---- the driver ---------------------------------------------------------------------------
    def push(self, text: str) -> list[Event]:
        """Read the next piece of content text; the events it completes."""
        self._buf += text
        self._run()
        return self._take()

    def finish(self) -> list[Event]:
        """The text has ended: what was held back."""
        self._eof = True
        self._run()
        if self._held_ws and self.n_calls == 0:
            self._events.append(Event("content", self._held_ws))
        self._held_ws = ""
        return self._take()

    def _take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def _run(self) -> None:
        while True:
            if self._parser is None and not self._scan_text():
                return
            try:
                next(self._parser)
                return  # it needs more text
            except StopIteration:
                self._end_container(broken=False)
            except _Broken:
                self._end_container(broken=True)

    def _end_container(self, broken: bool) -> None:
        if broken:
            # A bare call has no opener: one broken at its first character consumed nothing,
            # and would be tried again there forever. That character is content.
            self._pos = max(self._pos, self._call_start + 1)
            raw = self._buf[self._call_start:self._pos]
            dropped = [i for i in self._open]
            for index in dropped:
                self._events.append(Event("drop", "", index))
            if raw:
                self._content(raw, force=True)
        elif self._open:
            self._held_ws, self._after_call = "", True
        self._parser = None
        self._open = []
        self._trim()

    def _trim(self) -> None:
        if self._pos > 4096:
            self._buf = self._buf[self._pos:]
            self._pos = 0

    # ---- text between calls -------------------------------------------------------------------
    def _content(self, text: str, *, force: bool = False) -> None:
        """Release content; whitespace is held until text follows it (a reply that is only
        calls has no content), and dropped between a call and the text after it."""
        if not text:
            return
        if not force and not text.strip():
            self._held_ws += text
            return
        held, self._held_ws = self._held_ws, ""
        if self._after_call and not force:
            held, text = "", text.lstrip()
        self._after_call = False
        self._started = True
        body = text.rstrip(_WS)
        self._held_ws = text[len(body):]
        self._events.append(Event("content", held + body))

    def _scan_text(self) -> bool:
        """Release content up to the next call opener and start its parser; False when more
        text is needed."""
        buf, pos = self._buf, self._pos
        if not self._started and self.n_calls == 0:
            # Llama 3.x: a reply that opens with a JSON object is a call (or several).
            i = pos
            while i < len(buf) and buf[i] in _WS:
                i += 1
            if i == len(buf):  # only whitespace so far
                self._content(buf[pos:])
                self._pos = len(buf)
                return False
            if buf[i] == "{":
                self._content(buf[pos:i])
                self._start(i, self._bare_calls())
                return True
        best, which = len(buf), None
        for opener in OPENERS:
            at = buf.find(opener, pos)
            if 0 <= at < best:
                best, which = at, opener
        if which is None:
            keep = 0 if self._eof else _partial_suffix(buf, pos, OPENERS)
            end = len(buf) - keep
            self._content(buf[pos:end])
            self._pos = end
            self._trim()
            return False
        self._content(buf[pos:best])
        self._start(best, self._container(which))
        return True

    def _start(self, at: int, parser: Parse) -> None:
        self._call_start = at
        self._pos = at
        self._parser = parser

    # ---- reading helpers (generators: they yield while the text so far is not enough) ---------
    def _more(self) -> Parse:
        if self._eof:
            raise _Broken
        yield

    def _ws(self) -> Parse:
        while True:
            buf = self._buf
            while self._pos < len(buf) and buf[self._pos] in _WS:
                self._pos += 1
            if self._pos < len(buf) or self._eof:
                return
            yield from self._more()

    def _peek(self) -> Parse:
        """The next character (None at the end of the text)."""
        while self._pos >= len(self._buf):
            if self._eof:
                return None
            yield from self._more()
        return self._buf[self._pos]

    def _literal(self, text: str) -> Parse:
        """Consume ``text`` if it comes next; whether it did."""
        while True:
            have = self._buf[self._pos:self._pos + len(text)]
            if not text.startswith(have):
                return False
            if len(have) == len(text):
                self._pos += len(text)
                return True
            if self._eof:
                return False
            yield from self._more()

    def _until(self, *ends: str, limit: int | None = None) -> Parse:
        """The text up to the first of ``ends`` (consumed too); returns (text, end)."""
        while True:
            best, which = -1, None
            for end in ends:
                at = self._buf.find(end, self._pos)
                if at >= 0 and (best < 0 or at < best):
                    best, which = at, end
            if which is not None:
                text = self._buf[self._pos:best]
                if limit is not None and len(text) > limit:
                    raise _Broken
                self._pos = best + len(which)
                return text, which
            if limit is not None and len(self._buf) - self._pos > limit + max(map(len, ends)):
                raise _Broken
            yield from self._more()

    # ---- calls ----------------------------------------------------------------------------------
    def _begin(self, name: str) -> int:
        if name not in self.params:
            raise _Broken
        if not self.parallel and self.n_calls >= 1:
            raise _Broken
        index = self.n_calls
        self.n_calls += 1
        self._started = True
        self._held_ws = ""
        self._open.append(index)
        self._events.append(Event("call", index=index, id=new_call_id(), name=name))
        return index

    def _args(self, index: int, text: str) -> None:
        if text:
            self._events.append(Event("arguments", text, index))

    def _stream_json(self, index: int) -> Parse:
        """Stream a JSON object of arguments from the text."""
        yield from self._ws()
        reader = JsonStream()
        while True:
            out, used = reader.feed(self._buf[self._pos:])
            self._pos += used
            if reader.broken:
                raise _Broken
            self._args(index, out)
            if reader.done:
                return
            yield from self._more()

    def _json_call(self) -> Parse:
        """``{"name": N, "arguments"|"parameters": {...}}`` (also ``"type": "function"``
        first, and OpenAI's ``{"function": {...}}`` nesting or string arguments, read whole)."""
        yield from self._ws()
        head = self._pos
        header = yield from self._json_header()
        if header is None:  # another shape: read the whole object, then judge it
            self._pos = head
            while (end := value_end(self._buf, self._pos)) is None:
                if len(self._buf) - self._pos > 1 << 20:
                    raise _Broken
                yield from self._more()
            call = _decoded_call(self._buf[self._pos:end], set(self.params))
            if call is None:
                raise _Broken
            self._pos = end
            index = self._begin(call[0])
            self._args(index, call[1])
            return
        index = self._begin(header)
        yield from self._ws()
        if (yield from self._peek()) == '"':  # arguments given as JSON text
            end = yield from self._string_end()
            try:
                value = _DECODER.decode(_DECODER.decode(self._buf[self._pos:end]))
            except (ValueError, RecursionError):
                raise _Broken from None
            if not isinstance(value, dict):
                raise _Broken
            self._pos = end
            self._args(index, _dumps(value))
        else:
            yield from self._stream_json(index)
        # The rest of the call object: more keys ("id" ...) are tolerated, then "}".
        yield from self._ws()
        if (yield from self._literal("}")):
            return
        rest = self._pos
        while (end := value_end(self._buf, rest, depth=1)) is None:
            if len(self._buf) - rest > 1 << 20:
                raise _Broken
            yield from self._more()
        try:
            _DECODER.decode("{" + self._buf[rest:end].lstrip().removeprefix(","))
        except (ValueError, RecursionError):
            raise _Broken from None
        self._pos = end

    def _string_end(self) -> Parse:
        """The index just past the JSON string that starts at the current position."""
        while True:
            i = self._pos + 1
            buf = self._buf
            while i < len(buf):
                if buf[i] == "\\":
                    i += 2
                    continue
                if buf[i] == '"':
                    return i + 1
                i += 1
            yield from self._more()

    def _json_header(self) -> Parse:
        """The function name when the object opens as a streamable call (``{`` [``"type":
        "function",``] ``"name": N, "arguments"|"parameters":``), else None."""
        if not (yield from self._literal("{")):
            raise _Broken
        tokens: list[str] = []
        while True:
            yield from self._ws()
            c = yield from self._peek()
            if c is None:
                raise _Broken
            if c == '"':
                end = yield from self._string_end()
                try:
                    tokens.append('"' + _DECODER.decode(self._buf[self._pos:end]))
                except ValueError:
                    return None
                self._pos = end
            elif c in ":,":
                tokens.append(c)
                self._pos += 1
            else:
                return None
            state = _header_state(tokens)
            if state is None:
                return None
            if state is not True:
                return state

    def _container(self, opener: str) -> Parse:
        self._pos += len(opener)
        if opener == "<tool_call>":
            yield from self._tagged()
        elif opener == "```tool_call":
            yield from self._json_call()
            yield from self._ws()
            if not (yield from self._literal("```")) and not self._eof:
                raise _Broken
        elif opener == "[TOOL_CALLS]":
            yield from self._mistral()
        elif opener == "<|python_tag|>":
            yield from self._bare_calls(opened=True)
        else:
            yield from self._deepseek()

    def _bare_calls(self, opened: bool = False) -> Parse:
        """Llama 3.x: JSON calls separated by ``;``, ``,`` or whitespace, to the end."""
        while True:
            yield from self._json_call()
            while True:
                c = yield from self._peek()
                if c is None:
                    return
                if c in _WS + ";,":
                    self._pos += 1
                    continue
                break
            if c != "{":
                return

    def _tagged(self) -> Parse:
        """After ``<tool_call>``: a JSON call (Hermes), ``<function=`` (XML) or a name (GLM)."""
        yield from self._ws()
        c = yield from self._peek()
        if c == "{":
            yield from self._json_call()
        elif c == "<":
            yield from self._xml_call()
        else:
            yield from self._glm_call()
        yield from self._ws()
        if not (yield from self._literal("</tool_call>")) and not self._eof:
            raise _Broken

    def _xml_call(self) -> Parse:
        """``<function=N>`` ``<parameter=P>`` V ``</parameter>`` ... ``</function>``."""
        if not (yield from self._literal("<function=")):
            raise _Broken
        name, _ = yield from self._until(">", limit=_MAX_NAME)
        index = self._begin(name.strip())
        props = _properties(self.params[name.strip()])
        self._args(index, "{")
        first = True
        while True:
            yield from self._ws()
            if (yield from self._literal("</function>")):
                break
            if not (yield from self._literal("<parameter=")):
                raise _Broken
            key, _ = yield from self._until(">", limit=_MAX_NAME)
            key = key.strip()
            self._args(index, ("" if first else ", ") + _dumps(key) + ": ")
            first = False
            if (yield from self._peek()) == "\n":
                self._pos += 1
            if _is_string(props.get(key)):
                yield from self._stream_string(index, "</parameter>")
            else:
                value, _ = yield from self._until("</parameter>")
                self._args(index, _typed(value.removesuffix("\n"), props.get(key)))
        self._args(index, "}")

    def _stream_string(self, index: int, end: str) -> Parse:
        """A raw text value up to ``end`` as a JSON string, released as it comes (a final
        newline before ``end`` is the format's, not the value's)."""
        self._args(index, '"')
        while True:
            at = self._buf.find(end, self._pos)
            if at >= 0:
                stop = at - 1 if at > self._pos and self._buf[at - 1] == "\n" else at
                self._args(index, "".join(map(canonical_char, self._buf[self._pos:stop])))
                self._pos = at + len(end)
                self._args(index, '"')
                return
            # Held back: a possible start of the end tag, and a newline that may precede it.
            keep = _partial_suffix(self._buf, self._pos, ("\n" + end, end))
            cut = len(self._buf) - keep
            self._args(index, "".join(map(canonical_char, self._buf[self._pos:cut])))
            self._pos = cut
            yield from self._more()

    def _glm_call(self) -> Parse:
        """GLM: ``N`` then ``<arg_key>K</arg_key>`` ``<arg_value>V</arg_value>`` pairs."""
        name, ended = yield from self._until("<arg_key>", "</tool_call>", "\n", limit=_MAX_NAME)
        index = self._begin(name.strip())
        props = _properties(self.params[name.strip()])
        if ended == "</tool_call>":
            self._pos -= len(ended)
            self._args(index, "{}")
            return
        self._args(index, "{")
        first = True
        if ended == "<arg_key>":
            self._pos -= len(ended)
        while True:
            yield from self._ws()
            if not (yield from self._literal("<arg_key>")):
                break
            key, _ = yield from self._until("</arg_key>", limit=_MAX_NAME)
            yield from self._ws()
            if not (yield from self._literal("<arg_value>")):
                raise _Broken
            value, _ = yield from self._until("</arg_value>")
            self._args(index, ("" if first else ", ") + _dumps(key.strip()) + ": "
                       + _typed(value, props.get(key.strip())))
            first = False
        self._args(index, "}")

    def _mistral(self) -> Parse:
        """After ``[TOOL_CALLS]``: a JSON array of calls, an object, or
        ``N[CALL_ID]ID[ARGS]{...}``."""
        yield from self._ws()
        if (yield from self._literal("[")):
            while True:
                yield from self._json_call()
                yield from self._ws()
                if (yield from self._literal(",")):
                    continue
                if (yield from self._literal("]")) or self._eof:
                    return
                raise _Broken
        if (yield from self._peek()) == "{":  # one object (our built-in template writes it)
            yield from self._bare_calls()
            return
        name, ended = yield from self._until("[ARGS]", "[CALL_ID]", limit=_MAX_NAME)
        if ended == "[CALL_ID]":
            yield from self._until("[ARGS]", limit=_MAX_NAME)
        index = self._begin(name.strip())
        yield from self._stream_json(index)

    def _deepseek(self) -> Parse:
        """DeepSeek R1 / V3.1 call blocks up to ``<｜tool▁calls▁end｜>``."""
        while True:
            yield from self._ws()
            if (yield from self._literal(DS_CALLS_END)):
                return
            if not (yield from self._literal(DS_CALL_BEGIN)):
                if self._eof:
                    return
                raise _Broken
            kind, _ = yield from self._until(DS_SEP, limit=_MAX_NAME)
            fenced = kind.strip() == "function"
            if fenced:  # R1: function<｜tool▁sep｜>NAME\n```json\n{...}\n```
                name, _ = yield from self._until("\n", limit=_MAX_NAME)
                yield from self._ws()
                if (yield from self._literal("```")):
                    yield from self._literal("json")
            else:  # V3.1: NAME<｜tool▁sep｜>{...}
                name = kind
            index = self._begin(name.strip())
            yield from self._stream_json(index)
            yield from self._ws()
            if fenced:
                yield from self._literal("```")
                yield from self._ws()
            if not (yield from self._literal(DS_CALL_END)) and not self._eof:
                raise _Broken


# ---- helpers ----------------------------------------------------------------------------------
def _header_state(tokens: list[str]) -> str | bool | None:
    """Where the header tokens stand: the name once complete, True while they may still
    become one, None when they cannot."""
    patterns = (['"name', ":", "NAME", ",", "KEY", ":"],
                ['"type', ":", '"function', ",", '"name', ":", "NAME", ",", "KEY", ":"])
    for pattern in patterns:
        ok = True
        for tok, want in zip(tokens, pattern):
            if want == "NAME":
                ok = tok.startswith('"') and len(tok) <= _MAX_NAME
            elif want == "KEY":
                ok = tok in ('"arguments', '"parameters')
            else:
                ok = tok == want
            if not ok:
                break
        if ok:
            if len(tokens) == len(pattern):
                return tokens[pattern.index("NAME")][1:]
            return True
    return None


_NOT_JSON = object()


def _decoded(text: str) -> Any:
    """The JSON value of ``text``, or ``_NOT_JSON`` where it is not JSON (NaN and infinities
    included) or nests past Python's recursion limit."""
    try:
        return _DECODER.decode(text)
    except (ValueError, RecursionError):
        return _NOT_JSON


def _decoded_call(text: str, names: set[str]) -> tuple[str, str] | None:
    """(name, canonical arguments) of a call object of another shape, or None."""
    obj = _decoded(text)
    if not isinstance(obj, dict):
        return None
    fn = obj.get("function") if isinstance(obj.get("function"), dict) else obj
    name = fn.get("name")
    if not isinstance(name, str) or name not in names:
        return None
    args = fn.get("arguments", fn.get("parameters", {}))
    if isinstance(args, str):
        args = _decoded(args)
    if not isinstance(args, dict):
        return None
    try:
        return name, _dumps(args)
    except (ValueError, RecursionError):
        return None


def _dumps(value: Any) -> str:
    return canonical_dumps(value)


def _properties(schema: Any) -> dict:
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def _is_string(schema: Any) -> bool:
    """Whether a parameter's schema allows only strings (the raw text is the value)."""
    if not isinstance(schema, dict):
        return True  # an undeclared parameter: text, as the template wrote it
    kind = schema.get("type")
    if kind == "string" or "enum" in schema and all(isinstance(v, str) for v in schema["enum"]):
        return True
    return kind is None and not any(k in schema for k in ("properties", "items", "anyOf",
                                                           "oneOf", "const"))


def _typed(text: str, schema: Any) -> str:
    """A raw XML/GLM value as JSON: parsed as JSON when the parameter is not a string (and
    the text is JSON), else a JSON string."""
    value = _NOT_JSON if _is_string(schema) else _decoded(text.strip())
    if value is not _NOT_JSON:
        with contextlib.suppress(ValueError, RecursionError):  # nested deeper on the way out
            return _dumps(value)
    return _dumps(text)


def _partial_suffix(buf: str, pos: int, markers: tuple[str, ...]) -> int:
    """Length of the longest end of ``buf[pos:]`` that is a proper prefix of a marker (text
    held back: the marker may be completed by the next piece)."""
    best = 0
    for marker in markers:
        for k in range(min(len(marker) - 1, len(buf) - pos), best, -1):
            if buf.endswith(marker[:k]):
                best = k
                break
    return best


__all__ = ["OPENERS", "ToolScanner"]
