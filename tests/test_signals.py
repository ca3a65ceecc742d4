"""Interrupting a command (issue 8): Ctrl-C exits 130, SIGTERM exits 143, no traceback, and
no partial output file (neither OUT nor its temporary file) is left behind.

Each command runs as a subprocess through ``localllm.cli.app.main`` (the console entry point),
with one function wrapped so that, at its N-th call, it prints ``STALLED`` on stderr and
sleeps: the signal is sent only once that line arrives, so it always lands mid-way (after
the temporary output file has data in it), whatever the machine's speed.

The child starts from the dispositions of a command typed at a terminal, whatever the test
runner inherited (``nohup`` ignores SIGHUP, some runners ignore SIGINT): the tests must not
depend on them. ``IGNORE_SIGNALS`` ignores some on purpose (``nohup localllm ...``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Runs the CLI with STALL_AT=module:attr wrapped (see the module docstring).
WRAPPER = r"""
import importlib, os, signal, sys, time
# A terminal's dispositions, whatever we inherited (nohup: SIGHUP ignored; a test runner
# may ignore SIGINT): Ctrl-C raises KeyboardInterrupt, the others kill by default.
signal.signal(signal.SIGINT, signal.default_int_handler)
for name in ("SIGTERM", "SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM", "SIGQUIT"):
    signal.signal(getattr(signal, name), signal.SIG_DFL)
for name in filter(None, os.environ.get("IGNORE_SIGNALS", "").split(",")):
    signal.signal(getattr(signal, name), signal.SIG_IGN)  # nohup localllm ...
module, _, attr = os.environ["STALL_AT"].partition(":")
after = int(os.environ.get("STALL_AFTER", "1"))
owner = importlib.import_module(module)
*path, name = attr.split(".")
for p in path:
    owner = getattr(owner, p)
original = getattr(owner, name)
calls = 0
def stalled(*args, **kwargs):
    global calls
    result = original(*args, **kwargs)
    calls += 1
    if calls == after:
        print("STALLED", file=sys.stderr, flush=True)
        time.sleep(60)
    return result
