"""Loading a model onto a device, and the single-sequence :class:`Session` that runs it.

A session owns the sequence's :class:`~localllm.memory.Memory` (one memory per layer: KV
cache, sliding-window ring, latent cache or recurrent state, preallocated to ``ctx_size``)
and the list of tokens it holds. ``eval`` appends tokens: a prompt is prefilled in chunks of
``batch_size`` tokens (one forward each), a decode step is a one-token forward; on CUDA
that step has static shapes and is replayed as a CUDA graph (:mod:`localllm.runtime.graphs`).
The session only calls the memory's interface (append happens inside the model's forward;
``restorable`` / ``truncate`` / ``checkpoint`` / ``state`` here).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..backends import select_backend
from ..cpu.threads import use_threads_for
from ..errors import ContextOverflowError, LocalLLMError
from ..gguf.file import GGUFFile, open_gguf
from ..gguf.validate import validate_vocab
from ..memory import (
    CACHE_TYPES,
    DEFAULT_CHECKPOINTS,
    RING_SLACK,
    CacheType,
    check_cache_types,
    make_memory,
)
from ..models import architecture
from ..models.base import bind, check_tensors
from ..tokenizer import Tokenizer
from .graphs import DecodeGraph
from .resources import check_memory

SESSION_FORMAT = "localllm-session-1"


def resolve_device(device: str) -> torch.device:
    """``auto`` -> CUDA when a GPU is usable, else CPU.

    Raises:
        LocalLLMError: ``cuda`` was asked for without a usable GPU, or the name is unknown.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise LocalLLMError("--device cuda: no usable CUDA GPU (torch.cuda.is_available() is False)")
    if device not in ("cpu", "cuda"):
        raise LocalLLMError(f"--device must be auto, cpu or cuda, got {device!r}")
    return torch.device(device)


