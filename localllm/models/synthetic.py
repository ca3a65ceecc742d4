"""Random-weights GGUF files of real model geometries, for benchmarks (``bench --synthetic``).

A synthetic file has the hyperparameters, tensor names and shapes of a real model
(Llama-3-8B, Qwen2-7B, Gemma-3-270M), a vocabulary of the real size, and llama.cpp's
per-tensor type mix for a quantization recipe (:func:`localllm.quantize.recipe.plan`), so
that both our runtime and llama.cpp load it and read exactly as many bytes per token as
they would for the real model. Speed can then be measured without downloading weights.

Quantized tensors are random bytes whose fp16 block scales are set so that the dequantized
weights have a realistic spread (standard deviation ``WEIGHT_STD``, mean near zero): the
bytes are generated directly, which takes seconds for an 8B model, instead of quantizing
random floats. The block layouts are ggml's (``ggml-common.h``: ``block_q4_K`` ...).
"""

from __future__ import annotations

import itertools
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFWriter

from ..atomic import atomic_output
from ..errors import LocalLLMError, ParameterError
from ..gguf.quants import BLOCK_FORMATS
from ..tokenizer import BYTE, CONTROL, NORMAL, UNKNOWN, UNUSED  # GGUF token types

Q = GGMLQuantizationType

WEIGHT_STD = 0.02  # standard deviation of dequantized matrix weights (typical of trained LLMs)



@dataclass(frozen=True)
class Geometry:
    """Hyperparameters and vocabulary of a model family, as its GGUF metadata states them."""

    name: str
    arch: str  # general.architecture: "llama", "qwen2" or "gemma3"
    n_vocab: int
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    context_length: int
    rope_base: float
    norm_eps: float
    vocab: str  # tokenizer.ggml.model: "llama" (SentencePiece) or "gpt2" (byte-level BPE)
    pre: str  # tokenizer.ggml.pre
    specials: tuple[str, ...] = ()  # CONTROL tokens (see _spm_vocab / _bpe_vocab for placement)
    qkv_bias: bool = False
    tied_output: bool = False
    sliding_window: int | None = None
    n_pad_tokens: int = 0  # [PAD] tokens after the specials (rows of the embedding past the vocab)
    extra: dict = field(default_factory=dict)  # other ``{arch}.*`` keys
    optional: tuple[str, ...] = ()  # optional tensors to write (``rope_freqs.weight`` ...)


@dataclass(frozen=True)
class _Like:
    """A geometry of the table written as another's (``base``, an entry written out in
    full) with ``changes``: the 0.5-1B geometries keep their model's vocabulary and keys."""

    base: str
    changes: dict


def _like(base: str, **changes) -> _Like:
    return _Like(base, changes)


_LLAMA3_SPECIALS = tuple(
    {0: "<|begin_of_text|>", 1: "<|end_of_text|>", 6: "<|start_header_id|>",
     7: "<|end_header_id|>", 9: "<|eot_id|>"}.get(i, f"<|reserved_special_token_{i}|>")
    for i in range(256)
)

# o200k_harmony's special tokens (ids 199998 .. 201087 of the released vocabulary): the
# harmony chat format's markers among reserved ones.
_HARMONY_SPECIALS = tuple(
    {0: "<|startoftext|>", 1: "<|endoftext|>", 4: "<|return|>", 5: "<|constrain|>",
     7: "<|channel|>", 8: "<|start|>", 9: "<|end|>", 10: "<|message|>", 14: "<|call|>",
     20: "<|endofprompt|>"}.get(i, f"<|reserved_{199998 + i}|>")
    for i in range(1090)
)


def _gpt_oss_keys(n_expert: int, n_used: int, expert_ffn: int) -> dict:
    """gpt-oss's expert and RoPE keys (YaRN x32 over an original context of 4096)."""
    return {"gpt-oss.expert_count": n_expert, "gpt-oss.expert_used_count": n_used,
            "gpt-oss.expert_feed_forward_length": expert_ffn,
            "gpt-oss.rope.scaling.type": "yarn", "gpt-oss.rope.scaling.factor": 32.0,
            "gpt-oss.rope.scaling.original_context_length": 4096}


_LLAMA4_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|header_start|>",
                    "<|header_end|>", "<|eot|>")
_MISTRAL_SPECIALS = ("<unk>", "<s>", "</s>", "[INST]", "[/INST]")
_HUNYUAN_SPECIALS = ("<|bos|>", "<|eos|>", "<|pad|>", "<|extra_0|>")
# Ministral 3's RoPE and attention temperature (the keys llama.cpp's converter writes)
_MINISTRAL3_ROPE = {
    "mistral3.rope.scaling.type": "yarn", "mistral3.rope.scaling.factor": 16.0,
    "mistral3.rope.scaling.original_context_length": 16384,
    "mistral3.rope.scaling.yarn_beta_fast": 32.0, "mistral3.rope.scaling.yarn_beta_slow": 1.0,
    "mistral3.rope.scaling.yarn_log_multiplier": 1.0,
    "mistral3.attention.temperature_scale": 0.1}


_DEEPSEEK_SPECIALS = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")


def mla_keys(arch: str, *, kv_lora_rank: int, rope: int, key_mla: int, value_mla: int,
         experts: int, used: int, shared: int, expert_ffn: int, dense_lead: int,
         q_lora_rank: int = 0, groups: tuple[int, int] = (1, 1), sigmoid: bool = False,
         scale: float = 1.0, yarn: tuple[float, int, float] | None = None,
         kv_b: bool = False) -> dict:
    """The ``deepseek2`` keys llama.cpp's converter writes (``conversion/deepseek.py``): the
    latent's sizes (``attention.key_length`` = kv_lora_rank + RoPE dims, ``value_length`` =
    kv_lora_rank, the per-head sizes in the ``_mla`` keys), experts, groups, gating and YaRN
    (factor, original context, mscale_all_dim, stored x 0.1). ``kv_b``: the keys of files
    converted before the ``attn_kv_b`` split (the per-head sizes in ``key_length`` /
    ``value_length``, no ``_mla`` keys)."""
    a = arch + "."
    md = {a + "attention.kv_lora_rank": kv_lora_rank, a + "rope.dimension_count": rope}
    if kv_b:
        md.update({a + "attention.key_length": key_mla, a + "attention.value_length": value_mla})
    else:
        md.update({a + "attention.key_length": kv_lora_rank + rope,
                   a + "attention.value_length": kv_lora_rank,
                   a + "attention.key_length_mla": key_mla,
                   a + "attention.value_length_mla": value_mla})
    md |= {a + "leading_dense_block_count": dense_lead, a + "expert_count": experts,
          a + "expert_used_count": used, a + "expert_shared_count": shared,
          a + "expert_feed_forward_length": expert_ffn, a + "expert_weights_scale": scale,
          a + "expert_gating_func": 2 if sigmoid else 1}
    if q_lora_rank:
        md[a + "attention.q_lora_rank"] = q_lora_rank
    if sigmoid:
        md[a + "expert_weights_norm"] = True
    if groups[0] > 1:
        md[a + "expert_group_count"], md[a + "expert_group_used_count"] = groups
    if yarn is not None:
        md.update({a + "rope.scaling.type": "yarn", a + "rope.scaling.factor": yarn[0],
                   a + "rope.scaling.original_context_length": yarn[1],
                   a + "rope.scaling.yarn_log_multiplier": 0.1 * yarn[2]})
    return md


def _xielu(n_layers: int) -> dict:
    """Apertus' xIELU parameters, one per layer, as the checkpoint stores them (before
    softplus): near its initial values alpha_p = alpha_n = 0.8, beta = 0.5, eps = -1e-6,
    varied per layer."""
    ramp = [i / max(1, n_layers - 1) for i in range(n_layers)]
    return {"xielu.alpha_n": [0.4 + 0.5 * r for r in ramp],
            "xielu.alpha_p": [0.6 - 0.4 * r for r in ramp],
            "xielu.beta": [0.5] * n_layers, "xielu.eps": [-1e-6] * n_layers}


