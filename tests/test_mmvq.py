"""The integer-dot decode GEMV (llama.cpp's ``mul_mat_vec_q``) and its static profile.

Results: in Triton's interpreter (the portable dp4a), against the torch reference dequantizer
applied to the same 8-bit activations. Compiled code: for sm_90 with Triton's own toolchain
(no GPU), the targets of issue 19 read from the SASS of the main loop.
"""

from __future__ import annotations

import json
import os
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_kernels import make_weight, rel_err

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import PLANES, QuantWeight, _aot, block_format, quant_linear
from localllm.kernels.decode import MMVQ32_TYPES, MMVQ_TYPES
from localllm.kernels.decode_k23 import MMVQ64_TYPES
from localllm.kernels.dequant import dequantize as triton_dequantize
from localllm.kernels.gemv import (
    MIN_ROWS,
    TARGET_SMS,
    gemv,
    mmvq_config,
    mmvq_unit,
    quantize_q8,
)

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import kernel_profile

# Every type with an integer-dot GEMV in the layout a loaded model keeps it (planes for the
# types of PLANES): issue 19's types, then issue 30's Q2_K, Q3_K and MXFP4.
MMVQ_CLASS = sorted({*MMVQ_TYPES, *MMVQ32_TYPES, *MMVQ64_TYPES}, key=int)


def loaded_layout(qtype: T) -> str:
    return "planes" if qtype in PLANES else "blocks"


def test_quantize_q8_bounds_and_sums(device):
    x = torch.randn(96, generator=torch.Generator().manual_seed(0)) * 3
    x[32:64] = 0.0  # an all-zero chunk: scale 0, values 0
    x[70] = -50.0  # the extreme of its chunk maps to -127
    xq, xd, xs = (t.cpu() for t in quantize_q8(x.to(device)))
    assert xq.dtype == torch.int8 and xd.shape == (3,) and xs.dtype == torch.int32
    d = x.reshape(3, 32).abs().amax(1) / 127
    torch.testing.assert_close(xd, d)
    assert xq[32:64].eq(0).all() and xd[1] == 0
    assert xq[70] == -127 and xq.abs().max() <= 127
    back = xq.float().reshape(3, 32) * xd[:, None]
    assert ((back - x.reshape(3, 32)).abs() <= xd[:, None] / 2 + 1e-6).all()
    assert torch.equal(xs, xq.int().reshape(6, 16).sum(1, dtype=torch.int32))


@pytest.mark.parametrize("qtype, n, bpr", [
    (T.Q4_K, 37, 3),  # 37 rows: not a multiple of the rows per program; split-K 3
    (T.Q6_K, 9, 1),
    (T.Q8_0, 41, 5),  # K = 160: 10 groups, 2 a step
    (T.Q4_0, 19, 3),
    (T.Q5_0, 3, 4),
    (T.Q5_K, 5, 2),
    (T.Q4_1, 11, 2),
    (T.Q5_1, 6, 6),
], ids=lambda v: v.name if isinstance(v, T) else str(v))  # fmt: skip
def test_mmvq_on_quantized_activations(qtype, n, bpr, device):
    """The kernel is exact up to float32 rounding on the activations it quantized."""
    w, wref = make_weight(qtype, n=n, blocks_per_row=bpr, seed=n)
    x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(bpr))
    y = gemv(w.data.to(device), qtype, n, x.to(device)).cpu()
    xq, xd, _ = quantize_q8(x[0].to(device))
    xr = (xq.cpu().double().reshape(-1, 32) * xd.cpu().double()[:, None]).reshape(1, -1)
    assert y.shape == (1, n)
    assert rel_err(y, xr @ wref.double().T) < 1e-5
    # and close to the float product: 8-bit activations lose about 0.5% per dot product
    assert rel_err(y, x.double() @ wref.double().T) < 3e-2


