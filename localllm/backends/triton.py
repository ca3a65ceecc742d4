"""The Triton backend (CUDA; on the CPU, Triton's interpreter, for tests): matrices stay in
their ggml blocks on the device (:class:`localllm.kernels.QuantWeight`, repacked into aligned
planes where the blocks are not 16-byte aligned) and the Triton kernels multiply them
directly, so GPU memory is about the GGUF's tensor bytes plus the KV cache; a layer's
element-wise work is fused into few launches (:class:`KernelOps`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import kernels
from ..memory import BlockRows
from .base import ExpertList
from .dense import GATED, TorchOps, prefill_attention, store_kv
from .dense import Backend as _Backend


class TritonMatrix:
    """A :class:`~localllm.backends.Matrix` in ggml blocks on the device: the Triton GEMV for
    up to ``kernels.GEMV_MAX_ROWS`` rows, the dequantizing GEMM above (in float16, or
    bfloat16 with ``bf16``: activations beyond float16's range, Gemma's)."""

    def __init__(self, w: kernels.QuantWeight, *, bf16: bool = False) -> None:
        self.w = w
        self.shape = w.shape
        self.bf16 = bf16

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= kernels.GEMV_MAX_ROWS:
            return kernels.quant_linear(x, self.w, out_dtype=torch.float32)
        # bfloat16: the kernel rounds the float32 tiles it loads (no float16 copy to overflow)
        return kernels.quant_linear(x if self.bf16 else x.half(), self.w,
                                    out_dtype=torch.float32, bf16=self.bf16)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w.rows(ids)

    def stack(self, others: Sequence) -> TritonMatrix | None:
        if not all(isinstance(o, TritonMatrix) and o.w.qtype == self.w.qtype for o in others):
            return None
        fused = kernels.QuantWeight.cat([self.w, *(o.w for o in others)])
        # one output tensor (no per-part splits in the kernel call): Linear splits it
        return TritonMatrix(kernels.QuantWeight(fused.data, fused.qtype, fused.shape,
                                                layout=fused.layout), bf16=self.bf16)


class Backend(_Backend):
    """Matrices of the types :func:`localllm.kernels.supports` as :class:`TritonMatrix`
    (others dequantized), float16 KV caches, :class:`KernelOps`."""

    name = "triton"

    def __init__(self, device, dtype: torch.dtype = torch.float16, *,
                 prefill_bf16: bool = False) -> None:
        super().__init__(device, dtype, prefill_bf16=prefill_bf16)
        kernels.register_quants_backend()  # dequantize() of CUDA tensors by the kernel

    def make_ops(self):
        return KernelOps()

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.float16

    def _quant(self, data, qtype, shape) -> TritonMatrix:
        # aligned(): repacked on the device into 16-byte aligned planes where the blocks are
        # not (bit-exact; replaces the copy, no second one is kept)
        w = kernels.QuantWeight.from_bytes(data.copy(), qtype, shape).to(self.device).aligned()
        return TritonMatrix(w, bf16=self.prefill_bf16)

    def load_matrix(self, info) -> TritonMatrix | None:
        if not kernels.supports(info.qtype):
            return None
        return self._quant(info.data, info.qtype, info.shape)

    def load_experts(self, info) -> ExpertList | None:
        if not kernels.supports(info.qtype):
            return None
        n_exp, rows, cols = info.shape
        per = info.n_bytes // n_exp
        return ExpertList([self._quant(info.data[e * per:(e + 1) * per], info.qtype,
                                       (rows, cols)) for e in range(n_exp)])


class KernelOps(TorchOps):
    """The Triton kernels (the quantized backend): QK-norm with RoPE, residual add with the
    next pre-norm, and the gated activation each in one launch instead of several torch
    kernels (:mod:`localllm.kernels.fused`), and flash-decoding attention for one-token steps
    (:func:`localllm.kernels.decode_attention`), which reads only the visible part of a
    cache; a decode token's QK-norm, RoPE and cache write are one more launch
    (:func:`localllm.kernels.norm_rope_kv`). Prefill attention is torch's fused SDPA in the
    cache's dtype (:func:`prefill_attention`), :func:`attend` only with soft-capping. The
    short convolution and Mamba2's scan are one launch each, for a token or a prompt
    (:mod:`localllm.kernels.ssm`)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if weight.dim() != 1:  # a weight per group of rows (Mamba2's grouped norm): torch
            return TorchOps.rms_norm(x, weight, eps)
        return kernels.rms_norm(x, weight, eps)

    @staticmethod
    def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0,
                    magnitude: torch.Tensor | None = None):
        return positions, inv_freq, scale, magnitude  # the kernel computes the angles itself

    @staticmethod
    def rotate(x: torch.Tensor, angles, *, neox: bool) -> torch.Tensor:
        positions, inv_freq, scale, magnitude = angles
        return _magnified(kernels.rope(x, positions, inv_freq, neox=neox, scale=scale),
                          magnitude, neox)

    def norm_rope(self, x, weight, eps, angles, *, neox):
        positions, inv_freq, scale, magnitude = angles
        return _magnified(kernels.rms_norm_rope(x, weight, eps, positions, inv_freq, neox=neox,
                                                scale=scale), magnitude, neox)

    def residual_norm(self, x, f, post_weight, weight, eps):
        return kernels.residual_rms_norm(x, f, post_weight, weight, eps)

    @staticmethod
    def gated(gate, up, act, *, overwrite=False):
        if act in GATED:  # gated functions without a kernel (swiglu_oai): torch
            return TorchOps.gated(gate, up, act)
        return kernels.gated_act(gate, up, act=act)

    def self_attention(self, q, k, v, q_norm, k_norm, eps, angles, cache, pos, positions, *,
                       head_dim, neox, scale, softcap=None, norm_after_rope=False, sinks=None):
        """One token: two launches, :func:`localllm.kernels.norm_rope_kv` (QK-norm, RoPE and
        the cache write) then :func:`localllm.kernels.decode_attention` (attention sinks,
        gpt-oss's, included)."""
        rope_pos, inv_freq, rope_scale, magnitude = angles
        # a quantized cache (-ctk/-ctv): its rows are written by the block quantizers, so
        # the torch QK-norm and RoPE, then :meth:`attention` (the kernel reads q8_0 blocks)
        if q.shape[0] != 1 or magnitude is not None or norm_after_rope or cache.quantized:
            return super().self_attention(q, k, v, q_norm, k_norm, eps, angles, cache, pos,
                                          positions, head_dim=head_dim, neox=neox, scale=scale,
                                          softcap=softcap, norm_after_rope=norm_after_rope,
                                          sinks=sinks)
        q = q.reshape(1, -1, head_dim).transpose(0, 1)  # (nh, 1, hd)
        k = k.reshape(1, -1, head_dim).transpose(0, 1)  # (nkv, 1, hd)
        v = v.reshape(1, -1, head_dim).transpose(0, 1)
        q1 = kernels.norm_rope_kv(q, k, v, q_norm, k_norm, eps, rope_pos, inv_freq, cache.k,
                                  cache.v, cache.positions, neox=neox, scale=rope_scale)
        keys, values, k_pos = (cache.written_static() if isinstance(pos, torch.Tensor)
                               else cache.written(pos))
        return kernels.decode_attention(q1, keys, values, positions, k_positions=k_pos,
                                window=cache.window, chunk=cache.chunk, scale=scale,
                                softcap=softcap, sinks=sinks)

    def mla_attention(self, q_nope, q_pe, latent, k_b, v_b, cache, pos, positions, *, scale):
        """One token: the latent written, then one :func:`localllm.kernels.mla_decode`
        launch over the latent cache (every head); prefill: the torch form."""
        if q_nope.shape[1] != 1:
            return super().mla_attention(q_nope, q_pe, latent, k_b, v_b, cache, pos, positions,
                                         scale=scale)
        cached = (cache.update_static(pos, latent) if isinstance(pos, torch.Tensor)
                  else cache.update(pos, latent))
        q = torch.cat([self.per_head(q_nope, k_b), q_pe], dim=-1)[:, 0]
        o = kernels.mla_decode(q, cached, positions, k_b.shape[1], scale)  # (H, r)
        return self.per_head(o[:, None], v_b).reshape(1, -1)

    @staticmethod
    def short_conv(x, weight, bias, state, *, silu):
        return kernels.short_conv(x, weight, bias, state, silu=silu)

    @staticmethod
    def ssm_scan(x, dt, dt_bias, a, b, c, d, state):
        return kernels.ssm_scan(x, dt, dt_bias, a, b, c, d, state)

    @staticmethod
    def gated_delta_net(qkv, alpha, beta_logit, dt_bias, a, state, *, n_k_heads, eps,
                        interleave):
        return kernels.gated_delta_net(qkv, alpha, beta_logit, dt_bias, a, state,
                                       n_k_heads=n_k_heads, eps=eps, interleave=interleave)

    def attention(self, q, k, v, cache, pos, positions, *, scale: float,
                  softcap: float | None = None, sinks: torch.Tensor | None = None
                  ) -> torch.Tensor:
        """Prefill: SDPA (sinks as one more key, see :func:`prefill_attention`); a decode
        token: the flash-decoding kernel (sinks included), which reads q8_0 cache blocks
        directly; other quantized caches and quantized prefill:
        :func:`~localllm.backends.dense.attend`."""
        # SDPA has no soft-capping
        if ((cache.quantized and not (q.shape[1] == 1 and kernel_reads(cache)))
                or (softcap is not None and q.shape[1] != 1)):
            return super().attention(q, k, v, cache, pos, positions, scale=scale,
                                     softcap=softcap, sinks=sinks)
        keys, values, k_pos = store_kv(cache, pos, k, v)
        if q.shape[1] != 1:
            return prefill_attention(q, keys, values, positions, k_pos, window=cache.window,
                                     scale=scale, sinks=sinks, chunk=cache.chunk)
        return kernels.decode_attention(q[:, 0], _stored(keys), _stored(values), positions,
                                        k_positions=k_pos, window=cache.window,
                                        chunk=cache.chunk, scale=scale, softcap=softcap,
                                        sinks=sinks)


