"""Record llama.cpp's outputs for the default model into this folder (developer tool).

llama-cpp-python is the oracle here, never a dependency of localllm: run this with a Python
that has it (and numpy), giving the default model's GGUF file::

    python tests/data/reference/record.py /path/to/gemma-3-270m-q4_k_m.gguf

(``python -c "from localllm.registry import load_registry; print(load_registry().resolve('gemma3-270m')[0])"``
prints the path in localllm's own environment.)

Writes, for ``tests/test_reference.py`` and ``tests/test_perplexity.py``:

- ``gemma3-270m-q4_k_m/reference.json``: token ids of ten texts (BOS, with and without special
  tokens parsed); for three prompts their ids, the top-20 next tokens (logits and log-probs),
  48 greedy tokens and, teacher-forcing those, the top-2 (token, log-prob) at every position;
- ``gemma3-270m-q4_k_m/last_logprobs.npy``: (3, n_vocab) float32 next-token log-probs of the
  prompts;
- ``gemma3-270m-q4_k_m/perplexity-gpl3-ctx512.json``: llama-perplexity's method on
  ``gpl-3.txt`` at n_ctx 512 (chunks from an empty cache, first token replaced by BOS, tokens
  ``n_ctx/2 .. n_ctx-1`` scored).
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from llama_cpp import Llama, __version__

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from oracle import log_softmax

OUT = HERE / "gemma3-270m-q4_k_m"
N_THREADS = 2

TEXTS = [
    "Hello, world! The quick brown fox",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\ndone",
    "naïve café résumé — “quotes” ‘single’",
    "你好，llama！这是一个测试。",
    "emoji 🤖🚀👍🏽 and ZWJ 👨\u200d👩\u200d👧",
    "numbers 1234567890 3.14159 -42 1e10",
    "code: def f(x):\n    return x**2  # comment",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "",
]
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
N_GREEDY = 48


def all_logits(llm: Llama, ids: list[int]) -> np.ndarray:
    """(len(ids), n_vocab) float32 logits of one sequence evaluated from an empty cache."""
    llm.reset()
    llm.eval(ids)
    return np.array(llm.scores[: len(ids)], dtype=np.float32)


def record_prompts(llm: Llama) -> tuple[list[dict], np.ndarray]:
    prompts, last = [], []
    for text in PROMPTS:
        ids = llm.tokenize(text.encode(), add_bos=True, special=False)
        logits = all_logits(llm, ids)[-1]
        lp = log_softmax(logits)
        top = np.argsort(-logits, kind="stable")[:20]
        greedy: list[int] = []
        llm.reset()
        llm.eval(ids)
        for _ in range(N_GREEDY):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            greedy.append(tok)
            llm.eval([tok])
        forced = log_softmax(all_logits(llm, ids + greedy[:-1])[len(ids) - 1:])
        top2 = []
        for row in forced:
            a, b = np.argsort(-row, kind="stable")[:2]
            top2.append([int(a), float(row[a]), int(b), float(row[b])])
        prompts.append({
            "prompt": text, "prompt_ids": ids,
            "top20_ids": [int(t) for t in top],
            "top20_logits": [float(logits[t]) for t in top],
            "top20_logprobs": [float(lp[t]) for t in top],
            "greedy_48_ids": greedy,
            "greedy_48_text": llm.detokenize(greedy).decode("utf-8", "replace"),
            "teacher_forced_top2": top2,
        })
        last.append(lp.astype(np.float32))
    return prompts, np.stack(last)


def record_perplexity(llm: Llama, text: str, n_ctx: int) -> dict:
    tokens = llm.tokenize(text.encode(), add_bos=True, special=False)
    n_chunks = len(tokens) // n_ctx
    first = n_ctx // 2
    nll, scored = 0.0, 0
    for c in range(n_chunks):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        chunk[0] = llm.token_bos()
        lp = log_softmax(all_logits(llm, chunk))
        for j in range(first, n_ctx - 1):
            nll -= lp[j, tokens[c * n_ctx + j + 1]]
            scored += 1
    return {"text": "gpl-3.txt", "n_ctx": n_ctx, "n_tokens": len(tokens), "n_chunks": n_chunks,
            "scored": scored, "ppl": math.exp(nll / scored)}


def main(model: str) -> None:
    OUT.mkdir(exist_ok=True)
    llm = Llama(model, n_ctx=512, n_batch=512, n_threads=N_THREADS, logits_all=True,
                verbose=False)
    tokenize = [{
        "text": t,
        "add_bos_true": llm.tokenize(t.encode(), add_bos=True, special=False),
        "parse_special_true": llm.tokenize(t.encode(), add_bos=True, special=True),
    } for t in TEXTS]
    prompts, last = record_prompts(llm)
    ref = {"model": Path(model).name,
           "source": f"llama.cpp via llama-cpp-python {__version__}, CPU, n_threads={N_THREADS}",
           "tokenize": tokenize, "prompts": prompts}
    (OUT / "reference.json").write_text(json.dumps(ref, ensure_ascii=False) + "\n")
    np.save(OUT / "last_logprobs.npy", last)
    ppl = record_perplexity(llm, (HERE / "gpl-3.txt").read_text(encoding="utf-8"), 512)
    (OUT / "perplexity-gpl3-ctx512.json").write_text(json.dumps(ppl) + "\n")
    print(f"recorded into {OUT}: PPL {ppl['ppl']:.4f} over {ppl['scored']} tokens")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