def iq_blocks(qtype: T, n_blocks: int, seed: int = 0) -> np.ndarray:
    """Random IQ4_NL / IQ4_XS / MXFP4 blocks with small finite scales."""
    rng = np.random.default_rng(seed)
    ts = gguf.GGML_QUANT_SIZES[qtype][1]
    b = rng.integers(0, 256, (n_blocks, ts), dtype=np.uint8)
    if qtype == T.MXFP4:
        b[:, 0] = rng.integers(118, 130, n_blocks)  # E8M0 exponents near 2**0
    else:
        d = rng.standard_normal(n_blocks) * 1e-2
        b[:, 0:2] = d.astype(np.float16).view(np.uint8).reshape(n_blocks, 2)
    return b


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS, T.MXFP4], ids=lambda q: q.name)
def test_iq_dequant_bit_exact(qtype, device):
    """Against gguf-py's numpy dequantizer, every E8M0 exponent included for MXFP4."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    b = iq_blocks(qtype, 6, seed=1)
    if qtype == T.MXFP4:
        b = np.concatenate([b, iq_blocks(qtype, 256, seed=2)])
        b[6:, 0] = np.arange(256)  # 0 and 1 (subnormal halves) .. 255
    n_rows = 2 if qtype != T.MXFP4 else 262
    with np.errstate(over="ignore"):
        want = gguf.quants.dequantize(b.reshape(-1), qtype).reshape(n_rows, -1)
    got = triton_dequantize(torch.from_numpy(b.reshape(-1)).to(device), qtype,
                            (n_rows, b.size // n_rows // gguf.GGML_QUANT_SIZES[qtype][1] * bs),
                            torch.float32).cpu()  # fmt: skip
    assert np.array_equal(got.numpy().view(np.int32), want.view(np.int32))


@pytest.mark.parametrize("qtype", [T.IQ4_NL, T.IQ4_XS, T.MXFP4], ids=lambda q: q.name)
def test_iq_gemv(qtype, device):
    """One vector (integer dot for IQ4_NL/IQ4_XS, float for MXFP4) and a batch of 3."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    n, bpr = 13, (2 if bs == 256 else 5)
    b = iq_blocks(qtype, n * bpr, seed=3)
    wref = torch.from_numpy(gguf.quants.dequantize(b.reshape(-1), qtype).reshape(n, -1)).double()
    w = torch.from_numpy(b.reshape(-1)).to(device)
    x = torch.randn(3, bpr * bs, generator=torch.Generator().manual_seed(0))
    y1 = gemv(w, qtype, n, x[:1].to(device)).cpu()
    if qtype in MMVQ_TYPES:
        xq, xd, _ = quantize_q8(x[0].to(device))
        xr = (xq.cpu().double().reshape(-1, 32) * xd.cpu().double()[:, None]).reshape(1, -1)
        assert rel_err(y1, xr @ wref.T) < 1e-5
    else:
        assert rel_err(y1, x[:1].double() @ wref.T) < 1e-5
    y3 = gemv(w, qtype, n, x.to(device)).cpu()
    assert rel_err(y3, x.double() @ wref.T) < 1e-5
    # through the public entry point, as the models call it
    qw = QuantWeight.from_bytes(b.reshape(-1), qtype, (n, bpr * bs)).to(device)
    assert torch.equal(quant_linear(x[:1].to(device), qw).cpu(), y1)


@pytest.mark.parametrize("qtype, layout, n, bpr", [
    (T.Q4_K, "blocks", 37, 3),  # _mmvq_kernel, 3 splits
    (T.Q6_K, "planes", 21, 4),  # _mmvq_kernel from planes, 4 splits
    (T.Q4_0, "planes", 19, 8),  # _mmvq32_kernel, 8 splits
], ids=lambda v: v.name if isinstance(v, T) else str(v))  # fmt: skip
def test_split_k_summed_in_the_launch(qtype, layout, n, bpr, device):
    """A split key axis costs no launch of its own: the program that finishes its row range
    last adds the splits' partial sums (in split order: the same result at every launch) and
    resets its ticket for the next launch (a graph replay)."""
    from kernel_checks import LaunchCounter
    from localllm.kernels import _sync
    from test_planes import q8_activations, weight

    w, p, wref = weight(qtype, n, bpr, seed=n)
    w = (p if layout == "planes" else w).to(device)
    assert mmvq_config(qtype, n, w.shape[1], layout=layout)["SPLIT"] > 1
    x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(bpr)).to(device)
    y = quant_linear(x, w)  # the first launch also allocates the tickets
    with LaunchCounter() as counter:
        y2 = quant_linear(x, w)
    assert torch.equal(y2, y)
    gemv_kernel = "mmvq32_kernel" if qtype == T.Q4_0 else "mmvq_kernel"
    assert dict(+counter.launches) == {"quantize_q8_kernel": 1, gemv_kernel: 1}
    assert rel_err(y.cpu(), q8_activations(x.cpu(), device) @ wref.double().T) < 1e-5
    assert not _sync.TICKETS[device][-1].any()


