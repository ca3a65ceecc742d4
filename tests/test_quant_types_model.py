"""Models whose matrices use the newer quant types (IQ4_NL, IQ4_XS, MXFP4, lattice types)
load and run on the CPU path: their logits equal those of the same model stored as float32
values dequantized by gguf-py (the oracle), and ``localllm info`` reports their geometry."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from cli_helpers import run_cli
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize as gguf_dequantize
from tiny_model import write_tiny_gguf

from localllm.gguf.quants import BLOCK_FORMATS, bits_per_weight
from localllm.runtime.session import Session, load_model

WEIGHT_STD = 0.05  # typical magnitude of a matrix entry in the test model

# Shapes where every row is a multiple of 256 (the super-block of IQ4_XS and the lattices).
DIMS = {"d_model": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64, "ffn_dim": 512,
        "n_layers": 2}


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).view(np.uint8).reshape(len(x), 2)


def valid_blocks(qtype: T, x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Blocks of ``qtype`` for the float32 matrix ``x`` (rows, cols): gguf-py's quantizer where
    it has one (MXFP4), else random codes with a super-block scale chosen so that entries have
    about ``WEIGHT_STD``. uint8 (rows, row_bytes)."""
    rows, cols = x.shape
    fmt = BLOCK_FORMATS[qtype]
    if qtype == T.MXFP4:
        return gguf.quants.quantize(x, qtype)
    n = rows * cols // fmt.block_size
    b = rng.integers(0, 256, (n, fmt.type_size), dtype=np.uint8)
    # Standard deviation of the code values times sub-block scales for d = 1 (measured once
    # with gguf-py below), so that d scales them to WEIGHT_STD.
    b[:, 0:2] = _f16_bytes(np.ones(n))
    unit = float(np.std(gguf_dequantize(b, qtype)))
    d = WEIGHT_STD / unit * rng.uniform(0.75, 1.25, n)
    b[:, 0:2] = _f16_bytes(d)
    return b.reshape(rows, -1)


def _copy_fields(reader: gguf.GGUFReader, writer: gguf.GGUFWriter) -> None:
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub)


def write_pair(tmp: Path, qtype: T, seed: int = 0) -> tuple[Path, Path]:
    """A tiny llama model with every matrix stored as ``qtype``, and the same model with
    those matrices as float32 values from ``gguf.quants.dequantize``."""
    src = write_tiny_gguf(tmp / "f32.gguf", "llama", qtype=T.F32, seed=seed, **DIMS)
    reader = gguf.GGUFReader(src)
    rng = np.random.default_rng(seed)
    quant, ref = tmp / f"{qtype.name}.gguf", tmp / f"{qtype.name}-ref.gguf"
    writers = [gguf.GGUFWriter(str(p), "llama") for p in (quant, ref)]
    for w in writers:
        _copy_fields(reader, w)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if data.ndim == 2:
            blocks = valid_blocks(qtype, data.astype(np.float32), rng)
            writers[0].add_tensor(t.name, blocks, raw_dtype=qtype)
            writers[1].add_tensor(t.name, gguf_dequantize(blocks, qtype).astype(np.float32))
        else:
            for w in writers:
                w.add_tensor(t.name, data)
    for w in writers:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return quant, ref


TYPES = [T.IQ4_NL, T.IQ4_XS, T.MXFP4, T.IQ2_XXS, T.IQ3_S]


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_model_runs_and_matches_dequantized_float_model(tmp_path, qtype):
    quant_path, ref_path = write_pair(tmp_path, qtype)
    assert gguf.GGUFReader(quant_path).get_tensor(1).tensor_type in (qtype, T.F32)
    kw = {"device": "cpu", "progress": False, "dtype": torch.float32}
    quant, ref = load_model(quant_path, **kw), load_model(ref_path, **kw)
    ids = torch.randint(4, quant.tokenizer.n_vocab, (12,),
                        generator=torch.Generator().manual_seed(1)).tolist()
    got = Session(quant, ctx_size=32).eval(ids, all_logits=True)
    want = Session(ref, ctx_size=32).eval(ids, all_logits=True)
    assert torch.isfinite(got).all() and got.std() > 0
    assert torch.equal(got, want)  # the dequantized weights are bit-identical
    # The default CPU path (float16 weights) runs too, and stays close.
    half = Session(load_model(quant_path, device="cpu", progress=False), ctx_size=32)
    torch.testing.assert_close(half.eval(ids, all_logits=True), want, rtol=0.05, atol=0.05)


