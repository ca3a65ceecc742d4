"""Lazy grammars for ``tool_choice="auto"``: free text until the model opens a call in its
family's syntax, then the call constrained by the tool's ``parameters`` schema.

:func:`tool_call_constraint` builds, for a template's tool-call syntax
(:data:`localllm.chat.replies.TOOL_SYNTAXES`), a llguidance Lark grammar of one call (or
several, with ``parallel_tool_calls``) whose arguments are the tools' JSON schemas
(``%json``), wrapped in a :class:`~localllm.grammar.lazy.LazyConstraint` triggered by the
syntax's opener: its special token where the vocabulary has one (``<tool_call>``,
``[TOOL_CALLS]``, ``<｜tool▁calls▁begin｜>``), else its text. This is what llama.cpp's
``grammar_lazy`` with ``grammar_triggers`` does for each format (``common/chat.cpp``); the
grammars here are our own, written for llguidance.

Argument text is written on one line with ``", "`` and ``": "`` separators, as every JSON
output here. XML and GLM string values are raw text up to their closing tag.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from ..errors import GrammarError
from .budget import strict_schema
from .constraint import GrammarConstraint, check_schema, lltokenizer
from .lazy import LazyConstraint

_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
               "lenient": True}  # tools' schemas come from clients: unknown keywords ignored

_DS = {"calls_begin": "<｜tool▁calls▁begin｜>", "calls_end": "<｜tool▁calls▁end｜>",
       "call_begin": "<｜tool▁call▁begin｜>", "call_end": "<｜tool▁call▁end｜>",
       "sep": "<｜tool▁sep｜>"}


class _Lark:
    """Helpers writing Lark text for one tokenizer: marker texts become special-token
    references where the vocabulary has them as one special token."""

    def __init__(self, constraint_tokenizer: Any) -> None:
        self.tok = constraint_tokenizer

        self.rules: list[str] = []  # rules the bodies needed (embedded JSON values)

    def token(self, text: str) -> int | None:
        """The id of ``text`` when it is one special token (control, or user-defined)."""
        ids = self.tok.encode(text, add_bos=False, special=True)
        if len(ids) == 1 and lltokenizer(self.tok).is_special_token(ids[0]):
            return ids[0]
        return None

    def text_until(self, closing: str) -> str:
        """A new rule for raw text ended by ``closing`` (a lazy lexeme: the shortest text
        after which the closing matches); its name."""
        name = f"text{len(self.rules)}"
        self.rules.append(f"{name}[lazy]: /(?s:.*)/ {closing}")
        return name

    def json_value(self, schema: Any, where: str) -> str:
        """A new rule for a JSON value following ``schema``; its name."""
        check_schema(schema, where)
        name = f"json{len(self.rules)}"
        self.rules.append(f"{name}: %json " + json.dumps({**schema, "x-guidance": _JSON_STYLE}))
        return name

    def lit(self, text: str) -> str:
        token = self.token(text)
        return f"<[{token}]>" if token is not None else json.dumps(text)


def _args_schema(schema: Any, strict: bool) -> dict:
    """A tool's ``parameters`` as the schema of its arguments object."""
    if not isinstance(schema, dict) or not schema:
        schema = {"type": "object"}
    return strict_schema(schema) if strict else schema


def _string_type(schema: Any) -> bool:
    return isinstance(schema, dict) and schema.get("type") == "string"


def tool_call_constraint(tokenizer: Any, tools: list[dict], syntax: str, *,
                         parallel: bool = True) -> LazyConstraint | None:
    """The lazy constraint of ``tool_choice="auto"`` for ``syntax``, or None when the
    syntax has no grammar here.

    Args:
        tokenizer: the model's tokenizer.
        tools: the request's function tools (OpenAI's shape).
        syntax: the template's tool-call syntax (``hermes``, ``qwen-xml``, ``glm``,
            ``llama3``, ``mistral``, ``mistral-args``, ``deepseek-r1``, ``deepseek-v3``,
            ``harmony``, ``fenced``).
        parallel: several calls may follow one another.
    Raises:
        GrammarError: a tool's ``parameters`` schema does not compile (named).
    """
    lark = _Lark(tokenizer)
    fns = [t["function"] for t in tools]
    rules: list[str] = []
    calls: list[str] = []
    for i, fn in enumerate(fns):
        name = fn["name"]
        schema = _args_schema(fn.get("parameters"), bool(fn.get("strict")))
        rules.append(f"args{i}: " + lark.json_value(schema, f"tools[{i}].function.parameters"))
        calls.append(_call_body(syntax, lark, name, i, schema))
    head, sep = _frame(syntax, lark)
    if head is None or any(c is None for c in calls):
        return None
    body = " | ".join(f"call{i}" for i in range(len(fns)))
    rules += [f"call{i}: {c}" for i, c in enumerate(calls)]
    many = f" ({sep} one)*" if parallel and sep is not None else ""
    grammar = "\n".join([f"start: {head}one{many}{_tail(syntax, lark)}",
                         f"one: {_open(syntax, lark)}({body}){_close(syntax, lark)}",
                         *rules, *lark.rules])
    try:
        text = llguidance.LLMatcher.grammar_from_lark(grammar)
    except (ValueError, TypeError) as e:
        raise GrammarError(f"tools: {e}") from None
    inner = GrammarConstraint(text, tokenizer, source="tools")
    trigger = _trigger(syntax)
    token = lark.token(trigger)
    if token is not None:
        return LazyConstraint(inner, tokenizer, tokens=(token,))
    return LazyConstraint(inner, tokenizer, words=(trigger,), anchored=syntax == "llama3")


