"""The Llama family: ``llama`` (Llama 2/3.x, SmolLM2, TinyLlama, Mixtral-style MoE),
``mistral``, ``granite``, ``qwen2``, ``qwen3``, ``qwen3moe`` (llama.cpp's
``src/models/llama.cpp``, ``granite.cpp``, ``qwen2.cpp``, ``qwen3.cpp``, ``qwen3moe.cpp``).

Per layer::

    h   = x + s_r * wo(attn(attn_norm(x)))     # GQA; qwen2: QKV biases; qwen3*: QK-norm
    out = h + s_r * ffn(ffn_norm(h))            # ffn: down(silu(gate(n)) * up(n)), or MoE

MoE (``expert_count`` > 0; ``qwen3moe``): router ``ffn_gate_inp`` -> softmax over experts ->
top ``expert_used_count`` -> weights renormalised to sum 1 (``expert_weights_norm``, llama.cpp's
``norm_w``, true for these families) -> sum of the selected experts' SwiGLU outputs, each
expert a slice of the 3-D ``ffn_{gate,up,down}_exps`` tensors.

Granite multiplies the embedding by ``embedding_scale``, each sublayer output by
``residual_scale``, uses ``attention.scale`` as the attention scale and divides the logits by
``logit_scale``; the others have 1 and 1/sqrt(head_dim).

RoPE: adjacent pairs for ``llama``/``mistral``/``granite`` (the converter permutes Q/K for
that), halves (NEOX) for the Qwen families; linear scaling (``rope.scaling.type = linear``,
positions x 1/factor) and Llama 3.x's per-frequency factors from the ``rope_freqs.weight``
tensor (the ``llama3`` scaling, precomputed by the converter); YaRN (``yarn``: per-frequency
factors and attention scale of :func:`~localllm.models.common.yarn_rope`, as Qwen 2.5/3
long-context files use it). LongRoPE is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..backends import ExpertMatrix
from ..errors import UnsupportedError
from ..memory import KVSpec
from .base import (
    MAX_CONTEXT,
    MAX_EXPERTS,
    REQUIRED,
    BaseModel,
    DecoderArgs,
    HParams,
    TensorSpec,
    Weights,
    common_hparams,
)
from .common import Linear, Split, positions_of, rope_inv_freq, yarn_rope

NEOX_ARCHITECTURES = frozenset({"qwen2", "qwen3", "qwen3moe"})
QKV_BIAS = frozenset({"qwen2"})  # required Q/K/V biases (llama: optional biases)
QK_NORM = frozenset({"qwen3", "qwen3moe"})


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs):
    """Hyperparameters from ``{arch}.*`` metadata keys."""

    ffn_dim: int  # feed_forward_length (0 for MoE files without it)
    rope_yarn: dict | None = None  # YaRN: common.yarn_rope's arguments
    sliding_window: int | None = None  # mistral-style SWA on every layer, when given
    n_expert: int = 0  # expert_count
    n_expert_used: int = 0  # expert_used_count
    expert_ffn_dim: int = 0  # expert_feed_forward_length
    expert_weights_norm: bool = True
    embedding_scale: float = 1.0  # granite
    residual_scale: float = 1.0  # granite
    logit_scale: float = 1.0  # granite: logits are divided by it
    attention_scale: float = 0.0  # 1/sqrt(head_dim) unless attention.scale says otherwise

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named).
            UnsupportedError: LongRoPE scaling (``rope.scaling.type``), YaRN's
                ``rope.scaling.yarn_log_multiplier``.
        """
        hp = HParams(md, source)
        c = common_hparams(hp, n_vocab)
        n_expert = hp.int("expert_count", 0, lo=0, hi=MAX_EXPERTS)
        hp.require(n_expert > 0 or hp.arch != "qwen3moe", "expert_count",
                   "must be > 0 for qwen3moe")
        ffn = hp.int("feed_forward_length", 0 if n_expert else REQUIRED, lo=0 if n_expert else 1,
                     per_layer=True)
        kw = {}
        if n_expert:
            kw["n_expert"] = n_expert
            kw["n_expert_used"] = hp.int("expert_used_count", REQUIRED, hi=n_expert)
            kw["expert_ffn_dim"] = hp.int("expert_feed_forward_length", ffn or REQUIRED)
            kw["expert_weights_norm"] = hp.bool("expert_weights_norm", True)
        kind, factor = hp.rope_scaling(("linear", "yarn"))
        if kind == "yarn":
            kw["rope_yarn"] = yarn_hparams(hp, factor, c["context_length"])
            factor = 1.0  # folded into the frequencies (Model.prepare)
        if hp.arch == "granite":
            kw["embedding_scale"] = hp.float("embedding_scale", 1.0)
            kw["residual_scale"] = hp.float("residual_scale", 1.0)
            kw["logit_scale"] = hp.float("logit_scale", 1.0)
        scale = hp.float("attention.scale", 1.0 / math.sqrt(c["head_dim"]))
        # llama.cpp multiplies cos and sin (so Q and K) by rope.scaling.attn_factor, and by
        # YaRN's mscale: the scores by the square of both.
        mscale = hp.float("rope.scaling.attn_factor", 1.0)
        if kind == "yarn":
            mscale *= yarn_rope(c["head_dim"], c["rope_base"], **kw["rope_yarn"])[1]
        scale *= mscale ** 2
        return cls(**c, ffn_dim=ffn, rope_scale=1.0 / factor, attention_scale=scale,
                   sliding_window=hp.int("attention.sliding_window", None, hi=MAX_CONTEXT),
                   **kw)

    @property
    def neox(self) -> bool:
        return self.arch in NEOX_ARCHITECTURES