setattr(owner, name, stalled)
from localllm.cli.app import main
sys.argv[0] = "localllm"
main()
"""

SIGNALS = [pytest.param(signal.SIGINT, 130, id="SIGINT"),
           pytest.param(signal.SIGTERM, 143, id="SIGTERM")]


class Interrupted:
    """Outcome of :func:`interrupt`: exit code, stdout before the signal, all of stdout and
    stderr (text)."""

    def __init__(self, code: int, before: str, stdout: str, stderr: str,
                 survived: list[bool] | None = None) -> None:
        self.code, self.before, self.stdout, self.stderr = code, before, stdout, stderr
        self.survived = survived or []  # per signal sent before the last: still running


def start(args: list[str], stall_at: str, *, after: int = 1, cwd: Path,
          ignore: tuple[str, ...] = (), inherit_ignored: tuple[int, ...] = (),
          stderr: int = subprocess.PIPE) -> subprocess.Popen:
    """Start ``localllm ARGS`` under the stall wrapper; ``ignore``: signal names the child
    ignores on purpose (as under nohup); ``inherit_ignored``: signals it inherits ignored
    (which the wrapper resets, as a terminal would have them)."""
    env = {**os.environ, "STALL_AT": stall_at, "STALL_AFTER": str(after),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "PYTHONUNBUFFERED": "1", "IGNORE_SIGNALS": ",".join(ignore)}

    # Ignored dispositions survive exec: set them around the start, then put ours back.
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in inherit_ignored}
    try:
        return subprocess.Popen([sys.executable, "-c", WRAPPER, *args], cwd=cwd, env=env,
                                stdout=subprocess.PIPE, stderr=stderr)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def interrupt(args: list[str], stall_at: str, sig: int | Sequence[int], *, after: int = 1,
              cwd: Path, timeout: float = 60.0, on_stall: Callable[[], None] | None = None,
              ignore: tuple[str, ...] = (),
              inherit_ignored: tuple[int, ...] = ()) -> Interrupted:
    """Run ``localllm ARGS``, wait for the stall, call ``on_stall``, send ``sig`` (several:
    one after the other, half a second apart, noting whether the command survived each but
    the last), return what happened."""
    sigs = [sig] if isinstance(sig, int) else list(sig)
    survived: list[bool] = []
    proc = start(args, stall_at, after=after, cwd=cwd, ignore=ignore,
                 inherit_ignored=inherit_ignored)
    out: list[bytes] = []
    err: list[bytes] = []
    stalled = threading.Event()

    def pump(stream, sink: list[bytes], watch: bool) -> None:
        for line in iter(stream.readline, b""):
            sink.append(line)
            if watch and line.strip() == b"STALLED":
                stalled.set()

    def pump_out() -> None:  # stdout is read as it comes, not by lines (tokens stream)
        while chunk := proc.stdout.read1(4096):
            out.append(chunk)

    threads = [threading.Thread(target=pump, args=(proc.stderr, err, True), daemon=True),
               threading.Thread(target=pump_out, daemon=True)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + timeout
        while not stalled.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("the command ended or hung before the stall point:\n"
                                     + b"".join(err).decode(errors="replace"))
        time.sleep(0.05)  # let the stdout reader catch up with what was already written
        before = b"".join(out).decode(errors="replace")
        if on_stall is not None:
            on_stall()
        for s in sigs[:-1]:
            proc.send_signal(s)
            time.sleep(0.5)
            survived.append(proc.poll() is None)
        proc.send_signal(sigs[-1])
        code = proc.wait(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for t in threads:
        t.join(timeout=5)
    return Interrupted(code, before, b"".join(out).decode(errors="replace"),
                       b"".join(err).decode(errors="replace"), survived)


def assert_clean_exit(res: Interrupted, code: int) -> None:
    assert res.code == code, res.stderr
    assert "Traceback" not in res.stderr, res.stderr
    assert "STALLED" in res.stderr


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory) -> Path:
    """A tiny F16 llama in a folder of its own."""
    from tiny_model import write_tiny_gguf

    return write_tiny_gguf(tmp_path_factory.mktemp("signals-in") / "tiny-f16.gguf", "llama")


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_quantize_interrupted_leaves_no_file(tiny_f16, tmp_path, sig, code):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    res = interrupt(["quantize", str(tiny_f16), str(out_dir / "q8.gguf"), "--type", "Q8_0"],
                    "localllm.quantize.convert:quantize_rows", sig, after=2, cwd=tmp_path)
    assert_clean_exit(res, code)
    assert list(out_dir.iterdir()) == []  # neither OUT nor .OUT.tmp-PID


def test_quantize_stall_point_is_mid_write(tiny_f16, tmp_path):
    """The stall really is mid-way: while stalled, only the temporary file exists, with data
    (so the test above checks that it is removed)."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    seen: list[tuple[str, int]] = []

    def look() -> None:
        seen.extend((p.name, p.stat().st_size) for p in out_dir.iterdir())

    res = interrupt(["quantize", str(tiny_f16), str(out_dir / "q8.gguf"), "--type", "Q8_0"],
                    "localllm.quantize.convert:quantize_rows", signal.SIGTERM, after=2,
                    cwd=tmp_path, on_stall=look)
    assert res.code == 143
    assert len(seen) == 1 and seen[0][0].startswith(".q8.gguf.tmp") and seen[0][1] > 0, seen
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_kl_divergence_base_interrupted_while_saving(tiny_f16, tmp_path, sig, code):
    text = tmp_path / "text.txt"
    text.write_text("the tale and the sand of the sea is the end. " * 40)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["perplexity", str(tiny_f16), "-f", str(text), "--ctx-size", "32",
            "--kl-divergence-base", str(out_dir / "base.npz")]
    # numpy.savez_compressed has written the temporary file when it returns
    res = interrupt(args, "numpy:savez_compressed", sig, cwd=tmp_path)
    assert_clean_exit(res, code)
    assert "Final estimate: PPL" in res.stdout  # it was interrupted after scoring
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_kl_divergence_base_interrupted_while_scoring(tiny_f16, tmp_path, sig, code):
    text = tmp_path / "text.txt"
    text.write_text("the tale and the sand of the sea is the end. " * 40)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    args = ["perplexity", str(tiny_f16), "-f", str(text), "--ctx-size", "32",
            "--kl-divergence-base", str(out_dir / "base.npz")]
    res = interrupt(args, "localllm.runtime.session:Session.eval", sig, after=2, cwd=tmp_path)
    assert_clean_exit(res, code)
    assert "Final estimate" not in res.stdout
    assert list(out_dir.iterdir()) == []


@pytest.mark.parametrize(("sig", "code"), SIGNALS)
def test_run_interrupted_mid_generation_keeps_streamed_text(tiny_f16, tmp_path, sig, code):
    args = ["run", str(tiny_f16), "the tale", "-n", "200", "--seed", "3", "--temp", "1.0"]
    # eval call 1 is the prompt, then one per generated token: ~12 tokens are out
    res = interrupt(args, "localllm.runtime.session:Session.eval", sig, after=13, cwd=tmp_path)
    assert_clean_exit(res, code)
    assert res.before.strip()  # text was streamed before the signal ...
    assert res.stdout.startswith(res.before)  # ... and stays
    assert list(tmp_path.iterdir()) == []  # run writes no file
