"""``localllm pull hf.co/ORG/REPO[:TAG]`` and ``run ORG/REPO:TAG`` with the real
``huggingface_hub`` client against a Hub served on 127.0.0.1 by the test (tests/fake_hub.py,
``HF_ENDPOINT``): tag selection, split models, resume after a cut connection, sha256
checks, 401/404, offline use, and the cache's bad states.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from cli_helpers import assert_one_line_error, run_cli
from fake_hub import FakeHub, HubServer
from tiny_model import write_tiny_gguf

REPO = "org/Tiny-GGUF"
BIG = 12 << 20  # over huggingface_hub's 10 MiB read chunk, so a cut can resume mid-file


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, bytes]:
    """A repository as GGUF publishers lay them out: quants, a 3-part split, a projector."""
    d = tmp_path_factory.mktemp("repo")
    out = {}
    for seed, name in enumerate(("Tiny-Q4_K_M.gguf", "Tiny-Q8_0.gguf", "Tiny-BF16.gguf",
                                 "mmproj-Tiny-F16.gguf")):
        out[name] = write_tiny_gguf(d / name, "llama", seed=seed).read_bytes()
    (d / "split").mkdir()
    write_tiny_gguf(d / "split" / "Tiny-F16.gguf", "llama", seed=7, split_max_tensors=8)
    for p in sorted((d / "split").iterdir()):
        out[p.name] = p.read_bytes()
    out["README.md"] = b"# Tiny\n"
    return out


@pytest.fixture
def hub(files, tmp_path, monkeypatch):
    """A Hub serving REPO, an empty Hugging Face cache, localllm's cache and config in
    tmp_path, and a HOME without other tools' stores."""
    fake = FakeHub()
    fake.add(REPO, files, lfs_from=64)
    for var in ("HF_HOME", "HF_HUB_OFFLINE", "HF_TOKEN", "HUGGINGFACE_HUB_CACHE",
                "OLLAMA_MODELS", "LLAMA_CACHE", "LOCALLLM_MODELS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("LOCALLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    with HubServer(fake) as served:
        monkeypatch.setenv("HF_ENDPOINT", served.url)
        yield served


def snapshot(tmp_path: Path) -> Path:
    [snap] = (tmp_path / "hf" / "models--org--Tiny-GGUF" / "snapshots").iterdir()
    return snap


def blobs(tmp_path: Path) -> list[str]:
    folder = tmp_path / "hf" / "models--org--Tiny-GGUF" / "blobs"
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_pull_picks_the_tag_case_insensitively_into_the_hf_cache(hub, files, tmp_path,
                                                                  monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "pull", f"hf.co/{REPO}:q8_0")
    assert code == 0, err
    assert out.startswith(f"hf.co/{REPO}:Q8_0: ")
    path = snapshot(tmp_path) / "Tiny-Q8_0.gguf"
    assert path.is_symlink() and path.read_bytes() == files["Tiny-Q8_0.gguf"]
    # the standard layout: blob named by its sha256, refs/main -> the commit
    assert blobs(tmp_path) == [hashlib.sha256(files["Tiny-Q8_0.gguf"]).hexdigest()]
    ref = tmp_path / "hf" / "models--org--Tiny-GGUF" / "refs" / "main"
    assert ref.read_text() == hub.repos[REPO].commit == snapshot(tmp_path).name
    # pulled once: a second pull downloads nothing
    n = len(hub.gets("Tiny-Q8_0.gguf"))
    assert run_cli(monkeypatch, capsys, "pull", f"hf.co/{REPO}:Q8_0")[0] == 0
    assert len(hub.gets("Tiny-Q8_0.gguf")) == n


def test_default_tag_is_q4_k_m_and_huggingface_hub_sees_the_file(hub, files, tmp_path,
                                                                  monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "pull", REPO)
    assert code == 0, err
    assert out.startswith(f"hf.co/{REPO}:Q4_K_M: ")
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(REPO, "Tiny-Q4_K_M.gguf", cache_dir=str(tmp_path / "hf"))
    assert Path(found).read_bytes() == files["Tiny-Q4_K_M.gguf"]  # shared with other tools


def test_run_pulls_a_split_model_once_and_loads_it_as_one(hub, files, tmp_path, monkeypatch,
                                                          capsys):
    code, out, err = run_cli(monkeypatch, capsys, "run", f"{REPO}:F16", "the", "-n", "4",
                             "--temp", "0")
    assert code == 0, err
    assert err.startswith(f"pulling hf.co/{REPO}:F16 from ")
    names = sorted(p.name for p in snapshot(tmp_path).iterdir())
    assert names == [f"Tiny-F16-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    # the oracle: the same weights written unsplit
    from localllm import LLM

    whole = write_tiny_gguf(tmp_path / "whole.gguf", "llama", seed=7)
    split = LLM(f"hf.co/{REPO}:F16", device="cpu", ctx_size=64)
    assert split.model_name == f"hf.co/{REPO}:F16"
    ids = split.tokenize("the and of")
    assert (split.logits(ids) == LLM(str(whole), device="cpu", ctx_size=64).logits(ids)).all()
    # cached now: no more requests, even with the network gone
    before = len(hub.log)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    code, out2, err = run_cli(monkeypatch, capsys, "run", f"{REPO}:F16", "the", "-n", "4",
                              "--temp", "0")
    assert code == 0 and out2 == out and "pulling" not in err
    assert len(hub.log) == before


def test_offline_mode_uses_the_cache_only(hub, files, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, _, err = run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q8_0")
    assert_one_line_error(code, err, "HF_HUB_OFFLINE")
    assert hub.log == []
    monkeypatch.delenv("HF_HUB_OFFLINE")
    assert run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q8_0")[0] == 0
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = len(hub.log)
    code, _, err = run_cli(monkeypatch, capsys, "run", f"{REPO}:Q8_0", "the", "-n", "2")
    assert code == 0, err
    assert len(hub.log) == n


def test_a_cut_connection_resumes_with_a_range_request(hub, tmp_path, monkeypatch, capsys):
    data = os.urandom(BIG)
    hub.add("org/Big-GGUF", {"Big-Q4_K_M.gguf": data})
    hub.cut["Big-Q4_K_M.gguf"] = 11 << 20
    code, _, err = run_cli(monkeypatch, capsys, "pull", "hf.co/org/Big-GGUF")
    assert code == 0, err
    ranges = hub.gets("Big-Q4_K_M.gguf")
    assert len(ranges) == 2 and ranges[0] is None
    assert ranges[1].startswith("bytes=") and int(ranges[1][6:-1]) > 0  # not from the start
    [blob] = (tmp_path / "hf" / "models--org--Big-GGUF" / "blobs").iterdir()
    assert blob.read_bytes() == data


def test_sha256_mismatch_keeps_nothing_under_the_final_name(hub, files, tmp_path, monkeypatch,
                                                            capsys):
    hub.tamper.add("Tiny-Q8_0.gguf")  # other bytes than the Hub's LFS sha256 says
    code, _, err = run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q8_0")
    assert_one_line_error(code, err, "does not match the Hub's sha256",
                          hashlib.sha256(files["Tiny-Q8_0.gguf"]).hexdigest())
    assert blobs(tmp_path) == []
    assert not (snapshot(tmp_path) / "Tiny-Q8_0.gguf").exists()
    hub.tamper.clear()
    assert run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q8_0")[0] == 0


def test_private_repository_needs_hf_token(hub, files, monkeypatch, capsys):
    hub.add("org/Private-GGUF", {"P-Q4_K_M.gguf": files["Tiny-Q4_K_M.gguf"]}, token="hf_secret")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "hf.co/org/Private-GGUF")
    assert_one_line_error(code, err, "hf.co/org/Private-GGUF", "HF_TOKEN")
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "hf.co/org/Private-GGUF")
    assert code == 0, err


@pytest.mark.parametrize(("name", "fragments"), [
    ("hf.co/org/No-Such-Repo", ("no such repository",)),
    (f"hf.co/{REPO}:Q2_K", ("no file for tag 'Q2_K'", "Q4_K_M", "Q8_0")),
    (f"hf.co/{REPO}:Nope.gguf", ("no model file 'Nope.gguf'",)),
    ("hf.co/org/../etc", ("not a Hugging Face repository id",)),
    ("hf.co/org/x\x1b[2J", ("control characters",)),
    (f"hf.co/{REPO}:../../x.gguf", ("not a plain relative path",)),
    ("hf.co/org/a/b", ("not a Hugging Face repository id",)),
])
def test_bad_names_and_missing_repositories_are_one_line(hub, monkeypatch, capsys, name,
                                                         fragments):
    code, _, err = run_cli(monkeypatch, capsys, "pull", name)
    assert_one_line_error(code, err, *fragments)


def test_a_tag_matching_several_models_names_them(hub, files, monkeypatch, capsys):
    hub.add("org/Two-GGUF", {"a-7b.Q4_K_M.gguf": files["Tiny-Q4_K_M.gguf"],
                             "a-13b.Q4_K_M.gguf": files["Tiny-Q8_0.gguf"]})
    code, _, err = run_cli(monkeypatch, capsys, "pull", "hf.co/org/Two-GGUF:Q4_K_M")
    assert_one_line_error(code, err, "matches 2 models", "a-7b.Q4_K_M.gguf", "a-13b.Q4_K_M.gguf")
    code, _, err = run_cli(monkeypatch, capsys, "pull", "hf.co/org/Two-GGUF:a-7b.Q4_K_M.gguf")
    assert code == 0, err


def test_unreachable_hub_is_one_line(hub, monkeypatch, capsys):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    code, _, err = run_cli(monkeypatch, capsys, "pull", REPO)
    assert_one_line_error(code, err, "cannot reach http://127.0.0.1:9")


def test_tampered_and_truncated_cache_files_are_refused_then_repaired(hub, files, tmp_path,
                                                                      monkeypatch, capsys):
    assert run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q8_0")[0] == 0
    assert run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q4_K_M")[0] == 0
    other = (snapshot(tmp_path) / "Tiny-Q4_K_M.gguf").resolve()
    other_stat = other.stat()
    blob = (snapshot(tmp_path) / "Tiny-Q8_0.gguf").resolve()
    st = blob.stat()
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size, same mtime: only the ctime tells
    blob.write_bytes(bytes(data))
    os.utime(blob, ns=(st.st_atime_ns, st.st_mtime_ns))
    code, _, err = run_cli(monkeypatch, capsys, "run", f"{REPO}:Q8_0", "the", "-n", "2")
    assert_one_line_error(code, err, "sha256", f"localllm pull hf.co/{REPO}:Q8_0")
    code, _, err = run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q8_0")  # repairs it
    assert code == 0, err
    assert (snapshot(tmp_path) / "Tiny-Q8_0.gguf").read_bytes() == files["Tiny-Q8_0.gguf"]
    blob = (snapshot(tmp_path) / "Tiny-Q8_0.gguf").resolve()
    with open(blob, "r+b") as f:
        f.truncate(1000)
    code, _, err = run_cli(monkeypatch, capsys, "run", f"{REPO}:Q8_0", "the", "-n", "2")
    assert_one_line_error(code, err, "has 1000 bytes", "localllm pull")
    # the other model was never touched
    assert other.stat().st_mtime_ns == other_stat.st_mtime_ns
    assert other.read_bytes() == files["Tiny-Q4_K_M.gguf"]


def test_a_snapshot_link_out_of_the_cache_is_refused(hub, files, tmp_path, monkeypatch, capsys):
    assert run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q8_0")[0] == 0
    outside = tmp_path / "outside.gguf"
    outside.write_bytes(files["Tiny-Q8_0.gguf"])
    link = snapshot(tmp_path) / "Tiny-Q8_0.gguf"
    link.unlink()
    link.symlink_to(outside)
    code, _, err = run_cli(monkeypatch, capsys, "run", f"{REPO}:Q8_0", "the", "-n", "2")
    assert_one_line_error(code, err, "links outside the cache's blobs folder")


def test_a_read_only_cache_is_one_line(hub, tmp_path, monkeypatch, capsys):
    if os.geteuid() == 0:
        pytest.skip("root writes through read-only permissions")
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf").chmod(0o555)
    try:
        code, _, err = run_cli(monkeypatch, capsys, "pull", REPO)
    finally:
        (tmp_path / "hf").chmod(0o755)
    assert_one_line_error(code, err, "cannot write to the Hugging Face cache")


def test_a_cache_that_cannot_be_created_is_one_line(hub, tmp_path, monkeypatch, capsys):
    (tmp_path / "file").write_text("")  # root or not, no directory can be made under a file
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "file" / "hub"))
    code, _, err = run_cli(monkeypatch, capsys, "pull", REPO)
    assert_one_line_error(code, err, "cannot write to the Hugging Face cache", "Not a directory")


