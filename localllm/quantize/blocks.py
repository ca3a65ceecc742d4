"""Quantize / dequantize whole float32 matrices to and from ggml block types.

``quantize_rows(x, qtype)`` takes a float32 numpy array (rows, cols) and returns the packed
uint8 array (rows, row_bytes) with ggml's exact block layout; rows are processed in chunks so
that the working memory stays near ``CHUNK_ELEMENTS`` floats times a small constant.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from gguf import GGMLQuantizationType

from ..errors import UnsupportedError
from ..gguf.quants import block_format, dequantize, row_bytes  # noqa: F401 (re-exported)
from . import iquants, kquants, legacy

Q = GGMLQuantizationType

BLOCK_QUANTIZERS: dict[GGMLQuantizationType, Callable[[torch.Tensor], np.ndarray]] = {
    Q.Q8_0: legacy.quantize_q8_0,
    Q.Q4_0: legacy.quantize_q4_0,
    Q.Q4_1: legacy.quantize_q4_1,
    Q.Q5_0: legacy.quantize_q5_0,
    Q.Q5_1: legacy.quantize_q5_1,
    Q.MXFP4: legacy.quantize_mxfp4,
    Q.Q2_K: kquants.quantize_q2_k,
    Q.Q3_K: kquants.quantize_q3_k,
    Q.Q4_K: kquants.quantize_q4_k,
    Q.Q5_K: kquants.quantize_q5_k,
    Q.Q6_K: kquants.quantize_q6_k,
    Q.IQ4_NL: iquants.quantize_iq4_nl,
    Q.IQ4_XS: iquants.quantize_iq4_xs,
}

# Chunks small enough to stay in cache; Q3_K's refinement loops over positions with vectors of
# n/16 values, so it gets bigger chunks to amortize the per-operation overhead.
CHUNK_ELEMENTS = 1 << 18
CHUNK_ELEMENTS_Q3K = 1 << 20
# IQ4_NL/IQ4_XS try 16 scales at once: a chunk's temporaries are 16x its size (2^16 values
# ran about twice as fast as 2^17 or 2^18 here: the temporaries stay in cache).
CHUNK_ELEMENTS_IQ4 = 1 << 16


def quantize_rows(x: np.ndarray, qtype: GGMLQuantizationType) -> np.ndarray:
    """Quantize a float32 matrix (rows, cols) to ``qtype``: -> uint8 (rows, row_bytes).

    F32/F16/BF16 are plain conversions. Raises UnsupportedError for other types or when cols
    is not a multiple of the block size.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, cols = x.shape
    if qtype == Q.F32:
        return x.view(np.uint8)
    if qtype == Q.F16:
        return x.astype(np.float16).view(np.uint8)
    if qtype == Q.BF16:
        return torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint8)
    fn = BLOCK_QUANTIZERS.get(qtype)
    if fn is None:
        raise UnsupportedError(f"quantizing to {qtype.name} is not supported")
    fmt = block_format(qtype)
    block, size = fmt.block_size, fmt.type_size
    if cols % block:
        raise UnsupportedError(f"{qtype.name} needs rows that are a multiple of {block} values, "
                               f"got {cols}")
    out = np.empty((rows, cols // block * size), dtype=np.uint8)
    limit = {Q.Q3_K: CHUNK_ELEMENTS_Q3K, Q.IQ4_NL: CHUNK_ELEMENTS_IQ4,
             Q.IQ4_XS: CHUNK_ELEMENTS_IQ4}.get(qtype, CHUNK_ELEMENTS)
    step = max(1, limit // cols)

    def work(r0: int) -> None:
        chunk = torch.from_numpy(x[r0:r0 + step]).reshape(-1, block)
        out[r0:r0 + step] = fn(chunk).reshape(-1, out.shape[1])

    # Chunks run on a thread pool with single-threaded torch ops: torch releases the GIL, and
    # this avoids OpenMP's per-operation synchronisation, which dominates for these many
    # small elementwise operations (especially on a busy machine).
    starts = range(0, rows, step)
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        n_workers = min(len(starts), os.cpu_count() or 1, 8)
        if n_workers <= 1:
            for r0 in starts:
                work(r0)
        else:
            with ThreadPoolExecutor(n_workers) as pool:
                list(pool.map(work, starts))
    finally:
        torch.set_num_threads(prev)
    return out


def dequantize_rows(data: np.ndarray, qtype: GGMLQuantizationType, shape: tuple[int, ...]
                    ) -> np.ndarray:
    """Raw tensor bytes of ``qtype`` -> float32 array of ``shape`` (torch order, last dim = row).

    Uses ``localllm.gguf.quants.dequantize`` (which covers every type gguf-py dequantizes).

    Raises:
        UnsupportedError: a type without a dequantizer (e.g. Q8_K).
    """
    raw = np.ascontiguousarray(data).view(np.uint8)
    if qtype == Q.F32:
        return raw.view(np.float32).reshape(shape)
    if qtype in (Q.F16, Q.BF16):  # torch converts with SIMD, numpy's float16 is slow
        with warnings.catch_warnings():  # a read-only memmap: its bytes are only read
            warnings.simplefilter("ignore", UserWarning)
            t = torch.from_numpy(raw.view(np.int16))
        t = t.view(torch.float16 if qtype == Q.F16 else torch.bfloat16)
        return t.float().numpy().reshape(shape)
    with warnings.catch_warnings():  # a read-only memmap: its bytes are only read
        warnings.simplefilter("ignore", UserWarning)
        return dequantize(raw, qtype, tuple(shape)).numpy()
