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
from .base import (
    MAX_CONTEXT,
    REQUIRED,
    BaseModel,
    DecoderArgs,
    HParams,
    TensorSpec,
    common_hparams,
    swa_layers,
)
from .common import Linear, Split, positions_of
from .rope import GLOBAL, NOPE, Rope, RopeWeights, factor_specs, read_rope

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
        hp = HParams(md, source)
        c = common_hparams(hp, n_vocab)
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
    d, hd, v = a.d_model, a.head_dim, a.n_vocab
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    specs = [TensorSpec("token_embd.weight", (v, d)), *factor_specs(a.rope)]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_q.weight", (nq, d)),
                  TensorSpec(p + "attn_k.weight", (nkv, d)),
                  TensorSpec(p + "attn_v.weight", (nkv, d)),
                  TensorSpec(p + "attn_q.bias", (nq,), optional=True),
                  TensorSpec(p + "attn_k.bias", (nkv,), optional=True),
                  TensorSpec(p + "attn_v.bias", (nkv,), optional=True),
                  TensorSpec(p + "attn_q_norm.weight", (hd,)),
                  TensorSpec(p + "attn_k_norm.weight", (hd,)),
                  TensorSpec(p + "attn_output.weight", (d, nq)),
                  TensorSpec(p + "post_attention_norm.weight", (d,)),
                  TensorSpec(p + "ffn_gate.weight", (a.ffn_dim, d)),
                  TensorSpec(p + "ffn_up.weight", (a.ffn_dim, d)),
                  TensorSpec(p + "ffn_down.weight", (d, a.ffn_dim)),
                  TensorSpec(p + "post_ffw_norm.weight", (d,))]
    specs += [TensorSpec("output_norm.weight", (d,)),
              TensorSpec("output.weight", (v, d), optional=True)]
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim, a.sliding_window if a.swa[i] else None)
            for i in range(a.n_layers)]


@dataclass
class Layer:
    """The tensors of one block (``blk.{i}.*``)."""

    attn_qkv: Linear | Split  # fused attn_q, attn_k, attn_v (with their biases)
    attn_q_norm: torch.Tensor  # per head (head_dim,)
    attn_k_norm: torch.Tensor
    attn_output: Linear
    post_attention_norm: torch.Tensor
    ffn_gate_up: Linear | Split  # fused ffn_gate, ffn_up
    ffn_down: Linear
    post_ffw_norm: torch.Tensor


class Model(BaseModel):
    """An EXAONE 4 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    WEIGHTS = RopeWeights
    weights: RopeWeights

    def prepare(self) -> None:
        a = self.args
        self.rope = Rope.of(a.rope, self.weights, self.device)
        self.kinds = [a.rope_kind(i) for i in range(a.n_layers)]
        self.scales = {k: a.head_dim ** -0.5 * self.rope.score_scale(k) for k in set(self.kinds)}
        for b in self.layers:
            b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def forward(self, tokens: torch.Tensor, pos: int | torch.Tensor, memory, *,
                all_logits: bool = False, logits_start: int = 0) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32:
        (1, n_vocab) for the last position, or (T - logits_start, n_vocab) with all_logits."""
        a, ops, rope = self.args, self.ops, self.rope
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.token_embd(tokens)
        angles = rope.angles(ops, positions, memory.ctx_size, tuple(self.scales))
        eps = a.norm_eps
        for b, cache, kind in zip(self.layers, memory, self.kinds):
            q, k, v = b.attn_qkv(x)
            q, k = rope.arrange(q), rope.arrange(k)
            attn = ops.self_attention(q, k, v, b.attn_q_norm, b.attn_k_norm, eps, angles[kind],
                                      cache, pos, positions, head_dim=a.head_dim, neox=True,
                                      scale=self.scales[kind])
            del q, k, v
            h = x + ops.rms_norm(b.attn_output(attn), b.post_attention_norm, eps)
            del attn
            gate, up = b.ffn_gate_up(h)
            f = b.ffn_down(ops.gated(gate, up, "silu", overwrite=True))
            del gate, up
            x = h + ops.rms_norm(f, b.post_ffw_norm, eps)
            del h, f
        n = ops.rms_norm(x, self.output_norm, eps)
        return self.output(n[logits_start:] if all_logits else n[-1:])
