"""Triton kernels against the torch reference dequantizer.

Every test runs twice: on CPU tensors through Triton's interpreter (always, when Triton
imports) and natively on CUDA (``pytest -m cuda``; skipped without a GPU). The interpreter is
slow, so the tensors are a few blocks by a few rows, with sizes that are not multiples of the
tile sizes.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_quants import SCALE_OFFSETS, random_blocks

from localllm.errors import UnsupportedError
from localllm.gguf.quants import BLOCK_FORMATS
from localllm.gguf.quants import dequantize as reference

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import QuantWeight, quant_linear
from localllm.kernels.decode import KERNEL_TYPES, MMVQ_TYPES
from localllm.kernels.dequant import dequantize as triton_dequantize
from localllm.kernels.gemm import gemm
from localllm.kernels.gemm_decode import has_chunks
from localllm.kernels.gemv import gemv, quantize_q8

TYPE_IDS = {"ids": lambda q: q.name}


def weight_bytes(qtype: T, n_blocks: int, seed: int = 0) -> torch.Tensor:
    """Random blocks with small finite scales: products stay well inside float16's range."""
    rng = np.random.default_rng(seed)
    fmt = BLOCK_FORMATS[qtype]
    if qtype in (T.F32, T.F16, T.BF16):
        vals = torch.from_numpy(rng.standard_normal(n_blocks).astype(np.float32))
        dtype = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
        return vals.to(dtype).view(torch.uint8).clone()
    b = rng.integers(0, 256, (n_blocks, fmt.type_size), dtype=np.uint8)
    if qtype == T.MXFP4:  # E8M0 exponents: scales 2**-9 .. 2**-2
        b[:, 0] = rng.integers(118, 126, n_blocks)
    for off in SCALE_OFFSETS.get(qtype, ()):
        scale = rng.uniform(0.5, 1.5, n_blocks) * rng.choice([-1, 1], n_blocks) * 1e-2
        b[:, off : off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return torch.from_numpy(b).reshape(-1)


def make_weight(
    qtype: T, n: int, blocks_per_row: int, seed: int = 0
) -> tuple[QuantWeight, torch.Tensor]:
    """A (n, K) QuantWeight and its float32 reference dequantization."""
    k = blocks_per_row * BLOCK_FORMATS[qtype].block_size
    if BLOCK_FORMATS[qtype].block_size == 1:
        k = 48 * blocks_per_row  # unquantized: K is free, use one that no tile size divides
    raw = weight_bytes(qtype, n * k // BLOCK_FORMATS[qtype].block_size, seed)
    w = QuantWeight.from_bytes(raw, qtype, (n, k))
    return w, reference(raw, qtype, (n, k))


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double().cpu(), ref.double().cpu()
    return ((y - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("qtype", KERNEL_TYPES, **TYPE_IDS)
def test_dequant_bit_exact(qtype, device):
    fmt = BLOCK_FORMATS[qtype]
    # 3 rows; an element count that is not a multiple of the kernel's 1024-element program.
    n_cols = 3 * fmt.block_size if fmt.block_size > 1 else 100
    raw = torch.from_numpy(random_blocks(qtype, 3 * n_cols // fmt.block_size, seed=7))
    raw = raw.reshape(-1)
    expected = reference(raw, qtype, (3, n_cols))
    got = triton_dequantize(raw.to(device), qtype, (3, n_cols), torch.float32).cpu()
    assert got.shape == (3, n_cols)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0], **TYPE_IDS)
def test_dequant_half_outputs(qtype, dtype, device):
    fmt = BLOCK_FORMATS[qtype]
    raw = weight_bytes(qtype, 2, seed=3)
    expected = reference(raw, qtype, (2 * fmt.block_size,))
    got = triton_dequantize(raw.to(device), qtype, (2 * fmt.block_size,), dtype)
    assert got.dtype == dtype
    if device.type == "cpu" and dtype == torch.bfloat16:
        # The interpreter truncates float32 -> bfloat16 instead of rounding to nearest.
        assert rel_err(got.float(), expected) < 2**-7
    else:
        assert torch.equal(got.cpu(), expected.to(dtype))


def q8_reference(x: torch.Tensor) -> torch.Tensor:
    """One vector as the integer-dot GEMV sees it: quantized to 8 bits per 32 values."""
    xq, xd, _ = quantize_q8(x.reshape(-1))
    return (xq.double().reshape(-1, 32) * xd.double()[:, None].cpu()).reshape(1, -1).cpu()


@pytest.mark.parametrize("qtype", KERNEL_TYPES, **TYPE_IDS)
def test_gemv(qtype, device):
    w, wref = make_weight(qtype, n=7, blocks_per_row=3, seed=int(qtype))
    w = w.to(device)
    for rows in (1, 3):
        x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
        y = gemv(w.data, w.qtype, w.shape[0], x.to(device))
        assert y.shape == (rows, 7) and y.dtype == torch.float32
        if rows == 1 and qtype in MMVQ_TYPES:  # integer dot on 8-bit activations
            assert rel_err(y, q8_reference(x.to(device)) @ wref.double().T) < 1e-5
            assert rel_err(y, x.double() @ wref.double().T) < 3e-2
        else:
            assert rel_err(y, x.double() @ wref.double().T) < 1e-5


def test_gemv_batch_and_dtypes(device):
    w, wref = make_weight(T.Q4_K, n=5, blocks_per_row=2, seed=1)
    w = w.to(device)
    x = torch.randn(8, w.shape[1]).half()
    ref = x.double() @ wref.double().T
    y = gemv(w.data, w.qtype, 5, x.to(device))
    assert y.dtype == torch.float16
    assert rel_err(y, ref) < 2e-3  # float32 accumulation, one float16 rounding of the output
    y32 = gemv(w.data, w.qtype, 5, x.to(device), out_dtype=torch.float32)
    assert rel_err(y32, ref) < 1e-5
    # A strided view of x (every other row) gives the same rows.
    xs = x.to(device)[::2]
    assert torch.allclose(gemv(w.data, w.qtype, 5, xs, out_dtype=torch.float32), y32[::2])
    # One float16 vector (the integer-dot kernel on 8-bit activations).
    y1 = gemv(w.data, w.qtype, 5, x[3:4].to(device), out_dtype=torch.float32)
    assert rel_err(y1, q8_reference(x[3:4].to(device)) @ wref.double().T) < 1e-5
    with pytest.raises(ValueError, match="at most 8"):
        gemv(w.data, w.qtype, 5, torch.zeros(9, w.shape[1], device=device))


@pytest.mark.parametrize("qtype", KERNEL_TYPES, **TYPE_IDS)
def test_gemm(qtype, device):
    # K = 96 (legacy) / 144 (float) is not a multiple of block_k; K-quants have K = 512.
    bpr = 2 if BLOCK_FORMATS[qtype].block_size == 256 else 3
    w, wref = make_weight(qtype, n=33, blocks_per_row=bpr, seed=int(qtype))
    w = w.to(device)
    x = torch.randn(17, w.shape[1], generator=torch.Generator().manual_seed(0))
    # Small tiles: several tiles along M, N and K, the last ones partial.
    y = gemm(w.data, w.qtype, 33, x.to(device), block_m=16, block_n=16, block_k=64)
    assert y.shape == (17, 33) and y.dtype == torch.float32
    # float16 inputs, float32 accumulation: the error is that of rounding x and W to float16.
    assert rel_err(y, x.double() @ wref.double().T) < 3e-3
    # Weight by weight (float32 decoding, then rounded to float16): the same products where
    # the type has no chunk decoder in this layout, else within float16 rounding of the
    # scales (the chunk path scales each weight with one float16 FMA).
    y2 = gemm(w.data, w.qtype, 33, x.to(device), block_m=16, block_n=16, block_k=64, grouped=False)
    assert rel_err(y2, x.double() @ wref.double().T) < 3e-3
    if has_chunks(qtype, "blocks"):
        assert rel_err(y, y2) < 2e-3
    else:
        assert torch.equal(y, y2)


@pytest.mark.cuda
def test_gemm_bf16_and_default_tiles(device):
    if device.type != "cuda":
        pytest.skip("bfloat16 products are not emulated by the interpreter")
    w, wref = make_weight(T.Q5_0, n=100, blocks_per_row=9, seed=2)
    w = w.to(device)
    x = torch.randn(70, w.shape[1])
    ref = x.double() @ wref.double().T
    assert rel_err(gemm(w.data, w.qtype, 100, x.to(device)), ref) < 3e-3
    assert rel_err(gemm(w.data, w.qtype, 100, x.to(device), bf16=True), ref) < 2e-2


@pytest.mark.parametrize("rows", [1, 5, 12])
def test_quant_linear_fused(rows, device):
    parts = [make_weight(T.Q8_0, n=n, blocks_per_row=2, seed=n) for n in (6, 3, 3)]
    fused = QuantWeight.cat([p[0] for p in parts]).to(device)
    assert fused.shape == (12, 64) and fused.splits == (6, 3, 3)
    x = torch.randn(rows, 64).reshape(1, rows, 64)  # a leading batch dimension
    outs = quant_linear(x.to(device), fused)
    assert len(outs) == 3
    tol = 1e-5 if rows <= kernels.GEMV_MAX_ROWS else 3e-3
    xr = q8_reference(x.to(device)) if rows == 1 else x.double()  # 1 row: 8-bit activations
    for out, (_, wref) in zip(outs, parts, strict=True):
        assert out.shape == (1, rows, wref.shape[0])
        assert rel_err(out, xr @ wref.double().T) < tol
    single = quant_linear(x.to(device), parts[1][0].to(device))
    assert isinstance(single, torch.Tensor) and single.shape == (1, rows, 3)


def test_quants_backend(device):
    from localllm.kernels.dequant import quants_backend

    from localllm.gguf.quants import dequantize

    raw = weight_bytes(T.Q6_K, 2).to(device)
    out = quants_backend(raw, T.Q6_K, (2, 256), torch.float32)
    if device.type == "cuda":
        # Registered at import: "auto" takes the kernel for CUDA tensors.
        assert torch.equal(out.cpu(), reference(raw.cpu(), T.Q6_K, (2, 256)))
        assert torch.equal(dequantize(raw, T.Q6_K, (2, 256)).cpu(), out.cpu())
    else:
        assert out is None  # the reference handles CPU tensors
    assert quants_backend(raw, T.IQ2_XS, (256,), torch.float32) is None


def test_errors(device):
    raw = torch.zeros(74, dtype=torch.uint8, device=device)
    with pytest.raises(UnsupportedError, match="IQ2_XS"):
        triton_dequantize(raw, T.IQ2_XS, (256,))
    w, _ = make_weight(T.Q4_0, n=2, blocks_per_row=1)
    with pytest.raises(ValueError, match="features"):
        quant_linear(torch.zeros(1, 64, device=device), w.to(device))
    with pytest.raises(ValueError):
        QuantWeight(torch.zeros(10, dtype=torch.uint8), T.Q4_0, (1, 32))
    with pytest.raises(ValueError, match="type or input size"):
        QuantWeight.cat([w, make_weight(T.Q8_0, n=2, blocks_per_row=1)[0]])


def test_triton_unavailable(monkeypatch):
    kernels.triton_available.cache_clear()
    monkeypatch.setitem(sys.modules, "triton", None)  # makes `import triton` fail
    try:
        assert kernels.triton_available() is False
        assert kernels.supports(T.Q4_K) is False
        assert kernels.register_quants_backend() is False
        w, _ = make_weight(T.Q4_0, n=2, blocks_per_row=1)
        with pytest.raises(UnsupportedError, match="Triton is not available"):
            quant_linear(torch.zeros(1, 32), w)
        # The weight still dequantizes, through the torch reference.
        assert w.dequantize(torch.float32).shape == (2, 32)
    finally:
        kernels.triton_available.cache_clear()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_rms_norm(dtype, device):
    from localllm.kernels.norm_rope import rms_norm

    from localllm.backends.dense import rms_norm as torch_rms_norm

    x = (torch.randn(2, 3, 100) * 3).to(dtype)  # D = 100: not a power of two
    w = torch.randn(100)
    y = rms_norm(x.to(device), w.to(device), 1e-6)
    assert y.dtype == dtype and y.shape == x.shape
    ref = torch_rms_norm(x.float(), w, 1e-6)
    assert rel_err(y, ref) < (1e-6 if dtype == torch.float32 else 1e-3)
    y32 = rms_norm(x.to(device), w.to(device), 1e-6, out_dtype=torch.float32)
    assert y32.dtype == torch.float32


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "norm"])
def test_rope(neox, device):
    from localllm.kernels.norm_rope import rope

    from localllm.backends.dense import apply_rope
    from localllm.models.rope import rope_inv_freq

    head_dim = 24  # half = 12: not a power of two
    x = torch.randn(3, 5, head_dim)
    positions = torch.tensor([0, 1, 7, 100, 4095])
    inv = rope_inv_freq(head_dim, 10000.0)
    ref = apply_rope(x, positions, inv, neox=neox, scale=0.5)
    y = rope(x.to(device), positions.to(device), inv.to(device), neox=neox, scale=0.5)
    assert y.shape == x.shape
    assert rel_err(y, ref) < 1e-5
    # A non-contiguous head view (every other head) is handled.
    y2 = rope(x.to(device)[::2], positions.to(device), inv.to(device), neox=neox, scale=0.5)
    assert rel_err(y2, ref[::2]) < 1e-5
