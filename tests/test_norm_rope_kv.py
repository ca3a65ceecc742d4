"""The decode step's fused QKV epilogue (``kernels.fused.norm_rope_kv``) against the torch
path: ``rms_norm`` + ``rotate`` of q and k, then the caches' own ``update`` of k and v.

Runs on CPU tensors through Triton's interpreter and, as a cuda-marked variant, natively.
"""

from __future__ import annotations

import pytest
import torch
from kernel_checks import HOST_READS, NoLaunch, OpRecorder

from localllm.backends.dense import rms_norm, rope_angles, rotate
from localllm.memory import KVCache, RingKVCache
from localllm.models.rope import rope_inv_freq

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import fused
from localllm.kernels.fused import norm_rope_kv

EPS = 1e-6


def qkv_views(n_heads: int, n_kv: int, d: int, device, seed: int = 0):
    """q (H, 1, D), k and v (Hkv, 1, D): views of one fused QKV output, as the models take them."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(1, (n_heads + 2 * n_kv) * d, generator=g) * 3).to(device)
    q = qkv[:, : n_heads * d].reshape(1, n_heads, d).transpose(0, 1)
    k = qkv[:, n_heads * d : (n_heads + n_kv) * d].reshape(1, n_kv, d).transpose(0, 1)
    v = qkv[:, (n_heads + n_kv) * d :].reshape(1, n_kv, d).transpose(0, 1)
    return q, k, v


def make(kind: str, n_kv: int, d: int, dtype, device):
    if kind == "full":
        return KVCache(40, n_kv, d, dtype=dtype, device=device)
    return RingKVCache(8, n_kv, d, slack=5, dtype=dtype, device=device)  # 13 cells


@pytest.mark.parametrize("kind", ["full", "ring"])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "norm"])
@pytest.mark.parametrize(("d", "norms"), [(16, True), (64, False), (256, True)])
def test_matches_torch_path(kind, neox, d, norms, device):
    n_heads, n_kv = 6, 2
    g = torch.Generator().manual_seed(d)
    qw = (torch.rand(d, generator=g) + 0.5).to(device) if norms else None
    kw = (torch.rand(d, generator=g) + 0.5).to(device) if norms else None
    inv = rope_inv_freq(d, 10000.0, device=device)
    got = make(kind, n_kv, d, torch.float32, device)
    want = make(kind, n_kv, d, torch.float32, device)
    for pos in (0, 5, 17, 30):  # the ring (13 cells) wraps
        q, k, v = qkv_views(n_heads, n_kv, d, device, seed=pos)
        positions = torch.tensor([pos], device=device)
        q1 = norm_rope_kv(q, k, v, qw, kw, EPS, positions, inv, got.k, got.v,
                          getattr(got, "positions", None), neox=neox, scale=0.5)  # fmt: skip
        keys, values, k_pos = got.written(pos)
        angles = rope_angles(positions, inv, 0.5)
        rq = rotate(rms_norm(q, qw, EPS) if norms else q, angles, neox=neox)
        rk = rotate(rms_norm(k, kw, EPS) if norms else k, angles, neox=neox)
        wk, wv, wp = want.update(pos, rk, v)
        torch.testing.assert_close(q1.cpu(), rq[:, 0].cpu(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(keys.cpu(), wk.cpu(), rtol=1e-5, atol=1e-5)
        assert torch.equal(values.cpu(), wv.cpu())
        assert (k_pos is None) == (wp is None)
        if k_pos is not None:
            assert torch.equal(k_pos.cpu(), wp.cpu())
        assert got.n == want.n and getattr(got, "linear", None) == getattr(want, "linear", None)


def test_float16_cache_and_tensor_position(device):
    """The static step's form: position in a device tensor, float16 caches (CUDA's type)."""
    n_heads, n_kv, d = 4, 1, 128
    inv = rope_inv_freq(d, 10000.0, device=device)
    cache = make("ring", n_kv, d, torch.float16, device)
    q, k, v = qkv_views(n_heads, n_kv, d, device, seed=3)
    pos = torch.tensor([21], device=device)
    norm_rope_kv(q, k, v, None, None, EPS, pos, inv, cache.k, cache.v, cache.positions,
                 neox=True)  # fmt: skip
    keys, values, k_pos = cache.written(pos)
    assert keys is cache.k and k_pos is cache.positions
    rk = rotate(k, rope_angles(pos, inv), neox=True)[:, 0]
    slot = 21 % cache.size
    torch.testing.assert_close(keys[:, slot].float().cpu(), rk.cpu(), rtol=1e-3, atol=1e-3)
    assert torch.equal(values[:, slot].cpu(), v[:, 0].half().cpu())
    assert k_pos.cpu().tolist() == [-1] * slot + [21] + [-1] * (cache.size - slot - 1)


def _args(**over):
    q, k, v = qkv_views(4, 2, 16, "cpu")
    args = {"q": q, "k": k, "v": v, "q_weight": None, "k_weight": None, "eps": EPS,
            "positions": torch.tensor([3]), "inv_freq": torch.ones(8),
            "k_cache": torch.zeros(2, 10, 16), "v_cache": torch.zeros(2, 10, 16),
            "k_positions": None}  # fmt: skip
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"q": torch.zeros(4, 2, 16), "k": torch.zeros(2, 2, 16), "v": torch.zeros(2, 2, 16)},
         "one token"),
        ({"q": torch.zeros(4, 2, 16)}, "want q"),
        ({"k": torch.zeros(2, 1, 8)}, "want q"),
        ({"inv_freq": torch.ones(16)}, "inv_freq"),
        ({"positions": torch.tensor([1.0])}, "integers"),
        ({"k_cache": torch.zeros(3, 10, 16)}, "caches"),
        ({"v_cache": torch.zeros(2, 11, 16)}, "caches"),
        ({"k_positions": torch.zeros(9, dtype=torch.long)}, "k_positions"),
        ({"q_weight": torch.ones(8)}, "q_weight"),
        ({"k_cache": torch.zeros(2, 10, 16, dtype=torch.bfloat16),
          "v_cache": torch.zeros(2, 10, 16, dtype=torch.bfloat16)}, "float16/float32"),
        ({"q": torch.zeros(4, 1, 16, dtype=torch.float16)}, "float32"),
    ],
)
def test_errors(over, match):
    with pytest.raises(ValueError, match=match):
        norm_rope_kv(**_args(**over), neox=True)


def test_one_launch_no_host_reads(monkeypatch):
    stub = NoLaunch()
    monkeypatch.setattr(fused, "_norm_rope_kv_kernel", stub)
    args = _args(k_positions=torch.full((10,), -1))
    with OpRecorder() as rec:
        norm_rope_kv(**args, neox=False)
    assert stub.grids == [(6,)]  # 4 query heads + 2 KV heads
    assert not rec.ops & HOST_READS and rec.ops <= {"aten.empty"}, rec.ops


@pytest.mark.cuda
def test_cuda_graph_replay(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    d = 256
    inv = rope_inv_freq(d, 10000.0, device=device)
    cache = make("ring", 1, d, torch.float16, device)
    q, k, v = qkv_views(4, 1, d, device, seed=5)
    pos = torch.zeros(1, dtype=torch.long, device=device)
    norm_rope_kv(q, k, v, None, None, EPS, pos, inv, cache.k, cache.v, cache.positions, neox=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = norm_rope_kv(q, k, v, None, None, EPS, pos, inv, cache.k, cache.v,
                           cache.positions, neox=True)  # fmt: skip
    for p in (3, 40):
        pos.fill_(p)
        graph.replay()
        want = rotate(q, rope_angles(pos, inv), neox=True)[:, 0]
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
        assert int(cache.positions[p % cache.size]) == p
