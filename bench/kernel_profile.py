"""Static profile of the Triton kernels, from the compiled code (no GPU needed).

Usage::

    python bench/kernel_profile.py                          # decode GEMV, sm_90, 3 models
    python bench/kernel_profile.py --arch 90 86 89 --all    # every kernel, three GPUs
    python bench/kernel_profile.py --types Q4_K Q6_K --out prof --json
    python bench/kernel_profile.py --types Q4_K --prefill Q4_K Q6_K   # + prefill estimates

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

Prefill (``--prefill TYPES``, or every type with ``--all``; sm_90 only): the GEMM as
``gemm()`` launches it for 512 rows of each Llama-3-8B matrix, and flash attention at 512
tokens for the three models' layer shapes, with an estimated share of the H100's dense
float16 tensor peak from the main loop's SASS: per loop step the tensor-core time at peak
against the issue, shared-memory and L2 time of the step's instructions and bytes (see
"prefill" below: the model and its constants, the L2 bandwidth an assumption), times the
wave efficiency (the GEMM) or over the makespan of the causal prompt's uneven programs
(attention, counting only the visible query-key pairs as useful).

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
    """Dequantize, activation quantization, decode attention (one shape each: their code does
    not depend on the matrix shape) and the state-space recurrences."""
    from localllm.kernels import PLANES
    from localllm.kernels.attention import attention_case, default_block_s
    from localllm.kernels.dequant import _dequant_kernel
    from localllm.kernels.gemv import _quantize_q8_kernel

    out: dict[str, tuple[Case, dict]] = {}

    for q in (T.Q4_K, T.Q6_K, T.Q8_0):
        fmt = block_format(q)
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
    # State-space models' recurrences (Granite-4.0-H-1B's Mamba2: 48 heads x 64, state 128,
    # 3328 convolution channels; LFM2-1.2B's gated convolution: 2048 channels, 3 taps):
    # the main loop is the one over tokens; bytes per step are what a program reads a token.
    from localllm.kernels.ssm import conv_case, scan_case

    out["short_conv/granite4-1b"] = conv_case(3328, 4, arch=arch)
    out["short_conv/lfm2-1.2b"] = conv_case(2048, 3, bias=False, silu=False, arch=arch)
    out["ssm_scan/granite4-1b"] = scan_case(48, 64, 128, arch=arch)
    # The gated delta rule (Qwen3.5-0.8B: 16 value heads over 16 key heads; Qwen3-Next-80B:
    # 32 over 16, each key head repeated in place), heads of 128: the state block stays in
    # registers over the token loop.
    from localllm.kernels.recurrent import delta_case

    out["gated_delta_net/qwen35-0.8b"] = delta_case(16, 16, 128, interleave=False, arch=arch)
    out["gated_delta_net/qwen3next-80b"] = delta_case(32, 16, 128, interleave=True, arch=arch)
    # Multi-head latent attention at decode (DeepSeek-V3: 128 heads over latents of 512 + 64
    # float16 values): bytes per step are BLOCK_S latents, read once for 16 heads
    from localllm.kernels.mla import mla_case

    out["mla_decode/deepseek-v3"] = mla_case(128, 512, 64, arch=arch)
    return out


# ---- prefill: the GEMM on tensor cores ----------------------------------------------------------
#
# Model (sm_90 against the H100; an estimate, not a measurement). Per loop step a program
# multiplies a BLOCK_N x BLOCK_K weight tile by a BLOCK_M x BLOCK_K activation tile. The SM
# needs, per step, at least:
#
# - tensor cores: 2 * BLOCK_M * BLOCK_N * BLOCK_K / TENSOR_FLOPS_CLK cycles (dense float16
#   with float32 sums: 4096 FLOP a cycle an SM, the 989 TFLOPS of NVIDIA's H100 SXM figure at
#   1.83 GHz; the tensor-core time of the step at peak);
# - issue: loop warp-instructions / 4 schedulers;
# - shared memory: the bytes of the loop's shared-memory instructions (LDS, STS, LDSM and the
#   async copies' writes, LDGSTS) plus what HGMMA reads of its shared-memory operands, at
#   SMEM_BYTES_CLK (128) bytes a cycle;
# - L2: the bytes of the loop's global loads at L2_GBPS (an assumption: third-party figures
#   for the H100 SXM range to about 12 TB/s) shared by the SMs.
#
# The step takes the longest of these (perfect overlap: an upper bound); the share of peak is
# the tensor-core time over it, times the wave efficiency (CTAs / (waves * SMs)), and the whole
# matrix at most what DRAM can feed (every weight byte, the activations and the result once).
TENSOR_FLOPS_CLK = {90: 4096}
SMEM_BYTES_CLK = 128
L2_GBPS = {90: 10000.0}
PREFILL_ROWS = 512
GEMM_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
              "IQ4_NL", "IQ4_XS", "MXFP4"]


def gemm_case(qtype: T, m: int, n: int, k: int, arch: int) -> tuple[Case, dict]:
    """The GEMM as ``gemm()`` launches it for ``m`` float16 rows and an (n, k) ``qtype``
    matrix in the layout a loaded model keeps it, and its launch shape."""
    from localllm.kernels import PLANES
    from localllm.kernels.gemm import _gemm_kernel, gemm_config

    fmt = block_format(qtype)
    layout = "planes" if qtype in PLANES else "blocks"
    cfg = gemm_config(m, k, qtype, layout, n=n, split_k=True)  # a float32 result
    case = Case(
        _gemm_kernel,
        {"x": "*fp16", "w": "*u8", "y": "*fp32", "M": "i32", "N": "i32", "K": "i32",
         "stride_xm": "i32", "stride_ym": "i32"},
        {"BS": fmt.block_size, "TS": fmt.type_size, "QTYPE": int(qtype), "BF16": False,
         "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
         "CHUNKS": cfg["CHUNKS"], "EMULATE": False, "ASM": True, "PLANES": layout == "planes",
         "SPLIT_K": cfg["SPLIT_K"]},
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], arch=arch,
        aligned=("x", "w", "y", "N", "K", "stride_xm", "stride_ym"),
    )  # fmt: skip
    launch = {"grid": (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]),
                       cfg["SPLIT_K"]),
              "bytes_per_step": cfg["BLOCK_N"] * cfg["BLOCK_K"] * fmt.type_size // fmt.block_size,
              "tile": (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]), "marker": None,
              "loop_op": "HGMMA", "mma_k": cfg["BLOCK_K"],
              "variant": f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']}"
                         f"{'-chunks' if cfg['CHUNKS'] else ''}"
                         f"{'-splitK' if cfg['SPLIT_K'] > 1 else ''}"}  # fmt: skip
    return case, launch


def _ldsm_bytes(op: str) -> int:
    """Bytes a thread receives from ``LDSM[.16.M88|.MT88][.2|.4]`` (8x8 16-bit matrices)."""
    mods = op.split(".")
    return 4 * (int(mods[-1]) if mods[-1] in ("2", "4") else 1)


def _mma_shape(op: str) -> tuple[int, int, int]:
    """(m, n, k) of ``HGMMA.64x128x16.F32``."""
    m, n, k = op.split(".")[1].split("x")
    return int(m), int(n), int(k)


def memory_traffic(body, warps: int) -> dict:
    """Bytes the loop body moves, per pass: shared memory (LDS, STS, LDSM, the writes of
    LDGSTS, and the shared-memory operands HGMMA reads: once per warpgroup) and global
    (LDG, LDGSTS). ``LDS RZ, [RZ]`` (a fence, no data) counts no bytes."""
    smem = glob = 0
    for i in body:
        if i.base in ("LDS", "STS", "LDGSTS", "LDG"):
            if i.base == "LDS" and i.operands.startswith("RZ"):
                continue
            nbytes = _aot.load_bits(i) // 8 * 32 * warps
            if i.base != "LDG":
                smem += nbytes
            if i.base in ("LDG", "LDGSTS"):
                glob += nbytes
        elif i.base == "LDSM":
            smem += _ldsm_bytes(i.op) * 32 * warps
        elif i.base == "HGMMA":
            m, n, k = _mma_shape(i.op)
            ops = [o.strip() for o in i.operands.split(",")]
            b = n * k * 2 + (m * k * 2 if ops[1].startswith("gdesc") else 0)
            smem += b * max(1, warps // 4)
    return {"smem_bytes": smem, "global_bytes": glob}


def gemm_estimate(gpu: GPU, arch: int, fig: dict, launch: dict, n: int, k: int, m: int,
                  traffic: dict, qtype: T) -> dict:  # fmt: skip
    """The model above for one (n, k) matrix at ``m`` rows: bounds in cycles a step and the
    estimated share of the dense float16 peak."""
    bm, bn, bk = launch["tile"]
    steps = max(1, fig["loop_mma"] // max(1, bk // 16))  # loop passes per body (unrolling)
    t_mma = 2 * bm * bn * bk / TENSOR_FLOPS_CLK[arch]
    t_issue = fig["loop_instructions"] / steps * fig["num_warps"] / 4
    t_smem = traffic["smem_bytes"] / steps / SMEM_BYTES_CLK
    l2_clk = L2_GBPS[arch] / (gpu.sms * gpu.clock_ghz)  # bytes a cycle an SM
    t_l2 = traffic["global_bytes"] / steps / l2_clk
    bounds = {"tensor": t_mma, "issue": t_issue, "smem": t_smem, "l2": t_l2}
    limit = max(bounds, key=bounds.get)
    ctas = math.prod(launch["grid"])
    eff = ctas / (math.ceil(ctas / gpu.sms) * gpu.sms)
    frac = t_mma / bounds[limit] * eff
    peak = gpu.sms * TENSOR_FLOPS_CLK[arch] * gpu.clock_ghz * 1e9
    fmt = block_format(qtype)
    dram_bytes = n * k * fmt.type_size / fmt.block_size + m * k * 2 + m * n * 4
    t_dram = dram_bytes / (gpu.dram_gbps * 1e9)
    t_comp = 2 * m * n * k / (peak * frac)
    if t_dram > t_comp:
        limit, frac = "dram", 2 * m * n * k / peak / t_dram
    return {"cycles_per_step": {b: round(v, 1) for b, v in bounds.items()},
            "wave_efficiency": round(eff, 3), "limit": limit,
            "peak_fraction": round(frac, 3), "tflops": round(frac * peak / 1e12, 1),
            "peak_tflops": round(peak / 1e12, 1)}


# ---- prefill: flash attention ------------------------------------------------------------------
#
# The same bounds a loop step (a BLOCK_N-key step of a BLOCK_M-row program: 4 * BLOCK_M *
# BLOCK_N * head_dim FLOP of Q K^T and P V on tensor cores). A prompt of PREFILL_ROWS tokens
# into an empty cache: a program's steps cover the keys up to its last row's position (the
# causal mask skips later key blocks); the programs are spread over the SMs longest first
# (the makespan: the SM with the most steps), and the useful FLOP are those of the visible
# (query, key) pairs, so the causal diagonal's masked half of a step and the imbalance
# between programs count against the estimate.

# (query heads, KV heads, head_dim, sliding window or None) of the models' attention layers.
ATTENTION = {"llama3-8b": (32, 8, 128, None), "qwen2.5-7b": (28, 4, 128, None),
             "gemma3-270m": (4, 1, 256, 512)}  # fmt: skip


def attention_prefill_record(model: str, arch: int, compiled_figures) -> dict:
    """The JSON record of prefill attention for ``model``'s layer shape at PREFILL_ROWS."""
    import torch
    from localllm.kernels.flash_attention import prefill_case, prefill_config

    n_heads, n_kv, d, window = ATTENTION[model]
    group = n_heads // n_kv
    case = prefill_case(group, d, window=window is not None, arch=arch)
    cfg = prefill_config(d, torch.float16)
    bm, bn, t = cfg["BLOCK_M"], cfg["BLOCK_N"], PREFILL_ROWS
    launch = {"loop_op": "HGMMA", "marker": None, "bytes_per_step": 2 * bn * d * 2,
              "variant": f"G{group}D{d}M{bm}N{bn}{'W' if window else ''}"}  # fmt: skip
    fig, cubin = compiled_figures(f"prefill_attention/{model}", case, launch)
    gpu = GPUS[ARCH_GPU[arch]]
    steps, useful = [], 0
    for blk in range(math.ceil(group * t / bm)):
        pos = [r % t for r in range(blk * bm, min(group * t, (blk + 1) * bm))]
        lo = max(0, min(pos) - window + 1) // bn * bn if window else 0
        steps.append(math.ceil((max(pos) + 1 - lo) / bn))
        useful += sum(min(p + 1, window or p + 1) for p in pos)
    steps = steps * n_kv
    loads = [0] * gpu.sms
    for st in sorted(steps, reverse=True):  # longest first onto the least loaded SM
        loads[loads.index(min(loads))] += st
    t_mma = 4 * bm * bn * d / TENSOR_FLOPS_CLK[arch]
    bounds = {"tensor": t_mma, "issue": fig["loop_instructions"] * fig["num_warps"] / 4,
              "smem": fig["smem_bytes"] / SMEM_BYTES_CLK,
              "l2": fig["global_bytes"] / (L2_GBPS[arch] / (gpu.sms * gpu.clock_ghz))}
    limit = max(bounds, key=bounds.get)
    cycles = max(loads) * bounds[limit]
    flops = 4 * d * useful * n_kv
    frac = flops / (cycles * gpu.sms * TENSOR_FLOPS_CLK[arch])
    est = {"gpu": gpu.name, "cycles_per_step": {b: round(v, 1) for b, v in bounds.items()},
           "limit": limit, "programs": len(steps), "steps_max": max(loads),
           "steps_mean_per_sm": round(sum(steps) / gpu.sms, 1),
           "useful_fraction": round(flops / (sum(steps) * 4 * bm * bn * d), 3),
           "peak_fraction": round(frac, 3),
           "resident_ctas_per_sm": resident_ctas(gpu, fig["registers"], fig["num_warps"],
                                                 fig["shared_bytes"], 228 * 1024)}  # fmt: skip
    return {"kernel": "_prefill_attention_kernel", "model": model, "arch": arch, "rows": t,
            "variant": launch["variant"], "triton": triton.__version__, "cubin": cubin, **fig,
            "estimated": est}


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
    mma = [i for i in body if i.base in ("HGMMA", "HMMA", "IMMA")]
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
        "loop_mma": len(mma),
        "mma_ops": sorted({i.op for i in mma}),
        **memory_traffic(body, case.num_warps),
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
            out_dir: str | None, write_json: bool, show_sass: bool = False,
            prefill: list[str] = ()) -> list[dict]:  # fmt: skip
    """Compile, analyse and print; returns the JSON records. ``prefill``: the types whose
    prefill GEMM is estimated on Llama-3-8B's matrices at :data:`PREFILL_ROWS` rows (sm_90)."""
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
        if prefill and arch in TENSOR_FLOPS_CLK:
            print(f"# prefill at {PREFILL_ROWS} rows, llama3-8b; est: estimated share of the "
                  f"dense float16 peak; bounds: cycles a step (tensor/issue/smem/l2)")
            for tname in prefill:
                for mat, (n, k) in MODELS["llama3-8b"].items():
                    rec = prefill_record(tname, n, k, arch, compiled_figures)
                    rec["matrix"] = mat
                    records.append(rec)
                    est = rec["estimated"]
                    b = est["cycles_per_step"]
                    print(f"{'gemm/' + tname:<30}{f'{n}x{k}':>14}{arch:>4}{rec['registers']:>5}"
                          f"{rec['spill_instructions']:>6}{rec['shared_bytes']:>7}"
                          f"{rec['loop_instructions']:>6}{rec['warp_instructions_per_byte']:>7.3f}"
                          f"  {'/'.join(o.split('.')[0] + o.split('.')[1][:10] for o in rec['mma_ops'])[:18]:<18}"
                          f"{rec['ctas']:>6}{est['resident_ctas_per_sm']:>3}/SM"
                          f"  {b['tensor']:.0f}/{b['issue']:.0f}/{b['smem']:.0f}/{b['l2']:.0f}"
                          f"  est {100 * est['peak_fraction']:.0f}% {est['limit']}")  # fmt: skip
        if prefill and arch in TENSOR_FLOPS_CLK:
            print(f"# prefill attention at {PREFILL_ROWS} tokens (causal, empty cache); est: "
                  f"useful FLOP / the dense float16 peak over the makespan")
            for model in ATTENTION:
                rec = attention_prefill_record(model, arch, compiled_figures)
                records.append(rec)
                est = rec["estimated"]
                b = est["cycles_per_step"]
                print(f"{'prefill_attention/' + model:<30}{rec['variant']:>14}{arch:>4}"
                      f"{rec['registers']:>5}{rec['spill_instructions']:>6}{rec['shared_bytes']:>7}"
                      f"{rec['loop_instructions']:>6}{'':>7}"
                      f"  {'/'.join(o.split('.')[0] + o.split('.')[1][:10] for o in rec['mma_ops'])[:18]:<18}"
                      f"{est['programs']:>6}{est['resident_ctas_per_sm']:>3}/SM"
                      f"  {b['tensor']:.0f}/{b['issue']:.0f}/{b['smem']:.0f}/{b['l2']:.0f}"
                      f"  useful {100 * est['useful_fraction']:.0f}% steps {est['steps_max']}"
                      f"/{est['steps_mean_per_sm']}  est {100 * est['peak_fraction']:.0f}%"
                      f" {est['limit']}")  # fmt: skip
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


