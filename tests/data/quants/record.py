"""llama.cpp's own dequantization of random blocks of the newer ggml types, for
tests/test_quants.py (a second oracle next to ``gguf.quants.dequantize``).

Run ``/path/to/llama-venv/bin/python tests/data/quants/record.py`` (needs llama-cpp-python,
never a dependency of localllm) to write ``llama_cpp_dequant.npz`` next to this script: for
each type, ``{TYPE}_blocks`` (uint8, random bytes with finite fp16 scales of all magnitudes)
and ``{TYPE}_values`` (float32, the type's ``to_float`` in libggml-base).
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import gguf
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "quantize"))  # the libggml-base loader of record.py

N_BLOCKS = 12
# Byte offsets of the fp16 scale(s) in each block (ggml-common.h); IQ1_M spreads its scale
# over the top nibbles of its last four uint16s; MXFP4 / NVFP4 scales are any byte.
SCALE_OFFSETS = {
    "IQ4_NL": [0], "IQ4_XS": [0], "MXFP4": [], "NVFP4": [], "TQ1_0": [52], "TQ2_0": [64],
    "IQ2_XXS": [0], "IQ2_XS": [0], "IQ2_S": [0], "IQ3_XXS": [0], "IQ3_S": [0], "IQ1_S": [0],
    "IQ1_M": [],
}


def random_blocks(name: str, rng: np.random.Generator) -> np.ndarray:
    qt = gguf.GGMLQuantizationType[name]
    size = gguf.GGML_QUANT_SIZES[qt][1]
    b = rng.integers(0, 256, (N_BLOCKS, size), dtype=np.uint8)
    scale = rng.standard_normal(N_BLOCKS) * 10.0 ** rng.integers(-7, 3, N_BLOCKS)
    bits = scale.astype(np.float16).view(np.uint16)
    for off in SCALE_OFFSETS[name]:
        b[:, off:off + 2] = bits.view(np.uint8).reshape(N_BLOCKS, 2)
    if name == "IQ1_M":
        words = b[:, 48:56].copy().view(np.uint16)
        for w in range(4):
            words[:, w] = (words[:, w] & 0x0FFF) | (((bits >> (4 * w)) & 0xF) << 12)
        b[:, 48:56] = words.view(np.uint8)
    return b


def main() -> None:
    import record  # tests/data/quantize/record.py

    lib = record._ggml()
    rng = np.random.default_rng(14)
    arrays = {}
    for name in SCALE_OFFSETS:
        qt = gguf.GGMLQuantizationType[name]
        traits = lib.ggml_get_type_traits(int(qt)).contents
        assert traits.type_name.decode().lower() == name.lower(), traits.type_name
        blocks = np.ascontiguousarray(random_blocks(name, rng))
        n = N_BLOCKS * gguf.GGML_QUANT_SIZES[qt][0]
        out = np.zeros(n, dtype=np.float32)
        to_float = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)(
            traits.to_float)
        to_float(blocks.ctypes.data, out.ctypes.data, n)
        arrays[f"{name}_blocks"] = blocks
        arrays[f"{name}_values"] = out.reshape(N_BLOCKS, -1)
    np.savez_compressed(HERE / "llama_cpp_dequant.npz", **arrays)
    print("wrote", HERE / "llama_cpp_dequant.npz", file=sys.stderr)


if __name__ == "__main__":
    main()