def _glm4moe_keys(n_expert: int, n_used: int, expert_ffn: int, scale: float, *,
                  nextn: int = 0) -> dict:
    """GLM-4.5's MoE and RoPE keys: one leading dense layer, one shared expert, sigmoid
    scores normalised and scaled, half of each head rotated (64 of 128 in the releases)."""
    keys = {"glm4moe.expert_count": n_expert, "glm4moe.expert_used_count": n_used,
            "glm4moe.expert_feed_forward_length": expert_ffn,
            "glm4moe.expert_shared_count": 1, "glm4moe.leading_dense_block_count": 1,
            "glm4moe.expert_gating_func": 2, "glm4moe.expert_weights_norm": True,
            "glm4moe.expert_weights_scale": scale, "glm4moe.rope.dimension_count": 64}
    if nextn:
        keys["glm4moe.nextn_predict_layers"] = nextn
    return keys
_GEMMA_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>")


def _deltanet_moe_keys(arch: str, n_expert: int, n_used: int, expert_ffn: int, inner: int,
                       dt_rank: int, groups: int, *, sections: tuple[int, ...] = ()) -> dict:
    """``{arch}.*`` keys of a Qwen3.5-MoE / Qwen3-Next geometry: experts and a shared one
    as wide, gated delta-nets (kernel 4, state 128, ``inner`` wide, ``dt_rank`` value heads
    in ``groups`` key heads), one attention layer in four, RoPE on 64 dimensions
    (``sections``: Qwen3.5's M-RoPE sections)."""
    keys = {"expert_count": n_expert, "expert_used_count": n_used,
            "expert_feed_forward_length": expert_ffn,
            "expert_shared_feed_forward_length": expert_ffn, "ssm.conv_kernel": 4,
            "ssm.inner_size": inner, "ssm.state_size": 128, "ssm.time_step_rank": dt_rank,
            "ssm.group_count": groups, "full_attention_interval": 4,
            "rope.dimension_count": 64}
    if sections:
        keys["rope.dimension_sections"] = list(sections)
    return {f"{arch}.{k}": v for k, v in keys.items()}


def _gemma4(n_layers: int, shared: int, per_layer: int, period: int, ffn: int) -> dict:
    """Gemma 4's keys: every ``period``-th layer global (head 512), the others sliding
    (head 256, RoPE base 10,000), the last ``shared`` layers sharing KV with an FFN twice
    as wide, ``per_layer`` embedding values per layer, logits soft-capped at 30."""
    return {"gemma4.attention.sliding_window_pattern": [i % period != period - 1
                                                        for i in range(n_layers)],
            "gemma4.attention.key_length_swa": 256, "gemma4.attention.value_length_swa": 256,
            "gemma4.rope.dimension_count": 512, "gemma4.rope.dimension_count_swa": 256,
            "gemma4.rope.freq_base_swa": 10000.0, "gemma4.attention.shared_kv_layers": shared,
            "gemma4.embedding_length_per_layer_input": per_layer,
            "gemma4.final_logit_softcapping": 30.0,
            "gemma4.feed_forward_length": [ffn if i < n_layers - shared else 2 * ffn
                                           for i in range(n_layers)]}


