"""The native CPU kernels (localllm.cpu) against the torch reference dequantizer.

Dequantization is bit-exact with :func:`localllm.gguf.quants.dequantize` (itself bit-exact
with gguf-py); products are checked against a float64 product of the reference weights,
within float32 summation error. Shapes are not multiples of the blocking (rows, legacy
columns) and activations have 1..8 rows (the GEMV) or more (tiled prefill).

The kernels are compiled on first use: where a C++ compiler exists (CI), a failed build is
a test failure, not a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_quants import SCALE_OFFSETS

from localllm import cpu
from localllm.backends.dense import TorchOps
from localllm.errors import ParameterError, UnsupportedError
from localllm.gguf.quants import BLOCK_FORMATS
from localllm.gguf.quants import dequantize as reference

if not cpu.available():
    if shutil.which("c++") and os.environ.get("LOCALLLM_NATIVE_CPU", "1") != "0":
        pytest.fail("a C++ compiler exists but the native CPU kernels did not build",
                    pytrace=False)
    pytest.skip("native CPU kernels unavailable (no compiler)", allow_module_level=True)

QUANT_TYPES = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
               T.MXFP4]
ALL_TYPES = QUANT_TYPES + [T.F32, T.F16, T.BF16]
IDS = {"ids": lambda q: q.name}


def weight_bytes(qtype: T, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """(rows * row_bytes,) uint8 of random blocks with finite scales of varied magnitude."""
    rng = np.random.default_rng(seed)
    if qtype in (T.F32, T.F16):
        dt = np.float32 if qtype == T.F32 else np.float16
        return rng.standard_normal(rows * cols).astype(dt).view(np.uint8)
    if qtype == T.BF16:
        f = rng.standard_normal(rows * cols).astype(np.float32)
        return (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    fmt = BLOCK_FORMATS[qtype]
    n = rows * cols // fmt.block_size
    b = rng.integers(0, 256, (n, fmt.type_size), dtype=np.uint8)
    for off in SCALE_OFFSETS.get(qtype, []):
        scale = rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1, n)
        b[:, off:off + 2] = scale.astype(np.float16).view(np.uint8).reshape(n, 2)
    if qtype == T.MXFP4:  # e8m0 scales 2^-13 .. 2^0 (any byte is valid; these stay finite)
        b[:, 0] = rng.integers(115, 129, n)
    return b.reshape(-1)


def cols_for(qtype: T) -> int:
    """Columns that are whole blocks but not a multiple of 256 where the format allows."""
    return 3 * 256 if BLOCK_FORMATS[qtype].block_size == 256 else 7 * 32


def packed(qtype: T, rows: int, cols: int, seed: int = 0, q8: bool = False):
    raw = weight_bytes(qtype, rows, cols, seed)
    return (cpu.PackedWeight.from_bytes(raw, qtype, (rows, cols), q8=q8),
            reference(raw, qtype, (rows, cols)))


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """x (T, cols) as the int8 GEMV sees it: per 32 values q = round-half-even(x * 127 / amax),
    times amax / 127 (llama.cpp quantize_row_q8_0's rule, float32 scales)."""
    t, cols = x.shape
    xb = x.view(t, cols // 32, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv) * (amax / 127)).view(t, cols)


def assert_close_product(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """y == x @ w.T within float32 summation error (bounded by |x| @ |w|.T)."""
    exact = x.double() @ w.double().T
    bound = x.double().abs() @ w.double().abs().T
    err = (y.double() - exact).abs()
    assert y.dtype == torch.float32 and y.shape == exact.shape
    assert bool((err <= 2e-6 * bound + 1e-30).all()), float((err / (bound + 1e-30)).max())


@pytest.mark.parametrize("qtype", ALL_TYPES, **IDS)
def test_dequantize_rows_bit_exact(qtype):
    rows, cols = 5, cols_for(qtype)
    w, ref = packed(qtype, rows, cols, seed=int(qtype))
    assert torch.equal(w.dequantize().view(torch.int32), ref.view(torch.int32))
    # A row range, and looked-up rows (the embedding path).
    assert torch.equal(w.dequantize(2, 4).view(torch.int32), ref[2:4].view(torch.int32))
    idx = torch.tensor([4, 0, 4, 2])
    assert torch.equal(w.rows(idx).view(torch.int32), ref[idx].view(torch.int32))


@pytest.mark.parametrize("qtype", ALL_TYPES, **IDS)
def test_gemv_1_to_8_rows(qtype):
    rows, cols = 37, cols_for(qtype)
    w, ref = packed(qtype, rows, cols, seed=3)
    assert not w.q8
    gen = torch.Generator().manual_seed(int(qtype))
    for t in range(1, cpu.GEMV_MAX_ROWS + 1):
        x = torch.randn(t, cols, generator=gen)
        assert_close_product(cpu.qmatmul(x, w), x, ref)


needs_q8 = pytest.mark.skipif(not cpu.q8_activations(),
                              reason="the int8 GEMV needs AVX2 or AVX512-VNNI")
needs_moe = pytest.mark.skipif(not cpu.moe_q8(), reason="moe_ffn_q8 needs AVX512-VNNI")


@needs_q8
@pytest.mark.parametrize("qtype", QUANT_TYPES, **IDS)
def test_gemv_int8_activations(qtype):
    """The int8 GEMV is the exact product of the weights with the q8-quantized activations
    (up to float32 summation), and within the quantization error of the float product.
    Odd block counts (legacy columns 7 x 32) exercise the unpaired last block."""
    rows, cols = 37, cols_for(qtype)
    w, ref = packed(qtype, rows, cols, seed=3, q8=True)
    assert w.q8
    gen = torch.Generator().manual_seed(int(qtype))
    for t in range(1, cpu.GEMV_MAX_ROWS + 1):
        x = torch.randn(t, cols, generator=gen) * torch.rand(t, cols, generator=gen) ** 4 * 10
        y = cpu.qmatmul(x, w)
        assert_close_product(y, q8_activations(x), ref)
        exact = x.double() @ ref.double().T
        scale = x.double().abs() @ ref.double().abs().T
        assert float(((y.double() - exact).abs() / scale).max()) < 2e-2


@pytest.mark.parametrize("q8", [False, pytest.param(True, marks=needs_q8)])
@pytest.mark.parametrize("qtype", QUANT_TYPES, **IDS)
def test_gemv_rows_equal_one_row_products(qtype, q8):
    """Each row of a 2-8 row product is bit for bit that row's one-row product (decode's
    GEMV): a speculative verification batch scores its tokens exactly as decoding would."""
    rows, cols = 37, cols_for(qtype)
    w, _ = packed(qtype, rows, cols, seed=5, q8=q8)
    gen = torch.Generator().manual_seed(int(qtype) + 100)
    for t in range(2, cpu.GEMV_MAX_ROWS + 1):
        x = torch.randn(t, cols, generator=gen) * torch.rand(t, cols, generator=gen) ** 2 * 4
        y = cpu.qmatmul(x, w)
        for i in range(t):
            assert torch.equal(y[i], cpu.qmatmul(x[i:i + 1], w)[0]), (t, i)


@needs_q8
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K], **IDS)
def test_gemv_int8_k4_scale_groups(qtype):
    """Q4_K/Q5_K unpack the scales of four blocks at once: rows of 1 to 9 blocks (whole and
    partial groups of four, each block with its own random scales and minimums) give the
    exact product with the q8-quantized activations."""
    gen = torch.Generator().manual_seed(11)
    for nblocks in range(1, 10):
        cols = 256 * nblocks
        w, ref = packed(qtype, 19, cols, seed=nblocks, q8=True)
        for t in (1, 3):
            x = torch.randn(t, cols, generator=gen)
            assert_close_product(cpu.qmatmul(x, w), q8_activations(x), ref)


@needs_q8
def test_gemv_int8_activations_zero_and_float_weights():
    """An all-zero activation block has scale 0 (no division by zero); float weights keep
    float32 activations."""
    w, ref = packed(T.Q4_0, 5, 64, q8=True)
    x = torch.zeros(1, 64)
    x[0, 40] = 3.0
    torch.testing.assert_close(cpu.qmatmul(x, w), x @ ref.T, rtol=1e-6, atol=0)
    f, _ = packed(T.F16, 5, 64, q8=True)
    assert not f.q8


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q5_0, T.Q3_K], **IDS)
def test_prefill_tiles(qtype, monkeypatch):
    # Tiles of 48 rows over 100 rows: a ragged last tile.
    cols = cols_for(qtype)
    monkeypatch.setattr(cpu, "TILE_ELEMENTS", 48 * cols)
    w, ref = packed(qtype, 100, cols, seed=5)
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(1))
    assert_close_product(cpu.qmatmul(x, w), x, ref)


