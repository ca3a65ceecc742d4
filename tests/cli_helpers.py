"""Running the CLI in-process from tests, and checking its one-line errors."""

from __future__ import annotations

import io
import sys

from localllm.cli.app import main


def run_cli(monkeypatch, capsys, *args: str, stdin: str | None = None):
    """Run ``localllm ARGS`` in-process; returns (exit code, stdout, stderr)."""
    monkeypatch.setattr(sys, "argv", ["localllm", *args])
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    code = 0
    try:
        main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *fragments: str) -> None:
    """A non-zero exit and exactly one stderr line (blank lines count), ``error: ...``,
    containing every fragment."""
    assert code != 0
    lines = err.rstrip("\n").split("\n")
    assert len(lines) == 1 and lines[0].startswith("error: "), repr(err)
    assert "Traceback" not in err
    for f in fragments:
        assert f in lines[0], (f, lines[0])
