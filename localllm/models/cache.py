"""Per-layer KV caches for a single sequence.

Both caches are preallocated, so decoding never allocates cache memory:

* :class:`KVCache` holds every position up to the context size (global-attention layers).
* :class:`RingKVCache` holds the last ``window + slack`` positions of a sliding-window layer
  (Gemma 3's local layers, Mistral-style SWA). Slots are written at ``position % size``;
  the absolute position of each slot is kept beside it, so RoPE and the attention mask use
  absolute positions while the write index wraps. The ``slack`` lets a caller roll back
  up to ``slack`` tokens (chat turns re-rendered by the template) without recomputation,
  as llama.cpp's SWA cache keeps ``n_swa + n_ubatch`` cells.

``update(pos, k, v)`` writes ``T`` new positions and returns the keys, values and their
absolute positions that the new queries attend over (None when slot ``j`` holds position
``j``); :func:`attention_mask` turns those positions into the boolean mask.

Static decode (CUDA graphs): ``pos`` may be a (1,) int64 tensor on the cache's device instead
of an int. The write then goes through ``index_copy_`` at an index computed on the device and
the whole buffer is returned (positions past ``pos`` are masked), so the step has the same
shapes and addresses at every position and issues no host read. The caller records the
new length with :meth:`KVCache.set_length`, which the int path does itself.

On CUDA and with the native CPU kernels the caches hold float16 (llama.cpp's default KV
type: half the memory, and half the bytes read per decoded token); on the CPU's torch
backend float32.
"""

from __future__ import annotations

import torch

# Extra cells kept by sliding-window caches so that a rollback of up to this many tokens
# (a chat turn re-rendered by its template) needs no recomputation.
RING_SLACK = 256


def kv_dtype(device, *, half: bool = False) -> torch.dtype:
    """The KV cache element type on ``device``: float16 on CUDA, and with ``half`` (the
    native CPU backend's caches, which ``localllm/cpu/csrc/ops.cpp`` reads); else float32."""
    return torch.float16 if half or torch.device(device).type == "cuda" else torch.float32


