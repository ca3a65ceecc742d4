"""Bad input to the hybrid and state-space families (issue #27): a recurrent hyperparameter
missing, zero or inconsistent with the others or with the tensors, a per-layer array of the
wrong length, a mis-shaped SSM tensor. Each is one error naming the key or tensor, raised
before any weight is read; on the command line one ``error:`` line and exit 1.

The files are the families' llama.cpp fixtures (tests/families.py), one metadata value or
tensor changed.
"""

from __future__ import annotations

import dataclasses

import pytest
from cli_helpers import assert_one_line_error, run_cli
from families import write_family

from localllm.errors import GGUFError, LocalLLMError, UnsupportedError
from localllm.gguf.file import open_gguf
from localllm.runtime import session as runtime
from localllm.runtime.session import load_gguf


@pytest.fixture(scope="module")
def family_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hybrid-input")
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = open_gguf(write_family(family, directory))
        return cache[family]

    return get


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is bound."""
    def refuse(*a, **k):
        raise AssertionError("weights were read")
    monkeypatch.setattr(runtime, "bind", refuse)


def load(f, *, tensors=None, **changes):
    """load_gguf of ``f`` with metadata keys changed (None: removed) or other tensors."""
    md = dict(f.metadata)
    for k, v in changes.items():
        if v is None:
            md.pop(k, None)
        else:
            md[k] = v
    return load_gguf(dataclasses.replace(f, metadata=md, tensors=tensors or f.tensors),
                     device="cpu", progress=False, ctx_size=64)


BAD = [
    # missing, zero, out of range
    ("mamba2", "mamba2.ssm.state_size", None, "mamba2.ssm.state_size: is missing"),
    ("mamba2", "mamba2.ssm.conv_kernel", 0, "mamba2.ssm.conv_kernel: must be in 2..64"),
    ("mamba2", "mamba2.ssm.conv_kernel", 1, "mamba2.ssm.conv_kernel: must be in 2..64"),
    ("mamba2", "mamba2.ssm.time_step_rank", 0, "mamba2.ssm.time_step_rank: must be in"),
    ("mamba2", "mamba2.ssm.group_count", None, "mamba2.ssm.group_count: is missing"),
    ("mamba2", "mamba2.ssm.inner_size", -512, "mamba2.ssm.inner_size"),
    ("lfm2", "lfm2.shortconv.l_cache", None, "lfm2.shortconv.l_cache: is missing"),
    ("lfm2", "lfm2.shortconv.l_cache", 1, "lfm2.shortconv.l_cache: must be in 2..64"),
    ("nemotron_h", "nemotron_h.attention.layer_norm_epsilon", None,
     "nemotron_h.attention.layer_norm_epsilon: is missing"),
    # inconsistent with each other
    ("mamba2", "mamba2.ssm.time_step_rank", 7,
     "mamba2.ssm.time_step_rank: 7 heads do not divide ssm.inner_size 512"),
    ("mamba2", "mamba2.ssm.group_count", 3,
     "mamba2.ssm.group_count: 3 groups do not divide 8 heads"),
    ("granitehybrid", "granitehybrid.attention.head_count_kv", [0, 3, 0, 2],
     "granitehybrid.attention.head_count_kv: layer 1: 4 heads are not a multiple of 3"),
    ("lfm2", "lfm2.attention.head_count", 2, "lfm2.attention.head_count: layer 2: 2 heads"),
    # a per-layer array of the wrong length
    ("granitehybrid", "granitehybrid.attention.head_count_kv", [0, 2, 0],
     "granitehybrid.attention.head_count_kv: has 3 values for 4 layers"),
    ("nemotron_h", "nemotron_h.feed_forward_length", [0, 512, 0],
     "nemotron_h.feed_forward_length: has 3 values for 6 layers"),
    ("lfm2", "lfm2.attention.head_count_kv", [0, 0, 2, 0, 2, 0],
     "lfm2.attention.head_count_kv: has 6 values for 5 layers"),
    ("falcon-h1", "falcon-h1.attention.head_count_kv", [2, "x"],
     "falcon-h1.attention.head_count_kv"),
    # consistent keys that contradict the tensors: the first tensor they size is named
    ("mamba2", "mamba2.ssm.state_size", 32,
     "'blk.0.ssm_in.weight' has shape (1288, 256), but the hyperparameters need (1160, 256)"),
    ("mamba2", "mamba2.ssm.conv_kernel", 3, "'blk.0.ssm_conv1d.weight' has shape (768, 4)"),
    ("falcon-h1", "falcon-h1.ssm.time_step_rank", 16, "'blk.0.ssm_in.weight'"),
    ("nemotron_h", "nemotron_h.ssm.group_count", 2, "'blk.0.ssm_in.weight'"),
    ("lfm2", "lfm2.shortconv.l_cache", 4, "'blk.0.shortconv.conv.weight' has shape (256, 3)"),
    ("granitehybrid", "granitehybrid.attention.head_count_kv", [2, 2, 0, 2],
     "'blk.0.attn_q.weight' is missing"),
    ("nemotron_h", "nemotron_h.feed_forward_length", [0, 0, 0, 512, 0, 512],
     "'blk.1.ssm_in.weight' is missing"),
    # unsupported
    ("nemotron_h", "nemotron_h.expert_count", 4, "nemotron_h.expert_count: mixture-of-experts"),
]


@pytest.mark.parametrize("family, key, value, named", BAD,
                         ids=[f"{k}={v!r}"[:60] for _, k, v, _ in BAD])
def test_bad_recurrent_hyperparameter_is_one_error_naming_it(family_file, no_weights, family,
                                                             key, value, named):
    with pytest.raises(LocalLLMError) as e:
        load(family_file(family), **{key: value})
    assert isinstance(e.value, (GGUFError, UnsupportedError))
    msg = str(e.value)
    assert "\n" not in msg and named in msg, msg


@pytest.mark.parametrize("family, name, shape", [
    ("mamba2", "blk.1.ssm_a", (8, 2)),
    ("granitehybrid", "blk.2.ssm_d", (9, 1)),
    ("falcon-h1", "blk.0.ssm_dt.bias", (16,)),
    ("nemotron_h", "blk.4.ssm_norm.weight", (1, 512)),
    ("lfm2", "blk.3.shortconv.in_proj.weight", (512, 256)),
])
def test_mis_shaped_ssm_tensor_is_named(family_file, no_weights, family, name, shape):
    f = family_file(family)
    bad = {**f.tensors, name: dataclasses.replace(f.tensors[name], shape=shape)}
    with pytest.raises(GGUFError, match=rf"'{name}' has shape \({shape[0]},"):
        load(f, tensors=bad)
    missing = {k: v for k, v in f.tensors.items() if k != name}
    with pytest.raises(GGUFError, match=rf"'{name}' is missing"):
        load(f, tensors=missing)


def test_layer_kinds_follow_the_arrays(family_file):
    """The valid files load with the layer kinds their arrays declare."""
    m = load(family_file("nemotron_h"))
    assert m.args.kinds == ("mamba", "ffn", "attention", "ffn", "mamba", "ffn")
    m = load(family_file("lfm2"))
    assert m.args.recurrent == (True, True, False, True, False)
    assert [type(s).__name__ for s in m.memory_layout] == [
        "RecurrentSpec", "RecurrentSpec", "KVSpec", "RecurrentSpec", "KVSpec"]


def rewrite(path, out, key: str, value) -> None:
    """Copy the GGUF at ``path`` to ``out`` with metadata ``key`` set to ``value`` (the same
    tensors: a file whose metadata contradicts them, as no converter writes)."""
    from gguf import GGUFReader, GGUFWriter

    from localllm.models.synthetic import _add_kv

    f = open_gguf(path)
    w = GGUFWriter(str(out), f.architecture)
    for k, v in {**f.metadata, key: value}.items():
        if k != "general.architecture" and not k.startswith("GGUF."):
            _add_kv(w, k, v)
    for t in GGUFReader(path).tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_cli_names_the_key_in_one_line(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    rewrite(write_family("granitehybrid", tmp_path), bad,
            "granitehybrid.attention.head_count_kv", [0, 2, 0])
    for cmd in ("run", "info"):
        args = [cmd, str(bad)] + (["hello"] if cmd == "run" else [])
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert_one_line_error(code, err, "granitehybrid.attention.head_count_kv",
                              "has 3 values for 4 layers")
