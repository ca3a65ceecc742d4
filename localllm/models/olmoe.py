"""OLMoE (``olmoe``: OLMoE-1B-7B), as llama.cpp's ``src/models/olmoe.cpp`` computes it.

Per layer (pre-norms)::

    h   = x + wo(attn(attn_norm(x)))      # q = q_norm(wq x), k = k_norm(wk x)
    out = h + moe(ffn_norm(h))

The QK-norm is an RMSNorm over all heads together (weights of n_heads * head_dim and
n_kv_heads * head_dim), as OLMo 2's; RoPE rotates halves (NEOX). The MoE: router
``ffn_gate_inp`` -> softmax over the experts -> the top ``expert_used_count``, their
probabilities as weights, not renormalised (:func:`localllm.models.moe.route`) -> SwiGLU
experts ``feed_forward_length`` wide; no shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import TensorSpec, head_specs, qkv_specs
from .decoder import Block, Decoder, Step, kv_layout
from .moe import AllExpertsArgs, ExpertWeights, Routing, expert_specs, moe_ffn

ROUTING = Routing()  # softmax, the chosen probabilities as they are


class ModelArgs(AllExpertsArgs):
    """Hyperparameters from ``olmoe.*`` metadata keys."""


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``olmoe`` tensors (``llama_model_olmoe::load_arch_tensors``), torch
    shapes."""
    d, hd, v = a.d_model, a.head_dim, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  *qkv_specs(p, d, a.n_heads, a.n_kv_heads, hd),
                  TensorSpec(p + "attn_q_norm.weight", (a.n_heads * hd,)),
                  TensorSpec(p + "attn_k_norm.weight", (a.n_kv_heads * hd,)),
                  TensorSpec(p + "attn_output.weight", (d, a.n_heads * hd)),
                  TensorSpec(p + "ffn_norm.weight", (d,)),
                  *expert_specs(p, d, a.n_expert, a.ffn_dim)]
    return specs + head_specs(d, v, tied=False)


memory_layout = kv_layout


@dataclass
class Layer(Block, ExpertWeights):
    """The tensors of one block (``blk.{i}.*``)."""

    attn_q_norm: torch.Tensor  # over all heads (n_heads * head_dim,)
    attn_k_norm: torch.Tensor
    ffn_norm: torch.Tensor


class Model(Decoder):
    """An OLMoE decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        self.set_rope(a.attention_scale)
        for b in self.layers:  # QK-norm over all heads, in the rotation's order
            b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.args, self.ops
        # the QK-norm spans all heads: applied before the per-head RoPE
        o = self.attention(b, n, cache, step, q_norm=b.attn_q_norm, k_norm=b.attn_k_norm,
                           whole_qk_norm=True)
        h, n = ops.residual_norm(x, o, None, b.ffn_norm, a.norm_eps)
        del o, x
        f = moe_ffn(ops, b, n, a.n_expert_used, ROUTING)
        del n
        return ops.residual_norm(h, f, None, next_norm, a.norm_eps)
