"""The decode loop: a generator of :class:`Step` that every front end consumes.

``generate_tokens`` prefills the prompt (reusing whatever prefix the session's cache
already holds), then samples, yields and feeds back one token at a time until an
end-of-generation token, ``n_predict`` tokens, a full context, a stop string, or the
constraint (grammar) completes. With a drafter (:mod:`localllm.runtime.speculative`) each
fed-back token goes with the tokens guessed to follow it, all evaluated in one forward; the
guesses the sampler agrees with are then taken without another forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from ..tokenizer import StreamDecoder
from .session import Session, prefill
from .speculative import Drafter
from .stop import StopMatcher

# Most tokens drafted per step (llama.cpp's --draft-max default is 16; on the CPU the native
# GEMV reads the weights once for up to 8 rows, the token and 7 guesses).
DRAFT_MAX = 7


@dataclass
class Step:
    """One generated token.

    Attributes:
        token: the token id (-1 for the closing step that only carries text/finish_reason).
        text: text released by this step (may be empty while UTF-8 or a possible stop string
            is held back).
        logprob: log-probability of ``token`` under the raw model distribution (read from
            the device on first access: on a GPU that is a sync, so only when asked for).
        finish_reason: set on the last step: "eog", "length", "ctx", "stop" or "grammar".
    """

    token: int
    text: str
    _logprob: torch.Tensor | float | None = field(default=None, repr=False)
    finish_reason: str | None = None
    trace: object | None = None

    @property
    def logprob(self) -> float | None:
        if isinstance(self._logprob, torch.Tensor):
            self._logprob = float(self._logprob)
        return self._logprob


@dataclass
class Timings:
    """Wall-clock figures of one generation (seconds, tokens)."""

    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    reused_tokens: int = 0
    first_token_seconds: float = 0.0
    extra: dict = field(default_factory=dict)


def generate_tokens(
    session: Session,
    prompt_ids: Sequence[int],
    sampler,
    *,
    n_predict: int = -1,
    stop: Sequence[str] = (),
    constraint=None,
    timings: Timings | None = None,
    on_context_full: Callable[[list[int]], Sequence[int] | None] | None = None,
    drafter: Drafter | None = None,
    draft_max: int = DRAFT_MAX,
    draft_min: int = 0,
    preserved: Collection[int] = (),
) -> Iterator[Step]:
    """Generate from ``prompt_ids``; yields one :class:`Step` per token.

    Args:
        sampler: a :class:`localllm.sampling.chain.SamplerChain` (``sample``, ``accept``,
            ``accept_prompt``, ``last_trace``).
        n_predict: most tokens to generate (-1 or -2: until the context is full; 0: none,
            as llama.cpp: the prompt is not evaluated and one closing step with token -1 and
            finish_reason "length" is yielded).
        stop: strings that end generation; never included in the text.
        constraint: a grammar constraint; generation ends when it is finished.
        timings: filled in as generation goes.
        on_context_full: the context shift. When the next token no longer fits, it is called
            with the tokens generated so far and returns the ids the cache should hold
            instead (a shorter prompt followed by those tokens; the common prefix is reused),
            or None to finish with "ctx". Without it a full context finishes with "ctx".
        drafter: speculative decoding (llama.cpp's ``--model-draft`` / lookup decoding):
            after each token, up to ``draft_max`` guessed next tokens (none when fewer than
            ``draft_min`` are proposed) are evaluated with it in one forward, and each
            position is sampled from those logits while the samples agree with the guesses.
            The sampler sees exactly the logits and history of plain decoding, so the
            output is the same (see :mod:`localllm.runtime.speculative`); memories that
            cannot forget rejected guesses cheaply (recurrent states) are not drafted for.
            ``timings.extra`` gets ``draft_tokens`` and ``draft_accepted``.
        preserved: control tokens whose text appears in the steps' text (a chat format's
            markers: harmony's channels, Mistral's ``[TOOL_CALLS]``); others show nothing.
    Raises:
        ContextOverflowError: the prompt does not fit in the context.
    """
    tok = session.loaded.tokenizer
    timings = timings if timings is not None else Timings()
    if n_predict == 0:
        yield Step(-1, "", None, "length")
        return
    t0 = time.perf_counter()
    logits, timings.reused_tokens = prefill(session, prompt_ids)
    sampler.accept_prompt(prompt_ids)  # penalties see the prompt, as in llama.cpp's main loop
    timings.prompt_tokens = len(prompt_ids) - timings.reused_tokens
    timings.prompt_seconds = time.perf_counter() - t0
    decoder = StreamDecoder(tok, preserved=preserved)
    stopper = StopMatcher(stop)

    def remaining_text() -> str:
        # End of generation: release held-back UTF-8 bytes and possible stop-string starts.
        tail, stopped = stopper.push(decoder.flush())
        return tail + ("" if stopped else stopper.flush())

    t1 = time.perf_counter()
    n = 0
    generated: list[int] = []
    # Drafted tokens the session holds beyond the last sampled token, each with the logits
    # that follow it (row j of the verifying forward).
    queue: list[tuple[int, torch.Tensor]] = []
    if drafter is not None and not session.memory.cheap_rewind:
        drafter = None
    if drafter is not None:
        timings.extra.update(draft_tokens=0, draft_accepted=0)
    context = list(prompt_ids)

    def drop_queue() -> None:
        if queue:
            session.truncate(session.n_past - len(queue))
            queue.clear()

    while True:
        token = sampler.sample(logits)
        sampler.accept(token)
        generated.append(token)
        context.append(token)
        n += 1
        timings.generated_tokens = n
        if n == 1:
            timings.first_token_seconds = time.perf_counter() - t0
        logprob = logits[token] - torch.logsumexp(logits, -1)  # stays on the device
        trace = sampler.last_trace
        if token in tok.eog_ids:  # --ignore-eos masks these in the sampler
            tail = remaining_text()  # may complete a stop string held back for a longer one
            drop_queue()
            yield Step(token, tail, logprob, "stop" if stopper.stopped else "eog", trace)
            break
        text, stopped = stopper.push(decoder.push(token))
        if stopped:
            drop_queue()
            yield Step(token, text, logprob, "stop", trace)
            break
        finish = refill = None
        if constraint is not None and constraint.is_finished():
            finish = "grammar"
        elif n_predict >= 0 and n >= n_predict:
            finish = "length"
        elif session.n_past - len(queue) + 1 > session.ctx_size:
            refill = on_context_full(list(generated)) if on_context_full is not None else None
            finish = None if refill else "ctx"
        if finish:
            text += remaining_text()
            drop_queue()
            yield Step(token, text, logprob, "stop" if stopper.stopped else finish, trace)
            break
        yield Step(token, text, logprob, None, trace)
        if refill:  # context shift: recompute what changed, go on from the new last token
            drop_queue()
            logits, reused = prefill(session, refill)
            timings.reused_tokens += reused
            timings.prompt_tokens += len(refill) - reused
            context = list(refill)
        elif queue and queue[0][0] == token:  # the guess was right: its logits are computed
            logits = queue.pop(0)[1]
            timings.extra["draft_accepted"] += 1
        else:
            drop_queue()
            room = session.ctx_size - session.n_past - 1
            drafts = drafter.propose(context, min(draft_max, room)) if drafter else []
            if drafts and len(drafts) >= max(draft_min, 1):
                rows = session.eval([token, *drafts], all_logits=True)
                logits = rows[0]
                queue = list(zip(drafts, rows[1:]))
                timings.extra["draft_tokens"] += len(drafts)
            else:
                logits = session.eval([token])
        timings.generate_seconds = time.perf_counter() - t1
    timings.generate_seconds = time.perf_counter() - t1
