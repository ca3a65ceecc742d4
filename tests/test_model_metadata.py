"""Hyperparameters are validated before anything is sized from them (issue 16, item 2), and
a file's tensors are checked against the architecture's declaration before weights are read.

Each case is a valid tiny model with one metadata value or tensor changed; the load must raise
one LocalLLMError line naming the key or tensor, and read no weight.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from cli_helpers import assert_one_line_error, run_cli

from localllm.errors import GGUFError, LocalLLMError, UnsupportedError
from localllm.gguf.file import open_gguf
from localllm.runtime import session as runtime
from localllm.runtime.session import load_gguf


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is bound."""
    def refuse(*a, **k):
        raise AssertionError("weights were read")
    monkeypatch.setattr(runtime, "bind", refuse)


def _load(path, **changes):
    """load_gguf of the file at ``path`` with metadata keys changed (None: key removed)."""
    f = open_gguf(path)
    md = dict(f.metadata)
    for k, v in changes.items():
        if v is None:
            md.pop(k, None)
        else:
            md[k] = v
    return load_gguf(dataclasses.replace(f, metadata=md), device="cpu", progress=False,
                     ctx_size=64)


BAD_VALUES = [
    ("llama.attention.head_count", 0, "llama.attention.head_count"),
    ("llama.attention.head_count", -4, "llama.attention.head_count"),
    ("llama.context_length", math.nan, "llama.context_length"),
    ("llama.context_length", math.inf, "llama.context_length"),
    ("llama.context_length", "4096", "llama.context_length"),
    ("llama.context_length", [256, 256], "llama.context_length"),
    ("llama.feed_forward_length", None, "llama.feed_forward_length"),
    ("llama.block_count", 0, "llama.block_count"),
    ("llama.block_count", 2**40, "llama.block_count"),
    ("llama.block_count", 3, "blk.2.attn_norm.weight"),  # more layers than the file has
    ("llama.block_count", 1, "blk.1."),  # fewer: the file's layer 1 is foreign
    ("llama.embedding_length", None, "llama.embedding_length"),
    ("llama.embedding_length", 63.5, "llama.embedding_length"),
    ("llama.embedding_length", True, "llama.embedding_length"),
    ("llama.attention.key_length", 15, "llama.attention.key_length"),  # odd head size
    ("llama.attention.head_count_kv", 3, "llama.attention.head_count_kv"),  # 4 % 3
    ("llama.attention.head_count_kv", 8, "llama.attention.head_count_kv"),  # more KV than Q
    ("llama.attention.layer_norm_rms_epsilon", -1.0, "layer_norm_rms_epsilon"),
    ("llama.attention.layer_norm_rms_epsilon", math.nan, "layer_norm_rms_epsilon"),
    ("llama.rope.freq_base", 0.0, "llama.rope.freq_base"),
    ("llama.rope.freq_base", "x", "llama.rope.freq_base"),
    ("llama.rope.scaling.factor", math.inf, "llama.rope.scaling.factor"),
    ("llama.attention.sliding_window", -1, "llama.attention.sliding_window"),
    ("llama.expert_count", 4, "llama.expert_used_count"),  # MoE without its other keys
    ("llama.attention.value_length", 32, "llama.attention.value_length"),
    ("llama.rope.dimension_count", 18, "llama.rope.dimension_count"),  # above the head size
    ("llama.rope.dimension_count", 7, "llama.rope.dimension_count"),  # odd
    ("llama.rope.scaling.factor", 0.0, "llama.rope.scaling.factor"),
    ("general.architecture", "gemma3", "gemma3.embedding_length"),  # keys of another arch
    ("general.architecture", "mamba9", "mamba9"),
    ("general.architecture", 7, "architecture"),
]


@pytest.mark.parametrize("key, value, named", BAD_VALUES,
                         ids=[f"{k}={v!r}"[:60] for k, v, _ in BAD_VALUES])
def test_bad_hyperparameter_is_one_error_naming_it(tiny_model_path, no_weights, key, value,
                                                   named):
    with pytest.raises(LocalLLMError) as e:
        _load(tiny_model_path("llama"), **{key: value})
    assert isinstance(e.value, (GGUFError, UnsupportedError))
    msg = str(e.value)
    assert "\n" not in msg and named in msg


