"""A multi-turn conversation with a model: its messages, its KV cache, its context shift.

Each turn renders the whole conversation with the chat template and generates through the
LLM's one generation path (:meth:`LLM.prepare` / :meth:`LLM.stream`, under the LLM's lock);
the decode loop keeps the longest common prefix of the session's cache and evaluates only the
new tokens, so the cost of a turn does not grow with the history. When the context fills, the oldest whole messages
are dropped (the system prompt and the messages inside the first ``keep`` tokens stay) and
what changed is recomputed: llama.cpp's context shift (``tools/main/main.cpp``), done on
message boundaries so that the template still sees a well-formed conversation.

:class:`Conversation` prints nothing: :meth:`Conversation.reply` hands text pieces and
context-shift events to callbacks (the ``chat`` REPL in :mod:`localllm.cli.repl` prints them).

Small models loop ("a tale of endless love, a tale of endless love, ..." until the context
is full): a reply that becomes an exact repetition is stopped by :class:`LoopGuard`
(``stats.finish == "loop"``); ``n_predict`` caps a reply's length.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from ..errors import ContextOverflowError, LocalLLMError, ParameterError
from ..runtime.stop import cut_at_stop
from .replies import chat_format
from .template import ChatTemplate, template_for


@dataclasses.dataclass
class TurnStats:
    """Figures of the last reply: tokens, seconds, prompt tokens evaluated and reused.

    ``finish``: "eog", "length", "stop", "ctx" (full, context shift off), "full" (full and
    no older message left to drop), "loop" (stopped by the :class:`LoopGuard`),
    "interrupted" (Ctrl-C), or None.
    """

    generated: int = 0
    seconds: float = 0.0
    prompt_evaluated: int = 0
    prompt_reused: int = 0
    finish: str | None = None
    first_token_seconds: float = 0.0


class LoopGuard:
    """Detects a reply that has become an exact loop: its last ``min_tokens`` or more tokens
    repeat one block of at most ``max_period`` tokens at least ``min_repeats`` times.

    For each period p, the number of consecutive latest tokens equal to the token p places
    before is kept, so :meth:`push` costs O(``max_period``) per token. llama.cpp's remedies
    (DRY, the repetition penalties) reshape the distribution; this one only stops, which
    changes no reply that does not loop.
    """

    def __init__(self, *, min_tokens: int = 64, max_period: int = 128,
                 min_repeats: int = 3) -> None:
        self.min_tokens, self.max_period, self.min_repeats = min_tokens, max_period, min_repeats
        self.tokens: list[int] = []
        self.runs = [0] * (max_period + 1)

    def push(self, token: int) -> bool:
        """Add a generated token; True when the reply now loops."""
        self.tokens.append(token)
        n = len(self.tokens)
        for p in range(1, min(self.max_period, n - 1) + 1):
            run = self.runs[p] + 1 if self.tokens[n - 1 - p] == token else 0
            self.runs[p] = run
            span = run + p
            if span >= self.min_tokens and span >= self.min_repeats * p:
                return True
        return False


class Conversation:
    """A conversation: the messages, the window the model sees, and a session (KV cache).

    Args:
        llm: a :class:`localllm.LLM` (or an object with ``tokenizer``, ``metadata``,
            ``session()``, ``sampling_params()``, ``prepare()``/``stream()`` and optionally
            ``entry``/``path``).
        make_sampler: ``params -> sampler`` (an object with ``sample``, ``accept``,
            ``accept_prompt``, ``last_trace``), built afresh for every reply; default: the
            chain :meth:`LLM.stream` builds from ``params``.
        template: the chat template (default: :func:`template_for` the model).
        params: sampling parameters handed to ``make_sampler`` (default:
            ``llm.sampling_params()``).
        system: system prompt.
        keep: messages lying within the first ``keep`` tokens of the conversation are never
            dropped by a context shift (the system prompt never is); -1 keeps them all.
        context_shift: False ends a reply that fills the context instead of shifting.
        stop: stop strings.
        n_predict: most tokens per reply (-1: no limit; 0: none).
        session: the session to use (default: ``llm.session()``).
        loop_guard: stop a reply that loops (:class:`LoopGuard`).
        reasoning_format: ``none`` leaves a thinking model's reasoning in the reply;
            ``deepseek``/``auto`` (llama.cpp's ``--reasoning-format``) split it off: it goes to
            ``reply``'s ``emit_thinking`` and the message's ``reasoning_content``.
        reasoning_budget: reasoning tokens per reply (-1: no limit; 0: none where the
            template allows; a spent budget closes the block and the answer follows).
        variables: more template variables (``--chat-template-kwargs``: ``enable_thinking``).
    Raises:
        ParameterError: ``keep`` < -1.
    """

    def __init__(
        self,
        llm,
        *,
        make_sampler: Callable | None = None,
        template: ChatTemplate | None = None,
        params=None,
        system: str | None = None,
        keep: int = 0,
        context_shift: bool = True,
        stop: Sequence[str] = (),
        n_predict: int = -1,
        session=None,
        loop_guard: bool = True,
        reasoning_format: str = "auto",
        reasoning_budget: int = -1,
        variables: dict | None = None,
    ) -> None:
        if keep < -1:
            raise ParameterError(f"--keep must be >= -1, got {keep}")
        self.llm = llm
        self.tokenizer = llm.tokenizer
        self.template = template or template_for(llm)
        self.params = params if params is not None else llm.sampling_params()
        self.make_sampler = make_sampler
        self.session = session or llm.session()
        self.system = system or None
        self.keep = keep
        self.context_shift = context_shift
        self.stop = tuple(stop)
        self.n_predict = n_predict
        self.loop_guard = loop_guard
        self.reasoning_format = reasoning_format
        self.reasoning_budget = reasoning_budget
        self.variables = dict(variables or {})
        self.fmt = chat_format(self.template.source)
        self.messages: list[dict] = []  # the whole history (system prompt apart)
        self.window_start = 0  # messages before it (and after the pinned ones) were shifted out
        self.pinned = 0  # leading messages kept by ``keep``
        self.stats = TurnStats()
        self.last_reply_ids: list[int] = []  # token ids of the last reply (end of turn apart)

    @property
    def ctx_size(self) -> int:
        return self.session.ctx_size

    def window(self) -> list[dict]:
        """The messages the model sees: system, pinned, then the unshifted tail."""
        start = max(self.window_start, self.pinned)
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.messages[: self.pinned] + self.messages[start:]

    def _encode(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        return self.template.encode(self.tokenizer, messages, add_generation_prompt,
                                    **self.variables)

    def clear(self) -> None:
        """Forget the conversation and empty the KV cache."""
        self.messages = []
        self.window_start = self.pinned = 0
        self.session.reset()

    def load_messages(self, messages: list[dict]) -> None:
        """Replace the conversation (a leading system message becomes the system prompt).
        The cache is kept: the next turn reuses whatever prefix still matches."""
        system = None
        if messages and messages[0]["role"] == "system":
            system, messages = messages[0]["content"], messages[1:]
        self.system = system
        self.messages = [dict(m) for m in messages]
        self.window_start = self.pinned = 0

    # ---- the window -----------------------------------------------------------------------
    def _fit_prompt(self) -> list[int]:
        """Prompt ids of the window, shifting old messages out until it fits with room to
        generate.

        Raises:
            ContextOverflowError: it cannot fit (the user message is removed).
        """
        ids = self._encode(self.window())
        while len(ids) + 1 > self.ctx_size:
            if not self.context_shift or not self._drop_oldest():
                last = self.messages.pop()  # the message that does not fit
                n_msg = len(self._encode([last], add_generation_prompt=False))
                if n_msg + 1 > self.ctx_size:
                    raise ContextOverflowError(
                        f"the message is {n_msg} tokens; the context holds {self.ctx_size} "
                        "(raise --ctx-size or shorten it)")
                raise ContextOverflowError(
                    f"the context is full ({len(ids)} of {self.ctx_size} tokens): "
                    "/clear, or run without --no-context-shift")
            ids = self._encode(self.window())
        return ids

    def _drop_oldest(self) -> bool:
        """Shift the oldest droppable message out of the window; False when none is left.

        The message being answered (the last user message) is never dropped.
        """
        if self.keep and self.pinned == 0 and self.window_start == 0:
            self.pinned = self._count_pinned()
        start = max(self.window_start, self.pinned)
        last_user = max(i for i, m in enumerate(self.messages) if m["role"] == "user")
        if start >= last_user:
            return False
        self.window_start = start + 1
        # Do not leave the window opening on an assistant/tool turn.
        while (self.window_start < last_user
               and self.messages[self.window_start]["role"] != "user"):
            self.window_start += 1
        return True

    def _count_pinned(self) -> int:
        """How many leading messages end within the first ``keep`` tokens (-1: all but the
        message being answered)."""
        if self.keep < 0:
            return max(0, len(self.messages) - 1)
        head = [{"role": "system", "content": self.system}] if self.system else []
        n = 0
        while n < len(self.messages) - 1:
            if len(self._encode(head + self.messages[: n + 1], False)) > self.keep:
                break
            n += 1
        return n

    # ---- a turn ---------------------------------------------------------------------------
    def reply(
        self,
        emit: Callable[[str], None] = lambda text: None,
        on_shift: Callable[[int, int, int], None] = lambda dropped, before, after: None,
        emit_thinking: Callable[[str], None] = lambda text: None,
    ) -> str:
        """Answer the last user message; the reply is added to the messages and returned.

        Text pieces go to ``emit`` as they are generated (stop strings never appear);
        ``on_shift(dropped_messages, tokens_before, tokens_after)`` reports a context shift
        in the middle of the reply, after the piece that filled the context. Ctrl-C ends the
        reply early (``stats.finish == "interrupted"``); the partial reply is kept. With a
        thinking template (and ``reasoning_format`` other than ``none``) the reasoning goes to
        ``emit_thinking`` instead, and the answer alone is returned.

        Raises:
            LocalLLMError: the prompt cannot fit, or the template failed (the user message
                is then removed, and the conversation goes on).
        """
        self.stats = stats = TurnStats()
        self.last_reply_ids = reply_ids = []
        asked = self.messages[-1]
        try:
            prompt = self._fit_prompt()
        except LocalLLMError:
            if self.messages and self.messages[-1] is asked:
                self.messages.pop()
            raise
        shown: list[str] = []
        state = {"prompt": prompt, "shift": None, "gave_up": False}

        def shift(generated: list[int]) -> list[int] | None:
            if not self.context_shift:
                return None
            n_before = len(self.session.tokens)
            target = self.ctx_size * 3 // 4  # leave room to go on after the shift
            ids, dropped = state["prompt"], 0
            while len(ids) + len(generated) > target and self._drop_oldest():
                dropped += 1
                ids = self._encode(self.window())
            if dropped == 0 or len(ids) + len(generated) + 1 > self.ctx_size:
                state["gave_up"] = True
                return None
            state["prompt"] = ids
            state["shift"] = (dropped, n_before, len(ids) + len(generated))
            return ids + generated

        parser, thinking = self._reasoning()
        parts: dict[str, list[str]] = {"content": [], "reasoning": []}

        def show(piece: str) -> None:
            if parser is None:
                emit(piece)
                return
            for event in parser.push(piece):
                route(event)

        def route(event) -> None:
            if event.kind == "reasoning":
                parts["reasoning"].append(event.text)
                emit_thinking(event.text)
            elif event.kind in ("content", "drop"):
                parts["content"].append(event.text)
                emit(event.text)

        sampler = self.make_sampler(self.params) if self.make_sampler is not None else None
        extra = {"thinking": thinking} if thinking is not None else {}
        request = self.llm.prepare(prompt, params=self.params, session=self.session,
                                   n_predict=self.n_predict, stop=self.stop,
                                   on_context_full=shift, sampler=sampler, **extra)
        guard = LoopGuard() if self.loop_guard else None
        t0 = time.perf_counter()
        generation = self.llm.stream(request)
        try:
            with generation:
                for step in generation:
                    if step.token >= 0 and step.finish_reason != "eog":
                        reply_ids.append(step.token)
                    if step.text:
                        shown.append(step.text)
                        show(step.text)
                    if state["shift"] is not None:
                        on_shift(*state["shift"])
                        state["shift"] = None
                    stats.finish = step.finish_reason
                    if (guard is not None and step.finish_reason is None
                            and guard.push(step.token)):
                        stats.finish = "loop"
                        break
        except KeyboardInterrupt:
            stats.finish = "interrupted"
        if stats.finish in ("interrupted", "loop"):
            # Text the loop still held back (incomplete UTF-8, a possible stop string).
            full, _ = cut_at_stop(self.tokenizer.decode(reply_ids), self.stop)
            done = "".join(shown)
            if full.startswith(done) and len(full) > len(done):
                shown.append(full[len(done):])
                show(full[len(done):])
        if stats.finish == "ctx" and state["gave_up"]:
            stats.finish = "full"
        stats.generated = len(reply_ids)
        stats.seconds = time.perf_counter() - t0
        timings = generation.timings
        stats.first_token_seconds = timings.first_token_seconds
        stats.prompt_evaluated = timings.prompt_tokens
        stats.prompt_reused = timings.reused_tokens
        text = "".join(shown)
        message = {"role": "assistant", "content": text}
        if parser is not None:
            for event in parser.finish():
                route(event)
            message["content"] = text = "".join(parts["content"])
            if parts["reasoning"]:
                message["reasoning_content"] = "".join(parts["reasoning"])
        # The partial reply of an interrupted or cut turn is kept: the template closes it.
        self.messages.append(message)
        return text

    def _reasoning(self):
        """(the reply parser that splits the reasoning off, or None; the budget's
        :class:`~localllm.grammar.lazy.Thinking`, or None) for a thinking template."""
        fmt = self.fmt
        if fmt.thinking is None:
            return None, None
        from .reasoning import generation_prompt, opens_thinking, thinking_control
        from .replies import ReplyParser

        window = self.window()
        text = self.template.render(window, True, **self.variables)
        inside = False
        if not fmt.harmony:
            bare = self.template.render(window, False, **self.variables)
            inside = opens_thinking(generation_prompt(text, bare), fmt.thinking)
        parser = None
        if self.reasoning_format != "none":
            parser = ReplyParser(fmt, reasoning=True, inside=inside)
        thinking = None
        if self.reasoning_budget >= 0:
            thinking = thinking_control(self.tokenizer, fmt, inside, self.reasoning_budget)
        return parser, thinking


__all__ = ["Conversation", "LoopGuard", "TurnStats"]
