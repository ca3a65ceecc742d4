"""Llama 4 and Gemma 4 metadata: what llama.cpp's loaders derive from it (chunked and NoPE
layers, MoE interleaving, shared-KV sources), and one GGUFError naming the key or tensor,
before any weight is read, for each inconsistency (issue #28's bad-input list), Gemma 4's
mixture of experts included."""

from __future__ import annotations

import dataclasses

import pytest
from families import write_family

from localllm.errors import GGUFError
from localllm.gguf.file import open_gguf
from localllm.models.rope import GLOBAL, NOPE, SWA
from localllm.runtime import session as runtime
from localllm.runtime.session import load_gguf


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("l4g4")
    return {f: open_gguf(write_family(f, d)) for f in ("llama4", "gemma4", "gemma4-moe")}


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is bound."""
    def refuse(*a, **k):
        raise AssertionError("weights were read")
    monkeypatch.setattr(runtime, "bind", refuse)


def _args(f, **changes):
    """The validated args of ``f`` with metadata keys changed (None: removed), no weights."""
    md = dict(f.metadata)
    for k, v in changes.items():
        if v is None:
            md.pop(k, None)
        else:
            md[k] = v
    from localllm.models import model_args

    return model_args(md, len(md["tokenizer.ggml.tokens"]), "x.gguf")


def _load(f, **changes):
    md = dict(f.metadata)
    md.update(changes)
    return load_gguf(dataclasses.replace(f, metadata=md), device="cpu", progress=False)


def test_llama4_layers_as_llama_cpp_derives_them(files):
    a = _args(files["llama4"])
    assert a.chunk == 8192 and a.swa == (True, True, True, False)
    assert [a.rope_kind(i) for i in range(4)] == [SWA, SWA, SWA, NOPE]
    assert [a.is_moe(i) for i in range(4)] == [False, True, False, True]
    assert a.qk_norm and a.temperature_scale == 0.1
    # the file's window is ignored except for 0: no chunked layer, the last alone NoPE
    assert _args(files["llama4"], **{"llama4.attention.sliding_window": 512}).chunk == 8192
    b = _args(files["llama4"], **{"llama4.attention.sliding_window": 0})
    assert b.chunk is None and not any(b.swa) and b.temperature_scale == 0.0
    assert [b.rope_kind(i) for i in range(4)] == [GLOBAL, GLOBAL, GLOBAL, NOPE]
    # the 128-expert model (Maverick) has no L2 QK-norm
    assert not _args(files["llama4"], **{"llama4.expert_count": 128}).qk_norm


def test_gemma4_layers_as_llama_cpp_derives_them(files):
    a = _args(files["gemma4"])
    assert a.swa == (True, False) * 3 and a.n_kv_layers == 4
    assert [a.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
    assert [a.layer_head_dim(i) for i in range(2)] == [32, 64]
    assert a.rope_swa.n_rot == 24 and a.rope_swa.base == 500.0 and a.rope.base == 1e6
    assert a.ffn_dims == (512,) * 4 + (1024,) * 2 and a.n_embd_per_layer == 32


BAD = [
    ("llama4", "llama4.expert_count", 0),
    ("llama4", "llama4.expert_used_count", 5),
    ("llama4", "llama4.interleave_moe_layer_step", None),
    ("llama4", "llama4.interleave_moe_layer_step", -1),
    ("llama4", "llama4.attention.sliding_window_pattern", [True] * 3),  # wrong length
    ("llama4", "llama4.attention.sliding_window_pattern", [2] * 4),
    ("llama4", "llama4.attention.sliding_window", -1),
    ("llama4", "llama4.rope.dimension_count", 32),  # part of the head
    ("llama4", "llama4.feed_forward_length", None),  # the dense layers need it
    ("llama4", "llama4.expert_feed_forward_length", 0),
    ("gemma4", "gemma4.attention.sliding_window_pattern", [True] * 5),  # wrong length
    ("gemma4", "gemma4.attention.sliding_window_pattern", 6),  # not one per layer
    ("gemma4", "gemma4.attention.sliding_window_pattern", None),
    ("gemma4", "gemma4.attention.shared_kv_layers", 3),  # sources of the wrong kinds
    ("gemma4", "gemma4.attention.shared_kv_layers", 7),
    ("gemma4", "gemma4.attention.value_length_swa", 16),
    ("gemma4", "gemma4.attention.key_length_swa", None),
    ("gemma4", "gemma4.rope.dimension_count_swa", 48),  # past the sliding head
    ("gemma4", "gemma4.rope.dimension_count_swa", 23),
    ("gemma4", "gemma4.embedding_length_per_layer_input", None),
    ("gemma4", "gemma4.attention.sliding_window", None),
    ("gemma4", "gemma4.feed_forward_length", [512] * 5),
    ("gemma4", "gemma4.final_logit_softcapping", -1.0),
    ("gemma4-moe", "gemma4.expert_used_count", 9),  # more than expert_count
    ("gemma4-moe", "gemma4.expert_used_count", 0),
    ("gemma4-moe", "gemma4.expert_used_count", None),
    ("gemma4-moe", "gemma4.expert_count", -1),
    ("gemma4-moe", "gemma4.expert_feed_forward_length", None),
    ("gemma4-moe", "gemma4.expert_feed_forward_length", 0),
    ("gemma4-moe", "gemma4.expert_feed_forward_length", [128, 64, 128, 128]),
]


@pytest.mark.parametrize("family, key, value", BAD, ids=[f"{k}={v!r}"[:50] for _, k, v in BAD])
def test_bad_key_is_one_error_naming_it_before_weights(files, no_weights, family, key, value):
    md = dict(files[family].metadata)
    if value is None:
        md.pop(key)
    else:
        md[key] = value
    with pytest.raises(GGUFError) as e:
        load_gguf(dataclasses.replace(files[family], metadata=md), device="cpu", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and key in msg, msg


def test_expert_count_must_match_the_tensors(files, no_weights):
    with pytest.raises(GGUFError, match=r"ffn_gate_inp\.weight' has shape \(4, 256\)"):
        _load(files["llama4"], **{"llama4.expert_count": 8})
    # every layer MoE: layer 0's dense FFN is not part of the architecture then
    with pytest.raises(GGUFError, match=r"blk\.0\.ffn_gate_inp\.weight' is missing"):
        _load(files["llama4"], **{"llama4.interleave_moe_layer_step": 1})


def test_gemma4_moe_args_as_llama_cpp_reads_them(files):
    a = _args(files["gemma4-moe"])
    assert (a.n_expert, a.n_expert_used, a.expert_ffn_dim) == (8, 2, 128)
    assert a.ffn_dims == (512,) * 4 and _args(files["gemma4"]).n_expert == 0


def _without(f, *names):
    return dataclasses.replace(f, tensors={k: v for k, v in f.tensors.items() if k not in names})


@pytest.mark.parametrize("changes, tensors, error", [
    # the counts against the tensors' shapes
    ({"gemma4.expert_count": 16}, (), r"'blk\.0\.ffn_gate_inp\.weight' has shape \(8, 256\)"),
    ({"gemma4.expert_feed_forward_length": 64}, (),
     r"'blk\.0\.ffn_gate_up_exps\.weight' has shape \(8, 256, 256\)"),
    # a dense file said to have experts: the MoE tensors are missing
    ({"gemma4.expert_count": 4, "gemma4.expert_used_count": 2,
      "gemma4.expert_feed_forward_length": 128}, "dense",
     r"'blk\.0\.ffn_gate_inp\.scale' is missing"),
    # a MoE file said to be dense: its expert tensors are not part of that architecture
    ({"gemma4.expert_count": 0}, (), r"'blk\.0\.ffn_gate_inp\.scale' is not part"),
    # missing expert tensors: a separate gate without its up, the fused one, the down, the
    # router, the MoE branch's norms
    ({}, ("blk.1.ffn_up_exps.weight",),
     r"'blk\.1\.ffn_up_exps\.weight' is missing .*nor is 'blk\.1\.ffn_gate_up_exps"),
    ({}, ("blk.0.ffn_gate_up_exps.weight",), r"'blk\.0\.ffn_gate_exps\.weight' is missing"),
    ({}, ("blk.2.ffn_down_exps.weight",), r"'blk\.2\.ffn_down_exps\.weight' is missing"),
    ({}, ("blk.3.ffn_gate_inp.weight",), r"'blk\.3\.ffn_gate_inp\.weight' is missing"),
    ({}, ("blk.1.post_ffw_norm_2.weight",), r"'blk\.1\.post_ffw_norm_2\.weight' is missing"),
])
def test_gemma4_moe_inconsistent_with_its_tensors_is_one_error(files, no_weights, changes,
                                                                tensors, error):
    f = files["gemma4"] if tensors == "dense" else _without(files["gemma4-moe"], *tensors)
    with pytest.raises(GGUFError, match=error) as e:
        _load(f, **changes)
    assert "\n" not in str(e.value)
