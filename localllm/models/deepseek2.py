"""DeepSeek-V2/V3/R1 and Kimi K2 (GGUF architecture ``deepseek2``; llama.cpp's
``src/models/deepseek2.cpp``, hyperparameters and tensors in ``llama_model_deepseek2``).

Per layer::

    h   = x + wo(mla(attn_norm(x)))
    out = h + ffn(ffn_norm(h))       # SwiGLU for the first leading_dense_block_count layers,
                                     # else routed experts + shared experts

Multi-head latent attention (MLA; Liu et al. 2024, "DeepSeek-V2"), as llama.cpp's converter
stores it (``attention.key_length_mla``, ``attn_k_b``/``attn_v_b``)::

    q          = attn_q_b(rms(attn_q_a(n)))  or  attn_q(n)     # (T, H, nope + n_rot); no
                                                               # q_lora_rank: V2-Lite
    c, k_pe    = attn_kv_a_mqa(n)                              # (T, r), (T, n_rot)
    c          = rms(c) (attn_kv_a_norm); q_pe, k_pe rotated (RoPE, adjacent pairs)
    latent     = [c, k_pe]                                     # cached: r + n_rot per token
    score_h,s  = ([attn_k_b_h q_nope_h, q_pe_h] . latent_s) * kq_scale
    out_h      = attn_v_b_h (softmax(score_h) @ c)             # (dv,)

``r`` is ``attention.kv_lora_rank``; the cache holds one latent per position (the
projections ``attn_k_b``/``attn_v_b`` are absorbed into the query and the output), not every
head's keys and values (:class:`~localllm.memory.LatentSpec`). ``kq_scale`` is llama.cpp's:
``mscale^2 / sqrt(nope + n_rot)`` with ``mscale = attn_factor * (1 + 0.1 ln s) * (1 + 0.1
log_mul ln s)``, ``s`` the RoPE scaling factor and ``log_mul`` the file's
``rope.scaling.yarn_log_multiplier`` / 0.1 (the converter stores 0.1 x ``mscale_all_dim``).

Routing (llama.cpp's ``build_moe_ffn``): router logits -> softmax or sigmoid
(``expert_gating_func`` 1 / 2) -> selection scores = probabilities + ``exp_probs_b`` (V3's
correction bias; the weights stay unbiased) -> with ``expert_group_count`` > 1, only the
``expert_group_used_count`` groups whose two best scores sum highest stay eligible -> top
``expert_used_count`` -> weights renormalised (``expert_weights_norm``) and multiplied by
``expert_weights_scale``. ``expert_shared_count`` shared experts (one SwiGLU of
``expert_shared_count * expert_feed_forward_length``) are added to every token's output.

Files converted before llama.cpp split ``attn_kv_b`` into ``attn_k_b``/``attn_v_b`` (no
``attention.key_length_mla``; ``attention.key_length`` / ``value_length`` are then the
per-head sizes and ``attention.head_count_kv`` the head count, as llama.cpp's non-MLA path
reads them, e.g. early-2025 DeepSeek-R1 GGUFs) run the same way: ``attn_kv_b``, the per-head
(nope + dv, r) matrices stacked, is split into the two at load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from ..backends import ExpertMatrix
from ..memory import LatentSpec
from .base import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    MAX_HEADS,
    MAX_LAYERS,
    REQUIRED,
    DecoderArgs,
    HParams,
    TensorSpec,
    check_vocab,
    ffn_specs,
    head_specs,
)
from .common import Linear, Split, swiglu
from .decoder import Decoder, Step
from .llama import attention_temperature
from .moe import (
    GATING_FUNCS,
    ExpertArgs,
    ExpertWeights,
    expert_counts,
    expert_specs,
    shared_expert,
)
from .rope import GLOBAL, read_rope


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs, ExpertArgs):
    """Hyperparameters from ``deepseek2.*`` keys; ``head_dim`` is the query/key head size
    (``attention.key_length_mla`` = nope + n_rot), ``n_kv_heads`` 1 (the shared latent)."""

    kv_b: bool = False  # attn_kv_b instead of attn_k_b / attn_v_b (files before the split)

    q_lora_rank: int  # attention.q_lora_rank; 0: queries projected directly (attn_q)
    kv_lora_rank: int  # attention.kv_lora_rank: the compressed KV of the latent
    n_rot: int  # rope.dimension_count: the decoupled RoPE key (qk_rope_head_dim)
    head_dim_v: int  # attention.value_length_mla (v_head_dim)
    n_dense_lead: int  # leading_dense_block_count: layers with a dense FFN
    ffn_dim: int  # feed_forward_length (dense layers)
    kq_scale: float  # the attention scale (module docstring)
    expert_ffn_dim: int = 0
    n_expert_shared: int = 0
    expert_weights_scale: float = 1.0
    expert_weights_norm: bool = False
    gating: str = "softmax"  # "softmax" or "sigmoid"
    n_group: int = 0  # expert_group_count (0 or 1: no groups)
    n_group_used: int = 0  # expert_group_used_count
    temperature_scale: float = 0.0  # attention.temperature_scale (Mistral Large 3), 0: none
    temperature_length: int = 0  # attention.temperature_length

    @property
    def nope_dim(self) -> int:
        return self.head_dim - self.n_rot

    @property
    def latent_dim(self) -> int:
        """Values cached per position and layer: kv_lora_rank + n_rot."""
        return self.kv_lora_rank + self.n_rot

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): MLA
                ranks that contradict each other, expert and group counts that do not fit.
        """
        hp = HParams(md, source)
        check_vocab(hp, n_vocab)
        n_layers = hp.int("block_count", REQUIRED, hi=MAX_LAYERS)
        d_model = hp.int("embedding_length", REQUIRED)
        n_heads = hp.int("attention.head_count", REQUIRED, hi=MAX_HEADS, per_layer=True)
        kv_rank = hp.int("attention.kv_lora_rank", REQUIRED)
        q_rank = hp.int("attention.q_lora_rank", 0, lo=0)
        n_rot = hp.int("rope.dimension_count", REQUIRED, lo=2)
        hp.require(n_rot % 2 == 0, "rope.dimension_count", f"{n_rot} is odd (RoPE turns pairs)")
        kv_b = hp.key("attention.key_length_mla") not in md
        if kv_b:  # before the split: the per-head sizes in the plain keys (module docstring)
            n_kv = hp.int("attention.head_count_kv", n_heads, hi=MAX_HEADS, per_layer=True)
            hp.require(n_kv == n_heads, "attention.head_count_kv",
                       f"must be attention.head_count {n_heads} in a file with attn_kv_b "
                       f"(no attention.key_length_mla), got {n_kv}")
            dk_key, dk = "attention.key_length", hp.int("attention.key_length", REQUIRED)
            dv = hp.int("attention.value_length", REQUIRED)
        else:
            n_kv = hp.int("attention.head_count_kv", 1, hi=MAX_HEADS, per_layer=True)
            hp.require(n_kv == 1, "attention.head_count_kv",
                       f"must be 1 for multi-head latent attention (one latent shared by "
                       f"every head), got {n_kv}")
            dk_key, dk = "attention.key_length_mla", hp.int("attention.key_length_mla",
                                                            REQUIRED)
            dv = hp.int("attention.value_length_mla", REQUIRED)
            key_len = hp.int("attention.key_length", kv_rank + n_rot)
            hp.require(key_len == kv_rank + n_rot, "attention.key_length",
                       f"must be attention.kv_lora_rank + rope.dimension_count = "
                       f"{kv_rank + n_rot} (the latent), got {key_len}")
            val_len = hp.int("attention.value_length", kv_rank)
            hp.require(val_len == kv_rank, "attention.value_length",
                       f"must be attention.kv_lora_rank = {kv_rank}, got {val_len}")
        hp.require(dk > n_rot, dk_key,
                   f"{dk} must exceed rope.dimension_count {n_rot} (its RoPE part)")
        ctx = hp.int("context_length", 4096, hi=MAX_CONTEXT)

        n_dense = hp.int("leading_dense_block_count", 0, lo=0, hi=n_layers)
        ffn = hp.int("feed_forward_length", REQUIRED if n_dense else 0,
                     lo=1 if n_dense else 0, per_layer=True)
        kw: dict = {}
        if n_dense < n_layers:  # MoE layers
            kw.update(expert_counts(hp))
            n_expert, used = kw["n_expert"], kw["n_expert_used"]
            kw.update(expert_ffn_dim=hp.int("expert_feed_forward_length", REQUIRED,
                                            per_layer=True),
                      n_expert_shared=hp.int("expert_shared_count", 0, lo=0, hi=MAX_EXPERTS),
                      expert_weights_scale=hp.float("expert_weights_scale", 0.0, lo=0.0,
                                                    lo_open=False) or 1.0,
                      expert_weights_norm=hp.bool("expert_weights_norm", False))
            gating = hp.int("expert_gating_func", 0, lo=0, hi=1 << 16)
            if gating == 0:  # files before the key: softmax (GLM-4.7-Lite: sigmoid)
                gating = 2 if n_layers in (47, 48) and n_vocab == 154880 else 1
            hp.require(gating in GATING_FUNCS, "expert_gating_func",
                       f"{gating} is not 1 (softmax) or 2 (sigmoid)")
            kw["gating"] = GATING_FUNCS[gating]
            groups = hp.int("expert_group_count", 0, lo=0, hi=MAX_EXPERTS)
            if groups > 1:
                hp.require(groups < n_expert and n_expert % groups == 0, "expert_group_count",
                           f"{groups} groups do not divide expert_count {n_expert} experts "
                           "into groups of 2 or more")
                g_used = hp.int("expert_group_used_count", REQUIRED, hi=groups - 1)
                per = n_expert // groups
                hp.require(g_used * per >= used, "expert_group_used_count",
                           f"{g_used} groups of {per} experts cannot hold expert_used_count "
                           f"{used}")
                kw.update(n_group=groups, n_group_used=g_used)
        rope = read_rope(hp, head_dim=n_rot, context_length=ctx, neox=False)
        log_mul = hp.float("rope.scaling.yarn_log_multiplier", 0.0, lo=0.0, lo_open=False) / 0.1
        if rope.kind == "yarn" and log_mul:
            # llama-context.cpp: DeepSeek-V2's mscale is its mscale_all_dim (so YaRN's
            # magnitude of cos and sin is 1; the scores carry it through kq_scale instead)
            rope = replace(rope, log_mul=log_mul, mscale=log_mul if log_mul != 1.0 else 1.0)
        s = 1.0 / rope.freq_scale
        # llama.cpp's deepseek2.cpp: the original attention factor (its RoPE magnitude, with
        # ggml's YaRN factor put back) times the log multiplier's mscale, squared
        org = rope.magnitude() if rope.ext_factor else rope.attn_factor * (1 + 0.1 * math.log(s))
        mscale = org * (1.0 + 0.1 * log_mul * math.log(s))
        temp = hp.float("attention.temperature_scale", 0.0, lo=0.0, lo_open=False)
        if temp:
            kw["temperature_scale"] = temp
            kw["temperature_length"] = hp.int("attention.temperature_length", REQUIRED,
                                              hi=MAX_CONTEXT)
        return cls(arch=hp.arch, n_vocab=n_vocab, n_layers=n_layers, d_model=d_model,
                   n_heads=n_heads, n_kv_heads=1, head_dim=dk, context_length=ctx,
                   norm_eps=hp.float("attention.layer_norm_rms_epsilon", 1e-6, hi=1.0),
                   rope=rope, q_lora_rank=q_rank, kv_lora_rank=kv_rank, n_rot=n_rot,
                   head_dim_v=dv, n_dense_lead=n_dense, ffn_dim=ffn, kv_b=kv_b,
                   kq_scale=mscale * mscale / math.sqrt(dk), **kw)


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors (``llama_model_deepseek2::load_arch_tensors``), torch shapes."""
    d, v, h = a.d_model, a.n_vocab, a.n_heads
    specs = [TensorSpec("token_embd.weight", (v, d))]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs.append(TensorSpec(p + "attn_norm.weight", (d,)))
        if a.q_lora_rank:
            specs += [TensorSpec(p + "attn_q_a.weight", (a.q_lora_rank, d)),
                      TensorSpec(p + "attn_q_a_norm.weight", (a.q_lora_rank,)),
                      TensorSpec(p + "attn_q_b.weight", (h * a.head_dim, a.q_lora_rank))]
        else:
            specs.append(TensorSpec(p + "attn_q.weight", (h * a.head_dim, d)))
        specs += [TensorSpec(p + "attn_kv_a_mqa.weight", (a.latent_dim, d)),
                  TensorSpec(p + "attn_kv_a_norm.weight", (a.kv_lora_rank,))]
        if a.kv_b:
            specs.append(TensorSpec(p + "attn_kv_b.weight",
                                    (h * (a.nope_dim + a.head_dim_v), a.kv_lora_rank)))
        else:
            specs += [TensorSpec(p + "attn_k_b.weight", (h, a.kv_lora_rank, a.nope_dim)),
                      TensorSpec(p + "attn_v_b.weight", (h, a.head_dim_v, a.kv_lora_rank))]
        specs += [TensorSpec(p + "attn_output.weight", (d, h * a.head_dim_v)),
                  TensorSpec(p + "ffn_norm.weight", (d,))]
        specs += (ffn_specs(p, d, a.ffn_dim) if i < a.n_dense_lead else
                  expert_specs(p, d, a.n_expert, a.expert_ffn_dim, selection_bias="optional",
                               shared_dim=a.expert_ffn_dim * a.n_expert_shared))
    specs += head_specs(d, v)
    return specs


def memory_layout(a: ModelArgs) -> list[LatentSpec]:
    """One latent (kv_lora_rank + n_rot values) per position and layer."""
    return [LatentSpec(a.latent_dim)] * a.n_layers


@dataclass
class Layer(ExpertWeights):
    """The tensors of one block (``blk.{i}.*``); the MoE ones past the leading dense
    layers (``exp_probs_b``: DeepSeek-V3's selection bias)."""

    attn_norm: torch.Tensor
    attn_kv_a_mqa: Linear
    attn_kv_a_norm: torch.Tensor
    attn_output: Linear
    ffn_norm: torch.Tensor
    attn_k_b: ExpertMatrix | torch.Tensor | None = None  # (H, r, nope): ops.mla_heads form
    attn_v_b: ExpertMatrix | torch.Tensor | None = None  # (H, dv, r)
    attn_kv_b: Linear | None = None  # files before the split: (H * (nope + dv), r)
    attn_q: Linear | None = None  # no q_lora_rank
    attn_q_a: Linear | None = None
    attn_q_a_norm: torch.Tensor | None = None
    attn_q_b: Linear | None = None
    ffn_gate_up: Linear | Split | None = None  # leading dense layers
    ffn_down: Linear | None = None


def route(logits: torch.Tensor, a: ModelArgs,
          bias: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts of each token and their weights (llama.cpp's ``build_moe_ffn``, see the
    module docstring): logits (T, E) float32 -> (chosen (T, k) int64, weights (T, k)
    float32)."""
    probs = torch.softmax(logits, -1) if a.gating == "softmax" else torch.sigmoid(logits)
    scores = probs if bias is None else probs + bias
    if a.n_group > 1:
        t = scores.shape[0]
        grouped = scores.view(t, a.n_group, -1)  # (T, G, E/G)
        best = grouped.topk(2, dim=-1).values.sum(-1)  # (T, G)
        keep = best.topk(a.n_group_used, dim=-1).indices  # (T, g)
        mask = torch.ones_like(best, dtype=torch.bool).scatter_(1, keep, False)
        scores = grouped.masked_fill(mask[:, :, None], float("-inf")).view(t, -1)
    chosen = scores.topk(a.n_expert_used, dim=-1).indices  # (T, k)
    weights = probs.gather(1, chosen)
    if a.expert_weights_norm:
        weights = weights / weights.sum(-1, keepdim=True).clamp(min=6.103515625e-5)
    if a.expert_weights_scale != 1.0:
        weights = weights * a.expert_weights_scale
    return chosen, weights


class Model(Decoder):
    """A DeepSeek-V2/V3 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        # The magnitude of cos and sin multiplies the rotated part only (q_pe, k_pe), never
        # the scale the nope part shares: not folded into the scores (norm_after).
        a = self.args
        self.set_rope(a.kq_scale, norm_after=True)
        for b in self.layers:
            if b.attn_kv_b is not None:  # split as llama.cpp's converter does now
                eye = torch.eye(a.kv_lora_rank, dtype=torch.float32, device=self.device)
                w = b.attn_kv_b(eye).T.float().reshape(a.n_heads, -1, a.kv_lora_rank)
                b.attn_k_b = w[:, :a.nope_dim].transpose(1, 2).contiguous()
                b.attn_v_b = w[:, a.nope_dim:].contiguous()
                b.attn_kv_b = None
            else:  # in the backend's form (native: int8 products over the stored blocks)
                b.attn_k_b = self.ops.mla_heads(b.attn_k_b, self.device)
                b.attn_v_b = self.ops.mla_heads(b.attn_v_b, self.device)

    def ffn(self, b: Layer, n: torch.Tensor) -> torch.Tensor:
        """The FFN of a block on its normed input n (T, d) -> (T, d) float32."""
        ops = self.ops
        if b.ffn_gate_up is not None:
            return swiglu(ops, b.ffn_gate_up, b.ffn_down, n)
        chosen, weights = route(b.ffn_gate_inp(n), self.args, b.exp_probs_b_bias)
        return ops.experts(n, chosen, weights, b.ffn_gate_exps, b.ffn_up_exps,
                           b.ffn_down_exps, "silu", shared=shared_expert(b))

    def mla(self, b: Layer, n: torch.Tensor, cache, step: Step) -> torch.Tensor:
        """MLA of a block on its normed input n (T, d) -> (T, H * dv) float32."""
        a, ops, eps = self.args, self.ops, self.args.norm_eps
        t, nope, angles = n.shape[0], a.nope_dim, step.angles[GLOBAL]
        if b.attn_q is not None:
            q = b.attn_q(n)
        else:
            q = b.attn_q_b(ops.rms_norm(b.attn_q_a(n), b.attn_q_a_norm, eps))
        if step.temperature is not None:
            q = q * step.temperature  # linear in q: llama.cpp scales the absorbed query
        q = q.view(t, a.n_heads, a.head_dim).transpose(0, 1)  # (H, T, dk)
        q_pe = ops.norm_rope(q[:, :, nope:].contiguous(), None, eps, angles, neox=False)
        kv = b.attn_kv_a_mqa(n)  # (T, r + n_rot)
        c = ops.rms_norm(kv[:, :a.kv_lora_rank].contiguous(), b.attn_kv_a_norm, eps)
        k_pe = ops.norm_rope(kv[None, :, a.kv_lora_rank:].contiguous(), None, eps, angles,
                             neox=False)[0]
        return ops.mla_attention(q[:, :, :nope], q_pe, torch.cat([c, k_pe], -1), b.attn_k_b,
                                 b.attn_v_b, cache, step.pos, step.positions, scale=a.kq_scale)

    def temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        a = self.args
        return (attention_temperature(positions, a.temperature_scale, a.temperature_length)
                if a.temperature_scale else None)

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        ops, eps = self.ops, self.args.norm_eps
        o = b.attn_output(self.mla(b, n, cache, step))
        h, n = ops.residual_norm(x, o, None, b.ffn_norm, eps)
        del o
        return ops.residual_norm(h, self.ffn(b, n), None, next_norm, eps)