@pytest.mark.parametrize("t", [3, 13])
def test_rows_spaced_x_is_used_in_place(t):
    # x a column slice of a wider product (the FFN activation over the gate half): the same
    # result as from a contiguous copy, GEMV and prefill alike.
    cols = 256
    w, ref = packed(T.Q4_K, 40, cols, seed=7)
    wide = torch.randn(t, 2 * cols, generator=torch.Generator().manual_seed(2))
    x = wide[:, :cols]
    assert not x.is_contiguous()
    torch.testing.assert_close(cpu.qmatmul(x, w), cpu.qmatmul(x.contiguous(), w),
                               rtol=0, atol=0)
    assert_close_product(cpu.qmatmul(x, w), x, ref)


def test_prefill_tiles_in_bfloat16(monkeypatch):
    # bfloat16 x, W and products (float32 accumulation): within a few bfloat16 roundings.
    cols = 256
    monkeypatch.setattr(cpu, "TILE_ELEMENTS", 48 * cols)
    w, ref = packed(T.Q4_K, 100, cols, seed=6)
    x = torch.randn(13, cols, generator=torch.Generator().manual_seed(1))
    y = cpu.qmatmul(x, w, prefill_dtype=torch.bfloat16)
    bound = x.double().abs() @ ref.double().abs().T
    err = (y.double() - x.double() @ ref.double().T).abs()
    assert y.dtype == torch.float32 and bool((err <= 1e-2 * bound).all())
    assert not torch.equal(y, cpu.qmatmul(x, w))  # it did take the bfloat16 path


