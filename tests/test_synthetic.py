"""Synthetic random-weights GGUF files (localllm/synthetic.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from localllm.errors import ParameterError
from localllm.gguf.file import open_gguf
from localllm.gguf.quants import dequantize
from localllm.models import synthetic
from localllm.models.geometries import GEOMETRIES
from localllm.models.synthetic import synthetic_model, tensor_types
from localllm.runtime.session import Session, load_model

# Small models with the real families' layouts and vocabulary kinds (fast to write and load).
TINY = {
    "tiny-llama": dataclasses.replace(
        GEOMETRIES["llama3-8b"], name="tiny-llama", n_vocab=1024, n_layers=2, d_model=256,
        n_heads=4, n_kv_heads=2, head_dim=64, ffn_dim=512, context_length=256),
    "tiny-qwen2": dataclasses.replace(
        GEOMETRIES["qwen2-7b"], name="tiny-qwen2", n_vocab=700, n_layers=2, d_model=128,
        n_heads=4, n_kv_heads=2, head_dim=32, ffn_dim=256, context_length=256, n_pad_tokens=5),
    "tiny-gemma3": dataclasses.replace(
        GEOMETRIES["gemma3-270m"], name="tiny-gemma3", n_vocab=600, n_layers=6, d_model=128,
        n_heads=2, n_kv_heads=1, head_dim=64, ffn_dim=256, context_length=256,
        sliding_window=8),
}


@pytest.fixture
def tiny(monkeypatch, tmp_path):
    """synthetic_model for the TINY geometries, cached under tmp_path."""
    for name, g in TINY.items():
        monkeypatch.setitem(GEOMETRIES, name, g)
    return lambda name, quant="Q4_K_M": synthetic_model(name, quant, cache_dir=tmp_path)


def test_llama3_8b_q4_k_m_has_llama_cpp_type_counts():
    # llama-quantize on Meta-Llama-3-8B with Q4_K_M reports 65 f32, 193 q4_K, 33 q6_K tensors.
    counts = Counter(t.name for t in tensor_types(GEOMETRIES["llama3-8b"], "Q4_K_M").values())
    assert counts == {"F32": 65, "Q4_K": 193, "Q6_K": 33}


def test_q8_0_recipe_is_q8_0_everywhere():
    types = tensor_types(GEOMETRIES["qwen2-7b"], "Q8_0")
    assert {t for n, t in types.items() if n.endswith("weight") and "norm" not in n} == {Q.Q8_0}


def test_gemma3_270m_geometry_and_types_match_the_real_file():
    from localllm.registry import load_registry

    real = open_gguf(load_registry().resolve("gemma3-270m")[0])
    types = tensor_types(GEOMETRIES["gemma3-270m"], "Q4_K_M")
    shapes = dict(synthetic.tensor_shapes(GEOMETRIES["gemma3-270m"]))
    assert {n: (t.qtype, t.shape) for n, t in real.tensors.items()} == {
        n: (types[n], shapes[n]) for n in shapes}
    assert len(real.metadata["tokenizer.ggml.tokens"]) == GEOMETRIES["gemma3-270m"].n_vocab


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K,
                                   Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.F16, Q.F32])
def test_random_blocks_dequantize_to_realistic_weights(qtype):
    raw = synthetic.random_tensor("blk.0.ffn_up.weight", (64, 512), qtype,
                                  np.random.default_rng(3))
    x = dequantize(raw, qtype, (64, 512), dtype=torch.float32)
    assert torch.isfinite(x).all()
    assert abs(float(x.std()) - synthetic.WEIGHT_STD) < 0.15 * synthetic.WEIGHT_STD
    assert abs(float(x.mean())) < 0.15 * synthetic.WEIGHT_STD


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_synthetic_loads_and_gives_finite_logits(tiny, name):
    path = tiny(name)
    g = TINY[name]
    gf = open_gguf(path)
    assert len(gf.metadata["tokenizer.ggml.tokens"]) == g.n_vocab
    assert gf.metadata["tokenizer.ggml.model"] == g.vocab
    loaded = load_model(path, device="cpu", progress=False)
    assert loaded.args.n_layers == g.n_layers and loaded.args.n_vocab == g.n_vocab
    ids = loaded.tokenizer.encode("hello world")
    assert loaded.tokenizer.decode(ids) == "hello world"
    logits = Session(loaded, ctx_size=32).eval(ids)
    assert logits.shape == (g.n_vocab,) and torch.isfinite(logits).all()


def test_file_is_reused_and_written_atomically(tiny, tmp_path, monkeypatch):
    path = tiny("tiny-qwen2", "Q8_0")
    stamp = path.stat().st_mtime_ns
    assert tiny("tiny-qwen2", "q8_0") == path and path.stat().st_mtime_ns == stamp

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(synthetic, "random_tensor", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tiny("tiny-llama", "Q4_0")
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_unknown_geometry_or_quant_is_a_parameter_error(tmp_path):
    with pytest.raises(ParameterError, match="--synthetic llama9"):
        synthetic_model("llama9", "Q4_K_M", cache_dir=tmp_path)
    with pytest.raises(ParameterError, match="--quant Q9_K"):
        synthetic_model("gemma3-270m", "Q9_K", cache_dir=tmp_path)
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def gemma3_270m_file(tmp_path_factory):
    return synthetic_model("gemma3-270m", "Q4_K_M", cache_dir=tmp_path_factory.mktemp("syn"))


@pytest.mark.slow
def test_gemma3_270m_synthetic_loads(gemma3_270m_file):
    loaded = load_model(gemma3_270m_file, device="cpu", progress=False)
    logits = Session(loaded, ctx_size=64).eval([2, 100, 200, 300])
    assert torch.isfinite(logits).all() and float(logits.std()) > 0


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_every_geometry_follows_its_declaration(name):
    """Each real geometry (bench --synthetic) has metadata that validates, the tensors of its
    architecture's declaration and a type for every tensor under Q4_K_M; the parameter count
    is that of the real model within a few percent where the geometry says so."""
    from localllm.models import model_args, tensor_specs

    g = GEOMETRIES[name]
    args = model_args(synthetic._hparams(g), g.n_vocab)
    shapes = dict(synthetic.tensor_shapes(g))
    required = {s.name for s in tensor_specs(args)  # an alternative written: not needed
                if not s.optional and (s.unless is None or s.unless not in shapes)}
    assert required <= set(shapes)
    assert set(tensor_types(g, "Q4_K_M")) == set(shapes)
    n_params = sum(int(np.prod(s)) for s in shapes.values())
    billions = {"llama3-8b": 8.0, "qwen3-30b-a3b": 30.5, "gemma2-9b": 9.2, "phi3-mini": 3.8,
                "qwen2.5-7b": 7.6, "llama3.2-1b": 1.24, "qwen3-0.6b": 0.6, "mistral-7b": 7.2,
                "qwen2.5-0.5b": 0.49, "gemma3-1b": 1.0, "olmo2-1b": 1.48, "gemma4-26b-a4b": 25.2}
    if name in billions:
        assert abs(n_params / 1e9 / billions[name] - 1) < 0.05, n_params


@pytest.mark.parametrize("name", sorted(GEOMETRIES))
def test_every_geometry_has_a_memory_estimate(name):
    """``bench --synthetic``'s check before writing sizes each geometry's memories from the
    architecture's own args (a hybrid's recurrent state included): no geometry fails it, and
    a hybrid's estimate holds its fixed states."""
    import torch

    from localllm.eval.bench import check_synthetic_memory
    from localllm.memory import RecurrentSpec
    from localllm.models import memory_layout
    from localllm.models.synthetic import geometry_args
    from localllm.runtime.resources import kv_cache_bytes

    g = GEOMETRIES[name]
    check_synthetic_memory(g, [], torch.device("cpu"), 512)
    args = geometry_args(g)
    states = [s for s in memory_layout(args) if isinstance(s, RecurrentSpec)]
    if states:
        assert kv_cache_bytes(args, 512) >= sum(s.nbytes(512, 4) for s in states) > 0
