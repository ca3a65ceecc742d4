"""Quantized KV caches (llama.cpp's -ctk / -ctv): the types, their blocks against gguf-py's
quantizers, the byte counts, the native decode attention against the torch reference, rings
and prefix reuse, the prompt-cache file, and the flags' errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

from localllm.errors import LocalLLMError, ParameterError, UnsupportedError
from localllm.memory import CACHE_TYPES, BlockRows, KVCache, KVSpec, RingKVCache, cache_type

BLOCK_TYPES = [n for n, c in CACHE_TYPES.items() if c.quantized]
NATIVE_TYPES = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]


# ---- the types -----------------------------------------------------------------------------
def test_cache_type_takes_llama_cpp_names_and_ggml_ids():
    assert cache_type("q8_0").name == "q8_0"
    assert cache_type(" Q4_0 ").name == "q4_0"
    assert cache_type(8).name == "q8_0"  # llama-cpp-python's type_k=GGML_TYPE_Q8_0
    assert cache_type(2).name == "q4_0"
    assert cache_type(1).name == "f16"
    assert cache_type(None) is None
    assert list(CACHE_TYPES) == ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl",
                                 "q5_0", "q5_1"]


@pytest.mark.parametrize("bad", ["q3_k", "", "q8", 99, -1, True, 1.5, "f16 "[:0]])
def test_cache_type_refuses_anything_else_in_one_line(bad):
    with pytest.raises(ParameterError) as e:
        cache_type(bad, "--cache-type-k")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--cache-type-k: unsupported cache type")
    assert "q8_0" in msg and "iq4_nl" in msg


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_blocks_are_gguf_py_quantizers_bytes(name):
    """The cells' bytes are those of gguf-py's quantizer (ggml's reference rounding), and they
    decode to gguf-py's dequantization: the oracle is not our own code."""
    import gguf.quants as gq

    t = CACHE_TYPES[name]
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1)) * 3
    x[0, 0, :32] = 0.0  # an all-zero block (d = 0)
    blocks = t.encode(x)
    assert blocks.dtype == torch.uint8 and blocks.shape == (3, 5, t.row_bytes(64))
    ref = gq.quantize(x.reshape(-1, 64).numpy(), t.ggml)
    assert np.array_equal(blocks.reshape(15, -1).numpy(), ref)
    back = t.decode(blocks, 64).reshape(15, 64).numpy()
    assert np.array_equal(back, gq.dequantize(ref, t.ggml))


def test_iq4_nl_blocks_decode_as_gguf_py():
    import gguf.quants as gq

    t = CACHE_TYPES["iq4_nl"]
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(2))
    blocks = t.encode(x)
    back = t.decode(blocks, 64).numpy()
    assert np.array_equal(back, gq.dequantize(blocks.numpy(), t.ggml))
    assert float(np.abs(back - x.numpy()).max()) < 0.35 * float(x.abs().max())


def test_byte_counts_follow_the_block_sizes():
    spec = KVSpec(n_kv_heads=2, head_dim=64)
    f16 = spec.nbytes(1000, 2)
    q8 = spec.nbytes(1000, 2, types=(CACHE_TYPES["q8_0"], CACHE_TYPES["q8_0"]))
    q4 = spec.nbytes(1000, 2, types=(CACHE_TYPES["q4_0"], CACHE_TYPES["q4_0"]))
    mixed = spec.nbytes(1000, 2, types=(CACHE_TYPES["q8_0"], CACHE_TYPES["f16"]))
    assert q8 == f16 * 34 // 64 and q4 == f16 * 18 // 64  # ggml_row_size
    assert mixed == (f16 + q8) // 2
    assert spec.step_bytes(9, 2, types=(CACHE_TYPES["q8_0"],) * 2) == 10 * q8 // 1000
    cache = KVCache(1000, 2, 64, dtype=torch.float32, device="cpu",
                    type_k=CACHE_TYPES["q8_0"], type_v=CACHE_TYPES["q8_0"])
    assert cache.nbytes == q8


def test_a_head_size_that_is_not_whole_blocks_is_refused():
    with pytest.raises(UnsupportedError, match="head size 48 is not a multiple"):
        KVCache(8, 1, 48, dtype=torch.float32, device="cpu", type_k=CACHE_TYPES["q8_0"])


