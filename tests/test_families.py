"""Every family against llama.cpp: the small model of each family (tests/families.py),
regenerated bit-identically from its declaration, gives llama.cpp's next-token distributions
(fixtures recorded by tests/data/families/record.py with llama-cpp-python).

Per family: mean KL(llama.cpp || localllm) over the recorded positions <= 0.01 nats, and the
same top-1 token at the last position of every prompt.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from families import FAMILIES, RECURRENT, sha256, write_family

from localllm.eval.perplexity import perplexity_chunks, summarize
from localllm.runtime.session import Session, load_model

DATA = Path(__file__).parent / "data" / "families"
MAX_MEAN_KL = 0.01


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_llama_cpp(family, device, family_dir):
    """Prefill (all positions of a prompt in one forward), the device's default backend."""
    check_family(family, device, family_dir)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_llama_cpp_torch_backend(family, family_dir):
    """Prefill on the torch backend (the reference ops; matrices dequantized at load)."""
    check_family(family, "cpu", family_dir, backend="torch")


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_decode_steps_match_llama_cpp(family, backend, family_dir):
    """The recorded positions as one-token decode steps after a prefill of the rest (the
    native backend's fused decode attention; the torch reference)."""
    check_family(family, "cpu", family_dir, backend=backend, steps=True)


# The families with routed experts: SiLU experts (Q8_0; qwen3moe's prompts are below the rows
# per expert from which the model takes the kernel), gpt-oss's MXFP4 experts with biases and
# the clamped SwiGLU, Gemma 4's GEGLU experts with gate and up fused.
MOE_FAMILIES = ["qwen3moe", "gpt-oss", "phimoe", "olmoe", "glm4moe", "ernie4_5-moe", "llama4",
                "deepseek2", "granitehybrid-moe", "qwen35moe", "gemma4-moe"]


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_moe_prefill_kernel_matches_llama_cpp(family, family_dir, monkeypatch):
    """The native MoE prefill (localllm.cpu.moe_ffn_q8) on every prompt of a MoE family's
    fixture, however short (forced: the fixtures' prompts are mostly below the rows per
    expert from which the model takes it)."""
    from localllm import cpu
    from localllm.backends import native

    if not cpu.moe_q8():
        pytest.skip("the native MoE prefill needs the AVX512-VNNI int8 kernels")
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return moe_ffn_q8(*args, **kwargs)

    moe_ffn_q8 = cpu.moe_ffn_q8
    monkeypatch.setattr(cpu, "moe_ffn_q8", spy)
    monkeypatch.setattr(native, "MOE_MIN_ROWS", 0)
    check_family(family, "cpu", family_dir)
    assert calls and min(calls) > 1


def family_model(family: str, device: str, family_dir: Path, backend: str = "auto"):
    """The family's file (written once per module, checked against the recorded SHA-256),
    loaded on ``device`` with ``backend``."""
    ref = np.load(DATA / f"{family}.npz")
    path = family_dir / f"{family}.gguf"
    if not path.exists():
        write_family(family, family_dir)
    assert sha256(path) == str(ref["sha256"]), "the file differs from the one llama.cpp ran"
    return load_model(path, device=device, progress=False, backend=backend)


