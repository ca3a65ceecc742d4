"""Chat templates: GGUF ``tokenizer.chat_template`` rendered in a bounded Jinja sandbox.

A chat template is untrusted code that ships inside a model file. It is rendered with
Jinja's :class:`~jinja2.sandbox.ImmutableSandboxedEnvironment` (no attribute starting with
``_``, no mutating calls), extended here so that a template also cannot

* reach Python internals through ``cycler``/``joiner``/``lipsum`` (removed from the
  globals) or an unsafe attribute (refused at once instead of rendering as empty);
* build huge values: ``*``, ``**``, ``+`` and ``%`` are intercepted and refused when the
  result would exceed the output limit, ``str.format``/``%``/``center``/``indent`` widths
  are capped, string methods and filters that multiply their input (``ljust``, ``replace``,
  ``join``, ``expandtabs``, ``translate``, ``indent``, ``wordwrap`` ...) have the size of
  their result bounded *before* they run, and every value read, passed to a call, returned
  by a filter or built by a ``[...]``/``{...}``/``(...)`` literal is size-checked. The
  "weight" of a container counts shared parts once per use (``[x, x]`` weighs twice ``x``),
  so a value that doubles itself a few dozen times is refused before ``str()`` or
  ``tojson`` would spend hours in C expanding it;
* run for ever: a trace function checks a deadline on each line of Python run during the
  render (template code and pure-Python filters alike), and the call hook checks it too;
* cost much to compile: the source is at most :data:`MAX_TEMPLATE_CHARS`, compiling runs
  under the same deadline (checked on each call), constant folding is off (it would run
  filters on literals at compile time), and nesting too deep for Jinja's parser or Python's
  compiler is a :class:`~localllm.errors.TemplateError`. Whatever else the template's code
  raises (``LookupError`` from ``'x'.encode('rot13')``, ``AssertionError`` from
  ``truncate(-5)`` ...) is one too.

The globals and filters follow Hugging Face transformers' ``apply_chat_template``
(``raise_exception``, ``strftime_now``, ``tojson`` without HTML escaping, loop controls,
``trim_blocks``/``lstrip_blocks``, the ``{% generation %}`` tag), so templates written for
it render identically.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import stat
import string
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import ClassVar

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.utils import Namespace

from ..errors import LocalLLMError, TemplateError
from .builtin import BUILTIN_TEMPLATES, guess_builtin
from .harmony_tools import template_global as harmony_functions

MAX_OUTPUT_CHARS = 4_000_000  # far above any context window's worth of text
MAX_RENDER_SECONDS = 5.0
MAX_FORMAT_WIDTH = 10_000  # width/precision allowed in %-format, str.format, center, indent
MAX_INT_BITS = 100_000
MAX_VALUE_WEIGHT = 4 * MAX_OUTPUT_CHARS  # characters + items of a value, shared parts counted
# Longest template source. Real templates are under 20 kB; Jinja's compiler needs about 1 s
# and 10 MB per 30 kB (an 8 MB template took 96 s and 5.4 GB). Compiling also runs under
# the render time limit.
MAX_TEMPLATE_CHARS = 128 * 1024
_TEMPLATE_FILENAME = "<chat template>"


class _Timeout(Exception):
    pass


class _TooLarge(Exception):
    pass


def _check_size(value: object) -> object:
    if isinstance(value, (str, list, tuple, bytes)) and len(value) > MAX_OUTPUT_CHARS:
        raise _TooLarge(f"a value of {len(value)} items exceeds the limit of {MAX_OUTPUT_CHARS}")
    if isinstance(value, int) and value.bit_length() > MAX_INT_BITS:
        raise _TooLarge(f"an integer of {value.bit_length()} bits exceeds {MAX_INT_BITS} bits")
    return value


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")


def _check_percent_format(fmt: str) -> None:
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for n in (width, precision):
            if n == "*" or (n and int(n) > MAX_FORMAT_WIDTH):
                raise SecurityError(f"format width {n!r} is not allowed")


def _check_brace_format(fmt: str) -> None:
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec and "{" in spec:
            raise SecurityError("nested format specifications are not allowed")
        for n in re.findall(r"\d+", spec or ""):
            if int(n) > MAX_FORMAT_WIDTH:
                raise SecurityError(f"format width {n} is not allowed")


def _text_len(value: object) -> int:
    return len(value) if isinstance(value, (str, bytes)) else 0


def _replace_bound(s: str | bytes, old: object, new: object, count: object = None) -> int:
    """Length of ``s.replace(old, new, count)`` at most, without building it."""
    if type(old) is not type(s) or type(new) is not type(s) or len(new) <= len(old):
        return len(s)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * (len(new) - len(old))


def _refuse_if_over(bound: int, what: str) -> None:
    if bound > MAX_OUTPUT_CHARS:
        raise _TooLarge(f"{what} would make about {bound} characters")


def _check_width(width: object) -> None:
    if isinstance(width, int) and abs(width) > MAX_FORMAT_WIDTH:
        raise SecurityError(f"width {width} is not allowed")
    if isinstance(width, str) and len(width) > MAX_FORMAT_WIDTH:
        raise SecurityError("indent string too long")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with
    it for training masks); rendering just emits the body."""

    tags: ClassVar[set[str]] = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class _WeighingCodeGenerator(CodeGenerator):
    """Compiles ``[...]``, ``{...}`` and ``(...)`` literals to ``environment.weighed(...)``
    so that no hook-free template code can build an exponentially shared value."""

    def _weighed(self, visit, node, frame) -> None:
        self.write("environment.weighed(")
        visit(node, frame)
        self.write(")")

    def visit_List(self, node, frame):
        self._weighed(super().visit_List, node, frame)

    def visit_Dict(self, node, frame):
        self._weighed(super().visit_Dict, node, frame)

    def visit_Tuple(self, node, frame):
        if node.ctx != "load":
            return super().visit_Tuple(node, frame)
        self._weighed(super().visit_Tuple, node, frame)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """Immutable sandbox that also bounds sizes and time (see the module docstring)."""

    intercepted_binops = frozenset({"*", "**", "+", "%"})
    code_generator_class = _WeighingCodeGenerator

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[jinja2.ext.loopcontrols, _GenerationTag],
            autoescape=False,
            keep_trailing_newline=False,
        )
        # No constant folding at compile time: `'...'|wordwrap(2)` on a literal would run
        # while compiling, outside the render limits (74 s on a 1.9 MB literal).
        self.optimized = False
        self.deadline = float("inf")
        # id -> (value, weight) for this render; the value is kept so the id stays unique.
        self.weights: dict[int, tuple[object, int]] = {}
        for name in ("cycler", "joiner", "lipsum"):
            self.globals.pop(name, None)
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = _strftime_now
        self.globals["harmony_functions"] = harmony_functions  # the built-in harmony's
        self.filters["tojson"] = _tojson
        for name in ("center", "indent"):
            self.filters[name] = _width_checked(self.filters[name])
        self.filters["format"] = _checked_format_filter(self.filters["format"])
        self.filters["indent"] = _bounded_indent(self.filters["indent"])
        self.filters["wordwrap"] = _bounded_wordwrap(self.filters["wordwrap"])
        self.filters["replace"] = _bounded_replace(self.filters["replace"])
        self.filters["join"] = _bounded_join(self.filters["join"], self)
        for name, filt in list(self.filters.items()):
            self.filters[name] = _result_weighed(filt, self)

    # -- value sizes ------------------------------------------------------------------------
    def weigh(self, value: object) -> int:
        """Characters + items of ``value``, shared sub-values counted once per use."""
        if isinstance(value, (str, bytes)):
            return len(value) + 1
        if isinstance(value, Namespace):
            value = object.__getattribute__(value, "_Namespace__attrs")
        if not isinstance(value, (list, tuple, dict)):
            return 1
        known = self.weights.get(id(value))
        if known is not None and known[0] is value:
            return known[1]
        self.check_time()
        total = 1
        try:
            if isinstance(value, dict):
                for k, v in value.items():
                    total += self.weigh(k) + self.weigh(v)
                    if total > MAX_VALUE_WEIGHT:
                        break
            else:
                for v in value:
                    total += self.weigh(v)
                    if total > MAX_VALUE_WEIGHT:
                        break
        except RecursionError:
            total = MAX_VALUE_WEIGHT + 1
        self.weights[id(value)] = (value, total)
        return total

    def check_value(self, value: object) -> object:
        """``value`` itself, after :func:`_check_size` and a :meth:`weigh` check."""
        _check_size(value)
        if isinstance(value, (list, tuple, dict, Namespace)):
            weight = self.weigh(value)
            if weight > MAX_VALUE_WEIGHT:
                raise _TooLarge(f"a value of weight {weight} exceeds {MAX_VALUE_WEIGHT}")
        return value

    def weighed(self, value: object) -> object:
        """Called by compiled templates on each list, dict and tuple literal."""
        self.check_time()
        return self.check_value(value)

    def _bound_str_method(self, method, args: tuple, kwargs: dict) -> tuple:
        """Refuse a ``str``/``bytes``/``int`` method call whose result would be too large;
        returns ``args`` (an iterable given to ``join`` is made a list so it can be measured).
        """
        s, name = method.__self__, method.__name__
        if isinstance(s, int):
            if name == "to_bytes" and args and isinstance(args[0], int):
                _refuse_if_over(args[0], "int.to_bytes")
            return args
        if name in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
            _refuse_if_over(args[0], f"str.{name}")
        elif name == "expandtabs":
            tab = args[0] if args else kwargs.get("tabsize", 8)
            if isinstance(tab, int):
                _refuse_if_over(len(s) + s.count("\t") * max(tab, 0), "str.expandtabs")
        elif name == "replace" and len(args) >= 2:
            _refuse_if_over(_replace_bound(s, *args[:3]), "str.replace")
        elif name == "join" and args:
            items = list(args[0])
            _check_size(items)
            _refuse_if_over(sum(map(_text_len, items)) + len(s) * len(items), "str.join")
            args = (items, *args[1:])
        elif name == "translate" and args and isinstance(args[0], dict):
            longest = max((_text_len(v) for v in args[0].values()), default=1)
            _refuse_if_over(len(s) * max(longest, 1), "str.translate")
        return args

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise _Timeout

    # -- hooks of SandboxedEnvironment ------------------------------------------------------
    def unsafe_undefined(self, obj, attribute):
        # Jinja renders an unsafe attribute as an empty Undefined; refuse it outright.
        raise SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe"
        )

    def getattr(self, obj, attribute):
        self.check_time()
        if isinstance(attribute, str) and attribute.startswith("__"):
            # Even where Jinja would answer Undefined, a dunder name is an escape attempt.
            self.unsafe_undefined(obj, attribute)
        return _check_size(super().getattr(obj, attribute))

    def getitem(self, obj, argument):
        self.check_time()
        if isinstance(argument, str) and argument.startswith("__"):
            self.unsafe_undefined(obj, argument)
        return _check_size(super().getitem(obj, argument))

    def call(self, context, obj, /, *args, **kwargs):
        self.check_time()
        for a in (*args, *kwargs.values()):
            self.check_value(a)
        if isinstance(getattr(obj, "__self__", None), (str, bytes, int)):
            args = self._bound_str_method(obj, args, kwargs)
        return self.check_value(super().call(context, obj, *args, **kwargs))

    def wrap_str_format(self, value):
        wrapper = super().wrap_str_format(value)
        if wrapper is None:
            return None
        fmt = value.__self__

        def checked(*args, **kwargs):
            _check_brace_format(fmt)
            values = (*args, *kwargs.values(), *(args[0].values() if args
                                                  and isinstance(args[0], dict) else ()))
            _refuse_if_over(_format_bound(fmt, fmt.count("{"), values, self), "str.format")
            return _check_size(wrapper(*args, **kwargs))

        return checked

    def call_binop(self, context, operator, left, right):
        self.check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if (isinstance(seq, (str, list, tuple)) and isinstance(n, int)
                        and len(seq) * max(n, 0) > MAX_OUTPUT_CHARS):
                    raise _TooLarge("a repeated string or list would exceed the output limit")
            if (isinstance(left, int) and isinstance(right, int)
                    and left.bit_length() + right.bit_length() > MAX_INT_BITS):
                raise _TooLarge("integer product too large")
        elif operator == "**":
            if (isinstance(left, int) and isinstance(right, int) and abs(left) > 1
                    and right * left.bit_length() > MAX_INT_BITS):
                raise _TooLarge("integer power too large")
        elif operator == "%" and isinstance(left, str):
            _check_percent_format(left)
            values = right.values() if isinstance(right, dict) else (
                right if isinstance(right, tuple) else (right,))
            _refuse_if_over(_format_bound(left, left.count("%"), values, self), "'%' format")
        elif (operator == "+" and isinstance(left, (str, list, tuple))
              and isinstance(right, (str, list, tuple))
              and len(left) + len(right) > MAX_OUTPUT_CHARS):
            raise _TooLarge("a concatenation would exceed the output limit")
        return self.check_value(super().call_binop(context, operator, left, right))


