"""The forward pass shared by the pre-norm attention decoders (llama.cpp's graph of
``src/models/llama.cpp`` and the families built like it): embed the tokens, run each block
on its pre-normed input, read the logits of the last (or every) position.

Each block ends with the next block's pre-norm (``attn_norm``; the output norm after the
last), fused with its residual add (``ops.residual_norm``), so a block takes the residual
stream and its normed copy and returns both for the next. A family's ``Model`` sets its
:class:`~localllm.models.rope.Rope`, its layers' RoPE kinds and attention scales in
``prepare`` (:meth:`Decoder.set_rope`) and writes :meth:`Decoder.block`; it overrides
:meth:`Decoder.embed`, :meth:`Decoder.temperature` or :meth:`Decoder.head` where it scales
them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..memory import KVSpec
from .base import BaseModel, TensorSpec, ffn_specs, qkv_specs
from .common import Linear, Split, positions_of, swiglu
from .rope import GLOBAL, Rope, RopeWeights


@dataclass
class Step:
    """What every block of one forward pass shares: the first position ``pos`` (int or a
    (1,) device tensor), ``positions`` (T,) int64, the RoPE angles of each layer kind, and
    Llama 4's attention temperature (T, 1) float32 or None."""

    pos: int | torch.Tensor
    positions: torch.Tensor
    angles: dict
    temperature: torch.Tensor | None = None


@dataclass
class Block:
    """The tensors every pre-norm attention block has (``blk.{i}.*``); a family's
    ``Layer`` extends it."""

    attn_norm: torch.Tensor
    attn_qkv: Linear | Split  # fused attn_q, attn_k, attn_v (with their biases, if any)
    attn_output: Linear  # (with its bias, if any)


@dataclass(kw_only=True)
class DenseFFN:
    """A SwiGLU FFN in the layers that have one (the others route over experts)."""

    ffn_gate_up: Linear | Split | None = None  # fused ffn_gate, ffn_up
    ffn_down: Linear | None = None


def kv_layout(a, window: int | None = None) -> list[KVSpec]:
    """One KV cache per layer of ``a.n_kv_heads`` heads of ``a.head_dim`` (a sliding
    window of ``window`` positions on every layer where given)."""
    return [KVSpec(a.n_kv_heads, a.head_dim, window)] * a.n_layers


class Decoder(BaseModel):
    """A pre-norm decoder whose blocks chain their norms (module docstring).

    Attributes set by :meth:`set_rope` in ``prepare``: ``rope``, ``kinds`` (each layer's
    RoPE kind, :data:`~localllm.models.rope.GLOBAL` ...), ``scales`` (kind -> attention
    scale, the RoPE magnitude folded in).
    """

    WEIGHTS = RopeWeights  # the frequency factors where the family declares them
    weights: RopeWeights
    rope: Rope
    kinds: list[str]
    scales: dict[str, float]

    def set_rope(self, scale: float, kinds: list[str] | None = None, *, rope: Rope | None = None,
                 norm_after: bool = False) -> None:
        """The model's RoPE (``rope``, default: ``args.rope`` with the file's frequency
        factors; ``norm_after``: see :class:`~localllm.models.rope.Rope`), each layer's kind
        (default: every layer global) and each kind's attention scale, ``scale`` times the
        RoPE's :meth:`~Rope.score_scale`."""
        if rope is None:
            rope = Rope.of(self.args.rope, self.weights, self.device, norm_after=norm_after)
        self.rope = rope
        self.kinds = kinds if kinds is not None else [GLOBAL] * self.args.n_layers
        self.scales = {k: scale * rope.score_scale(k) for k in dict.fromkeys(self.kinds)}

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (T,) int64 -> the residual stream (T, d) float32."""
        return self.token_embd(tokens)

    def temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The attention temperature of each position (T, 1) float32, None without one."""
        return None

    def head(self, n: torch.Tensor) -> torch.Tensor:
        """The output-normed positions n (R, d) -> logits (R, n_vocab) float32."""
        return self.output(n)

    def block(self, i: int, b, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``i`` (tensors ``b``, memory ``cache`` of :meth:`layer_memories`): x (T, d)
        residual stream, n its ``attn_norm`` -> (x', next_norm(x'))."""
        raise NotImplementedError

    def forward(self, tokens: torch.Tensor, pos: int | torch.Tensor, memory, *,
                all_logits: bool = False, logits_start: int = 0) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32:
        (1, n_vocab) for the last position, or (T - logits_start, n_vocab) with all_logits.
        ``memory``: the sequence's :class:`~localllm.memory.Memory` (one cache per layer).

        ``pos`` may be a (1,) int64 tensor on the model's device for a one-token step with
        static shapes and no host reads (CUDA graphs, :mod:`localllm.runtime.graphs`)."""
        positions = positions_of(pos, tokens.shape[0], self.device)
        x = self.embed(tokens)  # (T, d)
        # the angles per kind of layer, shared by all layers of that kind
        step = Step(pos, positions,
                    self.rope.angles(self.ops, positions, memory.ctx_size, tuple(self.scales)),
                    self.temperature(positions))
        n = self.run_layers(x, memory, step)
        return self.head(n[logits_start:] if all_logits else n[-1:])

    def run_layers(self, x: torch.Tensor, memory, step: Step) -> torch.Tensor:
        """The blocks on the residual stream x (T, d) -> the output-normed stream (T, d)."""
        nexts = [b.attn_norm for b in self.layers[1:]] + [self.output_norm]
        n = self.ops.rms_norm(x, self.layers[0].attn_norm, self.args.norm_eps)
        caches = self.layer_memories(memory)
        for i, (b, cache, next_norm) in enumerate(zip(self.layers, caches, nexts)):
            x, n = self.block(i, b, cache, x, n, next_norm, step)
        return n

    def layer_memories(self, memory):
        """What each layer remembers, in layer order: the memory's caches, one per layer
        (a hybrid whose layers hold two pairs them)."""
        return memory

    def attention(self, b, n: torch.Tensor, cache, step: Step, kind: str = GLOBAL, *,
                  q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                  temperature: torch.Tensor | None = None, whole_qk_norm: bool = False,
                  **kw) -> torch.Tensor:
        """The attention sublayer of block ``b`` (``attn_qkv``, ``attn_output``) on its
        normed input n (T, d) -> (T, d) float32: queries and keys in the RoPE's order,
        queries times ``temperature`` (T, 1) where given (RoPE is linear: scaling before
        it is scaling after), the per-head QK-norm ``q_norm`` / ``k_norm`` where given (with
        ``whole_qk_norm``: one RMSNorm over all heads together, before the per-head RoPE:
        OLMo 2, OLMoE), the layer kind's angles and scale, ``ops.self_attention``'s other
        options ``kw``."""
        a, ops = self.args, self.ops
        q, k, v = b.attn_qkv(n)
        q, k = self.rope.arrange(q), self.rope.arrange(k)
        if whole_qk_norm:
            q, k = ops.rms_norm(q, q_norm, a.norm_eps), ops.rms_norm(k, k_norm, a.norm_eps)
            q_norm = k_norm = None
        if temperature is not None:
            q = q * temperature
        attn = ops.self_attention(q, k, v, q_norm, k_norm, a.norm_eps, step.angles[kind],
                                       cache, step.pos, step.positions, head_dim=a.head_dim,
                                       neox=a.rope.neox, scale=self.scales[kind], **kw)
        del q, k, v
        return b.attn_output(attn)


