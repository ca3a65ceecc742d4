"""Record llama.cpp's logits on the small model of every family (tests/families.py).

    .venv/bin/python tests/data/families/record.py [--llama-python /work/llamavenv/bin/python]

Run with localllm's environment, it writes each family's GGUF (deterministic, from the
architecture's declaration) and candidate prompts (random token ids; for MoE only those whose
routing is not at a near-tie, see :func:`candidate_prompts`) into a temporary directory,
then runs itself with a Python that has llama-cpp-python (``--record DIR``), which loads
each file unchanged, keeps per length the first prompt where its own top-1 is decisive, and
stores, per family, ``<family>.npz``: the prompts (token ids), the logits of the last ``N_LAST`` positions
of each prompt as float16, the GGUF's SHA-256, and llama-cpp-python's version.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
PROMPT_LENGTHS = (5, 12, 20, 27)
PROMPT_LENGTHS_MOE = (4, 5, 6, 8)  # each routing decision is a chance of a near-tie
N_LAST = 4
N_CTX = 64


MIN_MARGIN = 0.2  # nats between llama.cpp's top two tokens at a prompt's last position


MIN_ROUTER_GAP = 0.005  # MoE: router probability between the last chosen expert and the next
N_CANDIDATES = 3  # per length, for MoE (non-MoE: 50)


class RouterSpy:
    """A MoE layer's router (its ``ffn_gate_inp``) that records, per call, the smallest gap
    between the k-th and the (k+1)-th expert's softmax probability over the tokens."""

    def __init__(self, router, k: int, gaps: list[float]) -> None:
        self.router, self.k, self.gaps = router, k, gaps

    def __call__(self, x):
        import torch

        y = self.router(x)
        p = torch.softmax(y.float(), -1).sort(-1, descending=True).values
        self.gaps.append(float((p[:, self.k - 1] - p[:, self.k]).min()))
        return y


def candidate_prompts(path: Path, seed: int,
                      lengths: tuple[int, ...] | None = None) -> list[list[int]]:
    """Random prompts, N_CANDIDATES per length (``lengths``, default by kind of model; run
    with localllm's environment). For a MoE model only prompts whose every routing decision
    is clear (the k-th expert's probability exceeds the next one's by MIN_ROUTER_GAP in every
    layer, at every position) are kept: at a near-tie, rounding differences between two
    correct implementations pick different experts and the outputs diverge by far more than
    the rounding."""
    from localllm.runtime.session import Session, load_model

    m = load_model(path, device="cpu", progress=False)
    gaps: list[float] = []
    is_moe = bool(getattr(m.args, "n_expert", 0))
    if is_moe:  # every family's router is its layers' ffn_gate_inp
        for b in m.model.layers:
            if getattr(b, "ffn_gate_inp", None) is not None:
                b.ffn_gate_inp = RouterSpy(b.ffn_gate_inp, m.args.n_expert_used, gaps)
    rng = np.random.default_rng(seed)
    out = []
    if lengths is None:
        lengths = PROMPT_LENGTHS_MOE if is_moe else PROMPT_LENGTHS
    for n in lengths:
        found = 0
        while found < (N_CANDIDATES if is_moe else 50):
            ids = rng.integers(4, m.tokenizer.n_vocab - 4, n).tolist()
            gaps.clear()
            if is_moe:
                Session(m, ctx_size=N_CTX).eval(ids)
            if not gaps or min(gaps) >= MIN_ROUTER_GAP:
                out.append(ids)
                found += 1
    return out


def decisive_prompts(llm, candidates: list[list[int]]) -> tuple[list[list[int]], list[np.ndarray]]:
    """The first candidate prompt of each length where llama.cpp's top-1 at the last position
    leads the runner-up by MIN_MARGIN (a near-tie would make the top-1 comparison a coin
    toss), and llama.cpp's logits of their last N_LAST positions."""
    out, logits = [], []
    for n in sorted({len(c) for c in candidates}):
        for ids in (c for c in candidates if len(c) == n):
            llm.reset()
            llm.eval(ids)
            last = np.array(llm.scores[len(ids) - N_LAST:len(ids)], dtype=np.float32)
            top2 = np.sort(last[-1])[-2:]
            if top2[1] - top2[0] >= MIN_MARGIN:
                out.append(ids)
                logits.append(last.astype(np.float16))
                break
        else:
            raise SystemExit(f"no decisive prompt of {n} tokens among the candidates")
    return out, logits


def record(directory: Path) -> None:
    import llama_cpp

    for path in sorted(directory.glob("*.gguf")):
        family = path.stem
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, logits_all=True, seed=0,
                              n_threads=2, verbose=False)
        candidates = json.loads((directory / f"{family}.json").read_text())
        ps, logits = decisive_prompts(llm, candidates)
        sha = (directory / f"{family}.sha256").read_text().strip()
        np.savez_compressed(HERE / f"{family}.npz", sha256=sha, llama_cpp=llama_cpp.__version__,
                            logits=np.stack(logits),
                            **{f"prompt{i}": np.array(p, dtype=np.int32)
                               for i, p in enumerate(ps)})
        top = np.exp(logits[-1][-1].astype(np.float64) - logits[-1][-1].max())
        print(f"{family}: {len(ps)} prompts, top-1 probability of the last position "
              f"{top.max() / top.sum():.2f}")
        del llm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--record", type=Path, help="(internal) record from the GGUFs in DIR")
    ap.add_argument("--llama-python", default="/work/llamavenv/bin/python")
    ap.add_argument("families", nargs="*")
    args = ap.parse_args()
    if args.record:
        record(args.record)
        return
    sys.path.insert(0, str(HERE.parents[1]))
    from families import FAMILIES, PROMPT_LENGTHS, sha256, write_family

    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families or FAMILIES:
            path = write_family(family, tmp)
            (Path(tmp) / f"{family}.sha256").write_text(sha256(path))
            (Path(tmp) / f"{family}.json").write_text(
                json.dumps(candidate_prompts(path, seed=len(family),
                                             lengths=PROMPT_LENGTHS.get(family))))
        subprocess.run([args.llama_python, __file__, "--record", tmp], check=True)


if __name__ == "__main__":
    main()
