"""What reaches the terminal: names and metadata without control characters, and standard
streams that may be closed or full.

A GGUF file name, a ``general.name``, a models.toml key or note is data, not terminal
input: an escape sequence in it must not recolour, retitle or clear the terminal, and a
newline in it must not forge a second ``error:`` line. Tables (``models``, ``info``) drop
such characters (:func:`printable`); error and diagnostic lines show them escaped
(:func:`one_line`), so the user can still tell which file is meant.
"""

from __future__ import annotations

import os
import re
import sys

from rich.markup import escape

# C0/C1 control characters (escape sequences start with ESC or CSI), the line and paragraph
# separators, and the bidirectional overrides and isolates that reorder what a terminal shows.
_UNPRINTABLE = re.compile(
    r"[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: object) -> str:
    """``text`` safe for a terminal: control and bidi-override characters are dropped, tabs
    and newlines become spaces (a model's name or notes must not move the cursor, recolour
    or retitle the terminal)."""
    return _UNPRINTABLE.sub("", str(text).replace("\t", " ").replace("\n", " "))


def shown(text: object) -> str:
    """:func:`printable` and escaped for rich markup (``[bold]`` in a name stays text)."""
    return escape(printable(text))


def _escaped(m: re.Match) -> str:
    c = m.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(c) or (
        f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def one_line(text: object) -> str:
    """``text`` as one terminal line: every control, separator and bidi character is shown
    as its Python escape (``\\x1b``, ``\\n``, ``\\u202e``) instead of acting on the terminal."""
    return _UNPRINTABLE.sub(_escaped, str(text))


class LossyStream:
    """A standard stream (stderr) that drops what it cannot write.

    Diagnostics are not the command's output: with stderr on a full disk (``2>/dev/full``)
    or closed by its reader, losing them must not cost the user stdout's output or turn
    into a traceback. On the first failure the descriptor is pointed at ``/dev/null``
    (so the interpreter's flush at exit succeeds) and :attr:`failed` is set.
    """

    def __init__(self, stream) -> None:
        self._stream = stream
        self.failed = False

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except (OSError, ValueError):
            self._drop()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except (OSError, ValueError):
            self._drop()

    def _drop(self) -> None:
        self.failed = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
            self._stream.flush()  # what the buffer held goes to /dev/null now
        except (AttributeError, OSError, ValueError):  # no descriptor (a test's capture)
            pass

    def __getattr__(self, name: str):  # isatty, fileno, encoding ... of the real stream
        return getattr(self._stream, name)


def guard_standard_streams() -> object:
    """Make the standard streams safe to use, for the console entry point; returns what
    :func:`restore_standard_streams` needs to undo it.

    A descriptor 0-2 closed at start-up (``2>&-``) is opened on ``/dev/null``, so that no file
    the command opens later takes its number (native code, or Python's last-resort error
    printing, would write into it); Python set the stream to None: stdout and stderr become
    ``/dev/null`` streams (stdin stays None, so that reading it is a clear error). stderr
    becomes a :class:`LossyStream`.
    """
    saved = (sys.stdout, sys.stderr)
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))  # noqa: SIM115 - lives until exit
    sys.stderr = LossyStream(sys.stderr)
    return saved


def restore_standard_streams(saved: object) -> None:
    """Undo :func:`guard_standard_streams` (main() returning to a caller: tests)."""
    if isinstance(sys.stderr, LossyStream):
        sys.stderr.flush()
    sys.stdout, sys.stderr = saved  # type: ignore[misc]


def say(text: str) -> None:
    """One diagnostic line on stderr, control characters shown escaped (:func:`one_line`):
    a file name with an escape sequence or a newline must not act on the terminal or forge
    a line."""
    print(one_line(text), file=sys.stderr, flush=True)
