"""KL divergence of a model's next-token distributions against a base model's.

Like llama-perplexity's ``--kl-divergence-base`` / ``--kl-divergence`` (llama.cpp
``tools/perplexity/perplexity.cpp``), with a compact base file: for each scored position the
base's top-``k`` token ids and log-probabilities (fp16) are kept, plus its exact log-probability
of the actual next token; the probability mass outside the top k is one "rest" bucket. The KL
divergence is then computed over the k + 1 outcomes {top-k ids of the base, everything else}:

    KLD = sum_i p_i (log p_i - log q_i) + p_rest (log p_rest - log q_rest)

which by the data-processing inequality is a (tight, for k >= 32) lower bound of the full-vocab
KLD. The compared model's log-probabilities at those ids are rounded to fp16 exactly as the
base's were stored, so a model compared with itself gives exactly 0.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..atomic import atomic_output, check_input_file
from ..errors import LocalLLMError

FORMAT_VERSION = 1
DEFAULT_TOP_K = 32
PERCENTILES = (99.9, 99.0, 95.0, 90.0, 50.0, 10.0, 5.0, 1.0, 0.1)


def vocab_fingerprint(tokens: Sequence[str]) -> str:
    """sha256 of the vocabulary's token strings (models whose ids mean the same text match)."""
    h = hashlib.sha256()
    for t in tokens:
        h.update(t.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class ChunkDistributions:
    """One chunk's scored positions, n of them: what the base file keeps.

    nll: (n,) float64 NLL (nats) of the actual next token; top_ids: (n, k) int32 (descending
    probability); top_logp: (n, k) float16 log-probabilities.
    """

    nll: np.ndarray
    top_ids: np.ndarray
    top_logp: np.ndarray


@dataclass
class ChunkComparison:
    """Per-position statistics of a model against the base for one chunk (all (n,) arrays):
    nll and base_nll (nats), kld (nats), dp (probability of the actual token, model minus
    base), same_top (bool: same most probable token)."""

    nll: np.ndarray
    base_nll: np.ndarray
    kld: np.ndarray
    dp: np.ndarray
    same_top: np.ndarray


def distributions(logits: torch.Tensor, next_tokens: Sequence[int],
                  k: int = DEFAULT_TOP_K) -> ChunkDistributions:
    """Top-k summary of the next-token distributions. logits: (n, n_vocab) float32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.as_tensor(list(next_tokens), dtype=torch.long, device=logp.device)
    nll = -logp.gather(1, target[:, None])[:, 0].double()
    top_logp, top_ids = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
    return ChunkDistributions(nll.cpu().numpy(), top_ids.to(torch.int32).cpu().numpy(),
                              top_logp.to(torch.float16).cpu().numpy())


def _rest_log(logp16: np.ndarray) -> np.ndarray:
    """log of the mass outside the top-k, from fp16 log-probs (n, k) -> (n,) float64."""
    rest = 1.0 - np.exp(logp16.astype(np.float64)).sum(-1)
    return np.log(np.clip(rest, 1e-10, None))


def compare(logits: torch.Tensor, next_tokens: Sequence[int],
            base: ChunkDistributions) -> ChunkComparison:
    """Compare a model's logits (n, n_vocab) for a chunk with the base's stored summary."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.as_tensor(list(next_tokens), dtype=torch.long, device=logp.device)
    nll = (-logp.gather(1, target[:, None])[:, 0].double()).cpu().numpy()
    ids = torch.as_tensor(base.top_ids, dtype=torch.long, device=logp.device)
    q16 = logp.gather(1, ids).to(torch.float16).cpu().numpy()
    argmax = logp.argmax(-1).cpu().numpy()
    p16 = base.top_logp
    lp, lq = p16.astype(np.float64), q16.astype(np.float64)
    lp_rest, lq_rest = _rest_log(p16), _rest_log(q16)
    kld = (np.exp(lp) * (lp - lq)).sum(-1) + np.exp(lp_rest) * (lp_rest - lq_rest)
    dp = np.exp(-nll) - np.exp(-base.nll)
    return ChunkComparison(nll, base.nll, kld, dp, argmax == base.top_ids[:, 0])


# ---- the base file ---------------------------------------------------------------------------
@dataclass
class BaseFile:
    """The content of a ``--kl-divergence-base`` file."""

    tokens: np.ndarray  # (n_tokens,) int32 token ids of the whole text (BOS first)
    n_ctx: int
    vocab: str  # vocab_fingerprint of the base model
    model: str
    chunks: list[ChunkDistributions] = field(default_factory=list)


def save_base(path: str | Path, base: BaseFile) -> None:
    """Write the base distributions as a compressed ``.npz`` (written atomically).

    Raises:
        LocalLLMError: the file cannot be written.
    """
    path = Path(path)
    n = [len(c.nll) for c in base.chunks]
    arrays = {
        "version": np.array(FORMAT_VERSION), "tokens": base.tokens.astype(np.int32),
        "n_ctx": np.array(base.n_ctx), "vocab": np.array(base.vocab), "model": np.array(base.model),
        "chunk_sizes": np.array(n, dtype=np.int64),
        "nll": np.concatenate([c.nll for c in base.chunks]),
        "top_ids": np.concatenate([c.top_ids for c in base.chunks]),
        "top_logp": np.concatenate([c.top_logp for c in base.chunks]),
    }
    with atomic_output(path, "--kl-divergence-base") as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, **arrays)


