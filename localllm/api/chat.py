"""Chat turns: a conversation rendered with its template, generated with its reasoning and
tool calls separated, and shaped as OpenAI's ``ChatCompletion``.

:func:`render_chat` renders messages (and tools) with the model's chat template and reads
its reply format (:func:`localllm.chat.replies.chat_format`): reasoning markers, whether the
generation prompt opened a thinking block, the tool-call syntax. :func:`prepare_chat` turns
a checked request (:class:`~localllm.api.schema.ChatParams`) into a :class:`ChatTurn`: the
:class:`~localllm.api.core.GenerationRequest` (its constraint applies after the reasoning,
:mod:`localllm.grammar.lazy`; ``tool_choice="auto"`` gets the family's lazy call grammar,
:mod:`localllm.grammar.toolcalls`) and how to read the reply (:meth:`ChatTurn.events`).
:func:`create_chat_completion` shapes the events as OpenAI's dicts; the Anthropic Messages and
OpenAI Responses endpoints of the server shape the same events their way.

Request fields, as llama-server takes them: ``reasoning_format`` (``none`` | ``deepseek`` |
``auto``), ``reasoning_budget_tokens`` (also ``thinking_budget_tokens``; -1 no limit, 0 no
thinking where the template allows), ``chat_template_kwargs`` (template variables:
``enable_thinking`` ...), OpenAI's ``reasoning_effort`` (passed to the template, harmony's
``reasoning_effort``; ``"none"`` disables thinking), ``parallel_tool_calls`` (default true).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..chat.events import Event, ReplyMessage
from ..chat.reasoning import generation_prompt, opens_thinking, single_token, thinking_control
from ..chat.replies import ChatFormat, ReplyParser, chat_format
from ..errors import LocalLLMError, ParameterError
from ..grammar.lazy import Thinking
from ..runtime.generate import Step
from .completions import (
    _budget,
    _include_usage,
    _overrides,
    _response_constraint,
    _token_logprob,
    finish_reason,
    timings_dict,
)
from .schema import ChatParams, TextFormat

if TYPE_CHECKING:  # core imports this module in LLM.create_chat_completion
    from .core import LLM, Generation, GenerationRequest


@dataclass
class ChatPrompt:
    """A rendered chat prompt and what its template tells about the reply.

    Attributes:
        ids: the prompt's token ids.
        text: the rendered prompt.
        fmt: the reply format (:class:`~localllm.chat.replies.ChatFormat`).
        inside: the generation prompt left a thinking block open.
        template_name: the template's name (for messages).
    """

    ids: list[int]
    text: str
    fmt: ChatFormat
    inside: bool
    template_name: str


def render_chat(llm: LLM, messages: list[dict], *, template: Any = None,
                tools: list[dict] | None = None, variables: dict | None = None,
                files: bool = False) -> ChatPrompt:
    """Render ``messages`` with the model's chat template (``template``: as
    ``--chat-template``; ``files``: it may name a file) and read its reply format.

    Args:
        tools: OpenAI function tools: rendered by the template when it knows tools, else
            described in the system message (our fenced ``tool_call`` fallback).
        variables: more template variables (``chat_template_kwargs``: ``enable_thinking``,
            ``reasoning_effort`` ...).
    Raises:
        TemplateError: the template failed. LocalLLMError: it rendered nothing.
    """
    from ..chat.template import template_for
    from ..chat.tools import fallback_messages, template_knows_tools
    from ..chat.tools import template_messages as for_template

    chosen = template_for(llm, template if template is not None else llm.chat_template,
                          files=files)
    msgs = for_template(messages)
    native = bool(tools) and template_knows_tools(chosen.source)
    if tools and not native:
        msgs = fallback_messages(msgs, tools)
    fmt = chat_format(chosen.source, native_tools=native or not tools)
    if fmt.harmony:
        msgs = [_harmony_message(m) for m in msgs]
    variables = dict(variables or {})
    text = chosen.render(msgs, True, tools if native else None, **variables)
    inside = False
    if fmt.thinking is not None and not fmt.harmony:
        bare = chosen.render(msgs, False, tools if native else None, **variables)
        inside = opens_thinking(generation_prompt(text, bare), fmt.thinking)
    ids = chosen.tokenize(llm.tokenizer, text)
    if not ids:
        raise LocalLLMError("the chat template rendered an empty prompt")
    return ChatPrompt(ids, text, fmt, inside, chosen.name)


def _harmony_message(m: dict) -> dict:
    """gpt-oss's template reads an earlier reply's reasoning as ``thinking``; beside tool
    calls it is the one analysis message, so the content goes (llama.cpp's
    ``common_chat_params_init_gpt_oss`` does the same)."""
    if not m.get("reasoning_content"):
        return m
    m = {**m, "thinking": m["reasoning_content"]}
    if m.get("tool_calls"):
        m.pop("content", None)
    return m


def with_default_system(entry, messages: list[dict]) -> list[dict]:
    """``messages`` with the model's default system prompt (models.toml ``system``, Ollama's
    ``SYSTEM``; ``entry``: a :class:`~localllm.registry.ModelEntry` or None) first when none
    of them is a system or developer message, as Ollama does."""
    system = entry.system if entry is not None else None
    if not system or any(m.get("role") in ("system", "developer") for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def thinking_spec(llm: LLM, prompt: ChatPrompt, budget: int = -1, *,
                  call: bool = False) -> Thinking | None:
    """How the reply's reasoning is run (:func:`localllm.chat.reasoning.thinking_control` on
    the rendered prompt), or None when the template has no reasoning markers."""
    return thinking_control(llm.tokenizer, prompt.fmt, prompt.inside, budget, call=call)


@dataclass
class ChatTurn:
    """A prepared chat generation and how to read its reply.

    Attributes:
        request: the generation (:meth:`LLM.stream` runs it).
        prompt: the rendered prompt.
        tools: the tools whose calls are read from the reply ([]: none are).
        reasoning: reasoning is separated (``reasoning_format`` other than ``none``).
        parallel: several calls may be read.
    """

    request: GenerationRequest
    prompt: ChatPrompt
    tools: list[dict] = field(default_factory=list)
    reasoning: bool = True
    parallel: bool = True

    def parser(self) -> ReplyParser:
        return ReplyParser(self.prompt.fmt, reasoning=self.reasoning, inside=self.prompt.inside,
                           tools=self.tools or None, parallel=self.parallel)


def chat_variables(llm: LLM, body: ChatParams) -> tuple[dict, int, str]:
    """The template variables, reasoning budget and reasoning format of a request, over the
    LLM's defaults (the CLI's ``--chat-template-kwargs``, ``--reasoning-budget``,
    ``--reasoning-format``)."""
    variables = dict(llm.chat_template_kwargs)
    variables.update(body.chat_template_kwargs or {})
    budget = body.reasoning_budget_tokens
    if budget is None:
        budget = llm.reasoning_budget
    effort = body.reasoning_effort
    if effort == "none":
        variables.setdefault("enable_thinking", False)
    elif effort is not None:
        variables["reasoning_effort"] = effort
    if budget == 0:  # no thinking, where the template can switch it off
        variables.setdefault("enable_thinking", False)
    if "enable_thinking" in variables and not isinstance(variables["enable_thinking"], bool):
        raise ParameterError("chat_template_kwargs.enable_thinking must be true or false")
    return variables, budget, body.reasoning_format or llm.reasoning_format


def prepare_chat(llm: LLM, body: ChatParams, *, n_predict: int = -1,
                 time_limit: float | None = None,
                 cancel: threading.Event | None = None) -> ChatTurn:
    """Render, check and prepare a chat request (see the module docstring).

    Raises:
        ParameterError: tools and ``tool_choice`` that do not fit together, a bad template
            variable. TemplateError: the chat template is unknown or failed.
        ContextOverflowError, GrammarError: see :meth:`LLM.prepare`.
    """
    from ..chat.tools import forced_tool_schema
    from ..grammar.constraint import GrammarConstraint
    from ..grammar.toolcalls import tool_call_constraint

    tools = body.tool_dicts()
    choice = body.tool_choice
    if choice is not None and not isinstance(choice, str):
        choice = choice.model_dump()
    if choice not in (None, "none") and not tools:
        raise ParameterError("tool_choice needs tools")
    use_tools = bool(tools) and choice != "none"
    parallel = body.parallel_tool_calls is not False
    variables, budget, reasoning_format = chat_variables(llm, body)
    prompt = render_chat(llm, with_default_system(llm.entry, body.template_messages()),
                         template=body.chat_template,
                         tools=tools if use_tools else None, variables=variables)
    fmt = prompt.fmt
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = llm.sampling_params(**_overrides(body, (body.top_logprobs or 0)
                                              if body.logprobs else 0))
    forced = forced_tool_schema(tools, choice) if use_tools else None
    required = True
    if forced is not None:
        if not isinstance(body.response_format, (TextFormat, type(None))) or body.grammar:
            raise ParameterError("tool_choice that forces a call cannot be combined with "
                                 "response_format or grammar")
        if fmt.harmony:  # harmony's calls are channels: its call grammar, not a bare object
            lazy = tool_call_constraint(llm.tokenizer, _named(tools, choice), "harmony",
                                        parallel=False)
            constraint = lazy.inner if lazy is not None else None
        else:
            constraint = GrammarConstraint.from_json_schema(forced, llm.tokenizer,
                                                            source="tool_choice")
    else:
        constraint = _response_constraint(llm, body.response_format, body.grammar)
        if constraint is None and use_tools:
            constraint = tool_call_constraint(llm.tokenizer, tools, fmt.tool_syntax,
                                              parallel=parallel)
            required = False
    thinking = thinking_spec(llm, prompt, budget, call=forced is not None)
    if thinking is not None and budget < 0 and (constraint is None or fmt.harmony
                                                 and not required):
        # Nothing to run after the reasoning and no budget: no control at all (harmony's
        # lazy call grammar triggers on its own, in any message).
        thinking = None
    preserved = [t for text in fmt.preserved if (t := single_token(llm.tokenizer, text))
                 is not None]
    request = llm.prepare(prompt.ids, params=params, n_predict=_budget(max_tokens, n_predict),
                          stop=body.stops(), constraint=constraint,
                          cache_prompt=body.cache_prompt, time_limit=time_limit, cancel=cancel,
                          thinking=thinking, answer_required=required, preserved=preserved)
    return ChatTurn(request, prompt, tools if use_tools else [],
                    reasoning=reasoning_format != "none", parallel=parallel)


def _named(tools: list[dict], choice: Any) -> list[dict]:
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        return [t for t in tools if t["function"]["name"] == name]
    return tools


# ---- running a turn ------------------------------------------------------------------------------
class TurnRun:
    """The steps of a turn's generation with the events each produced.

    Iterate for ``(step, events)``; afterwards ``message`` holds the reply,
    ``reasoning_tokens`` the tokens generated inside the reasoning and ``count`` all tokens.
    """

    def __init__(self, llm: LLM, turn: ChatTurn) -> None:
        self.llm = llm
        self.turn = turn
        self.gen: Generation = llm.stream(turn.request)
        self.parser = turn.parser()
        self.message = ReplyMessage()
        self.count = 0
        self.reasoning_tokens = 0
        self.finish: str | None = None

    def __iter__(self) -> Iterator[tuple[Step, list[Event]]]:
        with self.gen:
            for step in self.gen:
                if step.token >= 0:
                    self.count += 1
                before = self.parser.thinking
                events = self.parser.push(step.text) if step.text else []
                if step.finish_reason:
                    events += self.parser.finish()
                    self.finish = step.finish_reason
                if step.token >= 0 and (before or any(e.kind == "reasoning" for e in events)):
                    self.reasoning_tokens += 1
                for event in events:
                    self.message.add(event)
                yield step, events
        if self.finish is None:  # cancelled
            for event in self.parser.finish():
                self.message.add(event)
            self.finish = self.gen.finish_reason

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish reason: ``tool_calls`` when the reply holds calls."""
        if self.message.calls:
            return "tool_calls"
        return finish_reason(self.finish)

    def usage(self) -> dict:
        n = len(self.turn.request.ids)
        return {"prompt_tokens": n, "completion_tokens": self.count,
                "total_tokens": n + self.count,
                "prompt_tokens_details": {"cached_tokens": self.gen.timings.reused_tokens},
                "completion_tokens_details": {"reasoning_tokens": self.reasoning_tokens}}


