"""Llama 4 (``llama4``: Scout, Maverick), as llama.cpp's ``src/models/llama4.cpp`` computes it.

Per layer::

    h   = x + wo(attn(attn_norm(x)))
    out = h + ffn(ffn_norm(h))

* Attention (iRoPE): three of every four layers (``attention.sliding_window_pattern``,
  llama.cpp's ``load_swa_pattern(ml, 4)``) attend in chunks of 8192 positions (chunked
  local attention: a query sees the keys of its own chunk only) with RoPE (adjacent pairs,
  the sliding layers' base ``rope.freq_base_swa``, default the global one) and, except for
  the 128-expert model, an L2 norm of queries and keys after the rotation (an RMSNorm
  without weight); every 4th layer (llama.cpp's ``n_no_rope_layer_step``) is global with
  no positional encoding (NoPE), its queries scaled by the attention temperature
  ``1 + 0.1 ln(1 + floor((p + 1) / 8192))`` at position p. llama.cpp sets the chunk size,
  the temperature and its period itself (the file's ``attention.sliding_window`` is read
  only for 0: then no layer is chunked, the last layer alone is NoPE and no temperature
  applies; llama.cpp itself asserts on such a file at its first step, localllm runs it).
* FFN: every ``interleave_moe_layer_step``-th layer is a mixture of experts (the others a
  SwiGLU FFN of ``feed_forward_length``): the router's logits pick the top
  ``expert_used_count`` experts; each chosen expert's SwiGLU runs on the *input* scaled by
  sigmoid(its logit) (llama.cpp's ``build_moe_ffn`` with ``weight_before_ffn``, sigmoid
  gating, no renormalisation), plus a shared SwiGLU expert (``ffn_*_shexp``) of the expert
  FFN size on the unscaled input.

RoPE: any of :mod:`localllm.models.rope` (the Llama 3 factors as ``rope_freqs``, as the
converter writes them for Llama 4), on every head dimension (llama.cpp asserts
``rope.dimension_count`` equals the head size).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..memory import KVSpec
from .base import (
    MAX_CONTEXT,
    MAX_LAYERS,
    REQUIRED,
    DecoderArgs,
    TensorSpec,
    ffn_specs,
    head_specs,
    qkv_specs,
    swa_layers,
)
from .common import swiglu
from .decoder import Block, Decoder, DenseFFN, Step
from .llama import attention_temperature
from .moe import ExpertArgs, ExpertWeights, expert_counts, expert_specs, shared_expert
from .rope import GLOBAL, NOPE, SWA, read_rope

CHUNK = 8192  # llama.cpp's n_swa for Llama 4 (the file's value is not read)
TEMPERATURE_SCALE = 0.1  # f_attn_temp_scale
TEMPERATURE_LENGTH = 8192  # n_attn_temp_floor_scale
TEMPERATURE_OFFSET = 1.0  # f_attn_temp_offset
NOPE_STEP = 4  # n_no_rope_layer_step
SWA_PERIOD = 4  # load_swa_pattern(ml, 4): three chunked layers, one global
NO_QK_NORM_EXPERTS = 128  # Llama-4-Maverick (LLM_TYPE_17B_128E) has no L2 QK-norm


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs, ExpertArgs):
    """Hyperparameters from ``llama4.*`` metadata keys."""

    ffn_dim: int  # feed_forward_length: the dense layers' FFN (0 when every layer is MoE)
    expert_ffn_dim: int  # expert_feed_forward_length (the shared expert's too)
    moe_step: int  # interleave_moe_layer_step: layer i is MoE where (i + 1) % step == 0
    chunk: int | None = CHUNK  # chunked attention's chunk size (None: no chunked layers)
    swa: tuple[bool, ...] = ()  # per layer: chunked local attention
    nope_step: int = NOPE_STEP
    qk_norm: bool = True  # L2 norm of RoPE layers' queries and keys
    temperature_scale: float = TEMPERATURE_SCALE  # 0: no temperature

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): no
                experts, more experts used than there are, a sliding-window pattern of
                another length than block_count, a RoPE over part of the head.
        """
        hp, c = cls.read(md, n_vocab, source)
        n = c["n_layers"]
        experts = expert_counts(hp)
        expert_ffn = hp.int("expert_feed_forward_length", REQUIRED, per_layer=True)
        step = hp.int("interleave_moe_layer_step", REQUIRED, lo=0, hi=MAX_LAYERS)
        dense = any(not _is_moe(step, i) for i in range(n))
        ffn = hp.int("feed_forward_length", REQUIRED if dense else 0, lo=1 if dense else 0,
                     per_layer=True)
        window = hp.int("attention.sliding_window", None, lo=0, hi=MAX_CONTEXT)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=False)
        hp.require(rope.n_rot == c["head_dim"], "rope.dimension_count",
                   f"{rope.n_rot} differs from the head size {c['head_dim']} (llama.cpp's "
                   "llama4 rotates whole heads)")
        kw: dict = {}
        if window == 0:  # llama.cpp: no chunked layers, "always use rope" but the last
            kw.update(chunk=None, swa=(False,) * n, nope_step=n, temperature_scale=0.0)
        else:
            kw["swa"] = tuple(swa_layers(hp, n, SWA_PERIOD))
        return cls(**c, rope=rope, ffn_dim=ffn, **experts, expert_ffn_dim=expert_ffn,
                   moe_step=step, qk_norm=experts["n_expert"] != NO_QK_NORM_EXPERTS, **kw)

    def is_moe(self, layer: int) -> bool:
        return _is_moe(self.moe_step, layer)

    def rope_kind(self, layer: int) -> str:
        """:data:`NOPE` for every ``nope_step``-th layer, :data:`SWA` for chunked layers
        (their base), :data:`GLOBAL` otherwise."""
        if (layer + 1) % self.nope_step == 0:
            return NOPE
        return SWA if self.swa[layer] else GLOBAL


