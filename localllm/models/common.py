"""Building blocks shared by the architectures: weights, linear layers, norms, RoPE, attention.

Compute convention on the CPU: weights are dequantized once at load to float16 (half the
memory of float32, and torch's float16 GEMV is several times faster than float32 here);
the residual stream, norms and attention run in float32. A matrix product with one or a
few rows (decode) multiplies in float16; with many rows (prefill) the weight is upcast to
float32 for the product, where torch's float32 GEMM is much faster than its float16 one.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import ClassVar

import torch
import torch.nn.functional as F

from ..errors import UnsupportedError
from ..gguf.file import GGUFFile
from ..gguf.quants import dequantize
from .cache import attention_mask

# Above this many rows a CPU product takes the float32 GEMM path (see the module docstring).
GEMV_MAX_ROWS = 8


class Loader:
    """Reads tensors of a GGUF file for :func:`localllm.models.base.bind`.

    Args:
        gguf: the opened file (tensor shapes already checked by ``base.check_tensors``).
        device: torch device for the weights.
        dtype: dtype of dequantized matrices (float16 on CPU); vectors are float32.
        quantized: keep matrices in their ggml blocks (Triton kernels) where a kernel exists.
        native: keep matrices in their ggml blocks, viewing the file without a copy, for the
            native CPU kernels (:mod:`localllm.cpu`) where a kernel exists.
        progress: called with the number of bytes of each tensor loaded.
    """

    def __init__(self, gguf: GGUFFile, device, dtype, *, quantized: bool = False,
                 native: bool = False, progress: Callable[[int], None] | None = None) -> None:
        self.gguf, self.device, self.dtype, self.quantized = gguf, device, dtype, quantized
        self.native = native  # CPU: matrices stay in their ggml blocks (localllm.cpu kernels)
        self.progress = progress or (lambda n: None)
        self.fallbacks: list[str] = []  # tensors without a kernel, dequantized instead

    def dense(self, name: str, dtype=None) -> torch.Tensor:
        """Tensor ``name`` dequantized (``dtype``: default ``self.dtype`` for matrices,
        float32 for vectors), in torch shape order, on the device.

        Raises:
            UnsupportedError: its quant type has no dequantizer.
        """
        info = self.gguf.tensor(name)
        if dtype is None:
            dtype = self.dtype if len(info.shape) > 1 else torch.float32
        try:
            out = dequantize(info.data, info.qtype, info.shape, dtype=dtype)
        except UnsupportedError:
            raise UnsupportedError(
                f"{self.gguf.path.name}: tensor {name!r} has type {info.qtype.name}, "
                "which localllm cannot dequantize"
            ) from None
        self.progress(info.n_bytes)
        return out.to(self.device)

    def _packed(self, data, qtype, shape):
        """A ``localllm.cpu.PackedWeight`` over ``data`` (no copy), or None without a native
        kernel for the type or shape. Prefill multiplies in bfloat16 where the CPU has it and
        decode quantizes activations to int8 where the CPU has AVX2, unless float32 matrices
        were asked for (exact checks)."""
        from ..cpu import PackedWeight, bf16_gemm, supports

        if not supports(qtype, shape[1]):
            return None
        exact = self.dtype == torch.float32
        return PackedWeight.from_bytes(
            data, qtype, shape, q8=not exact,
            prefill_dtype=torch.bfloat16 if not exact and bf16_gemm() else torch.float32)

    def matrix(self, name: str):
        """A 2-D weight (out, in) as stored for :class:`Linear`: a ``QuantWeight`` in its ggml
        blocks when quantized and a kernel exists for its type, a ``localllm.cpu.PackedWeight``
        viewing the file when native, else a dense tensor."""
        if self.native:
            info = self.gguf.tensor(name)
            packed = self._packed(info.data, info.qtype, info.shape)
            if packed is not None:
                self.progress(info.n_bytes)
                return packed
            self.fallbacks.append(f"{name} ({info.qtype.name})")
        if self.quantized:
            from localllm.kernels import QuantWeight, supports

            info = self.gguf.tensor(name)
            if supports(info.qtype):
                self.progress(info.n_bytes)
                # aligned(): repacked on the device into 16-byte aligned planes where the
                # blocks are not (bit-exact; replaces the copy, no second one is kept)
                return QuantWeight.from_bytes(info.data.copy(), info.qtype,
                                              info.shape).to(self.device).aligned()
            self.fallbacks.append(f"{name} ({info.qtype.name})")
        return self.dense(name)

    def experts(self, name: str) -> Experts:
        """A 3-D expert tensor (n_expert, out, in): one matrix per expert."""
        info = self.gguf.tensor(name)
        n_exp, rows, cols = info.shape
        if self.native:
            stacked = self._packed(info.data, info.qtype, (n_exp * rows, cols))
            if stacked is not None:
                self.progress(info.n_bytes)
                per = info.n_bytes // n_exp
                return Experts([dataclasses.replace(stacked, data=stacked.data[e * per:(e + 1) * per],
                                                    shape=(rows, cols)) for e in range(n_exp)],
                               stacked)
            self.fallbacks.append(f"{name} ({info.qtype.name})")
        if self.quantized:
            from localllm.kernels import QuantWeight, supports

            if supports(info.qtype):
                per = info.n_bytes // n_exp
                self.progress(info.n_bytes)
                return Experts([QuantWeight.from_bytes(info.data[e * per:(e + 1) * per].copy(),
                                                       info.qtype, (rows, cols)).to(self.device)
                                .aligned() for e in range(n_exp)])
            self.fallbacks.append(f"{name} ({info.qtype.name})")
        return Experts(list(self.dense(name).unbind(0)))


def matmul(x: torch.Tensor, w, *, bf16: bool = False) -> torch.Tensor:
    """x @ w.T for a weight (out, in): the one place a matrix product is dispatched.

    ``w`` is a dense tensor (float16 on CPU: GEMV in float16 for few rows, float32 GEMM for
    many, see the module docstring), a ``localllm.cpu.PackedWeight`` (native CPU kernels:
    GEMV from the blocks, tiled dequant + GEMM for prefill) or a
    ``localllm.kernels.QuantWeight`` (Triton dequant GEMV / GEMM). x: (T, in) float32 -> (T, out) float32.
    ``bf16``: the Triton GEMM (prefill) multiplies in bfloat16 instead of float16, for
    activations beyond float16's range (65504; Gemma's, see :func:`prefill_in_bf16`).
    """
    if isinstance(w, torch.Tensor):
        if x.shape[0] <= GEMV_MAX_ROWS or w.device.type != "cpu":
            return F.linear(x.to(w.dtype), w).float()
        return F.linear(x, w.float())
    from ..cpu import PackedWeight, qmatmul

    if isinstance(w, PackedWeight):  # the native CPU kernels (localllm.cpu)
        return qmatmul(x, w, prefill_dtype=w.prefill_dtype)
    from localllm.kernels import GEMV_MAX_ROWS as KERNEL_GEMV_ROWS
    from localllm.kernels import quant_linear

    if x.shape[0] <= KERNEL_GEMV_ROWS:
        return quant_linear(x, w, out_dtype=torch.float32)
    # bfloat16: the kernel rounds the float32 tiles it loads (no float16 copy to overflow).
    return quant_linear(x if bf16 else x.half(), w, out_dtype=torch.float32, bf16=bf16)


class Linear:
    """``y = x @ W.T (+ b)`` for a weight (out_features, in_features), dense or quantized.

    With ``sizes`` the weight holds several projections of the same input stacked by rows
    (fused Q/K/V or gate/up, see :func:`fuse`) and the call returns one output per part.
    ``bf16``: prefill products in bfloat16 (see :func:`matmul`).
    """

    bf16 = False

    def __init__(self, weight, bias: torch.Tensor | None = None,
                 sizes: list[int] | None = None) -> None:
        self.weight = weight  # torch.Tensor (out, in) or kernels.QuantWeight
        self.bias = bias  # (out,) float32 or None
        self.sizes = sizes

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def __call__(self, x: torch.Tensor):
        """x: (T, in) float32 -> (T, out) float32, or a tuple of (T, out_i) with ``sizes``."""
        y = matmul(x, self.weight, bf16=self.bf16)
        if self.bias is not None:
            y = y + self.bias
        return y if self.sizes is None else y.split(self.sizes, dim=-1)


class Split:
    """Projections of one input that cannot share a product (different quant types)."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p(x) for p in self.parts)


