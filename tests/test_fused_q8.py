"""Activation quantization fused into the kernels that produce a GEMV's input.

For one row (a decode step) ``residual_rms_norm``, ``gated_act`` and ``decode_attention``
(tested in tests/test_attention_kernel.py) also write their output quantized to 8 bits per
32 values (what ``gemv.quantize_q8`` computes) and attach it to the output tensor; the
integer-dot GEMV that multiplies that tensor reads it instead of launching ``quantize_q8``. Oracle: ``quantize_q8`` itself (the copies must be identical) and the logits
of the unfused path (bit-identical, since the GEMV sees the same bytes).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

import localllm.kernels.gemv as gemv_module  # the package's gemv is the function
from localllm.kernels import QuantWeight, fused, quant_linear
from localllm.kernels.gemv import attached_q8, quantize_q8


class CountingLaunch:
    """Wraps a kernel: counts launches, runs them."""

    def __init__(self, k) -> None:
        self.k, self.launches = k, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.k[grid]


@pytest.fixture
def q8_launches(monkeypatch):
    counter = CountingLaunch(gemv_module._quantize_q8_kernel)
    monkeypatch.setattr(gemv_module, "_quantize_q8_kernel", counter)
    return counter


def same_q8(got, x: torch.Tensor) -> bool:
    want = quantize_q8(x.reshape(-1))
    return got is not None and all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("d, post", [(64, False), (640, True), (96, True)])
def test_residual_norm_writes_the_q8_copy(d, post, device):
    g = torch.Generator().manual_seed(d)
    x, f = (torch.randn(1, d, generator=g).to(device) for _ in range(2))
    w, pw = (torch.rand(d, generator=g).to(device) + 0.5 for _ in range(2))
    _, n = fused.residual_rms_norm(x * 40, f, pw if post else None, w, 1e-6)
    assert same_q8(attached_q8(n), n)
    xq, xd, xs = attached_q8(n)
    assert xq.device == n.device and xd.shape == (d // 32,) and xs.shape == (d // 16,)


def test_q8_copy_only_for_one_row_of_whole_chunks(device):
    """Several rows (prefill) or D not a multiple of 32: nothing attached."""
    w = torch.ones(64, device=device)
    _, n2 = fused.residual_rms_norm(torch.randn(2, 64).to(device), torch.randn(2, 64).to(device),
                                    None, w, 1e-6)  # fmt: skip
    _, n48 = fused.residual_rms_norm(torch.randn(1, 48).to(device), torch.randn(1, 48).to(device),
                                     None, w[:48], 1e-6)  # fmt: skip
    y = fused.gated_act(torch.randn(3, 64).to(device), torch.randn(3, 64).to(device), act="silu")
    assert attached_q8(n2) is None and attached_q8(n48) is None and attached_q8(y) is None


@pytest.mark.parametrize("act, f", [("silu", 96), ("gelu_tanh", 1920)])  # 1920: 2 programs
def test_gated_act_writes_the_q8_copy(act, f, device):
    g = torch.Generator().manual_seed(f)
    gate, up = (torch.randn(1, f, generator=g).to(device) * 3 for _ in range(2))
    y = fused.gated_act(gate, up, act=act)
    assert same_q8(attached_q8(y), y)


def test_gemv_reads_the_attached_copy(q8_launches, device):
    """No quantizing launch for a tensor that carries its copy; the same result as without."""
    from test_planes import weight

    _, p, _ = weight(T.Q4_0, 9, 4, seed=2)
    p = p.to(device)
    _, n = fused.residual_rms_norm(torch.randn(1, 128).to(device), torch.randn(1, 128).to(device),
                                   None, torch.ones(128, device=device), 1e-6)  # fmt: skip
    q8_launches.launches = 0
    fused_y = quant_linear(n, p)
    assert q8_launches.launches == 0
    plain_y = quant_linear(n.clone(), p)  # a clone carries nothing: quantized by the GEMV
    assert q8_launches.launches == 1
    assert torch.equal(fused_y, plain_y)


def test_decode_step_quantizes_only_unfused_inputs(tiny_model_path, q8_launches, monkeypatch):
    """In a decode step of the kernel path, only the GEMV input that no fused kernel produced
    is quantized by a launch of its own: the first layer's QKV input (plain RMSNorm); the
    attention outputs come quantized from the attention kernel, and the output head reads a
    view of the last residual norm's output. The logits are those of the unfused path, bit
    for bit."""
    from localllm.kernels import attention

    from localllm.runtime.session import Session, load_model

    n_layers = 2
    path = tiny_model_path("llama", qtype=T.Q8_0, n_layers=n_layers)
    m = load_model(path, device="cpu", progress=False, backend="triton")
    ids = [5, 9, 2, 7, 11, 3]
    s = Session(m, ctx_size=32)
    s.eval(ids[:5])
    q8_launches.launches = 0
    got = s.eval(ids[5:])
    assert q8_launches.launches == 1  # was 4 per layer + 1 (the output head)
    for module in (fused, attention):  # the unfused path
        monkeypatch.setattr(module, "attach_q8", lambda x, q8: None)
    ref = Session(m, ctx_size=32)
    ref.eval(ids[:5])
    q8_launches.launches = 0
    want = ref.eval(ids[5:])
    assert q8_launches.launches == 4 * n_layers + 1
    assert torch.equal(got, want)


def test_views(device):
    """A view of the whole tensor shares its copy; a part of it, or a copy, does not."""
    _, n = fused.residual_rms_norm(torch.randn(1, 64).to(device), torch.randn(1, 64).to(device),
                                   None, torch.ones(64, device=device), 1e-6)  # fmt: skip
    assert attached_q8(n[-1:]) is attached_q8(n) is not None
    assert attached_q8(n.view(64)) is attached_q8(n)
    assert attached_q8(n[:, :32]) is None and attached_q8(n.clone()) is None


def test_blocks_layout_reads_the_copy_too(device):
    """Weights not repacked (the GGUF layout) take the same path."""
    from test_kernels import make_weight

    w, _ = make_weight(T.Q4_K, n=5, blocks_per_row=1, seed=3)
    assert isinstance(w, QuantWeight) and w.layout == "blocks"
    w = w.to(device)
    y = fused.gated_act(torch.randn(1, 256).to(device), torch.randn(1, 256).to(device),
                        act="silu")  # fmt: skip
    assert attached_q8(y) is not None
    assert torch.equal(quant_linear(y, w), quant_linear(y.clone(), w))
