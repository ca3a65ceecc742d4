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

from dataclasses import dataclass, replace

import torch

from .base import (
    MAX_EXPERTS,
    MAX_LAYERS,
    REQUIRED,
    DecoderArgs,
    TensorSpec,
    ffn_specs,
    head_specs,
    qkv_specs,
)
from .common import default_attention_scale, swiglu
from .decoder import Block, Decoder, DenseFFN, Step, kv_layout
from .moe import (
    GATING_FUNCS,
    ExpertArgs,
    ExpertWeights,
    Routing,
    expert_counts,
    expert_specs,
    moe_ffn,
)
from .rope import factor_specs, read_rope


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs, ExpertArgs):
    """Hyperparameters from ``glm4moe.*`` metadata keys; ``n_layers`` counts the decoder's
    blocks only (``block_count`` - ``nextn_predict_layers``)."""

    ffn_dim: int  # feed_forward_length (the dense layers)
    expert_ffn_dim: int  # expert_feed_forward_length
    n_shared: int  # expert_shared_count
    n_dense_lead: int  # leading_dense_block_count
    n_nextn: int = 0  # nextn_predict_layers
    routing: Routing  # expert_gating_func (default sigmoid), expert_weights_norm, _scale
    attention_scale: float = 0.0

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): no
                experts, more used experts than experts, more leading dense or
                next-token-prediction blocks than blocks, an unknown gating function.
        """
        hp, c = cls.read(md, n_vocab, source)
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
        experts = expert_counts(hp)
        exp_ffn = hp.int("expert_feed_forward_length", None, per_layer=True)
        if exp_ffn is None:  # llama.cpp: n_ff / n_expert_used
            hp.require(ffn >= experts["n_expert_used"], "expert_feed_forward_length",
                       "is missing, and feed_forward_length cannot stand in for it")
            exp_ffn = ffn // experts["n_expert_used"]
        func = hp.int("expert_gating_func", 0, lo=0, hi=2)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        c["n_layers"] = n_layers
        routing = Routing(gating=GATING_FUNCS.get(func, "sigmoid"),
                          norm=hp.bool("expert_weights_norm", False),
                          scale=hp.float("expert_weights_scale", 0.0, lo=0.0, lo_open=False))
        return cls(**c, rope=rope, ffn_dim=ffn, **experts, expert_ffn_dim=exp_ffn,
                   n_shared=hp.int("expert_shared_count", REQUIRED, lo=0, hi=MAX_EXPERTS),
                   n_dense_lead=dense, n_nextn=nextn, routing=routing,
                   attention_scale=default_attention_scale(c["head_dim"]))


def _block_specs(a: ModelArgs, i: int, skip: bool = False) -> list[TensorSpec]:
    d, hd = a.d_model, a.head_dim
    p = f"blk.{i}."
    specs = [TensorSpec(p + "attn_norm.weight", (d,)),
             *qkv_specs(p, d, a.n_heads, a.n_kv_heads, hd),
             TensorSpec(p + "attn_q_norm.weight", (hd,), True),
             TensorSpec(p + "attn_k_norm.weight", (hd,), True),
             TensorSpec(p + "attn_output.weight", (d, a.n_heads * hd)),
             TensorSpec(p + "post_attention_norm.weight", (d,))]
    if i < a.n_dense_lead:
        specs += ffn_specs(p, d, a.ffn_dim)
    else:
        specs += expert_specs(p, d, a.n_expert, a.expert_ffn_dim, selection_bias="required",
                              shared_dim=a.expert_ffn_dim * a.n_shared)
    if not skip:
        return specs
    # the next-token-prediction block: its tensors, and its own, checked and never read
    specs += [TensorSpec(p + "nextn.eh_proj.weight", (d, 2 * d)),
              TensorSpec(p + "nextn.enorm.weight", (d,)),
              TensorSpec(p + "nextn.hnorm.weight", (d,)),
              TensorSpec(p + "nextn.embed_tokens.weight", (a.n_vocab, d)),
              TensorSpec(p + "nextn.shared_head_head.weight", (a.n_vocab, d)),
              TensorSpec(p + "nextn.shared_head_norm.weight", (d,))]
    return [replace(s, optional=True, unused=True) for s in specs]


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of glm4moe (``llama_model_glm4_moe::load_arch_tensors``), torch
    shapes; the next-token-prediction blocks' tensors optional and skipped."""
    d, v = a.d_model, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers + a.n_nextn):
        specs += _block_specs(a, i, skip=i >= a.n_layers)
    return specs + [*head_specs(d, v), *factor_specs(a.rope)]


memory_layout = kv_layout


@dataclass
class Layer(Block, DenseFFN, ExpertWeights):
    """The tensors of one block (``blk.{i}.*``); the MoE ones in the layers past the
    leading dense ones."""

    post_attention_norm: torch.Tensor
    attn_q_norm: torch.Tensor | None = None  # per head (head_dim,)
    attn_k_norm: torch.Tensor | None = None


class Model(Decoder):
    """A GLM-4.5 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        self.set_rope(a.attention_scale)
        for b in self.layers:
            b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.args, self.ops
        o = self.attention(b, n, cache, step, q_norm=b.attn_q_norm, k_norm=b.attn_k_norm)
        h, n = ops.residual_norm(x, o, None, b.post_attention_norm, a.norm_eps)
        del o, x
        if b.ffn_gate_inp is None:  # a leading dense layer
            f = swiglu(ops, b.ffn_gate_up, b.ffn_down, n)
        else:
            f = moe_ffn(ops, b, n, a.n_expert_used, a.routing)
        del n
        return ops.residual_norm(h, f, None, next_norm, a.norm_eps)