# ---- OpenAI's shape ------------------------------------------------------------------------------
def create_chat_completion(llm: LLM, body: ChatParams, *, n_predict: int = -1,
                           time_limit: float | None = None,
                           cancel: threading.Event | None = None) -> dict | Iterator[dict]:
    """A chat reply, shaped as OpenAI's ``ChatCompletion`` (``ChatCompletionChunk`` dicts when
    ``body.stream``).

    Args:
        body: the request (see :class:`~localllm.api.schema.ChatParams`): ``messages``
            (``role`` system / developer / user / assistant / tool; ``content`` text or text
            parts; assistant ``tool_calls`` and ``reasoning_content``; tool
            ``tool_call_id``), rendered with the model's chat template (``chat_template``: a
            built-in name, a metadata variant or Jinja text; never a file);
            ``max_tokens`` / ``max_completion_tokens`` (the reasoning counts); ``tools``:
            OpenAI function tools, rendered through the template (or described in the system
            message when it knows nothing of tools); the calls the model writes in its
            family's format come back as ``message.tool_calls`` with finish_reason
            "tool_calls" (streamed as ``delta.tool_calls`` pieces, ids stable);
            ``tool_choice``: "auto" (default with tools: free text until the model opens a
            call, then the call follows the tool's schema), "none", "required" or
            ``{"type": "function", "function": {"name": N}}`` (the reply, after any
            reasoning, is a call whose arguments follow the tool's ``parameters`` schema);
            the reasoning fields of the module docstring; ``logprobs`` / ``top_logprobs``;
            the rest as in :func:`~localllm.api.completions.create_completion`.
        n_predict, time_limit, cancel: see :func:`~localllm.api.completions.create_completion`.
    Returns:
        ``{"id", "object": "chat.completion", "created", "model", "choices": [{"index",
        "message": {"role": "assistant", "content", "reasoning_content"?, "tool_calls"?},
        "logprobs", "finish_reason"}], "usage", "timings"}``.
    Raises:
        see :func:`prepare_chat`.
    """
    turn = prepare_chat(llm, body, n_predict=n_predict, time_limit=time_limit, cancel=cancel)
    head = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()),
            "model": llm.model_name}
    run = TurnRun(llm, turn)
    if body.stream:
        return _chunks(llm, run, head, bool(body.logprobs), _include_usage(body))
    return _completion(llm, run, head, bool(body.logprobs))


