"""ERNIE 4.5 MoE (``ernie4_5-moe``: ERNIE-4.5-21B-A3B, -300B-A47B), as llama.cpp's
``src/models/ernie4-5-moe.cpp`` computes it (tensors: ``ernie4-5.cpp``).

Per layer (pre-norms)::

    h   = x + wo(attn(attn_norm(x)))     # optional Q/K/V biases; attn_output.bias unused
    out = h + ffn(ffn_norm(h))

* the first ``leading_dense_block_count`` layers have a dense SwiGLU FFN
  (``feed_forward_length``); the others route (``interleave_moe_layer_step`` must be 1:
  llama.cpp loads experts for every layer past the dense ones): router ``ffn_gate_inp`` ->
  softmax -> the top ``expert_used_count`` by probability plus the optional selection bias
  ``exp_probs_b`` -> their probabilities renormalised to sum 1
  (:func:`localllm.models.moe.route`) -> SwiGLU experts of ``expert_feed_forward_length``,
  plus a shared SwiGLU of ``expert_shared_feed_forward_length`` when it is > 0;
* RoPE rotates adjacent pairs (llama.cpp's NORM order); attention scale 1/sqrt(head_dim).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..backends import ExpertMatrix
from ..memory import KVSpec
from .base import (
    MAX_EXPERTS,
    MAX_LAYERS,
    REQUIRED,
    BaseModel,
    DecoderArgs,
    HParams,
    TensorSpec,
    common_hparams,
)
from .common import Linear, Split, positions_of
from .moe import route
from .rope import Rope, RopeWeights, factor_specs, read_rope


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``ernie4_5-moe.*`` metadata keys."""

    ffn_dim: int  # feed_forward_length (the dense layers)
    n_expert: int  # expert_count
    n_expert_used: int  # expert_used_count
    expert_ffn_dim: int  # expert_feed_forward_length
    shared_ffn_dim: int  # expert_shared_feed_forward_length (0: no shared expert)
    n_dense_lead: int  # leading_dense_block_count
    attention_scale: float = 0.0

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): no
                experts, more used experts than experts, more leading dense layers than
                layers, a MoE layer step other than 1.
        """
        hp = HParams(md, source)
        c = common_hparams(hp, n_vocab)
        dense = hp.int("leading_dense_block_count", 0, lo=0, hi=MAX_LAYERS)
        hp.require(dense <= c["n_layers"], "leading_dense_block_count",
                   f"{dense} exceeds the {c['n_layers']} layers")
        step = hp.int("interleave_moe_layer_step", REQUIRED, hi=MAX_LAYERS)
        hp.require(step == 1, "interleave_moe_layer_step",
                   f"{step}: llama.cpp loads experts for every layer past the dense ones, "
                   "so only 1 is consistent")
        n_expert = hp.int("expert_count", REQUIRED, hi=MAX_EXPERTS)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=False)
        return cls(**c, rope=rope,
                   ffn_dim=hp.int("feed_forward_length", REQUIRED if dense else 0, lo=0,
                                  per_layer=True),
                   n_expert=n_expert,
                   n_expert_used=hp.int("expert_used_count", REQUIRED, hi=n_expert),
                   expert_ffn_dim=hp.int("expert_feed_forward_length", REQUIRED, per_layer=True),
                   shared_ffn_dim=hp.int("expert_shared_feed_forward_length", 0, lo=0),
                   n_dense_lead=dense, attention_scale=1.0 / math.sqrt(c["head_dim"]))


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of ernie4_5-moe (``llama_model_ernie4_5::load_arch_tensors``),
    torch shapes (the output may be tied)."""
    d, hd, v = a.d_model, a.head_dim, a.n_vocab
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    e, f, s = a.n_expert, a.expert_ffn_dim, a.shared_ffn_dim
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
                  TensorSpec(p + "attn_output.weight", (d, nq)),
                  TensorSpec(p + "attn_output.bias", (d,), optional=True, unused=True),
                  TensorSpec(p + "ffn_norm.weight", (d,))]
        if i < a.n_dense_lead:
            specs += [TensorSpec(p + "ffn_gate.weight", (a.ffn_dim, d)),
                      TensorSpec(p + "ffn_up.weight", (a.ffn_dim, d)),
                      TensorSpec(p + "ffn_down.weight", (d, a.ffn_dim))]
            continue
        specs += [TensorSpec(p + "ffn_gate_inp.weight", (e, d)),
                  TensorSpec(p + "exp_probs_b.bias", (e,), optional=True),
                  TensorSpec(p + "ffn_gate_exps.weight", (e, f, d)),
                  TensorSpec(p + "ffn_up_exps.weight", (e, f, d)),
                  TensorSpec(p + "ffn_down_exps.weight", (e, d, f))]
        if s:
            specs += [TensorSpec(p + "ffn_gate_shexp.weight", (s, d)),
                      TensorSpec(p + "ffn_up_shexp.weight", (s, d)),
                      TensorSpec(p + "ffn_down_shexp.weight", (d, s))]
    return specs + [TensorSpec("output_norm.weight", (d,)),
                    TensorSpec("output.weight", (v, d), optional=True), *factor_specs(a.rope)]


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim)] * a.n_layers


