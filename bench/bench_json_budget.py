"""Structured output within the token budget, many random schemas (issue 32's benchmark).

    python bench/bench_json_budget.py --count 200            # the default model, on the CPU
    python bench/bench_json_budget.py --count 50 --max-budget 120 --device cuda

Each example draws a random schema (tests/json_schemas.py: nested objects and arrays,
required and optional properties, enums, numeric bounds, string lengths, with and without
``additionalProperties``), a budget between the smallest valid value's size in tokens and
``--max-budget``, a seed, a temperature and strict or not, then asks
``create_completion(..., response_format={"type": "json_schema", ...}, max_tokens=budget)``.
An example passes when the text parses (no duplicate keys, no NaN/Infinity), validates with
``jsonschema`` and the finish reason is ``stop``. Prints one line per example and the pass
rate; ``--out FILE`` writes every example (schema included) as JSON lines, so a failure
can be replayed with ``--replay FILE --index I``.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from json_schemas import check_output, random_schema

from localllm import LLM
from localllm.grammar.schema import Schemas

PROMPT = "Produce a realistic example as JSON."


def example(rng: random.Random, llm: LLM, max_budget: int) -> dict:
    schema = random_schema(rng)
    smallest = Schemas(schema).minimal(schema).decode()
    n_small = len(llm.tokenize(smallest, add_bos=False))
    return {"schema": schema, "smallest": n_small,
            "budget": rng.randint(n_small, max(n_small, max_budget)),
            "seed": rng.randrange(2**31), "temperature": rng.choice([0.3, 0.8, 1.0, 1.5]),
            "strict": rng.random() < 0.5}


def run(llm: LLM, case: dict) -> dict:
    t0 = time.perf_counter()
    r = llm.create_completion(
        PROMPT, max_tokens=case["budget"], seed=case["seed"], temperature=case["temperature"],
        response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": case["schema"], "strict": case["strict"]}})
    choice = r["choices"][0]
    why = check_output(choice["text"], case["schema"])
    if why is None and choice["finish_reason"] != "stop":
        why = f"finish_reason {choice['finish_reason']}"
    return {**case, "text": choice["text"], "finish_reason": choice["finish_reason"],
            "tokens": r["usage"]["completion_tokens"], "seconds": time.perf_counter() - t0,
            "ok": why is None, "why": why}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--max-budget", type=int, default=300)
    ap.add_argument("--start", type=int, default=0, help="first example index (its RNG seed)")
    ap.add_argument("--out", type=Path, help="write every example as JSON lines")
    ap.add_argument("--replay", type=Path, help="a file written by --out")
    ap.add_argument("--index", type=int, help="with --replay: the example to run again")
    args = ap.parse_args()
    llm = LLM(args.model, device=args.device, ctx_size=4096)
    if args.replay:
        lines = [json.loads(x) for x in args.replay.read_text().splitlines() if x.strip()]
        cases = [lines[args.index]] if args.index is not None else lines
    else:
        cases = None
    out = args.out.open("a") if args.out else None
    passed = total = 0
    t0 = time.perf_counter()
    indices = range(len(cases)) if cases else range(args.start, args.start + args.count)
    for i in indices:
        case = cases[i] if cases else example(random.Random(i), llm, args.max_budget)
        got = run(llm, {k: case[k] for k in ("schema", "smallest", "budget", "seed",
                                              "temperature", "strict")})
        total += 1
        passed += got["ok"]
        print(f"{i:5d} {'ok  ' if got['ok'] else 'FAIL'} budget {got['budget']:3d} "
              f"(smallest {got['smallest']:3d}) used {got['tokens']:3d} "
              f"temp {got['temperature']} strict {got['strict']!s:5} "
              f"{got['seconds']:6.1f}s {got['why'] or ''}", flush=True)
        if not got["ok"]:
            print(f"      schema {json.dumps(got['schema'])}\n      text   {got['text']!r}")
        if out:
            out.write(json.dumps({"index": i, **got}) + "\n")
            out.flush()
    print(f"{passed}/{total} passed ({100.0 * passed / max(total, 1):.1f}%), "
          f"budgets up to {args.max_budget} tokens, {args.model} on {args.device}, "
          f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