def yarn_hparams(hp: HParams, factor: float, context_length: int) -> dict:
    """The keyword arguments of :func:`~localllm.models.common.yarn_rope` from the
    ``rope.scaling.*`` keys, with llama.cpp's defaults (``llama_context``: beta_fast 32,
    beta_slow 1, ext_factor 1, original context = the training context).

    Raises:
        GGUFError: ``rope.freq_base`` <= 1 (no correction dimensions), a key out of range.
        UnsupportedError: ``rope.scaling.yarn_log_multiplier`` (DeepSeek's mscale variant).
    """
    hp.require(hp.float("rope.freq_base", 10_000.0) > 1.0, "rope.freq_base",
               "must be > 1 for YaRN scaling (its correction dimensions divide by log(base))")
    log_mul = hp.float("rope.scaling.yarn_log_multiplier", 0.0, lo=0.0, lo_open=False)
    if log_mul != 0.0:
        raise UnsupportedError(
            f"{hp.pre}metadata {hp.key('rope.scaling.yarn_log_multiplier')} = {log_mul:g}: "
            "YaRN with a log multiplier is not supported")
    return {"factor": factor,
            "orig_context": hp.int("rope.scaling.original_context_length", context_length,
                                   hi=MAX_CONTEXT),
            "beta_fast": hp.float("rope.scaling.yarn_beta_fast", 32.0),
            "beta_slow": hp.float("rope.scaling.yarn_beta_slow", 1.0),
            "ext_factor": hp.float("rope.scaling.yarn_ext_factor", 1.0, lo=0.0, lo_open=False)}


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's tensors of the family (``llama_model::load_tensors``), torch shapes."""
    d, hd, v = a.d_model, a.head_dim, a.n_vocab
    nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
    specs = [TensorSpec("token_embd.weight", (v, d)),
             TensorSpec("rope_freqs.weight", (hd // 2,), optional=True)]
    bias_optional = a.arch not in QKV_BIAS
    for i in range(a.n_layers):
        p = f"blk.{i}."
        specs += [TensorSpec(p + "attn_norm.weight", (d,)),
                  TensorSpec(p + "attn_q.weight", (nq, d)),
                  TensorSpec(p + "attn_k.weight", (nkv, d)),
                  TensorSpec(p + "attn_v.weight", (nkv, d))]
        if a.arch in QKV_BIAS or a.arch in ("llama", "mistral", "granite"):
            specs += [TensorSpec(p + "attn_q.bias", (nq,), bias_optional),
                      TensorSpec(p + "attn_k.bias", (nkv,), bias_optional),
                      TensorSpec(p + "attn_v.bias", (nkv,), bias_optional)]
        if a.arch in QK_NORM:
            specs += [TensorSpec(p + "attn_q_norm.weight", (hd,)),
                      TensorSpec(p + "attn_k_norm.weight", (hd,))]
        specs.append(TensorSpec(p + "attn_output.weight", (d, nq)))
        if a.arch in ("llama", "mistral", "granite"):
            specs.append(TensorSpec(p + "attn_output.bias", (d,), optional=True))
        specs.append(TensorSpec(p + "ffn_norm.weight", (d,)))
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
    ffn_norm: torch.Tensor
    attn_q_norm: torch.Tensor | None = None  # qwen3*: per-head QK-norm
    attn_k_norm: torch.Tensor | None = None
    ffn_gate_up: Linear | Split | None = None  # dense FFN: fused ffn_gate, ffn_up
    ffn_down: Linear | None = None
    ffn_gate_inp: Linear | None = None  # MoE: the router (float32)
    ffn_gate_exps: ExpertMatrix | None = None
    ffn_up_exps: ExpertMatrix | None = None
    ffn_down_exps: ExpertMatrix | None = None


@dataclass
class LlamaWeights(Weights):
    rope_freqs: torch.Tensor | None = None  # Llama 3.x RoPE factors (head_dim/2,)


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


class Model(BaseModel):
    """A Llama-family decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    WEIGHTS = LlamaWeights
    rope_freqs: torch.Tensor | None

    def prepare(self) -> None:
        a = self.args
        self.inv_freq = rope_inv_freq(a.head_dim, a.rope_base, self.rope_freqs, device=self.device)
        if a.rope_yarn is not None:
            divisors, _ = yarn_rope(a.head_dim, a.rope_base, **a.rope_yarn)
            self.inv_freq = self.inv_freq / divisors.to(self.inv_freq.device)

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
        a, ops = self.args, self.ops
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.token_embd(tokens)  # (T, d)
        if a.embedding_scale != 1.0:
            x = x * a.embedding_scale
        rope = ops.rope_angles(positions, self.inv_freq, a.rope_scale)  # shared by every layer
        # Each block ends with the next block's pre-norm (the output norm after the last),
        # fused with its residual add.
        nexts = [b.attn_norm for b in self.layers[1:]] + [self.output_norm]
        eps, rs = a.norm_eps, a.residual_scale
        n = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        # Each intermediate is dropped as soon as it is used (del), before the next large
        # one is allocated: a prefill's peak memory holds one layer's products, not two.
        for b, cache, next_norm in zip(self.layers, memory, nexts):
            q, k, v = b.attn_qkv(n)
            attn = ops.self_attention(q, k, v, b.attn_q_norm, b.attn_k_norm, eps, rope, cache,
                                      pos, positions, head_dim=a.head_dim, neox=a.neox,
                                      scale=a.attention_scale)  # QK-norm: qwen3
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
