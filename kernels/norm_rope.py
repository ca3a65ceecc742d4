"""RMSNorm and rotary position embedding (float32 math, any float input).

RoPE shares the kernel of :func:`localllm.kernels.fused.rms_norm_rope`, without the norm.

Same conventions as the torch path (``localllm.models.common.rms_norm`` / ``apply_rope``):
RMSNorm (Zhang & Sennrich 2019) is ``x / sqrt(mean(x^2) + eps) * weight`` over the last
dimension; RoPE (Su et al. 2021) rotates pairs of a head by ``pos * scale * inv_freq[i]``,
either the two halves of the head (NEOX, llama.cpp's ``LLAMA_ROPE_TYPE_NEOX``) or adjacent
elements (``LLAMA_ROPE_TYPE_NORM``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._jit import kernel
from .fused import launch_norm_rope


@kernel
def _rms_norm_kernel(x, w, y, D, stride_x, stride_y, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    v = tl.load(x + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    ms = tl.sum(v * v, axis=0) / D
    r = 1.0 / tl.sqrt(ms + eps)
    g = tl.load(w + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y + row * stride_y + cols, (v * r * g).to(y.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension.

    Args:
        x: (..., D) float32/float16/bfloat16.
        weight: (D,) the norm's gain (float32 in GGUF files).
        eps: added to the mean square (``<arch>.attention.layer_norm_rms_epsilon``).
        out_dtype: result dtype (default ``x.dtype``).

    Returns:
        (..., D) ``out_dtype``, computed in float32.
    """
    d = x.shape[-1]
    if weight.shape != (d,):
        raise ValueError(f"rms_norm: weight {tuple(weight.shape)} does not match D={d}")
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=out_dtype or x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight, y, d, x2.stride(0), y.stride(0), float(eps),
            BLOCK_D=triton.next_power_of_2(d), num_warps=4 if d <= 4096 else 8,
        )  # fmt: skip
    return y.reshape(*x.shape[:-1], d)


def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    *,
    neox: bool,
    scale: float = 1.0,
) -> torch.Tensor:
    """Rotary position embedding.

    Args:
        x: (n_heads, T, head_dim) float32/float16/bfloat16 (last dim contiguous).
        positions: (T,) integer positions.
        inv_freq: (head_dim/2,) float32 inverse frequencies (``rope_inv_freq``).
        neox: rotate halves (NEOX) instead of adjacent pairs (NORM).
        scale: multiplies the positions (linear RoPE scaling).

    Returns:
        A new tensor like ``x``.
    """
    _, t, hd = x.shape
    if hd % 2 or inv_freq.shape != (hd // 2,) or positions.shape != (t,):
        raise ValueError("rope: x (H, T, D), positions (T,) and inv_freq (D/2,) disagree")
    if x.stride(-1) != 1:
        x = x.contiguous()
    # The kernel of rms_norm_rope, without the norm.
    return launch_norm_rope(x, None, 0.0, positions, inv_freq.float(), neox=neox, scale=scale)
