"""The AVX2 build of the native CPU kernels (``LOCALLLM_CPU_ARCH=haswell``): its int8 GEMV
(vpmaddubsw, for CPUs without AVX512-VNNI) against the reference product.

The kernels are built for -march=haswell in a subprocess (the build cache is keyed by the
flags, so the build happens once and later subprocesses load it). Each product is checked
as in test_cpu_kernels.py: the exact product of the reference weights
(:func:`localllm.gguf.quants.dequantize`) with the q8-quantized activations, within float32
summation error. Where the test machine itself lacks AVX2 the subprocess could not run
them: the module is skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DEFAULT_MODEL
from gguf import GGMLQuantizationType as T
from test_cpu_kernels import (
    QUANT_TYPES,
    assert_close_product,
    cols_for,
    q8_activations,
    weight_bytes,
)
from test_quants import SCALE_OFFSETS

from localllm import cpu
from localllm.cpu.build import _cpu_flags
from localllm.gguf.quants import BLOCK_FORMATS
from localllm.gguf.quants import dequantize as reference

if "avx2" not in _cpu_flags().split():
    pytest.skip("the AVX2 build needs an AVX2 CPU to run", allow_module_level=True)

IDS = {"ids": lambda q: q.name}


def run_haswell(code: str, *args: str) -> None:
    """Run ``code`` (python) with the kernels built for -march=haswell; fails on an error."""
    env = dict(os.environ, LOCALLLM_CPU_ARCH="haswell")
    r = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, check=False,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


# The subprocess: every case's weights through PackedWeight(q8=True) and qmatmul.
PRODUCTS = """
import sys, torch
import localllm.cpu as cpu
assert cpu.available() and cpu.q8_activations(), "the haswell build has no int8 GEMV"
cases = torch.load(sys.argv[1])
out = {}
for name, (raw, qtype, shape, xs) in cases.items():
    w = cpu.PackedWeight.from_bytes(raw, qtype, shape, q8=True)
    assert w.q8, name
    out[name] = [cpu.qmatmul(x, w) for x in xs]
