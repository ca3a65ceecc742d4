"""RoPE scaling in every family (issue 28, item 2): every ``rope.scaling.type`` llama.cpp
knows (none, linear, yarn, longrope; Phi-3's "su"), Llama 3's factors from the keys
("llama3"), partial RoPE (``rope.dimension_count`` below the head size) and the sliding
layers' own base load in every architecture and change what they should; a type that is not
one, or a value out of range, is one ``error:`` line naming the key, before any weight is read.

What each computes is checked against llama.cpp by the fixtures of tests/test_families.py
(``qwen2-yarn``, ``mistral3``: YaRN, its betas and log multiplier, past the original context;
``phi3``, ``phi3-partial``: LongRoPE, partial RoPE with an attention factor; ``llama``,
``apertus``, ``exaone4``: ``rope_freqs``; ``llama3-keys``: the llama3 keys against the
converter's tensor; ``gemma3-linear``; ``gemma3-swa``: ``rope.freq_base_swa``); here, that
the fixtures would notice each piece missing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli

from localllm.gguf.file import open_gguf
from localllm.models import ARCHITECTURES
from localllm.runtime import session as runtime
from localllm.runtime.session import Session, load_gguf, load_model

KINDS = ("linear", "yarn", "longrope", "su", "llama3")
# tiny models per architecture: gemma3's sixth layer is its first global one (linear scaling
# applies to global layers only); MoE needs its expert keys
LAYERS = {"gemma3": 6}
EXTRA = {"qwen3moe": {"expert_count": 4, "expert_used_count": 2,
                      "expert_feed_forward_length": 32},
         # MLA: a latent of 16 + 16 RoPE dims, heads of 16 + 16, a dense layer and a MoE one
         "deepseek2": {"attention.head_count_kv": 1, "attention.kv_lora_rank": 16,
                       "attention.key_length": 32, "attention.value_length": 16,
                       "rope.dimension_count": 16, "attention.key_length_mla": 32,
                       "attention.value_length_mla": 16, "leading_dense_block_count": 1,
                       "expert_count": 4, "expert_used_count": 2,
                       "expert_feed_forward_length": 32, "expert_shared_count": 1}}
# rope.dimension_count sizes deepseek2's latent and key tensors (its decoupled RoPE key):
# no partial rotation of a head
WHOLE_ROPE = ("deepseek2",)
ARCHS = sorted(ARCHITECTURES)
FAMILY_DATA = Path(__file__).parent / "data" / "families"


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is bound."""
    def refuse(*a, **k):
        raise AssertionError("weights were read")
    monkeypatch.setattr(runtime, "bind", refuse)


def _tiny(tmp_path, arch: str, name: str, **keys) -> Path:
    from tiny_model import write_tiny_gguf

    return write_tiny_gguf(tmp_path / f"{arch}-{name}.gguf", arch,
                           extra={**EXTRA.get(arch, {}), **keys},
                           n_layers=LAYERS.get(arch, 2))


def _logits(path: Path) -> torch.Tensor:
    s = Session(load_model(path, device="cpu", progress=False), ctx_size=64)
    return s.eval(list(range(3, 40)), all_logits=True)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """Each architecture's tiny model without scaling, and its logits (cached)."""
    cache: dict = {}

    def get(arch: str) -> torch.Tensor:
        if arch not in cache:
            cache[arch] = _logits(_tiny(tmp_path_factory.mktemp("plain"), arch, "none"))
        return cache[arch]

    return get


CASES = [(arch, kind) for arch in ARCHS for kind in KINDS]


@pytest.mark.parametrize("arch, kind", CASES, ids=[f"{a}-{k}" for a, k in CASES])
def test_every_scaling_type_loads_and_is_applied_in_every_family(arch, kind, tmp_path, plain):
    """The same weights (same seed) with and without the scaling: the logits agree at
    position 0 (no rotation) and differ later."""
    scaled = _logits(_tiny(tmp_path, arch, kind, **{
        "rope.scaling.type": kind, "rope.scaling.factor": 4.0,
        "rope.scaling.original_context_length": 16}))
    ref = plain(arch)
    assert torch.isfinite(scaled).all()
    assert torch.allclose(ref[0], scaled[0], atol=1e-4)
    assert (ref[1:] - scaled[1:]).abs().max() > 1e-3


@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in WHOLE_ROPE])
def test_partial_rope_loads_and_is_applied_in_every_family(arch, tmp_path, plain):
    """``rope.dimension_count`` half the head size: rotates fewer dimensions (the logits
    differ from the full rotation's past position 0)."""
    partial = _logits(_tiny(tmp_path, arch, "partial", **{"rope.dimension_count": 8}))
    ref = plain(arch)
    assert torch.allclose(ref[0], partial[0], atol=1e-4)
    assert (ref[1:] - partial[1:]).abs().max() > 1e-3