# What a base file holds: member -> (dtype kinds allowed, number of dimensions).
_MEMBERS = {
    "version": ("iu", 0), "n_ctx": ("iu", 0), "vocab": ("U", 0), "model": ("U", 0),
    "tokens": ("i", 1), "chunk_sizes": ("iu", 1), "nll": ("f", 1), "top_ids": ("i", 2),
    "top_logp": ("f", 2),
}
MAX_BASE_BYTES = 16 * 2**30  # uncompressed arrays, all together
MAX_COMPRESSION_RATIO = 100  # a member that inflates more than this is a zip bomb
MAX_STRING_CHARS = 4096  # the vocab fingerprint and the model name


def _check_members(path: Path, label: str) -> None:
    """Check the archive's members before numpy reads any: the expected names, .npy headers
    with the expected dtypes and dimensions, sizes that agree with the headers, and no
    member that inflates more than :data:`MAX_COMPRESSION_RATIO` times."""
    import zipfile

    def bad(what: str) -> LocalLLMError:
        return LocalLLMError(f"{label}: not a base file ({what})")

    try:
        with zipfile.ZipFile(path) as z:
            infos = {i.filename: i for i in z.infolist()}
            expected = {f"{name}.npy" for name in _MEMBERS}
            if set(infos) != expected:
                extra = sorted(set(infos) ^ expected)
                raise bad(f"members {', '.join(extra[:4])} missing or unexpected")
            total = 0
            for name, (kinds, ndim) in _MEMBERS.items():
                info = infos[f"{name}.npy"]
                total += info.file_size
                if total > MAX_BASE_BYTES:
                    raise bad(f"more than {MAX_BASE_BYTES >> 30} GiB of arrays")
                if info.file_size > 2**20 and (
                        info.file_size > MAX_COMPRESSION_RATIO * max(info.compress_size, 1)):
                    raise bad(f"member {name} inflates {info.file_size} bytes from "
                              f"{info.compress_size}: refused as a zip bomb")
                with z.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                   else np.lib.format.read_array_header_2_0)
                    shape, _fortran, dtype = read_header(f, max_header_size=10_000)
                    header = f.tell()
                if dtype.kind not in kinds or dtype.hasobject or dtype.fields is not None:
                    raise bad(f"member {name} has dtype {dtype}")
                if len(shape) != ndim:
                    raise bad(f"member {name} has shape {shape}")
                if kinds == "U" and dtype.itemsize > 4 * MAX_STRING_CHARS:
                    raise bad(f"member {name} is a string of {dtype.itemsize // 4} characters")
                if header + math.prod(shape) * dtype.itemsize != info.file_size:
                    raise bad(f"member {name}: its size does not match its shape {shape}")
    except LocalLLMError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise bad(f"{type(e).__name__}: {e}") from None


