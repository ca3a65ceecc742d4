"""The tree is ruff-clean under the project's configuration (``[tool.ruff]`` in pyproject.toml)."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed (it is in the [test] extra)")
    res = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "."],
                         cwd=REPO, capture_output=True, text=True, check=False, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
