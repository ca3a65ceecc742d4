"""Qwen3.5 (``qwen35``): a hybrid of gated delta-net layers (:mod:`.deltanet`) and gated
attention layers, three of the former to one of the latter (llama.cpp's
``src/models/qwen35.cpp``). The decoder here also runs ``qwen35moe`` (:mod:`.qwen35moe`: a
mixture of experts in place of the dense FFN) and ``qwen3next`` (:mod:`.qwen3next`), which
differ only in their declarations.

Per layer::

    h   = x + mixer(attn_norm(x))                 # delta-net, or gated attention
    out = h + ffn(post_attention_norm(h))         # SwiGLU; or MoE + gated shared expert

Which layers attend: ``attention.recurrent_layers`` (one boolean per block), else
``full_attention_interval`` (default 4: layer ``i`` attends when ``(i + 1) % 4 == 0``).

Gated attention: ``attn_q`` gives per head a query and a gate (head_dim each); per-head
RMSNorm of queries and keys (``attn_q_norm`` / ``attn_k_norm``); RoPE on the first
``rope.dimension_count`` dims of each head (NEOX halves of those dims, the rest unrotated);
``out = attn_output(attention * sigmoid(gate))``. Qwen3.5 declares interleaved M-RoPE
sections (``rope.dimension_sections``, llama.cpp's ``LLAMA_ROPE_TYPE_IMROPE``); for text the
temporal, height and width positions are all the token's position and the fourth section's
is 0, so a rotated pair turns by the position unless the interleaving assigns it to the
fourth section, where it does not turn.

Partial RoPE runs on the full-head kernels: queries and keys are gathered into an order
where the rotated dims are the first entries of each NEOX half (the unrotated ones after
them, with frequency 0), the QK-norm weights permuted alike; scores do not depend on the
order of the dims they sum over, and values keep theirs.

``nextn_predict_layers`` blocks after the trunk (multi-token prediction, for speculative
drafts) are declared, their shapes checked, and never read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..memory import KVSpec
from . import deltanet
from .base import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_LAYERS,
    REQUIRED,
    BaseModel,
    DecoderArgs,
    HParams,
    TensorSpec,
    attention_heads,
    check_vocab,
    ffn_specs,
    head_specs,
)
from .common import Linear, Split, positions_of, swiglu
from .deltanet import DeltaNetArgs
from .moe import ExpertWeights, Routing, expert_specs, routed_experts, shared_expert
from .rope import read_rope

ROUTING = Routing(norm=True)  # softmax, the chosen probabilities renormalised


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``{arch}.*`` metadata keys (module docstring)."""

    recurrent: tuple[bool, ...]  # per trunk layer: a delta-net (True) or attention
    deltanet: DeltaNetArgs
    rope_sections: tuple[int, ...] | None = None  # interleaved M-RoPE; None: plain NEOX
    ffn_dim: int = 0  # feed_forward_length
    n_nextn: int = 0  # nextn_predict_layers: blocks after the trunk, not run
    n_expert: int = 0  # expert_count
    n_expert_used: int = 0  # expert_used_count
    expert_ffn_dim: int = 0  # expert_feed_forward_length
    shared_ffn_dim: int = 0  # expert_shared_feed_forward_length

    # What distinguishes the families (set by their modules' subclasses).
    MOE = False
    MROPE = True
    FUSED_BA = False  # qwen3next: ssm_ba instead of ssm_beta / ssm_alpha
    INTERLEAVE = False  # qwen3next: value head h reads key head h // (Hv/Hk)

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): the
                ``ssm.*`` keys (:func:`.deltanet.deltanet_hparams`), a layer-kind array of
                the wrong length, RoPE dims or sections that do not fit the head.
        """
        hp = HParams(md, source)
        check_vocab(hp, n_vocab)
        d_model = hp.int("embedding_length", REQUIRED)
        n_all = hp.int("block_count", REQUIRED, hi=MAX_LAYERS)
        n_nextn = hp.int("nextn_predict_layers", 0, lo=0, hi=n_all - 1)
        n_layers = n_all - n_nextn
        n_heads, n_kv, hd, _ = attention_heads(hp, d_model)
        ctx = hp.int("context_length", 4096, hi=MAX_CONTEXT)
        rope = read_rope(hp, head_dim=hd, context_length=ctx, neox=True)
        sections = None
        if cls.MROPE:
            sections = hp.int_array("rope.dimension_sections", 4, REQUIRED)
            hp.require(0 < sum(sections) <= hd, "rope.dimension_sections",
                       f"the sections {list(sections)} must sum to 1..{hd} (the head size)")
        kw = {}
        ffn = hp.int("feed_forward_length", 0 if cls.MOE else REQUIRED,
                     lo=0 if cls.MOE else 1, per_layer=True)
        if cls.MOE:
            n_expert = hp.int("expert_count", REQUIRED, hi=MAX_EXPERTS)
            used = hp.int("expert_used_count", REQUIRED, hi=n_expert)
            kw = {"n_expert": n_expert, "n_expert_used": used,
                  "expert_ffn_dim": hp.int("expert_feed_forward_length",
                                           ffn // used if ffn >= used else REQUIRED,
                                           per_layer=True),
                  "shared_ffn_dim": hp.int("expert_shared_feed_forward_length",
                                           ffn or REQUIRED)}
        return cls(
            arch=hp.arch, n_vocab=n_vocab, n_layers=n_layers, d_model=d_model,
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=hd,
            context_length=ctx, rope=rope,
            norm_eps=hp.float("attention.layer_norm_rms_epsilon", REQUIRED, hi=1.0),
            recurrent=layer_kinds(hp, n_layers, n_all),
            deltanet=deltanet.deltanet_hparams(hp, interleave=cls.INTERLEAVE),
            rope_sections=sections, ffn_dim=ffn, n_nextn=n_nextn, **kw)


def layer_kinds(hp: HParams, n_layers: int, n_all: int) -> tuple[bool, ...]:
    """Per trunk layer whether it is recurrent (llama.cpp's ``hparams.is_recr``):
    ``attention.recurrent_layers`` (one boolean per block, the MTP blocks included), else
    every layer but each ``full_attention_interval``-th (default 4).

    Raises:
        GGUFError: the array has another length than ``block_count``, the interval is 0.
    """
    kinds = hp.bool_layers("attention.recurrent_layers", n_all)
    if kinds is not None:
        return kinds[:n_layers]
    interval = hp.int("full_attention_interval", 4, hi=MAX_LAYERS)
    return tuple((i + 1) % interval != 0 for i in range(n_layers))


def attention_specs(p: str, a: ModelArgs) -> list[TensorSpec]:
    """A gated-attention sublayer: Q (with the gate, twice the heads' width), K, V, QK-norm,
    output (llama.cpp's ``create_tensor_qkv`` with ``n_embd_head_k * n_head * 2``)."""
    d, hd = a.d_model, a.head_dim
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    return [TensorSpec(p + "attn_q.weight", (2 * nq, d)),
            TensorSpec(p + "attn_k.weight", (nkv, d)),
            TensorSpec(p + "attn_v.weight", (nkv, d)),
            TensorSpec(p + "attn_q_norm.weight", (hd,)),
            TensorSpec(p + "attn_k_norm.weight", (hd,)),
            TensorSpec(p + "attn_output.weight", (d, nq))]


def block_ffn_specs(p: str, a: ModelArgs) -> list[TensorSpec]:
    """The dense SwiGLU, or the routed experts and the gated shared expert (MoE)."""
    d = a.d_model
    if not a.n_expert:
        return ffn_specs(p, d, a.ffn_dim)
    return [*expert_specs(p, d, a.n_expert, a.expert_ffn_dim),
            TensorSpec(p + "ffn_gate_inp_shexp.weight", (d,)),
            *ffn_specs(p, d, a.shared_ffn_dim, "_shexp")]


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of the family (``load_arch_tensors``), torch shapes."""
    d, v = a.d_model, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers + a.n_nextn):
        p = f"blk.{i}."
        block = [TensorSpec(p + "attn_norm.weight", (d,)),
                 TensorSpec(p + "post_attention_norm.weight", (d,))]
        if i < a.n_layers and a.recurrent[i]:
            block += deltanet.deltanet_specs(p, d, a.deltanet, fused_ba=a.FUSED_BA)
        else:
            block += attention_specs(p, a)
        block += block_ffn_specs(p, a)
        if i >= a.n_layers:  # a multi-token-prediction block: checked, never read
            block += [TensorSpec(p + "nextn.eh_proj.weight", (d, 2 * d)),
                      TensorSpec(p + "nextn.enorm.weight", (d,)),
                      TensorSpec(p + "nextn.hnorm.weight", (d,)),
                      TensorSpec(p + "nextn.embed_tokens.weight", (v, d)),
                      TensorSpec(p + "nextn.shared_head_head.weight", (v, d)),
                      TensorSpec(p + "nextn.shared_head_norm.weight", (d,))]
            block = [replace(s, optional=True, unused=True, unless=None) for s in block]
        specs += block
    specs += head_specs(d, v)
    return specs


def memory_layout(a: ModelArgs) -> list:
    """A recurrent state per delta-net layer, a KV cache per attention layer."""
    return [deltanet.memory_spec(a.deltanet) if r else KVSpec(a.n_kv_heads, a.head_dim)
            for r in a.recurrent]


@dataclass
class Layer(ExpertWeights):
    """The tensors of one block (``blk.{i}.*``): attention or delta-net, dense or MoE FFN."""

    attn_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    # gated attention
    attn_qkv: Linear | Split | None = None  # attention: fused attn_q, attn_k, attn_v;
    # delta-net: the file's attn_qkv (queries, keys, values before the convolution)
    attn_output: Linear | None = None
    attn_q_norm: torch.Tensor | None = None
    attn_k_norm: torch.Tensor | None = None
    # gated delta-net (models/deltanet.py)
    attn_gate: Linear | None = None
    ssm_conv1d: torch.Tensor | None = None  # (conv_dim, d_conv) float32
    ssm_dt_bias: torch.Tensor | None = None
    ssm_a: torch.Tensor | None = None
    ssm_beta: Linear | None = None
    ssm_alpha: Linear | None = None
    ssm_ba: Linear | None = None  # qwen3next
    ssm_in: Linear | None = None  # legacy qwen3next
    ssm_norm: torch.Tensor | None = None
    ssm_out: Linear | None = None
    # FFN
    ffn_gate_up: Linear | Split | None = None
    ffn_down: Linear | None = None
    ffn_gate_inp_shexp: torch.Tensor | None = None  # (d,): the shared expert's gate


def rope_inv_freq(a: ModelArgs) -> torch.Tensor:
    """Frequencies (head_dim/2,) float32 of the reordered head (module docstring): pair ``i``
    of the first ``n_rot/2`` turns at ``base^(-2i/n_rot)`` (ggml's ``theta_scale`` over the
    rotated dims; the scaling of :class:`~.rope.RopeSpec` applied), unless interleaved M-RoPE
    gives it the fourth section (position 0 for text: frequency 0, as llama.cpp's
    ``ggml_mrope_cache_init``); the unrotated pairs 0."""
    half = a.rope.n_rot // 2
    inv = torch.zeros(a.head_dim // 2, dtype=torch.float32)
    inv[:half] = a.rope.inv_freq().float()
    if a.rope_sections is not None:
        s = a.rope_sections
        for p in range(half):
            sector = p % sum(s)
            if sector >= 3 * s[sector % 3]:  # neither t, h nor w: the fourth section
                inv[p] = 0.0
    return inv


def rope_order(head_dim: int, n_rot: int) -> torch.Tensor:
    """The head's dims in the order where partial NEOX RoPE is full NEOX RoPE (module
    docstring): (head_dim,) int64, new position -> original dim."""
    r, half, rest = n_rot // 2, head_dim // 2, (head_dim - n_rot) // 2
    first = list(range(r)) + list(range(n_rot, n_rot + rest))
    second = list(range(r, n_rot)) + list(range(n_rot + rest, head_dim))
    assert len(first) == len(second) == half
    return torch.tensor(first + second, dtype=torch.long)


class Model(BaseModel):
    """The Qwen3.5 / Qwen3.5-MoE / Qwen3-Next decoder; weights attached by
    :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a, dev = self.args, self.device
        hd = a.head_dim
        self.inv_freq = rope_inv_freq(a).to(dev)
        order = rope_order(hd, a.rope.n_rot)
        # YaRN's / attn_factor's magnitude of cos and sin, on the rotated pairs only
        m = a.rope.magnitude()
        self.magnitude = None
        if m != 1.0:
            self.magnitude = torch.ones(hd // 2, device=dev)
            self.magnitude[:a.rope.n_rot // 2] = m
        heads = torch.arange(a.n_heads)[:, None]
        self.q_idx = (heads * 2 * hd + order).reshape(-1).to(dev)
        self.gate_idx = (heads * 2 * hd + hd + torch.arange(hd)).reshape(-1).to(dev)
        self.k_idx = None
        if a.rope.n_rot != hd:
            self.k_idx = (torch.arange(a.n_kv_heads)[:, None] * hd + order).reshape(-1).to(dev)
            for b, rec in zip(self.layers, a.recurrent):
                if not rec:
                    b.attn_q_norm = b.attn_q_norm[order.to(b.attn_q_norm.device)]
                    b.attn_k_norm = b.attn_k_norm[order.to(b.attn_k_norm.device)]

    def attention(self, b: Layer, x: torch.Tensor, cache, pos, positions, rope) -> torch.Tensor:
        """Gated attention (module docstring) of the normalized input x (T, d) -> (T, d)."""
        a = self.args
        q_full, k, v = b.attn_qkv(x)
        q = q_full.index_select(1, self.q_idx)
        gate = q_full.index_select(1, self.gate_idx)
        if self.k_idx is not None:
            k = k.index_select(1, self.k_idx)
        o = self.ops.self_attention(q, k, v, b.attn_q_norm, b.attn_k_norm, a.norm_eps, rope,
                                    cache, pos, positions, head_dim=a.head_dim, neox=True,
                                    scale=1.0 / math.sqrt(a.head_dim))
        return b.attn_output(o.mul_(torch.sigmoid(gate)))

    def ffn(self, b: Layer, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU, or the routed experts (softmax, top ``expert_used_count``, weights
        renormalised: llama.cpp's ``build_moe_ffn``) plus the shared expert times
        ``sigmoid(x . ffn_gate_inp_shexp)``."""
        ops = self.ops
        if b.ffn_gate_inp is None:
            return swiglu(ops, b.ffn_gate_up, b.ffn_down, x)
        gate = torch.sigmoid(x @ b.ffn_gate_inp_shexp)[:, None]
        return routed_experts(ops, b, x, self.args.n_expert_used, ROUTING,
                              shared=shared_expert(b, weight=gate))

    def forward(self, tokens: torch.Tensor, pos: int | torch.Tensor, memory, *,
                all_logits: bool = False, logits_start: int = 0) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32: (1, n_vocab) for
        the last position, or (T - logits_start, n_vocab) with all_logits. ``memory``: the
        sequence's :class:`~localllm.memory.Memory` (a KV cache or a recurrent state per
        layer, :func:`memory_layout`)."""
        a, ops = self.args, self.ops
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.token_embd(tokens)
        rope = (ops.rope_angles(positions, self.inv_freq, magnitude=self.magnitude)
                if not all(a.recurrent) else None)
        nexts = [b.attn_norm for b in self.layers[1:]] + [self.output_norm]
        eps = a.norm_eps
        n = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        for b, rec, mem, next_norm in zip(self.layers, a.recurrent, memory, nexts):
            if rec:
                o = deltanet.delta_net(b, n, mem, ops, a.deltanet, eps)
            else:
                o = self.attention(b, n, mem, pos, positions, rope)
            del n
            h, n = ops.residual_norm(x, o, None, b.post_attention_norm, eps)
            del o
            f = self.ffn(b, n)
            x, n = ops.residual_norm(h, f, None, next_norm, eps)
            del h, f
        return self.output(n[logits_start:] if all_logits else n[-1:])
