"""The common sampler chains fused into static-shape tensor code: no host sync but the token id.

:class:`SamplerChain` runs llama.cpp's chain step by step on a full-vocabulary ``work`` tensor;
several steps read data back to the host (``int(...)``, ``.nonzero()``, boolean indexing), each a
device synchronization on a GPU. For the configurations people actually use

    logit bias -> top_k (k >= 1) -> top_p -> min_p -> temperature -> dist (or greedy, temp <= 0)
    logit bias -> argmax                     (temp <= 0, top_k off, top_p off)

:func:`plan_device_chain` returns a :class:`DeviceChain` that computes the same token with
topk/sort/softmax/cumsum/searchsorted/where on tensors of fixed size k; the one host read is
the chosen token id (-1 when every candidate was masked, raised on the host). On CPU logits,
where a host read is free and the step-by-step chain is faster, only the argmax path is used
unless :attr:`DeviceChain.on_cpu` is set (the tests set it to check the top_k path).

Exactness (same token as the step-by-step chain, same seed): every step applies the same torch
op to the same values in the same order as :mod:`localllm.sampling.samplers` does:

- top_k is the same ``torch.topk(work, k, sorted=False)`` call, so the same ids in the same order;
- the survivors that the reference compacts (``support[finite]``) are moved to the front of the
  fixed-size vector by a stable sort, keeping their order, and the tail is -inf. On the CPU
  ``torch.softmax`` of such a padded vector equals the softmax of the compacted one bit for bit
  from 16 survivors up (checked for AVX-512, AVX2 and the default kernels); fewer survivors take
  other reduction paths inside torch, so 1-7 and 8-15 survivors get softmaxes of slices of
  length 7 and 15, selected with ``where`` (:func:`softmax_front`);
- top_p's staged ``topk`` of the probabilities (256, 4096, all), its float32 cumsum and
  ``min_keep`` rule, min_p's float32 threshold and ``min_keep`` top-up, the division by the
  temperature, and dist's id order, float64 cumsum and right-sided ``searchsorted`` of
  ``u * total`` are reproduced; ``u`` is :meth:`localllm.sampling.samplers.Uniform.draw_tensor`, the
  draw ``Uniform.draw`` makes, kept as a tensor that is never read on the host.

Known difference: ``torch.topk`` orders exactly equal values in a way that depends on the
vector's length. Where the reference calls it on a compacted vector and this chain on the
padded one (top_p's sort when fewer than k candidates survive the logit bias; min_p's min_keep
top-up after top_p removed some), another member of an exact tie at the truncation boundary may
be kept. On CUDA the reference's own reductions depend on the candidate count, so there the
probabilities agree to the last ulp (a token can differ only when u lands within ~1e-7 of a
boundary of the cumulative distribution). Nothing here is measured on a GPU yet.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from . import samplers as S
from .trace import TokenTrace

NEG_INF = float("-inf")
# Lengths up to which torch's CPU softmax takes another reduction path than for longer vectors
# (its float vectors have 8 or 16 lanes); largest first (see softmax_front).
_SMALL = (15, 7)
# The step order the fused chain implements (a subsequence of llama.cpp's default order).
_ORDER = ("top_k", "top_p", "min_p", "temperature")


def _inactive(name: str, step) -> bool:
    """Whether a step of the chain is a no-op for every input (its "off" parameters)."""
    if name == "penalties":
        return not step.enabled
    if name == "dry":
        return not step.enabled
    if name == "top_n_sigma":
        return step.n <= 0
    if name == "typ_p":
        return step.p >= 1.0
    if name == "xtc":
        return step.probability <= 0.0 or step.threshold > 0.5
    if name == "top_k":
        return step.k <= 0
    if name == "top_p":
        return step.p >= 1.0
    if name == "min_p":
        return step.p <= 0.0
    return False


def plan_device_chain(chain) -> DeviceChain | None:
    """A :class:`DeviceChain` equivalent to ``chain`` (a built SamplerChain), or None.

    Eligible: no constraint, ``n_probs`` 0 (the raw top list is left to the reference),
    selector dist or greedy (no mirostat); every step but logit_bias, top_k, top_p, min_p and
    temperature inactive (penalties, DRY, top-n-sigma, typical, XTC off); the active ones of
    those four at most once each, in the order top_k, top_p, min_p, temperature, temperature
    present and static (dynatemp_range 0); top_k >= 1, or greedy with top_p off.
    Whether k truncates the vocabulary is checked per call (:meth:`DeviceChain.handles`).
    """
    if chain.constraint is not None or chain.params.n_probs > 0:
        return None
    if not isinstance(chain.selector, (S.Greedy, S.Dist)):
        return None
    bias, found = None, {}
    for i, (name, step) in enumerate(chain.steps):
        if name == "logit_bias" and i == 0:
            bias = step
        elif _inactive(name, step):
            continue
        elif name in _ORDER and name not in found:
            found[name] = step
        else:
            return None
    if "temperature" not in found or found["temperature"].delta != 0.0:
        return None
    names = [n for n, step in chain.steps if n in found and not _inactive(n, step)]
    if names != [n for n in _ORDER if n in found]:
        return None
    k = found["top_k"].k if "top_k" in found else 0
    top_p = found["top_p"].p if "top_p" in found else 1.0
    min_p = found["min_p"].p if "min_p" in found else 0.0
    greedy = isinstance(chain.selector, S.Greedy)
    if k <= 0 and not (greedy and top_p >= 1.0):
        return None  # full-vocabulary top_p / dist: the reference's sparse path is better
    return DeviceChain(bias, k, top_p, min_p, chain.params.min_keep,
                       found["temperature"].temp, greedy, chain.rng)


class DeviceTrace(TokenTrace):
    """A :class:`TokenTrace` whose processed log-prob stays a device tensor until it is read
    (reading it is a host sync; only ``--logprobs`` does)."""

    def __init__(self, token: int, processed: torch.Tensor | None) -> None:
        self.token, self.logprob, self.top = token, None, []
        self._processed = processed

    @property
    def processed_logprob(self) -> float:  # greedy (None): one candidate, log 1 = 0
        return 0.0 if self._processed is None else float(self._processed)


def softmax_front(front: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """``torch.softmax(front[:n])`` zero-padded to ``front``'s length, without reading ``n``.

    Args:
        front: float32 (K,) whose entries from ``n`` on are -inf.
        n: int64 0-d tensor, the number of leading finite entries (0 gives NaN).
    Returns float32 (K,). On the CPU bit-identical to the softmax of the compacted vector: torch
    reduces a vector in lanes of 8 or 16, and trailing zeros change no sum only while the
    padded length takes the same code path as the compacted one (checked for the AVX-512, AVX2
    and default kernels: lengths 1-7, 8-15 and 16+ are three such classes). Elsewhere (CUDA)
    the padded softmax, equal to the last ulp.
    """
    probs = torch.softmax(front, 0)
    size = front.numel()
    if front.device.type != "cpu":
        return probs
    for length in _SMALL:
        if length < size:
            small = F.pad(torch.softmax(front[:length], 0), (0, size - length))
            probs = torch.where(n <= length, small, probs)
    return probs


def _at(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """``t[i]`` for a 0-d index tensor, on the device (``t[i]`` itself reads ``i`` on the host)."""
    return t.gather(0, i.reshape(1)).squeeze(0)


def _compact(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Permutation moving ``keep``'s True entries to the front in their order, and their count."""
    return torch.argsort((~keep).to(torch.uint8), stable=True), keep.sum()