_TABLE: dict[str, Geometry | _Like] = {
    # Meta-Llama-3-8B (config.json of the HF release)
    "llama3-8b": Geometry(
        "llama3-8b", "llama", 128256, 32, 4096, 32, 8, 128, 14336, 8192, 500000.0, 1e-5,
        "gpt2", "llama-bpe", specials=_LLAMA3_SPECIALS),
    # Qwen2-7B: QKV biases, untied output, 152064-row embedding (vocab padded with [PAD] tokens)
    "qwen2-7b": Geometry(
        "qwen2-7b", "qwen2", 152064, 28, 3584, 28, 4, 128, 18944, 32768, 1000000.0, 1e-6,
        "gpt2", "qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        qkv_bias=True, n_pad_tokens=418),
    # Gemma-3-270M: tied output, 5 of 6 layers sliding-window (512)
    "gemma3-270m": Geometry(
        "gemma3-270m", "gemma3", 262144, 18, 640, 4, 1, 256, 2048, 32768, 1000000.0, 1e-6,
        "llama", "default", specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                                      "<end_of_turn>"),
        tied_output=True, sliding_window=512),
    # Llama-3.2-1B: tied output, Llama 3.x RoPE scaling through the rope_freqs tensor
    "llama3.2-1b": Geometry(
        "llama3.2-1b", "llama", 128256, 16, 2048, 32, 8, 64, 8192, 131072, 500000.0, 1e-5,
        "gpt2", "llama-bpe", specials=_LLAMA3_SPECIALS, tied_output=True,
        optional=("rope_freqs.weight",)),
    # Mistral-7B-v0.3 (GGUF architecture "llama", SentencePiece vocabulary)
    "mistral-7b": Geometry(
        "mistral-7b", "llama", 32768, 32, 4096, 32, 8, 128, 14336, 32768, 1000000.0, 1e-5,
        "llama", "default", specials=("<unk>", "<s>", "</s>")),
    # Qwen2.5-7B / 0.5B: QKV biases (0.5B: tied output)
    "qwen2.5-7b": _like("qwen2-7b"),  # Qwen2-7B's geometry
    "qwen2.5-0.5b": Geometry(
        "qwen2.5-0.5b", "qwen2", 151936, 24, 896, 14, 2, 64, 4864, 32768, 1000000.0, 1e-6,
        "gpt2", "qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        qkv_bias=True, tied_output=True, n_pad_tokens=290),
    # Qwen3-8B / 0.6B: QK-norm
    "qwen3-8b": Geometry(
        "qwen3-8b", "qwen3", 151936, 36, 4096, 32, 8, 128, 12288, 40960, 1000000.0, 1e-6,
        "gpt2", "qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        n_pad_tokens=290),
    "qwen3-0.6b": Geometry(
        "qwen3-0.6b", "qwen3", 151936, 28, 1024, 16, 8, 128, 3072, 40960, 1000000.0, 1e-6,
        "gpt2", "qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        tied_output=True, n_pad_tokens=290),
    # Qwen3-30B-A3B: 128 experts, 8 used, expert FFN 768
    "qwen3-30b-a3b": Geometry(
        "qwen3-30b-a3b", "qwen3moe", 151936, 48, 2048, 32, 4, 128, 6144, 40960, 1000000.0,
        1e-6, "gpt2", "qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        n_pad_tokens=290, extra={"qwen3moe.expert_count": 128, "qwen3moe.expert_used_count": 8,
                                 "qwen3moe.expert_feed_forward_length": 768}),
    # Gemma-2B (Gemma 1): MQA, tied output
    "gemma-2b": Geometry(
        "gemma-2b", "gemma", 256000, 18, 2048, 8, 1, 256, 16384, 8192, 10000.0, 1e-6,
        "llama", "default", specials=("<pad>", "<eos>", "<bos>", "<unk>"), tied_output=True),
    # Gemma-2-9B / 2B: soft-capping, every other layer sliding (4096)
    "gemma2-9b": Geometry(
        "gemma2-9b", "gemma2", 256000, 42, 3584, 16, 8, 256, 14336, 8192, 10000.0, 1e-6,
        "llama", "default", specials=("<pad>", "<eos>", "<bos>", "<unk>"), tied_output=True,
        sliding_window=4096, extra={"gemma2.attn_logit_softcapping": 50.0,
                                    "gemma2.final_logit_softcapping": 30.0}),
    "gemma2-2b": Geometry(
        "gemma2-2b", "gemma2", 256000, 26, 2304, 8, 4, 256, 9216, 8192, 10000.0, 1e-6,
        "llama", "default", specials=("<pad>", "<eos>", "<bos>", "<unk>"), tied_output=True,
        sliding_window=4096, extra={"gemma2.attn_logit_softcapping": 50.0,
                                    "gemma2.final_logit_softcapping": 30.0}),
    # Phi-3-mini-4k: fused QKV and gate/up
    "phi3-mini": Geometry(
        "phi3-mini", "phi3", 32064, 32, 3072, 32, 32, 96, 8192, 4096, 10000.0, 1e-5,
        "llama", "default", specials=("<unk>", "<s>", "</s>", "<|endoftext|>", "<|end|>")),
    # OLMo-2-7B: post-norms, QK-norm over all heads
    "olmo2-7b": Geometry(
        "olmo2-7b", "olmo2", 100352, 32, 4096, 32, 32, 128, 11008, 4096, 500000.0, 1e-6,
        "gpt2", "llama-bpe", specials=("<|endoftext|>", "<|pad|>")),
    # Granite-3.0-8B: embedding/residual/attention/logit multipliers
    "granite3-8b": Geometry(
        "granite3-8b", "granite", 49155, 40, 4096, 32, 8, 128, 12800, 4096, 10000.0, 1e-5,
        "gpt2", "llama-bpe", specials=("<|endoftext|>", "<fim_prefix>"), tied_output=True,
        extra={"granite.embedding_scale": 12.0, "granite.residual_scale": 0.22,
               "granite.attention.scale": 0.0078125, "granite.logit_scale": 16.0}),
    # Ministral-3-8B / 3B (architecture mistral3): YaRN x16 over 16384 tokens with its log
    # multiplier, Llama 4's attention temperature (Ministral3Config's defaults)
    "ministral3-8b": Geometry(
        "ministral3-8b", "mistral3", 131072, 34, 4096, 32, 8, 128, 14336, 262144, 1000000.0,
        1e-5, "gpt2", "tekken", specials=_MISTRAL_SPECIALS, extra=_MINISTRAL3_ROPE),
    "ministral3-3b": Geometry(
        "ministral3-3b", "mistral3", 131072, 26, 3072, 32, 8, 128, 9216, 262144, 1000000.0,
        1e-5, "gpt2", "tekken", specials=_MISTRAL_SPECIALS, tied_output=True,
        extra=_MINISTRAL3_ROPE),
    # SmolLM3-3B: every 4th layer without RoPE, tied output
    "smollm3-3b": Geometry(
        "smollm3-3b", "smollm3", 128256, 36, 2048, 16, 4, 128, 11008, 65536, 5000000.0, 1e-6,
        "gpt2", "llama-bpe", specials=_LLAMA3_SPECIALS, tied_output=True),
    # Apertus-8B: xIELU FFN (per-layer parameters), QK-norm, Llama 3 RoPE factors
    "apertus-8b": Geometry(
        "apertus-8b", "apertus", 131072, 32, 4096, 32, 8, 128, 21504, 65536, 12000000.0, 1e-5,
        "gpt2", "tekken", specials=_MISTRAL_SPECIALS, optional=("rope_freqs.weight",),
        extra=_xielu(32)),
    # Seed-OSS-36B: QKV biases, head size 128 with 80 query heads
    "seed-oss-36b": Geometry(
        "seed-oss-36b", "seed_oss", 155136, 64, 5120, 80, 8, 128, 27648, 524288, 10000000.0,
        1e-6, "gpt2", "seed-coder", specials=("<seed:bos>", "<seed:eos>", "<seed:pad>"),
        qkv_bias=True),
    # EXAONE-4.0-32B: post-norms, three sliding (4096, RoPE) layers to one global (NoPE)
    "exaone4-32b": Geometry(
        "exaone4-32b", "exaone4", 102400, 64, 5120, 40, 8, 128, 27392, 131072, 1000000.0, 1e-5,
        "gpt2", "exaone4", specials=("[PAD]", "[BOS]", "[EOS]", "[UNK]"), sliding_window=4096,
        optional=("rope_freqs.weight",)),
    # EXAONE-4.0-1.2B: every layer global with RoPE, tied output
    "exaone4-1.2b": Geometry(
        "exaone4-1.2b", "exaone4", 102400, 30, 2048, 32, 8, 64, 4096, 65536, 1000000.0, 1e-5,
        "gpt2", "exaone4", specials=("[PAD]", "[BOS]", "[EOS]", "[UNK]"), tied_output=True,
        optional=("rope_freqs.weight",)),
    # Hunyuan-7B (dense): QK-norm after RoPE, NTK-scaled base (rope.scaling.alpha)
    "hunyuan-7b": Geometry(
        "hunyuan-7b", "hunyuan-dense", 128167, 32, 4096, 32, 8, 128, 14336, 262144, 10000.0,
        1e-5, "gpt2", "hunyuan-dense", specials=_HUNYUAN_SPECIALS,
        extra={"hunyuan-dense.rope.scaling.alpha": 1000.0}),
    # ERNIE-4.5-0.3B (dense): SentencePiece vocabulary, tied output
    "ernie4.5-0.3b": Geometry(
        "ernie4.5-0.3b", "ernie4_5", 103424, 18, 1024, 16, 2, 64, 3072, 131072, 500000.0,
        1e-5, "llama", "default", specials=("<unk>", "<s>", "</s>", "<pad>"), tied_output=True),
    # Llama-4-Scout-17B-16E: every layer MoE (16 experts, top-1, a shared expert), chunked
    # attention in 3 of 4 layers, Llama 3 RoPE factors (rope_freqs)
    "llama4-scout": Geometry(
        "llama4-scout", "llama4", 202048, 48, 5120, 40, 8, 128, 16384, 10485760, 500000.0,
        1e-5, "gpt2", "llama4", specials=_LLAMA4_SPECIALS, optional=("rope_freqs.weight",),
        extra={"llama4.expert_count": 16, "llama4.expert_used_count": 1,
               "llama4.expert_feed_forward_length": 8192,
               "llama4.interleave_moe_layer_step": 1}),
    # Llama-4-Maverick-17B-128E: MoE every other layer (128 experts), no QK-norm
    "llama4-maverick": _like(
        "llama4-scout", context_length=1048576,
        extra={"llama4.expert_count": 128, "llama4.expert_used_count": 1,
               "llama4.expert_feed_forward_length": 8192,
               "llama4.interleave_moe_layer_step": 2}),
    # Gemma-4-E2B: per-layer embeddings (256 per layer), the last 20 of 35 layers sharing
    # KV, four sliding layers (head 256, window 512) to one global (head 512), the shared
    # layers' FFN twice as wide, soft-capped logits
    "gemma4-e2b": Geometry(
        "gemma4-e2b", "gemma4", 262144, 35, 1536, 8, 1, 512, 6144, 131072, 1000000.0, 1e-6,
        "llama", "default", specials=_GEMMA_SPECIALS, tied_output=True, sliding_window=512,
        extra=_gemma4(35, 20, 256, 5, 6144)),
    # Gemma-4-E4B: 42 layers, the last 18 sharing KV
    "gemma4-e4b": Geometry(
        "gemma4-e4b", "gemma4", 262144, 42, 2560, 8, 2, 512, 10240, 131072, 1000000.0, 1e-6,
        "llama", "default", specials=_GEMMA_SPECIALS, tied_output=True, sliding_window=512,
        extra=_gemma4(42, 18, 256, 6, 10240)),
    # Gemma-4-31B: dense, five sliding layers (window 1024) to one global, no per-layer
    # embeddings or shared KV
    "gemma4-31b": Geometry(
        "gemma4-31b", "gemma4", 262144, 60, 5376, 32, 16, 512, 21504, 262144, 1000000.0, 1e-6,
        "llama", "default", specials=_GEMMA_SPECIALS, tied_output=True, sliding_window=1024,
        extra=_gemma4(60, 0, 0, 6, 21504)),
    # Gemma-4-26B-A4B: every layer a mixture of 128 experts (8 used, GEGLU of 704, gate and
    # up fused as the converter writes them, a per-expert output scale) beside the dense
    # GEGLU of 2112 as a shared expert; five sliding layers (window 1024) to one global.
    # The global layers' 2 KV heads are written as 8 (localllm reads one count for all).
    "gemma4-26b-a4b": Geometry(
        "gemma4-26b-a4b", "gemma4", 262144, 30, 2816, 16, 8, 512, 2112, 262144, 1000000.0,
        1e-6, "llama", "default", specials=_GEMMA_SPECIALS, tied_output=True,
        sliding_window=1024, optional=("ffn_gate_up_exps.weight", "ffn_down_exps.scale"),
        extra={**_gemma4(30, 0, 0, 6, 2112), "gemma4.expert_count": 128,
               "gemma4.expert_used_count": 8, "gemma4.expert_feed_forward_length": 704}),
    # ---- 0.5-1B geometries of every family (bench/bench_families.py) ----------------------
    # Gemma-4-E2B's layers at 9 of its 35 (the last 4 sharing KV)
    "gemma4-1b": _like("gemma4-e2b", n_layers=9, extra=_gemma4(9, 4, 256, 5, 6144)),
    # Gemma-4-26B-A4B's proportions at 1B (0.45B active): 12 layers of 1024, 64 experts of
    # 256 (4 used), the dense FFN 768
    "gemma4-moe-1b": _like("gemma4-26b-a4b", n_layers=12, d_model=1024, n_heads=8,
                           n_kv_heads=4, ffn_dim=768, extra={
                               **_gemma4(12, 0, 0, 6, 768), "gemma4.expert_count": 64,
                               "gemma4.expert_used_count": 4,
                               "gemma4.expert_feed_forward_length": 256}),
    # Llama-4-Scout's vocabulary, head size and routing at 1B active (16 experts of 1024)
    "llama4-1b": _like("llama4-scout", n_layers=8, d_model=1536, n_heads=12, n_kv_heads=4,
                       ffn_dim=4096, extra={"llama4.expert_count": 16, "llama4.expert_used_count": 1,
                              "llama4.expert_feed_forward_length": 1024,
                              "llama4.interleave_moe_layer_step": 1}),
    # Gemma-3-1B: 5 of 6 layers sliding (512), MQA, head size 256
    "gemma3-1b": Geometry(
        "gemma3-1b", "gemma3", 262144, 26, 1152, 4, 1, 256, 6912, 32768, 1000000.0, 1e-6,
        "llama", "default", specials=("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>",
                                      "<end_of_turn>"),
        tied_output=True, sliding_window=512),
    # Gemma-2-2B's layers and vocabulary, 8 of its 26 layers (Gemma 2 has no model this small)
    "gemma2-1b": _like("gemma2-2b", n_layers=8),
    # Gemma-2B (Gemma 1)'s layers and vocabulary, 6 of its 18 layers
    "gemma-1b": _like("gemma-2b", n_layers=6),
    # Mistral-7B-v0.3's vocabulary, head size and GQA ratio at 1B (GGUF architecture "llama")
    "mistral-1b": _like("mistral-7b", n_layers=16, d_model=2048, n_heads=16, n_kv_heads=4,
                        ffn_dim=7168),
    # Phi-3-mini's vocabulary, fused QKV / gate-up and MHA at 1B
    "phi3-1b": _like("phi3-mini", n_layers=16, d_model=2048, head_dim=64),
    # OLMo-2-0425-1B
    "olmo2-1b": _like("olmo2-7b", n_layers=16, d_model=2048, n_heads=16, n_kv_heads=16,
                      ffn_dim=8192),
    # Granite-3.0-2B's layers and vocabulary, 16 of its 40 layers
    "granite3-1b": _like("granite3-8b", n_layers=16, d_model=2048, head_dim=64, ffn_dim=8192,
                         extra={"granite.embedding_scale": 12.0, "granite.residual_scale": 0.22,
                                "granite.attention.scale": 0.015625, "granite.logit_scale": 8.0}),
    # Ministral-3-3B's layers and vocabulary, 8 of its 26 layers
    "ministral3-1b": _like("ministral3-3b", n_layers=8),
    # SmolLM3-3B's layers and vocabulary, 12 of its 36 layers
    "smollm3-1b": _like("smollm3-3b", n_layers=12),
    # Apertus-8B's proportions at 1B (head size, GQA ratio, xIELU FFN of 5.25x)
    "apertus-1b": _like("apertus-8b", n_layers=12, d_model=2048, n_heads=16, n_kv_heads=4,
                        ffn_dim=10752, extra=_xielu(12)),
    # Seed-OSS-36B's vocabulary, head size and GQA ratio at 1B
    "seed-oss-1b": _like("seed-oss-36b", n_layers=12, d_model=2048, n_heads=32, n_kv_heads=4,
                         head_dim=64, ffn_dim=5632),
    # Hunyuan-1.8B's layers and vocabulary, 16 of its 32 layers
    "hunyuan-1b": _like("hunyuan-7b", n_vocab=120818, n_layers=16, d_model=2048, n_heads=16,
                        n_kv_heads=4, ffn_dim=6144, tied_output=True),
    # ERNIE-4.5-0.3B's vocabulary, head size and GQA ratio at 1B
    "ernie4.5-1b": _like("ernie4.5-0.3b", n_layers=16, d_model=2048, n_heads=32, n_kv_heads=4,
                         ffn_dim=6144),
    # gpt-oss-20b: 24 layers alternating sliding-window (128) and full attention, 32 experts
    # (4 used, 2880 wide, MXFP4 in the released files) with biases, attention sinks, YaRN
    # (x32 over 4096), the o200k_harmony vocabulary (pre-tokenizer gpt-4o)
    "gpt-oss-20b": Geometry(
        "gpt-oss-20b", "gpt-oss", 201088, 24, 2880, 64, 8, 64, 2880, 131072, 150000.0, 1e-5,
        "gpt2", "gpt-4o", specials=_HARMONY_SPECIALS, qkv_bias=True, sliding_window=128,
        extra=_gpt_oss_keys(32, 4, 2880)),
    # Qwen3-30B-A3B's proportions at 1B: 64 experts, 8 used (0.3B active), expert FFN 256
    "qwen3moe-1b": Geometry(
        "qwen3moe-1b", "qwen3moe", 151936, 16, 1024, 16, 4, 128, 3072, 40960, 1000000.0,
        1e-6, "gpt2", "qwen2", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        n_pad_tokens=290, extra={"qwen3moe.expert_count": 64, "qwen3moe.expert_used_count": 8,
                                 "qwen3moe.expert_feed_forward_length": 256}),
    # ---- multi-head latent attention (issue #28): GGUF architecture deepseek2 ----------------
    # DeepSeek-V2-Lite (16B, 2.4B active): queries without compression, latent 512 + 64, 64
    # experts (6 used, softmax) and 2 shared of 1408, first layer dense, YaRN x40 (mscale 0.707)
    "deepseek-v2-lite": Geometry(
        "deepseek-v2-lite", "deepseek2", 102400, 27, 2048, 16, 1, 192, 10944, 163840, 10000.0,
        1e-6, "gpt2", "deepseek-llm", specials=_DEEPSEEK_SPECIALS,
        extra=mla_keys("deepseek2", kv_lora_rank=512, rope=64, key_mla=192, value_mla=128,
                   experts=64, used=6, shared=2, expert_ffn=1408, dense_lead=1,
                   yarn=(40.0, 4096, 0.707))),
    # DeepSeek-V3 / R1 (671B, 37B active): q_lora_rank 1536, 256 experts in 8 groups (4 used
    # per token), sigmoid gating with the selection bias, 3 dense layers (memory estimates)
    "deepseek-v3": Geometry(
        "deepseek-v3", "deepseek2", 129280, 61, 7168, 128, 1, 192, 18432, 163840, 10000.0,
        1e-6, "gpt2", "deepseek-v3", specials=_DEEPSEEK_SPECIALS,
        optional=("exp_probs_b.bias",),
        extra=mla_keys("deepseek2", q_lora_rank=1536, kv_lora_rank=512, rope=64, key_mla=192,
                   value_mla=128, experts=256, used=8, shared=1, expert_ffn=2048,
                   dense_lead=3, groups=(8, 4), sigmoid=True, scale=2.5,
                   yarn=(40.0, 4096, 1.0))),
    # DeepSeek-V3's layout at 1.4B (0.7B active with the embeddings): 12 layers of 1536,
    # q_lora_rank 512, 32 experts of 512 in 4 groups (2 used), 6 routed + 1 shared
    "deepseek-v3-1b": _like(
        "deepseek-v3", n_layers=12, d_model=1536, n_heads=16, ffn_dim=4096,
        extra=mla_keys("deepseek2", q_lora_rank=512, kv_lora_rank=512, rope=64, key_mla=192,
                       value_mla=128, experts=32, used=6, shared=1, expert_ffn=512,
                       dense_lead=1, groups=(4, 2), sigmoid=True, scale=2.5,
                       yarn=(40.0, 4096, 1.0))),
    # ---- hybrid and state-space models (issue #27) ------------------------------------------
    # Mamba2-370m (state-spaces): 48 Mamba2 layers, GPT-NeoX vocabulary padded to 16
    "mamba2-370m": Geometry(
        "mamba2-370m", "mamba2", 50288, 48, 1024, 0, 0, 0, 0, 1 << 20, 10000.0, 1e-5,
        "gpt2", "gpt-2", specials=("<|endoftext|>",), tied_output=True,
        extra={"mamba2.ssm.conv_kernel": 4, "mamba2.ssm.inner_size": 2048,
               "mamba2.ssm.state_size": 128, "mamba2.ssm.time_step_rank": 32,
               "mamba2.ssm.group_count": 1}),
    # Granite-4.0-H-1B's proportions: 40 layers, 4 of them attention (9:1), no positions,
    # Mamba2 of 48 heads x 64, SwiGLU 4096, tied output
    "granite4-1b": Geometry(
        "granite4-1b", "granitehybrid", 100352, 40, 1536, 12, 4, 128, 4096, 131072, 10000.0,
        1e-5, "gpt2", "dbrx", specials=("<|end_of_text|>", "<|start_of_role|>",
                                        "<|end_of_role|>"),
        tied_output=True, optional=("ssm_conv1d.bias",),
        extra={"granitehybrid.attention.head_count_kv": [4 if i % 10 == 9 else 0
                                                          for i in range(40)],
               "granitehybrid.ssm.conv_kernel": 4, "granitehybrid.ssm.inner_size": 3072,
               "granitehybrid.ssm.state_size": 128, "granitehybrid.ssm.time_step_rank": 48,
               "granitehybrid.ssm.group_count": 1, "granitehybrid.rope.scaling.finetuned": False,
               "granitehybrid.embedding_scale": 12.0, "granitehybrid.residual_scale": 0.246,
               "granitehybrid.attention.scale": 0.0078125, "granitehybrid.logit_scale": 6.0}),
    # LFM2-1.2B: 16 layers, attention at 2, 5, 8, 10, 12, 14, short convolutions of 3 taps
    "lfm2-1.2b": Geometry(
        "lfm2-1.2b", "lfm2", 65536, 16, 2048, 32, 8, 64, 8192, 128000, 1000000.0, 1e-5,
        "gpt2", "lfm2", specials=("<|startoftext|>", "<|im_end|>", "<|pad|>"),
        tied_output=True,
        extra={"lfm2.attention.head_count_kv": [8 if i in (2, 5, 8, 10, 12, 14) else 0
                                                 for i in range(16)],
               "lfm2.shortconv.l_cache": 3}),
    # Falcon-H1-0.5B's proportions: 36 layers, each attention (8 heads, 2 KV) beside a
    # Mamba2 (24 heads x 64)
    "falcon-h1-0.5b": Geometry(
        "falcon-h1-0.5b", "falcon-h1", 32784, 36, 1024, 8, 2, 64, 2048, 16384, 100000000000.0,
        1e-5, "gpt2", "falcon-h1", specials=("<|end_of_text|>", "<|begin_of_text|>"),
        optional=("ssm_conv1d.bias",),
        extra={"falcon-h1.ssm.conv_kernel": 4, "falcon-h1.ssm.inner_size": 1536,
               "falcon-h1.ssm.state_size": 128, "falcon-h1.ssm.time_step_rank": 24,
               "falcon-h1.ssm.group_count": 1}),
    # Nemotron-H-4B's proportions: 52 layers alternating Mamba2 (112 heads x 64, 8 groups)
    # or attention with a squared-ReLU FFN; 4 attention layers
    "nemotron-h-4b": Geometry(
        "nemotron-h-4b", "nemotron_h", 131072, 52, 3072, 32, 8, 128, 12288, 8192, 10000.0,
        1e-5, "gpt2", "llama-bpe", specials=("<s>", "</s>"), optional=("ssm_conv1d.bias",),
        extra={"nemotron_h.attention.head_count_kv": [8 if i in (14, 22, 34, 44) else 0
                                                       for i in range(52)],
               "nemotron_h.feed_forward_length": [12288 if i % 2 else 0 for i in range(52)],
               "nemotron_h.attention.layer_norm_epsilon": 1e-5,
               "nemotron_h.ssm.conv_kernel": 4, "nemotron_h.ssm.inner_size": 7168,
               "nemotron_h.ssm.state_size": 128, "nemotron_h.ssm.time_step_rank": 112,
               "nemotron_h.ssm.group_count": 8}),
    # ---- gated delta-net hybrids (issue #27) -------------------------------------------------
    # Qwen3.5-0.8B's text model: 24 layers, 3 gated delta-nets (16 heads x 128) to 1 gated
    # attention (8 heads, 2 KV, head size 256, RoPE on 64 dims in interleaved M-RoPE
    # sections), SwiGLU 3584, tied output
    "qwen35-0.8b": Geometry(
        "qwen35-0.8b", "qwen35", 248320, 24, 1024, 8, 2, 256, 3584, 262144, 10000000.0, 1e-6,
        "gpt2", "qwen35", specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        tied_output=True, n_pad_tokens=271, extra={
            "qwen35.ssm.conv_kernel": 4, "qwen35.ssm.inner_size": 2048,
            "qwen35.ssm.state_size": 128, "qwen35.ssm.time_step_rank": 16,
            "qwen35.ssm.group_count": 16, "qwen35.full_attention_interval": 4,
            "qwen35.rope.dimension_count": 64, "qwen35.rope.dimension_sections": [11, 11, 10, 0]}),
    # Qwen3.5-35B-A3B: 40 layers, 256 experts (8 used, 512 wide) and a shared expert, 32
    # value heads over 16 key heads
    "qwen35moe-35b-a3b": Geometry(
        "qwen35moe-35b-a3b", "qwen35moe", 248320, 40, 2048, 16, 2, 256, 512, 262144,
        10000000.0, 1e-6, "gpt2", "qwen35",
        specials=("<|endoftext|>", "<|im_start|>", "<|im_end|>"), n_pad_tokens=271,
        extra=_deltanet_moe_keys("qwen35moe", 256, 8, 512, 4096, 32, 16,
                                 sections=(11, 11, 10, 0))),
    # Qwen3-Next-80B-A3B: 48 layers, 512 experts (10 used, 512 wide) and a shared expert
    "qwen3next-80b-a3b": Geometry(
        "qwen3next-80b-a3b", "qwen3next", 151936, 48, 2048, 16, 2, 256, 5120, 262144,
        10000000.0, 1e-6, "gpt2", "qwen2", specials=("<|endoftext|>", "<|im_start|>",
                                                     "<|im_end|>"), n_pad_tokens=290,
        extra=_deltanet_moe_keys("qwen3next", 512, 10, 512, 4096, 32, 16)),
    # Qwen3.5-35B-A3B's proportions at 1B: 16 layers, 64 experts (8 used, 256 wide)
    "qwen35moe-1b": _like(
        "qwen35moe-35b-a3b", n_layers=16, d_model=1024, n_heads=8, ffn_dim=256,
        extra=_deltanet_moe_keys("qwen35moe", 64, 8, 256, 2048, 16, 8,
                                 sections=(11, 11, 10, 0))),
    # Qwen3-Next-80B-A3B's proportions at 1B: 16 layers, 64 experts (8 used, 256 wide)
    "qwen3next-1b": _like(
        "qwen3next-80b-a3b", n_layers=16, d_model=1024, n_heads=8, ffn_dim=256,
        extra=_deltanet_moe_keys("qwen3next", 64, 8, 256, 2048, 16, 8)),
    # GLM-4.5-Air: 46 decoder layers (the first dense) and its next-token-prediction block,
    # 128 experts (8 used, sigmoid scores with a selection bias, normalised) and a shared one,
    # Q/K/V biases, RoPE on half of each head
    "glm4.5-air": Geometry(
        "glm4.5-air", "glm4moe", 151552, 47, 4096, 96, 8, 128, 10944, 131072, 1000000.0, 1e-5,
        "gpt2", "glm4", specials=("<|endoftext|>", "[gMASK]", "<sop>", "<|user|>",
                                  "<|assistant|>", "<|observation|>"),
        qkv_bias=True, extra=_glm4moe_keys(128, 8, 1408, 1.0, nextn=1)),
    # GLM-4.5-Air's proportions at 1.4B: 12 layers (the first dense), 32 experts
    "glm4moe-1b": _like("glm4.5-air", n_layers=12, d_model=1536, n_heads=24, n_kv_heads=4,
                        head_dim=64, ffn_dim=4608, extra=_glm4moe_keys(32, 8, 512, 1.0)),
    # OLMoE-1B-7B: 16 layers, 64 experts (8 used, softmax, not renormalised) 1024 wide,
    # QK-norm over all heads
    "olmoe-1b-7b": Geometry(
        "olmoe-1b-7b", "olmoe", 50304, 16, 2048, 16, 16, 128, 1024, 4096, 10000.0, 1e-5,
        "gpt2", "olmo", specials=("<|endoftext|>", "<|padding|>"),
        extra={"olmoe.expert_count": 64, "olmoe.expert_used_count": 8}),
    # ERNIE-4.5-21B-A3B: 28 layers (the first dense), 64 experts (6 used) 1536 wide and a
    # shared FFN of two experts' width
    "ernie4.5-21b-a3b": Geometry(
        "ernie4.5-21b-a3b", "ernie4_5-moe", 103424, 28, 2560, 20, 4, 128, 12288, 131072,
        500000.0, 1e-5, "llama", "default", specials=("<unk>", "<s>", "</s>", "<pad>"),
        tied_output=True,
        extra={"ernie4_5-moe.expert_count": 64, "ernie4_5-moe.expert_used_count": 6,
               "ernie4_5-moe.expert_feed_forward_length": 1536,
               "ernie4_5-moe.expert_shared_feed_forward_length": 3072,
               "ernie4_5-moe.leading_dense_block_count": 1,
               "ernie4_5-moe.interleave_moe_layer_step": 1}),
    # Phi-3.5-MoE: 32 layers, 16 experts (2 used) 6400 wide, biased norms, LongRoPE
    "phi3.5-moe": Geometry(
        "phi3.5-moe", "phimoe", 32064, 32, 4096, 32, 8, 128, 6400, 131072, 10000.0, 1e-5,
        "llama", "default", specials=("<unk>", "<s>", "</s>", "<|endoftext|>", "<|end|>"),
        optional=("rope_factors_long.weight", "rope_factors_short.weight"),
        extra={"phimoe.expert_count": 16, "phimoe.expert_used_count": 2,
               "phimoe.rope.scaling.original_context_length": 4096,
               "phimoe.rope.scaling.attn_factor": 1.19}),
    # ---- about 1B of the families above whose released sizes are far from it (bench rows) --
    # Mamba2-1.3b (state-spaces): 48 Mamba2 layers of 2048, 64 heads x 64
    "mamba2-1.3b": _like(
        "mamba2-370m", d_model=2048,
        extra={"mamba2.ssm.conv_kernel": 4, "mamba2.ssm.inner_size": 4096,
               "mamba2.ssm.state_size": 128, "mamba2.ssm.time_step_rank": 64,
               "mamba2.ssm.group_count": 1}),
    # Nemotron-H-4B's proportions at 0.9B: 24 layers of 1536 alternating Mamba2 (48 heads x
    # 64, 8 groups) or attention with a squared-ReLU FFN of 6144; 2 attention layers
    "nemotron-h-1b": _like(
        "nemotron-h-4b", n_layers=24, d_model=1536, n_heads=12, n_kv_heads=4, ffn_dim=6144,
        extra={"nemotron_h.attention.head_count_kv": [4 if i in (6, 16) else 0
                                                       for i in range(24)],
               "nemotron_h.feed_forward_length": [6144 if i % 2 else 0 for i in range(24)],
               "nemotron_h.attention.layer_norm_epsilon": 1e-5,
               "nemotron_h.ssm.conv_kernel": 4, "nemotron_h.ssm.inner_size": 3072,
               "nemotron_h.ssm.state_size": 128, "nemotron_h.ssm.time_step_rank": 48,
               "nemotron_h.ssm.group_count": 8}),
    # OLMoE-1B-7B's proportions at 1B: 8 layers of 1024, 64 experts (8 used) 512 wide
    "olmoe-1b": _like("olmoe-1b-7b", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=8,
                      ffn_dim=512),
    # ERNIE-4.5-21B-A3B's proportions at 0.9B: 8 layers of 1024 (the first dense, 4096),
    # 64 experts (6 used) 512 wide and a shared FFN of 1024
    "ernie4.5-moe-1b": _like(
        "ernie4.5-21b-a3b", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=2, ffn_dim=4096,
        extra={"ernie4_5-moe.expert_count": 64, "ernie4_5-moe.expert_used_count": 6,
               "ernie4_5-moe.expert_feed_forward_length": 512,
               "ernie4_5-moe.expert_shared_feed_forward_length": 1024,
               "ernie4_5-moe.leading_dense_block_count": 1,
               "ernie4_5-moe.interleave_moe_layer_step": 1}),
    # Phi-3.5-MoE's proportions at 0.9B: 8 layers of 1024, 16 experts (2 used) 2048 wide
    "phimoe-1b": _like("phi3.5-moe", n_layers=8, d_model=1024, n_heads=8, n_kv_heads=2,
                       ffn_dim=2048),
    # gpt-oss-20b's layer kinds, vocabulary and expert proportions at 1.4B: 12 layers,
    # 16 experts (4 used, 768 wide; 0.55B active with the output projection)
    "gpt-oss-1b": _like("gpt-oss-20b", n_layers=12, d_model=1536, n_heads=24, ffn_dim=768,
                        extra=_gpt_oss_keys(16, 4, 768)),
}
# every geometry by name, in the table's order
GEOMETRIES: dict[str, Geometry] = {
    name: replace(_TABLE[g.base], name=name, **g.changes) if isinstance(g, _Like) else g
    for name, g in _TABLE.items()}


def geometry_args(g: Geometry):
    """The architecture's validated ``ModelArgs`` of the geometry's metadata (what a model
    loaded from its file has: memory layouts and estimates read them)."""
    from . import model_args

    return model_args(_hparams(g), g.n_vocab)


def tensor_shapes(g: Geometry) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape in torch order) of every tensor, from the architecture's declaration
    (``tensor_specs`` of the geometry's metadata): the required tensors, ``output.weight``
    unless the output is tied, and the optional ones named in ``g.optional``; a tensor
    whose alternative (``TensorSpec.unless``, e.g. Gemma 4's fused ``ffn_gate_up_exps``)
    is written is left out."""
    from . import tensor_specs

    specs = [s for s in tensor_specs(geometry_args(g))
             if not s.optional or (s.name == "output.weight" and not g.tied_output)
             or s.name in g.optional or _unlayered(s.name) in g.optional
             or (g.qkv_bias and ".bias" in s.name and "attn_output" not in s.name)]
    written = {s.name for s in specs}
    return [(s.name, s.shape) for s in specs if s.unless is None or s.unless not in written]


def _unlayered(name: str) -> str:
    """``blk.3.ssm_conv1d.bias`` -> ``ssm_conv1d.bias`` (a per-layer optional tensor in
    ``Geometry.optional`` names every layer's)."""
    return name.split(".", 2)[2] if name.startswith("blk.") else name


def _stored_f32(name: str, shape: tuple[int, ...]) -> bool:
    """Vectors, biases (gpt-oss's per-expert biases are matrices) and the state-space
    parameters (``models.base.DENSE_TENSORS``: llama.cpp's SSM kernels read them as F32) are
    written F32, as the converters write them; other matrices F16 before the recipe."""
    from .base import DENSE_TENSORS, layer_of

    return len(shape) == 1 or name.endswith(".bias") or layer_of(name)[1] in DENSE_TENSORS


def tensor_types(g: Geometry, quant: str) -> dict[str, GGMLQuantizationType]:
    """llama.cpp's type of every tensor for file type ``quant`` (e.g. ``"Q4_K_M"``)."""
    from ..quantize.recipe import parse_file_type, plan

    ftype = parse_file_type(quant)
    tensors = [(n, s, Q.F32 if _stored_f32(n, s) else Q.F16) for n, s in tensor_shapes(g)]
    return plan(tensors, _hparams(g), ftype)


# ---- vocabulary -----------------------------------------------------------------------------
def _gpt2_byte_chars() -> list[str]:
    """GPT-2's printable stand-in character of each byte value 0..255 (byte-level BPE)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def _bpe_vocab(g: Geometry) -> dict:
    """Byte-level BPE vocabulary of ``g.n_vocab`` tokens: the 256 byte characters, filler
    pieces of 2 and 3 characters (each with the merge that builds it), then the special
    tokens, then ``[PAD]`` tokens up to the embedding size (as llama.cpp's converter pads)."""
    alphabet = _gpt2_byte_chars()
    n_pad = g.n_pad_tokens
    n_normal = g.n_vocab - len(g.specials) - n_pad
    tokens, merges = list(alphabet), []

    def fillers() -> Iterator[tuple[str, str]]:
        pairs = ((a, b) for a in alphabet for b in alphabet)
        yield from pairs
        for a, b in itertools.product(alphabet, alphabet):
            for c in alphabet:
                yield a + b, c

    for left, right in itertools.islice(fillers(), max(0, n_normal - len(tokens))):
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    types = [NORMAL] * len(tokens) + [CONTROL] * len(g.specials) + [UNUSED] * n_pad
    tokens += list(g.specials) + [f"[PAD{i}]" for i in range(n_pad)]
    first_special = n_normal
    md = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": g.pre,
          "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
          "tokenizer.ggml.merges": merges}
    if "<|return|>" in g.specials:  # harmony: as the released gpt-oss files
        md.update({"tokenizer.ggml.bos_token_id": first_special + g.specials.index("<|startoftext|>"),
                   "tokenizer.ggml.eos_token_id": first_special + g.specials.index("<|return|>"),
                   "tokenizer.ggml.padding_token_id": first_special + g.specials.index("<|endoftext|>"),
                   "tokenizer.ggml.add_bos_token": False})
    elif g.arch in ("llama", "mistral", "granite", "olmo2", "phi3"):
        md.update({"tokenizer.ggml.bos_token_id": first_special,
                   "tokenizer.ggml.eos_token_id": first_special + 1,
                   "tokenizer.ggml.add_bos_token": True})
    else:
        md.update({"tokenizer.ggml.bos_token_id": first_special,
                   "tokenizer.ggml.eos_token_id": first_special,
                   "tokenizer.ggml.padding_token_id": first_special,
                   "tokenizer.ggml.add_bos_token": False})
    return md


def _spm_vocab(g: Geometry) -> dict:
    """SentencePiece vocabulary of ``g.n_vocab`` tokens: the special tokens (pad, eos, bos,
    unk, ... as Gemma numbers them), the 256 byte-fallback tokens, then filler pieces made
    of lowercase letters, with and without the ``▁`` word prefix, by decreasing score."""
    tokens = list(g.specials) + [f"<0x{b:02X}>" for b in range(256)]
    types = [CONTROL] * len(g.specials) + [BYTE] * 256
    types[g.specials.index("<unk>")] = UNKNOWN

    def fillers() -> Iterator[str]:
        for n in itertools.count(1):
            for letters in itertools.product("abcdefghijklmnopqrstuvwxyz", repeat=n):
                s = "".join(letters)
                yield "▁" + s
                yield s

    n_fill = g.n_vocab - len(tokens)
    tokens += list(itertools.islice(fillers(), n_fill))
    types += [NORMAL] * n_fill
    scores = [0.0] * (len(g.specials) + 256) + [-float(i) for i in range(n_fill)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": g.pre,
            "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": _special(g, "<bos>", "<s>"),
            "tokenizer.ggml.eos_token_id": _special(g, "<eos>", "</s>"),
            "tokenizer.ggml.unknown_token_id": g.specials.index("<unk>"),
            "tokenizer.ggml.padding_token_id": _special(g, "<pad>", "<unk>"),
            "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_space_prefix": False}


def _special(g: Geometry, *names: str) -> int:
    """Id of the first of ``names`` among the geometry's special tokens."""
    return next(g.specials.index(n) for n in names if n in g.specials)


def _hparams(g: Geometry) -> dict:
    a = g.arch + "."
    md = {"general.architecture": g.arch, a + "context_length": g.context_length,
          a + "embedding_length": g.d_model, a + "block_count": g.n_layers,
          a + "feed_forward_length": g.ffn_dim, a + "attention.head_count": g.n_heads,
          a + "attention.head_count_kv": g.n_kv_heads, a + "attention.key_length": g.head_dim,
          a + "attention.value_length": g.head_dim, a + "rope.freq_base": g.rope_base,
          a + "attention.layer_norm_rms_epsilon": g.norm_eps}
    if not g.arch.startswith("gemma"):
        md[a + "rope.dimension_count"] = g.head_dim
        md[a + "vocab_size"] = g.n_vocab
    if g.sliding_window is not None:
        md[a + "attention.sliding_window"] = g.sliding_window
    md.update(g.extra)
    return md


# ---- tensor data ----------------------------------------------------------------------------
# ggml block layouts: byte offset of the fp16 scale ``d`` and of the fp16 min/dmin (or None),
# and the min as a multiple of d that centres the block's values near zero: for the "_1"
# types the block adds ``m`` (set to -ratio*d), for the K-quants it subtracts dmin * min_j
# with 4/6-bit mins as large as the scales (so dmin = ratio*d balances sc*q on average).
_SCALE_LAYOUT: dict[GGMLQuantizationType, tuple[int, int | None, float]] = {
    Q.Q4_0: (0, None, 0.0), Q.Q5_0: (0, None, 0.0), Q.Q8_0: (0, None, 0.0),
    Q.Q4_1: (0, 2, -7.5), Q.Q5_1: (0, 2, -15.5),
    Q.Q2_K: (80, 82, 1.5), Q.Q3_K: (108, None, 0.0), Q.Q4_K: (0, 2, 7.5),
    Q.Q5_K: (0, 2, 15.5), Q.Q6_K: (208, None, 0.0), Q.IQ4_NL: (0, None, 0.0),
    Q.IQ4_XS: (0, None, 0.0),
}
_UNIT_STD: dict[GGMLQuantizationType, float] = {}


def _ssm_values(name: str, x: np.ndarray, rng: np.random.Generator) -> np.ndarray | None:
    """Values of a state-space tensor in the ranges of Mamba2's initialization (Dao & Gu
    2024), from standard normals ``x``; None for other tensors. ``ssm_a``: A = -exp(U(0,
    ln 16)) (the converter stores -exp(A_log)); ``ssm_d``: D = 1 + N(0, 0.1);
    ``ssm_dt.bias``: softplus^-1 of dt log-uniform in [0.001, 0.1]; convolution kernels
    (``ssm_conv1d``, LFM2's ``shortconv.conv``): N(0, 0.5)."""
    if name.endswith(".ssm_a"):
        return -np.exp(rng.uniform(0.0, np.log(16.0), x.size)).astype(np.float32)
    if name.endswith(".ssm_d"):
        return (1.0 + 0.1 * x).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        dt = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), x.size))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    if name.endswith(("ssm_conv1d.weight", "shortconv.conv.weight")):
        return (0.5 * x).astype(np.float32)
    return None


def _random_blocks(qtype: GGMLQuantizationType, n_blocks: int, d: float,
                   rng: np.random.Generator) -> np.ndarray:
    """``n_blocks`` random blocks of ``qtype`` with scales ``d`` x U(0.75, 1.25): uint8
    (n_blocks, block_bytes). MXFP4's scale is a power of two (an E8M0 byte, 2^(e - 128)
    per unit of its codebook): ``d`` x U(0.75, 1.25) rounded to the nearest one."""
    size = BLOCK_FORMATS[qtype].type_size
    raw = np.frombuffer(rng.bytes(n_blocks * size), dtype=np.uint8).reshape(n_blocks, size).copy()
    if qtype == Q.MXFP4:  # block_mxfp4: [e: uint8][qs: 16 bytes of nibbles]
        e = 128 + np.rint(np.log2(d * rng.uniform(0.75, 1.25, n_blocks)))
        raw[:, 0] = np.clip(e, 2, 254).astype(np.uint8)
        return raw
    d_off, m_off, ratio = _SCALE_LAYOUT[qtype]
    scales = (d * rng.uniform(0.75, 1.25, n_blocks)).astype(np.float16)
    raw[:, d_off:d_off + 2] = scales.view(np.uint8).reshape(n_blocks, 2)
    if m_off is not None:
        mins = (scales.astype(np.float32) * ratio).astype(np.float16)
        raw[:, m_off:m_off + 2] = mins.view(np.uint8).reshape(n_blocks, 2)
    return raw


def _unit_std(qtype: GGMLQuantizationType) -> float:
    """Standard deviation of the dequantized values of random blocks with scale 1 (measured
    once per type with our dequantizer, so that the layout table above is checked too)."""
    if qtype not in _UNIT_STD:
        import torch

        from ..gguf.quants import dequantize

        block = BLOCK_FORMATS[qtype].block_size
        raw = _random_blocks(qtype, 512, 1.0, np.random.default_rng(1))
        x = dequantize(raw, qtype, (512, block), dtype=torch.float32)
        _UNIT_STD[qtype] = float(x.std())
    return _UNIT_STD[qtype]


def random_tensor(name: str, shape: tuple[int, ...], qtype: GGMLQuantizationType,
                  rng: np.random.Generator, std: float = WEIGHT_STD) -> np.ndarray:
    """Random data of one tensor as the bytes GGUF stores: uint8 (n_bytes,).

    Norm weights and Gemma 4's layer output scales are 1 + N(0, 0.02) (Gemma's GGUF norms
    already include its +1), other ``.scale`` vectors (Gemma 4's router input and
    per-expert output factors) 1 + N(0, 0.2); RoPE
    frequency factors (``rope_freqs``, ``rope_factors_*``) 1 + |N(0, 2)|; state-space
    parameters as :func:`_ssm_values` makes them; biases and float matrices are
    N(0, ``std``); quantized matrices dequantize to std ~``std``.
    """
    n = int(np.prod(shape))
    if qtype in (Q.F32, Q.F16, Q.BF16):
        x = rng.standard_normal(n, dtype=np.float32)
        ssm = _ssm_values(name, x, rng)
        if ssm is not None:
            x = ssm
        elif "norm" in name or "output_scale" in name:
            x *= WEIGHT_STD
            x += 1.0
        elif name.endswith(".scale"):
            x *= 0.2
            x += 1.0
        elif name.startswith("rope_f"):
            x = 1.0 + np.abs(x) * 2.0
        else:
            x *= std
        if qtype == Q.F32:
            return x.view(np.uint8)
        if qtype == Q.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    if qtype not in _SCALE_LAYOUT and qtype != Q.MXFP4:
        raise LocalLLMError(f"synthetic weights of type {qtype.name} are not supported")
    n_blocks = n // BLOCK_FORMATS[qtype].block_size
    return _random_blocks(qtype, n_blocks, std / _unit_std(qtype), rng).reshape(-1)


# ---- files ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of a synthetic file: name, shape (GGUF order reversed: rows last), type."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape))

    @property
    def n_bytes(self) -> int:
        fmt = BLOCK_FORMATS[self.qtype]
        return self.n_elements // fmt.block_size * fmt.type_size


def planned_tensors(geometry: Geometry, quant: str) -> list[PlannedTensor]:
    """The tensors :func:`write_synthetic` writes for ``geometry`` at recipe ``quant``.

    Raises:
        ParameterError: unknown quant type.
    """
    types = tensor_types(geometry, quant.upper())
    return [PlannedTensor(name, shape, types[name]) for name, shape in tensor_shapes(geometry)]


# Header, metadata (the vocabulary) and alignment padding, over the tensor bytes; generous.
_FILE_OVERHEAD = 64 * 2**20


def check_disk(path: Path, n_bytes: int) -> None:
    """Refuse to start writing ``n_bytes`` at ``path`` when its file system has less free.

    Raises:
        LocalLLMError: one line with the bytes needed and free, and the directory.
    """
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        return  # unknown: the write itself reports a full disk
    if n_bytes > free:
        raise LocalLLMError(f"{path.name}: writing it needs {n_bytes / 2**30:.1f} GiB of disk "
                            f"but {free / 2**30:.1f} GiB is free in {path.parent}")


def cache_path(name: str, quant: str) -> Path:
    """``<user cache>/localllm/synthetic/NAME-QUANT.gguf``."""
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("localllm")) / "synthetic" / f"{name}-{quant.upper()}.gguf"


