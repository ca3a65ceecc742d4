"""Record llama.cpp's sentence embeddings of the default model (developer tool).

llama-cpp-python is the oracle here (``embedding=True`` and ``pooling_type``: llama.cpp's
``LLAMA_POOLING_TYPE_*``, 1 mean, 3 last), never a dependency of localllm: run this with a
Python that has it, giving the default model's GGUF file::

    /work/llamavenv/bin/python tests/data/embeddings/record.py /path/to/gemma-3-270m-q4_k_m.gguf

Writes ``gemma3-270m-embed.npz`` beside this script, for ``tests/test_embeddings_reference.py``:
for each pooling P of :data:`POOLINGS` and each text i of :data:`TEXTS`, ``{P}_{i}`` (float32,
d_model): llama.cpp's embedding of the text tokenized with BOS (llama-server's way), L2-
normalized (llama-server's default ``embd_normalize`` 2); ``ids_{i}``, the token ids; and
``texts``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama, __version__

HERE = Path(__file__).resolve().parent
POOLINGS = {"mean": 1, "last": 3}
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "A lighthouse keeper climbs the spiral stair every evening to light the lamp.",
    "def add(a, b):\n    return a + b",
    "Paris",
    ("Quantized language models run on ordinary laptops with GGUF files and a few gigabytes "
     "of memory; the key-value cache grows with the context."),
]


def main() -> None:
    path = sys.argv[1]
    out: dict[str, np.ndarray] = {}
    for name, code in POOLINGS.items():
        llm = Llama(model_path=path, embedding=True, pooling_type=code, n_ctx=512,
                    n_batch=512, n_ubatch=512, n_threads=2, n_gpu_layers=0, verbose=False)
        for i, text in enumerate(TEXTS):
            ids = llm.tokenize(text.encode(), add_bos=True, special=False)
            out[f"ids_{i}"] = np.array(ids, dtype=np.int32)
            v = np.array(llm.embed(text, normalize=False), dtype=np.float64)
            out[f"{name}_{i}"] = (v / np.linalg.norm(v)).astype(np.float32)
        del llm
    out["texts"] = np.array(TEXTS)
    out["llama_cpp_python"] = np.array(__version__)
    np.savez_compressed(HERE / "gemma3-270m-embed.npz", **out)
    print(f"wrote {len(out)} arrays with llama-cpp-python {__version__}")


if __name__ == "__main__":
    main()