def load_base(path: str | Path) -> BaseFile:
    """Read a base file written by :func:`save_base`.

    The archive is checked before anything is loaded (member names, dtypes, shapes, sizes,
    compression ratio; see ``_MEMBERS``), then the arrays against each other: chunks of
    ``n_ctx - n_ctx/2 - 1`` scored positions, as many as the tokens make, and non-negative
    token ids (:meth:`BaseFile.check_vocab` checks them against a model's vocabulary).

    Raises:
        LocalLLMError: missing, unreadable, not a regular file, or not a base file.
    """
    path = Path(path)
    label = f"--kl-divergence-base {path}"
    check_input_file(path, "--kl-divergence-base")  # a FIFO would block the zip reader
    _check_members(path, label)
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["version"]) != FORMAT_VERSION:
                raise LocalLLMError(f"{label}: unsupported version {int(z['version'])}")
            n_ctx, tokens, sizes = int(z["n_ctx"]), z["tokens"], z["chunk_sizes"]
            nll, top_ids, top_logp = z["nll"], z["top_ids"], z["top_logp"]
            vocab, model = str(z["vocab"]), str(z["model"])
    except LocalLLMError:
        raise
    except (OSError, ValueError, KeyError, EOFError) as e:
        raise LocalLLMError(f"{label}: not a readable base file "
                            f"({type(e).__name__}: {e})") from None

    def bad(what: str) -> LocalLLMError:
        return LocalLLMError(f"{label}: not a base file ({what})")

    if not 4 <= n_ctx <= 2**24:
        raise bad(f"n_ctx {n_ctx}")
    per_chunk = n_ctx - n_ctx // 2 - 1
    if len(sizes) > len(tokens) // n_ctx or len(sizes) == 0 or (sizes != per_chunk).any():
        raise bad(f"chunk sizes do not match n_ctx {n_ctx} and {len(tokens)} tokens")
    n = int(sizes.sum())
    if len(nll) != n or top_ids.shape[0] != n or top_logp.shape != top_ids.shape:
        raise bad("the arrays of scored positions differ in length")
    if top_ids.shape[1] == 0 or (tokens < 0).any() or (top_ids < 0).any():
        raise bad("negative token ids")
    if not np.isfinite(nll).all():
        raise bad("non-finite log-likelihoods")
    bounds = np.cumsum(sizes)[:-1]
    chunks = [ChunkDistributions(a, b, c) for a, b, c in zip(
        np.split(nll.astype(np.float64), bounds), np.split(top_ids.astype(np.int32), bounds),
        np.split(top_logp.astype(np.float16), bounds), strict=True)]
    return BaseFile(tokens.astype(np.int32), n_ctx, vocab, model, chunks)


def check_vocab(base: BaseFile, n_vocab: int, label: str = "--kl-divergence-base") -> None:
    """Raise LocalLLMError when a token id of ``base`` is outside a vocabulary of ``n_vocab``."""
    top = max(int(base.tokens.max(initial=0)),
              max((int(c.top_ids.max(initial=0)) for c in base.chunks), default=0))
    if top >= n_vocab:
        raise LocalLLMError(f"{label}: token id {top} is outside the model's vocabulary "
                            f"(ids 0..{n_vocab - 1})")


# ---- summary ---------------------------------------------------------------------------------
def _mean_err(x: np.ndarray) -> tuple[float, float]:
    n = x.size
    mean = float(x.mean())
    return mean, float(math.sqrt(max(float(x.var()), 0.0) / max(n - 1, 1)))


@dataclass
class KLDResult:
    """Final statistics (llama.cpp's names in comments)."""

    n: int
    ppl: tuple[float, float]  # Mean PPL(Q)
    ppl_base: tuple[float, float]  # Mean PPL(base)
    cor: float  # Cor(ln(PPL(Q)), ln(PPL(base)))
    ln_ratio: tuple[float, float]  # Mean ln(PPL(Q)/PPL(base))
    ratio: tuple[float, float]  # Mean PPL(Q)/PPL(base)
    diff: tuple[float, float]  # Mean PPL(Q)-PPL(base)
    kld: tuple[float, float]
    kld_max: float
    kld_min: float
    kld_pct: dict[float, float]
    dp: tuple[float, float]  # Δp, probability units
    dp_max: float
    dp_min: float
    dp_pct: dict[float, float]
    rms_dp: tuple[float, float]
    same_top: tuple[float, float]  # fraction


