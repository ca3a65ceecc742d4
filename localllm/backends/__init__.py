"""Backends: how a model's matrices are stored and multiplied, and how the rest of a layer is
computed, chosen once when a model is loaded.

A backend (:class:`Backend`) turns each GGUF tensor into a weight object and supplies the
layer operations (``ops``: norms, RoPE, attention over a layer's memory, gated activations,
experts). Model code only ever calls these objects:

* a :class:`Matrix` multiplies itself (``w(x)``: ``x @ W.T``) and looks up rows
  (embeddings); three kinds exist, one per backend module — dense torch tensors
  (:mod:`.dense`), the native CPU kernels' packed blocks (:mod:`.native`) and the Triton
  kernels' quantized blocks (:mod:`.triton`) — and a model never asks which it holds;
* an :class:`ExpertMatrix` holds a mixture-of-experts tensor (``w(x, e)``: expert ``e``).

Adding a backend, or a weight kind, is one module: a :class:`Backend` subclass with its
``load_matrix`` / ``load_experts`` and its ops, plus its line in :data:`BACKENDS`.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from ..errors import LocalLLMError, UnsupportedError
from ..gguf.quants import dequantize

__all__ = ["BACKENDS", "Backend", "ExpertMatrix", "Matrix", "select_backend"]


@runtime_checkable
class Matrix(Protocol):
    """A 2-D weight (out, in) that multiplies itself.

    Attributes:
        shape: (out_features, in_features), torch order.
        nbytes: bytes held in memory (the file's block bytes for quantized kinds).
    """

    shape: tuple[int, int]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T``: x (T, in) float32 (unit column stride) -> (T, out) float32."""

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` (N,) int64 dequantized -> (N, in) float32 (embedding lookups)."""

    @property
    def nbytes(self) -> int: ...

    def stack(self, others: Sequence[Matrix]) -> Matrix | None:
        """This matrix and ``others`` (same input size) as one of stacked rows, whose product
        is theirs concatenated; None where the kind cannot stack them (other kinds or types;
        the caller then multiplies each)."""


@runtime_checkable
class ExpertMatrix(Protocol):
    """A mixture-of-experts tensor (n_expert, out, in) (llama.cpp's ``ffn_*_exps``)."""

    shape: tuple[int, int, int]

    def __call__(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x (T, in) float32 through expert ``e`` -> (T, out) float32."""


class ExpertList:
    """An :class:`ExpertMatrix` as one :class:`Matrix` per expert."""

    def __init__(self, matrices: list[Matrix]) -> None:
        self.matrices = matrices
        self.shape = (len(matrices), *matrices[0].shape)

    def __call__(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return self.matrices[e](x)


class Backend:
    """Loads a GGUF's tensors as weights and supplies the layer ops (see the module docstring).

    Args:
        device: where the weights live.
        dtype: dtype of dequantized matrices (float16; float32 for exact checks).
        prefill_bf16: products over many rows in bfloat16 where the backend has a choice
            (models whose activations outgrow float16, Gemma's).
    Attributes:
        name: "torch", "native" or "triton".
        ops: the layer operations (a ``TorchOps`` or subclass).
        kv_dtype: element type of KV and latent caches.
        fallbacks: tensors a kernel could not take, dequantized instead (``"name (TYPE)"``).
    """

    name = "torch"

    def __init__(self, device, dtype: torch.dtype = torch.float16, *,
                 prefill_bf16: bool = False) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.prefill_bf16 = prefill_bf16
        self.fallbacks: list[str] = []
        self.progress: Callable[[int], None] = lambda n: None
        self.source = ""  # the file's name, for messages (set by models.base.bind)
        self.ops = self.make_ops()

    # ---- what a backend module defines ----------------------------------------------------
    def make_ops(self):
        from .dense import TorchOps

        return TorchOps()

    @property
    def kv_dtype(self) -> torch.dtype:
        return torch.float16 if self.device.type == "cuda" else torch.float32

    def load_matrix(self, info) -> Matrix | None:
        """The backend's own kind for a 2-D GGUF tensor, or None (no kernel: dense)."""
        return None

    def load_experts(self, info) -> ExpertMatrix | None:
        """The backend's own kind for a 3-D expert tensor, or None (no kernel: dense)."""
        return None

    # ---- shared --------------------------------------------------------------------------
    def dense(self, info, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor ``info`` dequantized (``dtype``: default :attr:`dtype` for matrices,
        float32 for vectors), in torch shape order, on the device.

        Raises:
            UnsupportedError: its quant type has no dequantizer.
        """
        if dtype is None:
            dtype = self.dtype if len(info.shape) > 1 else torch.float32
        try:
            out = dequantize(info.data, info.qtype, info.shape, dtype=dtype)
        except UnsupportedError:
            pre = f"{self.source}: " if self.source else ""
            raise UnsupportedError(f"{pre}tensor {info.name!r} has type {info.qtype.name}, "
                                   "which localllm cannot dequantize") from None
        self.progress(info.n_bytes)
        return out.to(self.device)

    def dense_matrix(self, info, dtype: torch.dtype | None = None) -> Matrix:
        from .dense import DenseMatrix

        return DenseMatrix(self.dense(info, dtype))

    def matrix(self, info) -> Matrix:
        """A 2-D weight: the backend's kind when it has a kernel for it, else dense."""
        m = self.load_matrix(info)
        if m is None:
            if self.name != "torch":
                self.fallbacks.append(f"{info.name} ({info.qtype.name})")
            return self.dense_matrix(info)
        self.progress(info.n_bytes)
        return m

    def experts(self, info) -> ExpertMatrix:
        """A 3-D expert tensor (n_expert, out, in): the backend's kind, else dense."""
        m = self.load_experts(info)
        if m is not None:
            self.progress(info.n_bytes)
            return m
        if self.name != "torch":
            self.fallbacks.append(f"{info.name} ({info.qtype.name})")
        from .dense import DenseMatrix

        return ExpertList([DenseMatrix(w) for w in self.dense(info).unbind(0)])


# name -> module defining ``Backend`` (imported only when chosen).
BACKENDS = {"torch": ".dense", "native": ".native", "triton": ".triton"}


def backend_class(name: str) -> type[Backend]:
    return importlib.import_module(BACKENDS[name], __name__).Backend


def select_backend(name: str, device: torch.device, dtype: torch.dtype = torch.float16, *,
                   prefill_bf16: bool = False) -> Backend:
    """The backend for ``name`` ("auto", "torch", "native", "triton") on ``device``.

    "auto" is "triton" on CUDA when Triton is importable, "native" on the CPU when the native
    kernels load, else "torch" (with a one-line notice where a faster one was expected);
    "triton" on the CPU runs Triton's interpreter (tests only); "native" off the CPU, or
    without the kernels, is "torch".

    Raises:
        LocalLLMError: an unknown name.
    """
    if name not in ("auto", *BACKENDS):
        raise LocalLLMError(f"backend must be auto, torch, triton or native, got {name!r}")
    device = torch.device(device)
    chosen = "torch"
    if name == "triton" or (name == "auto" and device.type == "cuda"):
        from ..kernels import triton_available

        if triton_available():
            chosen = "triton"
        else:
            print("notice: Triton is not available; using the torch path", file=sys.stderr)
    elif name in ("auto", "native") and device.type == "cpu":
        from ..cpu import available

        if available():
            chosen = "native"
    return backend_class(chosen)(device, dtype, prefill_bf16=prefill_bf16)