def _width_checked(filt):
    def checked(value, width=80, *args, **kwargs):
        _check_width(width)
        return filt(value, width, *args, **kwargs)

    return checked


def _format_bound(fmt: str, n_fields: int, values, env: _BoundedSandbox) -> int:
    """Length of a format's result at most: each field may print the longest value."""
    longest = max((len(v) if isinstance(v, str) else env.weigh(v) * 4 for v in values),
                  default=0)
    return len(fmt) + n_fields * (longest + MAX_FORMAT_WIDTH)


def _checked_format_filter(filt):
    def checked(value, *args, **kwargs):
        fmt = str(value)
        _check_percent_format(fmt)
        longest = max((len(str(v)) for v in (*args, *kwargs.values())), default=0)
        _refuse_if_over(len(fmt) + fmt.count("%") * (longest + MAX_FORMAT_WIDTH), "format")
        return filt(value, *args, **kwargs)

    return checked


def _bounded_indent(filt):
    @functools.wraps(filt)
    def checked(s, width=4, *args, **kwargs):
        _check_width(width)
        text = str(s)
        pad = width if isinstance(width, int) else len(str(width))
        _refuse_if_over(len(text) + (text.count("\n") + 1) * pad, "indent")
        return filt(s, width, *args, **kwargs)

    return checked