def test_info_reports_new_types(tmp_path, monkeypatch, capsys):
    quant_path, _ = write_pair(tmp_path, T.IQ4_XS)
    code, out, err = run_cli(monkeypatch, capsys, "info", str(quant_path))
    assert code == 0, err
    rows = [line.replace("│", " ").split() for line in out.splitlines()]
    row = next(r for r in rows if r[:1] == ["IQ4_XS"])
    n_matrices = 2 + 7 * DIMS["n_layers"]  # token_embd, output, 7 per layer
    assert row[1] == str(n_matrices)
    assert row[-1] == f"{bits_per_weight(T.IQ4_XS):.2f}" == "4.25"


def test_info_describes_a_type_without_dequantizer(tmp_path, monkeypatch, capsys):
    """Q8_K has a geometry but no dequantizer: info describes the file, run refuses it."""
    path = write_tiny_gguf(tmp_path / "q8k.gguf", "llama", qtype=T.Q8_K, **DIMS)
    code, out, err = run_cli(monkeypatch, capsys, "info", str(path))
    assert code == 0, err
    rows = [line.replace("│", " ").split() for line in out.splitlines()]
    assert next(r for r in rows if r[:1] == ["Q8_K"])[-1] == "9.12"


def test_quantize_cli_then_run(tmp_path, monkeypatch, capsys):
    """``localllm quantize --type IQ4_NL/IQ4_XS`` writes files that load and run; their
    weights (dequantized by gguf-py) are closer to the originals than Q4_0's."""
    src = write_tiny_gguf(tmp_path / "f16.gguf", "llama", qtype=T.F16, **DIMS)
    orig = {t.name: gguf_dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(src).tensors}
    ids = list(range(270, 282))
    rmse = {}
    for ftype in ["Q4_0", "IQ4_NL", "IQ4_XS"]:
        dst = tmp_path / f"{ftype}.gguf"
        code, _, stderr = run_cli(monkeypatch, capsys, "quantize", str(src), str(dst),
                                  "--type", ftype)
        assert code == 0, stderr
        tensors = [t for t in gguf.GGUFReader(dst).tensors if t.tensor_type == T[ftype]]
        assert len(tensors) >= 2 * DIMS["n_layers"]
        sq = sum(float(((gguf_dequantize(t.data, t.tensor_type) - orig[t.name]) ** 2).sum())
                 for t in tensors)
        rmse[ftype] = (sq / sum(orig[t.name].size for t in tensors)) ** 0.5
        logits = Session(load_model(dst, device="cpu", progress=False), ctx_size=32).eval(ids)
        assert torch.isfinite(logits).all()
    assert rmse["IQ4_NL"] < rmse["Q4_0"] and rmse["IQ4_XS"] < rmse["Q4_0"], rmse


def test_cuda_memory_estimate_counts_types_without_kernel_dequantized(tmp_path):
    """On the quantized (Triton) path a matrix whose type has no kernel is dequantized to
    float16 at load, so the estimate counts it at 2 bytes per weight, not its file bytes."""
    from localllm.kernels import supports

    from localllm.gguf.file import open_gguf
    from localllm.runtime.resources import CUDA_WORKSPACE, weight_bytes

    assert not supports(T.IQ2_XXS), "this test needs a type without a Triton kernel"
    cuda = torch.device("cuda")  # only its type is read: nothing is allocated
    for qtype in (T.IQ2_XXS, T.Q8_0):
        path = write_tiny_gguf(tmp_path / f"{qtype.name}.gguf", "llama", qtype=qtype, **DIMS)
        g = open_gguf(path)
        vectors = sum(4 * t.n_elements for t in g.tensors.values() if len(t.shape) == 1)
        matrices = [t for t in g.tensors.values() if len(t.shape) > 1]
        assert {t.qtype for t in matrices} == {qtype}
        stored = (sum(t.n_bytes for t in matrices) if supports(qtype)
                  else sum(2 * t.n_elements for t in matrices))
        assert weight_bytes(g, cuda, torch.float16, quantized=True) == (
            CUDA_WORKSPACE + vectors + stored)
