"""Finishing a JSON value within a token budget.

A schema-constrained generation that reaches its token limit (``max_tokens``, ``-n``) in the
middle of a value would end with text that does not parse. :class:`BudgetedConstraint`
wraps a JSON :class:`~localllm.grammar.constraint.GrammarConstraint` and, once the tokens
left are no more than the shortest valid completion of the text so far needs, forces that
completion token by token: the open string is closed, a partial number or literal is
finished, required properties still missing get their smallest value (``0``, ``""``,
``false``, ``[]``, the first ``enum`` entry, the ``minimum`` ...), and every open array and
object is closed. Until then the model chooses freely under the grammar; the forced tokens
are checked against the grammar first (llguidance), so steering never breaks it, and a
completion the grammar would refuse (a ``pattern``, a keyword this module does not model)
leaves generation unsteered, as before.

:func:`shortest_completion` computes the completion from the text and the schema (the
subset of JSON Schema that drives the shape: ``type``, ``properties``, ``required``,
``additionalProperties``, ``items``, ``prefixItems``, ``minItems``, ``enum``, ``const``,
``anyOf``/``oneOf``/``allOf``, ``minimum``, ``minLength``, local ``$ref``). The text is the
one-line form the constraint emits (``", "`` and ``": "`` separators, no other whitespace).
"""

from __future__ import annotations

import json
import math
from typing import Any

_LITERALS = {"t": "true", "f": "false", "n": "null"}


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


class _Schemas:
    """Navigation in a schema: resolves local ``$ref`` and picks a branch of a union."""

    def __init__(self, root: Any) -> None:
        self.root = root if isinstance(root, dict) else {}

    def resolve(self, s: Any, kind: str | None = None, depth: int = 0) -> dict:
        if not isinstance(s, dict) or depth > 32:
            return {}
        ref = s.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            target: Any = self.root
            for part in ref[1:].split("/"):
                if part:
                    target = target.get(part.replace("~1", "/").replace("~0", "~"), {}) \
                        if isinstance(target, dict) else {}
            merged = {k: v for k, v in s.items() if k != "$ref"}
            return self.resolve({**target, **merged}, kind, depth + 1)
        if "allOf" in s and isinstance(s["allOf"], list):
            merged = {k: v for k, v in s.items() if k != "allOf"}
            for part in s["allOf"]:
                part = self.resolve(part, kind, depth + 1)
                for k, v in part.items():
                    if k == "properties":
                        merged["properties"] = {**merged.get("properties", {}), **v}
                    elif k == "required":
                        merged["required"] = list(merged.get("required", [])) + list(v)
                    else:
                        merged.setdefault(k, v)
            return merged
        for key in ("anyOf", "oneOf"):
            options = s.get(key)
            if isinstance(options, list) and options:
                rest = {k: v for k, v in s.items() if k != key}
                chosen = [self.resolve(o, kind, depth + 1) for o in options]
                if kind is not None:
                    fitting = [o for o in chosen if _fits(o, kind)]
                    chosen = fitting or chosen
                return {**rest, **chosen[0]}
        return s

    def minimal(self, s: Any, depth: int = 0) -> str:
        """The shortest JSON text we know to satisfy ``s`` (one line, canonical separators)."""
        if depth > 32:
            raise ValueError("schema too deep")
        if s is True or s is None:
            return "0"
        s = self.resolve(s)
        if "const" in s:
            return _dump(s["const"])
        if isinstance(s.get("enum"), list) and s["enum"]:
            return min((_dump(v) for v in s["enum"]), key=len)
        types = s.get("type")
        types = [types] if isinstance(types, str) else list(types or [])
        if not types:
            if "properties" in s or "required" in s:
                types = ["object"]
            elif "items" in s or "prefixItems" in s:
                types = ["array"]
            else:
                return "0"
        if "null" in types:
            return "null"
        kind = types[0]
        if kind == "object":
            props = s.get("properties") or {}
            parts = [f"{_dump(k)}: {self.minimal(props.get(k, _extra(s)), depth + 1)}"
                     for k in _ordered(s) if k in _required(s)]
            return "{" + ", ".join(parts) + "}"
        if kind == "array":
            n = int(s.get("minItems") or 0)
            prefix = s.get("prefixItems") or []
            items = [self.minimal(prefix[i] if i < len(prefix) else s.get("items", {}), depth + 1)
                     for i in range(n)]
            return "[" + ", ".join(items) + "]"
        if kind == "string":
            return _dump("a" * int(s.get("minLength") or 0))
        if kind in ("integer", "number"):
            return _number(s)
        if kind == "boolean":
            return "false"
        return "0"


