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

import math
from dataclasses import dataclass

import torch

from ..backends import ExpertMatrix
from ..memory import KVSpec
from .base import (
    MAX_EXPERTS,
    REQUIRED,
    BaseModel,
    DecoderArgs,
    HParams,
    TensorSpec,
    common_hparams,
)
from .common import Linear, Split, positions_of
from .moe import route
from .rope import Rope, read_rope


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``olmoe.*`` metadata keys."""

    ffn_dim: int  # feed_forward_length: each expert's width
    n_expert: int  # expert_count
    n_expert_used: int  # expert_used_count
    attention_scale: float = 0.0

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): no
                experts, more used experts than experts.
        """
        hp = HParams(md, source)
        c = common_hparams(hp, n_vocab)
        n_expert = hp.int("expert_count", REQUIRED, hi=MAX_EXPERTS)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        return cls(**c, rope=rope, ffn_dim=hp.int("feed_forward_length", REQUIRED, per_layer=True),
                   n_expert=n_expert,
                   n_expert_used=hp.int("expert_used_count", REQUIRED, hi=n_expert),
                   attention_scale=1.0 / math.sqrt(c["head_dim"]))


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``olmoe`` tensors (``llama_model_olmoe::load_arch_tensors``), torch
    shapes."""
    d, hd, v, e, f = a.d_model, a.head_dim, a.n_vocab, a.n_expert, a.ffn_dim
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  TensorSpec(p + "attn_q.weight", (nq, d)),
                  TensorSpec(p + "attn_k.weight", (nkv, d)),
                  TensorSpec(p + "attn_v.weight", (nkv, d)),
                  TensorSpec(p + "attn_q.bias", (nq,), optional=True),
                  TensorSpec(p + "attn_k.bias", (nkv,), optional=True),
                  TensorSpec(p + "attn_v.bias", (nkv,), optional=True),
                  TensorSpec(p + "attn_q_norm.weight", (nq,)),
                  TensorSpec(p + "attn_k_norm.weight", (nkv,)),
                  TensorSpec(p + "attn_output.weight", (d, nq)),
                  TensorSpec(p + "ffn_norm.weight", (d,)),
                  TensorSpec(p + "ffn_gate_inp.weight", (e, d)),
                  TensorSpec(p + "ffn_gate_exps.weight", (e, f, d)),
                  TensorSpec(p + "ffn_up_exps.weight", (e, f, d)),
                  TensorSpec(p + "ffn_down_exps.weight", (e, d, f))]
    return specs + [TensorSpec("output_norm.weight", (d,)), TensorSpec("output.weight", (v, d))]


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim)] * a.n_layers


@dataclass
class Layer:
    """The tensors of one block (``blk.{i}.*``)."""

    attn_norm: torch.Tensor
    attn_qkv: Linear | Split  # fused attn_q, attn_k, attn_v (with their biases, if any)
    attn_q_norm: torch.Tensor  # over all heads (n_heads * head_dim,)
    attn_k_norm: torch.Tensor
    attn_output: Linear
    ffn_norm: torch.Tensor
    ffn_gate_inp: Linear  # the router (float32)
    ffn_gate_exps: ExpertMatrix
    ffn_up_exps: ExpertMatrix
    ffn_down_exps: ExpertMatrix


class Model(BaseModel):
    """An OLMoE decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        self.rope = Rope(a.rope, self.device)
        self.scale = a.attention_scale * self.rope.score_scale()
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
        nexts = [b.attn_norm for b in self.layers[1:]] + [self.output_norm]
        eps = a.norm_eps
        n = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        for b, cache, next_norm in zip(self.layers, memory, nexts):
            x, n = self._block(b, cache, x, n, next_norm, pos, positions, angles)
        return self.output(n[logits_start:] if all_logits else n[-1:])

    def _block(self, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
               next_norm: torch.Tensor, pos, positions: torch.Tensor, angles
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, d) residual stream, n = attn_norm(x) -> (x', next_norm(x'))."""
        a, ops = self.args, self.ops
        eps = a.norm_eps
        q, k, v = b.attn_qkv(n)
        del n
        # the QK-norm spans all heads: applied here, before the per-head RoPE
        q = ops.rms_norm(self.rope.arrange(q), b.attn_q_norm, eps)
        k = ops.rms_norm(self.rope.arrange(k), b.attn_k_norm, eps)
        attn = ops.self_attention(q, k, v, None, None, eps, angles, cache, pos, positions,
                                  head_dim=a.head_dim, neox=True, scale=self.scale)
        del q, k, v
        o = b.attn_output(attn)
        del attn
        h, n = ops.residual_norm(x, o, None, b.ffn_norm, eps)
        del o, x
        weights, chosen = route(b.ffn_gate_inp(n), a.n_expert_used)
        f = ops.experts(n, chosen, weights, b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps,
                        "silu")
        del n
        return ops.residual_norm(h, f, None, next_norm, eps)
