"""Soak test: thousands of generated tokens in one chat session, with context shifts.

    python bench/soak.py                                  # gemma3-270m, 10,000 tokens, ctx 512
    python bench/soak.py --tokens 500                     # a quick check
    python bench/soak.py path/to/model.gguf --ctx-size 1024 -n 256

Drives :class:`localllm.cli.repl.ChatREPL` without a terminal (as tests/test_repl.py does): fixed
user messages in a loop, each reply sampled (fixed seed, ``--temp 1.0``, at most ``-n`` tokens),
until ``--tokens`` tokens have been generated. A small ``--ctx-size`` makes the conversation
overflow the context every few turns, so old messages are shifted out (before a turn, and in
the middle of a long reply) and the cache is recomputed.

Checked (issue 8, "steady memory, no errors"): after every reply the process RSS
(``VmRSS`` of /proc/self/status) is recorded; the KV cache is preallocated when the session
is created, so once warm (``--warmup`` replies and the first context shift, whose recompute
is the largest prefill) the RSS must not grow by more than ``--tolerance-mib``. The KV tensors
must be the same objects at the same addresses at the end (never reallocated), and no
``error:`` line may be printed. Exit status 1 when any check fails.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MESSAGES = (
    "Tell me a short story about a lighthouse keeper.",
    "What happened next?",
    "Describe the sea at night in a few sentences.",
    "Write a poem about rain on a tin roof.",
    "Explain how a sailing boat can move against the wind.",
    "Give me three ideas for a quiet weekend.",
    "Continue the story, please.",
    "Why is the sky blue? Answer simply.",
)


def rss_bytes() -> int:
    """Resident set size of this process in bytes (``VmRSS`` of /proc/self/status).

    Raises:
        RuntimeError: /proc/self/status has no VmRSS line (not Linux).
    """
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    raise RuntimeError("no VmRSS in /proc/self/status (Linux only)")


def cache_identity(session) -> list[tuple[int, int, int]]:
    """(id, k.data_ptr(), v.data_ptr()) of each layer's KV cache: equal lists mean that no
    cache was replaced or reallocated."""
    return [(id(c), c.k.data_ptr(), c.v.data_ptr()) for c in session.memory]


def cache_bytes(session) -> int:
    """Bytes of the session's preallocated K and V tensors (all layers)."""
    return sum(t.numel() * t.element_size() for c in session.memory for t in (c.k, c.v))


@dataclass
class SoakResult:
    """Figures of a soak run. RSS values in bytes; ``rss_warm`` is the RSS once warm."""

    tokens: int = 0
    replies: int = 0
    shifts: int = 0  # turns during which the window moved (old messages shifted out)
    mid_reply_shifts: int = 0  # shifts done in the middle of a reply (a "[context shift" notice)
    dropped: int = 0  # messages shifted out in all
    finishes: Counter = field(default_factory=Counter)
    rss_start: int = 0  # before the first reply
    rss_warm: int = 0
    rss_max: int = 0  # after warm-up
    rss_end: int = 0
    rss: list[int] = field(default_factory=list)  # after every reply
    kv_bytes: int = 0
    cache_stable: bool = True
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def rss_growth(self) -> int:
        """Most the RSS rose above its warm value (bytes)."""
        return max(0, self.rss_max - self.rss_warm)

    def ok(self, tolerance: int) -> bool:
        """No error, caches never reallocated, RSS growth within ``tolerance`` bytes."""
        return not self.errors and self.cache_stable and self.rss_growth <= tolerance

    def report(self) -> str:
        mib = 2.0**20
        fin = ", ".join(f"{k}: {v}" for k, v in sorted(self.finishes.items(), key=str))
        return "\n".join([
            f"tokens generated : {self.tokens}",
            f"replies          : {self.replies} (finish: {fin})",
            (f"context shifts   : {self.shifts} turns shifted ({self.mid_reply_shifts} "
             f"mid-reply), {self.dropped} messages dropped"),
            (f"KV cache         : {self.kv_bytes / mib:.2f} MiB preallocated, "
             f"{'same tensors at the end' if self.cache_stable else 'REALLOCATED'}"),
            (f"RSS              : start {self.rss_start / mib:.1f} MiB, after warm-up "
             f"{self.rss_warm / mib:.1f} MiB, max {self.rss_max / mib:.1f} MiB, end "
             f"{self.rss_end / mib:.1f} MiB (growth {self.rss_growth / mib:.1f} MiB)"),
            f"speed            : {self.tok_per_s:.1f} tok/s over {self.seconds:.1f} s",
            f"errors           : {len(self.errors)}",
        ] + [f"  {e}" for e in self.errors[:10]])


