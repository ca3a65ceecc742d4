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

# Apertus' xIELU parameters of two layers (before softplus)
_XIELU_2 = {"xielu.alpha_n": [0.4, 0.9], "xielu.alpha_p": [0.6, 0.2], "xielu.beta": [0.5, 0.5],
            "xielu.eps": [-1e-6, -1e-6]}

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
    # ---- hybrid and state-space families (issue #27): both layer kinds in each ----------
    "mamba2": (dataclasses.replace(
        GEOMETRIES["mamba2-370m"], **{**SMALL, "n_layers": 3, "n_heads": 0, "n_kv_heads": 0,
                                      "head_dim": 0, "ffn_dim": 0}, **BPE, tied_output=False,
        extra={"mamba2.ssm.conv_kernel": 4, "mamba2.ssm.inner_size": 512,
               "mamba2.ssm.state_size": 64, "mamba2.ssm.time_step_rank": 8,
               "mamba2.ssm.group_count": 2}), "Q4_K_M"),
    "granitehybrid": (dataclasses.replace(
        GEOMETRIES["granite4-1b"], **{**SMALL, "n_layers": 4}, **BPE, extra={
            "granitehybrid.attention.head_count_kv": [0, 2, 0, 2],
            "granitehybrid.ssm.conv_kernel": 4, "granitehybrid.ssm.inner_size": 512,
            "granitehybrid.ssm.state_size": 64, "granitehybrid.ssm.time_step_rank": 8,
            "granitehybrid.ssm.group_count": 1, "granitehybrid.rope.scaling.finetuned": False,
            "granitehybrid.embedding_scale": 2.0, "granitehybrid.residual_scale": 0.5,
            "granitehybrid.attention.scale": 0.02, "granitehybrid.logit_scale": 2.0}),
        "Q8_0"),  # with K-quants llama.cpp's 8-bit activations (Q8_K) move this random
    # model's logits by ~6% (ours in float32 by ~3%): KL ~0.015, above the bound
    # Granite-4.0-H-Tiny's layout: experts (softmax top-2 of 4) and a shared expert, RoPE
    "granitehybrid-moe": (dataclasses.replace(
        GEOMETRIES["granite4-1b"], **{**SMALL, "n_layers": 3, "ffn_dim": 256}, **BPE, extra={
            "granitehybrid.attention.head_count_kv": [0, 2, 0],
            "granitehybrid.expert_count": 4, "granitehybrid.expert_used_count": 2,
            "granitehybrid.expert_shared_feed_forward_length": 512,
            "granitehybrid.ssm.conv_kernel": 4, "granitehybrid.ssm.inner_size": 512,
            "granitehybrid.ssm.state_size": 64, "granitehybrid.ssm.time_step_rank": 8,
            "granitehybrid.ssm.group_count": 1, "granitehybrid.rope.scaling.finetuned": True,
            "granitehybrid.residual_scale": 0.5, "granitehybrid.logit_scale": 2.0}),
        "Q8_0"),
    "falcon-h1": (dataclasses.replace(
        GEOMETRIES["falcon-h1-0.5b"], **SMALL, **BPE, rope_base=10000.0, extra={
            "falcon-h1.ssm.conv_kernel": 4, "falcon-h1.ssm.inner_size": 512,
            "falcon-h1.ssm.state_size": 64, "falcon-h1.ssm.time_step_rank": 8,
            "falcon-h1.ssm.group_count": 1}), "Q4_K_M"),
    "nemotron_h": (dataclasses.replace(
        GEOMETRIES["nemotron-h-4b"], **{**SMALL, "n_layers": 6}, **BPE, extra={
            "nemotron_h.attention.head_count_kv": [0, 0, 2, 0, 0, 0],
            "nemotron_h.feed_forward_length": [0, 512, 0, 512, 0, 512],
            "nemotron_h.attention.layer_norm_epsilon": 1e-5,
            "nemotron_h.ssm.conv_kernel": 4, "nemotron_h.ssm.inner_size": 512,
            "nemotron_h.ssm.state_size": 64, "nemotron_h.ssm.time_step_rank": 8,
            "nemotron_h.ssm.group_count": 4}), "Q6_K"),
    "lfm2": (dataclasses.replace(
        GEOMETRIES["lfm2-1.2b"], **{**SMALL, "n_layers": 5}, **BPE, tied_output=False, extra={
            "lfm2.attention.head_count_kv": [0, 0, 2, 0, 2], "lfm2.shortconv.l_cache": 3}),
        "Q4_K_M"),
    # ---- issue 28: the dense families of 2025 and the complete RoPE scaling ----
    # YaRN with llama.cpp's mistral3 keys (betas, log multiplier) and Llama 4's attention
    # temperature; an original context of 16 tokens: the 20- and 27-token prompts run past it
    # (the long-context case), and their last positions get a temperature above 1
    "mistral3": (dataclasses.replace(
        GEOMETRIES["ministral3-8b"], **SMALL, rope_base=10000.0, extra={
            "mistral3.rope.scaling.type": "yarn", "mistral3.rope.scaling.factor": 4.0,
            "mistral3.rope.scaling.original_context_length": 16,
            "mistral3.rope.scaling.yarn_beta_fast": 16.0,
            "mistral3.rope.scaling.yarn_beta_slow": 0.5,
            "mistral3.rope.scaling.yarn_log_multiplier": 3.0,
            "mistral3.attention.temperature_scale": 1.5}), "Q4_K_M"),
    # layer 3 of 4 without RoPE
    "smollm3": (dataclasses.replace(GEOMETRIES["smollm3-3b"], **{**SMALL, "n_layers": 4}, **BPE,
                                    pre="llama-bpe"),
                "Q8_0"),
    "apertus": (dataclasses.replace(GEOMETRIES["apertus-8b"], **SMALL, extra=_XIELU_2),
                "Q5_K_M"),
    "seed_oss": (dataclasses.replace(GEOMETRIES["seed-oss-36b"], **SMALL), "Q8_0"),
    # the 32B's 64 layers (llama.cpp slides only with that count): 48 sliding layers with
    # RoPE (window 8), 16 global NoPE layers; narrow, so that the file stays small
    "exaone4": (dataclasses.replace(
        GEOMETRIES["exaone4-32b"], **{**SMALL, "n_layers": 64, "d_model": 128,
                                      "head_dim": 32, "ffn_dim": 256}, sliding_window=8),
        "Q8_0"),
    "exaone4-global": (dataclasses.replace(GEOMETRIES["exaone4-1.2b"], **SMALL), "Q4_K_M"),
    "hunyuan-dense": (dataclasses.replace(GEOMETRIES["hunyuan-7b"], **SMALL), "Q6_K"),
    "ernie4_5": (dataclasses.replace(GEOMETRIES["ernie4.5-0.3b"], **SMALL), "Q4_K_M"),
    # partial RoPE (48 of 64 dimensions, halves order, as Phi-4-mini) with LongRoPE and an
    # attention factor: the magnitude scales the rotated dimensions only
    "phi3-partial": (dataclasses.replace(
        GEOMETRIES["phi3-mini"], **{**SMALL, "n_kv_heads": 4},
        optional=("rope_factors_long.weight", "rope_factors_short.weight"),
        extra={"phi3.rope.dimension_count": 48, "phi3.rope.scaling.attn_factor": 1.19,
               "phi3.rope.scaling.original_context_length": 32}), "Q5_K_M"),
    # Llama 3.1's RoPE factors computed from the rope.scaling.* keys (type "llama3"); llama.cpp
    # runs the file its converter would write, the factors as the rope_freqs tensor
    # (record.py); an original context of 32 tokens puts wavelengths on both sides of the
    # interpolated band
    "llama3-keys": (dataclasses.replace(
        GEOMETRIES["llama3.2-1b"], **SMALL, **BPE, pre="llama-bpe", tied_output=False,
        rope_base=10000.0, optional=(), extra={
            "llama.rope.scaling.type": "llama3", "llama.rope.scaling.factor": 8.0,
            "llama.rope.scaling.low_freq_factor": 1.0,
            "llama.rope.scaling.high_freq_factor": 4.0,
            "llama.rope.scaling.original_context_length": 32}), "Q4_K_M"),
    # the sliding layers' own RoPE base (rope.freq_base_swa) and a per-layer pattern
    "gemma3-swa": (dataclasses.replace(
        GEOMETRIES["gemma3-270m"], **{**SMALL, "n_layers": 6}, sliding_window=8, extra={
            "gemma3.rope.freq_base_swa": 500.0,
            "gemma3.attention.sliding_window_pattern": [True, False, True, True, False, True]}),
        "Q4_K_M"),
}

