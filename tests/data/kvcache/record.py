"""Record llama.cpp's next-token distributions with quantized KV caches (developer tool).

llama-cpp-python is the oracle here (``type_k`` / ``type_v``: ggml type ids, llama.cpp's
``-ctk`` / ``-ctv``; a quantized V cache needs ``flash_attn``), never a dependency of
localllm: run this with a Python that has it, giving the default model's GGUF file::

    /work/llamavenv/bin/python tests/data/kvcache/record.py /path/to/gemma-3-270m-q4_k_m.gguf

Writes ``gemma3-270m-kv.npz`` beside this script, for ``tests/test_kv_quant_reference.py``:
for each cache type T of :data:`TYPES` (K and V both T) and each prompt of :data:`PROMPTS`
(ids ``prompt{p}_ids``), the next-token log-probs of the last :data:`N_POS` positions as
their top :data:`TOP` tokens (``{T}_p{p}_ids`` int32 and ``{T}_p{p}_logprobs`` float32,
(N_POS, TOP), largest first), and the perplexity of the first :data:`PPL_CHUNKS` chunks of
``gpl-3.txt`` at n_ctx 512 with that cache (``{T}_ppl``, llama-perplexity's method as
``tests/data/reference/record.py``: first token replaced by BOS, the second half scored).
The long prompt (900 tokens) wraps the model's sliding-window layers' caches.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama, __version__

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from oracle import log_softmax  # tests/data/oracle.py

TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2}  # llama.cpp's -ctk names -> ggml type ids
N_THREADS = 2
N_POS = 32
TOP = 1024
N_LONG = 900
PPL_CTX = 512
PPL_CHUNKS = 4


def perplexity(llm: Llama, text: str) -> float:
    tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
    nll, scored = 0.0, 0
    for c in range(PPL_CHUNKS):
        chunk = tokens[c * PPL_CTX:(c + 1) * PPL_CTX]
        chunk[0] = llm.token_bos()
        llm.reset()
        llm.eval(chunk)
        lp = log_softmax(np.array(llm.scores[:PPL_CTX], dtype=np.float32))
        for j in range(PPL_CTX // 2, PPL_CTX - 1):
            nll -= lp[j, tokens[c * PPL_CTX + j + 1]]
            scored += 1
    return math.exp(nll / scored)


def prompts(llm: Llama) -> list[list[int]]:
    text = (HERE.parent / "reference" / "gpl-3.txt").read_text(encoding="utf-8")
    long = llm.tokenize(text.encode(), add_bos=True, special=False)[:N_LONG]
    short = llm.tokenize(b"The capital of France is Paris. The capital of Germany is",
                         add_bos=True, special=False)
    return [short, long]


def main(model: str) -> None:
    out: dict[str, np.ndarray] = {}
    for name, ggml_type in TYPES.items():
        llm = Llama(model, n_ctx=1024, n_batch=512, n_threads=N_THREADS, logits_all=True,
                    flash_attn=True, type_k=ggml_type, type_v=ggml_type, verbose=False)
        for p, ids in enumerate(prompts(llm)):
            out[f"prompt{p}_ids"] = np.array(ids, dtype=np.int32)
            llm.reset()
            llm.eval(ids)
            n = min(N_POS, len(ids))
            lp = log_softmax(np.array(llm.scores[len(ids) - n: len(ids)], dtype=np.float32))
            top = np.argsort(-lp, axis=-1, kind="stable")[:, :TOP]
            out[f"{name}_p{p}_ids"] = top.astype(np.int32)
            out[f"{name}_p{p}_logprobs"] = np.take_along_axis(lp, top, -1).astype(np.float32)
        ppl = perplexity(llm, (HERE.parent / "reference" / "gpl-3.txt").read_text(encoding="utf-8"))
        out[f"{name}_ppl"] = np.array(ppl)
        print(f"{name}: PPL {ppl:.4f}", file=sys.stderr)
    out["source"] = np.array(f"llama.cpp via llama-cpp-python {__version__}, CPU, "
                             f"n_threads={N_THREADS}, flash_attn, {Path(model).name}")
    np.savez_compressed(HERE / "gemma3-270m-kv.npz", **out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
