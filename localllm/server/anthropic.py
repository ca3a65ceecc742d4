"""Anthropic's Messages API: ``POST /v1/messages`` and ``POST /v1/messages/count_tokens``.

The shapes follow Anthropic's API reference (docs.anthropic.com, "Messages"): a request's
``system``, ``messages`` of content blocks (``text``, ``tool_use``, ``tool_result``,
``thinking``), ``tools`` with ``input_schema``, ``tool_choice`` (``auto`` / ``any`` /
``tool`` / ``none``, ``disable_parallel_tool_use``), ``thinking`` (``enabled`` with
``budget_tokens``, or ``disabled``), ``stop_sequences``; the reply's content blocks
(``thinking``, ``text``, ``tool_use``), ``stop_reason`` and ``usage``; streams as
``message_start`` / ``content_block_start`` / ``content_block_delta`` (``text_delta``,
``thinking_delta``, ``input_json_delta``) / ``content_block_stop`` / ``message_delta`` /
``message_stop`` events. A request is mapped onto an OpenAI-shaped
:class:`~localllm.api.schema.ChatParams` and runs as the same chat turn
(:mod:`localllm.api.chat`), so templates, reasoning and tool calls are read as for
``/v1/chat/completions``. Errors are Anthropic's ``{"type": "error", "error": {"type",
"message"}}``; the key may come as ``x-api-key``.

Refused with a 400 naming the block: content blocks other than text, tool_use, tool_result,
thinking and redacted_thinking (images and documents until the models read them), a
``tool_result`` whose ``tool_use_id`` names no ``tool_use`` of the assistant turn before it,
server tools (``web_search`` ...). Fields of the request this server has no use for
(``metadata``, ``service_tier``, beta fields) are ignored, as clients such as Claude Code send
many.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import Request
from pydantic import Field

from ..api.chat import TurnRun, render_chat, with_default_system
from ..api.completions import timings_dict
from ..api.schema import InvalidRequest
from ..chat.events import Event
from .mapped import (
    Lenient,
    Mapped,
    MappedRequest,
    parse_mapped,
    run_mapped,
    texts_of,
    type_of,
)
from .protocol import Failure, Style, dumps

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                504: "api_error"}
_STOP = {"eog": "end_turn", "grammar": "end_turn", "cancelled": "end_turn", "stop":
         "stop_sequence", "length": "max_tokens", "ctx": "max_tokens"}


class AnthropicStyle(Style):
    """Anthropic's errors and ``event:``-named stream events (no ``[DONE]``)."""

    done = None

    def error(self, f: Failure) -> dict:
        return {"type": "error", "error": {"type": _ERROR_TYPES.get(f.status, "api_error"),
                                           "message": f.message}}

    def event(self, item: Any) -> dict:
        return {"event": item["type"], "data": dumps(item)}

    def tally(self, item: Any) -> tuple[dict, int, int] | None:
        if isinstance(item, dict) and "timings" in item and "usage" in item:
            usage = item["usage"]
            return item["timings"], usage.get("input_tokens", 0), usage["output_tokens"]
        return None


ANTHROPIC = AnthropicStyle()


# ---- the request ---------------------------------------------------------------------------------
class ThinkingConfig(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=0)


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class MessagesRequest(MappedRequest):
    """The fields of ``POST /v1/messages`` read here (content blocks are checked by hand,
    so that an error names the block)."""

    max_tokens: int = Field(ge=1)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None


class CountRequest(MessagesRequest):
    max_tokens: int = 1


def _text_only(kind: Any, where: str) -> InvalidRequest:
    return InvalidRequest(f"{where}: unsupported content block {kind!r} here (text blocks "
                          "only)", where)


def _text_of(blocks: Any, where: str) -> str:
    """Text of a string or of text blocks (``tool_result`` content, ``system``)."""
    return "\n".join(texts_of(blocks, where, ("text",), _text_only, "text blocks"))


def _unsupported(kind: Any, where: str) -> InvalidRequest:
    if kind in ("image", "document", "search_result", "container_upload"):
        return InvalidRequest(f"{where}: {kind} blocks are not supported: this server's models "
                              "read text only", where)
    return InvalidRequest(f"{where}: unknown content block type {kind!r} (known: text, "
                          "tool_use, tool_result, thinking, redacted_thinking)", where)


