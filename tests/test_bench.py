"""``localllm bench`` figures (localllm/bench.py) on tiny models."""

from __future__ import annotations

import json
import math

import pytest
from cli_helpers import run_cli
from typer.testing import CliRunner

from localllm.errors import ParameterError
from localllm.eval import bench
from localllm.memory import RING_SLACK
from localllm.runtime.session import load_model


@pytest.mark.parametrize("name, gbps", [
    ("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H100 PCIe", 2000.0), ("NVIDIA H200", 4800.0),
    ("NVIDIA A100-SXM4-80GB", 2039.0), ("NVIDIA A100-PCIE-40GB", 1555.0),
    ("NVIDIA GeForce RTX 4090", 1008.0), ("Some Future GPU", None)])
def test_peak_bandwidth_by_gpu_name(name, gbps):
    assert bench.peak_bandwidth_gbps(name) == gbps


def test_bytes_per_token_by_hand(tiny_model_path):
    # tiny llama: untied output; 287 tokens, d 64, 2 layers, 4 heads / 2 KV heads of 16
    loaded = load_model(tiny_model_path("llama"), device="cpu", progress=False)
    layer = 64 * 64 + 32 * 64 + 32 * 64 + 64 * 64 + 3 * 128 * 64
    matrices = 287 * 64 + 2 * layer  # output.weight, not the embedding table
    vectors = 64 + 2 * 2 * 64
    assert bench.weight_bytes_per_token(loaded) == 2 * matrices + 4 * vectors
    # positions 8..11 attend over 9..12 cells: K and V, 2 KV heads x 16 x float32, 2 layers
    assert bench.kv_bytes_per_token(loaded.args, 8, 4, RING_SLACK, 4) == 2 * 256 * 42 // 4
    # float16 (CUDA, the native backend)
    assert bench.kv_bytes_per_token(loaded.args, 8, 4, RING_SLACK, 2) == 256 * 42 // 4


def test_tied_embedding_is_read_and_windows_cap_kv(tiny_model_path):
    loaded = load_model(tiny_model_path("gemma3"), device="cpu", progress=False)
    assert bench.weight_bytes_per_token(loaded) == 186752  # every tensor (see test_resources)
    window = loaded.args.sliding_window + RING_SLACK  # both layers slide (window 8)
    per_cell = 2 * loaded.args.n_kv_heads * loaded.args.head_dim * 4
    far = bench.kv_bytes_per_token(loaded.args, 10_000, 2, RING_SLACK, 4)
    assert far == 2 * window * per_cell


def test_run_bench_json_line(tiny_model_path, capsys):
    res = bench.run_bench(str(tiny_model_path("llama")), n_prompt=16, n_gen=4, repetitions=1,
                          device="cpu", peak_bandwidth=50.0, llama_cpp=False, as_json=True)
    line = capsys.readouterr().out.strip()
    assert "\n" not in line
    figures = json.loads(line)
    assert figures == json.loads(json.dumps(res))
    for key in ("pp", "tg", "ttft_ms", "peak_mib", "achieved_gbps", "mbu"):
        assert figures[key] > 0 and math.isfinite(figures[key])
    assert figures["mbu"] == pytest.approx(figures["achieved_gbps"] / 50.0)
    assert figures["n_prompt"] == 16 and figures["device"] == "cpu"


def test_run_bench_compares_with_llama_cpp(tiny_model_path, capsys):
    pytest.importorskip("llama_cpp")
    res = bench.run_bench(str(tiny_model_path("gemma3")), n_prompt=16, n_gen=4, repetitions=1,
                          device="cpu")
    out = capsys.readouterr().out
    assert res["llama_cpp"]["tg"] > 0
    assert res["ratio_tg"] == pytest.approx(res["tg"] / res["llama_cpp"]["tg"])
    assert "ours / llama.cpp" in out


def test_bench_command(tiny_model_path):
    from localllm.cli.app import app

    path = tiny_model_path("qwen2")
    result = CliRunner().invoke(app, ["bench", str(path), "-p", "16", "-n", "2", "-r", "1",
                                      "--device", "cpu", "--no-llama-cpp", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["tg"] > 0


def test_bench_command_with_guessing(tiny_model_path, monkeypatch, capsys):
    """``bench --spec-ngram``/``--model-draft`` (issue #30: the flags in bench too): the decode
    speed with guessing and the acceptance, beside the plain figures; a bad flag is one line."""
    from localllm.cli.app import app

    path = str(tiny_model_path("qwen2"))
    result = CliRunner().invoke(app, ["bench", path, "-p", "16", "-n", "8", "-r", "1",
                                      "--device", "cpu", "--no-llama-cpp", "--json",
                                      "--model-draft", path, "--draft-p-min", "0"])
    assert result.exit_code == 0, result.output
    figures = json.loads(result.output.strip().splitlines()[-1])
    assert figures["tg_spec"] > 0 and figures["tg"] > 0
    # the draft is the model itself: every guess is the token greedy decoding picks, except
    # those past the last of the 8 tokens (the last step's, at most --draft-max 7)
    assert figures["draft_accepted"] >= 4
    assert figures["draft_tokens"] - figures["draft_accepted"] < 7
    assert "draft model" in figures["speculative"]
    code, _, err = run_cli(monkeypatch, capsys, "bench", path, "-p", "16", "-n", "2", "-r",
                           "1", "--device", "cpu", "--spec-ngram", "-2")
    assert code == 1 and err.startswith("error:") and "spec-ngram" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("kw, flag", [({"n_prompt": 4}, "--n-prompt"),
                                      ({"peak_bandwidth": 0.0}, "--peak-bandwidth"),
                                      ({"synthetic": "gpt5"}, "--synthetic"),
                                      ({"threads": 0}, "--threads")])
def test_bad_arguments(kw, flag):
    with pytest.raises(ParameterError, match=flag):
        bench.run_bench(None, **{"n_prompt": 16, "n_gen": 2, "repetitions": 1, **kw})
