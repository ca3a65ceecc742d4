"""-t/--threads (llama.cpp's flag) on run, chat, perplexity and bench."""

from __future__ import annotations

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


@pytest.mark.parametrize("command", [["run"], ["chat"], ["perplexity"], ["bench"]])
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
