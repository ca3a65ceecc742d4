"""Every top-level Triton kernel compiles for an NVIDIA sm_90 GPU, without a GPU.

tests/test_kernels.py checks the kernels' results in Triton's interpreter, which runs code the
compiler refuses (Python control flow on tensors, shapes or dtypes ``tl.dot`` does not take,
too much shared memory). Here each kernel goes through Triton's own compiler
(``triton.compile`` of an ``ASTSource``, :mod:`localllm.kernels._aot`) down to PTX and a cubin
(``ptxas`` ships in the Triton wheel) for the specializations the launchers in ``localllm.kernels`` use: argument
dtypes, constexprs, launch options, and the 16-byte alignment / ``== 1`` specializations
that the JIT applies at launch.

Each compilation takes about half a second (the file: 20-35 s on 2 shared cores with a cold
cache; Triton caches the results under ``~/.triton/cache``). Checked with Triton 3.6, 3.8, 3.9.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

triton = pytest.importorskip("triton")
kernels = pytest.importorskip("localllm.kernels")
if not kernels.triton_available():
    pytest.skip("Triton is not installed", allow_module_level=True)

from localllm.kernels import PLANES, _aot
from localllm.kernels._aot import Case
from localllm.kernels.attention import _decode_attention_kernel, attention_case
from localllm.kernels.decode import GROUP_SIZES, KERNEL_TYPES, MMVQ32_TYPES, MMVQ_TYPES
from localllm.kernels.decode_k23 import MMVQ64_TYPES
from localllm.kernels.dequant import _dequant_kernel
from localllm.kernels.flash_attention import _prefill_attention_kernel, prefill_case
from localllm.kernels.fused import (
    _ACTS,
    _gated_act_kernel,
    _norm_rope_kv_kernel,
    _residual_rms_norm_kernel,
    _rms_norm_rope_kernel,
)
from localllm.kernels.gemm import _gemm_kernel
from localllm.kernels.gemv import (
    _gemv1_kernel,
    _gemv_kernel,
    _mmvq32_kernel,
    _mmvq64_kernel,
    _mmvq_kernel,
    _quantize_q8_kernel,
    mmvq_case,
)
from localllm.kernels.mla import _mla_decode_kernel, mla_case
from localllm.kernels.norm_rope import _rms_norm_kernel
from localllm.kernels.recurrent import _delta_net_kernel, delta_case
from localllm.kernels.ssm import _short_conv_kernel, _ssm_scan_kernel, conv_case, scan_case

from localllm.gguf.quants import BLOCK_FORMATS

# The most shared memory a block may use: sm_90 (H100/H200) 227 KiB, sm_86 (RTX 30xx) 99 KiB.
MAX_SHARED = {90: 227 * 1024, 86: 99 * 1024}


def compile_case(case: Case):
    """The kernel compiled for ``sm_<arch>``; skips where this Triton cannot compile."""
    try:
        return _aot.compile_case(case)
    except _aot.CompileUnavailable as e:
        pytest.skip(str(e))


def _dequant(qtype: T, out: str = "*fp32", n: str = "i32", planes: bool = False) -> Case:
    fmt = kernels.block_format(qtype)
    return Case(
        _dequant_kernel,
        {"data": "*u8", "out": out, "n_elements": n},
        {"BS": fmt.block_size, "TS": fmt.type_size, "QTYPE": int(qtype), "BLOCK": 1024,
         "PLANES": planes},
        enable_fp_fusion=False,  # as dequantize() launches it: bit-exact float32
    )


def _gemv1(qtype: T) -> Case:
    """One vector (the decode step), grouped decoding: gemv() with B == 1, K >= 256."""
    fmt, g = BLOCK_FORMATS[qtype], GROUP_SIZES[qtype]
    return Case(
        _gemv1_kernel,
        {"w": "*u8", "x": "*fp32", "y": "*fp32", "N": "i32", "K": "i32"},
        {"BS": fmt.block_size, "TS": fmt.type_size, "QTYPE": int(qtype), "G": g,
         "BLOCK_N": 16, "GROUPS": 256 // g},
    )  # fmt: skip


def _mmvq(qtype: T, n: int = 4096, k: int = 4096, arch: int = 90, planes: bool = False) -> Case:
    """gemv() for one vector of a type with the integer-dot kernel, as launched for (n, k),
    from the GGUF blocks or (``planes``) from aligned planes."""
    return mmvq_case(qtype, n, k, layout="planes" if planes else "blocks", arch=arch)[0]


def _quantize_q8() -> Case:
    return Case(_quantize_q8_kernel, {"x": "*fp32", "xq": "*i8", "xd": "*fp32", "xs": "*i32",
                                      "n_chunks": "i32"}, {"CH": 8})  # fmt: skip


def _gemv(qtype: T, batch: int, planes: bool = False) -> Case:
    """gemv() for ``batch`` vectors (1 only for the unquantized types), K >= 256."""
    fmt = kernels.block_format(qtype)
    b_pad = 1 << (batch - 1).bit_length()
    types = {"w": "*u8", "x": "*fp32", "y": "*fp32", "N": "i32", "K": "i32",
             "stride_xb": "i32", "stride_yb": "i32"}  # fmt: skip
    constexprs = {"BS": fmt.block_size, "TS": fmt.type_size, "QTYPE": int(qtype), "B_PAD": b_pad,
                  "BLOCK_N": max(1, min(16, 4096 // (b_pad * 256))), "BLOCK_K": 256,
                  "PLANES": planes}  # fmt: skip
    if batch == 1:
        constexprs["B"] = 1
    else:
        types["B"] = "i32"
    return Case(_gemv_kernel, types, constexprs, aligned=tuple(n for n in types if n != "B"))


def _gemm(qtype: T, *, bf16: bool = False, grouped: bool = True, arch: int = 90,
          block_m: int = 128, planes: bool = False, n: int = 4096, split_k: bool = False) -> Case:
    """gemm() as launched for 512 rows of an (n, 4096) matrix (default tiles: see
    ``gemm_config``): X float16 (float32 with ``bf16``), Y float32; ``grouped``: the chunk
    decoders where the type has one in its layout; ``planes``: the weights as planes."""
    from localllm.kernels.gemm import gemm_config

    fmt = BLOCK_FORMATS[qtype]
    cfg = gemm_config(512, 4096, qtype, "planes" if planes else "blocks", n=n,
                      block_m=block_m, grouped=grouped, split_k=split_k)  # fmt: skip
    return Case(
        _gemm_kernel,
        {"x": "*fp32" if bf16 else "*fp16", "w": "*u8", "y": "*fp32", "M": "i32", "N": "i32",
         "K": "i32", "stride_xm": "i32", "stride_ym": "i32"},
        {"BS": fmt.block_size, "TS": fmt.type_size, "QTYPE": int(qtype), "BF16": bf16,
         "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "BLOCK_K": cfg["BLOCK_K"],
         "CHUNKS": cfg["CHUNKS"], "EMULATE": False, "ASM": True, "PLANES": planes,
         "SPLIT_K": cfg["SPLIT_K"]},
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"], arch=arch,
        aligned=("x", "w", "y", "N", "K", "stride_xm", "stride_ym"),  # M: any prompt length
    )  # fmt: skip


def _rms_norm(dtype: str, d: int) -> Case:
    return Case(
        _rms_norm_kernel,
        {"x": dtype, "w": "*fp32", "y": dtype, "D": "i32", "stride_x": "i32", "stride_y": "i32",
         "eps": "fp32"},
        {"BLOCK_D": triton.next_power_of_2(d)},
        num_warps=4 if d <= 4096 else 8,
    )  # fmt: skip


def _rope(neox: bool, decode: bool, dtype: str = "*fp32") -> Case:
    """rope(): the kernel of rms_norm_rope without a weight, in ``dtype``."""
    return _rms_norm_rope(neox, decode, weight=False, dtype=dtype)


def _rms_norm_rope(neox: bool, decode: bool, weight: bool = True, d: int = 256,
                   dtype: str = "*fp32") -> Case:
    """rms_norm_rope() for a prompt or, with ``decode``, one position (T == 1 is a constexpr)."""
    half = d // 2
    types = {"x": dtype, "w": "*fp32", "pos": "*i64", "inv_freq": "*fp32", "y": dtype,
             "stride_xh": "i32", "stride_xt": "i32", "eps": "fp32", "scale": "fp32"}  # fmt: skip
    constexprs = {"HALF": half, "BLOCK_H": triton.next_power_of_2(half), "NEOX": neox,
                  "HAS_WEIGHT": weight}  # fmt: skip
    if decode:
        constexprs["T"] = 1
    else:
        types["T"] = "i32"
    return Case(_rms_norm_rope_kernel, types, constexprs,
                num_warps=max(1, min(4, triton.next_power_of_2(half) // 128)),
                aligned=("x", "w", "pos", "inv_freq", "y", "stride_xh", "stride_xt"))  # fmt: skip


def _q8_types(q8: bool) -> dict[str, str]:
    """The 8-bit copy's outputs of the fused kernels (unused pointers without ``q8``)."""
    return {"xq": "*i8", "xd": "*fp32", "xs": "*i32"} if q8 else dict.fromkeys(
        ("xq", "xd", "xs"), "*fp32")


