"""The gated delta rule against a float64 reference written here from its definition
(llama.cpp's ``ggml_gated_delta_net``): the torch reference (recurrence for one token,
chunked form for a prompt), the native CPU kernel (``localllm/cpu/csrc/recurrent.cpp``) and
the Triton kernel (``kernels/recurrent.py``, in Triton's interpreter on the CPU). The short
convolution the layer shares with Mamba2 is tested in test_cpu_ssm.py / test_ssm_kernels.py."""

from __future__ import annotations

import pytest
import torch

from localllm.backends import deltanet, ssm
from localllm.backends.dense import TorchOps

# (T, Hk, Hv, S): one token, a few, prompts across chunk boundaries; a head size that is no
# multiple of the vector width
SHAPES = [(1, 2, 4, 64), (3, 2, 2, 16), (70, 1, 3, 24), (130, 2, 4, 32)]


def delta_reference(qkv, alpha, beta_logit, dt_bias, a, state, hk, eps, interleave):
    """float64 gated delta rule, token by token (module docstring of backends/deltanet.py)."""
    qkv, alpha, beta_logit = qkv.double(), alpha.double(), beta_logit.double()
    t, hv, s = qkv.shape[0], state.shape[0], state.shape[1]
    kd = hk * s
    m = state.double().clone()
    out = torch.empty(t, hv, s, dtype=torch.float64)
    for i in range(t):
        for h in range(hv):
            kh = h // (hv // hk) if interleave else h % hk
            q = qkv[i, kh * s:(kh + 1) * s]
            k = qkv[i, kd + kh * s:kd + (kh + 1) * s]
            v = qkv[i, 2 * kd + h * s:2 * kd + (h + 1) * s]
            q = q / torch.sqrt((q * q).sum() + eps) / s ** 0.5
            k = k / torch.sqrt((k * k).sum() + eps)
            g = torch.nn.functional.softplus(alpha[i, h] + dt_bias[h].double()) * a[h].double()
            b = torch.sigmoid(beta_logit[i, h])
            m[h] *= torch.exp(g)
            d = b * (v - m[h] @ k)
            m[h] += torch.outer(d, k)
            out[i, h] = m[h] @ q
    return out, m


def delta_inputs(t, hk, hv, s, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, 2 * hk * s + hv * s, generator=g)
    alpha, beta = torch.randn(t, hv, generator=g), torch.randn(t, hv, generator=g) * 2
    dt_bias = torch.randn(hv, generator=g)
    a = -torch.exp(torch.rand(hv, generator=g) * 2)
    state = torch.randn(hv, s, s, generator=g) * 0.3
    return qkv, alpha, beta, dt_bias, a, state


def assert_close64(ours, ref, *, rtol=2e-5, what=""):
    err = float((ours.double() - ref).abs().max())
    scale = float(ref.abs().max())
    assert err <= rtol * max(scale, 1.0), f"{what}: max error {err:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("interleave", [False, True])
def test_torch_delta_rule_matches_float64(shape, interleave):
    """The reference recurrence (one token) and its chunked form (prompts, chunks of 64 and
    a padded last chunk) against the token-by-token float64 definition."""
    t, hk, hv, s = shape
    qkv, alpha, beta, dt_bias, a, state = delta_inputs(t, hk, hv, s)
    ref, ref_state = delta_reference(qkv, alpha, beta, dt_bias, a, state, hk, 1e-6, interleave)
    out = TorchOps.gated_delta_net(qkv, alpha, beta, dt_bias, a, state, n_k_heads=hk, eps=1e-6,
                                   interleave=interleave)
    assert_close64(out, ref, what="output")
    assert_close64(state, ref_state, what="state")


def test_chunked_form_equals_steps():
    """A prompt through the chunked form leaves the state that its tokens one at a time
    leave (prefill then decode is the same recurrence)."""
    qkv, alpha, beta, dt_bias, a, state = delta_inputs(70, 2, 4, 32, seed=3)
    s1, s2 = state.clone(), state.clone()
    full = deltanet.gated_delta_net(qkv, alpha, beta, dt_bias, a, s1, n_k_heads=2, eps=1e-6,
                                    interleave=False)
    steps = torch.cat([deltanet.gated_delta_net(qkv[i:i + 1], alpha[i:i + 1], beta[i:i + 1],
                                                dt_bias, a, s2, n_k_heads=2, eps=1e-6,
                                                interleave=False) for i in range(70)])
    torch.testing.assert_close(full, steps, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s1, s2, rtol=1e-4, atol=1e-5)


def test_softplus_is_ggmls():
    x = torch.tensor([-30.0, -1.0, 0.0, 3.0, 19.9, 20.0, 25.0])
    expected = torch.where(x > 20, x, torch.log1p(torch.exp(x)))
    torch.testing.assert_close(ssm.softplus(x), expected)


# ---- native CPU kernels -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def native():
    from localllm import cpu

    if not cpu.available():
        pytest.skip("the native CPU kernels are unavailable")
    return torch.ops.localllm_cpu


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("interleave", [False, True])
def test_native_delta_rule_matches_float64(native, shape, interleave):
    t, hk, hv, s = shape
    qkv, alpha, beta, dt_bias, a, state = delta_inputs(t, hk, hv, s, seed=7)
    ref, ref_state = delta_reference(qkv, alpha, beta, dt_bias, a, state, hk, 1e-6, interleave)
    out = native.gated_delta_net(qkv, alpha, beta, dt_bias, a, state, hk, 1e-6, interleave)
    assert_close64(out, ref, what="output")
    assert_close64(state, ref_state, what="state")


def test_native_ops_refuse_bad_shapes(native):
    qkv, alpha, beta, dt_bias, a, state = delta_inputs(2, 2, 4, 16)
    with pytest.raises(RuntimeError, match="Hv must be a multiple of Hk"):
        native.gated_delta_net(qkv, alpha, beta, dt_bias, a, state, 3, 1e-6, False)
    with pytest.raises(RuntimeError, match="qkv must have"):
        native.gated_delta_net(qkv[:, 1:], alpha, beta, dt_bias, a, state, 2, 1e-6, False)


# ---- Triton kernels (the interpreter on the CPU) -------------------------------------------

@pytest.fixture(scope="module")
def kernels():
    from localllm import kernels

    if not kernels.triton_available():
        pytest.skip("Triton is not installed")
    return kernels


@pytest.mark.parametrize("shape", [(1, 2, 4, 32), (5, 1, 3, 24)])
@pytest.mark.parametrize("interleave", [False, True])
def test_triton_delta_rule_matches_float64(kernels, shape, interleave):
    t, hk, hv, s = shape
    qkv, alpha, beta, dt_bias, a, state = delta_inputs(t, hk, hv, s, seed=11)
    ref, ref_state = delta_reference(qkv, alpha, beta, dt_bias, a, state, hk, 1e-6, interleave)
    out = kernels.gated_delta_net(qkv, alpha, beta, dt_bias, a, state, n_k_heads=hk, eps=1e-6,
                                  interleave=interleave)
    assert_close64(out, ref, what="output")
    assert_close64(state, ref_state, what="state")
