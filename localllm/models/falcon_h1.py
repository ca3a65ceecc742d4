"""Falcon-H1 (``falcon-h1``; llama.cpp's ``src/models/falcon-h1.cpp``): every layer runs an
attention and a Mamba2 mixer side by side on the same normed input, then an FFN::

    n   = attn_norm(x)
    h   = x + attention(n) + mixer(n)     # RoPE over halves (NEOX), 1/sqrt(head_dim)
    out = h + ffn(ffn_norm(h))            # SwiGLU

Falcon-H1's many multipliers are folded into the weights by llama.cpp's converter. Each
layer holds a KV cache and a recurrent state (llama.cpp's hybrid memory with both filters
true); the norm before the FFN is the bias-less ``blk.{i}.ffn_norm`` (no ``.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import KVSpec
from .base import REQUIRED, TensorSpec, ffn_specs, head_specs
from .common import Linear, Split, swiglu
from .decoder import Step
from .hybrid import AttendingArgs, AttentionWeights, HybridDecoder, attention_specs
from .mamba import MixerWeights, SSMArgs, mamba2_mixer, ssm_hparams, ssm_memory, ssm_specs


@dataclass(kw_only=True)
class ModelArgs(AttendingArgs):
    """Hyperparameters from ``falcon-h1.*`` metadata keys (every layer attends)."""

    ffn_dim: int
    ssm: SSMArgs

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters.

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
            UnsupportedError: partial RoPE.
        """

        hp, c = cls.read(md, n_vocab, source, context_length=4096)
        ha = cls.read_heads(hp, c, lambda kv: [True] * len(kv))
        return cls(**c, heads=ha, ffn_dim=hp.int("feed_forward_length", REQUIRED, per_layer=True),
                   ssm=ssm_hparams(hp),
                   rope=cls.whole_head_rope(hp, ha.head_dim, c["context_length"], neox=True))


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of ``falcon-h1`` (``load_arch_tensors``), torch shapes."""
    d, v, f, hd = a.d_model, a.n_vocab, a.ffn_dim, a.heads.head_dim
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += ssm_specs(p, a.ssm, d, conv_bias=False, norm=False)
        specs += attention_specs(p, d, a.heads.n_heads[i], a.heads.n_kv_heads[i], hd)
        specs += [TensorSpec(p + "attn_norm.weight", (d,)), TensorSpec(p + "ffn_norm", (d,)),
                  *ffn_specs(p, d, f, bias=True)]
    return specs + head_specs(d, v)


def memory_layout(a: ModelArgs) -> list:
    """Per layer: its KV cache, then its Mamba2 state."""
    kv = [KVSpec(n, a.heads.head_dim) for n in a.heads.n_kv_heads]
    return [m for spec in kv for m in (spec, ssm_memory(a.ssm))]


@dataclass
class Layer(MixerWeights, AttentionWeights):
    """The tensors of one block: both mixers, the norms and the FFN."""

    attn_norm: torch.Tensor | None = None
    ffn_norm: torch.Tensor | None = None
    ffn_gate_up: Linear | Split | None = None
    ffn_down: Linear | None = None


class Model(HybridDecoder):
    """A Falcon-H1 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        self.set_rope(a.heads.head_dim ** -0.5)

    def layer_memories(self, memory):
        """Per layer: its KV cache and its Mamba2 state (:func:`memory_layout`)."""
        caches = iter(memory)
        return zip(caches, caches)

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops = self.args, self.ops
        kv, state = cache
        f = self.attend(b, n, kv, step)
        f += mamba2_mixer(b, n, state, a.ssm, a.norm_eps, ops)
        h, n = ops.residual_norm(x, f, None, b.ffn_norm, a.norm_eps)
        f = swiglu(ops, b.ffn_gate_up, b.ffn_down, n)
        return ops.residual_norm(h, f, None, next_norm, a.norm_eps)