@pytest.mark.parametrize("kind", ["dynamic", "llama4", 5])
def test_unsupported_rope_scaling_names_the_key(tiny_model_path, no_weights, kind):
    with pytest.raises(LocalLLMError, match=r"llama\.rope\.scaling\.type"):
        _load(tiny_model_path("llama"), **{"llama.rope.scaling.type": kind,
                                           "llama.rope.scaling.factor": 4.0})


def test_per_layer_arrays_that_agree_are_accepted(tiny_model_path):
    m = _load(tiny_model_path("llama"), **{"llama.attention.head_count_kv": [2, 2],
                                           "llama.feed_forward_length": [128, 128]})
    assert m.args.n_kv_heads == 2 and m.args.ffn_dim == 128
    with pytest.raises(GGUFError, match="head_count_kv: differs between layers"):
        _load(tiny_model_path("llama"), **{"llama.attention.head_count_kv": [2, 1]})


def test_mis_shaped_or_missing_tensor_is_named(tiny_model_path, no_weights):
    f = open_gguf(tiny_model_path("qwen2"))
    t = f.tensors["blk.1.attn_k.weight"]
    bad = {**f.tensors, "blk.1.attn_k.weight": dataclasses.replace(t, shape=(t.shape[0] * 2, 64))}
    with pytest.raises(GGUFError, match=r"'blk\.1\.attn_k\.weight' has shape \(64, 64\), but "
                                        r"the hyperparameters need \(32, 64\)"):
        load_gguf(dataclasses.replace(f, tensors=bad), device="cpu", progress=False)
    missing = {k: v for k, v in f.tensors.items() if k != "blk.0.attn_q.bias"}
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.bias' is missing"):
        load_gguf(dataclasses.replace(f, tensors=missing), device="cpu", progress=False)


def test_tensors_of_another_architecture_are_named(tiny_model_path, no_weights):
    # A Gemma 3 file relabelled as llama (keys renamed): its QK-norm tensors are foreign.
    f = open_gguf(tiny_model_path("gemma3"))
    md = {(k.replace("gemma3.", "llama.", 1) if k.startswith("gemma3.") else k): v
          for k, v in f.metadata.items()}
    md["general.architecture"] = "llama"
    with pytest.raises(GGUFError, match=r"tensor 'blk\.0\.attn_q_norm\.weight' is not part of "
                                        r"this architecture"):
        load_gguf(dataclasses.replace(f, metadata=md), device="cpu", progress=False)


def test_expert_count_must_match_the_expert_tensors(tmp_path, no_weights):
    from tiny_model import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "moe.gguf", "qwen3moe",
                           extra={"expert_count": 4, "expert_used_count": 2,
                                  "expert_feed_forward_length": 32})
    with pytest.raises(GGUFError, match=r"ffn_gate_inp\.weight' has shape \(4, 64\).*\(8, 64\)"):
        _load(path, **{"qwen3moe.expert_count": 8})
    with pytest.raises(GGUFError, match=r"qwen3moe\.expert_used_count: must be in 1\.\.4"):
        _load(path, **{"qwen3moe.expert_used_count": 5})
    with pytest.raises(GGUFError, match=r"qwen3moe\.expert_count: must be > 0"):
        _load(path, **{"qwen3moe.expert_count": 0})


def test_memory_estimate_is_bounded_by_validated_values(tiny_model_path, no_weights):
    # The estimate runs after validation: the largest accepted block_count is sized quickly.
    with pytest.raises(GGUFError, match="block_count: must be in 1..512"):
        _load(tiny_model_path("llama"), **{"llama.block_count": 10**6})


def test_cli_names_the_key_in_one_line(monkeypatch, capsys, workdir):
    from tiny_model import write_tiny_gguf

    f = write_tiny_gguf(workdir / "dynamic.gguf", "llama",
                        extra={"rope.scaling.type": "dynamic", "rope.scaling.factor": 4.0})
    for cmd in ("run", "info"):
        args = [cmd, str(f)] + (["hello"] if cmd == "run" else [])
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 1
        assert_one_line_error(code, err, "llama.rope.scaling.type", "dynamic")


def test_valid_values_still_load(tiny_model_path):
    m = _load(tiny_model_path("llama"), **{"llama.context_length": 128,
                                           "llama.rope.freq_base": 500000.0})
    assert m.args.context_length == 128 and np.isclose(m.args.rope.base, 500000.0)


