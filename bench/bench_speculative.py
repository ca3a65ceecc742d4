"""Speculative decoding against llama.cpp's plain decode, interleaved (issue #30 item 1).

    .venv/bin/python bench/bench_speculative.py MODEL.gguf --threads 1 --rounds 3 \
        --llama-python /path/to/venv-with-llama_cpp/bin/python [--draft DRAFT.gguf]

Three copy-heavy tasks, named so that the figures can be reproduced (``TASKS``):

* ``edit-code``: a given Python file, then the same file with one function renamed (its
  first lines given);
* ``reformat-json``: a given JSON object on one line, then the same object pretty-printed;
* ``quote-text``: a given passage, then its second paragraph quoted word for word.

Each round runs one localllm process (plain greedy decode, then n-gram drafting with
``--spec-ngram``; with ``--draft``, a draft model too) and one llama.cpp process (plain greedy
decode: ``eval`` plus an argmax, as llama.cpp's own examples decode), alternately, per thread
count. Each side tokenizes the prompt itself (the same file: the same ids), decodes
``--n-gen`` tokens greedily after the prompt, and reports decode tokens per second of wall
time (prefill excluded). Printed: medians over the rounds, the draft acceptance, and the ratio
localllm / llama.cpp. localllm's speculative output is checked token for token against its
plain output (greedy speculative decoding is exact).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

CODE = '''import json
from pathlib import Path


def load_items(path):
    """Read the items of a JSON-lines file."""
    items = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                items.append(json.loads(line))
    return items


def total_price(items):
    return sum(item["price"] * item["quantity"] for item in items)


def main():
    items = load_items(Path("orders.jsonl"))
    print(f"{len(items)} items, total {total_price(items):.2f}")


if __name__ == "__main__":
    main()
'''

RECORD = ('{"id": 4172, "name": "Ada Lovelace", "email": "ada@example.org", "roles": ["admin", '
          '"editor"], "address": {"street": "12 St James Square", "city": "London", "postcode": '
          '"SW1Y 4JH"}, "active": true, "logins": [{"date": "2024-03-01", "ip": "10.0.0.7"}, '
          '{"date": "2024-03-04", "ip": "10.0.0.9"}]}')

PASSAGE = """The lighthouse stood at the end of the causeway, a white tower with a red lantern room.
For a hundred years its keepers had climbed the spiral stair each evening to light the lamp.

In 1962 the light was automated, and the last keeper, a quiet man named Thomas Reed, left the
island with two suitcases and a cat. He said the sea had been the best neighbour he ever had.

