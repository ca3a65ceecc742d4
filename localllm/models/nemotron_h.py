"""Nemotron-H (``nemotron_h``: Nemotron-H-4B/8B/47B, Nemotron-Nano-9B/12B-v2; llama.cpp's
``src/models/nemotron-h.cpp``): a stack of single-purpose layers, each one of

* a Mamba2 mixer (``attention.head_count_kv`` and ``feed_forward_length`` both 0),
* an attention without positions (no RoPE; ``feed_forward_length`` 0, KV heads > 0),
* an FFN ``down(relu(up(n))^2)`` (``feed_forward_length`` > 0),

as ``x = x + layer(attn_norm(x))``. Only the Mamba2 and attention layers remember anything
(:func:`memory_layout` lists their memories in layer order). The MoE variant is llama.cpp's
separate ``nemotron_h_moe`` architecture: ``expert_count`` here is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..memory import KVSpec
from .base import REQUIRED, BaseModel, HParams, TensorSpec, head_specs
from .common import Linear, positions_of
from .hybrid import AttendingArgs, AttentionWeights, attention, attention_specs, hybrid_hparams
from .mamba import MixerWeights, SSMArgs, mamba2_mixer, ssm_hparams, ssm_memory, ssm_specs

MAMBA, ATTENTION, FFN = "mamba", "attention", "ffn"


@dataclass(kw_only=True)
class ModelArgs(AttendingArgs):
    """Hyperparameters from ``nemotron_h.*`` metadata keys."""

    ffn_dims: tuple[int, ...]  # feed_forward_length per layer (0: not an FFN layer)
    ssm: SSMArgs

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each layer's kind, as llama.cpp's ``is_recr`` and ``n_ff(il)`` decide it."""
        return tuple(FFN if f else (MAMBA if kv == 0 else ATTENTION)
                     for f, kv in zip(self.ffn_dims, self.heads.n_kv_heads))

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters.

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
            UnsupportedError: experts (``expert_count`` > 0).
        """
        hp = HParams(md, source)
        if hp.int("expert_count", 0, lo=0):
            raise UnsupportedError(f"{hp.pre}metadata {hp.key('expert_count')}: mixture-of-"
                                   "experts Nemotron-H layers are not supported")
        # llama.cpp's f_norm_eps (required) is the RMS norms' epsilon unless the RMS key is set
        c = hybrid_hparams(hp, n_vocab,
                           eps=hp.float("attention.layer_norm_epsilon", REQUIRED, hi=1.0))
        ffn = hp.int_layers("feed_forward_length", c["n_layers"], REQUIRED)
        heads = cls.read_heads(hp, c, lambda kv: [f == 0 and k > 0 for f, k in zip(ffn, kv)])
        return cls(**c, heads=heads, ffn_dims=ffn, ssm=ssm_hparams(hp))


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of ``nemotron_h`` (``load_arch_tensors``), torch shapes."""
    d, v, hd = a.d_model, a.n_vocab, a.heads.head_dim
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i, kind in enumerate(a.kinds):
        p = f"blk.{i}."
        specs.append(TensorSpec(p + "attn_norm.weight", (d,)))
        if kind == MAMBA:
            specs += ssm_specs(p, a.ssm, d, conv_bias=False)
        elif kind == ATTENTION:
            specs += attention_specs(p, d, a.heads.n_heads[i], a.heads.n_kv_heads[i], hd,
                                     out_bias=True)
        else:
            f = a.ffn_dims[i]
            specs += [TensorSpec(p + "ffn_up.weight", (f, d)),
                      TensorSpec(p + "ffn_down.weight", (d, f)),
                      TensorSpec(p + "ffn_up.bias", (f,), optional=True),
                      TensorSpec(p + "ffn_down.bias", (d,), optional=True)]
    return specs + head_specs(d, v)


def memory_layout(a: ModelArgs) -> list:
    """The memories of the Mamba2 and attention layers, in layer order (FFN layers: none)."""
    out: list = []
    for kind, kv in zip(a.kinds, a.heads.n_kv_heads):
        if kind == MAMBA:
            out.append(ssm_memory(a.ssm))
        elif kind == ATTENTION:
            out.append(KVSpec(kv, a.heads.head_dim))
    return out


@dataclass
class Layer(MixerWeights, AttentionWeights):
    """The tensors of one block: its norm and a mixer, an attention or an FFN."""

    attn_norm: torch.Tensor | None = None
    ffn_up: Linear | None = None
    ffn_down: Linear | None = None


class Model(BaseModel):
    """A Nemotron-H decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        # No positions: zero frequencies rotate nothing (exactly), and the backends' fused
        # attention paths stay usable.
        self.inv_freq = torch.zeros(self.args.heads.head_dim // 2, device=self.device)

    def forward(self, tokens: torch.Tensor, pos: int | torch.Tensor, memory, *,
                all_logits: bool = False, logits_start: int = 0) -> torch.Tensor:
        """tokens (T,) int64 at positions pos .. pos+T-1 -> logits float32, (1, n_vocab) for
        the last position or (T - logits_start, n_vocab) with ``all_logits``; ``memory``:
        the Mamba2 states and KV caches of :func:`memory_layout`."""
        a, ops = self.args, self.ops
        t, eps = tokens.shape[0], a.norm_eps
        positions = positions_of(pos, t, self.device)
        rope = ops.rope_angles(positions, self.inv_freq)
        x = self.token_embd(tokens)
        nexts = [b.attn_norm for b in self.layers[1:]] + [self.output_norm]
        n = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        mems = iter(memory)
        for b, kind, next_norm in zip(self.layers, a.kinds, nexts):
            if kind == MAMBA:
                f = mamba2_mixer(b, n, next(mems), a.ssm, eps, ops)
            elif kind == ATTENTION:
                f = attention(b, n, next(mems), ops, rope, pos, positions,
                              head_dim=a.heads.head_dim, neox=False,
                              scale=a.heads.head_dim ** -0.5, eps=eps)
            else:
                f = b.ffn_down(F.relu(b.ffn_up(n)).square_())
            x, n = ops.residual_norm(x, f, None, next_norm, eps)
            del f
        return self.output(n[logits_start:] if all_logits else n[-1:])
