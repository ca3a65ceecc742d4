"""bench/bench_families.py: the figures it derives (weight bytes a token reads, the rows
relative to llama, the issue's two rules), on a tiny MoE file and on given timings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from localllm.gguf.file import open_gguf

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_families.py"


@pytest.fixture(scope="module")
def bf():
    spec = importlib.util.spec_from_file_location("bench_families", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_family_has_a_0_5_to_1_5b_geometry(bf):
    from localllm.models import ARCHITECTURES
    from localllm.models.geometries import GEOMETRIES
    from localllm.models.synthetic import planned_tensors

    assert set(bf.FAMILIES) - set(bf.VARIANTS) | {"mistral"} == set(ARCHITECTURES)
    for fam, name in bf.FAMILIES.items():
        g = GEOMETRIES[name]
        assert g.arch == bf.VARIANTS.get(fam, fam)
        n = sum(t.n_elements for t in planned_tensors(g, "Q4_K_M"))
        assert 0.45e9 < n < 1.55e9, (name, n)


def test_moe_reads_only_the_used_experts(bf, tmp_path):
    from tiny_model import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "moe.gguf", "qwen3moe",
                           extra={"expert_count": 4, "expert_used_count": 1,
                                  "expert_feed_forward_length": 32})
    tensors = open_gguf(path).tensors
    experts = sum(t.n_bytes for n, t in tensors.items() if "_exps." in n)
    embd = tensors["token_embd.weight"].n_bytes
    total = sum(t.n_bytes for t in tensors.values())
    sizes = bf.weight_bytes(path)
    tied = "output.weight" not in tensors
    assert sizes["total_mb"] * 1e6 == pytest.approx(total - (0 if tied else embd))
    assert sizes["active_mb"] * 1e6 == pytest.approx(sizes["total_mb"] * 1e6 - experts * 3 / 4)


def test_rows_are_relative_to_llama_per_weight_byte(bf):
    sizes = {"llama": {"file_mb": 800, "active_mb": 800, "total_mb": 800},
             "qwen2": {"file_mb": 400, "active_mb": 400, "total_mb": 400},
             "qwen3moe": {"file_mb": 760, "active_mb": 200, "total_mb": 700}}

    def run(pp, tg):
        return [{"pp": pp, "tg": tg, "rss_mb": 1, "load_s": 1, "other_cores": 0.0}]

    results = {"llama": {"ours": run(100, 10), "llama": run(120, 20)},
               "qwen2": {"ours": run(150, 15), "llama": run(240, 40)},  # per byte: 0.75
               "qwen3moe": {"ours": run(300, 40), "llama": [{"error": "exit 1: boom"}]}}
    rows = bf.summarize(results, sizes)
    assert rows["llama"]["rel_ours_tg"] == 1.0
    assert rows["qwen2"]["ratio_tg"] == pytest.approx(15 / 40)
    assert rows["qwen2"]["rel_ours_tg"] == pytest.approx(15 * 400 / (10 * 800))
    assert rows["qwen2"]["rel_llama_tg"] == pytest.approx(40 * 400 / (20 * 800))
    assert rows["qwen3moe"]["rel_ours_tg"] == pytest.approx(40 * 200 / (10 * 800))
    assert rows["qwen3moe"]["ratio_tg"] is None
    # against llama.cpp: qwen2's ratio 15/40 over llama's 10/20
    assert rows["qwen2"]["norm_tg"] == pytest.approx((15 / 40) / (10 / 20))
    lines = bf.checks(rows)
    assert "qwen2 (pp 0.75)" in lines[0] and "qwen2 (tg 0.75)" in lines[0]
    assert "qwen2 (pp 0.75)" in lines[1] and "qwen2 (tg 0.75)" in lines[1]  # pp: 0.625/0.833
    assert "follows the active parameters" in lines[2] and "NOT" not in lines[2]
    meta = {"machine": "m", "threads": 2, "rounds": 1, "n_prompt": 512, "n_gen": 32,
            "quant": "Q4_K_M", "date": "d", "stat": "median"}
    table = bf.markdown(rows, meta)
    assert "| qwen3moe | qwen3moe-1b | 760 | 200 | 300.0 | — |" in table
    assert "qwen3moe llama: exit 1: boom" in table
