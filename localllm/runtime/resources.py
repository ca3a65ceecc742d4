"""Will the model fit? Memory needed by a load compared with what the device has free.

:func:`check_memory` runs after the GGUF header is read and before any weight is read, so a
model that cannot fit is refused in a fraction of a second with both figures, instead of
being killed by the OOM killer (CPU) or failing half-way with a CUDA out-of-memory error.

What a load stores (see ``localllm.models.base.bind`` and :mod:`localllm.memory`):

* weights of the torch backend: matrices dequantized to ``dtype`` (float16: 2 bytes per
  weight), vectors (norms, biases) as float32; of the quantized (Triton) backend, the
  default on CUDA: the tensors' bytes as in the file (the kernels read blocks directly;
  matrices of a type without a kernel are dequantized to ``dtype``); on CUDA plus ``CUDA_WORKSPACE`` bytes for activations;
* the KV cache at ``--ctx-size``: per layer 2 (K and V) x n_kv_heads x head_dim x cells x
  4 bytes (float32; 2 on CUDA and with the native backend, float16, see :func:`kv_dtype`), where a sliding-window layer holds ``window + RING_SLACK`` cells when
  that is less than the context (llama.cpp's SWA cache does the same).

* on the CPU, what else a load adds to the process (``MemoryEstimate.runtime``): the file's
  tensor bytes, whose memory-mapped pages stay resident once read; the vocabulary as Python
  objects and a sentencepiece/tokenizers model (:data:`VOCAB_TOKEN_BYTES` per token); and
  :data:`CPU_WORKSPACE` for activations, logits and torch's buffers during a decode step.

Measured against the real peak RSS a load and a decode step add (VmHWM minus the RSS before
the load; ``tests/test_resources.py``), the estimate for the default model is within 0.9-1.1x.

Free memory is the host's ``MemAvailable``, or less when the process's cgroup (v2
``memory.max`` / ``memory.current``, v1 ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``,
each less its reclaimable ``inactive_file``, over the cgroup and its ancestors) leaves less
room: in a container with a 500 MB limit a load that needs more is refused rather than
OOM-killed.

Setting ``LOCALLLM_SKIP_MEMORY_CHECK=1`` disables the check.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import InsufficientMemoryError
from ..memory import layout_bytes
from ..models import memory_layout
from ..models.base import DENSE_TENSORS, FLOAT32_MATRICES, layer_of

SKIP_ENV = "LOCALLLM_SKIP_MEMORY_CHECK"
CUDA_WORKSPACE = 256 * 2**20  # activations, logits and allocator slack on the GPU (bytes)
CPU_WORKSPACE = 64 * 2**20  # activations, logits and torch's buffers of a CPU decode step
VOCAB_TOKEN_BYTES = 512  # per token: its text, score and type as Python objects, the
# token-text index, the sentencepiece/tokenizers model (measured: 262,144 tokens, 130 MiB)
CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
_UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a number near 2^63


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes a load will add: ``weights`` (incl. any workspace), ``kv_cache`` and, on the
    CPU, ``runtime`` (mapped file pages, the vocabulary, the decode workspace)."""

    weights: int
    kv_cache: int
    ctx_size: int | None
    runtime: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.runtime


def weight_bytes(gguf, device: torch.device, dtype: torch.dtype = torch.float16,
                 quantized: bool | None = None) -> int:
    """Bytes of the weights once loaded on ``device`` (see the module docstring).

    ``quantized``: matrices stay in their file blocks (default: on CUDA), except those of a
    type the kernels do not handle (IQ2_XXS ...), which are dequantized to ``dtype`` at load.
    """
    if quantized is None:
        quantized = device.type == "cuda"
    kept = _kept_in_blocks(device) if quantized else (lambda t: False)
    workspace = CUDA_WORKSPACE if device.type == "cuda" else 0
    return workspace + sum(stored_bytes(t, kept(t), dtype) for t in gguf.tensors.values())


