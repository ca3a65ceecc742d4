"""Kernels per layer of a decode token on the Triton backend, and that path's results.

The decode step that CUDA graphs capture (``DecodeGraph.step``) runs here on the CPU through
Triton's interpreter, on tiny Q8_0 models; :class:`kernel_checks.LaunchCounter` counts what a
GPU would launch: each Triton kernel and each aten op that computes (views and allocations
are free). Per layer, 9 (issue #19's target; 12 before the attention output's quantization
and the split-K sums moved into their kernels):

- 4 x ``mmvq``: the QKV, output, gate/up and down GEMVs on 8-bit activations (llama.cpp's
  ``mul_mat_vec_q``), each input quantized by the kernel that produced it (the residual+norm
  kernels, the gated activation, attention); a split key axis (``mmvq_config``: on
  Llama-3-8B the QKV, output and down GEMVs, on Gemma-3-270M all four) is summed by the
  program that finishes its rows last, not by an ``aten.sum``;
- ``norm_rope_kv``: QK-norm, RoPE of q and k, the k/v cache write (ring position too);
- ``decode_attention``: the splits merged inside the launch, the output written with its
  8-bit copy for the output GEMV;
- 2 x ``residual_rms_norm``, 1 ``gated_act``.
"""

from __future__ import annotations

import gguf
import pytest
import torch
from kernel_checks import LaunchCounter

from localllm.runtime import session as runtime
from localllm.runtime.session import Session, load_model

kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

# The bound the count test holds (see the module docstring): issue #19's target, reached.
MAX_KERNELS_PER_LAYER = 9

Q8 = gguf.GGMLQuantizationType.Q8_0


def _quantized(tiny_model_path, arch: str, n_layers: int):
    path = tiny_model_path(arch, qtype=Q8, n_layers=n_layers)
    m = load_model(path, device="cpu", progress=False, backend="triton")
    assert m.backend == "triton" and not m.fallbacks
    return m


def _step_launches(model, pos: int = 20) -> LaunchCounter:
    """Launches of one static decode step at ``pos`` (kernels counted, not run: the counts
    depend on shapes only)."""
    s = Session(model, ctx_size=64, static_decode=True)
    _warm(s, pos)
    with LaunchCounter(run=False) as counter:
        s.decoder.step(20, pos)
    return counter


def _warm(s: Session, pos: int) -> None:
    """A step outside the count: the first split launch on a device allocates the ticket
    counters its programs share (``kernels._sync``), once per process (CUDA graphs capture
    after such a warm-up step)."""
    with LaunchCounter(run=False):
        s.decoder.step(20, pos)


def _check_layer(launches, where: str) -> None:
    total = sum(launches.values())
    assert total <= MAX_KERNELS_PER_LAYER, (where, total, dict(launches))
    # One launch each for the QKV epilogue and attention, and no cache-write kernels.
    assert launches["norm_rope_kv_kernel"] == 1, (where, dict(launches))
    assert launches["decode_attention_kernel"] == 1, (where, dict(launches))
    # No torch kernels (split-K sums included) and no separate activation quantization.
    others = {k for k, v in launches.items() if v and k.startswith("aten.")}
    assert not others, (where, others)
    assert not launches["quantize_q8_kernel"], (where, dict(launches))


def test_llama_kernels_per_layer(tiny_model_path):
    """The second layer's launches: a two-layer step minus a one-layer step."""
    one = _step_launches(_quantized(tiny_model_path, "llama", 1)).launches
    two = _step_launches(_quantized(tiny_model_path, "llama", 2)).launches
    per_layer = two.copy()
    per_layer.subtract(one)
    _check_layer(+per_layer, "llama")
    assert sum(per_layer.values()) == MAX_KERNELS_PER_LAYER  # reached, not only bounded


