"""Per-layer memories of a single sequence, behind one interface.

A model declares, per layer, what it must remember between forward passes
(``memory_layout(args)`` in its module): a :class:`KVSpec` (keys and values of every position,
or of a sliding window), a :class:`LatentSpec` (one compressed vector per position: MLA) or a
:class:`RecurrentSpec` (a fixed-size state: a short-convolution window and an SSM or delta-net
matrix). :func:`make_memory` builds a :class:`Memory` from that layout; the runtime
(``runtime/session.py``) then only calls :class:`Memory`'s methods, which apply
:class:`LayerMemory`'s operations to every layer:

* append: the model's attention or mixer writes at positions ``n .. n+T-1`` (the layer's own
  methods, called by the backend's ops);
* ``seq_len``: how many positions the layer holds;
* ``restorable(n)``: the longest prefix ``m <= n`` the layer can go back to without
  recomputation (a full cache: any; a ring: while its window is still in it; a recurrent
  state: a checkpoint), and ``truncate(m)``;
* ``checkpoint()``: remember the present state so that a later ``truncate`` can come back to
  it (llama.cpp's context checkpoints, ``--ctx-checkpoints``; a no-op where truncation is
  free);
* ``state()`` / ``load_state()``: the tensors of a prompt-cache file and their inverse.

Per-session hyperparameters that depend on the context size (phi3's long/short RoPE factors)
are read from :attr:`Memory.ctx_size` by the model's forward, never stored on the shared
model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from .kv import RING_SLACK, KVCache, RingKVCache, attention_mask, query_window
from .kvtypes import CACHE_TYPES, BlockRows, CacheType, cache_type
from .latent import LatentCache
from .recurrent import Checkpoints, RecurrentState

__all__ = [
    "CACHE_TYPES",
    "DEFAULT_CHECKPOINTS",
    "RING_SLACK",
    "BlockRows",
    "CacheType",
    "Checkpoints",
    "KVCache",
    "KVSpec",
    "LatentCache",
    "LatentSpec",
    "LayerMemory",
    "Memory",
    "RecurrentSpec",
    "RecurrentState",
    "RingKVCache",
    "attention_mask",
    "cache_type",
    "check_cache_types",
    "layout_bytes",
    "make_memory",
    "query_window",
]

# Context checkpoints kept per sequence (llama.cpp's --ctx-checkpoints default).
DEFAULT_CHECKPOINTS = 8

# The element types of a KV cache's keys and values (None: the float type of the caches'
# dtype), llama.cpp's -ctk / -ctv.
KVTypes = tuple[CacheType | None, CacheType | None]


@runtime_checkable
class LayerMemory(Protocol):
    """What the runtime needs of one layer's memory (see the module docstring)."""

    @property
    def seq_len(self) -> int: ...

    @property
    def nbytes(self) -> int: ...

    cheap_rewind: bool  # forgets a few just-appended positions without recomputation

    def set_length(self, n: int) -> None:
        """Record that positions ``0 .. n-1`` are held (after a static-shape decode step,
        whose write the device computed)."""

    def restorable(self, n: int) -> int:
        """The largest ``m <= n`` this memory can be truncated to without recomputation."""

    def truncate(self, n: int) -> None:
        """Forget positions ``n ..``; ``n`` must be :meth:`restorable`."""

    def checkpoint(self) -> None:
        """Remember the present state for a later :meth:`truncate` (may do nothing)."""

    def wants_checkpoints(self, upto: int) -> bool:
        """Whether checkpoints taken before position ``upto`` could ever be used (a
        recurrent state: always; a ring: once it wraps; a full cache: never)."""

    def reset(self) -> None: ...

    def rewritten(self) -> list[torch.Tensor]:
        """The tensors a step rewrites in place beyond the cells of its own positions (a
        recurrent state: all of it), which must be restored to repeat a step (a CUDA graph's
        warm-up runs the step before it is captured)."""

    def describe(self) -> str:
        """The geometry, as stored in a prompt-cache file (``full``, ``ring1280`` ...)."""

    def state(self) -> dict[str, torch.Tensor]:
        """The tensors that restore the present state (on the memory's device)."""

    def load_state(self, state: dict[str, torch.Tensor], n: int) -> None:
        """Replace the state by ``state`` (from :meth:`state`) holding ``n`` positions.

        Raises:
            ValueError: a tensor is missing, mis-shaped, of the wrong dtype, or inconsistent
                with ``n`` (the memory is then reset).
        """


