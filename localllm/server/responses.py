"""OpenAI's Responses API, stateless: ``POST /v1/responses``.

The shapes follow OpenAI's API reference ("Responses"): ``input`` (text, or items: messages
with ``input_text`` / ``output_text`` parts, ``function_call``, ``function_call_output``,
``reasoning``), ``instructions``, function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``max_output_tokens``, ``reasoning.effort``, ``text.format``
(``json_schema`` / ``json_object``); the reply's ``output`` items (``reasoning``,
``message``, ``function_call``) and ``usage``; streams as ``response.created`` ...
``response.output_text.delta`` ... ``response.function_call_arguments.delta`` ...
``response.completed`` events with their ``sequence_number``. A request is mapped onto an
OpenAI-shaped :class:`~localllm.api.schema.ChatParams` and runs as the same chat turn
(:mod:`localllm.api.chat`).

Stateless: nothing is stored, so ``previous_response_id`` (and ``conversation``) is refused
with a 400 (send the whole ``input``, as Codex does with ``store: false``). Refused with a 400
naming the item: item or part types other than those above (images and files until the models
read them), a ``function_call_output`` whose ``call_id`` names no earlier ``function_call``,
tools other than functions.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any, Literal

from fastapi import Request
from pydantic import Field

from ..api.chat import TurnRun
from ..api.completions import timings_dict
from ..api.schema import InvalidRequest
from ..chat.events import Event
from .mapped import Lenient, Mapped, MappedRequest, parse_mapped, run_mapped, texts_of
from .protocol import OPENAI, Style, dumps


class ResponsesStyle(Style):
    """Responses' stream events: ``event: TYPE`` and the event object, no ``[DONE]``."""

    done = None

    def event(self, item: Any) -> dict:
        return {"event": item["type"], "data": dumps(item)}

    def tally(self, item: Any) -> tuple[dict, int, int] | None:
        response = item.get("response") if isinstance(item, dict) and \
            item.get("type") == "response.completed" else item
        if isinstance(response, dict) and "timings" in response and response.get("usage"):
            usage = response["usage"]
            return response["timings"], usage["input_tokens"], usage["output_tokens"]
        return None

    def error(self, f) -> dict:
        return OPENAI.error(f)


RESPONSES = ResponsesStyle()


