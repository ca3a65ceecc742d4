"""Each architecture on a tiny random model: the cache must not change the math.

Prefill-then-decode, chunked prefill, and rollback (truncate) must all give the logits of
one full forward over the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from localllm.runtime import session as runtime
from localllm.runtime.session import Session, load_model

ARCHS = ["gemma3", "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "granite", "olmo2",
         "phi3", "qwen3moe"]
MOE = (("expert_count", 4), ("expert_used_count", 2), ("expert_feed_forward_length", 32))


def _model(tiny_model_path, arch):
    # 6 gemma3 layers: five sliding-window layers (window 8) and one global layer; gemma2's
    # layers alternate.
    kw = {"n_layers": 6} if arch == "gemma3" else {}
    if arch == "qwen3moe":
        kw["extra"] = MOE
    # float32 weights: decode (GEMV) and prefill (GEMM) then share one precision.
    return load_model(tiny_model_path(arch, **kw), device="cpu", progress=False, dtype=torch.float32)


def _tokens(n_vocab: int, n: int, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, n_vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_then_decode_equals_full_forward(tiny_model_path, arch):
    m = _model(tiny_model_path, arch)
    ids = _tokens(m.tokenizer.n_vocab, 30)
    full = Session(m, ctx_size=64).eval(ids, all_logits=True)  # (30, n_vocab)
    s = Session(m, ctx_size=64)
    got = [s.eval(ids[:12])]
    got += [s.eval([t]) for t in ids[12:]]
    torch.testing.assert_close(torch.stack(got), full[11:], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("arch", ["gemma3", "llama", "gemma2", "qwen3moe"])
def test_chunked_prefill_equals_one_batch(tiny_model_path, arch):
    m = _model(tiny_model_path, arch)
    ids = _tokens(m.tokenizer.n_vocab, 29, seed=2)
    one = Session(m, ctx_size=64, batch_size=512).eval(ids, all_logits=True)
    chunked = Session(m, ctx_size=64, batch_size=5).eval(ids, all_logits=True)
    torch.testing.assert_close(chunked, one, rtol=1e-4, atol=1e-4)


def test_truncate_then_continue_equals_fresh(tiny_model_path):
    m = _model(tiny_model_path, "gemma3")
    ids = _tokens(m.tokenizer.n_vocab, 40, seed=3)
    alt = _tokens(m.tokenizer.n_vocab, 10, seed=4)
    s = Session(m, ctx_size=64)
    s.eval(ids)
    s.truncate(25)  # within the ring's slack: no recomputation
    assert s.tokens == ids[:25]
    got = s.eval(alt)
    want = Session(m, ctx_size=64).eval(ids[:25] + alt)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_ring_cache_wraps_many_times(tiny_model_path, monkeypatch):
    # 100 tokens through a window of 8 (+ 4 of slack): the ring wraps; logits still match.
    monkeypatch.setattr(runtime, "RING_SLACK", 4)
    m = _model(tiny_model_path, "gemma3")
    ids = _tokens(m.tokenizer.n_vocab, 100, seed=5)
    full = Session(m, ctx_size=128).eval(ids, all_logits=True)[-1]
    s = Session(m, ctx_size=128, batch_size=7)
    assert s.memory[0].size == 12
    s.eval(ids[:50])
    for t in ids[50:-1]:
        s.eval([t])
    torch.testing.assert_close(s.eval(ids[-1:]), full, rtol=1e-4, atol=1e-4)


def test_context_overflow_is_a_user_error(tiny_model_path):
    from localllm.errors import ContextOverflowError

    m = _model(tiny_model_path, "llama")
    s = Session(m, ctx_size=16)
    with pytest.raises(ContextOverflowError, match="do not fit"):
        s.eval(list(range(4, 21)))
    assert s.tokens == []


@pytest.mark.parametrize("arch", ["gemma3", "qwen2", "qwen3moe", "phi3", "olmo2", "gemma2"])
def test_quantized_triton_path_matches_torch_path(tiny_model_path, arch):
    """The CUDA path (weights kept in Q8_0 blocks, Triton GEMV/GEMM) run in Triton's
    interpreter on the CPU gives the logits of the dequantize-at-load torch path."""
    pytest.importorskip("triton")
    import gguf

    kw = {"extra": MOE} if arch == "qwen3moe" else {}
    path = tiny_model_path(arch, qtype=gguf.GGMLQuantizationType.Q8_0, n_layers=2, **kw)
    ref = load_model(path, device="cpu", progress=False, dtype=torch.float32, backend="torch")
    quant = load_model(path, device="cpu", progress=False, backend="triton")
    assert quant.backend == "triton" and not quant.fallbacks
    ids = _tokens(ref.tokenizer.n_vocab, 12, seed=6)
    want = Session(ref, ctx_size=32).eval(ids, all_logits=True)  # prefill: GEMM kernel
    scale = want.abs().max()
    for static in (False, True):  # static: the step CUDA graphs capture, position in a tensor
        s = Session(quant, ctx_size=32, static_decode=static)
        got_prefill = s.eval(ids[:10], all_logits=True)
        # decode: GEMV, RMSNorm, RoPE and flash-decoding attention kernels
        got_decode = torch.stack([s.eval([t]) for t in ids[10:]])
        # fp16 tiles in the GEMM; the decode GEMV multiplies activations quantized to 8 bits
        # per 32 values (as llama.cpp's CUDA mul_mat_vec_q); float32 accumulation everywhere
        assert (got_prefill - want[:10]).abs().max() / scale < 2e-2
        assert (got_decode - want[10:]).abs().max() / scale < 3e-2


# ---- static decode (the step CUDA graphs capture) -----------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_static_decode_equals_dynamic(tiny_model_path, arch, monkeypatch):
    """One-token steps with the position in a device tensor (full-buffer writes and masks)
    give the logits of the ordinary decode, across ring wrap-around and a rollback."""
    monkeypatch.setattr(runtime, "RING_SLACK", 8)  # rings of 16 cells: they wrap
    m = _model(tiny_model_path, arch)
    ids = _tokens(m.tokenizer.n_vocab, 60, seed=7)
    alt = _tokens(m.tokenizer.n_vocab, 8, seed=8)
    dyn = Session(m, ctx_size=64, static_decode=False)
    sta = Session(m, ctx_size=64, static_decode=True)
    assert sta.decoder is not None and not sta.decoder.capture  # CPU: eager, no capture
    for s in (dyn, sta):
        s.eval(ids[:5])
    # Full-buffer vs sliced attention sum in different orders: float32 noise reaches ~2e-5.
    for t in ids[5:50]:
        torch.testing.assert_close(sta.eval([t]), dyn.eval([t]), rtol=1e-4, atol=1e-4)
    assert sta.tokens == dyn.tokens and all(c.seq_len == 50 for c in sta.memory)
    for s in (dyn, sta):
        s.truncate(44)  # inside the ring's slack: positions 44.. are forgotten in place
        assert s.n_past == 44
    for t in alt:
        torch.testing.assert_close(sta.eval([t]), dyn.eval([t]), rtol=1e-4, atol=1e-4)
    fresh = Session(m, ctx_size=64).eval(ids[:44] + alt + ids[50:51])
    torch.testing.assert_close(sta.eval(ids[50:51]), fresh, rtol=1e-4, atol=1e-4)


def _op_trace(fn) -> list[tuple[str, tuple]]:
    """The aten ops ``fn`` dispatches, with their output shapes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[tuple[str, tuple]] = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            shapes = tuple(tuple(o.shape) for o in (out if isinstance(out, (tuple, list))
                                                     else [out]) if isinstance(o, torch.Tensor))
            ops.append((str(func.overloadpacket.__name__), shapes))
            return out

    with Record():
        fn()
    return ops


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
def test_static_decode_step_is_capturable(tiny_model_path, arch, monkeypatch):
    """What a CUDA graph needs, checked on the CPU: the step reads nothing back to the host
    (no .item(), no boolean indexing) and dispatches the same ops with the same shapes at
    every position, before and after the ring cache wraps."""
    monkeypatch.setattr(runtime, "RING_SLACK", 4)  # gemma3's rings: 12 cells
    m = _model(tiny_model_path, arch)
    ids = _tokens(m.tokenizer.n_vocab, 40, seed=9)
    s = Session(m, ctx_size=48, static_decode=True)
    s.eval(ids[:3])
    first = _op_trace(lambda: s.decoder.step(ids[3], 3))
    for c in s.memory:
        c.set_length(4)
    s.tokens.append(ids[3])
    for t in ids[4:30]:
        s.eval([t])
    later = _op_trace(lambda: s.decoder.step(ids[30], 30))  # window 8 + slack: wrapped
    names = {name for name, _ in first}
    assert not names & {"_local_scalar_dense", "item", "nonzero", "masked_select", "tolist"}
    assert first == later
    assert len(first) > 20  # the trace saw the model's ops