# ---- attention over the blocks ----------------------------------------------------------------
def _filled(cache, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    nkv, hd = cache.k.shape[0], cache.dim_k
    cache.update(0, torch.randn(nkv, n, hd, generator=g), torch.randn(nkv, n, hd, generator=g))


def test_torch_attention_reads_the_blocks_a_few_heads_at_a_time(monkeypatch):
    """attend over BlockRows = attend over the dequantized cache, also when the blocks of
    heads are bounded (one head per block here)."""
    from localllm.backends import dense

    t = CACHE_TYPES["q8_0"]
    cache = KVCache(64, 4, 32, dtype=torch.float32, device="cpu", type_k=t, type_v=t)
    _filled(cache, 40, 0)
    keys, values, _ = cache.view(cache.k[:, :40], cache.v[:, :40]) + (None,)
    assert isinstance(keys, BlockRows) and keys.shape == (4, 40, 32)
    q = torch.randn(8, 3, 32)
    pos = torch.arange(37, 40)
    dense_out = dense.attend(q, keys.float(), values.float(), pos, None, window=None,
                             scale=0.2)
    monkeypatch.setattr(dense, "ATTEND_CHUNK_BYTES", 4 * 40 * 64)  # one head's K and V
    out = dense.attend(q, keys, values, pos, None, window=None, scale=0.2)
    assert torch.equal(out, dense_out)


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("name", NATIVE_TYPES)
def test_native_decode_attention_matches_the_torch_reference(name, ring):
    """localllm_cpu.attn_kvq (quantized write + attention over the blocks) against the torch
    path (CacheType.encode + attend over the dequantized cells): the same bytes in the cells,
    outputs to float32 rounding; GQA, a wrapped ring with its window, soft-capping, 1-3
    tokens."""
    from localllm import cpu
    from localllm.backends.dense import TorchOps
    from localllm.backends.native import NativeOps

    if not cpu.available():
        pytest.skip("no native CPU kernels")
    t = CACHE_TYPES[name]
    nkv, nh, hd = 2, 6, 64
    for n_new in (1, 3):
        def make():
            if ring:
                c = RingKVCache(16, nkv, hd, slack=4, dtype=torch.float32, device="cpu",
                                type_k=t, type_v=t)
                _filled(c, 18, 3)  # 20 cells: wraps on the next tokens with n_new=3
                return c
            c = KVCache(64, nkv, hd, dtype=torch.float32, device="cpu", type_k=t, type_v=t)
            _filled(c, 30, 3)
            return c

        g = torch.Generator().manual_seed(n_new)
        q = torch.randn(n_new, nh * hd, generator=g)
        k = torch.randn(n_new, nkv * hd, generator=g)
        v = torch.randn(n_new, nkv * hd, generator=g)
        cos = torch.ones(n_new, hd // 2)
        sin = torch.zeros(n_new, hd // 2)
        pos = 18 if ring else 30
        positions = torch.arange(pos, pos + n_new)
        a, b = make(), make()
        if ring and n_new > 1 and pos + n_new > a.size:
            continue  # several tokens on a wrapped ring go through update (torch) anyway
        kw = {"head_dim": hd, "neox": True, "scale": 0.125, "softcap": 30.0}
        out_native = NativeOps().self_attention(q, k, v, None, None, 1e-6, (cos, sin), a, pos,
                                                positions, **kw)
        out_torch = TorchOps().self_attention(q, k, v, None, None, 1e-6, (cos, sin), b, pos,
                                              positions, **kw)
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        if ring:
            assert torch.equal(a.positions, b.positions)
        assert torch.allclose(out_native, out_torch, atol=2e-5, rtol=1e-4), \
            float((out_native - out_torch).abs().max())


# ---- a model: rings, prefix reuse, the prompt-cache file --------------------------------------
@pytest.fixture(scope="module")
def tiny_path(tiny_model_path):
    # head size 32 (one block), a window of 8: a ring of 8 + 256 cells below the context
    return tiny_model_path("gemma3", head_dim=32, context_length=1024, sliding_window=8)


def _llm(path, name, backend="torch"):
    from localllm import LLM

    llm = LLM(str(path), device="cpu", ctx_size=1024, dtype=torch.float32, type_k=name,
              type_v=name)
    assert (llm.type_k.name, llm.type_v.name) == (name, name)
    return llm


@pytest.mark.parametrize("name", ["q8_0", "q4_0", "iq4_nl"])
def test_rings_wrap_and_prefixes_are_reused_with_a_quantized_cache(tiny_path, name):
    """A prompt that wraps the sliding-window ring, then a second prompt sharing most of it
    (prefix reuse: truncate to the common prefix), then token-by-token decode: the logits are
    those of a fresh session evaluating the same tokens."""
    from localllm.runtime.session import prefill

    llm = _llm(tiny_path, name)
    rng = np.random.default_rng(0)
    vocab = llm.tokenizer.n_vocab
    first = [int(x) for x in rng.integers(3, vocab, 400)]
    second = first[:350] + [int(x) for x in rng.integers(3, vocab, 30)]
    session = llm.session()
    ring = next(m for m in session.memory if isinstance(m, RingKVCache))
    assert ring.type_k.name == name and ring.k.dtype == torch.uint8
    session.eval(first)
    assert not ring.linear  # wrapped
    logits, reused = prefill(session, second)
    assert 300 <= reused <= 379
    fresh = llm.session()
    ref = fresh.eval(second)
    assert torch.allclose(logits, ref, atol=1e-4), float((logits - ref).abs().max())
    for tok in (5, 9, 11):
        a, b = session.eval([tok]), fresh.eval([tok])
        assert torch.allclose(a, b, atol=1e-4), float((a - b).abs().max())
    # rewinding a few tokens (the ring's slack) needs no recomputation
    n = session.n_past
    assert session.truncate(n - 3) == n - 3


def test_quantized_cache_is_close_to_the_float_one(tiny_path):
    """q8_0 moves the logits less than q4_0 does, and neither is the float cache."""
    from localllm import LLM

    ids = list(range(3, 60))
    ref = LLM(str(tiny_path), device="cpu", dtype=torch.float32).logits(ids)
    diff = {name: float((_llm(tiny_path, name).logits(ids) - ref).abs().max())
            for name in ("q8_0", "q4_0")}
    assert 0 < diff["q8_0"] < diff["q4_0"] / 2, diff


def test_prompt_cache_keeps_the_cache_type_and_refuses_another(tiny_path, tmp_path):
    llm = _llm(tiny_path, "q8_0")
    s = llm.session()
    ids = list(range(3, 40))
    logits = s.eval(ids)
    path = tmp_path / "cache.safetensors"
    s.save(path)
    again = llm.session()
    again.load(path)
    assert again.tokens == ids
    assert all(torch.equal(a.k, b.k) for a, b in zip(s.memory, again.memory))
    assert torch.allclose(again.eval([7]), s.eval([7]))
    del logits
    for other in ("f32", "q4_0"):
        o = _llm(tiny_path, other) if other != "f32" else None
        if o is None:
            from localllm import LLM

            o = LLM(str(tiny_path), device="cpu", ctx_size=1024, dtype=torch.float32)
        with pytest.raises(LocalLLMError) as e:
            o.session().load(path)
        msg = str(e.value)
        assert "\n" not in msg and "saved with a q8_0/q8_0 KV cache" in msg, msg
        assert "--cache-type-k" in msg


def test_prompt_cache_refuses_non_finite_blocks(tiny_path, tmp_path):
    from safetensors.torch import load_file, save_file

    llm = _llm(tiny_path, "q8_0")
    s = llm.session()
    s.eval(list(range(3, 20)))
    path = tmp_path / "cache.safetensors"
    s.save(path)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
    tensors = load_file(str(path))
    k = tensors["0.k"].clone()
    k[0, 0, 0:2] = torch.tensor([0x00, 0x7C], dtype=torch.uint8)  # d = +inf (fp16)
    tensors["0.k"] = k
    save_file(tensors, str(path), metadata=meta)
    with pytest.raises(LocalLLMError, match="non-finite"):
        llm.session().load(path)


# ---- the flags --------------------------------------------------------------------------------
def test_llm_refuses_a_bad_type_in_one_line(tiny_path):
    from localllm import LLM

    with pytest.raises(ParameterError, match=r"^type_k \(--cache-type-k\): unsupported cache "
                                             r"type 'q7'"):
        LLM(str(tiny_path), device="cpu", type_k="q7")
    with pytest.raises(ParameterError, match="type_v"):
        LLM(str(tiny_path), device="cpu", type_v=[8])


def test_a_model_whose_head_size_is_not_whole_blocks_is_refused_before_loading(tiny_model_path):
    from localllm import LLM

    path = tiny_model_path("gemma3", head_dim=16)
    with pytest.raises(UnsupportedError, match="head size 16 is not a multiple"):
        LLM(str(path), device="cpu", type_k="q8_0")
    LLM(str(path), device="cpu", type_k="f16", type_v="bf16")  # float types: any size


@pytest.mark.parametrize("command", ["run", "chat", "bench", "perplexity", "serve"])
def test_cli_refuses_a_bad_cache_type_with_one_error_line(tiny_path, command, monkeypatch,
                                                          capsys):
    args = {"run": ["run", str(tiny_path), "hi"], "chat": ["chat", str(tiny_path)],
            "bench": ["bench", str(tiny_path), "--no-llama-cpp", "-p", "8", "-n", "2"],
            "perplexity": ["perplexity", str(tiny_path), "-f", str(tiny_path)],
            "serve": ["serve", str(tiny_path), "--port", "0"]}[command]
    code, _, err = run_cli(monkeypatch, capsys, *args, "-ctv", "q3_k", stdin="")
    assert_one_line_error(code, err, "unsupported cache type 'q3_k'", "--cache-type-v")


def test_cli_run_with_quantized_cache(tiny_path, monkeypatch, capsys):
    base = ["run", str(tiny_path), "hello", "-n", "4", "--temp", "0"]
    code, out, err = run_cli(monkeypatch, capsys, *base, "-ctk", "q8_0", "-ctv", "q4_0")
    assert code == 0, err
    code2, plain, err2 = run_cli(monkeypatch, capsys, *base)
    assert code2 == 0, err2
    assert out and plain


def test_info_memory_line_counts_the_cache_type():
    from localllm.cli.info import memory_line

    spec = [KVSpec(n_kv_heads=1, head_dim=256)]
    f16 = memory_line(spec, 4096)
    q8 = memory_line(spec, 4096, (CACHE_TYPES["q8_0"], CACHE_TYPES["q8_0"]))
    assert "KV cache 4.0 MiB" in f16 and "f16" in f16
    assert "KV cache 2.1 MiB" in q8 and "q8_0" in q8


def test_triton_backend_attends_over_a_quantized_cache(tiny_model_path):
    """The Triton backend (its interpreter on the CPU) with q8_0 caches: the torch attention
    over the blocks in prefill, the decode kernel reading the blocks directly in dynamic and
    static-shape decode, gives the torch backend's logits with the same caches."""
    pytest.importorskip("triton")
    import gguf

    from localllm.runtime.session import Session, load_model

    path = tiny_model_path("gemma3", qtype=gguf.GGMLQuantizationType.Q8_0, head_dim=32,
                           context_length=1024, sliding_window=8)
    q8 = CACHE_TYPES["q8_0"]
    ref = load_model(path, device="cpu", progress=False, dtype=torch.float32, backend="torch")
    quant = load_model(path, device="cpu", progress=False, backend="triton")
    ids = list(range(3, 17))
    want = Session(ref, ctx_size=32, type_k=q8, type_v=q8).eval(ids, all_logits=True)
    scale = want.abs().max()
    for static in (False, True):
        s = Session(quant, ctx_size=32, static_decode=static, type_k=q8, type_v=q8)
        assert s.memory[0].k.dtype == torch.uint8
        got = torch.cat([s.eval(ids[:10], all_logits=True),
                         torch.stack([s.eval([t]) for t in ids[10:]])])
        assert (got - want).abs().max() / scale < 3e-2


def test_bench_counts_the_quantized_cache(tiny_path):
    from localllm.eval import bench

    common = {"n_prompt": 16, "n_gen": 4, "repetitions": 1, "device": "cpu",
              "llama_cpp": False, "print_result": False}
    plain = bench.run_bench(str(tiny_path), **common)
    q8 = bench.run_bench(str(tiny_path), kv_cache={"type_k": "q8_0", "type_v": "q8_0"},
                         **common)
    assert plain["cache_types"] is None and q8["cache_types"] == ["q8_0", "q8_0"]
    assert q8["tg"] > 0
    # the native backend's default is f16: q8_0 reads 34/64 of its bytes per step
    assert q8["kv_bytes_per_token"] == plain["kv_bytes_per_token"] * 34 // 64
    assert bench._llama_cache_args(
        (CACHE_TYPES["q8_0"], CACHE_TYPES["q4_0"])) == {"type_k": 8, "type_v": 2,
                                                        "flash_attn": True}


def test_info_command_states_the_cache_of_the_types(tiny_path, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "info", str(tiny_path), "-ctk", "q8_0",
                             "-ctv", "q4_0")
    assert code == 0, err
    line = next(x for x in out.splitlines() if x.startswith("memory per sequence"))
    assert "K q8_0, V q4_0" in line
    code, out, err = run_cli(monkeypatch, capsys, "info", str(tiny_path), "-ctk", "q9")
    assert_one_line_error(code, err, "--cache-type-k", "'q9'")