def test_gemma3_kernels_per_layer(tiny_model_path, monkeypatch):
    """Each of 6 layers (5 sliding-window layers on rings, 1 global), counted inside its
    block."""
    monkeypatch.setattr(runtime, "RING_SLACK", 4)  # rings of 12 cells
    model = _quantized(tiny_model_path, "gemma3", 6)
    counter = LaunchCounter(run=False)
    per_layer = []
    block = model.model.block

    def counted_block(*args, **kwargs):
        before = counter.launches.copy()
        out = block(*args, **kwargs)
        after = counter.launches.copy()
        after.subtract(before)
        per_layer.append(+after)
        return out

    s = Session(model, ctx_size=64, static_decode=True)
    _warm(s, 20)
    monkeypatch.setattr(model.model, "block", counted_block)
    with counter:
        s.decoder.step(40, 20)
    assert len(per_layer) == 6
    # Layer 0's input is the embedding's pre-norm (a plain rms_norm before the first block),
    # so its QKV GEMV quantizes that input itself: one launch more than the other layers.
    assert per_layer[0]["quantize_q8_kernel"] == per_layer[1]["quantize_q8_kernel"] + 1
    per_layer[0]["quantize_q8_kernel"] -= 1
    for i, launches in enumerate(per_layer):
        _check_layer(launches, f"gemma3 layer {i}")
        assert sum(launches.values()) == MAX_KERNELS_PER_LAYER  # reached, not only bounded
    assert counter.launches["decode_attention_kernel"] == 6


def test_counter_counts_torch_kernels_and_skips_views():
    """The counter can fail: computing aten ops count, views and allocations do not."""
    x = torch.randn(4, 8)
    with LaunchCounter() as counter:
        y = x.reshape(8, 4).transpose(0, 1)[1:]  # views
        torch.empty(3)
        z = y + 1
        z.index_copy_(0, torch.tensor([0]), z[:1])
    assert dict(+counter.launches) == {"aten.add": 1, "aten.index_copy_": 1}


@pytest.mark.parametrize(("arch", "kv"), [("gemma3", torch.float32), ("llama", torch.float32),
                                          ("gemma2", torch.float16),
                                          ("gpt-oss", torch.float16)])
def test_kernel_ops_match_torch_ops_across_ring_wrap(tiny_model_path, monkeypatch, arch, kv,
                                                     device):
    """Decode on the Triton ops (the fused QKV epilogue, tensor-core attention, fused norms)
    against the torch ops (``rms_norm``, ``rotate``, the caches' ``update``, ``attend``) on
    the same float32 weights, token by token, in the static step (what CUDA graphs capture)
    and eagerly, while gemma's rings (12 cells, window 8) wrap; gemma2 adds soft-capping and
    float16 caches (CUDA's KV type); gpt-oss its attention sinks (in the decode kernel)."""
    from localllm.backends.dense import TorchOps
    from localllm.backends.triton import KernelOps
    monkeypatch.setattr(runtime, "RING_SLACK", 4)
    extra = (("gpt-oss.expert_count", 4), ("gpt-oss.expert_used_count", 2),
             ("gpt-oss.expert_feed_forward_length", 64)) if arch == "gpt-oss" else None
    path = tiny_model_path(arch, n_layers=2, extra=extra)
    ref = load_model(path, device=device.type, progress=False, dtype=torch.float32,
                     backend="torch")
    ref.kv_dtype = kv  # the sessions' caches
    ref.model.ops = TorchOps()
    ids = [(7 * i + 3) % (ref.tokenizer.n_vocab - 4) + 4 for i in range(20)]
    s = Session(ref, ctx_size=64)
    s.eval(ids[:3])
    want = torch.stack([s.eval([t]) for t in ids[3:]])
    ref.model.ops = KernelOps()
    tol = 1e-4 if kv == torch.float32 else 3e-3  # float16: q and the weights P rounded
    for static in (True, False):
        s = Session(ref, ctx_size=64, static_decode=static)
        s.eval(ids[:3])
        got = torch.stack([s.eval([t]) for t in ids[3:]])
        assert ((got - want).abs().max() / want.abs().max()) < tol, static


@pytest.mark.cuda
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_kernels_per_layer_on_cuda(tiny_model_path, arch, device):
    """The same count on a GPU, kernels run (what the CUDA graph captures)."""
    if device.type != "cuda":
        pytest.skip("needs a GPU")
    counts = []
    for n_layers in (1, 2):
        path = tiny_model_path(arch, qtype=Q8, n_layers=n_layers)
        m = load_model(path, device="cuda", progress=False, backend="triton")
        s = Session(m, ctx_size=64, static_decode=False)
        s.eval([10, 11, 12])
        s.eval([13])  # compiles the decode kernels outside the count
        with LaunchCounter() as counter:
            s.eval([14])
        counts.append(counter.launches)
    per_layer = counts[1].copy()
    per_layer.subtract(counts[0])
    _check_layer(+per_layer, f"{arch} on CUDA")
