"""Triton decode attention (flash-decoding) against the torch reference ``attend``.

Every test runs on CPU tensors through Triton's interpreter and, as a cuda-marked variant,
natively on a GPU (skipped without one). Caches are small (S of 37..300) to keep the
interpreter fast, with sizes that are not multiples of the block size.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from kernel_checks import HOST_READS, NoLaunch, OpRecorder

from localllm.models.common import attend

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import attention
from localllm.kernels.attention import decode_attention, default_block_s, default_n_splits

POISON = 1e4  # written to the slots a query must not see: a leak shows at once


def random_qkv(n_heads, n_kv, s, d, *, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_heads, d, generator=g)
    k = torch.randn(n_kv, s, d, generator=g)
    v = torch.randn(n_kv, s, d, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference(q, k, v, q_pos: int, k_positions=None, window=None, scale=0.125):
    """``attend`` for one query, (1, n_heads * d) float32, on the CPU."""
    s = k.shape[1]
    kp = torch.arange(s) if k_positions is None else k_positions.cpu()
    return attend(q.float().cpu()[:, None], k.float().cpu(), v.float().cpu(),
                  torch.tensor([q_pos]), kp, window=window, scale=scale)  # fmt: skip


def run(q, k, v, q_pos: int, device, **kw):
    kp = kw.pop("k_positions", None)
    return decode_attention(
        q.to(device), k.to(device), v.to(device), torch.tensor([q_pos], device=device),
        k_positions=None if kp is None else kp.to(device), **kw,
    ).cpu()  # fmt: skip


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return ((y - ref).norm() / ref.norm()).item()


def ring_positions(s: int, n_written: int, empty=()) -> torch.Tensor:
    """Slot j of a ring of s slots after writing positions 0..n_written-1; ``empty`` cleared."""
    kp = torch.full((s,), -1, dtype=torch.int64)
    for p in range(n_written):
        kp[p % s] = p
    kp[list(empty)] = -1
    return kp


@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_full_cache_matches_attend(group, where, device):
    n_kv, s, d = 2, 77, 64
    q, k, v = random_qkv(n_kv * group, n_kv, s, d, seed=group)
    q_pos = {"first": 0, "middle": 40, "last": s - 1}[where]
    k[:, q_pos + 1 :] = POISON
    v[:, q_pos + 1 :] = POISON
    y = run(q, k, v, q_pos, device, scale=0.125)
    assert y.shape == (1, n_kv * group * d) and y.dtype == torch.float32
    assert rel_err(y, reference(q, k, v, q_pos)) < 1e-5


@pytest.mark.parametrize("window", [1, 5, 30, 200])
def test_full_cache_window_skips_old_blocks(window, device):
    n_kv, s, d = 1, 90, 64
    q, k, v = random_qkv(2, n_kv, s, d, seed=window)
    q_pos = 70
    k[:, q_pos + 1 :] = POISON
    v[:, q_pos + 1 :] = POISON
    lo = max(0, q_pos - window + 1)
    v[:, :lo] = POISON  # keys before the window must not count either
    y = run(q, k, v, q_pos, device, window=window, scale=0.2, n_splits=3, block_s=8)
    assert rel_err(y, reference(q, k, v, q_pos, window=window, scale=0.2)) < 1e-5


@pytest.mark.parametrize("window", [None, 16, 17])
def test_ring_cache_matches_attend(window, device):
    n_kv, s, d = 2, 50, 64
    q, k, v = random_qkv(4, n_kv, s, d, seed=3)
    n_written = 123  # wrapped twice: slot j holds 100 + j for j < 23, else 50 + j
    kp = ring_positions(s, n_written, empty=(3, 30, 31))
    q_pos = n_written - 1
    if window is not None:
        # q_pos - 16 = 106 sits in slot 6, q_pos - 15 in slot 7: the boundary is hit exactly.
        assert (kp == q_pos - 16).any() and (kp == q_pos - window + 1).any()
    k[:, kp < 0] = POISON
    v[:, kp < 0] = POISON
    y = run(q, k, v, q_pos, device, k_positions=kp, window=window, scale=0.125, n_splits=4)
    assert rel_err(y, reference(q, k, v, q_pos, kp, window)) < 1e-5


def test_ring_cache_with_future_slots(device):
    """Positions past the query (a cache ahead after a rewind) stay invisible."""
    s, d = 40, 64
    q, k, v = random_qkv(2, 1, s, d, seed=4)
    kp = ring_positions(s, 60)
    q_pos = 45
    k[:, kp > q_pos] = POISON
    v[:, kp > q_pos] = POISON
    y = run(q, k, v, q_pos, device, k_positions=kp, scale=0.125, n_splits=2, block_s=8)
    assert rel_err(y, reference(q, k, v, q_pos, kp)) < 1e-5


def test_non_contiguous_cache(device):
    """One layer's (n_kv, S, d) slice of a larger cache is read in place, strides and all."""
    s, d = 45, 64
    q, k_big, v_big = random_qkv(4, 2, 64, d, seed=5)
    k, v = k_big[:, :s], v_big[:, 10 : 10 + s]
    assert not k.is_contiguous()
    kp = ring_positions(s, 70)
    y = run(q, k, v, 69, device, k_positions=kp, scale=0.125)
    assert rel_err(y, reference(q, k, v, 69, kp)) < 1e-5