def summarize(parts: Sequence[ChunkComparison]) -> KLDResult:
    """Aggregate the per-chunk comparisons (llama.cpp's formulas for the errors)."""
    nll = np.concatenate([p.nll for p in parts])
    bnll = np.concatenate([p.base_nll for p in parts])
    kld = np.concatenate([p.kld for p in parts])
    dp = np.concatenate([p.dp for p in parts])
    same = np.concatenate([p.same_top for p in parts]).astype(np.float64)
    n = nll.size
    m_q, e_q = _mean_err(nll)
    m_b, e_b = _mean_err(bnll)
    ppl_q, ppl_b = math.exp(m_q), math.exp(m_b)
    cov = float(np.mean((nll - m_q) * (bnll - m_b)))
    sd = float(nll.std() * bnll.std())
    cor = cov / sd if sd > 0 else 1.0
    m_ln, e_ln = _mean_err(nll - bnll)
    ratio = math.exp(m_ln)
    diff_var = (ppl_q * e_q) ** 2 + (ppl_b * e_b) ** 2 - 2 * ppl_q * ppl_b * cov / max(n - 1, 1)
    ms_dp = float(np.mean(dp * dp))
    e_ms = math.sqrt(max(float(np.var(dp * dp)), 0.0) / max(n - 1, 1))
    rms = math.sqrt(ms_dp)
    p_same = float(same.mean())
    return KLDResult(
        n, (ppl_q, ppl_q * e_q), (ppl_b, ppl_b * e_b), cor, (m_ln, e_ln), (ratio, ratio * e_ln),
        (ppl_q - ppl_b, math.sqrt(max(diff_var, 0.0))), _mean_err(kld), float(kld.max()),
        float(kld.min()), {p: float(np.percentile(kld, p)) for p in PERCENTILES},
        _mean_err(dp), float(dp.max()), float(dp.min()),
        {p: float(np.percentile(dp, p)) for p in PERCENTILES},
        (rms, e_ms / (2 * rms) if rms > 0 else 0.0),
        (p_same, math.sqrt(p_same * (1 - p_same) / max(n - 1, 1))))


def format_report(r: KLDResult) -> str:
    """The three statistics sections of llama-perplexity's KL-divergence output."""
    lines = ["====== Perplexity statistics ======",
             f"Mean PPL(Q)                   : {r.ppl[0]:10.6f} ± {r.ppl[1]:10.6f}",
             f"Mean PPL(base)                : {r.ppl_base[0]:10.6f} ± {r.ppl_base[1]:10.6f}",
             f"Cor(ln(PPL(Q)), ln(PPL(base))): {100 * r.cor:6.2f}%",
             f"Mean ln(PPL(Q)/PPL(base))     : {r.ln_ratio[0]:10.6f} ± {r.ln_ratio[1]:10.6f}",
             f"Mean PPL(Q)/PPL(base)         : {r.ratio[0]:10.6f} ± {r.ratio[1]:10.6f}",
             f"Mean PPL(Q)-PPL(base)         : {r.diff[0]:10.6f} ± {r.diff[1]:10.6f}",
             "", "====== KL divergence statistics ======",
             f"Mean    KLD: {r.kld[0]:10.6f} ± {r.kld[1]:10.6f}",
             f"Maximum KLD: {r.kld_max:10.6f}"]
    lines += [f"{_pct_label(p)} KLD: {v:10.6f}" for p, v in r.kld_pct.items()]
    lines += [f"Minimum KLD: {r.kld_min:10.6f}", "",
              "====== Token probability statistics ======",
              f"Mean    Δp: {100 * r.dp[0]:8.3f} ± {100 * r.dp[1]:6.3f} %",
              f"Maximum Δp: {100 * r.dp_max:8.3f}%"]
    lines += [f"{_pct_label(p)} Δp: {100 * v:8.3f}%" for p, v in r.dp_pct.items()]
    lines += [f"Minimum Δp: {100 * r.dp_min:8.3f}%",
              f"RMS Δp    : {100 * r.rms_dp[0]:8.3f} ± {100 * r.rms_dp[1]:6.3f} %",
              f"Same top p: {100 * r.same_top[0]:8.3f} ± {100 * r.same_top[1]:6.3f} %"]
    return "\n".join(lines)


def _pct_label(p: float) -> str:
    return "Median " if p == 50.0 else f"{p:<5g}%".ljust(7)
