"""gpt-oss's harmony format: function tools declared as a TypeScript-like namespace.

The developer message of a harmony prompt lists the request's tools as
``namespace functions { ... }`` with one ``type NAME = (_: {...}) => any;`` per tool, each
parameter's JSON schema written as a TypeScript type (OpenAI's harmony documentation; the
official gpt-oss chat template, ``models/templates/openai-gpt-oss-120b.jinja`` in llama.cpp,
does it in Jinja). :func:`functions_namespace` writes the same text, character for
character, that the official template writes, including its spacing quirks (a nested
object's properties and ``oneOf`` variants carry the template's indentation), so that a
model without a template of its own sees what it was trained on. The built-in ``harmony``
template (:mod:`localllm.chat.builtin`) calls it as the global ``harmony_functions()``.

Where the official template fails (a tool without a description, a ``default`` that is not
text beside ``enum``/``oneOf``) this writes no comment line / the default as JSON; a tool or
schema that cannot be written at all is a :class:`~localllm.errors.TemplateError` naming it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from jinja2 import pass_context

from ..errors import TemplateError

MAX_DEPTH = 64  # nesting of a parameter schema (a cyclic one goes past it)
MAX_NODES = 20_000  # schemas visited for all the tools together (shared ones once per use)
_PRIMITIVE_ITEMS = {"string": "string[]", "number": "number[]", "integer": "number[]",
                    "boolean": "boolean[]"}
# The official template writes these after a newline and its source's indentation.
_NESTED_INDENT = "\n" + " " * 16
_VARIANT_INDENT = " " * 20


class _Writer:
    def __init__(self, where: str) -> None:
        self.where = where
        self.nodes = 0

    def fail(self, path: str, what: str) -> TemplateError:
        if len(path) > 80:  # a deep schema's path: its start says which parameter
            path = path[:80] + "..."
        return TemplateError(f"{self.where}{path}: {what}")

    def type_of(self, spec: Any, path: str, depth: int) -> str:
        """The TypeScript type of one JSON schema (a non-object schema is ``any``)."""
        self.nodes += 1
        if depth > MAX_DEPTH:
            raise self.fail(path, f"nested more than {MAX_DEPTH} levels deep (or cyclic)")
        if self.nodes > MAX_NODES:
            raise self.fail(path, f"more than {MAX_NODES} schemas to write")
        if not isinstance(spec, Mapping):
            return "any"
        kind = spec.get("type")
        null = " | null" if spec.get("nullable") else ""
        if kind == "array":
            items = spec.get("items")
            if not items:
                return "any[]" + null
            item_kind = items.get("type") if isinstance(items, Mapping) else None
            if isinstance(item_kind, str) and item_kind in _PRIMITIVE_ITEMS:
                return _PRIMITIVE_ITEMS[item_kind] + null
            inner = self.type_of(items, path + ".items", depth + 1)
            if inner == "object | object" or len(inner) > 50:
                return "any[]" + null
            return inner + "[]" + null
        if isinstance(kind, (list, tuple)) and kind:
            return " | ".join(map(_text, kind))
        variants = spec.get("oneOf")
        if variants:
            if not isinstance(variants, (list, tuple)):
                raise self.fail(path + ".oneOf", "must be a list of schemas")
            return self.variants(variants, path + ".oneOf", depth)
        if kind == "string":
            enum = spec.get("enum")
            if enum:
                if not isinstance(enum, (list, tuple)):
                    raise self.fail(path + ".enum", "must be a list")
                return '"' + '" | "'.join(map(_text, enum)) + '"'
            return "string" + null
        if kind in ("number", "integer"):
            return "number"
        if kind == "boolean":
            return "boolean"
        if kind == "object":
            props = self.properties(spec, path)
            if not props:
                return "object"
            required = self.required(spec, path)
            fields = [name + ("" if name in required else "?") + ": " + _NESTED_INDENT
                      + self.type_of(sub, f"{path}.properties.{name}", depth + 1)
                      for name, sub in props.items()]
            return "{\n" + ", ".join(fields) + "}"
        return "any"

    def variants(self, variants: list | tuple, path: str, depth: int) -> str:
        out = []
        for i, variant in enumerate(variants):
            text = self.type_of(variant, f"{path}[{i}]", depth + 1)
            if isinstance(variant, Mapping):
                if variant.get("description"):
                    text += "// " + _text(variant["description"])
                if "default" in variant:
                    text += _VARIANT_INDENT + "// default: " + self.json(variant["default"], path)
            out.append(text)
        return " | \n".join(out)

    def properties(self, spec: Mapping, path: str) -> Mapping:
        props = spec.get("properties")
        if props and not isinstance(props, Mapping):
            raise self.fail(path + ".properties", "must be an object")
        if props and not all(isinstance(k, str) for k in props):
            raise self.fail(path + ".properties", "names must be strings")
        return props or {}

    def required(self, spec: Mapping, path: str) -> list:
        required = spec.get("required") or []
        if not isinstance(required, (list, tuple)):
            raise self.fail(path + ".required", "must be a list")
        return list(required)

    def json(self, value: Any, path: str) -> str:
        try:
            return json.dumps(value, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as e:
            raise self.fail(path, f"default is not JSON ({e})") from None

    def default(self, spec: Mapping, path: str) -> str:
        """The ``// default: ...`` comment after a parameter's type, as the official template
        writes it (text beside ``enum``, no comma beside ``oneOf``, JSON otherwise)."""
        if "default" not in spec:
            return ""
        value = spec["default"]
        text = value if isinstance(value, str) else self.json(value, path)
        if spec.get("enum"):
            return ", // default: " + text
        if spec.get("oneOf"):
            return "// default: " + text
        return ", // default: " + self.json(value, path)

    def tool(self, tool: Any) -> str:
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if not isinstance(fn, Mapping) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise self.fail("", 'must be {"type": "function", "function": {"name": ..., ...}}')
        name = fn["name"]
        self.where += f" ({name})"
        out = ""
        description = fn.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise self.fail(".description", "must be text")
            out += "// " + description + "\n"
        out += "type " + name + " = "
        params = fn.get("parameters")
        if params is not None and not isinstance(params, Mapping):
            raise self.fail(".parameters", "must be a JSON schema object")
        props = self.properties(params or {}, ".parameters")
        if not props:
            return out + "() => any;\n\n"
        required = self.required(params, ".parameters")
        out += "(_: {\n"
        for pname, spec in props.items():
            path = f".parameters.properties.{pname}"
            if isinstance(spec, Mapping) and spec.get("description"):
                out += "// " + _text(spec["description"]) + "\n"
            out += pname + ("" if pname in required else "?") + ": "
            out += self.type_of(spec, path, 1)
            if isinstance(spec, Mapping):
                out += self.default(spec, path)
            out += ",\n"
        return out + "}) => any;\n\n"


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def functions_namespace(tools: Any) -> str:
    """The ``## functions`` section of a harmony developer message for OpenAI function tools.

    Args:
        tools: ``[{"type": "function", "function": {"name", "description", "parameters"}}]``
            (the request's ``tools``; ``parameters`` a JSON schema).
    Returns:
        ``"## functions\\n\\nnamespace functions {\\n\\n" ... "} // namespace functions"``.
    Raises:
        TemplateError: a tool that is not a named function, ``parameters``/``properties``
            that are not objects, ``required``/``enum``/``oneOf`` that are not lists, a
            ``default`` that is not JSON, a schema nested deeper than :data:`MAX_DEPTH`
            (or cyclic) or with more than :data:`MAX_NODES` sub-schemas.
    """
    if not isinstance(tools, (list, tuple)):
        raise TemplateError("tools must be a list")
    out = "## functions\n\nnamespace functions {\n\n"
    writer = _Writer("")
    for i, tool in enumerate(tools):
        writer.where = f"tools[{i}]"
        out += writer.tool(tool)
    return out + "} // namespace functions"


@pass_context
def template_global(context) -> str:
    """:func:`functions_namespace` of the template's ``tools``, as the global
    ``harmony_functions()``: it reads them from the context so that the sandbox's weighing of
    call arguments does not meet a cyclic schema first (this bounds depth and size itself,
    and names the tool)."""
    return functions_namespace(context.get("tools"))


__all__ = ["MAX_DEPTH", "MAX_NODES", "functions_namespace", "template_global"]
