"""The Llama family: pre-norm decoders with a SwiGLU FFN (or softmax-routed experts), one
module for the GGUF architectures that differ only in declared details (:data:`VARIANTS`):
``llama`` (Llama 2/3.x, SmolLM2, TinyLlama, Mixtral-style MoE), ``mistral``, ``mistral3``
(Ministral 3, Mistral Small 3.x), ``granite``, ``qwen2``, ``qwen3``, ``qwen3moe``,
``smollm3``, ``ernie4_5`` (dense), ``seed_oss``, ``hunyuan-dense`` (llama.cpp's
``src/models/llama.cpp``, ``mistral3.cpp``, ``granite.cpp``, ``qwen2.cpp``, ``qwen3.cpp``,
``qwen3moe.cpp``, ``smollm3.cpp``, ``ernie4-5.cpp``, ``seed-oss.cpp``, ``hunyuan-vl.cpp``).

Per layer::

    h   = x + s_r * wo(attn(attn_norm(x)))     # GQA; Q/K/V biases; QK-norm where declared
    out = h + s_r * ffn(ffn_norm(h))            # ffn: down(silu(gate(n)) * up(n)), or MoE

Variant details:

* RoPE order: adjacent pairs for ``llama``, ``mistral``, ``mistral3``, ``granite``,
  ``smollm3``, ``ernie4_5`` (the converter permutes Q/K for that), halves (NEOX) for the
  others. Scaling: any of :mod:`localllm.models.rope` (linear, YaRN, LongRoPE, Llama 3's
  factors from ``rope_freqs`` or the keys).
* QK-norm (per head): ``qwen3``/``qwen3moe`` before RoPE; ``hunyuan-dense`` after it
  (its base is NTK-scaled by ``rope.scaling.alpha``).
* ``smollm3``: every 4th layer has no RoPE (NoPE; llama.cpp's ``n_no_rope_layer_step``).
* ``mistral3``: YaRN with ``yarn_log_multiplier`` and its betas, and Llama 4's attention
  temperature: queries at position p times ``1 + temperature_scale * ln(1 + floor(p / n))``,
  n the original context (``attention.temperature_scale``).
* ``seed_oss``: the FFN's pre-norm is the file's ``post_attention_norm``.
* ``ernie4_5``: an ``attn_output.bias`` is loaded and, as llama.cpp does, not applied.
* ``granite``: the embedding times ``embedding_scale``, each sublayer output times
  ``residual_scale``, ``attention.scale`` as the attention scale, logits / ``logit_scale``.

MoE (``expert_count`` > 0; ``qwen3moe``, ``llama``, ``mistral3``): router ``ffn_gate_inp`` ->
softmax over experts -> top ``expert_used_count`` -> weights renormalised to sum 1
(``expert_weights_norm``, llama.cpp's ``norm_w``) -> sum of the selected experts' SwiGLU
outputs, each expert a slice of the 3-D ``ffn_{gate,up,down}_exps`` tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..memory import KVSpec
from .base import MAX_CONTEXT, REQUIRED, DecoderArgs, TensorSpec, ffn_specs, head_specs, qkv_specs
from .common import swiglu
from .decoder import Block, Decoder, DenseFFN, Step, kv_layout
from .moe import ExpertArgs, ExpertWeights, Routing, expert_counts, expert_specs, moe_ffn
from .rope import GLOBAL, NOPE, factor_specs, read_rope


@dataclass(frozen=True)
class Variant:
    """What distinguishes one GGUF architecture of the family (see the module docstring)."""

    neox: bool = False  # RoPE halves order
    qkv_bias: str = "optional"  # Q/K/V biases: "required", "optional" or "none"
    output_bias: str = "optional"  # attn_output.bias: "optional", "ignored" (loaded, unused), "none"
    ffn_bias: bool = False  # optional ffn_gate/up/down biases (llama.cpp's llama, mistral3)
    qk_norm: str = ""  # per-head QK-norm: "" none, "before" RoPE, "after" RoPE
    ffn_norm: str = "ffn_norm"  # the FFN pre-norm's GGUF stem
    nope_step: int = 0  # every n-th layer has no RoPE (n = nope_step)
    yarn_keys: tuple[str, ...] = ()  # optional YaRN keys llama.cpp reads (rope.YARN_KEYS)
    rope_factors: bool = True  # rope_freqs / LongRoPE factor tensors declared
    temperature: bool = False  # Llama 4 attention temperature (attention.temperature_scale)
    ntk_alpha: bool = False  # rope.scaling.alpha scales the base (Hunyuan)
    moe: str = "optional"  # expert_count: "optional", "required", "none"
    granite: bool = False  # embedding / residual / attention / logit multipliers
    rope_base: float = 10_000.0


_LLAMA = Variant(ffn_bias=True)
VARIANTS: dict[str, Variant] = {
    "llama": _LLAMA,
    "mistral": _LLAMA,
    "granite": Variant(ffn_bias=True, granite=True),
    "mistral3": Variant(ffn_bias=True, temperature=True,
                        yarn_keys=("yarn_beta_fast", "yarn_beta_slow", "yarn_log_multiplier")),
    "qwen2": Variant(neox=True, qkv_bias="required", output_bias="none", rope_factors=False),
    "qwen3": Variant(neox=True, qkv_bias="none", output_bias="none", qk_norm="before",
                     rope_factors=False, moe="none"),
    "qwen3moe": Variant(neox=True, qkv_bias="none", output_bias="none", qk_norm="before",
                        rope_factors=False, moe="required"),
    "smollm3": Variant(output_bias="none", nope_step=4, rope_factors=False, moe="none"),
    "ernie4_5": Variant(output_bias="ignored", rope_factors=False, moe="none"),
    "seed_oss": Variant(neox=True, output_bias="none", ffn_norm="post_attention_norm",
                        rope_factors=False, moe="none"),
    "hunyuan-dense": Variant(neox=True, output_bias="none", qk_norm="after", ntk_alpha=True,
                             rope_factors=False, moe="none"),
}


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs, ExpertArgs):
    """Hyperparameters from ``{arch}.*`` metadata keys."""

    ffn_dim: int  # feed_forward_length (0 for MoE files without it)
    sliding_window: int | None = None  # mistral-style SWA on every layer, when given
    expert_ffn_dim: int = 0  # expert_feed_forward_length
    expert_weights_norm: bool = True
    embedding_scale: float = 1.0  # granite
    residual_scale: float = 1.0  # granite
    logit_scale: float = 1.0  # granite: logits are divided by it
    attention_scale: float = 0.0  # 1/sqrt(head_dim) unless attention.scale says otherwise
    temperature_scale: float = 0.0  # mistral3: attention.temperature_scale (0: none)
    temperature_length: int = 0  # its floor scale: the original context

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
        """
        hp, c = cls.read(md, n_vocab, source)
        var = VARIANTS[hp.arch]
        experts = {} if var.moe == "none" else expert_counts(hp, 0, lo=0)
        n_expert = experts.get("n_expert", 0)
        hp.require(n_expert > 0 or var.moe != "required", "expert_count",
                   f"must be > 0 for {hp.arch}")
        ffn = hp.int("feed_forward_length", 0 if n_expert else REQUIRED, lo=0 if n_expert else 1,
                     per_layer=True)
        kw = dict(experts)
        if n_expert:
            kw["expert_ffn_dim"] = hp.int("expert_feed_forward_length", ffn or REQUIRED)
            kw["expert_weights_norm"] = hp.bool("expert_weights_norm", True)
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=var.neox, yarn_keys=var.yarn_keys, base=var.rope_base,
                         ntk_alpha=var.ntk_alpha)
        if var.granite:
            kw["embedding_scale"] = hp.float("embedding_scale", 1.0)
            kw["residual_scale"] = hp.float("residual_scale", 1.0)
            kw["logit_scale"] = hp.float("logit_scale", 1.0)
        scale = 1.0 / math.sqrt(c["head_dim"])
        if var.granite:
            scale = hp.float("attention.scale", scale)
        if var.temperature:
            kw["temperature_scale"] = hp.float("attention.temperature_scale", 0.0, lo=0.0,
                                               lo_open=False)
            kw["temperature_length"] = rope.orig_context
        return cls(**c, rope=rope, ffn_dim=ffn, attention_scale=scale,
                   sliding_window=hp.int("attention.sliding_window", None, hi=MAX_CONTEXT),
                   **kw)

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.arch]

    def rope_kind(self, layer: int) -> str:
        """:data:`~localllm.models.rope.NOPE` for smollm3's every 4th layer, else global."""
        step = self.variant.nope_step
        return NOPE if step and (layer + 1) % step == 0 else GLOBAL


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of the architecture (``load_arch_tensors``), torch shapes."""
    var = a.variant
    d, hd, v = a.d_model, a.head_dim, a.n_vocab
    nq = a.n_heads * hd
    specs = [TensorSpec("token_embd.weight", (v, d))]
    if var.rope_factors:
        specs += factor_specs(a.rope)
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  *qkv_specs(p, d, a.n_heads, a.n_kv_heads, hd, bias=var.qkv_bias)]
        if var.qk_norm:
            specs += [TensorSpec(p + "attn_q_norm.weight", (hd,)),
                      TensorSpec(p + "attn_k_norm.weight", (hd,))]
        specs.append(TensorSpec(p + "attn_output.weight", (d, nq)))
        if var.output_bias != "none":
            specs.append(TensorSpec(p + "attn_output.bias", (d,), optional=True))
        specs.append(TensorSpec(p + f"{var.ffn_norm}.weight", (d,)))
        if a.n_expert:
            specs += expert_specs(p, d, a.n_expert, a.expert_ffn_dim)
        else:
            specs += ffn_specs(p, d, a.ffn_dim, bias=var.ffn_bias)
    specs += head_specs(d, v)
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return kv_layout(a, a.sliding_window)


@dataclass
class Layer(Block, DenseFFN, ExpertWeights):
    """The tensors of one block (``blk.{i}.*``); the experts where ``expert_count`` > 0."""

    ffn_norm: torch.Tensor | None = None  # None where the file calls it post_attention_norm
    post_attention_norm: torch.Tensor | None = None  # seed_oss: the FFN's pre-norm
    attn_q_norm: torch.Tensor | None = None  # per-head QK-norm
    attn_k_norm: torch.Tensor | None = None


def attention_temperature(positions: torch.Tensor, scale: float, length: int,
                          offset: float = 0.0) -> torch.Tensor:
    """Llama 4's attention temperature per position (llama.cpp's ``llm_graph_input_attn_temp``):
    (T,) int64 -> (T, 1) float32, ``1 + scale * ln(1 + floor((p + offset) / length))``
    (``offset``: llama.cpp's ``f_attn_temp_offset``, 1 for Llama 4, 0 for Mistral 3)."""
    return (torch.log(torch.floor((positions.float() + offset) / length) + 1.0) * scale
            + 1.0)[:, None]


class Model(Decoder):
    """A Llama-family decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer

    def prepare(self) -> None:
        a, var = self.args, self.args.variant
        self.set_rope(a.attention_scale, [a.rope_kind(i) for i in range(a.n_layers)],
                      norm_after=var.qk_norm == "after")
        # softmax over the experts, the chosen probabilities renormalised where declared
        self.routing = Routing(norm=a.expert_weights_norm)
        for b in self.layers:
            if var.ffn_norm != "ffn_norm":  # the file's name for the FFN's pre-norm
                b.ffn_norm, b.post_attention_norm = b.post_attention_norm, None
            if var.output_bias == "ignored":
                b.attn_output.bias = None
            if var.qk_norm:
                b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
                b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.token_embd(tokens)  # (T, d)
        return x * self.args.embedding_scale if self.args.embedding_scale != 1.0 else x

    def temperature(self, positions: torch.Tensor) -> torch.Tensor | None:
        a = self.args
        return (attention_temperature(positions, a.temperature_scale, a.temperature_length)
                if a.temperature_scale else None)

    def head(self, n: torch.Tensor) -> torch.Tensor:
        logits = self.output(n)
        return logits / self.args.logit_scale if self.args.logit_scale != 1.0 else logits

    def block(self, i: int, b: Layer, cache, x: torch.Tensor, n: torch.Tensor,
              next_norm: torch.Tensor, step: Step) -> tuple[torch.Tensor, torch.Tensor]:
        # Each intermediate is dropped as soon as it is used (del), before the next large
        # one is allocated: a prefill's peak memory holds one layer's products, not two.
        a, ops = self.args, self.ops
        eps, rs = a.norm_eps, a.residual_scale
        o = self.attention(b, n, cache, step, self.kinds[i], q_norm=b.attn_q_norm,
                           k_norm=b.attn_k_norm, temperature=step.temperature,
                           norm_after_rope=a.variant.qk_norm == "after")
        del n
        h, n = ops.residual_norm(x, o * rs if rs != 1.0 else o, None, b.ffn_norm, eps)
        del o, x
        if a.n_expert:
            f = moe_ffn(ops, b, n, a.n_expert_used, self.routing)
        else:
            f = swiglu(ops, b.ffn_gate_up, b.ffn_down, n)
        del n
        x, n = ops.residual_norm(h, f * rs if rs != 1.0 else f, None, next_norm, eps)
        return x, n
