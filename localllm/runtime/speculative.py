"""Speculative decoding: cheap guesses of the next tokens, verified by the model in one
batched forward (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding"; Chen et al. 2023). A decode step on a memory-bound machine costs one read of the
weights whether it evaluates one token or eight, so every guessed token the model agrees
with is nearly free.

Two drafters, llama.cpp's (``common/speculative.cpp``, ``common/ngram-cache.cpp``):

* :class:`NgramDrafter` — prompt lookup (Saxena 2023): the last ``n`` tokens are looked up
  earlier in the context, and the tokens that followed them are the guess. No second model;
  pays off when the output copies the input (editing code, reformatting, quoting).
* :class:`ModelDrafter` — a smaller model with the same vocabulary drafts greedily, stopping
  where its own top probability falls under ``p_min`` (``--draft-p-min``).

Verification (:func:`localllm.runtime.generate.generate_tokens`) is llama.cpp's: the target
samples each position with its full sampler chain from the logits of the batched forward and
keeps the draft while they agree. With deterministic drafts this is Leviathan et al.'s
rejection sampling with a one-point draft distribution (accept ``d`` with probability
``p(d)``; on rejection draw from ``p`` without ``d``), so every token is drawn from exactly
the distribution plain decoding draws it from — with the same random numbers: a seeded run
gives the same text with and without drafting (up to the batched forward's float32 rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from ..errors import ParameterError
from .session import prefill

# llama.cpp's SPEC_VOCAB_MAX_SIZE_DIFFERENCE: a draft model's vocabulary may be this much
# larger or smaller than the target's (padding), no more.
MAX_VOCAB_DIFFERENCE = 128
# Tokens whose text must agree between the two vocabularies (llama.cpp checks from id 5).
CHECK_FROM = 5


class Drafter(Protocol):
    """Proposes tokens that may follow a context."""

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """At most ``k`` token ids guessed to follow ``context`` (may be empty)."""


class NgramDrafter:
    """Prompt lookup decoding: the longest suffix of ``n_max`` down to ``n_min`` tokens that
    occurred earlier in the context proposes the tokens that followed its latest earlier
    occurrence: at most ``2 ** n - 1`` of them for a suffix of n tokens (1, 3, 7 ...), since
    a short match predicts a short run. On the copy tasks of ``bench/bench_speculative.py``
    this cap took the code-editing task from 93 accepted of 175 drafted tokens to 96 of 134
    (fewer wasted verifications) and changed the others by a token or two.

    The n-gram index is kept between calls and extended with the new tokens, so a step costs
    O(n_max) dictionary lookups rather than a scan of the context; a context that does not
    extend the previous one (a new request) rebuilds it.

    Raises:
        ParameterError: ``n_max`` < 1, or ``n_min`` not in 1 .. n_max.
    """

    def __init__(self, n_max: int = 3, n_min: int | None = None) -> None:
        if n_min is None:
            n_min = min(2, n_max)
        if n_max < 1 or not 1 <= n_min <= n_max:
            raise ParameterError(f"n-gram sizes must satisfy 1 <= min <= max, got {n_min}, "
                                 f"{n_max}")
        self.n_max, self.n_min = n_max, n_min
        self._seen: list[int] = []
        # n -> n-gram -> the position after its latest occurrence whose successor is known
        self._index: list[dict[tuple[int, ...], int]] = [{} for _ in range(n_max + 1)]

    def _sync(self, context: Sequence[int]) -> None:
        seen = self._seen
        keep = len(seen)
        if keep > len(context) or list(context[:keep]) != seen:
            self._seen, self._index = [], [{} for _ in range(self.n_max + 1)]
            keep = 0
        ctx = list(context)
        # index the n-grams that end at j for every j whose successor j + 1 is in the context
        start = max(0, keep - 1)
        for j in range(start, len(ctx) - 1):
            for n in range(1, min(self.n_max, j + 1) + 1):
                self._index[n][tuple(ctx[j - n + 1 : j + 1])] = j + 1
        self._seen = ctx

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not context:
            return []
        self._sync(context)
        ctx = self._seen
        for n in range(min(self.n_max, len(ctx)), self.n_min - 1, -1):
            at = self._index[n].get(tuple(ctx[-n:]))
            if at is not None:
                return ctx[at : at + min(k, 2**n - 1)]
        return []


def check_draft_vocabulary(target, draft) -> None:
    """Refuse a draft model whose tokens would not mean the target's (llama.cpp's
    ``common_speculative_are_compatible``): the same vocabulary type, BOS/EOS ids and
    add-BOS flag, sizes within :data:`MAX_VOCAB_DIFFERENCE`, and the same token texts.

    ``target``, ``draft``: :class:`localllm.tokenizer.Tokenizer`.

    Raises:
        ParameterError: saying which property differs.
    """
    why = None
    if target.model_type != draft.model_type:
        why = f"vocabulary types differ ({target.model_type} vs {draft.model_type})"
    elif abs(target.n_vocab - draft.n_vocab) > MAX_VOCAB_DIFFERENCE:
        why = (f"vocabulary sizes differ by more than {MAX_VOCAB_DIFFERENCE} "
               f"({target.n_vocab} vs {draft.n_vocab})")
    elif (target.bos_id, target.eos_id, target.add_bos) != \
            (draft.bos_id, draft.eos_id, draft.add_bos):  # fmt: skip
        why = "BOS/EOS tokens or add_bos differ"
    else:
        n = min(target.n_vocab, draft.n_vocab)
        bad = next((i for i in range(CHECK_FROM, n) if target.tokens[i] != draft.tokens[i]),
                   None)
        if bad is not None:
            why = (f"token {bad} differs ({target.tokens[bad][:20]!r} vs "
                   f"{draft.tokens[bad][:20]!r})")
    if why:
        raise ParameterError(f"--model-draft: the draft model's vocabulary does not match the "
                             f"target's: {why}")


class ModelDrafter:
    """Greedy drafts from a smaller model of the same vocabulary.

    Args:
        session: a :class:`~localllm.runtime.session.Session` of the draft model; its memory
            follows the target's context (the common prefix is reused between steps).
        p_min: stop drafting where the draft's top probability is below this
            (llama.cpp's ``--draft-p-min``, default 0.8).
        n_vocab: the target's vocabulary size (draft ids at or above it are never proposed).
    """

    def __init__(self, session, *, p_min: float = 0.8, n_vocab: int | None = None) -> None:
        if not 0.0 <= p_min <= 1.0:
            raise ParameterError(f"--draft-p-min must be in 0..1, got {p_min}")
        self.session, self.p_min = session, p_min
        self.n_vocab = n_vocab if n_vocab is not None else session.loaded.tokenizer.n_vocab

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        s = self.session
        k = min(k, s.ctx_size - len(context))
        if k <= 0 or not context:
            return []
        logits, _ = prefill(s, list(context))
        out: list[int] = []
        while True:
            probs = torch.softmax(logits[: self.n_vocab].float(), -1)
            p, tok = probs.max(-1)
            if float(p) < self.p_min:
                break
            out.append(int(tok))
            if len(out) >= k:
                break
            logits = s.eval([out[-1]])
        return out


class Speculation:
    """A model's speculative decoding setup, made once per ``LLM``: the drafter of each
    generation (a fresh :class:`NgramDrafter`, or a :class:`ModelDrafter` over one
    persistent session of the draft model, so that consecutive generations reuse its prefix)
    and the draft sizes.

    Args:
        target: the :class:`~localllm.runtime.session.LoadedModel` being sped up.
        ctx_size: the target's context size (the draft session's too).
        draft: a loaded draft model (``--model-draft``), or None.
        ngram: prompt-lookup n-gram size (``--spec-ngram``; 0: off). With a draft model too,
            the draft model is used.
        draft_max, draft_min, p_min: llama.cpp's ``--draft-max``, ``--draft-min``,
            ``--draft-p-min``.
    Raises:
        ParameterError: the draft model's vocabulary does not match the target's
            (:func:`check_draft_vocabulary`), or a size is out of range.
    """

    def __init__(self, target, ctx_size: int, *, draft=None, ngram: int = 0,
                 draft_max: int = 7, draft_min: int = 0, p_min: float = 0.8) -> None:
        from .session import Session

        if draft_max < 1 or draft_min < 0 or draft_min > draft_max:
            raise ParameterError(f"--draft-min {draft_min} and --draft-max {draft_max} must "
                                 "satisfy 0 <= min <= max, max >= 1")
        if draft is not None:
            check_draft_vocabulary(target.tokenizer, draft.tokenizer)
        self.draft_max, self.draft_min, self.ngram, self.p_min = draft_max, draft_min, ngram, p_min
        self.n_vocab = target.tokenizer.n_vocab
        self.session = Session(draft, ctx_size=ctx_size) if draft is not None else None

    @property
    def enabled(self) -> bool:
        return self.session is not None or self.ngram > 0

    def drafter(self) -> Drafter | None:
        """The drafter of one generation (None when speculation is off)."""
        if self.session is not None:
            return ModelDrafter(self.session, p_min=self.p_min, n_vocab=self.n_vocab)
        return NgramDrafter(self.ngram) if self.ngram > 0 else None

    def describe(self) -> str:
        if self.session is not None:
            return (f"draft model {self.session.loaded.gguf.path.name}, --draft-max "
                    f"{self.draft_max}, --draft-min {self.draft_min}, --draft-p-min {self.p_min}")
        return f"n-gram lookup, n = {self.ngram}, --draft-max {self.draft_max}"
