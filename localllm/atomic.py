"""Files we write and files we read as data: checked before use, written atomically.

Outputs (``--prompt-cache``, ``quantize`` OUT, ``--kl-divergence-base``, ``--plot``, chat's
``/save``) are written only to regular files or new paths: a device node, a FIFO, a socket, a
directory, or a symbolic link that leads out of its own directory is refused before anything
is written (the atomic rename would otherwise replace ``/dev/null`` itself when run as root,
or turn a FIFO into a regular file). Data files read whole (a prompt cache, a KL-divergence
base, ``models.toml``) are opened with ``O_NONBLOCK`` and their type checked first, so a
FIFO with no writer is refused instead of blocking ``open()``.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import LocalLLMError


def _where(path: os.PathLike | str, label: str) -> str:
    return f"{label} {path}" if label else str(path)


def _kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a regular file"


def check_output_path(path: str | os.PathLike, label: str = "") -> Path:
    """The path to write for ``path``, refused before any work if it is not a regular file
    or a new name in an existing directory.

    A symbolic link is followed when it points into its own directory (the file it names is
    replaced and the link kept); a link anywhere else is refused, as are device nodes, FIFOs,
    sockets and directories (``os.replace`` would swap the node itself for a regular file).

    Returns:
        the path to write (the link's target where ``path`` is such a link).
    Raises:
        LocalLLMError: "<label> <path>: is a FIFO (named pipe), not a regular file: refused"
            (and alike), or the directory does not exist.
    """
    path = Path(path)
    where = _where(path, label)
    target = path
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise LocalLLMError(f"{where}: cannot write: {e.strerror or e}") from None
    if st is not None and stat.S_ISLNK(st.st_mode):
        target = Path(os.path.realpath(path))
        if target.parent != Path(os.path.realpath(path.parent)):
            raise LocalLLMError(f"{where}: is a symbolic link out of its directory (to "
                                f"{target}): refused, name the file itself")
        try:
            st = os.stat(target)
        except FileNotFoundError:
            st = None  # a dangling link within the directory: its target is a new file
        except OSError as e:
            raise LocalLLMError(f"{where}: cannot write: {e.strerror or e}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise LocalLLMError(f"{where}: is {_kind(st.st_mode)}, not a regular file: refused")
    if st is None and not target.parent.is_dir():
        raise LocalLLMError(f"{where}: the directory {target.parent} does not exist")
    return target


def check_input_file(path: str | os.PathLike, label: str = "") -> int:
    """Check that ``path`` is a regular file that can be read, without blocking; returns its
    size in bytes.

    The file is opened with ``O_NONBLOCK`` (a FIFO with no writer would block ``open()``)
    and ``fstat``-ed before anything reads it.

    Raises:
        LocalLLMError: missing, unreadable, or not a regular file (a FIFO, a device, a socket,
            a directory).
    """
    where = _where(path, label)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise LocalLLMError(f"{where}: cannot read: {e.strerror or e}") from None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(st.st_mode):
        raise LocalLLMError(f"{where}: is {_kind(st.st_mode)}, not a regular file: refused")
    return st.st_size


def read_input_file(path: str | os.PathLike, limit: int, label: str = "") -> bytes:
    """The bytes of the regular file ``path``, at most ``limit`` of them.

    Raises:
        LocalLLMError: what :func:`check_input_file` refuses, or a file over ``limit`` bytes
            (checked before reading, and while reading: the file may grow).
    """
    where = _where(path, label)
    size = check_input_file(path, label)
    if size > limit:
        raise LocalLLMError(f"{where}: {size} bytes, more than the {limit} allowed")
    return read_bounded(path, limit, where)


def read_bounded(path: str | os.PathLike, limit: int, where: str, what: str = "") -> bytes:
    """At most ``limit`` bytes of ``path``, whatever it is: a size is not trusted, so a file
    that grows, a pipe or ``-f /dev/zero`` stop at the limit instead of filling memory.

    Args:
        where: how messages name the file (``-f prompt.txt``); what: what it is, after
            "cannot read" ("prompt file"), or empty.
    Raises:
        LocalLLMError: "<where>: cannot read[ <what>]: <reason>", or "<where>: longer than
            <limit>" (in MiB where ``limit`` is a whole number of them, else in bytes).
    """
    try:
        with open(path, "rb") as f:
            data = f.read(limit + 1)
    except OSError as e:
        reading = f"cannot read {what}" if what else "cannot read"
        raise LocalLLMError(f"{where}: {reading}: {e.strerror or e}") from None
    if len(data) > limit:
        amount = f"{limit >> 20} MiB" if limit and limit % (1 << 20) == 0 else f"{limit} bytes"
        raise LocalLLMError(f"{where}: longer than {amount}")
    return data


# The OS's words inside a Rust io::Error, as Display ("I/O error: File too large (os error
# 27)") or Debug ('Os { code: 28, kind: StorageFull, message: "No space left on device" }').
_RUST_IO = re.compile(r'I/O error: (.+?) \(os error \d+\)|message: "([^"]*)"')


def _reason(e: BaseException) -> str:
    """A write failure in a few words: ``OSError``'s strerror, or the OS message inside a
    Rust ``io::Error`` (safetensors' ``SafetensorError``), or the exception's text."""
    if isinstance(e, OSError):
        return e.strerror or str(e)
    text = " ".join(str(e).split())
    m = _RUST_IO.search(text)
    return (m.group(1) or m.group(2)) if m else (text[:200] or type(e).__name__)


@contextmanager
def atomic_output(path: str | os.PathLike, label: str = "",
                  errors: tuple[type[BaseException], ...] = ()) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; it replaces ``path`` when the block ends.

    ``path`` is checked first (:func:`check_output_path`: a device, FIFO, socket, directory
    or a symbolic link out of its directory is refused before anything is written; a link
    within its directory has its target replaced). On any failure (an exception, Ctrl-C,
    SIGTERM turned into SystemExit) the temporary file is removed and ``path`` is untouched.

    Args:
        label: what names the file in errors (a flag such as ``--plot``), or "".
        errors: the writer's own exception types for a failed write (``OSError`` always
            counts): safetensors' ``SafetensorError`` on a full disk, say.
    Raises:
        LocalLLMError: ``path`` refused, or writing failed: "<label> <path>: cannot write:
            <reason>".
    """
    target = check_output_path(path, label)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        check_output_path(path, label)  # again: the node may have changed while we wrote
        os.replace(tmp, target)
    except (OSError, *errors) as e:
        tmp.unlink(missing_ok=True)
        raise LocalLLMError(f"{_where(path, label)}: cannot write: {_reason(e)}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