def write_synthetic(path: str | Path, geometry: Geometry, quant: str, *, seed: int = 0,
                    weight_std: float = WEIGHT_STD, stem_std: dict[str, float] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> Path:
    """Write a random-weights GGUF of ``geometry`` with the tensor types of recipe ``quant``.

    ``stem_std``: another standard deviation for the tensors of some stems (``{"ssm_in":
    0.05}``: a state-space input projection whose time steps stay small, as trained ones
    do). ``weight_std``: standard deviation of the matrices (larger: a more peaked next-token
    distribution, as the llama.cpp comparison fixtures use). The file is a deterministic
    function of the arguments.

    Tensors are generated and written one at a time (memory: about the largest tensor, not
    the file). The free disk space is checked first. The file is written to a temporary name
    beside ``path`` and renamed when complete, so an interrupted write leaves nothing
    behind. ``progress(bytes_written, total_bytes)`` is called after each tensor.
    Returns ``path``.

    Raises:
        ParameterError: unknown quant type.
        LocalLLMError: not enough disk space, or the file cannot be written.
    """
    from ..quantize.recipe import FILE_TYPES
    from .base import layer_of

    path = Path(path)
    quant = quant.upper()
    types = tensor_types(geometry, quant)
    vocab = _spm_vocab(geometry) if geometry.vocab == "llama" else _bpe_vocab(geometry)
    if len(vocab["tokenizer.ggml.tokens"]) != geometry.n_vocab:
        raise LocalLLMError(f"synthetic vocabulary of {geometry.name}: "
                            f"{len(vocab['tokenizer.ggml.tokens'])} != {geometry.n_vocab}")
    rng = np.random.default_rng(seed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise LocalLLMError(f"{path.parent}: cannot create: {e.strerror or e}") from None
    total = sum(t.n_bytes for t in planned_tensors(geometry, quant))
    check_disk(path, total + _FILE_OVERHEAD)
    with atomic_output(path) as tmp:
        w = GGUFWriter(tmp, geometry.arch)
        w.add_name(f"synthetic {geometry.name} {quant}")
        for key, value in {**_hparams(geometry), **vocab}.items():
            if key != "general.architecture":
                _add_kv(w, key, value)
        w.add_file_type(int(FILE_TYPES[quant][0]))
        w.add_quantization_version(2)
        shapes = tensor_shapes(geometry)
        for name, shape in shapes:
            qt = types[name]
            block, size = BLOCK_FORMATS[qt].block_size, BLOCK_FORMATS[qt].type_size
            row = shape[-1] // block * size
            w.add_tensor_info(name, (*shape[:-1], row), np.dtype(np.uint8),
                              row * int(np.prod(shape[:-1])), raw_dtype=qt)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        done = 0
        for name, shape in shapes:
            std = (stem_std or {}).get(layer_of(name)[1], weight_std)
            data = random_tensor(name, shape, types[name], rng, std)
            w.write_tensor_data(data)  # straight to the file: one tensor in memory at a time
            done += data.nbytes
            del data
            if progress is not None:
                progress(done, total)
        w.close()
    return path


def _add_kv(w: GGUFWriter, key: str, value) -> None:
    from gguf import GGUFValueType as V

    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, int):
        w.add_uint32(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, list):
        sub = (V.STRING if isinstance(value[0], str) else V.BOOL if isinstance(value[0], bool)
               else V.FLOAT32 if isinstance(value[0], float) else V.INT32)
        w.add_key_value(key, value, V.ARRAY, sub)
    else:
        raise TypeError(f"{key}: cannot store {type(value).__name__}")


def synthetic_model(name: str, quant: str = "Q4_K_M", *, cache_dir: str | Path | None = None,
                    before_write: Callable[[Geometry, list[PlannedTensor]], None] | None = None,
                    progress: Callable[[int, int], None] | None = None) -> Path:
    """Path of the synthetic model ``name`` (a key of :data:`GEOMETRIES`) at ``quant``,
    written on first use into the cache directory and reused afterwards.

    ``before_write(geometry, tensors)`` runs before a file is written (a memory check that
    raises to refuse); ``progress`` is :func:`write_synthetic`'s.

    Raises:
        ParameterError: unknown geometry name or quant type (naming ``--synthetic``/``--quant``).
        LocalLLMError: not enough disk space, or what ``before_write`` raises.
    """
    from ..quantize.recipe import parse_file_type

    if name not in GEOMETRIES:
        raise ParameterError(f"--synthetic {name}: unknown geometry "
                             f"(one of {', '.join(GEOMETRIES)})")
    try:
        quant = parse_file_type(quant)
    except ParameterError as e:
        raise ParameterError(str(e).replace("--type", "--quant", 1)) from None
    path = (Path(cache_dir) / f"{name}-{quant}.gguf" if cache_dir is not None
            else cache_path(name, quant))
    if not path.exists():
        if before_write is not None:
            before_write(GEOMETRIES[name], planned_tensors(GEOMETRIES[name], quant))
        write_synthetic(path, GEOMETRIES[name], quant, progress=progress)
    return path
