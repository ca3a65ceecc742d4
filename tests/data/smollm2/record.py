"""Record llama.cpp's reference for smollm2-135m-instruct (developer tool; llama venv).

Needs llama-cpp-python (an oracle only, never a dependency of localllm) and the pulled model::

    localllm pull smollm2-135m-instruct
    /work/llamavenv/bin/python tests/data/smollm2/record.py PATH/SmolLM2-135M-Instruct.Q4_1.gguf

Writes, beside this file:

* ``reference.json``: tokenization of tricky texts; chat conversations rendered by
  llama-cpp-python's jinja path (``Jinja2ChatFormatter`` on the GGUF's
  ``tokenizer.chat_template``) and by ``llama_chat_apply_template`` (llama.cpp's built-in
  detection), with their token ids; per prompt the top-20 next tokens, 48 greedy tokens and
  teacher-forced top-2 log-probs;
* ``last_logprobs.npy``: (n_prompts, n_vocab) float16 next-token log-probs at each prompt's end;
* ``perplexity-gpl3-ctx512.json``: llama-perplexity's figure on tests/data/reference/gpl-3.txt
  (chunks of 512 tokens from an empty cache, the second half of each scored).
"""

from __future__ import annotations

import ctypes
import json
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from oracle import GPL3, log_softmax

TEXTS = [
    "Hello, world! The quick brown fox",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\ndone",
    "naïve café résumé — “quotes” ‘single’",
    "你好，llama！这是一个测试。",
    "numbers 1234567 and 3.14159, code: def f(x): return x**2",
    "<|im_start|>user\nHi<|im_end|>\n",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What are the three primary colors?"}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Name a large animal."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello! How can I help you today?"},
     {"role": "user", "content": "Tell me a fact about the moon."}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris"},
     {"role": "user", "content": "And of Italy?"}],
]
PLAIN_PROMPTS = ["The capital of France is", "def fibonacci(n):"]


def main() -> None:
    import llama_cpp as lc
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    path = sys.argv[1]
    if "--perplexity-only" in sys.argv:
        return record_perplexity(lc, path)
    llm = lc.Llama(path, n_ctx=2048, logits_all=True, n_threads=2, verbose=False, seed=0)
    vocab = lc.llama_model_get_vocab(llm.model)
    meta = llm.metadata
    text_of = lambda i: lc.llama_vocab_get_text(vocab, i).decode()
    bos, eos = lc.llama_vocab_bos(vocab), lc.llama_vocab_eos(vocab)
    add_bos = bool(lc.llama_vocab_get_add_bos(vocab))
    template = meta["tokenizer.chat_template"]
    formatter = Jinja2ChatFormatter(template, eos_token=text_of(eos), bos_token=text_of(bos),
                                    add_generation_prompt=True)

    def tok(text: str, add_special: bool, parse_special: bool) -> list[int]:
        return llm.tokenize(text.encode(), add_bos=add_special, special=parse_special)

    def builtin(messages: list[dict]) -> str:
        arr = (lc.llama_chat_message * len(messages))()
        keep = []
        for k, m in enumerate(messages):
            r, c = m["role"].encode(), m["content"].encode()
            keep += [r, c]
            arr[k].role, arr[k].content = r, c
        buf = ctypes.create_string_buffer(16384)
        n = lc.llama_chat_apply_template(template.encode(), arr, len(messages), True, buf, 16384)
        assert 0 < n < 16384, n
        return buf.raw[:n].decode()

    ref: dict = {
        "model": Path(path).name,
        "source": f"llama.cpp via llama-cpp-python {lc.__version__}, CPU, n_threads=2",
        "add_bos": add_bos, "bos": bos, "eos": eos,
        "eog": [i for i in range(llm.n_vocab()) if lc.llama_vocab_is_eog(vocab, i)],
        "tokenize": [
            {"text": t, "plain": tok(t, False, False), "add_special": tok(t, True, False),
             "parse_special": tok(t, True, True)}
            for t in TEXTS
        ],
        "chat": [],
        "prompts": [],
    }
    prompts = []
    for conv in CONVERSATIONS:
        jinja = formatter(messages=conv).prompt
        ids = tok(jinja, add_bos, True)
        ref["chat"].append({"messages": conv, "jinja": jinja, "builtin": builtin(conv),
                            "ids": ids})
        prompts.append((jinja, ids))
    prompts += [(p, tok(p, add_bos, False)) for p in PLAIN_PROMPTS]

    last = []
    for prompt, ids in prompts:
        llm.reset()
        llm.eval(ids)
        lp = log_softmax(llm.scores[len(ids) - 1])
        last.append(lp)
        top = np.argsort(-lp)[:20]
        greedy = []
        for _ in range(48):
            t = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            greedy.append(t)
            if lc.llama_vocab_is_eog(vocab, t):
                break
            llm.eval([t])
        llm.reset()
        full = ids + greedy
        llm.eval(full[:-1])
        forced = []
        for j in range(len(greedy)):
            row = log_softmax(llm.scores[len(ids) - 1 + j])
            a, b = np.argsort(-row)[:2]
            forced.append([int(a), float(row[a]), int(b), float(row[b])])
        ref["prompts"].append({
            "prompt": prompt, "prompt_ids": ids,
            "top20_ids": [int(i) for i in top], "top20_logprobs": [float(lp[i]) for i in top],
            "greedy_48_ids": greedy,
            "greedy_48_text": llm.detokenize(greedy).decode(errors="replace"),
            "teacher_forced_top2": forced,
        })
    np.save(HERE / "last_logprobs.npy", np.stack(last).astype(np.float16))
    (HERE / "reference.json").write_text(json.dumps(ref, ensure_ascii=False, indent=1))
    record_perplexity(lc, path)


def record_perplexity(lc, path: str) -> None:
    # llama-perplexity: the whole text tokenized once, chunks of n_ctx from an empty cache,
    # the first token replaced by BOS when the vocabulary adds one, the second half scored.
    n_ctx = 512
    text = GPL3.read_text()
    ppl_llm = lc.Llama(path, n_ctx=n_ctx, n_batch=n_ctx, logits_all=True, n_threads=2,
                       verbose=False)
    vocab = lc.llama_model_get_vocab(ppl_llm.model)
    add_bos, bos = bool(lc.llama_vocab_get_add_bos(vocab)), lc.llama_vocab_bos(vocab)
    tokens = ppl_llm.tokenize(text.encode(), add_bos=add_bos, special=False)
    n_chunks = len(tokens) // n_ctx
    nll, first = [], n_ctx // 2
    for c in range(n_chunks):
        chunk = tokens[c * n_ctx:(c + 1) * n_ctx]
        if add_bos:
            chunk[0] = bos
        ppl_llm.reset()
        ppl_llm.eval(chunk)
        lp = log_softmax(ppl_llm.scores[first:n_ctx - 1])
        nll += [-lp[j, chunk[first + 1 + j]] for j in range(n_ctx - 1 - first)]
        print(f"chunk {c + 1}/{n_chunks}: ppl so far {np.exp(np.mean(nll)):.4f}", flush=True)
    (HERE / "perplexity-gpl3-ctx512.json").write_text(json.dumps({
        "text": "gpl-3.txt", "n_ctx": n_ctx, "n_tokens": len(tokens), "n_chunks": n_chunks,
        "scored": len(nll), "ppl": float(np.exp(np.mean(nll))),
    }))
    print("ppl", float(np.exp(np.mean(nll))))


if __name__ == "__main__":
    main()