def _fits(s: dict, kind: str) -> bool:
    t = s.get("type")
    types = [t] if isinstance(t, str) else list(t or [])
    if kind == "object":
        return "object" in types or (not types and "properties" in s)
    if kind == "array":
        return "array" in types or (not types and "items" in s)
    return True


def _dump(v: Any) -> str:
    return json.dumps(v, ensure_ascii=False, separators=(", ", ": "))


def _required(s: dict) -> list[str]:
    req = s.get("required")
    return [k for k in req if isinstance(k, str)] if isinstance(req, list) else []


def _extra(s: dict) -> Any:
    extra = s.get("additionalProperties", True)
    return extra if isinstance(extra, dict) else {}


def _number(s: dict) -> str:
    lo, hi = s.get("minimum"), s.get("maximum")
    xlo, xhi = s.get("exclusiveMinimum"), s.get("exclusiveMaximum")
    value = 0
    if isinstance(lo, (int, float)) and value < lo:
        value = math.ceil(lo)
    if isinstance(xlo, (int, float)) and not isinstance(xlo, bool) and value <= xlo:
        value = math.floor(xlo) + 1
    if isinstance(hi, (int, float)) and value > hi:
        value = math.floor(hi)
    if isinstance(xhi, (int, float)) and not isinstance(xhi, bool) and value >= xhi:
        value = math.ceil(xhi) - 1
    return str(int(value))


class _Frame:
    """An open object, array, or the top level."""

    def __init__(self, kind: str, schema: dict, state: str) -> None:
        self.kind = kind  # "obj", "arr", "top"
        self.schema = schema
        self.state = state  # obj: open, key, colon, value, after; arr: open, value, after
        self.keys: list[str] = []
        self.key: str | None = None
        self.n_items = 0


def shortest_completion(schema: Any, text: str | bytes) -> str | None:
    """The shortest text that turns ``text`` (a prefix of a JSON value as the constraint
    writes it) into a complete value satisfying ``schema``; "" when it is complete; None
    when ``text`` is not a JSON prefix we can follow, or nothing valid is known.

    Example: schema ``{"type": "object", "properties": {"a": {"type": "string"}, "b":
    {"type": "integer"}}, "required": ["a", "b"]}`` and text ``{"a": "xy`` give
    ``", "b": 0}``.
    """
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="ignore")
    nav = _Schemas(schema)
    try:
        return _complete(nav, schema, text)
    except (ValueError, TypeError, KeyError, IndexError, RecursionError):
        return None


def _value_schema(nav: _Schemas, frame: _Frame) -> Any:
    s = frame.schema
    if frame.kind == "top":
        return s
    if frame.kind == "obj":
        props = s.get("properties") or {}
        return props.get(frame.key, _extra(s))
    prefix = s.get("prefixItems") or []
    if frame.n_items < len(prefix):
        return prefix[frame.n_items]
    items = s.get("items", {})
    return items if isinstance(items, (dict, bool)) else {}


