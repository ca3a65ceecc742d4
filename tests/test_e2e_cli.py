"""End-to-end CLI checks found by trying localllm as a new user would (tiny models only).

Each test pins a bug found by trying the CLI as a new user (fixed since).
"""

from __future__ import annotations

import errno
import subprocess
import sys

import gguf
import pytest
from cli_helpers import assert_one_line_error, run_cli

from localllm.cli.app import main


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory):
    """A gemma3 tiny model whose rows are multiples of 256 (K-quants can quantize it)."""
    from tiny_model import write_tiny_gguf

    path = tmp_path_factory.mktemp("e2e") / "tiny-f16.gguf"
    return write_tiny_gguf(path, "gemma3", d_model=256, head_dim=64, ffn_dim=512,
                           qtype=gguf.GGMLQuantizationType.F16)


def test_quantize_then_run_and_same_path_refused(monkeypatch, capsys, workdir, tiny_f16):
    out_path = workdir / "q.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "quantize", str(tiny_f16), str(out_path),
                           "--type", "Q4_K_M")
    assert code == 0, err
    assert "Q4_K" in err and out_path.exists()
    code, out, err = run_cli(monkeypatch, capsys, "run", str(out_path), "hello", "-n", "3",
                             "--temp", "0")
    assert code == 0, err
    assert out != ""
    before = tiny_f16.read_bytes()
    code, _, err = run_cli(monkeypatch, capsys, "quantize", str(tiny_f16), str(tiny_f16),
                           "--type", "Q8_0")
    assert code == 1 and "error:" in err
    assert tiny_f16.read_bytes() == before


def test_quantize_error_is_exactly_one_line(monkeypatch, capsys, workdir, tiny_f16):
    first = workdir / "q8.gguf"
    assert run_cli(monkeypatch, capsys, "quantize", str(tiny_f16), str(first), "-t", "Q8_0")[0] == 0
    code, _, err = run_cli(monkeypatch, capsys, "quantize", str(first), "again.gguf", "-t", "Q4_0")
    assert_one_line_error(code, err, "--allow-requantize")
    assert not (workdir / "again.gguf").exists()


def test_negative_n_predict_other_than_minus_one_is_refused(monkeypatch, capsys, workdir,
                                                            tiny_f16):
    code, out, err = run_cli(monkeypatch, capsys, "run", str(tiny_f16), "hi", "-n", "-5",
                             "-c", "32", "--ignore-eos")
    assert_one_line_error(code, err, "-n")
    assert out == ""


def test_system_without_chat_is_refused(monkeypatch, capsys, workdir, tiny_f16):
    code, _, err = run_cli(monkeypatch, capsys, "run", str(tiny_f16), "hi", "-n", "2",
                           "--system", "be brief")
    assert_one_line_error(code, err, "--system")


def test_broken_pipe_exits_zero(monkeypatch, capsys, workdir, tiny_f16):
    class ClosedPipe:
        def write(self, s):
            raise BrokenPipeError(errno.EPIPE, "Broken pipe")

        def flush(self):
            pass

        def isatty(self):
            return False

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    monkeypatch.setattr(sys, "argv", ["localllm", "run", str(tiny_f16), "hi", "-n", "4",
                                      "--ignore-eos"])
    try:
        main()
    except SystemExit as exc:
        assert exc.code in (0, None)


def test_chat_error_lines_are_not_wrapped(workdir, tiny_f16):
    long_name = "no/such/dir/" + "x" * 100 + ".json"
    proc = subprocess.run(
        [sys.executable, "-m", "localllm.cli.app", "chat", str(tiny_f16)],
        input=f"/load {long_name}\n/exit\n", capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text
    errors = [line for line in text.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and long_name in errors[0], text