def check_family(family: str, device: str, family_dir: Path, *, backend: str = "auto",
                 steps: bool = False, loaded=None) -> None:
    """The family's file against llama.cpp's recorded logits (module docstring); ``steps``:
    the recorded positions evaluated one token at a time (decode steps) after a prefill of
    the rest. ``loaded``: the model already loaded (default: :func:`family_model` with
    ``backend``)."""
    ref = np.load(DATA / f"{family}.npz")
    if loaded is None:
        loaded = family_model(family, device, family_dir, backend)
    theirs = ref["logits"]  # (prompts, positions, n_vocab) float16
    n_last = theirs.shape[1]
    n_ctx = max(64, max(len(ref[f"prompt{i}"]) for i in range(theirs.shape[0])) + 1)
    kls = []
    for i in range(theirs.shape[0]):
        ids = ref[f"prompt{i}"].tolist()
        session = Session(loaded, ctx_size=n_ctx)
        start = len(ids) - n_last
        if steps:
            ours = [session.eval(ids[:start + 1])]
            ours += [session.eval([tok]) for tok in ids[start + 1:]]
            ours = torch.stack([o.reshape(-1) for o in ours])
        else:
            ours = session.eval(ids, all_logits=True, logits_start=start)
        ours = ours.float().cpu().numpy()
        lt, lo = _log_softmax(theirs[i]), _log_softmax(ours)
        kls.append((np.exp(lt) * (lt - lo)).sum(-1))
        assert int(ours[-1].argmax()) == int(theirs[i][-1].argmax()), f"prompt {i}: top-1"
    mean_kl = float(np.mean(kls))
    print(f"{family} {device} {loaded.backend} {'decode' if steps else 'prefill'}: "
          f"mean KL {mean_kl:.5f}, max {float(np.max(kls)):.5f}")
    assert mean_kl <= MAX_MEAN_KL


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("family", RECURRENT)
def test_recurrent_family_matches_llama_cpp(family, backend, family_dir):
    """The recurrent families on both CPU paths, their prompts up to 300 tokens (a prefill
    in chunks, cut at context checkpoints), then the same positions as one-token decode
    steps after a prefill of the rest (the recurrence of each mixer); and the perplexity of
    the fixture's text (tokens the model sampled, record.py) within 1% of llama.cpp's."""
    if backend == "native":
        from localllm import cpu

        if not cpu.available():
            pytest.skip("the native CPU kernels are unavailable")
    loaded = family_model(family, "cpu", family_dir, backend)
    assert loaded.backend == backend
    check_family(family, "cpu", family_dir, loaded=loaded)
    check_family(family, "cpu", family_dir, steps=True, loaded=loaded)
    ref = np.load(DATA / f"{family}.npz")
    if "ppl" not in ref:  # MoE (record.py): the dense file of the family checks perplexity
        return
    tokens, n_ctx = ref["ppl_tokens"].tolist(), int(ref["ppl_ctx"])
    nll = torch.cat([n for _, n in perplexity_chunks(_Runner(loaded), tokens, n_ctx)])
    ours = summarize(nll, len(tokens) // n_ctx).ppl
    print(f"{family} {backend}: perplexity {ours:.3f}, llama.cpp {float(ref['ppl']):.3f}")
    assert ours == pytest.approx(float(ref["ppl"]), rel=0.01)


class _Runner:
    """What :mod:`localllm.eval.perplexity` uses of an ``LLM`` (sessions and the tokenizer),
    over a model loaded with a chosen backend (``LLM`` picks it itself)."""

    def __init__(self, loaded) -> None:
        self.loaded, self.tokenizer = loaded, loaded.tokenizer

    def session(self, ctx_size: int) -> Session:
        return Session(self.loaded, ctx_size=ctx_size)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_commands_on_each_family(family, family_dir, monkeypatch, capsys, tmp_path):
    """``localllm info``, ``run``, ``chat`` and ``perplexity`` work on each family's file, and
    its model serves a chat completion to the official ``openai`` client over 127.0.0.1."""
    from cli_helpers import run_cli

    path = family_dir / f"{family}.gguf"
    if not path.exists():
        write_family(family, family_dir)
    code, out, err = run_cli(monkeypatch, capsys, "info", str(path))
    assert code == 0, err
    assert FAMILIES[family][0].arch in out
    code, out, err = run_cli(monkeypatch, capsys, "run", str(path), "the cat and the dog",
                             "-n", "4", "--temp", "0", "-c", "64")
    assert code == 0, err
    code, out, err = run_cli(monkeypatch, capsys, "chat", str(path), "-n", "4", "--temp", "0",
                             "-c", "1024", stdin="the cat and the dog\n")
    assert code == 0, err
    text = tmp_path / "text.txt"
    text.write_text(" ".join(["the quick brown fox jumps over the lazy dog"] * 6))
    code, out, err = run_cli(monkeypatch, capsys, "perplexity", str(path), "-f", str(text),
                             "-c", "16", "-b", "16")
    assert code == 0, err
    assert "PPL" in out + err or "perplexity" in (out + err).lower()
    _serve_one_reply(path)


def _serve_one_reply(path: Path) -> None:
    """The model's server on a free port of 127.0.0.1 (in this process:
    :func:`test_server.in_process_server`) answers one chat completion of the official
    client with 3 tokens."""
    import openai
    from test_server import in_process_server

    from localllm.api import LLM

    with in_process_server(LLM(path, device="cpu", ctx_size=1024)) as port:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1",
                               api_key="none", max_retries=0, timeout=60)
        r = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "the cat and the dog"}],
            max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("stop", "length")
        assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens >= 1