def soak(
    llm,
    *,
    n_tokens: int = 10_000,
    ctx_size: int = 512,
    n_predict: int = 128,
    temp: float = 1.0,
    seed: int = 1234,
    system: str | None = "You are a helpful assistant.",
    warmup: int = 3,
    messages: Sequence[str] = MESSAGES,
    on_reply: Callable[[int, SoakResult], None] | None = None,
):
    """Chat with ``llm`` until ``n_tokens`` tokens have been generated.

    Args:
        llm: a :class:`localllm.LLM`.
        ctx_size: context of the chat session (small: frequent context shifts).
        n_predict: most tokens per reply; temp / seed: sampling (the model's other defaults).
        warmup: replies before the RSS baseline (taken no earlier than the first shift).
        on_reply: called with (reply index, result so far) after every reply.
    Returns:
        (SoakResult, the ChatREPL) -- the REPL for further checks of its session.
    """
    from rich.console import Console

    from localllm.cli.repl import ChatREPL

    out = io.StringIO()
    console = Console(file=out, width=200, color_system=None, highlight=False)
    params = llm.sampling_params(temp=temp, seed=seed)
    repl = ChatREPL(llm, console=console, params=params, system=system, n_predict=n_predict,
                    session=llm.session(ctx_size=ctx_size))
    res = SoakResult(kv_bytes=cache_bytes(repl.session))
    session = repl.session
    before = cache_identity(session)
    res.rss_start = rss_bytes()
    warm = False
    t0 = time.perf_counter()
    while res.tokens < n_tokens:
        start = repl.window_start
        try:
            repl.handle_line(messages[res.replies % len(messages)])
        except Exception as e:  # noqa: BLE001 -- the REPL must handle everything itself: record, then stop
            where = traceback.extract_tb(e.__traceback__)[-1]
            res.errors.append(f"reply {res.replies}: {type(e).__name__}: {e} "
                              f"({Path(where.filename).name}:{where.lineno})")
            break
        text = out.getvalue()
        out.seek(0)
        out.truncate()  # the transcript is not kept: it would grow with the run
        res.errors += [f"reply {res.replies}: {line}" for line in text.splitlines()
                       if line.startswith("error:")]
        res.mid_reply_shifts += text.count("[context shift:")
        if repl.window_start > start:
            res.shifts += 1
            res.dropped += repl.window_start - start
        res.tokens += repl.stats.generated
        res.finishes[repl.stats.finish] += 1
        res.replies += 1
        rss = rss_bytes()
        res.rss.append(rss)
        if not warm and res.replies >= warmup and res.shifts > 0:
            warm = True
            res.rss_warm = res.rss_max = rss
        elif warm:
            res.rss_max = max(res.rss_max, rss)
        if on_reply is not None:
            on_reply(res.replies, res)
        if repl.session is not session:
            res.errors.append(f"reply {res.replies}: the REPL replaced its session")
            break
    res.seconds = time.perf_counter() - t0
    res.rss_end = rss_bytes()
    if not warm:  # too short a run to warm up: compare with the start
        res.rss_warm, res.rss_max = res.rss_start, max([res.rss_start, *res.rss])
    res.cache_stable = repl.session is session and cache_identity(session) == before
    return res, repl


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", default="gemma3-270m", help="models.toml name or .gguf")
    ap.add_argument("--tokens", type=int, default=10_000, help="tokens to generate in all")
    ap.add_argument("--ctx-size", "-c", type=int, default=512)
    ap.add_argument("--n-predict", "-n", type=int, default=128, help="most tokens per reply")
    ap.add_argument("--temp", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--device", default="cpu", help="auto, cpu or cuda")
    ap.add_argument("--threads", "-t", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--warmup", type=int, default=3, help="replies before the RSS baseline")
    ap.add_argument("--tolerance-mib", type=float, default=64.0,
                    help="largest RSS growth after warm-up (MiB)")
    ap.add_argument("--quiet", "-q", action="store_true", help="no per-reply line")
    a = ap.parse_args(argv)

    import torch

    from localllm import LLM

    if a.threads:
        torch.set_num_threads(a.threads)
    llm = LLM(a.model, device=a.device, ctx_size=a.ctx_size)

    def progress(i: int, r: SoakResult) -> None:
        if not a.quiet:
            print(f"reply {i:4d}: {r.tokens:6d} tokens, {r.shifts:3d} shifts, "
                  f"RSS {r.rss[-1] / 2**20:7.1f} MiB", file=sys.stderr, flush=True)

    print(f"soak: {llm.path.name}, ctx {a.ctx_size}, -n {a.n_predict}, temp {a.temp}, "
          f"seed {a.seed}, {a.tokens} tokens", flush=True)
    res, _ = soak(llm, n_tokens=a.tokens, ctx_size=a.ctx_size, n_predict=a.n_predict,
                  temp=a.temp, seed=a.seed, warmup=a.warmup, on_reply=progress)
    print(res.report())
    tolerance = int(a.tolerance_mib * 2**20)
    if not res.ok(tolerance):
        why = []
        if res.errors:
            why.append(f"{len(res.errors)} errors")
        if not res.cache_stable:
            why.append("KV cache reallocated")
        if res.rss_growth > tolerance:
            why.append(f"RSS grew {res.rss_growth / 2**20:.1f} MiB > {a.tolerance_mib} MiB")
        print("FAIL: " + ", ".join(why))
        return 1
    print("OK: memory steady, no errors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