@dataclass(frozen=True)
class KVSpec:
    """Keys and values of one attention layer: every position (``window`` None), or a
    sliding window of the last ``window`` positions (a ring of ``window + slack`` cells when
    that is smaller than the context). ``head_dim_v``: the value head size when it differs
    from the key's. ``chunked``: chunked local attention in chunks of ``window`` positions
    (Llama 4; a query sees the keys of its own chunk, all within its last ``window``
    positions, so the same ring holds them).

    Byte counts take ``itemsize`` (bytes per element of a float cache) or, where given,
    ``types``: the K and V :class:`~localllm.memory.kvtypes.CacheType` (a block type counts
    its block bytes: q8_0 34 bytes per 32 values, llama.cpp's ``ggml_row_size``)."""

    n_kv_heads: int
    head_dim: int
    window: int | None = None
    head_dim_v: int | None = None
    chunked: bool = False

    def __post_init__(self) -> None:
        if self.chunked and not self.window:
            raise ValueError("a chunked KVSpec needs its chunk size as the window")

    def cells(self, ctx_size: int, slack: int = RING_SLACK) -> int:
        """Positions held at ``ctx_size``: the context, or ``window + slack`` for a ring."""
        if self.window and self.window < ctx_size:
            return self.window + slack
        return ctx_size

    def nbytes(self, ctx_size: int, itemsize: int, slack: int = RING_SLACK,
               types: KVTypes | None = None) -> int:
        return self._cell_bytes(itemsize, types) * self.cells(ctx_size, slack)

    def step_bytes(self, pos: int, itemsize: int, slack: int = RING_SLACK,
                   types: KVTypes | None = None) -> int:
        """Bytes a decode step at position ``pos`` reads: the live cells, at most the ring."""
        return self._cell_bytes(itemsize, types) * min(pos + 1, self.cells(1 << 62, slack))

    def _cell_bytes(self, itemsize: int, types: KVTypes | None) -> int:
        dk, dv = self.head_dim, self.head_dim_v or self.head_dim
        tk, tv = types or (None, None)
        size_k = tk.row_bytes(dk) if tk is not None else dk * itemsize
        size_v = tv.row_bytes(dv) if tv is not None else dv * itemsize
        return (size_k + size_v) * self.n_kv_heads

    def make(self, ctx_size: int, *, dtype: torch.dtype, device, slack: int,
             checkpoints: int, types: KVTypes = (None, None)) -> KVCache | RingKVCache:
        type_k, type_v = types
        chunk = self.window if self.chunked else None
        if self.window and self.window < ctx_size:
            return RingKVCache(self.window, self.n_kv_heads, self.head_dim, slack=slack,
                               dtype=dtype, device=device, head_dim_v=self.head_dim_v,
                               checkpoints=checkpoints, chunk=chunk, type_k=type_k,
                               type_v=type_v)
        return KVCache(ctx_size, self.n_kv_heads, self.head_dim, dtype=dtype, device=device,
                       head_dim_v=self.head_dim_v, chunk=chunk, type_k=type_k, type_v=type_v)


@dataclass(frozen=True)
class LatentSpec:
    """One vector of ``dim`` values per position (multi-head latent attention, DeepSeek-V2:
    the compressed KV of ``kv_lora_rank`` values plus the decoupled RoPE key)."""

    dim: int

    def nbytes(self, ctx_size: int, itemsize: int, slack: int = RING_SLACK,
               types: KVTypes | None = None) -> int:
        return self.dim * itemsize * ctx_size

    def step_bytes(self, pos: int, itemsize: int, slack: int = RING_SLACK,
                   types: KVTypes | None = None) -> int:
        return self.dim * itemsize * (pos + 1)

    def make(self, ctx_size: int, *, dtype: torch.dtype, device, slack: int,
             checkpoints: int, types: KVTypes = (None, None)) -> LatentCache:
        # The latent vector is not a K/V row: it stays in dtype whatever -ctk/-ctv say.
        return LatentCache(ctx_size, self.dim, dtype=dtype, device=device)


@dataclass(frozen=True)
class RecurrentSpec:
    """A fixed-size recurrent state: named float32 tensors of fixed shapes (for example
    ``conv`` (d_conv - 1, channels) and ``ssm`` (heads, d_state, head_dim)), llama.cpp's
    ``llama_memory_recurrent`` r/s tensors."""

    shapes: tuple[tuple[str, tuple[int, ...]], ...]

    def nbytes(self, ctx_size: int, itemsize: int, slack: int = RING_SLACK,
               types: KVTypes | None = None) -> int:
        return sum(4 * _numel(s) for _, s in self.shapes)

    def step_bytes(self, pos: int, itemsize: int, slack: int = RING_SLACK,
                   types: KVTypes | None = None) -> int:
        return self.nbytes(pos + 1, itemsize, slack)  # the whole state, read and written

    def make(self, ctx_size: int, *, dtype: torch.dtype, device, slack: int,
             checkpoints: int, types: KVTypes = (None, None)) -> RecurrentState:
        return RecurrentState(dict(self.shapes), device=device, checkpoints=checkpoints)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


