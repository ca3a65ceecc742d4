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

from ..backends import ExpertMatrix
from ..memory import KVSpec
from .base import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    REQUIRED,
    BaseModel,
    DecoderArgs,
    HParams,
    TensorSpec,
    common_hparams,
)
from .common import Linear, Split, positions_of
from .rope import GLOBAL, NOPE, Rope, RopeWeights, factor_specs, read_rope


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
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``{arch}.*`` metadata keys."""

    ffn_dim: int  # feed_forward_length (0 for MoE files without it)
    sliding_window: int | None = None  # mistral-style SWA on every layer, when given
    n_expert: int = 0  # expert_count
    n_expert_used: int = 0  # expert_used_count
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
        hp = HParams(md, source)
        var = VARIANTS[hp.arch]
        c = common_hparams(hp, n_vocab)
        n_expert = 0 if var.moe == "none" else hp.int("expert_count", 0, lo=0, hi=MAX_EXPERTS)
        hp.require(n_expert > 0 or var.moe != "required", "expert_count",
                   f"must be > 0 for {hp.arch}")
        ffn = hp.int("feed_forward_length", 0 if n_expert else REQUIRED, lo=0 if n_expert else 1,
                     per_layer=True)
        kw = {}
        if n_expert:
            kw["n_expert"] = n_expert
            kw["n_expert_used"] = hp.int("expert_used_count", REQUIRED, hi=n_expert)
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
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    specs = [TensorSpec("token_embd.weight", (v, d))]
    if var.rope_factors:
        specs += factor_specs(a.rope)
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  TensorSpec(p + "attn_q.weight", (nq, d)),
                  TensorSpec(p + "attn_k.weight", (nkv, d)),
                  TensorSpec(p + "attn_v.weight", (nkv, d))]
        if var.qkv_bias != "none":
            optional = var.qkv_bias == "optional"
            specs += [TensorSpec(p + "attn_q.bias", (nq,), optional),
                      TensorSpec(p + "attn_k.bias", (nkv,), optional),
                      TensorSpec(p + "attn_v.bias", (nkv,), optional)]
        if var.qk_norm:
            specs += [TensorSpec(p + "attn_q_norm.weight", (hd,)),
                      TensorSpec(p + "attn_k_norm.weight", (hd,))]
        specs.append(TensorSpec(p + "attn_output.weight", (d, nq)))
        if var.output_bias != "none":
            specs.append(TensorSpec(p + "attn_output.bias", (d,), optional=True))
        specs.append(TensorSpec(p + f"{var.ffn_norm}.weight", (d,)))
        if a.n_expert:
            e, f = a.n_expert, a.expert_ffn_dim
            specs += [TensorSpec(p + "ffn_gate_inp.weight", (e, d)),
                      TensorSpec(p + "ffn_gate_exps.weight", (e, f, d)),
                      TensorSpec(p + "ffn_up_exps.weight", (e, f, d)),
                      TensorSpec(p + "ffn_down_exps.weight", (e, d, f))]
        else:
            specs += [TensorSpec(p + "ffn_gate.weight", (a.ffn_dim, d)),
                      TensorSpec(p + "ffn_up.weight", (a.ffn_dim, d)),
                      TensorSpec(p + "ffn_down.weight", (d, a.ffn_dim))]
            if var.ffn_bias:
                specs += [TensorSpec(p + "ffn_gate.bias", (a.ffn_dim,), optional=True),
                          TensorSpec(p + "ffn_up.bias", (a.ffn_dim,), optional=True),
                          TensorSpec(p + "ffn_down.bias", (d,), optional=True)]
    specs += [TensorSpec("output_norm.weight", (d,)),
              TensorSpec("output.weight", (v, d), optional=True)]
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    return [KVSpec(a.n_kv_heads, a.head_dim, a.sliding_window)] * a.n_layers


@dataclass
class Layer:
    """The tensors of one block (``blk.{i}.*``)."""

    attn_norm: torch.Tensor
    attn_qkv: Linear | Split  # fused attn_q, attn_k, attn_v (with their biases)
    attn_output: Linear
    ffn_norm: torch.Tensor | None = None  # None where the file calls it post_attention_norm
    post_attention_norm: torch.Tensor | None = None  # seed_oss: the FFN's pre-norm
    attn_q_norm: torch.Tensor | None = None  # per-head QK-norm
    attn_k_norm: torch.Tensor | None = None
    ffn_gate_up: Linear | Split | None = None  # dense FFN: fused ffn_gate, ffn_up
    ffn_down: Linear | None = None
    ffn_gate_inp: Linear | None = None  # MoE: the router (float32)
    ffn_gate_exps: ExpertMatrix | None = None
    ffn_up_exps: ExpertMatrix | None = None
    ffn_down_exps: ExpertMatrix | None = None


def moe_ffn(layer: Layer, x: torch.Tensor, n_used: int, norm: bool, ops) -> torch.Tensor:
    """Mixture of experts on x (T, d) float32 -> (T, d) float32 (llama.cpp's
    ``build_moe_ffn`` with softmax gating and SwiGLU experts): router ``ffn_gate_inp`` ->
    softmax -> top ``n_used`` experts (weights renormalised to sum 1 when ``norm``), then the
    backend's ``ops.experts``."""
    probs = torch.softmax(layer.ffn_gate_inp(x), dim=-1)  # (T, E)
    weights, chosen = probs.topk(n_used, dim=-1)  # (T, k)
    if norm:
        weights = weights / weights.sum(-1, keepdim=True)
    return ops.experts(x, chosen, weights, layer.ffn_gate_exps, layer.ffn_up_exps,
                       layer.ffn_down_exps, "silu")