def test_bf16_gemm_choice(monkeypatch):
    monkeypatch.setenv("LOCALLLM_CPU_PREFILL", "fp32")
    assert not cpu.bf16_gemm()
    monkeypatch.setenv("LOCALLLM_CPU_PREFILL", "bf16")
    assert cpu.bf16_gemm()


def test_threads_do_not_change_results():
    w, _ = packed(T.Q4_K, 2048, 512, seed=9)
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(2))
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.qmatmul(x, w)
        torch.set_num_threads(max(2, n))
        many = cpu.qmatmul(x, w)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, many)  # rows are independent: the split cannot change a sum


def test_fused_linear_writes_column_slices_with_biases():
    cols = 256
    (wa, ra), (wb, rb) = packed(T.Q4_K, 40, cols, 1), packed(T.Q6_K, 24, cols, 2)
    bias = torch.randn(24)
    fused = cpu.NativeFusedLinear([cpu.NativeLinear(wa), cpu.NativeLinear(wb, bias)])
    for t in (1, 5, 11):
        x = torch.randn(t, cols)
        ya, yb = fused(x)
        assert ya.shape == (t, 40) and yb.shape == (t, 24)
        assert_close_product(ya, x, ra)
        assert_close_product(yb - bias, x, rb)


def test_embedding_and_tied_head():
    w, ref = packed(T.Q8_0, 50, 64, seed=4)
    emb = cpu.NativeEmbedding(w)
    tokens = torch.tensor([3, 49, 0])
    assert torch.equal(emb(tokens), ref[tokens])
    x = torch.randn(2, 64)
    assert_close_product(emb.head(x), x, ref)


def test_errors():
    raw = weight_bytes(T.Q4_K, 4, 256)
    with pytest.raises(ParameterError, match="takes 576 bytes"):
        cpu.PackedWeight.from_bytes(raw[:-1], T.Q4_K, (4, 256))
    with pytest.raises(UnsupportedError, match="no native CPU kernel"):
        cpu.PackedWeight.from_bytes(raw, T.Q4_K, (2, 512 + 256 + 32))
    with pytest.raises(UnsupportedError, match="no native CPU kernel"):
        cpu.PackedWeight.from_bytes(raw, T.IQ4_XS, (4, 256))
    w = cpu.PackedWeight.from_bytes(raw, T.Q4_K, (4, 256))
    with pytest.raises(ParameterError, match=r"x must be \(T, 256\)"):
        cpu.qmatmul(torch.zeros(1, 255), w)
    assert cpu.qmatmul(torch.zeros(0, 256), w).shape == (0, 4)


