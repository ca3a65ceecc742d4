"""deepseek2 (issue #28): multi-head latent attention and its routing, apart from the
llama.cpp fixtures (tests/test_families.py).

* the absorbed attention over the latent cache equals the expanded multi-head form
  (keys ``[k_b^T c, k_pe]`` and values ``v_b c`` per head, DeepSeek-V2's eq. 9-19), which
  llama.cpp's ``deepseek2.cpp`` computes for files without MLA;
* the group-limited routing equals a brute force over every choice of groups;
* bad input: inconsistent MLA ranks, expert counts that do not match the tensors, group
  counts that do not divide the experts, each one error naming the key (or the tensor)
  before any weight is read, and one ``error:`` line on the command line.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch
from cli_helpers import assert_one_line_error, run_cli
from families import write_family
from test_hybrid_input import load, rewrite

from localllm.backends.dense import TorchOps
from localllm.errors import GGUFError, LocalLLMError
from localllm.gguf.file import open_gguf
from localllm.memory import LatentSpec, make_memory
from localllm.models import deepseek2
from localllm.runtime import session as runtime


@pytest.fixture(scope="module")
def family_file(tmp_path_factory):
    directory = tmp_path_factory.mktemp("deepseek2-input")
    cache = {}

    def get(family: str):
        if family not in cache:
            cache[family] = open_gguf(write_family(family, directory))
        return cache[family]

    return get


@pytest.fixture
def no_weights(monkeypatch):
    """Fail the test if any weight is bound."""
    def refuse(*a, **k):
        raise AssertionError("weights were read")
    monkeypatch.setattr(runtime, "bind", refuse)


def expanded_attention(q_nope, q_pe, c, k_pe, k_b, v_b, scale):
    """MLA as multi-head attention with every head's keys and values expanded from the
    latent: (H, T, *) queries, (T, r) c, (T, n_rot) k_pe -> (T, H * dv), causal."""
    h, t, _ = q_nope.shape
    k_nope = torch.einsum("hrn,tr->htn", k_b, c)  # (H, T, nope)
    v = torch.einsum("hvr,tr->htv", v_b, c)  # (H, T, dv)
    k = torch.cat([k_nope, k_pe[None].expand(h, -1, -1)], -1)
    q = torch.cat([q_nope, q_pe], -1)
    scores = q @ k.transpose(1, 2) * scale
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1)


@pytest.mark.parametrize("steps", [False, True])
def test_absorbed_attention_equals_the_expanded_heads(steps):
    """The latent cache and absorbed projections give multi-head attention's result, in one
    prefill and as a prefill followed by one-token steps (which read the cache)."""
    g = torch.Generator().manual_seed(3)
    h, t, r, nope, rot, dv = 4, 9, 16, 8, 6, 10
    q_nope, q_pe = torch.randn(h, t, nope, generator=g), torch.randn(h, t, rot, generator=g)
    c, k_pe = torch.randn(t, r, generator=g), torch.randn(t, rot, generator=g)
    k_b, v_b = torch.randn(h, r, nope, generator=g), torch.randn(h, dv, r, generator=g)
    scale = 1 / math.sqrt(nope + rot)
    want = expanded_attention(q_nope, q_pe, c, k_pe, k_b, v_b, scale)
    memory = make_memory([LatentSpec(r + rot)], 16, dtype=torch.float32, device="cpu")
    latent = torch.cat([c, k_pe], -1)
    ops, cuts = TorchOps(), ([0, 5, 6, 7, 8, 9] if steps else [0, t])
    got = torch.cat([ops.mla_attention(q_nope[:, a:b], q_pe[:, a:b], latent[a:b], k_b, v_b,
                                       memory[0], a, torch.arange(a, b), scale=scale)
                     for a, b in itertools.pairwise(cuts)])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert memory.seq_len == t and memory[0].nbytes == 16 * (r + rot) * 4


def _args(**kw) -> deepseek2.ModelArgs:
    from localllm.models.rope import RopeSpec

    return deepseek2.ModelArgs(**{
        "arch": "deepseek2", "n_vocab": 8, "n_layers": 1, "d_model": 8, "n_heads": 1,
        "n_kv_heads": 1, "head_dim": 4, "context_length": 16,
        "rope": RopeSpec(2, 2, 1e4, False), "q_lora_rank": 0, "kv_lora_rank": 4, "n_rot": 2,
        "head_dim_v": 4, "n_dense_lead": 0, "ffn_dim": 0, "kq_scale": 1.0, "n_expert": 12,
        "n_expert_used": 3, "expert_ffn_dim": 4, **kw})


@pytest.mark.parametrize("gating", ["softmax", "sigmoid"])
def test_group_limited_routing_is_the_best_choice_of_groups(gating):
    """Each token's experts are the top-k of the groups whose two best biased scores sum
    highest (brute force over every set of groups), weighted by the unbiased probabilities,
    renormalised and scaled."""
    a = _args(n_group=4, n_group_used=2, gating=gating, expert_weights_norm=True,
              expert_weights_scale=2.5)
    g = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(32, 12, generator=g), 0.3 * torch.randn(12, generator=g)
    chosen, weights = deepseek2.route(logits, a, bias)
    probs = logits.softmax(-1) if gating == "softmax" else logits.sigmoid()
    scores = probs + bias
    for t in range(32):
        best = max(itertools.combinations(range(4), 2),
                   key=lambda gs, t=t: sum(scores[t, 3 * i:3 * i + 3].topk(2).values.sum()
                                           for i in gs))
        allowed = [e for i in best for e in range(3 * i, 3 * i + 3)]
        want = sorted(allowed, key=lambda e: -scores[t, e])[:3]
        assert sorted(chosen[t].tolist()) == sorted(want)
        w = probs[t, chosen[t]]
        torch.testing.assert_close(weights[t], w / w.sum() * 2.5)
    # without groups, norm or scale: the plain top-k of the biased scores, unbiased weights
    chosen, weights = deepseek2.route(logits, _args(gating=gating), bias)
    assert torch.equal(chosen.sort(-1).values, scores.topk(3, -1).indices.sort(-1).values)
    torch.testing.assert_close(weights, probs.gather(1, chosen))


def test_latent_cache_is_what_a_layer_remembers(family_file):
    """One latent of kv_lora_rank + n_rot values per position and layer; the geometries'
    per-token bytes are DeepSeek's (V2-Lite and V3: 576 values, 70272 bytes in float16 over
    61 layers for V3)."""
    m = load(family_file("deepseek2"))
    assert [s for s in m.memory_layout] == [LatentSpec(128 + 32)] * 2
    from localllm.models import memory_layout, model_args
    from localllm.models.geometries import GEOMETRIES
    from localllm.models.synthetic import _hparams

    for name, layers in (("deepseek-v2-lite", 27), ("deepseek-v3", 61), ("deepseek-v3-1b", 12)):
        g = GEOMETRIES[name]
        layout = memory_layout(model_args(_hparams(g), g.n_vocab))
        assert layout == [LatentSpec(576)] * layers
        assert sum(s.nbytes(1, 2) for s in layout) == 576 * 2 * layers


BAD = [
    # inconsistent MLA ranks
    ("deepseek2", "deepseek2.attention.key_length", 192,
     "deepseek2.attention.key_length: must be attention.kv_lora_rank + rope.dimension_count"),
    ("deepseek2", "deepseek2.attention.value_length", 64,
     "deepseek2.attention.value_length: must be attention.kv_lora_rank = 128"),
    ("deepseek2", "deepseek2.attention.kv_lora_rank", 96, "deepseek2.attention.key_length"),
    ("deepseek2", "deepseek2.attention.key_length_mla", 32,
     "deepseek2.attention.key_length_mla: 32 must exceed rope.dimension_count 32"),
    # without key_length_mla a file is read as converted before the attn_kv_b split
    ("deepseek2", "deepseek2.attention.key_length_mla", None,
     ("deepseek2.attention.head_count_kv: must be attention.head_count 4 in a file with "
     "attn_kv_b")),
    ("deepseek2-kvb", "deepseek2.attention.head_count_kv", 1,
     "deepseek2.attention.head_count_kv: must be attention.head_count 4"),
    ("deepseek2-kvb", "deepseek2.attention.value_length", 32,
     "'blk.0.attn_kv_b.weight' has shape (512, 128), but the hyperparameters need (384, 128)"),
    ("deepseek2-kvb", "deepseek2.attention.key_length", 32,
     "deepseek2.attention.key_length: 32 must exceed rope.dimension_count 32"),
    ("deepseek2", "deepseek2.rope.dimension_count", 33, "deepseek2.rope.dimension_count"),
    ("deepseek2", "deepseek2.attention.head_count_kv", 4,
     "deepseek2.attention.head_count_kv: must be 1"),
    ("deepseek2", "deepseek2.attention.q_lora_rank", 96, "'blk.0.attn_q_a.weight' has shape"),
    ("deepseek2-lite", "deepseek2.attention.q_lora_rank", 64,
     "'blk.0.attn_q_a.weight' is missing"),
    ("deepseek2", "deepseek2.attention.kv_lora_rank", 0, "deepseek2.attention.kv_lora_rank"),
    # expert counts that do not match the tensors (or each other)
    ("deepseek2", "deepseek2.expert_count", 8,
     "'blk.1.ffn_gate_inp.weight' has shape (16, 256), but the hyperparameters need (8, 256)"),
    ("deepseek2", "deepseek2.expert_count", None, "deepseek2.expert_count: is missing"),
    ("deepseek2", "deepseek2.expert_used_count", 17, "deepseek2.expert_used_count: must be in"),
    ("deepseek2", "deepseek2.expert_shared_count", 2, "'blk.1.ffn_gate_shexp.weight' has shape"),
    ("deepseek2", "deepseek2.expert_feed_forward_length", 128,
     "'blk.1.ffn_gate_exps.weight' has shape"),
    ("deepseek2", "deepseek2.leading_dense_block_count", 2, "'blk.1.ffn_gate.weight' is missing"),
    ("deepseek2", "deepseek2.leading_dense_block_count", 3,
     "deepseek2.leading_dense_block_count: must be in 0..2"),
    # group counts that do not divide the experts
    ("deepseek2", "deepseek2.expert_group_count", 3,
     "deepseek2.expert_group_count: 3 groups do not divide expert_count 16"),
    ("deepseek2", "deepseek2.expert_group_count", 16, "deepseek2.expert_group_count"),
    ("deepseek2", "deepseek2.expert_group_used_count", 4,
     "deepseek2.expert_group_used_count: must be in 1..3"),
    ("deepseek2", "deepseek2.expert_group_used_count", None,
     "deepseek2.expert_group_used_count: is missing"),
    ("deepseek2-lite", "deepseek2.expert_group_count", 4,
     "deepseek2.expert_group_used_count: is missing"),
    # gating, scaling
    ("deepseek2", "deepseek2.expert_gating_func", 4,
     "deepseek2.expert_gating_func: 4 is not 1 (softmax) or 2 (sigmoid)"),
    ("deepseek2", "deepseek2.expert_weights_scale", -1.0, "deepseek2.expert_weights_scale"),
    ("deepseek2", "deepseek2.rope.scaling.yarn_log_multiplier", math.nan,
     "deepseek2.rope.scaling.yarn_log_multiplier"),
    ("deepseek2", "deepseek2.rope.scaling.factor", 0.0, "deepseek2.rope.scaling.factor"),
]


@pytest.mark.parametrize("family, key, value, named", BAD,
                         ids=[f"{f}:{k}={v!r}"[:70] for f, k, v, _ in BAD])
def test_bad_mla_hyperparameter_is_one_error_naming_it(family_file, no_weights, family, key,
                                                       value, named):
    with pytest.raises(LocalLLMError) as e:
        load(family_file(family), **{key: value})
    assert isinstance(e.value, GGUFError)
    msg = str(e.value)
    assert "\n" not in msg and named in msg, msg


def test_mis_shaped_latent_tensor_is_named(family_file, no_weights):
    f = family_file("deepseek2")
    name = "blk.0.attn_k_b.weight"
    bad = {**f.tensors, name: dataclasses.replace(f.tensors[name], shape=(4, 128, 32))}
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_k_b\.weight' has shape \(4, 128, 32\)"):
        load(f, tensors=bad)


def test_cli_names_the_key_in_one_line(monkeypatch, capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    rewrite(write_family("deepseek2", tmp_path), bad, "deepseek2.expert_group_count", 3)
    for cmd in ("run", "info"):
        args = [cmd, str(bad)] + (["hello"] if cmd == "run" else [])
        code, _, err = run_cli(monkeypatch, capsys, *args)
        assert code == 1
        assert_one_line_error(code, err, "deepseek2.expert_group_count",
                              "do not divide expert_count 16")


def test_info_states_the_latent_cache_bytes_per_token(monkeypatch, capsys, tmp_path):
    """2 layers x (128 + 32) float16 values: 640 bytes per token, 0.3 MiB at the file's
    context of 512 tokens."""
    path = write_family("deepseek2", tmp_path)
    code, out, err = run_cli(monkeypatch, capsys, "info", str(path))
    assert code == 0, err
    line = " ".join(out.split())
    assert ("memory per sequence: latent cache 0.3 MiB at 512 tokens (2 layers, float16: "
            "640 bytes per token)") in line
    assert "kv_lora_rank" in line and "KV cache" not in line


def test_synthetic_memory_check_counts_the_latent_cache(monkeypatch):
    """``bench --synthetic``'s memory check sizes the memories from the geometry's validated
    arguments (a latent per position for MLA), and refuses DeepSeek-V3 on a small machine."""
    from localllm.eval import bench
    from localllm.models.geometries import GEOMETRIES
    from localllm.models.synthetic import geometry_args, planned_tensors
    from localllm.runtime import resources

    g = GEOMETRIES["deepseek-v2-lite"]
    args = geometry_args(g)
    assert resources.kv_cache_bytes(args, 4096) == 27 * 576 * 4 * 4096  # float32 on the CPU
    monkeypatch.delenv(resources.SKIP_ENV, raising=False)
    monkeypatch.setattr(resources, "free_memory", lambda device: 64 * 2**30)
    v3 = GEOMETRIES["deepseek-v3"]
    with pytest.raises(LocalLLMError, match="--synthetic deepseek-v3: benching it needs"):
        bench.check_synthetic_memory(v3, planned_tensors(v3, "Q4_K_M"), torch.device("cpu"),
                                     512)