@dataclass
class Layer:
    """The tensors of one block (``blk.{i}.*``)."""

    attn_norm: torch.Tensor
    attn_qkv: Linear | Split  # fused attn_q, attn_k, attn_v (with their biases, if any)
    attn_output: Linear
    ffn_norm: torch.Tensor
    ffn_gate_up: Linear | Split | None = None  # the leading dense layers
    ffn_down: Linear | None = None
    ffn_gate_inp: Linear | None = None  # the router (float32)
    exp_probs_b_bias: torch.Tensor | None = None  # (n_expert,) selection bias
    ffn_gate_exps: ExpertMatrix | None = None
    ffn_up_exps: ExpertMatrix | None = None
    ffn_down_exps: ExpertMatrix | None = None
    ffn_gate_up_shexp: Linear | Split | None = None  # fused shared expert's gate and up
    ffn_down_shexp: Linear | None = None


class Model(BaseModel):
    """An ERNIE 4.5 MoE decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    WEIGHTS = RopeWeights
    weights: RopeWeights
    FUSE: ClassVar[dict[str, tuple[str, ...]]] = {
        **BaseModel.FUSE, "ffn_gate_up_shexp": ("ffn_gate_shexp", "ffn_up_shexp")}

    def prepare(self) -> None:
        self.rope = Rope.of(self.args.rope, self.weights, self.device)
        self.scale = self.args.attention_scale * self.rope.score_scale()

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
        n = ops.rms_norm(x, self.layers[0].attn_norm, a.norm_eps)
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
        q, k = self.rope.arrange(q), self.rope.arrange(k)
        attn = ops.self_attention(q, k, v, None, None, eps, angles, cache, pos, positions,
                                  head_dim=a.head_dim, neox=False, scale=self.scale)
        del q, k, v
        o = b.attn_output(attn)
        del attn
        h, n = ops.residual_norm(x, o, None, b.ffn_norm, eps)
        del o, x
        if b.ffn_gate_inp is None:  # a leading dense layer
            gate, up = b.ffn_gate_up(n)
            f = b.ffn_down(ops.gated(gate, up, "silu", overwrite=True))
        else:
            weights, chosen = route(b.ffn_gate_inp(n), a.n_expert_used, norm=True,
                                    selection_bias=b.exp_probs_b_bias)
            f = ops.experts(n, chosen, weights, b.ffn_gate_exps, b.ffn_up_exps,
                            b.ffn_down_exps, "silu")
            if b.ffn_gate_up_shexp is not None:
                gate, up = b.ffn_gate_up_shexp(n)
                f = f + b.ffn_down_shexp(ops.gated(gate, up, "silu", overwrite=True))
        del n
        return ops.residual_norm(h, f, None, next_norm, eps)
