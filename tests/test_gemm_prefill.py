"""The prefill GEMM's chunk decoders (kernels/gemm_decode.py) with the launch's own tiles, and
its static profile on sm_90 (issue 30: tensor cores, no spills, an estimated share of the
H100's dense peak on Llama-3-8B's matrices at 512 rows).

Results: in Triton's interpreter (the portable byte permutes), against gguf-py's dequantizer
times the activations (float64); tests/test_kernels.py and tests/test_planes.py run the same
kernel with small tiles on every type and layout.
"""

from __future__ import annotations

import os
import sys

import gguf
import pytest
import torch
from gguf import GGMLQuantizationType as T
from test_kernels import rel_err
from test_planes import weight

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import PLANES, _aot, quant_linear
from localllm.kernels.gemm import gemm, gemm_config
from localllm.kernels.gemm_decode import has_chunks

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import kernel_profile

GEMM_TYPES = [T[n] for n in kernel_profile.GEMM_TYPES]


def _loaded(qtype: T, n: int, blocks_per_row: int, seed: int):
    """(the QuantWeight as a loaded model keeps it, float64 reference (n, K))."""
    w, p, ref = weight(qtype, n, blocks_per_row, seed)
    return (p if qtype in PLANES else w), ref.double()


@pytest.mark.parametrize("qtype", GEMM_TYPES, ids=lambda q: q.name)
def test_chunk_path_default_tiles(qtype, device):
    """Every quant type through its chunk decoder with the launch's tiles (K steps of 128:
    the 256-weight types' chunks at constant positions in their half-block): 20 rows, 40
    weight rows (one partial tile each), two K steps."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    w, ref = _loaded(qtype, 40, 256 // bs, seed=int(qtype))
    cfg = gemm_config(20, w.shape[1], qtype, w.layout, n=40)
    assert cfg["CHUNKS"] and has_chunks(qtype, w.layout) and cfg["BLOCK_K"] == 128
    x = torch.randn(20, w.shape[1], generator=torch.Generator().manual_seed(1))
    y = gemm(w.data.to(device), qtype, 40, x.to(device), out_dtype=torch.float32,
             layout=w.layout).cpu()  # fmt: skip
    # float16 activations and weights (each weight one float16 FMA of its scale)
    assert rel_err(y, x.double() @ ref.T) < 3e-3


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q3_K], ids=lambda q: q.name)
def test_chunk_path_bf16(qtype, device):
    """The bfloat16 GEMM (Gemma's prefill) decodes the chunks in float32, then rounds."""
    bs = gguf.GGML_QUANT_SIZES[qtype][0]
    w, ref = _loaded(qtype, 24, 256 // bs, seed=3)
    x = torch.randn(9, w.shape[1], generator=torch.Generator().manual_seed(2)) * 1e3
    y = gemm(w.data.to(device), qtype, 24, x.to(device), out_dtype=torch.float32, bf16=True,
             layout=w.layout).cpu()  # fmt: skip
    assert rel_err(y, x.double() @ ref.T) < 2e-2


def test_quant_linear_takes_the_gemm(device):
    """More than GEMV_MAX_ROWS rows: quant_linear runs the tensor-core GEMM (fused weights
    split back into their outputs)."""
    from kernel_checks import LaunchCounter

    w, ref = _loaded(T.Q6_K, 24, 1, seed=5)
    x = torch.randn(kernels.GEMV_MAX_ROWS + 3, 256).half()
    with LaunchCounter() as counter:
        y = quant_linear(x.to(device), w.to(device), out_dtype=torch.float32)
    assert dict(+counter.launches) == {"gemm_kernel": 1}
    assert rel_err(y.cpu(), x.double() @ ref.T) < 3e-3


def test_tile_choice():
    """128 x 128 tiles; 64-row weight tiles where 128-row ones would leave the last wave more
    than a fifth idle (Llama-3-8B's QKV at 512 rows) and K is not split (a float16 result);
    K steps within the type's bounds."""
    assert gemm_config(512, 4096, T.Q4_K, n=4096)["BLOCK_N"] == 128
    assert gemm_config(512, 4096, T.Q4_K, n=6144)["BLOCK_N"] == 64
    assert gemm_config(512, 4096, T.Q4_K, n=28672)["BLOCK_N"] == 128
    assert gemm_config(20, 4096, T.Q4_K)["BLOCK_M"] == 64
    assert gemm_config(512, 4096, T.Q4_K, block_k=32)["BLOCK_K"] == 64  # a sub-block pair
    assert gemm_config(512, 96, T.Q8_0, "planes")["BLOCK_K"] == 32  # K = 96: one block a step
    assert not gemm_config(512, 4096, T.Q6_K, "blocks")["CHUNKS"]  # 210-byte blocks: per weight


def _estimate(qtype: T, n: int, k: int):
    case, launch = kernel_profile.gemm_case(qtype, kernel_profile.PREFILL_ROWS, n, k, 90)
    try:
        compiled = _aot.compile_case(case)
    except _aot.CompileUnavailable as e:
        pytest.skip(str(e))
    fig = kernel_profile.static_figures(compiled, case, launch)
    est = kernel_profile.gemm_estimate(kernel_profile.GPUS["H100"], 90, fig, launch, n, k,
                                       kernel_profile.PREFILL_ROWS, fig, qtype)  # fmt: skip
    return compiled, fig, est


@pytest.mark.parametrize("matrix", ["attn_qkv", "ffn_down"])
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0, T.Q2_K], ids=lambda q: q.name)
def test_static_targets(qtype, matrix):
    """Issue 30 on sm_90: HGMMA (Hopper's tensor cores) in the main loop with the weights as
    the register operand, no spills, and an estimated >= 50% of the H100's dense float16
    peak on Llama-3-8B's matrices at 512 rows (bench/kernel_profile.py's model)."""
    n, k = kernel_profile.MODELS["llama3-8b"][matrix]
    compiled, fig, est = _estimate(qtype, n, k)
    assert fig["spill_instructions"] == 0 and fig["local_bytes"] == 0
    assert fig["loop_mma"] >= 4 and all(op.startswith("HGMMA") for op in fig["mma_ops"])
    body = kernel_profile._main_loop(_aot.parse_sass(_aot.sass(compiled.asm["cubin"])), "HGMMA")
    a_operands = {i.operands.split(",")[1].strip()[0] for i in body if i.base == "HGMMA"}
    assert a_operands == {"R"}, "the decoded weights go to wgmma from registers"
    assert est["peak_fraction"] >= 0.5, est


