"""Native CPU kernels: matrix products read directly from a GGUF file's ggml blocks.

The CPU counterpart of ``localllm.kernels`` (Triton, CUDA): weights stay in their blocks (a
view of the memory-mapped file, no float16 copy), so a model's memory is about its file's
tensor bytes and loading reads nothing up front.

* :func:`qmatmul` ``y = x @ W.T``: 1-8 rows (decode, small batches) run the native GEMV.
  With AVX512-VNNI or AVX2 (and ``LOCALLLM_CPU_ACTIVATIONS`` unset or ``q8``) the
  activations are quantized once per call to int8, one float32 scale per 32 values (as
  llama.cpp quantizes them to ``block_q8_0``/``block_q8_K``, but finer than q8_K's one scale
  per 256), and each weight block is multiplied with integer dot products (``vpdpbusd``;
  on AVX2 ``vpmaddubsw`` + ``vpmaddwd``, or AVX-VNNI's ``vpdpbusd``): the result is the
  exact product of the weights with those quantized activations, up to float32 summation
  order. Otherwise (``LOCALLLM_CPU_ACTIVATIONS=f32``, float weights, CPUs without AVX2)
  each block is dequantized into L1 and multiplied in float32 (exact up to summation
  order). More rows
  (prefill) dequantize tiles of W into a float32 working buffer, each multiplied by
  torch's GEMM, so memory stays at the file's bytes plus one tile.
* :func:`moe_ffn_q8`: a prompt's mixture-of-experts FFN (every expert's gate, up, gated
  activation and down, with their biases, over the tokens routed to it) in one call, with
  int8 activations.
* :class:`PackedWeight` is the weight type; :class:`NativeLinear`, :class:`NativeFusedLinear`
  and :class:`NativeEmbedding` are the layers the models use.

The kernels (``csrc/*.cpp``) are compiled on first use and cached
(:mod:`localllm.cpu.build`); :func:`available` is False without a compiler (one notice on
stderr) or with ``LOCALLLM_NATIVE_CPU=0``, and the models then dequantize at load as before.
Types: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, MXFP4
(gpt-oss's experts; layouts: llama.cpp ``ggml/src/ggml-common.h``; dequantization:
``ggml/src/ggml-quants.c``).
"""

from __future__ import annotations

import functools
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGMLQuantizationType as T

from ..errors import ParameterError, UnsupportedError
from ..gguf.quants import block_format
from .build import _cpu_flags, load_native

# Up to this many activation rows a product runs the native GEMV (decode, small batches).
GEMV_MAX_ROWS = 8
# Weight elements per dequantized tile in prefill (float32: 4 MiB).
TILE_ELEMENTS = 1 << 20

FLOAT_TYPES = frozenset({T.F32, T.F16, T.BF16})
SUPPORTED = FLOAT_TYPES | {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
                           T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.MXFP4}
# The gated activations of the native kernels (ops.cpp's gated, moe_ffn_q8) by name: their
# codes (ops.cpp's Act).
GATED_ACTS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}


