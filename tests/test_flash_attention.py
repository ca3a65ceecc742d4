"""The flash-attention prefill kernel (``localllm.kernels.prefill_attention``) against
``attend`` (localllm.backends.dense, float32 softmax over the masked scores) and torch's SDPA.

Results in Triton's interpreter on the CPU (and natively with ``-m cuda``); small shapes with
lengths that are not multiples of the tiles. Compiled code: tests/test_kernel_compile.py and
the static checks at the end (sm_90 SASS: tensor-core products, no spills).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from localllm.backends.dense import attend
from localllm.memory import attention_mask

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import _aot, prefill_attention
from localllm.kernels.flash_attention import prefill_case, prefill_config

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import kernel_profile


def _qkv(n_heads, n_kv, t, s, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_heads, t, d, generator=g)
    k = torch.randn(n_kv, s, d, generator=g).to(dtype)
    v = torch.randn(n_kv, s, d, generator=g).to(dtype)
    return q, k, v


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# (query heads, KV heads, queries, slots, head_dim, window, softcap)
CASES = {
    "causal-prompt": (4, 2, 21, 21, 32, None, None),  # a whole prompt into an empty cache
    "chunk-after-prefix": (4, 4, 7, 27, 64, None, None),  # positions 20..26
    "gqa4-window": (8, 2, 19, 40, 32, 6, None),  # window edge mid-block
    "gqa7-d48": (7, 1, 9, 9, 48, None, None),  # a group that is no power of two; padded D
    "mqa-softcap": (4, 1, 11, 30, 32, None, 20.0),  # Gemma 2's soft-capping
    "window-softcap": (2, 1, 13, 33, 16, 4, 30.0),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_matches_attend(case, dtype, device):
    """Slot j holds position j (a full cache or a ring before it wraps); the queries are the
    last T positions. Small tiles: several row blocks and key steps, the last ones partial;
    the window and the causal diagonal cut blocks in the middle."""
    nh, nkv, t, s, d, window, softcap = CASES[case]
    q, k, v = _qkv(nh, nkv, t, s, d, dtype, seed=len(case))
    qp = torch.arange(s - t, s)
    got = prefill_attention(q.to(device), k.to(device), v.to(device), qp.to(device), None,
                            window=window, scale=d**-0.5, softcap=softcap, block_m=16,
                            block_n=16).cpu()  # fmt: skip
    want = attend(q, k, v, qp, None, window=window, scale=d**-0.5, softcap=softcap)
    assert got.shape == want.shape == (t, nh * d) and got.dtype == torch.float32
    # float16 caches: q and the softmax weights rounded to float16 (as llama.cpp's fattn)
    assert _rel(got, want) < (1e-5 if dtype == torch.float32 else 3e-3)


def test_default_tiles(device):
    """The launch's own tile shape (prefill_config) on a prompt longer than one row block."""
    q, k, v = _qkv(4, 2, 40, 40, 64, torch.float32, seed=1)
    qp = torch.arange(40)
    got = prefill_attention(q.to(device), k.to(device), v.to(device), qp.to(device), None,
                            window=None, scale=0.125).cpu()  # fmt: skip
    assert _rel(got, attend(q, k, v, qp, None, window=None, scale=0.125)) < 1e-5


def test_ring_positions(device):
    """A wrapped ring (RingKVCache.update's keys: empty slots -1, positions out of order) with
    a window, GQA 2, against attend and against torch's SDPA with the boolean mask."""
    q, k, v = _qkv(4, 2, 5, 16, 32, torch.float32, seed=3)
    kp = torch.tensor([16, 17, 18, -1, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15])
    qp = torch.arange(15, 20)
    got = prefill_attention(q.to(device), k.to(device), v.to(device), qp.to(device),
                            kp.to(device), window=6, scale=0.2, block_m=16,
                            block_n=16).cpu()  # fmt: skip
    assert _rel(got, attend(q, k, v, qp, kp, window=6, scale=0.2)) < 1e-5
    mask = attention_mask(qp, kp, 6)
    kk, vv = k.repeat_interleave(2, 0), v.repeat_interleave(2, 0)
    sdpa = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask, scale=0.2)
    assert _rel(got, sdpa.transpose(0, 1).reshape(5, -1)) < 1e-5


