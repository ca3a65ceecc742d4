"""Triton MLA decode (kernels/mla.py) against the torch reference ``TorchOps.mla_attention``.

On CPU tensors through Triton's interpreter (and, cuda-marked, natively on a GPU): latents
of sizes that are not powers of two, caches that are not multiples of the step, queries in
the middle of the cache (the cells past them hold poison that a leak would show), several
splits, and the whole decode step of ``KernelOps`` over a latent cache.
"""

from __future__ import annotations

import pytest
import torch

from localllm.backends.dense import TorchOps
from localllm.memory import LatentSpec, make_memory

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import mla

POISON = 1e4


def reference(q, latent, q_pos, r, scale):
    """softmax(q . latent[:q_pos+1]) @ latent[:q_pos+1, :r] per head, float32."""
    k = latent[: q_pos + 1].float()
    p = torch.softmax(q.float() @ k.T * scale, -1)
    return p @ k[:, :r]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("h, r, rot, s, q_pos", [
    (4, 48, 16, 37, 20),  # one head block, a partial step, poison past the query
    (20, 32, 8, 70, 69),  # two head blocks, the last query of the cache
    (3, 128, 32, 300, 250),  # several splits
])
def test_mla_decode_matches_the_reference(device, h, r, rot, s, q_pos, monkeypatch):
    if device == "cpu":
        monkeypatch.setattr(mla, "TARGET_PROGRAMS", 4)  # more splits on small caches
    g = torch.Generator().manual_seed(h + s)
    q = torch.randn(h, r + rot, generator=g)
    latent = torch.randn(s, r + rot, generator=g)
    latent[q_pos + 1:] = POISON
    scale = (r + rot) ** -0.5
    want = reference(q, latent, q_pos, r, scale)
    got = mla.mla_decode(q.to(device), latent.to(device),
                         torch.tensor([q_pos], device=device), r, scale).cpu()
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)


def test_split_plan_covers_the_cache():
    for h, s in ((16, 1), (128, 4096), (4, 300), (128, 163840)):
        split, n = mla.split_plan(h, s)
        assert split % mla.BLOCK_S == 0 and n <= mla.MAX_SPLITS and (n - 1) * split < s <= n * split


@pytest.mark.parametrize("device", DEVICES)
def test_kernel_ops_decode_step_matches_torch(device):
    """KernelOps.mla_attention of one token (the cache write, the kernel, the value
    expansion) against TorchOps' after the same prefill, int and device positions."""
    from localllm.backends.triton import KernelOps

    g = torch.Generator().manual_seed(1)
    h, t, r, nope, rot, dv = 4, 11, 32, 16, 16, 24
    q_nope, q_pe = torch.randn(h, t, nope, generator=g), torch.randn(h, t, rot, generator=g)
    latent = torch.randn(t, r + rot, generator=g)
    k_b, v_b = torch.randn(h, r, nope, generator=g), torch.randn(h, dv, r, generator=g)
    outs = []
    for ops in (TorchOps(), KernelOps()):
        for static in (False, True):
            mem = make_memory([LatentSpec(r + rot)], 16, dtype=torch.float32, device=device)
            args = [x.to(device) for x in (q_nope, q_pe, latent)]
            ops.mla_attention(args[0][:, :-1], args[1][:, :-1], args[2][:-1], k_b.to(device),
                              v_b.to(device), mem[0], 0, torch.arange(t - 1, device=device),
                              scale=0.2)
            pos = torch.tensor([t - 1], device=device)
            out = ops.mla_attention(args[0][:, -1:], args[1][:, -1:], args[2][-1:],
                                    k_b.to(device), v_b.to(device), mem[0],
                                    pos if static else t - 1, pos, scale=0.2)
            outs.append(out.cpu())
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], rtol=2e-4, atol=2e-4)
