"""Phi-3 / Phi-4-mini (``phi3``), as llama.cpp's ``src/models/phi3.cpp`` computes it.

Per layer::

    h   = x + wo(attn(attn_norm(x)))          # Q/K/V from one fused ``attn_qkv`` tensor
    out = h + down(silu(g) * u),  (g, u) = halves of ffn_up(ffn_norm(h))

RoPE rotates halves (NEOX), over all or the first ``rope.dimension_count`` dimensions of a
head (Phi-4-mini: 96 of 128). LongRoPE ("su") scaling: per-frequency factors from the
``rope_factors_short`` / ``rope_factors_long`` tensors, the long ones when the context
exceeds ``rope.scaling.original_context_length`` (llama.cpp's ``get_rope_factors``), and the
rotated dimensions of Q and K scaled by ``rope.scaling.attn_factor``
(:mod:`localllm.models.rope`). ``attention.sliding_window`` is read but not used: llama.cpp
disables Phi-3's SWA too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import MAX_CONTEXT, REQUIRED, DecoderArgs, TensorSpec, head_specs
from .common import Linear, swiglu
from .decoder import Block, Decoder, Step, kv_layout
from .rope import read_rope


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``phi3.*`` metadata keys."""

    ffn_dim: int
    attention_scale: float = 0.0

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
        """
        hp, c = cls.read(md, n_vocab, source)
        ffn = hp.int("feed_forward_length", REQUIRED, per_layer=True)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        hp.int("attention.sliding_window", None, lo=0, hi=MAX_CONTEXT)  # validated, unused
        return cls(**c, rope=rope, ffn_dim=ffn, attention_scale=1.0 / c["head_dim"] ** 0.5)


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``phi3`` tensors (fused ``attn_qkv``, ``ffn_up`` holding gate and up)."""
    d, hd, v = a.d_model, a.head_dim, a.n_vocab
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    r = a.rope.n_rot // 2  # llama.cpp's phi3 loads both factor sets whatever the scaling
    specs = [TensorSpec("token_embd.weight", (v, d)),
             TensorSpec("rope_factors_long.weight", (r,), optional=True),
             TensorSpec("rope_factors_short.weight", (r,), optional=True)]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  TensorSpec(p + "attn_qkv.weight", (nq + 2 * nkv, d), parts=(nq, nkv, nkv)),
                  TensorSpec(p + "attn_output.weight", (d, nq)),
                  TensorSpec(p + "ffn_norm.weight", (d,)),
                  TensorSpec(p + "ffn_up.weight", (2 * a.ffn_dim, d),
                             parts=(a.ffn_dim, a.ffn_dim)),
                  TensorSpec(p + "ffn_down.weight", (d, a.ffn_dim))]
    specs += head_specs(d, v)
    return specs


memory_layout = kv_layout


@dataclass
class Layer(Block):
    """The tensors of one block (``blk.{i}.*``)."""

    ffn_norm: torch.Tensor
    ffn_up: Linear  # gate and up stacked: returns (gate, up)
    ffn_down: Linear


class Model(Decoder):
    """A Phi-3 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    FUSE: ClassVar[dict] = {}  # the file's tensors are fused already

    def prepare(self) -> None:
        # the long or short factors by the sequence's context (a per-session choice)
        self.set_rope(self.args.attention_scale)

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        ops, eps = self.ops, self.args.norm_eps
        h, n = ops.residual_norm(x, self.attention(b, n, cache, step), None, b.ffn_norm, eps)
        return ops.residual_norm(h, swiglu(ops, b.ffn_up, b.ffn_down, n), None, next_norm, eps)