def test_fallback_notice_without_a_compiler(tmp_path):
    """A failed build prints one notice and leaves the torch path (available() False)."""
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"), XDG_CACHE_HOME=str(tmp_path))
    code = "import localllm.cpu as c; print(c.available())"
    r = subprocess.run([sys.executable, "-c", code], check=False, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "False"
    notices = [ln for ln in r.stderr.splitlines() if ln.startswith("notice: native CPU kernels")]
    assert len(notices) == 1 and "torch path" in notices[0], r.stderr
    assert "Traceback" not in r.stderr


PORTABLE = """
import sys, torch
import localllm.cpu as cpu
assert cpu.available() and not cpu.q8_activations(), "the x86-64 build: float GEMV only"
out = {}
for name, (raw, qtype, shape, x) in torch.load(sys.argv[1]).items():
    w = cpu.PackedWeight.from_bytes(raw, qtype, shape)
    out[name] = (w.dequantize(), cpu.qmatmul(x, w),
                 torch.ops.localllm_cpu.rms_norm(x, torch.ones(shape[1]), 1e-6),
                 torch.ops.localllm_cpu.gated(x, x, 0))
torch.save(out, sys.argv[2])
"""


@pytest.mark.skipif(os.uname().machine != "x86_64", reason="-march=x86-64 builds on x86-64")
def test_portable_build(tmp_path):
    """The build without AVX2 (LOCALLLM_CPU_ARCH=x86-64: simd.h's 16 scalar lanes) compiles
    and computes what the reference does: dequantization bit-exact, the float32 GEMV within
    summation error, rms_norm and SiLU as torch's."""
    cases = {}
    for qtype in [T.Q4_0, T.Q5_1, T.Q3_K, T.Q5_K, T.F16]:
        cols = cols_for(qtype) if qtype != T.F16 else 224
        raw = weight_bytes(qtype, 5, cols, seed=2)
        cases[qtype.name] = (torch.from_numpy(raw), int(qtype), (5, cols), torch.randn(3, cols))
    torch.save(cases, tmp_path / "cases.pt")
    env = dict(os.environ, LOCALLLM_CPU_ARCH="x86-64")
    r = subprocess.run([sys.executable, "-c", PORTABLE, str(tmp_path / "cases.pt"),
                        str(tmp_path / "out.pt")], env=env, capture_output=True, check=False,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    out = torch.load(tmp_path / "out.pt")
    for name, (raw, qtype, shape, x) in cases.items():
        w, y, n, g = out[name]
        ref = reference(raw.numpy(), qtype, shape)
        assert torch.equal(w, ref), name
        assert_close_product(y, x, ref)
        torch.testing.assert_close(n, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        torch.testing.assert_close(g, torch.nn.functional.silu(x) * x)


@pytest.mark.parametrize("arch,qtype", [("gemma3", T.Q8_0), ("llama", T.Q4_0), ("qwen2", T.F16)])
def test_model_native_equals_dequantized(tiny_model_path, arch, qtype):
    """A tiny model on the native path (float32: exact products) gives the logits of the
    float32 dequantized path, in decode (GEMV) and in prefill (tiles)."""
    from localllm.runtime.session import Session, load_model

    path = tiny_model_path(arch, qtype=qtype)
    native = load_model(path, device="cpu", progress=False, backend="native",
                        dtype=torch.float32)
    exact = load_model(path, device="cpu", progress=False, backend="torch", dtype=torch.float32)
    assert native.backend == "native" and exact.backend == "torch"
    assert native.fallbacks == []
    ids = torch.randint(4, native.tokenizer.n_vocab, (20,),
                        generator=torch.Generator().manual_seed(0)).tolist()
    logits = []
    for m in (native, exact):
        s = Session(m, ctx_size=64)
        prefill = s.eval(ids[:12], all_logits=True)
        logits.append((prefill, torch.stack([s.eval([t]) for t in ids[12:]])))
    for got, want in zip(*logits):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_model_native_bf16_prefill_is_close(tiny_model_path, monkeypatch):
    """The default precision with bfloat16 prefill tiles stays close to the exact logits."""
    from localllm.runtime.session import Session, load_model

    monkeypatch.setenv("LOCALLLM_CPU_PREFILL", "bf16")
    path = tiny_model_path("gemma3", qtype=T.Q8_0)
    fast = load_model(path, device="cpu", progress=False, backend="native")
    exact = load_model(path, device="cpu", progress=False, backend="torch", dtype=torch.float32)
    assert fast.model.layers[0].ffn_down.weight.w.prefill_dtype == torch.bfloat16
    ids = list(range(4, 40))
    got = Session(fast, ctx_size=64).eval(ids, all_logits=True)
    want = Session(exact, ctx_size=64).eval(ids, all_logits=True)
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


# gate/up type, down type; d = 256 or 512 (K-quant blocks), n_ff = 64 or 96 (legacy down)
MOE_CASES = [(T.Q4_K, T.Q6_K, 512, 256), (T.Q5_K, T.Q4_K, 256, 256), (T.Q4_0, T.Q8_0, 256, 96),
             (T.Q2_K, T.Q3_K, 256, 256), (T.Q5_1, T.Q4_1, 256, 64), (T.MXFP4, T.MXFP4, 256, 96)]


def moe_reference(x, chosen, weights, gate, up, down, act="silu", biases=(None, None, None)):
    """The expert FFNs in float64 from the reference dequantizer (one (n_ff, d) / (d, n_ff)
    matrix per expert) and the torch backend's activation ``act`` (``TorchOps.gated``; or
    a function of (gate, up)), with int8 activations where the kernel quantizes them (the
    input of gate/up, and of down)."""
    xq = q8_activations(x).double()
    bg, bu, bd = (torch.zeros(n, dtype=torch.float64) if b is None else b.double()
                  for b, n in zip(biases, (gate.shape[0:2], up.shape[0:2], down.shape[0:2])))
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for e, w in zip(chosen[t].tolist(), weights[t].tolist()):
            g = xq[t] @ gate[e].double().T + bg[e]
            u = xq[t] @ up[e].double().T + bu[e]
            g, u = g.float()[None], u.float()[None]
            h = act(g, u) if callable(act) else TorchOps.gated(g, u, act)
            out[t] += w * ((q8_activations(h).double() @ down[e].double().T)[0] + bd[e])
    return out


def moe_case(gu_type, down_type, n_exp, d, n_ff):
    """Stacked random experts: the packed (gate, up, down) and their reference weights
    (n_exp, rows, cols) each."""
    raw = [weight_bytes(gu_type, n_exp * n_ff, d, 1), weight_bytes(gu_type, n_exp * n_ff, d, 2),
           weight_bytes(down_type, n_exp * d, n_ff, 3)]
    shapes = [(n_exp * n_ff, d), (n_exp * n_ff, d), (n_exp * d, n_ff)]
    types = [gu_type, gu_type, down_type]
    packs = [cpu.PackedWeight.from_bytes(r, q, s, q8=True) for r, q, s in zip(raw, types, shapes)]
    refs = [reference(r, q, s).view(n_exp, s[0] // n_exp, s[1])
            for r, q, s in zip(raw, types, shapes)]
    return packs, refs


@needs_moe
@pytest.mark.parametrize("gu_type,down_type,d,n_ff", MOE_CASES,
                         ids=lambda v: v.name if isinstance(v, T) else str(v))
def test_moe_ffn_q8(gu_type, down_type, d, n_ff):
    """The native MoE FFN against float64 products of the reference weights, per expert and
    token: odd token counts, experts with no token, one token, and more than 8 (several
    batches); equal whatever the number of threads."""
    n_exp, k = 6, 2
    packs, refs = moe_case(gu_type, down_type, n_exp, d, n_ff)
    gen = torch.Generator().manual_seed(int(gu_type))
    for t in (1, 2, 13, 21):
        x = torch.randn(t, d, generator=gen) * torch.rand(t, d, generator=gen) ** 2 * 3
        # expert 1 never chosen; expert 0 by every token (21 tokens: three batches)
        chosen = torch.stack([torch.zeros(t, dtype=torch.long),
                              torch.tensor([2, 3, 4, 5, 3])[torch.arange(t) % 5]], 1)
        if t == 13:
            chosen = chosen.flip(1)  # slot order does not matter
        weights = torch.rand(t, k, generator=gen)
        y = cpu.moe_ffn_q8(x, chosen, weights, *packs)
        ref = moe_reference(x, chosen, weights, *refs)
        # float32 summation error, bounded by the same sums over magnitudes (the kernel's
        # h differs from the reference's by float32 rounding: an int8 value of h flipping
        # by one step would show as ~1e-4 here; these seeds have none)
        bound = moe_reference(x.abs(), chosen, weights, *[r.abs() for r in refs])
        err = (y.double() - ref).abs()
        assert y.shape == (t, d) and bool((err <= 1e-5 * bound).all()), float((err / bound).max())
        n = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = cpu.moe_ffn_q8(x, chosen, weights, *packs)
        finally:
            torch.set_num_threads(n)
        assert torch.equal(one, y)


@needs_moe
@pytest.mark.parametrize("act", ["swiglu_oai", "gelu_tanh", "silu"])
@pytest.mark.parametrize("gu_type,down_type", [(T.MXFP4, T.MXFP4), (T.Q4_K, T.Q8_0)],
                         ids=lambda v: v.name)
def test_moe_ffn_q8_biases_and_activations(gu_type, down_type, act):
    """gpt-oss's experts (biases on gate, up and down; the clamped SwiGLU, whose clamps the
    gate and up values here cross on both sides) and GELU experts against the float64
    reference; dropping any one bias, or the clamp, gives a result outside the tolerance."""
    n_exp, d, n_ff, t = 5, 256, 96, 37
    packs, refs = moe_case(gu_type, down_type, n_exp, d, n_ff)
    gen = torch.Generator().manual_seed(7)
    # gate/up values of standard deviation 5: |g|, |u| > 7 (the clamp's limit) occur, and
    # the biases (standard deviation 2 for gate/up, the outputs' size for down) count
    x = torch.randn(t, d, generator=gen)
    x *= 5 / float((x @ refs[0][0].T).std())
    chosen = torch.stack([torch.randperm(n_exp, generator=gen)[:2] for _ in range(t)])
    weights = torch.rand(t, 2, generator=gen)
    gu_biases = (torch.randn(n_exp, n_ff, generator=gen) * 2,
                 torch.randn(n_exp, n_ff, generator=gen) * 2)
    size = float(moe_reference(x, chosen, weights, *refs, act=act,
                               biases=(*gu_biases, None)).abs().mean())
    biases = (*gu_biases, torch.randn(n_exp, d, generator=gen) * size)
    y = cpu.moe_ffn_q8(x, chosen, weights, *packs, biases=biases, act=act)
    ref = moe_reference(x, chosen, weights, *refs, act=act, biases=biases)
    scale = float(ref.abs().mean())
    err = float((y.double() - ref).abs().max()) / scale
    assert y.shape == (t, d) and err < 1e-4, err
    if act == "swiglu_oai":  # the same without the clamps is far off
        def unclamped(g, u):
            return g * torch.sigmoid(1.702 * g) * (u + 1)

        other = moe_reference(x, chosen, weights, *refs, act=unclamped, biases=biases)
        assert float((y.double() - other).abs().max()) / scale > 1e-2
    for i in range(3):  # each bias matters
        dropped = tuple(None if j == i else b for j, b in enumerate(biases))
        other = moe_reference(x, chosen, weights, *refs, act=act, biases=dropped)
        assert float((y.double() - other).abs().max()) / scale > 1e-2, i
    # no biases: the same as the call without them
    bare = cpu.moe_ffn_q8(x, chosen, weights, *packs, act=act)
    assert torch.equal(bare, cpu.moe_ffn_q8(x, chosen, weights, *packs, act=act,
                                            biases=(None, None, None)))


@needs_moe
@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_K], ids=lambda v: v.name)
def test_moe_ffn_q8_fused_gate_up(qtype):
    """Gate and up fused in one tensor (Gemma 4's ``ffn_gate_up_exps``: each expert's gate
    rows, then its up rows) give bit for bit the result of the two tensors; GEGLU, biases."""
    n_exp, d, n_ff, t = 4, 256, 64, 29
    raw = [weight_bytes(qtype, n_exp * n_ff, d, s) for s in (1, 2)]
    per = raw[0].size // n_exp
    fused = np.concatenate([np.concatenate([r[e * per:(e + 1) * per] for r in raw])
                            for e in range(n_exp)])
    down = cpu.PackedWeight.from_bytes(weight_bytes(T.Q8_0, n_exp * d, n_ff, 3), T.Q8_0,
                                       (n_exp * d, n_ff), q8=True)
    gate, up = (cpu.PackedWeight.from_bytes(r, qtype, (n_exp * n_ff, d), q8=True) for r in raw)
    gate_up = cpu.PackedWeight.from_bytes(fused, qtype, (2 * n_exp * n_ff, d), q8=True)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(t, d, generator=gen)
    chosen = torch.stack([torch.randperm(n_exp, generator=gen)[:2] for _ in range(t)])
    weights = torch.rand(t, 2, generator=gen)
    biases = (torch.randn(n_exp, n_ff, generator=gen), torch.randn(n_exp, n_ff, generator=gen),
              torch.randn(n_exp, d, generator=gen))
    for b in ((None, None, None), biases):
        two = cpu.moe_ffn_q8(x, chosen, weights, gate, up, down, biases=b, act="gelu_tanh")
        one = cpu.moe_ffn_q8(x, chosen, weights, gate_up, None, down, biases=b,
                             act="gelu_tanh")
        assert torch.equal(one, two)
    with pytest.raises(ParameterError, match="do not match"):
        cpu.moe_ffn_q8(x, chosen, weights, gate, None, down)


@needs_moe
def test_moe_ffn_q8_errors():
    d, n_ff, n_exp = 256, 64, 3
    g = cpu.PackedWeight.from_bytes(weight_bytes(T.Q4_K, n_exp * n_ff, d), T.Q4_K,
                                    (n_exp * n_ff, d), q8=True)
    dn = cpu.PackedWeight.from_bytes(weight_bytes(T.Q8_0, n_exp * d, n_ff), T.Q8_0,
                                     (n_exp * d, n_ff), q8=True)
    x, w = torch.randn(3, d), torch.rand(3, 2)
    with pytest.raises(ParameterError, match="do not match"):
        cpu.moe_ffn_q8(x[:, :128], torch.zeros(3, 2, dtype=torch.long), w, g, g, dn)
    with pytest.raises(RuntimeError, match="expert 3 out of range"):
        cpu.moe_ffn_q8(x, torch.full((3, 2), 3), w, g, g, dn)
    f = cpu.PackedWeight.from_bytes(weight_bytes(T.F16, n_exp * n_ff, d), T.F16,
                                    (n_exp * n_ff, d))
    with pytest.raises(UnsupportedError, match="quantized experts"):
        cpu.moe_ffn_q8(x, torch.zeros(3, 2, dtype=torch.long), w, f, f, dn)
    with pytest.raises(ParameterError, match="unknown activation 'relu'"):
        cpu.moe_ffn_q8(x, torch.zeros(3, 2, dtype=torch.long), w, g, g, dn, act="relu")
    with pytest.raises(ParameterError, match="biases"):
        cpu.moe_ffn_q8(x, torch.zeros(3, 2, dtype=torch.long), w, g, g, dn,
                       biases=(torch.zeros(n_exp, d), None, None))


@needs_q8
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q4_1, T.Q3_K, T.MXFP4],
                         ids=lambda v: v.name)