def test_reads_only_what_a_block_sees(device):
    """Slots past the block's last position, before its window, and a ring's empty slots are
    never read: NaN there leaves the result finite and equal to attend on clean data."""
    q, k, v = _qkv(2, 1, 8, 64, 16, torch.float32, seed=4)
    qp = torch.arange(40, 48)
    dirty_k, dirty_v = k.clone(), v.clone()
    for x in (dirty_k, dirty_v):
        x[:, 48:] = float("nan")  # after the last query
        x[:, :32] = float("nan")  # before the window of every query (40 - 8 + 1 = 33)
    got = prefill_attention(q.to(device), dirty_k.to(device), dirty_v.to(device),
                            qp.to(device), None, window=8, scale=0.25, block_m=16,
                            block_n=16).cpu()  # fmt: skip
    assert torch.isfinite(got).all()
    assert _rel(got, attend(q, k, v, qp, None, window=8, scale=0.25)) < 1e-5
    kp = torch.arange(64)
    kp[50:] = -1  # empty ring slots hold NaN
    got = prefill_attention(q.to(device), dirty_k.to(device), dirty_v.to(device),
                            qp.to(device), kp.to(device), window=8, scale=0.25, block_m=16,
                            block_n=16).cpu()  # fmt: skip
    assert torch.isfinite(got).all()
    assert _rel(got, attend(q, k, v, qp, kp, window=8, scale=0.25)) < 1e-5


def test_no_visible_key_gives_zeros(device):
    """A query that sees nothing (an all-empty ring) gives zeros, not NaN."""
    q, k, v = _qkv(2, 1, 3, 16, 16, torch.float32)
    kp = torch.full((16,), -1, dtype=torch.int64)
    got = prefill_attention(q.to(device), k.to(device), v.to(device), torch.arange(3).to(device),
                            kp.to(device), window=None, scale=0.25)  # fmt: skip
    assert torch.equal(got.cpu(), torch.zeros(3, 32))
    empty = prefill_attention(q[:, :0].to(device), k.to(device), v.to(device),
                              torch.arange(0).to(device), None, window=None, scale=0.25)
    assert empty.shape == (0, 32)


def test_bad_arguments():
    q, k, v = _qkv(4, 2, 3, 8, 16, torch.float32)
    qp = torch.arange(5, 8)
    with pytest.raises(ValueError, match="split into"):
        prefill_attention(q[:3], k, v, qp, None, window=None, scale=1.0)
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention(q, k[..., :8], v[..., :8], qp, None, window=None, scale=1.0)
    with pytest.raises(ValueError, match="float32 or float16"):
        prefill_attention(q, k.double(), v.double(), qp, None, window=None, scale=1.0)
    with pytest.raises(ValueError, match="q_positions"):
        prefill_attention(q, k, v, qp.int(), None, window=None, scale=1.0)
    with pytest.raises(ValueError, match="k_positions"):
        prefill_attention(q, k, v, qp, torch.arange(7), window=None, scale=1.0)
    with pytest.raises(ValueError, match="window"):
        prefill_attention(q, k, v, qp, None, window=0, scale=1.0)
    with pytest.raises(ValueError, match="softcap"):
        prefill_attention(q, k, v, qp, None, window=None, scale=1.0, softcap=-1.0)
    with pytest.raises(ValueError, match="power of two"):
        prefill_attention(q, k, v, qp, None, window=None, scale=1.0, block_n=24)


def _compiled(case):
    try:
        return _aot.compile_case(case)
    except _aot.CompileUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("args", [
    {"group": 4, "d": 128},  # Llama-3-8B
    {"group": 4, "d": 256, "window": True, "kpos": True},  # Gemma 3's sliding layers
    {"group": 2, "d": 256, "window": True, "kpos": True, "softcap": True},  # Gemma 2
], ids=["llama", "gemma3-ring", "gemma2-softcap"])  # fmt: skip
def test_static_tensor_cores_no_spills(args):
    """sm_90: both products on tensor cores (HGMMA) in the main loop, no spills."""
    compiled = _compiled(prefill_case(**args))
    instrs = _aot.parse_sass(_aot.sass(compiled.asm["cubin"]))
    assert not [i for i in instrs if i.base in ("LDL", "STL")]
    assert _aot.resource_usage(compiled.asm["cubin"]).get("LOCAL", 0) == 0
    body = kernel_profile._main_loop(instrs, "HGMMA")
    assert sum(1 for i in body if i.base == "HGMMA") >= 2
    d_pad = prefill_config(args["d"], torch.float16)["D_PAD"]
    assert compiled.metadata.shared <= 227 * 1024 and d_pad == args["d"]


def test_profile_estimate():
    """bench/kernel_profile.py's estimate for Llama-3-8B at 512 tokens: a share of the dense
    peak that accounts for the causal mask (useful FLOP below the computed ones)."""
    cache = {}

    def compiled_figures(name, case, launch):
        if name not in cache:
            c = _compiled(case)
            cache[name] = (kernel_profile.static_figures(c, case, launch), None)
        return cache[name]

    rec = kernel_profile.attention_prefill_record("llama3-8b", 90, compiled_figures)
    est = rec["estimated"]
    assert rec["spill_instructions"] == 0 and rec["loop_mma"] >= 2
    assert 0.5 < est["useful_fraction"] < 1.0
    assert 0 < est["peak_fraction"] <= est["useful_fraction"]
