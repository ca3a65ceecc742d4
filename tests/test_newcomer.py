"""What a newcomer hits first (issue 13): usage errors, --help, a light start.

Usage errors (unknown flag, bad value, missing value) are one ``error:`` line and exit 1 on
every command, whatever typer version (typer >= 0.28 vendors click as ``typer._click``).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer.main
from cli_helpers import assert_one_line_error, run_cli

from localllm.cli.app import _plain_metavars, app


def _commands() -> dict:
    group = typer.main.get_command(app)
    _plain_metavars(group)
    return group.commands


def _value_options(command) -> list:
    return [p for p in command.params
            if p.param_type_name == "option" and not getattr(p, "is_flag", False)]


COMMANDS = sorted(_commands())
NUMERIC = {name: next((p for p in _value_options(cmd) if p.metavar == "N"), None)
           for name, cmd in _commands().items()}
VALUED = {name: next(iter(_value_options(cmd)), None) for name, cmd in _commands().items()}


def test_every_command_is_covered():
    assert {"run", "chat", "info", "tokenize", "models", "bench", "quantize",
            "perplexity"} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_flag_is_one_error_line(monkeypatch, capsys, command):
    code, out, err = run_cli(monkeypatch, capsys, command, "--no-such-flag")
    assert_one_line_error(code, err, "--no-such-flag", f"localllm {command}")
    assert code == 1 and out == ""


@pytest.mark.parametrize("command", [c for c in COMMANDS if NUMERIC[c] is not None])
def test_bad_value_is_one_error_line(monkeypatch, capsys, command):
    flag = NUMERIC[command].opts[0]
    code, out, err = run_cli(monkeypatch, capsys, command, flag, "abc")
    assert_one_line_error(code, err, flag)
    assert code == 1 and out == ""


@pytest.mark.parametrize("command", [c for c in COMMANDS if VALUED[c] is not None])
def test_missing_value_is_one_error_line(monkeypatch, capsys, command):
    flag = VALUED[command].opts[0]
    code, out, err = run_cli(monkeypatch, capsys, command, flag)
    assert_one_line_error(code, err, flag)
    assert code == 1 and out == ""


@pytest.mark.parametrize("args, fragment", [
    (["run", "hi", "--temp", "abc"], "--temp"), (["run", "hi", "-n", "abc"], "-n"),
    (["perplexity", "--chunks", "x"], "--chunks"), (["nosuch"], "nosuch"),
    (["quantize", "only-input"], "OUTPUT"), (["tokenize", "a", "b", "c"], "extra argument"),
])
def test_usage_errors_from_the_issue(monkeypatch, capsys, args, fragment):
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert_one_line_error(code, err, fragment)
    assert code == 1


def test_no_arguments_prints_help_and_succeeds(monkeypatch, capsys):
    code, out, err = run_cli(monkeypatch, capsys, "run")
    assert code == 0 and "Usage" in out + err and "Traceback" not in err


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_no_type_tags(monkeypatch, capsys, command):
    code, out, _ = run_cli(monkeypatch, capsys, command, "--help")
    assert code == 0 and "Usage" in out
    for tag in ("<bool>", "<int>", "<float>", "<str>", "<path>", "<list[str]>", "BOOLEAN"):
        assert tag not in out, (tag, out)


def test_spelled_out_constants_agree_with_the_library():
    from localllm.cli.perplexity import DEFAULT_KL_TOP_K
    from localllm.cli.quantize import TYPE_NAMES
    from localllm.eval.kld import DEFAULT_TOP_K
    from localllm.quantize.recipe import FILE_TYPES

    assert DEFAULT_KL_TOP_K == DEFAULT_TOP_K
    assert TYPE_NAMES == ", ".join(FILE_TYPES)


def test_building_the_cli_imports_no_torch():
    """`localllm --help` must start fast: the CLI imports torch (and numpy, jinja2, gguf)
    only inside the commands that need them."""
    code = ("import sys, typer.main; from localllm.cli import app; typer.main.get_command(app); "
            "print(sorted(m for m in ('torch', 'numpy', 'jinja2', 'gguf') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"
