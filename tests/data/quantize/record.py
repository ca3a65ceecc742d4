"""Golden quantization figures from llama.cpp, for tests/test_quantize.py.

``write_f16_model(path)`` writes a small llama-architecture F16 GGUF with deterministic random
weights (heavy-tailed rows of different scales, a few outlier columns; rows of 256 and 640
values, so that ffn_down exercises llama.cpp's fallback for rows that are not a multiple of
256). The tests regenerate it; ``golden_rmse.json`` records a checksum of its tensor data.

Run ``python tests/data/quantize/record.py`` (needs ``pip install llama-cpp-python``; it is
never a dependency of localllm) to write, next to this script:

- ``golden_rmse.json``: for each ``--type``, the type llama.cpp's ``llama_model_quantize``
  chose for every tensor and the RMSE of its dequantized values against the F16 original;
- ``blocks.npz``: for each ggml block type, 4 rows x 512 sample values, llama.cpp's
  quantized bytes of them (``ggml_quantize_chunk``) and llama.cpp's dequantization of those
  bytes (the type's ``to_float``), to check that our layouts are bit-compatible; and
  llama.cpp's IQ4_NL / IQ4_XS bytes of 64 x 256 more varied values (``iq4_rows``), which
  our quantizers must reproduce exactly.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import sys
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))  # tests/, for tiny_model's vocabulary helper

N_LAYERS = 4
D_MODEL = 256
N_HEADS = 4
N_KV_HEADS = 1
HEAD_DIM = 64
FFN_DIM = 640
SEED = 1234

FILE_TYPES = ["Q8_0", "Q6_K", "Q5_K_M", "Q5_K_S", "Q4_K_M", "Q4_K_S", "Q3_K_L", "Q3_K_M",
              "Q3_K_S", "Q2_K", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]
BLOCK_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
               "IQ4_NL", "IQ4_XS"]


def _weights(rng: np.random.Generator, rows: int, cols: int, scale: float) -> np.ndarray:
    """Student-t (df 5) values, per-row log-normal scales, and a few large outlier columns:
    roughly how trained transformer matrices look."""
    w = rng.standard_t(5, size=(rows, cols)) * np.exp(0.3 * rng.standard_normal((rows, 1)))
    outliers = rng.choice(cols, size=max(1, cols // 128), replace=False)
    w[:, outliers] *= 4.0
    return (w * scale).astype(np.float32)


def write_f16_model(path: str | Path) -> str:
    """Write the F16 test model to ``path``; returns the sha256 of its tensor values."""
    from tiny_model import _spm_vocab

    rng = np.random.default_rng(SEED)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("quantize-golden")
    n_vocab = _spm_vocab(w)
    w.add_context_length(256)
    w.add_embedding_length(D_MODEL)
    w.add_block_count(N_LAYERS)
    w.add_feed_forward_length(FFN_DIM)
    w.add_head_count(N_HEADS)
    w.add_head_count_kv(N_KV_HEADS)
    w.add_key_length(HEAD_DIM)
    w.add_value_length(HEAD_DIM)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    digest = hashlib.sha256()

    def mat(name: str, rows: int, cols: int, scale: float) -> None:
        a = _weights(rng, rows, cols, scale).astype(np.float16)
        digest.update(a.tobytes())
        w.add_tensor(name, a)

    def vec(name: str, n: int) -> None:
        a = (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)
        digest.update(a.tobytes())
        w.add_tensor(name, a)

    mat("token_embd.weight", n_vocab, D_MODEL, 0.05)
    vec("output_norm.weight", D_MODEL)
    mat("output.weight", n_vocab, D_MODEL, 0.03)
    for i in range(N_LAYERS):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", D_MODEL)
        mat(p + "attn_q.weight", N_HEADS * HEAD_DIM, D_MODEL, 0.03)
        mat(p + "attn_k.weight", N_KV_HEADS * HEAD_DIM, D_MODEL, 0.03)
        mat(p + "attn_v.weight", N_KV_HEADS * HEAD_DIM, D_MODEL, 0.02)
        mat(p + "attn_output.weight", D_MODEL, N_HEADS * HEAD_DIM, 0.02)
        vec(p + "ffn_norm.weight", D_MODEL)
        mat(p + "ffn_gate.weight", FFN_DIM, D_MODEL, 0.03)
        mat(p + "ffn_up.weight", FFN_DIM, D_MODEL, 0.03)
        mat(p + "ffn_down.weight", D_MODEL, FFN_DIM, 0.02)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return digest.hexdigest()


def read_tensors(path: str | Path) -> dict[str, tuple[str, np.ndarray]]:
    """name -> (ggml type name, float32 values) of a GGUF file, via gguf's dequantizer."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        shape = tuple(int(d) for d in reversed(t.shape))
        vals = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        out[t.name] = (t.tensor_type.name, np.asarray(vals, np.float32).reshape(shape))
    return out