Spec = KVSpec | LatentSpec | RecurrentSpec


def layout_bytes(layout: Sequence[Spec], ctx_size: int, itemsize: int,
                 slack: int = RING_SLACK, types: KVTypes | None = None) -> int:
    """Bytes of the memories of ``layout`` at ``ctx_size`` positions, KV and latent caches of
    ``itemsize``-byte elements, or KV caches of the K and V ``types`` where given (recurrent
    states are float32); checkpoints not counted."""
    return sum(spec.nbytes(ctx_size, itemsize, slack, types) for spec in layout)


class Memory(Sequence):
    """The memories of every layer of one sequence, and the context size they were made for.

    Indexing and iteration give the layers' memories (what a model's forward passes to its
    ops); the methods below are what the runtime calls.
    """

    def __init__(self, layers: list[LayerMemory], ctx_size: int) -> None:
        self.layers = layers
        self.ctx_size = ctx_size

    def __getitem__(self, i):
        return self.layers[i]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[LayerMemory]:
        return iter(self.layers)

    @property
    def seq_len(self) -> int:
        return min((m.seq_len for m in self.layers), default=0)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.layers)

    @property
    def cheap_rewind(self) -> bool:
        """Whether every layer forgets a few just-appended positions without recomputation
        (KV, ring and latent caches; not recurrent states): what speculative decoding's
        rejected guesses need."""
        return all(m.cheap_rewind for m in self.layers)

    def set_length(self, n: int) -> None:
        for m in self.layers:
            m.set_length(n)

    def restorable(self, n: int) -> int:
        """The longest prefix ``m <= n`` every layer can go back to (a fixed point: a layer
        that can only restore an earlier position pulls the others back to it)."""
        m = n
        while True:
            lo = min((mem.restorable(m) for mem in self.layers), default=m)
            if lo == m:
                return m
            m = lo

    def truncate(self, n: int) -> None:
        for m in self.layers:
            m.truncate(n)

    def checkpoint(self) -> None:
        for m in self.layers:
            m.checkpoint()

    def wants_checkpoints(self, upto: int) -> bool:
        return any(m.wants_checkpoints(upto) for m in self.layers)

    def reset(self) -> None:
        for m in self.layers:
            m.reset()

    def describe(self) -> str:
        return ",".join(m.describe() for m in self.layers)

    def state(self) -> dict[str, torch.Tensor]:
        """Every layer's :meth:`LayerMemory.state`, keys prefixed ``{layer}.``."""
        return {f"{i}.{k}": v for i, m in enumerate(self.layers) for k, v in m.state().items()}

    def load_state(self, tensors: dict[str, torch.Tensor], n: int) -> None:
        """The inverse of :meth:`state` for ``n`` positions.

        Raises:
            ValueError: a layer's tensors are missing or malformed (every layer is reset).
        """
        try:
            for i, m in enumerate(self.layers):
                pre = f"{i}."
                m.load_state({k[len(pre):]: v for k, v in tensors.items()
                              if k.startswith(pre)}, n)
        except ValueError as e:
            self.reset()
            raise ValueError(f"layer {i}: {e}") from None


def check_cache_types(layout: Sequence[Spec], types: KVTypes) -> None:
    """Raises UnsupportedError: a block type of ``types`` (K, V) whose block does not divide
    the head size of a KV layer of ``layout`` (ggml's blocks run along a row)."""
    for spec in layout:
        if isinstance(spec, KVSpec):
            if types[0] is not None:
                types[0].check_dim(spec.head_dim, "key")
            if types[1] is not None:
                types[1].check_dim(spec.head_dim_v or spec.head_dim, "value")


def make_memory(layout: Sequence[Spec], ctx_size: int, *, dtype: torch.dtype, device,
                slack: int = RING_SLACK, checkpoints: int = DEFAULT_CHECKPOINTS,
                types: KVTypes = (None, None)) -> Memory:
    """The :class:`Memory` of an architecture's ``memory_layout(args)`` at ``ctx_size``
    positions: KV and latent caches of ``dtype`` elements on ``device`` (KV caches of the K
    and V ``types`` where given: llama.cpp's ``-ctk`` / ``-ctv``), rings of
    ``window + slack`` cells, at most ``checkpoints`` context checkpoints per layer that
    needs them.

    Raises:
        UnsupportedError: a block type whose block does not divide a head size.
    """
    return Memory([spec.make(ctx_size, dtype=dtype, device=device, slack=slack,
                             checkpoints=checkpoints, types=types) for spec in layout], ctx_size)