def cat_biases(biases: list[torch.Tensor | None], sizes: list[int], device) -> torch.Tensor | None:
    """The biases of fused projections as one vector (zeros where one has none), or None."""
    if not any(b is not None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(n, device=device)
                      for b, n in zip(biases, sizes)])


def fuse(parts: list[Linear]) -> Linear | Split:
    """One :class:`Linear` for projections of one input when their weights can be stacked
    (all dense, or all quantized with one type), else a :class:`Split`; both return one
    output per part. One larger product costs less than several, above all in decode."""
    sizes = [p.out_features for p in parts]
    ws = [p.weight for p in parts]
    device = ws[0].device if isinstance(ws[0], torch.Tensor) else ws[0].data.device
    bias = cat_biases([p.bias for p in parts], sizes, device)
    if all(isinstance(w, torch.Tensor) for w in ws) and len({w.dtype for w in ws}) == 1:
        return Linear(torch.cat(ws), bias, sizes)
    if any(type(w).__name__ == "PackedWeight" for w in ws):
        return Split(parts)  # native: each part read from the file's own blocks, no copy
    if not any(isinstance(w, torch.Tensor) for w in ws) and len({w.qtype for w in ws}) == 1:
        from localllm.kernels import QuantWeight

        fused = QuantWeight.cat(ws)
        # One output tensor (no per-part splits in the kernel call); split after the bias.
        return Linear(QuantWeight(fused.data, fused.qtype, fused.shape, layout=fused.layout),
                      bias, sizes)
    return Split(parts)


