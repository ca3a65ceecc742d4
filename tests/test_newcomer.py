"""What a newcomer hits first (issue 13).

- Usage errors (unknown flag, bad value, missing value) are one ``error:`` line and exit 1 on
  every command, whatever typer version (typer >= 0.28 vendors click as ``typer._click``);
  ``--help`` has no type tags and marks the default model's sampling defaults.
- Building the CLI imports no torch; the assembled default model's path is remembered.
- ``run``: ``-n 0`` generates nothing, a newline ends the text on a terminal and before
  ``--verbose``'s lines, which include llama.cpp's ``sampler chain:``.
- ``info`` names the file type, ``quantize`` takes model names, ``tokenize -f``,
  ``perplexity --compare`` plots only with ``--plot``, points sorted by bits per weight.
- Progress on a terminal only; the synthetic writer checks memory and disk and streams.
(The wheel install is tests/test_wheel.py; the one decode loop is in tests/test_repl.py.)
"""

from __future__ import annotations

import json
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
    # `localllm` alone; a command without its arguments is a usage error
    # (tests/test_hostile_files.py)
    code, out, err = run_cli(monkeypatch, capsys)
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


# ---- run: -n 0, newlines, --verbose ---------------------------------------------------------
def test_n_predict_zero_generates_nothing(monkeypatch, capsys, tiny_model_path):
    path = str(tiny_model_path("llama"))
    code, out, err = run_cli(monkeypatch, capsys, "run", path, "the", "-n", "0", "--temp", "0")
    assert code == 0 and out == "", err
    code, out, _ = run_cli(monkeypatch, capsys, "run", path, "the", "-n", "1", "--temp", "0")
    assert code == 0 and out  # one token does print


def test_verbose_prints_the_effective_sampler_chain(monkeypatch, capsys, tiny_model_path):
    code, _, err = run_cli(monkeypatch, capsys, "run", str(tiny_model_path("llama")), "the",
                           "-n", "2", "--verbose", "--seed", "3", "--top-k", "5",
                           "--samplers", "top_k;temperature", "-l", "5+1")
    assert code == 0, err
    lines = err.splitlines()
    assert "sampler seed: 3" in lines
    assert any(x.startswith("sampler params: ") and "top_k = 5" in x for x in lines)
    assert "sampler chain: logits -> logit-bias -> top-k -> temp-ext -> dist" in lines


def _cli_process(args, **kw):
    return subprocess.run([sys.executable, "-c", "from localllm.cli import main; main()", *args],
                          check=False, **kw)


