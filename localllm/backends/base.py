"""What every backend is: the :class:`Matrix` and :class:`ExpertMatrix` protocols a model's
weights follow, and the :class:`Backend` base class that loads them (see the package
docstring)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..errors import UnsupportedError
from ..gguf.quants import dequantize

__all__ = ["Backend", "ExpertList", "ExpertMatrix", "Matrix"]


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
    """A mixture-of-experts tensor (n_expert, out, in) (llama.cpp's ``ffn_*_exps``), with
    an optional bias per expert (``bias``: (n_expert, out) float32 or None; gpt-oss's
    ``ffn_*_exps.bias``, set by :func:`localllm.models.base.bind`)."""

    shape: tuple[int, int, int]
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """x (T, in) float32 through expert ``e`` (plus its bias) -> (T, out) float32."""


class ExpertList:
    """An :class:`ExpertMatrix` as one :class:`Matrix` per expert."""

    def __init__(self, matrices: list[Matrix]) -> None:
        self.matrices = matrices
        self.shape = (len(matrices), *matrices[0].shape)
        self.bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, e: int) -> torch.Tensor:
        y = self.matrices[e](x)
        return y if self.bias is None else y + self.bias[e]


@dataclass(frozen=True)
class SharedExpert:
    """A MoE layer's shared SwiGLU expert, added to every token's routed experts
    (llama.cpp's ``ffn_*_shexp`` in DeepSeek-V2/V3, GLM-4.5, ERNIE 4.5, Llama 4, Qwen3.5):
    ``weight * down(silu(gate) * up)`` with ``gate, up = gate_up(x)``.

    gate_up: a callable (T, d) -> (gate (T, ff), up (T, ff)) float32 (a fused or split
    projection of :mod:`localllm.models.common`); down: a callable (T, ff) -> (T, d);
    weight: a float or a (T, 1) float32 tensor (Qwen3.5's ``sigmoid(x . ffn_gate_inp_shexp)``),
    None for 1; x: the expert's own input (T, d) when it is not the routed experts' (Llama 4
    scales the routed input by the routing weight, not the shared expert's).
    """

    gate_up: Callable
    down: Callable
    weight: float | torch.Tensor | None = None
    x: torch.Tensor | None = None


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
        """The layer operations (each backend module returns its own)."""
        raise NotImplementedError

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
        """A dense :class:`Matrix` of ``info`` dequantized (``dtype``: see :meth:`dense`)."""
        return self.dense_matrix_of(self.dense(info, dtype))

    def matrix(self, info) -> Matrix:
        """A 2-D weight: the backend's kind when it has a kernel for it, else dense."""
        m = self.load_matrix(info)
        if m is None:
            if self.name != "torch":
                self.fallbacks.append(f"{info.name} ({info.qtype.name})")
            return self.dense_matrix_of(self.dense(info))
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
        return ExpertList([self.dense_matrix_of(w) for w in self.dense(info).unbind(0)])

    def dense_matrix_of(self, w: torch.Tensor) -> Matrix:
        """A dense :class:`Matrix` holding the tensor ``w`` (out, in)."""
        raise NotImplementedError
