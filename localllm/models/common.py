"""Building blocks shared by the architectures: weights, linear layers, norms, RoPE, attention.

Compute convention on the CPU: weights are dequantized once at load to float16 (half the
memory of float32, and torch's float16 GEMV is several times faster than float32 here);
the residual stream, norms and attention run in float32. A matrix product with one or a
few rows (decode) multiplies in float16; with many rows (prefill) the weight is upcast to
float32 for the product, where torch's float32 GEMM is much faster than its float16 one.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..gguf.file import GGUFFile
from ..gguf.quants import dequantize
from ..gguf.validate import check_tensor_shape
from .cache import attention_mask

# Above this many rows a CPU product takes the float32 GEMM path (see the module docstring).
GEMV_MAX_ROWS = 8


class Weights:
    """Loads tensors of a GGUF file by name, dequantized, checked against expected shapes.

    Args:
        gguf: the opened file.
        device: torch device for the weights.
        dtype: storage dtype of matrices (float16 on CPU); vectors (norms, biases) are float32.
        progress: called with the number of bytes of each tensor loaded.
    """

    def __init__(
        self,
        gguf: GGUFFile,
        device,
        dtype,
        progress: Callable[[int], None] | None = None,
        *,
        quantized: bool = False,
        native: bool = False,
    ):
        self.gguf, self.device, self.dtype = gguf, device, dtype
        self.progress = progress or (lambda n: None)
        # Keep matrices in their ggml blocks and multiply with the Triton kernels (CUDA).
        self.quantized = quantized
        # Keep matrices in their ggml blocks and multiply with the native CPU kernels.
        self.native = native
        self.fallbacks: list[str] = []  # tensors without a kernel, dequantized instead

    def has(self, name: str) -> bool:
        return name in self.gguf.tensors

    def get(self, name: str, shape: tuple[int, ...], *, dtype=None) -> torch.Tensor:
        """Tensor ``name`` dequantized to ``dtype`` with torch shape ``shape``.

        Raises:
            GGUFError: the tensor is missing or its shape contradicts the hyperparameters.
        """
        info = self.gguf.tensor(name)
        check_tensor_shape(name, shape, info.shape, self.gguf.path.name)
        if dtype is None:
            dtype = self.dtype if len(shape) > 1 else torch.float32
        try:
            out = dequantize(info.data, info.qtype, info.shape, dtype=dtype)
        except UnsupportedError:
            raise UnsupportedError(
                f"{self.gguf.path.name}: tensor {name!r} has type {info.qtype.name}, "
                "which localllm cannot dequantize"
            ) from None
        self.progress(info.n_bytes)
        return out.to(self.device)


    def _quant(self, name: str, shape: tuple[int, int]):
        """The tensor as a ``QuantWeight`` on the device, or None without a kernel for its type."""
        from localllm.kernels import QuantWeight, supports

        info = self.gguf.tensor(name)
        check_tensor_shape(name, shape, info.shape, self.gguf.path.name)
        if not supports(info.qtype):
            self.fallbacks.append(f"{name} ({info.qtype.name})")
            return None
        self.progress(info.n_bytes)
        return QuantWeight.from_bytes(info.data.copy(), info.qtype, shape).to(self.device)

    # --- Native CPU kernels (localllm.cpu, issue #17): the one dispatch point. ---------------
    # With ``native``, linear/fused/embedding wrap the file's blocks (no copy) in
    # localllm.cpu's layers; matrices without a native kernel take the dequantized path.
    def _native(self, name: str, shape: tuple[int, int]):
        """The matrix as a ``localllm.cpu.PackedWeight`` viewing the file, or None."""
        from ..cpu import PackedWeight, supports

        info = self.gguf.tensor(name)
        check_tensor_shape(name, shape, info.shape, self.gguf.path.name)
        if not supports(info.qtype, shape[1]):
            self.fallbacks.append(f"{name} ({info.qtype.name})")
            return None
        self.progress(info.n_bytes)
        return PackedWeight.from_bytes(info.data, info.qtype, shape)

    def _native_layer(self, name: str, shape: tuple[int, int], bias, *, embedding=False):
        """A ``localllm.cpu`` layer for tensor ``name``, or None (see :meth:`_native`).
        Prefill multiplies in bfloat16 where the CPU has it, unless float32 was asked for."""
        from ..cpu import NativeEmbedding, NativeLinear, bf16_gemm

        packed = self._native(name, shape)
        if packed is None:
            return None
        fast = self.dtype != torch.float32 and bf16_gemm()
        dt = torch.bfloat16 if fast else torch.float32
        return (NativeEmbedding(packed, prefill_dtype=dt) if embedding
                else NativeLinear(packed, bias, prefill_dtype=dt))
    # --- end of the native CPU dispatch point. -------------------------------------------

    def linear(self, name: str, shape: tuple[int, int], bias: str | None = None):
        """A projection by tensor ``name`` (out, in): quantized when the weights stay so."""
        b = self.get(bias, (shape[0],)) if bias and self.has(bias) else None
        if self.native and (layer := self._native_layer(name, shape, b)) is not None:
            return layer
        if self.quantized:
            q = self._quant(name, shape)
            if q is not None:
                return QuantLinear(q, b)
        return Linear(self.get(name, shape), b)

    def fused(self, specs: list[tuple[str, tuple[int, int]]], biases: list[str | None] | None = None):
        """Projections of one input (Q/K/V, gate/up) as one product where the types allow."""
        biases = biases or [None] * len(specs)
        if self.native:
            from ..cpu import NativeFusedLinear, NativeLinear

            parts = [self.linear(n, s, b) for (n, s), b in zip(specs, biases)]
            if all(isinstance(p, NativeLinear) for p in parts):
                return NativeFusedLinear(parts)
            return SeparateLinears(parts)
        if self.quantized:
            parts = [self.linear(n, s, b) for (n, s), b in zip(specs, biases)]
            if all(isinstance(p, QuantLinear) for p in parts):
                return FusedQuantLinear(parts)
            return SeparateLinears(parts)
        bias_vecs = [self.get(b, (s[0],)) if b and self.has(b) else None
                     for (_, s), b in zip(specs, biases)]
        return FusedLinear([self.get(n, s) for n, s in specs], bias_vecs)

    def embedding(self, name: str, shape: tuple[int, int]):
        """The token embedding table (n_vocab, d), also usable as a tied output projection."""
        if self.native and (layer := self._native_layer(name, shape, None, embedding=True)):
            return layer
        if self.quantized:
            q = self._quant(name, shape)
            if q is not None:
                return QuantEmbedding(q)
        return Embedding(self.get(name, shape))


class Linear:
    """``y = x @ W.T (+ b)`` for a weight of shape (out_features, in_features)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # (out, in), float16 on CPU
        self.bias = bias  # (out,) float32 or None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in) float32 -> (T, out) float32."""
        w = self.weight
        if x.shape[0] <= GEMV_MAX_ROWS or w.device.type != "cpu":
            y = F.linear(x.to(w.dtype), w).float()
        else:
            y = F.linear(x, w.float())
        return y if self.bias is None else y + self.bias