def _kept_in_blocks(device: torch.device):
    """Whether a tensor stays in its ggml blocks on ``device``: a type with a Triton kernel
    on CUDA, a type and width with a native kernel on the CPU (:mod:`localllm.cpu`)."""
    if device.type == "cpu":
        from ..cpu import supports as native

        return lambda t: native(t.qtype, t.shape[-1])
    from localllm.kernels import supports

    return lambda t: supports(t.qtype)


def stored_bytes(info, quantized: bool, dtype: torch.dtype = torch.float16) -> int:
    """Bytes the runtime holds for one GGUF tensor (a ``TensorInfo``): its file bytes when
    ``quantized`` and a matrix, else ``dtype`` elements for matrices, float32 for vectors, MoE
    routers and state-space parameters (``models.base.FLOAT32_MATRICES``, ``DENSE_TENSORS``)."""
    if len(info.shape) < 2 or layer_of(info.name)[1] in (*FLOAT32_MATRICES, *DENSE_TENSORS):
        return info.n_elements * 4
    if quantized:
        return info.n_bytes
    return info.n_elements * torch.empty((), dtype=dtype).element_size()


def kv_dtype(device: torch.device | str, *, half: bool = False) -> torch.dtype:
    """The KV cache element type: float16 on CUDA, and with ``half`` (the native backend's
    caches); else float32 (the CPU's torch backend)."""
    return torch.float16 if half or torch.device(device).type == "cuda" else torch.float32


def kv_cache_bytes(args, ctx_size: int, device: torch.device | str = "cpu", *,
                   half: bool = False, types=None) -> int:
    """Bytes of one session's memories at ``ctx_size`` tokens (capped at the model's context)
    on ``device``, from the architecture's ``memory_layout(args)`` (full layers hold the
    context, sliding-window layers ``window + RING_SLACK`` cells when that is less,
    recurrent layers their fixed state); ``half``: float16 on the CPU too (the native
    backend's caches); ``types``: the K and V
    :class:`~localllm.memory.CacheType` (``-ctk`` / ``-ctv``; None: the float default).

    ``args``: a model's validated ModelArgs.
    """
    ctx = max(1, min(ctx_size, args.context_length))
    return layout_bytes(memory_layout(args), ctx, kv_dtype(device, half=half).itemsize,
                        types=types)


def estimate_memory(gguf, args, ctx_size: int | None, device: torch.device,
                    dtype: torch.dtype = torch.float16, *,
                    quantized: bool | None = None, types=None) -> MemoryEstimate:
    """Weights and KV cache bytes of loading ``gguf`` on ``device`` (KV 0 if ctx_size is None;
    0 means the model's context length; ``types``: the KV cache's K and V types, see
    :func:`kv_cache_bytes`)."""
    if ctx_size == 0:
        ctx_size = args.context_length
    # The native backend (quantized on the CPU) keeps float16 caches unless dtype is float32.
    half = bool(quantized) and device.type == "cpu" and dtype != torch.float32
    kv = kv_cache_bytes(args, ctx_size, device, half=half, types=types) if ctx_size else 0
    return MemoryEstimate(weight_bytes(gguf, device, dtype, quantized), kv, ctx_size,
                          runtime_bytes(gguf, args, bool(quantized)) if device.type == "cpu"
                          else 0)


def runtime_bytes(gguf, args=None, quantized: bool = False) -> int:
    """What a CPU load adds besides weights and KV cache (see the module docstring); with
    ``quantized`` (the native backend) the mapped pages are the weights, counted once."""
    mapped = 0 if quantized else sum(t.n_bytes for t in gguf.tensors.values())
    n_vocab = len(gguf.metadata.get("tokenizer.ggml.tokens") or ())
    return mapped + VOCAB_TOKEN_BYTES * n_vocab + CPU_WORKSPACE