def sample_rows() -> np.ndarray:
    """The values whose llama.cpp quantization blocks.npz stores: (4, 512) float32."""
    rng = np.random.default_rng(SEED + 1)
    x = _weights(rng, 4, 512, 0.02)
    x[3, :32] = 0.0  # an all-zero block
    x[3, 32:48] = 1e-3  # a constant run
    return x


class _Traits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


def _ggml():
    import llama_cpp

    libdir = Path(llama_cpp.__file__).parent / "lib"
    lib = ctypes.CDLL(str(next(libdir.glob("libggml-base.*"))))
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                        ctypes.c_void_p]
    return lib


def iq4_rows() -> np.ndarray:
    """Values whose IQ4_NL / IQ4_XS quantization blocks.npz stores bytes of, to check that
    ours are llama.cpp's: (64, 256) float32 of varied shapes (heavy tails, uniform, outliers,
    values exactly on the codebook, blocks near the all-zero threshold)."""
    rng = np.random.default_rng(SEED + 2)
    x = np.concatenate([
        rng.standard_t(3, size=(16, 256)) * 0.02,
        rng.uniform(-1, 1, size=(16, 256)) * 10.0 ** rng.integers(-4, 2, size=(16, 1)),
        _weights(rng, 16, 256, 0.03),
        rng.standard_normal((16, 256)),
    ]).astype(np.float32)
    kvalues = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                        113], dtype=np.float32)
    x[48, :] = rng.choice(kvalues, 256) * 0.001  # on the codebook
    x[49, :32] = 1e-16  # below GROUP_MAX_EPS: an all-zero block
    x[49, 32:64] = 1e-14
    x[50, :] = 0.0
    return x


def _ggml_quantize(lib, name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's bytes of ``x`` quantized to ``name`` and their dequantization."""
    qt = gguf.GGMLQuantizationType[name]
    traits = lib.ggml_get_type_traits(int(qt)).contents
    assert traits.type_name.decode().lower() == name.lower(), traits.type_name
    block, size = gguf.GGML_QUANT_SIZES[qt]
    dst = np.zeros(x.size // block * size, dtype=np.uint8)
    n = lib.ggml_quantize_chunk(int(qt), x.ctypes.data, dst.ctypes.data, 0, x.shape[0],
                                x.shape[1], None)
    assert n == dst.size
    deq = np.zeros(x.size, dtype=np.float32)
    to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
        traits.to_float)
    to_float(dst.ctypes.data, deq.ctypes.data, x.size)
    return dst.reshape(x.shape[0], -1), deq.reshape(x.shape)


def record_blocks(out: Path) -> None:
    lib = _ggml()
    x = np.ascontiguousarray(sample_rows())
    arrays = {"values": x}
    for name in BLOCK_TYPES:
        arrays[f"{name}_bytes"], arrays[f"{name}_dequant"] = _ggml_quantize(lib, name, x)
    x = np.ascontiguousarray(iq4_rows())
    arrays["iq4_values"] = x
    for name in ("IQ4_NL", "IQ4_XS"):
        arrays[f"{name}_iq4_bytes"] = _ggml_quantize(lib, name, x)[0]
    np.savez_compressed(out, **arrays)


def record_files(tmp: Path) -> dict:
    import llama_cpp

    src = tmp / "model-f16.gguf"
    digest = write_f16_model(src)
    orig = read_tensors(src)
    golden: dict = {"llama_cpp_python": llama_cpp.__version__, "f16_sha256": digest,
                    "types": {}}
    for ftype in FILE_TYPES:
        dst = tmp / f"model-{ftype}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = int(gguf.LlamaFileType[f"MOSTLY_{ftype}"])
        params.nthread = 1
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(),
                                            ctypes.byref(params))
        assert rc == 0, f"llama_model_quantize failed for {ftype}"
        per_tensor = {}
        for name, (tname, vals) in read_tensors(dst).items():
            ref = orig[name][1]
            rmse = float(np.sqrt(np.mean((vals.astype(np.float64) - ref) ** 2)))
            per_tensor[name] = {"type": tname, "rmse": rmse}
        golden["types"][ftype] = per_tensor
        print(ftype, sorted({v["type"] for v in per_tensor.values()}), file=sys.stderr)
    return golden


def main() -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        golden = record_files(Path(d))
    (HERE / "golden_rmse.json").write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
    record_blocks(HERE / "blocks.npz")
    print("wrote", HERE / "golden_rmse.json", HERE / "blocks.npz", file=sys.stderr)


if __name__ == "__main__":
    main()