def test_verbose_lines_never_glue_onto_the_text(tiny_model_path):
    """`run -v ... 2>&1`: the text gets its own line before the timings."""
    proc = _cli_process(["run", str(tiny_model_path("llama")), "the", "-n", "6", "--temp",
                         "0", "--verbose", "--device", "cpu"],
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout
    lines = proc.stdout.splitlines()
    for label in ("sampler seed:", "sampler chain:", "load time", "prompt eval time"):
        assert any(x.lstrip().startswith(label) for x in lines), (label, proc.stdout)
    assert not any(label in x and not x.lstrip().startswith(label)
                   for x in lines for label in ("load time", "sampler seed:")), proc.stdout


def test_run_ends_with_a_newline_on_a_terminal(tiny_model_path):
    import os
    import pty

    master, slave = pty.openpty()
    try:
        proc = _cli_process(["run", str(tiny_model_path("llama")), "the", "-n", "6", "--temp",
                             "0"], stdout=slave, stderr=subprocess.DEVNULL, timeout=300)
        os.close(slave)
        data = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the writer is gone
                break
            if not chunk:
                break
            data += chunk
    finally:
        os.close(master)
    assert proc.returncode == 0
    assert data.strip() and data.endswith(b"\n"), data


# ---- --help shows the model's defaults -------------------------------------------------------
def test_help_shows_the_default_models_sampling_defaults(monkeypatch, capsys):
    from localllm.registry import load_registry

    reg = load_registry()
    own = reg.models[reg.default].sampling
    assert own  # models.toml gives the default model its own sampling defaults
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(monkeypatch, capsys, "run", "--help")
    assert code == 0 and "Sampling defaults" in out
    assert f"{reg.default}: {own['temp']})" in out  # on the --temp line
    code, out, _ = run_cli(monkeypatch, capsys, "chat", "--help")
    assert code == 0 and f"{reg.default}: {own['top_k']})" in out


# ---- info, quantize, tokenize, perplexity ---------------------------------------------------
def test_quantize_by_model_name_and_info_names_the_file_type(monkeypatch, capsys, tmp_path,
                                                              tiny_model_path):
    src = tiny_model_path("llama")
    registry = tmp_path / "models.toml"
    registry.write_text(f'[models.tiny-f16]\npath = "{src}"\n')
    monkeypatch.setenv("LOCALLLM_MODELS", str(registry))
    out_file = tmp_path / "tiny-q8.gguf"
    code, _, err = run_cli(monkeypatch, capsys, "quantize", "tiny-f16", str(out_file),
                           "--type", "Q8_0")
    assert code == 0 and out_file.is_file(), err
    monkeypatch.setenv("COLUMNS", "200")
    code, out, _ = run_cli(monkeypatch, capsys, "info", str(out_file))
    assert code == 0 and "file type Q8_0" in out and "file type 7" not in out


def test_file_type_names():
    from localllm.cli.info import file_type_name

    assert file_type_name(15) == "Q4_K_M" and file_type_name(1) == "F16"
    assert file_type_name(0) == "F32" and file_type_name(None) == "?"
    assert file_type_name(9999) == "9999 (unknown)"


def test_tokenize_reads_a_file(monkeypatch, capsys, tmp_path, tiny_model_path):
    path = str(tiny_model_path("gemma3"))
    f = tmp_path / "text.txt"
    f.write_text("the and")
    code, out_file, _ = run_cli(monkeypatch, capsys, "tokenize", path, "-f", str(f))
    code2, out_arg, _ = run_cli(monkeypatch, capsys, "tokenize", path, "the and")
    assert code == code2 == 0 and out_file == out_arg and out_arg.startswith("[2,")
    code, _, err = run_cli(monkeypatch, capsys, "tokenize", path, "x", "-f", str(f))
    assert_one_line_error(code, err, "TEXT", "-f")


def test_compare_writes_a_plot_only_when_asked_sorted_by_bpw(monkeypatch, capsys, workdir,
                                                              tiny_model_path):
    from localllm.quantize.convert import quantize_gguf

    src = tiny_model_path("llama", d_model=256, n_heads=4, head_dim=64, ffn_dim=512,
                          context_length=64)
    q4, q8 = workdir / "m-Q4_0.gguf", workdir / "m-Q8_0.gguf"
    quantize_gguf(src, q8, "Q8_0")
    quantize_gguf(src, q4, "Q4_0")
    text = workdir / "text.txt"
    text.write_text(" ".join(["the sand and the tale of the"] * 40))
    before = sorted(p.name for p in workdir.iterdir())
    args = ["perplexity", "-f", str(text), "--compare", str(q8), str(q4), "-c", "16", "-b",
            "16", "--chunks", "1", "--device", "cpu"]
    code, _, err = run_cli(monkeypatch, capsys, *args)
    assert code == 0, err
    assert sorted(p.name for p in workdir.iterdir()) == before  # no PNG unasked
    pytest.importorskip("matplotlib")
    from PIL import Image

    plot = workdir / "cmp.png"
    code, _, err = run_cli(monkeypatch, capsys, *args, "--plot", str(plot))
    assert code == 0, err
    points = Image.open(plot).text["Description"].removeprefix("bpw,ppl: ").split()
    bpw = [float(p.split(",")[0]) for p in points]
    assert len(bpw) == 2 and bpw == sorted(bpw)  # Q8_0 was given first
    code, _, err = run_cli(monkeypatch, capsys, "perplexity", "-f", str(text), "--plot", "x.png")
    assert_one_line_error(code, err, "--compare")


# ---- start-up: the assembled default model is not hashed on every run ---------------------
def test_assembled_path_is_remembered_until_the_file_changes(monkeypatch, tmp_path):
    import os

    from localllm.registry import load_registry

    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF model bytes")
    calls = tmp_path / "calls"
    (tmp_path / "assembler_probe.py").write_text(
        "from pathlib import Path\n"
        "def assemble():\n"
        f"    with open({str(calls)!r}, 'a') as f:\n"
        "        f.write('x')\n"
        f"    return Path({str(model)!r})\n")
    dist = tmp_path / "assembler_probe-1.0.dist-info"  # an installed distribution owns it
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: assembler-probe\nVersion: 1.0\n"
                                   "Keywords: llm,gguf\n")  # it ships a GGUF model
    (dist / "RECORD").write_text("assembler_probe.py,,\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    registry = tmp_path / "models.toml"
    registry.write_text('[models.probe]\npackage = "assembler-probe"\n'
                        'assembler = "assembler_probe:assemble"\n')
    reg = load_registry([registry])
    for _ in range(3):
        assert reg.resolve("probe")[0] == model
    assert calls.read_text() == "x"  # assembled (and checked) once, then remembered
    os.utime(model, ns=(1, 1))  # the file changed: assemble (and check) again
    assert reg.resolve("probe")[0] == model and calls.read_text() == "xx"
    assert reg.resolve("probe")[0] == model and calls.read_text() == "xx"


# ---- long work shows progress (on a terminal only); the synthetic writer is bounded ---------
def _read_pty(master) -> bytes:
    import os

    data = b""
    while True:
        try:
            chunk = os.read(master, 65536)
        except OSError:  # EIO: the writer is gone
            return data
        if not chunk:
            return data
        data += chunk


def test_bench_shows_its_steps_on_a_terminal(tiny_model_path):
    import os
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", "from localllm.cli import main; main()", "bench",
             str(tiny_model_path("llama")), "-p", "16", "-n", "2", "-r", "2", "--device", "cpu",
             "--no-llama-cpp", "--json"], stdout=subprocess.PIPE, stderr=slave)
        os.close(slave)
        err = _read_pty(master)
        out, _ = proc.communicate(timeout=300)
    finally:
        os.close(master)
    assert proc.returncode == 0, err
    assert b"loading the model" in err or b"localllm: pp16" in err, err
    assert json.loads(out)["tg"] > 0  # stdout: the figures only


