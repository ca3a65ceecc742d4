"""The recurrent operations of state-space models against a float64 reference written out
token by token: the causal short convolution and Mamba2's selective scan, as the torch
backend computes them (the scan in its chunked form for a prompt, across chunk boundaries)
and as the native kernels do (``localllm/cpu/csrc/ssm.cpp``: the build of this machine, and
the AVX2 build in a subprocess). Sizes are odd so that vector tails run; inputs are views
into a wider projection, as the models pass them.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from localllm import cpu
from localllm.backends import ssm

native = pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels are unavailable")


def conv_reference(x, w, bias, state, silu):
    """float64, one output at a time: y[t, c] = sum_j w[c, j] u[t + j, c] (+ b, SiLU)."""
    x, w, state = x.double(), w.double(), state.double()
    k = w.shape[1]
    u = torch.cat([state, x])
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(k):
            y[t] += w[:, j] * u[t + j]
    if bias is not None:
        y += bias.double()
    return (y * torch.sigmoid(y) if silu else y), u[x.shape[0]:]


def scan_reference(x, dt, dt_bias, a, b, c, d, state):
    """float64, token by token and head by head (module docstring of backends/ssm.py)."""
    x, dt, b, c, s = x.double(), dt.double(), b.double(), c.double(), state.double().clone()
    h_len, g_len = x.shape[1], b.shape[1]
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for h in range(h_len):
            g = h // (h_len // g_len)
            v = float(dt[t, h] + dt_bias[h])
            dts = v if v > 20 else torch.log1p(torch.exp(torch.tensor(v, dtype=torch.float64)))
            s[h] = s[h] * torch.exp(dts * float(a[h])) + (x[t, h] * dts)[:, None] * b[t, g][None]
            y[t, h] = s[h] @ c[t, g] + (float(d[h]) * x[t, h] if d is not None else 0.0)
    return y, s


def conv_case(t, ch, k, seed):
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(t, ch + 9, generator=g)  # x: a column slice, as from the projection
    return (wide[:, 3:3 + ch], torch.randn(ch, k, generator=g) * 0.5,
            torch.randn(ch, generator=g), torch.randn(k - 1, ch, generator=g))


def scan_case(t, h, p, g_len, n, seed):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(t, h * p + 2 * g_len * n + h + 5, generator=g)
    x, b, c, dt = proj[:, 5:].split([h * p, g_len * n, g_len * n, h], dim=-1)
    return (x.reshape(t, h, p), dt * 2, torch.rand(h, generator=g) * -4 - 2,
            -torch.rand(h, generator=g) * 8 - 0.5, b.reshape(t, g_len, n),
            c.reshape(t, g_len, n), torch.randn(h, generator=g),
            torch.randn(h, p, n, generator=g))


def assert_close(ours, ref, what):
    err = float((ours.double() - ref).abs().max())
    scale = float(ref.abs().max()) + 1.0
    assert err <= 2e-6 * scale, f"{what}: max error {err:g} (scale {scale:g})"


CONV_CASES = list(itertools.product([1, 33], [1, 37], [2, 4], [True, False]))
SCAN_CASES = [(1, 6, 5, 2, 17), (9, 6, 5, 3, 64), (1, 4, 8, 1, 1), (40, 4, 3, 2, 33),
              (150, 3, 4, 1, 16)]


def run_conv(op, t, ch, k, silu, seed):
    x, w, bias, state = conv_case(t, ch, k, seed)
    ref_y, ref_s = conv_reference(x, w, bias if silu else None, state, silu)
    s = state.clone()
    y = op(x, w, bias if silu else None, s, silu=silu)
    assert_close(y, ref_y, f"conv y T={t} C={ch} K={k}")
    assert_close(s, ref_s, f"conv state T={t} C={ch} K={k}")


def run_scan(op, t, h, p, g_len, n, with_d, seed):
    x, dt, bias, a, b, c, d, state = scan_case(t, h, p, g_len, n, seed)
    d = d if with_d else None
    ref_y, ref_s = scan_reference(x, dt, bias, a, b, c, d, state)
    s = state.clone()
    y = op(x, dt, bias, a, b, c, d, s)
    assert_close(y, ref_y, f"scan y T={t} H={h} P={p} G={g_len} N={n}")
    assert_close(s, ref_s, f"scan state T={t} H={h} P={p} G={g_len} N={n}")


@pytest.mark.parametrize("t,ch,k,silu", CONV_CASES)
def test_torch_short_conv(t, ch, k, silu):
    run_conv(ssm.short_conv, t, ch, k, silu, seed=t * 100 + ch + k)


@pytest.mark.parametrize("case", SCAN_CASES)
def test_torch_scan_step_and_chunked(case):
    """One token: the recurrence; more: the chunked form, across chunk boundaries (150)."""
    run_scan(ssm.ssm_scan, *case, with_d=True, seed=sum(case))


def _native_conv(x, w, bias, state, *, silu):
    return torch.ops.localllm_cpu.short_conv(x, w, bias, state, silu)


def _native_scan(*args):
    return torch.ops.localllm_cpu.ssm_scan(*args)


@native
@pytest.mark.parametrize("t,ch,k,silu", CONV_CASES)
def test_native_short_conv(t, ch, k, silu):
    run_conv(_native_conv, t, ch, k, silu, seed=t * 100 + ch + k)


@native
@pytest.mark.parametrize("with_d", [True, False])
@pytest.mark.parametrize("case", SCAN_CASES)
def test_native_scan(case, with_d):
    run_scan(_native_scan, *case, with_d=with_d, seed=sum(case))


@native
def test_native_ops_refuse_bad_shapes():
    x, w, bias, state = conv_case(3, 8, 4, 0)
    with pytest.raises(RuntimeError, match="state must be"):
        _native_conv(x, w, bias, state[:2].contiguous(), silu=True)
    args = list(scan_case(2, 4, 3, 2, 5, 0))
    args[7] = args[7][:, :, :4].contiguous()
    with pytest.raises(RuntimeError, match="state must be"):
        _native_scan(*args)


AVX2_CHECK = """
import sys
sys.path.insert(0, sys.argv[1])
import torch
from localllm import cpu
assert cpu.available()
import test_cpu_ssm as T
for t, ch, k, silu in T.CONV_CASES:
    T.run_conv(T._native_conv, t, ch, k, silu, seed=t * 100 + ch + k)
for case in T.SCAN_CASES:
    T.run_scan(T._native_scan, *case, with_d=True, seed=sum(case))
"""


@native
def test_avx2_build():
    """The same checks on the -march=haswell build (AVX2 + FMA, 8 lanes)."""
    from pathlib import Path

    pytest.importorskip("test_cpu_avx2", reason="needs an AVX2 CPU")
    from test_cpu_avx2 import run_haswell

    run_haswell(AVX2_CHECK, str(Path(__file__).parent))