def _bounded_wordwrap(filt):
    @functools.wraps(filt)
    def checked(environment, s, width=79, break_long_words=True, wrapstring=None,
                *args, **kwargs):
        text = str(s)
        breaks = len(text) // max(width, 1) if isinstance(width, int) else len(text)
        breaks += sum(c.isspace() for c in text) + 1
        sep = len(wrapstring) if isinstance(wrapstring, str) else 2
        _refuse_if_over(len(text) + breaks * sep, "wordwrap")
        return filt(environment, s, width, break_long_words, wrapstring, *args, **kwargs)

    return checked


def _bounded_replace(filt):
    @functools.wraps(filt)
    def checked(eval_ctx, s, old, new, count=None):
        _refuse_if_over(_replace_bound(str(s), str(old), str(new), count), "replace")
        return filt(eval_ctx, s, old, new, count)

    return checked


def _bounded_join(filt, env: _BoundedSandbox):
    @functools.wraps(filt)
    def checked(eval_ctx, value, d="", attribute=None):
        items = list(value)
        _check_size(items)
        if attribute is None:
            size = sum(len(v) if isinstance(v, str) else env.weigh(v) * 4 for v in items)
            _refuse_if_over(size + len(str(d)) * len(items), "join")
        return filt(eval_ctx, items, d, attribute)

    return checked


