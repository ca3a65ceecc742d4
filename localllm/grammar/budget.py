"""Finishing a JSON value within a token budget, and the key and number rules of JSON output.

A schema-constrained generation that reaches its token limit (``max_tokens``, ``-n``, the
context) in the middle of a value would end with text that does not parse.
:class:`BudgetedConstraint` wraps a JSON :class:`~localllm.grammar.constraint.GrammarConstraint`
and keeps, at every step, the shortest valid completion of the text so far, counted in tokens
of the model's tokenizer: from the parse state of :class:`~localllm.grammar.cursor.JsonCursor`
(open string or number, missing required properties with their smallest values, ``minItems``
still due, separators, closing brackets), checked by llguidance. When the tokens left come
within a margin of that count (the most one token can add to it, from the schema's largest
smallest value), only tokens whose own completion still fits the tokens left remain allowed —
extra properties and longer strings stop fitting first — so the value is always complete when
the budget runs out, provided the budget holds the smallest valid value at all.

It also refuses what llguidance's JSON grammar lets through: a key written twice in one
object (libraries disagree on which value wins), the empty key unless the schema names it, a
declared name spelled with escapes, and a number whose fraction or exponent overflows to
``Infinity`` once parsed.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import numpy as np
import torch

from ..errors import GrammarError
from .constraint import GrammarConstraint
from .cursor import OK, REFUSED, JsonCursor
from .schema import MAX_MINIMAL_BYTES, Schemas, TooLarge, strict_schema

__all__ = ["BudgetedConstraint", "shortest_completion", "strict_schema"]

_TOP_K = 16
# Keywords whose value maps names to subschemas (not a schema itself).
_MAPPINGS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # candidates checked against the budget per step, once steering has begun
_NUMBER_START = frozenset(b"0123456789.eE+-")
_VOCAB_CACHE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Vocab:
    """Per-tokenizer tables: the longest token (bytes); the tokens holding one, two, three
    or more quotes (those that may close a key, depending on where the text is); the
    tokens starting a run of number bytes, and those whose run holds a point or an exponent
    (the only ones that can overflow a number without one)."""

    def __init__(self, tokenizer: Any) -> None:
        quotes: list[list[int]] = [[], [], []]
        numbers, floats, longest = [], [], 1
        for i in range(tokenizer.n_vocab):
            data = tokenizer.token_bytes(i)
            longest = max(longest, len(data))
            n = data.count(0x22)
            if n:
                quotes[min(n, 3) - 1].append(i)
            if data and data[0] in _NUMBER_START:
                numbers.append(i)
                run = data[: next((j for j, b in enumerate(data) if b not in _NUMBER_START),
                                  len(data))]
                if any(c in run for c in b".eE"):
                    floats.append(i)
        self.longest = longest

        def ids(values: list[int]) -> np.ndarray:
            return np.array(sorted(values), dtype=np.int64)

        # quotes[k]: tokens with at least k + 1 quotes.
        self.quotes = [ids(quotes[0] + quotes[1] + quotes[2]), ids(quotes[1] + quotes[2]),
                       ids(quotes[2])]
        self.numbers = ids(numbers)
        self.floats = ids(floats)


def _vocab(tokenizer: Any) -> _Vocab:
    vocab = _VOCAB_CACHE.get(tokenizer)
    if vocab is None:
        vocab = _VOCAB_CACHE[tokenizer] = _Vocab(tokenizer)
    return vocab


def shortest_completion(schema: Any, text: str | bytes) -> str | None:
    """The shortest text we know that turns ``text`` (a prefix of a JSON value as the
    constraint writes it) into a complete value satisfying ``schema``; "" when it is
    complete; None when ``text`` breaks a rule or leaves what we can follow.

    Example: schema ``{"type": "object", "properties": {"a": {"type": "string"}, "b":
    {"type": "integer"}}, "required": ["a", "b"]}`` and text ``{"a": "xy`` give
    ``", "b": 0}``.
    """
    cursor = JsonCursor(Schemas(schema))
    if cursor.feed(text.encode("utf-8") if isinstance(text, str) else text) != OK:
        return None
    try:
        options = cursor.completions()
    except TooLarge:
        return None
    return options[0].decode("utf-8", errors="replace") if options else None


class BudgetedConstraint:
    """A JSON constraint that always leaves room to finish its value within the budget.

    Args:
        inner: the :class:`~localllm.grammar.constraint.GrammarConstraint` built from
            ``schema`` (or any JSON); this object forwards its protocol (``apply``,
            ``is_allowed``, ``accept``, ``reset``, ``is_accepting``, ``is_finished``).
        schema: the JSON schema ``inner`` was built from (``{}`` for any JSON value).
        budget: tokens the generation may sample (``max_tokens``, or what the context holds).
    Raises:
        GrammarError: the schema's smallest value cannot fit in ``budget`` tokens whatever
            the tokenization (longer than ``budget`` times the longest token, or than
            256 KiB): the message names the keyword responsible.
    Attributes:
        smallest: tokens of the smallest valid value (None when unknown).
        margin: tokens one token can add to the shortest completion, at most; steering
            begins when the tokens left are within it of that completion.
        steered: True once the budget limited a choice.
    """

    def __init__(self, inner: Any, schema: Any, budget: int) -> None:
        self.inner = inner
        self.schema = schema
        self.budget = budget
        self._lltok = inner._lltok
        self._vocab = _vocab(inner.tokenizer)
        cap = min(MAX_MINIMAL_BYTES, max(budget, 1) * self._vocab.longest)
        self._ranges: dict[str, Any] = {}
        self._nav = Schemas(schema, max_bytes=cap, accepts=self._number_fits)
        try:
            smallest = self._nav.minimal(schema)
            self.margin = self._margin()
        except TooLarge as e:
            raise GrammarError(
                f"{inner.source}: the smallest value the schema allows ({e.where}) cannot fit "
                f"in {budget} tokens") from None
        self.smallest = None if smallest is None else len(self._tokens(smallest))
        self.reset_budget()

    def _number_fits(self, s: dict, text: str) -> bool:
        """Whether llguidance takes ``text`` for a number under ``s``'s type and bounds (its
        range expressions refuse a few values inside them): one small grammar per range."""
        keys = ("type", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
                "multipleOf")
        part = {k: s[k] for k in keys if k in s}
        if len(part) == ("type" in part):
            return True  # no bounds: any number the search writes is plain JSON
        key = json.dumps(part, sort_keys=True)
        grammar = self._ranges.get(key)
        if grammar is None:
            try:
                grammar = GrammarConstraint.from_json_schema(part, self.inner.tokenizer)
            except GrammarError:
                grammar = False
            self._ranges[key] = grammar
        return bool(grammar) and grammar.matches(text)

    def _tokens(self, data: bytes) -> list[int]:
        return self._lltok.tokenize_bytes(data) if data else []

    def _margin(self) -> int:
        """The most tokens one generated token can add to the shortest completion: the
        largest smallest value of any subschema it could open, plus a key, separators and
        closing brackets."""
        longest = b""
        todo = [self._nav.root]
        seen: set[int] = set()
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            if isinstance(node, dict):
                try:
                    value = self._nav.minimal(node)
                except TooLarge:  # an optional part that never fits: always steer
                    return max(self.budget, 0)
                if value is not None and len(value) > len(longest):
                    longest = value
                for k, v in node.items():
                    if k in _MAPPINGS and isinstance(v, dict):  # name -> subschema
                        todo.extend(x for x in v.values() if isinstance(x, (dict, list)))
                    elif isinstance(v, (dict, list)) and k not in ("const", "enum", "default",
                                                                   "examples"):
                        todo.append(v)
            elif isinstance(node, list):
                todo.extend(v for v in node if isinstance(v, (dict, list)))
        return len(self._tokens(longest)) + 6

    def reset_budget(self) -> None:
        """Start a new generation: nothing written, the whole budget left."""
        self.n = 0
        self.cursor = JsonCursor(self._nav)
        self.steered = False
        self._plan: list[int] | None = None  # a checked completion of the text so far
        self._plan_at = -1
        self._after: dict[int, tuple[JsonCursor, str, list[int] | None]] = {}

    def __getattr__(self, name: str) -> Any:  # source, tokenizer, matches ... of the inner one
        return getattr(self.inner, name)

    # ---- the budget --------------------------------------------------------------------------
    def _best(self, cursor: JsonCursor, matcher: Any) -> list[int] | None:
        """The fewest tokens that complete the value from ``cursor``'s state which
        llguidance accepts from ``matcher``'s (not modified), or None."""
        try:
            options = cursor.completions()
        except TooLarge:
            return None
        for tokens in sorted((self._tokens(c) for c in options), key=len):
            m = matcher.deep_copy()
            if m.validate_tokens(tokens) == len(tokens):
                m.consume_tokens(tokens)
                if m.is_accepting() and not m.is_error():
                    return tokens
        return None

    def _now(self) -> list[int] | None:
        """The shortest checked completion of the text so far, recomputed once per step."""
        if self._plan_at != self.n:
            best = self._best(self.cursor, self.inner._matcher) if not self.cursor.lost \
                else None
            if best is not None and (self._plan is None or len(best) <= len(self._plan)):
                self._plan = best
            self._plan_at = self.n
            self._after = {}
        return self._plan

    def _tight(self) -> bool:
        """Whether one free token could leave too few tokens to complete the value."""
        plan = self._now()
        return plan is not None and len(plan) + self.margin > self.budget - self.n - 1

    def _judge(self, token: int, tight: bool) -> bool:
        """Whether ``token`` keeps the key and number rules and, when ``tight``, leaves a
        checked completion within the tokens left after it. llguidance has allowed it."""
        self._now()
        cached = self._after.get(token)
        if cached is None and not tight:
            quick = self.cursor.closes_refused_key(self.inner.tokenizer.token_bytes(token))
            if quick is not None:
                return not quick
        if cached is None:
            cursor = self.cursor.copy()
            verdict = cursor.feed(self.inner.tokenizer.token_bytes(token))
            cached = (cursor, verdict, None)
        cursor, verdict, plan = cached
        if verdict == REFUSED:
            self._after[token] = cached
            return False
        if tight and plan is None and verdict == OK:
            matcher = self.inner._matcher.deep_copy()
            matcher.consume_token(token)
            plan = self._best(cursor, matcher)
        self._after[token] = (cursor, verdict, plan)
        if not tight:
            return True
        return plan is not None and len(plan) <= self.budget - self.n - 1

    # ---- the sampler-chain protocol ----------------------------------------------------------
    def is_allowed(self, token: int) -> bool:
        if not self.inner.is_allowed(token):
            return False
        if self.cursor.lost:
            return True
        return self._judge(token, self._tight())

    def apply(self, logits: torch.Tensor) -> None:
        self.inner.apply(logits)
        if self.cursor.lost:
            return
        tight = self._tight()
        n = min(logits.shape[-1], self.inner.n_vocab)
        # Tokens that may break a key or number rule, by where the text is: closing a key
        # takes one quote inside it, two from between members, three from inside a value
        # string; overflowing a number without a point or exponent yet takes a token with one.
        quotes, number = self.cursor.risks()
        checks = []
        if quotes:
            checks.append(self._vocab.quotes[quotes - 1])
        if number:
            checks.append(self._vocab.numbers if number == "float" else self._vocab.floats)
        for ids in checks:
            ids = ids[: np.searchsorted(ids, n)]
            if not len(ids):
                continue
            # numpy on the CPU: torch's indexing of a few thousand entries woke its thread
            # pool, tens of milliseconds on a busy machine.
            values = logits[..., ids].cpu().numpy() if logits.device.type != "cpu" \
                or logits.dim() != 1 else logits.numpy()[ids]
            for token in ids[np.isfinite(values)].tolist():
                if not self._judge(token, False):
                    logits[..., token] = float("-inf")
        if not tight:
            return
        self.steered = True
        k = min(_TOP_K, n)
        top = torch.topk(logits[..., :n], k).indices.tolist()
        keep = [t for t in top if logits[..., t].isfinite().item() and self._judge(t, True)]
        plan = self._now()
        if plan and plan[0] not in keep:
            keep.append(plan[0])
        values = logits[..., keep].clone()
        logits.fill_(float("-inf"))
        logits[..., keep] = torch.where(values.isfinite(), values, torch.zeros_like(values))

    def accept(self, token: int) -> None:
        self.inner.accept(token)
        plan = self._now()
        cached = self._after.get(token)
        if cached is not None and cached[1] != REFUSED:
            self.cursor = cached[0]
            nxt = cached[2]
        else:
            if self.cursor.feed(self.inner.tokenizer.token_bytes(token)) == REFUSED:
                self.cursor.lost = True  # a token forced past the rules: stop steering
            nxt = None
        if nxt is None and plan and plan[0] == token:
            nxt = plan[1:]
        self._plan = nxt
        self.n += 1

    def reset(self) -> None:
        self.inner.reset()
        self.reset_budget()

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()

    def is_finished(self) -> bool:
        """Finished when the grammar is, or when the value is complete and the budget spent
        (a number at the top level could go on, but no token is left for it)."""
        return self.inner.is_finished() or (self.n >= self.budget and self.inner.is_accepting())

