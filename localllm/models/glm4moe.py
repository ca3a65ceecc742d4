"""GLM-4.5 / GLM-4.6 (``glm4moe``), as llama.cpp's ``src/models/glm4-moe.cpp`` computes it
(``LLM_ARCH_GLM4_MOE``, text decoder; no multimodal M-RoPE).

Per layer::

    h   = x + wo(attn(attn_norm(x)))       # Q/K/V biases, optional per-head QK-norm
    out = h + ffn(post_attention_norm(h))

* the first ``leading_dense_block_count`` layers have a dense SwiGLU FFN
  (``feed_forward_length``); the others route: router ``ffn_gate_inp`` -> sigmoid scores
  (``expert_gating_func``, default sigmoid) -> the top ``expert_used_count`` by score plus
  the selection bias ``ffn_exp_probs_b`` -> weights = the chosen scores (without the bias),
  renormalised with ``expert_weights_norm``, times ``expert_weights_scale``
  (:func:`localllm.models.moe.route`) -> SwiGLU experts of ``expert_feed_forward_length``,
  plus ``expert_shared_count`` shared experts (one SwiGLU of that many times the width);
* RoPE rotates halves (NEOX) of the first ``rope.dimension_count`` dimensions (half the
  head in the released models); attention scale 1/sqrt(head_dim);
* ``nextn_predict_layers`` trailing blocks (counted in ``block_count``) are the
  multi-token-prediction head: their tensors are accepted and checked, never loaded, as
  llama.cpp's ordinary decoding does.
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
from .moe import GATING_FUNCS, route
from .rope import Rope, RopeWeights, factor_specs, read_rope


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``glm4moe.*`` metadata keys; ``n_layers`` counts the decoder's
    blocks only (``block_count`` - ``nextn_predict_layers``)."""

    ffn_dim: int  # feed_forward_length (the dense layers)
    n_expert: int  # expert_count
    n_expert_used: int  # expert_used_count
    expert_ffn_dim: int  # expert_feed_forward_length
    n_shared: int  # expert_shared_count
    n_dense_lead: int  # leading_dense_block_count
    n_nextn: int = 0  # nextn_predict_layers
    gating: str = "sigmoid"  # expert_gating_func
    weights_norm: bool = False  # expert_weights_norm
    weights_scale: float = 1.0  # expert_weights_scale
    attention_scale: float = 0.0

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): no
                experts, more used experts than experts, more leading dense or
                next-token-prediction blocks than blocks, an unknown gating function.
        """
        hp = HParams(md, source)
        c = common_hparams(hp, n_vocab)
        n_blocks = c["n_layers"]
        nextn = hp.int("nextn_predict_layers", 0, lo=0, hi=MAX_LAYERS)
        hp.require(nextn < n_blocks, "nextn_predict_layers",
                   f"{nextn} of {n_blocks} blocks leaves no decoder layer")
        n_layers = n_blocks - nextn
        dense = hp.int("leading_dense_block_count", 0, lo=0, hi=MAX_LAYERS)
        hp.require(dense <= n_layers, "leading_dense_block_count",
                   f"{dense} exceeds the {n_layers} decoder layers")
        ffn = hp.int("feed_forward_length", REQUIRED if dense else 0, lo=0, per_layer=True)
        hp.require(ffn > 0 or not dense, "feed_forward_length", "must be > 0 for dense layers")
        n_expert = hp.int("expert_count", REQUIRED, hi=MAX_EXPERTS)
        n_used = hp.int("expert_used_count", REQUIRED, hi=n_expert)
        exp_ffn = hp.int("expert_feed_forward_length", None, per_layer=True)
        if exp_ffn is None:  # llama.cpp: n_ff / n_expert_used
            hp.require(ffn >= n_used, "expert_feed_forward_length",
                       "is missing, and feed_forward_length cannot stand in for it")
            exp_ffn = ffn // n_used
        func = hp.int("expert_gating_func", 0, lo=0, hi=2)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        c["n_layers"] = n_layers
        return cls(**c, rope=rope, ffn_dim=ffn, n_expert=n_expert, n_expert_used=n_used,
                   expert_ffn_dim=exp_ffn,
                   n_shared=hp.int("expert_shared_count", REQUIRED, lo=0, hi=MAX_EXPERTS),
                   n_dense_lead=dense, n_nextn=nextn,
                   gating=GATING_FUNCS.get(func, "sigmoid"),
                   weights_norm=hp.bool("expert_weights_norm", False),
                   weights_scale=hp.float("expert_weights_scale", 0.0, lo=0.0, lo_open=False),
                   attention_scale=1.0 / math.sqrt(c["head_dim"]))


def _block_specs(a: ModelArgs, i: int, skip: bool = False) -> list[TensorSpec]:
    d, hd = a.d_model, a.head_dim
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    e, f = a.n_expert, a.expert_ffn_dim
    p = f"blk.{i}."

    def t(name: str, shape: tuple[int, ...], optional: bool = False) -> TensorSpec:
        return TensorSpec(p + name, shape, optional=optional or skip, unused=skip)

    specs = [t("attn_norm.weight", (d,)),
             t("attn_q.weight", (nq, d)), t("attn_k.weight", (nkv, d)),
             t("attn_v.weight", (nkv, d)),
             t("attn_q.bias", (nq,), True), t("attn_k.bias", (nkv,), True),
             t("attn_v.bias", (nkv,), True),
             t("attn_q_norm.weight", (hd,), True), t("attn_k_norm.weight", (hd,), True),
             t("attn_output.weight", (d, nq)),
             t("post_attention_norm.weight", (d,))]
    if i < a.n_dense_lead:
        return specs + [t("ffn_gate.weight", (a.ffn_dim, d)), t("ffn_up.weight", (a.ffn_dim, d)),
                        t("ffn_down.weight", (d, a.ffn_dim))]
    specs += [t("ffn_gate_inp.weight", (e, d)), t("exp_probs_b.bias", (e,)),
              t("ffn_gate_exps.weight", (e, f, d)), t("ffn_up_exps.weight", (e, f, d)),
              t("ffn_down_exps.weight", (e, d, f))]
    if a.n_shared:
        s = f * a.n_shared
        specs += [t("ffn_gate_shexp.weight", (s, d)), t("ffn_up_shexp.weight", (s, d)),
                  t("ffn_down_shexp.weight", (d, s))]
    if skip:  # the next-token-prediction block's own tensors
        specs += [t("nextn.eh_proj.weight", (d, 2 * d)), t("nextn.enorm.weight", (d,)),
                  t("nextn.hnorm.weight", (d,)),
                  t("nextn.embed_tokens.weight", (a.n_vocab, d)),
                  t("nextn.shared_head_head.weight", (a.n_vocab, d)),
                  t("nextn.shared_head_norm.weight", (d,))]
    return specs


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of glm4moe (``llama_model_glm4_moe::load_arch_tensors``), torch
    shapes; the next-token-prediction blocks' tensors optional and skipped."""
    d, v = a.d_model, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers + a.n_nextn):
        specs += _block_specs(a, i, skip=i >= a.n_layers)
    return specs + [TensorSpec("output_norm.weight", (d,)),
                    TensorSpec("output.weight", (v, d), optional=True), *factor_specs(a.rope)]


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim)] * a.n_layers


