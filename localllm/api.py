"""The Python API shared by the CLI, the REPL, scripting and perplexity.

    >>> from localllm import LLM
    >>> llm = LLM("gemma3-270m")                     # a models.toml name or a .gguf path
    >>> "".join(llm.generate("The capital of France is", n_predict=16, temp=0))
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from .errors import ContextOverflowError, LocalLLMError, ParameterError
from .grammar.budget import BudgetedConstraint, strict_schema
from .registry import ModelEntry, load_registry
from .runtime.generate import Step, Timings, generate_tokens
from .runtime.session import Session, load_model
from .sampling.chain import SamplingParams, build_sampler


class LLM:
    """A loaded model.

    Concurrency: generations on one ``LLM`` may be interleaved (two :meth:`stream`
    generators consumed in turns) or run from several threads. Each generation has its own
    session (KV cache): the shared one when it is free, a fresh one when another generation
    holds it. Forward passes take the model's lock one step at a time, so threads share the
    model in turns rather than in parallel.

    Args:
        model: a name from models.toml, or a path to a .gguf file (default: the registry's
            default model).
        device: "auto" (CUDA when available), "cpu" or "cuda".
        ctx_size: context size of sessions, in tokens (capped at the model's context length;
            0: the model's context length, as llama.cpp's ``-c 0``).
        batch_size: most tokens per forward during prefill.
        verbose: print load progress on stderr when it is a terminal.
        dtype: storage dtype of dequantized weights on the torch backend (float32 for an
            exact evaluation; twice the memory of the float16 default).
    Raises:
        ModelNotFoundError, GGUFError, UnsupportedError: see :func:`load_model`.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        *,
        device: str = "auto",
        ctx_size: int = 4096,
        batch_size: int = 512,
        verbose: bool = False,
        progress: bool | None = None,
        dtype: torch.dtype = torch.float16,
    ) -> None:
        if ctx_size < 0:
            raise ParameterError(f"--ctx-size must be >= 0 (0: the model's), got {ctx_size}")
        if batch_size < 1:
            raise ParameterError(f"--batch-size must be >= 1, got {batch_size}")
        path, entry = load_registry().resolve(model)
        self.path: Path = path
        self.entry: ModelEntry | None = entry
        self.loaded = load_model(path, device=device, progress=progress, ctx_size=ctx_size,
                                 dtype=dtype)
        self.tokenizer = self.loaded.tokenizer
        self.args = self.loaded.args
        self.metadata: dict = self.loaded.gguf.metadata
        self.device = self.loaded.device
        self.ctx_size = min(ctx_size or self.args.context_length, self.args.context_length)
        self.batch_size = batch_size
        self.verbose = verbose
        self.last_timings: Timings | None = None
        self._session: Session | None = None
        self._lock = threading.RLock()  # one generation (or forward) at a time
        self._lock_owner: int | None = None
        self.chat_template: str | None = None  # override of create_chat_completion's template
        self._templates: dict = {}

    # ---- tokens ---------------------------------------------------------------------------
    def tokenize(self, text: str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of ``text`` (BOS first when ``add_bos`` and the vocabulary uses one).

        Raises:
            ParameterError: ``text`` is not a str, or holds lone surrogates (not UTF-8).
        """
        if not isinstance(text, str):
            raise ParameterError(f"text must be a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # lone surrogates (bytes decoded with surrogateescape)
            raise ParameterError(f"text is not valid UTF-8 (character {e.start})") from None
        return self.tokenizer.encode(text, add_bos=add_bos and self.tokenizer.add_bos,
                                     special=special)

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids.

        Raises:
            ParameterError: an id that is not an int in ``[0, n_vocab)``.
        """
        return self.tokenizer.decode(self.check_ids(ids))

    def check_ids(self, ids: Sequence[int]) -> list[int]:
        """``ids`` as a list, after checking each is an int in ``[0, n_vocab)``.

        Raises:
            ParameterError: naming the first bad id and its position.
        """
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise ParameterError(f"token ids must be a sequence of ints, got {type(ids).__name__}")
        out = list(ids)
        n = self.tokenizer.n_vocab
        for i, t in enumerate(out):
            if isinstance(t, bool) or not isinstance(t, int):
                raise ParameterError(f"token #{i} must be an int, got {type(t).__name__}")
            if not 0 <= t < n:
                raise ParameterError(f"token #{i} = {t} is outside the vocabulary (ids 0..{n - 1})")
        return out

    # ---- evaluation -----------------------------------------------------------------------
    def session(self, ctx_size: int | None = None) -> Session:
        """A fresh sequence with its own KV cache."""
        return Session(self.loaded, ctx_size=ctx_size or self.ctx_size, batch_size=self.batch_size)

    def _shared_session(self) -> Session:
        if self._session is None:
            self._session = self.session()
        return self._session

    def logits(self, ids: Sequence[int]) -> torch.Tensor:
        """Next-token logits after ``ids``: float32 tensor of shape (n_vocab,), on the CPU.

        Raises:
            ContextOverflowError: ``ids`` does not fit in the context.
        """
        ids = self.check_ids(ids)
        if not ids:
            raise LocalLLMError("logits() needs at least one token")
        with self._lock:
            session = self.session(ctx_size=max(self.ctx_size, len(ids)))
            return session.eval(ids).cpu()

    # ---- generation -----------------------------------------------------------------------
    def sampling_params(self, params: SamplingParams | None = None, **overrides) -> SamplingParams:
        """The model's defaults (models.toml), then ``params``, then keyword ``overrides``."""
        if params is None:
            params = SamplingParams.from_dict(dict(self.entry.sampling) if self.entry else {})
        elif not isinstance(params, SamplingParams):
            raise ParameterError(f"params must be a SamplingParams, got {type(params).__name__}")
        if overrides:
            names = {f.name for f in dataclasses.fields(SamplingParams)}
            unknown = sorted(set(overrides) - names)
            if unknown:
                raise ParameterError(f"unknown sampling parameter {unknown[0]!r}")
            params = dataclasses.replace(params, **overrides)
        params.validate()
        return params

    def encode_prompt(self, prompt: str | Sequence[int], *, special: bool = False) -> list[int]:
        """Token ids of a prompt: text is tokenized (with BOS), ids are checked.

        Raises:
            ParameterError: a prompt that is neither text nor token ids, or a bad id.
            LocalLLMError: an empty prompt.
        """
        ids = (self.tokenize(prompt, special=special) if isinstance(prompt, str)
               else self.check_ids(prompt))
        if not ids:
            raise LocalLLMError("the prompt is empty")
        return ids

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        params: SamplingParams | None = None,
        n_predict: int = -1,
        stop: Sequence[str] = (),
        constraint=None,
        grammar: str | None = None,
        json_schema=None,
        json: bool = False,
        session: Session | None = None,
        special: bool = False,
        cache_prompt: bool = False,
        **sampling,
    ) -> Iterator[Step]:
        """Generate from ``prompt``, yielding a :class:`Step` per token.

        Args:
            prompt: text (tokenized with BOS) or token ids.
            params / sampling: sampling settings (llama.cpp names: temp, top_k, min_p ...).
            n_predict: most tokens to generate (-1: until end of generation or full context).
            stop: stop strings.
            constraint: a grammar constraint (:mod:`localllm.grammar.constraint`); or build one with
                ``grammar`` (GBNF text), ``json_schema`` (dict or JSON text) or ``json=True``.
                A JSON constraint steers to the shortest valid completion when the budget
                (``n_predict``, or the context) runs out (:mod:`localllm.grammar.budget`).
            session: generate in this session, reusing the prefix its cache already holds.
                By default the LLM's own session is used: cleared first, so that the same
                seed and settings give the same text on every call, unless ``cache_prompt``
                (then the longest common prefix of its cache is reused, as in
                :meth:`create_completion`).
        Raises:
            ContextOverflowError: the prompt leaves no room to generate in the context.
            ParameterError: a sampling parameter is out of range or of the wrong type, a
                token id is out of range.
            GrammarError: the grammar or schema is invalid.
            LocalLLMError: another generation of this LLM is still open in this thread.
        """
        ids = self.encode_prompt(prompt, special=special)
        if isinstance(n_predict, bool) or not isinstance(n_predict, int):
            raise ParameterError(f"n_predict must be an int, got {type(n_predict).__name__}")
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise ParameterError("stop must be a list of strings")
        if session is not None and not isinstance(session, Session):
            raise ParameterError(f"session must be a Session, got {type(session).__name__}")
        target = session if session is not None else self._shared_session()
        self._check_fits(ids, target)
        params = self.sampling_params(params, **sampling)
        if constraint is None and (grammar is not None or json_schema is not None or json):
            from .grammar.constraint import constraint_for

            constraint = constraint_for(self.tokenizer, grammar=grammar, json_schema=json_schema,
                                        json=json)
        constraint = self._budgeted(constraint, n_predict, len(ids), target.ctx_size)
        yield from self._steps(ids, params, n_predict=n_predict, stop=stop, constraint=constraint,
                               session=session, reuse=cache_prompt)

    def _check_fits(self, ids: Sequence[int], session: Session) -> None:
        if len(ids) >= session.ctx_size:
            raise ContextOverflowError(
                f"the prompt is {len(ids)} tokens; the context holds {session.ctx_size} "
                "(raise --ctx-size or shorten the prompt)"
            )

    @staticmethod
    def _budgeted(constraint, n_predict: int, n_prompt: int, ctx_size: int):
        """Wrap a JSON constraint so that it completes its value within the token budget."""
        schema = getattr(constraint, "json_schema", None)
        if constraint is None or schema is None or isinstance(constraint, BudgetedConstraint):
            return constraint
        budget = ctx_size - n_prompt
        if n_predict >= 0:
            budget = min(budget, n_predict)
        return BudgetedConstraint(constraint, schema, budget)

    def _steps(self, ids: list[int], params: SamplingParams, *, n_predict: int,
               stop: Sequence[str], constraint, session: Session | None, reuse: bool,
               cancel: threading.Event | None = None) -> Iterator[Step]:
        """The decode loop under this LLM's lock (one generation at a time)."""
        me = threading.get_ident()
        if self._lock_owner == me:
            raise LocalLLMError(
                "another generation of this LLM is still open in this thread: "
                "exhaust or close() it first")
        with self._lock:
            self._lock_owner = me
            try:
                if session is None:
                    session = self._shared_session()
                    if not reuse:
                        session.reset()
                if constraint is not None and hasattr(constraint, "reset_budget"):
                    constraint.reset_budget()
                sampler = build_sampler(params, self.tokenizer, constraint=constraint,
                                        n_ctx=session.ctx_size)
                self.last_sampler = sampler
                self.last_timings = Timings()
                for step in generate_tokens(
                    session, ids, sampler, n_predict=n_predict, stop=stop,
                    constraint=constraint, timings=self.last_timings,
                ):
                    yield step
                    if cancel is not None and cancel.is_set():
                        return
            finally:
                self._lock_owner = None

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Iterator[str]:
        """Like :meth:`stream`, yielding only the text pieces."""
        for step in self.stream(prompt, **kwargs):
            if step.text:
                yield step.text

    # ---- OpenAI-shaped API (llama-cpp-python's names) -----------------------------------------
    @property
    def model_name(self) -> str:
        """The name reported in responses: the models.toml name, else the file name."""
        return self.entry.name if self.entry is not None else self.path.name

    def create_completion(
        self,
        prompt: str | Sequence[int],
        *,
        max_tokens: int | None = 16,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        stream: bool = False,
        logprobs: int | None = None,
        echo: bool = False,
        response_format: dict | None = None,
        grammar: str | None = None,
        stream_options: dict | None = None,
        cache_prompt: bool = True,
        model: str | None = None,
        n: int = 1,
        _cancel: threading.Event | None = None,
        **sampler_params,
    ) -> dict | Iterator[dict]:
        """A text completion, shaped as OpenAI's ``Completion`` (``CompletionChunk`` dicts
        when ``stream``), as llama-cpp-python's ``Llama.create_completion``.

        Args:
            prompt: text (tokenized with BOS) or token ids.
            max_tokens: most tokens to generate (None or <= 0: until end of generation or a
                full context); finish_reason "length" when it is reached.
            temperature, top_p, top_k, min_p, seed: sampling (None: the model's defaults
                from models.toml, else llama.cpp's). ``sampler_params``: any other llama.cpp
                sampler parameter, by its llama-server / llama-cpp-python name
                (``repeat_penalty``, ``presence_penalty``, ``frequency_penalty``,
                ``typical_p``, ``mirostat_mode``, ``dry_multiplier``, ``xtc_probability``,
                ``top_n_sigma``, ``logit_bias`` ...) or its ``SamplingParams`` field name.
            stop: stop string(s), never included in the text (finish_reason "stop").
            logprobs: include the chosen token's log-probability and the ``logprobs`` most
                likely alternatives (raw model distribution, natural log) per token.
            echo: prepend the prompt to the text.
            response_format: ``{"type": "json_object"}`` or ``{"type": "json_schema",
                "json_schema": {"schema": ..., "strict": true}}``: constrained decoding that
                finishes the JSON value before ``max_tokens`` runs out.
            grammar: GBNF text (llama.cpp's ``grammar``).
            cache_prompt: reuse the longest common token prefix of the previous call's KV cache
                (llama-server's ``cache_prompt``); False evaluates the whole prompt afresh.
        Returns:
            ``{"id", "object": "text_completion", "created", "model", "choices": [{"text",
            "index", "logprobs", "finish_reason"}], "usage"}``; finish_reason is "stop" (end of
            generation, a stop string, the grammar completed) or "length" (``max_tokens`` or
            the context).
        Raises:
            ParameterError: an unknown keyword (named) or a value out of range.
            ContextOverflowError, GrammarError: see :meth:`stream`.
        Thread safety: calls on one LLM run one at a time (a lock; the runtime holds one
        sequence). A stream holds the lock until it is exhausted or closed.
        """
        if n != 1:
            raise ParameterError(f"n must be 1 (one sequence at a time), got {n}")
        ids = self.encode_prompt(prompt)
        params = self._openai_params(temperature, top_p, top_k, min_p, seed, sampler_params,
                                     top_logprobs=logprobs or 0)
        session = self._shared_session()
        self._check_fits(ids, session)
        budget = max_tokens if max_tokens is not None and max_tokens > 0 else -1
        constraint = self._response_constraint(response_format, grammar)
        constraint = self._budgeted(constraint, budget, len(ids), session.ctx_size)
        stops = _stop_list(stop)
        run = self._steps(ids, params, n_predict=budget, stop=stops, constraint=constraint,
                          session=None, reuse=cache_prompt, cancel=_cancel)
        head = {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time()),
                "model": self.model_name}
        prefix = (prompt if isinstance(prompt, str) else self.detokenize(ids)) if echo else ""
        want = logprobs is not None
        if stream:
            return self._completion_chunks(run, head, ids, prefix, want, stream_options)
        return self._completion(run, head, ids, prefix, want)

    def _completion(self, run, head, ids, prefix, want) -> dict:
        text, lps, finish, count = [prefix], _CompletionLogprobs(len(prefix)), None, 0
        for step in run:
            count += step.token >= 0
            text.append(step.text)
            if want and step.token >= 0:
                lps.add(self.tokenizer, step)
            finish = step.finish_reason or finish
        return {**head, "object": "text_completion",
                "choices": [{"text": "".join(text), "index": 0,
                             "logprobs": lps.as_dict() if want else None,
                             "finish_reason": _finish(finish)}],
                "usage": self._usage(ids, count)}

    def _completion_chunks(self, run, head, ids, prefix, want, stream_options) -> Iterator[dict]:
        lps = _CompletionLogprobs(len(prefix))
        count = 0
        first = True
        for step in run:
            count += step.token >= 0
            piece = (prefix if first else "") + step.text
            first = False
            entry = None
            if want and step.token >= 0:
                entry = _CompletionLogprobs(lps.offset)
                entry.add(self.tokenizer, step)
                lps.offset = entry.offset
            chunk = {**head, "object": "text_completion",
                     "choices": [{"text": piece, "index": 0,
                                  "logprobs": entry.as_dict() if entry else None,
                                  "finish_reason": _finish(step.finish_reason)}]}
            if step.finish_reason:
                chunk["usage"] = self._usage(ids, count)
            yield chunk
        if (stream_options or {}).get("include_usage"):
            yield {**head, "object": "text_completion", "choices": [],
                   "usage": self._usage(ids, count)}

    def create_chat_completion(
        self,
        messages: Sequence[dict],
        *,
        max_tokens: int | None = None,
        max_completion_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        stream: bool = False,
        logprobs: bool | None = None,
        top_logprobs: int | None = None,
        response_format: dict | None = None,
        tools: list[dict] | None = None,
        tool_choice: str | dict | None = None,
        grammar: str | None = None,
        stream_options: dict | None = None,
        chat_template: str | None = None,
        cache_prompt: bool = True,
        model: str | None = None,
        n: int = 1,
        _cancel: threading.Event | None = None,
        **sampler_params,
    ) -> dict | Iterator[dict]:
        """A chat reply, shaped as OpenAI's ``ChatCompletion`` (``ChatCompletionChunk`` dicts
        when ``stream``), as llama-cpp-python's ``Llama.create_chat_completion``.

        Args:
            messages: OpenAI messages (``role`` system / developer / user / assistant / tool;
                ``content`` text or parts; assistant ``tool_calls``; tool ``tool_call_id``),
                rendered with the model's chat template (``chat_template`` overrides it).
            max_tokens / max_completion_tokens: most tokens to generate (None: until end of
                generation or a full context).
            tools: OpenAI function tools, rendered through the template; calls the model
                writes (Hermes/Qwen ``<tool_call>``, Llama 3.1 JSON, Mistral ``[TOOL_CALLS]``,
                the built-in templates' fenced ``tool_call``) come back as
                ``message.tool_calls`` with finish_reason "tool_calls".
            tool_choice: "auto" (default with tools), "none" (tools ignored), "required" (one
                call to some tool) or ``{"type": "function", "function": {"name": N}}``: the
                last two constrain the reply to a JSON call whose arguments follow the tool's
                ``parameters`` schema.
            logprobs / top_logprobs: per-token log-probabilities (raw model distribution)
                and the ``top_logprobs`` most likely alternatives.
            response_format, stop, seed, sampling, cache_prompt: see :meth:`create_completion`.
            With tools (tool_choice not "none"), a stream sends the whole reply in one chunk
            at the end, since a call is only known once it is complete.
        Returns:
            ``{"id", "object": "chat.completion", "created", "model", "choices": [{"index",
            "message": {"role": "assistant", "content", "tool_calls"?}, "logprobs",
            "finish_reason"}], "usage"}``.
        Raises:
            ParameterError: an unknown keyword (named), a malformed message or tool, a value
                out of range. TemplateError: the chat template failed.
            ContextOverflowError, GrammarError: see :meth:`stream`.
        """
        from .chat.template import template_for
        from .chat.tools import (
            check_tools,
            fallback_messages,
            forced_tool_schema,
            template_knows_tools,
            template_messages,
        )

        if n != 1:
            raise ParameterError(f"n must be 1 (one sequence at a time), got {n}")
        _check_messages(messages)
        messages = with_default_system(self.entry, messages)
        tools = check_tools(tools)
        if tool_choice is not None and not tools and tool_choice != "none":
            raise ParameterError("tool_choice needs tools")
        use_tools = bool(tools) and tool_choice != "none"
        key = chat_template or self.chat_template
        if key not in self._templates:
            self._templates[key] = template_for(self, key)
        template = self._templates[key]
        msgs = template_messages(list(messages))
        if use_tools and not template_knows_tools(template.source):
            msgs = fallback_messages(msgs, tools)
        ids = template.encode(self.tokenizer, msgs,
                              tools=tools if use_tools and template_knows_tools(template.source)
                              else None)
        if not ids:
            raise LocalLLMError("the chat template rendered an empty prompt")
        if max_completion_tokens is not None:
            max_tokens = max_completion_tokens
        params = self._openai_params(temperature, top_p, top_k, min_p, seed, sampler_params,
                                     top_logprobs=(top_logprobs or 0) if logprobs else 0)
        session = self._shared_session()
        self._check_fits(ids, session)
        budget = max_tokens if max_tokens is not None and max_tokens > 0 else -1
        forced = forced_tool_schema(tools, tool_choice) if use_tools else None
        if forced is not None:
            if response_format not in (None, {"type": "text"}) or grammar is not None:
                raise ParameterError("tool_choice that forces a call cannot be combined with "
                                     "response_format or grammar")
            from .grammar.constraint import GrammarConstraint

            constraint = GrammarConstraint.from_json_schema(forced, self.tokenizer,
                                                            source="tool_choice")
        else:
            constraint = self._response_constraint(response_format, grammar)
        constraint = self._budgeted(constraint, budget, len(ids), session.ctx_size)
        run = self._steps(ids, params, n_predict=budget, stop=_stop_list(stop),
                          constraint=constraint, session=None, reuse=cache_prompt, cancel=_cancel)
        head = {"id": "chatcmpl-" + uuid.uuid4().hex, "created": int(time.time()),
                "model": self.model_name}
        tool_list = tools if use_tools else []
        if stream:
            return self._chat_chunks(run, head, ids, tool_list, bool(logprobs), stream_options)
        return self._chat(run, head, ids, tool_list, logprobs)

    def _chat(self, run, head, ids, tool_list, logprobs) -> dict:
        text, content_lps, finish, count = [], [], None, 0
        for step in run:
            count += step.token >= 0
            text.append(step.text)
            if logprobs and step.token >= 0:
                content_lps.append(_token_logprob(self.tokenizer, step))
            finish = step.finish_reason or finish
        message, reason = _chat_message("".join(text), tool_list, finish)
        return {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": message,
                             "logprobs": {"content": content_lps, "refusal": None}
                             if logprobs else None,
                             "finish_reason": reason}],
                "usage": self._usage(ids, count)}

    def _chat_chunks(self, run, head, ids, tools, logprobs, stream_options) -> Iterator[dict]:
        def chunk(delta: dict, finish=None, lps=None) -> dict:
            return {**head, "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "logprobs": lps,
                                 "finish_reason": finish}]}

        yield chunk({"role": "assistant", "content": ""})
        count, finish, held, held_lps = 0, None, [], []
        for step in run:
            count += step.token >= 0
            finish = step.finish_reason or finish
            lp = [_token_logprob(self.tokenizer, step)] if logprobs and step.token >= 0 else []
            if tools:  # a tool call is only known once complete: hold the reply back
                held.append(step.text)
                held_lps += lp
            elif step.text or lp:
                yield chunk({"content": step.text},
                            lps={"content": lp, "refusal": None} if logprobs else None)
        if tools:
            message, reason = _chat_message("".join(held), tools, finish)
            delta = {k: v for k, v in message.items() if k != "role" and v is not None}
            if "tool_calls" in delta:
                delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
            if delta:
                yield chunk(delta, lps={"content": held_lps, "refusal": None} if logprobs else None)
        else:
            reason = _finish(finish)
        last = chunk({}, reason)
        last["usage"] = self._usage(ids, count)
        yield last
        if (stream_options or {}).get("include_usage"):
            yield {**head, "object": "chat.completion.chunk", "choices": [],
                   "usage": self._usage(ids, count)}

    def _usage(self, ids: Sequence[int], completion_tokens: int) -> dict:
        t = self.last_timings
        cached = t.reused_tokens if t is not None else 0
        return {"prompt_tokens": len(ids), "completion_tokens": completion_tokens,
                "total_tokens": len(ids) + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _openai_params(self, temperature, top_p, top_k, min_p, seed, extra: dict,
                       top_logprobs: int = 0) -> SamplingParams:
        """SamplingParams from OpenAI / llama-cpp-python / llama-server names over the model's
        defaults. Raises ParameterError naming an unknown keyword."""
        given = {"temp": temperature, "top_p": top_p, "top_k": top_k, "min_p": min_p,
                 "seed": seed}
        overrides = {k: v for k, v in given.items() if v is not None}
        fields = {f.name for f in dataclasses.fields(SamplingParams)}
        for name, value in extra.items():
            field_name = SAMPLER_ALIASES.get(name, name)
            if field_name not in fields:
                known = sorted(set(SAMPLER_ALIASES) | fields - {"n_probs"})
                raise ParameterError(
                    f"unknown keyword argument {name!r} (sampler parameters: {', '.join(known)})")
            if value is None:
                continue
            if field_name == "logit_bias":
                try:
                    value = {int(k): float(v) for k, v in dict(value).items()}
                except (TypeError, ValueError):
                    raise ParameterError("logit_bias must map token ids to numbers") from None
            elif field_name == "samplers" and isinstance(value, str):
                from .sampling.chain import parse_samplers

                value = parse_samplers(value)
            overrides[field_name] = value
        if isinstance(overrides.get("seed"), int) and overrides["seed"] < 0:
            overrides["seed"] = None  # -1: a random seed, as llama.cpp
        if top_logprobs:
            if not 0 <= top_logprobs <= 20:
                raise ParameterError(f"top_logprobs/logprobs must be 0..20, got {top_logprobs}")
            overrides["n_probs"] = top_logprobs
        return self.sampling_params(**overrides)

    def _response_constraint(self, response_format: dict | None, grammar: str | None):
        from .grammar.constraint import GrammarConstraint

        if grammar is not None and response_format not in (None, {"type": "text"}):
            raise ParameterError("grammar and response_format cannot be used together")
        if grammar is not None:
            return GrammarConstraint.from_gbnf(grammar, self.tokenizer, source="grammar")
        if response_format is None:
            return None
        if not isinstance(response_format, dict):
            raise ParameterError("response_format must be an object with a 'type'")
        kind = response_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            schema = response_format.get("schema") or {"type": "object"}
        elif kind == "json_schema":
            spec = response_format.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
                raise ParameterError(
                    "response_format json_schema needs {\"json_schema\": {\"name\": ..., "
                    "\"schema\": {...}}}")
            schema = spec.get("schema") or {}
            if spec.get("strict"):
                schema = strict_schema(schema)
        else:
            raise ParameterError(
                f"response_format type must be text, json_object or json_schema, got {kind!r}")
        return GrammarConstraint.from_json_schema(schema, self.tokenizer, source="response_format")


# OpenAI / llama-cpp-python / llama-server parameter names -> SamplingParams fields.
SAMPLER_ALIASES = {
    "temperature": "temp", "typical_p": "typ_p", "presence_penalty": "penalty_present",
    "frequency_penalty": "penalty_freq", "repeat_penalty": "penalty_repeat",
    "repeat_last_n": "penalty_last_n", "mirostat_mode": "mirostat", "dry_penalty_last_n":
    "dry_penalty_last_n", "n_probs": "n_probs",
}

_FINISH = {"eog": "stop", "stop": "stop", "grammar": "stop", "length": "length", "ctx": "length"}
_ROLES = ("system", "developer", "user", "assistant", "tool", "function", "ipython")


def _finish(reason: str | None) -> str | None:
    return _FINISH.get(reason, "stop") if reason else None


def _stop_list(stop: str | Sequence[str] | None) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else list(stop)
    if not all(isinstance(s, str) for s in stops):
        raise ParameterError("stop must be a string or a list of strings")
    return [s for s in stops if s]


def with_default_system(entry: ModelEntry | None, messages: list) -> list:
    """``messages`` with the model's default system prompt (models.toml ``system``, Ollama's
    ``SYSTEM``) first when none of them is a system or developer message, as Ollama does."""
    system = entry.system if entry is not None else None
    if not system or any(m.get("role") in ("system", "developer") for m in messages):
        return messages
    return [{"role": "system", "content": system}, *messages]


def _check_messages(messages) -> None:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ParameterError("messages must be a non-empty list of {\"role\", \"content\"} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ParameterError(f"messages[{i}] must be an object")
        if m.get("role") not in _ROLES:
            raise ParameterError(f"messages[{i}].role must be one of {', '.join(_ROLES)}, "
                                 f"got {m.get('role')!r}")
        content = m.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ParameterError(f"messages[{i}].content must be a string, a list of parts or null")


def _chat_message(text: str, tools: list[dict], finish: str | None) -> tuple[dict, str | None]:
    from .chat.tools import parse_tool_calls

    if tools:
        content, calls = parse_tool_calls(text, tools)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"
    return {"role": "assistant", "content": text}, _finish(finish)


def _token_logprob(tokenizer, step: Step) -> dict:
    def entry(token: int, logprob: float) -> dict:
        data = tokenizer.token_bytes(token)
        return {"token": data.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(data)}

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
        text = tokenizer.token_bytes(step.token).decode("utf-8", errors="replace")
        self.tokens.append(text)
        self.token_logprobs.append(step.logprob)
        trace = step.trace
        self.top.append({tokenizer.token_bytes(t).decode("utf-8", errors="replace"): lp
                         for t, lp in (trace.top if trace is not None else [])})
        self.offsets.append(self.offset)
        self.offset += len(text)

    def as_dict(self) -> dict:
        return {"tokens": self.tokens, "token_logprobs": self.token_logprobs,
                "top_logprobs": self.top, "text_offset": self.offsets}
