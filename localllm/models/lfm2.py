"""LFM2 (``lfm2``: LiquidAI LFM2 / LFM2.5 350M-2.6B; llama.cpp's ``src/models/lfm2.cpp``):
gated short-convolution layers with a few attention layers between them
(``attention.head_count_kv`` 0 marks a convolution layer), each followed by a SwiGLU FFN::

    h   = x + operator(attn_norm(x))
    out = h + ffn(ffn_norm(h))

    conv operator:  B, C, X = split(in_proj(n), 3)
                    y = out_proj(C * conv(B * X))      # causal, shortconv.l_cache taps
    attention:      QK-norm, RoPE over halves (NEOX), 1/sqrt(head_dim); sliding-window
                    when ``attention.sliding_window`` is set

The final norm is the file's ``token_embd_norm.weight`` (llama.cpp's "fix for wrong tensor
name"). A convolution layer remembers its last ``l_cache - 1`` inputs (``conv``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import KVSpec, RecurrentSpec
from .base import MAX_CONTEXT, REQUIRED, TensorSpec
from .common import Embedding, Linear, Split, swiglu
from .decoder import Step
from .hybrid import AttendingArgs, AttentionWeights, HybridDecoder, attention_specs
from .mamba import MAX_CONV
from .rope import Rope


@dataclass(kw_only=True)
class ModelArgs(AttendingArgs):
    """Hyperparameters from ``lfm2.*`` metadata keys (0 KV heads: a convolution layer)."""

    ffn_dim: int
    l_cache: int  # shortconv.l_cache: taps of the convolution
    sliding_window: int | None = None

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters.

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
            UnsupportedError: partial RoPE.
        """

        hp, c = cls.read(md, n_vocab, source)
        ha, d = cls.read_heads(hp, c), c["d_model"]
        for i, (h, k) in enumerate(zip(ha.n_heads, ha.n_kv_heads)):
            hp.require(k == 0 or h * ha.head_dim == d, "attention.head_count",
                       f"layer {i}: {h} heads of {ha.head_dim} differ from "
                       f"embedding_length {d} (LFM2's attention keeps the width)")
        window = hp.int("attention.sliding_window", 0, lo=0, hi=MAX_CONTEXT)
        return cls(**c, heads=ha, ffn_dim=hp.int("feed_forward_length", REQUIRED, per_layer=True),
                   l_cache=hp.int("shortconv.l_cache", REQUIRED, lo=2, hi=MAX_CONV),
                   rope=cls.whole_head_rope(hp, ha.head_dim, c["context_length"], neox=True),
                   sliding_window=window or None)


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of ``lfm2`` (``llama_model_lfm2::load_arch_tensors``)."""
    d, v, f, hd = a.d_model, a.n_vocab, a.ffn_dim, a.heads.head_dim
    specs = [TensorSpec("token_embd.weight", (v, d)),
             TensorSpec("token_embd_norm.weight", (d,)),
             TensorSpec("output.weight", (v, d), optional=True)]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  TensorSpec(p + "ffn_norm.weight", (d,)),
                  TensorSpec(p + "ffn_gate.weight", (f, d)),
                  TensorSpec(p + "ffn_up.weight", (f, d)),
                  TensorSpec(p + "ffn_down.weight", (d, f))]
        if a.recurrent[i]:
            specs += [TensorSpec(p + "shortconv.conv.weight", (d, a.l_cache)),
                      TensorSpec(p + "shortconv.in_proj.weight", (3 * d, d)),
                      TensorSpec(p + "shortconv.out_proj.weight", (d, d))]
        else:
            specs += attention_specs(p, d, a.heads.n_heads[i], a.heads.n_kv_heads[i], hd,
                                     qk_norm=True)
    return specs


def memory_layout(a: ModelArgs) -> list:
    """Per layer: the convolution's last inputs, or a KV cache (a ring with a window)."""
    conv = RecurrentSpec((("conv", (a.l_cache - 1, a.d_model)),))
    return [conv if r else KVSpec(kv, a.heads.head_dim, a.sliding_window)
            for r, kv in zip(a.recurrent, a.heads.n_kv_heads)]


@dataclass
class Layer(AttentionWeights):
    """The tensors of one block."""

    attn_norm: torch.Tensor | None = None
    ffn_norm: torch.Tensor | None = None
    ffn_gate_up: Linear | Split | None = None
    ffn_down: Linear | None = None
    shortconv_conv: torch.Tensor | None = None  # (d, l_cache)
    shortconv_in_proj: Linear | None = None  # (3 d, d): B, C, X
    shortconv_out_proj: Linear | None = None


@dataclass
class Lfm2Weights:
    """The top-level tensors: the output norm is ``token_embd_norm``."""

    token_embd: Embedding
    token_embd_norm: torch.Tensor
    output: Linear | None = None


def short_conv_block(b: Layer, x: torch.Tensor, state, ops) -> torch.Tensor:
    """LFM2's gated convolution operator on a normed x (T, d) -> (T, d); ``state`` the
    layer's :class:`~localllm.memory.RecurrentState` (``conv``: the last B*X rows)."""
    bb, c, xx = b.shortconv_in_proj(x).chunk(3, dim=-1)
    y = ops.short_conv(bb * xx, b.shortconv_conv, None, state["conv"], silu=False)
    del bb, xx
    state.advance(x.shape[0])
    return b.shortconv_out_proj(c * y)


class Model(HybridDecoder):
    """An LFM2 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    WEIGHTS = Lfm2Weights
    token_embd_norm: torch.Tensor

    def prepare(self) -> None:
        a = self.args
        self.output_norm = self.token_embd_norm
        self.set_rope(a.heads.head_dim ** -0.5, rope=Rope(a.rope, self.device))

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.args, self.ops
        if a.recurrent[i]:
            f = short_conv_block(b, n, cache, ops)
        else:
            f = self.attend(b, n, cache, step)
        h, n = ops.residual_norm(x, f, None, b.ffn_norm, a.norm_eps)
        f = swiglu(ops, b.ffn_gate_up, b.ffn_down, n)
        return ops.residual_norm(h, f, None, next_norm, a.norm_eps)
