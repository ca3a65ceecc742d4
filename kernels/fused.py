"""Fused element-wise kernels for the decode step: fewer, larger launches per layer.

A small model's decode step on a GPU is bound by kernel launches, not arithmetic; each kernel
here does in one launch what the torch path does in several:

- :func:`rms_norm_rope`: per-head RMSNorm (Gemma 3's q/k norms) then RoPE, read straight from
  a view of the fused QKV output;
- :func:`norm_rope_kv`: the decode step's whole QKV epilogue, QK-norm and RoPE of q and k and
  the KV-cache write of k and v (ring position included);
- :func:`residual_rms_norm`: optional post-norm of a sublayer output, the residual add and the
  next sublayer's pre-norm (Gemma 3: post-attention norm + residual + pre-FFN norm);
- :func:`gated_act`: ``act(gate) * up`` of a gated FFN (GeGLU / SwiGLU).

Semantics follow the torch path in :mod:`localllm.models.common` (``rms_norm``, ``rotate`` with
``rope_angles``, ``gelu_tanh``, ``F.silu``), in float32. The launchers read nothing back to the
host and size their grids from shapes only, so they can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import device_fn, kernel
from .gemv import attach_q8, q8_buffers, store_q8

# Activation codes of _gated_act_kernel's ACT constexpr.
_ACTS = {"gelu_tanh": 0, "silu": 1}


def _check_f32(name: str, **tensors: torch.Tensor | None) -> None:
    for arg, t in tensors.items():
        if t is not None and t.dtype != torch.float32:
            raise ValueError(f"{name}: {arg} must be float32, not {t.dtype}")


def _check_device(name: str, ref: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    for arg, t in tensors.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name}: {arg} is on {t.device}, the input on {ref.device}")


@device_fn
def _rope_pairs(HALF: tl.constexpr, BLOCK_H: tl.constexpr, NEOX: tl.constexpr):
    """The rotated pairs of a head: lanes i < HALF, each pairing element i1 with i2 (the two
    halves with NEOX, else adjacent elements)."""
    i = tl.arange(0, BLOCK_H)
    if NEOX:
        i1 = i
        i2 = i + HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    return i, i1, i2, i < HALF


@device_fn
def _norm_rope_row(xrow, w, eps, c, s, i1, i2, mask, HALF: tl.constexpr,
                   HAS_WEIGHT: tl.constexpr):  # fmt: skip
    """One head: RMSNorm (with a weight) then the rotation by (c, s); its two halves."""
    x1 = tl.load(xrow + i1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + i2, mask=mask, other=0.0).to(tl.float32)
    if HAS_WEIGHT:
        ms = (tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / (2 * HALF)
        r = 1.0 / tl.sqrt(ms + eps)
        x1 = x1 * r * tl.load(w + i1, mask=mask, other=0.0)
        x2 = x2 * r * tl.load(w + i2, mask=mask, other=0.0)
    return x1 * c - x2 * s, x2 * c + x1 * s


@kernel
def _rms_norm_rope_kernel(x, w, pos, inv_freq, y, T, stride_xh, stride_xt, eps, scale,
                          HALF: tl.constexpr, BLOCK_H: tl.constexpr, NEOX: tl.constexpr,
                          HAS_WEIGHT: tl.constexpr):  # fmt: skip
    # One program per (head, token) row; each loads the row as its two rotation halves.
    pid = tl.program_id(0).to(tl.int64)
    h = pid // T
    t = pid % T
    i, i1, i2, mask = _rope_pairs(HALF, BLOCK_H, NEOX)
    # The position is read here, on the device: a graph replay picks up the current one.
    p = tl.load(pos + t).to(tl.float32) * scale
    angle = p * tl.load(inv_freq + i, mask=mask, other=0.0)
    y1, y2 = _norm_rope_row(x + h * stride_xh + t * stride_xt, w, eps, tl.cos(angle),
                            tl.sin(angle), i1, i2, mask, HALF, HAS_WEIGHT)  # fmt: skip
    yrow = y + pid * (2 * HALF)
    tl.store(yrow + i1, y1.to(y.dtype.element_ty), mask=mask)
    tl.store(yrow + i2, y2.to(y.dtype.element_ty), mask=mask)


def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    neox: bool,
    scale: float = 1.0,
) -> torch.Tensor:
    """Per-head RMSNorm then rotary position embedding, in one launch.

    RMSNorm (Zhang & Sennrich 2019): ``x / sqrt(mean(x^2) + eps) * weight`` over each head;
    RoPE (Su et al. 2021): pairs rotated by ``positions[t] * scale * inv_freq[i]``, the two
    halves of the head (``neox``, llama.cpp's ``LLAMA_ROPE_TYPE_NEOX``) or adjacent elements
    (``LLAMA_ROPE_TYPE_NORM``). Equals ``rotate(rms_norm(x, weight, eps),
    rope_angles(positions, inv_freq, scale), neox=neox)`` of ``localllm.models.common``.

    Args:
        x: (H, T, D) float32, D even; the last dimension contiguous, the others of any stride
            (a view of a fused QKV output, e.g. ``qkv[:, :H*D].reshape(T, H, D).transpose(0, 1)``).
        weight: (D,) float32 norm gain, or None for RoPE alone (``eps`` is then unused).
        eps: added to the mean square.
        positions: (T,) integer tensor on ``x``'s device, read by the kernel (never on the host).
        inv_freq: (D/2,) float32 inverse frequencies (``rope_inv_freq``).
        neox: rotate halves (NEOX) instead of adjacent pairs (NORM).
        scale: multiplies the positions (linear RoPE scaling).

    Returns:
        A new contiguous (H, T, D) float32 tensor.

    Raises:
        ValueError: shapes, dtypes or devices disagree, or x's last dimension is strided.
    """
    name = "rms_norm_rope"
    if x.dim() != 3:
        raise ValueError(f"{name}: x must be (H, T, D), got {tuple(x.shape)}")
    _, t, d = x.shape
    if d % 2 or inv_freq.shape != (d // 2,) or positions.shape != (t,):
        raise ValueError(
            f"{name}: x {tuple(x.shape)}, positions {tuple(positions.shape)} and inv_freq "
            f"{tuple(inv_freq.shape)} disagree (want (H, T, D), (T,), (D/2,) with D even)"
        )
    if weight is not None and weight.shape != (d,):
        raise ValueError(f"{name}: weight {tuple(weight.shape)} does not match D={d}")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"{name}: positions must be integers, not {positions.dtype}")
    _check_f32(name, x=x, weight=weight, inv_freq=inv_freq)
    _check_device(name, x, weight=weight, positions=positions, inv_freq=inv_freq)
    if d and x.stride(-1) != 1:
        raise ValueError(f"{name}: x's last dimension must be contiguous")
    return launch_norm_rope(x, weight, eps, positions, inv_freq, neox=neox, scale=scale)


def launch_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    neox: bool,
    scale: float,
) -> torch.Tensor:
    """The launch behind :func:`rms_norm_rope` and ``norm_rope.rope``, on checked arguments:
    x (H, T, D) of any float dtype with a contiguous last dimension -> a new contiguous
    tensor of x's dtype (float32 math)."""
    n_heads, t, d = x.shape
    y = torch.empty((n_heads, t, d), dtype=x.dtype, device=x.device)
    if n_heads * t * d:
        half = d // 2
        block_h = triton.next_power_of_2(half)
        w = weight.contiguous() if weight is not None else inv_freq  # unread without a weight
        _rms_norm_rope_kernel[(n_heads * t,)](
            x, w, positions.contiguous(), inv_freq.contiguous(), y, t, x.stride(0), x.stride(1),
            float(eps), float(scale), HALF=half, BLOCK_H=block_h, NEOX=bool(neox),
            HAS_WEIGHT=weight is not None, num_warps=max(1, min(4, block_h // 128)),
        )  # fmt: skip
    return y


@device_fn
def _store_q8(v, c0, n, xq, xd, xs, NC: tl.constexpr):
    """The 8-bit copy of ``v`` (NC * 32,) float32, chunks ``c0 ..`` of 32 of a vector of ``n``
    values (``gemv.store_q8``)."""
    c = c0 + tl.arange(0, NC)
    store_q8(v, c, c * 32 < n, xq, xd, xs, NC)


@kernel
def _norm_rope_kv_kernel(q, k, v, qw, kw, pos, inv_freq, q_out, k_cache, v_cache, k_pos,
                         n_heads, size, stride_qh, stride_kh, stride_vh, stride_kch, stride_kcs,
                         stride_vch, stride_vcs, eps, scale, HALF: tl.constexpr,
                         BLOCK_H: tl.constexpr, NEOX: tl.constexpr, Q_NORM: tl.constexpr,
                         K_NORM: tl.constexpr, RING: tl.constexpr):  # fmt: skip
    # Programs 0 .. n_heads-1: query heads; then one per KV head (k rotated into the cache,
    # v copied beside it). The position and the slot are read and computed on the device.
    pid = tl.program_id(0)
    i, i1, i2, mask = _rope_pairs(HALF, BLOCK_H, NEOX)
    p = tl.load(pos)
    angle = p.to(tl.float32) * scale * tl.load(inv_freq + i, mask=mask, other=0.0)
    c = tl.cos(angle)
    s = tl.sin(angle)
    if pid < n_heads:
        y1, y2 = _norm_rope_row(q + pid.to(tl.int64) * stride_qh, qw, eps, c, s, i1, i2, mask,
                                HALF, Q_NORM)  # fmt: skip
        orow = q_out + pid.to(tl.int64) * (2 * HALF)
        tl.store(orow + i1, y1, mask=mask)
        tl.store(orow + i2, y2, mask=mask)
    else:
        h = (pid - n_heads).to(tl.int64)
        slot = p % size  # a full cache: the position itself (p < size)
        y1, y2 = _norm_rope_row(k + h * stride_kh, kw, eps, c, s, i1, i2, mask, HALF, K_NORM)
        krow = k_cache + h * stride_kch + slot * stride_kcs
        tl.store(krow + i1, y1.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(krow + i2, y2.to(k_cache.dtype.element_ty), mask=mask)
        rd = tl.arange(0, 2 * BLOCK_H)
        vv = tl.load(v + h * stride_vh + rd, mask=rd < 2 * HALF, other=0.0)
        tl.store(v_cache + h * stride_vch + slot * stride_vcs + rd,
                 vv.to(v_cache.dtype.element_ty), mask=rd < 2 * HALF)  # fmt: skip
        if RING and h == 0:
            tl.store(k_pos + slot, p)


def norm_rope_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_positions: torch.Tensor | None,
    *,
    neox: bool,
    scale: float = 1.0,
) -> torch.Tensor:
    """One decode token's QKV epilogue in one launch: QK-norm and RoPE of q and k, and the
    KV-cache write of k and v.

    q and k become ``rotate(rms_norm(x, weight, eps), angles)`` as :func:`rms_norm_rope`
    computes them (no norm where the weight is None); k and v are then stored at slot
    ``positions[0] % S`` of every KV head of the caches (a full cache: slot = position; a
    ring, :class:`localllm.models.cache.RingKVCache`: the ring slot, and ``k_positions[slot]``
    becomes the position). The position is read on the device: the launch can be replayed
    in a CUDA graph. Replaces llama.cpp's separate ``ggml_rms_norm``, ``ggml_rope_ext`` and
    ``ggml_set_rows`` (KV store) nodes of a decode step.

    Args:
        q: (H, 1, D) float32 queries, k, v: (Hkv, 1, D) float32; the last dimension
            contiguous, the first of any stride (views of a fused QKV output).
        q_weight, k_weight: (D,) float32 norm gains, or None.
        eps: added to the mean square.
        positions: (1,) integer tensor on q's device, the token's position.
        inv_freq: (D/2,) float32 RoPE inverse frequencies.
        k_cache, v_cache: (Hkv, S, D) float16/float32 caches, last dimension contiguous.
        k_positions: (S,) int64 positions of a ring's slots, or None (full cache).
        neox: rotate halves (NEOX) instead of adjacent pairs (NORM).
        scale: multiplies the position (linear RoPE scaling).

    Returns:
        (H, D) float32: the rotated queries (contiguous).

    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    name = "norm_rope_kv"
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape or q.shape[1:] != k.shape[1:]:
        raise ValueError(f"{name}: want q (H, 1, D), k and v (Hkv, 1, D), got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")  # fmt: skip
    n_heads, t, d = q.shape
    n_kv = k.shape[0]
    if t != 1 or d % 2 or inv_freq.shape != (d // 2,) or positions.shape != (1,):
        raise ValueError(f"{name}: one token of even head_dim, (1,) positions and (D/2,) "
                         f"inv_freq; got q {tuple(q.shape)}, positions "
                         f"{tuple(positions.shape)}, inv_freq {tuple(inv_freq.shape)}")  # fmt: skip
    if k_cache.dim() != 3 or k_cache.shape[0] != n_kv or k_cache.shape[2] != d \
            or v_cache.shape != k_cache.shape:  # fmt: skip
        raise ValueError(f"{name}: caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                         f"do not hold ({n_kv}, S, {d})")
    size = k_cache.shape[1]
    if k_positions is not None and (k_positions.shape != (size,)
                                    or k_positions.dtype != torch.int64):  # fmt: skip
        raise ValueError(f"{name}: k_positions must be ({size},) int64")
    for arg, wt in (("q_weight", q_weight), ("k_weight", k_weight)):
        if wt is not None and wt.shape != (d,):
            raise ValueError(f"{name}: {arg} {tuple(wt.shape)} does not match D={d}")
    if positions.dtype.is_floating_point or positions.dtype == torch.bool:
        raise ValueError(f"{name}: positions must be integers, not {positions.dtype}")
    _check_f32(name, q=q, k=k, v=v, q_weight=q_weight, k_weight=k_weight, inv_freq=inv_freq)
    for arg, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dtype not in (torch.float16, torch.float32) or c.stride(-1) != 1:
            raise ValueError(f"{name}: {arg} must be float16/float32 with a contiguous last "
                             f"dimension")  # fmt: skip
    _check_device(name, q, k=k, v=v, q_weight=q_weight, k_weight=k_weight, positions=positions,
                  inv_freq=inv_freq, k_cache=k_cache, v_cache=v_cache, k_positions=k_positions)
    if any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError(f"{name}: q, k and v need a contiguous last dimension")
    q_out = torch.empty((n_heads, d), dtype=torch.float32, device=q.device)
    if n_heads + n_kv and size:
        half = d // 2
        block_h = triton.next_power_of_2(half)
        _norm_rope_kv_kernel[(n_heads + n_kv,)](
            q, k, v, q_weight if q_weight is not None else inv_freq,
            k_weight if k_weight is not None else inv_freq, positions, inv_freq, q_out,
            k_cache, v_cache, k_positions if k_positions is not None else positions, n_heads,
            size, q.stride(0), k.stride(0), v.stride(0), k_cache.stride(0), k_cache.stride(1),
            v_cache.stride(0), v_cache.stride(1), float(eps), float(scale), HALF=half,
            BLOCK_H=block_h, NEOX=bool(neox), Q_NORM=q_weight is not None,
            K_NORM=k_weight is not None, RING=k_positions is not None,
            num_warps=max(1, min(4, block_h // 128)),
        )  # fmt: skip
    return q_out


@kernel
def _residual_rms_norm_kernel(x, f, pw, w, h_out, n_out, D, stride_x, stride_f, eps, xq, xd, xs,
                              HAS_POST: tl.constexpr, BLOCK_D: tl.constexpr,
                              Q8: tl.constexpr = False):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    xv = tl.load(x + row * stride_x + cols, mask=mask, other=0.0)
    fv = tl.load(f + row * stride_f + cols, mask=mask, other=0.0)
    if HAS_POST:
        rf = 1.0 / tl.sqrt(tl.sum(fv * fv, axis=0) / D + eps)
        fv = fv * rf * tl.load(pw + cols, mask=mask, other=0.0)
    hv = xv + fv  # masked columns stay 0 and add nothing to the sum below
    tl.store(h_out + row * D + cols, hv, mask=mask)
    rh = 1.0 / tl.sqrt(tl.sum(hv * hv, axis=0) / D + eps)
    nv = hv * rh * tl.load(w + cols, mask=mask, other=0.0)
    tl.store(n_out + row * D + cols, nv, mask=mask)
    if Q8:  # one row (decode): also the 8-bit copy the next GEMV reads
        _store_q8(nv, 0, D, xq, xd, xs, BLOCK_D // 32)


def residual_rms_norm(
    x: torch.Tensor,
    f: torch.Tensor,
    post_weight: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add around a sublayer and the next RMSNorm, in one launch.

    ``h = x + rms_norm(f, post_weight, eps)`` (``x + f`` without ``post_weight``) and
    ``n = rms_norm(h, weight, eps)``, RMSNorm as in Zhang & Sennrich 2019. Gemma 3 uses the
    post-norm (post-attention / post-FFN norm, then the next pre-norm); Llama only the residual
    add and the pre-norm.

    Args:
        x: (..., D) float32 residual stream (last dimension contiguous, rows of any stride).
        f: (..., D) float32 sublayer output, same shape (same stride rules).
        post_weight: (D,) float32 gain of the sublayer's post-norm, or None.
        weight: (D,) float32 gain of the next pre-norm.
        eps: added to the mean squares.

    Returns:
        ``(h, n)``: new contiguous (..., D) float32 tensors, the updated residual stream and
        its normalization. For one row with D a multiple of 32 the same launch also writes
        ``n`` quantized to 8 bits per 32 values (``gemv.quantize_q8``'s result, attached to
        ``n``, see ``gemv.attach_q8``): the integer-dot GEMV that multiplies ``n`` next
        reads it instead of quantizing ``n`` in a launch of its own.

    Raises:
        ValueError: shapes, dtypes or devices disagree.
    """
    name = "residual_rms_norm"
    if x.dim() == 0 or f.shape != x.shape:
        raise ValueError(f"{name}: x {tuple(x.shape)} and f {tuple(f.shape)} differ")
    d = x.shape[-1]
    for arg, g in (("post_weight", post_weight), ("weight", weight)):
        if g is not None and g.shape != (d,):
            raise ValueError(f"{name}: {arg} {tuple(g.shape)} does not match D={d}")
    _check_f32(name, x=x, f=f, post_weight=post_weight, weight=weight)
    _check_device(name, x, f=f, post_weight=post_weight, weight=weight)
    h = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    rows = x.numel() // d if d else 0
    if rows:
        x2 = x.reshape(rows, d)
        f2 = f.reshape(rows, d)
        # A strided last dimension is copied (on the device) rather than read scattered.
        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        f2 = f2 if f2.stride(-1) == 1 else f2.contiguous()
        w = weight.contiguous()
        pw = post_weight.contiguous() if post_weight is not None else w  # unread without it
        q8 = q8_buffers(d, n.device) if rows == 1 and d % 32 == 0 else None
        _residual_rms_norm_kernel[(rows,)](
            x2, f2, pw, w, h, n, d, x2.stride(0), f2.stride(0), float(eps),
            *(q8 if q8 is not None else (n, n, n)), HAS_POST=post_weight is not None,
            BLOCK_D=triton.next_power_of_2(d), Q8=q8 is not None,
            num_warps=4 if d <= 4096 else 8,
        )  # fmt: skip
        if q8 is not None:
            attach_q8(n, q8)
    return h, n


@kernel
def _gated_act_kernel(gate, up, y, F, stride_g, stride_u, xq, xd, xs, ACT: tl.constexpr,
                      BLOCK: tl.constexpr, Q8: tl.constexpr = False):  # fmt: skip
    # Rows on grid axis 0 (up to 2**31 - 1 programs); column blocks on axis 1 (<= 65535).
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < F
    g = tl.load(gate + row * stride_g + cols, mask=mask, other=0.0)
    u = tl.load(up + row * stride_u + cols, mask=mask, other=0.0)
    if ACT == 0:
        # 0.5 * g * (1 + tanh(z)) == g * sigmoid(2z) == g / (1 + exp(-2z)): no tanh needed,
        # no cancellation for negative z, and exp's overflow to inf gives the limit (-0).
        # 0.79788...: sqrt(2 / pi), the approximation's inner scale.
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = g / (1.0 + tl.exp(-2.0 * z))
    else:
        a = g / (1.0 + tl.exp(-g))
    tl.store(y + row * F + cols, a * u, mask=mask)
    if Q8:  # one row (decode): also the 8-bit copy of this block for the down GEMV
        _store_q8(a * u, tl.program_id(1) * (BLOCK // 32), F, xq, xd, xs, BLOCK // 32)


def gated_act(gate: torch.Tensor, up: torch.Tensor, *, act: str) -> torch.Tensor:
    """``act(gate) * up``: the gated FFN's activation (GLU variants, Shazeer 2020), one launch.

    ``act`` is ``"gelu_tanh"``, GELU's tanh approximation (Hendrycks & Gimpel 2016; torch's
    ``F.gelu(approximate="tanh")``; GeGLU, Gemma) or ``"silu"`` (``F.silu``; SwiGLU, Llama).
    GELU's ``0.5 * g * (1 + tanh(z))`` is computed as the equal ``g / (1 + exp(-2z))``.

    Args:
        gate: (T, F) float32, last dimension contiguous, any row stride (e.g. the first half
            of a fused gate/up output ``gu[:, :F]``).
        up: (T, F) float32, same rules (``gu[:, F:]``).
        act: ``"gelu_tanh"`` or ``"silu"``.

    Returns:
        A new contiguous (T, F) float32 tensor; for one row with F a multiple of 32 it
        carries its 8-bit copy, written by the same launch (see :func:`residual_rms_norm`).

    Raises:
        ValueError: unknown ``act``; shapes, dtypes or devices disagree.
    """
    name = "gated_act"
    if act not in _ACTS:
        raise ValueError(f"{name}: unknown act {act!r} (want one of {', '.join(_ACTS)})")
    if gate.dim() != 2 or up.shape != gate.shape:
        raise ValueError(
            f"{name}: gate {tuple(gate.shape)} and up {tuple(up.shape)} must both be (T, F)"
        )
    _check_f32(name, gate=gate, up=up)
    _check_device(name, gate, up=up)
    t, n = gate.shape
    y = torch.empty((t, n), dtype=torch.float32, device=gate.device)
    if t * n:
        gate = gate if gate.stride(-1) == 1 else gate.contiguous()
        up = up if up.stride(-1) == 1 else up.contiguous()
        block = min(1024, triton.next_power_of_2(n))
        q8 = q8_buffers(n, y.device) if t == 1 and n % 32 == 0 else None
        _gated_act_kernel[(t, triton.cdiv(n, block))](
            gate, up, y, n, gate.stride(0), up.stride(0), *(q8 if q8 is not None else (y, y, y)),
            ACT=_ACTS[act], BLOCK=block, Q8=q8 is not None, num_warps=4,
        )  # fmt: skip
        if q8 is not None:
            attach_q8(y, q8)
    return y
