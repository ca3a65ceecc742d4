"""The individual sampling steps of llama.cpp's sampler chain, on full-vocabulary logits.

Every step works in place on one float32 tensor of shape (n_vocab,) on the model's device:
a token is removed by setting its logit to ``-inf``. The "candidates" of llama.cpp's
``llama_token_data_array`` are therefore the finite entries. Steps that depend on history keep
their own window of recent tokens and update it in :meth:`accept`.

Semantics follow llama.cpp's ``src/llama-sampling.cpp`` (penalties, DRY, top-n-sigma, top-k,
typical, top-p, min-p, XTC, temperature/dynamic temperature, mirostat v1/v2, dist); the papers
are named on each class. Where llama.cpp counts masked (-inf) entries as candidates we count
finite entries only; the difference shows only in degenerate cases (a step after a logit bias
of -inf that precedes every truncation).
"""

from __future__ import annotations

import math
import weakref
from collections import Counter, deque
from typing import Protocol

import numpy as np
import torch

from ..errors import LocalLLMError

NEG_INF = float("-inf")
Support = torch.Tensor | None


class Sampler(Protocol):
    """One step of the chain.

    ``apply(logits, support)`` edits ``logits`` (n_vocab,) float32 in place. ``support`` is
    None or int64 ids that contain every finite entry (a hint that spares full-vocabulary
    scans once a truncation has run); ``apply`` returns the support after it.
    """

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support: ...

    def accept(self, token: int) -> None: ...

    def reset(self) -> None: ...


class Selector(Protocol):
    """The last step: picks one token (and may mask ``logits`` to the distribution it drew from)."""

    def select(self, logits: torch.Tensor, support: Support = None) -> int: ...

    def reset(self) -> None: ...


class _Stateless:
    def accept(self, token: int) -> None:
        pass

    def reset(self) -> None:
        pass


