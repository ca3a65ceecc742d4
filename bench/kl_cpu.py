"""KL divergence of the CPU paths to an exact float32 evaluation, beside llama.cpp's own.

    .venv/bin/python bench/kl_cpu.py MODEL.gguf --llama-python /path/to/python-with-llama_cpp

The reference is localllm's torch path with float32 weights (dequantized exactly, float32
products): the "exact float32 evaluation". On the same tokens (the first ``--n`` tokens of
tests/data/reference/gpl-3.txt) it reports the mean KL(exact || x) per position for
x = the native kernels (prefill: all positions in one batch; decode: one token per step over
the first ``--n-decode`` positions; by default with int8 activations where the CPU has
AVX2 or AVX512-VNNI, and with ``dtype=float32``: float32 activations),
the float16 torch path, and llama.cpp (CPU, all logits of one batch). The llama.cpp side
imports only llama_cpp and numpy.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

TEXT = Path(__file__).resolve().parent.parent / "tests" / "data" / "reference" / "gpl-3.txt"


def _kl(ref_logp, logp) -> list[float]:
    import numpy as np

    ref_logp = ref_logp.astype(np.float64)
    logp = logp.astype(np.float64)
    return (np.exp(ref_logp) * (ref_logp - logp)).sum(-1).tolist()


def _log_softmax(x):
    import numpy as np

    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def side_llama(path: str, ids_file: str, exact_file: str, threads: int, n_decode: int) -> dict:
    import llama_cpp
    import numpy as np

    ids = json.loads(Path(ids_file).read_text())
    exact = np.load(exact_file)
    llm = llama_cpp.Llama(model_path=path, n_ctx=len(ids) + 8, n_batch=len(ids),
                          n_ubatch=len(ids), n_gpu_layers=0, n_threads=threads,
                          n_threads_batch=threads, logits_all=True, verbose=False)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float32)
    kl = _kl(exact, _log_softmax(logits))
    return {"llama.cpp": float(np.mean(kl)),
            f"llama.cpp, first {n_decode}": float(np.mean(kl[:n_decode]))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--n", type=int, default=128, help="tokens scored")
    ap.add_argument("--n-decode", type=int, default=48, help="positions also decoded one by one")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--llama-python")
    ap.add_argument("--side", help=argparse.SUPPRESS)
    ap.add_argument("--ids", help=argparse.SUPPRESS)
    ap.add_argument("--exact", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.side == "llama":
        print(json.dumps(side_llama(a.model, a.ids, a.exact, a.threads, a.n_decode)))
        return

    import numpy as np
    import torch

    from localllm.runtime.session import Session, load_model

    torch.set_num_threads(a.threads)
    exact_m = load_model(a.model, device="cpu", progress=False, backend="torch",
                         dtype=torch.float32)
    ids = exact_m.tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_bos=True)[: a.n]

    def logp(m, decode: bool = False):
        s = Session(m, ctx_size=len(ids) + 8, batch_size=len(ids))
        if not decode:
            return torch.log_softmax(s.eval(ids, all_logits=True).double(), -1).numpy()
        out = [s.eval([t]) for t in ids[: a.n_decode]]
        return torch.log_softmax(torch.stack(out).double(), -1).numpy()

    exact = logp(exact_m)
    exact_dec = logp(exact_m, decode=True)
    del exact_m
    res = {"tokens": len(ids)}
    native = load_model(a.model, device="cpu", progress=False, backend="native")
    assert native.backend == "native", native.backend
    res["native prefill"] = float(np.mean(_kl(exact, logp(native))))
    res["native decode"] = float(np.mean(_kl(exact_dec, logp(native, decode=True))))
    del native
    exact_native = load_model(a.model, device="cpu", progress=False, backend="native",
                              dtype=torch.float32)  # float32 tiles and activations
    res["native decode, float32 activations"] = float(
        np.mean(_kl(exact_dec, logp(exact_native, decode=True))))
    del exact_native
    f16 = load_model(a.model, device="cpu", progress=False, backend="torch")
    res["torch float16 prefill"] = float(np.mean(_kl(exact, logp(f16))))
    res["torch float16 decode"] = float(np.mean(_kl(exact_dec, logp(f16, decode=True))))
    del f16
    if a.llama_python:
        with tempfile.TemporaryDirectory() as d:
            ids_file, exact_file = Path(d) / "ids.json", Path(d) / "exact.npy"
            ids_file.write_text(json.dumps(ids))
            np.save(exact_file, exact.astype(np.float32))
            out = subprocess.run([a.llama_python, __file__, a.model, "--side", "llama",
                                  "--ids", str(ids_file), "--exact", str(exact_file),
                                  "--threads", str(a.threads), "--n-decode", str(a.n_decode)],
                                 capture_output=True, text=True, check=True).stdout
            res |= json.loads(out.strip().splitlines()[-1])
    for k, v in res.items():
        print(f"{k:>24}: {v:.3g}" if isinstance(v, float) else f"{k:>24}: {v}")


if __name__ == "__main__":
    sys.exit(main())
