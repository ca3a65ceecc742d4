"""Gemma 4 (``gemma4``: the dense E2B, E4B, 31B and the mixture-of-experts 26B-A4B), as
llama.cpp's ``src/models/gemma4.cpp`` computes it.

Per layer::

    h   = x + post_attention_norm(wo(attn(attn_norm(x))))
    x'  = h + post_ffw_norm(down(gelu_tanh(gate(n)) * up(n))),  n = ffn_norm(h)
    x'  = x' + post_norm(proj(gelu_tanh(inp_gate(x')) * ple_i))   # per-layer embeddings
    x'  = x' * layer_output_scale                                  # where the file has it

* Attention: queries and keys RMS-normed per head (``attn_q_norm``, ``attn_k_norm``), values
  RMS-normed without weight, then RoPE (halves order) on queries and keys; scale 1 (no
  1/sqrt(d)). Which layers slide is ``attention.sliding_window_pattern`` (one boolean per
  layer, required); sliding layers have their own head size (``attention.key_length_swa``),
  rotated dimensions (``rope.dimension_count_swa``) and base (``rope.freq_base_swa``,
  default 10,000, no frequency scaling), global layers ``attention.key_length`` and the
  ``rope_freqs`` factors (proportional RoPE). A layer without ``attn_v`` uses its keys'
  projection as values.
* Shared KV (``attention.shared_kv_layers`` = s): the last s layers compute only queries and
  attend over the keys and values of layer n - s - 2 (sliding) or n - s - 1 (global) of
  the same step (llama.cpp's ``layer_reuse_cb``); they hold no cache.
* Per-layer embeddings (``embedding_length_per_layer_input`` = P > 0): per token,
  ``ple = (rms_norm(per_layer_model_proj(x0) / sqrt(d)) + per_layer_token_embd[tok] *
  sqrt(P)) / sqrt(2)``, P values per layer, x0 the scaled input embedding.
* The embedding is scaled by sqrt(d_model); the output is tied unless the file has one; the
  logits are soft-capped (``final_logit_softcapping``) where the file says so.
* The FFN size may differ per layer (``feed_forward_length`` as an array: the wider FFN of
  the shared-KV layers).
* Mixture of experts (``expert_count`` > 0, 26B-A4B; every layer): the dense FFN above acts
  as a shared expert beside the routed ones, each branch normed before and after, and their
  sum takes the place of the dense FFN's output before ``post_ffw_norm``::

      f = post_ffw_norm_1(down(gelu_tanh(gate(n)) * up(n)))                 # n = ffn_norm(h)
        + post_ffw_norm_2(experts(pre_ffw_norm_2(h)))
      router logits = ffn_gate_inp(rms_norm(h) / sqrt(d) * ffn_gate_inp.scale)

  routed by softmax over all experts, the top ``expert_used_count`` renormalised to sum 1
  (:data:`ROUTING`), each chosen expert's GEGLU (``gelu_tanh``) of
  ``expert_feed_forward_length`` scaled by its ``ffn_down_exps.scale`` where the file has
  it; gate and up either separate (``ffn_gate_exps``, ``ffn_up_exps``) or fused
  (``ffn_gate_up_exps``, the current converter's).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..memory import KVSpec
from .base import (
    MAX_CONTEXT,
    MAX_DIM,
    REQUIRED,
    BaseModel,
    DecoderArgs,
    TensorSpec,
    swa_layers,
)
from .common import Linear, Split, positions_of
from .moe import ExpertArgs, ExpertWeights, Routing, expert_counts, expert_specs, routed_experts
from .rope import GLOBAL, Rope, RopeSpec, RopeWeights, read_rope

SWA_BASE = 10_000.0  # llama.cpp's default rope_freq_base_train_swa
# build_moe_ffn's arguments in gemma4.cpp: softmax gating, weights renormalised, GEGLU experts
ROUTING = Routing(gating="softmax", norm=True, act="gelu_tanh")


@dataclass(kw_only=True)
class ModelArgs(DecoderArgs, ExpertArgs):
    """Hyperparameters from ``gemma4.*`` metadata keys (``head_dim``: global layers';
    ``n_expert`` 0: a dense model)."""

    ffn_dims: tuple[int, ...]  # feed_forward_length, per layer
    sliding_window: int
    swa: tuple[bool, ...]  # per layer: sliding-window attention
    head_dim_swa: int  # attention.key_length_swa
    rope_swa: RopeSpec  # sliding layers' RoPE (head size, rotated dims, base)
    n_kv_layers: int  # layers with their own KV cache (block_count - shared_kv_layers)
    n_embd_per_layer: int = 0  # embedding_length_per_layer_input (0: no per-layer inputs)
    final_softcap: float | None = None
    norm_eps: float = 1e-6
    expert_ffn_dim: int = 0  # expert_feed_forward_length (MoE)

    @classmethod
    def from_gguf(cls, md: dict, n_vocab: int, source: str = "") -> ModelArgs:
        """Validated hyperparameters (see :class:`~localllm.models.base.HParams`).

        Raises:
            GGUFError: a key missing, mistyped, out of range or inconsistent (named): a
                sliding-window pattern that is not one boolean per layer, shared-KV layers
                whose source layers are missing or of the other kind, a sliding head size
                whose key and value lengths differ; for a mixture of experts, more used
                experts than experts or no ``expert_feed_forward_length``.
        """
        hp, c = cls.read(md, n_vocab, source, eps=1e-6, context_length=131072)
        n = c["n_layers"]
        experts = expert_counts(hp, 0, lo=0)
        expert_ffn = (hp.int("expert_feed_forward_length", REQUIRED, per_layer=True)
                      if experts["n_expert"] else 0)
        ffn = hp.int_layers("feed_forward_length", n, REQUIRED, lo=1)
        pattern = hp.md.get(hp.key("attention.sliding_window_pattern"))
        hp.require(isinstance(pattern, list), "attention.sliding_window_pattern",
                   "must be an array of one boolean per layer")
        swa = tuple(swa_layers(hp, n, 0))
        window = hp.int("attention.sliding_window", REQUIRED, hi=MAX_CONTEXT)
        hd_swa = hp.int("attention.key_length_swa", REQUIRED)
        hp.require(hp.int("attention.value_length_swa", REQUIRED) == hd_swa,
                   "attention.value_length_swa", "must equal attention.key_length_swa "
                   "(llama.cpp's Gemma 4 requires it)")
        hp.require(hd_swa % 2 == 0, "attention.key_length_swa", f"{hd_swa} is odd")
        shared = hp.int("attention.shared_kv_layers", 0, lo=0, hi=n)
        n_kv = n - shared
        if shared:
            hp.require(n_kv >= 2 and swa[n_kv - 2] and not swa[n_kv - 1],
                       "attention.shared_kv_layers",
                       f"{shared} shared layers of {n} need a sliding then a global layer "
                       "just before them (their keys and values)")
        rope = read_rope(hp, head_dim=c["head_dim"], context_length=c["context_length"],
                         neox=True, swa_base=SWA_BASE, swa_scale=1.0)
        n_rot_swa = hp.int("rope.dimension_count_swa", min(rope.n_rot, hd_swa), lo=2,
                           hi=hd_swa)
        hp.require(n_rot_swa % 2 == 0, "rope.dimension_count_swa", f"{n_rot_swa} is odd")
        rope_swa = dataclasses.replace(
            rope, head_dim=hd_swa, n_rot=n_rot_swa, base=rope.layer(swa=True)[0],
            kind="none", factor=1.0, ext_factor=0.0, base_swa=None, freq_scale_swa=None)
        ple = hp.int("embedding_length_per_layer_input", REQUIRED, lo=0,
                     hi=MAX_DIM // max(1, n))
        return cls(**c, rope=rope, ffn_dims=ffn, sliding_window=window, swa=swa,
                   head_dim_swa=hd_swa, rope_swa=rope_swa, n_kv_layers=n_kv,
                   n_embd_per_layer=ple,
                   final_softcap=hp.float("final_logit_softcapping", None), **experts,
                   expert_ffn_dim=expert_ffn)

    def layer_head_dim(self, i: int) -> int:
        return self.head_dim_swa if self.swa[i] else self.head_dim

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer ``i`` attends over (itself, or for a
        shared-KV layer the last layer of its kind with a cache)."""
        if i < self.n_kv_layers:
            return i
        return self.n_kv_layers - (2 if self.swa[i] else 1)


