"""A wheel install has its registry and grammars (package data through importlib.resources).

The test builds the wheel from a copy of the source tree, installs it with ``--no-deps`` into
a fresh venv whose only other path is this environment's site-packages (for torch and the
other dependencies; its .pth files, the editable install among them, are not processed),
and runs the installed ``localllm`` from outside the checkout.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _run(args, **kw):
    return subprocess.run(args, check=False, capture_output=True, text=True, timeout=600, **kw)


def test_wheel_ships_models_toml_and_grammars(tmp_path):
    src = tmp_path / "src"
    keep = {"localllm", "kernels", "grammars", "models.toml", "pyproject.toml", "README.md"}
    src.mkdir()
    for name in keep:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, symlinks=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    wheels = tmp_path / "wheels"
    # this environment's setuptools when it has one (no download); else pip fetches it
    offline = ["--no-build-isolation"] if importlib.util.find_spec("setuptools") else []
    r = _run([sys.executable, "-m", "pip", "wheel", "--no-deps", *offline, "-q",
              "-w", str(wheels), str(src)])
    assert r.returncode == 0, r.stderr
    (wheel,) = wheels.glob("localllm-*.whl")

    venv = tmp_path / "venv"
    r = _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    assert r.returncode == 0, r.stderr
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
                     ).stdout.strip())
    (site / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")  # torch & co
    r = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
              "-q", str(wheel)])
    assert r.returncode == 0, r.stderr

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LOCALLLM_MODELS")}
    env.update(COLUMNS="200", XDG_CONFIG_HOME=str(tmp_path / "config"))
    r = _run([str(venv / "bin" / "localllm"), "models"], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    assert "gemma3-270m" in r.stdout and "(default)" in r.stdout

    code = ("import localllm, localllm.data as d; "
            "from localllm.grammar.constraint import resolve_grammar_file as g; "
            "print(localllm.__file__); print(g('yes_no')); print(d.MODELS_TOML)")
    r = _run([str(python), "-c", code], cwd=tmp_path, env=env)
    assert r.returncode == 0, r.stderr
    module, grammar, registry = (Path(line) for line in r.stdout.split())
    assert module.is_relative_to(site)  # the installed wheel, not the checkout
    assert grammar.is_relative_to(site) and grammar.read_text().strip()
    assert registry.is_relative_to(site) and "gemma3-270m" in registry.read_text()


def test_every_package_is_listed_for_the_wheel():
    """A subpackage missing from pyproject's list installs from a checkout but not from the
    wheel (``localllm.tokenizer`` once did): every folder with an ``__init__.py`` is listed."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "localllm").rglob("__init__.py")}
    found |= {"localllm.kernels"}  # kernels/ is installed as localllm.kernels
    assert found <= listed, sorted(found - listed)