@dataclass
class LoadedModel:
    """A model ready to run: file, tokenizer, hyperparameters and weights on ``device``."""

    gguf: GGUFFile
    tokenizer: Tokenizer
    args: object
    model: object
    device: torch.device
    load_seconds: float
    backend: str = "torch"  # "triton" / "native": matrices stay quantized (Triton / CPU kernels)
    fallbacks: list[str] | None = None  # tensors without a kernel, dequantized instead
    kv_dtype: torch.dtype = torch.float32  # of KV and latent caches (the backend's choice)
    memory_layout: list | None = None  # the architecture's memory_layout(args)
    _sha256: str | None = None

    def sha256(self) -> str:
        """Hex SHA-256 of the model file, of all its parts in order for a split model
        (computed once, about 1 s per GB)."""
        if self._sha256 is None:
            import hashlib

            h = hashlib.sha256()
            for path in self.gguf.files:
                with open(path, "rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
            self._sha256 = h.hexdigest()
        return self._sha256


def load_model(
    path: str | Path,
    *,
    device: str = "auto",
    progress: bool | None = None,
    dtype: torch.dtype = torch.float16,
    ctx_size: int | None = None,
    backend: str = "auto",
    cache_types: tuple[CacheType | None, CacheType | None] = (None, None),
) -> LoadedModel:
    """Open, validate and load a GGUF model.

    Args:
        dtype: storage dtype of dequantized weight matrices (float16 by default; float32 for
            exact checks, which also keeps the native backend's KV cache float32 instead of
            float16).
        backend: "torch" dequantizes every matrix at load; "triton" keeps matrices in their
            ggml blocks and multiplies with the Triton kernels (on the CPU they run in
            Triton's interpreter: for tests only); "native" keeps them in their blocks on the
            CPU and multiplies with the native kernels (:mod:`localllm.cpu`, compiled on first
            use; "torch" with a notice when they cannot be built); "auto" is "triton" on CUDA
            when Triton is importable, "native" on the CPU when the kernels load, else "torch".
        progress: show a progress bar on stderr (default: when stderr is a terminal).
        ctx_size: context size the caller will use; its KV cache counts in the memory check.
        cache_types: the K and V cache types sessions will use (``-ctk`` / ``-ctv``; None:
            the backend's float type): checked against the model's head sizes and counted in
            the memory check.
    Raises:
        GGUFError, UnsupportedError: the file is malformed, its hyperparameters are invalid
            or contradict its tensors, or it uses something unsupported (a cache type whose
            block does not divide a head size), raised before any weight is read.
        LocalLLMError: the weights and KV cache do not fit in the device's free memory
            (:func:`localllm.runtime.resources.check_memory`), raised before any weight is read.
    """
    t0 = time.perf_counter()
    return load_gguf(open_gguf(path), device=device, progress=progress, dtype=dtype,
                     ctx_size=ctx_size, backend=backend, t0=t0, cache_types=cache_types)


def load_gguf(gguf: GGUFFile, *, device: str = "auto", progress: bool | None = None,
              dtype: torch.dtype = torch.float16, ctx_size: int | None = None,
              backend: str = "auto", t0: float | None = None,
              cache_types: tuple[CacheType | None, CacheType | None] = (None, None),
              ) -> LoadedModel:
    """:func:`load_model` of an opened file (the metadata fuzzer feeds it mutated metadata).

    Order: architecture, vocabulary, hyperparameters (validated), tensor shapes against the
    declaration, memory check; only then are weights read. Raises as :func:`load_model`.
    """
    t0 = time.perf_counter() if t0 is None else t0
    arch = architecture(gguf.architecture)
    validate_vocab(gguf.metadata, gguf.path.name)
    tokenizer = Tokenizer(gguf.metadata)
    args = arch.ModelArgs.from_gguf(gguf.metadata, tokenizer.n_vocab, gguf.path.name)
    specs = arch.tensor_specs(args)
    check_tensors(specs, gguf.tensors, gguf.path.name)
    dev = resolve_device(device)
    chosen = select_backend(backend, dev, dtype, prefill_bf16=arch.Model.PREFILL_BF16)
    layout = arch.memory_layout(args)
    types = None
    if any(t is not None for t in cache_types):
        check_cache_types(layout, cache_types)
        default = next(c for c in CACHE_TYPES.values() if c.dtype == chosen.kv_dtype)
        types = (cache_types[0] or default, cache_types[1] or default)
    check_memory(gguf, args, ctx_size, dev, dtype, quantized=chosen.name != "torch",
                 types=types)
    if progress is None:
        progress = _isatty(sys.stderr)
    model = arch.Model(args)
    with _load_progress(gguf, enabled=progress) as advance:
        fallbacks = bind(model, gguf, chosen, specs, progress=advance)
    return LoadedModel(gguf, tokenizer, args, model, dev, time.perf_counter() - t0,
                       chosen.name, fallbacks, chosen.kv_dtype, layout)


def _isatty(stream) -> bool:
    """``stream.isatty()``, False for a closed or missing stream."""
    try:
        return stream is not None and stream.isatty()
    except (ValueError, OSError):
        return False


@contextmanager
def _load_progress(gguf: GGUFFile, *, enabled: bool) -> Iterator[Callable[[int], None] | None]:
    """A transient progress bar on stderr over the file's tensor bytes; yields its advance."""
    if not enabled:
        yield None
        return
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn

    total = sum(t.n_bytes for t in gguf.tensors.values())
    bar = Progress(TextColumn(f"loading {gguf.path.name}"), BarColumn(), DownloadColumn(),
                   transient=True, console=Console(stderr=True))
    with bar:
        task = bar.add_task("load", total=total)
        yield lambda n: bar.advance(task, n)


# Prefill takes a context checkpoint every this many positions (and one token before the end
# of each prompt) where a layer's memory cannot simply be truncated (recurrent states, wrapped
# rings), so that a later prompt sharing a prefix restores a nearby one.
CHECKPOINT_INTERVAL = 256


class Session:
    """One sequence and its memory.

    Args:
        loaded: the model.
        ctx_size: context size in tokens (capped at the model's context length).
        batch_size: the most tokens evaluated in one forward during prefill.
        static_decode: run one-token steps with static shapes (:class:`DecodeGraph`,
            captured as a CUDA graph on CUDA); default: on CUDA. On the CPU it is slower
            (the attention covers the whole cache) and exists for tests.
        checkpoints: context checkpoints kept for memories that cannot be truncated
            (llama.cpp's ``--ctx-checkpoints``); 0 recomputes from the start instead.
        type_k, type_v: element types of the KV caches' keys and values (llama.cpp's
            ``-ctk`` / ``-ctv``, :mod:`localllm.memory.kvtypes`); None: the backend's
            ``kv_dtype``. A block type makes one-token steps dynamic (no CUDA graph).
    Raises:
        UnsupportedError: a block type whose block does not divide the model's head size.
    Attributes:
        tokens: the tokens currently held by the memory, in order.
        memory: the :class:`~localllm.memory.Memory` of the sequence.
    """

    def __init__(self, loaded: LoadedModel, *, ctx_size: int = 4096, batch_size: int = 512,
                 static_decode: bool | None = None,
                 checkpoints: int = DEFAULT_CHECKPOINTS, type_k: CacheType | None = None,
                 type_v: CacheType | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.ctx_size = max(1, min(ctx_size, loaded.args.context_length))
        self.batch_size = max(1, batch_size)
        default = next(c for c in CACHE_TYPES.values() if c.dtype == loaded.kv_dtype)
        self.cache_types = (type_k or default, type_v or default)
        self.memory = make_memory(loaded.memory_layout, self.ctx_size, dtype=loaded.kv_dtype,
                                  device=loaded.device, slack=RING_SLACK,
                                  checkpoints=checkpoints, types=self.cache_types)
        self.tokens: list[int] = []
        if static_decode is None:  # a block type's write is not a static-shape step
            static_decode = loaded.device.type == "cuda" and not any(
                t.quantized for t in self.cache_types)
        self.decoder = DecodeGraph(self.model, self.memory, loaded.device) \
            if static_decode else None  # fmt: skip

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    def _chunks(self, n: int) -> list[tuple[int, int, bool]]:
        """(start, end, checkpoint after) of the forwards that evaluate ``n`` new tokens:
        ``batch_size`` at most each, cut at the checkpoint positions where the memory wants
        them (multiples of :data:`CHECKPOINT_INTERVAL`, and one token before the end)."""
        base = self.n_past
        cuts = set(range(self.batch_size, n, self.batch_size))
        marks: set[int] = set()
        if n > 1 and self.memory.wants_checkpoints(base + n):
            first = (base // CHECKPOINT_INTERVAL + 1) * CHECKPOINT_INTERVAL - base
            marks = set(range(first, n, CHECKPOINT_INTERVAL)) | {n - 1}
        ends = sorted(cuts | marks | {n})
        return [(s, e, e in marks) for s, e in zip([0, *ends[:-1]], ends)]

    @torch.inference_mode()
    def eval(
        self, ids: Sequence[int], *, all_logits: bool = False, logits_start: int = 0
    ) -> torch.Tensor:
        """Append ``ids`` to the sequence and run them through the model.

        Returns float32 logits: (n_vocab,) for the last position, or, when ``all_logits``,
        (len(ids) - logits_start, n_vocab) for positions ``logits_start ..`` of ``ids`` (the
        output projection is the costliest product: perplexity skips unscored rows).
        Raises:
            ContextOverflowError: the sequence would exceed ``ctx_size``.
        """
        ids = list(ids)
        if not ids:
            raise ValueError("eval needs at least one token")
        use_threads_for(len(ids))  # llama.cpp's -tb for batches, -t for one-token steps
        if self.n_past + len(ids) > self.ctx_size:
            raise ContextOverflowError(
                f"{self.n_past + len(ids)} tokens do not fit in the context of {self.ctx_size} "
                "tokens (raise --ctx-size or shorten the prompt)"
            )
        if len(ids) == 1 and self.decoder is not None and not all_logits:
            logits = self.decoder.step(ids[0], self.n_past)
            self.tokens.append(ids[0])
            self.memory.set_length(self.n_past)
            return logits.float()
        device = self.loaded.device
        outs = []
        for start, end, checkpoint in self._chunks(len(ids)):
            chunk = ids[start:end]
            tokens = torch.tensor(chunk, dtype=torch.long, device=device)
            out = self.model.forward(tokens, self.n_past, self.memory, all_logits=all_logits,
                                     logits_start=max(0, logits_start - start))
            if (end > logits_start) if all_logits else (end == len(ids)):
                outs.append(out)
            self.tokens += chunk
            if checkpoint:
                self.memory.checkpoint()
        logits = torch.cat(outs) if all_logits else outs[-1][-1]
        return logits.float()

    def truncate(self, n: int) -> int:
        """Keep the first ``n`` tokens: the memory goes back to the longest prefix it can
        restore (any, for KV caches; a checkpoint, for recurrent states and wrapped rings)
        and the rest up to ``n`` is recomputed. Returns how many tokens were kept without
        recomputation."""
        n = max(0, min(n, self.n_past))
        if n == self.n_past:
            return n
        keep = self.tokens[:n]
        m = self.memory.restorable(n)
        self.memory.truncate(m)
        del self.tokens[m:]
        if m < n:
            self.eval(keep[m:])
        return m

    def reset(self) -> None:
        """Forget every token."""
        self.memory.reset()
        self.tokens = []

    # ---- saving and loading the memory (llama.cpp's --prompt-cache) -----------------------------
    def _geometry(self) -> dict[str, str]:
        return {"n_layer": str(len(self.memory)), "caches": self.memory.describe()}

    def save(self, path: str | Path) -> None:
        """Write the memory and its tokens to ``path`` (safetensors, written atomically).

        Tensors: ``tokens`` int64 (n,); per layer ``{i}.{name}``, its memory's ``state()``
        (``{i}.k`` / ``{i}.v`` (n_kv_heads, n, head_dim) for full caches, the whole ring and
        ``{i}.positions`` for sliding-window layers, the state tensors of recurrent layers and
        those of their latest checkpoint, ``{i}.{name}@{position}``).
        Metadata: the model file's SHA-256, its name, the geometry, ``ctx_size`` and the KV
        cache types (``cache_type_k`` / ``cache_type_v``: llama.cpp's names, ``q8_0`` ...; a
        block type's ``k`` / ``v`` are its uint8 blocks).
        Raises:
            LocalLLMError: the file cannot be written, or ``path`` is a device, FIFO, socket or
                a symbolic link out of its directory (``localllm.atomic``).
        """
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        from ..atomic import atomic_output

        tensors = {"tokens": torch.tensor(self.tokens, dtype=torch.int64).reshape(-1),
                   **self.memory.state()}
        tensors = {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}
        meta = {"format": SESSION_FORMAT, "model_sha256": self.loaded.sha256(),
                "model_name": self.loaded.gguf.path.name, "ctx_size": str(self.ctx_size),
                "cache_type_k": self.cache_types[0].name,
                "cache_type_v": self.cache_types[1].name, **self._geometry()}
        with atomic_output(path, "prompt cache", errors=(SafetensorError,)) as tmp:
            save_file(tensors, str(tmp), metadata=meta)

    def load(self, path: str | Path) -> None:
        """Replace this session's memory and tokens with those saved in ``path``.

        Raises:
            LocalLLMError: the file is unreadable, not a regular file (a FIFO, a device) or
                not a session file, or it was saved for another model file (SHA-256), with
                other KV cache types where either is a block type (float caches convert;
                files without the types hold floats), or for another geometry (layers, sliding-window sizes, head shapes), or it holds more
                tokens than this session's context, token ids that are not int64 ids of the
                vocabulary, or malformed memory tensors (non-finite values, ring positions
                that do not fit the ring).
        """
        from safetensors import safe_open

        from ..atomic import check_input_file

        check_input_file(path, "prompt cache")  # a FIFO would block open(); a device, never end
        where = f"prompt cache {path}"
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (not a dict)
        except Exception as e:  # noqa: BLE001 (safetensors raises its own error types and OSError)
            raise LocalLLMError(f"{where}: cannot read: {' '.join(str(e).split())[:200]}") from None
        if meta.get("format") != SESSION_FORMAT:
            raise LocalLLMError(f"{where}: not a localllm session file")
        if meta.get("model_sha256") != self.loaded.sha256():
            raise LocalLLMError(
                f"{where}: saved for another model ({str(meta.get('model_name'))[:80]!r}, "
                f"sha256 {str(meta.get('model_sha256'))[:12]}...), not "
                f"{self.loaded.gguf.path.name}")
        self._check_cache_types(where, meta)
        mine = self._geometry()
        theirs = {k: meta.get(k) for k in mine}
        if theirs != mine:
            diff = ", ".join(f"{k} {str(theirs[k])[:80]!r} vs {mine[k]!r}" for k in mine
                             if theirs[k] != mine[k])
            raise LocalLLMError(f"{where}: cache geometry differs ({diff})")
        tokens = tensors.pop("tokens", None)
        if tokens is None or tokens.dim() != 1 or tokens.dtype != torch.int64:
            raise LocalLLMError(f"{where}: no int64 token list")
        n = tokens.numel()
        if n > self.ctx_size:
            raise LocalLLMError(f"{where}: {n} tokens do not fit in the context of {self.ctx_size}")
        vocab = self.loaded.tokenizer.n_vocab
        if n and not bool(((tokens >= 0) & (tokens < vocab)).all()):
            raise LocalLLMError(f"{where}: token ids out of the vocabulary")
        self.reset()
        try:
            self.memory.load_state({k: v.to(self.loaded.device) for k, v in tensors.items()}, n)
        except ValueError as e:
            raise LocalLLMError(f"{where}: malformed cache ({e})") from None
        self.tokens = [int(t) for t in tokens.tolist()]


    def _check_cache_types(self, where: str, meta: dict[str, str]) -> None:
        """Raises LocalLLMError: the file's K/V cache types differ from this session's and
        either side stores blocks (floats of one width load into another's cache)."""
        mine = tuple(t.name for t in self.cache_types)
        theirs = (meta.get("cache_type_k", "f32"), meta.get("cache_type_v", "f32"))
        block = {c.name for c in CACHE_TYPES.values() if c.quantized}
        if theirs != mine and block & {*mine, *theirs}:
            raise LocalLLMError(f"{where}: saved with a {str(theirs[0])[:10]}/"
                                f"{str(theirs[1])[:10]} KV cache, this session's is "
                                f"{mine[0]}/{mine[1]} (-ctk/--cache-type-k, "
                                "-ctv/--cache-type-v)")


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def prefill(session: Session, prompt_ids: Sequence[int]) -> tuple[torch.Tensor, int]:
    """Bring the session's cache to exactly ``prompt_ids`` and return the next-token logits.

    Tokens already in the cache are reused (at least the last prompt token is recomputed,
    for its logits; a recurrent state goes back to its nearest checkpoint and recomputes
    from there). Returns (logits (n_vocab,) float32, number of reused tokens: those not
    recomputed).
    """
    keep = min(common_prefix(session.tokens, prompt_ids), len(prompt_ids) - 1)
    reused = session.truncate(keep)
    return session.eval(prompt_ids[session.n_past:]), reused
