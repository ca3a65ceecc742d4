"""Element types of KV caches: llama.cpp's ``-ctk/--cache-type-k`` and ``-ctv/--cache-type-v``.

A cache of a float type (``f32``, ``f16``, ``bf16``) holds torch tensors of that dtype. A
cache of a block type (``q8_0``, ``q4_0``, ``q4_1``, ``iq4_nl``, ``q5_0``, ``q5_1``) holds
each cell's key or value row (``head_dim`` values of one KV head) as ggml blocks of 32
values, byte for byte ggml's ``block_q8_0`` ... (``ggml/src/ggml-common.h``): a uint8 tensor
(n_kv_heads, cells, head_dim / 32 * block bytes), as llama.cpp's ``llama_kv_cache`` stores
its quantized K and V tensors. Rows are written through localllm's block quantizers
(:data:`localllm.quantize.blocks.BLOCK_QUANTIZERS`, ggml's ``quantize_row_*_ref`` rounding)
and read through the reference dequantizer (:func:`localllm.gguf.quants.dequantize_blocks`)
a few heads at a time inside the attention (:class:`BlockRows`), or directly by the native
CPU kernel (``localllm/cpu/csrc/attn_kvq.cpp``).

llama.cpp's list of allowed types is ``common/arg.cpp``'s ``kv_cache_types``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGMLQuantizationType as T

from ..errors import ParameterError, UnsupportedError
from ..gguf.quants import block_format, dequantize_blocks

__all__ = ["CACHE_TYPES", "BlockRows", "CacheType", "cache_type"]


@dataclass(frozen=True)
class CacheType:
    """One KV-cache element type.

    Attributes:
        name: llama.cpp's name (``q8_0``).
        ggml: the ggml type (llama-cpp-python's ``type_k`` / ``type_v`` take its id).
        dtype: the torch dtype of a float type; ``torch.uint8`` (packed blocks) otherwise.
    """

    name: str
    ggml: T
    dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.dtype == torch.uint8

    @property
    def block(self) -> int:
        """Values per block (1 for float types)."""
        return block_format(self.ggml).block_size if self.quantized else 1

    def check_dim(self, dim: int, what: str) -> None:
        """Raises UnsupportedError: ``dim`` (the model's ``what`` head size) is not a multiple
        of the block (ggml's blocks run along a row)."""
        if dim % self.block:
            raise UnsupportedError(f"cache type {self.name} stores blocks of {self.block} "
                                   f"values: the model's {what} head size {dim} is not a "
                                   "multiple")

    def row_bytes(self, dim: int) -> int:
        """Bytes of one row of ``dim`` values (``dim`` a multiple of :attr:`block`)."""
        if not self.quantized:
            return dim * torch.empty((), dtype=self.dtype).element_size()
        return dim // self.block * block_format(self.ggml).type_size

    def storage_dim(self, dim: int) -> int:
        """The last dimension of the cache tensor holding rows of ``dim`` values."""
        return self.row_bytes(dim) if self.quantized else dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Rows as the cache holds them: x (..., dim) float -> (..., dim) of :attr:`dtype`
        (rounded to nearest), or (..., row_bytes) uint8 blocks (ggml's reference rounding,
        bit-exact with ``gguf.quants.quantize`` where it has the type), on x's device."""
        if not self.quantized:
            return x.to(self.dtype)
        from ..quantize.blocks import BLOCK_QUANTIZERS  # the quantizers import numpy code

        dim = x.shape[-1]
        flat = x.detach().reshape(-1, self.block).float().cpu()
        blocks = torch.from_numpy(BLOCK_QUANTIZERS[self.ggml](flat))
        return blocks.reshape(*x.shape[:-1], self.row_bytes(dim)).to(x.device)

    def decode(self, b: torch.Tensor, dim: int) -> torch.Tensor:
        """The inverse of :meth:`encode`: (..., storage_dim) -> (..., dim) float32."""
        if not self.quantized:
            return b.float()
        fmt = block_format(self.ggml)
        flat = dequantize_blocks(b.reshape(-1, fmt.type_size), self.ggml)
        return flat.reshape(*b.shape[:-1], dim)


# llama.cpp's kv_cache_types, in its order (f32 too: llama.cpp accepts it).
CACHE_TYPES: dict[str, CacheType] = {c.name: c for c in (
    CacheType("f32", T.F32, torch.float32),
    CacheType("f16", T.F16, torch.float16),
    CacheType("bf16", T.BF16, torch.bfloat16),
    CacheType("q8_0", T.Q8_0, torch.uint8),
    CacheType("q4_0", T.Q4_0, torch.uint8),
    CacheType("q4_1", T.Q4_1, torch.uint8),
    CacheType("iq4_nl", T.IQ4_NL, torch.uint8),
    CacheType("q5_0", T.Q5_0, torch.uint8),
    CacheType("q5_1", T.Q5_1, torch.uint8),
)}
_BY_ID = {int(c.ggml): c for c in CACHE_TYPES.values()}


def cache_type(value: str | int | CacheType | None, flag: str = "--cache-type-k") -> CacheType | None:
    """A cache type from llama.cpp's name (``"q8_0"``, any case), a ggml type id (``8``, as
    llama-cpp-python's ``type_k``), a :class:`CacheType`, or None (the backend's default).

    Raises:
        ParameterError: anything else; the message names ``flag`` and the allowed types.
    """
    if value is None or isinstance(value, CacheType):
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value in _BY_ID:
        return _BY_ID[value]
    if isinstance(value, str) and value.strip().lower() in CACHE_TYPES:
        return CACHE_TYPES[value.strip().lower()]
    allowed = ", ".join(CACHE_TYPES)
    raise ParameterError(f"{flag}: unsupported cache type {str(value)[:40]!r} "
                         f"(allowed: {allowed}, or their ggml type ids)")


class BlockRows:
    """A view of a block-type cache that attention reads a few heads at a time.

    ``data``: uint8 (n_kv_heads, S, row_bytes); ``shape``: (n_kv_heads, S, dim), the
    dequantized shape. ``rows[h0:h1]`` is the view of heads h0 .. h1-1 and ``.float()``
    dequantizes it (float32): :func:`localllm.backends.dense.attend` calls both per block of
    its scores, so no dequantized copy of the whole cache is made.
    """

    __slots__ = ("ctype", "data", "dim")

    def __init__(self, data: torch.Tensor, ctype: CacheType, dim: int) -> None:
        self.data = data
        self.ctype = ctype
        self.dim = dim

    @property
    def shape(self) -> tuple[int, int, int]:
        return (int(self.data.shape[0]), int(self.data.shape[1]), self.dim)

    @property
    def dtype(self) -> torch.dtype:
        return torch.uint8

    def __getitem__(self, heads: slice) -> BlockRows:
        return BlockRows(self.data[heads], self.ctype, self.dim)

    def float(self) -> torch.Tensor:
        return self.ctype.decode(self.data, self.dim)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.float().to(dtype)