def free_memory(device: torch.device) -> int | None:
    """Bytes free on ``device``: CUDA's free memory, or on the CPU the least of the host's
    MemAvailable (/proc/meminfo; psutil elsewhere) and the room the cgroup leaves
    (:func:`cgroup_room`). None when it cannot be known."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    host = _host_available()
    room = cgroup_room()
    if host is None or room is None:
        return host if room is None else room
    return min(host, room)


def _host_available() -> int | None:
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


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _inactive_file(stat: Path) -> int:
    """Reclaimable page cache of a cgroup (``inactive_file`` in memory.stat), or 0."""
    try:
        for line in stat.read_text(encoding="ascii").splitlines():
            key, _, value = line.partition(" ")
            if key in ("inactive_file", "total_inactive_file"):
                return int(value)
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    return 0


def cgroup_room() -> int | None:
    """Bytes this process's cgroup and its ancestors still allow: the least of limit minus
    usage (less reclaimable page cache) over the cgroups that set a limit. cgroup v2
    (``memory.max`` / ``memory.current``) and v1 (``memory/memory.limit_in_bytes`` /
    ``memory.usage_in_bytes``); None without a limit or a readable cgroup."""
    try:
        lines = PROC_CGROUP.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
    dirs: list[tuple[Path, str, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.strip().lstrip("/")
        if controllers == "":  # v2, unified hierarchy
            dirs.append((CGROUP_ROOT / rel, "memory.max", "memory.current"))
        elif "memory" in controllers.split(","):  # v1 memory controller
            dirs.append((CGROUP_ROOT / "memory" / rel, "memory.limit_in_bytes",
                         "memory.usage_in_bytes"))
    best: int | None = None
    for leaf, limit_name, usage_name in dirs:
        base = CGROUP_ROOT if limit_name == "memory.max" else CGROUP_ROOT / "memory"
        d = leaf
        while True:  # the cgroup, then each ancestor up to the mount root
            limit = _read_int(d / limit_name)
            usage = _read_int(d / usage_name)
            if limit is not None and limit < _UNLIMITED and usage is not None:
                room = max(0, limit - max(0, usage - _inactive_file(d / "memory.stat")))
                best = room if best is None else min(best, room)
            if d == base or base not in d.parents:
                break
            d = d.parent
    return best


def format_bytes(n: int) -> str:
    """``9.1 GiB`` / ``512.0 MiB``."""
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def check_memory(gguf, args, ctx_size: int | None, device: torch.device,
                 dtype: torch.dtype = torch.float16, *,
                 quantized: bool | None = None, types=None) -> MemoryEstimate:
    """Refuse a load that cannot fit in the free memory of ``device``.

    ``quantized``: the load keeps matrices in their file blocks (default: on CUDA);
    ``types``: the KV cache's K and V types (:func:`kv_cache_bytes`).

    Returns the estimate (also when the check is skipped by ``LOCALLLM_SKIP_MEMORY_CHECK=1``
    or the free memory is unknown).
    Raises:
        InsufficientMemoryError: one line naming the memory needed (weights + KV cache at
            --ctx-size) and the memory free.
    """
    est = estimate_memory(gguf, args, ctx_size, device, dtype, quantized=quantized,
                          types=types)
    if os.environ.get(SKIP_ENV, "") not in ("", "0"):
        return est
    free = free_memory(device)
    if free is None or est.total <= free:
        return est
    parts = f"weights {format_bytes(est.weights)}"
    if est.runtime:
        parts += f" + runtime {format_bytes(est.runtime)}"
    if ctx_size:
        parts += (f" + KV cache {format_bytes(est.kv_cache)} at --ctx-size "
                  f"{min(ctx_size, args.context_length)}")
    raise InsufficientMemoryError(
        f"{gguf.path.name}: model needs {format_bytes(est.total)} ({parts}) but only "
        f"{format_bytes(free)} is free on {device.type} (lower --ctx-size, or set "
        f"{SKIP_ENV}=1 to try anyway)"
    )
