"""Bad hybrid-model files (issue #27, "Bad input"): a recurrent hyperparameter missing, zero
or inconsistent with the others or with the tensors, a layer-kind array of the wrong length,
RoPE dims or sections that do not fit the head, an SSM tensor mis-shaped: one ``error:`` line
naming the key or tensor, exit 1, before any weight is read."""

from __future__ import annotations

import dataclasses

import pytest
from cli_helpers import assert_one_line_error, run_cli
from tiny_model import write_tiny_gguf

from localllm.errors import GGUFError
from localllm.gguf.file import open_gguf
from localllm.runtime.session import load_gguf

# A valid tiny qwen35 / qwen3next: 2 layers (a delta-net, then attention), 4 value heads of
# 16 over 2 key heads, RoPE on 8 of the head's 16 dims.
QWEN35 = {"ssm.conv_kernel": 4, "ssm.state_size": 16, "ssm.group_count": 2,
          "ssm.time_step_rank": 4, "ssm.inner_size": 64, "full_attention_interval": 2,
          "rope.dimension_count": 8, "rope.dimension_sections": [2, 1, 1, 0]}
MOE = {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 32,
       "expert_shared_feed_forward_length": 32}
QWEN3NEXT = {**{k: v for k, v in QWEN35.items() if k != "rope.dimension_sections"}, **MOE}


def tiny(tmp_path, arch: str = "qwen35", **extra):
    return write_tiny_gguf(tmp_path / f"{arch}.gguf", arch,
                           extra={**(QWEN35 if arch == "qwen35" else QWEN3NEXT), **extra})


def rewrite(src, dst, changes: dict, tensors_from=None):
    """``src`` with its metadata ``changes`` (``{arch}.KEY`` -> value, None deletes; written
    with gguf-py's writer) and the tensors of ``tensors_from`` (default: its own)."""
    import gguf

    from localllm.models.synthetic import _add_kv

    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    changes = {f"{arch}.{k}": v for k, v in changes.items()}
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.name in changes:
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(field.name, field.contents(), field.types[0], sub)
    for key, value in changes.items():
        if value is not None:
            _add_kv(w, key, value)
    for t in gguf.GGUFReader(str(tensors_from or src)).tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.fixture