def to_chat(req: MessagesRequest) -> dict:
    """The OpenAI-shaped chat request of a Messages request.

    Raises:
        InvalidRequest: a block of an unknown or unsupported type, a ``tool_result`` that
            answers no ``tool_use``, a server tool (each named by its path).
    """
    messages: list[dict] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text_of(req.system, "system")})
    open_calls: set[str] = set()  # tool_use ids of the last assistant turn
    for m, msg in enumerate(req.messages):
        where = f"messages[{m}]"
        role = msg.get("role")
        if role not in ("user", "assistant"):
            raise InvalidRequest(f"{where}.role: must be 'user' or 'assistant'", f"{where}.role")
        content = msg.get("content")
        if isinstance(content, str):
            messages.append({"role": role, "content": content})
            open_calls = set()
            continue
        if not isinstance(content, list):
            raise InvalidRequest(f"{where}.content: must be a string or a list of content "
                                 "blocks", f"{where}.content")
        texts, calls, results, reasoning = [], [], [], []
        for b, block in enumerate(content):
            at = f"{where}.content[{b}]"
            kind = type_of(block)
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant":
                name, call_id = block.get("name"), block.get("id")
                if not isinstance(name, str) or not isinstance(call_id, str):
                    raise InvalidRequest(f"{at}: a tool_use block needs a string id and name", at)
                args = block.get("input", {})
                if not isinstance(args, dict):
                    raise InvalidRequest(f"{at}.input: must be an object", f"{at}.input")
                calls.append({"id": call_id, "type": "function",
                              "function": {"name": name, "arguments": dumps(args)}})
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if call_id not in open_calls:
                    raise InvalidRequest(
                        f"{at}.tool_use_id: {call_id!r} answers no tool_use block of the "
                        "assistant turn before it", f"{at}.tool_use_id")
                text = _text_of(block.get("content", ""), f"{at}.content")
                if block.get("is_error"):
                    text = "Error: " + text
                results.append({"role": "tool", "tool_call_id": call_id, "content": text})
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                if isinstance(block.get("thinking"), str):
                    reasoning.append(block["thinking"])
            else:
                raise _unsupported(kind, f"{at}.type" if kind is not None else at)
        if role == "assistant":
            out: dict[str, Any] = {"role": "assistant", "content": "".join(texts) or None}
            if calls:
                out["tool_calls"] = calls
            if reasoning:
                out["reasoning_content"] = "\n".join(reasoning)
            messages.append(out)
            open_calls = {c["id"] for c in calls}
        else:
            messages += results
            if texts:
                messages.append({"role": "user", "content": "\n".join(texts)})
            open_calls = set()
    body: dict[str, Any] = {"messages": messages, "max_tokens": req.max_tokens,
                            "stream": req.stream}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.stop_sequences:
        body["stop"] = req.stop_sequences
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    choice = req.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequest("tool_choice.name: required with type 'tool'",
                                     "tool_choice.name")
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[
                choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        if req.thinking.type == "disabled":
            body["reasoning_budget_tokens"] = 0
        elif req.thinking.budget_tokens is not None:
            body["reasoning_budget_tokens"] = req.thinking.budget_tokens
    return body


def _tool(tool: dict, i: int) -> dict:
    kind = tool.get("type")
    if kind not in (None, "custom"):
        raise InvalidRequest(f"tools[{i}].type: server tool {kind!r} is not available here "
                             "(custom tools with an input_schema only)", f"tools[{i}].type")
    name, schema = tool.get("name"), tool.get("input_schema")
    if not isinstance(name, str) or not name:
        raise InvalidRequest(f"tools[{i}].name: required", f"tools[{i}].name")
    if not isinstance(schema, dict):
        raise InvalidRequest(f"tools[{i}].input_schema: must be a JSON schema object",
                             f"tools[{i}].input_schema")
    fn: dict[str, Any] = {"name": name, "parameters": schema}
    if isinstance(tool.get("description"), str):
        fn["description"] = tool["description"]
    return {"type": "function", "function": fn}


def parse_messages(body: bytes, model: type[MessagesRequest] = MessagesRequest
                   ) -> Mapped[MessagesRequest]:
    """A Messages request and the chat parameters it maps to.

    Raises:
        InvalidRequest: see :func:`to_chat` and :func:`~localllm.server.mapped.parse_mapped`.
    """
    return parse_mapped(body, model, to_chat)


# ---- the reply ---------------------------------------------------------------------------------
def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def create_message(llm, parsed: Mapped[MessagesRequest], **limits: Any
                   ) -> dict | Iterator[dict]:
    """Run a Messages request: the ``message`` object, or its stream events (``limits``: see
    :func:`~localllm.server.mapped.run_mapped`)."""
    head = {"id": "msg_" + secrets.token_hex(12), "type": "message", "role": "assistant",
            "model": parsed.req.model or llm.model_name}
    return run_mapped(llm, parsed, head, _events, _message, **limits)


def _message(run: TurnRun, head: dict) -> dict:
    message = run.message
    content: list[dict] = []
    if message.reasoning:
        content.append({"type": "thinking", "thinking": message.reasoning, "signature": ""})
    text = message.text
    if text or not message.calls:
        content.append({"type": "text", "text": text})
    for call in message.calls:
        content.append({"type": "tool_use", "id": _tool_id(call["id"]),
                        "name": call["function"]["name"],
                        "input": json.loads(call["function"]["arguments"] or "{}")})
    return {**head, "content": content, "stop_reason": _stop_reason(run),
            "stop_sequence": None, "usage": _usage(run),
            "timings": timings_dict(run.gen.timings)}


def _stop_reason(run: TurnRun) -> str:
    if run.message.calls:
        return "tool_use"
    return _STOP.get(run.finish or "eog", "end_turn")


def _usage(run: TurnRun) -> dict:
    return {"input_tokens": len(run.turn.request.ids), "output_tokens": run.count,
            "cache_read_input_tokens": run.gen.timings.reused_tokens}


def _events(run: TurnRun, head: dict) -> Iterator[dict]:
    yield {"type": "message_start", "message": {
        **head, "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": len(run.turn.request.ids), "output_tokens": 0}}}
    blocks = _Blocks()
    for _, events in run:
        for event in events:
            yield from blocks.add(event)
    yield from blocks.close()
    yield {"type": "message_delta", "delta": {"stop_reason": _stop_reason(run),
                                              "stop_sequence": None},
           "usage": {"output_tokens": run.count}}
    yield {"type": "message_stop", "usage": _usage(run), "timings": timings_dict(run.gen.timings)}