def test_a_full_disk_is_one_line_and_leaves_nothing(hub, tmp_path):
    """The file size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes writes fail with EFBIG
    past 100 kB, as a full disk makes them fail with ENOSPC."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "hf"),
               LOCALLLM_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))

    child = ("import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
             "resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000)); "
             "from localllm.cli import main; main()")
    done = subprocess.run([sys.executable, "-c", child, "pull", REPO], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    assert_one_line_error(done.returncode, done.stderr, "cannot write to the Hugging Face cache",
                          "File too large")
    assert blobs(tmp_path) == []


def test_two_concurrent_pulls_download_once(hub, files, tmp_path, monkeypatch):
    from localllm.stores import huggingface

    hub.slow["Tiny-Q8_0.gguf"] = 0.002
    results, errors = [], []

    def pull():
        try:
            results.append(huggingface.pull_model(huggingface.parse(f"{REPO}:Q8_0"),
                                                  progress=False))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=pull) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert [r.path.read_bytes() == files["Tiny-Q8_0.gguf"] for r in results] == [True, True]
    assert len(hub.gets("Tiny-Q8_0.gguf")) == 1


def test_stale_incomplete_downloads_are_removed(hub, files, tmp_path, monkeypatch, capsys):
    sha = hashlib.sha256(files["Tiny-Q8_0.gguf"]).hexdigest()
    folder = tmp_path / "hf" / "models--org--Tiny-GGUF" / "blobs"
    folder.mkdir(parents=True)
    (folder / f"{sha}.0badf00d.incomplete").write_bytes(b"x" * 100)  # a SIGKILLed pull's
    assert run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q8_0")[0] == 0
    assert blobs(tmp_path) == [sha]


def test_ctrl_c_mid_download_leaves_nothing_then_pulls(hub, files, tmp_path):
    hub.add("org/Big-GGUF", {"Big-Q4_K_M.gguf": os.urandom(BIG)})
    hub.slow["Big-Q4_K_M.gguf"] = 0.01  # about 30 s for the whole file
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    env.update(HF_ENDPOINT=hub.url, HF_HUB_CACHE=str(tmp_path / "hf"),
               LOCALLLM_CACHE=str(tmp_path / "cache"), HOME=str(tmp_path / "home"))
    # a test runner may start us with SIGINT ignored, which the child would inherit
    child = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "from localllm.cli import main; main()")
    proc = subprocess.Popen([sys.executable, "-c", child, "pull", "hf.co/org/Big-GGUF"], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = tmp_path / "hf" / "models--org--Big-GGUF" / "blobs"
    deadline = time.monotonic() + 120
    while not (folder.exists() and any(folder.iterdir())) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1] == "interrupted"
    assert list(folder.iterdir()) == []  # no partial file, nothing under the blob's name
    assert not (tmp_path / "hf" / "models--org--Big-GGUF" / "snapshots").exists() or not any(
        (tmp_path / "hf" / "models--org--Big-GGUF" / "snapshots").rglob("*.gguf"))


def test_models_lists_pulled_repositories_and_rm_removes_them(hub, tmp_path, monkeypatch,
                                                              capsys):
    assert run_cli(monkeypatch, capsys, "pull", f"{REPO}:Q8_0")[0] == 0
    assert run_cli(monkeypatch, capsys, "pull", f"{REPO}:F16")[0] == 0
    code, out, _ = run_cli(monkeypatch, capsys, "models")
    assert code == 0
    assert f"hf.co/{REPO}:Q8_0" in out and f"hf.co/{REPO}:F16" in out and "+2 parts" in out
    code, out, err = run_cli(monkeypatch, capsys, "rm", f"hf.co/{REPO}:F16")
    assert code == 0, err
    assert "3 files" in out
    assert len(blobs(tmp_path)) == 1  # the Q8_0 file stays
    code, _, err = run_cli(monkeypatch, capsys, "rm", f"hf.co/{REPO}:F16")
    assert_one_line_error(code, err, "not in the Hugging Face cache")