def candidates(logits: torch.Tensor, support: Support = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The surviving (finite) entries: (ids int64 (n,), logits float32 (n,)), in id order when
    ``support`` is None, else in support order."""
    if support is None:
        ids = (logits > NEG_INF).nonzero().squeeze(1)
    else:
        ids = support[logits[support] > NEG_INF]
    return ids, logits[ids]


def _drop(logits: torch.Tensor, ids: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Mask ``ids[~keep]`` to -inf; returns ``ids[keep]`` (the new support)."""
    logits[ids[~keep]] = NEG_INF
    return ids[keep]


def _keep_only(logits: torch.Tensor, ids: torch.Tensor) -> None:
    """Mask every entry of ``logits`` except ``ids`` to -inf (in place)."""
    kept = logits[ids]
    logits.fill_(NEG_INF)
    logits[ids] = kept


class Uniform:
    """The chain's one seeded ``torch.Generator`` (CPU, so draws do not depend on the device)."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(seed)

    def draw(self) -> float:
        """One float in [0, 1)."""
        return float(self.draw_tensor())

    def draw_tensor(self) -> torch.Tensor:
        """The same draw as a float64 0-d CPU tensor (the device chain never reads it)."""
        return torch.rand((), generator=self.generator, dtype=torch.float64)

    def reset(self) -> None:
        self.generator.manual_seed(self.seed)


# ---- logit bias, penalties, DRY ---------------------------------------------------------------
class LogitBias(_Stateless):
    """Adds a fixed bias to chosen tokens' logits (``--logit-bias``; -inf bans a token)."""

    def __init__(self, biases: dict[int, float]) -> None:
        self.biases = dict(biases)
        self._ids = torch.tensor(list(self.biases), dtype=torch.int64)
        self._vals = torch.tensor(list(self.biases.values()), dtype=torch.float32)

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support:
        if self.biases:
            if self._ids.device != logits.device:
                self._ids, self._vals = self._ids.to(logits.device), self._vals.to(logits.device)
            logits.index_add_(0, self._ids, self._vals)
        return support


class Penalties:
    """Repetition (CTRL, Keskar et al. 2019), frequency and presence penalties (OpenAI) over the
    last ``last_n`` accepted tokens.

    A repeated token's logit is divided by ``repeat`` when positive and multiplied when not
    (llama.cpp's fix of the paper's plain division), then ``count * freq + present`` is
    subtracted. ``last_n`` 0 disables; None keeps the whole history.
    """

    def __init__(self, last_n: int | None, repeat: float, freq: float, present: float) -> None:
        self.last_n, self.repeat, self.freq, self.present = last_n, repeat, freq, present
        self.window: deque[int] = deque(maxlen=last_n)
        self.counts: Counter[int] = Counter()

    @property
    def enabled(self) -> bool:
        return self.last_n != 0 and (self.repeat != 1.0 or self.freq != 0.0 or self.present != 0.0)

    def accept(self, token: int) -> None:
        if self.last_n == 0:
            return
        if self.window.maxlen is not None and len(self.window) == self.window.maxlen:
            old = self.window[0]
            self.counts[old] -= 1
            if self.counts[old] == 0:
                del self.counts[old]
        self.window.append(token)
        self.counts[token] += 1

    def reset(self) -> None:
        self.window.clear()
        self.counts.clear()

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support:
        if not self.enabled or not self.counts:
            return support
        ids = torch.tensor(list(self.counts), dtype=torch.int64, device=logits.device)
        n = torch.tensor(list(self.counts.values()), dtype=torch.float32, device=logits.device)
        x = logits[ids]
        x = torch.where(x <= 0, x * self.repeat, x / self.repeat)
        logits[ids] = x - (n * self.freq + self.present)
        return support


# DRY limits from llama.cpp: breakers longer than this are cut, and their token tails too.
_DRY_MAX_CHARS = 40
_DRY_MAX_TAIL = 20
_DRY_CACHED_TABLES = 8  # breaker tuples kept per tokenizer (each request may bring its own)
_breaker_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def dry_breaker_table(tokenizer, breakers: tuple[str, ...]) -> dict[int, set[tuple[int, ...]]]:
    """Restart sequences of DRY: head token -> set of tails (token ids that must follow).

    A token whose text contains a breaker is a breaker on its own (empty tail). A token whose
    text ends with a proper prefix of a breaker starts one, completed by the tokenization of the
    rest of the breaker (at most 20 tokens), as llama.cpp's ``get_overlapping_token_sequences``.
    Token texts render control tokens (llama.cpp detokenizes with ``special = true``).
    Cached per tokenizer and breaker tuple (the last few tuples: a bounded cache).
    """
    per_tok = _breaker_cache.setdefault(tokenizer, {})
    if breakers in per_tok:
        per_tok[breakers] = per_tok.pop(breakers)  # most recently used last
        return per_tok[breakers]
    render = getattr(tokenizer, "special_bytes", tokenizer.token_bytes)
    words = [render(i) for i in range(tokenizer.n_vocab)]
    table: dict[int, set[tuple[int, ...]]] = {}
    for text in breakers:
        brk = text.encode("utf-8")[:_DRY_MAX_CHARS]
        if not brk:
            continue
        prefixes = {brk[:k]: k for k in range(1, len(brk))}
        last_bytes = {p[-1] for p in prefixes}
        tails: dict[int, tuple[int, ...]] = {}
        for tok, word in enumerate(words):
            if brk in word:
                table.setdefault(tok, set()).add(())
                continue
            if not word or word[-1] not in last_bytes:
                continue
            for prefix, k in prefixes.items():
                if word.endswith(prefix):
                    if k not in tails:
                        rest = brk[k:].decode("utf-8", errors="replace")
                        ids = tokenizer.encode(rest, add_bos=False, special=False)
                        tails[k] = tuple(ids[:_DRY_MAX_TAIL])
                    table.setdefault(tok, set()).add(tails[k])
    per_tok[breakers] = table
    while len(per_tok) > _DRY_CACHED_TABLES:
        del per_tok[next(iter(per_tok))]
    return table


class DRY:
    """DRY, "Don't Repeat Yourself" (p-e-w, text-generation-webui #5677; llama.cpp's DRY sampler).

    If emitting token t would extend a sequence that already occurred in the last ``last_n``
    tokens by a repeat of length L >= ``allowed_length``, t's logit loses
    ``multiplier * base ** (L - allowed_length)``. Repeats never reach back across a sequence
    breaker, and single-token breakers are never penalized.
    """

    def __init__(self, multiplier: float, base: float, allowed_length: int, last_n: int | None,
                 breakers: dict[int, set[tuple[int, ...]]], n_vocab: int) -> None:
        self.multiplier, self.base, self.allowed = multiplier, base, allowed_length
        self.last_n = last_n
        self.history: deque[int] = deque(maxlen=last_n)
        self.breakers = breakers
        self.is_head = np.zeros(n_vocab, dtype=bool)
        self.is_single = np.zeros(n_vocab, dtype=bool)
        for tok, tails in breakers.items():
            if tok < n_vocab:
                self.is_head[tok] = True
                self.is_single[tok] = () in tails
        # Clamp the exponent so base ** exp stays a finite float32 (as llama.cpp does).
        self.max_exponent = int(88.7228391 / math.log(base)) if base > 1.000001 else 0

    @property
    def enabled(self) -> bool:
        return self.multiplier != 0.0 and self.base >= 1.0 and self.last_n != 0

    def accept(self, token: int) -> None:
        if self.enabled:
            self.history.append(token)

    def reset(self) -> None:
        self.history.clear()

    def _rep_limit(self, rev: np.ndarray) -> int:
        """Distance back to the most recent complete sequence breaker (len(rev) if none)."""
        for i in np.nonzero(self.is_head[rev])[0].tolist():
            longest = -1
            for tail in self.breakers[int(rev[i])]:
                n = len(tail)
                if longest < n <= i and all(tail[o] == rev[i - o - 1] for o in range(n)):
                    longest = n
            if longest >= 0:
                return i - longest
        return len(rev)

    def penalties(self) -> tuple[np.ndarray, np.ndarray]:
        """Tokens to penalize and their penalties (int64 (m,), float32 (m,))."""
        empty = np.zeros(0, np.int64), np.zeros(0, np.float32)
        n = len(self.history)
        if not self.enabled or n <= self.allowed:
            return empty
        h = np.fromiter(self.history, dtype=np.int64, count=n)
        rep_limit = self._rep_limit(h[::-1])
        if rep_limit < self.allowed:
            return empty
        # length[j]: how many tokens ending at h[j] equal the tokens ending at h[-1]. Lengths
        # beyond allowed + max_exponent give the same penalty, so the extension stops there.
        cap = rep_limit if self.max_exponent == 0 else min(rep_limit, self.allowed + self.max_exponent)
        length = np.zeros(n - 1, dtype=np.int64)
        alive = np.nonzero(h[:-1] == h[-1])[0]
        step = 0
        while alive.size and step < cap:
            step += 1
            length[alive] = step
            alive = alive[alive >= step]
            alive = alive[h[alive - step] == h[n - 1 - step]]
        hit = np.nonzero(length >= self.allowed)[0]
        if hit.size == 0:
            return empty
        following = h[hit + 1]
        tokens, inverse = np.unique(following, return_inverse=True)
        longest = np.zeros(tokens.size, dtype=np.int64)
        np.maximum.at(longest, inverse, length[hit])
        keep = ~self.is_single[tokens]
        tokens, longest = tokens[keep], longest[keep]
        exponent = longest - self.allowed
        if self.max_exponent > 0:
            exponent = np.minimum(exponent, self.max_exponent)
        pen = (self.multiplier * np.power(float(self.base), exponent.astype(np.float64)))
        return tokens, pen.astype(np.float32)

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support:
        tokens, pen = self.penalties()
        if tokens.size:
            ids = torch.from_numpy(tokens).to(logits.device)
            logits.index_add_(0, ids, -torch.from_numpy(pen).to(logits.device))
        return support


# ---- truncation -------------------------------------------------------------------------------
class TopNSigma(_Stateless):
    """Top-nσ (Tang et al. 2024, arXiv:2411.07641): keep logits >= max - n * std of the finite
    logits (population std). ``n`` <= 0 disables."""

    def __init__(self, n: float) -> None:
        self.n = n

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support:
        if self.n <= 0:
            return support
        ids, vals = candidates(logits, support)
        if vals.numel() <= 1:
            return ids
        return _drop(logits, ids, vals >= vals.max() - self.n * vals.std(correction=0))


class TopK(_Stateless):
    """Top-k (Fan et al. 2018): keep the k largest logits. ``k`` <= 0 disables."""

    def __init__(self, k: int) -> None:
        self.k = k

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support:
        if self.k <= 0:
            return support
        if support is None:
            if self.k >= logits.numel():
                return None
            top = torch.topk(logits, self.k, sorted=False).indices
            _keep_only(logits, top)
            return top
        ids, vals = candidates(logits, support)
        if self.k >= ids.numel():
            return ids
        keep = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
        keep[torch.topk(vals, self.k, sorted=False).indices] = True
        return _drop(logits, ids, keep)


class _MassCut(_Stateless):
    """Keeps the tokens of an order until their probability mass passes ``p`` (at least
    ``min_keep``); subclasses give the order and the cumulative test (:meth:`prefix`)."""

    def __init__(self, p: float, min_keep: int = 0) -> None:
        self.p, self.min_keep = p, min_keep

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support:
        if self.p >= 1.0:
            return support
        ids, vals = candidates(logits, support)
        if vals.numel() <= 1:
            return ids
        cut = self.prefix(vals)
        if cut is None:
            return ids
        order, last = cut
        keep = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
        keep[order[:last]] = True
        return _drop(logits, ids, keep)

    def first(self, ok: torch.Tensor) -> int | None:
        """1 + the first index where ``ok`` (the cumulative mass passes ``p``) at or after
        ``min_keep - 1``, or None."""
        if self.min_keep > 1:
            ok[: self.min_keep - 1] = False
        hit = ok.nonzero()
        return int(hit[0]) + 1 if hit.numel() else None

    def prefix(self, vals: torch.Tensor) -> tuple[torch.Tensor, int] | None:
        """(an order of the candidates, how many of it to keep), or None to keep all."""
        raise NotImplementedError


class Typical(_MassCut):
    """Locally typical sampling (Meister et al. 2022, arXiv:2202.00666): keep the tokens whose
    surprise is closest to the entropy until their probability mass exceeds ``p``."""

    def prefix(self, vals):
        logp = torch.log_softmax(vals, 0)
        probs = logp.exp()
        entropy = -(probs * logp).nan_to_num().sum()
        order = torch.argsort((-logp - entropy).abs(), stable=True)
        last = self.first(torch.cumsum(probs[order], 0) > self.p)
        return None if last is None else (order, last)


class TopP(_MassCut):
    """Nucleus sampling (Holtzman et al. 2019, arXiv:1904.09751): keep the most probable tokens
    until their mass reaches ``p``. Sorts only the top 256, then the top 4096, and all of them
    only if the nucleus is larger still (a full sort of 262,144 costs ~30 ms on one CPU core)."""

    def prefix(self, vals):
        probs = torch.softmax(vals, 0)
        n = vals.numel()
        k = min(256, n)
        while True:
            top, order = torch.topk(probs, k)
            last = self.first(torch.cumsum(top, 0) >= self.p)
            if last is not None or k == n:
                return None if last is None else (order, last)
            k = min(n, 4096) if k < 4096 else n


class MinP(_Stateless):
    """Min-p (Nguyen et al. 2024, arXiv:2407.01082): keep tokens with probability >= p times
    the top probability, i.e. logit >= max_logit + log(p). ``p`` <= 0 disables."""

    def __init__(self, p: float, min_keep: int = 0) -> None:
        self.p, self.min_keep = p, min_keep

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support:
        if self.p <= 0.0:
            return support
        if support is None:  # one pass over the vocabulary; the support stays unknown
            threshold = logits.max() + np.float32(math.log(self.p))
            drop = logits < threshold
            if self.min_keep > 1 and int((~drop & (logits > NEG_INF)).sum()) < self.min_keep:
                top = torch.topk(logits, min(self.min_keep, logits.numel())).indices
                _keep_only(logits, top)
                return top
            logits.masked_fill_(drop, NEG_INF)
            return None
        ids, vals = candidates(logits, support)
        if not ids.numel():
            return ids
        keep = vals >= vals.max() + np.float32(math.log(self.p))
        if self.min_keep > 1 and int(keep.sum()) < self.min_keep:
            keep[torch.topk(vals, min(self.min_keep, vals.numel())).indices] = True
        return _drop(logits, ids, keep)


class XTC(_Stateless):
    """Exclude Top Choices (p-e-w, text-generation-webui #6335): with chance ``probability``,
    remove every token with probability >= ``threshold`` except the least probable of them."""

    def __init__(self, probability: float, threshold: float, rng: Uniform, min_keep: int = 0):
        self.probability, self.threshold, self.rng, self.min_keep = probability, threshold, rng, min_keep

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support:
        if self.probability <= 0.0 or self.threshold > 0.5:
            return support
        ids, vals = candidates(logits, support)
        n = vals.numel()
        if n < 2 or self.rng.draw() > self.probability:
            return ids
        probs = torch.softmax(vals, 0)
        n_above = int((probs >= self.threshold).sum())
        if n_above < 2 or n - (n_above - 1) < self.min_keep:
            return ids
        keep = torch.ones(n, dtype=torch.bool, device=ids.device)
        keep[torch.topk(probs, n_above - 1).indices] = False
        return _drop(logits, ids, keep)


class Temperature(_Stateless):
    """Temperature, and dynamic temperature (entropy-scaled, kalomaze; llama.cpp temp_ext) when
    ``delta`` > 0: t = max(0, temp - delta) + 2 delta * (H / log n) ** exponent.
    t <= 0 keeps only the (first) largest logit: greedy."""

    def __init__(self, temp: float, delta: float = 0.0, exponent: float = 1.0) -> None:
        self.temp, self.delta, self.exponent = temp, delta, exponent

    @staticmethod
    def scale(logits: torch.Tensor, t: float, support: Support = None) -> Support:
        """Divide by ``t``; ``t`` <= 0 keeps only the first largest logit (in id order)."""
        if support is None:
            if t <= 0.0:
                top = logits.argmax().reshape(1)
                _keep_only(logits, top)
                return top
            logits.div_(t)
            return None
        if t <= 0.0:
            ids = support.sort().values  # first in id order on ties, as a full argmax
            ids = ids[logits[ids] > NEG_INF]
            if not ids.numel():  # everything masked: the selector reports it
                return ids
            vals = logits[ids]
            keep = torch.zeros(ids.numel(), dtype=torch.bool, device=ids.device)
            keep[vals.argmax()] = True
            return _drop(logits, ids, keep)
        logits[support] = logits[support] / t
        return support

    def dynamic(self, vals: torch.Tensor) -> float:
        """The temperature dynamic temperature picks for candidate logits ``vals``."""
        lo, hi = max(0.0, self.temp - self.delta), self.temp + self.delta
        logp = torch.log_softmax(vals.double(), 0)
        entropy = float(-(logp.exp() * logp).nan_to_num().sum())
        normalized = entropy / math.log(vals.numel())
        return lo + (hi - lo) * normalized**self.exponent

    def apply(self, logits: torch.Tensor, support: Support = None) -> Support:
        if self.delta > 0:
            ids, vals = candidates(logits, support)
            if vals.numel() <= 1:
                return ids
            return self.scale(logits, self.dynamic(vals), ids)
        return self.scale(logits, self.temp, support)


# ---- selecting steps --------------------------------------------------------------------------
def _draw(probs: torch.Tensor, rng: Uniform) -> int:
    """Index drawn from ``probs`` (n,) by inverse CDF with one uniform draw."""
    cdf = torch.cumsum(probs.double(), 0)
    u = rng.draw() * float(cdf[-1])
    return min(int(torch.searchsorted(cdf, torch.tensor([u], dtype=cdf.dtype,
                                                        device=cdf.device), right=True)),
               probs.numel() - 1)


def _no_candidates() -> LocalLLMError:
    return LocalLLMError("no token can be sampled: every candidate was masked")


class Greedy:
    """Pick the largest logit (first on ties)."""

    def select(self, logits: torch.Tensor, support: Support = None) -> int:
        if support is not None:
            ids, vals = candidates(logits, support.sort().values)
            if not ids.numel():
                raise _no_candidates()
            return int(ids[vals.argmax()])
        if not bool((logits > NEG_INF).any()):
            raise _no_candidates()
        return int(logits.argmax())

    def reset(self) -> None:
        pass


class Dist:
    """Draw from softmax(logits) with the chain's generator (llama.cpp ``dist``)."""

    def __init__(self, rng: Uniform) -> None:
        self.rng = rng

    def select(self, logits: torch.Tensor, support: Support = None) -> int:
        ids, vals = candidates(logits, None if support is None else support.sort().values)
        if ids.numel() == 0:
            raise _no_candidates()
        return int(ids[_draw(torch.softmax(vals, 0), self.rng)])

    def reset(self) -> None:
        pass


class _Mirostat:
    """What both Mirostats share (Basu et al. 2021, arXiv:2007.14966): the target surprise τ,
    the learning rate η, and μ, which starts at 2τ and follows each draw's surprise."""

    def __init__(self, tau: float, eta: float, rng: Uniform) -> None:
        self.tau, self.eta, self.rng = tau, eta, rng
        self.mu = 2.0 * tau

    def reset(self) -> None:
        self.mu = 2.0 * self.tau

    def _draw_and_learn(self, ids: torch.Tensor, vals: torch.Tensor) -> int:
        """Draw one of the kept candidates ``ids`` (logits ``vals``) by their renormalized
        probabilities, then μ -= η (surprise - τ), the surprise being -log2 p of the draw."""
        probs = torch.softmax(vals, 0)
        j = _draw(probs, self.rng)
        self.mu -= self.eta * (-math.log2(float(probs[j])) - self.tau)
        return int(ids[j])


class Mirostat(_Mirostat):
    """Mirostat v1 (Basu et al. 2021, arXiv:2007.14966, Algorithm 1).

    Estimates the Zipf exponent s from the ``m`` most probable tokens, keeps the top
    k = (ε 2^μ / (1 - N^-ε))^(1/s) with ε = s - 1, draws, then μ -= η (surprise - τ).
    μ starts at 2τ.
    """

    def __init__(self, n_vocab: int | None, tau: float, eta: float, rng: Uniform,
                 m: int = 100) -> None:
        super().__init__(tau, eta, rng)
        self.n_vocab, self.m = n_vocab, m

    def estimate_k(self, sorted_probs: np.ndarray, n_vocab: int) -> int:
        """k from the top probabilities sorted descending (float64 (n,), n >= 2).

        Returns ``n_vocab`` when k is unbounded (s_hat = 0: equal probabilities) and 1 when
        probabilities underflowed to 0 (s_hat is 0/0 there; the distribution is one spike).
        """
        n = min(self.m - 1, sorted_probs.size - 1)
        i = np.arange(n, dtype=np.float64)
        t = np.log((i + 2) / (i + 1))
        with np.errstate(divide="ignore", invalid="ignore"):
            b = np.log(sorted_probs[:n] / sorted_probs[1 : n + 1])
        s_hat = float((t * b).sum() / (t * t).sum())
        if math.isnan(s_hat):
            return 1
        eps = s_hat - 1.0
        try:
            k = (eps * 2.0**self.mu / (1.0 - float(n_vocab) ** -eps)) ** (1.0 / s_hat)
        except (OverflowError, ZeroDivisionError):
            k = float("inf")
        if isinstance(k, complex) or not math.isfinite(k):
            return n_vocab
        return max(int(k), 1)

    def select(self, logits: torch.Tensor, support: Support = None) -> int:
        ids, vals = candidates(logits, support)
        n = ids.numel()
        if n == 0:
            raise _no_candidates()
        if n > 1:
            probs = torch.softmax(vals, 0)
            top = torch.topk(probs, min(self.m, n)).values.double().cpu().numpy()
            k = min(self.estimate_k(top, self.n_vocab or logits.numel()), n)
            keep = torch.topk(vals, k).indices
            ids, vals = ids[keep], vals[keep]
            _keep_only(logits, ids)
        return self._draw_and_learn(ids, vals)


class MirostatV2(_Mirostat):
    """Mirostat v2 (Basu et al. 2021, arXiv:2007.14966, Algorithm 2 as in llama.cpp).

    Drops tokens whose surprise -log2 p exceeds μ (keeps at least the top one), renormalizes,
    draws, then μ -= η (surprise - τ). μ starts at 2τ.
    """

    def select(self, logits: torch.Tensor, support: Support = None) -> int:
        ids, vals = candidates(logits, support)
        if ids.numel() == 0:
            raise _no_candidates()
        probs = torch.softmax(vals, 0)
        keep = (-torch.log2(probs) <= self.mu).nonzero().squeeze(1)
        if keep.numel() == 0:
            keep = probs.argmax().reshape(1)
        ids, vals = ids[keep], vals[keep]
        _keep_only(logits, ids)
        return self._draw_and_learn(ids, vals)