def test_gemv_experts_equals_one_gemv_per_expert(qtype):
    """One token's experts of a stacked matrix in one call (MoE decode) give exactly the
    per-expert GEMV's result: shared input (gate/up) and one input per expert (down),
    repeated and unordered experts, rows not a multiple of the thread grain; an expert id
    out of range is refused."""
    n_exp, rows, cols = 5, 37, 512
    raw = weight_bytes(qtype, n_exp * rows, cols, 7)
    stacked = cpu.PackedWeight.from_bytes(raw, qtype, (n_exp * rows, cols), q8=True)
    row_bytes = raw.size // (n_exp * rows)
    per_expert = [cpu.PackedWeight.from_bytes(raw[e * rows * row_bytes:(e + 1) * rows * row_bytes],
                                              qtype, (rows, cols), q8=True)
                  for e in range(n_exp)]
    experts = torch.tensor([3, 0, 4, 3])
    gen = torch.Generator().manual_seed(3)
    x1 = torch.randn(1, cols, generator=gen)
    xk = torch.randn(len(experts), cols, generator=gen)
    for x in (x1, xk):
        got = cpu.gemv_experts(x, stacked, experts, rows)
        for j, e in enumerate(experts.tolist()):
            want = cpu.qmatmul(x[j if x.shape[0] > 1 else 0][None], per_expert[e])[0]
            assert torch.equal(got[j], want), (j, e)
    with pytest.raises(RuntimeError, match="expert 5 out of range"):
        cpu.gemv_experts(x1, stacked, torch.tensor([5]), rows)


