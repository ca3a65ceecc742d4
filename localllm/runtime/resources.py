"""Will the model fit? Memory needed by a load compared with what the device has free.

:func:`check_memory` runs after the GGUF header is read and before any weight is read, so a
model that cannot fit is refused in a fraction of a second with both figures, instead of
being killed by the OOM killer (CPU) or failing half-way with a CUDA out-of-memory error.

What a load stores (see ``localllm.models.base.bind`` and ``localllm.models.cache``):

* weights of the torch backend: matrices dequantized to ``dtype`` (float16: 2 bytes per
  weight), vectors (norms, biases) as float32; of the quantized (Triton) backend, the
  default on CUDA: the tensors' bytes as in the file (the kernels read blocks directly;
  matrices of a type without a kernel are dequantized to ``dtype``); on CUDA plus ``CUDA_WORKSPACE`` bytes for activations;
* the KV cache at ``--ctx-size``: per layer 2 (K and V) x n_kv_heads x head_dim x cells x
  4 bytes (float32; 2 on CUDA, float16, see ``localllm.models.cache.kv_dtype``), where a sliding-window layer holds ``window + RING_SLACK`` cells when
  that is less than the context (llama.cpp's SWA cache does the same).

Setting ``LOCALLLM_SKIP_MEMORY_CHECK=1`` disables the check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..errors import LocalLLMError

SKIP_ENV = "LOCALLLM_SKIP_MEMORY_CHECK"
CUDA_WORKSPACE = 256 * 2**20  # activations, logits and allocator slack on the GPU (bytes)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a load will hold: ``weights`` (incl. any workspace) and ``kv_cache``."""

    weights: int
    kv_cache: int
    ctx_size: int | None

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache


def weight_bytes(gguf, device: torch.device, dtype: torch.dtype = torch.float16,
                 quantized: bool | None = None) -> int:
    """Bytes of the weights once loaded on ``device`` (see the module docstring).

    ``quantized``: matrices stay in their file blocks (default: on CUDA), except those of a
    type the kernels do not handle (IQ2_XXS ...), which are dequantized to ``dtype`` at load.
    """
    if quantized is None:
        quantized = device.type == "cuda"
    if quantized:
        from localllm.kernels import supports
    workspace = CUDA_WORKSPACE if device.type == "cuda" else 0
    return workspace + sum(stored_bytes(t, quantized and supports(t.qtype), dtype)
                           for t in gguf.tensors.values())


def stored_bytes(info, quantized: bool, dtype: torch.dtype = torch.float16) -> int:
    """Bytes the runtime holds for one GGUF tensor (a ``TensorInfo``): its file bytes when
    ``quantized`` and a matrix, else ``dtype`` elements for matrices, float32 for vectors and
    MoE routers (``models.base.FLOAT32_MATRICES``)."""
    from ..models.base import FLOAT32_MATRICES

    if len(info.shape) < 2 or info.name.split(".")[-2] in FLOAT32_MATRICES:
        return info.n_elements * 4
    if quantized:
        return info.n_bytes
    return info.n_elements * torch.empty((), dtype=dtype).element_size()


def kv_cell_bytes(args, device: torch.device | str = "cpu") -> int:
    """Bytes of one cache cell of one layer on ``device``: K and V of every KV head (of the
    first layer of ``cache_layout(args)``; the families here have one geometry per model)."""
    from ..models import cache_layout
    from ..models.cache import kv_dtype

    c = cache_layout(args)[0]
    return 2 * c.n_kv_heads * c.head_dim * kv_dtype(device).itemsize


def kv_cache_bytes(args, ctx_size: int, device: torch.device | str = "cpu") -> int:
    """Bytes of one session's KV cache at ``ctx_size`` tokens (capped at the model's context)
    on ``device``, from the architecture's ``cache_layout(args)`` (full layers hold the
    context, sliding-window layers ``window + RING_SLACK`` cells when that is less).

    ``args``: a model's validated ModelArgs.
    """
    from ..models import cache_layout
    from ..models.cache import RING_SLACK, kv_dtype, layout_cells

    ctx = max(1, min(ctx_size, args.context_length))
    layout = cache_layout(args)
    item = kv_dtype(device).itemsize
    return sum(2 * c.n_kv_heads * c.head_dim * item * cells
               for c, cells in zip(layout, layout_cells(layout, ctx, RING_SLACK)))


def estimate_memory(gguf, args, ctx_size: int | None, device: torch.device,
                    dtype: torch.dtype = torch.float16, *,
                    quantized: bool | None = None) -> MemoryEstimate:
    """Weights and KV cache bytes of loading ``gguf`` on ``device`` (KV 0 if ctx_size is None;
    0 means the model's context length)."""
    if ctx_size == 0:
        ctx_size = args.context_length
    kv = kv_cache_bytes(args, ctx_size, device) if ctx_size else 0
    return MemoryEstimate(weight_bytes(gguf, device, dtype, quantized), kv, ctx_size)


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device``: CUDA's free memory, or the CPU's MemAvailable
    (/proc/meminfo; psutil elsewhere). None when it cannot be known."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil
    except ImportError:
        return None
    return int(psutil.virtual_memory().available)


def format_bytes(n: int) -> str:
    """``9.1 GiB`` / ``512.0 MiB``."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_memory(gguf, args, ctx_size: int | None, device: torch.device,
                 dtype: torch.dtype = torch.float16, *,
                 quantized: bool | None = None) -> MemoryEstimate:
    """Refuse a load that cannot fit in the free memory of ``device``.

    ``quantized``: the load keeps matrices in their file blocks (default: on CUDA).

    Returns the estimate (also when the check is skipped by ``LOCALLLM_SKIP_MEMORY_CHECK=1``
    or the free memory is unknown).
    Raises:
        LocalLLMError: one line naming the memory needed (weights + KV cache at --ctx-size)
            and the memory free.
    """
    est = estimate_memory(gguf, args, ctx_size, device, dtype, quantized=quantized)
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return est
    free = free_memory(device)
    if free is None or est.total <= free:
        return est
    parts = f"weights {format_bytes(est.weights)}"
    if ctx_size:
        parts += (f" + KV cache {format_bytes(est.kv_cache)} at --ctx-size "
                  f"{min(ctx_size, args.context_length)}")
    raise LocalLLMError(
        f"{gguf.path.name}: model needs {format_bytes(est.total)} ({parts}) but only "
        f"{format_bytes(free)} is free on {device.type} (lower --ctx-size, or set "
        f"{SKIP_ENV}=1 to try anyway)"
    )
