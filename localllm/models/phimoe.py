"""Phi-3.5-MoE (``phimoe``), as llama.cpp computes it (``src/models/phimoe.cpp`` for the
tensors, the graph of ``src/models/phi3.cpp``).

Per layer::

    h   = x + wo(attn(attn_norm(x))) + bo     # optional Q/K/V biases
    out = h + moe(ffn_norm(h))

Every norm is an RMSNorm followed by a bias (``attn_norm.bias``, ``ffn_norm.bias``,
``output_norm.bias``: llama.cpp's ``build_norm`` with LLM_NORM_RMS and a bias), and the
output projection has a bias. RoPE rotates halves (NEOX), LongRoPE factors
(``rope_factors_long`` / ``rope_factors_short``) when the file has them. The MoE: router
``ffn_gate_inp`` -> softmax -> the top ``expert_used_count`` (2) -> their probabilities
renormalised to sum 1 (:func:`localllm.models.moe.route`) -> SwiGLU experts
``feed_forward_length`` wide; no shared expert.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BaseModel, TensorSpec, qkv_specs
from .common import positions_of
from .decoder import Block, kv_layout
from .moe import AllExpertsArgs, ExpertWeights, Routing, expert_specs, moe_ffn
from .rope import Rope, RopeWeights, factor_specs

ROUTING = Routing(norm=True)  # softmax, the chosen probabilities renormalised


class ModelArgs(AllExpertsArgs):
    """Hyperparameters from ``phimoe.*`` metadata keys."""


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``phimoe`` tensors (``llama_model_phimoe::load_arch_tensors``), torch
    shapes."""
    d, v = a.d_model, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d)), *factor_specs(a.rope)]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  TensorSpec(p + "attn_norm.bias", (d,)),
                  *qkv_specs(p, d, a.n_heads, a.n_kv_heads, a.head_dim),
                  TensorSpec(p + "attn_output.weight", (d, a.n_heads * a.head_dim)),
                  TensorSpec(p + "attn_output.bias", (d,)),
                  TensorSpec(p + "ffn_norm.weight", (d,)),
                  TensorSpec(p + "ffn_norm.bias", (d,)),
                  *expert_specs(p, d, a.n_expert, a.ffn_dim)]
    return specs + [TensorSpec("output_norm.weight", (d,)), TensorSpec("output_norm.bias", (d,)),
                    TensorSpec("output.weight", (v, d)), TensorSpec("output.bias", (v,))]


memory_layout = kv_layout


@dataclass
class Layer(Block, ExpertWeights):
    """The tensors of one block (``blk.{i}.*``); the output projection with its bias."""

    attn_norm_bias: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_norm_bias: torch.Tensor


@dataclass
class Weights(RopeWeights):
    """Top-level tensors: the output norm's bias besides the RoPE factors."""

    output_norm_bias: torch.Tensor | None = None


class Model(BaseModel):
    """A Phi-3.5-MoE decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    WEIGHTS = Weights
    weights: Weights

    def prepare(self) -> None:
        self.rope = Rope.of(self.args.rope, self.weights, self.device)
        self.scale = self.args.attention_scale * self.rope.score_scale()

    def forward(self, tokens: torch.Tensor, pos: int | torch.Tensor, memory, *,
                all_logits: bool = False, logits_start: int = 0) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32:
        (1, n_vocab) for the last position, or (T - logits_start, n_vocab) with all_logits."""
        a, ops = self.args, self.ops
        eps = a.norm_eps
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.token_embd(tokens)
        angles = self.rope.angles(ops, positions, memory.ctx_size)["global"]
        for b, cache in zip(self.layers, memory):
            n = ops.rms_norm(x, b.attn_norm, eps) + b.attn_norm_bias
            q, k, v = b.attn_qkv(n)
            del n
            q, k = self.rope.arrange(q), self.rope.arrange(k)
            attn = ops.self_attention(q, k, v, None, None, eps, angles, cache, pos, positions,
                                      head_dim=a.head_dim, neox=True, scale=self.scale)
            del q, k, v
            h = x + b.attn_output(attn)
            del attn, x
            n = ops.rms_norm(h, b.ffn_norm, eps) + b.ffn_norm_bias
            x = h + moe_ffn(ops, b, n, a.n_expert_used, ROUTING)
            del h, n
        n = ops.rms_norm(x, self.output_norm, eps) + self.output_norm_bias
        return self.output(n[logits_start:] if all_logits else n[-1:])