def attention_temperature(positions: torch.Tensor, scale: float, length: int,
                          offset: float = 0.0) -> torch.Tensor:
    """Llama 4's attention temperature per position (llama.cpp's ``llm_graph_input_attn_temp``):
    (T,) int64 -> (T, 1) float32, ``1 + scale * ln(1 + floor((p + offset) / length))``
    (``offset``: llama.cpp's ``f_attn_temp_offset``, 1 for Llama 4, 0 for Mistral 3)."""
    return (torch.log(torch.floor((positions.float() + offset) / length) + 1.0) * scale
            + 1.0)[:, None]


class Model(BaseModel):
    """A Llama-family decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    WEIGHTS = RopeWeights
    weights: RopeWeights

    def prepare(self) -> None:
        a, var = self.args, self.args.variant
        self.rope = Rope.of(a.rope, self.weights, self.device, norm_after=var.qk_norm == "after")
        self.kinds = [a.rope_kind(i) for i in range(a.n_layers)]
        self.scales = {k: a.attention_scale * self.rope.score_scale(k) for k in set(self.kinds)}
        for b in self.layers:
            if var.ffn_norm != "ffn_norm":  # the file's name for the FFN's pre-norm
                b.ffn_norm, b.post_attention_norm = b.post_attention_norm, None
            if var.output_bias == "ignored":
                b.attn_output.bias = None
            if var.qk_norm:
                b.attn_q_norm = self.rope.arrange_weight(b.attn_q_norm)
                b.attn_k_norm = self.rope.arrange_weight(b.attn_k_norm)

    def forward(
        self,
        tokens: torch.Tensor,
        pos: int | torch.Tensor,
        memory,
        *,
        all_logits: bool = False,
        logits_start: int = 0,
    ) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32:
        (1, n_vocab) for the last position, or (T - logits_start, n_vocab) with all_logits.
        ``memory``: the sequence's :class:`~localllm.memory.Memory` (one KV cache per layer).

        ``pos`` may be a (1,) int64 tensor on the model's device for a one-token step with
        static shapes and no host reads (CUDA graphs, :mod:`localllm.runtime.graphs`)."""
        a, ops, rope = self.args, self.ops, self.rope
        after = a.variant.qk_norm == "after"
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.token_embd(tokens)  # (T, d)
        if a.embedding_scale != 1.0:
            x = x * a.embedding_scale
        angles = rope.angles(ops, positions, memory.ctx_size, tuple(self.scales))
        temp = (attention_temperature(positions, a.temperature_scale, a.temperature_length)
                if a.temperature_scale else None)
        # Each block ends with the next block's pre-norm (the output norm after the last),
        # fused with its residual add.
        nexts = [b.attn_norm for b in self.layers[1:]] + [self.output_norm]
        eps, rs = a.norm_eps, a.residual_scale
        n = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        # Each intermediate is dropped as soon as it is used (del), before the next large
        # one is allocated: a prefill's peak memory holds one layer's products, not two.
        for b, cache, next_norm, kind in zip(self.layers, memory, nexts, self.kinds):
            q, k, v = b.attn_qkv(n)
            q, k = rope.arrange(q), rope.arrange(k)
            if temp is not None:
                q = q * temp  # RoPE is linear: scaling before it is scaling after
            attn = ops.self_attention(q, k, v, b.attn_q_norm, b.attn_k_norm, eps, angles[kind],
                                      cache, pos, positions, head_dim=a.head_dim,
                                      neox=a.rope.neox, scale=self.scales[kind],
                                      norm_after_rope=after)
            del q, k, v
            o = b.attn_output(attn)
            del attn
            h, n = ops.residual_norm(x, o * rs if rs != 1.0 else o, None, b.ffn_norm, eps)
            del o
            if a.n_expert:
                f = moe_ffn(b, n, a.n_expert_used, a.expert_weights_norm, ops)
            else:
                gate, up = b.ffn_gate_up(n)
                del n
                f = b.ffn_down(ops.gated(gate, up, "silu", overwrite=True))
                del gate, up
            x, n = ops.residual_norm(h, f * rs if rs != 1.0 else f, None, next_norm, eps)
            del h, f
        logits = self.output(n[logits_start:] if all_logits else n[-1:])
        return logits / a.logit_scale if a.logit_scale != 1.0 else logits
