"""Static profile of the Triton kernels, from the compiled code (no GPU needed).

Usage::

    python bench/kernel_profile.py                          # decode GEMV, sm_90, 3 models
    python bench/kernel_profile.py --arch 90 86 89 --all    # every kernel, three GPUs
    python bench/kernel_profile.py --types Q4_K Q6_K --out prof --json

Each kernel is compiled with Triton's own toolchain (``triton.compile`` down to a cubin;
``ptxas`` and ``cuobjdump`` ship in the Triton wheel) for the specialization its launcher
uses on the real matrix shapes of Llama-3-8B, Qwen2.5-7B and Gemma-3-270M. From
``cuobjdump -res-usage`` and the SASS it reports, per kernel and quant type:

- registers per thread, spills (local-memory instructions ``LDL``/``STL`` in the SASS and the
  ``LOCAL`` bytes), shared memory per program;
- the global loads of the main loop (the loop with the most global loads) by width
  (``LDG.E.128`` moves 16 bytes per thread);
- SASS instructions in the main loop (``NOP`` excluded) and **warp-instructions per weight
  byte**: ``loop instructions x warps per program / weight bytes one program reads per
  loop step`` (when ptxas unrolls the loop, the body covers several steps; the count of a
  per-step marker instruction, e.g. 4 ``IDP.4A`` per thread for the integer-dot GEMV, says
  how many);
- per matrix shape: programs (CTAs) launched against the SM count, and the ceiling below.

The ceiling model (per matrix, decode: every weight byte read once):

- issue bound: an SM issues at most one warp-instruction per cycle per scheduler (4
  schedulers), so ``B_issue = SMs * 4 * clock / (warp-instructions per byte) * E`` where the
  wave efficiency ``E = CTAs / (ceil(CTAs / SMs) * SMs)`` (idle SMs in the last wave);
- latency bound (Little's law): ``B_lat = SMs * min(CTAs / SMs, resident CTAs per SM) *
  bytes per step * stages / latency``, the bytes a program has in flight per step;
- ``ceiling = min(DRAM bandwidth, B_issue, B_lat)``. It ignores stalls other than memory
  latency, L2 effects and the activation reads: an upper bound, not a prediction.

Constants (vendor figures; latency is the loaded DRAM latency, an assumption):

=============  ====  =========  ==========  ===========  ===============  =================
GPU            SMs   clock      DRAM        latency      max threads/SM   registers/SM
=============  ====  =========  ==========  ===========  ===============  =================
H100 SXM5      132   1.755 GHz  3350 GB/s   650 ns       2048             65536
RTX 4090       128   2.52 GHz   1008 GB/s   550 ns       1536             65536
RTX 3090       82    1.695 GHz  936 GB/s    550 ns       1536             65536
=============  ====  =========  ==========  ===========  ===============  =================

Code compiled for sm_90 is held against the H100, sm_89 against the RTX 4090, sm_86 against
the RTX 3090.

All GPU figures printed here are **estimates** from the compiled code, not measurements
(``bench/gpu_validate.sh`` measures them on a GPU).

With ``--out DIR`` each compiled cubin is written to DIR (``<kernel>-<variant>-sm<arch>.cubin``)
and, with ``--json``, one JSON record per kernel and shape to ``DIR/profile.jsonl``: kernel,
quant type, shape, weight bytes one program reads per loop step and the figures above, so
they can be recounted from the binaries (``cuobjdump -sass``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from collections import Counter
from dataclasses import dataclass

import triton
from gguf import GGMLQuantizationType as T
from localllm.kernels import _aot, block_format
from localllm.kernels._aot import Case


@dataclass(frozen=True)
class GPU:
    name: str
    sms: int
    clock_ghz: float
    dram_gbps: float
    latency_ns: float
    max_threads: int
    regs: int = 65536
    max_ctas: int = 32


GPUS = {
    "H100": GPU("H100 SXM5", 132, 1.755, 3350.0, 650.0, 2048),
    "RTX4090": GPU("RTX 4090", 128, 2.52, 1008.0, 550.0, 1536, max_ctas=24),
    "RTX3090": GPU("RTX 3090", 82, 1.695, 936.0, 550.0, 1536, max_ctas=16),
}
# The GPU whose ceiling each compiled architecture is measured against.
ARCH_GPU = {90: "H100", 89: "RTX4090", 86: "RTX3090"}

# (N, K) of each matrix of a decode step, fused as the models fuse them (Q/K/V, gate/up).
MODELS = {
    "llama3-8b": {"attn_qkv": (6144, 4096), "attn_output": (4096, 4096),
                  "ffn_gate_up": (28672, 4096), "ffn_down": (4096, 14336),
                  "output": (128256, 4096)},
    "qwen2.5-7b": {"attn_qkv": (4608, 3584), "attn_output": (3584, 3584),
                   "ffn_gate_up": (37888, 3584), "ffn_down": (3584, 18944),
                   "output": (152064, 3584)},
    "gemma3-270m": {"attn_qkv": (1536, 640), "attn_output": (640, 1024),
                    "ffn_gate_up": (4096, 640), "ffn_down": (640, 2048),
                    "output": (262144, 640)},
}  # fmt: skip

DECODE_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
                "IQ4_NL", "IQ4_XS", "MXFP4"]


# ---- the kernels' specializations -------------------------------------------------------------


def decode_gemv_case(qtype: T, n: int, k: int, arch: int) -> tuple[Case, dict]:
    """The kernel ``gemv()`` launches for one vector of an (n, k) ``qtype`` matrix in the
    layout a loaded model keeps it (``QuantWeight.aligned``: planes for the types of
    ``localllm.kernels.PLANES``), and its launch shape: grid, weight bytes per program per
    loop step, per-step marker. Split-K launches (``SPLITK``: the last program of a row range
    sums the splits) are their own variant."""
    from localllm.kernels import PLANES
    from localllm.kernels.decode import GROUP_SIZES
    from localllm.kernels.gemv import _gemv1_kernel, mmvq_case, mmvq_unit

    fmt = block_format(qtype)
    layout = "planes" if qtype in PLANES else "blocks"
    if mmvq_unit(qtype, layout):
        case, cfg = mmvq_case(qtype, n, k, layout=layout, arch=arch)
        # one dp4a per 4 weights of a slot (16, 32 or 64 weights), RPT slots a thread
        launch = {"grid": cfg["grid"], "bytes_per_step": cfg["bytes_per_step"],
                  "marker": ("IDP", cfg["UNIT"] // 4 * cfg["RPT"]), "stages": cfg["STAGES"],
                  "variant": f"{'planes-' if layout == 'planes' else ''}R{cfg['ROWS']}"
                             f"G{cfg['GP']}P{cfg['RPT']}"
                             f"{'-splitK' if cfg['SPLIT'] > 1 else ''}"}  # fmt: skip
        return case, launch
    if qtype not in GROUP_SIZES:  # the general kernel, one vector
        from localllm.kernels.gemv import _gemv_kernel

        block_k = min(256, 1 << (k - 1).bit_length())
        block_n = max(1, min(16, 4096 // block_k))
        case = Case(
            _gemv_kernel,
            {"w": "*u8", "x": "*fp32", "y": "*fp32", "N": "i32", "K": "i32",
             "stride_xb": "i32", "stride_yb": "i32"},
            {"BS": fmt.block_size, "TS": fmt.type_size, "QTYPE": int(qtype), "B": 1,
             "B_PAD": 1, "BLOCK_N": block_n, "BLOCK_K": block_k,
             "PLANES": layout == "planes"},
            arch=arch,
        )  # fmt: skip
        launch = {"grid": (triton.cdiv(n, block_n), 1),
                  "bytes_per_step": block_n * block_k * fmt.type_size // fmt.block_size,
                  "marker": None, "stages": 1, "variant": f"N{block_n}K{block_k}"}  # fmt: skip
        return case, launch
    g = GROUP_SIZES[qtype]
    groups = max(1, min(256, 1 << (k - 1).bit_length()) // g)
    case = Case(
        _gemv1_kernel,
        {"w": "*u8", "x": "*fp32", "y": "*fp32", "N": "i32", "K": "i32"},
        {"BS": fmt.block_size, "TS": fmt.type_size, "QTYPE": int(qtype), "G": g,
         "BLOCK_N": 16, "GROUPS": groups},
        arch=arch,
    )  # fmt: skip
    launch = {"grid": (triton.cdiv(n, 16), 1),
              "bytes_per_step": 16 * groups * g * fmt.type_size // fmt.block_size,
              "marker": None, "stages": 1, "variant": f"N16G{groups}"}  # fmt: skip
    return case, launch


def other_cases(arch: int) -> dict[str, tuple[Case, dict]]:
    """Prefill GEMM, dequantize, activation quantization and decode attention (one shape
    each: their code does not depend on the matrix shape)."""
    from localllm.kernels import PLANES
    from localllm.kernels.attention import attention_case, default_block_s
    from localllm.kernels.decode import GROUP_SIZES
    from localllm.kernels.dequant import _dequant_kernel
    from localllm.kernels.gemm import NUM_STAGES, WORD_TYPES, _gemm_kernel
    from localllm.kernels.gemv import _quantize_q8_kernel

    out: dict[str, tuple[Case, dict]] = {}

    for q in (T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0):
        fmt = block_format(q)
        # Prefill GEMM as gemm() launches it for a prompt of > 64 rows: 128 x 64 x 64 tiles,
        # 8 warps; bytes per step: the 64 x 64 weight tile. The main loop: the one with the
        # tensor-core products.
        out[f"gemm/{q.name}"] = (Case(
            _gemm_kernel,
            {"x": "*fp16", "w": "*u8", "y": "*fp32", "M": "i32", "N": "i32", "K": "i32",
             "stride_xm": "i32", "stride_ym": "i32"},
            {"BS": fmt.block_size, "TS": fmt.type_size, "QTYPE": int(q),
             "G": GROUP_SIZES.get(q, 0), "BF16": False, "BLOCK_M": 128, "BLOCK_N": 64,
             "BLOCK_K": 64, "WORDS": WORD_TYPES.get(int(q), 0), "EMULATE": False,
             "PLANES": q in PLANES},
            num_warps=8, num_stages=NUM_STAGES, arch=arch,
            aligned=("x", "w", "y", "N", "K", "stride_xm", "stride_ym")),
            {"bytes_per_step": 64 * 64 * fmt.type_size // fmt.block_size, "marker": None,
             "loop_op": "HMMA",
             "variant": f"128x64x64{'-words' if int(q) in WORD_TYPES else ''}"})  # fmt: skip
        if q == T.Q5_K:  # dequantize: one K-quant of each layout family is enough
            continue
        out[f"dequant/{q.name}"] = (Case(
            _dequant_kernel, {"data": "*u8", "out": "*fp16", "n_elements": "i32"},
            {"BS": fmt.block_size, "TS": fmt.type_size, "QTYPE": int(q), "BLOCK": 1024,
             "PLANES": q in PLANES}, enable_fp_fusion=False, arch=arch),
            {"bytes_per_step": 1024 * fmt.type_size // fmt.block_size, "marker": None,
             "variant": "B1024"})  # fmt: skip
    out["quantize_q8/F32"] = (Case(
        _quantize_q8_kernel, {"x": "*fp32", "xq": "*i8", "xd": "*fp32", "xs": "*i32",
                              "n_chunks": "i32"}, {"CH": 8}, arch=arch),
        {"bytes_per_step": 8 * 32 * 4, "marker": None, "variant": "CH8"})  # fmt: skip
    # Decode attention: bytes per step are the K and V tiles (float16) of BLOCK_S slots; the
    # main loop is the one with the tensor-core products (the split merge has more loads).
    for name, group, d, ring in (("llama3-8b", 4, 128, False), ("qwen2.5-7b", 7, 128, False),
                                 ("gemma3-270m", 4, 256, True)):
        bs = default_block_s(d)
        out[f"decode_attention/{name}"] = (
            attention_case(group, d, ring=ring, arch=arch),
            {"bytes_per_step": 2 * bs * d * 2, "marker": None, "loop_op": "HMMA",
             "variant": f"G{group}D{d}S{bs}{'R' if ring else ''}"})  # fmt: skip
    return out


# ---- figures ------------------------------------------------------------------------------------


def _main_loop(instrs, loop_op: str | None):
    """The loop holding the most ``loop_op`` instructions (e.g. ``HMMA``: tensor-core
    products) when given, else :func:`_aot.main_loop` (the most global loads)."""
    if loop_op:
        best = max(_aot.loops(instrs), default=None,
                   key=lambda r: sum(i.base == loop_op for i in instrs[r[0]:r[1] + 1]))
        if best is not None:
            return instrs[best[0]:best[1] + 1]
    return _aot.main_loop(instrs)


def static_figures(compiled, case: Case, launch: dict) -> dict:
    """Registers, spills, shared memory, main-loop SASS and warp-instructions per byte."""
    cubin = compiled.asm["cubin"]
    res = _aot.resource_usage(cubin)
    instrs = _aot.parse_sass(_aot.sass(cubin))
    body = _aot.counted(_main_loop(instrs, launch.get("loop_op")))
    spill_ops = sum(1 for i in instrs if i.base in ("LDL", "STL"))
    loads = Counter(f"{i.op}" for i in _aot.global_loads(body))
    steps = 1
    marker = launch.get("marker")
    if marker:
        n_marker = sum(1 for i in body if i.base == marker[0])
        steps = max(1, round(n_marker / marker[1]))
    per_step = len(body) / steps
    ipb = per_step * case.num_warps / launch["bytes_per_step"]
    widths = sorted({_aot.load_bits(i) for i in _aot.global_loads(body)})
    return {
        "registers": res.get("REG", 0),
        "spill_instructions": spill_ops,
        "local_bytes": res.get("LOCAL", 0),
        "shared_bytes": max(res.get("SHARED", 0), getattr(compiled.metadata, "shared", 0)),
        "num_warps": case.num_warps,
        "loop_instructions": len(body),
        "loop_steps_per_body": steps,
        "loop_global_loads": dict(sorted(loads.items())),
        "load_widths_bits": widths,
        "instruction_mix": dict(Counter(i.base for i in body).most_common(8)),
        "bytes_per_step": launch["bytes_per_step"],
        "warp_instructions_per_byte": round(ipb, 4),
    }


def resident_ctas(gpu: GPU, regs: int, warps: int, shared: int, smem_per_sm: int) -> int:
    threads = 32 * warps
    by_regs = gpu.regs // max(1, regs * threads)
    by_threads = gpu.max_threads // threads
    by_smem = smem_per_sm // shared if shared else gpu.max_ctas
    return max(1, min(by_regs, by_threads, by_smem, gpu.max_ctas))


def ceiling(gpu: GPU, fig: dict, ctas: int, stages: int) -> dict:
    """The model of the docstring: GB/s bounds for one matrix."""
    smem = 228 * 1024 if gpu.sms == 132 else 100 * 1024  # shared memory per SM
    resident = resident_ctas(gpu, fig["registers"], fig["num_warps"], fig["shared_bytes"], smem)
    waves = math.ceil(ctas / gpu.sms)
    eff = ctas / (waves * gpu.sms)
    issue = gpu.sms * 4 * gpu.clock_ghz * 1e9 / fig["warp_instructions_per_byte"] * eff / 1e9
    per_sm = min(ctas / gpu.sms, resident)
    latency = gpu.sms * per_sm * fig["bytes_per_step"] * max(1, stages) / gpu.latency_ns
    bound = min(gpu.dram_gbps, issue, latency)
    return {"resident_ctas_per_sm": resident, "wave_efficiency": round(eff, 3),
            "issue_bound_gbps": round(issue, 1), "latency_bound_gbps": round(latency, 1),
            "ceiling_gbps": round(bound, 1),
            "limit": "dram" if bound == gpu.dram_gbps else
                     ("issue" if bound == issue else "latency")}  # fmt: skip


# ---- driver -------------------------------------------------------------------------------------


def _fmt_loads(loads: dict) -> str:
    return " ".join(f"{op.replace('LDG.E', 'LDG')}x{n}" for op, n in loads.items()) or "-"


def profile(types: list[str], archs: list[int], models: list[str], with_others: bool,
            out_dir: str | None, write_json: bool, show_sass: bool = False) -> list[dict]:
    """Compile, analyse and print; returns the JSON records."""
    records: list[dict] = []
    cache: dict[tuple, tuple] = {}
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)

    def compiled_figures(kernel: str, case: Case, launch: dict):
        key = (kernel, launch["variant"], case.arch)
        if key not in cache:
            compiled = _aot.compile_case(case)
            fig = static_figures(compiled, case, launch)
            cubin_path = None
            if out_dir:
                cubin_path = os.path.join(out_dir, f"{kernel.replace('/', '-')}-"
                                          f"{launch['variant']}-sm{case.arch}.cubin")
                with open(cubin_path, "wb") as f:
                    f.write(compiled.asm["cubin"])
            if show_sass:
                print(_aot.sass(compiled.asm["cubin"]))
            cache[key] = (fig, cubin_path)
        return cache[key]

    print(f"# Triton {triton.__version__}; estimated ceilings, not measurements")
    hdr = (f"{'kernel':<30}{'shape':>14}{'sm':>4}{'regs':>5}{'spill':>6}{'smem':>7}"
           f"{'loop':>6}{'wi/B':>7}  {'weight loads in loop':<28}{'CTAs':>7}{'/SM':>6}"
           f"  {'GPU':<10}{'GB/s':>7}")  # fmt: skip
    print(hdr)
    for arch in archs:
        for tname in types:
            qtype = T[tname]
            for model in models:
                for mat, (n, k) in MODELS[model].items():
                    if k % block_format(qtype).block_size:
                        continue  # that type cannot hold this matrix
                    case, launch = decode_gemv_case(qtype, n, k, arch)
                    kname = f"{case.kernel.fn.__name__.strip('_')}/{tname}"
                    fig, cubin = compiled_figures(kname, case, launch)
                    ctas = launch["grid"][0] * launch["grid"][1]
                    gpu = GPUS[ARCH_GPU[arch]]
                    ceil = ceiling(gpu, fig, ctas, launch["stages"])
                    rec = {"kernel": case.kernel.fn.__name__, "qtype": tname, "arch": arch,
                           "model": model, "matrix": mat, "shape": [n, k],
                           "variant": launch["variant"], "grid": list(launch["grid"]),
                           "ctas": ctas, "triton": triton.__version__, "cubin": cubin,
                           **fig, "estimated": {"gpu": gpu.name, **ceil}}  # fmt: skip
                    records.append(rec)
                    print(f"{kname:<30}{f'{n}x{k}':>14}{arch:>4}{fig['registers']:>5}"
                          f"{fig['spill_instructions']:>6}{fig['shared_bytes']:>7}"
                          f"{fig['loop_instructions']:>6}{fig['warp_instructions_per_byte']:>7.3f}"
                          f"  {_fmt_loads(fig['loop_global_loads']):<28}{ctas:>7}"
                          f"{ctas / gpu.sms:>6.1f}  {ARCH_GPU[arch]:<10}"
                          f"{ceil['ceiling_gbps']:>7.0f} {ceil['limit']}")  # fmt: skip
        if with_others:
            for kname, (case, launch) in other_cases(arch).items():
                fig, cubin = compiled_figures(kname, case, launch)
                rec = {"kernel": case.kernel.fn.__name__, "qtype": kname.split("/")[1],
                       "arch": arch, "variant": launch["variant"], "triton": triton.__version__,
                       "cubin": cubin, **fig}  # fmt: skip
                records.append(rec)
                print(f"{kname:<30}{'-':>14}{arch:>4}{fig['registers']:>5}"
                      f"{fig['spill_instructions']:>6}{fig['shared_bytes']:>7}"
                      f"{fig['loop_instructions']:>6}{fig['warp_instructions_per_byte']:>7.3f}"
                      f"  {_fmt_loads(fig['loop_global_loads']):<28}")  # fmt: skip
    print("# wi/B: warp-instructions per weight byte; GB/s: estimated ceiling and what sets it")
    if out_dir and write_json:
        with open(os.path.join(out_dir, "profile.jsonl"), "w") as f:
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    return records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", nargs="+", default=DECODE_TYPES, choices=DECODE_TYPES)
    ap.add_argument("--arch", nargs="+", type=int, default=[90], choices=sorted(ARCH_GPU),
                    help="sm_XX to compile for")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--all", action="store_true",
                    help="also GEMM, dequantize, activation quantization, attention")
    ap.add_argument("--out", help="directory for the cubins (and profile.jsonl with --json)")
    ap.add_argument("--json", action="store_true", help="write DIR/profile.jsonl (needs --out)")
    ap.add_argument("--show-sass", action="store_true", help="print each kernel's SASS")
    args = ap.parse_args(argv)
    if args.json and not args.out:
        ap.error("--json needs --out DIR")
    try:
        profile(args.types, args.arch, args.models, args.all, args.out, args.json, args.show_sass)
    except _aot.CompileUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
