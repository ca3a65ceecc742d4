"""The Triton kernels of the recurrent operations (``localllm/kernels/ssm.py``) in Triton's
interpreter, against the same float64 references as the native kernels (test_cpu_ssm.py),
on views into a wider projection as the models pass them."""

from __future__ import annotations

import pytest
from localllm.kernels import triton_available
from test_cpu_ssm import run_conv, run_scan

pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed")


@pytest.mark.parametrize("t,ch,k,silu", [(1, 37, 4, True), (5, 300, 2, False), (3, 5, 4, True)])
def test_short_conv_kernel(t, ch, k, silu):
    from localllm import kernels

    run_conv(kernels.short_conv, t, ch, k, silu, seed=t + ch)


@pytest.mark.parametrize("with_d", [True, False])
@pytest.mark.parametrize("case", [(1, 6, 5, 2, 17), (4, 4, 3, 2, 33), (2, 3, 70, 1, 16)])
def test_ssm_scan_kernel(case, with_d):
    from localllm import kernels

    run_scan(kernels.ssm_scan, *case, with_d=with_d, seed=sum(case))
