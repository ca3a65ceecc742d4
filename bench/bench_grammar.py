"""Grammar benchmark: token-mask time per step and decode slowdown with --json.

    python bench/bench_grammar.py                 # both parts, default model
    python bench/bench_grammar.py --mask-only     # mask timing only (no model weights loaded)

Mask timing: the default model's 262,144-token vocabulary; a JSON document is fed token by
token through each constraint, timing the mask computation (llguidance) and the whole
``apply`` (mask + unpack + masked_fill on the logits). Figures are per token, in ms.
Decode slowdown: ms per generated token, unconstrained and with ``--json`` (any JSON value),
from the generation timings (prompt excluded), and the time spent inside the constraint
itself (apply / is_allowed / accept), which does not depend on what else the CPU is doing.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localllm.grammar.constraint import GrammarConstraint, lltokenizer, resolve_grammar_file

DOC = ('{"name": "Ada Lovelace", "born": 1815, "fields": ["mathematics", "computing"], '
       '"notes": {"first_program": true, "machine": "Analytical Engine", "year": 1843.5}}')


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def bench_masks(tokenizer, repeat: int) -> None:
    t0 = time.perf_counter()
    lltokenizer(tokenizer)
    print(f"llguidance tokenizer build ({tokenizer.n_vocab} tokens): "
          f"{time.perf_counter() - t0:.2f} s (cached per tokenizer)")
    ids = tokenizer.encode(DOC, add_bos=False)
    constraints = {
        "json.gbnf": lambda: GrammarConstraint.from_gbnf(
            resolve_grammar_file("json").read_text(), tokenizer),
        "--json (any value)": lambda: GrammarConstraint.any_json(tokenizer),
        "--json-schema": lambda: GrammarConstraint.from_json_schema({
            "type": "object",
            "properties": {"name": {"type": "string"}, "born": {"type": "integer"},
                           "fields": {"type": "array", "items": {"type": "string"}},
                           "notes": {"type": "object"}},
            "required": ["name", "born"]}, tokenizer),
    }
    logits = torch.zeros(tokenizer.n_vocab)
    print(f"{'grammar':<20} {'compile ms':>10} {'mask p50':>9} {'mask p90':>9} "
          f"{'apply p50':>9} {'apply p90':>9}   ({len(ids)} tokens x {repeat})")
    for name, make in constraints.items():
        t0 = time.perf_counter()
        c = make()
        compile_ms = (time.perf_counter() - t0) * 1e3
        masks, applies = [], []
        for _ in range(repeat):
            c.reset()
            for t in ids:
                t0 = time.perf_counter()
                c.allowed_mask()
                t1 = time.perf_counter()
                c.apply(logits)
                t2 = time.perf_counter()
                masks.append((t1 - t0) * 1e3)
                applies.append((t2 - t1) * 1e3)
                c.accept(t)
            assert c.is_accepting() or name == "json.gbnf"
        print(f"{name:<20} {compile_ms:>10.1f} {pct(masks, .5):>9.3f} {pct(masks, .9):>9.3f} "
              f"{pct(applies, .5):>9.3f} {pct(applies, .9):>9.3f}")


class TimedConstraint:
    """Delegates to a constraint, adding up the seconds spent in it (robust to CPU noise)."""

    def __init__(self, inner: GrammarConstraint) -> None:
        self.inner, self.seconds = inner, 0.0

    def __getattr__(self, name: str):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def bench_decode(llm, n_predict: int) -> None:
    prompt = "Write a JSON object describing a book:"
    results: dict[str, list[float]] = {}
    runs = [("warm-up", lambda: None)]
    runs += [("unconstrained", lambda: None),
             ("--json", lambda: TimedConstraint(GrammarConstraint.any_json(llm.tokenizer)))] * 2
    grammar_ms: list[float] = []
    for name, make in runs:
        c = make()
        generation = llm.stream(prompt, constraint=c, n_predict=n_predict, temp=0.0,
                                ignore_eos=c is None)
        steps = list(generation)
        t = generation.timings
        ms = t.generate_seconds / max(1, t.generated_tokens - 1) * 1e3
        results.setdefault(name, []).append(ms)
        if c is not None:
            grammar_ms.append(c.seconds / max(1, t.generated_tokens) * 1e3)
        print(f"{name:<14} {len(steps):>3} tokens  {ms:8.1f} ms/token  "
              f"{''.join(s.text for s in steps)[:60]!r}")
    base = statistics.median(results["unconstrained"])
    constrained = statistics.median(results["--json"])
    print(f"decode slowdown with --json: {(constrained / base - 1) * 100:+.1f}% "
          f"({constrained:.1f} vs {base:.1f} ms/token; wall clock, noisy on a shared machine)")
    spent = statistics.median(grammar_ms)
    print(f"time inside the grammar constraint: {spent:.3f} ms/token = "
          f"{spent / base * 100:.2f}% of an unconstrained decode step")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="models.toml name or .gguf path")
    ap.add_argument("--mask-only", action="store_true", help="skip the decode comparison")
    ap.add_argument("--repeat", type=int, default=3, help="passes over the JSON document")
    ap.add_argument("-n", "--n-predict", type=int, default=32, help="tokens per decode run")
    args = ap.parse_args()
    if args.mask_only:
        from localllm.gguf.file import open_gguf
        from localllm.registry import load_registry
        from localllm.tokenizer import Tokenizer

        path, _ = load_registry().resolve(args.model)
        bench_masks(Tokenizer(open_gguf(path).metadata), args.repeat)
        return
    from localllm import LLM

    llm = LLM(args.model, device="cpu")
    bench_masks(llm.tokenizer, args.repeat)
    bench_decode(llm, args.n_predict)


if __name__ == "__main__":
    main()
