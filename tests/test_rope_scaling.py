"""RoPE scaling types (issue 14): every ``{arch}.rope.scaling.type`` value the families use
(none, linear, yarn, llama3, longrope/su) is either implemented or refused with one
``error:`` line naming the key, before any weight is read.

What is implemented is checked against llama.cpp in tests/test_families.py (``llama``:
Llama 3.x ``rope_freqs``; ``phi3``: LongRoPE; ``qwen2-yarn``: YaRN; ``gemma3-linear``:
linear scaling of the global layers). Here: the refusals, and that a supported type changes
the output (it is not silently ignored).
"""

from __future__ import annotations

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

from localllm.runtime import session as runtime
from localllm.runtime.session import Session, load_model

# The values a GGUF may carry: llama.cpp's LLAMA_ROPE_SCALING_TYPES (none, linear, yarn,
# longrope), Phi-3's older "su", and "llama3" (Llama 3.1's HF rope_type; llama.cpp's
# converter stores it as the rope_freqs tensor instead, and llama.cpp aborts on the string).
VALUES = ("none", "linear", "yarn", "longrope", "su", "llama3")
SUPPORTED = {
    **dict.fromkeys(("llama", "mistral", "granite", "qwen2", "qwen3"),
                    ("none", "linear", "yarn")),
    **dict.fromkeys(("gemma", "gemma2", "gemma3", "olmo2"), ("none", "linear")),
    "phi3": ("none", "linear", "longrope", "su"),
}
REFUSED = [(arch, v) for arch, ok in SUPPORTED.items() for v in VALUES if v not in ok]


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is bound."""
    def refuse(*a, **k):
        raise AssertionError("weights were read")
    monkeypatch.setattr(runtime, "bind", refuse)


# gemma3: layer 5 is the first global one (linear scaling applies to global layers only)
LAYERS = {"gemma3": 6}


def _scaled(tmp_path, arch: str, kind: str, **keys):
    from tiny_model import write_tiny_gguf

    extra = {"rope.scaling.type": kind, "rope.scaling.factor": 4.0, **keys}
    return write_tiny_gguf(tmp_path / f"{arch}-{kind}.gguf", arch, extra=extra,
                           n_layers=LAYERS.get(arch, 2))


@pytest.mark.parametrize("arch, kind", REFUSED, ids=[f"{a}-{k}" for a, k in REFUSED])
def test_unsupported_scaling_type_is_one_error_naming_the_key(arch, kind, tmp_path,
                                                              monkeypatch, capsys, no_weights):
    path = _scaled(tmp_path, arch, kind)
    code, _, err = run_cli(monkeypatch, capsys, "run", str(path), "hello", "-n", "2")
    assert code == 1
    assert_one_line_error(code, err, f"{arch}.rope.scaling.type", repr(kind))


def test_yarn_log_multiplier_is_refused_naming_the_key(tmp_path, monkeypatch, capsys,
                                                       no_weights):
    path = _scaled(tmp_path, "qwen2", "yarn", **{"rope.scaling.yarn_log_multiplier": 0.1})
    code, _, err = run_cli(monkeypatch, capsys, "run", str(path), "hello", "-n", "2")
    assert_one_line_error(code, err, "qwen2.rope.scaling.yarn_log_multiplier")


SCALED = [(arch, v) for arch, ok in SUPPORTED.items() for v in ok if v != "none"
          and not (arch == "phi3" and v in ("longrope", "su"))]  # phi3: factors tensors


@pytest.mark.parametrize("arch, kind", SCALED, ids=[f"{a}-{k}" for a, k in SCALED])
def test_supported_scaling_type_changes_the_logits(arch, kind, tmp_path):
    """A supported type loads and is applied: the logits at later positions differ from the
    same file without scaling (the weights are the same: same seed)."""
    from tiny_model import write_tiny_gguf

    plain = write_tiny_gguf(tmp_path / f"{arch}-none.gguf", arch, n_layers=LAYERS.get(arch, 2))
    scaled = _scaled(tmp_path, arch, kind)
    ids = list(range(3, 40))
    out = [Session(load_model(p, device="cpu", progress=False), ctx_size=64)
           .eval(ids, all_logits=True) for p in (plain, scaled)]
    assert torch.isfinite(out[1]).all()
    assert torch.allclose(out[0][0], out[1][0], atol=1e-4)  # position 0: no rotation
    assert (out[0][1:] - out[1][1:]).abs().max() > 1e-3


def test_yarn_with_a_base_of_one_is_refused_naming_the_key(tmp_path, monkeypatch, capsys,
                                                          no_weights):
    path = _scaled(tmp_path, "qwen2", "yarn", **{"rope.freq_base": 1.0})
    code, _, err = run_cli(monkeypatch, capsys, "run", str(path), "hello", "-n", "2")
    assert_one_line_error(code, err, "qwen2.rope.freq_base")
