"""Aligned weight planes (``QuantWeight.aligned``, ``localllm.kernels.PLANES``): the types
whose blocks are not 16-byte aligned are repacked field by field so that the kernels read
them with 128-bit loads.

Oracles: gguf-py's numpy dequantizer (bit-exact) and, for the products, the float product of
the reference weights with the same 8-bit activations the kernel quantized (one vector) or
with the float activations (several vectors, GEMM). Kernels run in Triton's interpreter on
the CPU (the portable dp4a and byte-permute code) and natively with ``-m cuda``.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_kernels import rel_err, weight_bytes
from test_mmvq import iq_blocks

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

import triton.language as tl
from localllm.kernels import PLANES, QuantWeight, plane_offsets, quant_linear
from localllm.kernels._jit import kernel
from localllm.kernels.decode import MMVQ32_TYPES, prmt
from localllm.kernels.decode_k23 import MMVQ64_TYPES
from localllm.kernels.dequant import dequantize as triton_dequantize
from localllm.kernels.gemm import gemm
from localllm.kernels.gemv import gemv, mmvq_config, quantize_q8

TYPES = list(PLANES)
IDS = {"ids": lambda q: q.name}


def raw_blocks(qtype: T, n_blocks: int, seed: int) -> torch.Tensor:
    """Random blocks with small finite scales, flat uint8."""
    if qtype in (T.IQ4_NL, T.IQ4_XS, T.MXFP4):
        return torch.from_numpy(iq_blocks(qtype, n_blocks, seed).reshape(-1))
    return weight_bytes(qtype, n_blocks, seed)


def weight(qtype: T, n: int, blocks_per_row: int, seed: int = 0):
    """(blocks-layout QuantWeight, its planes, float32 reference (n, K) from gguf-py)."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    raw = raw_blocks(qtype, n * blocks_per_row, seed)
    w = QuantWeight.from_bytes(raw, qtype, (n, blocks_per_row * bs))
    ref = gguf.quants.dequantize(raw.numpy(), qtype).reshape(n, -1)
    return w, w.aligned(), torch.from_numpy(ref)


def q8_activations(x: torch.Tensor, device) -> torch.Tensor:
    """The (1, K) float64 vector the integer-dot kernels multiply: ``x`` quantized to 8 bits
    per 32 values by the kernel, dequantized exactly."""
    xq, xd, _ = quantize_q8(x[0].to(device))
    return (xq.cpu().double().reshape(-1, 32) * xd.cpu().double()[:, None]).reshape(1, -1)


@pytest.mark.parametrize("qtype", TYPES, **IDS)
def test_repack_is_exact_and_aligned(qtype):
    """Planes hold the same bytes (back to blocks unchanged), each plane starts on a 16-byte
    boundary, and the padding is at most 15 bytes a plane."""
    w, p, _ = weight(qtype, 5, 3, seed=1)
    assert p.layout == "planes" and p.qtype == qtype and p.shape == w.shape
    assert p.data.ndim == 1 and p.data.dtype == torch.uint8
    assert torch.equal(p.blocks(), w.data)
    offs, total = plane_offsets(qtype, w.n_blocks)
    assert all(o % 16 == 0 for o in offs) and total == p.nbytes
    assert 0 <= p.nbytes - w.nbytes <= 15 * len(PLANES[qtype])
    sizes = [s for _, s in PLANES[qtype]]
    assert sum(sizes) == gguf.GGML_QUANT_SIZES[qtype][1]  # every byte of a block, once
    # plane i holds field i of each block, blocks in order
    src, size = PLANES[qtype][0]
    blocks = w.data.reshape(w.n_blocks, -1)
    assert torch.equal(p.data[: w.n_blocks * size].view(w.n_blocks, size),
                       blocks[:, src : src + size])  # fmt: skip
    assert p.aligned() is p and QuantWeight.from_bytes(raw_blocks(T.Q4_K, 2, 0), T.Q4_K,
                                                       (1, 512)).aligned().layout == "blocks"


