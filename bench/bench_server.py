"""Server benchmark (issue 18): HTTP overhead and the prefix cache's time to first token.

    python bench/bench_server.py                      # gemma3-270m on the CPU
    python bench/bench_server.py --device cuda --repeats 20

1. Overhead: time to first token of the same short completion (``max_tokens=1``, streamed)
   through ``LLM.create_completion`` in-process and through ``localllm serve`` with the
   official ``openai`` client over 127.0.0.1; the prompt is repeated, so the prefix cache
   leaves one token to prefill and the difference is the server's cost (HTTP, JSON, SSE,
   the queue's thread hop). Medians over ``--repeats``.
2. Prefix cache: a 500-token shared prefix (a long system text) with two different
   questions after it. Time to first token of the second question with the cache
   (``cache_prompt``, the default) against the same request with ``cache_prompt: false``
   (the whole prompt prefilled), both through the server.
3. Streaming cost per token (issue #29): ``--stream-tokens`` greedy tokens (``ignore_eos``)
   streamed in-process (``LLM.create_completion(stream=True)``) and through the server with
   the ``openai`` client; the time from the first chunk to the last over the tokens after
   the first, medians over ``--repeats``; the difference is what the server adds per token.
4. The lazy tool-call grammar before its trigger (issue #29): the same chat request with a
   tool and ``tool_choice="auto"`` and without tools, in-process, time per generated token
   from the generation's timings (chunk gaps are not token times there: text is held back
   while a call could still open); the run reports whether a trigger fired.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PARAGRAPH = ("The library keeps its quantized weights in GGUF files and reads them with memory "
             "maps; the runtime holds one sequence and reuses the cached prefix of the previous "
             "request, so a long shared system prompt is evaluated only once. ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def shared_prefix(llm, n_tokens: int) -> str:
    ids = llm.tokenize(PARAGRAPH * (n_tokens // 20 + 2), add_bos=False)[:n_tokens]
    return llm.detokenize(ids)


def first_chunk_seconds(stream_factory) -> float:
    t0 = time.perf_counter()
    stream = stream_factory()
    for _ in stream:
        elapsed = time.perf_counter() - t0
        break
    for _ in stream:  # drain (max_tokens=1: nothing much)
        pass
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default="gemma3-270m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--prefix", type=int, default=500, help="shared prefix tokens")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--stream-tokens", type=int, default=64)
    args = ap.parse_args()

    import openai
    import torch

    from localllm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)
    llm = LLM(args.model, device=args.device, ctx_size=2048)
    prompt = "The capital of France is"
    for _ in range(3):  # warm-up
        llm.create_completion(prompt, max_tokens=1)
    local = [first_chunk_seconds(lambda m=llm: m.create_completion(prompt, max_tokens=1, stream=True))
             for _ in range(args.repeats)]
    n_stream = args.stream_tokens
    stream_kw = {"max_tokens": n_stream, "temperature": 0.0}
    local_stream = [per_token_seconds(llm.create_completion(
        prompt, stream=True, ignore_eos=True, **stream_kw)) for _ in range(args.repeats)]
    lazy, plain, fired = lazy_grammar_seconds(llm, n_stream, args.repeats)

    port = free_port()
    cmd = [sys.executable, "-c", "from localllm.cli import main; main()", "serve", args.model,
           "--port", str(port), "--device", args.device, "-c", "2048"]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, env={**os.environ})
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                               max_retries=0)
        deadline = time.monotonic() + 300
        while True:
            try:
                # the name the server gives the model (a file's is not its path)
                served_id = client.models.list().data[0].id
                break
            except openai.APIConnectionError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise SystemExit("the server did not start") from None
                time.sleep(0.3)
        del llm  # one copy of the model at a time from here on

        def remote(p: str, **extra):
            return lambda: client.completions.create(model=served_id, prompt=p, max_tokens=1,
                                                     stream=True, extra_body=extra or None)

        for _ in range(3):
            first_chunk_seconds(remote(prompt))
        served = [first_chunk_seconds(remote(prompt)) for _ in range(args.repeats)]
        served_stream = [per_token_seconds(client.completions.create(
            model=served_id, prompt=prompt, stream=True, extra_body={"ignore_eos": True},
            **stream_kw)) for _ in range(args.repeats)]

        prefix = shared_prefix(_Tok(args.model), args.prefix)
        questions = [f"\nQuestion {i}: what does the runtime reuse?"
                     for i in range(args.repeats + 1)]
        cold, warm = [], []
        for i in range(args.repeats):
            cold.append(first_chunk_seconds(remote(prefix + questions[i], cache_prompt=False)))
            first_chunk_seconds(remote(prefix + questions[i]))  # the cache now holds the prefix
            warm.append(first_chunk_seconds(remote(prefix + questions[i + 1])))
    finally:
        server.terminate()
        server.wait(30)

    med = statistics.median
    rows = {
        "ttft_in_process_ms": med(local) * 1e3,
        "ttft_server_ms": med(served) * 1e3,
        "server_overhead_ms": (med(served) - med(local)) * 1e3,
        f"ttft_{args.prefix}_prefix_cold_ms": med(cold) * 1e3,
        f"ttft_{args.prefix}_prefix_cached_ms": med(warm) * 1e3,
        "cached_over_cold": med(warm) / med(cold),
        "stream_in_process_ms_per_token": med(local_stream) * 1e3,
        "stream_server_ms_per_token": med(served_stream) * 1e3,
        "stream_overhead_ms_per_token": (med(served_stream) - med(local_stream)) * 1e3,
        "chat_no_tools_ms_per_token": med(plain) * 1e3,
        "chat_lazy_tool_grammar_ms_per_token": med(lazy) * 1e3,
        "lazy_grammar_cost_ms_per_token": (med(lazy) - med(plain)) * 1e3,
    }
    for k, v in rows.items():
        print(f"{k:>32}  {v:9.3f}")
    if fired:
        print(f"note: the tool-call trigger fired in {fired} of the lazy-grammar runs")
    print(json.dumps({"model": args.model, "device": args.device, "repeats": args.repeats,
                      **{k: round(v, 4) for k, v in rows.items()}}))


def per_token_seconds(stream) -> float:
    """Seconds per streamed chunk after the first (each chunk carries one token)."""
    stamps = [time.perf_counter() for _ in stream]
    if len(stamps) < 3:
        raise SystemExit("error: the stream ended after fewer than 3 chunks")
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1)


TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def lazy_grammar_seconds(llm, n: int, repeats: int) -> tuple[list, list, int]:
    """Per-token seconds of a streamed chat reply with a tool offered (``tool_choice="auto"``:
    the family's lazy call grammar waits for its trigger) and without, from the generation's
    own timings; how many runs opened a call (the trigger fired)."""
    messages = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]
    lazy, plain, fired = [], [], 0
    for _ in range(repeats):
        for tools, out in ((None, plain), ([TOOL], lazy)):
            chunks = llm.create_chat_completion(messages, tools=tools, max_tokens=n,
                                                temperature=0.0, stream=True, ignore_eos=True)
            called, timings = False, None
            for c in chunks:
                delta = c["choices"][0]["delta"] if c["choices"] else {}
                called |= bool(delta.get("tool_calls"))
                timings = c.get("timings", timings)
            fired += called and tools is not None
            # the generation's own per-token time (llama-server's timings, in the last
            # chunk): a chunk may carry several tokens (text held back while a call could
            # still open), so chunk gaps are not token times
            out.append(timings["predicted_per_token_ms"] / 1e3)
    return lazy, plain, fired


class _Tok:
    """Just the tokenizer of a model (no weights), for building the shared prefix."""

    def __init__(self, model: str) -> None:
        from localllm.gguf.file import open_gguf
        from localllm.registry import load_registry
        from localllm.tokenizer import Tokenizer

        path, _ = load_registry().resolve(model)
        self.tokenizer = Tokenizer(open_gguf(path).metadata)

    def tokenize(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tokenizer.encode(text, add_bos=add_bos)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(ids)


if __name__ == "__main__":
    main()