def test_split_k_halves_add_up(device):
    """Two programs along K add their float32 sums into a zeroed result: the same as one
    program up to float32 summation order, and the same at every launch."""
    w, ref = _loaded(T.Q4_K, 40, 4, seed=7)  # K = 1024: two halves of 4 steps
    x = torch.randn(20, 1024, generator=torch.Generator().manual_seed(3)).to(device)
    args = (w.data.to(device), T.Q4_K, 40, x)
    y1 = gemm(*args, out_dtype=torch.float32, split_k=1)
    y2 = gemm(*args, out_dtype=torch.float32, split_k=2)
    assert rel_err(y2.cpu(), x.cpu().double() @ ref.T) < 3e-3
    assert rel_err(y2, y1) < 1e-6
    assert torch.equal(gemm(*args, out_dtype=torch.float32, split_k=2), y2)
    with pytest.raises(ValueError, match="float32"):
        gemm(*args, out_dtype=torch.float16, split_k=2)
    with pytest.raises(ValueError, match="split into"):
        gemm(*args, out_dtype=torch.float32, split_k=16)
    # chosen where it fills the GPU: Llama-3-8B's QKV at 512 rows, a float32 result
    cfg = gemm_config(512, 4096, T.Q4_K, n=6144, split_k=True)
    assert (cfg["SPLIT_K"], cfg["BLOCK_N"]) == (2, 128)
    assert gemm_config(512, 4096, T.Q4_K, n=4096, split_k=True)["SPLIT_K"] == 1