def _trigger(syntax: str) -> str:
    return {"hermes": "<tool_call>", "qwen-xml": "<tool_call>", "glm": "<tool_call>",
            "fenced": "```tool_call", "llama3": '{"', "mistral": "[TOOL_CALLS]",
            "mistral-args": "[TOOL_CALLS]", "deepseek-r1": _DS["calls_begin"],
            "deepseek-v3": _DS["calls_begin"], "harmony": "to=functions."}[syntax]


def _frame(syntax: str, lark: _Lark) -> tuple[str | None, str]:
    """(what opens the calls, what separates two calls)."""
    if syntax in ("hermes", "qwen-xml", "glm", "fenced"):
        return "", '/[ \\n]{0,2}/'
    if syntax == "llama3":
        return "", '"; "'
    if syntax == "mistral":
        return lark.lit("[TOOL_CALLS]") + ' "[" ', '", "'
    if syntax == "mistral-args":
        return "", '""'
    if syntax in ("deepseek-r1", "deepseek-v3"):
        return lark.lit(_DS["calls_begin"]) + " ", '""'
    if syntax == "harmony":
        return "", None  # one call, ended by <|call|>
    return None, ""


def _tail(syntax: str, lark: _Lark) -> str:
    if syntax == "mistral":
        return ' "]"'
    if syntax in ("deepseek-r1", "deepseek-v3"):
        return " " + lark.lit(_DS["calls_end"])
    return ""


def _open(syntax: str, lark: _Lark) -> str:
    if syntax in ("hermes", "qwen-xml", "glm"):
        return lark.lit("<tool_call>") + (' "\\n" ' if syntax != "glm" else " ")
    if syntax == "fenced":
        return '"```tool_call\\n" '
    if syntax == "mistral-args":
        return lark.lit("[TOOL_CALLS]") + " "
    if syntax in ("deepseek-r1", "deepseek-v3"):
        return lark.lit(_DS["call_begin"]) + " "
    if syntax == "harmony":
        return '"to=functions." '
    return ""


def _close(syntax: str, lark: _Lark) -> str:
    if syntax in ("hermes", "qwen-xml"):
        return ' "\\n" ' + lark.lit("</tool_call>")
    if syntax == "glm":
        return " " + lark.lit("</tool_call>")
    if syntax == "fenced":
        return ' "\\n```"'
    if syntax in ("deepseek-r1", "deepseek-v3"):
        return " " + lark.lit(_DS["call_end"])
    return ""


def _call_body(syntax: str, lark: _Lark, name: str, i: int, params: Any) -> str | None:
    q = json.dumps
    if syntax in ("hermes", "fenced"):
        return q('{"name": ' + q(name) + ', "arguments": ') + f" args{i} " + q("}")
    if syntax == "llama3":
        return q('{"name": ' + q(name) + ', "parameters": ') + f" args{i} " + q("}")
    if syntax == "mistral-args":
        return (q(name) + ' ("[CALL_ID]" /[A-Za-z0-9]{9}/)? ' + lark.lit("[ARGS]") + f" args{i}")
    if syntax == "deepseek-r1":
        return (q("function") + " " + lark.lit(_DS["sep"]) + " " + q(name + "\n```json\n")
                + f" args{i} " + q("\n```"))
    if syntax == "deepseek-v3":
        return q(name) + " " + lark.lit(_DS["sep"]) + f" args{i}"
    if syntax == "harmony":  # the channel may follow the recipient, or precede it
        return (q(name) + " (" + lark.lit("<|channel|>") + ' "commentary")? (" " '
                + lark.lit("<|constrain|>") + '? "json")? ' + lark.lit("<|message|>")
                + f" args{i}")
    if syntax == "mistral":  # Nemo's template writes the call's id after its arguments
        return (q('{"name": ' + q(name) + ', "arguments": ') + f" args{i} "
                + '(", \\"id\\": \\"" /[A-Za-z0-9]{9}/ "\\"")? ' + q("}"))
    props = params.get("properties") if isinstance(params, dict) else None
    props = props if isinstance(props, dict) else {}
    required = params.get("required") if isinstance(params, dict) else None
    required = [k for k in required or () if k in props]
    rules: dict[str, str] = {}
    for key, schema in props.items():
        if syntax == "qwen-xml":
            opening, closing = q(f"<parameter={key}>\n"), q("\n</parameter>\n")
        else:
            opening = (lark.lit("<arg_key>") + " " + q(key) + " " + lark.lit("</arg_key>")
                       + ' "\\n" ' + lark.lit("<arg_value>"))
            closing = lark.lit("</arg_value>") + ' "\\n"'
        if _string_type(schema):  # raw text up to the closing tag
            value = lark.text_until(closing)
        else:
            sub = schema if isinstance(schema, dict) else {}
            value = lark.json_value(sub, f"tools[{i}].function.parameters.properties.{key}")
            value += " " + closing
        rules[key] = f"{opening} {value}"
    # The required parameters in their order, then any of the others.
    params_rule = " ".join(rules[k] for k in required)
    values = [rule for k, rule in rules.items() if k not in required]
    if values:
        params_rule += f" ({' | '.join(values)})*"
    params_rule = params_rule.strip() or '""'
    if syntax == "qwen-xml":
        return q(f"<function={name}>\n") + f" {params_rule} " + q("</function>")
    if syntax == "glm":
        return q(name + "\n") + f" {params_rule}"
    return None


__all__ = ["tool_call_constraint"]
