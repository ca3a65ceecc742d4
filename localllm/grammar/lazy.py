"""Constraints that wait: lazy grammars with triggers, and reasoning before the answer.

Both plug into the sampler chain like any constraint (``apply``, ``is_allowed``, ``accept``,
``reset``, ``is_accepting``, ``is_finished``; :mod:`localllm.grammar.constraint`).

* :class:`LazyConstraint` lets the model write freely until a *trigger* — a token (a
  special token that opens a tool call, ``<tool_call>``) or a word (text such as
  ``[TOOL_CALLS]``) — and then constrains the rest by its inner grammar, which is fed the
  trigger first (llama.cpp's ``grammar_lazy`` / ``grammar_triggers``,
  ``common/sampling.cpp``). Before the trigger it masks nothing and runs no parser: a
  membership test and a search in the last few bytes per token.
* :class:`ThinkingControl` runs a reply's reasoning block first and its constraint after:
  the answer's grammar (a JSON schema, a GBNF grammar, a forced or lazy tool call) activates
  once the block's end marker is written, so a template that opens ``<think>`` is not forced
  into JSON at its first token. With a reasoning budget (llama.cpp's ``--reasoning-budget``,
  ``common/reasoning-budget.cpp``) the end marker is forced when the budget is spent, and the
  reasoning is ended early enough that a JSON answer still fits in the generation's token
  budget (its smallest value, :mod:`localllm.grammar.budget`), which it then gets the rest of.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch

from .budget import BudgetedConstraint, shortest_completion

_WS_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
GAP_TOKENS = 2  # whitespace tokens allowed between the reasoning and a constrained answer


def whitespace_tokens(tokenizer: Any) -> torch.Tensor:
    """Ids of the tokens whose text is only whitespace (int64 tensor), cached."""
    ids = _WS_CACHE.get(tokenizer)
    if ids is None:
        ids = torch.tensor([i for i in range(tokenizer.n_vocab)
                            if (b := tokenizer.token_bytes(i)) and not b.strip()],
                           dtype=torch.long)
        _WS_CACHE[tokenizer] = ids
    return ids


class LazyConstraint:
    """Free text until a trigger, then ``inner`` (see the module docstring).

    Args:
        inner: the constraint of what follows the trigger; its grammar starts with the
            trigger itself (the token, or the word's text).
        tokenizer: the model's tokenizer.
        tokens: trigger token ids.
        words: trigger texts (found in the generated text, across token boundaries).
        anchored: words trigger only at the start of the text (after whitespace): Llama
            3.x's calls are the whole reply.
    Attributes:
        active: the trigger has fired.
    """

    def __init__(self, inner: Any, tokenizer: Any, *, tokens: tuple[int, ...] = (),
                 words: tuple[str, ...] = (), anchored: bool = False) -> None:
        self.inner = inner
        self.tokenizer = tokenizer
        self.tokens = frozenset(tokens)
        self.words = tuple(w.encode("utf-8") for w in words if w)
        self.anchored = anchored
        self._keep = max((len(w) for w in self.words), default=0)
        self.active = False
        self._tail = b""
        self._blank = True  # only whitespace so far (anchored words may still trigger)

    def apply(self, logits: torch.Tensor) -> None:
        if self.active:
            self.inner.apply(logits)

    def is_allowed(self, token: int) -> bool:
        return self.inner.is_allowed(token) if self.active else True

    def accept(self, token: int) -> None:
        if self.active:
            self.inner.accept(token)
            return
        if token in self.tokens:
            self.active = True
            self.inner.accept(token)
            return
        if not self.words or (self.anchored and not self._blank):
            return
        data = self._tail + self.tokenizer.token_bytes(token)
        if self.anchored:  # the text so far, leading whitespace apart, must open with a word
            data = data.lstrip()
            for word in self.words:
                if data.startswith(word) and self._fire(data):
                    return
            waiting = any(word.startswith(data) for word in self.words)
            self._blank = waiting
            self._tail = data if waiting else b""
            return
        for word in self.words:
            at = data.find(word)
            if at >= 0 and self._fire(data[at:]):
                return
        self._tail = data[-self._keep:]

    def _fire(self, text: bytes) -> bool:
        """Feed ``text`` (the trigger and what came with it) to the inner constraint; False
        (and nothing fed) when its grammar does not start that way."""
        ids = self.inner._lltok.tokenize_bytes(text)
        matcher = self.inner._matcher.deep_copy()
        if matcher.validate_tokens(ids) != len(ids):
            return False
        self.active = True
        for t in ids:
            self.inner.accept(t)
        return True

    def reset(self) -> None:
        self.active = False
        self._tail = b""
        self._blank = True
        self.inner.reset()

    def is_accepting(self) -> bool:
        return self.inner.is_accepting() if self.active else True

    def is_finished(self) -> bool:
        return self.active and self.inner.is_finished()


@dataclass(frozen=True)
class Thinking:
    """How a reply's reasoning block is run (built by the chat layer from the template).

    Attributes:
        end: the text that closes the block (special-token text included: ``</think>``).
        forced: token ids forced when the budget is spent: the end marker and the
            whitespace the family writes after it.
        start_token: a one-token opening marker the model may write first (``<think>``),
            or None (the reply starts inside the block, or cannot open one).
        inside: the generation prompt opened the block.
        budget: reasoning tokens allowed (-1: no limit; 0: none — an optional block is not
            opened, an open one is closed at once).
        bridge: token ids forced after the end marker before the answer (harmony: the
            header of the ``final`` channel; ``forced`` ends with them too).
        skip: text that, written inside the block, means there was no reasoning and the
            answer begins (harmony: ``<|channel|>final<|message|>``).
    """

    end: str
    forced: tuple[int, ...]
    start_token: int | None = None
    inside: bool = False
    budget: int = -1
    bridge: tuple[int, ...] = ()
    skip: str = ""


class ThinkingControl:
    """Reasoning first, then the answer's constraint (see the module docstring).

    Args:
        thinking: the :class:`Thinking` description.
        answer: the answer's constraint (None: the answer is free; a
            :class:`~localllm.grammar.budget.BudgetedConstraint` gets the token budget left
            after the reasoning).
        tokenizer: the model's tokenizer.
        total: tokens the whole generation may sample (-1: no limit).
        required: the answer must come (its constraint is not lazy): the reply may not end
            inside the reasoning.
    Attributes:
        phase: ``start`` (a block may still open), ``thinking``, ``forcing`` (the budget is
            spent), ``gap`` (whitespace after the block), ``answer``.
        thought: reasoning tokens sampled.
    """

    def __init__(self, thinking: Thinking, answer: Any, tokenizer: Any, *, total: int = -1,
                 required: bool = False) -> None:
        self.thinking = thinking
        self.answer = answer
        self.tokenizer = tokenizer
        self.total = total
        self.required = required and answer is not None
        self._eog = torch.tensor(sorted(tokenizer.eog_ids), dtype=torch.long)
        self._ws = whitespace_tokens(tokenizer) if answer is not None else None
        self._end = thinking.end.encode("utf-8")
        self._skip = thinking.skip.encode("utf-8")
        self._answer_budget = answer.budget if isinstance(answer, BudgetedConstraint) else None
        self.limit = self._limit()
        self.reset()

    def _limit(self) -> int:
        """Reasoning tokens allowed: the budget, and room left for the answer's smallest
        value (a JSON answer) within the whole generation's."""
        limit = self.thinking.budget
        if self.total >= 0:
            reserve = len(self.thinking.forced) + 1
            if self._answer_budget is not None:
                smallest = shortest_completion(self.answer.schema, b"") or ""
                lltok = self.answer._lltok
                reserve += len(lltok.tokenize_bytes(smallest.encode("utf-8"))) + 4
            room = max(0, self.total - reserve)
            limit = room if limit < 0 else min(limit, room)
        return limit

    def reset(self) -> None:
        self.phase = "thinking" if self.thinking.inside else (
            "start" if self.thinking.start_token is not None else "answer")
        self.thought = 0
        self.used = 0  # tokens sampled in all
        self._tail = b""
        self._forcing: list[int] = []
        self._gap = 0
        if self.phase == "thinking" and self.limit == 0:
            self._force()
        if self.answer is not None:
            if self._answer_budget is not None:
                self.answer.budget = self._answer_budget
            self.answer.reset()
        if self.phase == "answer":
            self._enter_answer()

    # ---- phases ----------------------------------------------------------------------------
    def _force(self) -> None:
        self.phase = "forcing"
        self._forcing = list(self.thinking.forced)
        if not self._forcing:
            self._after_block()

    def _after_block(self) -> None:
        self.phase = "gap" if self.answer is not None else "answer"
        self._gap = 0
        if self.phase == "answer":
            self._enter_answer()

    def _enter_answer(self) -> None:
        self.phase = "answer"
        if self._answer_budget is not None and self.used:
            self.answer.budget = max(0, self._answer_budget - self.used)

    # ---- the sampler-chain protocol ----------------------------------------------------------
    def apply(self, logits: torch.Tensor) -> None:
        phase = self.phase
        if phase == "forcing":
            keep = logits[..., self._forcing[0]].clone()
            logits.fill_(float("-inf"))
            logits[..., self._forcing[0]] = keep if bool(keep.isfinite().all()) else 0.0
        elif phase == "thinking":
            if self.required:
                logits[..., self._eog.to(logits.device)] = float("-inf")
        elif phase == "start":
            start = self.thinking.start_token
            keep = logits[..., start].clone()
            if self.answer is not None:
                self.answer.apply(logits)
            if self.thinking.budget != 0:
                logits[..., start] = keep
            else:
                logits[..., start] = float("-inf")
        elif phase == "gap":
            ws = self._ws.to(logits.device)
            keep = logits[..., ws].clone()
            self.answer.apply(logits)
            if self._gap < GAP_TOKENS:
                logits[..., ws] = keep
        elif self.answer is not None:
            self.answer.apply(logits)

    def is_allowed(self, token: int) -> bool:
        phase = self.phase
        if phase == "forcing":
            return token == self._forcing[0]
        if phase == "thinking":
            return not (self.required and token in self.tokenizer.eog_ids)
        if phase == "start":
            if token == self.thinking.start_token:
                return self.thinking.budget != 0
            return self.answer is None or self.answer.is_allowed(token)
        if phase == "gap":
            if self._gap < GAP_TOKENS and self._is_ws(token):
                return True
            return self.answer.is_allowed(token)
        return self.answer is None or self.answer.is_allowed(token)

    def _is_ws(self, token: int) -> bool:
        data = self.tokenizer.token_bytes(token)
        return bool(data) and not data.strip()

    def accept(self, token: int) -> None:
        self.used += 1
        phase = self.phase
        if phase == "start":
            if token == self.thinking.start_token:
                self.phase = "thinking"
                if self.limit == 0:
                    self._force()
                return
            self._enter_answer()
            phase = "answer"
        if phase == "thinking":
            self.thought += 1
            data = self._tail + self.tokenizer.special_bytes(token)
            if self._skip and self._skip in data:
                self._enter_answer()
                return
            if self._end in data:
                if self.thinking.bridge:
                    self.phase = "forcing"
                    self._forcing = list(self.thinking.bridge)
                else:
                    self._after_block()
                return
            self._tail = data[-max(len(self._end), len(self._skip)):]
            if 0 <= self.limit <= self.thought:
                self._force()
        elif phase == "forcing":
            self._forcing.pop(0)
            if not self._forcing:
                self._after_block()
        elif phase == "gap":
            if self._gap < GAP_TOKENS and self._is_ws(token):
                self._gap += 1
                return
            self._enter_answer()
            self.answer.accept(token)
        elif self.answer is not None:
            self.answer.accept(token)

    def is_accepting(self) -> bool:
        """Whether the reply may end here: an answer that must come has come whole."""
        if self.answer is None:
            return True
        if self.phase in ("answer", "start"):
            return self.answer.is_accepting()
        return not self.required

    def is_finished(self) -> bool:
        return self.phase == "answer" and self.answer is not None and self.answer.is_finished()

    @property
    def reasoning_over(self) -> bool:
        """The block has ended (or never opened)."""
        return self.phase in ("gap", "answer")


__all__ = ["GAP_TOKENS", "LazyConstraint", "Thinking", "ThinkingControl", "whitespace_tokens"]
