"""Key/value caches of attention layers, preallocated so that decoding never allocates.

* :class:`KVCache` holds every position up to the context size (global-attention layers).
* :class:`RingKVCache` holds the last ``window + slack`` positions of a sliding-window layer
  (Gemma 3's local layers, Mistral-style SWA). Cells are written at ``position % size``;
  the absolute position of each cell is kept beside it, so RoPE and the attention mask use
  absolute positions while the write index wraps. The ``slack`` lets a caller roll back up
  to ``slack`` tokens (chat turns re-rendered by the template) without recomputation, as
  llama.cpp's SWA cache keeps ``n_swa + n_ubatch`` cells; beyond that, a wrapped ring comes
  back to a context checkpoint (:meth:`RingKVCache.checkpoint`).

``update(pos, k, v)`` writes ``T`` new positions and returns the keys, values and their
absolute positions that the new queries attend over (None when cell ``j`` holds position
``j``); :func:`attention_mask` turns those positions into the boolean mask.

Static decode (CUDA graphs) uses :meth:`update_static` / :meth:`written_static` instead: the
position is a (1,) int64 tensor on the cache's device, the write goes through
``index_copy_`` at an index computed on the device and the whole buffer is returned
(positions past ``pos`` are masked), so the step has the same shapes and addresses at every
position and issues no host read; the runtime records the new length with ``set_length``.
"""

from __future__ import annotations

import torch

from .kvtypes import CACHE_TYPES, BlockRows, CacheType
from .recurrent import Appendable, Checkpoints

# Extra cells kept by sliding-window caches so that a rollback of up to this many tokens
# (a chat turn re-rendered by its template) needs no recomputation.
RING_SLACK = 256


