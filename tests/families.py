"""Small random-weights models of every family, for the llama.cpp comparison fixtures.

Each entry is a real geometry of :data:`localllm.models.synthetic.GEOMETRIES` shrunk to a few
layers (d_model 256, so that K-quants fit the rows), a vocabulary of 320 tokens, and matrices
with a larger spread than a trained model's (``WEIGHT_STD``) so that the next-token
distribution is peaked. :func:`write_family` writes the GGUF deterministically (same bytes
for the same arguments; the fixture stores its SHA-256), with llama.cpp's tensor types of the
family's quantization recipe.
"""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path

from localllm.models.synthetic import GEOMETRIES, write_synthetic

WEIGHT_STD = 0.15
SEED = 14
N_VOCAB = 320
SMALL = {"n_vocab": N_VOCAB, "n_layers": 2, "d_model": 256, "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
             "ffn_dim": 512, "context_length": 512, "n_pad_tokens": 0}
BPE = {"vocab": "gpt2", "specials": ("<|endoftext|>", "<|im_end|>")}
# o200k_harmony's markers (gpt-oss), as the released vocabulary names them
HARMONY = {"vocab": "gpt2", "specials": ("<|startoftext|>", "<|endoftext|>", "<|return|>",
                                         "<|constrain|>", "<|channel|>", "<|start|>", "<|end|>",
                                         "<|message|>", "<|call|>")}

# family -> (geometry, recipe)
FAMILIES: dict[str, tuple] = {
    "llama": (dataclasses.replace(GEOMETRIES["llama3.2-1b"], **SMALL, **BPE,
                                  pre="llama-bpe", tied_output=False), "Q4_K_M"),
    "mistral": (dataclasses.replace(GEOMETRIES["mistral-7b"], **SMALL), "Q5_K_M"),
    "qwen2": (dataclasses.replace(GEOMETRIES["qwen2.5-7b"], **SMALL, **BPE), "Q8_0"),
    "qwen3": (dataclasses.replace(GEOMETRIES["qwen3-8b"], **SMALL, **BPE), "Q6_K"),
    "qwen3moe": (dataclasses.replace(
        GEOMETRIES["qwen3-30b-a3b"], **SMALL, **BPE,
        extra={"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
               "qwen3moe.expert_feed_forward_length": 256}), "Q8_0"),
    "gemma": (dataclasses.replace(GEOMETRIES["gemma-2b"], **{**SMALL, "n_kv_heads": 1}),
              "Q4_0"),
    # soft-caps low enough to bite on these activations
    "gemma2": (dataclasses.replace(GEOMETRIES["gemma2-9b"], **SMALL, sliding_window=8,
                                   extra={"gemma2.attn_logit_softcapping": 3.0,
                                          "gemma2.final_logit_softcapping": 4.0}), "Q4_K_M"),
    "gemma3": (dataclasses.replace(GEOMETRIES["gemma3-270m"], **{**SMALL, "n_layers": 6},
                                   sliding_window=8), "Q4_K_M"),
    # LongRoPE: a context of 64 > 32 selects the long factors (llama.cpp and localllm)
    "phi3": (dataclasses.replace(GEOMETRIES["phi3-mini"], **{**SMALL, "n_kv_heads": 4},
                                 optional=("rope_factors_long.weight",
                                           "rope_factors_short.weight"),
                                 extra={"phi3.rope.scaling.attn_factor": 1.19,
                                        "phi3.rope.scaling.original_context_length": 32}),
             "Q5_K_M"),
    "olmo2": (dataclasses.replace(GEOMETRIES["olmo2-7b"], **{**SMALL, "n_kv_heads": 4}),
              "Q4_K_M"),
    # RoPE scaling: YaRN (Qwen 2.5/3 long-context files; an original context of 32 puts the
    # ramp between extrapolated and interpolated frequencies inside the head) and linear
    # (Gemma 3 4B+: global layers only)
    "qwen2-yarn": (dataclasses.replace(
        GEOMETRIES["qwen2.5-7b"], **SMALL, **BPE, rope_base=10000.0,
        extra={"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
               "qwen2.rope.scaling.original_context_length": 32}), "Q8_0"),
    "gemma3-linear": (dataclasses.replace(
        GEOMETRIES["gemma3-270m"], **{**SMALL, "n_layers": 6}, sliding_window=8,
        extra={"gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}),
        "Q4_K_M"),
    "granite": (dataclasses.replace(
        GEOMETRIES["granite3-8b"], **SMALL, extra={
            "granite.embedding_scale": 12.0, "granite.residual_scale": 0.22,
            "granite.attention.scale": 0.1, "granite.logit_scale": 2.0}), "Q4_K_M"),
    # gpt-oss: MXFP4 experts with biases (the release format: every other matrix Q8_0),
    # attention sinks, a window of 4 on the even layers (the prompts pass it), YaRN over an
    # original context of 16 (the longer prompts pass it), its own RoPE base on the sliding
    # layers
    "gpt-oss": (dataclasses.replace(
        GEOMETRIES["gpt-oss-20b"], **SMALL, **HARMONY, sliding_window=4, rope_base=10000.0,
        extra={"gpt-oss.expert_count": 4, "gpt-oss.expert_used_count": 2,
               "gpt-oss.expert_feed_forward_length": 256, "gpt-oss.rope.freq_base_swa": 1000.0,
               "gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": 4.0,
               "gpt-oss.rope.scaling.original_context_length": 16}), "MXFP4_MOE"),
}

# Prompt lengths of the families whose fixtures need others than record.py's defaults
# (gpt-oss: past its original context of 16, so that YaRN's interpolation counts).
PROMPT_LENGTHS: dict[str, tuple[int, ...]] = {"gpt-oss": (5, 12, 20, 27)}


# Gemma 2/3 scale the (tied) embedding by sqrt(d_model) and post-norm each sublayer: with
# WEIGHT_STD the input token's own logit would dominate every distribution.
STD = {"gemma2": 0.05, "gemma3": 0.05, "gemma3-linear": 0.05}


def write_family(family: str, directory: str | Path) -> Path:
    """Write the small model of ``family`` into ``directory`` (``<family>.gguf``)."""
    g, quant = FAMILIES[family]
    g = dataclasses.replace(g, name=f"tiny-{family}")
    return write_synthetic(Path(directory) / f"{family}.gguf", g, quant, seed=SEED,
                           weight_std=STD.get(family, WEIGHT_STD))


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