BAD = [
    ("llama", {"rope.scaling.type": "dynamic"}, "llama.rope.scaling.type"),
    ("exaone4", {"rope.scaling.type": "llama4"}, "exaone4.rope.scaling.type"),
    ("gemma3", {"rope.scaling.type": "Linear"}, "gemma3.rope.scaling.type"),
    ("phi3", {"rope.scaling.type": 5}, "phi3.rope.scaling.type"),
    ("qwen2", {"rope.scaling.type": "yarn", "rope.scaling.factor": 0.0},
     "qwen2.rope.scaling.factor"),
    ("mistral3", {"rope.scaling.type": "yarn", "rope.scaling.factor": -4.0},
     "mistral3.rope.scaling.factor"),
    ("qwen2", {"rope.scaling.type": "yarn", "rope.freq_base": 1.0}, "qwen2.rope.freq_base"),
    ("mistral3", {"rope.scaling.type": "yarn", "rope.scaling.yarn_log_multiplier": -1.0},
     "mistral3.rope.scaling.yarn_log_multiplier"),
    ("mistral3", {"rope.scaling.type": "yarn", "rope.scaling.yarn_beta_fast": 0.0},
     "mistral3.rope.scaling.yarn_beta_fast"),
    ("llama", {"rope.scaling.type": "llama3", "rope.scaling.low_freq_factor": 4.0,
               "rope.scaling.high_freq_factor": 1.0}, "llama.rope.scaling.high_freq_factor"),
    ("llama", {"rope.scaling.original_context_length": 0},
     "llama.rope.scaling.original_context_length"),
    ("smollm3", {"rope.dimension_count": 17}, "smollm3.rope.dimension_count"),
    ("seed_oss", {"rope.dimension_count": 64}, "seed_oss.rope.dimension_count"),
    ("gemma3", {"rope.freq_base_swa": 0.0}, "gemma3.rope.freq_base_swa"),
    ("hunyuan-dense", {"rope.scaling.alpha": -2.0}, "hunyuan-dense.rope.scaling.alpha"),
    ("mistral3", {"attention.temperature_scale": -0.1}, "mistral3.attention.temperature_scale"),
    ("phi3", {"rope.scaling.attn_factor": float("nan")}, "phi3.rope.scaling.attn_factor"),
]


@pytest.mark.parametrize("arch, keys, named", BAD, ids=[f"{a}-{next(iter(k.items()))}"[:60]
                                                         for a, k, _ in BAD])
def test_bad_rope_value_is_one_error_naming_the_key(arch, keys, named, tmp_path, monkeypatch,
                                                    capsys, no_weights):
    path = _tiny(tmp_path, arch, "bad", **keys)
    code, _, err = run_cli(monkeypatch, capsys, "run", str(path), "hello", "-n", "2")
    assert_one_line_error(code, err, named)


# ---- the fixtures notice each piece missing ---------------------------------------------------
def _mean_kl(family: str, family_dir: Path, **changes) -> float:
    """Mean KL(llama.cpp || localllm) over the family's fixture, float32 torch backend, with
    metadata keys changed (None: removed)."""
    from families import write_family

    ref = np.load(FAMILY_DATA / f"{family}.npz")
    path = family_dir / f"{family}.gguf"
    if not path.exists():
        write_family(family, family_dir)
    f = open_gguf(path)
    md = {k: v for k, v in f.metadata.items() if k not in changes}
    md.update({k: v for k, v in changes.items() if v is not None})
    m = load_gguf(dataclasses.replace(f, metadata=md), device="cpu", progress=False,
                  backend="torch", dtype=torch.float32)
    theirs = ref["logits"].astype(np.float64)
    kls = []
    for i in range(theirs.shape[0]):
        ids = ref[f"prompt{i}"].tolist()
        ours = Session(m, ctx_size=64).eval(ids, all_logits=True,
                                            logits_start=len(ids) - theirs.shape[1])
        lo = torch.log_softmax(ours.double(), -1).numpy()
        lt = torch.log_softmax(torch.from_numpy(theirs[i]), -1).numpy()
        kls.append((np.exp(lt) * (lt - lo)).sum(-1).mean())
    return float(np.mean(kls))


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


ABLATIONS = [
    ("mistral3", {"mistral3.rope.scaling.yarn_beta_slow": None}),
    ("mistral3", {"mistral3.rope.scaling.yarn_log_multiplier": None}),
    ("mistral3", {"mistral3.attention.temperature_scale": None}),
    ("gemma3-swa", {"gemma3.rope.freq_base_swa": None}),
    ("gemma3-swa", {"gemma3.attention.sliding_window_pattern": None}),
    ("phi3-partial", {"phi3.rope.scaling.attn_factor": None}),
    ("hunyuan-dense", {"hunyuan-dense.rope.scaling.alpha": None}),
    ("exaone4", {"exaone4.attention.sliding_window": 0}),  # every layer global, with RoPE
    ("llama3-keys", {"llama.rope.scaling.low_freq_factor": 2.0}),
]


@pytest.mark.parametrize("family, changes", ABLATIONS,
                         ids=[f"{f}-{next(iter(c))}" for f, c in ABLATIONS])
def test_fixture_needs_the_key(family, changes, family_dir):
    """Without the key (or with another value), localllm's distributions move away from
    llama.cpp's (at least twice the mean KL): the fixture checks what the key does, not only
    that it loads."""
    with_key = _mean_kl(family, family_dir)
    without = _mean_kl(family, family_dir, **changes)
    assert without > 2 * with_key, (with_key, without)


def test_smollm3_fixture_needs_its_nope_layers(family_dir, monkeypatch):
    """SmolLM3's every 4th layer without RoPE (a rule of llama.cpp's, no key): rotating it
    moves the distributions away from llama.cpp's."""
    from localllm.models import llama

    with_nope = _mean_kl("smollm3", family_dir)
    monkeypatch.setitem(llama.VARIANTS, "smollm3",
                        dataclasses.replace(llama.VARIANTS["smollm3"], nope_step=0))
    assert _mean_kl("smollm3", family_dir) > 2 * with_nope


def test_partial_rope_fixture_needs_the_halves_pairing(family_dir, monkeypatch):
    """Partial NEOX RoPE pairs dimension j with j + n_rot/2 (not j + head_dim/2): without
    :meth:`Rope.arrange`'s permutation the phi3-partial fixture moves away from llama.cpp."""
    from localllm.models import rope

    with_perm = _mean_kl("phi3-partial", family_dir)
    monkeypatch.setattr(rope.Rope, "arrange", lambda self, x: x)
    assert _mean_kl("phi3-partial", family_dir) > 2 * with_perm