# The cache types the decode kernel reads (llama.cpp's names): q8_0 blocks dequantized in
# the kernel, and the float types.
KERNEL_CACHE_TYPES = ("f32", "f16", "q8_0")


def kernel_reads(cache) -> bool:
    """Whether :func:`localllm.kernels.decode_attention` reads ``cache``'s K and V as
    stored: each of :data:`KERNEL_CACHE_TYPES`, and not float32 with float16."""
    types = (cache.type_k, cache.type_v)
    return (all(t.name in KERNEL_CACHE_TYPES for t in types)
            and len({t.name for t in types if not t.quantized}) <= 1)


def _stored(x):
    """A cache view as the kernel takes it: a float tensor, or the uint8 blocks of
    :class:`~localllm.memory.BlockRows`."""
    return x.data if isinstance(x, BlockRows) else x


def _magnified(x: torch.Tensor, magnitude: torch.Tensor | None, neox: bool) -> torch.Tensor:
    """x (..., head_dim) rotated, times the per-pair ``magnitude`` (head_dim/2,) of its angles
    (see ``TorchOps.rope_angles``): the kernels rotate by unit cos and sin."""
    if magnitude is None:
        return x
    m = torch.cat([magnitude, magnitude]) if neox else magnitude.repeat_interleave(2)
    return x * m
