"""OLMo 2 (``olmo2``), as llama.cpp's ``src/models/olmo2.cpp`` computes it.

Per layer (no pre-norms: the norms follow each sublayer)::

    h   = x + post_attention_norm(wo(attn(q, k, v)))   # q = q_norm(wq x), k = k_norm(wk x)
    out = h + post_ffw_norm(down(silu(gate(h)) * up(h)))

The QK-norm is an RMSNorm over all heads together (weights of n_heads * head_dim and
n_kv_heads * head_dim), unlike Qwen 3's per-head norm. RoPE rotates halves (NEOX).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import REQUIRED, DecoderArgs, TensorSpec, head_specs
from .decoder import PostNormDecoder, PostNormLayer, Step, kv_layout, post_norm_specs
from .rope import read_rope


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``olmo2.*`` metadata keys."""

    ffn_dim: int
    norm_eps: float = 1e-6

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
        """
        hp, c = cls.read(md, n_vocab, source, eps=1e-6)
        ffn = hp.int("feed_forward_length", REQUIRED, per_layer=True)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        return cls(**c, rope=rope, ffn_dim=ffn)


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``olmo2`` tensors, torch shapes: QK-norms over all heads, no biases."""
    d, v = a.d_model, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        specs += post_norm_specs(f"blk.{i}.", a, qkv_bias="none",
                                 qk_norm=(a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim))
    specs += head_specs(d, v)
    return specs


memory_layout = kv_layout


class Model(PostNormDecoder):
    """An OLMo 2 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = PostNormLayer  # QK-norms over all heads (n_heads * head_dim,)

    def prepare(self) -> None:
        a = self.args
        self.set_rope(a.head_dim ** -0.5)
        for b in self.layers:  # QK-norm over all heads, in the rotation's order
            b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def post_norm_block(self, i: int, b: PostNormLayer, cache, x: torch.Tensor, step: Step
                        ) -> torch.Tensor:
        return super().post_norm_block(i, b, cache, x, step, q_norm=b.attn_q_norm,
                                       k_norm=b.attn_k_norm, whole_qk_norm=True)