torch.save(out, sys.argv[2])
"""


def extreme_weights(qtype: T, rows: int, cols: int) -> np.ndarray:
    """Blocks with every quantized value at its extreme (all bits set: u = 3 .. 63; Q8_0
    -128 in even rows, 127 in odd rows; MXFP4 -12 and 12), the scales 1.0: the largest
    integer dot products, where vpmaddubsw's int16 pair sums could saturate."""
    fmt = BLOCK_FORMATS[qtype]
    n_row = cols // fmt.block_size
    b = np.full((rows * n_row, fmt.type_size), 0xFF, np.uint8)
    if qtype == T.Q8_0:
        b[:, 2:] = np.where((np.arange(rows * n_row) // n_row % 2)[:, None] == 0, 0x80, 0x7F)
    for off in SCALE_OFFSETS.get(qtype, []):
        b[:, off:off + 2] = np.array([1.0], np.float16).view(np.uint8)
    if qtype == T.MXFP4:  # e8m0 scale 1.0; nibbles -12 (0xF) in even rows, +12 (0x7) in odd
        b[:, 0] = 128
        b[:, 1:] = np.where((np.arange(rows * n_row) // n_row % 2)[:, None] == 0, 0xFF, 0x77)
    return b.reshape(-1)


def cases() -> dict:
    """name -> (raw weights, ggml type id, (rows, cols), activation matrices of 1..8 rows)."""
    out = {}
    for qtype in QUANT_TYPES:
        rows, cols = 37, cols_for(qtype)  # rows: no multiple of any blocking
        gen = torch.Generator().manual_seed(int(qtype))
        xs = [torch.randn(t, cols, generator=gen) * torch.rand(t, cols, generator=gen) ** 4 * 10
              for t in range(1, cpu.GEMV_MAX_ROWS + 1)]
        out[qtype.name] = (torch.from_numpy(weight_bytes(qtype, rows, cols, seed=3)),
                           int(qtype), (rows, cols), xs)
        # activations at +-127 after quantization (every value of a block the same
        # magnitude), with the weights at their extremes: rows of +1, of -1, and alternating
        signs = torch.ones(3, cols)
        signs[1] = -1
        signs[2, 1::2] = -1
        out[qtype.name + "-extreme"] = (torch.from_numpy(extreme_weights(qtype, 6, cols)),
                                        int(qtype), (6, cols), [signs, signs[1:2] * 0.5])
    return out


@pytest.fixture(scope="module")
def haswell_products(tmp_path_factory):
    """(cases, products of the haswell build): built and run once."""
    d = tmp_path_factory.mktemp("haswell")
    c = cases()
    torch.save(c, d / "cases.pt")
    run_haswell(PRODUCTS, str(d / "cases.pt"), str(d / "out.pt"))
    return c, torch.load(d / "out.pt")


@pytest.mark.parametrize("qtype", QUANT_TYPES, **IDS)
def test_avx2_int8_gemv(haswell_products, qtype):
    """Every type, 1..8 activation rows, 37 rows (odd legacy block counts: 7 x 32 columns):
    the exact product with the quantized activations, and within the quantization error of
    the float product."""
    c, out = haswell_products
    raw, _, shape, xs = c[qtype.name]
    ref = reference(raw.numpy(), qtype, shape)
    for x, y in zip(xs, out[qtype.name]):
        assert_close_product(y, q8_activations(x), ref)
        exact = x.double() @ ref.double().T
        scale = x.double().abs() @ ref.double().abs().T
        assert float(((y.double() - exact).abs() / scale).max()) < 2e-2


@pytest.mark.parametrize("qtype", QUANT_TYPES, **IDS)
def test_avx2_int8_gemv_saturation(haswell_products, qtype):
    """Weights at their extremes times activations at +-127: no int16 saturation (Q8_0's
    -128 * -127 pairs included)."""
    c, out = haswell_products
    raw, _, shape, xs = c[qtype.name + "-extreme"]
    ref = reference(raw.numpy(), qtype, shape)
    for x, y in zip(xs, out[qtype.name + "-extreme"]):  # |x| the block maximum: q = +-127
        assert_close_product(y, q8_activations(x), ref)


@pytest.mark.skipif(not cpu.q8_activations(), reason="the native build has no int8 GEMV")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.Q6_K], **IDS)
def test_avx2_equals_native_int8(haswell_products, qtype):
    """The haswell build's products equal this machine's native int8 GEMV (the same
    quantized activations; float32 summation order aside)."""
    c, out = haswell_products
    raw, _, shape, xs = c[qtype.name]
    w = cpu.PackedWeight.from_bytes(raw, qtype, shape, q8=True)
    for x, y in zip(xs, out[qtype.name]):
        want = cpu.qmatmul(x, w)
        bound = q8_activations(x).abs() @ reference(raw.numpy(), qtype, shape).abs().T
        assert bool(((y - want).abs() <= 4e-6 * bound).all())


# The subprocess: the default model's logits over a few decode steps (the GEMV path).
LOGITS = """
import sys, torch
from localllm.runtime.session import Session, load_model
m = load_model(sys.argv[1], device="cpu", progress=False, backend="native")
s = Session(m, ctx_size=64)
ids = [int(i) for i in sys.argv[3].split(",")]
torch.save(torch.stack([s.eval(ids[:6])] + [s.eval([t]) for t in ids[6:]]), sys.argv[2])
"""


def test_avx2_default_model_logits(tmp_path):
    """The default model's next-token logits on the haswell build are close to the native
    build's, with the same top token at every step.

    Each matrix product agrees to ~1e-7 (float32 summation order), but where an activation
    sits near a rounding boundary of its int8 quantization such a difference moves it by a
    quantization step, so the logits differ by about the int8 quantization error (2-3% of
    the largest logit on gemma3-270m, as int8 against float32 activations does)."""
    from localllm.registry import load_registry
    from localllm.runtime.session import Session, load_model

    path, _ = load_registry().resolve(DEFAULT_MODEL)
    ids = [2, 818, 5279, 529, 7001, 563, 236761, 669, 1346]
    run_haswell(LOGITS, str(path), str(tmp_path / "logits.pt"), ",".join(map(str, ids)))
    got = torch.load(tmp_path / "logits.pt")
    s = Session(load_model(path, device="cpu", progress=False, backend="native"), ctx_size=64)
    want = torch.stack([s.eval(ids[:6])] + [s.eval([t]) for t in ids[6:]])
    assert got.shape == want.shape
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert float((got - want).abs().max()) <= 5e-2 * float(want.abs().max())


BENCH = os.path.join(os.path.dirname(__file__), "..", "bench", "bench_cpu_gemv.py")


def test_bench_cpu_gemv_script(tiny_model_path, tmp_path):
    """bench/bench_cpu_gemv.py runs each build in its own process and reports GB/s for the
    int8 and float32 GEMVs; a missing file is one error line."""
    path = tiny_model_path("llama", qtype=T.Q4_0)
    r = subprocess.run([sys.executable, BENCH, str(path), "--arch", "native", "haswell",
                        "--rounds", "1", "--json", str(tmp_path / "g.json")],
                       capture_output=True, text=True, check=False, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    medians = json.loads((tmp_path / "g.json").read_text())["medians"]
    assert medians["haswell int8 all"][0] > 0 and medians["haswell float32 all"][0] > 0
    assert "native float32 all" in medians
    r = subprocess.run([sys.executable, BENCH, str(tmp_path / "none.gguf")],
                       capture_output=True, text=True, check=False)
    assert r.returncode == 1 and r.stderr.strip().splitlines() == [
        f"error: no such file: {tmp_path / 'none.gguf'}"]
