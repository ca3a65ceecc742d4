"""Mamba2 (``mamba2``: state-spaces/mamba2-*, Mamba-Codestral; llama.cpp's
``src/models/mamba.cpp`` with ``build_mamba2_layer``): every layer a Mamba2 mixer, no
attention, no FFN, no positions::

    x = x + mixer(rms_norm(x))        # models/mamba.py

The memory is one fixed-size recurrent state per layer (:func:`~.mamba.ssm_memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import BaseModel, TensorSpec, head_specs
from .hybrid import HybridArgs
from .mamba import MixerWeights, SSMArgs, mamba2_mixer, ssm_hparams, ssm_memory, ssm_specs


@dataclass(kw_only=True)
class ModelArgs(HybridArgs):
    """Hyperparameters from ``mamba2.*`` metadata keys."""

    ssm: SSMArgs

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters.

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
        """
        # the converter writes a context of 2**20: a recurrence has no limit of its own
        hp, c = cls.read(md, n_vocab, source, context_length=1 << 20)
        return cls(**c, ssm=ssm_hparams(hp))


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of ``mamba2`` (``llama_model_mamba2::load_arch_tensors``)."""
    d, v = a.d_model, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs.append(TensorSpec(p + "attn_norm.weight", (d,)))
        specs += ssm_specs(p, a.ssm, d)
    return specs + head_specs(d, v)


def memory_layout(a: ModelArgs) -> list:
    return [ssm_memory(a.ssm)] * a.n_layers


@dataclass
class Layer(MixerWeights):
    """The tensors of one block: its norm and mixer."""

    attn_norm: torch.Tensor | None = None


class Model(BaseModel):
    """A Mamba2 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def forward(self, tokens: torch.Tensor, pos: int | torch.Tensor, memory, *,
                all_logits: bool = False, logits_start: int = 0) -> torch.Tensor:
        """tokens (T,) int64 -> logits float32, (1, n_vocab) for the last position or
        (T - logits_start, n_vocab) with ``all_logits``; ``memory``: one recurrent state per
        layer. ``pos`` is unused (no positions): the state carries the past."""
        a, ops = self.args, self.ops
        eps = a.norm_eps
        x = self.token_embd(tokens)
        nexts = [b.attn_norm for b in self.layers[1:]] + [self.output_norm]
        n = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        for b, state, next_norm in zip(self.layers, memory, nexts):
            f = mamba2_mixer(b, n, state, a.ssm, eps, ops)
            x, n = ops.residual_norm(x, f, None, next_norm, eps)
            del f
        return self.output(n[logits_start:] if all_logits else n[-1:])