@dataclass
class Layer:
    """The tensors of one block (``blk.{i}.*``)."""

    attn_norm: torch.Tensor
    attn_qkv: Linear | Split  # fused attn_q, attn_k, attn_v with their biases
    attn_output: Linear
    post_attention_norm: torch.Tensor
    attn_q_norm: torch.Tensor | None = None  # per head (head_dim,)
    attn_k_norm: torch.Tensor | None = None
    ffn_gate_up: Linear | Split | None = None  # the leading dense layers
    ffn_down: Linear | None = None
    ffn_gate_inp: Linear | None = None  # the router (float32)
    exp_probs_b_bias: torch.Tensor | None = None  # (n_expert,) selection bias
    ffn_gate_exps: ExpertMatrix | None = None
    ffn_up_exps: ExpertMatrix | None = None
    ffn_down_exps: ExpertMatrix | None = None
    ffn_gate_up_shexp: Linear | Split | None = None  # fused shared experts' gate and up
    ffn_down_shexp: Linear | None = None


class Model(BaseModel):
    """A GLM-4.5 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    WEIGHTS = RopeWeights
    weights: RopeWeights
    FUSE: ClassVar[dict[str, tuple[str, ...]]] = {
        **BaseModel.FUSE, "ffn_gate_up_shexp": ("ffn_gate_shexp", "ffn_up_shexp")}

    def prepare(self) -> None:
        a = self.args
        self.rope = Rope.of(a.rope, self.weights, self.device)
        self.scale = a.attention_scale * self.rope.score_scale()
        for b in self.layers:
            b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def forward(self, tokens: torch.Tensor, pos: int | torch.Tensor, memory, *,
                all_logits: bool = False, logits_start: int = 0) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32:
        (1, n_vocab) for the last position, or (T - logits_start, n_vocab) with all_logits.
        ``memory``: one KV cache per decoder layer."""
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
        attn = ops.self_attention(q, k, v, b.attn_q_norm, b.attn_k_norm, eps, angles, cache,
                                  pos, positions, head_dim=a.head_dim, neox=True,
                                  scale=self.scale)
        del q, k, v
        o = b.attn_output(attn)
        del attn
        h, n = ops.residual_norm(x, o, None, b.post_attention_norm, eps)
        del o, x
        if b.ffn_gate_inp is None:  # a leading dense layer
            gate, up = b.ffn_gate_up(n)
            f = b.ffn_down(ops.gated(gate, up, "silu", overwrite=True))
        else:
            f = self._moe(b, n)
        del n
        return ops.residual_norm(h, f, None, next_norm, eps)

    def _moe(self, b: Layer, n: torch.Tensor) -> torch.Tensor:
        """The routed experts plus the shared ones: n (T, d) -> (T, d) float32."""
        a, ops = self.args, self.ops
        weights, chosen = route(b.ffn_gate_inp(n), a.n_expert_used, gating=a.gating,
                                norm=a.weights_norm, selection_bias=b.exp_probs_b_bias,
                                scale=a.weights_scale)
        f = ops.experts(n, chosen, weights, b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps,
                        "silu")
        if b.ffn_gate_up_shexp is not None:
            gate, up = b.ffn_gate_up_shexp(n)
            f = f + b.ffn_down_shexp(ops.gated(gate, up, "silu", overwrite=True))
        return f