def prefill_in_bf16(model) -> None:
    """Make the prefill products of ``model``'s matrices (its own and its layers'
    :class:`Linear` and :class:`Split` attributes, the tied head included) run in bfloat16:
    for models whose activations can outgrow float16's 65504 (Gemma: the gated FFN product,
    the input of ``ffn_down``, is not normalized)."""
    for obj in [model, *getattr(model, "layers", [])]:
        for v in vars(obj).values():
            parts = v.parts if isinstance(v, Split) else [v.head] if isinstance(v, Embedding) \
                else [v]  # fmt: skip
            for lin in parts:
                if isinstance(lin, Linear):
                    lin.bf16 = True


class Experts:
    """The matrices of a mixture-of-experts layer (llama.cpp's ``ffn_*_exps``), one per expert,
    each (out, in) dense or quantized: a product reads only the experts a token selected."""

    def __init__(self, weights: list, stacked=None) -> None:
        self.weights = weights
        # native CPU: all experts as one localllm.cpu.PackedWeight (n_expert * out, in)
        self.stacked = stacked

    def __call__(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x: (T, in) float32 through expert ``e`` -> (T, out) float32."""
        return matmul(x, self.weights[e])


class Embedding:
    """The token embedding table (n_vocab, d), dense or in ggml blocks (rows dequantized when
    looked up); ``head`` is the tied output projection."""

    def __init__(self, weight) -> None:
        self.weight = weight
        self.head = Linear(weight)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (T,) int64 -> (T, d) float32."""
        w = self.weight
        if isinstance(w, torch.Tensor):
            return w[tokens].float()
        if hasattr(w, "rows"):  # cpu.PackedWeight, kernels.QuantWeight: rows dequantized
            return w.rows(tokens)
        rows = w.data[tokens]  # (T, row_bytes) uint8
        return dequantize(rows, w.qtype, (tokens.shape[0], w.shape[1]))


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


def yarn_rope(head_dim: int, base: float, factor: float, orig_context: int, *,
              beta_fast: float = 32.0, beta_slow: float = 1.0,
              ext_factor: float = 1.0) -> tuple[torch.Tensor, float]:
    """YaRN RoPE scaling (Peng et al. 2023, "YaRN: Efficient Context Window Extension"), as
    ggml's ``rope_yarn`` computes it (``ggml/src/ggml-cpu/ops.cpp``,
    ``ggml_rope_yarn_corr_dims``): the rotation angle of pair i at position p is
    ``p * inv_freq_i * m_i`` with ``m_i = (1 - r_i) / factor + r_i``, where the ramp ``r_i``
    (times ``ext_factor``) is 1 for the high-frequency pairs below the correction dimension of
    ``beta_fast`` rotations over ``orig_context`` tokens, 0 above that of ``beta_slow``, and
    linear between; cos and sin are multiplied by ``mscale = 1 + 0.1 ln(factor)`` (when
    ``ext_factor`` is not 0).

    Returns:
        (divisors (head_dim/2,) float32 to divide ``inv_freq`` by, as ``rope_freqs`` factors
        are, i.e. 1 / m_i; mscale). Multiplying cos and sin by mscale equals scaling the
        attention scores by mscale**2, which is how the architectures apply it.
    """
    def corr_dim(n_rot: float) -> float:
        return head_dim * math.log(orig_context / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(0.0, math.floor(corr_dim(beta_fast)))
    high = min(head_dim - 1.0, math.ceil(corr_dim(beta_slow)))
    i = torch.arange(head_dim // 2, dtype=torch.float32)
    ramp = 1.0 - ((i - low) / max(0.001, high - low)).clamp(0.0, 1.0)
    mix = ramp * ext_factor
    m = (1.0 - mix) / factor + mix
    mscale = 1.0 + 0.1 * math.log(factor) if ext_factor != 0.0 else 1.0
    return 1.0 / m, mscale


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


# Scores of at most this many bytes at a time in :func:`attend` (prefill's working set).
ATTEND_CHUNK_BYTES = 2 << 20


def score_blocks(n_kv: int, group: int, t: int, s: int) -> Iterator[tuple[int, int, int, int]]:
    """The blocks :func:`attend` computes the (n_kv, group * t, s) float32 scores in:
    ``(h0, h1, r0, r1)``, KV heads h0..h1 and query rows r0..r1 of their groups, each block
    at most :data:`ATTEND_CHUNK_BYTES` (at least one row). Whole KV heads while one fits,
    else whole queries of a group (multiples of ``t`` rows), else part of one query head's
    rows; every row of every head once, in order."""
    rows = max(1, ATTEND_CHUNK_BYTES // (4 * s))  # score rows per block
    gt = group * t
    if rows >= gt:
        step = rows // gt
        for h0 in range(0, n_kv, step):
            yield h0, min(n_kv, h0 + step), 0, gt
        return
    span = rows // t * t if rows >= t else rows
    ends = range(span, gt + span, span) if rows >= t else \
        [min(m + t, r + span) for m in range(0, gt, t) for r in range(m, m + t, span)]
    for h in range(n_kv):
        r0 = 0
        for r1 in ends:
            r1 = min(r1, gt)
            yield h, h + 1, r0, r1
            r0 = r1


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor | None,
    *,
    window: int | None,
    scale: float,
    softcap: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads (GQA), float32.

    q: (n_heads, T, hd); keys/values: (n_kv_heads, S, hd) float32 or float16;
    k_positions: (S,) int64 absolute positions (-1: empty slot), or None when slot ``j``
    holds position ``j`` -> (T, n_heads * hd) float32.
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2's
    ``attn_logit_softcapping``, llama.cpp's ``hparams.attn_soft_cap``).
    Query head h reads KV head h // (n_heads / n_kv_heads), as llama.cpp does. The heads of a
    group are stacked into one product instead of repeating K/V: in decode this is several
    times faster on the CPU than torch's SDPA with a mask.
    """
    n_heads, t, hd = q.shape
    n_kv, s = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    mask = attention_mask(q_positions, s if k_positions is None else k_positions,
                          window)  # (T, S)
    qg = q.reshape(n_kv, group * t, hd)  # (nkv, g*T, hd)
    # A long prompt's scores are large (32 heads x 512 x 512 x 4 bytes = 32 MiB): computed
    # in place (softmax included) in blocks of at most ATTEND_CHUNK_BYTES (score_blocks), so
    # that prefill's working set stays small; each row's result is the same either way.
    out = torch.empty(n_kv, group * t, hd, dtype=torch.float32, device=q.device)
    hidden = ~mask
    for h0, h1, r0, r1 in score_blocks(n_kv, group, t, s):
        scores = torch.matmul(qg[h0:h1, r0:r1], keys[h0:h1].float().transpose(1, 2))
        scores.mul_(scale)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        if (r1 - r0) % t == 0:  # whole queries: r0 is a multiple of t too
            scores.view(h1 - h0, -1, t, s).masked_fill_(hidden, float("-inf"))
        else:  # part of one query head's rows
            scores.masked_fill_(hidden[r0 % t : r0 % t + r1 - r0], float("-inf"))
        torch.softmax(scores, dim=-1, out=scores)
        torch.matmul(scores, values[h0:h1].float(), out=out[h0:h1, r0:r1])  # (n, rows, hd)
        del scores
    return out.view(n_heads, t, hd).transpose(0, 1).reshape(t, n_heads * hd)


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      q_positions: torch.Tensor, k_positions: torch.Tensor | None, *,
                      window: int | None, scale: float) -> torch.Tensor:
    """:func:`attend` (no soft-capping) in the cache's dtype through torch's fused
    ``scaled_dot_product_attention`` (float16 on CUDA: its memory-efficient kernel, after
    Rabe & Staats 2021; float32 accumulation), with no float32 copies of the keys and values.

    q: (n_heads, T, hd) float32; keys/values: (n_kv_heads, S, hd) float16/float32 ->
    (T, n_heads * hd) float32. A query with no visible key gives NaN, as ``attend``.
    """
    n_heads, t, hd = q.shape
    n_kv = keys.shape[0]
    group = n_heads // n_kv
    dt = keys.dtype
    mask = attention_mask(q_positions, keys.shape[1] if k_positions is None else k_positions,
                          window)  # (T, S)
    # A KV group's query heads as one longer query sequence (as attend does): no repeated
    # K/V, and no enable_gqa, which with a mask sends SDPA to its quadratic math backend.
    qg = q.to(dt).reshape(n_kv, group * t, hd)
    out = F.scaled_dot_product_attention(qg[None], keys[None], values.to(dt)[None],
                                         attn_mask=mask.repeat(group, 1), scale=scale)
    return out[0].reshape(n_heads, t, hd).transpose(0, 1).reshape(t, n_heads * hd).float()


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
    then per layer ``ops.self_attention`` (QK-norm and RoPE of the projected queries and
    keys, the KV-cache write and attention), ``ops.residual_norm`` after each sublayer and
    ``ops.gated`` in the FFN. :class:`KernelOps` computes the same with the Triton kernels,
    fusing each of these into one launch (a decode token's ``self_attention``: two);
    :class:`NativeOps` with the native CPU kernels.
    """

    rms_norm = staticmethod(rms_norm)
    rope_angles = staticmethod(rope_angles)
    rotate = staticmethod(rotate)
    kv_half = False  # float16 KV caches on the CPU too (models.cache.kv_dtype)

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
    def gated(gate: torch.Tensor, up: torch.Tensor, act: str, *,
              overwrite: bool = False) -> torch.Tensor:
        """act(gate) * up (T, F), ``act`` a key of :data:`ACTIVATIONS`. ``overwrite``: the
        caller no longer needs ``gate``, and the result may be written over it (the native
        ops do: no buffer of its own; these return a new tensor)."""
        return ACTIVATIONS[act](gate) * up

    def self_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        angles,
        cache,
        pos: int | torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        neox: bool,
        scale: float,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """The attention of a layer from its projections: per-head RMSNorm of q and k by
        ``q_norm`` / ``k_norm`` when given (QK-norm), RoPE by ``angles`` (from
        :meth:`rope_angles`; ``neox``: halves, else adjacent pairs), then :meth:`attention`.

        q: (T, n_heads * head_dim), k/v: (T, n_kv_heads * head_dim) float32 (views with unit
        column stride) -> (T, n_heads * head_dim) float32.
        """
        t = q.shape[0]
        q = q.reshape(t, -1, head_dim).transpose(0, 1)  # (nh, T, hd)
        k = k.reshape(t, -1, head_dim).transpose(0, 1)  # (nkv, T, hd)
        v = v.reshape(t, -1, head_dim).transpose(0, 1)
        q = self.norm_rope(q, q_norm, eps, angles, neox=neox)
        k = self.norm_rope(k, k_norm, eps, angles, neox=neox)
        return self.attention(q, k, v, cache, pos, positions, scale=scale, softcap=softcap)

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
        softcap: float | None = None,
    ) -> torch.Tensor:
        """Store the new keys/values in ``cache`` and attend the new queries over it.

        q: (n_heads, T, hd), k/v: (n_kv_heads, T, hd) float32 at ``positions`` (T,) int64, the
        first of which is ``pos`` (an int, or a (1,) device tensor in static decode: see
        :mod:`localllm.models.cache`) -> (T, n_heads * hd) float32.
        """
        keys, values, k_pos = cache.update(pos, k, v)
        return attend(q, keys, values, positions, k_pos, window=cache.window, scale=scale,
                      softcap=softcap)


class KernelOps(TorchOps):
    """The Triton kernels (the quantized backend): QK-norm with RoPE, residual add with the
    next pre-norm, and the gated activation each in one launch instead of several torch
    kernels (:mod:`localllm.kernels.fused`), and flash-decoding attention for one-token steps
    (:func:`localllm.kernels.decode_attention`), which reads only the visible part of a
    cache; a decode token's QK-norm, RoPE and cache write are one more launch
    (:func:`localllm.kernels.norm_rope_kv`). Prefill attention is torch's fused SDPA in the
    cache's dtype (:func:`prefill_attention`), :func:`attend` only with soft-capping."""

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
    def gated(gate, up, act, *, overwrite=False):
        from localllm.kernels import gated_act

        return gated_act(gate, up, act=act)

    def self_attention(self, q, k, v, q_norm, k_norm, eps, angles, cache, pos, positions, *,
                       head_dim, neox, scale, softcap=None):
        """One token: two launches, :func:`localllm.kernels.norm_rope_kv` (QK-norm, RoPE and
        the cache write) then :func:`localllm.kernels.decode_attention`."""
        if q.shape[0] != 1 or not hasattr(cache, "written"):
            return super().self_attention(q, k, v, q_norm, k_norm, eps, angles, cache, pos,
                                          positions, head_dim=head_dim, neox=neox, scale=scale,
                                          softcap=softcap)
        from localllm.kernels import decode_attention, norm_rope_kv

        q = q.reshape(1, -1, head_dim).transpose(0, 1)  # (nh, 1, hd)
        k = k.reshape(1, -1, head_dim).transpose(0, 1)  # (nkv, 1, hd)
        v = v.reshape(1, -1, head_dim).transpose(0, 1)
        rope_pos, inv_freq, rope_scale = angles
        q1 = norm_rope_kv(q, k, v, q_norm, k_norm, eps, rope_pos, inv_freq, cache.k, cache.v,
                          getattr(cache, "positions", None), neox=neox, scale=rope_scale)
        keys, values, k_pos = cache.written(pos)
        return decode_attention(q1, keys, values, positions, k_positions=k_pos,
                                window=cache.window, scale=scale, softcap=softcap)

    def attention(self, q, k, v, cache, pos, positions, *, scale: float,
                  softcap: float | None = None) -> torch.Tensor:
        if q.shape[1] != 1 and softcap is not None:  # SDPA has no soft-capping
            return super().attention(q, k, v, cache, pos, positions, scale=scale,
                                     softcap=softcap)
        if q.shape[1] != 1:
            keys, values, k_pos = cache.update(pos, k, v)
            return prefill_attention(q, keys, values, positions, k_pos, window=cache.window,
                                     scale=scale)
        from localllm.kernels import decode_attention

        keys, values, k_pos = cache.update(pos, k, v)
        return decode_attention(q[:, 0], keys, values, positions, k_positions=k_pos,
                                window=cache.window, scale=scale, softcap=softcap)


class NativeOps(TorchOps):
    """The native CPU kernels (backend ``native``; ``localllm/cpu/csrc/ops.cpp``), float32:
    RMSNorm, the residual add with the next pre-norm (and Gemma's post-norm), QK-norm with
    RoPE, and the gated activation (SiLU, GELU-tanh) in one native call each, for any number
    of rows; the whole attention of a step of up to :attr:`FEW` tokens (QK-norm and RoPE of
    q and k, the KV-cache write, grouped-query attention over the live cells with the
    causal, window and soft-capping masks) in one call. Longer steps (prefill) attend with
    :func:`attend` (torch's batched products).

    Each agrees with the torch composition it replaces to float32 rounding (summation order;
    exp and tanh from the kernels' own polynomials): ``tests/test_cpu_ops.py``.
    """

    ACT: ClassVar[dict[str, int]] = {"silu": 0, "gelu_tanh": 1}  # the kernel's codes
    FEW = 8  # steps of up to this many tokens attend natively (decode, small batches)

    def __init__(self, *, kv_half: bool = True) -> None:
        """``kv_half``: float16 KV caches (llama.cpp's default type, half the memory), which
        the native step reads; False keeps them float32 (exact checks)."""
        from ..cpu import available

        if not available():
            raise UnsupportedError("the native CPU kernels are unavailable (no C++ compiler, "
                                   "or LOCALLLM_NATIVE_CPU=0)")
        ops = torch.ops.localllm_cpu
        self._rms_norm, self._residual_norm = ops.rms_norm.default, ops.residual_norm.default
        self._gated, self._norm_rope = ops.gated.default, ops.norm_rope.default
        self._attn_decode = ops.attn_decode.default
        self._no_positions = torch.empty(0, dtype=torch.long)
        self.kv_half = kv_half

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
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
        return self._gated(gate, up, self.ACT[act], gate if overwrite else None)

    def self_attention(self, q, k, v, q_norm, k_norm, eps, angles, cache, pos, positions, *,
                       head_dim, neox, scale, softcap=None):
        t = q.shape[0]
        where = None
        if t <= self.FEW and isinstance(pos, int) and cache.k.dtype in (torch.float32,
                                                                        torch.float16):
            where = cache.decode_slot(pos, t)
        if where is None:  # prefill, static decode, or a wrapped ring: the torch attention
            return super().self_attention(q, k, v, q_norm, k_norm, eps, angles, cache, pos,
                                          positions, head_dim=head_dim, neox=neox,
                                          scale=scale, softcap=softcap)
        slot, live, k_pos = where
        cos, sin = angles
        return self._attn_decode(q, k, v, q_norm, k_norm, eps, cos, sin, neox, cache.k, cache.v,
                                 self._no_positions if k_pos is None else k_pos, slot, live,
                                 pos, cache.window or 0, scale, softcap or 0.0)


def default_ops(device, *, native: bool = False, kv_half: bool = True) -> TorchOps:
    """The ops for ``device``: the native CPU kernels when ``native`` (matrices bound for
    them; float16 KV caches with ``kv_half``), the Triton kernels on CUDA when Triton is
    importable, else torch."""
    if native:
        return NativeOps(kv_half=kv_half)
    if torch.device(device).type == "cuda":
        from localllm.kernels import triton_available

        if triton_available():
            return KernelOps()
    return TorchOps()


def positions_of(pos: int | torch.Tensor, t: int, device) -> torch.Tensor:
    """Absolute positions (T,) int64 of ``t`` tokens starting at ``pos`` (int or (1,) tensor)."""
    if isinstance(pos, torch.Tensor):
        if t != 1:
            raise ValueError("a position held in a tensor (static decode) takes one token")
        return pos
    return torch.arange(pos, pos + t, device=device)


def default_attention_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
