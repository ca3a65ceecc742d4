"""The native CPU backend: matrices stay in their ggml blocks as views of the memory-mapped
file (:mod:`localllm.cpu`, no copy: a model's memory is about its file's tensor bytes plus
the KV cache), multiplied by the native kernels; the rest of a layer runs as fused native
calls (``localllm/cpu/csrc/ops.cpp``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import ClassVar

import torch
from gguf import GGMLQuantizationType as T

from .. import cpu
from ..errors import UnsupportedError
from ..memory import query_window
from .base import ExpertList
from .dense import Backend as _Backend
from .dense import TorchOps

# The KV cache block types the native decode attention reads (csrc/attn_kvq.cpp).
QUANTIZED_KV = frozenset({T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1})

# From this many rows per expert on average, a prompt's native experts run as one
# moe_ffn_q8 call (which unpacks every selected expert's matrices once; with fewer rows the
# per-expert int8 GEMV / tiled products read less: qwen3moe-1b, 64 experts, 8 used, one
# thread: 32 tokens 16 vs 12 ms per layer, 64 tokens 19 vs 30 ms).
MOE_MIN_ROWS = 8


class NativeMatrix:
    """A :class:`~localllm.backends.Matrix` in ggml blocks (:class:`localllm.cpu.PackedWeight`):
    1-8 rows through the native GEMV (int8 activations where the weight's ``q8``), more
    through tiles dequantized to its ``prefill_dtype`` and torch's GEMM
    (:func:`localllm.cpu.qmatmul`)."""

    def __init__(self, w: cpu.PackedWeight) -> None:
        self.w = w
        self.shape = w.shape

    @property
    def nbytes(self) -> int:
        return self.w.data.numel()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu.qmatmul(x, self.w, prefill_dtype=self.w.prefill_dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.rows(ids)

    def stack(self, others: Sequence) -> None:
        return None  # each part is read from the file's own blocks: no concatenated copy


class PackedExperts(ExpertList):
    """Experts in ggml blocks: one :class:`NativeMatrix` per expert, all viewing ``stacked``
    (n_expert * out, in), which the one-call expert kernels read."""

    def __init__(self, stacked: cpu.PackedWeight, n_expert: int) -> None:
        rows = stacked.shape[0] // n_expert
        per = stacked.data.numel() // n_expert
        super().__init__([NativeMatrix(dataclasses.replace(
            stacked, data=stacked.data[e * per:(e + 1) * per], shape=(rows, stacked.shape[1])))
            for e in range(n_expert)])
        self.stacked = stacked


class Backend(_Backend):
    """Matrices of the types :func:`localllm.cpu.supports` as :class:`NativeMatrix` (others
    dequantized); float16 KV caches (llama.cpp's default type) unless float32 matrices were
    asked for (exact checks: float32 activations and caches too)."""

    name = "native"

    def make_ops(self):
        return NativeOps()

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.float32 if self._exact else torch.float16

    @property
    def _exact(self) -> bool:
        return self.dtype == torch.float32

    def _packed(self, info, shape: tuple[int, int]) -> cpu.PackedWeight | None:
        if not cpu.supports(info.qtype, shape[1]):
            return None
        # Prefill multiplies in bfloat16 where the CPU has it and decode quantizes
        # activations to int8 where it has AVX2, unless float32 matrices were asked for.
        return cpu.PackedWeight.from_bytes(
            info.data, info.qtype, shape, q8=not self._exact,
            prefill_dtype=torch.bfloat16 if not self._exact and cpu.bf16_gemm()
            else torch.float32)

    def load_matrix(self, info) -> NativeMatrix | None:
        w = self._packed(info, tuple(info.shape))
        return None if w is None else NativeMatrix(w)

    def load_experts(self, info) -> PackedExperts | None:
        n_exp, rows, cols = info.shape
        w = self._packed(info, (n_exp * rows, cols))
        return None if w is None else PackedExperts(w, n_exp)


class NativeOps(TorchOps):
    """The native CPU kernels (backend ``native``; ``localllm/cpu/csrc/ops.cpp``), float32:
    RMSNorm, the residual add with the next pre-norm (and Gemma's post-norm), QK-norm with
    RoPE, and the gated activation (SiLU, GELU-tanh, gpt-oss's swiglu_oai) in one native
    call each, for any number
    of rows; the whole attention of a step of up to :attr:`FEW` tokens (QK-norm and RoPE of
    q and k, the KV-cache write, grouped-query attention over the live cells with the
    causal, window and soft-capping masks) in one call (over a q8_0, q4_0, q4_1, q5_0 or
    q5_1 cache: QK-norm and RoPE in one call, the quantized write and the attention over the
    blocks in another, ``csrc/attn_kvq.cpp``); the short convolution and Mamba2's
    scan of any number of tokens in one call each (``csrc/ssm.cpp``). Longer steps (prefill)
    attend with :func:`attend` (torch's batched products).

    Each agrees with the torch composition it replaces to float32 rounding (summation order;
    exp and tanh from the kernels' own polynomials): ``tests/test_cpu_ops.py``.
    """

    ACT: ClassVar[dict[str, int]] = cpu.GATED_ACTS  # the kernel's codes (ops.cpp's Act)
    FEW = 8  # steps of up to this many tokens attend natively (decode, small batches)

    def __init__(self) -> None:
        """Raises:
            UnsupportedError: the native kernels are unavailable."""
        if not cpu.available():
            raise UnsupportedError("the native CPU kernels are unavailable (no C++ compiler, "
                                   "or LOCALLLM_NATIVE_CPU=0)")
        ops = torch.ops.localllm_cpu
        self._rms_norm, self._residual_norm = ops.rms_norm.default, ops.residual_norm.default
        self._gated, self._norm_rope = ops.gated.default, ops.norm_rope.default
        self._attn_decode, self._attn_kvq = ops.attn_decode.default, ops.attn_kvq.default
        self._short_conv, self._ssm_scan = ops.short_conv.default, ops.ssm_scan.default
        self._delta_net = ops.gated_delta_net.default
        self._no_positions = torch.empty(0, dtype=torch.long)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dim() != 1:  # a weight per group of rows (Mamba2's grouped norm): torch
            return super().rms_norm(x, weight, eps)
        if x.dim() == 2:
            return self._rms_norm(x.contiguous() if x.stride(-1) != 1 else x, weight, eps)
        return self._rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)

    def norm_rope(self, x, weight, eps, angles, *, neox):
        cos, sin = angles
        return self._norm_rope(x if x.stride(-1) == 1 else x.contiguous(), weight, eps, cos,
                               sin, neox)

    def residual_norm(self, x, f, post_weight, weight, eps):
        return self._residual_norm(x, f, post_weight, weight, eps)

    def gated(self, gate, up, act, *, overwrite=False):
        if act not in self.ACT:  # gated functions without a kernel: torch
            return super().gated(gate, up, act, overwrite=overwrite)
        return self._gated(gate, up, self.ACT[act], gate if overwrite else None)

    def self_attention(self, q, k, v, q_norm, k_norm, eps, angles, cache, pos, positions, *,
                       head_dim, neox, scale, softcap=None, norm_after_rope=False, sinks=None):
        t = q.shape[0]
        where = None
        # chunked attention: one query's chunk is a window (query_window), several queries'
        # are not one window; sinks: the float kernel only
        few = (t <= self.FEW and isinstance(pos, int) and not norm_after_rope
               and (cache.chunk is None or t == 1))
        if few and cache.quantized:
            if (cache.type_k.ggml in QUANTIZED_KV and cache.type_v.ggml in QUANTIZED_KV
                    and cache.dim_k == cache.dim_v and sinks is None):
                where = cache.decode_slot(pos, t)
            if where is not None:
                return self._attention_blocks(q, k, v, q_norm, k_norm, eps, angles, cache, pos,
                                              where, head_dim=head_dim, neox=neox, scale=scale,
                                              softcap=softcap)
        elif few and cache.k.dtype in (torch.float32, torch.float16):
            where = cache.decode_slot(pos, t)
        if where is None:  # prefill, static decode, a wrapped ring, a norm after the rotation
            return super().self_attention(q, k, v, q_norm, k_norm, eps, angles, cache, pos,
                                          positions, head_dim=head_dim, neox=neox,
                                          scale=scale, softcap=softcap,
                                          norm_after_rope=norm_after_rope, sinks=sinks)
        slot, live, k_pos = where
        cos, sin = angles
        return self._attn_decode(q, k, v, q_norm, k_norm, eps, cos, sin, neox, cache.k, cache.v,
                                 self._no_positions if k_pos is None else k_pos, slot, live,
                                 pos, query_window(cache, pos) or 0, scale, softcap or 0.0, sinks)

    def _attention_blocks(self, q, k, v, q_norm, k_norm, eps, angles, cache, pos, where, *,
                          head_dim, neox, scale, softcap):
        """A few tokens over a quantized cache (``csrc/attn_kvq.cpp``): QK-norm and RoPE of
        q and k (:meth:`norm_rope`), then one call that quantizes the new keys and values
        into their cells and attends over the cells' blocks directly."""
        slot, live, k_pos = where
        t = q.shape[0]
        qr = self.norm_rope(q.reshape(t, -1, head_dim).transpose(0, 1), q_norm, eps, angles,
                            neox=neox)
        kr = self.norm_rope(k.reshape(t, -1, head_dim).transpose(0, 1), k_norm, eps, angles,
                            neox=neox)
        return self._attn_kvq(qr, kr, v if v.stride(-1) == 1 else v.contiguous(), cache.k,
                              int(cache.type_k.ggml), cache.v, int(cache.type_v.ggml),
                              self._no_positions if k_pos is None else k_pos, slot, live, pos,
                              query_window(cache, pos) or 0, scale, softcap or 0.0)

    def short_conv(self, x, weight, bias, state, *, silu):
        """One native call (``localllm/cpu/csrc/ssm.cpp``): every token and channel, and the
        state's shift."""
        if x.stride(-1) != 1:
            x = x.contiguous()
        return self._short_conv(x, weight, bias, state, silu)

    def ssm_scan(self, x, dt, dt_bias, a, b, c, d, state):
        """The recurrence token by token in one native call (``ssm.cpp``), heads over threads:
        for a prompt as for one token (per token it reads the state once, as the chunked
        torch form's products do several times)."""
        return self._ssm_scan(x, dt, dt_bias, a, b, c, d, state)

    def gated_delta_net(self, qkv, alpha, beta_logit, dt_bias, a, state, *, n_k_heads, eps,
                        interleave):
        """The native recurrence (``recurrent.cpp``), token by token with each head's state
        in cache, for a decode step and a prompt."""
        return self._delta_net(qkv.contiguous(), alpha.contiguous(), beta_logit.contiguous(),
                               dt_bias, a, state, n_k_heads, eps, interleave)

    @staticmethod
    def mla_heads(w, device):
        """MLA's per-head matrices kept as the file stores them when the int8 GEMV reads
        their blocks (:class:`PackedExperts`, one "expert" per head): a decode step reads
        their stored bytes instead of a float32 copy 4-8x larger (DeepSeek-V3's layout at
        1B: 8 MB of float32 per layer against 1.3 MB); otherwise dense, as the torch ops."""
        if isinstance(w, PackedExperts) and w.stacked.q8:
            return w
        return TorchOps.mla_heads(w, device)

    @staticmethod
    def per_head(x, w):
        """Head h of x (H, T, in) through head h's matrix: one
        :func:`localllm.cpu.gemv_experts` call for one token (every head an "expert" with
        its own input row), one product per head for more; dense heads as the torch ops."""
        if not isinstance(w, PackedExperts):
            return TorchOps.per_head(x, w)
        h, t, _ = x.shape
        if t == 1:
            heads = torch.arange(h)
            return cpu.gemv_experts(x[:, 0].contiguous(), w.stacked, heads, w.shape[1])[:, None]
        return torch.stack([w.matrices[i](x[i]) for i in range(h)])

    def experts(self, x, chosen, weights, gate, up, down, act, *, shared=None):
        """One token whose experts (and shared expert, bias-free) are all int8-ready
        blocks: the whole FFN in one :func:`localllm.cpu.moe_token_q8` call (two parallel
        passes instead of five to seven calls and their Python). Otherwise :meth:`_routed`
        plus the shared expert."""
        if x.shape[0] == 1:
            stacked = _q8_blocks(gate, up, down)
            sh = None if shared is None else _packed_shared(shared)
            weight = None if shared is None else shared.weight
            if (act in cpu.GATED_ACTS and stacked is not None
                    and (shared is None or sh is not None)
                    and (weight is None or isinstance(weight, float) or weight.numel() == 1)):
                return cpu.moe_token_q8(
                    x, chosen[0], weights[0], stacked[0], None if up is None else stacked[1],
                    stacked[-1], biases=_expert_biases(gate, up, down), act=act, shared=sh,
                    shared_weight=1.0 if weight is None else float(weight),
                    shared_x=None if shared is None else shared.x)
        return super().experts(x, chosen, weights, gate, up, down, act, shared=shared)

    def _routed(self, x, chosen, weights, gate, up, down, act):
        """Native int8 experts (all :class:`PackedExperts` with ``q8`` weights; ``up`` None:
        ``gate`` is the fused ``ffn_gate_up_exps``, see ``TorchOps.experts``): one
        token's k experts in one :func:`localllm.cpu.gemv_experts` call per matrix (a call
        per expert and matrix spent most of a MoE decode step in Python; the experts'
        biases added by row), and a prompt of at least :data:`MOE_MIN_ROWS` rows per expert
        on average in one :func:`localllm.cpu.moe_ffn_q8` call (every family's experts:
        SiLU, GELU or gpt-oss's clamped SwiGLU, with or without biases, gate and up fused
        or not, MXFP4 included; the per-expert loop spent most of a MoE prefill in small
        products and Python).
        Otherwise the torch grouping."""
        stacked = _q8_blocks(gate, up, down)
        if stacked is not None:
            n_expert, n_ff = gate.shape[0], gate.shape[1]
            if x.shape[0] == 1:
                e = chosen[0]
                mats = (gate,) if up is None else (gate, up)  # up None: gate_up fused
                proj = [_biased(cpu.gemv_experts(x, w, e, n_ff), m.bias, e)
                        for w, m in zip(stacked[:-1], mats)]
                # fused: (k, 2 n_ff), its halves made contiguous for the kernel
                g, u = proj if up is not None else (h.contiguous() for h in proj[0].chunk(2, -1))
                h = self.gated(g, u, act, overwrite=True)  # (k, n_ff)
                return weights @ _biased(cpu.gemv_experts(h, stacked[-1], e, x.shape[1]),
                                         down.bias, e)
            if (act in cpu.GATED_ACTS and cpu.moe_q8()
                    and x.shape[0] * chosen.shape[1] >= MOE_MIN_ROWS * n_expert):
                return cpu.moe_ffn_q8(x, chosen, weights, stacked[0],
                                      None if up is None else stacked[1], stacked[-1],
                                      biases=_expert_biases(gate, up, down), act=act)
        return super()._routed(x, chosen, weights, gate, up, down, act)


def _q8_blocks(gate, up, down) -> list[cpu.PackedWeight] | None:
    """The stacked blocks of gate, up (None: ``gate`` is the fused ``ffn_gate_up_exps``)
    and down when all are int8-ready :class:`PackedExperts`, else None."""
    mats = (gate, down) if up is None else (gate, up, down)
    stacked = [m.stacked if isinstance(m, PackedExperts) else None for m in mats]
    return stacked if all(w is not None and w.q8 for w in stacked) else None


def _expert_biases(gate, up, down) -> tuple:
    """The experts' (gate, up, down) biases, each (n_expert, rows) or None, as the native
    expert calls take them: a fused ``ffn_gate_up_exps``'s bias split into its halves."""
    if up is not None:
        return gate.bias, up.bias, down.bias
    halves = (None, None) if gate.bias is None else gate.bias.chunk(2, -1)
    return (*halves, down.bias)


def _packed_shared(shared) -> tuple[cpu.PackedWeight, ...] | None:
    """A shared expert's gate, up and down blocks when each is one bias-free int8-ready
    :class:`NativeMatrix` (gate and up the two parts of a split projection, as this backend
    keeps them: :meth:`NativeMatrix.stack`), else None."""
    parts = [*getattr(shared.gate_up, "parts", ()), shared.down]
    if len(parts) != 3:
        return None
    packed = []
    for p in parts:
        w = getattr(p, "weight", None)
        if (not isinstance(w, NativeMatrix) or not w.w.q8 or p.bias is not None
                or getattr(p, "sizes", None) is not None):
            return None
        packed.append(w.w)
    return tuple(packed)


def _biased(y: torch.Tensor, bias: torch.Tensor | None, experts: torch.Tensor) -> torch.Tensor:
    """``y`` (k, out), one row per chosen expert, plus each expert's bias row (in place)."""
    return y if bias is None else y.add_(bias[experts])
