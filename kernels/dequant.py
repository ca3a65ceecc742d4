"""Triton dequantization: raw ggml blocks -> float32 / float16 / bfloat16 tensor.

One program decodes ``BLOCK`` consecutive weights (see :mod:`.decode` for the layouts). With
a float32 output the result is bit-exact with the torch reference (``localllm.gguf.quants``): the
kernel is compiled with fp contraction disabled so ``d * q - m`` rounds twice as numpy does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from gguf import GGMLQuantizationType as T

from localllm.errors import UnsupportedError

from ._jit import kernel
from .decode import KERNEL_TYPES, decode, decode_planes
from .layout import PLANES, block_format, plane_offsets

_OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@kernel
def _dequant_kernel(
    data,
    out,
    n_elements,
    BS: tl.constexpr,
    TS: tl.constexpr,
    QTYPE: tl.constexpr,
    BLOCK: tl.constexpr,
    PLANES: tl.constexpr = False,
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_elements
    j = (offs % BS).to(tl.int32)
    if PLANES:
        v = decode_planes(data, n_elements // BS, offs // BS, j, mask, QTYPE)
    else:
        v = decode(data + (offs // BS) * TS, j, mask, QTYPE)
    tl.store(out + offs, v.to(out.dtype.element_ty), mask=mask)


def supports(qtype: T) -> bool:
    """Whether the kernels handle ``qtype``."""
    return qtype in KERNEL_TYPES


def dequantize(
    data: torch.Tensor, qtype: T, shape: tuple[int, ...], dtype: torch.dtype = torch.float16,
    *, layout: str = "blocks",
) -> torch.Tensor:  # fmt: skip
    """Dequantize the bytes of one tensor with Triton.

    Args:
        data: uint8 bytes of the tensor (contiguous, file order), on CUDA (or on the CPU, which
            runs the kernel in Triton's interpreter).
        qtype: ggml type, one of :data:`.decode.KERNEL_TYPES`.
        shape: logical torch-order shape (rows x cols).
        dtype: float32, float16 or bfloat16; values are rounded once from float32.
        layout: "blocks" (file order) or "planes" (``localllm.kernels.PLANES``).

    Returns:
        ``dtype`` tensor of ``shape`` on ``data``'s device.

    Raises:
        UnsupportedError: no kernel for ``qtype``.
        ValueError: byte count, dtype or layout mismatch.
    """
    fmt = block_format(qtype)
    if not supports(qtype):
        raise UnsupportedError(f"tensor type {T(qtype).name} has no Triton kernel")
    if dtype not in _OUT_DTYPES:
        raise ValueError(f"dequantize: output dtype must be one of {_OUT_DTYPES}, got {dtype}")
    data = data.reshape(-1)
    if data.dtype != torch.uint8 or not data.is_contiguous():
        raise ValueError("dequantize: data must be contiguous uint8 bytes")
    n = 1
    for s in shape:
        n *= int(s)
    if layout not in ("blocks", "planes") or (layout == "planes" and qtype not in PLANES):
        raise ValueError(f"dequantize: no layout {layout!r} for {T(qtype).name}")
    want = n // fmt.block_size * fmt.type_size
    if layout == "planes" and n % fmt.block_size == 0:
        want = plane_offsets(qtype, n // fmt.block_size)[1]
    if n % fmt.block_size or data.numel() != want:
        raise ValueError(f"{T(qtype).name}: {data.numel()} bytes do not hold shape {list(shape)}")
    out = torch.empty(tuple(shape), dtype=dtype, device=data.device)
    if n == 0:
        return out
    block = 1024
    grid = (triton.cdiv(n, block),)
    _dequant_kernel[grid](
        data,
        out,
        n,
        BS=fmt.block_size,
        TS=fmt.type_size,
        QTYPE=int(qtype),
        BLOCK=block,
        PLANES=layout == "planes",
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


def quants_backend(
    data: torch.Tensor, qtype: T, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
    """``localllm.gguf.quants`` backend: CUDA tensors of supported types, else ``None``."""
    if data.device.type != "cuda" or not supports(qtype) or dtype not in _OUT_DTYPES:
        return None
    if qtype == T.F32 and dtype == torch.float32:
        return None  # a plain copy; the reference does it
    return dequantize(data.contiguous(), qtype, shape, dtype)