def _top_p_keep(probs: torch.Tensor, p: float, min_keep: int) -> torch.Tensor:
    """TopP's kept positions of ``probs`` (K,): the staged partial sorts of
    :class:`localllm.sampling.samplers.TopP` (256, 4096, all), each stage used if its cumulative mass
    reaches ``p`` (at index >= min_keep - 1), else the next; the last keeps all on no hit."""
    size = probs.numel()
    stages = [min(256, size)]
    while stages[-1] < size:
        stages.append(min(size, 4096) if stages[-1] < 4096 else size)
    result = None
    for s in reversed(stages):
        top, order = torch.topk(probs, s)
        ok = torch.cumsum(top, 0) >= p
        if min_keep > 1:
            ok[: min_keep - 1] = False
        hit = ok.any()
        last = torch.where(hit, ok.to(torch.int32).argmax() + 1, s)
        kept = torch.arange(s, device=probs.device) < last
        mask = torch.zeros(size, dtype=torch.bool, device=probs.device).scatter(0, order, kept)
        if result is None:
            result = torch.where(hit, mask, torch.ones_like(mask))
        else:
            result = torch.where(hit, mask, result)
    return result


class DeviceChain:
    """logit bias -> top_k -> top_p -> min_p -> temperature -> dist/greedy on fixed shapes.

    Built by :func:`plan_device_chain`; :meth:`sample` returns the token and its trace.

    Attributes:
        on_cpu: use the top_k path on CPU logits too. Off by default: a host read costs nothing
            on the CPU, and there the step-by-step chain is faster (~0.75 vs ~0.85 ms per
            token at 262,144 logits, one thread); tests turn it on to check the path. The
            argmax path (greedy, nothing truncating) is faster on the CPU and always used.
    """

    on_cpu = False

    def __init__(self, bias: S.LogitBias | None, k: int, top_p: float, min_p: float,
                 min_keep: int, temp: float, greedy: bool, rng: S.Uniform) -> None:
        self.bias, self.k, self.top_p, self.min_p = bias, k, top_p, min_p
        self.min_keep, self.temp, self.greedy, self.rng = min_keep, temp, greedy, rng

    def handles(self, logits: torch.Tensor) -> bool:
        """Whether this chain applies to ``logits`` (n_vocab,): k must truncate the vocabulary
        (k >= n_vocab leaves the reference's top_p on the full vocabulary in id order), or the
        chain is a plain argmax; CPU logits only with :attr:`on_cpu` (or the argmax)."""
        n = logits.numel()
        if 0 < self.k < n:
            return self.on_cpu or logits.device.type != "cpu"
        return self.greedy and self.top_p >= 1.0

    def token_tensor(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The chosen token as an int64 0-d tensor on ``logits``' device (-1: nothing left), and
        the processed log-prob as a float32 0-d tensor (None for greedy: it is 0).

        Args:
            logits: float32 (n_vocab,); not modified. Consumes one draw of the generator per
            dist selection, as the reference does.
        """
        work = logits.clone()
        if self.bias is not None:
            self.bias.apply(work)  # the reference's own index_add_, so the same sums
        n_vocab = work.numel()
        if not 0 < self.k < n_vocab:  # greedy with nothing truncating: first largest logit
            best = work.argmax()
            return torch.where(_at(work, best) > NEG_INF, best, -1), None
        dev = work.device
        idx = torch.topk(work, self.k, sorted=False).indices  # == TopK's call
        vals = work[idx]
        perm, n = _compact(vals > NEG_INF)  # the reference's support[finite], in order
        idx, vals = idx[perm], vals[perm]
        alive = torch.arange(self.k, device=dev) < n
        if self.top_p < 1.0:
            alive = alive & _top_p_keep(softmax_front(vals, n), self.top_p, self.min_keep)
        if self.min_p > 0.0:
            masked = torch.where(alive, vals, NEG_INF)
            keep = alive & (vals >= masked.max() + np.float32(math.log(self.min_p)))
            if self.min_keep > 1:
                top = torch.topk(masked, min(self.min_keep, self.k)).indices
                forced = torch.zeros_like(alive).scatter(0, top, True) & alive
                keep = torch.where(keep.sum() < self.min_keep, keep | forced, keep)
            alive = keep
        if self.temp > 0.0:
            vals = vals / self.temp
        # dist and greedy see the survivors in id order (the reference sorts its support).
        order = torch.argsort(torch.where(alive, idx, idx + n_vocab))
        ids = idx[order]
        vals = torch.where(alive, vals, NEG_INF)[order]
        n = alive.sum()
        if self.greedy:
            j = vals.argmax()
            return torch.where(n > 0, _at(ids, j), -1), None
        u = self.rng.draw_tensor()  # the draw Dist takes, unread on the host
        cdf = torch.cumsum(softmax_front(vals, n).double(), 0)
        x = (u.to(dev) * cdf[-1]).reshape(1)
        j = torch.searchsorted(cdf, x, right=True)[0]
        j = torch.minimum(j, n - 1).clamp(min=0)
        token = torch.where(n > 0, _at(ids, j), -1)
        return token, _at(vals, j) - torch.logsumexp(vals, 0)

    def sample(self, logits: torch.Tensor) -> tuple[int, DeviceTrace]:
        """Token id and trace for float32 ``logits`` (n_vocab,); one host read (the token).

        Raises:
            LocalLLMError: every candidate was masked (the reference chain's error).
        """
        # The reference raises before drawing; undo this path's draw so later draws agree.
        state = None if self.greedy else self.rng.generator.get_state()
        token_t, logprob = self.token_tensor(logits)
        token = int(token_t)
        if token < 0:
            if state is not None:
                self.rng.generator.set_state(state)
            raise S._no_candidates()
        return token, DeviceTrace(token, logprob)