def test_mmvq_float16_output(device):
    w, _ = make_weight(T.Q4_K, n=12, blocks_per_row=2, seed=2)
    x = torch.randn(1, w.shape[1]).half()
    y = gemv(w.data.to(device), T.Q4_K, 12, x.to(device))
    assert y.dtype == torch.float16 and y.shape == (1, 12)
    y32 = gemv(w.data.to(device), T.Q4_K, 12, x.to(device), out_dtype=torch.float32)
    assert rel_err(y, y32) < 1e-3


@pytest.mark.parametrize("model", list(kernel_profile.MODELS))
def test_launch_shapes_fill_the_gpu(model):
    """>= 2 programs per SM for every matrix of the three models, whole blocks per split,
    programs of at least MIN_ROWS rows."""
    for qtype in MMVQ_CLASS:
        bs = block_format(qtype).block_size
        for n, k in kernel_profile.MODELS[model].values():
            if k % bs:
                continue
            if qtype not in MMVQ_TYPES:  # only from planes
                cfg = mmvq_config(qtype, n, k, layout="planes")
                # or, for a matrix too small for that (Gemma's 640 x 1024 in Q2_K / Q3_K:
                # 10240 64-weight slots), as many programs as 2-warp programs of one slot
                # a thread make
                most = n * (k // cfg["UNIT"]) // 64
                assert cfg["grid"][0] * cfg["grid"][1] >= min(2 * TARGET_SMS, most), (qtype, n, k)
                assert cfg["grid"][0] * cfg["ROWS"] >= n
                assert (k // cfg["UNIT"] // cfg["SPLIT"]) % cfg["GP"] == 0
                assert cfg["ROWS"] >= MIN_ROWS, (qtype.name, n, k)
                continue
            cfg = mmvq_config(qtype, n, k)
            assert cfg["grid"][0] * cfg["grid"][1] >= 2 * TARGET_SMS, (qtype.name, n, k)
            assert cfg["grid"][0] * cfg["ROWS"] >= n
            assert cfg["ROWS"] >= MIN_ROWS, (qtype.name, n, k)
            assert cfg["blocks_per_split"] * cfg["SPLIT"] * bs == k
            assert (cfg["blocks_per_split"] * bs // 16) % cfg["GP"] == 0
            if qtype in PLANES:  # as a loaded model keeps them
                cfg = mmvq_config(qtype, n, k, layout="planes")
                assert cfg["grid"][0] * cfg["grid"][1] >= 2 * TARGET_SMS, (qtype.name, n, k)
                assert cfg["grid"][0] * cfg["ROWS"] >= n
                assert (k // cfg["UNIT"] // cfg["SPLIT"]) % cfg["GP"] == 0
                assert cfg["ROWS"] >= MIN_ROWS, (qtype.name, n, k)


def _compiled(qtype: T, n: int = 4096, k: int = 4096):
    case, launch = kernel_profile.decode_gemv_case(qtype, n, k, 90)
    try:
        compiled = _aot.compile_case(case)
    except _aot.CompileUnavailable as e:
        pytest.skip(str(e))
    return compiled, kernel_profile.static_figures(compiled, case, launch)


@pytest.mark.parametrize("matrix", ["llama3-8b/attn_output", "gemma3-270m/attn_output"])
@pytest.mark.parametrize("qtype", MMVQ_CLASS, ids=lambda q: q.name)
def test_static_targets(qtype, matrix):
    """Issue 19's targets on sm_90 (issue 30: Q2_K, Q3_K and MXFP4 too), for the layout a
    loaded model keeps (aligned planes for the types of ``PLANES``): <= 0.25
    warp-instructions per weight byte, no spills, dp4a in the loop and no shuffles there;
    the weight bits in 128-bit loads: per loop step at least one LDG.128 per (row, group)
    slot a thread holds plus the activations', no byte loads, 16-bit loads only for the fp16
    scales (one a slot). On Llama-3-8B's 4096 x 4096 and on
    Gemma-3-270M's 640 x 1024 (a 2-warp, split-K launch: the smallest programs)."""
    assert mmvq_unit(qtype, loaded_layout(qtype))
    model, name = matrix.split("/")
    n, k = kernel_profile.MODELS[model][name]
    compiled, fig = _compiled(qtype, n, k)
    assert fig["warp_instructions_per_byte"] <= 0.25, fig
    assert fig["spill_instructions"] == 0 and fig["local_bytes"] == 0
    body = _aot.main_loop(_aot.parse_sass(_aot.sass(compiled.asm["cubin"])))
    # no shuffles, no shared-memory exchanges (layout conversions) in the loop
    assert not [i.op for i in body if i.base in ("SHFL", "BAR", "STS", "LDS")], fig
    assert sum(1 for i in body if i.op.startswith("IDP.4A")) >= 4
    if block_format(qtype).type_size % 16 == 0 or qtype in PLANES:
        rpt = mmvq_config(qtype, n, k, layout="planes" if qtype in PLANES else
                          "blocks")["RPT"]  # fmt: skip
        steps = fig["loop_steps_per_body"]
        bits = [_aot.load_bits(i) for i in _aot.global_loads(body)]
        assert bits.count(128) >= steps * (rpt + 1), fig
        assert bits.count(16) <= steps * rpt, fig
        assert bits.count(8) == 0, fig


def test_profile_writes_cubins_and_json(tmp_path, capsys):
    rc = kernel_profile.main(["--types", "Q4_K", "--models", "gemma3-270m", "--out",
                              str(tmp_path), "--json"])  # fmt: skip
    if rc == 1 and "error:" in capsys.readouterr().err:
        pytest.skip("this Triton cannot compile ahead of time")
    assert rc == 0
    out = capsys.readouterr().out
    assert "mmvq_kernel/Q4_K" in out and "640x1024" in out
    records = [json.loads(line) for line in (tmp_path / "profile.jsonl").read_text().splitlines()]
    assert {tuple(r["shape"]) for r in records} == {(640, 1024), (640, 2048)}  # K % 256 == 0
    for r in records:
        assert r["qtype"] == "Q4_K" and r["bytes_per_step"] > 0 and r["registers"] > 0
        assert os.path.getsize(r["cubin"]) > 0
        # recount from the binary: the loop instructions per step give the figure
        with open(r["cubin"], "rb") as f:
            instrs = _aot.parse_sass(_aot.sass(f.read()))
        loop = _aot.counted(_aot.main_loop(instrs))
        assert len(loop) == r["loop_instructions"]
        assert r["warp_instructions_per_byte"] == pytest.approx(
            len(loop) / r["loop_steps_per_body"] * r["num_warps"] / r["bytes_per_step"], abs=1e-4)
        assert r["estimated"]["gpu"] == "H100 SXM5"
        assert 0 < r["estimated"]["ceiling_gbps"] <= 3350.0


def test_sass_parser_finds_the_loop():
    text = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
        /*0020*/                   LDG.E.128 R8, desc[UR4][R6.64] ;
        /*0030*/                   IDP.4A.S8.S8 R3, R8, R2, RZ ;
        /*0040*/               @P0 BRA 0x10 ;
        /*0050*/                   NOP ;
        /*0060*/                   EXIT ;
    """
    instrs = _aot.parse_sass(text)
    assert [i.op for i in instrs][:3] == ["MOV", "LDG.E", "LDG.E.128"]
    assert _aot.loops(instrs) == [(1, 4)]
    body = _aot.main_loop(instrs)
    assert [i.base for i in body] == ["LDG", "LDG", "IDP", "BRA"]
    assert [_aot.load_bits(i) for i in _aot.global_loads(body)] == [32, 128]
