"""-t/--threads (llama.cpp's flag) on run, chat, perplexity, serve and bench."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

from localllm.cpu.threads import physical_cores, set_threads
from localllm.errors import ParameterError


@pytest.fixture
def keep_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_set_threads(keep_threads, monkeypatch):
    assert 1 <= physical_cores() <= (torch.get_num_threads() + 256)
    assert set_threads(1) == 1 and torch.get_num_threads() == 1
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert set_threads(None) == physical_cores() == torch.get_num_threads()
    with pytest.raises(ParameterError, match="-t/--threads must be >= 1"):
        set_threads(0)


@pytest.mark.parametrize("command", [["run"], ["chat"], ["perplexity"], ["serve"], ["bench"]])
def test_bad_thread_count_is_one_error_line(monkeypatch, capsys, workdir, tiny_model_path,
                                            keep_threads, command):
    path = str(tiny_model_path("llama"))
    args = [*command, path] + (["hello"] if command == ["run"] else [])
    code, _, err = run_cli(monkeypatch, capsys, *args, "-t", "0")
    assert_one_line_error(code, err, "-t/--threads must be >= 1, got 0")


def test_run_with_one_thread(monkeypatch, capsys, workdir, tiny_model_path, keep_threads):
    path = str(tiny_model_path("llama"))
    code, out, _ = run_cli(monkeypatch, capsys, "run", path, "the", "-n", "4", "--temp", "0",
                           "-t", "1")
    assert code == 0 and out and torch.get_num_threads() == 1


def _serve_ready_line(path, *args: str, timeout: float = 120.0) -> str:
    """Start a real ``localllm serve`` on a free port, return its ready line, stop it."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    cmd = [sys.executable, "-c", "from localllm.cli import main; main()", "serve", str(path),
           "--port", "0", "--device", "cpu", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**env, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "serving" in line:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    ready = [x for x in lines if "serving" in x]
    assert ready, "".join(lines)
    return ready[0]


def test_serve_runs_on_the_threads_asked(tiny_model_path):
    """serve -t N sets the CPU threads (its ready line says how many); without -t it uses
    the physical cores, as llama-server does."""
    path = tiny_model_path("llama")
    assert "(1 CPU thread;" in _serve_ready_line(path, "-t", "1")
    n = physical_cores()
    assert f"({n} CPU thread{'s' if n > 1 else ''};" in _serve_ready_line(path)
