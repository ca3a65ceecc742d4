"""Each architecture on a tiny random model: the cache must not change the math.

Prefill-then-decode, chunked prefill, and rollback (truncate) must all give the logits of
one full forward over the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from localllm.runtime import Session, load_model

ARCHS = ["gemma3", "llama", "mistral", "qwen2", "qwen3"]


def _model(tiny_model_path, arch):
    # 6 gemma3 layers: five sliding-window layers (window 8) and one global layer.
    kw = {"n_layers": 6} if arch == "gemma3" else {}
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


@pytest.mark.parametrize("arch", ["gemma3", "llama"])
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


def test_ring_cache_wraps_many_times(tiny_model_path):
    # 100 tokens through a window of 8 (+ slack): the ring wraps; logits still match.
    m = _model(tiny_model_path, "gemma3")
    ids = _tokens(m.tokenizer.n_vocab, 100, seed=5)
    full = Session(m, ctx_size=128).eval(ids, all_logits=True)[-1]
    s = Session(m, ctx_size=128, batch_size=7)
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


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_quantized_triton_path_matches_torch_path(tiny_model_path, arch):
    """The CUDA path (weights kept in Q8_0 blocks, Triton GEMV/GEMM) run in Triton's
    interpreter on the CPU gives the logits of the dequantize-at-load torch path."""
    pytest.importorskip("triton")
    import gguf

    path = tiny_model_path(arch, qtype=gguf.GGMLQuantizationType.Q8_0, n_layers=2)
    ref = load_model(path, device="cpu", progress=False, dtype=torch.float32, backend="torch")
    quant = load_model(path, device="cpu", progress=False, backend="triton")
    assert quant.backend == "triton" and not quant.fallbacks
    ids = _tokens(ref.tokenizer.n_vocab, 12, seed=6)
    want = Session(ref, ctx_size=32).eval(ids, all_logits=True)  # prefill: GEMM kernel
    s = Session(quant, ctx_size=32)
    got_prefill = s.eval(ids[:10], all_logits=True)
    got_decode = torch.stack([s.eval([t]) for t in ids[10:]])  # decode: GEMV kernel
    scale = want.abs().max()
    # fp16 tiles in the GEMM, float32 accumulation everywhere
    assert (got_prefill - want[:10]).abs().max() / scale < 2e-2
    assert (got_decode - want[10:]).abs().max() / scale < 1e-3