def cat_biases(biases: list[torch.Tensor | None], sizes: list[int], device) -> torch.Tensor | None:
    """The biases of fused projections as one vector (zeros where one has none), or None."""
    if not any(b is not None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(n, device=device)
                      for b, n in zip(biases, sizes)])


class FusedLinear:
    """Several projections of the same input in one product (Q/K/V, gate/up).

    One larger matrix product costs less than several small ones, above all in decode.
    Returns the outputs as a tuple, in the order of ``weights``.
    """

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None = None):
        self.sizes = [w.shape[0] for w in weights]
        bias = cat_biases(biases or [None] * len(weights), self.sizes, weights[0].device)
        self.linear = Linear(torch.cat(weights), bias)

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x: (T, in) -> one (T, out_i) tensor per weight."""
        return self.linear(x).split(self.sizes, dim=-1)


class SeparateLinears:
    """Projections of one input that cannot share a product (different quant types)."""

    def __init__(self, parts: list) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p(x) for p in self.parts)


class QuantLinear:
    """``y = x @ W.T (+ b)`` reading W in its ggml blocks (Triton GEMV / GEMM kernels)."""

    def __init__(self, weight, bias: torch.Tensor | None = None) -> None:
        self.weight = weight  # localllm.kernels.QuantWeight (out, in)
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in) float32 -> (T, out) float32 (GEMV in float32, GEMM with fp16 tiles)."""
        from localllm.kernels import GEMV_MAX_ROWS as KERNEL_GEMV_ROWS
        from localllm.kernels import quant_linear

        xin = x if x.shape[0] <= KERNEL_GEMV_ROWS else x.half()
        y = quant_linear(xin, self.weight, out_dtype=torch.float32)
        return y if self.bias is None else y + self.bias


