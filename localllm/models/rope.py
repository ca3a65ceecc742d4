"""Rotary position embeddings (RoPE, Su et al. 2021) and their scaling, shared by every
family: what a file says (:class:`RopeSpec`, read and validated by :func:`read_rope`) and the
tables a model rotates with (:class:`Rope`, built in a model's ``prepare``).

The computation is ggml's ``ggml_rope_ext`` (``ggml/src/ggml-cpu/ops.cpp``: ``rope_yarn``,
``ggml_rope_yarn_corr_dims``) with llama.cpp's parameters (``src/llama-context.cpp``,
``src/llama-model.cpp``): pair ``i`` of the ``n_rot`` rotated dimensions of a head turns at
position ``p`` by

    theta_i = p * base^(-2i / n_rot) / ff_i * (s * (1 - mix_i) + mix_i)

where ``ff`` are the frequency factors (a file's ``rope_freqs`` tensor, LongRoPE's
``rope_factors_long`` / ``rope_factors_short`` chosen by the context size, or Llama 3's
factors computed from ``rope.scaling.*`` keys), ``s`` the frequency scale (1 / factor for the
``linear``, ``yarn`` and ``longrope`` scalings) and ``mix_i`` YaRN's ramp (Peng et al. 2023:
1 for the pairs that turn more than ``beta_fast`` times over the original context, 0 below
``beta_slow``, linear between; times ``ext_factor``; 0 without YaRN). cos and sin are
multiplied by a magnitude (``rope.scaling.attn_factor``, times YaRN's ``mscale``), which
scales the scores of the rotated dimensions by its square.

Partial RoPE (``rope.dimension_count`` below the head size) rotates the first ``n_rot``
dimensions: adjacent pairs (llama.cpp's NORM order) need no more than inverse frequencies of
0 for the other pairs; the halves order (NEOX) pairs ``j`` with ``j + n_rot/2``, which
:meth:`Rope.arrange` turns into the full head's pairing by a fixed permutation of each
head's dimensions, applied alike to queries, keys and their norm weights (a dot product and
an RMSNorm do not depend on the order of the dimensions), so that every backend's RoPE
rotates whole heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from .base import MAX_CONTEXT, HParams, TensorSpec, Weights

# rope.scaling.type values: llama.cpp's (LLAMA_ROPE_SCALING_TYPES), Phi-3's older "su" for
# "longrope", and "llama3" (Llama 3.1's factors computed from the rope.scaling.* keys, where
# llama.cpp's converter writes them as the rope_freqs tensor instead).
SCALING_TYPES = ("none", "linear", "yarn", "longrope", "su", "llama3")
# Optional YaRN keys a family's llama.cpp loader reads (the others it ignores, and so does
# localllm): ``yarn_beta_fast``, ``yarn_beta_slow``, ``yarn_log_multiplier``.
YARN_KEYS = ("yarn_beta_fast", "yarn_beta_slow", "yarn_log_multiplier")


def rope_inv_freq(
    head_dim: int, base: float, freq_factors: torch.Tensor | None = None, device=None
) -> torch.Tensor:
    """Plain RoPE inverse frequencies (head_dim/2,) float32: base^(-2i/d) / factor_i
    (``freq_factors``: a ``rope_freqs`` tensor)."""
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    return inv if freq_factors is None else inv / freq_factors.to(inv.device)


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude for a context ``scale`` (llama-context.cpp's ``get_mscale``)."""
    return 1.0 if scale <= 1.0 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_corr_dims(n_rot: int, orig_context: int, base: float, beta_fast: float,
                   beta_slow: float) -> tuple[float, float]:
    """The first and last pair index of YaRN's ramp, float32 as ggml computes them
    (``ggml_rope_yarn_corr_dims``: the dimension that turns ``beta`` times over
    ``orig_context`` tokens, floored / ceiled, clamped to 0 .. n_rot - 1)."""
    f = np.float32

    def corr_dim(n: float) -> np.float32:
        return f(n_rot) * np.log(f(orig_context) / (f(n) * f(2) * f(math.pi))) / (
            f(2) * np.log(f(base)))

    with np.errstate(all="ignore"):
        start, end = np.floor(corr_dim(beta_fast)), np.ceil(corr_dim(beta_slow))
    return max(0.0, float(start)), min(n_rot - 1.0, float(end))


