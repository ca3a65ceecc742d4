"""JSON schemas as the budget steering reads them: navigation, smallest values, size limits.

:class:`Schemas` resolves local ``$ref`` and ``allOf``, splits ``anyOf``/``oneOf`` into their
alternatives, and gives the smallest value (as the one-line text the constraint writes:
``", "`` and ``": "`` separators) of a subschema, bounded in size. :func:`check_sizes`
refuses size keywords (``minItems``, ``minLength``, ``minProperties``, repetition counts in
``pattern``) beyond a hard limit before llguidance compiles the schema, and
:func:`finish_number` / :func:`number_in_range` complete numbers within ``minimum`` /
``maximum`` bounds. The subset of JSON Schema modelled is the one that drives a value's
shape: ``type``, ``properties``, ``required``, ``additionalProperties``, ``items``,
``prefixItems``, ``minItems``, ``maxItems``, ``minProperties``, ``enum``, ``const``,
``anyOf``/``oneOf``/``allOf``, ``minimum``/``maximum`` (exclusive too), ``minLength``,
``format``, local ``$ref``; whatever else the grammar demands is checked by llguidance
before a completion is forced.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Any

from ..errors import GrammarError

# The largest minItems / minLength / minProperties and pattern repetition count accepted: the
# same bound as GBNF's {m,n} (gbnf.MAX_REPEAT). minItems 1e18 made the smallest-value search
# loop forever, minLength 1e9 took 6.5 GB.
MAX_SCHEMA_SIZE = 10_000
# The longest smallest value computed (bytes), whatever the token budget.
MAX_MINIMAL_BYTES = 256 * 1024
_SIZE_KEYWORDS = ("minItems", "minLength", "minProperties")
_MAX_ALTERNATIVES = 64  # branches of nested anyOf/oneOf followed at once

# Smallest strings of the formats llguidance implements (a value the format accepts).
FORMATS = {
    "date-time": "2000-01-01T00:00:00Z", "date": "2000-01-01", "time": "00:00:00Z",
    "email": "a@a.aa", "uuid": "00000000-0000-0000-0000-000000000000", "uri": "a:",
    "hostname": "a", "ipv4": "0.0.0.0", "ipv6": "::", "duration": "P0D",
}


def dump(value: Any) -> str:
    """``value`` as the constraint writes it: one line, ``", "`` and ``": "``, UTF-8 kept."""
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "))


class TooLarge(Exception):
    """A smallest value beyond its byte limit; ``where`` names the keyword responsible."""

    def __init__(self, where: str) -> None:
        super().__init__(where)
        self.where = where


def types_of(s: dict) -> list[str]:
    t = s.get("type")
    return [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] \
        if isinstance(t, list) else []


def required(s: dict) -> list[str]:
    req = s.get("required")
    return [k for k in req if isinstance(k, str)] if isinstance(req, list) else []


def ordered(s: dict) -> list[str]:
    """Declared names in the order llguidance lets them be written: ``properties`` in
    order, then required names that are not declared. Extra properties come after all
    of them."""
    props = s.get("properties")
    names = list(props) if isinstance(props, dict) else []
    return names + [k for k in required(s) if k not in names]


def property_schema(s: dict, name: str) -> Any:
    props = s.get("properties")
    if isinstance(props, dict) and name in props:
        return props[name]
    extra = s.get("additionalProperties", True)
    return extra if isinstance(extra, dict) else {} if extra is not False else False


def item_schema(s: dict, index: int) -> Any:
    prefix = s.get("prefixItems")
    if isinstance(prefix, list) and index < len(prefix):
        return prefix[index]
    items = s.get("items", {})
    return items if isinstance(items, (dict, bool)) else {}


def _int(s: dict, key: str, default: int = 0) -> int:
    v = s.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) else default


def min_items(s: dict) -> int:
    return _int(s, "minItems")


def max_items(s: dict) -> int | None:
    v = _int(s, "maxItems", -1)
    return None if v < 0 else v


class Schemas:
    """Navigation in one root schema, with its smallest values memoized.

    Args:
        root: the JSON schema (a dict; ``{}`` for any JSON value).
        max_bytes: the longest smallest value :meth:`minimal` may build.
        accepts: ``accepts(schema, text)``, whether the grammar takes ``text`` for a number
            under ``schema`` (llguidance's number ranges refuse a few values inside their
            bounds); None takes the first candidate.
    """

    def __init__(self, root: Any, max_bytes: int = MAX_MINIMAL_BYTES,
                 accepts: Callable[[dict, str], bool] | None = None) -> None:
        self.root = root if isinstance(root, dict) else {}
        self.max_bytes = max_bytes
        self.accepts = accepts
        self._minimal: dict[int, tuple[Any, bytes | None]] = {}
        self._alts: dict[int, tuple[Any, list[dict]]] = {}

    def resolve(self, s: Any) -> dict | None:
        """``s`` with ``$ref`` followed and ``allOf`` merged; None for ``false``."""
        for _ in range(64):
            if s is True or s is None:
                return {}
            if not isinstance(s, dict):
                return None
            ref = s.get("$ref")
            if not isinstance(ref, str) or not ref.startswith("#"):
                break
            target: Any = self.root
            for part in ref[1:].split("/"):
                if part:
                    part = part.replace("~1", "/").replace("~0", "~")
                    target = target.get(part, {}) if isinstance(target, dict) else {}
            s = {**(target if isinstance(target, dict) else {}),
                 **{k: v for k, v in s.items() if k != "$ref"}}
        else:
            return {}
        parts = s.get("allOf")
        if isinstance(parts, list):
            merged = {k: v for k, v in s.items() if k != "allOf"}
            for part in parts:
                part = self.resolve(part)
                if part is None:
                    return None
                for k, v in part.items():
                    if k == "properties" and isinstance(v, dict):
                        merged["properties"] = {**(merged.get("properties") or {}), **v}
                    elif k == "required" and isinstance(v, list):
                        merged["required"] = list(merged.get("required") or []) + v
                    else:
                        merged.setdefault(k, v)
            return merged
        return s

    def alternatives(self, s: Any) -> list[dict]:
        """The single-branch schemas ``s`` allows (``anyOf``/``oneOf`` split, each branch
        merged with the keywords beside it), at most 64."""
        cached = self._alts.get(id(s))
        if cached is not None and cached[0] is s:
            return cached[1]
        out: list[dict] = []
        todo = [(s, 0)]
        while todo and len(out) < _MAX_ALTERNATIVES:
            node, depth = todo.pop(0)
            node = self.resolve(node)
            if node is None:
                continue
            key = next((k for k in ("anyOf", "oneOf") if isinstance(node.get(k), list)), None)
            if key is None or depth > 16:
                out.append(node)
                continue
            rest = {k: v for k, v in node.items() if k != key}
            for option in node[key]:
                option = self.resolve(option)
                if option is not None:
                    todo.append(({**rest, **option}, depth + 1))
        self._alts[id(s)] = (s, out)
        return out

    # ---- smallest values ----------------------------------------------------------------------
    def minimal(self, s: Any) -> bytes | None:
        """The shortest value we know to satisfy ``s``, UTF-8, None when none is known.

        Raises:
            TooLarge: the value would be longer than ``max_bytes``.
        """
        cached = self._minimal.get(id(s))
        if cached is not None and cached[0] is s:
            return cached[1]
        best: bytes | None = None
        for alt in self.alternatives(s):
            value = self._minimal_one(alt)
            if value is not None and (best is None or len(value) < len(best)):
                best = value
        self._minimal[id(s)] = (s, best)
        return best

    def _check(self, size: int, s: dict, keyword: str) -> None:
        if size > self.max_bytes:
            raise TooLarge(blame(self.root, keyword))

    def _minimal_one(self, s: dict) -> bytes | None:
        if "const" in s:
            return dump(s["const"]).encode()
        if isinstance(s.get("enum"), list):
            options = [dump(v).encode() for v in s["enum"]]
            return min(options, key=len) if options else None
        kinds = types_of(s)
        if not kinds:
            if any(k in s for k in ("minimum", "maximum", "exclusiveMinimum",
                                    "exclusiveMaximum", "multipleOf")):
                return b"null"
            return b"0"
        if "null" in kinds:
            return b"null"
        if "boolean" in kinds:
            return b"false"
        if "integer" in kinds or "number" in kinds:
            options = numbers_in_range(s, integer="number" not in kinds)
            value = next((o for o in options if self.accepts is None or self.accepts(s, o)),
                         None)
            return None if value is None else value.encode()
        if "string" in kinds:
            if isinstance(s.get("format"), str) and s["format"] in FORMATS:
                return dump(FORMATS[s["format"]]).encode()
            n = _int(s, "minLength")
            if isinstance(s.get("pattern"), str):  # its length at least (the text is a guess)
                try:
                    n = max(n, pattern_min_length(s["pattern"]))
                except ValueError:
                    raise TooLarge(blame(self.root, "pattern")) from None
            self._check(n, s, "minLength" if n == _int(s, "minLength") else "pattern")
            return b'"' + b"a" * n + b'"'
        if "array" in kinds:
            return self._minimal_array(s)
        if "object" in kinds:
            return self._minimal_object(s)
        return None

    def _minimal_array(self, s: dict) -> bytes | None:
        n = min_items(s)
        self._check(2 * n, s, "minItems")
        parts: list[bytes] = []
        size = 2
        for i in range(n):
            item = self.minimal(item_schema(s, i))
            if item is None:
                return None
            parts.append(item)
            size += len(item) + 2
            self._check(size, s, "minItems")
        return b"[" + b", ".join(parts) + b"]"

    def _minimal_object(self, s: dict) -> bytes | None:
        parts: list[bytes] = []
        size = 2
        req = set(required(s))
        need = _int(s, "minProperties") - len(req)
        self._check(6 * need, s, "minProperties")
        for name in ordered(s):
            if name not in req and need <= 0:
                continue
            value = self.minimal(property_schema(s, name))
            if value is None:
                if name in req:
                    return None
                continue
            need -= name not in req
            parts.append(dump(name).encode() + b": " + value)
            size += len(parts[-1]) + 2
            self._check(size, s, "properties")
        if need > 0:
            extra = property_schema(s, "")
            value = self.minimal(extra) if extra is not False else None
            if value is None:
                return None
            names = set(ordered(s))
            for name in _fresh_names(names, need):
                parts.append(dump(name).encode() + b": " + value)
                size += len(parts[-1]) + 2
                self._check(size, s, "minProperties")
        return b"{" + b", ".join(parts) + b"}"


def blame(schema: Any, keyword: str) -> str:
    """``keyword`` where its largest value sits in ``schema`` ("minItems 5000 at /items"),
    for messages; "required properties" when ``keyword`` is ``properties``."""
    best: tuple[float, str] | None = None
    todo: list[tuple[Any, str]] = [(schema, "")]
    while todo:
        node, path = todo.pop()
        if isinstance(node, dict):
            value = node.get(keyword)
            if isinstance(value, str):  # a pattern: by the length of its shortest match
                try:
                    size = pattern_min_length(value)
                except ValueError:
                    size = MAX_SCHEMA_SIZE + 1
                if best is None or size > best[0]:
                    best = (size, f"{keyword} at {path or '/'}")
            elif keyword != "properties" and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and (best is None or value > best[0]):
                best = (value, f"{keyword} {_show(value)} at {path or '/'}")
            todo.extend((v, f"{path}/{k}") for k, v in node.items()
                        if isinstance(v, (dict, list)) and k not in ("const", "enum"))
        elif isinstance(node, list):
            todo.extend((v, f"{path}/{i}") for i, v in enumerate(node))
    return best[1] if best else "its required properties"


def _fresh_names(taken: set[str], n: int) -> list[str]:
    """``n`` short property names not in ``taken`` (a, b, ..., z, aa, ab ...)."""
    out: list[str] = []
    i = 0
    while len(out) < n:
        name, k = "", i
        while True:
            name = chr(97 + k % 26) + name
            k = k // 26 - 1
            if k < 0:
                break
        if name not in taken:
            out.append(name)
        i += 1
    return out


def fresh_name(taken: set[str], prefix: str = "") -> str:
    """The shortest property name starting with ``prefix`` that is not empty and not in
    ``taken``."""
    if prefix and prefix not in taken:
        return prefix
    for tail in _fresh_names(set(), len(taken) + 1):
        if prefix + tail not in taken:
            return prefix + tail
    raise AssertionError("unreachable: more candidates than taken names")


# ---- numbers ------------------------------------------------------------------------------------
def _bounds(s: dict) -> tuple[Fraction | None, bool, Fraction | None, bool]:
    """(low, low exclusive, high, high exclusive) of a numeric schema, exact."""

    def num(key: str) -> Fraction | None:
        v = s.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return None
        if isinstance(v, float):  # its decimal form, as written in the schema
            return Fraction(repr(v)) if math.isfinite(v) else None
        return Fraction(v)

    lo, xlo, hi, xhi = num("minimum"), num("exclusiveMinimum"), num("maximum"), \
        num("exclusiveMaximum")
    low, low_x = lo, False
    if xlo is not None and (low is None or xlo >= low):
        low, low_x = xlo, True
    high, high_x = hi, False
    if xhi is not None and (high is None or xhi <= high):
        high, high_x = xhi, True
    return low, low_x, high, high_x


def _fits(v: Fraction, b: tuple) -> bool:
    low, low_x, high, high_x = b
    if low is not None and (v < low or (low_x and v == low)):
        return False
    return not (high is not None and (v > high or (high_x and v == high)))


def number_in_range(s: dict, *, integer: bool) -> str | None:
    """The shortest number text within ``s``'s bounds, the one closest to zero (an
    integer ``multipleOf`` respected for integers); None when nothing fits."""
    options = numbers_in_range(s, integer=integer)
    return options[0] if options else None


def numbers_in_range(s: dict, *, integer: bool) -> list[str]:
    """A few short number texts within ``s``'s bounds, preferred first (see
    :func:`number_in_range`): llguidance's range expressions refuse some values inside
    their bounds (1.8 between 1.75 and 1.87, where 1.80 passes), so callers that can check
    try them in order."""
    b = _bounds(s)
    low, low_x, high, high_x = b
    step = s.get("multipleOf")
    if integer and isinstance(step, int) and not isinstance(step, bool) and step > 1:
        if _fits(Fraction(0), b):
            return ["0"]
        if low is not None and low >= 0:
            v = math.ceil(low / step) * step
            v += step if low_x and v == low else 0
        elif high is not None:
            v = math.floor(high / step) * step
            v -= step if high_x and v == high else 0
        else:
            return []
        return [str(v)] if _fits(Fraction(v), b) else []
    if _fits(Fraction(0), b):
        return ["0"]
    neg = not (low is not None and low >= 0)  # 0 does not fit: the side of the range
    sign = "-" if neg else ""
    tails = [sign + t for t in _complete(neg, None, None, b, integer, n=8)]
    near, near_x = (high, high_x) if neg else (low, low_x)
    if near is None or near.denominator == 1:
        return tails
    # The bound itself when inclusive, then values with as many fraction digits as it has.
    text = repr(float(near))
    places = len(text.partition(".")[2])
    alike = [t for t in tails if len(t.partition(".")[2]) == places]
    return ([text] if not near_x else []) + alike + [t for t in tails if t not in alike]


_NUMBER = re.compile(r"(-?)(\d*)(?:(\.)(\d*))?(?:([eE])([+-]?)(\d*))?")


def finish_number(prefix: str, s: dict, *, integer: bool, n: int = 3) -> list[str]:
    """The shortest texts (up to ``n``, shortest first) that turn ``prefix`` (the start of a
    JSON number) into a number within ``s``'s ``minimum``/``maximum`` bounds (exclusive
    ones too); empty when none exists. Example: ``"1"`` with minimum 50 and maximum 100
    gives ``["00"]``.
    """
    m = _NUMBER.fullmatch(prefix)
    if m is None:
        return []
    sign, whole, dot, frac, e, _, exp = m.groups()
    if e:  # llguidance writes bounded numbers without exponents: only finish the syntax
        return [""] if exp else ["0"]
    return _complete(sign == "-", whole or None, frac if dot else None, _bounds(s), integer, n)


def _complete(neg: bool, whole: str | None, frac: str | None, b: tuple,
              integer: bool, n: int = 1) -> list[str]:
    """The shortest digits (and point) to append to a number whose sign is ``neg``, integer
    digits ``whole`` (None: none yet) and fraction digits ``frac`` (None: no point yet)
    so that its value lies within ``b``. Every way of appending L characters reaches an
    arithmetic progression of magnitudes; the shortest lengths with one inside the bounds
    win, and within a length the magnitudes closest to zero. Returns up to ``n`` of them
    (llguidance's range expressions refuse a few values inside the bounds, such as
    ``3.0`` below a maximum of 3.008 or ``-0`` where 0 is not the lowest value, so callers
    try the next)."""
    low, low_x, high, high_x = b
    # The bounds on the magnitude.
    mb = (-high if high is not None else None, high_x, -low if low is not None else None,
          low_x) if neg else b
    out: list[str] = []
    base = int(whole or "0")
    for length in range(24):
        shapes = []  # (start, unit, count, digits before the point, digits after it)
        if frac is not None:
            if length or frac:
                scale = 10 ** (len(frac) + length)
                start = Fraction(base * 10 ** len(frac) + int(frac or "0"), 10 ** len(frac))
                shapes.append((start, Fraction(1, scale), 10 ** length, None, length))
        else:
            for k in range(length + 1):
                j = length - k - 1  # digits after the point; -1: no point
                if whole == "0" and k or whole is None and k == 0 or integer and j >= 0 \
                        or j == 0:
                    continue
                first = 10 ** (k - 1) if whole is None and k > 1 else 0
                start = Fraction(base * 10 ** k + first)
                if j < 0:
                    shapes.append((start, Fraction(1), 10 ** k - first, k, None))
                else:
                    shapes.append((start, Fraction(1, 10 ** j), (10 ** k - first) * 10 ** j, k, j))
        for start, unit, count, k, j in shapes:
            i = 0 if mb[0] is None else max(0, math.ceil((mb[0] - start) / unit))
            for cand in range(i, min(i + 1 + n, count)):
                if _fits(start + cand * unit, mb):
                    out.append(_digits(start + cand * unit, base, k, j, frac))
                    if len(out) >= n:
                        return out
    return out


def _digits(v: Fraction, base: int, k: int | None, j: int | None, frac: str | None) -> str:
    """The characters appended to reach magnitude ``v`` in a shape (see :func:`_complete`)."""
    if frac is not None:  # only fraction digits are appended
        scale = 10 ** (len(frac) + j)
        return f"{int(v * scale) % 10 ** j:0{j}d}" if j else ""
    whole = int(v)
    head = f"{whole - base * 10 ** k:0{k}d}" if k else ""
    if j is None:
        return head
    return head + "." + f"{int((v - whole) * 10 ** j):0{j}d}"


# ---- size limits --------------------------------------------------------------------------------
def check_sizes(schema: Any, source: str) -> None:
    """Refuse, before llguidance compiles ``schema``: size keywords (``minItems``,
    ``minLength``, ``minProperties``) above :data:`MAX_SCHEMA_SIZE`, a ``pattern`` whose
    repetition counts or shortest match exceed it, and strings (keys too) holding a lone
    surrogate, which have no UTF-8 form. Iterative, linear in the schema's size (which
    ``constraint.check_schema`` bounds first).

    Raises:
        GrammarError: one line naming the keyword and its JSON pointer, e.g. ``source:
            minItems 100000 at /properties/a is above the limit of 10000``.
    """
    todo: list[tuple[Any, str, bool]] = [(schema, "", False)]
    while todo:
        node, path, literal = todo.pop()  # literal: inside const/enum/default/examples
        if isinstance(node, str):
            _check_text(node, path, source)
            continue
        if isinstance(node, list):
            todo.extend((v, f"{path}/{i}", literal) for i, v in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            where = f"{path}/{key.replace('~', '~0').replace('/', '~1')}"
            _check_text(key, where, source)
            here = path or "/"
            if not literal and key in _SIZE_KEYWORDS and not isinstance(value, bool) \
                    and isinstance(value, (int, float)) and value > MAX_SCHEMA_SIZE:
                raise GrammarError(f"{source}: {key} {_show(value)} at {here} is above "
                                   f"the limit of {MAX_SCHEMA_SIZE}")
            if not literal and key == "pattern" and isinstance(value, str):
                try:
                    pattern_min_length(value)
                except ValueError as e:
                    raise GrammarError(f"{source}: pattern at {here}: {e}") from None
            if isinstance(value, (dict, list, str)):
                todo.append((value, where, literal or key in ("const", "enum", "default",
                                                               "examples")))


def _check_text(text: str, where: str, source: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise GrammarError(f"{source}: a string at {where or '/'} holds a lone surrogate "
                           f"(\\u{ord(text[e.start]):04x}), which UTF-8 cannot encode") from None


def _show(v: float) -> str:
    return str(v) if isinstance(v, int) and abs(v) < 10**12 else f"{v:.3g}"


def pattern_min_length(pattern: str) -> int:
    """The fewest characters a string matching ``pattern`` (ECMA-262 syntax) has, with every
    repetition count checked against :data:`MAX_SCHEMA_SIZE`.

    Raises:
        ValueError: a count above the limit, ``{m,n}`` with n < m, or a shortest match
            longer than :data:`MAX_SCHEMA_SIZE` characters (nested counts multiply).
    """
    pos = 0
    n = len(pattern)

    def count() -> int:
        nonlocal pos
        start = pos
        while pos < n and pattern[pos].isdigit():
            pos += 1
        if pos == start:
            return -1
        digits = pattern[start:pos]
        if len(digits) > 9 or int(digits) > MAX_SCHEMA_SIZE:
            raise ValueError(f"repetition count {digits if len(digits) <= 12 else digits[:9] + '...'}"
                             f" is above the limit of {MAX_SCHEMA_SIZE}")
        return int(digits)

    def quantifier(length: int) -> int:
        nonlocal pos
        if pos >= n:
            return length
        c = pattern[pos]
        if c in "*?":
            pos += 1
            length = 0
        elif c == "+":
            pos += 1
        elif c == "{":
            save = pos
            pos += 1
            lo = count()
            hi = lo
            if lo >= 0 and pos < n and pattern[pos] == ",":
                pos += 1
                hi = count()
                hi = -2 if hi < 0 else hi
            if lo < 0 or pos >= n or pattern[pos] != "}":
                pos = save + 1  # a literal '{', as ECMA-262 reads it outside unicode mode
                return length
            pos += 1
            if hi >= 0 and hi < lo:
                raise ValueError(f"repetition {{{lo},{hi}}}: the maximum is below the minimum")
            length *= lo
        else:
            return length
        if pos < n and pattern[pos] == "?":
            pos += 1
        if length > MAX_SCHEMA_SIZE:
            raise ValueError(f"the shortest match is longer than {MAX_SCHEMA_SIZE} characters")
        return length

    def alternation(depth: int) -> int:
        nonlocal pos
        if depth > 64:
            raise ValueError("groups nested deeper than 64")
        best = None
        total = 0
        while True:
            if pos >= n or pattern[pos] in "|)":
                best = total if best is None else min(best, total)
                if pos < n and pattern[pos] == "|":
                    pos += 1
                    total = 0
                    continue
                return best
            c = pattern[pos]
            if c == "(":
                pos += 1
                look = pattern.startswith(("?=", "?!", "?<=", "?<!"), pos)
                if pattern.startswith("?", pos):
                    pos = pattern.find(":", pos) + 1 if pattern.startswith("?:", pos) \
                        else (pattern.find(">", pos) + 1 if pattern.startswith("?<", pos) and
                              not pattern.startswith(("?<=", "?<!"), pos) else pos + 2)
                    if look and pattern.startswith(("?<=", "?<!"), pos - 2):
                        pos += 1
                inner = alternation(depth + 1)
                if pos < n and pattern[pos] == ")":
                    pos += 1
                atom = 0 if look else inner
            elif c == "[":
                pos += 1
                if pos < n and pattern[pos] == "^":
                    pos += 1
                if pos < n and pattern[pos] == "]":
                    pos += 1
                while pos < n and pattern[pos] != "]":
                    pos += 2 if pattern[pos] == "\\" else 1
                pos += 1
                atom = 1
            elif c == "\\":
                nxt = pattern[pos + 1:pos + 2]
                pos += 2
                atom = 0 if nxt in ("b", "B") or nxt.isdigit() and nxt != "0" else 1
            elif c in "^$":
                pos += 1
                atom = 0
            else:
                pos += 1
                atom = 1
            total += quantifier(atom)
            if total > MAX_SCHEMA_SIZE:
                raise ValueError(
                    f"the shortest match is longer than {MAX_SCHEMA_SIZE} characters")

    length = 0
    while pos < n:
        length = max(length, alternation(0))
        pos += 1  # an unbalanced ')': llguidance reports it
    return length


def strict_schema(schema: Any) -> Any:
    """A copy of ``schema`` where every object schema without ``additionalProperties`` gets
    ``additionalProperties: false`` (OpenAI's ``strict: true`` structured outputs)."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict_schema(v) if k not in ("const", "enum", "default", "examples") else v
           for k, v in schema.items()}
    if (schema.get("type") == "object" or "properties" in schema) \
            and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out
