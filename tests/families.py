"""Small random-weights models of every family, for the llama.cpp comparison fixtures.

Each entry is a real geometry of :data:`localllm.models.geometries.GEOMETRIES` shrunk to a few
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

from localllm.models.geometries import GEOMETRIES, mla_keys
from localllm.models.synthetic import write_synthetic

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

# Apertus' xIELU parameters of two layers (before softplus)
_XIELU_2 = {"xielu.alpha_n": [0.4, 0.9], "xielu.alpha_p": [0.6, 0.2], "xielu.beta": [0.5, 0.5],
            "xielu.eps": [-1e-6, -1e-6]}


def _mla_small(**kw) -> dict:
    """deepseek2 keys of the small MLA models: a latent of 128 + 32 RoPE dims, heads of
    64 + 32 (keys) and 64 (values), one dense layer, 8 experts (2 used) of 256."""
    return mla_keys("deepseek2", **{"kv_lora_rank": 128, "rope": 32, "key_mla": 96,
                                "value_mla": 64, "experts": 8, "used": 2, "shared": 1,
                                "expert_ffn": 256, "dense_lead": 1,
                                "yarn": (4.0, 8, 0.707), **kw})


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
    # ---- gated delta-net hybrids (issue #27): three delta-nets to one gated attention ----
    # (value heads twice the key heads: Qwen3.5 tiles the key heads, Qwen3-Next repeats
    # each in place; partial RoPE on a quarter of the head)
    "qwen35": (dataclasses.replace(
        GEOMETRIES["qwen35-0.8b"], **{**SMALL, "n_layers": 4}, **BPE, pre="qwen35",
        tied_output=False, extra={
            "qwen35.ssm.conv_kernel": 4, "qwen35.ssm.inner_size": 256,
            "qwen35.ssm.state_size": 64, "qwen35.ssm.time_step_rank": 4,
            "qwen35.ssm.group_count": 2, "qwen35.full_attention_interval": 4,
            "qwen35.rope.dimension_count": 16, "qwen35.rope.dimension_sections": [3, 3, 2, 0]}),
        "Q4_K_M"),
    # interleaved M-RoPE sections that leave a pair to the fourth section (not turned)
    "qwen35moe": (dataclasses.replace(
        GEOMETRIES["qwen35moe-35b-a3b"], **{**SMALL, "n_layers": 4}, **BPE, pre="qwen35",
        extra={"qwen35moe.expert_count": 4, "qwen35moe.expert_used_count": 2,
               "qwen35moe.expert_feed_forward_length": 256,
               "qwen35moe.expert_shared_feed_forward_length": 256,
               "qwen35moe.ssm.conv_kernel": 4, "qwen35moe.ssm.inner_size": 256,
               "qwen35moe.ssm.state_size": 64, "qwen35moe.ssm.time_step_rank": 4,
               "qwen35moe.ssm.group_count": 2, "qwen35moe.full_attention_interval": 4,
               "qwen35moe.rope.dimension_count": 16,
               "qwen35moe.rope.dimension_sections": [3, 3, 1, 1]}), "Q8_0"),
    # layer kinds from attention.recurrent_layers (one boolean per block)
    "qwen3next": (dataclasses.replace(
        GEOMETRIES["qwen3next-80b-a3b"], **{**SMALL, "n_layers": 4}, **BPE,
        extra={"qwen3next.expert_count": 4, "qwen3next.expert_used_count": 2,
               "qwen3next.expert_feed_forward_length": 256,
               "qwen3next.expert_shared_feed_forward_length": 256,
               "qwen3next.ssm.conv_kernel": 4, "qwen3next.ssm.inner_size": 256,
               "qwen3next.ssm.state_size": 64, "qwen3next.ssm.time_step_rank": 4,
               "qwen3next.ssm.group_count": 2,
               "qwen3next.attention.recurrent_layers": [True, True, False, True],
               "qwen3next.rope.dimension_count": 16}), "Q8_0"),
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
    # GLM-4.5: a leading dense layer then two routed ones (sigmoid scores, a selection bias,
    # normalised and scaled weights, a shared expert), Q/K/V biases, QK-norm (the 355B's),
    # RoPE on half of each head
    "glm4moe": (dataclasses.replace(
        GEOMETRIES["glm4moe-1b"], **{**SMALL, "n_layers": 3}, **BPE,
        optional=("attn_q_norm.weight", "attn_k_norm.weight"),
        extra={**{k: v for k, v in GEOMETRIES["glm4moe-1b"].extra.items()},
               "glm4moe.expert_count": 4, "glm4moe.expert_used_count": 2,
               "glm4moe.expert_feed_forward_length": 128, "glm4moe.expert_weights_scale": 2.5,
               "glm4moe.rope.dimension_count": 32}), "Q8_0"),
    "olmoe": (dataclasses.replace(
        GEOMETRIES["olmoe-1b-7b"], **{**SMALL, "n_kv_heads": 4, "ffn_dim": 256}, **BPE,
        extra={"olmoe.expert_count": 4, "olmoe.expert_used_count": 2}), "Q8_0"),
    # a leading dense layer, then softmax routing with a selection bias, renormalised, and a
    # shared FFN; the unused attn_output.bias present
    "ernie4_5-moe": (dataclasses.replace(
        GEOMETRIES["ernie4.5-21b-a3b"], **{**SMALL, "n_layers": 3},
        optional=("exp_probs_b.bias", "attn_output.bias"),
        extra={**GEOMETRIES["ernie4.5-21b-a3b"].extra, "ernie4_5-moe.expert_count": 4,
               "ernie4_5-moe.expert_used_count": 2,
               "ernie4_5-moe.expert_feed_forward_length": 128,
               "ernie4_5-moe.expert_shared_feed_forward_length": 256}), "Q8_0"),
    # biased RMSNorms, an output bias, LongRoPE factors (the long ones past 16 tokens:
    # the 20-token context of the longer prompts)
    "phimoe": (dataclasses.replace(
        GEOMETRIES["phi3.5-moe"], **{**SMALL, "ffn_dim": 256},
        extra={"phimoe.expert_count": 4, "phimoe.expert_used_count": 2,
               "phimoe.rope.scaling.original_context_length": 16,
               "phimoe.rope.scaling.attn_factor": 1.19}), "Q8_0"),
    # Llama 4: layers 0-2 chunked with RoPE and the L2 QK-norm, layer 3 global NoPE;
    # layers 1 and 3 MoE (top-1 of 4 experts, sigmoid weight on the input, shared expert),
    # 0 and 2 dense
    "llama4": (dataclasses.replace(
        GEOMETRIES["llama4-scout"], **{**SMALL, "n_layers": 4}, **BPE, pre="llama4", extra={
            "llama4.expert_count": 4, "llama4.expert_used_count": 1,
            "llama4.expert_feed_forward_length": 256,
            "llama4.interleave_moe_layer_step": 2}), "Q8_0"),
    # Llama-4-Maverick's 128 experts: llama.cpp drops the L2 QK-norm for that count
    "llama4-128e": (dataclasses.replace(
        GEOMETRIES["llama4-maverick"], **{**SMALL, "n_layers": 4}, **BPE, pre="llama4", extra={
            "llama4.expert_count": 128, "llama4.expert_used_count": 1,
            "llama4.expert_feed_forward_length": 64,
            "llama4.interleave_moe_layer_step": 2}), "Q8_0"),
    # Llama 4 past its first attention chunk (llama.cpp's chunk of 8192 positions): a prompt
    # of LONG_PROMPTS tokens, whose last positions attend within the second chunk in the
    # chunked layers and carry an attention temperature above 1 in the NoPE layer; narrow
    # and dense (interleave_moe_layer_step 0), so that the long prompts stay cheap
    "llama4-chunked": (dataclasses.replace(
        GEOMETRIES["llama4-scout"], **{**SMALL, "n_layers": 4, "d_model": 128, "n_heads": 2,
                                      "n_kv_heads": 1, "ffn_dim": 256,
                                      "context_length": 16384}, **BPE, pre="llama4", extra={
            "llama4.expert_count": 4, "llama4.expert_used_count": 1,
            "llama4.expert_feed_forward_length": 256,
            "llama4.interleave_moe_layer_step": 0}), "Q8_0"),
    # Gemma 4: layers 0, 2, 4 sliding (head 32, 24 dims rotated, base 500, window 8), 1, 3, 5
    # global (head 64, rope_freqs); 4 and 5 share the KV of 2 and 3 with a wider FFN;
    # layers 0-2 with attn_v, 3 with values from attn_k; per-layer embeddings of 32;
    # output scales; soft-capped logits
    "gemma4": (dataclasses.replace(
        GEOMETRIES["gemma4-e2b"], **{**SMALL, "n_layers": 6}, sliding_window=8,
        optional=("blk.0.attn_v.weight", "blk.1.attn_v.weight", "blk.2.attn_v.weight",
                  "layer_output_scale.weight"), extra={
            "gemma4.attention.sliding_window_pattern": [True, False] * 3,
            "gemma4.attention.key_length_swa": 32, "gemma4.attention.value_length_swa": 32,
            "gemma4.rope.dimension_count": 64, "gemma4.rope.dimension_count_swa": 24,
            "gemma4.rope.freq_base_swa": 500.0, "gemma4.attention.shared_kv_layers": 2,
            "gemma4.embedding_length_per_layer_input": 32,
            "gemma4.final_logit_softcapping": 30.0,
            "gemma4.feed_forward_length": [512] * 4 + [1024] * 2}), "Q8_0"),
    # Gemma 4's mixture of experts (26B-A4B): every layer 8 experts (2 used, GEGLU of 128)
    # beside the dense FFN as a shared expert, the router on its own norm of the stream;
    # layer 0's gate and up fused (ffn_gate_up_exps), the others' separate; per-expert
    # output scales; layers 0, 2 sliding with attn_v, 1, 3 global with values from attn_k
    "gemma4-moe": (dataclasses.replace(
        GEOMETRIES["gemma4-26b-a4b"], **{**SMALL, "n_layers": 4}, sliding_window=8,
        optional=("blk.0.ffn_gate_up_exps.weight", "ffn_down_exps.scale",
                  "blk.0.attn_v.weight", "blk.2.attn_v.weight", "layer_output_scale.weight"),
        extra={
            "gemma4.attention.sliding_window_pattern": [True, False] * 2,
            "gemma4.attention.key_length_swa": 32, "gemma4.attention.value_length_swa": 32,
            "gemma4.rope.dimension_count": 64, "gemma4.rope.dimension_count_swa": 32,
            "gemma4.rope.freq_base_swa": 10000.0, "gemma4.attention.shared_kv_layers": 0,
            "gemma4.embedding_length_per_layer_input": 0,
            "gemma4.final_logit_softcapping": 30.0, "gemma4.feed_forward_length": 512,
            "gemma4.expert_count": 8, "gemma4.expert_used_count": 2,
            "gemma4.expert_feed_forward_length": 128}), "Q8_0"),
    # ---- issue 28: multi-head latent attention (deepseek2) ----
    # DeepSeek-V3's layout: compressed queries, a latent of 128 + 32 RoPE dims, one dense
    # layer, then 16 experts in 4 groups (2 kept) with sigmoid gating, the selection bias,
    # renormalised weights x2.5 and a shared expert; YaRN x4 over an original context of 4
    # tokens (the prompts of 5 to 8 run past it) with DeepSeek's log multiplier
    "deepseek2": (dataclasses.replace(
        GEOMETRIES["deepseek-v3-1b"], **{**SMALL, "n_layers": 2, "n_kv_heads": 1,
                                         "head_dim": 96}, **BPE,
        extra=_mla_small(q_lora_rank=128, experts=16, groups=(4, 2), sigmoid=True,
                         scale=2.5, yarn=(4.0, 4, 0.707))), "Q8_0"),
    # DeepSeek-V2-Lite's: queries without compression (q_lora_rank 0 written, as llama.cpp
    # requires the key below 26 layers), softmax over 8 experts, 2 shared, no YaRN; Mistral
    # Large 3's attention temperature (scale 0.5, floor length 2: it grows along the prompt)
    "deepseek2-lite": (dataclasses.replace(
        GEOMETRIES["deepseek-v2-lite"], **{**SMALL, "n_layers": 3, "n_kv_heads": 1,
                                           "head_dim": 96}, **BPE, optional=(),
        extra={**_mla_small(shared=2, yarn=None), "deepseek2.attention.q_lora_rank": 0,
               "deepseek2.attention.temperature_scale": 0.5,
               "deepseek2.attention.temperature_length": 2}),
        "Q8_0"),
    # a file converted before llama.cpp split attn_kv_b (early-2025 DeepSeek-R1 GGUFs): the
    # per-head sizes in key_length / value_length, as many KV heads as heads
    "deepseek2-kvb": (dataclasses.replace(
        GEOMETRIES["deepseek-v2-lite"], **{**SMALL, "n_layers": 3, "n_kv_heads": 4,
                                           "head_dim": 96}, **BPE, optional=(),
        extra={**_mla_small(shared=2, yarn=None, kv_b=True),
               "deepseek2.attention.q_lora_rank": 0}), "Q8_0"),
}

# Families with one more prompt of this many tokens (record.py), past a length where their
# attention changes.
LONG_PROMPTS = {"llama4-chunked": 8200}

# The families whose layers fold positions into a fixed-size state: their fixtures add a
# long prompt (recurrent prefill in chunks, with context checkpoints), one-token steps
# after it, and a perplexity (record.py).
RECURRENT = ("mamba2", "granitehybrid", "granitehybrid-moe", "falcon-h1", "nemotron_h", "lfm2",
             "qwen35", "qwen35moe", "qwen3next")

# Prompt lengths of the families whose fixtures need others than record.py's defaults
# (gpt-oss: past its original context of 16, so that YaRN's interpolation counts).
PROMPT_LENGTHS: dict[str, tuple[int, ...]] = {"gpt-oss": (5, 12, 20, 27)}


# Gemma 2/3 scale the (tied) embedding by sqrt(d_model) and post-norm each sublayer: with
# WEIGHT_STD the input token's own logit would dominate every distribution.
STD = {"gemma2": 0.05, "gemma3": 0.05, "gemma4": 0.08, "gemma4-moe": 0.08, "gemma3-linear": 0.05, "gemma3-swa": 0.05,
       "smollm3": 0.1, "ernie4_5": 0.1,
       # gpt-oss: no QK-norm and large attention scores (YaRN's magnitude squared): at 0.15
       # llama.cpp's 8-bit activations alone move its logits by KL ~0.005 with spikes where
       # an attention or routing argmax flips (with F16 weights both agree to 1e-5); glm4moe
       # likewise (a flipped sigmoid routing at 0.15); olmoe (the native int8 experts flip a
       # routing at 0.15, and at 0.1 no 6-token prompt is decisive); ernie4_5-moe (KL 0.003
       # at 0.15, 0.001 at 0.12)
       "gpt-oss": 0.1, "glm4moe": 0.1, "olmoe": 0.12, "ernie4_5-moe": 0.12,
       # the recurrent families' outputs pass through more norms and gates: a larger spread
       # keeps their next-token distributions as peaked as the others'
       "mamba2": 0.25, "granitehybrid": 0.3, "granitehybrid-moe": 0.3, "falcon-h1": 0.25,
       "lfm2": 0.25, "qwen35": 0.2, "qwen35moe": 0.2, "qwen3next": 0.25}


# Mamba2's input projection smaller than the other matrices: its time steps (dt) stay small,
# as a trained model's do, and the states it accumulates stay in range without a norm.
STEM_STD = {"ssm_in": 0.05}
# A router with a smaller spread: its probabilities spread over the experts, so that the
# k-th and the next are seldom at a near-tie (fewer prompts lost to them).
ROUTER_STD = {"ffn_gate_inp": 0.05}
SPREAD_ROUTER = ("granitehybrid-moe", "qwen35moe", "qwen3next")
# deepseek2's router too: its selection then leans on the (exact) bias exp_probs_b as much as
# on the router's probabilities, which llama.cpp's 8-bit activations move by ~4% of the
# router logits after two layers (random weights: the rounding of each product compounds)
MLA = ("deepseek2", "deepseek2-lite", "deepseek2-kvb")
# Gemma 4's router reads a vector of norm ~1 (the stream RMS-normed, over sqrt(d_model)): a
# router of this spread gives logits of spread ~1, the probabilities well apart
GEMMA4_ROUTER_STD = {"ffn_gate_inp": 1.0}


def write_family(family: str, directory: str | Path) -> Path:
    """Write the small model of ``family`` into ``directory`` (``<family>.gguf``)."""
    g, quant = FAMILIES[family]
    g = dataclasses.replace(g, name=f"tiny-{family}")
    return write_synthetic(Path(directory) / f"{family}.gguf", g, quant, seed=SEED,
                           weight_std=STD.get(family, WEIGHT_STD),
                           stem_std=GEMMA4_ROUTER_STD if family == "gemma4-moe"
                           else {**STEM_STD, **ROUTER_STD} if family in SPREAD_ROUTER
                           else ROUTER_STD if family in MLA
                           else STEM_STD if family in RECURRENT else None)


def sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()
