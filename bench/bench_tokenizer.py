"""Tokenizer benchmark: 1 MB of text through localllm's tokenizer and llama.cpp's, same vocabulary.

    python bench/bench_tokenizer.py                       # smollm2-135m-instruct if pulled
    python bench/bench_tokenizer.py --model PATH.gguf     # any GGUF (only its vocabulary is read)
    python bench/bench_tokenizer.py --mb 4 --llama-python /work/llamavenv/bin/python

The text is tests/data/reference/gpl-3.txt plus code, numbers, CJK, emoji and whitespace runs,
repeated to ``--mb`` megabytes. localllm's figure is :meth:`Tokenizer.encode` on the whole
text; llama.cpp's is ``llama_tokenize`` through llama-cpp-python (``vocab_only``), run in the
interpreter ``--llama-python`` names (llama-cpp-python is never a dependency of localllm;
without it only localllm's figure is printed). Both count the same ids; figures are the best
of ``--repeat`` runs, in MB/s and ms.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIXED = (
    "def f(x):\n    return x ** 2  # 1234567 3.14159\n\t\tif a != b: pass\n"
    "你好，世界！日本語のテキスト。한국어 🤖🚀👍🏽 naïve café it's I'll\n\n   \n"
)


def bench_text(mb: float) -> str:
    base = (ROOT / "tests" / "data" / "reference" / "gpl-3.txt").read_text() + MIXED * 50
    n = int(mb * 1_000_000)
    return (base * (n // len(base.encode()) + 1)).encode()[:n].decode("utf-8", "ignore")


def default_model() -> Path:
    from localllm import hub
    from localllm.registry import load_registry

    source = load_registry().models["smollm2-135m-instruct"].wheel_source
    if hub.state(source) != "pulled":
        sys.exit("smollm2-135m-instruct is not pulled: localllm pull smollm2-135m-instruct, "
                 "or give --model")
    return hub.cached_path(source)


_LLAMA_SIDE = r"""
import json, sys, time
import llama_cpp as lc
quiet = lc.llama_log_callback(lambda *a: None)
lc.llama_log_set(quiet, None)
path, text_path, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3])
params = lc.llama_model_default_params()
params.vocab_only = True
model = lc.llama_model_load_from_file(path.encode(), params)
vocab = lc.llama_model_get_vocab(model)
data = open(text_path, "rb").read()
buf = (lc.llama_token * (len(data) + 16))()
best = float("inf")
for _ in range(repeat):
    t = time.perf_counter()
    n = lc.llama_tokenize(vocab, data, len(data), buf, len(data) + 16, False, False)
    best = min(best, time.perf_counter() - t)
print(json.dumps({"seconds": best, "n_tokens": n, "head": list(buf[:64])}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, help="a GGUF whose vocabulary is used")
    ap.add_argument("--mb", type=float, default=1.0, help="megabytes of text")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--llama-python", default="/work/llamavenv/bin/python",
                    help="an interpreter with llama-cpp-python (the oracle)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()

    from localllm.gguf.file import open_gguf
    from localllm.tokenizer import Tokenizer

    path = args.model or default_model()
    tok = Tokenizer(open_gguf(path).metadata)
    text = bench_text(args.mb)
    n_bytes = len(text.encode())
    tok.encode("warm up " * 100, add_bos=False)
    best, ids = float("inf"), []
    for _ in range(args.repeat):
        t = time.perf_counter()
        ids = tok.encode(text, add_bos=False)
        best = min(best, time.perf_counter() - t)
    out = {"model": path.name, "vocab": tok.model_type, "pre": tok.pre, "bytes": n_bytes,
           "localllm_ms": best * 1e3, "localllm_mb_s": n_bytes / best / 1e6,
           "n_tokens": len(ids)}
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".txt", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        try:
            done = subprocess.run([args.llama_python, "-c", _LLAMA_SIDE, str(path), f.name,
                                   str(args.repeat)], capture_output=True, text=True, check=True)
            ref = json.loads(done.stdout)
            out.update(llama_cpp_ms=ref["seconds"] * 1e3,
                       llama_cpp_mb_s=n_bytes / ref["seconds"] / 1e6,
                       llama_cpp_n_tokens=ref["n_tokens"],
                       same_ids=ref["n_tokens"] == len(ids) and ref["head"] == ids[:64],
                       ratio=best / ref["seconds"])
        except (OSError, subprocess.CalledProcessError, ValueError) as e:
            out["llama_cpp"] = f"not measured: {e}"
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['model']} ({out['vocab']}, pre {out['pre']}): {n_bytes / 1e6:.2f} MB, "
          f"{out['n_tokens']} tokens")
    print(f"  localllm : {out['localllm_ms']:8.1f} ms  {out['localllm_mb_s']:6.2f} MB/s")
    if "llama_cpp_ms" in out:
        print(f"  llama.cpp: {out['llama_cpp_ms']:8.1f} ms  {out['llama_cpp_mb_s']:6.2f} MB/s  "
              f"(localllm/llama.cpp time {out['ratio']:.2f}x, same ids: {out['same_ids']})")
    else:
        print(f"  llama.cpp: {out['llama_cpp']}")


if __name__ == "__main__":
    main()
