"""EXAONE 4.0 (``exaone4``), as llama.cpp's ``src/models/exaone4.cpp`` computes it.

Per layer (no pre-norms: the norms follow each sublayer, as OLMo 2's)::

    h   = x + post_attention_norm(wo(attn(q, k, v)))   # per-head QK-norm, then RoPE (NEOX)
    out = h + post_ffw_norm(down(silu(gate(h)) * up(h)))

The 32B model (llama.cpp keys this on its 64 layers) interleaves sliding-window layers
(``attention.sliding_window``, default 4096; ``attention.sliding_window_pattern``, default
three of every four layers) with global ones, and only its sliding layers use RoPE: the
global layers have no positional encoding (NoPE). Every layer of the smaller models is
global, with RoPE. The sliding layers rotate with the global base (llama.cpp reads
``rope.freq_base_swa`` for this family but its graph does not use it). RoPE: Llama 3's
factors (``rope_freqs``, or the ``llama3`` keys), or any :mod:`localllm.models.rope` scaling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import KVSpec
from .base import MAX_CONTEXT, REQUIRED, DecoderArgs, TensorSpec, head_specs, swa_layers
from .decoder import PostNormDecoder, PostNormLayer, Step, post_norm_specs
from .rope import GLOBAL, NOPE, factor_specs, read_rope

LAYERS_SWA = 64  # llama.cpp's exaone4 slides only with the 32B model's layer count


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``exaone4.*`` metadata keys."""

    ffn_dim: int
    sliding_window: int | None = None
    swa: tuple[bool, ...] = ()  # per layer: sliding-window attention (and RoPE)

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named; a
                sliding-window pattern of another length than block_count).
        """
        hp, c = cls.read(md, n_vocab, source)
        ffn = hp.int("feed_forward_length", REQUIRED, per_layer=True)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True)
        n = c["n_layers"]
        window = hp.int("attention.sliding_window", 4096, lo=0, hi=MAX_CONTEXT)
        swa = (False,) * n
        if n == LAYERS_SWA and window:
            swa = tuple(swa_layers(hp, n, 4))
        return cls(**c, rope=rope, ffn_dim=ffn, swa=swa,
                   sliding_window=window if any(swa) else None)

    @property
    def iswa(self) -> bool:
        """Sliding-window layers with RoPE beside global NoPE layers (the 32B model)."""
        return any(self.swa)

    def rope_kind(self, layer: int) -> str:
        return GLOBAL if self.swa[layer] or not self.iswa else NOPE


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``exaone4`` tensors (``load_arch_tensors``), torch shapes."""
    d, v = a.d_model, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d)), *factor_specs(a.rope)]
    for i in range(a.n_layers):
        specs += post_norm_specs(f"blk.{i}.", a, qkv_bias="optional",
                                 qk_norm=(a.head_dim, a.head_dim))
    specs += head_specs(d, v)
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim, a.sliding_window if a.swa[i] else None)
            for i in range(a.n_layers)]


class Model(PostNormDecoder):
    """An EXAONE 4 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = PostNormLayer  # per-head QK-norms (head_dim,)

    def prepare(self) -> None:
        a = self.args
        self.set_rope(a.head_dim ** -0.5,
                      [a.rope_kind(i) for i in range(a.n_layers)])
        for b in self.layers:
            b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def post_norm_block(self, i: int, b: PostNormLayer, cache, x: torch.Tensor, step: Step
                        ) -> torch.Tensor:
        return super().post_norm_block(i, b, cache, x, step, q_norm=b.attn_q_norm,
                                       k_norm=b.attn_k_norm)
