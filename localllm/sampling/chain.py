"""Sampling parameters and the sampler chain (llama.cpp's ``common/sampling.cpp`` rebuilt).

:class:`SamplingParams` carries llama.cpp's ``common_params_sampling`` names and defaults.
:func:`build_sampler` turns it into a :class:`SamplerChain`, the same chain llama.cpp builds:

    logit bias -> the steps named by ``samplers`` (default: penalties; dry; top_n_sigma; top_k;
    typ_p; top_p; min_p; xtc; temperature) -> dist

or, with ``mirostat`` 1 or 2, logit bias -> temperature -> mirostat. ``temp`` <= 0 makes the
temperature step keep only the largest logit, i.e. greedy decoding after the steps before it.
The steps themselves live in :mod:`localllm.sampling.samplers`.
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import ParameterError, UnsupportedError
from . import samplers as S
from .device import plan_device_chain
from .trace import TokenTrace

# llama.cpp's sampler names (common_sampler_type_from_name), their aliases and one-letter codes.
SAMPLER_NAMES = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                 "temperature", "infill")
SAMPLER_ALIASES = {
    "top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "top-n-sigma": "top_n_sigma",
    "typical-p": "typ_p", "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p", "min-p": "min_p",
    "temp": "temperature",
}
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p",
                 "p": "top_p", "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill"}
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                    "temperature")
DEFAULT_DRY_BREAKERS = ("\n", ":", '"', "*")
# Each DRY breaker costs a pass over the vocabulary when the chain is built (5,000 of them
# kept a server busy for 10 minutes); llama.cpp cuts each to 40 bytes, we also bound how many.
MAX_DRY_BREAKERS = 16
MAX_SAMPLERS = 32  # entries of --samplers (there are 9 kinds)
MAX_LOGIT_BIAS = 100.0  # OpenAI's range; -inf (llama.cpp) bans a token
_FLOAT32_MAX = 3.4028234663852886e38  # the chain runs in float32
_INT32 = 2**31

# Field name -> the command-line flag that sets it (error messages name the flag).
FLAGS = {
    "seed": "--seed", "top_k": "--top-k", "top_p": "--top-p", "min_p": "--min-p",
    "typ_p": "--typical", "temp": "--temp", "dynatemp_range": "--dynatemp-range",
    "dynatemp_exponent": "--dynatemp-exp", "penalty_last_n": "--repeat-last-n",
    "penalty_repeat": "--repeat-penalty", "penalty_freq": "--frequency-penalty",
    "penalty_present": "--presence-penalty", "dry_multiplier": "--dry-multiplier",
    "dry_base": "--dry-base", "dry_allowed_length": "--dry-allowed-length",
    "dry_penalty_last_n": "--dry-penalty-last-n", "dry_sequence_breakers": "--dry-sequence-breaker",
    "xtc_probability": "--xtc-probability", "xtc_threshold": "--xtc-threshold",
    "top_n_sigma": "--top-n-sigma", "mirostat": "--mirostat", "mirostat_tau": "--mirostat-ent",
    "mirostat_eta": "--mirostat-lr", "ignore_eos": "--ignore-eos", "logit_bias": "--logit-bias",
    "samplers": "--samplers", "n_probs": "--logprobs", "min_keep": "--min-keep",
}


def _flag(name: str) -> str:
    return f"{FLAGS.get(name, name)} ({name})"


def sampler_name(name: str, *, flag: str = "--samplers") -> str:
    """llama.cpp's canonical name of sampler ``name`` (aliases accepted).

    Raises:
        ParameterError: an unknown name.
    """
    key = name.strip().lower()
    key = SAMPLER_ALIASES.get(key, key)
    if key not in SAMPLER_NAMES:
        valid = ", ".join(n for n in SAMPLER_NAMES if n != "infill")
        raise ParameterError(f"{flag}: unknown sampler {name!r} (valid: {valid})")
    return key


def parse_samplers(text: str) -> list[str]:
    """Names from ``--samplers "penalties;dry;top_k;..."`` (';'-separated, aliases accepted)."""
    return [sampler_name(part) for part in text.split(";") if part.strip()]


def parse_sampling_seq(text: str) -> list[str]:
    """Names from ``--sampling-seq edskypmxt`` (one letter per sampler).

    Raises:
        ParameterError: an unknown letter.
    """
    out = []
    for ch in text:
        if ch not in SAMPLER_CHARS:
            raise ParameterError(
                f"--sampling-seq: unknown sampler letter {ch!r} (valid: edskypmxt)")
        out.append(SAMPLER_CHARS[ch])
    return out


@dataclass
class SamplingParams:
    """Sampling settings, with llama.cpp's ``common_params_sampling`` names and defaults.

    ``seed`` None (or -1, or 4294967295 as in llama.cpp) draws a random seed per chain. Setting a step's parameter to its
    "off" value disables it: top_k <= 0, top_p = 1, min_p = 0, typ_p = 1, top_n_sigma <= 0,
    xtc_probability = 0, dry_multiplier = 0, penalty_repeat = 1 with zero freq/presence.
    """

    seed: int | None = None
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    typ_p: float = 1.0
    temp: float = 0.8
    dynatemp_range: float = 0.0
    dynatemp_exponent: float = 1.0
    penalty_last_n: int = 64
    penalty_repeat: float = 1.0
    penalty_freq: float = 0.0
    penalty_present: float = 0.0
    dry_multiplier: float = 0.0
    dry_base: float = 1.75
    dry_allowed_length: int = 2
    dry_penalty_last_n: int = -1
    dry_sequence_breakers: list[str] = field(default_factory=lambda: list(DEFAULT_DRY_BREAKERS))
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    top_n_sigma: float = -1.0
    mirostat: int = 0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    samplers: list[str] = field(default_factory=lambda: list(DEFAULT_SAMPLERS))
    n_probs: int = 0
    min_keep: int = 0

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SamplingParams:
        """Params from a mapping of field names (a models.toml ``[models.X.sampling]`` table).

        ``samplers`` may be a ';'-separated string; ``logit_bias`` keys may be strings.
        Raises:
            ParameterError: an unknown key or a value of the wrong type or range.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ParameterError(
                f"unknown sampling parameter {unknown[0]!r} (valid: {', '.join(sorted(names))})")
        values = dict(d)
        if isinstance(values.get("samplers"), str):
            values["samplers"] = parse_samplers(values["samplers"])
        if isinstance(values.get("dry_sequence_breakers"), str):
            values["dry_sequence_breakers"] = [values["dry_sequence_breakers"]]
        if "logit_bias" in values:
            try:
                values["logit_bias"] = {int(k): float(v) for k, v in dict(values["logit_bias"]).items()}
            except (TypeError, ValueError):
                raise ParameterError(
                    "logit_bias must map token ids to numbers, e.g. {\"15043\" = -1.0}") from None
        params = cls(**values)
        params.validate()
        return params

    def validate(self) -> None:
        """Check types and ranges.

        Raises:
            ParameterError: one line naming the flag and its valid range.
        """
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = {"int": int, "float": float, "bool": bool}.get(str(f.type).split(" ")[0])
            bad_int = isinstance(value, bool) or not isinstance(value, int)
            if kind is int and bad_int and not (f.name == "seed" and value is None):
                raise ParameterError(f"{_flag(f.name)} must be an integer, got {value!r}")
            if kind is int and f.name != "seed" and not -_INT32 <= value < _INT32:
                raise ParameterError(f"{_flag(f.name)} must be a 32-bit integer, got {value!r}")
            if kind is float:
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise ParameterError(f"{_flag(f.name)} must be a number, got {value!r}")
                if not abs(value) <= _FLOAT32_MAX:  # also NaN and infinities
                    raise ParameterError(
                        f"{_flag(f.name)} must be a finite float32 number, got {value!r}")
            if kind is bool and not isinstance(value, bool):
                raise ParameterError(f"{_flag(f.name)} must be true or false, got {value!r}")

        def check(name: str, ok: bool, valid: str) -> None:
            if not ok:
                raise ParameterError(
                    f"{_flag(name)} must be {valid}, got {getattr(self, name)!r}")

        if self.seed is not None:
            check("seed", -1 <= self.seed < 2**32, "-1 (random) or in [0, 4294967295]")
        check("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]")
        check("min_p", 0.0 <= self.min_p <= 1.0, "in [0, 1]")
        check("typ_p", 0.0 < self.typ_p <= 1.0, "in (0, 1]")
        check("dynatemp_range", self.dynatemp_range >= 0.0, ">= 0")
        check("dynatemp_exponent", self.dynatemp_exponent >= 0.0, ">= 0")
        check("penalty_last_n", self.penalty_last_n >= -1, ">= -1 (-1: context size, 0: off)")
        check("penalty_repeat", self.penalty_repeat > 0.0, "> 0 (1.0: off)")
        check("dry_multiplier", self.dry_multiplier >= 0.0, ">= 0 (0: off)")
        check("dry_base", self.dry_base >= 1.0, ">= 1")
        check("dry_allowed_length", self.dry_allowed_length >= 0, ">= 0")
        check("dry_penalty_last_n", self.dry_penalty_last_n >= -1,
              ">= -1 (-1: context size, 0: off)")
        check("xtc_probability", 0.0 <= self.xtc_probability <= 1.0, "in [0, 1]")
        check("xtc_threshold", 0.0 <= self.xtc_threshold <= 1.0, "in [0, 1] (> 0.5: off)")
        check("mirostat", self.mirostat in (0, 1, 2), "0 (off), 1 or 2")
        check("mirostat_tau", self.mirostat_tau >= 0.0, ">= 0")
        check("mirostat_eta", self.mirostat_eta >= 0.0, ">= 0")
        check("n_probs", self.n_probs >= 0, ">= 0")
        check("min_keep", self.min_keep >= 0, ">= 0")
        if not isinstance(self.dry_sequence_breakers, (list, tuple)) or not all(
                isinstance(b, str) for b in self.dry_sequence_breakers):
            raise ParameterError(f"{_flag('dry_sequence_breakers')} must be a list of strings")
        if len(self.dry_sequence_breakers) > MAX_DRY_BREAKERS:
            raise ParameterError(f"{_flag('dry_sequence_breakers')}: at most {MAX_DRY_BREAKERS} "
                                 f"breakers, got {len(self.dry_sequence_breakers)}")
        if not isinstance(self.samplers, (list, tuple)):
            raise ParameterError(f"{_flag('samplers')} must be a list of sampler names")
        if len(self.samplers) > MAX_SAMPLERS:
            raise ParameterError(f"{_flag('samplers')}: at most {MAX_SAMPLERS} entries, got "
                                 f"{len(self.samplers)}")
        for name in self.samplers:
            sampler_name(str(name))
        if not isinstance(self.logit_bias, dict):
            raise ParameterError(f"{_flag('logit_bias')} must map token ids to biases")
        for tok, bias in self.logit_bias.items():
            if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < _INT32:
                raise ParameterError(f"--logit-bias: token id must be an integer >= 0, got {tok!r}")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias):
                raise ParameterError(f"--logit-bias: bias of token {tok} must be a number")
            # A bias of 1e308 is +inf in float32, and softmax of inf - inf is NaN: the draw
            # would be garbage. -inf bans the token (llama.cpp).
            if bias != -math.inf and not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ParameterError(
                    f"--logit-bias: bias of token {tok} must be in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}] or -inf, got {bias!r}")


