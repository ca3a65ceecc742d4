"""The memory check before loading (localllm/resources.py)."""

from __future__ import annotations

import pytest
import torch

from localllm.errors import LocalLLMError
from localllm.gguf.file import open_gguf
from localllm.models import architecture
from localllm.runtime import resources
from localllm.runtime import session as runtime
from localllm.runtime.resources import check_memory, estimate_memory, kv_cache_bytes
from localllm.runtime.session import Session, load_model
from localllm.tokenizer import Tokenizer

CPU = torch.device("cpu")


def _args(path):
    gguf = open_gguf(path)
    arch = architecture(gguf.architecture)
    return gguf, arch.ModelArgs.from_gguf(gguf.metadata, Tokenizer(gguf.metadata).n_vocab)


def test_tiny_gemma3_estimate_matches_hand_count(tiny_model_path):
    # tiny_model.py: 287 tokens, 2 layers, d 64, 4 heads / 2 KV heads of 16, ffn 128, window 8
    gguf, args = _args(tiny_model_path("gemma3"))
    matrices = 287 * 64 + 2 * (64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 128 * 64)
    vectors = 64 + 2 * (4 * 64 + 2 * 16)
    est = estimate_memory(gguf, args, 100, CPU)
    assert est.weights == 2 * matrices + 4 * vectors == 186752
    # both layers slide (window 8 < 100): 8 + 256 cells of K and V, 2 heads x 16 x 4 bytes
    assert est.kv_cache == 2 * (8 + runtime.RING_SLACK) * 2 * 2 * 16 * 4
    # runtime: the mapped F16 matrices and F32 vectors, 287 tokens, the decode workspace
    assert est.runtime == matrices * 2 + vectors * 4 + 287 * resources.VOCAB_TOKEN_BYTES + (
        resources.CPU_WORKSPACE)
    assert est.total == est.weights + est.kv_cache + est.runtime
    cuda = estimate_memory(gguf, args, 100, torch.device("cuda"))
    assert cuda.weights == sum(t.n_bytes for t in gguf.tensors.values()) + resources.CUDA_WORKSPACE
    torch_cuda = estimate_memory(gguf, args, 100, torch.device("cuda"), quantized=False)
    assert torch_cuda.weights == est.weights + resources.CUDA_WORKSPACE
    assert cuda.kv_cache == est.kv_cache // 2  # float16 cache on CUDA


def test_kv_estimate_caps_at_context_length_without_window(tiny_model_path):
    _, args = _args(tiny_model_path("llama"))
    per_token = 2 * 2 * 16 * 4 * 2  # K+V, 2 KV heads, head_dim 16, float32, 2 layers
    assert kv_cache_bytes(args, 100) == 100 * per_token
    assert kv_cache_bytes(args, 100_000) == 256 * per_token  # context_length 256


@pytest.mark.parametrize("arch, ctx", [("gemma3", 4), ("gemma3", 100), ("llama", 50)])
def test_estimate_equals_what_a_session_allocates(tiny_model_path, arch, ctx):
    path = tiny_model_path(arch)
    loaded = load_model(path, device="cpu", progress=False)
    session = Session(loaded, ctx_size=ctx)
    allocated = sum(c.k.nbytes + c.v.nbytes for c in session.memory)
    assert kv_cache_bytes(loaded.args, ctx, half=loaded.kv_dtype == torch.float16) == allocated
    weights = _tensor_bytes(loaded.model)
    assert estimate_memory(loaded.gguf, loaded.args, ctx, CPU).weights == weights


def _tensor_bytes(obj) -> int:
    """Bytes of the distinct parameter tensors reachable from a model object (float, or
    uint8 ggml blocks on the native CPU backend)."""
    seen: dict[int, int] = {}

    def walk(x, depth=0):
        if isinstance(x, torch.Tensor):
            # RoPE tables are derived, not loaded
            if x.dtype.is_floating_point or x.dtype == torch.uint8:
                seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
        elif isinstance(x, (list, tuple)):
            for y in x:
                walk(y, depth)
        elif hasattr(x, "__dict__") and depth < 6:
            for k, y in vars(x).items():
                if k not in ("args", "inv_freq", "inv_freq_global", "inv_freq_local",
                             "inv_freq_long", "inv_freq_short"):
                    walk(y, depth + 1)

    walk(obj)
    return sum(seen.values())


def test_refusal_names_both_sizes_and_loads_nothing(tiny_model_path, monkeypatch):
    path = tiny_model_path("gemma3")
    monkeypatch.delenv(resources.SKIP_ENV, raising=False)
    monkeypatch.setattr(resources, "free_memory", lambda device: 100 * 1024)
    built = []
    monkeypatch.setattr(runtime, "bind", lambda *a, **k: built.append(a))
    with pytest.raises(LocalLLMError) as err:  # the torch path: weights as float16 copies
        load_model(path, device="cpu", ctx_size=4096, progress=False, backend="torch")
    msg = str(err.value)
    assert "\n" not in msg and not built
    # ctx 4096 is capped at the model's 256; both layers hold 8 + 256 ring cells
    assert ("model needs 64.6 MiB (weights 0.2 MiB + runtime 64.3 MiB + KV cache 0.1 MiB at "
            "--ctx-size 256)") in msg
    assert "only 0.1 MiB is free on cpu" in msg


def test_refusal_through_llm_and_the_override(tiny_model_path, monkeypatch):
    from localllm import LLM

    path = tiny_model_path("llama")
    monkeypatch.setattr(resources, "free_memory", lambda device: 1000)
    monkeypatch.delenv(resources.SKIP_ENV, raising=False)
    with pytest.raises(LocalLLMError, match=r"KV cache .* at --ctx-size 64\) but only"):
        LLM(str(path), device="cpu", ctx_size=64)
    monkeypatch.setenv(resources.SKIP_ENV, "1")
    assert LLM(str(path), device="cpu", ctx_size=64).logits([1, 2]).isfinite().all()


def test_unknown_free_memory_skips_the_check(tiny_model_path, monkeypatch):
    gguf, args = _args(tiny_model_path("gemma3"))
    monkeypatch.delenv(resources.SKIP_ENV, raising=False)
    monkeypatch.setattr(resources, "free_memory", lambda device: None)
    assert check_memory(gguf, args, 64, CPU).total > 0


def test_free_memory_on_this_machine():
    free = resources.free_memory(CPU)
    assert free is None or free > 0


@pytest.mark.parametrize("arch", ["qwen3moe", "gemma2", "phi3", "olmo2"])
def test_estimate_equals_allocation_for_other_families(tiny_model_path, arch):
    # The estimate and the caches both follow the declaration (cache_layout, tensor list):
    # MoE experts and routers, alternating sliding windows, fused file tensors.
    kw = {"extra": (("expert_count", 4), ("expert_used_count", 2),
                    ("expert_feed_forward_length", 32))} if arch == "qwen3moe" else {}
    loaded = load_model(tiny_model_path(arch, **kw), device="cpu", progress=False)
    session = Session(loaded, ctx_size=100)
    allocated = sum(c.k.nbytes + c.v.nbytes for c in session.memory)
    assert kv_cache_bytes(loaded.args, 100, half=loaded.kv_dtype == torch.float16) == allocated
    assert estimate_memory(loaded.gguf, loaded.args, 100, CPU).weights == _tensor_bytes(loaded.model)
