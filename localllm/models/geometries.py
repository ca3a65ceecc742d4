"""Real model geometries: the hyperparameters, vocabulary sizes and architecture keys of the
models people run (Llama-3-8B, Qwen2-7B, Gemma-3-270M, gpt-oss-20b, DeepSeek-V3 ...) and of
about 1B versions of each family's proportions, by name (:data:`GEOMETRIES`).
:mod:`localllm.models.synthetic` writes random-weights GGUF files of them (``bench
--synthetic``); ``bench/bench_families.py`` times one per family.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


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
    "qwen3moe-1b": _like(
        "qwen3-30b-a3b", n_layers=16, d_model=1024, n_heads=16, ffn_dim=3072,
        extra={"qwen3moe.expert_count": 64, "qwen3moe.expert_used_count": 8,
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
