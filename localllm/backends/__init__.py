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

Adding a backend, or a weight kind, is one module: a :class:`~.base.Backend` subclass with
its ``load_matrix`` / ``load_experts``, its dense fallback and its ops, plus its line in
:data:`BACKENDS`.
"""

from __future__ import annotations

import importlib
import sys

import torch

from ..errors import LocalLLMError
from .base import Backend, ExpertList, ExpertMatrix, Matrix, SharedExpert

__all__ = ["BACKENDS", "Backend", "ExpertList", "ExpertMatrix", "Matrix", "SharedExpert",
           "select_backend"]


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
