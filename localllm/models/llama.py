"""The Llama family: ``llama``, ``mistral``, ``qwen2``, ``qwen3`` (llama.cpp's
``src/models/llama.cpp``, ``qwen2.cpp``, ``qwen3.cpp``).

Per layer::

    h   = x + wo(attn(attn_norm(x)))          # GQA; Qwen2 has QKV biases, Qwen3 QK-norm
    out = h + down(silu(gate(n)) * up(n)),  n = ffn_norm(h)

RoPE: adjacent pairs for ``llama``/``mistral`` (the converter permutes Q/K for that),
halves (NEOX) for ``qwen2``/``qwen3``; linear scaling from ``rope.scaling.factor`` and
Llama 3.1's per-frequency factors from the ``rope_freqs.weight`` tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cache import make_cache
from .common import Weights, model_ops, positions_of, rope_inv_freq

NEOX_ARCHITECTURES = frozenset({"qwen2", "qwen3"})


@dataclass
class ModelArgs:
    """Hyperparameters from ``{arch}.*`` metadata keys."""

    arch: str
    n_vocab: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    context_length: int
    norm_eps: float = 1e-5
    rope_base: float = 10_000.0
    rope_scale: float = 1.0
    sliding_window: int | None = None  # mistral-style SWA on every layer, when given

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int) -> ModelArgs:
        arch = md["general.architecture"]
        a = arch + "."
        n_heads = int(md[a + "attention.head_count"])
        d_model = int(md[a + "embedding_length"])
        factor = md.get(a + "rope.scaling.factor")
        use_linear = md.get(a + "rope.scaling.type", "linear" if factor else "none") == "linear"
        window = md.get(a + "attention.sliding_window")
        return cls(
            arch=arch,
            n_vocab=n_vocab,
            n_layers=int(md[a + "block_count"]),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(md.get(a + "attention.head_count_kv", n_heads)),
            head_dim=int(md.get(a + "attention.key_length", d_model // n_heads)),
            ffn_dim=int(md[a + "feed_forward_length"]),
            context_length=int(md.get(a + "context_length", 4096)),
            norm_eps=float(md.get(a + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_base=float(md.get(a + "rope.freq_base", 10_000.0)),
            rope_scale=1.0 / float(factor) if (factor and use_linear) else 1.0,
            sliding_window=int(window) if window else None,
        )

    @property
    def neox(self) -> bool:
        return self.arch in NEOX_ARCHITECTURES

    @property
    def attention_scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)


class Block:
    def __init__(self, w: Weights, i: int, args: ModelArgs) -> None:
        p, d, hd = f"blk.{i}.", args.d_model, args.head_dim
        nq, nkv = args.n_heads * hd, args.n_kv_heads * hd

        self.attn_norm = w.get(p + "attn_norm.weight", (d,))
        self.wqkv = w.fused(
            [(p + "attn_q.weight", (nq, d)), (p + "attn_k.weight", (nkv, d)),
             (p + "attn_v.weight", (nkv, d))],
            [p + "attn_q.bias", p + "attn_k.bias", p + "attn_v.bias"],
        )
        self.q_norm = w.get(p + "attn_q_norm.weight", (hd,)) if w.has(p + "attn_q_norm.weight") else None
        self.k_norm = w.get(p + "attn_k_norm.weight", (hd,)) if w.has(p + "attn_k_norm.weight") else None
        self.wo = w.linear(p + "attn_output.weight", (d, nq), p + "attn_output.bias")
        self.ffn_norm = w.get(p + "ffn_norm.weight", (d,))
        self.gate_up = w.fused([
            (p + "ffn_gate.weight", (args.ffn_dim, d)),
            (p + "ffn_up.weight", (args.ffn_dim, d)),
        ])
        self.down = w.linear(p + "ffn_down.weight", (d, args.ffn_dim))


class Model:
    """A Llama-family decoder over a GGUF file's weights."""

    def __init__(self, args: ModelArgs, w: Weights) -> None:
        self.args = args
        self.device = w.device
        self.tok_embd = w.embedding("token_embd.weight", (args.n_vocab, args.d_model))
        self.blocks = [Block(w, i, args) for i in range(args.n_layers)]
        self.output_norm = w.get("output_norm.weight", (args.d_model,))
        self.lm_head = (
            w.linear("output.weight", (args.n_vocab, args.d_model))
            if w.has("output.weight") else self.tok_embd.head
        )
        factors = (
            w.get("rope_freqs.weight", (args.head_dim // 2,)) if w.has("rope_freqs.weight") else None
        )
        self.inv_freq = rope_inv_freq(args.head_dim, args.rope_base, factors, device=w.device)
        self.ops = model_ops(w)

    def make_caches(self, ctx_size: int, *, slack: int) -> list:
        a = self.args
        return [make_cache(ctx_size, a.sliding_window, a.n_kv_heads, a.head_dim, slack=slack,
                           device=self.device) for _ in self.blocks]

    def forward(
        self,
        tokens: torch.Tensor,
        pos: int | torch.Tensor,
        caches: list,
        *,
        all_logits: bool = False,
        logits_start: int = 0,
    ) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32:
        (1, n_vocab) for the last position, or (T - logits_start, n_vocab) with all_logits.

        ``pos`` may be a (1,) int64 tensor on the model's device for a one-token step with
        static shapes and no host reads (CUDA graphs, :mod:`localllm.runtime.graphs`)."""
        a, ops = self.args, self.ops
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.tok_embd(tokens)  # (T, d)
        rope = ops.rope_angles(positions, self.inv_freq, a.rope_scale)  # shared by every layer
        # Each block ends with the next block's pre-norm (the output norm after the last),
        # fused with its residual add.
        nexts = [b.attn_norm for b in self.blocks[1:]] + [self.output_norm]
        eps = a.norm_eps
        n = ops.rms_norm(x, self.blocks[0].attn_norm, eps)
        for b, cache, next_norm in zip(self.blocks, caches, nexts):
            q, k, v = b.wqkv(n)
            q = q.reshape(t, a.n_heads, a.head_dim).transpose(0, 1)  # (nh, T, hd)
            k = k.reshape(t, a.n_kv_heads, a.head_dim).transpose(0, 1)  # (nkv, T, hd)
            v = v.reshape(t, a.n_kv_heads, a.head_dim).transpose(0, 1)
            q = ops.norm_rope(q, b.q_norm, eps, rope, neox=a.neox)  # QK-norm: qwen3
            k = ops.norm_rope(k, b.k_norm, eps, rope, neox=a.neox)
            attn = ops.attention(q, k, v, cache, pos, positions, scale=a.attention_scale)
            h, n = ops.residual_norm(x, b.wo(attn), None, b.ffn_norm, eps)
            gate, up = b.gate_up(n)
            x, n = ops.residual_norm(h, b.down(ops.gated(gate, up, "silu")), None, next_norm, eps)
        return self.lm_head(n[logits_start:] if all_logits else n[-1:])
