"""Time the Triton GEMV / GEMM / dequantize kernels per quant type on a CUDA GPU.

Usage::

    python bench/bench_kernels.py                       # Llama-3-8B-sized matrices
    python bench/bench_kernels.py --n 640 --k 640       # Gemma-3-270M attention size
    python bench/bench_kernels.py --types Q4_K Q6_K --rows 1 4 512

For each type it prints the time per call, the effective bandwidth on the quantized bytes
(what bounds decode) and, for the GEMM, TFLOP/s, next to cuBLAS on the dequantized float16
weight (``torch.nn.functional.linear``) as the baseline.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL",
         "IQ4_XS", "F16"]


def random_weight(qtype, n: int, k: int, seed: int = 0):
    """A QuantWeight (n, k) of random blocks with small finite scales, on CUDA, in the layout
    a loaded model keeps (``QuantWeight.aligned``: planes where the blocks are unaligned)."""
    from localllm.kernels import QuantWeight, block_format

    fmt = block_format(qtype)
    rng = np.random.default_rng(seed)
    n_blocks = n * k // fmt.block_size
    if fmt.block_size == 1:
        raw = torch.from_numpy(rng.standard_normal(n_blocks).astype(np.float16)).view(torch.uint8)
    else:
        b = rng.integers(0, 256, (n_blocks, fmt.type_size), dtype=np.uint8)
        # Small finite fp16 scales: no inf/NaN, products within float16's range.
        for off in _scale_offsets(qtype):
            vals = (rng.uniform(0.5, 1.5, n_blocks) * 1e-3).astype(np.float16)
            b[:, off : off + 2] = vals.view(np.uint8).reshape(n_blocks, 2)
        raw = torch.from_numpy(b)
    return QuantWeight.from_bytes(raw.reshape(-1), qtype, (n, k)).to("cuda").aligned()


def _scale_offsets(qtype) -> set[int]:
    from gguf import GGMLQuantizationType as T

    return {
        T.Q4_0: {0}, T.Q4_1: {0, 2}, T.Q5_0: {0}, T.Q5_1: {0, 2}, T.Q8_0: {0},
        T.Q2_K: {80, 82}, T.Q3_K: {108}, T.Q4_K: {0, 2}, T.Q5_K: {0, 2}, T.Q6_K: {208},
        T.IQ4_NL: {0}, T.IQ4_XS: {0},
    }.get(qtype, set())  # fmt: skip


def bench(fn, reps: int = 50) -> float:
    """Median milliseconds per call (CUDA events, after warm-up)."""
    from triton.testing import do_bench

    return float(do_bench(fn, rep=reps, return_mode="median"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--n", type=int, default=14336, help="output features (rows of W)")
    p.add_argument("--k", type=int, default=4096, help="input features")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 512], help="rows of X")
    p.add_argument("--types", nargs="+", default=TYPES)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("error: no CUDA GPU", file=sys.stderr)
        return 1
    from gguf import GGMLQuantizationType as T
    from localllm.kernels import GEMV_MAX_ROWS, quant_linear
    from localllm.kernels.dequant import dequantize
    from localllm.kernels.gemm import gemm

    print(f"# {torch.cuda.get_device_name()}  W: {args.n} x {args.k}")
    print(f"{'type':6} {'rows':>5} {'triton ms':>10} {'GB/s':>8} {'TFLOP/s':>8} {'cuBLAS ms':>10}")
    for name in args.types:
        qtype = T[name]
        w = random_weight(qtype, args.n, args.k)
        w16 = w.dequantize(torch.float16)
        for rows in args.rows:
            x = torch.randn(rows, args.k, device="cuda", dtype=torch.float16)
            ms = bench(lambda x=x, w=w: quant_linear(x, w))
            ms_ref = bench(lambda x=x, w16=w16: torch.nn.functional.linear(x, w16))
            gbs = (w.nbytes + x.numel() * 2) / ms / 1e6
            tflops = 2 * rows * args.n * args.k / ms / 1e9
            print(f"{name:6} {rows:5d} {ms:10.4f} {gbs:8.1f} {tflops:8.2f} {ms_ref:10.4f}")
            if rows > GEMV_MAX_ROWS:  # the GEMM decoding weight by weight, for comparison
                ms = bench(lambda x=x, w=w: gemm(w.data, w.qtype, args.n, x, grouped=False,
                                                 layout=w.layout))
                tflops = 2 * rows * args.n * args.k / ms / 1e9
                print(f"{name:6} {rows:5d} {ms:10.4f} {'':8} {tflops:8.2f}  (ungrouped)")
        ms = bench(lambda w=w: dequantize(w.data, w.qtype, w.shape, torch.float16,
                                          layout=w.layout))
        out_bytes = args.n * args.k * 2
        print(f"{name:6} {'deq':>5} {ms:10.4f} {(w.nbytes + out_bytes) / ms / 1e6:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
