"""The OpenAI-shaped layer: text completions over :class:`~localllm.api.core.LLM`, and the
helpers chat completions (:mod:`localllm.api.chat`) share with them.

:func:`create_completion` takes validated parameters
(:class:`~localllm.api.schema.CompletionParams`: OpenAI's and llama-server's names), turns
them into one :class:`~localllm.api.core.GenerationRequest` with :meth:`LLM.prepare`
(``response_format`` and ``grammar`` are resolved here) and shapes the steps of the
:class:`~localllm.api.core.Generation` as the dicts of OpenAI's API: they validate as the
``openai`` package's ``Completion``. Each result carries its own ``usage`` and llama-server's
``timings`` (the last chunk of a stream does). ``LLM.create_completion`` and the server call
it.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from ..errors import ParameterError
from ..runtime.generate import Step, Timings
from .schema import ChatParams, CompletionParams, JsonObjectFormat, JsonSchemaFormat, TextFormat

if TYPE_CHECKING:  # core imports this module in LLM.create_completion
    from .core import LLM, Generation

_FINISH = {"eog": "stop", "stop": "stop", "grammar": "stop", "length": "length", "ctx": "length",
           "cancelled": "stop"}


def create_completion(llm: LLM, body: CompletionParams, *, n_predict: int = -1,
                      time_limit: float | None = None,
                      cancel: threading.Event | None = None) -> dict | Iterator[dict]:
    """A text completion, shaped as OpenAI's ``Completion`` (``CompletionChunk`` dicts when
    ``body.stream``).

    Args:
        body: the request (see :class:`~localllm.api.schema.CompletionParams`): ``prompt``
            (text, tokenized with BOS, or token ids); ``max_tokens`` (None: until end of
            generation or a full context; finish_reason "length" when reached); sampling by
            OpenAI / llama-server names (None: the model's defaults from models.toml, else
            llama.cpp's); ``stop``; ``logprobs`` N (the chosen token's log-probability and the
            N most likely alternatives, raw model distribution); ``echo``;
            ``response_format`` (``json_object`` / ``json_schema``: constrained decoding that
            finishes the value before ``max_tokens`` runs out); ``grammar`` (GBNF text);
            ``cache_prompt`` (reuse the longest common token prefix of the previous call's KV
            cache, llama-server's name).
        n_predict: a cap on ``max_tokens`` (-1: none; the server's ``--n-predict``).
        time_limit: seconds the generation may run (:class:`GenerationTimeout` after).
        cancel: set to end the generation early (a client that left).
    Returns:
        ``{"id", "object": "text_completion", "created", "model", "choices": [{"text",
        "index", "logprobs", "finish_reason"}], "usage", "timings"}``; finish_reason "stop"
        (end of generation, a stop string, the grammar completed) or "length".
    Raises:
        ParameterError, ContextOverflowError, GrammarError: see :meth:`LLM.prepare`.
    """
    params = llm.sampling_params(**_overrides(body, body.logprobs or 0))
    request = llm.prepare(body.prompt, params=params,
                          n_predict=_budget(body.max_tokens, n_predict), stop=body.stops(),
                          constraint=_response_constraint(llm, body.response_format, body.grammar),
                          cache_prompt=body.cache_prompt, time_limit=time_limit, cancel=cancel)
    gen = llm.stream(request)
    head = {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time()),
            "model": llm.model_name}
    prefix = ""
    if body.echo:
        prefix = body.prompt if isinstance(body.prompt, str) else llm.detokenize(request.ids)
    shape = _Shape(llm, gen, head)
    want = body.logprobs is not None
    if body.stream:
        return shape.completion_chunks(prefix, want, _include_usage(body))
    return shape.completion(prefix, want)


# ---- parameters -----------------------------------------------------------------------------
def _overrides(body: CompletionParams | ChatParams, top_logprobs: int) -> dict[str, Any]:
    out = body.sampling_overrides()
    if top_logprobs:
        out["n_probs"] = top_logprobs
    return out


def _budget(max_tokens: int | None, cap: int) -> int:
    """``max_tokens`` under the cap (-1: none): the tokens to generate, -1 for no limit."""
    n = -1 if max_tokens is None else max_tokens
    if cap >= 0:
        n = cap if n < 0 else min(n, cap)
    return n


def _include_usage(body: CompletionParams | ChatParams) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _response_constraint(llm: LLM, response_format: Any, grammar: str | None):
    """The constraint of ``grammar`` (GBNF text) or ``response_format``, or None."""
    from ..grammar.budget import strict_schema
    from ..grammar.constraint import GrammarConstraint

    if grammar is not None and not isinstance(response_format, (TextFormat, type(None))):
        raise ParameterError("grammar and response_format cannot be used together")
    if grammar is not None:
        return GrammarConstraint.from_gbnf(grammar, llm.tokenizer, source="grammar")
    if isinstance(response_format, JsonObjectFormat):
        schema = response_format.schema_ or {"type": "object"}
    elif isinstance(response_format, JsonSchemaFormat):
        spec = response_format.json_schema
        schema = spec.schema_ if spec.schema_ is not None else {}
        if spec.strict:
            schema = strict_schema(schema)
    else:
        return None
    return GrammarConstraint.from_json_schema(schema, llm.tokenizer, source="response_format")


# ---- results ---------------------------------------------------------------------------------
def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reason for a step's: "stop" or "length" (None while running)."""
    return _FINISH.get(reason, "stop") if reason else None


def timings_dict(t: Timings) -> dict:
    """llama-server's ``timings`` object of one generation (milliseconds, tokens)."""
    prompt_ms, predicted_ms = t.prompt_seconds * 1e3, t.generate_seconds * 1e3
    return {"cache_n": t.reused_tokens, "prompt_n": t.prompt_tokens, "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / t.prompt_tokens if t.prompt_tokens else 0.0,
            "prompt_per_second": t.prompt_tokens / t.prompt_seconds if t.prompt_seconds else 0.0,
            "predicted_n": t.generated_tokens, "predicted_ms": predicted_ms,
            "predicted_per_token_ms": (predicted_ms / t.generated_tokens
                                       if t.generated_tokens else 0.0),
            "predicted_per_second": (t.generated_tokens / t.generate_seconds
                                     if t.generate_seconds else 0.0)}


class _Shape:
    """OpenAI's dicts from the steps of one generation."""

    def __init__(self, llm: LLM, gen: Generation, head: dict) -> None:
        self.tokenizer = llm.tokenizer
        self.gen = gen
        self.head = head
        self.count = 0  # tokens generated

    def steps(self) -> Iterator[Step]:
        with self.gen:
            for step in self.gen:
                self.count += step.token >= 0
                yield step

    def usage(self) -> dict:
        n = len(self.gen.request.ids)
        return {"prompt_tokens": n, "completion_tokens": self.count,
                "total_tokens": n + self.count,
                "prompt_tokens_details": {"cached_tokens": self.gen.timings.reused_tokens}}

    def tail(self) -> dict:
        return {"usage": self.usage(), "timings": timings_dict(self.gen.timings)}

    # -- /v1/completions ---------------------------------------------------------------------
    def completion(self, prefix: str, want: bool) -> dict:
        text, lps, finish = [prefix], _CompletionLogprobs(len(prefix)), None
        for step in self.steps():
            text.append(step.text)
            if want and step.token >= 0:
                lps.add(self.tokenizer, step)
            finish = step.finish_reason or finish
        return {**self.head, "object": "text_completion",
                "choices": [{"text": "".join(text), "index": 0,
                             "logprobs": lps.as_dict() if want else None,
                             "finish_reason": finish_reason(finish)}], **self.tail()}

    def completion_chunks(self, prefix: str, want: bool, usage_chunk: bool) -> Iterator[dict]:
        lps = _CompletionLogprobs(len(prefix))
        first = True
        for step in self.steps():
            piece = (prefix if first else "") + step.text
            first = False
            entry = None
            if want and step.token >= 0:
                entry = _CompletionLogprobs(lps.offset)
                entry.add(self.tokenizer, step)
                lps.offset = entry.offset
            chunk = {**self.head, "object": "text_completion",
                     "choices": [{"text": piece, "index": 0,
                                  "logprobs": entry.as_dict() if entry else None,
                                  "finish_reason": finish_reason(step.finish_reason)}]}
            if step.finish_reason:
                chunk.update(self.tail())
            yield chunk
        if usage_chunk:
            yield {**self.head, "object": "text_completion", "choices": [], **self.tail()}


def _token_text(tokenizer, token: int) -> tuple[str, list[int]]:
    data = tokenizer.token_bytes(token)
    return data.decode("utf-8", errors="replace"), list(data)


def _token_logprob(tokenizer, step: Step) -> dict:
    def entry(token: int, logprob: float) -> dict:
        text, data = _token_text(tokenizer, token)
        return {"token": text, "logprob": logprob, "bytes": data}

    trace = step.trace
    top = [entry(t, lp) for t, lp in trace.top] if trace is not None else []
    return {**entry(step.token, step.logprob), "top_logprobs": top}


class _CompletionLogprobs:
    """The legacy completions ``logprobs`` object: tokens, their log-probabilities, the top
    alternatives per position and each token's character offset in the text."""

    def __init__(self, offset: int) -> None:
        self.offset = offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float] = []
        self.top: list[dict] = []
        self.offsets: list[int] = []

    def add(self, tokenizer, step: Step) -> None:
        text = _token_text(tokenizer, step.token)[0]
        self.tokens.append(text)
        self.token_logprobs.append(step.logprob)
        trace = step.trace
        self.top.append({_token_text(tokenizer, t)[0]: lp
                         for t, lp in (trace.top if trace is not None else [])})
        self.offsets.append(self.offset)
        self.offset += len(text)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top, "text_offset": self.offsets}