def message_dict(message: ReplyMessage) -> dict:
    """OpenAI's assistant message of a reply (content None when it is only calls)."""
    out: dict[str, Any] = {"role": "assistant",
                           "content": (message.text or None) if message.calls else message.text}
    if message.calls:
        out["tool_calls"] = message.calls
    if message.reasoning:
        out["reasoning_content"] = message.reasoning
    return out


def _completion(llm: LLM, run: TurnRun, head: dict, logprobs: bool) -> dict:
    content_lps = []
    for step, _ in run:
        if logprobs and step.token >= 0:
            content_lps.append(_token_logprob(llm.tokenizer, step))
    return {**head, "object": "chat.completion",
            "choices": [{"index": 0, "message": message_dict(run.message),
                         "logprobs": {"content": content_lps, "refusal": None}
                         if logprobs else None,
                         "finish_reason": run.finish_reason}],
            "usage": run.usage(), "timings": timings_dict(run.gen.timings)}


def _chunks(llm: LLM, run: TurnRun, head: dict, logprobs: bool,
            usage_chunk: bool) -> Iterator[dict]:
    def chunk(delta: dict, finish=None, lps=None) -> dict:
        return {**head, "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": lps,
                             "finish_reason": finish}]}

    yield chunk({"role": "assistant", "content": ""})
    held: list[dict] = []  # log-probabilities of steps whose text is not out yet
    for step, events in run:
        if logprobs and step.token >= 0:
            held.append(_token_logprob(llm.tokenizer, step))
        for delta in _deltas(events):
            lps = None
            if logprobs:
                lps, held = {"content": held, "refusal": None}, []
            yield chunk(delta, lps=lps)
    tail = {"usage": run.usage(), "timings": timings_dict(run.gen.timings)}
    yield {**chunk({}, run.finish_reason,
                   {"content": held, "refusal": None} if logprobs and held else None), **tail}
    if usage_chunk:
        yield {**head, "object": "chat.completion.chunk", "choices": [], **tail}


def _deltas(events: list[Event]) -> Iterator[dict]:
    """OpenAI chunk deltas of events (consecutive texts of one kind merged)."""
    text_kind, text = None, ""
    for e in events:
        if e.kind in ("content", "reasoning"):
            if text_kind not in (None, e.kind):
                yield {_FIELD[text_kind]: text}
                text = ""
            text_kind = e.kind
            text += e.text
            continue
        if text:
            yield {_FIELD[text_kind]: text}
            text_kind, text = None, ""
        if e.kind == "call":
            yield {"tool_calls": [{"index": e.index, "id": e.id, "type": "function",
                                   "function": {"name": e.name, "arguments": ""}}]}
        elif e.kind == "arguments":
            yield {"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]}
    if text:
        yield {_FIELD[text_kind]: text}


_FIELD = {"content": "content", "reasoning": "reasoning_content"}

__all__ = ["ChatPrompt", "ChatTurn", "TurnRun", "create_chat_completion", "message_dict",
           "prepare_chat", "render_chat", "thinking_spec"]