def _result_weighed(filt, env: _BoundedSandbox):
    @functools.wraps(filt)
    def checked(*args, **kwargs):
        return env.check_value(filt(*args, **kwargs))

    return checked


class _RaisedByTemplate(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise _RaisedByTemplate(str(message))


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None,
            sort_keys: bool = False) -> str:
    """JSON like transformers' ``tojson``: no HTML escaping, non-ASCII kept.

    With ``indent`` or ``separators`` it is encoded chunk by chunk (``JSONEncoder.iterencode``,
    pure Python, as ``json.dumps`` with ``indent`` is anyway), so that long separators are
    refused once the output passes the limit instead of being expanded in C; the plain case
    stays on the C encoder (its output is a few times the value's checked weight).
    """
    if isinstance(indent, int) and not isinstance(indent, bool) and indent > 64:
        raise SecurityError(f"tojson indent {indent} is not allowed")
    if isinstance(indent, str) and len(indent) > 64:
        raise SecurityError(f"tojson indent of {len(indent)} characters is not allowed")
    if separators is not None:
        if (not isinstance(separators, (tuple, list)) or len(separators) != 2
                or not all(isinstance(x, str) for x in separators)):
            raise SecurityError("tojson separators must be two strings")
        if max(map(len, separators)) > 64:
            raise SecurityError("tojson separators longer than 64 characters are not allowed")
    if indent is None and separators is None:
        return json.dumps(value, ensure_ascii=bool(ensure_ascii), sort_keys=bool(sort_keys))
    encoder = json.JSONEncoder(ensure_ascii=bool(ensure_ascii), indent=indent,
                               separators=separators, sort_keys=bool(sort_keys))
    chunks: list[str] = []
    size = 0
    for chunk in encoder.iterencode(value):
        size += len(chunk)
        if size > MAX_OUTPUT_CHARS:
            raise _TooLarge(f"tojson output over {MAX_OUTPUT_CHARS} characters")
        chunks.append(chunk)
    return "".join(chunks)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _validate_messages(messages: Sequence[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise TemplateError(f"message {i} must be an object with a string 'role'")
        out.append(m)
    return out


@dataclass
class ChatTemplate:
    """A compiled chat template.

    Attributes:
        name: where it came from ("gemma (built-in)", "metadata", a file path ...).
        source: the Jinja text.
        bos_token / eos_token: texts of the vocabulary's BOS / EOS tokens ("" when none).
    """

    name: str
    source: str
    bos_token: str = ""
    eos_token: str = ""
    time_limit: float = MAX_RENDER_SECONDS

    def __post_init__(self) -> None:
        self._env = _BoundedSandbox()
        # A compiled template is shared (see compiled()); its sandbox keeps per-render state.
        self._lock = threading.Lock()
        where = f"chat template {self.name}"
        if not isinstance(self.source, str):
            raise TemplateError(f"{where}: the template is not text")
        if len(self.source) > MAX_TEMPLATE_CHARS:
            raise TemplateError(f"{where}: {len(self.source)} characters, more than the limit "
                                f"of {MAX_TEMPLATE_CHARS}")
        try:
            self._template = self._bounded(self._compile, lines=False)
        except jinja2.TemplateSyntaxError as e:
            raise TemplateError(
                f"{where}: syntax error at line {e.lineno}: {_one_line(e.message)}"
            ) from None
        except _Timeout:
            raise TemplateError(
                f"{where}: compiling took longer than {self.time_limit:g} s") from None
        except (RecursionError, SyntaxError, MemoryError) as e:
            # Nesting deep enough to exhaust Jinja's parser or Python's compiler
            # (RecursionError, "too many statically nested blocks", IndentationError).
            raise TemplateError(
                f"{where}: nested too deeply to compile ({type(e).__name__})") from None

    def _compile(self) -> jinja2.Template:
        ast = self._env.parse(self.source)
        for ref in ast.find_all(nodes.NSRef):
            # `{% set ns.__class__ = ... %}` has no runtime hook: refuse it when compiling.
            if ref.attr.startswith("_"):
                raise TemplateError(
                    f"chat template {self.name}: line {ref.lineno}: assigning to "
                    f"namespace attribute {ref.attr!r} is unsafe"
                )
        return self._env.from_string(ast)

    def render(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool = True,
        tools: list | None = None,
        **kwargs,
    ) -> str:
        """The conversation as prompt text.

        Args:
            messages: ``{"role": ..., "content": ...}`` dicts (content str, parts list or None;
                optional ``tool_calls``).
            add_generation_prompt: end with the opening of an assistant turn.
            tools: JSON-schema tool descriptions, passed to the template as ``tools``.
            kwargs: further template variables (e.g. ``enable_thinking``).
        Raises:
            TemplateError: the template raised, failed, tried to escape the sandbox, or went
                over the size (``MAX_OUTPUT_CHARS``) or time (``MAX_RENDER_SECONDS``) limits.
        """
        ctx = dict(kwargs)
        ctx.update(
            messages=_validate_messages(messages),
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        where = f"chat template {self.name}"
        try:
            return self._render_bounded(ctx)
        except _RaisedByTemplate as e:
            raise TemplateError(f"{where} raised: {_one_line(e)}") from None
        except TemplateError as e:  # from a global of ours (harmony_functions)
            raise TemplateError(f"{where}: {_one_line(e)}") from None
        except SecurityError as e:
            raise TemplateError(f"{where} refused: {_one_line(e)}") from None
        except _Timeout:
            raise TemplateError(
                f"{where} stopped: rendering took longer than {self.time_limit:g} s"
            ) from None
        except (_TooLarge, MemoryError, OverflowError) as e:
            raise TemplateError(f"{where} stopped: output too large ({_one_line(e)})") from None
        except RecursionError:
            raise TemplateError(f"{where} stopped: recursion too deep") from None
        except jinja2.TemplateError as e:
            raise TemplateError(f"{where}: {type(e).__name__}: {_one_line(e)}") from None
        except Exception as e:  # noqa: BLE001 - whatever untrusted template code raised
            # (TypeError, LookupError from 'x'.encode('rot13'), AssertionError from
            # truncate(-5) ...): the template's fault, reported as such.
            raise TemplateError(f"{where}: {type(e).__name__}: {_one_line(e)}") from None

    def _render_bounded(self, ctx: dict) -> str:
        def generate() -> str:
            chunks: list[str] = []
            size = 0
            for chunk in self._template.generate(**ctx):
                size += len(chunk)
                if size > MAX_OUTPUT_CHARS:
                    raise _TooLarge(f"more than {MAX_OUTPUT_CHARS} characters")
                chunks.append(chunk)
            return "".join(chunks)

        return self._bounded(generate)

    def _bounded(self, work, lines: bool = True):
        """``work()`` under the time limit: compiling and rendering alike.

        ``lines``: check the deadline on every line run (rendering: loops in template code and
        in pure-Python filters can run without calling anything), else on every call only
        (compiling: Jinja's lexer, parser and code generator call functions all the time, and
        tracing their lines would make a large template compile three times slower).
        """
        env = self._env

        def on_line(frame, event, arg):
            if time.monotonic() > env.deadline:
                raise _Timeout
            return on_line

        def on_call(frame, event, arg):
            if lines:
                return on_line
            if time.monotonic() > env.deadline:
                raise _Timeout
            return None

        with self._lock:  # one render at a time: the sandbox holds this render's state
            env.deadline = time.monotonic() + self.time_limit
            previous = sys.gettrace()
            sys.settrace(on_call)
            try:
                return work()
            finally:
                sys.settrace(previous)
                env.deadline = float("inf")
                env.weights.clear()

    def starts_with_bos(self, text: str) -> bool:
        """True when ``text`` begins with the BOS token's text (then tokenize without BOS)."""
        return bool(self.bos_token) and text.startswith(self.bos_token)

    def encode(self, tokenizer, messages: Sequence[dict], add_generation_prompt: bool = True,
               tools: list | None = None, **kwargs) -> list[int]:
        """Render and tokenize: special-token texts are parsed, and BOS is added only when
        the vocabulary wants one and the template did not already write it."""
        return self.tokenize(tokenizer, self.render(messages, add_generation_prompt, tools,
                                                    **kwargs))

    def tokenize(self, tokenizer, text: str) -> list[int]:
        """Token ids of rendered text (see :meth:`encode`).

        Raises:
            TemplateError: the text holds lone surrogates (not UTF-8).
        """
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: bytes that were not UTF-8 (stdin, argv)
            raise TemplateError(f"chat template {self.name}: the prompt holds text that is "
                                "not valid UTF-8") from None
        add_bos = tokenizer.add_bos and not self.starts_with_bos(text)
        return tokenizer.encode(text, add_bos=add_bos, special=True)


def _token_text(metadata: dict, key: str) -> str:
    tokens = metadata.get("tokenizer.ggml.tokens") or ()
    i = metadata.get(key)
    return str(tokens[int(i)]) if i is not None and 0 <= int(i) < len(tokens) else ""


MAX_CACHED_TEMPLATES = 32  # compiled templates kept (each at most MAX_TEMPLATE_CHARS of source)


@functools.lru_cache(maxsize=MAX_CACHED_TEMPLATES)
def compiled(name: str, source: str, bos: str = "", eos: str = "") -> ChatTemplate:
    """The :class:`ChatTemplate` of ``source``, compiled once and kept in a bounded LRU cache
    (requests that each bring their own template cost a compile, never unbounded memory).

    Raises:
        TemplateError: see :class:`ChatTemplate`.
    """
    return ChatTemplate(name, source, bos, eos)


def read_template_file(path: str | Path, flag: str = "--chat-template") -> str:
    """The text of a template file named on the command line: a regular file (not a FIFO, a
    device or a directory) of at most :data:`MAX_TEMPLATE_CHARS` characters, in UTF-8.

    Raises:
        TemplateError: no such file, not a regular file, unreadable, too large, not UTF-8.
    """
    where = f"{flag} {path}"
    try:
        fd = os.open(Path(path).expanduser(), os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise TemplateError(f"{where}: cannot open: {e.strerror or e}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TemplateError(f"{where}: not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(4 * MAX_TEMPLATE_CHARS + 1)  # UTF-8: at most 4 bytes a character
    except OSError as e:
        raise TemplateError(f"{where}: cannot read: {e.strerror or e}") from None
    finally:
        os.close(fd)
    too_large = TemplateError(f"{where}: larger than the limit of {MAX_TEMPLATE_CHARS} characters")
    if len(data) > 4 * MAX_TEMPLATE_CHARS:
        raise too_large
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise TemplateError(f"{where}: not UTF-8 text (byte {e.start})") from None
    if len(text) > MAX_TEMPLATE_CHARS:
        raise too_large
    return text


def select_template(metadata: dict, override: str | None = None, *,
                    files: bool = False) -> ChatTemplate:
    """The chat template for a model.

    Args:
        metadata: GGUF metadata (key -> value).
        override: a built-in name (gemma, llama3, chatml, mistral, llama2, phi3, harmony),
            the NAME of a metadata variant ``tokenizer.chat_template.NAME``, or Jinja text; with
            ``files``, also a template file (``--chat-template FILE``, models.toml). Without
            it: the metadata's ``tokenizer.chat_template`` (for a harmony model, the built-in
            harmony when it does not compile), else the built-in that
            :func:`localllm.chat.builtin.guess_builtin` picks.
        files: whether ``override`` may name a file. Only the command line and models.toml
            may: text that reaches the API or the server is never taken for a path (it would
            let a client read the server's files).
    Raises:
        TemplateError: an unknown name (or, with ``files``, a missing or unreadable file),
            or a template with a syntax error.
    """
    bos = _token_text(metadata, "tokenizer.ggml.bos_token_id")
    eos = _token_text(metadata, "tokenizer.ggml.eos_token_id")
    if not override:
        source = metadata.get("tokenizer.chat_template")
        if isinstance(source, str) and source.strip():
            try:
                return compiled("tokenizer.chat_template", source, bos, eos)
            except TemplateError as e:
                # The built-in harmony writes what the official gpt-oss template writes:
                # a stand-in for a variant of it this sandbox cannot compile.
                if guess_builtin(metadata) != "harmony":
                    raise
                logging.getLogger("localllm.chat").warning("%s; using the built-in harmony", e)
        name = guess_builtin(metadata)
        return compiled(f"{name} (built-in)", BUILTIN_TEMPLATES[name], bos, eos)
    if not isinstance(override, str):
        raise TemplateError(f"chat template must be text, got {type(override).__name__}")
    if override in BUILTIN_TEMPLATES:
        return compiled(f"{override} (built-in)", BUILTIN_TEMPLATES[override], bos, eos)
    variant = metadata.get(f"tokenizer.chat_template.{override}")
    if isinstance(variant, str):
        return compiled(f"tokenizer.chat_template.{override}", variant, bos, eos)
    if "{{" in override or "{%" in override:
        return compiled("--chat-template text" if files else "chat_template text",
                        override, bos, eos)
    known = ", ".join(sorted(BUILTIN_TEMPLATES))
    if files:
        if not Path(override).expanduser().exists():
            raise TemplateError(f"--chat-template {override}: no such file, and not a "
                                f"built-in template ({known})")
        return compiled(override, read_template_file(override), bos, eos)
    shown = override if len(override) <= 60 else override[:57] + "..."
    raise TemplateError(f"chat template {shown!r} is not a built-in template ({known}), a "
                        "tokenizer.chat_template.NAME variant of the model, or Jinja text")


def template_for(llm, override: str | ChatTemplate | None = None, *,
                 files: bool = False) -> ChatTemplate:
    """:func:`select_template` for a loaded LLM: ``override`` (the CLI flag, the API's
    ``chat_template``, or a ready :class:`ChatTemplate`) wins over the model's models.toml
    ``chat_template`` (which may name a file: models.toml is the user's own)."""
    if isinstance(override, ChatTemplate):
        return override
    if override:
        return select_template(llm.metadata, override, files=files)
    entry = getattr(llm, "entry", None)
    chosen = entry.chat_template if entry is not None else None
    return select_template(llm.metadata, chosen, files=True)


def apply_chat(llm, prompt: str, system: str | None = None,
               template: str | None = None) -> list[int]:
    """Token ids of a one-shot chat prompt (``localllm run --chat``): an optional system
    message and one user message, rendered with the generation prompt.

    ``template`` is as ``--chat-template``: a name, Jinja text or a file.

    Raises:
        TemplateError: see :func:`select_template` and :meth:`ChatTemplate.render`.
    """
    messages = ([{"role": "system", "content": system}] if system else []) + [
        {"role": "user", "content": prompt}
    ]
    ids = template_for(llm, template, files=True).encode(llm.tokenizer, messages)
    if not ids:
        raise LocalLLMError("the chat template rendered an empty prompt")
    return ids
