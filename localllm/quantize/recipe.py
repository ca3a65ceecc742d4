"""Which ggml type each tensor gets for a file type (``--type Q4_K_M`` ...).

The rules follow llama.cpp's ``src/llama-quant.cpp`` (``llama_tensor_get_type_impl`` and
``tensor_type_fallback``), restricted to the file types ``localllm quantize`` offers:
the output / tied token-embedding matrix goes to Q6_K (Q8_0 for Q8_0 files or rows that do not
fit 256-blocks); the ``_M``/``_L`` mixes give attn_v, ffn_down and attn_output more bits, by
layer position (``use_more_bits``: the first and last eighth of the layers and every third
layer between); rows whose length is not a multiple of the block size fall back to a
32-block type (Q2_K/Q3_K -> Q4_0, Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL)
or to F16. IQ4_NL / IQ4_XS files give attn_v Q5_K when 4+ query heads share a KV head, and the
first eighth of the ffn_down matrices Q5_K. MXFP4_MOE (gpt-oss's release format) gives the
expert tensors MXFP4 and every other matrix Q8_0.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGMLQuantizationType, LlamaFileType

from ..errors import ParameterError, UnsupportedError
from ..gguf.quants import block_format

Q = GGMLQuantizationType
F = LlamaFileType

# --type name -> (general.file_type value, default tensor type)
FILE_TYPES: dict[str, tuple[LlamaFileType, GGMLQuantizationType]] = {
    "Q8_0": (F.MOSTLY_Q8_0, Q.Q8_0),
    "Q6_K": (F.MOSTLY_Q6_K, Q.Q6_K),
    "Q5_K_M": (F.MOSTLY_Q5_K_M, Q.Q5_K),
    "Q5_K_S": (F.MOSTLY_Q5_K_S, Q.Q5_K),
    "Q4_K_M": (F.MOSTLY_Q4_K_M, Q.Q4_K),
    "Q4_K_S": (F.MOSTLY_Q4_K_S, Q.Q4_K),
    "Q3_K_L": (F.MOSTLY_Q3_K_L, Q.Q3_K),
    "Q3_K_M": (F.MOSTLY_Q3_K_M, Q.Q3_K),
    "Q3_K_S": (F.MOSTLY_Q3_K_S, Q.Q3_K),
    "Q2_K": (F.MOSTLY_Q2_K, Q.Q2_K),
    "Q4_0": (F.MOSTLY_Q4_0, Q.Q4_0),
    "Q4_1": (F.MOSTLY_Q4_1, Q.Q4_1),
    "Q5_0": (F.MOSTLY_Q5_0, Q.Q5_0),
    "Q5_1": (F.MOSTLY_Q5_1, Q.Q5_1),
    "IQ4_NL": (F.MOSTLY_IQ4_NL, Q.IQ4_NL),
    "IQ4_XS": (F.MOSTLY_IQ4_XS, Q.IQ4_XS),
    # gpt-oss's release format: experts MXFP4, every other matrix Q8_0
    "MXFP4_MOE": (F.MOSTLY_MXFP4_MOE, Q.MXFP4),
}

FLOAT_TYPES = (Q.F32, Q.F16, Q.BF16)

_FALLBACK = {Q.Q2_K: Q.Q4_0, Q.Q3_K: Q.Q4_0, Q.Q4_K: Q.Q5_0, Q.Q5_K: Q.Q5_1, Q.Q6_K: Q.Q8_0,
             Q.IQ4_XS: Q.IQ4_NL}
_IQ4 = ("IQ4_NL", "IQ4_XS")

# substrings of 2-D ".weight" tensors that llama.cpp never quantizes
_KEEP = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj",
         "ssm_conv1d", "shortconv.conv.weight", "attn_rel_b.weight", ".position_embd",
         ".rel_pos", ".patch_embd", ".patch_merger", "time_mix_")


def parse_file_type(name: str) -> str:
    """Normalize a ``--type`` value (case-insensitive).

    Raises:
        ParameterError: unknown type (the message lists the valid ones).
    """
    key = name.strip().upper()
    if key not in FILE_TYPES:
        raise ParameterError(f"--type {name}: unknown quantization type "
                             f"(one of {', '.join(FILE_TYPES)})")
    return key


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of layers that get more bits in the _M mixes."""
    return (i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8
            or (i_layer - n_layers // 8) % 3 == 2)


def category(name: str) -> str:
    """llama.cpp's tensor category: output, token_embd, attn_v, attn_k, ... or other."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    # fused qkv and MLA's kv_b are treated like attn_v (llama.cpp category_is_attn_v)
    for key, cat in (("attn_qkv.weight", "attn_v"), ("attn_kv_b.weight", "attn_v"),
                     ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"),
                     ("attn_q.weight", "attn_q"), ("attn_output.weight", "attn_output"),
                     ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """Matrices (2-D or 3-D) whose name ends in ``weight``, except norms and a few small ones."""
    if len(shape) < 2 or not name.endswith("weight"):
        return False
    return not any(k in name for k in _KEEP) and name not in ("position_embd.weight",
                                                              "token_types.weight")


def _layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


@dataclass
class ModelShape:
    """The hyperparameters the recipe looks at (from GGUF metadata)."""

    arch: str
    n_layer: int
    n_gqa: int
    n_expert: int
    is_70b: bool = False

    @classmethod
    def from_metadata(cls, md: dict) -> ModelShape:
        arch = str(md.get("general.architecture", ""))

        def first(key: str, default: int) -> int:
            v = md.get(f"{arch}.{key}", default)
            if isinstance(v, (list, tuple)):
                v = max(v) if v else default
            return int(v)

        n_layer = first("block_count", 1)
        n_head = first("attention.head_count", 1)
        n_head_kv = first("attention.head_count_kv", n_head) or n_head
        gqa = n_head // n_head_kv if n_head_kv else 1
        return cls(arch, n_layer, gqa, first("expert_count", 0),
                   arch == "llama" and n_layer == 80 and n_head != n_head_kv)


def _tensor_type(ftype: str, default: GGMLQuantizationType, name: str, cat: str, ncols: int,
                 ms: ModelShape, counters: dict[str, int], tied: bool,
                 n_experts: int = 1) -> GGMLQuantizationType:
    """llama_tensor_get_type_impl for the supported file types (``n_experts``: the leading
    dimension of a 3-D expert tensor, else 1)."""
    new = default
    falcon = ms.arch == "falcon"
    if cat == "output" or (tied and cat == "token_embd"):
        block = block_format(default).block_size
        if falcon or ncols % block or ftype == "MXFP4_MOE":
            return Q.Q8_0
        return Q.Q6_K if default != Q.Q8_0 else Q.Q8_0
    if ftype == "MXFP4_MOE":  # experts (n_expert > 1) MXFP4, the rest Q8_0
        return Q.MXFP4 if n_experts > 1 else Q.Q8_0
    if cat == "token_embd":
        return new
    if cat == "attn_v":
        i, n = counters["attn_v"], counters["n_attn_v"]
        counters["attn_v"] += 1
        if ftype == "Q2_K":
            new = Q.Q4_K if ms.n_gqa >= 4 else Q.Q3_K
        elif ftype == "Q3_K_M":
            new = Q.Q5_K if i < 2 else Q.Q4_K
        elif ftype == "Q3_K_L" or (ftype in _IQ4 and ms.n_gqa >= 4):
            new = Q.Q5_K
        elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
            new = Q.Q6_K
        elif ftype == "Q4_K_S" and i < 4:
            new = Q.Q5_K
        if ms.is_70b and new in (Q.Q3_K, Q.Q4_K):
            new = Q.Q5_K
        if ms.n_expert == 8:
            new = Q.Q8_0
        return new
    if cat == "attn_k":
        return Q.Q8_0 if ms.n_expert == 8 else new
    if cat == "ffn_down":
        i = _layer_of(name)
        if i < 0:
            i = counters["ffn_down"]
        counters["ffn_down"] += 1
        n = ms.n_layer
        if ftype == "Q2_K":
            new = Q.Q3_K
        elif ftype == "Q3_K_M":
            new = (Q.Q5_K if i < n // 16 else
                   Q.Q4_K if not falcon or use_more_bits(i, n) else Q.Q3_K)
        elif ftype == "Q3_K_L":
            new = Q.Q4_K if falcon else Q.Q5_K
        elif ftype == "Q4_K_M":
            if falcon:
                new = (Q.Q6_K if i < n // 16 else Q.Q5_K if use_more_bits(i, n) else Q.Q4_K)
            elif use_more_bits(i, n):
                new = Q.Q6_K
        elif ftype in _IQ4 and i < n // 8:  # llama.cpp: only without an importance matrix
            new = Q.Q5_K
        elif ftype == "Q5_K_M" and use_more_bits(i, n):
            new = Q.Q6_K
        elif ftype == "Q4_K_S" and not falcon and i < n // 8:
            new = Q.Q5_K
        return new
    if cat == "attn_output":
        if not falcon:
            if ms.n_expert == 8:
                if ftype in ("Q2_K", "Q3_K_S", "Q3_K_M", "Q4_K_S", "Q4_K_M", *_IQ4):
                    new = Q.Q5_K
            else:
                new = {"Q2_K": Q.Q3_K, "Q3_K_M": Q.Q4_K, "Q3_K_L": Q.Q5_K}.get(ftype, new)
        elif ftype == "Q3_K_L":
            new = Q.Q4_K
        return new
    return new


def fallback(qtype: GGMLQuantizationType, ncols: int) -> GGMLQuantizationType:
    """A type whose block size divides ``ncols`` (llama.cpp ``tensor_type_fallback``).

    Raises:
        UnsupportedError: a 32-block type that does not fit (llama.cpp has no fallback).
    """
    block = block_format(qtype).block_size
    if ncols % block == 0:
        return qtype
    if qtype not in _FALLBACK:
        raise UnsupportedError(f"rows of {ncols} values cannot be stored as {qtype.name} "
                               f"(needs a multiple of {block})")
    new = _FALLBACK[qtype]
    return new if ncols % block_format(new).block_size == 0 else Q.F16


def plan(tensors: list[tuple[str, tuple[int, ...], GGMLQuantizationType]], metadata: dict,
         ftype: str) -> dict[str, GGMLQuantizationType]:
    """Target type of every tensor. ``tensors``: (name, shape in torch order, current type).

    Tensors that are not quantized keep their type. Counters (attn_v index ...) advance in
    llama.cpp's tensor order: by layer, then by name.
    """
    default = FILE_TYPES[ftype][1]
    ms = ModelShape.from_metadata(metadata)
    names = {t[0] for t in tensors}
    tied = "output.weight" not in names
    counters = {"attn_v": 0, "ffn_down": 0,
                "n_attn_v": sum(category(n) == "attn_v" for n in names)}
    out: dict[str, GGMLQuantizationType] = {}
    for name, shape, cur in sorted(tensors, key=lambda t: (_layer_of(t[0]), t[0])):
        if not allows_quantization(name, shape):
            out[name] = cur
            continue
        ncols = shape[-1]
        new = _tensor_type(ftype, default, name, category(name), ncols, ms, counters, tied,
                           shape[0] if len(shape) == 3 else 1)
        out[name] = fallback(new, ncols)
    return out