def _complete(nav: _Schemas, schema: Any, text: str) -> str | None:
    stack = [_Frame("top", schema if isinstance(schema, dict) else {}, "value")]
    scalar: dict | None = None  # the string, number or literal being written

    def value_done() -> None:
        f = stack[-1]
        if f.kind == "obj":
            if f.key is not None:
                f.keys.append(f.key)
        else:
            f.n_items += 1
        f.state = "after"

    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if scalar is not None:
            kind = scalar["kind"]
            if kind == "string":
                if scalar["hex"]:
                    scalar["hex"] -= 1
                    scalar["raw"] += c
                elif scalar["esc"]:
                    scalar["esc"] = False
                    scalar["raw"] += c
                    if c == "u":
                        scalar["hex"] = 4
                elif c == "\\":
                    scalar["esc"] = True
                    scalar["raw"] += c
                elif c == '"':
                    value = json.loads('"' + scalar["raw"] + '"')
                    scalar = None
                    f = stack[-1]
                    if f.kind == "obj" and f.state in ("open", "key"):
                        f.key = value
                        f.state = "colon"
                    else:
                        value_done()
                else:
                    scalar["raw"] += c
                i += 1
                continue
            if kind == "number":
                if c in "0123456789+-.eE":
                    scalar["raw"] += c
                    i += 1
                    continue
                scalar = None
                value_done()
                continue  # this character is structural: handle it below
            if kind == "literal":
                scalar["raw"] += c
                i += 1
                if scalar["raw"] == scalar["word"]:
                    scalar = None
                    value_done()
                elif not scalar["word"].startswith(scalar["raw"]):
                    return None
                continue
        f = stack[-1]
        if c == " ":
            pass
        elif c == "{":
            sub = nav.resolve(_value_schema(nav, f), "object")
            stack.append(_Frame("obj", sub, "open"))
        elif c == "[":
            sub = nav.resolve(_value_schema(nav, f), "array")
            stack.append(_Frame("arr", sub, "open"))
        elif c == '"':
            scalar = {"kind": "string", "raw": "", "esc": False, "hex": 0}
        elif c in "-0123456789":
            scalar = {"kind": "number", "raw": c}
        elif c in _LITERALS:
            scalar = {"kind": "literal", "raw": c, "word": _LITERALS[c]}
        elif c == ",":
            f.state = "key" if f.kind == "obj" else "value"
            f.key = None
        elif c == ":":
            f.state = "value"
        elif c in "}]":
            if len(stack) < 2:
                return None
            stack.pop()
            value_done()
        else:
            return None
        i += 1

    out: list[str] = []
    if text.endswith((",", ":")) and scalar is None:
        out.append(" ")
    if scalar is not None:
        f = stack[-1]
        if scalar["kind"] == "string":
            if scalar["hex"]:
                out.append("0" * scalar["hex"])
            elif scalar["esc"]:
                out.append("n")
            partial = json.loads('"' + scalar["raw"] + "0" * scalar["hex"]
                                 + ("n" if scalar["esc"] and not scalar["hex"] else "") + '"')
            if f.kind == "obj" and f.state in ("open", "key"):
                name = _pick_key(f, partial)
                if name is None:
                    return None
                out.append(_dump(name)[1 + len(_dump(partial)) - 2:])
                f.key = name
                f.state = "colon"
            else:
                s = nav.resolve(_value_schema(nav, f))
                out.append(_finish_string(s, partial))
                value_done()
        elif scalar["kind"] == "number":
            if scalar["raw"][-1] in "-+.eE":
                out.append("0")
            value_done()
        else:
            out.append(scalar["word"][len(scalar["raw"]):])
            value_done()

    while stack:
        f = stack.pop()
        if f.kind == "top":
            if f.state == "value":
                out.append(nav.minimal(f.schema))
            break
        if f.kind == "obj":
            if f.state == "colon":
                out.append(": ")
                f.state = "value"
            if f.state == "value":
                out.append(nav.minimal(_value_schema(nav, f)))
                f.keys.append(f.key)
                f.state = "after"
            missing = [k for k in _ordered(f.schema) if k in _required(f.schema)
                       and k not in f.keys]
            if f.state == "key" and not missing:
                extra = _pick_key(f, "")
                if extra is None:
                    return None
                missing = [extra]
            props = f.schema.get("properties") or {}
            parts = [f"{_dump(k)}: {nav.minimal(props.get(k, _extra(f.schema)))}" for k in missing]
            if parts and f.state == "after":
                out.append(", ")
            out.append(", ".join(parts) + "}")
        else:
            n_min = int(f.schema.get("minItems") or 0)
            count = f.n_items
            parts = []
            if f.state == "value":
                parts.append(nav.minimal(_value_schema(nav, f)))
                count += 1
            while count < n_min:
                f.n_items = count
                parts.append(nav.minimal(_value_schema(nav, f)))
                count += 1
            if parts and f.state == "after":
                out.append(", ")
            out.append(", ".join(parts) + "]")
        parent = stack[-1]
        if parent.kind == "obj":
            parent.keys.append(parent.key)
        else:
            parent.n_items += 1
        parent.state = "after"
    return "".join(out)


def _ordered(s: dict) -> list[str]:
    """Property names in the order the grammar writes them: declared order, then required
    names that are not declared."""
    props = list((s.get("properties") or {}).keys())
    return props + [k for k in _required(s) if k not in props]