@pytest.mark.parametrize("q_dtype", [torch.float16, torch.float32])
def test_float16_cache(q_dtype, device):
    n_kv, s, d = 2, 61, 64
    q, k, v = random_qkv(4, n_kv, s, d, seed=6, dtype=torch.float16)
    q = q.to(q_dtype)
    for q_pos in (0, 33, s - 1):
        y = run(q, k, v, q_pos, device, scale=0.125)
        # The kernel widens float16 exactly: only the float32 summation order differs.
        assert rel_err(y, reference(q, k, v, q_pos)) < 1e-5
    kp = ring_positions(s, 100, empty=(0,))
    y = run(q, k, v, 99, device, k_positions=kp, window=40, scale=0.125)
    assert rel_err(y, reference(q, k, v, 99, kp, window=40)) < 1e-5


@pytest.mark.parametrize("n_splits", [1, 2, 5, 16])
def test_splits_and_ragged_blocks(n_splits, device):
    """S = 37 in blocks of 8; 16 splits leave splits past S, small q_pos whole splits empty."""
    s, d = 37, 64
    q, k, v = random_qkv(2, 1, s, d, seed=7)
    for q_pos in (3, 20, s - 1):
        kk, vv = k.clone(), v.clone()
        kk[:, q_pos + 1 :] = POISON
        vv[:, q_pos + 1 :] = POISON
        y = run(q, kk, vv, q_pos, device, scale=0.125, n_splits=n_splits, block_s=8)
        assert rel_err(y, reference(q, kk, vv, q_pos)) < 1e-5
    # Ring: the first split's slots are all empty, the second's all in the future.
    kp = ring_positions(s, s)
    kp[:8] = -1
    kp[8:16] += 1000
    y = run(q, k, v, s - 1, device, k_positions=kp, scale=0.125, n_splits=n_splits, block_s=8)
    assert torch.isfinite(y).all()
    assert rel_err(y, reference(q, k, v, s - 1, kp)) < 1e-5


@pytest.mark.parametrize("d", [64, 256])
def test_head_dims(d, device):
    """Gemma 3 shapes (4 heads on 1 KV head, d = 256, window 512) and d = 64."""
    s = 300
    q, k, v = random_qkv(4, 1, s, d, seed=d)
    for q_pos, window in ((0, None), (150, None), (299, 100)):
        y = run(q, k, v, q_pos, device, window=window, scale=d**-0.5)
        assert rel_err(y, reference(q, k, v, q_pos, window=window, scale=d**-0.5)) < 1e-5


def test_no_visible_key_gives_zeros(device):
    q, k, v = random_qkv(2, 1, 20, 64, seed=8)
    kp = torch.full((20,), -1, dtype=torch.int64)
    y = run(q, k, v, 5, device, k_positions=kp, scale=0.125, n_splits=3)
    assert torch.equal(y, torch.zeros_like(y))


def test_default_sizes_are_functions_of_shapes():
    assert default_block_s(4, 256) * 4 * 256 <= attention.PRODUCT_BUDGET
    assert default_block_s(1, 64) == 32
    assert default_n_splits(37, 2, 16) == 1
    # Long caches: about TARGET_PROGRAMS programs in all, never a split shorter than 64 slots.
    n = default_n_splits(32768, 8, 16)
    assert n * 8 >= attention.TARGET_PROGRAMS and n == 33
    assert default_n_splits(4096, 1, 16) == 64


