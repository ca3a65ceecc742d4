"""Gemma 3 (text), as llama.cpp's ``src/models/gemma3.cpp`` computes it.

Per layer::

    h   = x + post_attn_norm(attn(attn_norm(x)))      # QK-norm, NEOX RoPE
    out = h + post_ffw_norm(down(gelu_tanh(gate(n)) * up(n))),  n = ffn_norm(h)

The input embedding is scaled by sqrt(d_model); the output projection is tied to it.
Five of every six layers use sliding-window attention (window 512 for the small models)
with their own RoPE base (10,000); the sixth is global (base from the metadata). The GGUF
norm weights already include Gemma's "+1" (llama.cpp's converter adds it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .cache import make_cache
from .common import Weights, model_ops, positions_of, rope_inv_freq


@dataclass
class ModelArgs:
    """Hyperparameters from ``gemma3.*`` metadata keys."""

    n_vocab: int
    n_layers: int  # gemma3.block_count
    d_model: int  # gemma3.embedding_length
    n_heads: int  # gemma3.attention.head_count
    n_kv_heads: int  # gemma3.attention.head_count_kv
    head_dim: int  # gemma3.attention.key_length
    ffn_dim: int  # gemma3.feed_forward_length
    context_length: int
    norm_eps: float = 1e-6
    rope_base: float = 1_000_000.0  # global layers
    rope_base_swa: float = 10_000.0  # sliding-window layers (llama.cpp's rope_freq_base_train_swa)
    rope_scale: float = 1.0  # linear scaling of global layers: 1 / rope.scaling.factor
    sliding_window: int = 512
    swa_pattern: int = 6  # every 6th layer is global

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int) -> ModelArgs:
        a = "gemma3."
        factor = md.get(a + "rope.scaling.factor")
        use_linear = md.get(a + "rope.scaling.type", "linear" if factor else "none") == "linear"
        n_heads = int(md[a + "attention.head_count"])
        d_model = int(md[a + "embedding_length"])
        return cls(
            n_vocab=n_vocab,
            n_layers=int(md[a + "block_count"]),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=int(md.get(a + "attention.head_count_kv", n_heads)),
            head_dim=int(md.get(a + "attention.key_length", d_model // n_heads)),
            ffn_dim=int(md[a + "feed_forward_length"]),
            context_length=int(md.get(a + "context_length", 131072)),
            norm_eps=float(md.get(a + "attention.layer_norm_rms_epsilon", 1e-6)),
            rope_base=float(md.get(a + "rope.freq_base", 1_000_000.0)),
            rope_scale=1.0 / float(factor) if (factor and use_linear) else 1.0,
            sliding_window=int(md.get(a + "attention.sliding_window", 512)),
        )

    def is_sliding(self, layer: int) -> bool:
        return (layer + 1) % self.swa_pattern != 0

    @property
    def attention_scale(self) -> float:
        # llama.cpp: 1/sqrt(head_dim), except the 27B model which uses d_model / n_heads.
        return 1.0 / math.sqrt(self.head_dim)


class Block:
    def __init__(self, w: Weights, i: int, args: ModelArgs) -> None:
        p, d, hd = f"blk.{i}.", args.d_model, args.head_dim
        self.attn_norm = w.get(p + "attn_norm.weight", (d,))
        self.wqkv = w.fused([
            (p + "attn_q.weight", (args.n_heads * hd, d)),
            (p + "attn_k.weight", (args.n_kv_heads * hd, d)),
            (p + "attn_v.weight", (args.n_kv_heads * hd, d)),
        ])
        self.q_norm = w.get(p + "attn_q_norm.weight", (hd,))
        self.k_norm = w.get(p + "attn_k_norm.weight", (hd,))
        self.wo = w.linear(p + "attn_output.weight", (d, args.n_heads * hd))
        self.post_attn_norm = w.get(p + "post_attention_norm.weight", (d,))
        self.ffn_norm = w.get(p + "ffn_norm.weight", (d,))
        self.gate_up = w.fused([
            (p + "ffn_gate.weight", (args.ffn_dim, d)),
            (p + "ffn_up.weight", (args.ffn_dim, d)),
        ])
        self.down = w.linear(p + "ffn_down.weight", (d, args.ffn_dim))
        self.post_ffw_norm = w.get(p + "post_ffw_norm.weight", (d,))
        self.sliding = args.is_sliding(i)


class Model:
    """Gemma 3 text model over a GGUF file's weights."""

    def __init__(self, args: ModelArgs, w: Weights) -> None:
        self.args = args
        self.device = w.device
        self.tok_embd = w.embedding("token_embd.weight", (args.n_vocab, args.d_model))
        self.blocks = [Block(w, i, args) for i in range(args.n_layers)]
        self.output_norm = w.get("output_norm.weight", (args.d_model,))
        # Gemma ties the output projection to the embedding.
        self.lm_head = (
            w.linear("output.weight", (args.n_vocab, args.d_model))
            if w.has("output.weight") else self.tok_embd.head
        )
        self.inv_freq_global = rope_inv_freq(args.head_dim, args.rope_base, device=w.device)
        self.inv_freq_local = rope_inv_freq(args.head_dim, args.rope_base_swa, device=w.device)
        self.ops = model_ops(w)

    def make_caches(self, ctx_size: int, *, slack: int) -> list:
        a = self.args
        return [make_cache(ctx_size, a.sliding_window if b.sliding else None, a.n_kv_heads,
                           a.head_dim, slack=slack, device=self.device) for b in self.blocks]

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
        a = self.args
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.tok_embd(tokens) * math.sqrt(a.d_model)  # (T, d)
        rope = {  # the angles per kind of layer, shared by all layers of that kind
            True: self.ops.rope_angles(positions, self.inv_freq_local),
            False: self.ops.rope_angles(positions, self.inv_freq_global, a.rope_scale),
        }
        # Each block ends with the next block's pre-norm (the output norm after the last),
        # fused with its residual add.
        nexts = [b.attn_norm for b in self.blocks[1:]] + [self.output_norm]
        n = self.ops.rms_norm(x, self.blocks[0].attn_norm, a.norm_eps)
        for block, cache, next_norm in zip(self.blocks, caches, nexts):
            x, n = self._block(block, cache, x, n, next_norm, pos, positions,
                               rope[block.sliding])
        return self.lm_head(n[logits_start:] if all_logits else n[-1:])

    def _block(self, b: Block, cache, x: torch.Tensor, n: torch.Tensor, next_norm: torch.Tensor,
               pos, positions: torch.Tensor, rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (T, d) residual stream, n = attn_norm(x) -> (x', next_norm(x'))."""
        a, ops = self.args, self.ops
        t, hd, eps = x.shape[0], a.head_dim, a.norm_eps
        q, k, v = b.wqkv(n)
        q = q.reshape(t, a.n_heads, hd).transpose(0, 1)  # (nh, T, hd)
        k = k.reshape(t, a.n_kv_heads, hd).transpose(0, 1)  # (nkv, T, hd)
        v = v.reshape(t, a.n_kv_heads, hd).transpose(0, 1)
        q = ops.norm_rope(q, b.q_norm, eps, rope, neox=True)
        k = ops.norm_rope(k, b.k_norm, eps, rope, neox=True)
        # A sliding layer whose window covers the whole context has a full cache (no window).
        attn = ops.attention(q, k, v, cache, pos, positions, scale=a.attention_scale)
        h, n = ops.residual_norm(x, b.wo(attn), b.post_attn_norm, b.ffn_norm, eps)
        gate, up = b.gate_up(n)
        f = b.down(ops.gated(gate, up, "gelu_tanh"))
        return ops.residual_norm(h, f, b.post_ffw_norm, next_norm, eps)
