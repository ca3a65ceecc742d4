"""Tool (function) calling: parsing calls out of model text, the JSON schema that forces a
call, and tool messages for chat templates (the request itself is checked by
:mod:`localllm.api.schema`).

Models write tool calls in their family's format; :func:`parse_tool_calls` recognises

* Hermes / Qwen 2.5+: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (repeated);
* Llama 3.1+: the whole reply is ``{"name": ..., "parameters": {...}}`` (``arguments`` also
  accepted), optionally after ``<|python_tag|>``, several separated by ``;``;
* Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``;
* our built-in templates' fallback (``localllm/chat/builtin.py``): a fenced block
  ```` ```tool_call\\n{"name": ..., "arguments": {...}}\\n``` ````.

Only names of the request's tools count as calls; anything else stays content. The formats
follow llama.cpp's ``common/chat.cpp`` parsers (names and shapes, not code).
"""

from __future__ import annotations

import json
import re
from typing import Any

from ..errors import ParameterError


def forced_tool_schema(tools: list[dict], tool_choice: Any) -> dict | None:
    """The JSON schema a reply must follow for ``tool_choice``, or None when the model may
    answer freely (``"auto"``, ``"none"``, None).

    ``"required"``: one call to any of the tools; ``{"type": "function", "function":
    {"name": N}}``: a call to N. The call is ``{"name": N, "arguments": {...}}`` with the
    arguments following the tool's ``parameters`` schema (Llama 3.1's JSON form, which
    :func:`parse_tool_calls` reads back).

    Raises:
        ParameterError: an unknown ``tool_choice`` or a name not among ``tools``.
    """
    if tool_choice in (None, "auto", "none"):
        return None
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if tool_choice == "required":
        names = list(by_name)
    elif isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in by_name:
            raise ParameterError(f"tool_choice names {name!r}, which is not among tools")
        names = [name]
    else:
        raise ParameterError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if not names:
        raise ParameterError(f"tool_choice={tool_choice!r} needs at least one tool")

    def call(name: str) -> dict:
        params = by_name[name].get("parameters") or {"type": "object"}
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": params},
                "required": ["name", "arguments"], "additionalProperties": False}

    return call(names[0]) if len(names) == 1 else {"anyOf": [call(n) for n in names]}


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: Python's json reads them


_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def parse_tool_calls(text: str, tools: list[dict]) -> tuple[str | None, list[dict]]:
    """Split a whole reply into (content, tool calls) in OpenAI's shape, in any family's
    format (:class:`~localllm.chat.toolparse.ToolScanner`, the streaming reader, run over the
    whole text).

    Linear in the length of ``text``. A value that is not JSON (``NaN``, ``Infinity``), that
    is nested deeper than the JSON parser goes, or that names no tool of ``tools`` is no call.

    Returns:
        content: the text outside the calls, stripped (None when empty and there are calls);
        calls: ``[{"id": "call_...", "type": "function", "function": {"name": ...,
        "arguments": "<JSON text>"}}]`` (empty when the reply holds no call to a known tool:
        the content is then ``text`` itself).
    """
    from .events import ReplyMessage
    from .toolparse import ToolScanner

    if not tools:
        return text, []
    scanner = ToolScanner(tools)
    message = ReplyMessage()
    for event in [*scanner.push(text), *scanner.finish()]:
        message.add(event)
    if not message.calls:
        return text, []
    return message.content.strip() or None, message.calls


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates expect them: tool-call ``arguments`` given as JSON text
    (OpenAI's wire form) become objects, as Hugging Face templates read them; the
    ``developer`` role is ``system``; content given as text parts is one string."""
    out = []
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "developer":  # OpenAI's newer name
            m = {**m, "role": "system"}
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            # Text parts as one string: many templates only handle strings.
            m = {**m, "content": _text(m["content"])}
        calls = m.get("tool_calls") if isinstance(m, dict) else None
        if calls:
            m = dict(m)
            fixed = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    fn["arguments"] = _arguments_value(fn["arguments"])
                call["function"] = fn
                fixed.append(call)
            m["tool_calls"] = fixed
        out.append(m)
    return out


def _arguments_value(text: str) -> Any:
    """Tool-call arguments given as JSON text, as the object they encode; the text itself
    when it is not JSON or nests too deep for a template to walk."""
    try:
        value = _DECODER.decode(text)
    except (ValueError, RecursionError):
        return text
    return value if _shallow(value) else text


def _shallow(value: Any, limit: int = 128) -> bool:
    """Whether ``value`` nests at most ``limit`` levels (templates and ``json.dumps`` recurse)."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (list, dict)):
            if depth >= limit:
                return False
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict)
                                                  else item))
    return True


def template_knows_tools(source: str) -> bool:
    """Whether a chat template's Jinja reads the ``tools`` variable at all."""
    return re.search(r"\btools\b", source) is not None


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return "" if content is None else str(content)


def fallback_messages(messages: list[dict], tools: list[dict]) -> list[dict]:
    """Tools for a template that knows nothing of them (Gemma 3's, many fine-tunes'): the
    descriptions and the call format (our built-in fenced ``tool_call`` block) go into the
    system message, earlier calls become assistant text in that format, and tool results
    become user text in a ``tool_response`` block (merged with an adjacent user turn, for
    templates that insist on alternating roles). llama.cpp's generic tool format does the
    same with its own wording."""
    described = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    instructions = (
        "You can call these tools (JSON schemas):\n" + described + "\n"
        "To call one, reply with only:\n```tool_call\n"
        '{"name": <tool name>, "arguments": {<argument>: <value>}}\n```')
    rest = list(messages)
    system = instructions
    if rest and rest[0].get("role") == "system":
        system = _text(rest[0].get("content")) + "\n\n" + instructions
        rest = rest[1:]
    out: list[dict] = [{"role": "system", "content": system}]
    for m in rest:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            blocks = []
            for call in m["tool_calls"]:
                fn = call.get("function") or {}
                blocks.append("```tool_call\n" + json.dumps(
                    {"name": fn.get("name"), "arguments": fn.get("arguments")},
                    ensure_ascii=False) + "\n```")
            text = _text(m.get("content"))
            out.append({"role": "assistant", "content": (text + "\n" if text else "")
                        + "\n".join(blocks)})
        elif role == "tool":
            text = "```tool_response\n" + _text(m.get("content")) + "\n```"
            if out[-1]["role"] == "user":
                out[-1] = {"role": "user", "content": _text(out[-1].get("content")) + "\n\n" + text}
            else:
                out.append({"role": "user", "content": text})
        else:
            out.append(m)
    return out
