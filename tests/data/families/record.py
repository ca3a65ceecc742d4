"""Record llama.cpp's logits on the small model of every family (tests/families.py).

    .venv/bin/python tests/data/families/record.py [--llama-python /work/llamavenv/bin/python]

Run with localllm's environment, it writes each family's GGUF (deterministic, from the
architecture's declaration) and candidate prompts (random token ids; for MoE only those whose
routing is not at a near-tie, see :func:`candidate_prompts`) into a temporary directory,
then runs itself with a Python that has llama-cpp-python (``--record DIR``), which loads
each file unchanged, keeps per length the first prompt where its own top-1 is decisive, and
stores, per family, ``<family>.npz``: the prompts (token ids), the logits of the last ``N_LAST`` positions
of each prompt as float16, the GGUF's SHA-256, and llama-cpp-python's version.

The recurrent families (``families.RECURRENT``) add a prompt of ``LONG_PROMPT`` tokens (a
recurrent prefill in several chunks, with context checkpoints, whose last positions the test
also evaluates as one-token decode steps) in a context of ``N_CTX_LONG``, and llama-perplexity's
figure (``ppl``; not for MoE, where a routing near-tie somewhere in the text is sure) on a
text of ``PPL_CHUNKS`` x ``PPL_CTX`` tokens the model sampled itself (``ppl_tokens``:
:func:`sampled_text`), in chunks of ``PPL_CTX`` from an empty memory, the second half of
each scored.
of each prompt as float16, the GGUF's SHA-256, and llama-cpp-python's version. A file whose
RoPE llama.cpp cannot read as written (the ``llama3`` scaling keys) is given to llama.cpp as
its converter would have written it (:func:`as_llama_cpp_runs_it`).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
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
LONG_PROMPT = 300
N_CTX_LONG = 512
PPL_CTX = 128
PPL_CHUNKS = 4


MIN_MARGIN = 0.2  # nats between llama.cpp's top two tokens at a prompt's last position


MIN_ROUTER_GAP = 0.005  # MoE: router probability between the last chosen expert and the next
MIN_ROUTER_LOGIT_GAP = 0.2  # Llama 4 (selection on the router's logits)
# deepseek2 (sigmoid gating, groups): its scores move by up to ~0.02 between llama.cpp and
# localllm (MLA's chain of products, each rounded by llama.cpp's 8-bit activations)
MIN_ROUTER_GAP_MLA = 0.01
N_CANDIDATES = 3  # per length, for MoE (non-MoE: 50)


class RouterSpy:
    """A MoE layer's router (its ``ffn_gate_inp``) that records, per call, the smallest gap
    between the k-th and the (k+1)-th expert's selection score over the tokens: the softmax
    probability, for sigmoid gating (GLM-4.5) the sigmoid plus the selection bias, and for
    Llama 4 (``logits``: selection on the router's logits) the logit gap; each as a fraction
    of its threshold (MIN_ROUTER_GAP, MIN_ROUTER_LOGIT_GAP: with 128 experts a probability
    gap of MIN_ROUTER_GAP is a logit gap small enough for the two CPU paths' rounding to
    cross), so that a prompt is kept where every recorded value is at least 1."""

    def __init__(self, router, k: int, gaps: list[float], gating: str = "softmax",
                 bias=None) -> None:
        self.router, self.k, self.gaps = router, k, gaps
        self.gating, self.bias = gating, bias

    def __call__(self, x):
        import torch

        y = self.router(x)
        if self.gating == "logits":
            lg = y.float().sort(-1, descending=True).values
            self.gaps.append(float((lg[:, self.k - 1] - lg[:, self.k]).min())
                             / MIN_ROUTER_LOGIT_GAP)
            return y
        p = torch.sigmoid(y.float()) if self.gating == "sigmoid" else torch.softmax(y.float(), -1)
        if self.bias is not None:
            p = p + self.bias
        p = p.sort(-1, descending=True).values
        self.gaps.append(float((p[:, self.k - 1] - p[:, self.k]).min()) / MIN_ROUTER_GAP)
        return y


def candidate_prompts(path: Path, seed: int, *, long: bool = False,
                      lengths: tuple[int, ...] | None = None,
                      extra_lengths: tuple[int, ...] = ()) -> list[list[int]]:
    """Random prompts, N_CANDIDATES per length (``lengths``, default by kind of model, then
    ``extra_lengths``, and with ``long`` a LONG_PROMPT for non-MoE models; run with
    localllm's environment). For a MoE model only prompts whose every routing decision is
    clear (the k-th expert's score exceeds the next one's by MIN_ROUTER_GAP in every layer,
    at every position: :class:`RouterSpy`) are kept: at a near-tie, rounding differences
    between two correct implementations pick different experts and the outputs diverge by
    far more than the rounding."""
    import torch

    from localllm.models import deepseek2
    from localllm.runtime.session import Session, load_model

    m = load_model(path, device="cpu", progress=False)
    gaps: list[float] = []
    route = deepseek2.route

    def spy_route(logits, a, bias):
        # deepseek2: the gaps of its selection scores, of the groups' scores too
        p = torch.softmax(logits, -1) if a.gating == "softmax" else torch.sigmoid(logits)
        s = p if bias is None else p + bias
        if a.n_group > 1:
            grouped = s.view(s.shape[0], a.n_group, -1)
            g = grouped.topk(2, -1).values.sum(-1).sort(-1, descending=True)
            gaps.append(float((g.values[:, a.n_group_used - 1]
                               - g.values[:, a.n_group_used]).min()) / MIN_ROUTER_GAP_MLA)
            out = torch.ones_like(g.values, dtype=torch.bool).scatter_(
                1, g.indices[:, :a.n_group_used], False)
            s = grouped.masked_fill(out[:, :, None], float("-inf")).view(s.shape[0], -1)
        s = s.sort(-1, descending=True).values
        k = a.n_expert_used
        gaps.append(float((s[:, k - 1] - s[:, k]).min()) / MIN_ROUTER_GAP_MLA)
        return route(logits, a, bias)

    is_moe = bool(getattr(m.args, "n_expert", 0))
    if is_moe and m.args.arch == "deepseek2":  # its own routing function (groups)
        deepseek2.route = spy_route
    elif is_moe:  # every other family's router is its layers' ffn_gate_inp
        gating = "logits" if m.args.arch == "llama4" else getattr(m.args, "gating", "softmax")
        for b in m.model.layers:
            if getattr(b, "ffn_gate_inp", None) is not None:
                b.ffn_gate_inp = RouterSpy(b.ffn_gate_inp, m.args.n_expert_used, gaps, gating,
                                           getattr(b, "exp_probs_b_bias", None))
    rng = np.random.default_rng(seed)
    out = []
    if lengths is None:
        lengths = PROMPT_LENGTHS_MOE if is_moe else PROMPT_LENGTHS
    if long and not is_moe:  # a MoE prompt this long always has a near-tie somewhere
        lengths = (*lengths, LONG_PROMPT)
    try:
        for n in (*lengths, *extra_lengths):
            found = 0
            while found < (N_CANDIDATES if is_moe else 50):
                ids = rng.integers(4, m.tokenizer.n_vocab - 4, n).tolist()
                gaps.clear()
                if is_moe:
                    Session(m, ctx_size=max(N_CTX_LONG, n + 1)).eval(ids)
                if not gaps or min(gaps) >= 1.0:  # each gap over its threshold
                    out.append(ids)
                    found += 1
    finally:
        deepseek2.route = route
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


def sampled_text(llm, n_ctx: int, n_chunks: int, seed: int) -> list[int]:
    """The perplexity text: ``n_chunks`` runs of ``n_ctx`` tokens, each sampled by llama.cpp
    at temperature 1 from an empty memory after a random first token, so that the model
    predicts it as well as it predicts its own text (a random-weights model gives other
    text a perplexity in the hundreds of thousands, where only its far tails count)."""
    rng = np.random.default_rng(seed)
    tokens: list[int] = []
    for _ in range(n_chunks):
        llm.reset()
        chunk = [int(rng.integers(4, llm.n_vocab() - 4))]
        while len(chunk) < n_ctx:
            llm.eval(chunk[-1:])
            x = np.array(llm.scores[len(chunk) - 1], dtype=np.float64)
            p = np.exp(x - x.max())
            chunk.append(int(rng.choice(len(p), p=p / p.sum())))
        tokens += chunk
    return tokens


def llama_perplexity(llm, tokens: list[int], n_ctx: int) -> float:
    """llama-perplexity's PPL of ``tokens`` in chunks of ``n_ctx`` (each from an empty memory,
    its first token replaced by BOS when the vocabulary adds one; positions n_ctx/2 ..
    n_ctx-2 scored), from llama.cpp's logits."""
    bos, add_bos = llm.token_bos(), llm._model.add_bos_token()
    nll = []
    for c in range(len(tokens) // n_ctx):
        chunk = list(tokens[c * n_ctx:(c + 1) * n_ctx])
        if add_bos:
            chunk[0] = bos
        llm.reset()
        llm.eval(chunk)
        x = np.array(llm.scores[n_ctx // 2:n_ctx - 1], dtype=np.float64)
        x -= x.max(-1, keepdims=True)
        logp = x - np.log(np.exp(x).sum(-1, keepdims=True))
        nll += [-logp[j, chunk[n_ctx // 2 + 1 + j]] for j in range(len(x))]
    return float(np.exp(np.mean(nll)))


def record(directory: Path) -> None:
    import llama_cpp

    for path in sorted(directory.glob("*.gguf")):
        family = path.stem
        long = (directory / f"{family}.long").exists()
        # YaRN's betas from the file where the family reads them (llama.cpp's own default;
        # llama-cpp-python's is to force 32 and 1)
        candidates = json.loads((directory / f"{family}.json").read_text())
        n_ctx = max(N_CTX_LONG if long else N_CTX, max(len(c) for c in candidates) + 1)
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx,
                              logits_all=True, seed=0, n_threads=2, verbose=False,
                              yarn_beta_fast=-1.0, yarn_beta_slow=-1.0)
        ps, logits = decisive_prompts(llm, candidates)
        sha = (directory / f"{family}.sha256").read_text().strip()
        extra = {}
        if long and (directory / f"{family}.long").read_text() == "ppl":
            tokens = sampled_text(llm, PPL_CTX, PPL_CHUNKS, seed=len(family))
            ppl = llama_perplexity(llm, tokens, PPL_CTX)
            extra = {"ppl": ppl, "ppl_tokens": np.array(tokens, np.int32), "ppl_ctx": PPL_CTX}
            print(f"{family}: perplexity {ppl:.3f} over {len(tokens)} tokens")
        np.savez_compressed(HERE / f"{family}.npz", sha256=sha, llama_cpp=llama_cpp.__version__,
                            logits=np.stack(logits),
                            **{f"prompt{i}": np.array(p, dtype=np.int32)
                               for i, p in enumerate(ps)}, **extra)
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
    from families import FAMILIES, LONG_PROMPTS, PROMPT_LENGTHS, RECURRENT, sha256, write_family

    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tmp) / "written"
        for family in args.families or FAMILIES:
            path = write_family(family, written)
            long = family in RECURRENT
            (Path(tmp) / f"{family}.sha256").write_text(sha256(path))
            (Path(tmp) / f"{family}.json").write_text(
                json.dumps(candidate_prompts(path, seed=len(family), long=long,
                                             lengths=PROMPT_LENGTHS.get(family),
                                             extra_lengths=tuple(filter(None, [
                                                 LONG_PROMPTS.get(family)])))))
            if long:  # MoE: no perplexity (a routing near-tie somewhere in its text is sure)
                moe = any(k.endswith("expert_count") for k in FAMILIES[family][0].extra)
                (Path(tmp) / f"{family}.long").write_text("" if moe else "ppl")
            as_llama_cpp_runs_it(path, Path(tmp) / path.name)
        subprocess.run([args.llama_python, __file__, "--record", tmp], check=True)


def as_llama_cpp_runs_it(path: Path, out: Path) -> None:
    """The file llama.cpp is given for ``path``: the same file, except where its
    ``rope.scaling.type`` is ``llama3`` (localllm computes Llama 3.1's frequency factors from
    the ``rope.scaling.*`` keys; llama.cpp refuses that type, its converter writes the factors
    as the ``rope_freqs`` tensor instead): then the converter's output, the factors computed
    as ``conversion/llama.py``'s ``generate_extra_tensors`` does, the keys dropped."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = str(reader.get_field("general.architecture").contents())
    kind = reader.get_field(f"{arch}.rope.scaling.type")
    if kind is None or kind.contents() != "llama3":
        shutil.copyfile(path, out)
        return

    def value(key: str, default: float) -> float:
        field = reader.get_field(f"{arch}.{key}")
        return float(field.contents()) if field is not None else default

    dim = int(value("attention.key_length", 0))
    base = value("rope.freq_base", 10000.0)
    factor = value("rope.scaling.factor", 8.0)
    low, high = value("rope.scaling.low_freq_factor", 1.0), value("rope.scaling.high_freq_factor", 4.0)
    old_len = value("rope.scaling.original_context_length", 8192)
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old_len / high:
            factors.append(1.0)
        elif wavelen > old_len / low:
            factors.append(factor)
        else:
            smooth = (old_len / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    dropped = {f"{arch}.rope.scaling.{k}" for k in ("type", "factor", "low_freq_factor",
                                                      "high_freq_factor")}
    writer = gguf.GGUFWriter(out, arch)
    for field in reader.fields.values():
        if field.name in dropped or field.name.startswith("GGUF.") or \
                field.name == "general.architecture":
            continue
        vtype = field.types[0]
        writer.add_key_value(field.name, field.contents(), vtype,
                             sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
    rope_freqs = np.array(factors, dtype=np.float32)
    writer.add_tensor_info("rope_freqs.weight", rope_freqs.shape, rope_freqs.dtype,
                           rope_freqs.nbytes, gguf.GGMLQuantizationType.F32)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.write_tensor_data(rope_freqs)
    for t in reader.tensors:
        writer.write_tensor_data(t.data)
    writer.close()


if __name__ == "__main__":
    main()