def _norm_rope_kv(d: int, *, neox: bool, norms: bool, ring: bool, cache: str = "*fp16") -> Case:
    """norm_rope_kv(): a decode token's QK-norm, RoPE and KV-cache write."""
    half = d // 2
    return Case(
        _norm_rope_kv_kernel,
        {"q": "*fp32", "k": "*fp32", "v": "*fp32", "qw": "*fp32", "kw": "*fp32", "pos": "*i64",
         "inv_freq": "*fp32", "q_out": "*fp32", "k_cache": cache, "v_cache": cache,
         "k_pos": "*i64", "n_heads": "i32", "size": "i32", "stride_qh": "i32",
         "stride_kh": "i32", "stride_vh": "i32", "stride_kch": "i32", "stride_kcs": "i32",
         "stride_vch": "i32", "stride_vcs": "i32", "eps": "fp32", "scale": "fp32"},
        {"HALF": half, "BLOCK_H": triton.next_power_of_2(half), "NEOX": neox, "Q_NORM": norms,
         "K_NORM": norms, "RING": ring},
        num_warps=max(1, min(4, triton.next_power_of_2(half) // 128)),
        aligned=("q", "k", "v", "qw", "kw", "pos", "inv_freq", "q_out", "k_cache", "v_cache",
                 "k_pos", "stride_qh", "stride_kh", "stride_vh", "stride_kch", "stride_kcs",
                 "stride_vch", "stride_vcs"),
    )  # fmt: skip


def _residual_rms_norm(d: int, post: bool, q8: bool = False) -> Case:
    return Case(
        _residual_rms_norm_kernel,
        {"x": "*fp32", "f": "*fp32", "pw": "*fp32", "w": "*fp32", "h_out": "*fp32",
         "n_out": "*fp32", "D": "i32", "stride_x": "i32", "stride_f": "i32", "eps": "fp32",
         **_q8_types(q8)},
        {"HAS_POST": post, "BLOCK_D": triton.next_power_of_2(d), "Q8": q8},
        num_warps=4 if d <= 4096 else 8,
        aligned=("x", "f", "pw", "w", "h_out", "n_out", "D", "stride_x", "stride_f", "xq",
                 "xd", "xs"),
    )  # fmt: skip


def _gated_act(act: str, f: int, q8: bool = False) -> Case:
    return Case(
        _gated_act_kernel,
        {"gate": "*fp32", "up": "*fp32", "y": "*fp32", "F": "i32", "stride_g": "i32",
         "stride_u": "i32", **_q8_types(q8)},
        {"ACT": _ACTS[act], "BLOCK": min(1024, triton.next_power_of_2(f)), "Q8": q8},
        aligned=("gate", "up", "y", "F", "stride_g", "stride_u", "xq", "xd", "xs"),
    )  # fmt: skip


CASES = {
    **{f"dequant-{q.name}": _dequant(q) for q in KERNEL_TYPES},
    "dequant-Q6_K-fp16": _dequant(T.Q6_K, "*fp16"),
    "dequant-Q8_0-bf16-i64": _dequant(T.Q8_0, "*bf16", "i64"),  # > 2**31 weights
    **{f"gemv1-{q.name}": _gemv1(q) for q in KERNEL_TYPES if q in GROUP_SIZES},
    **{f"mmvq-{q.name}": _mmvq(q) for q in MMVQ_TYPES},
    "mmvq-Q8_0-gemma-qkv": _mmvq(T.Q8_0, 1536, 640),  # 8 groups a step
    "mmvq-Q4_K-sm86": _mmvq(T.Q4_K, arch=86),
    # aligned planes (QuantWeight.aligned): what a loaded model launches for these types
    **{f"dequant-{q.name}-planes": _dequant(q, "*fp16", planes=True) for q in PLANES},
    **{f"mmvq-{q.name}-planes": _mmvq(q, planes=True) for q in PLANES},
    "mmvq-Q8_0-planes-gemma-qkv": _mmvq(T.Q8_0, 1536, 640, planes=True),
    "mmvq-IQ4_XS-planes-sm86": _mmvq(T.IQ4_XS, arch=86, planes=True),
    "mmvq-Q3_K-planes-sm86": _mmvq(T.Q3_K, arch=86, planes=True),
    # one split: Llama-3-8B's gate/up (Q2_K: the plain store of _mmvq64_kernel)
    "mmvq-Q2_K-planes-llama-gate_up": _mmvq(T.Q2_K, 28672, 4096, planes=True),
    # one split (Llama-3-8B's gate/up): the plain store, no split-K epilogue
    "mmvq-Q4_K-llama-gate_up": _mmvq(T.Q4_K, 28672, 4096),
    "mmvq-Q4_0-planes-llama-gate_up": _mmvq(T.Q4_0, 28672, 4096, planes=True),
    **{f"gemv-{q.name}-b4-planes": _gemv(q, 4, planes=True) for q in PLANES},
    **{f"gemm-{q.name}-planes": _gemm(q, planes=True) for q in PLANES},
    "quantize_q8": _quantize_q8(),
    "attention-llama-g4-d128": attention_case(4, 128, ring=False),
    "attention-gemma-ring-g4-d256": attention_case(4, 256, ring=True),
    "attention-gemma-ring-g4-d256-1split": attention_case(4, 256, ring=True, single=True),
    "attention-gemma2-softcap-g2-d256": attention_case(2, 256, ring=True, softcap=True),
    "attention-g1-d64-fp32": attention_case(1, 64, ring=False, kv="*fp32"),
    "attention-phi3-g1-d96": attention_case(1, 96, ring=False),
    "attention-g32-d128": attention_case(32, 128, ring=False),
    "attention-g7-d128-sm86": attention_case(7, 128, ring=True, arch=86),
    "attention-g2-d48-no-q8": attention_case(2, 48, ring=False),  # chunks would span heads
    # gpt-oss-20b's attention sinks: its sliding layers (ring, the split merge adds the
    # sinks) and its full layers at one split (the program adds them)
    "attention-gptoss-sinks-ring-g8-d64": attention_case(8, 64, ring=True, sinks=True),
    "attention-gptoss-sinks-g8-d64-1split": attention_case(8, 64, ring=False, sinks=True,
                                                           single=True),
    # Llama 4 Scout's chunked layers (a ring of the chunk, the window found in the kernel)
    "attention-llama4-chunked-ring-g5-d128": attention_case(5, 128, ring=True, chunked=True),
    # a KV cache of q8_0 blocks (-ctk/-ctv q8_0) dequantized in the kernel: Llama-3-8B's
    # shapes, and a ring of Gemma 3's head_dim
    "attention-llama-q8_0-g4-d128": attention_case(4, 128, ring=False, kv="*u8"),
    "attention-gemma-ring-q8_0-g4-d256": attention_case(4, 256, ring=True, kv="*u8"),
    **{f"gemv-{q.name}-b1": _gemv(q, 1) for q in KERNEL_TYPES if q not in GROUP_SIZES},
    **{f"gemv-{q.name}-b8": _gemv(q, 8) for q in KERNEL_TYPES},
    "gemv-Q4_K-b3": _gemv(T.Q4_K, 3),
    "gemm-Q4_K": _gemm(T.Q4_K),
    "gemm-Q4_K-m64": _gemm(T.Q4_K, block_m=64),
    "gemm-Q4_K-n64": _gemm(T.Q4_K, n=6144),  # 64-row weight tiles: Llama-3-8B's QKV
    "gemm-Q4_K-splitK": _gemm(T.Q4_K, n=6144, split_k=True),  # the same, float32 out
    "gemm-Q5_K-bf16": _gemm(T.Q5_K, bf16=True),
    "gemm-Q6_K": _gemm(T.Q6_K),  # blocks: weight by weight
    "gemm-Q8_0-bf16": _gemm(T.Q8_0, bf16=True),
    "gemm-Q8_0-planes-bf16": _gemm(T.Q8_0, bf16=True, planes=True),
    "gemm-Q5_K-ungrouped": _gemm(T.Q5_K, grouped=False),
    "gemm-Q4_1": _gemm(T.Q4_1),
    "gemm-Q5_1": _gemm(T.Q5_1),
    "gemm-F16": _gemm(T.F16),
    "gemm-Q4_K-sm86": _gemm(T.Q4_K, arch=86),  # Ampere/Ada: mma, not Hopper's wgmma
    "gemm-Q6_K-planes-sm86": _gemm(T.Q6_K, arch=86, planes=True),
    # prefill attention: Llama-3-8B, Gemma 3's sliding layers (ring), Gemma 2's soft-capping,
    # Phi-3's head_dim 96, float32 caches (the interpreter's products), Ampere
    "prefill-attention-llama-g4-d128": prefill_case(4, 128),
    "prefill-attention-gemma3-ring-d256": prefill_case(4, 256, window=True, kpos=True),
    "prefill-attention-gemma2-softcap": prefill_case(2, 256, window=True, kpos=True,
                                                     softcap=True),
    "prefill-attention-g1-d96": prefill_case(1, 96),
    "prefill-attention-g7-d64-fp32": prefill_case(7, 64, kv="*fp32"),
    "prefill-attention-g4-d128-sm86": prefill_case(4, 128, window=True, arch=86),
    "rms_norm-fp32-640": _rms_norm("*fp32", 640),
    "rms_norm-fp16-8192": _rms_norm("*fp16", 8192),
    "rope-neox-prefill": _rope(True, decode=False),
    "rope-norm-decode": _rope(False, decode=True),
    "rope-neox-decode-fp16": _rope(True, decode=True, dtype="*fp16"),
    "rms_norm_rope-neox-decode": _rms_norm_rope(True, decode=True),
    "rms_norm_rope-norm-prefill": _rms_norm_rope(False, decode=False, d=128),
    "rms_norm_rope-neox-nonorm-prefill-d64": _rms_norm_rope(True, decode=False, weight=False, d=64),
    "norm_rope_kv-gemma3-ring-d256": _norm_rope_kv(256, neox=True, norms=True, ring=True),
    "norm_rope_kv-llama-d128": _norm_rope_kv(128, neox=False, norms=False, ring=False),
    "norm_rope_kv-qwen3-d128-fp32": _norm_rope_kv(128, neox=True, norms=True, ring=False,
                                                  cache="*fp32"),
    "residual_rms_norm-post-640": _residual_rms_norm(640, post=True),
    "residual_rms_norm-8192": _residual_rms_norm(8192, post=False),
    # one row (decode): the 8-bit copy for the next GEMV written by the same launch
    "residual_rms_norm-post-640-q8": _residual_rms_norm(640, post=True, q8=True),
    "residual_rms_norm-4096-q8": _residual_rms_norm(4096, post=False, q8=True),
    "gated_act-silu-14336-q8": _gated_act("silu", 14336, q8=True),
    "gated_act-gelu_tanh-2048-q8": _gated_act("gelu_tanh", 2048, q8=True),
    "gated_act-gelu_tanh-2048": _gated_act("gelu_tanh", 2048),
    "gated_act-silu-14336": _gated_act("silu", 14336),
    "short_conv-granite4-k4": conv_case(3328, 4)[0],
    "short_conv-lfm2-k3-nobias": conv_case(2048, 3, bias=False, silu=False)[0],
    "ssm_scan-granite4-p64-n128": scan_case(48, 64, 128)[0],
    "ssm_scan-n16-nod": scan_case(8, 64, 16, with_d=False)[0],
    "gated_delta_net-qwen35-s128": delta_case(16, 16, 128, interleave=False)[0],
    "gated_delta_net-qwen3next-s128": delta_case(32, 16, 128, interleave=True)[0],
    "gated_delta_net-s64-ratio2": delta_case(4, 2, 64, interleave=False)[0],
    # MLA decode over the latent cache: DeepSeek-V3 (128 heads, 512 + 64), V2-Lite (16),
    # a float32 cache and a latent whose parts are not powers of two
    "mla_decode-deepseek-v3": mla_case(128, 512, 64)[0],
    "mla_decode-deepseek-v2-lite": mla_case(16, 512, 64)[0],
    "mla_decode-r96-rot24-fp32": mla_case(8, 96, 24, kv="*fp32")[0],
}


@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_kernel_compiles(case: Case):
    compiled = compile_case(case)
    assert f".target sm_{case.arch}" in compiled.asm["ptx"]
    assert len(compiled.asm["cubin"]) > 0
    assert compiled.metadata.num_warps == case.num_warps
    assert compiled.metadata.shared <= MAX_SHARED[case.arch], "more shared memory than sm has"


def test_every_kernel_type_is_covered():
    """Each kernel is compiled for every type it can be launched with."""
    cases = list(CASES.values())
    for kernel, eligible in [
        (_dequant_kernel, KERNEL_TYPES),
        (_gemv_kernel, KERNEL_TYPES),
        (_gemv1_kernel, [q for q in KERNEL_TYPES if q in GROUP_SIZES]),
        (_mmvq_kernel, list(MMVQ_TYPES)),
        (_mmvq32_kernel, list(MMVQ32_TYPES)),
        (_mmvq64_kernel, list(MMVQ64_TYPES)),
    ]:
        covered = {c.constexprs["QTYPE"] for c in cases
                   if c.kernel is kernel and not c.constexprs.get("PLANES")}  # fmt: skip
        assert covered == {int(q) for q in eligible}, kernel.fn.__name__
    for kernel in (_dequant_kernel, _gemv_kernel, _gemm_kernel):  # every planes type
        covered = {c.constexprs["QTYPE"] for c in cases
                   if c.kernel is kernel and c.constexprs.get("PLANES")}  # fmt: skip
        assert covered == {int(q) for q in PLANES}, kernel.fn.__name__
    launched = {_dequant_kernel, _gemv_kernel, _gemv1_kernel, _gemm_kernel, _rms_norm_kernel,
                _rms_norm_rope_kernel, _residual_rms_norm_kernel, _gated_act_kernel,
                _norm_rope_kv_kernel, _mmvq_kernel, _mmvq32_kernel, _mmvq64_kernel,
                _quantize_q8_kernel, _prefill_attention_kernel,
                _decode_attention_kernel, _short_conv_kernel, _ssm_scan_kernel,
                _delta_net_kernel, _mla_decode_kernel}  # fmt: skip
    assert {c.kernel for c in cases} == launched


def test_both_epilogues_are_compiled():
    """The GEMVs with and without the split-K epilogue, attention with and without its
    output's 8-bit copy, with and without attention sinks and chunking."""
    for kernel, flag in ((_mmvq_kernel, "SPLITK"), (_mmvq32_kernel, "SPLITK"),
                         (_mmvq64_kernel, "SPLITK"), (_decode_attention_kernel, "Q8"),
                         (_decode_attention_kernel, "SINKS"),
                         (_decode_attention_kernel, "CHUNKED")):  # fmt: skip
        seen = {c.constexprs[flag] for c in CASES.values() if c.kernel is kernel}
        assert seen == {False, True}, (kernel.fn.__name__, flag)


def test_cuda_variant_is_a_jit_function():
    """``DualKernel.variant`` builds the compiler's JITFunction without touching a GPU."""
    from triton.runtime.jit import JITFunction

    fn = _dequant_kernel.variant(torch.device("cuda"))
    assert isinstance(fn, JITFunction)
    assert fn.fn is _dequant_kernel.fn
    assert _dequant_kernel.variant(torch.device("cuda", 0)) is fn


def test_compiles_after_an_interpreted_launch(monkeypatch, tmp_path):
    """An interpreted launch leaves ``triton.language`` as it was, so compiling still works.

    The interpreter patches ``tl.tensor``'s operators and leaves some patched after calls to
    helpers (``tl.sum`` here); ``localllm.kernels._jit`` undoes them.
    """
    import triton.language as tl
    from localllm.kernels.norm_rope import rms_norm

    before = [dict(vars(o)) for o in (tl, tl.core, tl.tensor)]
    x = torch.randn(3, 40)
    y = rms_norm(x, torch.ones(40), 1e-6)
    torch.testing.assert_close(y, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert [dict(vars(o)) for o in (tl, tl.core, tl.tensor)] == before
    # An empty cache: the compiler's front end must run, not a cached result be loaded.
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    compile_case(CASES["rms_norm-fp32-640"])
    assert any(tmp_path.iterdir()), "the compiler did not use the fresh cache directory"
