"""Building blocks shared by the architectures: linear layers and embeddings over a
backend's :class:`~localllm.backends.Matrix`, RoPE frequency tables, positions.

The operations themselves (norms, RoPE rotation, attention, activations) belong to the
backend (``model.ops``); a model's forward composes these blocks and those ops and never asks
what kind of weight it holds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


class Linear:
    """``y = x @ W.T (+ b)`` for a weight :class:`~localllm.backends.Matrix` (out, in).

    With ``sizes`` the weight holds several projections of the same input stacked by rows
    (fused Q/K/V or gate/up, see :func:`fuse`, or a file's own fused ``attn_qkv``) and the
    call returns one output per part.
    """

    def __init__(self, weight, bias: torch.Tensor | None = None,
                 sizes: Sequence[int] | None = None) -> None:
        self.weight = weight
        self.bias = bias  # (out,) float32 or None
        self.sizes = list(sizes) if sizes is not None else None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor):
        """x: (T, in) float32 -> (T, out) float32, or a tuple of (T, out_i) with ``sizes``."""
        y = self.weight(x)
        if self.bias is not None:
            y = y + self.bias
        return y if self.sizes is None else y.split(self.sizes, dim=-1)


class Split:
    """Projections of one input that cannot share a product (different kinds or types):
    one output per part."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p(x) for p in self.parts)


def fuse(parts: list[Linear]) -> Linear | Split:
    """One :class:`Linear` for projections of one input when their weights stack
    (:meth:`~localllm.backends.Matrix.stack`: same kind and type), else a :class:`Split`;
    both return one output per part. One larger product costs less than several, above all
    in decode."""
    sizes = [p.out_features for p in parts]
    stacked = parts[0].weight.stack([p.weight for p in parts[1:]])
    if stacked is None:
        return Split(parts)
    biases = [p.bias for p in parts]
    bias = None
    if any(b is not None for b in biases):
        device = next(b for b in biases if b is not None).device
        bias = torch.cat([b if b is not None else torch.zeros(n, device=device)
                          for b, n in zip(biases, sizes)])
    return Linear(stacked, bias, sizes)


class Embedding:
    """The token embedding table (n_vocab, d), a :class:`~localllm.backends.Matrix` whose
    looked-up rows are dequantized; ``head`` is the tied output projection."""

    def __init__(self, weight) -> None:
        self.weight = weight
        self.head = Linear(weight)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (T,) int64 -> (T, d) float32."""
        return self.weight.rows(tokens)


def rope_inv_freq(
    head_dim: int, base: float, freq_factors: torch.Tensor | None = None, device=None
) -> torch.Tensor:
    """RoPE inverse frequencies (head_dim/2,) float32: base^(-2i/d) / factor_i.

    ``freq_factors`` is llama.cpp's ``rope_freqs.weight`` (Llama 3.1 long-context scaling).
    """
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    return inv if freq_factors is None else inv / freq_factors.to(inv.device)


def yarn_rope(head_dim: int, base: float, factor: float, orig_context: int, *,
              beta_fast: float = 32.0, beta_slow: float = 1.0,
              ext_factor: float = 1.0) -> tuple[torch.Tensor, float]:
    """YaRN RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as
    ggml's ``rope_yarn`` computes it (``ggml/src/ggml-cpu/ops.cpp``,
    ``ggml_rope_yarn_corr_dims``): the rotation angle of pair i at position p is
    ``p * inv_freq_i * m_i`` with ``m_i = (1 - r_i) / factor + r_i``, where the ramp ``r_i``
    (times ``ext_factor``) is 1 for the high-frequency pairs below the correction dimension of
    ``beta_fast`` rotations over ``orig_context`` tokens, 0 above that of ``beta_slow``, and
    linear between; cos and sin are multiplied by ``mscale = 1 + 0.1 ln(factor)`` (when
    ``ext_factor`` is not 0).

    Returns:
        (divisors (head_dim/2,) float32 to divide ``inv_freq`` by, as ``rope_freqs`` factors
        are, i.e. 1 / m_i; mscale). Multiplying cos and sin by mscale equals scaling the
        attention scores by mscale**2, which is how the architectures apply it.
    """
    def corr_dim(n_rot: float) -> float:
        return head_dim * math.log(orig_context / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(head_dim - 1.0, math.ceil(corr_dim(beta_slow)))
    i = torch.arange(head_dim // 2, dtype=torch.float32)
    ramp = 1.0 - ((i - low) / max(0.001, high - low)).clamp(0.0, 1.0)
    mix = ramp * ext_factor
    m = (1.0 - mix) / factor + mix
    mscale = 1.0 + 0.1 * math.log(factor) if ext_factor != 0.0 else 1.0
    return 1.0 / m, mscale


def positions_of(pos: int | torch.Tensor, t: int, device) -> torch.Tensor:
    """Absolute positions (T,) int64 of ``t`` tokens starting at ``pos`` (int or (1,) tensor)."""
    if isinstance(pos, torch.Tensor):
        if t != 1:
            raise ValueError("a position held in a tensor (static decode) takes one token")
        return pos
    return torch.arange(pos, pos + t, device=device)


def default_attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