def attention_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor | int, window: int | None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Boolean (T, S) mask, True where query ``i`` may attend to key ``j``.

    Causal over absolute positions; keys with position -1 are empty cells. ``k_positions``
    may be the number of keys S instead, when cell ``j`` holds position ``j``. With a
    ``window``, a query at p sees keys at p - window + 1 .. p (llama.cpp's standard SWA).
    With a ``chunk`` (chunked local attention, Llama 4: llama.cpp's LLAMA_SWA_TYPE_CHUNKED,
    ``llama_hparams::is_masked_swa``), a query at p sees only the keys of its own chunk,
    floor(p / chunk) * chunk .. p.
    """
    if isinstance(k_positions, int):
        k_positions = torch.arange(k_positions, device=q_positions.device)
    q = q_positions[:, None]
    k = k_positions[None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= q - k < window
    if chunk is not None:
        mask &= k >= torch.div(q, chunk, rounding_mode="floor") * chunk
    return mask


def query_window(cache, pos: int) -> int | None:
    """The window of keys one query at ``pos`` sees in ``cache`` (a :class:`KVCache` or
    :class:`RingKVCache`): its own window, or for a chunked layer the keys from the start of
    the query's chunk, ``pos % chunk + 1`` of them (what lets one-token kernels that take a
    window run chunked attention unchanged)."""
    if cache.chunk is None:
        return cache.window
    w = pos % cache.chunk + 1
    return w if cache.window is None else min(w, cache.window)


def _heads(cache) -> str:
    """``{kv heads}x{key size}x{value size}`` of a cache, for :meth:`describe`."""
    return f"{cache.k.shape[0]}x{cache.dim_k}x{cache.dim_v}"


def _chunk(cache) -> str:
    """The chunk size of a chunked cache for :meth:`describe` (``:chunk8192``), or ``""``."""
    return f":chunk{cache.chunk}" if cache.chunk else ""


def _check_float(name: str, t: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    if t is None:
        raise ValueError(f"no tensor {name!r}")
    if not t.is_floating_point() or tuple(t.shape) != shape:
        raise ValueError(f"{name!r} is {t.dtype} {tuple(t.shape)}, expected floats {shape}")
    if not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name!r} holds non-finite values")
    return t


def _check_rows(name: str, t: torch.Tensor | None, ctype: CacheType, shape: tuple[int, ...],
                dim: int) -> torch.Tensor:
    """A state tensor of a cache of ``ctype``: floats (float types), or uint8 blocks whose
    values are finite (block types); ``shape`` is the stored shape."""
    if not ctype.quantized:
        return _check_float(name, t, shape)
    if t is None:
        raise ValueError(f"no tensor {name!r}")
    if t.dtype != torch.uint8 or tuple(t.shape) != shape:
        raise ValueError(f"{name!r} is {t.dtype} {tuple(t.shape)}, expected {ctype.name} "
                         f"blocks uint8 {shape}")
    if not bool(torch.isfinite(ctype.decode(t, dim)).all()):
        raise ValueError(f"{name!r} holds non-finite values")
    return t


def _types(dtype: torch.dtype, type_k: CacheType | None,
           type_v: CacheType | None) -> tuple[CacheType, CacheType]:
    """The K and V types of a cache: those given, else the float type of ``dtype``."""
    default = next(c for c in CACHE_TYPES.values() if c.dtype == dtype)
    return type_k or default, type_v or default


class _Rows:
    """What KV caches share: their element types and the conversions between the rows the
    attention computes (float32) and the cells' storage (see :mod:`.kvtypes`)."""

    k: torch.Tensor
    v: torch.Tensor

    def _alloc(self, n_kv_heads: int, size: int, head_dim: int, head_dim_v: int | None, *,
               dtype: torch.dtype, device, type_k: CacheType | None,
               type_v: CacheType | None) -> None:
        self.type_k, self.type_v = _types(dtype, type_k, type_v)
        self.dim_k, self.dim_v = head_dim, head_dim_v or head_dim
        self.type_k.check_dim(self.dim_k, "key")
        self.type_v.check_dim(self.dim_v, "value")
        self.k = torch.zeros(n_kv_heads, size, self.type_k.storage_dim(self.dim_k),
                             dtype=self.type_k.dtype, device=device)
        self.v = torch.zeros(n_kv_heads, size, self.type_v.storage_dim(self.dim_v),
                             dtype=self.type_v.dtype, device=device)

    def encode(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k (n_kv_heads, T, head_dim), v (.., head_dim_v) float -> as the cells hold them."""
        return self.type_k.encode(k), self.type_v.encode(v)

    def view(self, k: torch.Tensor, v: torch.Tensor):
        """Stored keys and values as the attention reads them: the tensors (float types) or
        :class:`~localllm.memory.kvtypes.BlockRows` (block types)."""
        if self.type_k.quantized:
            k = BlockRows(k, self.type_k, self.dim_k)
        if self.type_v.quantized:
            v = BlockRows(v, self.type_v, self.dim_v)
        return k, v

    @property
    def quantized(self) -> bool:
        """Whether keys or values are stored in blocks."""
        return self.type_k.quantized or self.type_v.quantized



class KVCache(_Rows, Appendable):
    """Keys and values of positions ``0 .. size-1``.

    Args:
        size: context size in tokens.
        n_kv_heads, head_dim: per-layer geometry (``head_dim_v``: the values' head size,
            default ``head_dim``).
        type_k, type_v: element types (:mod:`.kvtypes`); default: the float type of ``dtype``.
    Tensors ``k`` (n_kv_heads, size, head_dim) and ``v`` (n_kv_heads, size, head_dim_v) of
    the types' dtypes; for a block type, uint8 (n_kv_heads, size, row bytes).
    Raises:
        UnsupportedError: a block type whose block does not divide the head size.
    """

    window: int | None = None
    positions: torch.Tensor | None = None  # cell j holds position j

    def __init__(self, size: int, n_kv_heads: int, head_dim: int, *, dtype: torch.dtype,
                 device, head_dim_v: int | None = None, chunk: int | None = None,
                 type_k: CacheType | None = None, type_v: CacheType | None = None) -> None:
        self.size = size
        self.chunk = chunk  # chunked local attention (attention_mask), or None
        self._alloc(n_kv_heads, size, head_dim, head_dim_v, dtype=dtype, device=device,
                    type_k=type_k, type_v=type_v)
        self.n = 0  # positions 0 .. n-1 are valid

    # ---- the attention's side -------------------------------------------------------------
    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor):
        """Write ``k``/``v`` (n_kv_heads, T, head_dim) at positions ``pos .. pos+T-1``.

        Returns (keys, values, None): (n_kv_heads, pos + T, head_dim) views where cell ``j``
        holds position ``j`` (:class:`~localllm.memory.kvtypes.BlockRows` for block types).
        """
        end = pos + k.shape[1]
        k, v = self.encode(k, v)
        self.k[:, pos:end] = k
        self.v[:, pos:end] = v
        self.n = end
        return *self.view(self.k[:, :end], self.v[:, :end]), None

    def update_static(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """:meth:`update` of one token at a (1,) device position: the whole buffers."""
        k, v = self.encode(k, v)
        self.k.index_copy_(1, pos, k)
        self.v.index_copy_(1, pos, v)
        return *self.view(self.k, self.v), None

    def decode_slot(self, pos: int, t: int = 1) -> tuple[int, int, torch.Tensor | None]:
        """The bookkeeping of an :meth:`update` of ``t`` tokens at ``pos`` whose writes the
        caller does itself (the native CPU step).

        Returns (slot, live, positions): the new tokens go to cells slot .. slot+t-1, the
        queries attend over the first ``live`` cells (the new ones included), and cell
        positions are None here (cell j holds position j).
        """
        self.n = pos + t
        return pos, pos + t, None

    def written(self, pos: int):
        """After a kernel stored one token's k/v at cell ``pos`` (the Triton decode step):
        the bookkeeping and the return of ``update(pos, k, v)`` for T = 1."""
        self.n = pos + 1
        return *self.view(self.k[:, : pos + 1], self.v[:, : pos + 1]), None

    def written_static(self):
        """:meth:`written` of a static-shape step: the whole buffers."""
        return *self.view(self.k, self.v), None

    # ---- the runtime's side (memory.LayerMemory) ------------------------------------------
    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes

    def describe(self) -> str:
        return f"full:{_heads(self)}{_chunk(self)}"

    def state(self) -> dict[str, torch.Tensor]:
        return {"k": self.k[:, : self.n], "v": self.v[:, : self.n]}

    def load_state(self, state: dict[str, torch.Tensor], n: int) -> None:
        hk, _, dk = self.k.shape
        dv = self.v.shape[2]
        if not 0 <= n <= self.size:
            raise ValueError(f"{n} positions do not fit in {self.size} cells")
        k = _check_rows("k", state.get("k"), self.type_k, (hk, n, dk), self.dim_k)
        v = _check_rows("v", state.get("v"), self.type_v, (hk, n, dv), self.dim_v)
        self.k[:, :n] = k
        self.v[:, :n] = v
        self.n = n


class RingKVCache(_Rows):
    """Keys and values of the last ``size = window + slack`` positions, in a ring.

    ``positions[i]`` is the absolute position held by cell ``i`` (-1 when empty). At most
    ``checkpoints`` copies of a wrapped ring are kept by :meth:`checkpoint`. Element types as
    :class:`KVCache`'s.
    """

    cheap_rewind = True  # see memory.LayerMemory

    def __init__(self, window: int, n_kv_heads: int, head_dim: int, *, slack: int,
                 dtype: torch.dtype, device, head_dim_v: int | None = None,
                 checkpoints: int = 0, chunk: int | None = None,
                 type_k: CacheType | None = None, type_v: CacheType | None = None) -> None:
        self.window = window
        # chunked local attention (attention_mask): a query sees its own chunk only, a
        # subset of the window when window == chunk, so the ring holds what it needs
        self.chunk = chunk
        self.size = window + slack
        self._alloc(n_kv_heads, self.size, head_dim, head_dim_v, dtype=dtype, device=device,
                    type_k=type_k, type_v=type_v)
        self.positions = torch.full((self.size,), -1, dtype=torch.long, device=device)
        self.n = 0  # next absolute position expected
        # Until the ring wraps, cell j holds position j (or nothing): attention then reads
        # only cells 0 .. pos+T-1, the live cells, instead of the whole ring.
        self.linear = True
        self.checkpoints = Checkpoints(checkpoints)

    # ---- the attention's side -------------------------------------------------------------
    def update(self, pos: int, k: torch.Tensor, v: torch.Tensor):
        """Attend over the ring's valid cells plus the ``T`` new positions, then store them.

        Returns (keys, values, key_positions): before the ring first wraps (pos + T <= size),
        the S = pos + T live cells, cell j holding position j; after, S = size + T entries
        (S = size when T = 1) where empty cells and positions at or after ``pos`` carry
        position -1 (masked out).
        """
        t = k.shape[1]
        device = self.k.device
        if pos + t > self.size:
            self.linear = False
        k, v = self.encode(k, v)  # rounded (quantized) as the cells will hold them
        if self.linear:  # before the ring wraps: write in place, attend over the live prefix
            end = pos + t
            self.k[:, pos:end] = k
            self.v[:, pos:end] = v
            self.positions[pos:end] = torch.arange(pos, end, device=device)
            self.n = end
            return *self.view(self.k[:, :end], self.v[:, :end]), self.positions[:end]
        if t == 1:
            # Decode: write first, then the ring itself holds the window (no concatenation).
            slot = pos % self.size
            self.k[:, slot] = k[:, 0]
            self.v[:, slot] = v[:, 0]
            self.positions[slot] = pos
            self.n = pos + 1
            return *self.view(self.k, self.v), self.positions
        old_pos = torch.where(self.positions < pos, self.positions, -1)
        new_pos = torch.arange(pos, pos + t, device=device)
        keys = torch.cat([self.k, k], dim=1)
        values = torch.cat([self.v, v], dim=1)
        positions = torch.cat([old_pos, new_pos])
        # Store only the last `size` of the new positions (older ones are out of every window).
        keep = min(t, self.size)
        slots = new_pos[t - keep :] % self.size
        self.k[:, slots] = k[:, t - keep :]
        self.v[:, slots] = v[:, t - keep :]
        self.positions[slots] = new_pos[t - keep :]
        self.n = pos + t
        return *self.view(keys, values), positions

    def update_static(self, pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """:meth:`update` of one token at a (1,) device position: the cell is computed on
        the device; returns the whole ring."""
        slot = pos % self.size
        k, v = self.encode(k, v)
        self.k.index_copy_(1, slot, k)
        self.v.index_copy_(1, slot, v)
        self.positions.index_copy_(0, slot, pos)
        return *self.view(self.k, self.v), self.positions

    def decode_slot(self, pos: int, t: int = 1) -> tuple[int, int, torch.Tensor] | None:
        """The bookkeeping of an :meth:`update` of ``t`` tokens at ``pos`` whose writes the
        caller does itself (the native CPU step).

        Returns (slot, live, positions): the new tokens go to cells slot .. slot+t-1, the
        queries attend over the first ``live`` cells (the live prefix before the ring wraps,
        the whole ring after), and the caller stores the new positions in
        :attr:`positions` at those cells; cells whose position is -1, after the query's or
        outside the window are masked. None (nothing changed) for several tokens once the
        ring has wrapped: their cells are not contiguous and the oldest ones are still
        visible to the first queries, so :meth:`update` must do it.
        """
        linear = self.linear and pos + t <= self.size
        if not linear and t > 1:
            return None
        self.linear = linear
        self.n = pos + t
        if linear:
            return pos, pos + t, self.positions
        return pos % self.size, self.size, self.positions

    def written(self, pos: int):
        """After a kernel stored one token's k/v at cell ``pos % size`` and ``pos`` in
        ``positions`` (the Triton decode step): the bookkeeping and the return of
        ``update(pos, k, v)`` for T = 1."""
        end = pos + 1
        if end > self.size:
            self.linear = False
        self.n = end
        if self.linear:
            return *self.view(self.k[:, :end], self.v[:, :end]), self.positions[:end]
        return *self.view(self.k, self.v), self.positions

    def written_static(self):
        """:meth:`written` of a static-shape step: the whole ring."""
        return *self.view(self.k, self.v), self.positions

    # ---- the runtime's side (memory.LayerMemory) ------------------------------------------
    @property
    def seq_len(self) -> int:
        return self.n

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.positions.nbytes + self.checkpoints.nbytes

    def set_length(self, n: int) -> None:
        self.n = n
        if n > self.size:
            self.linear = False

    def _holds_window(self, n: int) -> bool:
        """True when positions ``n - window .. n - 1`` are all still in the ring."""
        lo = max(0, n - self.window)
        if n > self.n:
            return False
        held = self.positions[(self.positions >= lo) & (self.positions < n)]
        return held.numel() == n - lo

    def restorable(self, n: int) -> int:
        n = min(n, self.n)
        if self._holds_window(n):
            return n
        at = self.checkpoints.best(n)
        return at if at is not None else 0

    def truncate(self, n: int) -> None:
        n = min(n, self.n)
        self.checkpoints.drop_after(n)
        if n == 0:
            self.reset()
        elif self._holds_window(n):
            self.positions[self.positions >= n] = -1
            self.n = n
        else:
            saved = self.checkpoints.get(n)
            if saved is None:
                raise ValueError(f"the ring cannot go back to position {n}")
            self.k.copy_(saved["k"])
            self.v.copy_(saved["v"])
            self.positions.copy_(saved["positions"])
            self.n, self.linear = n, False

    def wants_checkpoints(self, upto: int) -> bool:
        """A ring that will have wrapped by position ``upto`` can only come back to positions
        older than its slack through a checkpoint."""
        return self.checkpoints.limit > 0 and upto > self.size

    def checkpoint(self) -> None:
        if not self.linear:
            self.checkpoints.save(self.n, {"k": self.k, "v": self.v,
                                           "positions": self.positions})

    def reset(self) -> None:
        self.positions.fill_(-1)
        self.n = 0
        self.linear = True
        self.checkpoints.clear()

    def rewritten(self) -> list[torch.Tensor]:
        return []  # a step writes only the cells of its own positions

    def describe(self) -> str:
        return f"ring{self.size}:{_heads(self)}{_chunk(self)}"

    def state(self) -> dict[str, torch.Tensor]:
        return {"k": self.k, "v": self.v, "positions": self.positions}

    def load_state(self, state: dict[str, torch.Tensor], n: int) -> None:
        k = _check_rows("k", state.get("k"), self.type_k, tuple(self.k.shape), self.dim_k)
        v = _check_rows("v", state.get("v"), self.type_v, tuple(self.v.shape), self.dim_v)
        pos = state.get("positions")
        if pos is None or pos.dtype != torch.int64 or tuple(pos.shape) != (self.size,):
            raise ValueError(f"'positions' must be int64 ({self.size},)")
        held = pos[pos >= 0]
        if bool(((pos < -1) | (pos >= n)).any()):
            raise ValueError(f"a cell position is outside -1 .. {n - 1}")
        slots = torch.nonzero(pos >= 0).flatten().to(pos.device)
        if bool((held % self.size != slots).any()):
            raise ValueError("a cell holds a position that does not belong to it")
        lo = max(0, n - self.window)
        if int(((held >= lo) & (held < n)).sum()) != n - lo:
            raise ValueError(f"the ring does not hold the window before position {n}")
        self.k.copy_(k)
        self.v.copy_(v)
        self.positions.copy_(pos)
        self.n = n
        self.linear = n <= self.size and bool((held == slots).all())
        self.checkpoints.clear()