def bf16_gemm() -> bool:
    """True when prefill tiles should multiply in bfloat16: the CPU has AVX512_BF16 or AMX
    (oneDNN's bf16 GEMM is then 2-3x torch's float32 one), unless LOCALLLM_CPU_PREFILL=fp32."""
    choice = os.environ.get("LOCALLLM_CPU_PREFILL", "auto")
    if choice in ("fp32", "bf16"):
        return choice == "bf16"
    flags = set(_cpu_flags().split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


@functools.cache
def q8_activations() -> bool:
    """True when the GEMV quantizes its activations to int8 (the kernels built for AVX512-VNNI
    or AVX2, and ``LOCALLLM_CPU_ACTIVATIONS`` is not ``f32``)."""
    return (available() and os.environ.get("LOCALLLM_CPU_ACTIVATIONS", "q8") != "f32"
            and bool(torch.ops.localllm_cpu.q8_available()))


@functools.cache
def moe_q8() -> bool:
    """True when :func:`moe_ffn_q8` is built (AVX512-VNNI kernels, :func:`q8_activations`)."""
    return q8_activations() and bool(torch.ops.localllm_cpu.moe_available())


def available() -> bool:
    """True when the native kernels are built and loaded (compiles them the first time)."""
    return load_native()


def supports(qtype, cols: int) -> bool:
    """True when a (rows, ``cols``) matrix of ``qtype`` has a native kernel: a supported type
    and whole 32-weight groups (float types are read 32 values at a time)."""
    try:
        qtype = T(qtype)
    except ValueError:
        return False
    if qtype not in SUPPORTED:
        return False
    return cols % max(block_format(qtype).block_size, 32) == 0


@dataclass(frozen=True)
class PackedWeight:
    """A (rows, cols) matrix in ggml blocks: ``data`` uint8 (rows * row_bytes,), row-major
    blocks as in the GGUF file; ``qtype`` its ggml type; ``prefill_dtype`` the precision of
    the tiled GEMM over more than 8 rows; ``q8``: the GEMV quantizes its activations to int8
    (only where :func:`q8_activations`; else float32 activations, exact)."""

    data: torch.Tensor
    qtype: T
    shape: tuple[int, int]
    prefill_dtype: torch.dtype = torch.float32
    q8: bool = False

    @classmethod
    def from_bytes(cls, data, qtype, shape: tuple[int, int], *,
                   prefill_dtype: torch.dtype = torch.float32, q8: bool = False) -> PackedWeight:
        """Wrap ``data`` (numpy uint8 array, possibly a read-only memory map, or a uint8
        tensor) without copying.

        Raises:
            UnsupportedError: the kernels are unavailable (:func:`available`), or have no
                kernel for the type or the shape.
            ParameterError: the byte count does not match ``shape``.
        """
        if not available():
            raise UnsupportedError("the native CPU kernels are unavailable (no C++ compiler, "
                                   "or LOCALLLM_NATIVE_CPU=0)")
        qtype = T(qtype)
        rows, cols = shape
        if not supports(qtype, cols):
            raise UnsupportedError(f"no native CPU kernel for a {qtype.name} matrix of "
                                   f"{cols} columns")
        if isinstance(data, np.ndarray):
            with warnings.catch_warnings():  # a read-only memory map: the kernels only read it
                warnings.simplefilter("ignore", UserWarning)
                data = torch.from_numpy(np.ascontiguousarray(data).reshape(-1))
        data = data.reshape(-1)
        fmt = block_format(qtype)
        need = rows * (cols // fmt.block_size) * fmt.type_size
        if data.dtype != torch.uint8 or data.numel() != need:
            raise ParameterError(f"a ({rows}, {cols}) {qtype.name} matrix takes {need} bytes, "
                                 f"got {data.numel()}")
        return cls(data, qtype, (rows, cols), prefill_dtype,
                   q8 and qtype not in FLOAT_TYPES and q8_activations())

    @property
    def row_bytes(self) -> int:
        fmt = block_format(self.qtype)
        return self.shape[1] // fmt.block_size * fmt.type_size

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (N,) int64 dequantized -> (N, cols) float32 (bit-exact with
        :func:`localllm.gguf.quants.dequantize`)."""
        blocks = self.data.view(self.shape[0], self.row_bytes)[index]
        out = torch.empty(index.shape[0], self.shape[1])
        torch.ops.localllm_cpu.dequant_rows(blocks, int(self.qtype), 0, self.shape[1], out)
        return out

    def dequantize(self, r0: int = 0, r1: int | None = None, dtype=torch.float32) -> torch.Tensor:
        """Rows ``r0 .. r1-1`` dequantized -> (r1 - r0, cols) float32 or bfloat16."""
        r1 = self.shape[0] if r1 is None else r1
        out = torch.empty(r1 - r0, self.shape[1], dtype=dtype)
        torch.ops.localllm_cpu.dequant_rows(self.data, int(self.qtype), r0, self.shape[1], out)
        return out


def _check_x(x: torch.Tensor, cols: int) -> torch.Tensor:
    if x.dim() != 2 or x.shape[1] != cols:
        raise ParameterError(f"qmatmul: x must be (T, {cols}), got {tuple(x.shape)}")
    x = x.float()
    # Rows may be spaced (a column slice of a wider output, e.g. the FFN activation written
    # over the gate half of the gate/up product): the GEMV and torch's GEMM take a row stride.
    return x if x.stride(1) == 1 and x.stride(0) >= cols else x.contiguous()


def qmatmul(x: torch.Tensor, weight: PackedWeight, out: torch.Tensor | None = None, *,
            prefill_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ W.T``: x (T, cols) float32 (rows may be spaced: unit column stride), W a
    :class:`PackedWeight` (rows, cols) -> (T, rows)
    float32, written into ``out`` when given (a (T, rows) float32 view with unit column
    stride, e.g. a column slice of a wider output).

    T <= :data:`GEMV_MAX_ROWS`: the native GEMV (int8 activations, one scale per 32 values,
    where ``weight.q8``; else float32, exact up to summation order); else tiles of W are dequantized to ``prefill_dtype`` (float32, or bfloat16: x and the
    products are then rounded to bfloat16, float32 accumulation) and multiplied with torch's
    GEMM (no full-size copy of W).

    Raises:
        ParameterError: x does not have ``cols`` columns.
    """
    rows, cols = weight.shape
    x = _check_x(x, cols)
    t = x.shape[0]
    if out is None:
        out = torch.empty(t, rows)
    if t == 0:
        return out
    if t <= GEMV_MAX_ROWS:
        gemv = torch.ops.localllm_cpu.gemv_q8 if weight.q8 else torch.ops.localllm_cpu.gemv
        gemv(x, weight.data, int(weight.qtype), rows, cols, out)
        return out
    tile = max(16, TILE_ELEMENTS // cols)
    buf = torch.empty(min(tile, rows), cols, dtype=prefill_dtype)
    x = x.to(prefill_dtype)
    for r0 in range(0, rows, tile):
        n = min(tile, rows - r0)
        w = buf[:n]
        torch.ops.localllm_cpu.dequant_rows(weight.data, int(weight.qtype), r0, cols, w)
        out[:, r0:r0 + n] = torch.mm(x, w.t())
    return out


def gemv_experts(x: torch.Tensor, weight: PackedWeight, experts: torch.Tensor,
                 rows: int) -> torch.Tensor:
    """One token through the experts it selected (llama.cpp's ``ggml_mul_mat_id`` for one
    token): ``out[j] = x_j @ W_e.T`` with ``e = experts[j]``, W_e rows ``e * rows ..
    (e + 1) * rows`` of the stacked ``weight`` (n_expert * rows, cols), ``x_j = x[0]`` when x
    has one row (gate and up) or ``x[j]`` (down: one input per expert); int8 activations as
    :func:`qmatmul`'s GEMV. One native call instead of one per expert.

    x: (1 or k, cols) float32; experts: (k,) int64 -> (k, rows) float32.

    Raises:
        UnsupportedError: no int8 kernels (:func:`q8_activations`), or a float type.
        RuntimeError: an expert id out of range (from the kernel).
    """
    if not weight.q8:
        raise UnsupportedError("gemv_experts needs the int8 kernels and a quantized matrix")
    experts = experts.long().contiguous()
    out = torch.empty(experts.shape[0], rows)
    torch.ops.localllm_cpu.gemv_q8_experts(_check_x(x, weight.shape[1]), weight.data,
                                           int(weight.qtype), rows, weight.shape[1], experts,
                                           out)
    return out


def moe_token_q8(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
                 gate: PackedWeight, up: PackedWeight | None, down: PackedWeight, *,
                 biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
                 = (None, None, None), act: str = "silu",
                 shared: tuple[PackedWeight, PackedWeight, PackedWeight] | None = None,
                 shared_weight: float = 1.0,
                 shared_x: torch.Tensor | None = None) -> torch.Tensor:
    """One token's whole mixture-of-experts FFN after the routing, in one native call
    (llama.cpp's ``build_moe_ffn`` for one token, with the families' shared expert
    ``ffn_*_shexp``): ``out = sum_j weights[j] * (down_e(act(gate_e(x) + bg_e, up_e(x) +
    bu_e)) + bd_e)`` over ``e = chosen[j]`` in increasing expert order, plus
    ``shared_weight * down_s(silu(gate_s(xs)) * up_s(xs))`` with ``xs = shared_x`` or x.
    Int8 activations as :func:`gemv_experts`; the gate and up rows of every expert, the
    shared one included, are one pass over the threads and the down rows another (the
    separate calls spent a decode step's MoE layer in Python and thread start-ups).

    x, shared_x: (1, d) float32; chosen: (k,) int64; weights: (k,) float32; gate, up, down:
    the stacked experts as :func:`moe_ffn_q8` takes them (``up`` None: ``gate`` is the fused
    ``ffn_gate_up_exps``); biases as :func:`moe_ffn_q8`'s; shared: the shared expert's gate
    (sh_ff, d), up (sh_ff, d) and down (d, sh_ff) -> (1, d) float32.

    Raises:
        UnsupportedError: no int8 kernels (:func:`q8_activations`), or a float type.
        ParameterError: an unknown activation, or shapes that do not match.
        RuntimeError: an expert id out of range (from the kernel).
    """
    mats = [gate, down] + ([] if up is None else [up]) + list(shared or ())
    if not q8_activations() or any(not w.q8 for w in mats):
        raise UnsupportedError("moe_token_q8 needs the int8 kernels and quantized matrices")
    if act not in GATED_ACTS:
        raise ParameterError(f"moe_token_q8: unknown activation {act!r} (one of "
                             f"{', '.join(GATED_ACTS)})")
    d, n_ff = x.shape[-1], down.shape[1]
    if x.shape != (1, d) or chosen.dim() != 1 or weights.shape != chosen.shape:
        raise ParameterError(f"moe_token_q8: x {tuple(x.shape)}, chosen {tuple(chosen.shape)}"
                             f", weights {tuple(weights.shape)} do not match")
    sg, su, sd = shared or (None, None, None)
    out = torch.empty(1, d)
    torch.ops.localllm_cpu.moe_token_q8(
        _check_x(x, d), chosen.long().contiguous(), weights.float().contiguous(), gate.data,
        None if up is None else up.data, down.data, int(gate.qtype),
        int((up or gate).qtype), int(down.qtype), n_ff,
        *(None if b is None else b.float().contiguous() for b in biases), GATED_ACTS[act],
        *(None if w is None else w.data for w in (sg, su, sd)),
        *(0 if w is None else int(w.qtype) for w in (sg, su, sd)),
        0 if sd is None else sd.shape[1], float(shared_weight),
        None if shared_x is None else _check_x(shared_x, d), out)
    return out


def moe_ffn_q8(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor,
               gate: PackedWeight, up: PackedWeight | None, down: PackedWeight, *,
               biases: tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]
               = (None, None, None), act: str = "silu") -> torch.Tensor:
    """The gated experts of a mixture-of-experts layer over a prompt, after the routing
    (llama.cpp's ``build_moe_ffn``, ``src/llama-graph.cpp``, from its ``ggml_mul_mat_id``):
    ``out[t] = sum_j weights[t, j] * (down_e(act(gate_e(x[t]) + bg_e, up_e(x[t]) + bu_e))
    + bd_e)``, ``e = chosen[t, j]``, ``act`` a key of :data:`GATED_ACTS`: ``silu`` and
    ``gelu_tanh`` times up, or gpt-oss's clamped SwiGLU ``swiglu_oai``
    (:func:`localllm.backends.dense.swiglu_oai`, ggml's ``swiglu_oai``); the biases
    (gpt-oss's ``ffn_{gate,up,down}_exps.bias``) optional. In one native call: each
    expert's tokens pass through its matrices
    in batches of 16 tokens (AVX512-VNNI, one int32 lane per token) with int8 activations
    (as :func:`qmatmul`'s GEMV: one scale per 32 values; llama.cpp quantizes them to
    ``block_q8_K``), each tile of an expert's rows unpacked once for all of them;
    contributions are summed in increasing expert order.

    x: (T, d) float32; chosen: (T, k) int64 expert ids; weights: (T, k) float32;
    gate, up: the stacked ``ffn_{gate,up}_exps`` (n_expert * n_ff, d), or ``up`` None and
    ``gate`` the fused ``ffn_gate_up_exps`` (n_expert * 2 n_ff, d: each expert's gate rows,
    then its up rows); down: ``ffn_down_exps`` (n_expert * d, n_ff), each a quantized
    :class:`PackedWeight`; biases: (gate (n_expert, n_ff), up (n_expert, n_ff), down
    (n_expert, d)) float32, each or None -> (T, d) float32.

    Raises:
        UnsupportedError: no AVX512-VNNI int8 kernels (:func:`moe_q8` is False), or a float type.
        ParameterError: inconsistent shapes, or an unknown ``act``.
    """
    fused = up is None
    up = gate if fused else up
    if not moe_q8() or any(w.qtype in FLOAT_TYPES for w in (gate, up, down)):
        raise UnsupportedError("moe_ffn_q8 needs the AVX512-VNNI int8 kernels and "
                               "quantized experts")
    if act not in GATED_ACTS:
        raise ParameterError(f"moe_ffn_q8: unknown activation {act!r} (one of "
                             f"{', '.join(GATED_ACTS)})")
    t, d = x.shape
    n_ff = down.shape[1]
    n_expert = down.shape[0] // d if d else 0
    bias_shapes = ((n_expert, n_ff), (n_expert, n_ff), (n_expert, d))
    if (gate.shape != (n_expert * n_ff * (2 if fused else 1), d) or up.shape != gate.shape
            or down.shape != (n_expert * d, n_ff) or chosen.shape != weights.shape
            or chosen.shape[0] != t or any(b is not None and tuple(b.shape) != s
                                           for b, s in zip(biases, bias_shapes))):
        raise ParameterError(
            f"moe_ffn_q8: x {tuple(x.shape)}, chosen {tuple(chosen.shape)}, weights "
            f"{tuple(weights.shape)}, gate {gate.shape}, up {None if fused else up.shape}, "
            f"down {down.shape}, biases "
            f"{[None if b is None else tuple(b.shape) for b in biases]} do not match")
    out = torch.empty(t, d)
    torch.ops.localllm_cpu.moe_ffn_q8(
        x.float().contiguous(), chosen.long().contiguous(), weights.float().contiguous(),
        gate.data, up.data, down.data, int(gate.qtype), int(up.qtype), int(down.qtype),
        n_expert, n_ff, *(None if b is None else b.float().contiguous() for b in biases),
        GATED_ACTS[act], fused, out)
    return out


class NativeLinear:
    """``y = x @ W.T (+ b)`` reading W (out, in) from its ggml blocks (:func:`qmatmul`)."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None = None, *,
                 prefill_dtype: torch.dtype = torch.float32) -> None:
        self.weight = weight
        self.bias = bias  # (out,) float32 or None
        self.prefill_dtype = prefill_dtype  # of the GEMM over more than GEMV_MAX_ROWS rows

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: (T, in) float32 -> (T, out) float32."""
        y = qmatmul(x, self.weight, prefill_dtype=self.prefill_dtype)
        return y if self.bias is None else y + self.bias


class NativeFusedLinear:
    """Several projections of one input (Q/K/V, gate/up) written into one output, each read
    from its own blocks (no concatenated copy of the weights); returns one (T, out_i) view
    per projection."""

    def __init__(self, parts: list[NativeLinear]) -> None:
        self.parts = parts
        self.sizes = [p.weight.shape[0] for p in parts]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = _check_x(x, self.parts[0].weight.shape[1])
        y = torch.empty(x.shape[0], sum(self.sizes))
        off = 0
        for p, n in zip(self.parts, self.sizes):
            ys = y[:, off:off + n]
            qmatmul(x, p.weight, ys, prefill_dtype=p.prefill_dtype)
            if p.bias is not None:
                ys += p.bias
            off += n
        return y.split(self.sizes, dim=-1)


class NativeEmbedding:
    """An embedding table (n_vocab, d) kept in ggml blocks: looked-up rows are dequantized;
    ``head`` is the tied output projection."""

    def __init__(self, weight: PackedWeight, *, prefill_dtype: torch.dtype = torch.float32) -> None:
        self.weight = weight
        self.head = NativeLinear(weight, prefill_dtype=prefill_dtype)

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens: (T,) int64 -> (T, d) float32."""
        return self.weight.rows(tokens)