def test_bench_progress_stays_off_a_pipe(monkeypatch, capsys, tiny_model_path):
    code, out, err = run_cli(monkeypatch, capsys, "bench", str(tiny_model_path("llama")), "-p",
                             "16", "-n", "2", "-r", "1", "--device", "cpu", "--no-llama-cpp",
                             "--json")
    assert code == 0 and json.loads(out)["tg"] > 0
    assert "loading the model" not in err and "localllm: pp" not in err


def _medium_geometry():
    import dataclasses

    from localllm.models.geometries import GEOMETRIES

    return dataclasses.replace(
        GEOMETRIES["llama3-8b"], name="medium-llama", n_vocab=1024, n_layers=6, d_model=1024,
        n_heads=8, n_kv_heads=2, head_dim=128, ffn_dim=4096, context_length=256)


def test_synthetic_writer_streams_tensors_with_progress(tmp_path):
    import tracemalloc

    from localllm.models.synthetic import planned_tensors, write_synthetic

    g = _medium_geometry()
    tensors = planned_tensors(g, "Q8_0")
    total = sum(t.n_bytes for t in tensors)
    seen: list[tuple[int, int]] = []
    tracemalloc.start()
    try:
        path = write_synthetic(tmp_path / "m.gguf", g, "Q8_0",
                               progress=lambda done, n: seen.append((done, n)))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(seen) == len(tensors) and seen[-1] == (total, total)
    assert [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert path.stat().st_size >= total
    # one tensor at a time: far less than the file (the largest tensor is ~4.5 MB of ~110 MB)
    assert peak < total / 3, (peak, total)


def test_synthetic_refuses_before_writing(tmp_path):
    import dataclasses

    import torch

    from localllm.errors import LocalLLMError
    from localllm.eval.bench import check_synthetic_memory
    from localllm.models.geometries import GEOMETRIES
    from localllm.models.synthetic import (
        check_disk,
        planned_tensors,
        synthetic_model,
    )

    with pytest.raises(LocalLLMError, match="of disk but"):
        check_disk(tmp_path / "x.gguf", 2**60)
    huge = dataclasses.replace(GEOMETRIES["llama3-8b"], n_layers=512)  # ~240 GB of float16
    with pytest.raises(LocalLLMError, match="nothing was written"):
        check_synthetic_memory(huge, planned_tensors(huge, "Q4_K_M"), torch.device("cpu"), 512)

    def refuse(geometry, tensors):
        raise LocalLLMError(f"refused {geometry.name} ({len(tensors)} tensors)")

    with pytest.raises(LocalLLMError, match="refused gemma3-270m"):
        synthetic_model("gemma3-270m", "Q8_0", cache_dir=tmp_path, before_write=refuse)
    assert list(tmp_path.iterdir()) == []


def test_cpu_load_imports_no_triton(tiny_model_path):
    """A CPU load (native kernels, or the torch path without a compiler) does not pay for
    importing Triton at start-up."""
    code = ("import sys; from localllm import LLM; "
            f"llm = LLM({str(tiny_model_path('llama'))!r}, device='cpu'); "
            "print(llm.loaded.backend, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    backend, triton_imported = out.split()
    assert backend in ("native", "torch") and triton_imported == "False"