def _packed(qtype: T, rows: int, cols: int, seed: int) -> cpu.PackedWeight:
    return cpu.PackedWeight.from_bytes(weight_bytes(qtype, rows, cols, seed), qtype,
                                       (rows, cols), q8=True)


@needs_q8
@pytest.mark.parametrize("gu_type,down_type,act,fused,biased", [
    (T.Q4_K, T.Q6_K, "silu", False, False),
    (T.Q8_0, T.Q4_0, "gelu_tanh", True, False),
    (T.MXFP4, T.MXFP4, "swiglu_oai", False, True),
    (T.Q3_K, T.Q5_K, "silu", True, True),
], ids=lambda v: v.name if isinstance(v, T) else str(v))
def test_moe_token_q8_equals_the_separate_calls(gu_type, down_type, act, fused, biased):
    """One token's MoE FFN in one call gives the result of the calls it replaces (the
    per-matrix expert GEMVs, the gated activation, the weighted sum, the shared expert
    through qmatmul) to float32 summation order, with the shared expert of another width,
    other types, a weight and its own input; without it, with one thread as with two; and
    within the float64 reference's tolerance."""
    n_exp, d, n_ff, sh_ff = 6, 256, 256, 512
    packs, refs = moe_case(gu_type, down_type, n_exp, d, n_ff)
    gate, up, down = packs
    if fused:  # each expert's gate rows, then its up rows, in one tensor
        raw = [weight_bytes(gu_type, n_exp * n_ff, d, s) for s in (1, 2)]
        per = raw[0].size // n_exp
        gate = cpu.PackedWeight.from_bytes(
            np.concatenate([np.concatenate([r[e * per:(e + 1) * per] for r in raw])
                            for e in range(n_exp)]), gu_type, (2 * n_exp * n_ff, d), q8=True)
        up = None
    shared = (_packed(T.Q5_K, sh_ff, d, 11), _packed(T.Q4_K, sh_ff, d, 12),
              _packed(T.Q8_0, d, sh_ff, 13))
    gen = torch.Generator().manual_seed(int(gu_type) + 100 * fused)
    biases = ((torch.randn(n_exp, n_ff, generator=gen), torch.randn(n_exp, n_ff, generator=gen),
               torch.randn(n_exp, d, generator=gen)) if biased else (None, None, None))
    x, xs = torch.randn(1, d, generator=gen), torch.randn(1, d, generator=gen)
    chosen, weights = torch.tensor([4, 1, 3]), torch.rand(3, generator=gen)

    def separate(with_shared: bool) -> torch.Tensor:
        mats = [gate] if up is None else [gate, up]
        proj = [cpu.gemv_experts(x, w, chosen, n_ff * (2 if up is None else 1)) for w in mats]
        g, u = proj if up is not None else (p.contiguous() for p in proj[0].chunk(2, -1))
        if biased:
            g, u = g + biases[0][chosen], u + biases[1][chosen]
        y = cpu.gemv_experts(TorchOps.gated(g, u, act), down, chosen, d)
        if biased:
            y = y + biases[2][chosen]
        out = torch.zeros(1, d)
        for j in chosen.argsort().tolist():  # increasing expert order
            out += y[j] * weights[j]
        if with_shared:
            hs = TorchOps.gated(cpu.qmatmul(xs, shared[0]), cpu.qmatmul(xs, shared[1]), "silu")
            out += cpu.qmatmul(hs, shared[2]) * 0.375
        return out

    kw = {"biases": biases, "act": act}
    got = cpu.moe_token_q8(x, chosen, weights, gate, up, down, **kw, shared=shared,
                           shared_weight=0.375, shared_x=xs)
    want = separate(True)
    scale = float(want.abs().mean())
    assert got.shape == (1, d) and float((got - want).abs().max()) < 1e-5 * scale
    alone = cpu.moe_token_q8(x, chosen, weights, gate, up, down, **kw)
    assert float((alone - separate(False)).abs().max()) < 1e-5 * scale
    assert float((got - alone).abs().max()) > 1e-2 * scale  # the shared expert counts
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = cpu.moe_token_q8(x, chosen, weights, gate, up, down, **kw, shared=shared,
                               shared_weight=0.375, shared_x=xs)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, got)
    if not fused:
        ref = moe_reference(x, chosen[None], weights[None], *refs, act=act, biases=biases)
        err = float((alone.double() - ref).abs().max()) / float(ref.abs().mean())
        assert err < 1e-4, err