class SamplerChain:
    """A built chain: :meth:`sample` picks a token from logits, :meth:`accept` records it.

    Attributes:
        seed: the generator's seed (random when the params gave none; print it to reproduce).
        steps: [(name, sampler)] in application order; ``selector``: the selecting step.
        last_trace: :class:`TokenTrace` of the last :meth:`sample`.
    """

    def __init__(self, params: SamplingParams, steps: list[tuple[str, S.Sampler]],
                 selector: S.Selector, rng: S.Uniform, constraint=None) -> None:
        self.params, self.steps, self.selector, self.rng = params, steps, selector, rng
        self.seed = rng.seed
        self.constraint = constraint
        self.last_trace: TokenTrace | None = None

        # The same chain fused into fixed-shape tensor ops (one host read), when eligible;
        # None forces the step-by-step chain.
        self.device_chain = plan_device_chain(self)

    def _run(self, work: torch.Tensor) -> tuple[int, S.Support]:
        support = None
        for _, step in self.steps:
            support = step.apply(work, support)
        return self.selector.select(work, support), support

    def sample(self, logits: torch.Tensor) -> int:
        """Run the chain on a copy of ``logits`` and select a token.

        Args:
            logits: float32 (n_vocab,) on any device; not modified.
        With a constraint, llama.cpp's fast path: the token is drawn without the grammar and
        checked; only if the grammar rejects it are fresh logits masked by the grammar and the
        chain run again.
        Raises:
            LocalLLMError: every candidate was masked (e.g. the grammar allows no token).
        """
        raw = logits.reshape(-1)
        if raw.dtype != torch.float32:
            raw = raw.float()
        if self.device_chain is not None and self.device_chain.handles(raw):
            token, self.last_trace = self.device_chain.sample(raw)
            return token
        work = raw.clone()
        token, support = self._run(work)
        if self.constraint is not None and not self.constraint.is_allowed(token):
            work = raw.clone()
            self.constraint.apply(work)
            token, support = self._run(work)
        self.last_trace = self._trace(raw, work, support, token)
        return token

    def _trace(self, raw: torch.Tensor, work: torch.Tensor, support: S.Support,
               token: int) -> TokenTrace:
        _, vals = S.candidates(work, support)
        processed = float(work[token] - torch.logsumexp(vals, 0))
        if self.params.n_probs <= 0:  # the raw distribution costs a pass over the vocabulary
            return TokenTrace(token, None, processed, [])
        raw_lse = torch.logsumexp(raw, 0)
        v, i = torch.topk(raw, min(self.params.n_probs, raw.numel()))
        top = list(zip(i.tolist(), (v - raw_lse).tolist()))
        return TokenTrace(token, float(raw[token] - raw_lse), processed, top)

    def accept(self, token: int, *, accept_grammar: bool = True) -> None:
        """Record ``token`` in the history samplers (and the constraint, if ``accept_grammar``).

        llama.cpp also accepts the prompt's tokens (without the grammar) so that penalties see
        them: use :meth:`accept_prompt`.
        """
        for _, step in self.steps:
            step.accept(token)
        if self.constraint is not None and accept_grammar:
            self.constraint.accept(token)

    def accept_prompt(self, ids) -> None:
        """Record prompt tokens in the history samplers only (llama.cpp's main loop does so)."""
        for token in ids:
            self.accept(int(token), accept_grammar=False)

    def reset(self) -> None:
        """Forget history and mirostat state, re-seed the generator, reset the constraint."""
        for _, step in self.steps:
            step.reset()
        self.selector.reset()
        self.rng.reset()
        if self.constraint is not None:
            self.constraint.reset()

    def __repr__(self) -> str:
        names = " -> ".join([n for n, _ in self.steps] + [type(self.selector).__name__.lower()])
        return f"SamplerChain({names}, seed={self.seed})"


