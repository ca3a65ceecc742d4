"""Integrity of model files in caches and stores: content hashes checked on first use and
remembered as *stamps*, records written so that they never follow a symlink.

A stamp is what ``fstat`` says of the file whose hash was checked: device, inode, size, mtime
and ctime. Any change of them makes the next use hash the file again: a file replaced by
another (a new inode), truncated or extended (size), or rewritten in place — even with its
mtime set back by ``utime``, which itself moves the ctime, and ctime cannot be set by a user.
Hashing reads the file through the descriptor the stamp came from, opened with
``O_NOFOLLOW``, so what was hashed is what was stamped.

Records are small JSON files. :func:`write_record` creates a fresh temporary file with
``O_CREAT | O_EXCL | O_NOFOLLOW`` and renames it over the record: a symlink planted at the
record's name is replaced, never written through.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from pathlib import Path

from ..errors import CorruptModelError

CHUNK = 1 << 20
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_SHOW_PROGRESS_BYTES = 64 << 20  # smaller files hash in well under a second


def stamp_of(st: os.stat_result) -> dict:
    """The fields of ``st`` that change whenever a file's content may have changed."""
    return {"dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns}


def open_regular(path: Path) -> int:
    """A read-only descriptor of ``path``, which must be a regular file and not a symlink.

    Raises:
        FileNotFoundError: no such file.
        CorruptModelError: a symlink, or not a regular file.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError as e:
        if isinstance(e, FileNotFoundError):
            raise
        if os.path.islink(path):
            raise CorruptModelError(f"{path} is a symbolic link: a cached model must be a "
                                    "regular file") from None
        raise CorruptModelError(f"cannot read {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CorruptModelError(f"{path} is not a regular file")
    return fd


def hash_fd(fd: int, *, algorithm: str = "sha256", git_blob: bool = False,
            label: str | None = None) -> str:
    """Hex digest of the whole file behind ``fd`` (read from offset 0).

    Args:
        algorithm: a :mod:`hashlib` name.
        git_blob: hash as git does a blob (``"blob <size>\\0"`` + content; sha1 for the Hub's
            non-LFS files).
        label: shown on a progress bar on stderr (a terminal only) for files over 64 MiB.
    """
    size = os.fstat(fd).st_size
    h = hashlib.new(algorithm)
    if git_blob:
        h.update(b"blob %d\0" % size)
    offset = 0
    bars = transfer_bars(show=label is not None and size >= _SHOW_PROGRESS_BYTES, transient=True)
    with bars:
        task = bars.add_task(label or "", total=size)
        while chunk := os.pread(fd, CHUNK, offset):
            h.update(chunk)
            offset += len(chunk)
            bars.advance(task, len(chunk))
    return h.hexdigest()


def transfer_bars(*, show: bool = True, transient: bool = False):
    """rich progress bars for byte transfers (description, bar, bytes, speed, time left) on
    stderr, drawn only where stderr is a terminal and ``show`` is set."""
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
    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=console,
                    disable=not (show and console.is_terminal), transient=transient)


def read_record(path: Path, limit: int = 1 << 16) -> dict | None:
    """The JSON object in ``path`` (not followed if a symlink), or None when it is missing,
    unreadable, oversized or not a JSON object."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except OSError:
        return None
    try:
        data = os.read(fd, limit + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > limit:
        return None
    try:
        value = json.loads(data)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def write_record(path: Path, value: dict) -> bool:
    """Write ``value`` as JSON to ``path`` through a new temporary file renamed over it (a
    symlink at ``path`` is replaced, not followed). Best effort: False when the directory is
    read-only or full (the file is then only hashed again next time)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
        try:
            os.write(fd, json.dumps(value).encode())
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return False
    return True


def verify_file(path: Path, *, digest: str, record: Path, fix: str, algorithm: str = "sha256",
                git_blob: bool = False, label: str | None = None) -> None:
    """Check that ``path`` (a regular file, not a symlink) hashes to ``digest``, unless
    ``record`` holds the stamp of that same file checked against that digest.

    Args:
        record: where the stamp of the last successful check lives (written on success).
        fix: what the user can do, appended to the error (``run `localllm pull --force NAME```).
        algorithm / git_blob / label: see :func:`hash_fd`.
    Raises:
        FileNotFoundError: ``path`` does not exist.
        CorruptModelError: a symlink or not a regular file, or the digest differs.
    """
    fd = open_regular(path)
    try:
        stamp = {**stamp_of(os.fstat(fd)), "path": str(path), "digest": digest.lower(),
                 "algorithm": algorithm + ("-git-blob" if git_blob else "")}
        if read_record(record) == stamp:
            return
        got = hash_fd(fd, algorithm=algorithm, git_blob=git_blob, label=label)
    finally:
        os.close(fd)
    if got != digest.lower():
        raise CorruptModelError(f"{path} fails its {algorithm} check (expected "
                                f"{digest[:12]}..., got {got[:12]}...): {fix}")
    write_record(record, stamp)


def record_for(root: Path, path: Path, digest: str) -> Path:
    """The stamp record, under ``root``, of a file outside localllm's own cache (a read-only
    store's blob): named by the digest and the path, so a blob seen at two places has two."""
    where = hashlib.sha256(str(path).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return root / "verified" / f"{digest.lower()[:64]}-{where}.json"


__all__ = ["CHUNK", "hash_fd", "open_regular", "read_record", "record_for", "stamp_of",
           "verify_file", "write_record"]