@needs_q8
def test_moe_token_q8_errors():
    d, n_ff, n_exp = 256, 64, 3
    g, dn = _packed(T.Q4_K, n_exp * n_ff, d, 1), _packed(T.Q8_0, n_exp * d, n_ff, 2)
    x, w = torch.randn(1, d), torch.rand(2)
    ok = torch.tensor([0, 2])
    with pytest.raises(RuntimeError, match="expert 3 out of range"):
        cpu.moe_token_q8(x, torch.tensor([0, 3]), w, g, g, dn)
    with pytest.raises(ParameterError, match="unknown activation 'relu'"):
        cpu.moe_token_q8(x, ok, w, g, g, dn, act="relu")
    with pytest.raises(ParameterError, match="do not match"):
        cpu.moe_token_q8(torch.randn(2, d), ok, w, g, g, dn)
    with pytest.raises(RuntimeError, match="same number"):  # up of another expert count
        cpu.moe_token_q8(x, ok, w, g, _packed(T.Q4_K, 2 * n_ff, d, 3), dn)
    with pytest.raises(RuntimeError, match="shared expert's matrices"):
        cpu.moe_token_q8(x, ok, w, g, g, dn, shared=(_packed(T.Q4_K, 64, d, 4),
                                                     _packed(T.Q4_K, 32, d, 5),
                                                     _packed(T.Q8_0, d, 64, 6)))
    f = cpu.PackedWeight.from_bytes(weight_bytes(T.F16, n_exp * n_ff, d), T.F16,
                                    (n_exp * n_ff, d))
    with pytest.raises(UnsupportedError, match="quantized matrices"):
        cpu.moe_token_q8(x, ok, w, f, f, dn)
