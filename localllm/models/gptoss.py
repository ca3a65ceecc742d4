"""OpenAI's gpt-oss (``gpt-oss``: gpt-oss-20b, gpt-oss-120b), as llama.cpp's
``src/models/openai-moe.cpp`` computes it (``LLM_ARCH_OPENAI_MOE``).

Per layer::

    h   = x + wo(attn(attn_norm(x))) + bo        # GQA with Q/K/V biases and attention sinks
    out = h + moe(post_attention_norm(h))

* attention sinks: one learned logit per query head (``attn_sinks``) joins each softmax's
  denominator and attends to nothing, so a head can attend "nowhere"
  (:func:`localllm.backends.dense.attend`);
* sliding-window and full attention alternate: layer il slides (window
  ``attention.sliding_window``, 128 in the released models) when il % 2 == 0, unless
  ``attention.sliding_window_pattern`` says otherwise (llama.cpp's ``load_swa_pattern(2)``);
  sliding layers may have their own ``rope.freq_base_swa``;
* the MoE: router ``ffn_gate_inp`` (with a bias) -> the top ``expert_used_count`` experts by
  logit, weighted by the softmax of those logits (:func:`localllm.models.moe.route`,
  ``softmax_weight``) -> each expert's clamped SwiGLU with biases (``swiglu_oai``:
  ``min(g, 7) * sigmoid(1.702 min(g, 7)) * (clamp(u, -7, 7) + 1)``), then its down
  projection with a bias; no shared expert. The released files store the experts in MXFP4;
* RoPE rotates halves (NEOX), scaled by YaRN in the released models (factor 32 over an
  original context of 4096), on every layer; attention scale 1/sqrt(head_dim) times YaRN's
  magnitude correction squared.

The output projection is never tied to the embedding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import KVSpec
from .base import MAX_CONTEXT, REQUIRED, DecoderArgs, TensorSpec, head_specs, qkv_specs, swa_layers
from .common import default_attention_scale
from .decoder import Block, Decoder, Step
from .moe import ExpertArgs, ExpertWeights, Routing, expert_counts, expert_specs, moe_ffn
from .rope import GLOBAL, SWA, read_rope

SWA_PERIOD = 2  # llama.cpp's load_swa_pattern(ml, 2): even layers slide
# the top experts by logit, weighted by the softmax of those logits; clamped SwiGLU experts
ROUTING = Routing(gating="softmax_weight", act="swiglu_oai")


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs, ExpertArgs):
    """Hyperparameters from ``gpt-oss.*`` metadata keys."""

    expert_ffn_dim: int  # expert_feed_forward_length
    sliding_window: int  # attention.sliding_window
    swa: tuple[bool, ...]  # per layer: sliding (attention.sliding_window_pattern)
    attention_scale: float = 0.0  # 1/sqrt(head_dim), before RoPE's magnitude

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): no
                experts, more used experts than experts, a sliding-window pattern whose
                length is not ``block_count``, a YaRN factor <= 0 or a base <= 1.
        """
        hp, c = cls.read(md, n_vocab, source)
        experts = expert_counts(hp)
        expert_ffn = hp.int("expert_feed_forward_length", REQUIRED, per_layer=True)
        window = hp.int("attention.sliding_window", REQUIRED, hi=MAX_CONTEXT)
        swa = tuple(swa_layers(hp, c["n_layers"], SWA_PERIOD))
        # llama.cpp's loader reads no optional YaRN key for gpt-oss (betas 32 / 1); the
        # sliding layers' base defaults to the global one
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        if rope.kind == "yarn" and any(swa):
            hp.require(rope.layer(swa=True)[0] > 1.0, "rope.freq_base_swa", "must be > 1 for "
                       "YaRN scaling (its correction dimensions divide by log(base))")
        return cls(**c, rope=rope, **experts, expert_ffn_dim=expert_ffn, sliding_window=window,
                   swa=swa, attention_scale=default_attention_scale(c["head_dim"]))


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of gpt-oss (``llama_model_openai_moe::load_arch_tensors``), torch
    shapes. Q/K/V biases are optional there (the released files have them); the router
    and every expert have biases."""
    d, v = a.d_model, a.n_vocab
    e, f = a.n_expert, a.expert_ffn_dim
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        gate_inp, *experts = expert_specs(p, d, e, f)
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  *qkv_specs(p, d, a.n_heads, a.n_kv_heads, a.head_dim),
                  TensorSpec(p + "attn_output.weight", (d, a.n_heads * a.head_dim)),
                  TensorSpec(p + "attn_output.bias", (d,)),
                  TensorSpec(p + "attn_sinks.weight", (a.n_heads,)),
                  TensorSpec(p + "post_attention_norm.weight", (d,)),
                  gate_inp, TensorSpec(p + "ffn_gate_inp.bias", (e,))]
        for w in experts:  # each expert matrix, then its bias (n_expert, rows)
            specs += [w, TensorSpec(w.name.replace(".weight", ".bias"), w.shape[:2])]
    specs += head_specs(d, v, tied=False)
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim, a.sliding_window if a.swa[i] else None)
            for i in range(a.n_layers)]


@dataclass
class Layer(Block, ExpertWeights):
    """The tensors of one block (``blk.{i}.*``); the router and the experts with their
    biases."""

    attn_sinks: torch.Tensor  # (n_heads,) float32
    post_attention_norm: torch.Tensor


class Model(Decoder):
    """A gpt-oss decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        self.set_rope(a.attention_scale,
                      [SWA if sliding else GLOBAL for sliding in a.swa])

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.args, self.ops
        o = self.attention(b, n, cache, step, self.kinds[i], sinks=b.attn_sinks)
        h, n = ops.residual_norm(x, o, None, b.post_attention_norm, a.norm_eps)
        del o, x
        f = moe_ffn(ops, b, n, a.n_expert_used, ROUTING)
        del n
        return ops.residual_norm(h, f, None, next_norm, a.norm_eps)