class FusedQuantLinear(QuantLinear):
    """Quantized projections of one input with one type, fused into one kernel launch."""

    def __init__(self, parts: list[QuantLinear]) -> None:
        from localllm.kernels import QuantWeight

        self.sizes = [p.weight.shape[0] for p in parts]
        fused = QuantWeight.cat([p.weight for p in parts])
        # One output tensor (no per-part splits in the kernel call); split after the bias.
        super().__init__(QuantWeight(fused.data, fused.qtype, fused.shape),
                         cat_biases([p.bias for p in parts], self.sizes, fused.data.device))

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().__call__(x).split(self.sizes, dim=-1)


class Embedding:
    """A dequantized embedding table (n_vocab, d); ``head`` is the tied output projection."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        self.head = Linear(table)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (T,) int64 -> (T, d) float32."""
        return self.table[tokens].float()


class QuantEmbedding:
    """An embedding table kept in ggml blocks: rows are dequantized when looked up."""

    def __init__(self, weight) -> None:
        self.weight = weight  # QuantWeight (n_vocab, d)
        self.head = QuantLinear(weight)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        rows = self.weight.data[tokens]  # (T, row_bytes) uint8
        return dequantize(rows, self.weight.qtype, (tokens.shape[0], self.weight.shape[1]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (Zhang & Sennrich 2019), float32: x / rms(x) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_inv_freq(
    head_dim: int, base: float, freq_factors: torch.Tensor | None = None, device=None
) -> torch.Tensor:
    """RoPE inverse frequencies (head_dim/2,) float32: base^(-2i/d) / factor_i.

    ``freq_factors`` is llama.cpp's ``rope_freqs.weight`` (Llama 3.1 long-context scaling).
    """
    inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim))
    return inv if freq_factors is None else inv / freq_factors.to(inv.device)


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the RoPE angles, each (T, head_dim/2) float32; computed once per forward
    and shared by the layers that use the same frequencies. ``scale`` multiplies positions
    (linear RoPE scaling: 1 / factor)."""
    angles = (positions.float() * scale)[:, None] * inv_freq[None, :]
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], *, neox: bool):
    """Rotary position embedding (Su et al. 2021) on x: (n_heads, T, head_dim) float32.

    ``neox``: rotate the two halves of each head (GPT-NeoX, llama.cpp's LLAMA_ROPE_TYPE_NEOX);
    otherwise rotate adjacent pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM).
    """
    cos, sin = cos_sin
    if neox:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, neox: bool, scale: float = 1.0
) -> torch.Tensor:
    """:func:`rotate` by the angles of ``positions`` (see :func:`rope_angles`)."""
    return rotate(x, rope_angles(positions, inv_freq, scale), neox=neox)


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor | None,
    *,
    window: int | None,
    scale: float,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads (GQA), float32.

    q: (n_heads, T, hd); keys/values: (n_kv_heads, S, hd) float32 or float16;
    k_positions: (S,) int64 absolute positions (-1: empty slot), or None when slot ``j``
    holds position ``j`` -> (T, n_heads * hd) float32.
    Query head h reads KV head h // (n_heads / n_kv_heads), as llama.cpp does. The heads of a
    group are stacked into one product instead of repeating K/V: in decode this is several
    times faster on the CPU than torch's SDPA with a mask.
    """
    n_heads, t, hd = q.shape
    n_kv = keys.shape[0]
    group = n_heads // n_kv
    mask = attention_mask(q_positions, keys.shape[1] if k_positions is None else k_positions,
                          window)  # (T, S)
    qg = q.reshape(n_kv, group * t, hd)  # (nkv, g*T, hd)
    scores = torch.matmul(qg, keys.float().transpose(1, 2)) * scale  # (nkv, g*T, S)
    scores = scores.view(n_kv, group, t, -1).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(n_kv, group * t, -1)
    out = torch.matmul(probs, values.float())  # (nkv, g*T, hd)
    return out.view(n_heads, t, hd).transpose(0, 1).reshape(t, n_heads * hd)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016), as Gemma's FFN uses it."""
    return F.gelu(x, approximate="tanh")


# Gate activations of gated FFNs (GEGLU, SwiGLU: Shazeer 2020) by name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": gelu_tanh,
    "silu": F.silu,
}