def tensor_specs(a: ModelArgs) -> list[TensorSpec]:
    """llama.cpp's ``gemma4`` tensors (``load_arch_tensors``), torch shapes: with experts,
    every layer's router, its input scale, the experts and the MoE branch's norms."""
    d, v, p = a.d_model, a.n_vocab, a.n_embd_per_layer
    specs = [TensorSpec("token_embd.weight", (v, d)),
             TensorSpec("output.weight", (v, d), optional=True),
             TensorSpec("output_norm.weight", (d,))]
    if not all(a.swa):  # the global layers' proportional RoPE (required by llama.cpp)
        specs.append(TensorSpec("rope_freqs.weight", (a.head_dim // 2,)))
    if p:
        specs += [TensorSpec("per_layer_token_embd.weight", (v, p * a.n_layers)),
                  TensorSpec("per_layer_model_proj.weight", (p * a.n_layers, d)),
                  TensorSpec("per_layer_proj_norm.weight", (p,))]
    for i in range(a.n_layers):
        pre, hd, f = f"blk.{i}.", a.layer_head_dim(i), a.ffn_dims[i]
        nq, nkv = a.n_heads * hd, a.n_kv_heads * hd
        shared = i >= a.n_kv_layers  # llama.cpp: K and its norm not required there
        specs += [TensorSpec(pre + "attn_norm.weight", (d,)),
                  TensorSpec(pre + "attn_q.weight", (nq, d)),
                  TensorSpec(pre + "attn_k.weight", (nkv, d), optional=shared),
                  TensorSpec(pre + "attn_v.weight", (nkv, d), optional=True),
                  TensorSpec(pre + "attn_output.weight", (d, nq)),
                  TensorSpec(pre + "attn_q_norm.weight", (hd,)),
                  TensorSpec(pre + "attn_k_norm.weight", (hd,), optional=shared),
                  TensorSpec(pre + "post_attention_norm.weight", (d,)),
                  TensorSpec(pre + "layer_output_scale.weight", (1,), optional=True),
                  TensorSpec(pre + "ffn_norm.weight", (d,)),
                  TensorSpec(pre + "ffn_gate.weight", (f, d)),
                  TensorSpec(pre + "ffn_up.weight", (f, d)),
                  TensorSpec(pre + "ffn_down.weight", (d, f)),
                  TensorSpec(pre + "post_ffw_norm.weight", (d,))]
        if a.n_expert:
            specs += [TensorSpec(pre + "ffn_gate_inp.scale", (d,)),
                      TensorSpec(pre + "pre_ffw_norm_2.weight", (d,)),
                      TensorSpec(pre + "post_ffw_norm_1.weight", (d,)),
                      TensorSpec(pre + "post_ffw_norm_2.weight", (d,)),
                      *expert_specs(pre, d, a.n_expert, a.expert_ffn_dim, fused_gate_up=True,
                                    down_scale=True)]
        if p:
            specs += [TensorSpec(pre + "inp_gate.weight", (p, d)),
                      TensorSpec(pre + "proj.weight", (d, p)),
                      TensorSpec(pre + "post_norm.weight", (d,))]
    return specs


def memory_layout(a: ModelArgs) -> list[KVSpec]:
    """One cache per layer before the shared-KV layers (which hold none)."""
    return [KVSpec(a.n_kv_heads, a.layer_head_dim(i), a.sliding_window if a.swa[i] else None)
            for i in range(a.n_kv_layers)]


@dataclass
class Weights(RopeWeights):
    """Top-level tensors, with the per-layer embeddings' (where P > 0)."""

    per_layer_token_embd: Linear | None = None  # (n_vocab, P * n_layers): rows looked up
    per_layer_model_proj: Linear | None = None
    per_layer_proj_norm: torch.Tensor | None = None


@dataclass
class Layer(ExpertWeights):
    """The tensors of one block (``blk.{i}.*``); a MoE model's also its router, experts and
    the MoE branch's norms."""

    attn_norm: torch.Tensor
    attn_output: Linear
    attn_q_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_gate_up: Linear | Split  # fused ffn_gate, ffn_up
    ffn_down: Linear
    post_ffw_norm: torch.Tensor
    attn_qkv: Linear | Split | None = None  # fused attn_q, attn_k, attn_v when all three
    attn_q: Linear | None = None  # otherwise (no attn_v: values from attn_k)
    attn_k: Linear | None = None
    attn_v: Linear | None = None
    attn_k_norm: torch.Tensor | None = None
    layer_output_scale: torch.Tensor | None = None  # (1,)
    inp_gate: Linear | None = None  # per-layer embeddings
    proj: Linear | None = None
    post_norm: torch.Tensor | None = None
    ffn_gate_inp_scale: torch.Tensor | None = None  # (d,) the router input's; / sqrt(d) once bound
    pre_ffw_norm_2: torch.Tensor | None = None
    post_ffw_norm_1: torch.Tensor | None = None
    post_ffw_norm_2: torch.Tensor | None = None


class Model(BaseModel):
    """A Gemma 4 decoder; weights attached by :func:`localllm.models.base.bind`."""

    LAYER = Layer
    WEIGHTS = Weights
    weights: Weights
    PREFILL_BF16 = True  # Gemma's activations outgrow float16

    def prepare(self) -> None:
        a = self.args
        # rope_freqs holds head_dim / 2 factors; ggml's rope reads the first n_rot / 2
        ff = self.weights.rope_freqs
        self.rope_full = Rope(a.rope, self.device,
                              rope_freqs=None if ff is None else ff[: a.rope.n_rot // 2])
        self.rope_swa = Rope(a.rope_swa, self.device)
        # llama.cpp's f_attention_scale = 1, times the RoPE magnitude folded in
        self.scale_full = self.rope_full.score_scale(GLOBAL)
        self.scale_swa = self.rope_swa.score_scale(GLOBAL)
        self.units = {hd: torch.ones(hd, dtype=torch.float32, device=self.device)
                      for hd in (a.head_dim, a.head_dim_swa)}
        for i, b in enumerate(self.layers):
            rope = self.rope_swa if a.swa[i] else self.rope_full
            b.attn_q_norm = rope.arrange_weight(b.attn_q_norm)
            b.attn_k_norm = rope.arrange_weight(b.attn_k_norm)
            if b.ffn_gate_inp_scale is not None:  # llama.cpp's 1/sqrt(d) folded in
                b.ffn_gate_inp_scale = b.ffn_gate_inp_scale * (1.0 / math.sqrt(a.d_model))

    def _per_layer_inputs(self, tokens: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """(n_layers, T, P) float32: llama.cpp's ``build_inp_per_layer`` and
        ``project_per_layer_inputs`` of the scaled embedding x (T, d)."""
        a, ops = self.args, self.ops
        t, p = tokens.shape[0], a.n_embd_per_layer
        emb = self.per_layer_token_embd.weight.rows(tokens).view(t, a.n_layers, p)
        proj = (self.per_layer_model_proj(x) * (1.0 / math.sqrt(a.d_model))).view(
            t, a.n_layers, p)
        proj = ops.rms_norm(proj.contiguous(), self.per_layer_proj_norm, a.norm_eps)
        out = (proj + emb * math.sqrt(p)) * (1.0 / math.sqrt(2.0))
        return out.transpose(0, 1).contiguous()  # (n_layers, T, P): one layer's contiguous

    def forward(self, tokens: torch.Tensor, pos: int | torch.Tensor, memory, *,
                all_logits: bool = False, logits_start: int = 0) -> torch.Tensor:
        """tokens: (T,) int64 at positions pos .. pos+T-1 -> logits float32:
        (1, n_vocab) for the last position, or (T - logits_start, n_vocab) with all_logits.
        ``memory``: one KV cache per layer with its own (:func:`memory_layout`)."""
        a, ops = self.args, self.ops
        t = tokens.shape[0]
        positions = positions_of(pos, t, self.device)
        x = self.token_embd(tokens) * math.sqrt(a.d_model)
        ple = self._per_layer_inputs(tokens, x) if a.n_embd_per_layer else None
        angles = {False: self.rope_full.angles(ops, positions, memory.ctx_size)[GLOBAL],
                  True: self.rope_swa.angles(ops, positions, memory.ctx_size)[GLOBAL]}
        eps = a.norm_eps
        sources = {a.kv_source(i) for i in range(a.n_kv_layers, a.n_layers)}
        shared: dict[int, object] = {}  # source layer -> what its queries attended over
        n = ops.rms_norm(x, self.layers[0].attn_norm, eps)
        for i, b in enumerate(self.layers):
            attn = self._attention(i, b, n, memory, pos, positions, angles[a.swa[i]],
                                   sources, shared)
            del n
            h, n = ops.residual_norm(x, b.attn_output(attn), b.post_attention_norm,
                                     b.ffn_norm, eps)
            del attn, x
            gate, up = b.ffn_gate_up(n)
            f = b.ffn_down(ops.gated(gate, up, "gelu_tanh", overwrite=True))
            del gate, up, n
            if b.ffn_gate_inp is not None:
                f = self._with_experts(b, h, f)
            x = h + ops.rms_norm(f, b.post_ffw_norm, eps)
            del h, f
            if ple is not None:
                g = ops.gated(b.inp_gate(x), ple[i], "gelu_tanh", overwrite=True)
                x = x + ops.rms_norm(b.proj(g), b.post_norm, eps)
                del g
            if b.layer_output_scale is not None:
                x = x * b.layer_output_scale
            nxt = self.layers[i + 1].attn_norm if i + 1 < a.n_layers else self.output_norm
            n = ops.rms_norm(x, nxt, eps)
        logits = self.output(n[logits_start:] if all_logits else n[-1:])
        if a.final_softcap is not None:
            logits = torch.tanh(logits / a.final_softcap) * a.final_softcap
        return logits

    def _with_experts(self, b: Layer, h: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
        """A MoE layer's FFN output (T, d) float32 from the stream after attention h and the
        dense FFN's output f (T, d): both branches post-normed and summed (module
        docstring), the router reading h RMS-normed by its scaled input weight."""
        a, ops, eps = self.args, self.ops, self.args.norm_eps
        moe = routed_experts(ops, b, ops.rms_norm(h, b.pre_ffw_norm_2, eps), a.n_expert_used,
                             ROUTING, router_input=ops.rms_norm(h, b.ffn_gate_inp_scale, eps))
        return ops.rms_norm(f, b.post_ffw_norm_1, eps) + ops.rms_norm(moe, b.post_ffw_norm_2,
                                                                        eps)

    def _attention(self, i: int, b: Layer, n: torch.Tensor, memory, pos, positions, angles,
                   sources: set[int], shared: dict[int, object]) -> torch.Tensor:
        """Layer i's attention of its normed input n (T, d) -> (T, n_heads * head_dim)."""
        a, ops = self.args, self.ops
        eps, t = a.norm_eps, n.shape[0]
        swa = a.swa[i]
        rope = self.rope_swa if swa else self.rope_full
        hd = a.layer_head_dim(i)
        scale = self.scale_swa if swa else self.scale_full
        if b.attn_qkv is not None:
            q, k, v = b.attn_qkv(n)
        else:
            q = b.attn_q(n)
            k = b.attn_k(n) if b.attn_k is not None else None
            v = b.attn_v(n) if b.attn_v is not None else k
        q = rope.arrange(q)
        if i >= a.n_kv_layers:  # shared KV: queries only, over the source layer's keys
            qh = ops.norm_rope(q.reshape(t, -1, hd).transpose(0, 1), b.attn_q_norm, eps,
                               angles, neox=True)
            return ops.attend_shared(qh, shared[a.kv_source(i)], positions,
                                     window=a.sliding_window if swa else None, scale=scale)
        k = rope.arrange(k)
        # values: RMSNorm per head without weight (llama.cpp's ggml_rms_norm of Vcur)
        v = ops.rms_norm(v.reshape(t, -1, hd).contiguous(), self.units[hd], eps).view(t, -1)
        cache = memory[i]
        if i not in sources:
            return ops.self_attention(q, k, v, b.attn_q_norm, b.attn_k_norm, eps, angles, cache,
                                      pos, positions, head_dim=hd, neox=True, scale=scale)
        qh = ops.norm_rope(q.reshape(t, -1, hd).transpose(0, 1), b.attn_q_norm, eps, angles,
                           neox=True)
        kh = ops.norm_rope(k.reshape(t, -1, hd).transpose(0, 1), b.attn_k_norm, eps, angles,
                           neox=True)
        out, shared[i] = ops.attention_shared(qh, kh, v.reshape(t, -1, hd).transpose(0, 1),
                                              cache, pos, positions, scale=scale)
        return out