class Reasoning(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None


class ResponsesRequest(MappedRequest):
    """The fields of ``POST /v1/responses`` read here (items are checked by hand, so that an
    error names the item)."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    reasoning: Reasoning | None = None
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    conversation: Any = None


def _unsupported(kind: Any, where: str) -> InvalidRequest:
    if kind in ("input_image", "input_file", "input_audio"):
        return InvalidRequest(f"{where}: {kind} parts are not supported: this server's models "
                              "read text only", where)
    return InvalidRequest(f"{where}: unknown content part type {kind!r} (known: input_text, "
                          "output_text)", where)


def _parts_text(content: Any, where: str) -> str:
    """Text of a string or of text parts (a message's content, a call's output)."""
    return "".join(texts_of(content, where, ("input_text", "output_text", "text"),
                            _unsupported, "content parts"))


def to_chat(req: ResponsesRequest) -> dict:
    """The OpenAI-shaped chat request of a Responses request.

    Raises:
        InvalidRequest: a stored-state field, an unknown or unsupported item, a call output
            that answers no call (each named by its path).
    """
    if req.previous_response_id is not None or req.conversation is not None:
        which = "previous_response_id" if req.previous_response_id is not None \
            else "conversation"
        raise InvalidRequest(f"{which}: this server stores no responses; send the whole "
                             "conversation in input", which)
    messages: list[dict] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    items = [{"role": "user", "content": req.input}] if isinstance(req.input, str) else req.input
    calls: set[str] = set()
    reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise InvalidRequest(f"{where}.role: must be user, assistant, system or "
                                     "developer", f"{where}.role")
            text = _parts_text(item.get("content", ""), f"{where}.content")
            if role == "assistant" and messages and messages[-1]["role"] == "assistant" \
                    and messages[-1].get("tool_calls") and not messages[-1]["content"]:
                messages[-1]["content"] = text
            else:
                messages.append({"role": role, "content": text})
            if role == "assistant" and reasoning:
                messages[-1]["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
        elif kind == "function_call":
            name, call_id = item.get("name"), item.get("call_id")
            args = item.get("arguments", "{}")
            if not isinstance(name, str) or not isinstance(call_id, str) \
                    or not isinstance(args, str):
                raise InvalidRequest(f"{where}: a function_call needs string name, call_id "
                                     "and arguments", where)
            call = {"id": call_id, "type": "function",
                    "function": {"name": name, "arguments": args}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
                if reasoning:
                    messages[-1]["reasoning_content"] = "\n".join(reasoning)
                    reasoning = []
            calls.add(call_id)
        elif kind == "function_call_output":
            call_id = item.get("call_id")
            if call_id not in calls:
                raise InvalidRequest(f"{where}.call_id: {call_id!r} answers no function_call "
                                     "before it", f"{where}.call_id")
            output = item.get("output", "")
            text = output if isinstance(output, str) else _parts_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": call_id, "content": text})
        elif kind == "reasoning":
            parts = [p.get("text", "") for p in (item.get("content") or item.get("summary") or [])
                     if isinstance(p, dict)]
            reasoning.append("\n".join(p for p in parts if isinstance(p, str)))
        else:
            raise InvalidRequest(f"{where}.type: unknown input item type {kind!r} (known: "
                                 "message, function_call, function_call_output, reasoning)",
                                 f"{where}.type")
    body: dict[str, Any] = {"messages": messages, "stream": req.stream}
    if req.max_output_tokens is not None:
        body["max_tokens"] = req.max_output_tokens
    for key in ("temperature", "top_p", "parallel_tool_calls"):
        if getattr(req, key) is not None:
            body[key] = getattr(req, key)
    if req.tools:
        body["tools"] = [_tool(t, i) for i, t in enumerate(req.tools)]
    if req.tool_choice is not None:
        choice = req.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise InvalidRequest("tool_choice: must be 'auto', 'none', 'required' or "
                                     '{"type": "function", "name": ...}', "tool_choice")
            choice = {"type": "function", "function": {"name": choice["name"]}}
        body["tool_choice"] = choice
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    fmt = (req.text or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        body["response_format"] = {"type": "json_schema", "json_schema": {
            k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
    elif isinstance(fmt, dict) and fmt.get("type") == "json_object":
        body["response_format"] = {"type": "json_object"}
    return body


def _tool(tool: dict, i: int) -> dict:
    if tool.get("type") != "function":
        raise InvalidRequest(f"tools[{i}].type: {tool.get('type')!r} tools are not available "
                             "here (function tools only)", f"tools[{i}].type")
    fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool
          and tool[k] is not None}
    return {"type": "function", "function": fn}


def parse_responses(body: bytes) -> Mapped[ResponsesRequest]:
    """A Responses request and the chat parameters it maps to.

    Raises:
        InvalidRequest: see :func:`to_chat` and :func:`~localllm.server.mapped.parse_mapped`.
    """
    return parse_mapped(body, ResponsesRequest, to_chat)


# ---- the reply ---------------------------------------------------------------------------------
def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def create_response(llm, parsed: Mapped[ResponsesRequest], **limits: Any
                    ) -> dict | Iterator[dict]:
    """Run a Responses request: the ``response`` object, or its stream events (``limits``: see
    :func:`~localllm.server.mapped.run_mapped`)."""
    req = parsed.req
    shell = {"id": _new_id("resp"), "object": "response", "created_at": int(time.time()),
             "model": req.model or llm.model_name, "status": "in_progress", "output": [],
             "parallel_tool_calls": req.parallel_tool_calls is not False,
             "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
             "tools": req.tools or [], "instructions": req.instructions, "error": None,
             "incomplete_details": None, "metadata": {}, "temperature": req.temperature,
             "top_p": req.top_p, "max_output_tokens": req.max_output_tokens, "usage": None}
    return run_mapped(llm, parsed, shell, _events, _response, **limits)


def _response(run: TurnRun, shell: dict) -> dict:
    message = run.message
    output: list[dict] = []
    if message.reasoning:
        output.append({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                       "content": [{"type": "reasoning_text", "text": message.reasoning}]})
    text = message.text
    if text:
        output.append({"type": "message", "id": _new_id("msg"), "status": "completed",
                       "role": "assistant",
                       "content": [{"type": "output_text", "text": text, "annotations": []}]})
    for call in message.calls:
        output.append({"type": "function_call", "id": _new_id("fc"), "call_id": call["id"],
                       "name": call["function"]["name"],
                       "arguments": call["function"]["arguments"], "status": "completed"})
    return _finished(run, shell, output)


def _finished(run: TurnRun, shell: dict, output: list[dict]) -> dict:
    usage = run.usage()
    incomplete = run.finish in ("length", "ctx") and not run.message.calls
    return {**shell, "status": "incomplete" if incomplete else "completed", "output": output,
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "output_tokens": usage["completion_tokens"],
                      "total_tokens": usage["total_tokens"],
                      "input_tokens_details": {"cached_tokens":
                                               usage["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens_details": {"reasoning_tokens": run.reasoning_tokens}},
            "timings": timings_dict(run.gen.timings)}


def _events(run: TurnRun, shell: dict) -> Iterator[dict]:
    seq = iter(range(1 << 62))
    yield {"type": "response.created", "sequence_number": next(seq), "response": shell}
    yield {"type": "response.in_progress", "sequence_number": next(seq), "response": shell}
    items = _Items()
    for _, events in run:
        for event in events:
            for e in items.add(event):
                yield {**e, "sequence_number": next(seq)}
    for e in items.close():
        yield {**e, "sequence_number": next(seq)}
    # A reply cut by max_output_tokens ends with "response.completed" too, its status
    # "incomplete": the openai package's stream helper knows no "response.incomplete".
    final = _finished(run, shell, items.output)
    yield {"type": "response.completed", "sequence_number": next(seq), "response": final}


class _Items:
    """Output items opened and closed as the reply's events stream (``output`` holds them;
    a call found not to be one after its start stays, as its events are out)."""

    def __init__(self) -> None:
        self.output: list[dict] = []
        self.open: dict | None = None

    def _start(self, item: dict) -> Iterator[dict]:
        yield from self.close()
        self.output.append(item)
        self.open = item
        yield {"type": "response.output_item.added", "output_index": len(self.output) - 1,
               "item": {**item, "status": "in_progress"} if "status" in item else item}
        if item["type"] == "message":
            yield {"type": "response.content_part.added", "item_id": item["id"],
                   "output_index": len(self.output) - 1, "content_index": 0,
                   "part": {"type": "output_text", "text": "", "annotations": []}}

    def close(self) -> Iterator[dict]:
        item, self.open = self.open, None
        if item is None:
            return
        index = self.output.index(item)
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            yield {"type": "response.reasoning_text.done", "item_id": item["id"],
                   "output_index": index, "content_index": 0, "text": text}
        elif item["type"] == "message":
            part = item["content"][0]
            yield {"type": "response.output_text.done", "item_id": item["id"],
                   "output_index": index, "content_index": 0, "text": part["text"],
                   "logprobs": []}
            yield {"type": "response.content_part.done", "item_id": item["id"],
                   "output_index": index, "content_index": 0, "part": part}
        else:
            yield {"type": "response.function_call_arguments.done", "item_id": item["id"],
                   "output_index": index, "arguments": item["arguments"], "name": item["name"]}
        yield {"type": "response.output_item.done", "output_index": index, "item": item}

    def add(self, e: Event) -> Iterator[dict]:
        item = self.open
        if e.kind == "reasoning":
            if item is None or item["type"] != "reasoning":
                yield from self._start({"type": "reasoning", "id": _new_id("rs"), "summary": [],
                                        "content": [{"type": "reasoning_text", "text": ""}]})
                item = self.open
            item["content"][0]["text"] += e.text
            yield {"type": "response.reasoning_text.delta", "item_id": item["id"],
                   "output_index": len(self.output) - 1, "content_index": 0, "delta": e.text}
        elif e.kind in ("content", "drop") and e.text:
            if item is None or item["type"] != "message":
                if not e.text.strip():
                    return
                yield from self._start({"type": "message", "id": _new_id("msg"),
                                        "status": "completed", "role": "assistant",
                                        "content": [{"type": "output_text", "text": "",
                                                     "annotations": []}]})
                item = self.open
            item["content"][0]["text"] += e.text
            yield {"type": "response.output_text.delta", "item_id": item["id"],
                   "output_index": len(self.output) - 1, "content_index": 0, "delta": e.text,
                   "logprobs": []}
        elif e.kind == "call":
            yield from self._start({"type": "function_call", "id": _new_id("fc"),
                                    "call_id": e.id, "name": e.name, "arguments": "",
                                    "status": "completed"})
        elif e.kind == "arguments" and item is not None and item["type"] == "function_call":
            item["arguments"] += e.text
            yield {"type": "response.function_call_arguments.delta", "item_id": item["id"],
                   "output_index": len(self.output) - 1, "delta": e.text}


def register(app, api) -> None:
    """Add ``/v1/responses`` to ``app``."""

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await api.answer(request, "/v1/responses", parse_responses, create_response,
                                RESPONSES)


__all__ = ["RESPONSES", "create_response", "parse_responses", "register", "to_chat"]