# The families whose layers fold positions into a fixed-size state: their fixtures add a
# long prompt (recurrent prefill in chunks, with context checkpoints), one-token steps
# after it, and a perplexity (record.py).
RECURRENT = ("mamba2", "granitehybrid", "granitehybrid-moe", "falcon-h1", "nemotron_h", "lfm2")


# Gemma 2/3 scale the (tied) embedding by sqrt(d_model) and post-norm each sublayer: with
# WEIGHT_STD the input token's own logit would dominate every distribution.
STD = {"gemma2": 0.05, "gemma3": 0.05, "gemma3-linear": 0.05, "gemma3-swa": 0.05,
       "smollm3": 0.1, "ernie4_5": 0.1,
       # the recurrent families' outputs pass through more norms and gates: a larger spread
       # keeps their next-token distributions as peaked as the others'
       "mamba2": 0.25, "granitehybrid": 0.3, "granitehybrid-moe": 0.3, "falcon-h1": 0.25,
       "lfm2": 0.25}


# Mamba2's input projection smaller than the other matrices: its time steps (dt) stay small,
# as a trained model's do, and the states it accumulates stay in range without a norm.
STEM_STD = {"ssm_in": 0.05}
# A router with a smaller spread: its probabilities spread over the experts, so that the
# k-th and the next are seldom at a near-tie (fewer prompts lost to them).
ROUTER_STD = {"ffn_gate_inp": 0.05}


def write_family(family: str, directory: str | Path) -> Path:
    """Write the small model of ``family`` into ``directory`` (``<family>.gguf``)."""
    g, quant = FAMILIES[family]
    g = dataclasses.replace(g, name=f"tiny-{family}")
    return write_synthetic(Path(directory) / f"{family}.gguf", g, quant, seed=SEED,
                           weight_std=STD.get(family, WEIGHT_STD),
                           stem_std={**STEM_STD, **ROUTER_STD} if family == "granitehybrid-moe"
                           else STEM_STD if family in RECURRENT else None)


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
