"""The core of the Python API: a loaded model, its tokens, its sessions and one generation
path.

    >>> from localllm import LLM
    >>> llm = LLM("gemma3-270m")                     # a models.toml name or a .gguf path
    >>> "".join(llm.generate("The capital of France is", n_predict=16, temp=0))

Every generation, whatever the front end (``LLM.stream``, the OpenAI-shaped calls of
:mod:`localllm.api.completions`, the server, the chat REPL), goes the same way: arguments are
checked and turned into a :class:`GenerationRequest` once, by :meth:`LLM.prepare`; then
:meth:`LLM.stream` runs it as a :class:`Generation` (an iterator of
:class:`~localllm.runtime.generate.Step`) under the LLM's lock, which is taken in
:meth:`LLM._run` only. The generation carries its own figures (:class:`Timings`) and sampler.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

import torch

from ..errors import ContextOverflowError, LocalLLMError, ParameterError
from ..grammar.budget import BudgetedConstraint
from ..grammar.lazy import Thinking, ThinkingControl
from ..memory import cache_type
from ..registry import ModelEntry, load_registry
from ..runtime.generate import Step, Timings, generate_tokens
from ..runtime.session import Session, load_model
from ..runtime.speculative import Speculation
from ..sampling.chain import SamplingParams, build_sampler
from .schema import parse_options

_DTYPES = (torch.float16, torch.float32, torch.bfloat16)


class GenerationTimeout(LocalLLMError):
    """A generation ran past its wall-clock limit (``time_limit``; the server's ``--timeout``)."""


@dataclass
class GenerationRequest:
    """Everything one generation needs, checked: built by :meth:`LLM.prepare`, run once by
    :meth:`LLM.stream`.

    Attributes:
        ids: the prompt's token ids (each in ``[0, n_vocab)``; they fit in the context).
        params: the sampling settings (validated).
        n_predict: most tokens to generate (-1: until end of generation or a full context).
        stop: stop strings (never part of the text).
        constraint: a grammar constraint, or None; a JSON one is budgeted (it completes its
            value within ``n_predict`` or the context, :mod:`localllm.grammar.budget`).
        session: the sequence to generate in; None: the LLM's own, cleared first unless
            ``cache_prompt`` (then the longest common prefix of its cache is reused).
        cache_prompt: see ``session``.
        deadline: ``time.monotonic()`` after which the generation stops with
            :class:`GenerationTimeout` (checked between tokens); None: no limit.
        cancel: set (from any thread) to end the generation before its next token.
        on_context_full: the context shift hook of
            :func:`~localllm.runtime.generate.generate_tokens`.
        sampler: a ready sampler chain to use instead of one built from ``params``.
        drafter: speculative decoding (:mod:`localllm.runtime.speculative`): guessed tokens
            verified in one forward; the output is the same.
        preserved: control tokens whose text the steps carry (a chat format's markers).
    """

    ids: list[int]
    params: SamplingParams
    n_predict: int = -1
    stop: tuple[str, ...] = ()
    constraint: Any = None
    session: Session | None = None
    cache_prompt: bool = False
    deadline: float | None = None
    cancel: threading.Event | None = None
    on_context_full: Callable[[list[int]], Sequence[int] | None] | None = None
    sampler: Any = None
    drafter: Any = None
    preserved: frozenset[int] = frozenset()
    _used: bool = field(default=False, init=False, repr=False)


class Generation:
    """One running generation: an iterator of :class:`~localllm.runtime.generate.Step`.

    The LLM's lock is taken at the first ``next()`` and held until the generation is
    exhausted or closed (``close()``, ``with``, or garbage collection).

    Attributes:
        request: the :class:`GenerationRequest`.
        timings: this generation's figures (prompt tokens evaluated and reused, seconds),
            filled in as it goes.
        sampler: the sampler chain (None until the first step).
        finish_reason: the last step's ("eog", "length", "ctx", "stop", "grammar"), or
            "cancelled"; None while running.
    """

    def __init__(self, llm: LLM, request: GenerationRequest) -> None:
        self.request = request
        self.timings = Timings()
        self.sampler = None
        self.finish_reason: str | None = None
        self._steps = llm._run(request, self)

    def __iter__(self) -> Self:
        return self

    def __next__(self) -> Step:
        return next(self._steps)

    def close(self) -> None:
        """End the generation now and release the LLM."""
        self._steps.close()

    def cancel(self) -> None:
        """Ask the generation to end before its next token (safe from any thread)."""
        if self.request.cancel is None:
            self.request.cancel = threading.Event()
        self.request.cancel.set()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class LLM:
    """A loaded model.

    Concurrency: one generation runs at a time per ``LLM`` (the runtime holds one sequence at
    a time): a generation takes the LLM's lock at its first step and holds it until it is
    exhausted or closed, so other threads wait their turn, and a second generation opened in
    the thread that holds an unfinished one is refused (it would wait for ever).

    Args:
        model: a name from models.toml, or a path to a .gguf file (default: the registry's
            default model).
        device: "auto" (CUDA when available), "cpu" or "cuda".
        ctx_size: context size of sessions, in tokens (capped at the model's context length;
            0: the model's context length, as llama.cpp's ``-c 0``).
        batch_size: most tokens per forward during prefill.
        verbose: print load progress on stderr when it is a terminal.
        progress: a progress bar while loading (None: when stderr is a terminal).
        dtype: storage dtype of dequantized weights on the torch backend (float32 for an
            exact evaluation; twice the memory of the float16 default).
        draft_model, spec_ngram, draft_max, draft_min, draft_p_min: speculative decoding
            (:mod:`localllm.runtime.speculative`, llama.cpp's ``--model-draft``,
            ``--draft-max``, ``--draft-min``, ``--draft-p-min``; ``--spec-ngram N``: prompt
            lookup with n-grams of up to N tokens): a draft model (name or path, same
            vocabulary) or n-gram lookup guesses tokens that one batched forward verifies;
            the output is the same as without it.
        type_k, type_v: element types of the KV cache's keys and values, llama-cpp-python's
            keywords: a ggml type id (8: Q8_0) or llama.cpp's ``-ctk`` / ``-ctv`` name
            (``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q4_0"``, ``"q4_1"``, ``"iq4_nl"``,
            ``"q5_0"``, ``"q5_1"``, ``"f32"``; :mod:`localllm.memory.kvtypes`); None: the
            backend's float type (float16; float32 on the CPU's torch path).
    Raises:
        ParameterError: an unknown keyword, or an argument of the wrong type or range.
        ModelNotFoundError, GGUFError, UnsupportedError: see :func:`load_model`.
    """

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        device: str = "auto",
        ctx_size: int = 4096,
        batch_size: int = 512,
        verbose: bool = False,
        progress: bool | None = None,
        dtype: torch.dtype = torch.float16,
        **unknown: Any,
    ) -> None:
        options = parse_options({"device": device, "ctx_size": ctx_size,
                                 "batch_size": batch_size, "verbose": verbose,
                                 "progress": progress, **unknown})
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise ParameterError(f"model must be a name or a path, got {type(model).__name__}")
        if dtype not in _DTYPES:
            raise ParameterError(f"dtype must be torch.float16, float32 or bfloat16, got {dtype!r}")
        self.ctx_checkpoints = options.ctx_checkpoints
        self.type_k = cache_type(options.type_k, "type_k (--cache-type-k)")
        self.type_v = cache_type(options.type_v, "type_v (--cache-type-v)")
        path, entry = load_registry().resolve(model)
        self.path: Path = path
        self.entry: ModelEntry | None = entry
        self.loaded = load_model(path, device=options.device, progress=options.progress,
                                 ctx_size=options.ctx_size, dtype=dtype,
                                 cache_types=(self.type_k, self.type_v))
        self.tokenizer = self.loaded.tokenizer
        self.args = self.loaded.args
        self.metadata: dict = self.loaded.gguf.metadata
        self.device = self.loaded.device
        self.ctx_size = min(options.ctx_size or self.args.context_length,
                            self.args.context_length)
        self.batch_size = options.batch_size
        self.verbose = options.verbose
        # The chat defaults create_chat_completion uses when a request says nothing: the
        # template (a built-in name, a metadata variant's name, Jinja text or a ChatTemplate:
        # --chat-template), template variables (--chat-template-kwargs), the reasoning
        # format and budget (--reasoning-format, --reasoning-budget).
        self.chat_template: Any = None
        self.chat_template_kwargs: dict = {}
        self.reasoning_format: str = "auto"
        self.reasoning_budget: int = -1
        draft = None
        if options.draft_model is not None:
            draft = load_model(load_registry().resolve(options.draft_model)[0],
                               device=options.device, progress=options.progress,
                               ctx_size=options.ctx_size, dtype=dtype)
        self.speculation = Speculation(
            self.loaded, self.ctx_size, draft=draft, ngram=options.spec_ngram,
            draft_max=options.draft_max, draft_min=options.draft_min,
            p_min=options.draft_p_min)
        self._session: Session | None = None
        self._lock = threading.RLock()  # one generation (or forward) at a time
        self._lock_owner: int | None = None

    @property
    def model_name(self) -> str:
        """The name reported in responses: the models.toml name, else the file name."""
        return self.entry.name if self.entry is not None else self.path.name

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

    # ---- evaluation -----------------------------------------------------------------------
    def session(self, ctx_size: int | None = None) -> Session:
        """A fresh sequence with its own KV cache (``eval``, ``truncate``, ``reset``,
        ``save``/``load``, ``tokens``, ``n_past``, ``ctx_size``)."""
        return Session(self.loaded, ctx_size=ctx_size or self.ctx_size, batch_size=self.batch_size,
                       type_k=self.type_k, type_v=self.type_v,
                       checkpoints=self.ctx_checkpoints)

    def reserve(self) -> None:
        """Allocate the KV cache of the LLM's own session (the one :meth:`prepare` uses by
        default) now rather than in the first generation; the server does at start-up."""
        with self._lock:
            self._own_session()

    def _own_session(self) -> Session:
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
        """The model's defaults (models.toml), then ``params``, then keyword ``overrides``.

        Raises:
            ParameterError: an unknown name, a value of the wrong type or out of range.
        """
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

    def prepare(
        self,
        prompt: str | Sequence[int],
        *,
        params: SamplingParams | None = None,
        n_predict: int = -1,
        stop: str | Sequence[str] = (),
        constraint: Any = None,
        grammar: str | None = None,
        json_schema: Any = None,
        json: bool = False,
        session: Session | None = None,
        special: bool = False,
        cache_prompt: bool = False,
        time_limit: float | None = None,
        cancel: threading.Event | None = None,
        on_context_full: Callable[[list[int]], Sequence[int] | None] | None = None,
        sampler: Any = None,
        drafter: Any = None,
        thinking: Thinking | None = None,
        answer_required: bool = False,
        preserved: Collection[int] = (),
        **sampling: Any,
    ) -> GenerationRequest:
        """Check a generation's arguments once and build its :class:`GenerationRequest`.

        Args:
            prompt: text (tokenized with BOS; ``special`` parses special-token text) or ids.
            params / sampling: sampling settings (llama.cpp names: temp, top_k, min_p ...)
                over the model's defaults.
            n_predict: most tokens to generate (-1 or -2: until end of generation or a full
                context; 0: none).
            stop: stop strings.
            constraint: a grammar constraint (:mod:`localllm.grammar.constraint`); or build
                one with ``grammar`` (GBNF text), ``json_schema`` (dict or JSON text) or
                ``json=True``. A JSON constraint steers to the shortest valid completion when
                the budget (``n_predict``, or the context) runs out.
            session / cache_prompt: see :class:`GenerationRequest`.
            time_limit: seconds from now after which the generation stops with
                :class:`GenerationTimeout` (None: no limit).
            cancel / on_context_full / sampler / drafter / preserved: see
                :class:`GenerationRequest`.
            thinking: the reply opens with a reasoning block
                (:class:`~localllm.grammar.lazy.Thinking`): the constraint applies after it,
                its budget ends it, and a JSON constraint's token budget is what it leaves
                (:class:`~localllm.grammar.lazy.ThinkingControl`).
            answer_required: with ``thinking``, the constraint's answer must follow the
                reasoning (not a lazy grammar): the reply may not end inside it.
        Raises:
            ContextOverflowError: the prompt leaves no room to generate in the context.
            ParameterError: a sampling parameter is out of range or of the wrong type, a
                token id is out of range.
            GrammarError: the grammar or schema is invalid.
        """
        ids = self.encode_prompt(prompt, special=special)
        if isinstance(n_predict, bool) or not isinstance(n_predict, int):
            raise ParameterError(f"n_predict must be an int, got {type(n_predict).__name__}")
        if n_predict < -2:
            raise ParameterError(f"n_predict must be -1 (no limit), -2 or >= 0, got {n_predict}")
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise ParameterError("stop must be a list of strings")
        if session is not None and not isinstance(session, Session):
            raise ParameterError(f"session must be a Session, got {type(session).__name__}")
        if time_limit is not None and (isinstance(time_limit, bool) or not isinstance(
                time_limit, (int, float)) or not time_limit > 0):
            raise ParameterError(f"time_limit must be a number of seconds > 0, got {time_limit!r}")
        if cancel is not None and not isinstance(cancel, threading.Event):
            raise ParameterError(f"cancel must be a threading.Event, got {type(cancel).__name__}")
        ctx_size = session.ctx_size if session is not None else self.ctx_size
        if len(ids) >= ctx_size:
            raise ContextOverflowError(
                f"the prompt is {len(ids)} tokens; the context holds {ctx_size} "
                "(raise --ctx-size or shorten the prompt)")
        params = self.sampling_params(params, **sampling)
        if constraint is None and (grammar is not None or json_schema is not None or json):
            from ..grammar.constraint import constraint_for

            constraint = constraint_for(self.tokenizer, grammar=grammar, json_schema=json_schema,
                                        json=json)
        budget = ctx_size - len(ids)
        if n_predict >= 0:
            budget = min(budget, n_predict)
        schema = getattr(constraint, "json_schema", None)
        if schema is not None and not isinstance(constraint, BudgetedConstraint):
            constraint = BudgetedConstraint(constraint, schema, budget)
        if thinking is not None:
            if not isinstance(thinking, Thinking):
                raise ParameterError(f"thinking must be a Thinking, got {type(thinking).__name__}")
            constraint = ThinkingControl(thinking, constraint, self.tokenizer, total=budget,
                                         required=answer_required)
        return GenerationRequest(
            ids=ids, params=params, n_predict=n_predict, stop=tuple(s for s in stop if s),
            constraint=constraint, session=session, cache_prompt=bool(cache_prompt),
            deadline=None if time_limit is None else time.monotonic() + time_limit,
            cancel=cancel, on_context_full=on_context_full, sampler=sampler, drafter=drafter,
            preserved=frozenset(preserved))

    def stream(self, prompt: str | Sequence[int] | GenerationRequest, **kwargs: Any) -> Generation:
        """Generate, yielding a :class:`~localllm.runtime.generate.Step` per token (token,
        text, log-probability, finish reason, sampler trace).

        Args:
            prompt: a :class:`GenerationRequest` from :meth:`prepare`, or a prompt with
                :meth:`prepare`'s keyword arguments.
        Returns:
            a :class:`Generation` (an iterator; it takes the lock at its first step).
        Raises:
            see :meth:`prepare`; when iterated, LocalLLMError if another generation of this
            LLM is still open in this thread, :class:`GenerationTimeout` past the deadline.
        """
        if isinstance(prompt, GenerationRequest):
            if kwargs:
                raise ParameterError("stream(request) takes no other arguments: "
                                     "give them to prepare()")
            request = prompt
        else:
            request = self.prepare(prompt, **kwargs)
        if request._used:
            raise ParameterError("this GenerationRequest has already run: prepare() another")
        request._used = True
        return Generation(self, request)

    def generate(self, prompt: str | Sequence[int] | GenerationRequest, **kwargs) -> Iterator[str]:
        """Like :meth:`stream`, yielding only the text pieces."""
        with self.stream(prompt, **kwargs) as steps:
            for step in steps:
                if step.text:
                    yield step.text

    def _run(self, req: GenerationRequest, gen: Generation) -> Iterator[Step]:
        """The decode loop of ``req`` under this LLM's lock: the one place a generation
        takes it."""
        me = threading.get_ident()
        if self._lock_owner == me:
            raise LocalLLMError(
                "another generation of this LLM is still open in this thread: "
                "exhaust or close() it first")
        with self._lock:
            self._lock_owner = me
            try:
                session = req.session
                if session is None:
                    session = self._own_session()
                    if not req.cache_prompt:
                        session.reset()
                if isinstance(req.constraint, BudgetedConstraint):
                    req.constraint.reset_budget()
                sampler = req.sampler or build_sampler(req.params, self.tokenizer,
                                                       constraint=req.constraint,
                                                       n_ctx=session.ctx_size)
                gen.sampler = sampler
                spec = self.speculation
                steps = generate_tokens(session, req.ids, sampler, n_predict=req.n_predict,
                                        stop=req.stop, constraint=req.constraint,
                                        timings=gen.timings, on_context_full=req.on_context_full,
                                        drafter=req.drafter or spec.drafter(),
                                        draft_max=spec.draft_max, draft_min=spec.draft_min,
                                        preserved=req.preserved)
                for step in steps:
                    if req.deadline is not None and time.monotonic() > req.deadline:
                        raise GenerationTimeout(
                            f"the generation ran past its time limit after "
                            f"{gen.timings.generated_tokens} tokens")
                    gen.finish_reason = step.finish_reason
                    yield step
                    if req.cancel is not None and req.cancel.is_set() and not step.finish_reason:
                        gen.finish_reason = "cancelled"
                        return
            finally:
                self._lock_owner = None

    # ---- the OpenAI-shaped API (localllm.api.completions) ------------------------------------
    def create_completion(self, prompt: str | Sequence[int] | None = None, /,
                          **kwargs: Any) -> dict | Iterator[dict]:
        """A text completion shaped as OpenAI's ``Completion`` (``CompletionChunk`` dicts when
        ``stream=True``), as llama-cpp-python's ``Llama.create_completion``: see
        :func:`localllm.api.completions.create_completion` for the keywords (OpenAI's and
        llama-server's names, checked by :class:`~localllm.api.schema.CompletionParams`).

        Raises:
            ParameterError: an unknown keyword (named), a value of the wrong type or range.
            ContextOverflowError, GrammarError: see :meth:`prepare`.
        """
        from .completions import create_completion
        from .schema import CompletionParams, parse

        return create_completion(self, parse(CompletionParams, _with(kwargs, prompt=prompt)))

    def create_chat_completion(self, messages: Sequence[dict] | None = None, /,
                               **kwargs: Any) -> dict | Iterator[dict]:
        """A chat reply shaped as OpenAI's ``ChatCompletion`` (``ChatCompletionChunk`` dicts
        when ``stream=True``), as llama-cpp-python's ``Llama.create_chat_completion``: see
        :func:`localllm.api.chat.create_chat_completion` for the keywords (tools,
        ``tool_choice``, ``response_format``, reasoning, logprobs, sampling; checked by
        :class:`~localllm.api.schema.ChatParams`).

        Raises:
            ParameterError: an unknown keyword (named), a malformed message or tool, a value
                out of range. TemplateError: the chat template failed.
            ContextOverflowError, GrammarError: see :meth:`prepare`.
        """
        from .chat import create_chat_completion
        from .schema import ChatParams, parse

        return create_chat_completion(self, parse(ChatParams, _with(kwargs, messages=messages)))


def _with(kwargs: dict, **positional: Any) -> dict:
    """The keywords of an OpenAI-shaped call with its positional argument (given either way;
    keywords are positional-only-safe: a body field named ``self`` is just an unknown one)."""
    out = dict(kwargs)
    for name, value in positional.items():
        if value is not None:
            if name in out:
                raise ParameterError(f"{name} given twice (positionally and by keyword)")
            out[name] = value
    return out