@dataclass(frozen=True)
class RopeSpec:
    """A model's RoPE, as its metadata states it (see the module docstring).

    Attributes:
        head_dim: head size (keys); ``n_rot``: dimensions rotated, even, <= head_dim.
        base: ``rope.freq_base`` (Hunyuan: times ``rope.scaling.alpha^(d/(d-2))``).
        neox: halves order (llama.cpp's LLAMA_ROPE_TYPE_NEOX), else adjacent pairs.
        kind: one of :data:`SCALING_TYPES` ("su" is stored as "longrope").
        factor: ``rope.scaling.factor`` (1 when absent).
        orig_context: ``rope.scaling.original_context_length`` (YaRN's ramp, LongRoPE's
            long/short choice, Llama 3's factors).
        attn_factor: ``rope.scaling.attn_factor``, a magnitude of cos and sin.
        ext_factor: YaRN's extrapolation mix (1 for ``yarn``, else 0, as llama.cpp).
        beta_fast, beta_slow: YaRN's ramp ends in rotations over ``orig_context``.
        log_mul: ``rope.scaling.yarn_log_multiplier`` (HF's ``mscale_all_dim``): the magnitude
            becomes get_mscale(factor, mscale) / get_mscale(factor, log_mul).
        mscale: HF's ``mscale`` paired with ``log_mul`` (1; DeepSeek-V2: ``log_mul``).
        low_freq_factor, high_freq_factor: Llama 3's (``kind == "llama3"``).
        base_swa, freq_scale_swa: base and frequency scale of sliding-window layers
            (``rope.freq_base_swa``; llama.cpp's ``get_rope_freq_base``/``_scale``).
    """

    head_dim: int
    n_rot: int
    base: float
    neox: bool
    kind: str = "none"
    factor: float = 1.0
    orig_context: int = 4096
    attn_factor: float = 1.0
    ext_factor: float = 0.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    log_mul: float = 0.0
    mscale: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    base_swa: float | None = None
    freq_scale_swa: float | None = None

    def __str__(self) -> str:
        s = f"{'neox' if self.neox else 'norm'}, {self.n_rot}/{self.head_dim} dims, base {self.base:g}"
        if self.kind != "none":
            s += f", {self.kind} x{self.factor:g} (original context {self.orig_context})"
        if self.base_swa is not None and self.base_swa != self.base:
            s += f", SWA base {self.base_swa:g}"
        return s

    @property
    def freq_scale(self) -> float:
        """llama.cpp's ``rope_freq_scale``: 1 / factor, except for ``none`` and ``llama3``."""
        return 1.0 if self.kind in ("none", "llama3") else 1.0 / self.factor

    def layer(self, swa: bool = False) -> tuple[float, float]:
        """(base, frequency scale) of a global or a sliding-window layer."""
        if not swa:
            return self.base, self.freq_scale
        return (self.base if self.base_swa is None else self.base_swa,
                self.freq_scale if self.freq_scale_swa is None else self.freq_scale_swa)

    def inv_freq(self, *, swa: bool = False, factors: torch.Tensor | None = None) -> torch.Tensor:
        """Inverse frequencies of the rotated pairs, (n_rot/2,) float64: the angle of pair i
        at position p is p times entry i (frequency scale and YaRN's ramp included).
        ``factors``: (n_rot/2,) frequency factors (a file's ``rope_freqs`` or LongRoPE's)."""
        base, fs = self.layer(swa)
        i = torch.arange(self.n_rot // 2, dtype=torch.float64)
        theta = base ** (-2.0 * i / self.n_rot)
        if factors is not None:
            theta = theta / factors.double().cpu()
        elif self.kind == "llama3":
            theta = theta / self.llama3_factors()
        if self.ext_factor == 0.0:
            return theta * fs
        low, high = yarn_corr_dims(self.n_rot, self.orig_context, base, self.beta_fast,
                                   self.beta_slow)
        mix = (1.0 - ((i - low) / max(0.001, high - low)).clamp(0.0, 1.0)) * self.ext_factor
        return theta * (fs * (1.0 - mix) + mix)

    def llama3_factors(self) -> torch.Tensor:
        """Llama 3.1's frequency factors (n_rot/2,) float64, as llama.cpp's converter computes
        the ``rope_freqs`` tensor (``conversion/llama.py``, ``generate_extra_tensors``): 1 for
        wavelengths below orig_context / high_freq_factor, ``factor`` above orig_context /
        low_freq_factor, interpolated between."""
        i = torch.arange(self.n_rot // 2, dtype=torch.float64)
        wavelen = 2 * math.pi * self.base ** (2.0 * i / self.n_rot)
        low_wl = self.orig_context / self.low_freq_factor
        high_wl = self.orig_context / self.high_freq_factor
        smooth = ((self.orig_context / wavelen - self.low_freq_factor)
                  / (self.high_freq_factor - self.low_freq_factor))
        mid = 1.0 / ((1.0 - smooth) / self.factor + smooth)
        return torch.where(wavelen < high_wl, torch.ones_like(wavelen),
                           torch.where(wavelen > low_wl, torch.full_like(wavelen, self.factor),
                                       mid))

    def magnitude(self, *, swa: bool = False) -> float:
        """The factor of cos and sin: ``attn_factor``, and with YaRN its mscale (llama.cpp's
        ``yarn_attn_factor``, which cancels ggml's own 1 + 0.1 ln(factor), times ggml's
        1 + 0.1 ln(1 / layer scale))."""
        m = self.attn_factor
        if self.ext_factor != 0.0:
            f = 1.0 / self.freq_scale
            y = (get_mscale(f, self.mscale) / get_mscale(f, self.log_mul) if self.log_mul
                 else get_mscale(f))
            m *= y / (1.0 + 0.1 * math.log(f)) * (1.0 + 0.1 * math.log(1.0 / self.layer(swa)[1]))
        return m


def read_rope(hp: HParams, *, head_dim: int, context_length: int, neox: bool,
              yarn_keys: tuple[str, ...] = (), base: float = 10_000.0, ntk_alpha: bool = False,
              swa_base: float | None = None, swa_scale: float | None = None,
              log_mul_mscale: bool = False) -> RopeSpec:
    """The RoPE of a file, validated (every key through ``hp``; one GGUFError naming it).

    Args:
        head_dim: the head size (``rope.dimension_count`` may not exceed it).
        context_length: the training context (default original context).
        neox: the family's RoPE order (llama.cpp's ``llama_model_rope_type``).
        yarn_keys: the optional YaRN keys (:data:`YARN_KEYS`) the family's llama.cpp loader
            reads; the others keep llama.cpp's defaults whatever the file says.
        base: the family's default ``rope.freq_base``.
        ntk_alpha: read ``rope.scaling.alpha`` (Hunyuan's NTK-aware base).
        swa_base: default base of sliding-window layers when ``rope.freq_base_swa`` is
            absent (None: the global base; the key is read in either case).
        swa_scale: frequency scale of sliding-window layers (None: the global one).
        log_mul_mscale: DeepSeek-V2's rule, mscale = log_mul where log_mul != 1.
    Raises:
        GGUFError: an unknown scaling type, a factor <= 0, a dimension count that is odd or
            above the head size, a YaRN base <= 1, Llama 3 factors out of order.
    """
    n_rot = hp.int("rope.dimension_count", head_dim, lo=2, hi=head_dim)
    hp.require(n_rot % 2 == 0, "rope.dimension_count", f"{n_rot} is odd (RoPE turns pairs)")
    freq_base = hp.float("rope.freq_base", base)
    if ntk_alpha:
        alpha = hp.float("rope.scaling.alpha", None)
        if alpha is not None:
            hp.require(head_dim > 2, "rope.scaling.alpha", "needs a head size above 2")
            freq_base *= alpha ** (head_dim / (head_dim - 2))
    factor = hp.float("rope.scaling.factor", None)
    if factor is None:
        factor = hp.float("rope.scale_linear", None)
    kind = hp.str("rope.scaling.type", "linear")
    hp.require(kind in SCALING_TYPES, "rope.scaling.type",
               f"{kind[:40]!r} is not a RoPE scaling type (one of {', '.join(SCALING_TYPES)})")
    kind = "longrope" if kind == "su" else kind
    if kind == "linear" and factor in (None, 1.0):
        kind = "none"
    kw: dict = {}
    orig = hp.int("rope.scaling.original_context_length", context_length, hi=MAX_CONTEXT)
    if kind == "yarn":
        hp.require(freq_base > 1.0, "rope.freq_base",
                   "must be > 1 for YaRN scaling (its correction dimensions divide by log(base))")
        kw["ext_factor"] = 1.0
        if "yarn_beta_fast" in yarn_keys:
            kw["beta_fast"] = hp.float("rope.scaling.yarn_beta_fast", 32.0)
        if "yarn_beta_slow" in yarn_keys:
            kw["beta_slow"] = hp.float("rope.scaling.yarn_beta_slow", 1.0)
        if "yarn_log_multiplier" in yarn_keys:
            log_mul = hp.float("rope.scaling.yarn_log_multiplier", 0.0, lo=0.0, lo_open=False)
            kw["log_mul"] = log_mul
            if log_mul_mscale and log_mul not in (0.0, 1.0):
                kw["mscale"] = log_mul
    if kind == "llama3":
        kw["low_freq_factor"] = hp.float("rope.scaling.low_freq_factor", 1.0)
        kw["high_freq_factor"] = hp.float("rope.scaling.high_freq_factor", 4.0)
        hp.require(kw["high_freq_factor"] > kw["low_freq_factor"],
                   "rope.scaling.high_freq_factor", "must exceed rope.scaling.low_freq_factor")
        factor = 8.0 if factor is None else factor
    spec = RopeSpec(head_dim=head_dim, n_rot=n_rot, base=freq_base, neox=neox, kind=kind,
                    factor=factor or 1.0, orig_context=orig,
                    attn_factor=hp.float("rope.scaling.attn_factor", 1.0),
                    base_swa=hp.float("rope.freq_base_swa", swa_base),
                    freq_scale_swa=swa_scale, **kw)
    for swa in (False, True):
        m = spec.magnitude(swa=swa)
        hp.require(math.isfinite(m) and m > 0, "rope.scaling.factor",
                   f"{spec.factor:g} gives a RoPE magnitude of {m:g}")
    return spec


def factor_specs(spec: RopeSpec) -> list[TensorSpec]:
    """The optional frequency-factor tensors llama.cpp loads with a RoPE (``llama.cpp``,
    ``mistral3``, ``granite``...: ``rope_factors_long`` / ``rope_factors_short`` for
    LongRoPE, else ``rope_freqs``), (n_rot/2,) each."""
    names = (("rope_factors_long", "rope_factors_short") if spec.kind == "longrope"
             else ("rope_freqs",))
    return [TensorSpec(f"{n}.weight", (spec.n_rot // 2,), optional=True) for n in names]


@dataclass
class RopeWeights(Weights):
    """Top-level tensors with a model's frequency factors (:func:`factor_specs`)."""

    rope_freqs: torch.Tensor | None = None  # (n_rot/2,): Llama 3.x, EXAONE ...
    rope_factors_long: torch.Tensor | None = None  # LongRoPE (n_rot/2,)
    rope_factors_short: torch.Tensor | None = None


# The kinds of layer a model's RoPE tables serve: the global layers, the sliding-window
# layers (their own base and scale) and the layers without positions (NoPE).
GLOBAL, SWA, NOPE = "global", "swa", "nope"


class Rope:
    """A model's RoPE tables for each kind of layer (:data:`GLOBAL`, :data:`SWA`,
    :data:`NOPE`), built once in ``prepare`` from the spec and the file's factor tensors.

    Per forward, :meth:`angles` gives each kind's angles through the backend's
    ``ops.rope_angles`` (inverse frequencies padded to head_dim/2 with zeros, so that
    partial RoPE and NoPE layers rotate whole heads by nothing past ``n_rot``); the model
    passes a layer's angles to ``ops.self_attention``, multiplies its attention scale by
    :meth:`score_scale`, and puts queries and keys through :meth:`arrange` (and QK-norm
    weights through :meth:`arrange_weight`) before they reach the norm or the rotation.

    The magnitude of cos and sin (:meth:`RopeSpec.magnitude`) is folded into the scores'
    scale (its square) where every dimension is rotated and nothing normalizes after the
    rotation (``norm_after``: Hunyuan's QK-norm, which cancels it); otherwise it is a
    per-pair factor of the angles (1 past ``n_rot``).
    """

    def __init__(self, spec: RopeSpec, device, *, rope_freqs: torch.Tensor | None = None,
                 factors_long: torch.Tensor | None = None,
                 factors_short: torch.Tensor | None = None, norm_after: bool = False) -> None:
        self.spec = spec
        self.device = device
        half = spec.head_dim // 2
        fold = spec.n_rot == spec.head_dim and not norm_after
        # factor sets: "long" / "short" (LongRoPE, chosen per sequence by its context), or one
        sets = ({"long": factors_long, "short": factors_short} if rope_freqs is None
                and (factors_long is not None or factors_short is not None)
                else {"": rope_freqs})
        self._long = "long" in sets
        self._tables: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
        self._score: dict[str, float] = {NOPE: 1.0}
        for kind in (GLOBAL, SWA):
            m = spec.magnitude(swa=kind == SWA)
            self._score[kind] = m * m if fold else 1.0
            mag = None
            if not fold and m != 1.0:
                mag = torch.ones(half, dtype=torch.float32)
                mag[:spec.n_rot // 2] = m
                mag = mag.to(device)
            for name, ff in sets.items():
                inv = torch.zeros(half, dtype=torch.float64)
                inv[:spec.n_rot // 2] = spec.inv_freq(swa=kind == SWA, factors=ff)
                self._tables[(kind, name)] = (inv.float().to(device), mag)
        self._tables[(NOPE, "")] = (torch.zeros(half, dtype=torch.float32, device=device),
                                    None)
        self.perm: torch.Tensor | None = None
        if spec.neox and spec.n_rot < spec.head_dim:
            r, d = spec.n_rot // 2, spec.head_dim
            p = (d - spec.n_rot) // 2
            self.perm = torch.cat([torch.arange(0, r), torch.arange(2 * r, 2 * r + p),
                                   torch.arange(r, 2 * r), torch.arange(2 * r + p, d)]).to(device)

    @classmethod
    def of(cls, spec: RopeSpec, weights: RopeWeights, device, *, norm_after: bool = False) -> Rope:
        """The tables of ``spec`` with the factor tensors of a model's ``weights``."""
        return cls(spec, device, rope_freqs=weights.rope_freqs,
                   factors_long=weights.rope_factors_long,
                   factors_short=weights.rope_factors_short, norm_after=norm_after)

    def score_scale(self, kind: str = GLOBAL) -> float:
        """The factor of a layer kind's attention scale (the folded magnitude squared)."""
        return self._score[kind]

    def angles(self, ops, positions: torch.Tensor, ctx_size: int,
               kinds: tuple[str, ...] = (GLOBAL,)) -> dict:
        """Each kind's angles (opaque, from ``ops.rope_angles``) at ``positions`` (T,) int64,
        for a sequence whose context is ``ctx_size`` tokens (LongRoPE's choice of factors,
        llama.cpp's ``get_rope_factors``: long where it exceeds the original context)."""
        which = ("long" if ctx_size > self.spec.orig_context else "short") if self._long else ""
        out = {}
        for kind in kinds:
            inv, mag = self._tables[(kind, "" if kind == NOPE else which)]
            out[kind] = ops.rope_angles(positions, inv, 1.0, mag)
        return out

    def arrange(self, x: torch.Tensor) -> torch.Tensor:
        """Queries or keys (T, n_heads * head_dim) in the order the rotation expects (the
        partial-NEOX permutation of each head; ``x`` itself otherwise)."""
        if self.perm is None:
            return x
        t = x.shape[0]
        return x.view(t, -1, self.spec.head_dim)[:, :, self.perm].reshape(t, -1)

    def arrange_weight(self, w: torch.Tensor | None) -> torch.Tensor | None:
        """A QK-norm weight (head_dim,) or (n_heads * head_dim,) in :meth:`arrange`'s order."""
        if w is None or self.perm is None:
            return w
        return w.view(-1, self.spec.head_dim)[:, self.perm].reshape(w.shape).contiguous()