class _Blocks:
    """Content blocks opened and closed as the reply's events come."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None  # the open block's: thinking, text, tool_use
        self.call = -1
        self.started = False  # some content was sent (whitespace-only text is skipped)

    def _open(self, kind: str, block: dict) -> Iterator[dict]:
        yield from self.close()
        self.index += 1
        self.kind = kind
        yield {"type": "content_block_start", "index": self.index, "content_block": block}

    def close(self) -> Iterator[dict]:
        if self.kind is None:
            return
        if self.kind == "thinking":
            yield {"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "signature_delta", "signature": ""}}
        yield {"type": "content_block_stop", "index": self.index}
        self.kind = None

    def add(self, e: Event) -> Iterator[dict]:
        if e.kind == "reasoning":
            if self.kind != "thinking":
                yield from self._open("thinking", {"type": "thinking", "thinking": "",
                                                   "signature": ""})
            yield {"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "thinking_delta", "thinking": e.text}}
        elif e.kind in ("content", "drop") and e.text:
            if self.kind != "text":
                yield from self._open("text", {"type": "text", "text": ""})
            yield {"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "text_delta", "text": e.text}}
        elif e.kind == "call":
            self.call = e.index
            yield from self._open("tool_use", {"type": "tool_use", "id": _tool_id(e.id),
                                               "name": e.name, "input": {}})
        elif e.kind == "arguments" and self.kind == "tool_use" and e.index == self.call:
            yield {"type": "content_block_delta", "index": self.index,
                   "delta": {"type": "input_json_delta", "partial_json": e.text}}


def count_tokens(llm, parsed: Mapped[MessagesRequest]) -> dict:
    """``/v1/messages/count_tokens``: the prompt's tokens."""
    params = parsed.params
    tools = params.tool_dicts() if params.tool_choice != "none" else []
    prompt = render_chat(llm, with_default_system(llm.entry, params.template_messages()),
                         tools=tools or None)
    return {"input_tokens": len(prompt.ids)}


def register(app, api) -> None:
    """Add ``/v1/messages`` and ``/v1/messages/count_tokens`` to ``app``."""

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await api.answer(request, "/v1/messages", parse_messages, create_message,
                                ANTHROPIC)

    @app.post("/v1/messages/count_tokens")
    async def count(request: Request):
        return await api.quick(request, "/v1/messages/count_tokens",
                               lambda b: parse_messages(b, CountRequest), count_tokens, ANTHROPIC)


__all__ = ["ANTHROPIC", "AnthropicStyle", "create_message", "parse_messages", "register",
           "to_chat"]
