"""localllm/models/rope.py against ggml's RoPE, written out here from ggml's loop
(``ggml/src/ggml-cpu/ops.cpp``: ``ggml_rope_cache_init``, ``rope_yarn``, ``rotate_pairs``),
and the backends' RoPE with a magnitude or a QK-norm after the rotation against the torch
reference (Triton's interpreter on the CPU; natively under ``pytest -m cuda``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from localllm.backends.dense import TorchOps, xielu
from localllm.errors import GGUFError
from localllm.models.base import HParams, swa_layers
from localllm.models.rope import GLOBAL, SWA, Rope, RopeSpec, read_rope

f32 = np.float32


def ggml_rope(x: np.ndarray, p: int, *, n_dims: int, mode_neox: bool, base: float,
              freq_scale: float, ext_factor: float, attn_factor: float, n_ctx_orig: int,
              beta_fast: float, beta_slow: float, ff: np.ndarray | None = None) -> np.ndarray:
    """One head (ne0,) float32 rotated at position p, as ggml's CPU loop does it, float32."""
    ne0 = x.shape[0]

    def corr_dim(n_rot):
        return f32(n_dims) * f32(math.log(f32(n_ctx_orig) / (f32(n_rot) * f32(2 * math.pi)))) / (
            f32(2) * f32(math.log(f32(base))))

    low = max(f32(0), f32(math.floor(corr_dim(beta_fast))))
    high = min(f32(n_dims - 1), f32(math.ceil(corr_dim(beta_slow))))
    theta_scale = f32(base) ** f32(-2.0 / n_dims)
    cache = np.zeros(ne0, dtype=f32)
    theta = f32(p)
    for i0 in range(0, n_dims, 2):  # (ggml fills the cache past n_dims too, unused)
        theta_extrap = theta / (f32(ff[i0 // 2]) if ff is not None else f32(1))
        theta_interp = f32(freq_scale) * theta_extrap
        th, mscale = theta_interp, f32(attn_factor)
        if ext_factor != 0.0:
            y = (f32(i0 // 2) - low) / max(f32(0.001), high - low)
            ramp = f32(1) - min(f32(1), max(f32(0), y))
            mix = ramp * f32(ext_factor)
            th = theta_interp * (f32(1) - mix) + theta_extrap * mix
            mscale *= f32(1) + f32(0.1) * f32(math.log(1.0 / freq_scale))
        cache[i0], cache[i0 + 1] = f32(math.cos(th)) * mscale, f32(math.sin(th)) * mscale
        theta = theta * theta_scale
    out = x.copy()
    for i0 in range(0, n_dims, 2):
        c, s = cache[i0], cache[i0 + 1]
        a, b = (i0 // 2, i0 // 2 + n_dims // 2) if mode_neox else (i0, i0 + 1)
        out[a] = x[a] * c - x[b] * s
        out[b] = x[a] * s + x[b] * c
    return out


def llama_cpp_attn_factor(spec: RopeSpec) -> float:
    """llama-context.cpp's ``cparams.yarn_attn_factor`` for a spec (the value ggml's rope gets
    as attn_factor)."""
    a = spec.attn_factor
    if spec.ext_factor == 0.0:
        return a

    def get_mscale(scale, m):
        return 1.0 if scale <= 1.0 else 0.1 * m * math.log(scale) + 1.0

    f = spec.factor
    y = (get_mscale(f, spec.mscale) / get_mscale(f, spec.log_mul) if spec.log_mul
         else get_mscale(f, 1.0))
    return y / (1.0 + 0.1 * math.log(f)) * a


SPECS = {
    "plain-norm": RopeSpec(head_dim=32, n_rot=32, base=10000.0, neox=False),
    "linear-neox": RopeSpec(head_dim=32, n_rot=32, base=500000.0, neox=True, kind="linear",
                            factor=4.0, attn_factor=1.1),
    "yarn": RopeSpec(head_dim=32, n_rot=32, base=10000.0, neox=True, kind="yarn", factor=4.0,
                     orig_context=32, ext_factor=1.0),
    "yarn-betas-logmul": RopeSpec(head_dim=32, n_rot=32, base=10000.0, neox=False, kind="yarn",
                                  factor=8.0, orig_context=16, ext_factor=1.0, beta_fast=16.0,
                                  beta_slow=0.5, log_mul=0.7),
    "yarn-partial-neox": RopeSpec(head_dim=32, n_rot=24, base=10000.0, neox=True, kind="yarn",
                                  factor=4.0, orig_context=32, ext_factor=1.0),
    "longrope-partial-norm": RopeSpec(head_dim=32, n_rot=16, base=10000.0, neox=False,
                                      kind="longrope", factor=2.0, attn_factor=1.19),
    "swa-base": RopeSpec(head_dim=32, n_rot=32, base=1e6, neox=True, kind="yarn", factor=4.0,
                         orig_context=32, ext_factor=1.0, base_swa=10000.0,
                         freq_scale_swa=1.0),
}


@pytest.mark.parametrize("swa", [False, True], ids=["global", "swa"])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_rotation_is_ggml_rope(name, swa):
    """Queries and keys through Rope (arrange, padded angles, magnitude per pair or folded
    into the scores' scale) give ggml's scores q.k for every pair of positions."""
    spec = SPECS[name]
    hd = spec.head_dim
    ff = (1.0 + torch.rand(spec.n_rot // 2, generator=torch.Generator().manual_seed(3)) * 3
          if spec.kind == "longrope" else None)
    rope = Rope(spec, "cpu", factors_long=ff, factors_short=ff)
    kind = SWA if swa else GLOBAL
    base, fs = spec.layer(swa)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, hd)).astype(f32)
    positions = torch.tensor([0, 1, 7, 30, 95])
    ops = TorchOps()
    angles = rope.angles(ops, positions, 64, (kind,))[kind]
    tq = rope.arrange(torch.from_numpy(q)[None].repeat(len(positions), 1))[:, None]
    tk = rope.arrange(torch.from_numpy(k)[None].repeat(len(positions), 1))[:, None]
    rq = ops.rotate(tq.transpose(0, 1), angles, neox=spec.neox)[0]  # (T, hd)
    rk = ops.rotate(tk.transpose(0, 1), angles, neox=spec.neox)[0]
    ours = (rq @ rk.T).double() * rope.score_scale(kind)
    kw = {"n_dims": spec.n_rot, "mode_neox": spec.neox, "base": base, "freq_scale": fs,
              "ext_factor": spec.ext_factor, "attn_factor": llama_cpp_attn_factor(spec),
              "n_ctx_orig": spec.orig_context, "beta_fast": spec.beta_fast,
              "beta_slow": spec.beta_slow, "ff": None if ff is None else ff.numpy()}
    gq = np.stack([ggml_rope(q, int(p), **kw) for p in positions])
    gk = np.stack([ggml_rope(k, int(p), **kw) for p in positions])
    theirs = torch.from_numpy(gq.astype(np.float64) @ gk.astype(np.float64).T)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_yarn_magnitude_is_llama_cpps():
    """llama.cpp's log for the mistral3 fixture: "setting new yarn_attn_factor = 1.0379
    (mscale == 1.0, mscale_all_dim = 0.7)" (before it cancels its own 1 + 0.1 ln(4))."""
    spec = RopeSpec(head_dim=64, n_rot=64, base=10000.0, neox=False, kind="yarn", factor=4.0,
                    ext_factor=1.0, log_mul=0.7)
    assert spec.magnitude() == pytest.approx(1.0379, abs=1e-4)


def test_llama3_factors_are_the_converters():
    """Llama 3.1's factors (conversion/llama.py's loop, written out) for Llama 3.1-8B's
    parameters."""
    spec = RopeSpec(head_dim=128, n_rot=128, base=500000.0, neox=False, kind="llama3",
                    factor=8.0, orig_context=8192, low_freq_factor=1.0, high_freq_factor=4.0)
    freqs = 1.0 / (500000.0 ** (np.arange(0, 128, 2, dtype=np.float32) / 128))
    want = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            want.append(1.0)
        elif wavelen > 8192 / 1.0:
            want.append(8.0)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            want.append(1 / ((1 - smooth) / 8.0 + smooth))
    np.testing.assert_allclose(spec.llama3_factors().numpy(), want, rtol=1e-5)


def test_read_rope_defaults_and_keys_llama_cpp_ignores():
    """A YaRN file's betas are read only where the family's llama.cpp loader reads them."""
    md = {"general.architecture": "qwen2", "qwen2.rope.scaling.type": "yarn",
          "qwen2.rope.scaling.factor": 4.0, "qwen2.rope.scaling.yarn_beta_fast": 8.0}
    spec = read_rope(HParams(md), head_dim=64, context_length=4096, neox=True)
    assert (spec.kind, spec.beta_fast, spec.orig_context, spec.ext_factor) == ("yarn", 32.0,
                                                                                4096, 1.0)
    spec = read_rope(HParams(md), head_dim=64, context_length=4096, neox=True,
                     yarn_keys=("yarn_beta_fast",))
    assert spec.beta_fast == 8.0
    md = {"general.architecture": "llama", "llama.rope.scale_linear": 2.0}  # the old key
    assert read_rope(HParams(md), head_dim=64, context_length=4096, neox=False).freq_scale == 0.5


def ggml_softplus(x: float) -> float:
    return x if x > 20.0 else math.log(1 + math.exp(x))


def test_xielu_is_ggmls():
    """xIELU with the file's raw parameters as ggml_xielu and op_xielu compute it."""
    an, ap, beta, eps = 0.3, -0.4, 0.5, -1e-6
    x = torch.linspace(-8, 8, 101)
    a_n, a_p = beta + ggml_softplus(an), ggml_softplus(ap)
    want = [a_p * v * v + beta * v if v > 0 else (math.expm1(min(v, eps)) - v) * a_n + beta * v
            for v in x.tolist()]
    torch.testing.assert_close(xielu(x, a_n, a_p, beta, eps), torch.tensor(want),
                               rtol=1e-5, atol=1e-6)


def test_swa_pattern():
    """llama.cpp's load_swa_pattern: a period (default or key) or one boolean per layer."""
    md = {"general.architecture": "gemma3"}
    assert swa_layers(HParams(md), 6, 6) == [True] * 5 + [False]
    assert swa_layers(HParams(md), 4, 2, dense_first=True) == [False, True, False, True]
    md["gemma3.attention.sliding_window_pattern"] = [True, False, False]
    assert swa_layers(HParams(md), 3, 6) == [True, False, False]
    for bad in ([True, False], [2, 0, 1], 1.5, "LLLG"):
        md["gemma3.attention.sliding_window_pattern"] = bad
        with pytest.raises(GGUFError, match="gemma3.attention.sliding_window_pattern"):
            swa_layers(HParams(md), 3, 6)


# ---- the backends' rotation with a magnitude / a norm after it ------------------------------
@pytest.mark.parametrize("case", ["magnitude", "norm-after"])
def test_kernel_ops_attention_matches_torch(case, device):
    """KernelOps.self_attention (one decode token after a prefill) with the angles of a
    partial YaRN RoPE (a per-pair magnitude) or with Hunyuan's QK-norm after the rotation,
    against TorchOps."""
    kernels = pytest.importorskip("localllm.kernels")
    if not kernels.triton_available():
        pytest.skip("Triton is not installed")
    from localllm.backends.triton import KernelOps
    from localllm.memory import KVCache

    hd, nh, nkv = 32, 4, 2
    spec = RopeSpec(head_dim=hd, n_rot=24, base=10000.0, neox=True, kind="yarn", factor=4.0,
                    orig_context=8, ext_factor=1.0)
    rope = Rope(spec, device, norm_after=case == "norm-after")
    g = torch.Generator().manual_seed(5)
    qn, kn = (1 + 0.1 * torch.randn(hd, generator=g)).to(device), \
        (1 + 0.1 * torch.randn(hd, generator=g)).to(device)
    qkv = (torch.randn(6, (nh + 2 * nkv) * hd, generator=g) * 2).to(device)
    outs = []
    for ops in (TorchOps(), KernelOps()):
        cache = KVCache(16, nkv, hd, dtype=torch.float16, device=device)
        for pos, rows in ((0, slice(0, 5)), (5, slice(5, 6))):
            x = qkv[rows]
            q, k, v = x[:, :nh * hd], x[:, nh * hd:(nh + nkv) * hd], x[:, (nh + nkv) * hd:]
            positions = torch.arange(pos, pos + x.shape[0], device=device)
            angles = rope.angles(ops, positions, 16)[GLOBAL]
            out = ops.self_attention(rope.arrange(q), rope.arrange(k), v, qn, kn, 1e-6, angles,
                                     cache, pos, positions, head_dim=hd, neox=True,
                                     scale=hd ** -0.5, norm_after_rope=case == "norm-after")
        outs.append(out.float().cpu())
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-3, atol=2e-3)