# ---- issue 28: the keys of the 2025 dense families ---------------------------------------------
EXAONE4_ISWA = {"n_layers": 64, "d_model": 32, "n_heads": 2, "n_kv_heads": 1, "ffn_dim": 32}
GPT_OSS = {"extra": (("expert_count", 4), ("expert_used_count", 2),
                     ("expert_feed_forward_length", 32))}
GLM4MOE = {"n_layers": 3, "extra": (("expert_count", 4), ("expert_used_count", 2),
                                    ("expert_feed_forward_length", 32),
                                    ("expert_shared_count", 1),
                                    ("leading_dense_block_count", 1))}
ERNIE_MOE = {"extra": (("expert_count", 4), ("expert_used_count", 2),
                       ("expert_feed_forward_length", 32),
                       ("expert_shared_feed_forward_length", 32),
                       ("leading_dense_block_count", 1), ("interleave_moe_layer_step", 1))}
NEW_KEYS = [
    ("apertus", {}, "xielu.alpha_n", [0.8], "xielu.alpha_n"),  # one value for two layers
    ("apertus", {}, "xielu.beta", None, "xielu.beta"),  # required
    ("apertus", {}, "xielu.eps", "x", "xielu.eps"),
    ("apertus", {}, "xielu.alpha_p", [0.8, float("nan")], "xielu.alpha_p"),
    ("exaone4", EXAONE4_ISWA, "exaone4.attention.sliding_window_pattern", [True] * 63,
     "exaone4.attention.sliding_window_pattern"),  # a pattern of the wrong length
    ("exaone4", EXAONE4_ISWA, "exaone4.attention.sliding_window_pattern", [3] * 64,
     "exaone4.attention.sliding_window_pattern"),
    ("exaone4", EXAONE4_ISWA, "exaone4.attention.sliding_window", -8,
     "exaone4.attention.sliding_window"),
    ("gemma3", {"n_layers": 6}, "gemma3.attention.sliding_window_pattern", [True] * 7,
     "gemma3.attention.sliding_window_pattern"),
    ("gemma2", {}, "gemma2.attention.sliding_window_pattern", -1,
     "gemma2.attention.sliding_window_pattern"),
    ("mistral3", {}, "mistral3.attention.temperature_scale", "0.1",
     "mistral3.attention.temperature_scale"),
    ("hunyuan-dense", {}, "hunyuan-dense.rope.scaling.alpha", 0.0,
     "hunyuan-dense.rope.scaling.alpha"),
    ("smollm3", {"n_layers": 4}, "smollm3.rope.dimension_count", 3,
     "smollm3.rope.dimension_count"),
    # gpt-oss: expert counts, its window and pattern, YaRN
    ("gpt-oss", GPT_OSS, "gpt-oss.expert_count", 0, "gpt-oss.expert_count"),
    ("gpt-oss", GPT_OSS, "gpt-oss.expert_count", 3, "ffn_gate_inp"),  # tensors have 4
    ("gpt-oss", GPT_OSS, "gpt-oss.expert_used_count", 5, "gpt-oss.expert_used_count"),
    ("gpt-oss", GPT_OSS, "gpt-oss.expert_feed_forward_length", None,
     "gpt-oss.expert_feed_forward_length"),
    ("gpt-oss", GPT_OSS, "gpt-oss.attention.sliding_window", None,
     "gpt-oss.attention.sliding_window"),
    ("gpt-oss", GPT_OSS, "gpt-oss.attention.sliding_window_pattern", [True, False, True],
     "gpt-oss.attention.sliding_window_pattern"),  # three values for two layers
    ("gpt-oss", GPT_OSS, "gpt-oss.rope.scaling.type", "yarm", "gpt-oss.rope.scaling.type"),
    ("gpt-oss", {**GPT_OSS, "extra": (*GPT_OSS["extra"], ("rope.scaling.type", "yarn"))},
     "gpt-oss.rope.scaling.factor", -4.0, "gpt-oss.rope.scaling.factor"),
    ("gpt-oss", {**GPT_OSS, "extra": (*GPT_OSS["extra"], ("rope.scaling.type", "yarn"),
                                      ("rope.scaling.factor", 4.0))},
     "gpt-oss.rope.freq_base_swa", 1.0, "gpt-oss.rope.freq_base_swa"),
    # glm4moe: its MoE layout
    ("glm4moe", GLM4MOE, "glm4moe.nextn_predict_layers", 3, "glm4moe.nextn_predict_layers"),
    ("glm4moe", GLM4MOE, "glm4moe.leading_dense_block_count", 4,
     "glm4moe.leading_dense_block_count"),
    ("glm4moe", GLM4MOE, "glm4moe.leading_dense_block_count", 2, "blk.1."),  # routed tensors
    ("glm4moe", GLM4MOE, "glm4moe.expert_shared_count", None, "glm4moe.expert_shared_count"),
    ("glm4moe", GLM4MOE, "glm4moe.expert_gating_func", 7, "glm4moe.expert_gating_func"),
    ("glm4moe", GLM4MOE, "glm4moe.expert_count", 5, "ffn_gate_inp"),  # the tensors have 4
    ("glm4moe", GLM4MOE, "glm4moe.expert_weights_scale", -1.0,
     "glm4moe.expert_weights_scale"),
    ("olmoe", {"extra": (("expert_count", 4), ("expert_used_count", 2))},
     "olmoe.expert_used_count", 0, "olmoe.expert_used_count"),
    ("olmoe", {"extra": (("expert_count", 4), ("expert_used_count", 2))},
     "olmoe.expert_count", 8, "ffn_gate_inp"),  # the tensors have 4
    ("ernie4_5-moe", ERNIE_MOE, "ernie4_5-moe.interleave_moe_layer_step", 2,
     "ernie4_5-moe.interleave_moe_layer_step"),
    ("ernie4_5-moe", ERNIE_MOE, "ernie4_5-moe.interleave_moe_layer_step", None,
     "ernie4_5-moe.interleave_moe_layer_step"),
    ("ernie4_5-moe", ERNIE_MOE, "ernie4_5-moe.leading_dense_block_count", 3,
     "ernie4_5-moe.leading_dense_block_count"),
    ("ernie4_5-moe", ERNIE_MOE, "ernie4_5-moe.expert_shared_feed_forward_length", 64,
     "ffn_gate_shexp"),  # the tensors are 32 wide
    ("phimoe", {"extra": (("expert_count", 4), ("expert_used_count", 2))},
     "phimoe.expert_used_count", 5, "phimoe.expert_used_count"),
    ("phimoe", {"extra": (("expert_count", 4), ("expert_used_count", 2))},
     "phimoe.expert_count", None, "phimoe.expert_count"),
]