def _is_moe(step: int, layer: int) -> bool:
    return step > 0 and (layer + 1) % step == 0


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``llama4`` tensors (``load_arch_tensors``), torch shapes."""
    d, v = a.d_model, a.n_vocab
    specs = [TensorSpec("token_embd.weight", (v, d)),
             TensorSpec("rope_freqs.weight", (a.rope.n_rot // 2,), optional=True)]
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  *qkv_specs(p, d, a.n_heads, a.n_kv_heads, a.head_dim),
                  TensorSpec(p + "attn_output.weight", (d, a.n_heads * a.head_dim)),
                  TensorSpec(p + "ffn_norm.weight", (d,))]
        specs += (expert_specs(p, d, a.n_expert, a.expert_ffn_dim, shared_dim=a.expert_ffn_dim)
                  if a.is_moe(i) else ffn_specs(p, d, a.ffn_dim))
    specs += head_specs(d, v)
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    """Chunked layers: a ring of the chunk (a query's chunk lies within its last ``chunk``
    positions); global layers: every position."""
    return [KVSpec(a.n_kv_heads, a.head_dim, a.chunk, chunked=True) if a.swa[i]
            else KVSpec(a.n_kv_heads, a.head_dim) for i in range(a.n_layers)]


@dataclass
class Layer(Block, DenseFFN, ExpertWeights):
    """The tensors of one block (``blk.{i}.*``); the MoE ones (with a shared expert) in
    the MoE layers."""

    ffn_norm: torch.Tensor


def route(layer: Layer, x: torch.Tensor, n_used: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama 4's routing of x (T, d) float32: the top ``n_used`` experts by router logit
    and their weights sigmoid(logit) -> (chosen (T, k) int64, weights (T, k) float32)
    (llama.cpp's ``build_moe_ffn``: selection on the logits, sigmoid gating, no
    renormalisation)."""
    logits, chosen = layer.ffn_gate_inp(x).topk(n_used, dim=-1)
    return chosen, torch.sigmoid(logits)


def moe_ffn(layer: Layer, x: torch.Tensor, n_used: int, ops) -> torch.Tensor:
    """The MoE FFN of x (T, d) float32 -> (T, d) float32: each chosen expert's SwiGLU of
    ``weight * x`` (the weight applied to the input, llama.cpp's ``weight_before_ffn``),
    summed, plus the shared expert's SwiGLU of x."""
    chosen, weights = route(layer, x, n_used)
    ones = torch.ones_like(weights[:, :1])
    out = None
    for j in range(n_used):  # the experts are not linear: one scaled input per slot
        # the shared expert (on x itself) with the last slot's experts, in one backend call
        shared = shared_expert(layer, x=x) if j == n_used - 1 else None
        y = ops.experts(x * weights[:, j:j + 1], chosen[:, j:j + 1], ones, layer.ffn_gate_exps,
                        layer.ffn_up_exps, layer.ffn_down_exps, "silu", shared=shared)
        out = y if out is None else out + y
    return out


class Model(Decoder):
    """A Llama 4 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a = self.args
        base = 1.0 / math.sqrt(a.head_dim)
        self.set_rope(base, [a.rope_kind(i) for i in range(a.n_layers)])
        # The L2 norm after the rotation cancels the RoPE magnitude (folded into the scale
        # otherwise); a weightless RMSNorm commutes with the rotation, so it runs before it
        # as a QK-norm of unit weight (the backends' fused path).
        if a.qk_norm:
            self.scales.update({k: base for k in self.scales if k != NOPE})
        self.unit = torch.ones(a.head_dim, dtype=torch.float32, device=self.device)

    def temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        """The NoPE layers' attention temperature (T, 1), None when the file has none."""
        scale = self.args.temperature_scale
        return (attention_temperature(positions, scale, TEMPERATURE_LENGTH, TEMPERATURE_OFFSET)
                if scale else None)

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        a, ops, kind = self.args, self.ops, self.kinds[i]
        norm = self.unit if a.qk_norm and kind != NOPE else None
        o = self.attention(b, n, cache, step, kind, q_norm=norm, k_norm=norm,
                           temperature=step.temperature if kind == NOPE else None)
        h, n = ops.residual_norm(x, o, None, b.ffn_norm, a.norm_eps)
        del o, x
        f = (moe_ffn(b, n, a.n_expert_used, ops) if a.is_moe(i)
             else swiglu(ops, b.ffn_gate_up, b.ffn_down, n))
        del n
        return ops.residual_norm(h, f, None, next_norm, a.norm_eps)
