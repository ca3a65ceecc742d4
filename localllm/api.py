"""The Python API shared by the CLI, the REPL, scripting and perplexity.

    >>> from localllm import LLM
    >>> llm = LLM("gemma3-270m")                     # a models.toml name or a .gguf path
    >>> "".join(llm.generate("The capital of France is", n_predict=16, temp=0))
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from .errors import ContextOverflowError, LocalLLMError, ParameterError
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
        self._session_busy = False
        self._lock = threading.RLock()  # one forward pass at a time

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

    def _take_session(self) -> tuple[Session, bool]:
        """The shared session (cleared) when no other generation holds it, else a fresh one.
        Returns (session, whether it is the shared one)."""
        with self._lock:
            if self._session_busy:
                return self.session(), False
            if self._session is None:
                self._session = self.session()
            self._session_busy = True
            self._session.reset()
            return self._session, True

    def _release_session(self) -> None:
        with self._lock:
            self._session_busy = False

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
            session: generate in this session, reusing the prefix its cache already holds.
                By default the LLM's own session is cleared first (or, while another
                generation uses it, a fresh one is made), so that the same seed and settings
                give the same text on every call.
        Raises:
            ContextOverflowError: the prompt leaves no room to generate in the context.
            ParameterError: a sampling parameter is out of range or of the wrong type, a
                token id is out of range.
            GrammarError: the grammar or schema is invalid.
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
        params = self.sampling_params(params, **sampling)
        if constraint is None and (grammar is not None or json_schema is not None or json):
            from .grammar.constraint import constraint_for

            constraint = constraint_for(self.tokenizer, grammar=grammar, json_schema=json_schema,
                                        json=json)
        return self._generate(ids, session, params, constraint, n_predict, stop)

    def _generate(self, ids, session, params, constraint, n_predict, stop) -> Iterator[Step]:
        shared = False
        if session is None:
            session, shared = self._take_session()
        try:
            if len(ids) >= session.ctx_size:
                raise ContextOverflowError(
                    f"the prompt is {len(ids)} tokens; the context holds {session.ctx_size} "
                    "(raise --ctx-size or shorten the prompt)"
                )
            sampler = build_sampler(params, self.tokenizer, constraint=constraint,
                                    n_ctx=session.ctx_size)
            self.last_sampler = sampler
            self.last_timings = timings = Timings()
            steps = generate_tokens(session, ids, sampler, n_predict=n_predict, stop=stop,
                                    constraint=constraint, timings=timings)
            while True:
                with self._lock:  # one step; never held across the yield
                    step = next(steps, None)
                if step is None:
                    return
                yield step
        finally:
            if shared:
                self._release_session()

    def generate(self, prompt: str | Sequence[int], **kwargs) -> Iterator[str]:
        """Like :meth:`stream`, yielding only the text pieces."""
        for step in self.stream(prompt, **kwargs):
            if step.text:
                yield step.text