Today the tower is a museum. Visitors can climb the stair, read the keepers' logbooks and look
out over the water where so many ships once found their way home.
"""

TASKS = {
    "edit-code": f"# app.py (version 1)\n{CODE}\n\n# app.py (version 2: load_items renamed to "
                 "read_items)\nimport json\nfrom pathlib import Path\n\n\ndef read_items(path):\n",
    "reformat-json": f"Compact JSON:\n{RECORD}\n\nThe same JSON, pretty-printed with an indent "
                     "of 2:\n",
    "quote-text": f"{PASSAGE}\nQuote the second paragraph of the text above word for word:\n\n",
}


def side_ours(path, threads, n_gen, ngram, draft_path, draft_max):
    import torch

    torch.set_num_threads(threads)
    from localllm.runtime.generate import Timings, generate_tokens
    from localllm.runtime.session import Session, load_model
    from localllm.runtime.speculative import ModelDrafter, NgramDrafter
    from localllm.sampling.chain import SamplingParams, build_sampler

    m = load_model(path, device="cpu", progress=False)
    draft = load_model(draft_path, device="cpu", progress=False) if draft_path else None
    res = {}
    for task, text in TASKS.items():
        prompt = m.tokenizer.encode(text)
        modes = ["plain", f"ngram{ngram}"] + (["draft"] if draft is not None else [])
        out = {}
        for mode in modes:
            ctx = len(prompt) + n_gen + 16
            s = Session(m, ctx_size=ctx)
            drafter = (None if mode == "plain"
                       else ModelDrafter(Session(draft, ctx_size=ctx), p_min=0.0)
                       if mode == "draft" else NgramDrafter(ngram))
            sampler = build_sampler(SamplingParams(temp=0.0, ignore_eos=True), m.tokenizer)
            t = Timings()
            toks = [st.token for st in generate_tokens(
                s, prompt, sampler, n_predict=n_gen, timings=t, drafter=drafter,
                draft_max=draft_max)]
            out[mode] = {"tokens": toks, "prompt_tokens": len(prompt),
                         "tg": (len(toks) - 1) / t.generate_seconds,
                         "drafted": t.extra.get("draft_tokens", 0),
                         "accepted": t.extra.get("draft_accepted", 0)}
        res[task] = out
    return res


def side_llama(path, threads, n_gen):
    import llama_cpp
    import numpy as np

    res = {}
    llm = llama_cpp.Llama(model_path=path, n_ctx=2048, n_batch=512, n_ubatch=512,
                          n_gpu_layers=0, n_threads=threads, n_threads_batch=threads,
                          logits_all=False, verbose=False)
    n_vocab, eos = llm.n_vocab(), llm.token_eos()

    def argmax():  # end of generation masked, as localllm's --ignore-eos
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1),
                                       shape=(n_vocab,)).copy()
        logits[eos] = -np.inf
        return int(np.argmax(logits))

    for task, text in TASKS.items():
        prompt = llm.tokenize(text.encode(), add_bos=True, special=False)
        llm.reset()
        llm.eval(prompt)
        tok, toks = argmax(), []
        toks.append(tok)
        t0 = time.perf_counter()
        for _ in range(n_gen - 1):  # the same count of one-token steps as localllm's
            llm.eval([tok])
            tok = argmax()
            toks.append(tok)
        res[task] = {"plain": {"tokens": toks, "prompt_tokens": len(prompt),
                               "tg": (n_gen - 1) / (time.perf_counter() - t0)}}
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, nargs="+", default=[1])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--n-gen", type=int, default=128)
    ap.add_argument("--spec-ngram", type=int, default=4)
    ap.add_argument("--draft-max", type=int, default=7)
    ap.add_argument("--draft", help="a draft model (same vocabulary) to time as well")
    ap.add_argument("--llama-python", help="python with llama_cpp (omit: localllm only)")
    ap.add_argument("--side", choices=["ours", "llama"], help=argparse.SUPPRESS)
    ap.add_argument("--json", help="write all runs and medians to this file")
    a = ap.parse_args()
    if a.side:
        t = a.threads[0]
        r = (side_ours(a.model, t, a.n_gen, a.spec_ngram, a.draft, a.draft_max)
             if a.side == "ours" else side_llama(a.model, t, a.n_gen))
        print(json.dumps(r))
        return
    sides = [("localllm", sys.executable, "ours")]
    if a.llama_python:
        sides.append(("llama.cpp", a.llama_python, "llama"))
    runs: dict = {}
    for rnd in range(a.rounds):
        for t in a.threads:
            for name, py, side in sides:
                cmd = [py, __file__, a.model, "--side", side, "--threads", str(t), "--n-gen",
                       str(a.n_gen), "--spec-ngram", str(a.spec_ngram), "--draft-max",
                       str(a.draft_max)] + (["--draft", a.draft] if a.draft else [])
                r = subprocess.run(cmd, capture_output=True, text=True, check=False)
                if r.returncode != 0:
                    sys.exit(f"error: the {name} side failed: "
                             f"{(r.stderr.strip().splitlines() or ['?'])[-1]}")
                for task, modes in json.loads(r.stdout.strip().splitlines()[-1]).items():
                    for mode, v in modes.items():  # runs["t=1 edit-code"]["localllm plain"]
                        runs.setdefault(f"t={t} {task}", {}).setdefault(
                            f"{name} {mode}", []).append(v)
                        print(f"round {rnd} t={t} {task:13} {name:9} {mode:7} "
                              f"tg {v['tg']:6.1f} tok/s", flush=True)
    print("\nmedians (decode tokens/s, wall time):")
    table = {}
    for where, sides_runs in runs.items():
        row = {label: statistics.median(x["tg"] for x in vs) for label, vs in sides_runs.items()}
        base = row.get("llama.cpp plain")
        plain = sides_runs["localllm plain"][0]["tokens"]
        line = f"{where:17}"
        for label, tg in row.items():
            line += f" | {label} {tg:6.1f}"
            if base and label != "llama.cpp plain":
                line += f" (x{tg / base:.2f})"
            v = sides_runs[label][0]
            if v.get("drafted"):
                same = v["tokens"] == plain
                line += (f" accepted {v['accepted']}/{v['drafted']}"
                         f"{'' if same else ' OUTPUT DIFFERS'}")
        table[where] = row
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"runs": runs, "medians": table}, f, indent=1)


if __name__ == "__main__":
    main()
