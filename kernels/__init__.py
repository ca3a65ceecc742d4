"""Triton kernels for quantized weights (installed as ``localllm.kernels``).

Weights stay in their ggml blocks on the GPU; the kernels decode them on the fly:

- :mod:`.dequant`: blocks -> float32/float16/bfloat16 tensor (bit-exact in float32);
- :mod:`.gemv`: fused dequant x vector for decode (<= 8 rows); one row: integer dot
  products on 8-bit activations (llama.cpp's ``mul_mat_vec_q``);
- :mod:`.gemm`: prefill GEMM decoding weight tiles for ``tl.dot``;
- :mod:`.norm_rope`: RMSNorm and RoPE;
- :mod:`.fused`: fused element-wise work of a layer (``rms_norm_rope``, ``norm_rope_kv``,
  ``residual_rms_norm``, ``gated_act``): fewer launches per decode step;
- :mod:`.attention`: decode attention over the KV cache (flash-decoding, split-K).

Every kernel also runs on CPU tensors through Triton's interpreter (slowly: for tests);
:mod:`._aot` compiles them for NVIDIA GPUs without one (``bench/kernel_profile.py``).
Without Triton, :func:`triton_available` is False and nothing here imports it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
from gguf import GGMLQuantizationType as T

from localllm.errors import UnsupportedError
from localllm.gguf.quants import BlockFormat
from localllm.gguf.quants import block_format as _reference_block_format
from localllm.gguf.quants import dequantize as reference_dequantize

# Types the kernels decode beyond localllm.gguf.quants' table when that table lacks them
# (their geometry from gguf-py's GGML_QUANT_SIZES; the layouts are ggml's block_iq4_nl,
# block_iq4_xs and block_mxfp4, ggml/src/ggml-common.h).
IQ_TYPES = (T.IQ4_NL, T.IQ4_XS, T.MXFP4)


def block_format(qtype: T) -> BlockFormat:
    """Geometry of ``qtype`` (localllm.gguf.quants' table, then :data:`IQ_TYPES`).

    Raises:
        UnsupportedError: unknown type.
    """
    try:
        return _reference_block_format(qtype)
    except UnsupportedError:
        if qtype not in IQ_TYPES:
            raise
        from gguf import GGML_QUANT_SIZES

        return BlockFormat(*GGML_QUANT_SIZES[T(qtype)])

__all__ = [
    "GEMV_MAX_ROWS",
    "QuantWeight",
    "decode_attention",
    "dequantize",
    "gated_act",
    "gemm",
    "gemv",
    "norm_rope_kv",
    "quant_linear",
    "register_quants_backend",
    "residual_rms_norm",
    "rms_norm",
    "rms_norm_rope",
    "rope",
    "supports",
    "triton_available",
]

# Kernel entry points, imported on first use (they import Triton).
_LAZY = {
    "decode_attention": ".attention",
    "dequantize": ".dequant",
    "gated_act": ".fused",
    "gemv": ".gemv",
    "gemm": ".gemm",
    "norm_rope_kv": ".fused",
    "residual_rms_norm": ".fused",
    "rms_norm": ".norm_rope",
    "rms_norm_rope": ".fused",
    "rope": ".norm_rope",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Row counts up to this take the GEMV kernel, more the GEMM.
GEMV_MAX_ROWS = 8


@cache
def triton_available() -> bool:
    """Whether Triton imports (the kernels then run on CUDA, or interpreted on the CPU)."""
    try:
        import triton
        import triton.language  # noqa: F401
        from triton.runtime.interpreter import InterpretedFunction  # noqa: F401
    except Exception:  # noqa: BLE001 - a broken install fails in many ways; all mean "no"
        return False
    return True


def supports(qtype: T) -> bool:
    """Whether the kernels handle the ggml type ``qtype`` (False without Triton)."""
    if not triton_available():
        return False
    from .decode import KERNEL_TYPES

    return qtype in KERNEL_TYPES or qtype in IQ_TYPES


@dataclass(frozen=True)
class QuantWeight:
    """A weight matrix kept in its ggml blocks.

    Attributes:
        data: uint8 (N, row_bytes): the blocks of each row, as stored in the GGUF file.
        qtype: the ggml type.
        shape: logical (N, K) in torch order (out_features, in_features).
        splits: row counts of the matrices fused into this one (see :meth:`cat`).
    """

    data: torch.Tensor
    qtype: T
    shape: tuple[int, int]
    splits: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        fmt = block_format(self.qtype)
        n, k = self.shape
        if k % fmt.block_size:
            raise ValueError(f"QuantWeight: K={k} is not a multiple of {fmt.block_size}")
        row_bytes = k // fmt.block_size * fmt.type_size
        if self.data.dtype != torch.uint8 or self.data.numel() != n * row_bytes:
            raise ValueError(
                f"QuantWeight: {self.data.numel()} {self.data.dtype} values do not hold "
                f"{T(self.qtype).name} {list(self.shape)}"
            )
        object.__setattr__(self, "data", self.data.reshape(n, row_bytes).contiguous())
        if not self.splits:
            object.__setattr__(self, "splits", (n,))

    @classmethod
    def from_bytes(cls, data, qtype: T, shape: tuple[int, int]) -> QuantWeight:
        """From the raw bytes of a GGUF tensor (numpy or torch uint8) and its torch shape."""
        if not isinstance(data, torch.Tensor):
            data = torch.from_numpy(data)
        return cls(data.reshape(-1), T(qtype), (int(shape[0]), int(shape[1])))

    @classmethod
    def cat(cls, weights: list[QuantWeight]) -> QuantWeight:
        """Fuse matrices that share their input (Q/K/V, gate/up) into one of stacked rows.

        Raises:
            ValueError: the types or input sizes differ.
        """
        first = weights[0]
        for w in weights[1:]:
            if w.qtype != first.qtype or w.shape[1] != first.shape[1]:
                raise ValueError("QuantWeight.cat: weights differ in type or input size")
        data = torch.cat([w.data for w in weights], dim=0)
        splits = tuple(s for w in weights for s in w.splits)
        return cls(data, first.qtype, (sum(w.shape[0] for w in weights), first.shape[1]), splits)

    def to(self, device) -> QuantWeight:
        return QuantWeight(self.data.to(device), self.qtype, self.shape, self.splits)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def dequantize(self, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """The weight as a (N, K) ``dtype`` tensor (Triton on CUDA, else the torch reference)."""
        if self.data.is_cuda and supports(self.qtype):
            from .dequant import dequantize

            return dequantize(self.data, self.qtype, self.shape, dtype)
        return reference_dequantize(self.data, self.qtype, self.shape, dtype=dtype)


def quant_linear(
    x: torch.Tensor, w: QuantWeight, *, out_dtype: torch.dtype | None = None, bf16: bool = False
) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """``x @ W.T`` reading ``W`` quantized: GEMV for <= 8 rows, GEMM otherwise.

    Args:
        x: (..., K) float16/float32/bfloat16 on ``w``'s device (CUDA; CPU runs interpreted).
        w: the weight (N, K); fused weights (``QuantWeight.cat``) return one output each.
        out_dtype: dtype of the result (default ``x.dtype``).
        bf16: for the GEMM, multiply in bfloat16 instead of float16.

    Returns:
        (..., N) ``out_dtype``, or a tuple of (..., N_i) views for a fused weight.

    Raises:
        UnsupportedError: Triton is unavailable or has no kernel for the type.
        ValueError: ``x``'s last dimension is not K.
    """
    if not triton_available():
        raise UnsupportedError("Triton is not available")
    if not supports(w.qtype):
        raise UnsupportedError(f"tensor type {T(w.qtype).name} has no Triton kernel")
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"quant_linear: x has {x.shape[-1]} features, the weight wants {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] <= GEMV_MAX_ROWS:
        from .gemv import gemv

        y = gemv(w.data, w.qtype, n, x2, out_dtype=out_dtype)
    else:
        from .gemm import gemm

        y = gemm(w.data, w.qtype, n, x2, out_dtype=out_dtype, bf16=bf16)
    y = y.reshape(*lead, n)
    if len(w.splits) > 1:
        return tuple(torch.split(y, list(w.splits), dim=-1))
    return y


def register_quants_backend() -> bool:
    """Make ``localllm.gguf.quants.dequantize`` use the Triton kernel for CUDA tensors.

    Returns:
        whether it was registered (False without Triton).
    """
    if not triton_available():
        return False
    from localllm.gguf.quants import register_backend

    from .dequant import quants_backend

    register_backend("triton", quants_backend, device_types=("cuda",))
    return True


register_quants_backend()