class TorchOps:
    """Norms, RoPE, activations and attention as torch operations: the torch backend, on
    every device.

    A model calls ``ops.rope_angles`` once per forward (the result is opaque to the model),
    then per layer ``ops.norm_rope`` for queries and keys, ``ops.attention``,
    ``ops.residual_norm`` after each sublayer and ``ops.gated`` in the FFN.
    :class:`KernelOps` computes the same with the Triton kernels, fusing each of these into
    one launch.
    """

    rms_norm = staticmethod(rms_norm)
    rope_angles = staticmethod(rope_angles)
    rotate = staticmethod(rotate)

    def norm_rope(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, angles, *,
                  neox: bool) -> torch.Tensor:
        """RoPE of RMSNorm(x) (QK-norm), or of x when ``weight`` is None; x (H, T, D)."""
        if weight is not None:
            x = self.rms_norm(x, weight, eps)
        return self.rotate(x, angles, neox=neox)

    def residual_norm(self, x: torch.Tensor, f: torch.Tensor, post_weight: torch.Tensor | None,
                      weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the next pre-norm: h = x + f (f post-normed by
        ``post_weight`` when given, as Gemma does) and RMSNorm(h); (T, D) each."""
        h = x + (f if post_weight is None else self.rms_norm(f, post_weight, eps))
        return h, self.rms_norm(h, weight, eps)

    @staticmethod
    def gated(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
        """act(gate) * up (T, F), ``act`` a key of :data:`ACTIVATIONS`."""
        return ACTIVATIONS[act](gate) * up

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache,
        pos: int | torch.Tensor,
        positions: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Store the new keys/values in ``cache`` and attend the new queries over it.

        q: (n_heads, T, hd), k/v: (n_kv_heads, T, hd) float32 at ``positions`` (T,) int64, the
        first of which is ``pos`` (an int, or a (1,) device tensor in static decode: see
        :mod:`localllm.models.cache`) -> (T, n_heads * hd) float32.
        """
        keys, values, k_pos = cache.update(pos, k, v)
        return attend(q, keys, values, positions, k_pos, window=cache.window, scale=scale)


class KernelOps(TorchOps):
    """The Triton kernels (the quantized backend): QK-norm with RoPE, residual add with the
    next pre-norm, and the gated activation each in one launch instead of several torch
    kernels (:mod:`localllm.kernels.fused`), and flash-decoding attention for one-token steps
    (:func:`localllm.kernels.decode_attention`), which reads only the visible part of a full
    cache. Prefill attention stays :func:`attend`."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        from localllm.kernels import rms_norm as kernel_rms_norm

        return kernel_rms_norm(x, weight, eps)

    @staticmethod
    def rope_angles(positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0):
        return positions, inv_freq, scale  # the kernel computes the angles itself

    @staticmethod
    def rotate(x: torch.Tensor, angles, *, neox: bool) -> torch.Tensor:
        from localllm.kernels import rope

        positions, inv_freq, scale = angles
        return rope(x, positions, inv_freq, neox=neox, scale=scale)

    def norm_rope(self, x, weight, eps, angles, *, neox):
        from localllm.kernels import rms_norm_rope

        positions, inv_freq, scale = angles
        return rms_norm_rope(x, weight, eps, positions, inv_freq, neox=neox, scale=scale)

    def residual_norm(self, x, f, post_weight, weight, eps):
        from localllm.kernels import residual_rms_norm

        return residual_rms_norm(x, f, post_weight, weight, eps)

    @staticmethod
    def gated(gate, up, act):
        from localllm.kernels import gated_act

        return gated_act(gate, up, act=act)

    def attention(self, q, k, v, cache, pos, positions, *, scale: float) -> torch.Tensor:
        if q.shape[1] != 1:
            return super().attention(q, k, v, cache, pos, positions, scale=scale)
        from localllm.kernels import decode_attention

        keys, values, k_pos = cache.update(pos, k, v)
        return decode_attention(q[:, 0], keys, values, positions, k_positions=k_pos,
                                window=cache.window, scale=scale)


def model_ops(w: Weights) -> TorchOps:
    """The kernels when the weights stay quantized (Triton backend), else torch."""
    return KernelOps() if w.quantized else TorchOps()


def positions_of(pos: int | torch.Tensor, t: int, device) -> torch.Tensor:
    """Absolute positions (T,) int64 of ``t`` tokens starting at ``pos`` (int or (1,) tensor)."""
    if isinstance(pos, torch.Tensor):
        if t != 1:
            raise ValueError("a position held in a tensor (static decode) takes one token")
        return pos
    return torch.arange(pos, pos + t, device=device)


def default_attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
