"""Building blocks shared by the architectures: linear layers and embeddings over a
backend's :class:`~localllm.backends.Matrix`, positions (RoPE: :mod:`localllm.models.rope`).

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


def swiglu(ops, gate_up: Linear | Split, down: Linear, x: torch.Tensor) -> torch.Tensor:
    """A SwiGLU FFN on x (T, d) float32 -> (T, d) float32: ``down(silu(gate(x)) * up(x))``,
    gate and up one fused product (``ffn_gate_up``, a shared expert's ``ffn_gate_up_shexp``)."""
    gate, up = gate_up(x)
    return down(ops.gated(gate, up, "silu", overwrite=True))


def positions_of(pos: int | torch.Tensor, t: int, device) -> torch.Tensor:
    """Absolute positions (T,) int64 of ``t`` tokens starting at ``pos`` (int or (1,) tensor)."""
    if isinstance(pos, torch.Tensor):
        if t != 1:
            raise ValueError("a position held in a tensor (static decode) takes one token")
        return pos
    return torch.arange(pos, pos + t, device=device)


def default_attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