@pytest.mark.parametrize("qtype", TYPES, **IDS)
def test_memory_within_two_percent(qtype):
    """Repacked in place of, not beside, the file's bytes: the weight holds one copy, within
    2% of the GGUF tensor bytes, for the smallest real matrix shapes (Gemma 3 270M)."""
    bs, ts = gguf.GGML_QUANT_SIZES[qtype]
    for n, k in ((640, 1024), (1536, 640), (1, 256)):
        if k % bs:
            continue
        file_bytes = n * k // bs * ts
        w = QuantWeight.from_bytes(torch.zeros(file_bytes, dtype=torch.uint8), qtype, (n, k))
        p = w.aligned()
        assert p.nbytes <= file_bytes * 1.02 + 15 * len(PLANES[qtype]) * (n == 1)
        assert p.data.untyped_storage().nbytes() == p.nbytes  # no hidden second buffer


@pytest.mark.parametrize("qtype", TYPES, **IDS)
def test_dequant_planes_bit_exact(qtype, device):
    """The dequantize kernel reads planes bit-exactly (3 rows, not a multiple of its tile)."""
    w, p, ref = weight(qtype, 3, 3, seed=2)
    got = triton_dequantize(p.data.to(device), qtype, w.shape, torch.float32, layout="planes")
    assert torch.equal(got.cpu().view(torch.int32), ref.view(torch.int32))
    assert torch.equal(p.to(device).rows(torch.tensor([2, 0], device=device)).cpu(), ref[[2, 0]])


@pytest.mark.parametrize("qtype, n, bpr", [
    (T.Q4_0, 37, 5),  # 37 rows: not a multiple of the rows per program
    (T.Q5_0, 19, 3),
    (T.Q8_0, 41, 10),  # K = 320: 10 sub-blocks, split along K
    (T.IQ4_NL, 13, 7),
    (T.IQ4_XS, 9, 2),
    (T.Q6_K, 11, 3),
    (T.Q2_K, 13, 3),  # _mmvq64_kernel: 64-weight units, 3 blocks: split along K
    (T.Q3_K, 70, 2),  # 70 rows: 9 programs of 8, the last partly past N
    (T.MXFP4, 9, 8),  # _mmvq32_kernel with a lookup table, like IQ4_NL
], ids=lambda v: v.name if isinstance(v, T) else str(v))  # fmt: skip
def test_gemv_one_vector_from_planes(qtype, n, bpr, device):
    """Integer-dot GEMV from planes: exact up to float32 rounding (relative error < 1e-5)
    against the reference weights times the kernel's 8-bit activations; within 3% of the
    float product (what 8-bit activations cost)."""
    w, p, ref = weight(qtype, n, bpr, seed=n)
    x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(bpr))
    y = gemv(p.data.to(device), qtype, n, x.to(device), layout="planes").cpu()
    assert y.shape == (1, n)
    assert rel_err(y, q8_activations(x, device) @ ref.double().T) < 1e-5
    assert rel_err(y, x.double() @ ref.double().T) < 3e-2
    cfg = mmvq_config(qtype, n, w.shape[1], layout="planes")
    assert cfg["UNIT"] == (64 if qtype in MMVQ64_TYPES else 32 if qtype in MMVQ32_TYPES else 16)


def test_gemv_split_k_from_planes(device):
    """A launch shape with the key axis split over programs (partial sums added after)."""
    _w, p, ref = weight(T.Q4_0, 3, 32, seed=5)  # few rows, K = 1024: split to fill the GPU
    assert mmvq_config(T.Q4_0, 3, 1024, layout="planes")["SPLIT"] > 1
    x = torch.randn(1, 1024, generator=torch.Generator().manual_seed(5))
    y = gemv(p.data.to(device), T.Q4_0, 3, x.to(device), layout="planes").cpu()
    assert rel_err(y, q8_activations(x, device) @ ref.double().T) < 1e-5


@pytest.mark.parametrize("qtype", TYPES, **IDS)
def test_gemv_batch_and_gemm_from_planes(qtype, device):
    """Several vectors (float GEMV) and the prefill GEMM (float16 tiles) read the planes."""
    w, p, ref = weight(qtype, 7, 3, seed=4)
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(1))
    y = gemv(p.data.to(device), qtype, 7, x.to(device), layout="planes").cpu()
    assert rel_err(y, x.double() @ ref.double().T) < 1e-5
    xm = torch.randn(17, w.shape[1], generator=torch.Generator().manual_seed(2)).half()
    got = gemm(p.data.to(device), qtype, 7, xm.to(device), out_dtype=torch.float32,
               block_m=16, block_n=16, block_k=32 if w.shape[1] % 256 else 64,
               layout="planes").cpu()  # fmt: skip
    assert rel_err(got, xm.double() @ ref.double().T) < 2e-3


