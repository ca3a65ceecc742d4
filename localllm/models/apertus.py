"""Apertus (``apertus``), as llama.cpp's ``src/models/apertus.cpp`` computes it.

Per layer::

    h   = x + wo(attn(attn_norm(x)))          # per-head QK-norm before RoPE (NEOX)
    out = h + down(xielu_l(up(ffn_norm(h))))  # no gate: the xIELU activation

xIELU's parameters are per layer (``xielu.alpha_n``, ``xielu.alpha_p``, ``xielu.beta``,
``xielu.eps``: a number or one per layer, keys outside the ``apertus.`` namespace as
llama.cpp names them); the effective ones are ``alpha_p = softplus(a_p)``,
``alpha_n = beta + softplus(a_n)`` (``ggml_xielu``). RoPE: Llama 3's factors
(``rope_freqs``, or the ``llama3`` keys), or any :mod:`localllm.models.rope` scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import REQUIRED, DecoderArgs, TensorSpec, head_specs, qkv_specs
from .common import Linear
from .decoder import Block, Decoder, Step, kv_layout
from .rope import factor_specs, read_rope

XIELU_KEYS = ("alpha_n", "alpha_p", "beta", "eps")


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``apertus.*`` and ``xielu.*`` metadata keys."""

    ffn_dim: int
    xielu: tuple[tuple[float, float, float, float], ...] = ()  # per layer: alpha_n, alpha_p, beta, eps

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named; an
                ``xielu.*`` array of another length than block_count).
        """
        hp, c = cls.read(md, n_vocab, source)
        ffn = hp.int("feed_forward_length", REQUIRED, per_layer=True)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        # raw values as the file stores them (softplus'd in Model.prepare); bounded so that
        # the activation stays finite
        cols = [hp.floats(f"xielu.{k}", c["n_layers"], REQUIRED, lo=-1e4, hi=1e4)
                for k in XIELU_KEYS]
        return cls(**c, rope=rope, ffn_dim=ffn, xielu=tuple(zip(*cols)))


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``apertus`` tensors (``load_arch_tensors``), torch shapes."""
    d, hd, v = a.d_model, a.head_dim, a.n_vocab
    nq = a.n_heads * hd
    specs = [TensorSpec("token_embd.weight", (v, d)), *factor_specs(a.rope)]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  *qkv_specs(p, d, a.n_heads, a.n_kv_heads, hd),
                  TensorSpec(p + "attn_q_norm.weight", (hd,)),
                  TensorSpec(p + "attn_k_norm.weight", (hd,)),
                  TensorSpec(p + "attn_output.weight", (d, nq)),
                  TensorSpec(p + "attn_output.bias", (d,), optional=True),
                  TensorSpec(p + "ffn_norm.weight", (d,)),
                  TensorSpec(p + "ffn_up.weight", (a.ffn_dim, d)),
                  TensorSpec(p + "ffn_down.weight", (d, a.ffn_dim))]
    specs += head_specs(d, v, tied=False)  # required: llama.cpp ties no head
    return specs


memory_layout = kv_layout


@dataclass
class Layer(Block):
    """The tensors of one block (``blk.{i}.*``)."""

    attn_q_norm: torch.Tensor
    attn_k_norm: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_up: Linear
    ffn_down: Linear


def softplus(x: float) -> float:
    """ggml's ``ggml_compute_softplus_f32``: x above 20, else ln(1 + e^x)."""
    return x if x > 20.0 else math.log1p(math.exp(x))


class Model(Decoder):
    """An Apertus decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        self.set_rope(a.head_dim ** -0.5)
        # ggml_xielu's effective parameters: (alpha_n, alpha_p, beta, eps) per layer
        self.act = [(beta + softplus(an), softplus(ap), beta, eps)
                    for an, ap, beta, eps in a.xielu]
        for b in self.layers:
            b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        ops, eps = self.ops, self.args.norm_eps
        o = self.attention(b, n, cache, step, q_norm=b.attn_q_norm, k_norm=b.attn_k_norm)
        h, n = ops.residual_norm(x, o, None, b.ffn_norm, eps)
        del o, x
        f = b.ffn_down(ops.xielu(b.ffn_up(n), *self.act[i]))
        del n
        return ops.residual_norm(h, f, None, next_norm, eps)
