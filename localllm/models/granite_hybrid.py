"""Granite 4.0 hybrid (``granitehybrid``: Granite-4.0-H-Micro/Tiny/Small, Bamba; llama.cpp's
``src/models/granite-hybrid.cpp``): Mamba2 layers with a few attention layers between them
(``attention.head_count_kv`` 0 marks a Mamba2 layer), each followed by an FFN::

    h   = x + s_r * mixer_or_attention(attn_norm(x))
    out = h + s_r * ffn(ffn_norm(h))      # SwiGLU, or MoE (softmax top-k, renormalised)
                                          # plus a shared SwiGLU expert

with Granite's multipliers: the embedding times ``embedding_scale``, each sublayer output
times ``residual_scale``, the attention scores times ``attention.scale`` (else
1/sqrt(head_dim)) and the logits divided by ``logit_scale`` (0 or absent: 1). RoPE (adjacent
pairs) only where ``rope.scaling.finetuned`` is true (Bamba); Granite 4.0's hybrids have no
positions at all.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..memory import KVSpec
from .base import REQUIRED, HParams, TensorSpec, ffn_specs, head_specs
from .common import Linear, Split, swiglu
from .decoder import Step
from .hybrid import AttendingArgs, AttentionWeights, HybridDecoder, attention_specs
from .mamba import MixerWeights, SSMArgs, mamba2_mixer, ssm_hparams, ssm_memory, ssm_specs
from .moe import ExpertArgs, ExpertWeights, Routing, expert_counts, expert_specs, moe_ffn
from .rope import GLOBAL, NOPE, read_rope

ROUTING = Routing(norm=True)  # softmax, the chosen probabilities renormalised


@dataclass(kw_only=True)
class ModelArgs(AttendingArgs, ExpertArgs):
    """Hyperparameters from ``granitehybrid.*`` metadata keys (0 KV heads: a Mamba2
    layer)."""

    ffn_dim: int  # feed_forward_length (the expert size with experts)
    ssm: SSMArgs
    use_rope: bool = False  # rope.scaling.finetuned
    shared_ffn_dim: int = 0  # expert_shared_feed_forward_length
    embedding_scale: float = 1.0
    residual_scale: float = 1.0
    logit_scale: float = 1.0
    attention_scale: float = 0.0

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters.

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
            UnsupportedError: partial RoPE.
        """
        hp, c = cls.read(md, n_vocab, source, context_length=1 << 20)
        ha, ctx = cls.read_heads(hp, c), c["context_length"]
        use_rope = hp.bool("rope.scaling.finetuned", True)
        rope = (cls.whole_head_rope(hp, ha.head_dim, ctx, neox=False) if use_rope
                else read_rope(hp, head_dim=ha.head_dim, context_length=ctx, neox=False))
        kw = expert_counts(hp, 0, lo=0)
        if kw["n_expert"]:
            kw["shared_ffn_dim"] = hp.int("expert_shared_feed_forward_length", 0, lo=0)
        return cls(
            **c, heads=ha, ffn_dim=hp.int("feed_forward_length", REQUIRED, per_layer=True),
            ssm=ssm_hparams(hp), rope=rope, use_rope=use_rope,
            embedding_scale=unset_is_one(hp, "embedding_scale"),
            residual_scale=unset_is_one(hp, "residual_scale"),
            logit_scale=unset_is_one(hp, "logit_scale"),
            attention_scale=hp.float("attention.scale", 0.0, lo=0.0, lo_open=False)
            or 1.0 / math.sqrt(ha.head_dim), **kw)


def unset_is_one(hp: HParams, name: str) -> float:
    """A multiplier that llama.cpp applies when non-zero (absent or 0: 1)."""
    return hp.float(name, 0.0, lo=0.0, lo_open=False) or 1.0


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of ``granitehybrid`` (``load_arch_tensors``), torch shapes."""
    d, v, hd = a.d_model, a.n_vocab, a.heads.head_dim
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)), TensorSpec(p + "ffn_norm.weight", (d,))]
        if a.recurrent[i]:
            specs += ssm_specs(p, a.ssm, d, conv_bias=False)
        else:
            specs += attention_specs(p, d, a.heads.n_heads[i], a.heads.n_kv_heads[i], hd,
                                     out_bias=True)
        f = a.ffn_dim
        if a.n_expert:
            specs += expert_specs(p, d, a.n_expert, f, shared_dim=a.shared_ffn_dim)
        else:
            specs += ffn_specs(p, d, f, bias=True)
    return specs + head_specs(d, v)


def memory_layout(a: ModelArgs) -> list:
    """Per layer in order: a Mamba2 state, or a KV cache of its attention."""
    return [ssm_memory(a.ssm) if r else KVSpec(kv, a.heads.head_dim)
            for r, kv in zip(a.recurrent, a.heads.n_kv_heads)]


@dataclass
class Layer(MixerWeights, AttentionWeights, ExpertWeights):
    """The tensors of one block: norms, a mixer or an attention, and the FFN."""

    attn_norm: torch.Tensor | None = None
    ffn_norm: torch.Tensor | None = None
    ffn_gate_up: Linear | Split | None = None  # dense: fused ffn_gate, ffn_up
    ffn_down: Linear | None = None


class Model(HybridDecoder):
    """A Granite hybrid decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        # Without RoPE, the NOPE tables (zero frequencies: cos 1, sin 0 rotate nothing,
        # exactly), and the backends' fused attention paths stay usable.
        self.set_rope(a.attention_scale,
                      [GLOBAL if a.use_rope else NOPE] * a.n_layers)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embd(tokens)
        return x * self.args.embedding_scale if self.args.embedding_scale != 1.0 else x

    def head(self, n: torch.Tensor) -> torch.Tensor:
        logits = self.output(n)
        return logits / self.args.logit_scale if self.args.logit_scale != 1.0 else logits

    def ffn(self, b: Layer, n: torch.Tensor) -> torch.Tensor:
        a, ops = self.args, self.ops
        if not a.n_expert:
            return swiglu(ops, b.ffn_gate_up, b.ffn_down, n)
        return moe_ffn(ops, b, n, a.n_expert_used, ROUTING)

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.args, self.ops
        eps, rs = a.norm_eps, a.residual_scale
        if a.recurrent[i]:
            f = mamba2_mixer(b, n, cache, a.ssm, eps, ops)
        else:
            f = self.attend(b, n, cache, step, self.kinds[i])
        h, n = ops.residual_norm(x, f * rs if rs != 1.0 else f, None, b.ffn_norm, eps)
        f = self.ffn(b, n)
        x, n = ops.residual_norm(h, f * rs if rs != 1.0 else f, None, next_norm, eps)
        return x, n
