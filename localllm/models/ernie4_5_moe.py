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

from dataclasses import dataclass

import torch

from .base import MAX_LAYERS, REQUIRED, DecoderArgs, TensorSpec, ffn_specs, head_specs, qkv_specs
from .common import default_attention_scale, swiglu
from .decoder import Block, Decoder, DenseFFN, Step, kv_layout
from .moe import ExpertArgs, ExpertWeights, Routing, expert_counts, expert_specs, moe_ffn
from .rope import factor_specs, read_rope

ROUTING = Routing(norm=True)  # softmax, the chosen probabilities renormalised


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs, ExpertArgs):
    """Hyperparameters from ``ernie4_5-moe.*`` metadata keys."""

    ffn_dim: int  # feed_forward_length (the dense layers)
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
        hp, c = cls.read(md, n_vocab, source)
        dense = hp.int("leading_dense_block_count", 0, lo=0, hi=MAX_LAYERS)
        hp.require(dense <= c["n_layers"], "leading_dense_block_count",
                   f"{dense} exceeds the {c['n_layers']} layers")
        step = hp.int("interleave_moe_layer_step", REQUIRED, hi=MAX_LAYERS)
        hp.require(step == 1, "interleave_moe_layer_step",
                   f"{step}: llama.cpp loads experts for every layer past the dense ones, "
                   "so only 1 is consistent")
        experts = expert_counts(hp)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=False)
        return cls(**c, rope=rope,
                   ffn_dim=hp.int("feed_forward_length", REQUIRED if dense else 0, lo=0,
                                  per_layer=True),
                   **experts,
                   expert_ffn_dim=hp.int("expert_feed_forward_length", REQUIRED, per_layer=True),
                   shared_ffn_dim=hp.int("expert_shared_feed_forward_length", 0, lo=0),
                   n_dense_lead=dense, attention_scale=default_attention_scale(c["head_dim"]))


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of ernie4_5-moe (``llama_model_ernie4_5::load_arch_tensors``),
    torch shapes (the output may be tied)."""
    d, v = a.d_model, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  *qkv_specs(p, d, a.n_heads, a.n_kv_heads, a.head_dim),
                  TensorSpec(p + "attn_output.weight", (d, a.n_heads * a.head_dim)),
                  TensorSpec(p + "attn_output.bias", (d,), optional=True, unused=True),
                  TensorSpec(p + "ffn_norm.weight", (d,))]
        specs += (ffn_specs(p, d, a.ffn_dim) if i < a.n_dense_lead else
                  expert_specs(p, d, a.n_expert, a.expert_ffn_dim, selection_bias="optional",
                               shared_dim=a.shared_ffn_dim))
    return specs + [*head_specs(d, v), *factor_specs(a.rope)]


memory_layout = kv_layout


@dataclass
class Layer(Block, DenseFFN, ExpertWeights):
    """The tensors of one block (``blk.{i}.*``); the MoE ones in the layers past the
    leading dense ones."""

    ffn_norm: torch.Tensor


class Model(Decoder):
    """An ERNIE 4.5 MoE decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        self.set_rope(self.args.attention_scale)

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.args, self.ops
        h, n = ops.residual_norm(x, self.attention(b, n, cache, step), None, b.ffn_norm,
                                 a.norm_eps)
        del x
        if b.ffn_gate_inp is None:  # a leading dense layer
            f = swiglu(ops, b.ffn_gate_up, b.ffn_down, n)
        else:
            f = moe_ffn(ops, b, n, a.n_expert_used, ROUTING)
        del n
        return ops.residual_norm(h, f, None, next_norm, a.norm_eps)