def no_weights_read(monkeypatch):
    """Any read of a weight fails the test (the refusal must come first)."""
    from localllm.runtime import session

    def bind(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr(session, "bind", bind)


@pytest.mark.parametrize("arch,key,value,fragment", [
    ("qwen35", "ssm.state_size", None, "qwen35.ssm.state_size: is missing"),
    ("qwen35", "ssm.conv_kernel", 0, "qwen35.ssm.conv_kernel"),
    ("qwen35", "ssm.conv_kernel", 1, "qwen35.ssm.conv_kernel"),
    ("qwen35", "ssm.group_count", 0, "qwen35.ssm.group_count"),
    ("qwen35", "ssm.time_step_rank", 3, "qwen35.ssm.time_step_rank"),  # not a multiple of 2
    ("qwen35", "ssm.inner_size", 60, "qwen35.ssm.inner_size"),  # not 4 heads x 16
    ("qwen35", "ssm.state_size", 2**20, "qwen35.ssm.state_size"),
    ("qwen35", "full_attention_interval", 0, "qwen35.full_attention_interval"),
    ("qwen35", "attention.recurrent_layers", [True], "qwen35.attention.recurrent_layers"),
    ("qwen35", "attention.recurrent_layers", [1, 0], "qwen35.attention.recurrent_layers"),
    ("qwen35", "rope.dimension_sections", None, "qwen35.rope.dimension_sections: is missing"),
    ("qwen35", "rope.dimension_sections", [0, 0, 0, 0], "qwen35.rope.dimension_sections"),
    ("qwen35", "rope.dimension_sections", [8, 8, 8, 8], "qwen35.rope.dimension_sections"),
    ("qwen35", "rope.dimension_count", 7, "qwen35.rope.dimension_count"),
    ("qwen35", "rope.dimension_count", 32, "qwen35.rope.dimension_count"),  # > head size
    ("qwen35", "nextn_predict_layers", 2, "qwen35.nextn_predict_layers"),  # no trunk left
    ("qwen3next", "ssm.time_step_rank", None, "qwen3next.ssm.time_step_rank: is missing"),
    ("qwen3next", "expert_count", 0, "qwen3next.expert_count"),
    ("qwen3next", "expert_shared_feed_forward_length", 0,
     "qwen3next.expert_shared_feed_forward_length"),
])
def test_bad_hyperparameter_is_one_error_line(tmp_path, monkeypatch, capsys, no_weights_read,
                                              arch, key, value, fragment):
    path = rewrite(tiny(tmp_path, arch), tmp_path / "bad.gguf", {key: value})
    code, _, err = run_cli(monkeypatch, capsys, "run", str(path), "hi", "-n", "1")
    assert_one_line_error(code, err, fragment)


@pytest.mark.parametrize("key,value,tensor", [
    ("ssm.conv_kernel", 3, "blk.0.ssm_conv1d.weight"),  # the file's kernels have 4 taps
    ("ssm.state_size", 8, "blk.0.attn_qkv.weight"),  # heads of 8: other projections
    ("ssm.group_count", 1, "blk.0.attn_qkv.weight"),
    ("full_attention_interval", 1, "blk.0.attn_q.weight"),  # every layer attends: no tensors
])
def test_hyperparameter_inconsistent_with_the_tensors(tmp_path, no_weights_read, key, value,
                                                      tensor):
    """Valid on their own, the keys contradict the file's tensors: the first tensor that
    disagrees is named (``ssm.state_size`` 8 with ``inner_size`` 32 is consistent)."""
    f = open_gguf(tiny(tmp_path))
    md = {**f.metadata, f"qwen35.{key}": value}
    if key == "ssm.state_size":
        md["qwen35.ssm.inner_size"] = 4 * value
    with pytest.raises(GGUFError, match=tensor.replace(".", r"\.")):
        load_gguf(dataclasses.replace(f, metadata=md), device="cpu", progress=False)


def test_mis_shaped_ssm_tensor_is_named(tmp_path, monkeypatch, capsys, no_weights_read):
    """An SSM tensor of another shape than the hyperparameters give (the file written for
    ``ssm.conv_kernel`` 5, its metadata then saying 4)."""
    wide = write_tiny_gguf(tmp_path / "wide.gguf", "qwen35",
                           extra={**QWEN35, "ssm.conv_kernel": 5})
    rewrite(wide, tmp_path / "mixed.gguf", {"ssm.conv_kernel": 4})
    code, _, err = run_cli(monkeypatch, capsys, "run", str(tmp_path / "mixed.gguf"), "hi",
                           "-n", "1")
    assert_one_line_error(code, err, "blk.0.ssm_conv1d.weight")


def test_legacy_qwen3next_projection_missing_is_named(tmp_path, no_weights_read):
    """A Qwen3-Next delta-net layer needs attn_qkv and attn_gate, or the legacy ssm_in."""
    f = open_gguf(tiny(tmp_path, "qwen3next"))
    tensors = {k: v for k, v in f.tensors.items() if k != "blk.0.attn_gate.weight"}
    with pytest.raises(GGUFError, match="blk.0.attn_gate.weight.*ssm_in"):
        load_gguf(dataclasses.replace(f, tensors=tensors), device="cpu", progress=False)


@pytest.mark.parametrize("arch", ["qwen35", "qwen3next"])
def test_tiny_files_load_and_run(tmp_path, arch):
    """The valid tiny files of these tests load and run (so that each refusal above is the
    changed key's)."""
    from localllm.runtime.session import Session

    m = load_gguf(open_gguf(tiny(tmp_path, arch)), device="cpu", progress=False)
    s = Session(m, ctx_size=16)
    s.eval([1, 2, 3])
    s.eval([4])