def test_quant_linear_and_cat_keep_the_layout(device):
    """Fused weights (Q/K/V) concatenate plane by plane; quant_linear reads either layout to
    the same result (bit-identical for the batch kernel, which decodes the same floats)."""
    ws = [weight(T.Q5_0, n, 4, seed=n) for n in (5, 3, 2)]
    fused = QuantWeight.cat([p.to(device) for _, p, _ in ws])
    assert fused.layout == "planes" and fused.splits == (5, 3, 2) and fused.shape == (10, 128)
    assert torch.equal(fused.blocks().cpu(), torch.cat([w.data for w, _, _ in ws]))
    blocks = QuantWeight.cat([w.to(device) for w, _, _ in ws])
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(0)).to(device)
    for a, b in zip(quant_linear(x, fused), quant_linear(x, blocks)):
        assert torch.equal(a, b)
    one = quant_linear(x[:1], fused)
    ref = torch.cat([r for _, _, r in ws]).double()
    assert rel_err(torch.cat(one, dim=-1), q8_activations(x[:1].cpu(), device) @ ref.T) < 1e-5


def test_layout_errors():
    w, p, _ = weight(T.Q5_0, 1, 1)  # 22 bytes of blocks, 34 of planes (padding before d)
    assert (w.nbytes, p.nbytes) == (22, 34)
    with pytest.raises(ValueError, match="no layout"):
        QuantWeight(torch.zeros(144, dtype=torch.uint8), T.Q4_K, (1, 256), layout="planes")
    with pytest.raises(ValueError, match="do not hold"):
        QuantWeight(w.data, T.Q5_0, (1, 32), layout="planes")  # blocks bytes, not planes
    with pytest.raises(ValueError, match="do not hold"):
        gemv(w.data, T.Q5_0, 1, torch.randn(1, 32), layout="planes")
    with pytest.raises(ValueError, match="no layout"):
        gemv(p.data, T.Q5_0, 1, torch.randn(1, 32), layout="rows")
    with pytest.raises(ValueError, match="no layout"):
        triton_dequantize(p.data, T.Q4_K, (1, 256), layout="planes")


def test_loader_keeps_planes(tiny_model_path):
    """The quantized (Triton) backend loads Q8_0 matrices as planes, fused ones included."""
    from localllm.runtime.session import load_model

    path = tiny_model_path("llama", qtype=T.Q8_0, n_layers=1)
    m = load_model(path, device="cpu", progress=False, backend="triton")
    layouts = {w.layout for w in _quant_weights(m)}
    assert layouts == {"planes"}


def _quant_weights(obj, seen=None):
    """Every QuantWeight reachable from ``obj``'s attributes."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, QuantWeight):
        return [obj]
    if isinstance(obj, (list, tuple)):
        items = obj
    elif isinstance(obj, dict):
        items = obj.values()
    elif hasattr(obj, "__dict__") and not isinstance(obj, (torch.Tensor, type)):
        items = vars(obj).values()
    else:
        return []
    return [w for v in items for w in _quant_weights(v, seen)]


def test_prmt_portable_matches_ptx_semantics():
    """The interpreter's byte permute is PTX's ``prmt.b32`` (default mode), checked against a
    plain Python statement of the instruction on random words, sign-replicate nibbles too."""
    rng = np.random.default_rng(0)
    a, b, c = (torch.from_numpy(rng.integers(-2**31, 2**31, 64, dtype=np.int64).astype(np.int32))
               for _ in range(3))  # fmt: skip
    out = torch.empty(64, dtype=torch.int32)
    _prmt_kernel[(1,)](a, b, c, out, BLOCK=64)

    def ptx(a, b, c):
        src = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
        r = 0
        for i in range(4):
            s = (c >> (4 * i)) & 15
            byte = (src >> (8 * (s & 7))) & 255
            if s & 8:
                byte = 255 if byte & 128 else 0
            r |= byte << (8 * i)
        return r - (1 << 32) if r & (1 << 31) else r

    want = [ptx(int(x), int(y), int(z)) for x, y, z in zip(a, b, c)]
    assert out.tolist() == want


@kernel
def _prmt_kernel(a, b, c, out, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(out + i, prmt(tl.load(a + i), tl.load(b + i), tl.load(c + i), False))
