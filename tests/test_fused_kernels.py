"""Fused element-wise kernels (kernels/fused.py) against the torch path of the models.

Every test runs on CPU tensors through Triton's interpreter and, as a cuda-marked variant,
natively on a GPU (skipped without one). Inputs are views laid out as the models make them
(slices of a fused QKV or gate/up output), with sizes that are not powers of two where the
kernels mask.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_checks import HOST_READS, NoLaunch, OpRecorder

from localllm.backends.dense import gelu_tanh, rms_norm, rope_angles, rotate
from localllm.models.rope import rope_inv_freq

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import fused
from localllm.kernels.fused import gated_act, residual_rms_norm, rms_norm_rope

TOL = {"rtol": 1e-5, "atol": 1e-5}
EPS = 1e-6


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def qkv_views(t: int, n_heads: int, n_kv: int, d: int, device, seed: int = 0):
    """q (H, T, D) and k (H_kv, T, D) as the models take them from one fused QKV output."""
    qkv = torch.randn(t, (n_heads + 2 * n_kv) * d, generator=gen(seed)) * 3
    qkv = qkv.to(device)
    q = qkv[:, : n_heads * d].reshape(t, n_heads, d).transpose(0, 1)
    k = qkv[:, n_heads * d : (n_heads + n_kv) * d].reshape(t, n_kv, d).transpose(0, 1)
    return q, k


def rope_reference(x, weight, positions, inv_freq, *, neox, scale):
    x = x.cpu()
    if weight is not None:
        x = rms_norm(x, weight.cpu(), EPS)
    return rotate(x, rope_angles(positions.cpu(), inv_freq.cpu(), scale), neox=neox)


@pytest.mark.parametrize("d", [16, 256])
@pytest.mark.parametrize("t", [1, 5])
@pytest.mark.parametrize("neox", [True, False], ids=["neox", "norm"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["norm", "rope-only"])
def test_rms_norm_rope(with_weight, neox, t, d, device):
    q, k = qkv_views(t, 4, 2, d, device, seed=d + t)
    if t > 1:  # token rows of the full QKV width (a size-1 dim's stride is arbitrary)
        assert q.stride() == k.stride() == (d, 8 * d, 1)
    weight = (torch.randn(d, generator=gen(1)) + 1).to(device) if with_weight else None
    positions = torch.tensor([7, 0, 1, 100, 4095][:t], device=device)
    inv = rope_inv_freq(d, 10000.0, device=device)
    for x in (q, k):
        y = rms_norm_rope(x, weight, EPS, positions, inv, neox=neox, scale=0.5)
        assert y.shape == x.shape and y.dtype == torch.float32 and y.is_contiguous()
        ref = rope_reference(x, weight, positions, inv, neox=neox, scale=0.5)
        torch.testing.assert_close(y.cpu(), ref, **TOL)


@pytest.mark.parametrize("neox", [True, False], ids=["neox", "norm"])
def test_rms_norm_rope_odd_half_and_contiguous(neox, device):
    """D = 24 (half of 12 is masked up to 16), a contiguous input, scale 1, int32 positions."""
    x = torch.randn(3, 4, 24, generator=gen(2)).to(device)
    weight = torch.randn(24, generator=gen(3)).to(device)
    positions = torch.tensor([3, 9, 2, 31], dtype=torch.int32, device=device)
    inv = rope_inv_freq(24, 1e6, device=device)
    y = rms_norm_rope(x, weight, EPS, positions, inv, neox=neox)
    ref = rope_reference(x, weight, positions.long(), inv, neox=neox, scale=1.0)
    torch.testing.assert_close(y.cpu(), ref, **TOL)


def test_rms_norm_rope_reads_positions_from_the_tensor(device):
    """The same launch arguments with new values in ``positions`` give the new rotation."""
    x, _ = qkv_views(1, 4, 1, 64, device)
    inv = rope_inv_freq(64, 10000.0, device=device)
    positions = torch.zeros(1, dtype=torch.long, device=device)
    at0 = rms_norm_rope(x, None, EPS, positions, inv, neox=True)
    torch.testing.assert_close(at0.cpu(), x.cpu().contiguous(), **TOL)
    positions.fill_(42)
    y = rms_norm_rope(x, None, EPS, positions, inv, neox=True)
    ref = rope_reference(x, None, torch.tensor([42]), inv, neox=True, scale=1.0)
    torch.testing.assert_close(y.cpu(), ref, **TOL)


@pytest.mark.parametrize("d", [640, 40])
@pytest.mark.parametrize("t", [1, 7])
@pytest.mark.parametrize("post", [True, False], ids=["post-norm", "no-post-norm"])
def test_residual_rms_norm(post, t, d, device):
    x = torch.randn(t, d, generator=gen(d + t)) * 2
    # f: the left half of a wider output (a row stride that is not D).
    f_wide = torch.randn(t, 2 * d, generator=gen(5)) * 7
    post_weight = torch.randn(d, generator=gen(6)) + 1 if post else None
    weight = torch.randn(d, generator=gen(7)) + 1
    h, n = residual_rms_norm(
        x.to(device), f_wide.to(device)[:, :d],
        post_weight.to(device) if post else None, weight.to(device), EPS,
    )  # fmt: skip
    f = f_wide[:, :d]
    h_ref = x + (rms_norm(f, post_weight, EPS) if post else f)
    assert h.shape == n.shape == (t, d) and h.is_contiguous() and n.is_contiguous()
    torch.testing.assert_close(h.cpu(), h_ref, **TOL)
    torch.testing.assert_close(n.cpu(), rms_norm(h_ref, weight, EPS), **TOL)


def test_residual_rms_norm_leading_dims(device):
    """(..., D) inputs keep their shape (the rows are flattened for the launch)."""
    x = torch.randn(2, 3, 40, generator=gen(8))
    f = torch.randn(2, 3, 40, generator=gen(9))
    weight = torch.randn(40, generator=gen(10))
    h, n = residual_rms_norm(x.to(device), f.to(device), None, weight.to(device), EPS)
    assert h.shape == n.shape == (2, 3, 40)
    torch.testing.assert_close(h.cpu(), x + f, **TOL)
    torch.testing.assert_close(n.cpu(), rms_norm(x + f, weight, EPS), **TOL)


ACTS = {"gelu_tanh": gelu_tanh, "silu": F.silu}


# exp(-2z) overflows to inf for the large negative gates: intended (the limit, -0).
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("n", [2048, 100])
@pytest.mark.parametrize("act", list(ACTS))
def test_gated_act(act, n, device):
    t = 3
    gu = torch.randn(t, 2 * n, generator=gen(n)) * 4
    gu[0, : n // 4] = 30.0  # tanh / sigmoid saturate; exp of the negative argument overflows
    gu[1, : n // 4] = -30.0
    gu[2, :4] = torch.tensor([-100.0, 100.0, 1e-30, 0.0])
    gate, up = gu[:, :n], gu[:, n:]
    gu_dev = gu.to(device)  # sliced on the device: views with a row stride of 2F
    y = gated_act(gu_dev[:, :n], gu_dev[:, n:], act=act)
    assert y.shape == (t, n) and y.is_contiguous() and y.dtype == torch.float32
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.cpu(), ACTS[act](gate) * up, **TOL)
    # Against float64 the activation alone is as close as float32 allows.
    a = gated_act(gu_dev[:, :n], torch.ones(t, n, device=device), act=act).cpu()
    torch.testing.assert_close(a.double(), ACTS[act](gate.double()), rtol=2e-6, atol=1e-6)


def test_gated_act_transposed_views(device):
    """Non-contiguous views with a strided last dimension are copied, not misread."""
    gate = torch.randn(50, 3, generator=gen(11)).t()
    up = torch.randn(50, 3, generator=gen(12)).t()
    y = gated_act(gate.to(device), up.to(device), act="silu")
    torch.testing.assert_close(y.cpu(), F.silu(gate) * up, **TOL)


def test_empty_inputs(device):
    inv = rope_inv_freq(16, 10000.0, device=device)
    x = torch.zeros(4, 0, 16, device=device)
    empty_pos = torch.zeros(0, dtype=torch.long, device=device)
    assert rms_norm_rope(x, None, EPS, empty_pos, inv, neox=True).shape == (4, 0, 16)
    z = torch.zeros(0, 40, device=device)
    h, n = residual_rms_norm(z, z, None, torch.ones(40, device=device), EPS)
    assert h.shape == n.shape == (0, 40)
    assert gated_act(z, z, act="silu").shape == (0, 40)


def _rope_args(**over):
    args = {"x": torch.zeros(4, 3, 16), "weight": torch.ones(16), "eps": EPS,
            "positions": torch.arange(3), "inv_freq": torch.ones(8)}  # fmt: skip
    args.update(over)
    return args


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"x": torch.zeros(3, 16)}, r"\(H, T, D\)"),
        ({"x": torch.zeros(4, 3, 15), "weight": torch.ones(15)}, "disagree"),
        ({"positions": torch.arange(4)}, "disagree"),
        ({"inv_freq": torch.ones(16)}, "disagree"),
        ({"weight": torch.ones(8)}, "weight"),
        ({"positions": torch.zeros(3)}, "integers"),
        ({"x": torch.zeros(4, 3, 16, dtype=torch.float16)}, "float32"),
        ({"x": torch.zeros(4, 16, 3).transpose(1, 2)}, "contiguous"),
    ],
)
def test_rms_norm_rope_errors(over, match):
    args = _rope_args(**over)
    with pytest.raises(ValueError, match=match):
        rms_norm_rope(args.pop("x"), args.pop("weight"), args.pop("eps"), args.pop("positions"),
                      args.pop("inv_freq"), neox=True)  # fmt: skip


def test_residual_and_gated_errors():
    x = torch.zeros(2, 40)
    with pytest.raises(ValueError, match="differ"):
        residual_rms_norm(x, torch.zeros(2, 41), None, torch.ones(40), EPS)
    with pytest.raises(ValueError, match="weight"):
        residual_rms_norm(x, x, None, torch.ones(41), EPS)
    with pytest.raises(ValueError, match="post_weight"):
        residual_rms_norm(x, x, torch.ones(39), torch.ones(40), EPS)
    with pytest.raises(ValueError, match="float32"):
        residual_rms_norm(x, x.double(), None, torch.ones(40), EPS)
    with pytest.raises(ValueError, match="unknown act 'relu'"):
        gated_act(x, x, act="relu")
    with pytest.raises(ValueError, match=r"\(T, F\)"):
        gated_act(x, torch.zeros(2, 41), act="silu")
    with pytest.raises(ValueError, match=r"\(T, F\)"):
        gated_act(torch.zeros(40), torch.zeros(40), act="silu")
    with pytest.raises(ValueError, match="float32"):
        gated_act(x.half(), x.half(), act="gelu_tanh")


def test_no_host_reads_one_launch_each(monkeypatch):
    stubs = {name: NoLaunch() for name in
             ("_rms_norm_rope_kernel", "_residual_rms_norm_kernel", "_gated_act_kernel")}  # fmt: skip
    for name, stub in stubs.items():
        monkeypatch.setattr(fused, name, stub)
    q, _ = qkv_views(5, 4, 2, 64, "cpu")
    positions = torch.arange(5)
    inv = rope_inv_freq(64, 10000.0)
    gu = torch.randn(5, 200)
    with OpRecorder() as rec:
        rms_norm_rope(q, torch.ones(64), EPS, positions, inv, neox=True, scale=0.25)
        rms_norm_rope(q, None, EPS, positions, inv, neox=False)
        residual_rms_norm(gu[:, :100], gu[:, 100:], torch.ones(100), torch.ones(100), EPS)
        gated_act(gu[:, :100], gu[:, 100:], act="gelu_tanh")
    assert not rec.ops & HOST_READS, rec.ops & HOST_READS
    assert stubs["_rms_norm_rope_kernel"].grids == [(20,), (20,)]
    assert stubs["_residual_rms_norm_kernel"].grids == [(5,)]
    assert stubs["_gated_act_kernel"].grids == [(5, 1)]
    # The recorder does see a host read when there is one: the check above can fail.
    with OpRecorder() as rec:
        positions[0].item()
    assert rec.ops & HOST_READS


@pytest.mark.cuda
def test_cuda_graph_replay(device):
    if device.type != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    q, _ = qkv_views(1, 8, 2, 256, device, seed=3)
    weight = torch.randn(256, device=device)
    inv = rope_inv_freq(256, 10000.0, device=device)
    positions = torch.zeros(1, dtype=torch.long, device=device)
    gu = torch.randn(1, 4096, device=device)
    args = (q, weight, EPS, positions, inv)
    rms_norm_rope(*args, neox=True)  # compile outside the capture
    gated_act(gu[:, :2048], gu[:, 2048:], act="gelu_tanh")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = rms_norm_rope(*args, neox=True)
        a = gated_act(gu[:, :2048], gu[:, 2048:], act="gelu_tanh")
    for p in (5, 1000):
        positions.fill_(p)
        graph.replay()
        ref = rope_reference(q, weight, torch.tensor([p]), inv, neox=True, scale=1.0)
        torch.testing.assert_close(y.cpu(), ref, **TOL)
        torch.testing.assert_close(a.cpu(), (gelu_tanh(gu[:, :2048]) * gu[:, 2048:]).cpu(), **TOL)
