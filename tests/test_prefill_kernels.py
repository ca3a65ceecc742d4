"""Prefill on the Triton backend: attention in the cache's dtype (torch's fused SDPA) against
``attend``, and bfloat16 GEMM inputs where float16 would overflow (Gemma)."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from localllm.backends.dense import attend, prefill_attention
from localllm.models.common import Linear

kernels = pytest.importorskip("localllm.kernels")
TritonMatrix = pytest.importorskip("localllm.backends.triton").TritonMatrix


def _qkv(n_heads, n_kv, t, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_heads, t, d, generator=g)
    k = torch.randn(n_kv, s, d, generator=g).to(dtype)
    v = torch.randn(n_kv, s, d, generator=g).to(dtype)
    return q, k, v


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_attention_full_cache(dtype, group):
    """A chunk of 7 queries at positions 20..26 over a 27-slot cache; with and without a
    window."""
    q, k, v = _qkv(2 * group, 2, 7, 27, 64, dtype, seed=group)
    qp = torch.arange(20, 27)
    for window in (None, 5):
        got = prefill_attention(q, k, v, qp, None, window=window, scale=0.125)
        want = attend(q, k, v, qp, None, window=window, scale=0.125)
        assert got.shape == want.shape == (7, 2 * group * 64) and got.dtype == torch.float32
        assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_prefill_attention_ring_positions():
    """A wrapped ring's keys with empty (-1) and future slots, as RingKVCache.update returns."""
    q, k, v = _qkv(4, 2, 5, 16, 32, torch.float32, seed=3)
    kp = torch.tensor([16, 17, 18, -1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])
    qp = torch.arange(15, 20)
    got = prefill_attention(q, k, v, qp, kp, window=6, scale=0.2)
    want = attend(q, k, v, qp, kp, window=6, scale=0.2)
    assert _rel(got, want) < 1e-5


def _q8_weight(rng):
    from localllm.kernels import QuantWeight

    w = (rng.standard_normal((40, 64)) * 0.1).astype(np.float32)
    q8 = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    dense = torch.from_numpy(gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0))
    return QuantWeight.from_bytes(q8, gguf.GGMLQuantizationType.Q8_0, (40, 64)), dense


def test_bf16_prefill_passes_float32_tiles(monkeypatch):
    """With ``bf16`` the GEMM gets the float32 activations and rounds them to bfloat16
    itself: no float16 copy (which would overflow) is made on the way."""
    if not kernels.triton_available():
        pytest.skip("Triton is not installed")
    from localllm.kernels import gemm as gemm_mod

    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda x, *args, **kw: seen.append((x.dtype, kw["BF16"]))

    monkeypatch.setattr(gemm_mod, "_gemm_kernel", Recorder())
    qw, _ = _q8_weight(np.random.default_rng(0))
    lin = Linear(TritonMatrix(qw))
    x = torch.full((9, 64), 1e5)
    lin(x)
    lin.weight.bf16 = True
    lin(x)
    lin(x[:2])  # decode rows: the GEMV, unchanged
    assert seen == [(torch.float16, False), (torch.float32, True)]
    # (the products themselves: test_bf16_prefill_product_does_not_overflow)


def test_bf16_prefill_product_does_not_overflow(device):
    """Activations past float16's 65504 (Gemma's gated FFN products): the GEMM in float16
    gives inf, in bfloat16 the product within bfloat16's rounding (emulated exactly in the
    interpreter: bfloat16-rounded operands, float32 products and sums)."""
    rng = np.random.default_rng(0)
    qw, dense = _q8_weight(rng)
    x = torch.from_numpy(rng.standard_normal((9, 64)).astype(np.float32)) * 3e5
    want = x.double() @ dense.double().T
    lin = Linear(TritonMatrix(qw.to(device)))
    assert not torch.isfinite(lin(x.to(device))).all()  # float16 tiles: inf
    lin.weight.bf16 = True
    y = lin(x.to(device)).cpu()
    assert torch.isfinite(y).all()
    assert 1e-4 < _rel(y.double(), want) < 1e-2  # bfloat16's 8-bit mantissa, no more


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q5_K])
def test_gemm_word_path_default_tiles(qtype, device):
    """Q4_K / Q5_K through the word path with the default 128-row tile (8 warps): 70 rows
    and 40 columns (both partial tiles), K = 512, against gguf-py's dequantizer."""
    if not kernels.triton_available():
        pytest.skip("Triton is not installed")
    from localllm.kernels.gemm import gemm

    rng = np.random.default_rng(int(qtype))
    n, k = 40, 512
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
    raw.reshape(n, -1, size)[:, :, :4] = np.frombuffer(  # sane fp16 d and dmin
        np.array([0.01, 0.005], dtype=np.float16).tobytes(), dtype=np.uint8)
    dense = torch.from_numpy(gguf.quants.dequantize(raw, qtype).reshape(n, k))
    x = torch.from_numpy(rng.standard_normal((70, k)).astype(np.float32))
    y = gemm(torch.from_numpy(raw).reshape(-1).to(device), qtype, n, x.to(device),
             out_dtype=torch.float32).cpu()  # fmt: skip
    assert _rel(y.double(), x.double() @ dense.double().T) < 3e-3


def test_gemma_prefills_in_bf16(tiny_model_path):
    from localllm.runtime.session import load_model

    path = tiny_model_path("gemma3", qtype=gguf.GGMLQuantizationType.Q8_0, n_layers=1)
    m = load_model(path, device="cpu", progress=False, backend="triton").model
    linears = [v for v in vars(m.layers[0]).values() if isinstance(v, Linear)]
    assert len(linears) == 4 and all(lin.weight.bf16 for lin in linears)
    assert m.output.weight.bf16
    llama = load_model(tiny_model_path("llama", qtype=gguf.GGMLQuantizationType.Q8_0),
                       device="cpu", progress=False, backend="triton").model  # fmt: skip
    assert not any(v.weight.bf16 for v in vars(llama.layers[0]).values()
                   if isinstance(v, Linear))