@pytest.mark.parametrize(
    ("q_shape", "kv_shape", "kwargs", "match"),
    [
        ((4, 48), (2, 10, 48), {}, "power of two"),
        ((4, 512), (2, 10, 512), {}, "power of two"),
        ((3, 64), (2, 10, 64), {}, "KV heads"),
        ((4, 64), (2, 10, 32), {}, "head_dim"),
        ((4, 64), (2, 10, 64), {"window": 0}, "window"),
        ((4, 64), (2, 10, 64), {"n_splits": 0}, "n_splits"),
        ((4, 64), (2, 10, 64), {"block_s": 12}, "block_s"),
        ((4, 64), (2, 10, 64), {"k_positions": torch.arange(9)}, "k_positions"),
    ],
)
def test_bad_arguments(q_shape, kv_shape, kwargs, match):
    q, kv = torch.zeros(q_shape), torch.zeros(kv_shape)
    with pytest.raises(ValueError, match=match):
        decode_attention(q, kv, kv, torch.tensor([0]), scale=1.0, **kwargs)
    with pytest.raises(ValueError, match="q_pos"):
        decode_attention(torch.zeros(4, 64), torch.zeros(2, 5, 64), torch.zeros(2, 5, 64),
                         torch.tensor([0], dtype=torch.int32), scale=1.0)  # fmt: skip


def test_no_host_reads(monkeypatch):
    partial, combine = NoLaunch(), NoLaunch()
    monkeypatch.setattr(attention, "_partial_kernel", partial)
    monkeypatch.setattr(attention, "_combine_kernel", combine)
    q, k, v = random_qkv(4, 2, 50, 64)
    q_pos = torch.tensor([30])
    with OpRecorder() as rec:
        decode_attention(q, k, v, q_pos, scale=0.125)
        decode_attention(q, k, v, q_pos, window=8, scale=0.125, n_splits=3)
        decode_attention(q, k, v, q_pos, k_positions=ring_positions(50, 80), scale=0.125)
    assert partial.launches == combine.launches == 3
    assert not rec.ops & HOST_READS, rec.ops & HOST_READS
    # The recorder does see a host read when there is one: the check above can fail.
    with OpRecorder() as rec:
        q_pos.item()
    assert rec.ops & HOST_READS


@pytest.mark.cuda
def test_cuda_graph_replay(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    s, d = 256, 128
    q, k, v = (t.to(device) for t in random_qkv(8, 2, s, d, seed=9))
    q_pos = torch.tensor([0], device=device)
    decode_attention(q, k, v, q_pos, scale=0.1)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, q_pos, scale=0.1)
    for p in (5, 100, s - 1):
        q_pos.fill_(p)
        graph.replay()
        assert rel_err(out.cpu(), reference(q, k, v, p, scale=0.1)) < 1e-5


# Run in a fresh process: Triton's interpreter patches triton.language during the interpreted
# tests above and (3.6 to 3.9) does not undo the patches made for @jit helpers such as tl.sum;
# a native compile after them in the same process failed ("'value' object has no attribute
# 'dtype'") until kernels/_jit.py restored them. The check must not depend on that state.
COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from localllm.kernels import attention

def compile_(kernel, pointers, constexprs):
    fn = JITFunction(kernel.fn)
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        else:
            sig[name] = pointers.get(name, "fp32" if name == "qk_scale" else "i32")
    src = ASTSource(fn=fn, signature=sig, constexprs=constexprs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    assert out.asm["cubin"]

ptrs = {n: "*fp16" for n in ("q", "k_cache", "v_cache")}
ptrs |= {"q_pos_ptr": "*i64", "k_pos": "*i64"}
ptrs |= {n: "*fp32" for n in ("ws_m", "ws_l", "ws_acc")}
for ring in (False, True):
    cx = {"GROUP": 4, "GROUP_PAD": 4, "D": 256, "BLOCK_S": attention.default_block_s(4, 256),
          "RING": ring, "HAS_WINDOW": True}
    compile_(attention._partial_kernel, ptrs, cx)
compile_(attention._combine_kernel, {n: "*fp32" for n in ("ws_m", "ws_l", "ws_acc", "out")},
         {"D": 256, "SPLITS_PAD": 64, "CHUNK": 16})
print("compiled")
"""


def test_compiles_for_sm90():
    """Both kernels compile to a cubin for an H100 (sm_90) without a GPU (bundled ptxas)."""
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import ASTSource  # noqa: F401
    except ImportError:
        pytest.skip("this Triton has no ASTSource/GPUTarget")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", COMPILE_SCRIPT],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("compiled")
