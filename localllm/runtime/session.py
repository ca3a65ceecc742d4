"""Loading a model onto a device, and the single-sequence :class:`Session` that runs it.

A session owns one KV cache per layer, preallocated to ``ctx_size``, and the list of tokens
the cache holds. ``eval`` appends tokens: a prompt is prefilled in chunks of
``batch_size`` tokens (one forward each), a decode step is a one-token forward; on CUDA
that step has static shapes and is replayed as a CUDA graph (:mod:`localllm.runtime.graphs`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import ContextOverflowError, LocalLLMError
from ..gguf.file import GGUFFile, open_gguf
from ..gguf.validate import validate_vocab
from ..models import architecture
from ..models.cache import RING_SLACK
from ..models.common import Weights
from ..tokenizer import Tokenizer
from .graphs import DecodeGraph
from .resources import check_memory


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


def load_model(
    path: str | Path,
    *,
    device: str = "auto",
    progress: bool | None = None,
    dtype: torch.dtype = torch.float16,
    ctx_size: int | None = None,
    backend: str = "auto",
) -> LoadedModel:
    """Open, validate and load a GGUF model.

    Args:
        dtype: storage dtype of dequantized weight matrices (float16 by default; float32 for
            exact checks).
        backend: "torch" dequantizes every matrix at load; "triton" keeps matrices in their
            ggml blocks and multiplies with the Triton kernels (on the CPU they run in
            Triton's interpreter: for tests only); "native" keeps them in their blocks on the
            CPU and multiplies with the native kernels (:mod:`localllm.cpu`, compiled on first
            use; "torch" with a notice when they cannot be built); "auto" is "triton" on CUDA
            when Triton is importable, "native" on the CPU when the kernels load, else "torch".
        progress: show a progress bar on stderr (default: when stderr is a terminal).
        ctx_size: context size the caller will use; its KV cache counts in the memory check.
    Raises:
        GGUFError, UnsupportedError: the file is malformed or uses something unsupported.
        LocalLLMError: the weights and KV cache do not fit in the device's free memory
            (:func:`localllm.runtime.resources.check_memory`), raised before any weight is read.
    """
    t0 = time.perf_counter()
    gguf = open_gguf(path)
    arch = architecture(gguf.architecture)
    validate_vocab(gguf.metadata, gguf.path.name)
    tokenizer = Tokenizer(gguf.metadata)
    args = arch.ModelArgs.from_gguf(gguf.metadata, tokenizer.n_vocab)
    dev = resolve_device(device)
    quantized = _use_quantized(backend, dev)
    native = not quantized and _use_native(backend, dev)
    check_memory(gguf, args, ctx_size, dev, dtype, quantized=quantized or native)
    if progress is None:
        progress = sys.stderr.isatty()
    with _load_progress(gguf, enabled=progress) as advance:
        weights = Weights(gguf, dev, dtype, advance, quantized=quantized, native=native)
        model = arch.Model(args, weights)
    name = "triton" if quantized else "native" if native else "torch"
    return LoadedModel(gguf, tokenizer, args, model, dev, time.perf_counter() - t0,
                       name, weights.fallbacks)


def _use_native(backend: str, device: torch.device) -> bool:
    """The native CPU kernels (localllm.cpu) for ``auto``/``native`` on the CPU when they load."""
    if device.type != "cpu" or backend not in ("auto", "native"):
        return False
    from ..cpu import available

    return available()


def _use_quantized(backend: str, device: torch.device) -> bool:
    if backend not in ("auto", "torch", "triton", "native"):
        raise LocalLLMError(f"backend must be auto, torch, triton or native, got {backend!r}")
    if backend in ("torch", "native"):
        return False
    from ..kernels import triton_available

    if not triton_available():
        if backend == "triton" or device.type == "cuda":
            print("notice: Triton is not available; using the torch path", file=sys.stderr)
        return False
    return backend == "triton" or device.type == "cuda"


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


class Session:
    """One sequence and its KV cache.

    Args:
        loaded: the model.
        ctx_size: context size in tokens (capped at the model's context length).
        batch_size: the most tokens evaluated in one forward during prefill.
        static_decode: run one-token steps with static shapes (:class:`DecodeGraph`,
            captured as a CUDA graph on CUDA); default: on CUDA. On the CPU it is slower
            (the attention covers the whole cache) and exists for tests.
    Attributes:
        tokens: the tokens currently held by the cache, in order.
    """

    def __init__(self, loaded: LoadedModel, *, ctx_size: int = 4096, batch_size: int = 512,
                 static_decode: bool | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.ctx_size = max(1, min(ctx_size, loaded.args.context_length))
        self.batch_size = max(1, batch_size)
        self.caches = self.model.make_caches(self.ctx_size, slack=RING_SLACK)
        self.tokens: list[int] = []
        if static_decode is None:
            static_decode = loaded.device.type == "cuda"
        self.decoder = DecodeGraph(self.model, self.caches, loaded.device) if static_decode else None

    @property
    def n_past(self) -> int:
        return len(self.tokens)

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
        if self.n_past + len(ids) > self.ctx_size:
            raise ContextOverflowError(
                f"{self.n_past + len(ids)} tokens do not fit in the context of {self.ctx_size} "
                "tokens (raise --ctx-size or shorten the prompt)"
            )
        if len(ids) == 1 and self.decoder is not None and not all_logits:
            logits = self.decoder.step(ids[0], self.n_past)
            self.tokens.append(ids[0])
            for c in self.caches:
                c.set_length(self.n_past)
            return logits.float()
        device = self.loaded.device
        outs = []
        for start in range(0, len(ids), self.batch_size):
            chunk = ids[start : start + self.batch_size]
            end = start + len(chunk)
            tokens = torch.tensor(chunk, dtype=torch.long, device=device)
            out = self.model.forward(tokens, self.n_past, self.caches, all_logits=all_logits,
                                     logits_start=max(0, logits_start - start))
            if (end > logits_start) if all_logits else (end == len(ids)):
                outs.append(out)
            self.tokens += chunk
        logits = torch.cat(outs) if all_logits else outs[-1][-1]
        return logits.float()

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens; recompute the cache when a ring buffer forgot them."""
        n = max(0, min(n, self.n_past))
        if n == self.n_past:
            return
        if all(c.can_truncate(n) for c in self.caches):
            for c in self.caches:
                c.truncate(n)
            del self.tokens[n:]
            return
        keep = self.tokens[:n]
        self.reset()
        if keep:
            self.eval(keep)

    def reset(self) -> None:
        """Forget every token."""
        for c in self.caches:
            c.reset()
        self.tokens = []
