"""Chat benchmark: the KV cache is reused across turns (issue 5).

    python bench/bench_chat.py                       # gemma3-270m on the CPU, 8 turns
    python bench/bench_chat.py --turns 8 -n 48 --device cuda

Drives :class:`localllm.cli.repl.ChatREPL` without a terminal with fixed user messages and greedy
replies. Each turn re-renders the whole conversation with the chat template; the REPL keeps
the cached prefix and prefills only the new turn's tokens, so the time to first token should
not grow with the history. Per turn the table gives: the tokens of history already in the
cache, the tokens reused and prefilled, the time to first token (ms: prefill + first sample),
and -- with ``--cold`` (default) -- the time to first token of the same prompt in a fresh
session (everything prefilled), which is what a turn would cost without the reuse.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MESSAGES = (
    "Hi! Can you help me plan a short trip to Lisbon?",
    "What are three neighbourhoods worth walking around?",
    "Which one is best for food?",
    "What should I order at a pastelaria?",
    "How do I get there from the airport?",
    "Is three days enough for the city?",
    "Suggest a day trip outside Lisbon.",
    "Summarise the plan in five bullet points.",
)


def cold_ttft(llm, prompt: list[int], ctx_size: int, params) -> float:
    """Seconds to the first token of ``prompt`` in a fresh session (full prefill + sample)."""
    from localllm.sampling.chain import build_sampler

    session = llm.session(ctx_size=ctx_size)
    sampler = build_sampler(params, llm.tokenizer)
    t0 = time.perf_counter()
    sampler.sample(session.eval(prompt))
    return time.perf_counter() - t0


def run(llm, *, turns: int, n_predict: int, ctx_size: int, cold: bool,
        messages: Sequence[str] = MESSAGES) -> list[dict]:
    """Play ``turns`` turns; one row of figures per turn (times in ms)."""
    from rich.console import Console

    from localllm.cli.repl import ChatREPL

    params = llm.sampling_params(temp=0.0)
    repl = ChatREPL(llm, console=Console(file=io.StringIO(), width=200, color_system=None),
                    params=params, n_predict=n_predict, session=llm.session(ctx_size=ctx_size))
    repl.handle_line("Hello.")  # warm-up (first-call allocations), then start over
    repl.handle_line("/clear")
    rows = []
    for i in range(turns):
        history = len(repl.session.tokens)
        repl.handle_line(messages[i % len(messages)])
        st = repl.stats
        prompt_len = st.prompt_reused + st.prompt_evaluated
        row = {"turn": i + 1, "history": history, "reused": st.prompt_reused,
               "prefilled": st.prompt_evaluated, "prompt": prompt_len,
               "ttft_ms": st.first_token_seconds * 1e3, "generated": st.generated,
               "tok_s": st.generated / st.seconds if st.seconds > 0 else 0.0}
        if cold:
            prompt = repl._encode(repl.window()[:-1])  # the prompt of this turn
            row["cold_ttft_ms"] = cold_ttft(llm, prompt, ctx_size, params) * 1e3
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    cold = "cold_ttft_ms" in rows[0]
    head = ("| turn | history tokens | reused | new tokens prefilled | TTFT ms |"
            + (" cold TTFT ms (no reuse) |" if cold else "") + " reply tokens | tok/s |")
    sep = "|" + "---|" * (head.count("|") - 1)
    lines = [head, sep]
    for r in rows:
        lines.append(f"| {r['turn']} | {r['history']} | {r['reused']} | {r['prefilled']} | "
                     f"{r['ttft_ms']:.0f} |" + (f" {r['cold_ttft_ms']:.0f} |" if cold else "")
                     + f" {r['generated']} | {r['tok_s']:.1f} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="gemma3-270m", help="models.toml name or .gguf")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--n-predict", "-n", type=int, default=48, help="most tokens per reply")
    ap.add_argument("--ctx-size", "-c", type=int, default=4096)
    ap.add_argument("--device", default="cpu", help="auto, cpu or cuda")
    ap.add_argument("--threads", "-t", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--no-cold", dest="cold", action="store_false",
                    help="skip the fresh-session time to first token")
    a = ap.parse_args(argv)

    import torch

    from localllm import LLM

    if a.threads:
        torch.set_num_threads(a.threads)
    llm = LLM(a.model, device=a.device, ctx_size=a.ctx_size)
    rows = run(llm, turns=a.turns, n_predict=a.n_predict, ctx_size=a.ctx_size, cold=a.cold)
    print(f"{llm.path.name}, device {llm.device}, ctx {a.ctx_size}, greedy, -n {a.n_predict}, "
          f"torch threads {torch.get_num_threads()}")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
