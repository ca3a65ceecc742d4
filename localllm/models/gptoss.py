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

import math
from dataclasses import dataclass

import torch

from ..backends import ExpertMatrix
from ..memory import KVSpec
from .base import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    REQUIRED,
    BaseModel,
    DecoderArgs,
    HParams,
    TensorSpec,
    common_hparams,
    swa_layers,
)
from .common import Linear, Split, positions_of
from .moe import route
from .rope import GLOBAL, SWA, Rope, read_rope

SWA_PERIOD = 2  # llama.cpp's load_swa_pattern(ml, 2): even layers slide


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``gpt-oss.*`` metadata keys."""

    n_expert: int  # expert_count
    n_expert_used: int  # expert_used_count
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
        hp = HParams(md, source)
        c = common_hparams(hp, n_vocab)
        n_expert = hp.int("expert_count", REQUIRED, hi=MAX_EXPERTS)
        n_used = hp.int("expert_used_count", REQUIRED, hi=n_expert)
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
        return cls(**c, rope=rope, n_expert=n_expert, n_expert_used=n_used,
                   expert_ffn_dim=expert_ffn, sliding_window=window, swa=swa,
                   attention_scale=1.0 / math.sqrt(c["head_dim"]))


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of gpt-oss (``llama_model_openai_moe::load_arch_tensors``), torch
    shapes. Q/K/V biases are optional there (the released files have them)."""
    d, hd, v = a.d_model, a.head_dim, a.n_vocab
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    e, f = a.n_expert, a.expert_ffn_dim
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
                  TensorSpec(p + "attn_output.bias", (d,)),
                  TensorSpec(p + "attn_sinks.weight", (a.n_heads,)),
                  TensorSpec(p + "post_attention_norm.weight", (d,)),
                  TensorSpec(p + "ffn_gate_inp.weight", (e, d)),
                  TensorSpec(p + "ffn_gate_inp.bias", (e,)),
                  TensorSpec(p + "ffn_gate_exps.weight", (e, f, d)),
                  TensorSpec(p + "ffn_gate_exps.bias", (e, f)),
                  TensorSpec(p + "ffn_up_exps.weight", (e, f, d)),
                  TensorSpec(p + "ffn_up_exps.bias", (e, f)),
                  TensorSpec(p + "ffn_down_exps.weight", (e, d, f)),
                  TensorSpec(p + "ffn_down_exps.bias", (e, d))]
    specs += [TensorSpec("output_norm.weight", (d,)),
              TensorSpec("output.weight", (v, d))]
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim, a.sliding_window if a.swa[i] else None)
            for i in range(a.n_layers)]


@dataclass
class Layer:
    """The tensors of one block (``blk.{i}.*``)."""

    attn_norm: torch.Tensor
    attn_qkv: Linear | Split  # fused attn_q, attn_k, attn_v with their biases
    attn_output: Linear  # with its bias
    attn_sinks: torch.Tensor  # (n_heads,) float32
    post_attention_norm: torch.Tensor
    ffn_gate_inp: Linear  # the router (float32, with its bias)
    ffn_gate_exps: ExpertMatrix  # experts with their biases
    ffn_up_exps: ExpertMatrix
    ffn_down_exps: ExpertMatrix


class Model(BaseModel):
    """A gpt-oss decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        self.rope = Rope(a.rope, self.device)
        self.kinds = [SWA if sliding else GLOBAL for sliding in a.swa]
        self.scales = {k: a.attention_scale * self.rope.score_scale(k) for k in set(self.kinds)}

    def forward(
        self,
        tokens: torch.Tensor,
        pos: int | torch.Tensor,
        memory,
        *,
        all_logits: bool = False,
        logits_start: int = 0,
    ) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32:
        (1, n_vocab) for the last position, or (T - logits_start, n_vocab) with all_logits.
        ``memory``: the sequence's :class:`~localllm.memory.Memory` (one KV cache per layer,
        a sliding-window one on the sliding layers).

        ``pos`` may be a (1,) int64 tensor on the model's device for a one-token step with
        static shapes and no host reads (CUDA graphs, :mod:`localllm.runtime.graphs`)."""
        a, ops = self.args, self.ops
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.token_embd(tokens)  # (T, d)
        # the angles per kind of layer, shared by all layers of that kind
        angles = self.rope.angles(ops, positions, memory.ctx_size, tuple(self.scales))
        # Each block ends with the next block's pre-norm (the output norm after the last),
        # fused with its residual add.
        nexts = [b.attn_norm for b in self.layers[1:]] + [self.output_norm]
        eps = a.norm_eps
        n = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        for b, cache, next_norm, kind in zip(self.layers, memory, nexts, self.kinds):
            x, n = self._block(b, cache, x, n, next_norm, pos, positions, angles[kind],
                               self.scales[kind])
        return self.output(n[logits_start:] if all_logits else n[-1:])

    def _block(self, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
               next_norm: torch.Tensor, pos, positions: torch.Tensor, angles, scale: float
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, d) residual stream, n = attn_norm(x) -> (x', next_norm(x'))."""
        a, ops = self.args, self.ops
        eps = a.norm_eps
        q, k, v = b.attn_qkv(n)
        del n  # each intermediate dropped once used: prefill's peak holds fewer of them
        attn = ops.self_attention(q, k, v, None, None, eps, angles, cache, pos, positions,
                                  head_dim=a.head_dim, neox=True, scale=scale,
                                  sinks=b.attn_sinks)
        del q, k, v
        o = b.attn_output(attn)
        del attn
        h, n = ops.residual_norm(x, o, None, b.post_attention_norm, eps)
        del o, x
        weights, chosen = route(b.ffn_gate_inp(n), a.n_expert_used, gating="softmax_weight")
        f = ops.experts(n, chosen, weights, b.ffn_gate_exps, b.ffn_up_exps, b.ffn_down_exps,
                        "swiglu_oai")
        del n
        return ops.residual_norm(h, f, None, next_norm, eps)
