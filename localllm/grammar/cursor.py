"""Where a one-line JSON value being generated stands in its schema, byte by byte.

:class:`JsonCursor` is the state the budget steering (:mod:`.budget`) reads: fed the bytes of
each accepted token, it keeps the open objects and arrays (with the keys already written and
the items counted), the string, number or literal being written, and the schema at each
level — one such path per ``anyOf``/``oneOf`` branch still possible. From that state it
gives the shortest completions (:meth:`JsonCursor.completions`) and enforces what llguidance
does not: no key twice in an object, no empty key unless the schema names it, no declared
name spelled with escapes (llguidance would take it for an extra property), and no number
that overflows to ``Infinity`` once parsed.

The text is the form the JSON constraint writes: ``", "`` and ``": "`` separators, no other
whitespace.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .schema import (
    FORMATS,
    Schemas,
    dump,
    finish_number,
    fresh_name,
    item_schema,
    max_items,
    min_items,
    ordered,
    property_schema,
    required,
    types_of,
)

OK, REFUSED, LOST = "ok", "refused", "lost"
_NUMBER_BYTES = frozenset(b"0123456789.eE+-")
_HEX = frozenset(b"0123456789abcdefABCDEF")
_ESCAPES = frozenset(b'"\\/bfnrtu')
_LITERALS = {ord("t"): b"true", ord("f"): b"false", ord("n"): b"null"}


class _Frame:
    """An open object (``obj``), array (``arr``) or the top level (``top``)."""

    __slots__ = ("key", "kind", "n_items", "pos", "schema", "space", "state", "written")

    def __init__(self, kind: str, schema: Any, state: str) -> None:
        self.kind = kind
        self.schema = schema  # obj/arr: one resolved branch; top: the root schema
        # obj: open, key, colon, value, after; arr: open, value, after; top: value, done
        self.state = state
        self.written: list[str] = []  # obj: the keys so far, decoded
        self.key: str | None = None
        self.pos = 0  # obj: index in ordered(schema) after the last declared name written
        self.n_items = 0
        self.space = False  # a ' ' is due (after ',' or ':')

    def copy(self) -> _Frame:
        f = _Frame.__new__(_Frame)
        f.kind, f.schema, f.state, f.key = self.kind, self.schema, self.state, self.key
        f.written, f.pos, f.n_items, f.space = list(self.written), self.pos, self.n_items, \
            self.space
        return f


class _Scalar:
    """A key, string, number or literal being written."""

    __slots__ = ("chars", "esc", "hex", "integer", "kind", "options", "raw", "schema")

    def __init__(self, kind: str, schema: Any = None, raw: bytes = b"",
                 options: list[bytes] | None = None, integer: bool = False) -> None:
        self.kind = kind  # key, string, number, options
        self.schema = schema
        self.raw = bytearray(raw)  # strings: the bytes after the opening quote
        self.options = options
        self.integer = integer
        self.esc = False
        self.hex = 0
        self.chars = 0  # code points written (minLength)

    def copy(self) -> _Scalar:
        s = _Scalar.__new__(_Scalar)
        s.kind, s.schema, s.raw, s.options, s.integer = self.kind, self.schema, \
            bytearray(self.raw), self.options, self.integer
        s.esc, s.hex, s.chars = self.esc, self.hex, self.chars
        return s


class _Path:
    __slots__ = ("scalar", "stack")

    def __init__(self, stack: list[_Frame], scalar: _Scalar | None) -> None:
        self.stack = stack
        self.scalar = scalar

    def copy(self) -> _Path:
        return _Path([f.copy() for f in self.stack],
                     self.scalar.copy() if self.scalar is not None else None)


class JsonCursor:
    """The parse state of a JSON value being written under a schema.

    Args:
        nav: the schema (:class:`~localllm.grammar.schema.Schemas`).
    Attributes:
        lost: True once the text left what this model of JSON Schema can follow (then it
            neither steers nor refuses anything; llguidance still holds the grammar).
    """

    MAX_PATHS = 32

    def __init__(self, nav: Schemas) -> None:
        self.nav = nav
        self.paths = [_Path([_Frame("top", nav.root, "value")], None)]
        self.lost = False

    def copy(self) -> JsonCursor:
        c = JsonCursor.__new__(JsonCursor)
        c.nav, c.lost = self.nav, self.lost
        c.paths = [p.copy() for p in self.paths]
        return c

    def feed(self, data: bytes) -> str:
        """Advance over ``data`` (a token's bytes). Returns ``OK``, ``REFUSED`` (the bytes
        break a rule above: the state is then unusable, feed a copy to test) or ``LOST``."""
        if self.lost:
            return LOST
        for b in data:
            paths: list[_Path] = []
            refused = False
            for path in self.paths:
                out = _step(self.nav, path, b)
                if out is REFUSED:
                    refused = True
                else:
                    paths.extend(out)
            if not paths:
                if refused:
                    return REFUSED
                self.lost = True
                self.paths = []
                return LOST
            self.paths = paths[: self.MAX_PATHS]
        return OK

    def risks(self) -> tuple[int, str]:
        """Which tokens may break a rule next: (the fewest quotes a token needs to close a key,
        0 when no object is open; "float" when a number with a point or exponent is being
        written, "plain" for one without, "" for none)."""
        quotes, number = 0, ""
        for p in self.paths:
            sc = p.scalar
            if any(f.kind == "obj" for f in p.stack):
                need = 1 if sc is not None and sc.kind == "key" else \
                    3 if sc is not None and sc.kind == "string" else 2
                quotes = need if not quotes else min(quotes, need)
            if sc is not None and sc.kind == "number":
                big = any(c in sc.raw for c in b".eE") or len(sc.raw) > 300
                number = "float" if big or number == "float" else "plain"
        return quotes, number

    def closes_refused_key(self, data: bytes) -> bool | None:
        """A quick :meth:`feed` verdict for a token while a key is being written: whether
        ``data`` closes it into a key the rules refuse on every path; None when this needs
        the full :meth:`feed` (not in a key, or a second quote follows)."""
        refused = []
        for p in self.paths:
            sc = p.scalar
            if sc is None or sc.kind != "key":
                return None
            esc, hexes, raw, end = sc.esc, sc.hex, bytearray(sc.raw), None
            for i, b in enumerate(data):
                if hexes:
                    hexes -= 1
                elif esc:
                    esc, hexes = False, 4 if b == 0x75 else 0
                elif b == 0x5C:
                    esc = True
                elif b == 0x22:
                    end = i
                    break
                raw.append(b)
            if end is None:
                return False
            if 0x22 in data[end + 1:]:
                return None
            try:
                key = json.loads(b'"' + bytes(raw) + b'"')
            except ValueError:
                return None
            refused.append(_key_refused(p.stack[-1], bytes(raw), key))
        return all(refused) if refused else None

    def completions(self) -> list[bytes]:
        """The shortest completions known, shortest first (b"" when the value is complete;
        empty when none is known). Each is what the constraint would write: finishing the
        open string, number or literal, the missing required properties with their smallest
        values, the ``minItems`` still due, the closing brackets."""
        out: set[bytes] = set()
        for path in self.paths:
            out.update(_completions(self.nav, path))
        return sorted(out, key=len)


# ---- following the text -----------------------------------------------------------------------
def _step(nav: Schemas, path: _Path, b: int) -> list[_Path] | str:
    """``path`` advanced over byte ``b`` (mutated; forks are copies), or ``REFUSED``; an
    empty list when this path cannot follow."""
    sc = path.scalar
    if sc is not None:
        if sc.kind in ("key", "string"):
            return _string_byte(path, sc, b)
        if sc.kind == "number":
            if b in _NUMBER_BYTES:
                sc.raw.append(b)
                return REFUSED if _overflows(sc.raw) else [path]
            path.scalar = None
            _value_done(path)
        else:  # options
            grown = bytes(sc.raw) + bytes([b])
            if any(o.startswith(grown) for o in sc.options):
                sc.raw.append(b)
                return [path]
            if bytes(sc.raw) not in sc.options:
                return []
            path.scalar = None
            _value_done(path)
    f = path.stack[-1]
    if b == 0x20:  # the space of ", " and ": "
        if not f.space:
            return []
        f.space = False
        return [path]
    if f.space:
        return []
    st = f.state
    if f.kind == "obj":
        if b == 0x22 and st in ("open", "key"):
            path.scalar = _Scalar("key")
            return [path]
        if b == 0x3A and st == "colon":
            f.state, f.space = "value", True
            return [path]
        if b == 0x2C and st == "after":
            f.state, f.space = "key", True
            return [path]
        if b == 0x7D and st in ("open", "after"):
            return _close(path)
        if st == "value":
            return _begin(nav, path, property_schema(f.schema, f.key), b)
        return []
    if f.kind == "arr":
        if b == 0x5D and st in ("open", "after"):
            return _close(path)
        if b == 0x2C and st == "after":
            f.state, f.space = "value", True
            return [path]
        if st in ("open", "value"):
            limit = max_items(f.schema)
            if limit is not None and f.n_items >= limit:
                return []
            return _begin(nav, path, item_schema(f.schema, f.n_items), b)
        return []
    if st == "value":
        return _begin(nav, path, f.schema, b)
    return []


def _string_byte(path: _Path, sc: _Scalar, b: int) -> list[_Path] | str:
    if sc.hex:
        if b not in _HEX:
            return []
        sc.hex -= 1
    elif sc.esc:
        if b not in _ESCAPES:
            return []
        sc.esc = False
        sc.hex = 4 if b == 0x75 else 0
        sc.chars += 1
    elif b == 0x5C:
        sc.esc = True
    elif b == 0x22:
        path.scalar = None
        if sc.kind == "string":
            _value_done(path)
            return [path]
        return _key_done(path, bytes(sc.raw))
    elif b < 0x20:
        return []
    elif b & 0xC0 != 0x80:
        sc.chars += 1
    sc.raw.append(b)
    return [path]


def _key_done(path: _Path, raw: bytes) -> list[_Path] | str:
    """An object key was closed: apply the key rules, then follow llguidance's order
    (declared names in order, then extra properties)."""
    f = path.stack[-1]
    try:
        key = json.loads(b'"' + raw + b'"')
    except ValueError:
        return []
    if _key_refused(f, raw, key):
        return REFUSED
    names = ordered(f.schema)
    if key in names:
        i = names.index(key)
        if i < f.pos:
            return []
        f.pos = i + 1
    else:
        if f.schema.get("additionalProperties", True) is False:
            return []
        f.pos = len(names)
    f.key = key
    f.state = "colon"
    return [path]


def _key_refused(f: _Frame, raw: bytes, key: str) -> bool:
    """The key rules: no key twice in an object, no empty key unless the schema names it,
    no declared name spelled with escapes (llguidance would take it for an extra one)."""
    names = ordered(f.schema)
    if key in f.written or (key == "" and "" not in names):
        return True
    return key in names and raw != dump(key)[1:-1].encode()


def _overflows(raw: bytearray) -> bool:
    """Whether a number with a fraction or exponent parses to an infinite float."""
    if not any(c in raw for c in b".eE"):
        return False
    text = bytes(raw).rstrip(b"eE+-.")
    try:
        return text not in (b"", b"-") and math.isinf(float(text))
    except ValueError:
        return False


def _value_done(path: _Path) -> None:
    f = path.stack[-1]
    if f.kind == "obj":
        f.written.append(f.key)
        f.key = None
    elif f.kind == "arr":
        f.n_items += 1
    else:
        f.state = "done"
        return
    f.state = "after"


def _close(path: _Path) -> list[_Path]:
    path.stack.pop()
    if not path.stack:
        return []
    _value_done(path)
    return [path]


def _value_kinds(alt: dict, b: int) -> tuple[str, Any] | None:
    """How a value starting with byte ``b`` is followed under the branch ``alt``:
    (kind, detail) or None when the branch does not allow it."""
    if "const" in alt or isinstance(alt.get("enum"), list):
        values = [alt["const"]] if "const" in alt else alt["enum"]
        options = [o for o in (dump(v).encode() for v in values) if o[:1] == bytes([b])]
        return ("options", options) if options else None
    kinds = types_of(alt)
    if b == 0x7B:
        want = ("object",)
    elif b == 0x5B:
        want = ("array",)
    elif b == 0x22:
        want = ("string",)
    elif b == 0x2D or 0x30 <= b <= 0x39:
        want = ("number", "integer")
    elif b in _LITERALS:
        want = ("null",) if b == ord("n") else ("boolean",)
    else:
        return None
    if kinds and not any(k in kinds for k in want):
        return None
    if b in _LITERALS:
        return "options", [_LITERALS[b]]
    if want[0] == "number":
        return "number", bool(kinds) and "number" not in kinds
    return want[0], None


def _begin(nav: Schemas, path: _Path, schema: Any, b: int) -> list[_Path]:
    """A value starts with byte ``b`` under ``schema``: one path per branch allowing it."""
    fitting = [(alt, how) for alt in nav.alternatives(schema)
               if (how := _value_kinds(alt, b)) is not None]
    out: list[_Path] = []
    for n, (alt, (kind, detail)) in enumerate(fitting):
        p = path if n == len(fitting) - 1 else path.copy()
        if kind == "object":
            p.stack.append(_Frame("obj", alt, "open"))
        elif kind == "array":
            p.stack.append(_Frame("arr", alt, "open"))
        elif kind == "string":
            p.scalar = _Scalar("string", alt)
        elif kind == "number":
            p.scalar = _Scalar("number", alt, bytes([b]), integer=detail)
        else:
            p.scalar = _Scalar("options", alt, bytes([b]), options=detail)
        out.append(p)
    return out


# ---- completions ------------------------------------------------------------------------------
def _completions(nav: Schemas, path: _Path) -> list[bytes]:
    """Candidate completions of one path (a few: numbers and keys have alternatives that
    llguidance may refuse)."""
    stack = path.stack
    f = stack[-1]
    # The innermost frame as it stands once the scalar is finished: (head, state overrides).
    heads: list[tuple[bytes, dict]] = []
    sc = path.scalar
    if sc is None:
        heads.append((b"", {}))
    elif sc.kind == "key":
        heads.extend(_finish_key(f, sc))
    else:
        for text in _finish_scalar(sc):
            heads.append((text, {"done": True}))
    out = []
    for head, over in heads:
        tail = _close_all(nav, stack, over)
        if tail is not None:
            out.append(head + tail)
    return out


def _seal(sc: _Scalar) -> bytes:
    """Bytes that end an escape or a UTF-8 sequence left open in a string."""
    if sc.hex:
        return b"0" * sc.hex
    if sc.esc:
        return b"n"
    raw = sc.raw
    # A UTF-8 sequence cut short: its lead byte and how many continuation bytes it has.
    for back in range(1, min(4, len(raw)) + 1):
        c = raw[-back]
        if c & 0xC0 == 0x80:
            continue
        need = 2 if c >> 5 == 0b110 else 3 if c >> 4 == 0b1110 else 4 if c >> 3 == 0b11110 \
            else 1
        missing = need - back
        if missing <= 0:
            return b""
        # The smallest continuation valid after this lead (E0 needs A0+, F0 needs 90+).
        first = 0xA0 if c == 0xE0 and back == 1 else 0x90 if c == 0xF0 and back == 1 \
            else 0x80
        return bytes([first]) + b"\x80" * (missing - 1)
    return b""


def _finish_scalar(sc: _Scalar) -> list[bytes]:
    s = sc.schema if isinstance(sc.schema, dict) else {}
    if sc.kind == "options":
        raw = bytes(sc.raw)
        fits = sorted((o for o in sc.options if o.startswith(raw)), key=len)
        return [o[len(raw):] for o in fits[:2]]
    if sc.kind == "number":
        raw = bytes(sc.raw).decode("ascii", errors="replace")
        return [t.encode() for t in finish_number(raw, s, integer=sc.integer)]
    seal = _seal(sc)
    out = []
    fmt = s.get("format")
    if isinstance(fmt, str) and fmt in FORMATS:
        # Follow the template from where the text is (a prefix of another value of the
        # format usually continues as the template does: "2024-0" + "1-01T...").
        template = FORMATS[fmt].encode()
        written = len(sc.raw) + len(seal)
        if written <= len(template):
            out.append(seal + template[written:] + b'"')
    n_min = s.get("minLength") if isinstance(s.get("minLength"), int) else 0
    pad = max(0, n_min - sc.chars - sc.esc)  # an open escape is one more character
    out.append(seal + b"a" * pad + b'"')
    return out


def _finish_key(f: _Frame, sc: _Scalar) -> list[tuple[bytes, dict]]:
    """Ways to end the key being written: the declared names it starts that llguidance's
    order allows next (up to the first required one missing), or an extra property's
    fresh name."""
    raw = bytes(sc.raw)
    names = ordered(f.schema)
    req = set(required(f.schema))
    out: list[tuple[bytes, dict]] = []
    for i in range(f.pos, len(names)):
        name = names[i]
        spelled = dump(name)[1:-1].encode()
        if name not in f.written and spelled.startswith(raw):
            out.append((spelled[len(raw):] + b'"', {"key": name, "pos": i + 1}))
        if name in req and name not in f.written:
            break  # a required name cannot be skipped
    missing = [k for k in names[f.pos:] if k in req and k not in f.written]
    if not missing and f.schema.get("additionalProperties", True) is not False:
        seal = _seal(sc)
        try:
            partial = json.loads(b'"' + raw + seal + b'"')
        except ValueError:
            return out
        name = fresh_name(set(f.written) | set(names) | {""}, partial)
        rest = dump(name[len(partial):])[1:-1].encode()
        out.append((seal + rest + b'"', {"key": name, "pos": len(names)}))
    return out


def _close_all(nav: Schemas, stack: list[_Frame], over: dict) -> bytes | None:
    """The text that closes every open frame, innermost first; ``over`` describes the
    innermost one once its scalar is finished (``done``: a value was just completed;
    ``key``/``pos``: a key was just completed)."""
    parts: list[bytes] = []
    done = over.get("done", False)
    for depth in range(len(stack) - 1, -1, -1):
        f = stack[depth]
        state, written, pos, n_items = f.state, f.written, f.pos, f.n_items
        key = over.get("key", f.key) if depth == len(stack) - 1 else f.key
        if depth == len(stack) - 1 and "key" in over:
            state, pos = "colon", over["pos"]
        space = f.space and depth == len(stack) - 1 and not done
        if done:  # the value in this frame was completed
            state = "after" if f.kind != "top" else "done"
            if f.kind == "obj":
                written = [*written, key]
            elif f.kind == "arr":
                n_items += 1
        if f.kind == "top":
            if state == "value":
                value = nav.minimal(f.schema)
                if value is None:
                    return None
                parts.append(value)
            break
        text = _close_obj(nav, f, state, written, pos, key, space) if f.kind == "obj" \
            else _close_arr(nav, f, state, n_items, space)
        if text is None:
            return None
        parts.append(text)
        done = True
    return b"".join(parts)


def _member(nav: Schemas, s: dict, name: str) -> bytes | None:
    value = nav.minimal(property_schema(s, name))
    return None if value is None else dump(name).encode() + b": " + value


def _close_obj(nav: Schemas, f: _Frame, state: str, written: list[str], pos: int,
               key: str | None, space: bool) -> bytes | None:
    s = f.schema
    head = b""
    if state in ("colon", "value"):
        value = nav.minimal(property_schema(s, key))
        if value is None:
            return None
        head = (b": " if state == "colon" else b" " if space else b"") + value
        written = [*written, key]
        state = "after"
        space = False
    names = ordered(s)
    req = set(required(s))
    n_min = s.get("minProperties") if isinstance(s.get("minProperties"), int) else 0
    todo = [k for k in names[pos:] if k in req and k not in written]
    need = n_min - len(written) - len(todo)
    members: list[bytes] = []
    for name in names[pos:]:
        if name in written:
            continue
        if name not in req and need <= 0:
            continue
        member = _member(nav, s, name)
        if member is None:
            if name in req:
                return None
            continue
        need -= name not in req
        members.append(member)
    extra_ok = s.get("additionalProperties", True) is not False
    if state == "key" and not members and need <= 0:  # after ", " a member must follow
        for name in names[pos:]:
            member = None if name in written else _member(nav, s, name)
            if member is not None:
                members.append(member)
                break
    if need > 0 or (state == "key" and not members):
        if not extra_ok:
            return None
        taken = set(written) | set(names) | {""}
        for _ in range(max(need, 1)):
            name = fresh_name(taken)
            taken.add(name)
            member = _member(nav, s, name)
            if member is None:
                return None
            members.append(member)
    body = b", ".join(members)
    if state == "key":
        return head + (b" " if space else b"") + body + b"}"
    return head + (b", " + body if members and state == "after" else body) + b"}"


def _close_arr(nav: Schemas, f: _Frame, state: str, n_items: int, space: bool) -> bytes | None:
    s = f.schema
    count = max(0, min_items(s) - n_items)
    if state == "value":
        count = max(count, 1)
    items = []
    for i in range(n_items, n_items + count):
        item = nav.minimal(item_schema(s, i))
        if item is None:
            return None
        items.append(item)
    body = b", ".join(items)
    if state == "value":
        return (b" " if space else b"") + body + b"]"
    return (b", " + body if items and state == "after" else body) + b"]"