@pytest.mark.parametrize("arch, kw, key, value, named", NEW_KEYS,
                         ids=[f"{k}={v!r}"[:60] for _, _, k, v, _ in NEW_KEYS])
def test_bad_key_of_a_new_family_is_one_error_naming_it(tiny_model_path, no_weights, arch, kw,
                                                       key, value, named):
    with pytest.raises(GGUFError) as e:
        _load(tiny_model_path(arch, **kw), **{key: value})
    msg = str(e.value)
    assert "\n" not in msg and named in msg


def test_glm4moe_next_token_prediction_block_is_checked_not_loaded(tiny_model_path):
    """nextn_predict_layers: the last block (counted in block_count) is accepted with its
    tensors' shapes checked, and the decoder has one layer less (llama.cpp's trunk)."""
    m = _load(tiny_model_path("glm4moe", **GLM4MOE), **{"glm4moe.nextn_predict_layers": 1})
    assert m.args.n_layers == 2 and len(m.model.layers) == 2


def test_exaone4_slides_only_with_the_32b_layer_count(tiny_model_path):
    """llama.cpp's rule: three sliding (RoPE) layers to one global (NoPE) at 64 layers, or
    the file's pattern; every layer global with RoPE otherwise."""
    from localllm.models.rope import GLOBAL, NOPE

    a = _load(tiny_model_path("exaone4", **EXAONE4_ISWA)).args
    assert a.swa[:4] == (True, True, True, False) and a.sliding_window == 4096
    assert [a.rope_kind(i) for i in range(4)] == [GLOBAL, GLOBAL, GLOBAL, NOPE]
    pattern = [i % 2 == 0 for i in range(64)]
    a = _load(tiny_model_path("exaone4", **EXAONE4_ISWA),
              **{"exaone4.attention.sliding_window_pattern": pattern}).args
    assert list(a.swa) == pattern
    a = _load(tiny_model_path("exaone4")).args
    assert not any(a.swa) and a.rope_kind(1) == GLOBAL