def prefill_record(tname: str, n: int, k: int, arch: int, compiled_figures) -> dict:
    """The JSON record of the prefill GEMM of an (n, k) ``tname`` matrix (see the model)."""
    qtype = T[tname]
    case, launch = gemm_case(qtype, PREFILL_ROWS, n, k, arch)
    fig, cubin = compiled_figures(f"gemm/{tname}", case, launch)
    gpu = GPUS[ARCH_GPU[arch]]
    est = gemm_estimate(gpu, arch, fig, launch, n, k, PREFILL_ROWS,
                        {"smem_bytes": fig["smem_bytes"], "global_bytes": fig["global_bytes"]},
                        qtype)  # fmt: skip
    est["resident_ctas_per_sm"] = resident_ctas(gpu, fig["registers"], fig["num_warps"],
                                                fig["shared_bytes"], 228 * 1024)  # fmt: skip
    ctas = math.prod(launch["grid"])
    return {"kernel": "_gemm_kernel", "qtype": tname, "arch": arch, "model": "llama3-8b",
            "rows": PREFILL_ROWS, "shape": [n, k], "variant": launch["variant"],
            "grid": list(launch["grid"]), "ctas": ctas, "triton": triton.__version__,
            "cubin": cubin, **fig, "estimated": {"gpu": gpu.name, **est}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--types", nargs="+", default=DECODE_TYPES, choices=DECODE_TYPES)
    ap.add_argument("--arch", nargs="+", type=int, default=[90], choices=sorted(ARCH_GPU),
                    help="sm_XX to compile for")
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--all", action="store_true",
                    help="also the prefill GEMM (every --prefill type), dequantize, activation "
                         "quantization, attention")
    ap.add_argument("--prefill", nargs="*", choices=GEMM_TYPES,
                    help="prefill GEMM types to estimate (default with --all: all of them)")
    ap.add_argument("--out", help="directory for the cubins (and profile.jsonl with --json)")
    ap.add_argument("--json", action="store_true", help="write DIR/profile.jsonl (needs --out)")
    ap.add_argument("--show-sass", action="store_true", help="print each kernel's SASS")
    args = ap.parse_args(argv)
    if args.json and not args.out:
        ap.error("--json needs --out DIR")
    try:
        prefill = args.prefill if args.prefill is not None else (GEMM_TYPES if args.all else [])
        profile(args.types, args.arch, args.models, args.all, args.out, args.json, args.show_sass,
                prefill)
    except _aot.CompileUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
