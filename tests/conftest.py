"""Shared fixtures: the real default model (loaded once) and tiny random models."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# llama.cpp's reference outputs for the default model, recorded by
# tests/data/reference/record.py (LOCALLLM_REFERENCE_DIR points elsewhere).
REFERENCE_DIR = Path(os.environ.get(
    "LOCALLLM_REFERENCE_DIR",
    Path(__file__).resolve().parent / "data" / "reference" / "gemma3-270m-q4_k_m"))
# The default model by name, or the path of its GGUF file (LOCALLLM_TEST_MODEL).
DEFAULT_MODEL = os.environ.get("LOCALLLM_TEST_MODEL", "gemma3-270m")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def native_cpu_kernels():
    """Build the native CPU kernels (localllm.cpu) once, before a test or a CLI subprocess
    with a short timeout would compile them on first use."""
    import localllm.cpu

    return localllm.cpu.available()


@pytest.fixture(scope="session")
def llm():
    """The default model (gemma3-270m Q4_K_M) on the CPU, loaded once per test session."""
    from localllm import LLM

    return LLM(DEFAULT_MODEL, device="cpu", ctx_size=4096)


@pytest.fixture(scope="session")
def llm_cuda():
    """The default model on CUDA (Triton backend, CUDA graphs), loaded once; skips without."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU")
    from localllm import LLM

    return LLM(DEFAULT_MODEL, device="cuda", ctx_size=4096)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def any_llm(request):
    """The default model on each device: the CPU, and CUDA under ``pytest -m cuda``."""
    return request.getfixturevalue("llm" if request.param == "cpu" else "llm_cuda")


@pytest.fixture(scope="session")
def reference():
    """llama.cpp's outputs for the default model (tests/data/reference)."""
    return json.loads((REFERENCE_DIR / "reference.json").read_text())


@pytest.fixture(params=["cpu-interpret", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request):
    """Kernel tests run on CPU tensors through Triton's interpreter and, under
    ``pytest -m cuda``, natively on a GPU."""
    import torch

    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs an NVIDIA GPU")
        return torch.device("cuda")
    return torch.device("cpu")


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """A fresh current directory (to check that nothing is left behind in it)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory):
    """Factory: path of a tiny random model of architecture ``arch`` (cached per session)."""
    from tiny_model import write_tiny_gguf

    cache: dict = {}

    def make(arch: str = "gemma3", **kw) -> Path:
        key = (arch, tuple(sorted(kw.items())))
        if key not in cache:
            path = tmp_path_factory.mktemp("tiny") / f"tiny-{arch}.gguf"
            cache[key] = write_tiny_gguf(path, arch, **kw)
        return cache[key]

    return make


@pytest.fixture
def keep_threads():
    """The thread counts (torch's, and :mod:`localllm.cpu.threads`' chosen counts and core
    watch) as they were before the test."""
    import torch

    from localllm.cpu import threads

    n, state = torch.get_num_threads(), (threads._counts, threads._share)
    yield
    torch.set_num_threads(n)
    threads._counts, threads._share = state
