"""The CLI: user errors are one line, non-zero, no traceback; commands work end to end."""

from __future__ import annotations

import struct

from cli_helpers import assert_one_line_error, run_cli


def _listing(path):
    return sorted(p.name for p in path.iterdir())


def test_not_a_gguf(monkeypatch, capsys, workdir):
    bad = workdir / "notes.gguf"
    bad.write_bytes(b"this is not a model at all" * 10)
    before = _listing(workdir)
    code, out, err = run_cli(monkeypatch, capsys, "run", str(bad), "hello")
    assert_one_line_error(code, err, "notes.gguf")
    assert out == "" and _listing(workdir) == before


def test_truncated_gguf(monkeypatch, capsys, workdir, tiny_model_path):
    data = tiny_model_path("llama").read_bytes()
    cut = workdir / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    code, _, err = run_cli(monkeypatch, capsys, "run", str(cut), "hello")
    assert_one_line_error(code, err, "cut.gguf")


def test_unsupported_version(monkeypatch, capsys, workdir, tiny_model_path):
    data = bytearray(tiny_model_path("llama").read_bytes())
    data[4:8] = struct.pack("<I", 7)
    f = workdir / "v7.gguf"
    f.write_bytes(bytes(data))
    code, _, err = run_cli(monkeypatch, capsys, "run", str(f), "hello")
    assert_one_line_error(code, err, "version")


def test_unknown_architecture(monkeypatch, capsys, workdir):
    import gguf
    import numpy as np

    f = workdir / "odd.gguf"
    w = gguf.GGUFWriter(str(f), "mamba9")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    code, _, err = run_cli(monkeypatch, capsys, "run", str(f), "hello")
    assert_one_line_error(code, err, "mamba9")


def test_unsupported_quant_type_names_tensor_and_type(monkeypatch, capsys, workdir):
    import gguf
    from tiny_model import write_tiny_gguf

    # Q8_K (llama.cpp's activation type) has a geometry but no dequantizer.
    f = write_tiny_gguf(workdir / "q8k.gguf", "llama", qtype=gguf.GGMLQuantizationType.Q8_K,
                        d_model=256, head_dim=64, ffn_dim=512)
    code, _, err = run_cli(monkeypatch, capsys, "run", str(f), "hello")
    assert_one_line_error(code, err, "token_embd.weight", "Q8_K")


def test_unknown_model_name(monkeypatch, capsys, workdir):
    code, _, err = run_cli(monkeypatch, capsys, "run", "no-such-model", "hello")
    assert_one_line_error(code, err, "no-such-model", "models.toml")


def test_empty_prompt(monkeypatch, capsys, workdir, tiny_model_path):
    code, _, err = run_cli(monkeypatch, capsys, "run", str(tiny_model_path("llama")), "")
    assert_one_line_error(code, err, "empty")


def test_prompt_longer_than_context(monkeypatch, capsys, workdir, tiny_model_path):
    code, out, err = run_cli(monkeypatch, capsys, "run", str(tiny_model_path("llama")),
                             "the and " * 200, "--ctx-size", "64")
    assert_one_line_error(code, err, "context")
    assert out == ""


def test_run_streams_greedy_text_and_reads_stdin(monkeypatch, capsys, workdir, tiny_model_path):
    path = str(tiny_model_path("llama"))
    code, out1, _ = run_cli(monkeypatch, capsys, "run", path, "the", "-n", "8", "--temp", "0")
    assert code == 0 and out1
    code, out2, _ = run_cli(monkeypatch, capsys, "run", path, "-", "-n", "8", "--temp", "0",
                            stdin="the")
    assert code == 0 and out2 == out1


def test_run_verbose_prints_timings(monkeypatch, capsys, workdir, tiny_model_path):
    code, _, err = run_cli(monkeypatch, capsys, "run", str(tiny_model_path("llama")), "the",
                           "-n", "4", "--verbose", "--seed", "3")
    assert code == 0
    assert "prompt eval time" in err and "eval time" in err and "seed: 3" in err


def test_tokenize_and_info(monkeypatch, capsys, workdir, tiny_model_path):
    path = str(tiny_model_path("gemma3"))
    code, out, _ = run_cli(monkeypatch, capsys, "tokenize", path, "the and")
    assert code == 0 and out.strip().startswith("[2,")
    code, out, _ = run_cli(monkeypatch, capsys, "tokenize", path, "the", "--no-bos")
    assert code == 0 and not out.strip().startswith("[2,")
    code, out, _ = run_cli(monkeypatch, capsys, "info", path)
    assert code == 0 and "gemma3" in out and "F16" in out


def test_models_lists_the_default(monkeypatch, capsys):
    code, out, _ = run_cli(monkeypatch, capsys, "models")
    assert code == 0 and "gemma3-270m" in out and "default" in out
