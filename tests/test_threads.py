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


class _Machine:
    """A simulated machine for :class:`CoreShare`: a clock, and a step's seconds and our
    threads' run-queue wait per second as functions of the thread count in use."""

    def __init__(self, step_s, wait_per_s):
        self.t, self.waited = 0.0, 0.0
        self.step_s, self.wait_per_s = step_s, wait_per_s

    def clock(self):
        return self.t

    def wait(self):
        return self.waited

    def step(self, n):
        """One step on ``n`` threads: its time passes, its threads wait their share."""
        d = self.step_s(n)
        self.t += d
        self.waited += d * self.wait_per_s(n) * n

    def run(self, share, seconds):
        """One-token steps for ``seconds``; the thread counts used, one per step."""
        used, end = [], self.t + seconds
        while self.t < end:
            used.append(share.usable(1))
            self.step(used[-1])
        return used


def _busy_machine(busy):
    """Beside a process of the same priority (while ``busy["on"]``), 2 threads are 5x
    slower than 1 and wait; without it, 2 threads are faster."""
    return _Machine(step_s=lambda n: (0.2 if n == 2 else 0.04) if busy["on"] else 0.05 / n,
                    wait_per_s=lambda n: (0.4 if n == 2 else 0.0) if busy["on"] else 0.0)


def _share(machine, cap=2):
    from localllm.cpu.threads import CoreShare

    return CoreShare(cap, wait=machine.wait, clock=machine.clock)


def test_idle_machine_keeps_every_thread_and_tries_nothing():
    m = _Machine(step_s=lambda n: 0.05 / n, wait_per_s=lambda n: 0.01)
    share = _share(m)
    assert set(m.run(share, 20.0)) == {2}


def test_a_busy_core_takes_one_thread_off_and_the_end_of_it_gives_it_back():
    busy = {"on": True}
    m = _busy_machine(busy)
    share = _share(m)
    used = m.run(share, 20.0)
    assert used[-1] == 1
    # after the first interval, at most one short trial of 2 threads every RETRY seconds
    tried = sum(0.2 for n in used[5:] if n == 2)
    assert tried <= (20.0 / share.RETRY + 1) * (share.INTERVAL + 0.2)
    busy["on"] = False
    used = m.run(share, 2 * share.RETRY)
    assert used[-1] == 2 and used[-10:] == [2] * 10


def test_threads_that_wait_but_still_go_faster_are_kept():
    # beside nice-19 jobs our threads wait too, yet 2 threads beat 1: a trial of 1 thread
    # is made at most every RETRY seconds and never kept
    m = _Machine(step_s=lambda n: 0.026 if n == 2 else 0.04, wait_per_s=lambda n: 0.2)
    share = _share(m)
    used = m.run(share, 20.0)
    assert used[-1] == 2
    ones = sum(0.04 for n in used if n == 1)
    assert ones <= (20.0 / share.RETRY + 1) * (share.INTERVAL + 0.04)


def test_no_run_queue_times_means_fixed_threads():
    m = _Machine(step_s=lambda n: 0.2 if n == 2 else 0.04, wait_per_s=lambda n: 0.5)
    from localllm.cpu.threads import CoreShare

    share = CoreShare(2, wait=lambda: None, clock=m.clock)
    assert set(m.run(share, 5.0)) == {2}


def test_pauses_between_steps_are_not_step_time():
    # a long pause (the user reading) between two steps is not counted as a slow step
    m = _Machine(step_s=lambda n: 0.03, wait_per_s=lambda n: 0.3)
    share = _share(m)
    m.run(share, 0.1)
    m.t += 30.0
    share.usable(1)
    assert share._step_s < 1.0


def test_run_queue_wait_reads_this_process():
    from localllm.cpu.threads import run_queue_wait

    w = run_queue_wait()
    if not os.path.exists("/proc/self/task"):
        assert w is None
    else:
        assert w is not None and w >= 0.0


def test_use_threads_for_applies_the_share(keep_threads, monkeypatch):
    from localllm.cpu import threads

    set_threads(2)
    m = _busy_machine({"on": True})
    monkeypatch.setattr(threads, "_share", _share(m))
    counts = []
    for _ in range(40):  # the steps' own counts, as the session asks before each
        threads.use_threads_for(1)
        counts.append(torch.get_num_threads())
        m.step(counts[-1])
    assert counts[0] == 2 and counts[-1] == 1
    threads.use_threads_for(8)  # a batch while crowded: no more threads than a step
    assert torch.get_num_threads() == 1


def test_adaptive_threads_can_be_turned_off(keep_threads, monkeypatch):
    from localllm.cpu import threads

    monkeypatch.setenv("LOCALLLM_ADAPTIVE_THREADS", "0")
    set_threads(2)
    assert threads._share is None
    monkeypatch.delenv("LOCALLLM_ADAPTIVE_THREADS")
    set_threads(2)
    assert threads._share is not None
    set_threads(1)
    assert threads._share is None


def test_steps_are_counted_per_thread_count():
    m = _busy_machine({"on": True})
    share = _share(m)
    used = m.run(share, 10.0)
    assert share.steps == {n: used.count(n) for n in set(used)} and set(used) == {1, 2}


def test_verbose_timings_say_when_threads_stepped_back(keep_threads, monkeypatch, capsys):
    from localllm.cli.app import print_timings
    from localllm.cpu import threads

    class Timings:
        prompt_seconds, prompt_tokens, generate_seconds = 0.1, 4, 1.0
        generated_tokens, first_token_seconds, extra = 9, 0.05, {}

    class Loaded:
        load_seconds = 0.5

    class Llm:
        loaded = Loaded()

    set_threads(2)
    monkeypatch.setattr(threads._share, "steps", {2: 3, 1: 5})
    print_timings(Llm(), Timings(), "length")
    assert "decode threads =" in capsys.readouterr().err
    monkeypatch.setattr(threads._share, "steps", {2: 8})
    print_timings(Llm(), Timings(), "length")
    assert "decode threads" not in capsys.readouterr().err