def _pick_key(f: _Frame, partial: str) -> str | None:
    """A property name starting with ``partial`` not used yet: the first missing required
    one in declared order (llguidance keeps that order), else the first declared one, else
    (when extra properties are allowed) ``partial``."""
    order = _ordered(f.schema)
    required = _required(f.schema)
    for group in ([k for k in order if k in required], order):
        fits = [k for k in group if k.startswith(partial) and k not in f.keys]
        if fits:
            return fits[0]
    if f.schema.get("additionalProperties", True) is False:
        return None
    return partial


def _finish_string(s: dict, partial: str) -> str:
    """The rest of a string value (closing quote included)."""
    options = s.get("enum") if isinstance(s.get("enum"), list) else (
        [s["const"]] if "const" in s else None)
    if options is not None:
        fits = [v for v in options if isinstance(v, str) and v.startswith(partial)]
        if not fits:
            raise ValueError("no enum value continues the text")
        rest = min(fits, key=len)[len(partial):]
        return _dump(rest)[1:]
    pad = max(0, int(s.get("minLength") or 0) - len(partial))
    return "a" * pad + '"'


class BudgetedConstraint:
    """A JSON constraint that steers to the shortest valid completion near the budget.

    Args:
        inner: the :class:`~localllm.grammar.constraint.GrammarConstraint` (JSON schema or
            any JSON) whose protocol this object forwards (``apply``, ``is_allowed``,
            ``accept``, ``reset``, ``is_accepting``, ``is_finished``).
        schema: the JSON schema ``inner`` was built from (``{}`` for any JSON value).
        budget: tokens the generation may still sample (``max_tokens``).
    Attributes:
        steered: True once the completion was forced.
    """

    def __init__(self, inner: Any, schema: Any, budget: int) -> None:
        self.inner = inner
        self.schema = schema
        self.budget = budget
        self.reset_budget()

    def reset_budget(self) -> None:
        self.n = 0
        self.data = bytearray()
        self.forced: list[int] | None = None
        self.steered = False
        self._unsteerable = False
        self._next_check = 0

    def __getattr__(self, name: str) -> Any:  # source, tokenizer, matches ... of the inner one
        return getattr(self.inner, name)

    def _plan(self) -> int | None:
        """The token to force now, or None to let the model choose."""
        if self.forced:
            return self.forced[0]
        if self._unsteerable or self.inner.is_accepting():
            return None
        if self.n < self._next_check:
            return None
        remaining = self.budget - self.n
        completion = shortest_completion(self.schema, bytes(self.data))
        if not completion:
            return None
        lltok = self.inner._lltok
        tokens = lltok.tokenize_bytes(completion.encode("utf-8"))
        slack = remaining - len(tokens) - 1
        if slack > 0:
            # Far from the budget: look again after a few tokens (the completion rarely
            # grows by more than a token or two per generated token).
            self._next_check = self.n + max(1, min(16, slack // 4))
            return None
        matcher = self.inner._matcher.deep_copy()
        if matcher.validate_tokens(tokens) != len(tokens):
            self._unsteerable = True
            return None
        matcher.consume_tokens(tokens)
        if matcher.is_error() or not matcher.is_accepting():
            self._unsteerable = True
            return None
        self.forced = list(tokens)
        self.steered = True
        return self.forced[0]

    # ---- the sampler-chain protocol ----------------------------------------------------------
    def is_allowed(self, token: int) -> bool:
        forced = self._plan()
        if forced is not None:
            return token == forced
        return self.inner.is_allowed(token)

    def apply(self, logits) -> None:
        forced = self._plan()
        if forced is None:
            self.inner.apply(logits)
            return
        keep = logits[..., forced].clone()
        logits.fill_(float("-inf"))
        logits[..., forced] = keep if bool(keep.isfinite().all()) else 0.0

    def accept(self, token: int) -> None:
        self.inner.accept(token)
        self.n += 1
        self.data += self.inner.tokenizer.token_bytes(token)
        if self.forced:
            if token == self.forced[0]:
                self.forced.pop(0)
            else:
                self.forced = None

    def reset(self) -> None:
        self.inner.reset()
        self.reset_budget()

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()

    def is_finished(self) -> bool:
        return self.inner.is_finished()
