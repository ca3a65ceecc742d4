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

from ..memory import KVSpec
from .base import REQUIRED, BaseModel, DecoderArgs, HParams, TensorSpec, common_hparams
from .common import Linear, Split, positions_of
from .rope import Rope, read_rope


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
        hp = HParams(md, source)
        c = common_hparams(hp, n_vocab, eps=1e-6)
        ffn = hp.int("feed_forward_length", REQUIRED, per_layer=True)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        return cls(**c, rope=rope, ffn_dim=ffn)


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``olmo2`` tensors, torch shapes."""
    d, hd, v = a.d_model, a.head_dim, a.n_vocab
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_q.weight", (nq, d)),
                  TensorSpec(p + "attn_k.weight", (nkv, d)),
                  TensorSpec(p + "attn_v.weight", (nkv, d)),
                  TensorSpec(p + "attn_q_norm.weight", (nq,)),
                  TensorSpec(p + "attn_k_norm.weight", (nkv,)),
                  TensorSpec(p + "attn_output.weight", (d, nq)),
                  TensorSpec(p + "post_attention_norm.weight", (d,)),
                  TensorSpec(p + "ffn_gate.weight", (a.ffn_dim, d)),
                  TensorSpec(p + "ffn_up.weight", (a.ffn_dim, d)),
                  TensorSpec(p + "ffn_down.weight", (d, a.ffn_dim)),
                  TensorSpec(p + "post_ffw_norm.weight", (d,))]
    specs += [TensorSpec("output_norm.weight", (d,)),
              TensorSpec("output.weight", (v, d), optional=True)]
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim)] * a.n_layers


@dataclass
class Layer:
    """The tensors of one block (``blk.{i}.*``)."""

    attn_qkv: Linear | Split  # fused attn_q, attn_k, attn_v
    attn_q_norm: torch.Tensor  # over all heads (n_heads * head_dim,)
    attn_k_norm: torch.Tensor
    attn_output: Linear
    post_attention_norm: torch.Tensor
    ffn_gate_up: Linear | Split  # fused ffn_gate, ffn_up
    ffn_down: Linear
    post_ffw_norm: torch.Tensor


class Model(BaseModel):
    """An OLMo 2 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        self.rope = Rope(a.rope, self.device)
        self.scale = a.head_dim ** -0.5 * self.rope.score_scale()
        for b in self.layers:  # QK-norm over all heads, in the rotation's order
            b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def forward(self, tokens: torch.Tensor, pos: int | torch.Tensor, memory, *,
                all_logits: bool = False, logits_start: int = 0) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32:
        (1, n_vocab) for the last position, or (T - logits_start, n_vocab) with all_logits."""
        a, ops = self.args, self.ops
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.token_embd(tokens)
        angles = self.rope.angles(ops, positions, memory.ctx_size)["global"]
        eps = a.norm_eps
        for b, cache in zip(self.layers, memory):
            q, k, v = b.attn_qkv(x)
            # The QK-norm spans all heads: applied here, before the per-head RoPE.
            q = ops.rms_norm(self.rope.arrange(q), b.attn_q_norm, eps)
            k = ops.rms_norm(self.rope.arrange(k), b.attn_k_norm, eps)
            attn = ops.self_attention(q, k, v, None, None, eps, angles, cache, pos, positions,
                                      head_dim=a.head_dim, neox=True, scale=self.scale)
            h = x + ops.rms_norm(b.attn_output(attn), b.post_attention_norm, eps)
            gate, up = b.ffn_gate_up(h)
            x = h + ops.rms_norm(b.ffn_down(ops.gated(gate, up, "silu")), b.post_ffw_norm, eps)
        n = ops.rms_norm(x, self.output_norm, eps)
        return self.output(n[logits_start:] if all_logits else n[-1:])