def build_sampler(params: SamplingParams, tokenizer, *, constraint=None,
                  n_ctx: int | None = None) -> SamplerChain:
    """The chain llama.cpp's ``common_sampler_init`` builds for ``params``.

    Args:
        tokenizer: gives n_vocab, eog_ids (--ignore-eos) and token texts (DRY); may be None
            when neither DRY nor --ignore-eos is used.
        constraint: optional grammar (``apply``/``is_allowed``/``accept``/``reset``).
        n_ctx: the context size that -1 in penalty_last_n / dry_penalty_last_n stands for
            (None: the whole history).
    Raises:
        ParameterError: invalid params or a logit-bias token outside the vocabulary.
        UnsupportedError: the ``infill`` sampler.
    """
    params.validate()
    # None, -1 and llama.cpp's LLAMA_DEFAULT_SEED (0xFFFFFFFF) all mean a random seed.
    seed = params.seed if params.seed not in (None, -1, 0xFFFFFFFF) else secrets.randbits(32)
    rng = S.Uniform(seed)
    n_vocab = tokenizer.n_vocab if tokenizer is not None else None

    steps: list[tuple[str, S.Sampler]] = []
    bias = dict(params.logit_bias)
    if params.ignore_eos:
        if tokenizer is None:
            raise ValueError("ignore_eos needs a tokenizer")
        bias.update({t: float("-inf") for t in tokenizer.eog_ids})
    if n_vocab is not None:
        for tok in bias:
            if not 0 <= tok < n_vocab:
                raise ParameterError(
                    f"--logit-bias: token id {tok} is outside the vocabulary [0, {n_vocab})")
    if bias:
        steps.append(("logit_bias", S.LogitBias(bias)))

    def window(n: int) -> int | None:
        return n_ctx if n == -1 else n

    if params.mirostat == 0:
        for name in (sampler_name(n) for n in params.samplers):
            steps.append((name, _make_step(name, params, tokenizer, rng, window)))
        names = [n for n, _ in steps]
        greedy = params.temp <= 0 and params.dynatemp_range <= 0 and "temperature" in names
        selector: S.Selector = S.Greedy() if greedy else S.Dist(rng)
    else:
        steps.append(("temperature", S.Temperature(params.temp)))
        if params.mirostat == 1:
            selector = S.Mirostat(n_vocab, params.mirostat_tau, params.mirostat_eta, rng, m=100)
        else:
            selector = S.MirostatV2(params.mirostat_tau, params.mirostat_eta, rng)
    return SamplerChain(params, steps, selector, rng, constraint)