class KVCache:
    """Keys and values of positions ``0 .. size-1``.

    Args:
        size: context size in tokens.
        n_kv_heads, head_dim: per-layer geometry.
    Tensors ``k``/``v`` have shape (n_kv_heads, size, head_dim).
    """

    window: int | None = None

    def __init__(
        self, size: int, n_kv_heads: int, head_dim: int, *, dtype: torch.dtype, device
    ) -> None:
        self.size = size
        self.k = torch.zeros(n_kv_heads, size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.n = 0  # positions 0 .. n-1 are valid

    def update(self, pos: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Write ``k``/``v`` (n_kv_heads, T, head_dim) at positions ``pos .. pos+T-1``.

        Returns (keys, values, None): (n_kv_heads, S, head_dim) twice, where slot ``j`` holds
        position ``j``; S = pos + T, or the whole ``size`` when ``pos`` is a tensor (T = 1).
        """
        if isinstance(pos, torch.Tensor):
            self.k.index_copy_(1, pos, k.to(self.k.dtype))
            self.v.index_copy_(1, pos, v.to(self.v.dtype))
            return self.k, self.v, None
        end = pos + k.shape[1]
        self.k[:, pos:end] = k
        self.v[:, pos:end] = v
        self.n = end
        return self.k[:, :end], self.v[:, :end], None

    def decode_slot(self, pos: int, t: int = 1) -> tuple[int, int, torch.Tensor | None]:
        """The bookkeeping of an :meth:`update` of ``t`` tokens at ``pos`` whose writes the
        caller does itself (the native CPU step, :class:`~localllm.models.common.NativeOps`).

        Returns (slot, live, positions): the new tokens go to cells slot .. slot+t-1, the
        queries attend over the first ``live`` cells (the new ones included), and cell
        positions are None here (cell j holds position j).
        """
        self.n = pos + t
        return pos, pos + t, None

    def written(self, pos: int | torch.Tensor):
        """After a kernel stored one token's k/v at slot ``pos`` on the device
        (``localllm.kernels.norm_rope_kv``): the bookkeeping and the return of
        ``update(pos, k, v)`` for T = 1."""
        if isinstance(pos, torch.Tensor):
            return self.k, self.v, None
        self.n = pos + 1
        return self.k[:, : pos + 1], self.v[:, : pos + 1], None

    def set_length(self, n: int) -> None:
        """Record that positions ``0 .. n-1`` are valid (after a static-decode write)."""
        self.n = n

    def can_truncate(self, n: int) -> bool:
        return n <= self.n

    def truncate(self, n: int) -> None:
        self.n = min(self.n, n)

    def reset(self) -> None:
        self.n = 0


class RingKVCache:
    """Keys and values of the last ``size = window + slack`` positions, in a ring.

    ``positions[i]`` is the absolute position held by slot ``i`` (-1 when empty).
    """

    def __init__(
        self,
        window: int,
        n_kv_heads: int,
        head_dim: int,
        *,
        slack: int,
        dtype: torch.dtype,
        device,
    ) -> None:
        self.window = window
        self.size = window + slack
        self.k = torch.zeros(n_kv_heads, self.size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.positions = torch.full((self.size,), -1, dtype=torch.long, device=device)
        self.n = 0  # next absolute position expected
        # Until the ring wraps, slot j holds position j (or nothing): attention then reads
        # only slots 0 .. pos+T-1, the live cells, instead of the whole ring.
        self.linear = True

    def update(self, pos: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """Attend over the ring's valid slots plus the ``T`` new positions, then store them.

        Returns (keys, values, key_positions): before the ring first wraps (pos + T <= size),
        the S = pos + T live slots, slot j holding position j; after, S = size + T entries
        (S = size when T = 1) where empty slots and positions at or after ``pos`` carry
        position -1 (masked out).
        """
        t = k.shape[1]
        device = self.k.device
        if isinstance(pos, torch.Tensor):  # static decode: the slot is computed on the device
            slot = pos % self.size
            self.k.index_copy_(1, slot, k.to(self.k.dtype))
            self.v.index_copy_(1, slot, v.to(self.v.dtype))
            self.positions.index_copy_(0, slot, pos)
            return self.k, self.v, self.positions
        if pos + t > self.size:
            self.linear = False
        if self.linear:  # before the ring wraps: write in place, attend over the live prefix
            end = pos + t
            self.k[:, pos:end] = k
            self.v[:, pos:end] = v
            self.positions[pos:end] = torch.arange(pos, end, device=device)
            self.n = end
            return self.k[:, :end], self.v[:, :end], self.positions[:end]
        if t == 1:
            # Decode: write first, then the ring itself holds the window (no concatenation).
            slot = pos % self.size
            self.k[:, slot] = k[:, 0]
            self.v[:, slot] = v[:, 0]
            self.positions[slot] = pos
            self.n = pos + 1
            return self.k, self.v, self.positions
        k, v = k.to(self.k.dtype), v.to(self.v.dtype)  # rounded as the cells will hold them
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
        return keys, values, positions

    def decode_slot(self, pos: int, t: int = 1) -> tuple[int, int, torch.Tensor] | None:
        """The bookkeeping of an :meth:`update` of ``t`` tokens at ``pos`` whose writes the
        caller does itself (the native CPU step, :class:`~localllm.models.common.NativeOps`).

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

    def written(self, pos: int | torch.Tensor):
        """After a kernel stored one token's k/v at slot ``pos % size`` and ``pos`` in
        ``positions`` on the device (``localllm.kernels.norm_rope_kv``): the bookkeeping and
        the return of ``update(pos, k, v)`` for T = 1."""
        if isinstance(pos, torch.Tensor):
            return self.k, self.v, self.positions
        end = pos + 1
        if end > self.size:
            self.linear = False
        self.n = end
        if self.linear:
            return self.k[:, :end], self.v[:, :end], self.positions[:end]
        return self.k, self.v, self.positions

    def set_length(self, n: int) -> None:
        """Record that the next position expected is ``n`` (after a static-decode write)."""
        self.n = n
        if n > self.size:
            self.linear = False

    def can_truncate(self, n: int) -> bool:
        """True when positions ``n - window .. n - 1`` are all still in the ring."""
        lo = max(0, n - self.window)
        if n > self.n:
            return False
        held = self.positions[(self.positions >= lo) & (self.positions < n)]
        return held.numel() == n - lo

    def truncate(self, n: int) -> None:
        self.positions[self.positions >= n] = -1
        self.n = min(self.n, n)

    def reset(self) -> None:
        self.positions.fill_(-1)
        self.n = 0
        self.linear = True


def make_cache(
    ctx_size: int, window: int | None, n_kv_heads: int, head_dim: int, *, slack: int, device,
    half: bool = False,
) -> KVCache | RingKVCache:
    """The cache of one layer (:func:`kv_dtype` elements): a ring of ``window + slack`` cells
    when the layer uses sliding-window attention with a window smaller than the context,
    else the full context."""
    dtype = kv_dtype(device, half=half)
    if window and window < ctx_size:
        return RingKVCache(window, n_kv_heads, head_dim, slack=slack, dtype=dtype, device=device)
    return KVCache(ctx_size, n_kv_heads, head_dim, dtype=dtype, device=device)


def make_caches(layout: list, ctx_size: int, *, slack: int, device, half: bool = False) -> list:
    """One cache per ``base.LayerCache`` of an architecture's ``cache_layout(args)``."""
    return [make_cache(ctx_size, c.window, c.n_kv_heads, c.head_dim, slack=slack, device=device,
                       half=half) for c in layout]


def layout_cells(layout: list, ctx_size: int, slack: int) -> list[int]:
    """Cells each layer's cache holds at ``ctx_size``: the context, or ``window + slack`` for
    a sliding-window layer whose window is smaller than the context (as :func:`make_cache`)."""
    return [c.window + slack if c.window and c.window < ctx_size else ctx_size for c in layout]


def attention_mask(
    q_positions: torch.Tensor, k_positions: torch.Tensor | int, window: int | None
) -> torch.Tensor:
    """Boolean (T, S) mask, True where query ``i`` may attend to key ``j``.

    Causal over absolute positions; keys with position -1 are empty slots. ``k_positions``
    may be the number of keys S instead, when slot ``j`` holds position ``j``. With a
    ``window``, a query at p sees keys at p - window + 1 .. p (llama.cpp's standard SWA).
    """
    if isinstance(k_positions, int):
        k_positions = torch.arange(k_positions, device=q_positions.device)
    q = q_positions[:, None]
    k = k_positions[None, :]
    mask = (k >= 0) & (k <= q)
    if window is not None:
        mask &= q - k < window
    return mask