class PostNormDecoder(Decoder):
    """A decoder whose sublayers norm their outputs before the residual add and take the
    stream itself (OLMo 2, EXAONE 4): :meth:`post_norm_block` per layer, the output norm
    after the last."""

    def run_layers(self, x: torch.Tensor, memory, step: Step) -> torch.Tensor:
        for i, (b, cache) in enumerate(zip(self.layers, memory)):
            x = self.post_norm_block(i, b, cache, x, step)
        return self.ops.rms_norm(x, self.output_norm, self.args.norm_eps)

    def post_norm_block(self, i: int, b: PostNormLayer, cache, x: torch.Tensor, step: Step,
                        **kw) -> torch.Tensor:
        """Layer ``i``: x (T, d) -> x + post_attention_norm(attention(x)) = h, then
        h + post_ffw_norm(swiglu(h)); ``kw``: :meth:`Decoder.attention`'s options."""
        ops, eps = self.ops, self.args.norm_eps
        h = x + ops.rms_norm(self.attention(b, x, cache, step, self.kinds[i], **kw),
                             b.post_attention_norm, eps)
        del x
        return h + ops.rms_norm(swiglu(ops, b.ffn_gate_up, b.ffn_down, h), b.post_ffw_norm, eps)


@dataclass
class PostNormLayer:
    """The tensors of a post-norm block (``blk.{i}.*``): no pre-norms."""

    attn_qkv: Linear | Split  # fused attn_q, attn_k, attn_v (with their biases)
    attn_q_norm: torch.Tensor  # QK-norm: per head (head_dim,) or over all heads
    attn_k_norm: torch.Tensor
    attn_output: Linear
    post_attention_norm: torch.Tensor
    ffn_gate_up: Linear | Split  # fused ffn_gate, ffn_up
    ffn_down: Linear
    post_ffw_norm: torch.Tensor


def post_norm_specs(p: str, a, *, qkv_bias: str, qk_norm: tuple[int, int]) -> list[TensorSpec]:
    """A :class:`PostNormLayer`'s tensors (prefix ``p``): Q/K/V (``qkv_bias``: see
    :func:`~localllm.models.base.qkv_specs`), QK-norm weights of ``qk_norm`` sizes (per head
    or over all heads), the output projection, the post-norms around a SwiGLU FFN."""
    d = a.d_model
    return [*qkv_specs(p, d, a.n_heads, a.n_kv_heads, a.head_dim, bias=qkv_bias),
            TensorSpec(p + "attn_q_norm.weight", (qk_norm[0],)),
            TensorSpec(p + "attn_k_norm.weight", (qk_norm[1],)),
            TensorSpec(p + "attn_output.weight", (d, a.n_heads * a.head_dim)),
            TensorSpec(p + "post_attention_norm.weight", (d,)),
            *ffn_specs(p, d, a.ffn_dim),
            TensorSpec(p + "post_ffw_norm.weight", (d,))]