def _make_step(name: str, p: SamplingParams, tokenizer, rng: S.Uniform, window) -> S.Sampler:
    if name == "penalties":
        return S.Penalties(window(p.penalty_last_n), p.penalty_repeat, p.penalty_freq,
                           p.penalty_present)
    if name == "dry":
        last_n = window(p.dry_penalty_last_n)
        enabled = p.dry_multiplier != 0.0 and p.dry_base >= 1.0 and last_n != 0
        if enabled and tokenizer is None:
            raise ValueError("DRY needs a tokenizer")
        table = (S.dry_breaker_table(tokenizer, tuple(p.dry_sequence_breakers)) if enabled
                 else {})
        n_vocab = tokenizer.n_vocab if tokenizer is not None else 0
        return S.DRY(p.dry_multiplier, p.dry_base, p.dry_allowed_length, last_n, table, n_vocab)
    if name == "top_n_sigma":
        return S.TopNSigma(p.top_n_sigma)
    if name == "top_k":
        return S.TopK(p.top_k)
    if name == "typ_p":
        return S.Typical(p.typ_p, p.min_keep)
    if name == "top_p":
        return S.TopP(p.top_p, p.min_keep)
    if name == "min_p":
        return S.MinP(p.min_p, p.min_keep)
    if name == "xtc":
        return S.XTC(p.xtc_probability, p.xtc_threshold, rng, p.min_keep)
    if name == "temperature":
        return S.Temperature(p.temp, p.dynatemp_range, p.dynatemp_exponent)
    raise UnsupportedError(f"--samplers: the {name!r} sampler is not supported")
