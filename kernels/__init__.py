"""Triton kernels for quantized weights (installed as ``localllm.kernels``).

Weights stay in their ggml blocks on the GPU (the types whose blocks are not 16-byte aligned
repacked into aligned planes of the same bytes, :meth:`QuantWeight.aligned`); the kernels
decode them on the fly:

- :mod:`.dequant`: blocks -> float32/float16/bfloat16 tensor (bit-exact in float32);
- :mod:`.gemv`: fused dequant x vector for decode (<= 8 rows); one row: integer dot
  products on 8-bit activations (llama.cpp's ``mul_mat_vec_q``);
- :mod:`.gemm`: prefill GEMM decoding weight tiles for ``tl.dot`` (:mod:`.gemm_decode`);
- :mod:`.norm_rope`: RMSNorm and RoPE;
- :mod:`.fused`: fused element-wise work of a layer (``rms_norm_rope``, ``norm_rope_kv``,
  ``residual_rms_norm``, ``gated_act``): fewer launches per decode step;
- :mod:`.attention`: decode attention over the KV cache (flash-decoding, split-K);
- :mod:`.ssm`: the short convolution and Mamba2's selective scan of state-space models.
- :mod:`.recurrent`: the gated delta rule of Qwen3.5 / Qwen3-Next's delta-net layers.
- :mod:`.flash_attention`: prefill attention over the KV cache (flash attention).
- :mod:`.flash`: what both attention kernels share (argument checks, the online-softmax step).

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
from localllm.gguf.quants import block_format
from localllm.gguf.quants import dequantize as reference_dequantize

from .layout import LAYOUTS, PLANES, from_planes, plane_offsets, to_planes

__all__ = [
    "GEMV_MAX_ROWS",
    "PLANES",
    "QuantWeight",
    "decode_attention",
    "dequantize",
    "gated_act",
    "gated_delta_net",
    "gemm",
    "gemv",
    "norm_rope_kv",
    "prefill_attention",
    "quant_linear",
    "register_quants_backend",
    "residual_rms_norm",
    "rms_norm",
    "rms_norm_rope",
    "rope",
    "short_conv",
    "ssm_scan",
    "supports",
    "triton_available",
]

# Kernel entry points, imported on first use (they import Triton).
_LAZY = {
    "decode_attention": ".attention",
    "dequantize": ".dequant",
    "gated_act": ".fused",
    "gated_delta_net": ".recurrent",
    "gemv": ".gemv",
    "gemm": ".gemm",
    "mla_decode": ".mla",
    "norm_rope_kv": ".fused",
    "prefill_attention": ".flash_attention",
    "residual_rms_norm": ".fused",
    "rms_norm": ".norm_rope",
    "rms_norm_rope": ".fused",
    "rope": ".norm_rope",
    "short_conv": ".ssm",
    "ssm_scan": ".ssm",
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

    return qtype in KERNEL_TYPES


@dataclass(frozen=True)
class QuantWeight:
    """A weight matrix kept in its ggml blocks.

    Attributes:
        data: uint8, the blocks of each row: (N, row_bytes) as stored in the GGUF file
            (``layout`` "blocks"), or flat (``layout`` "planes": the same bytes field by
            field, each field 16-byte aligned, see :data:`PLANES` and :meth:`aligned`).
        qtype: the ggml type.
        shape: logical (N, K) in torch order (out_features, in_features).
        splits: row counts of the matrices fused into this one (see :meth:`cat`).
        layout: "blocks" or "planes".
    """

    data: torch.Tensor
    qtype: T
    shape: tuple[int, int]
    splits: tuple[int, ...] = ()
    layout: str = "blocks"

    def __post_init__(self) -> None:
        fmt = block_format(self.qtype)
        n, k = self.shape
        if k % fmt.block_size:
            raise ValueError(f"QuantWeight: K={k} is not a multiple of {fmt.block_size}")
        if self.layout not in LAYOUTS or (self.layout == "planes" and self.qtype not in PLANES):
            raise ValueError(f"QuantWeight: no layout {self.layout!r} for {T(self.qtype).name}")
        row_bytes = k // fmt.block_size * fmt.type_size
        want = n * row_bytes
        if self.layout == "planes":
            want = plane_offsets(self.qtype, n * (k // fmt.block_size))[1]
        if self.data.dtype != torch.uint8 or self.data.numel() != want:
            raise ValueError(
                f"QuantWeight: {self.data.numel()} {self.data.dtype} values do not hold "
                f"{T(self.qtype).name} {list(self.shape)}"
            )
        if self.layout == "blocks":
            object.__setattr__(self, "data", self.data.reshape(n, row_bytes).contiguous())
        else:
            object.__setattr__(self, "data", self.data.reshape(-1).contiguous())
        if not self.splits:
            object.__setattr__(self, "splits", (n,))

    @classmethod
    def from_bytes(cls, data, qtype: T, shape: tuple[int, int]) -> QuantWeight:
        """From the raw bytes of a GGUF tensor (numpy or torch uint8) and its torch shape."""
        if not isinstance(data, torch.Tensor):
            data = torch.from_numpy(data)
        return cls(data.reshape(-1), T(qtype), (int(shape[0]), int(shape[1])))

    @property
    def n_blocks(self) -> int:
        return self.shape[0] * (self.shape[1] // block_format(self.qtype).block_size)

    def aligned(self) -> QuantWeight:
        """The weight in the layout the kernels read fastest: "planes" for the types of
        :data:`PLANES` (repacked once, on the data's device, bit-exact), else itself. The
        result replaces this weight: keep no reference to the old one, so that memory stays
        about the file's tensor bytes (+ at most 15 bytes per plane)."""
        if self.layout == "planes" or self.qtype not in PLANES:
            return self
        planes = to_planes(self.data.reshape(self.n_blocks, -1), self.qtype)
        return QuantWeight(planes, self.qtype, self.shape, self.splits, "planes")

    def blocks(self) -> torch.Tensor:
        """The weight's bytes in the GGUF layout: uint8 (N, row_bytes)."""
        if self.layout == "blocks":
            return self.data
        return from_planes(self.data, self.qtype, self.n_blocks).reshape(self.shape[0], -1)

    @classmethod
    def cat(cls, weights: list[QuantWeight]) -> QuantWeight:
        """Fuse matrices that share their input (Q/K/V, gate/up) into one of stacked rows,
        in the layout of the first.

        Raises:
            ValueError: the types or input sizes differ.
        """
        first = weights[0]
        for w in weights[1:]:
            if w.qtype != first.qtype or w.shape[1] != first.shape[1]:
                raise ValueError("QuantWeight.cat: weights differ in type or input size")
        splits = tuple(s for w in weights for s in w.splits)
        shape = (sum(w.shape[0] for w in weights), first.shape[1])
        if first.layout == "planes":  # plane by plane: one copy, no GGUF-layout detour
            ws = [w.aligned() for w in weights]
            n_blocks = sum(w.n_blocks for w in ws)
            offs, total = plane_offsets(first.qtype, n_blocks)
            data = torch.zeros(total, dtype=torch.uint8, device=first.data.device)
            for i, (_, size) in enumerate(PLANES[first.qtype]):
                parts = [w.data[plane_offsets(w.qtype, w.n_blocks)[0][i]:][: w.n_blocks * size]
                         for w in ws]  # fmt: skip
                torch.cat(parts, out=data[offs[i] : offs[i] + n_blocks * size])
            return cls(data, first.qtype, shape, splits, "planes")
        data = torch.cat([w.blocks() for w in weights], dim=0)
        return cls(data, first.qtype, shape, splits)

    def to(self, device) -> QuantWeight:
        return QuantWeight(self.data.to(device), self.qtype, self.shape, self.splits, self.layout)

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (T,) int64 dequantized -> (T, K) float32 (embedding lookups);
        bit-exact with the torch reference."""
        if self.layout == "blocks":
            blocks = self.data[index]
        else:
            nb = self.shape[1] // block_format(self.qtype).block_size
            blk = (index[:, None] * nb + torch.arange(nb, device=index.device)).reshape(-1)
            offs, _ = plane_offsets(self.qtype, self.n_blocks)
            fields = [self.data[o : o + self.n_blocks * size].view(self.n_blocks, size)[blk]
                      for o, (_, size) in zip(offs, PLANES[self.qtype])]  # fmt: skip
            order = sorted(range(len(fields)), key=lambda i: PLANES[self.qtype][i][0])
            blocks = torch.cat([fields[i] for i in order], dim=1)
        return reference_dequantize(blocks, self.qtype, (index.shape[0], self.shape[1]),
                                    dtype=torch.float32)  # fmt: skip

    def dequantize(self, dtype: torch.dtype = torch.float16) -> torch.Tensor:
        """The weight as a (N, K) ``dtype`` tensor (Triton on CUDA, else the torch reference)."""
        if self.data.is_cuda and supports(self.qtype):
            from .dequant import dequantize

            return dequantize(self.data, self.qtype, self.shape, dtype, layout=self.layout)
        return reference_dequantize(self.blocks(), self.qtype, self.shape, dtype=dtype)


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
        from .gemv import attached_q8, gemv

        # a one-row x from a fused kernel carries its 8-bit copy: no quantizing launch
        q8 = attached_q8(x) if x2.shape[0] == 1 else None
        y = gemv(w.data, w.qtype, n, x2, out_dtype=out_dtype, layout=w.layout, x_q8=q8)
    else:
        from .gemm import gemm

        y = gemm(w.data, w.qtype, n, x2, out_dtype=out_dtype, bf16=bf16, layout=w.layout)
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


