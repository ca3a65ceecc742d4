"""Writing output files so that a failure or an interrupt leaves nothing behind."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import LocalLLMError


@contextmanager
def atomic_output(path: str | os.PathLike, label: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; it replaces ``path`` when the block ends.

    On any failure (an exception, Ctrl-C, SIGTERM turned into SystemExit) the temporary file
    is removed and ``path`` is untouched.

    Args:
        label: what names the file in errors (a flag such as ``--plot``), or "".
    Raises:
        LocalLLMError: writing failed (``OSError``): "<label> <path>: cannot write: <reason>".
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        where = f"{label} {path}" if label else str(path)
        raise LocalLLMError(f"{where}: cannot write: {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
