"""The torch backend: dense weights (dequantized once at load) and layer operations as torch
operations, on every device; also the reference the other backends' fused ops are tested
against.

Compute convention on the CPU: weights are dequantized once at load to float16 (half the
memory of float32, and torch's float16 GEMV is several times faster than float32 here);
the residual stream, norms and attention run in float32. A matrix product with one or a
few rows (decode) multiplies in float16; with many rows (prefill) the weight is upcast to
float32 for the product, where torch's float32 GEMM is much faster than its float16 one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as T

from ..memory import BlockRows, attention_mask
from . import deltanet, ssm
from .base import Backend as _Backend
from .base import SharedExpert

# Above this many rows a CPU product takes the float32 GEMM path (see the module docstring).
GEMV_MAX_ROWS = 8


class DenseMatrix:
    """A :class:`~localllm.backends.Matrix` held as a torch tensor (out, in): float16 (float32
    for exact checks and MoE routers)."""

    def __init__(self, w: torch.Tensor) -> None:
        self.w = w
        self.shape = (int(w.shape[0]), int(w.shape[1]))

    @property
    def qtype(self) -> T:
        return {torch.float32: T.F32, torch.bfloat16: T.BF16}.get(self.w.dtype, T.F16)

    @property
    def nbytes(self) -> int:
        return self.w.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        w = self.w
        if x.shape[0] <= GEMV_MAX_ROWS or w.device.type != "cpu":
            return F.linear(x.to(w.dtype), w).float()
        return F.linear(x, w.float())

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        return self.w[ids].float()

    def stack(self, others: Sequence) -> DenseMatrix | None:
        if not all(isinstance(o, DenseMatrix) and o.w.dtype == self.w.dtype for o in others):
            return None
        return DenseMatrix(torch.cat([self.w, *(o.w for o in others)]))


class Backend(_Backend):
    """Every matrix dequantized at load (:class:`DenseMatrix`), ops in torch; the other
    backends fall back to these dense matrices for the types their kernels lack."""

    name = "torch"

    def make_ops(self) -> TorchOps:
        return TorchOps()

    def dense_matrix_of(self, w: torch.Tensor) -> DenseMatrix:
        return DenseMatrix(w)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim (Zhang & Sennrich 2019), float32: x / rms(x) * weight."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_angles(
    positions: torch.Tensor, inv_freq: torch.Tensor, scale: float = 1.0,
    magnitude: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of the RoPE angles, each (T, head_dim/2) float32; computed once per forward
    and shared by the layers that use the same frequencies. ``scale`` multiplies positions
    (linear RoPE scaling: 1 / factor); ``magnitude`` (head_dim/2,) float32 multiplies cos and
    sin per pair (ggml's ``mscale``: YaRN's and ``rope.scaling.attn_factor``, where it cannot
    be folded into the attention scale, see :class:`~localllm.models.rope.Rope`)."""
    angles = (positions.float() * scale)[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    if magnitude is not None:
        cos, sin = cos * magnitude, sin * magnitude
    return cos, sin


def rotate(x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], *, neox: bool):
    """Rotary position embedding (Su et al. 2021) on x: (n_heads, T, head_dim) float32.

    ``neox``: rotate the two halves of each head (GPT-NeoX, llama.cpp's LLAMA_ROPE_TYPE_NEOX);
    otherwise rotate adjacent pairs (llama.cpp's LLAMA_ROPE_TYPE_NORM).
    """
    cos, sin = cos_sin
    if neox:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def apply_rope(
    x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, *, neox: bool, scale: float = 1.0
) -> torch.Tensor:
    """:func:`rotate` by the angles of ``positions`` (see :func:`rope_angles`)."""
    return rotate(x, rope_angles(positions, inv_freq, scale), neox=neox)


# Scores of at most this many bytes at a time in :func:`attend` (prefill's working set).
ATTEND_CHUNK_BYTES = 2 << 20


def score_blocks(n_kv: int, group: int, t: int, s: int,
                 head_bytes: int = 0) -> Iterator[tuple[int, int, int, int]]:
    """The blocks :func:`attend` computes the (n_kv, group * t, s) float32 scores in:
    ``(h0, h1, r0, r1)``, KV heads h0..h1 and query rows r0..r1 of their groups, each block
    at most :data:`ATTEND_CHUNK_BYTES` (at least one row). Whole KV heads while one fits,
    else whole queries of a group (multiples of ``t`` rows), else part of one query head's
    rows; every row of every head once, in order. ``head_bytes``: bytes of one KV head's
    keys and values once dequantized (a quantized cache): a block of whole heads also keeps
    those within :data:`ATTEND_CHUNK_BYTES` (at least one head)."""
    rows = max(1, ATTEND_CHUNK_BYTES // (4 * s))  # score rows per block
    gt = group * t
    if rows >= gt:
        step = rows // gt
        if head_bytes:
            step = min(step, max(1, ATTEND_CHUNK_BYTES // head_bytes))
        for h0 in range(0, n_kv, step):
            yield h0, min(n_kv, h0 + step), 0, gt
        return
    span = rows // t * t if rows >= t else rows
    ends = range(span, gt + span, span) if rows >= t else \
        [min(m + t, r + span) for m in range(0, gt, t) for r in range(m, m + t, span)]
    for h in range(n_kv):
        r0 = 0
        for r1 in ends:
            r1 = min(r1, gt)
            yield h, h + 1, r0, r1
            r0 = r1


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    q_positions: torch.Tensor,
    k_positions: torch.Tensor | None,
    *,
    window: int | None,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention with grouped KV heads (GQA), float32.

    q: (n_heads, T, hd); keys/values: (n_kv_heads, S, hd) float32, float16 or bfloat16, or
    :class:`~localllm.memory.BlockRows` (a quantized cache: dequantized a block of heads at
    a time, inside the loop over score blocks, never as a whole);
    k_positions: (S,) int64 absolute positions (-1: empty slot), or None when slot ``j``
    holds position ``j`` -> (T, n_heads * hd) float32.
    ``softcap``: scores become ``softcap * tanh(scores / softcap)`` before the mask (Gemma 2's
    ``attn_logit_softcapping``, llama.cpp's ``hparams.attn_soft_cap``).
    ``sinks``: (n_heads,) float32, one learned logit per query head that joins the softmax's
    denominator and attends to nothing (gpt-oss's attention sinks; llama.cpp's
    ``ggml_soft_max_add_sinks``: ``p_j = exp(s_j - m) / (sum_i exp(s_i - m) + exp(sink - m))``,
    ``m`` the maximum of the scores and the sink, the sink neither scaled nor capped).
    ``chunk``: chunked local attention (see :func:`~localllm.memory.attention_mask`).
    Query head h reads KV head h // (n_heads / n_kv_heads), as llama.cpp does. The heads of a
    group are stacked into one product instead of repeating K/V: in decode this is several
    times faster on the CPU than torch's SDPA with a mask.
    """
    n_heads, t, hd = q.shape
    n_kv, s = keys.shape[0], keys.shape[1]
    group = n_heads // n_kv
    mask = attention_mask(q_positions, s if k_positions is None else k_positions,
                          window, chunk)  # (T, S)
    qg = q.reshape(n_kv, group * t, hd)  # (nkv, g*T, hd)
    # A long prompt's scores are large (32 heads x 512 x 512 x 4 bytes = 32 MiB): computed
    # in place (softmax included) in blocks of at most ATTEND_CHUNK_BYTES (score_blocks), so
    # that prefill's working set stays small; each row's result is the same either way.
    out = torch.empty(n_kv, group * t, hd, dtype=torch.float32, device=q.device)
    hidden = ~mask
    # each score row's sink: row r of KV head h belongs to query head h * group + r // t
    sink_rows = (None if sinks is None else
                 sinks.float().view(n_kv, group).repeat_interleave(t, dim=1)[..., None])
    blocks = isinstance(keys, BlockRows) or isinstance(values, BlockRows)
    head_bytes = 4 * s * (keys.shape[2] + values.shape[2]) if blocks else 0
    dense: tuple[int, int, torch.Tensor, torch.Tensor] | None = None  # the heads dequantized
    for h0, h1, r0, r1 in score_blocks(n_kv, group, t, s, head_bytes):
        if dense is None or dense[:2] != (h0, h1):  # the blocks of a head range come in a row
            dense = (h0, h1, keys[h0:h1].float(), values[h0:h1].float())
        scores = torch.matmul(qg[h0:h1, r0:r1], dense[2].transpose(1, 2))
        scores.mul_(scale)
        if softcap is not None:
            scores.div_(softcap).tanh_().mul_(softcap)
        if (r1 - r0) % t == 0:  # whole queries: r0 is a multiple of t too
            scores.view(h1 - h0, -1, t, s).masked_fill_(hidden, float("-inf"))
        else:  # part of one query head's rows
            scores.masked_fill_(hidden[r0 % t : r0 % t + r1 - r0], float("-inf"))
        if sink_rows is None:
            torch.softmax(scores, dim=-1, out=scores)
        else:
            sink_softmax_(scores, sink_rows[h0:h1, r0:r1])
        torch.matmul(scores, dense[3], out=out[h0:h1, r0:r1])  # (n, rows, hd)
        del scores
    return out.view(n_heads, t, hd).transpose(0, 1).reshape(t, n_heads * hd)


def sink_softmax_(scores: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Softmax over the last dim in place, with one more logit per row in the denominator
    (attention sinks, see :func:`attend`): scores (..., S) float32, sinks broadcastable to
    (..., 1). A row whose scores are all -inf becomes zeros (the sink takes everything)."""
    m = torch.maximum(scores.amax(-1, keepdim=True), sinks)
    scores.sub_(m).exp_()
    scores.div_(scores.sum(-1, keepdim=True) + (sinks - m).exp())
    return scores


def prefill_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                      q_positions: torch.Tensor, k_positions: torch.Tensor | None, *,
                      window: int | None, scale: float,
                      sinks: torch.Tensor | None = None,
                      chunk: int | None = None) -> torch.Tensor:
    """:func:`attend` (no soft-capping) in the cache's dtype through torch's fused
    ``scaled_dot_product_attention`` (float16 on CUDA: its memory-efficient kernel, after
    Rabe & Staats 2021; float32 accumulation), with no float32 copies of the keys and values.

    q: (n_heads, T, hd) float32; keys/values: (n_kv_heads, S, hd) float16/float32 ->
    (T, n_heads * hd) float32. A query with no visible key gives NaN, as ``attend``.
    ``sinks`` (n_heads,): attention sinks (see :func:`attend`), taken as one more key of
    zeros whose score is set by an additive mask to the head's sink logit, and whose value
    is zero (the sink in the cache's dtype: float16 on CUDA).
    """
    n_heads, t, hd = q.shape
    n_kv = keys.shape[0]
    group = n_heads // n_kv
    dt = keys.dtype
    mask = attention_mask(q_positions, keys.shape[1] if k_positions is None else k_positions,
                          window, chunk)  # (T, S)
    # A KV group's query heads as one longer query sequence (as attend does): no repeated
    # K/V, and no enable_gqa, which with a mask sends SDPA to its quadratic math backend.
    qg = q.to(dt).reshape(n_kv, group * t, hd)
    mask = mask.repeat(group, 1)  # (group * T, S)
    values = values.to(dt)
    if sinks is not None:
        zero = keys.new_zeros(n_kv, 1, hd)
        keys, values = torch.cat([keys, zero], 1), torch.cat([values, zero], 1)
        bias = torch.zeros(n_kv, group * t, mask.shape[1] + 1, dtype=dt, device=q.device)
        bias[..., :-1].masked_fill_(~mask, float("-inf"))
        bias[..., -1] = sinks.view(n_kv, group).repeat_interleave(t, dim=1).to(dt)
        mask = bias
    out = F.scaled_dot_product_attention(qg[None], keys[None], values[None],
                                         attn_mask=mask[None], scale=scale)
    return out[0].reshape(n_heads, t, hd).transpose(0, 1).reshape(t, n_heads * hd).float()


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (Hendrycks & Gimpel 2016), as Gemma's FFN uses it."""
    return F.gelu(x, approximate="tanh")


def xielu(x: torch.Tensor, alpha_n: float, alpha_p: float, beta: float, eps: float) -> torch.Tensor:
    """xIELU (Huang & Schlag 2025, "Deriving Activation Functions Using Integration"), as
    ggml's ``op_xielu`` computes it (``ggml/src/ggml-cpu/unary-ops.cpp``), element-wise on
    float32 x: ``alpha_p x^2 + beta x`` where x > 0, else
    ``alpha_n (expm1(min(x, eps)) - x) + beta x``. The parameters are the effective ones
    (``ggml_xielu``: alpha_p = softplus(a_p), alpha_n = beta + softplus(a_n) of the file's
    ``xielu.*`` values)."""
    pos = x * (x * alpha_p + beta)
    neg = (torch.expm1(torch.clamp(x, max=eps)) - x) * alpha_n + x * beta
    return torch.where(x > 0, pos, neg)


# Gate activations of gated FFNs (GEGLU, SwiGLU: Shazeer 2020) by name.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_tanh": gelu_tanh,
    "silu": F.silu,
}

# gpt-oss's clamped SwiGLU (llama.cpp's LLM_FFN_SWIGLU_OAI_MOE in src/llama-graph.cpp).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0


def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gpt-oss's gated activation, as ggml's ``ggml_swiglu_oai`` computes it
    (``ggml/src/ggml-cpu/ops.cpp``): ``x * sigmoid(alpha x) * (y + 1)`` with
    ``x = min(gate, limit)``, ``y = clamp(up, -limit, limit)``, alpha 1.702, limit 7.
    (T, F) float32 each -> (T, F) float32."""
    x = gate.clamp(max=SWIGLU_OAI_LIMIT)
    return x * torch.sigmoid(SWIGLU_OAI_ALPHA * x) * (up.clamp(-SWIGLU_OAI_LIMIT,
                                                               SWIGLU_OAI_LIMIT) + 1.0)


# Gated activations that are not ``act(gate) * up``, by name.
GATED: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "swiglu_oai": swiglu_oai,
}


class TorchOps:
    """Norms, RoPE, activations and attention as torch operations: the torch backend, on
    every device.

    A model calls ``ops.rope_angles`` once per forward (the result is opaque to the model),
    then per layer ``ops.self_attention`` (QK-norm and RoPE of the projected queries and
    keys, the KV-cache write and attention), ``ops.residual_norm`` after each sublayer and
    ``ops.gated`` (or ``ops.experts``) in the FFN. The Triton backend's ``KernelOps``
    computes the same with the Triton kernels, fusing each of these into one launch (a decode
    token's ``self_attention``: two); the native backend's ``NativeOps`` with the native CPU
    kernels.
    """

    rms_norm = staticmethod(rms_norm)
    rope_angles = staticmethod(rope_angles)
    rotate = staticmethod(rotate)
    xielu = staticmethod(xielu)  # Apertus' FFN activation (not gated)

    def norm_rope(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float, angles, *,
                  neox: bool) -> torch.Tensor:
        """RoPE of RMSNorm(x) (QK-norm), or of x when ``weight`` is None; x (H, T, D)."""
        if weight is not None:
            x = self.rms_norm(x, weight, eps)
        return self.rotate(x, angles, neox=neox)

    def residual_norm(self, x: torch.Tensor, f: torch.Tensor, post_weight: torch.Tensor | None,
                      weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the next pre-norm: h = x + f (f post-normed by
        ``post_weight`` when given, as Gemma does) and RMSNorm(h); (T, D) each."""
        h = x + (f if post_weight is None else self.rms_norm(f, post_weight, eps))
        return h, self.rms_norm(h, weight, eps)

    @staticmethod
    def gated(gate: torch.Tensor, up: torch.Tensor, act: str, *,
              overwrite: bool = False) -> torch.Tensor:
        """act(gate) * up (T, F), ``act`` a key of :data:`ACTIVATIONS`, or the gated
        function :data:`GATED` names (``swiglu_oai``). ``overwrite``: the caller no longer
        needs ``gate``, and the result may be written over it (the native ops do: no buffer
        of its own; these return a new tensor)."""
        if act in GATED:
            return GATED[act](gate, up)
        return ACTIVATIONS[act](gate) * up

    def self_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        q_norm: torch.Tensor | None,
        k_norm: torch.Tensor | None,
        eps: float,
        angles,
        cache,
        pos: int | torch.Tensor,
        positions: torch.Tensor,
        *,
        head_dim: int,
        neox: bool,
        scale: float,
        softcap: float | None = None,
        norm_after_rope: bool = False,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The attention of a layer from its projections: per-head RMSNorm of q and k by
        ``q_norm`` / ``k_norm`` when given (QK-norm), RoPE by ``angles`` (from
        :meth:`rope_angles`; ``neox``: halves, else adjacent pairs), then :meth:`attention`.
        ``norm_after_rope``: the QK-norm follows the rotation instead (Hunyuan,
        llama.cpp's ``hunyuan-vl.cpp``).

        q: (T, n_heads * head_dim), k/v: (T, n_kv_heads * head_dim) float32 (views with unit
        column stride) -> (T, n_heads * head_dim) float32. ``sinks``: (n_heads,) float32
        attention sinks (see :func:`attend`), or None.
        """
        t = q.shape[0]
        q = q.reshape(t, -1, head_dim).transpose(0, 1)  # (nh, T, hd)
        k = k.reshape(t, -1, head_dim).transpose(0, 1)  # (nkv, T, hd)
        v = v.reshape(t, -1, head_dim).transpose(0, 1)
        if norm_after_rope:
            q = self.rms_norm(self.norm_rope(q, None, eps, angles, neox=neox), q_norm, eps)
            k = self.rms_norm(self.norm_rope(k, None, eps, angles, neox=neox), k_norm, eps)
        else:
            q = self.norm_rope(q, q_norm, eps, angles, neox=neox)
            k = self.norm_rope(k, k_norm, eps, angles, neox=neox)
        return self.attention(q, k, v, cache, pos, positions, scale=scale, softcap=softcap,
                              sinks=sinks)

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cache,
        pos: int | torch.Tensor,
        positions: torch.Tensor,
        *,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store the new keys/values in ``cache`` and attend the new queries over it.

        q: (n_heads, T, hd), k/v: (n_kv_heads, T, hd) float32 at ``positions`` (T,) int64, the
        first of which is ``pos`` (an int, or a (1,) device tensor in static decode: see
        :mod:`localllm.memory.kv`) -> (T, n_heads * hd) float32. ``sinks``: see :func:`attend`.
        """
        keys, values, k_pos = store_kv(cache, pos, k, v)
        return attend(q, keys, values, positions, k_pos, window=cache.window, scale=scale,
                      softcap=softcap, sinks=sinks, chunk=cache.chunk)

    def attention_shared(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache,
                         pos: int | torch.Tensor, positions: torch.Tensor, *, scale: float,
                         softcap: float | None = None):
        """:meth:`attention`, also returning what the queries attended over, for layers that
        share this layer's keys and values (Gemma 3n/4's shared-KV layers: llama.cpp's
        ``layer_reuse_cb``): (out (T, n_heads * hd), kv), ``kv`` opaque, for
        :meth:`attend_shared`. q, k, v as :meth:`attention` takes them."""
        keys, values, k_pos = store_kv(cache, pos, k, v)
        out = attend(q, keys, values, positions, k_pos, window=cache.window, scale=scale,
                     softcap=softcap, chunk=cache.chunk)
        return out, (keys, values, k_pos)

    def attend_shared(self, q: torch.Tensor, kv, positions: torch.Tensor, *,
                      window: int | None, scale: float,
                      softcap: float | None = None) -> torch.Tensor:
        """Queries q (n_heads, T, hd) float32 at ``positions`` over another layer's keys and
        values of the same step (``kv`` from :meth:`attention_shared`), with this layer's
        ``window`` -> (T, n_heads * hd) float32; nothing is stored."""
        keys, values, k_pos = kv
        return attend(q, keys, values, positions, k_pos, window=window, scale=scale,
                      softcap=softcap)

    def mla_attention(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_b: torch.Tensor,
        v_b: torch.Tensor,
        cache,
        pos: int | torch.Tensor,
        positions: torch.Tensor,
        *,
        scale: float,
    ) -> torch.Tensor:
        """Multi-head latent attention over a latent cache with absorbed projections
        (DeepSeek-V2, Liu et al. 2024; llama.cpp's ``src/models/deepseek2.cpp``, MLA branch):
        each head's query is taken into the latent space, ``[k_b[h] @ q_nope[h], q_pe[h]]``,
        and attends over the cached latents ``[c, k_pe]`` of every position as one shared
        key (MQA); the values are the latents' first ``kv_lora_rank`` values ``c``, and each
        head's result is expanded by ``v_b[h]``. Only the latent is stored.

        q_nope: (H, T, nope), q_pe: (H, T, n_rot) (rotated) float32; latent: (T, r + n_rot)
        float32, the new positions' ``[c, k_pe]`` (c RMS-normed, k_pe rotated), written into
        ``cache`` (a :class:`~localllm.memory.LatentCache`) at ``positions`` (T,) int64 from
        ``pos`` (an int, or a (1,) device tensor in static decode); k_b: (H, r, nope), v_b:
        (H, dv, r), each as :meth:`mla_heads` gave it -> (T, H * dv) float32.
        """
        h, t, _ = q_nope.shape
        r = k_b.shape[1]
        if isinstance(pos, torch.Tensor):
            cached = cache.update_static(pos, latent)
        else:
            cached = cache.update(pos, latent)
        q = torch.cat([self.per_head(q_nope, k_b), q_pe], dim=-1)  # (H, T, D)
        kv = cached[None]  # (1, S, D): the latent is both keys and (its first r) values
        out = attend(q, kv, kv, positions, None, window=None, scale=scale)  # (T, H * D)
        o = out.view(t, h, -1)[:, :, :r].transpose(0, 1)  # (H, T, r)
        return self.per_head(o, v_b).transpose(0, 1).reshape(t, -1)

    @staticmethod
    def mla_heads(w, device) -> torch.Tensor:
        """MLA's per-head matrices ``attn_k_b`` / ``attn_v_b`` (an :class:`ExpertMatrix`
        (H, out, in), one matrix per head) in the form :meth:`mla_attention` takes: here
        one dense float32 tensor (H, out, in) (each head multiplies the identity: exact for
        every kind; once, at load), so that every head's matrix is one batched product."""
        eye = torch.eye(w.shape[2], dtype=torch.float32, device=device)
        return torch.stack([w(eye, h).T for h in range(w.shape[0])]).float().contiguous()

    @staticmethod
    def per_head(x: torch.Tensor, w) -> torch.Tensor:
        """Head h of x (H, T, in) float32 through head h's matrix of ``w`` (from
        :meth:`mla_heads`) -> (H, T, out) float32."""
        return torch.matmul(x, w.transpose(1, 2))

    @staticmethod
    def short_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   state: torch.Tensor, *, silu: bool) -> torch.Tensor:
        """Causal depthwise convolution continuing from ``state`` (updated in place):
        x (T, C), weight (C, d_conv), bias (C,) or None, state (d_conv - 1, C) float32 ->
        (T, C) float32 (:func:`localllm.backends.ssm.short_conv`)."""
        return ssm.short_conv(x, weight, bias, state, silu=silu)

    @staticmethod
    def ssm_scan(x: torch.Tensor, dt: torch.Tensor, dt_bias: torch.Tensor, a: torch.Tensor,
                 b: torch.Tensor, c: torch.Tensor, d: torch.Tensor | None,
                 state: torch.Tensor) -> torch.Tensor:
        """Mamba2's selective scan continuing from ``state`` (H, P, N), updated in place:
        x (T, H, P), dt (T, H), dt_bias / a / d (H,), b / c (T, G, N) float32 ->
        y (T, H, P) float32 (:func:`localllm.backends.ssm.ssm_scan`: the recurrence for one
        token, the chunked form for more)."""
        return ssm.ssm_scan(x, dt, dt_bias, a, b, c, d, state)

    @staticmethod
    def gated_delta_net(qkv: torch.Tensor, alpha: torch.Tensor, beta_logit: torch.Tensor,
                        dt_bias: torch.Tensor, a: torch.Tensor, state: torch.Tensor, *,
                        n_k_heads: int, eps: float, interleave: bool) -> torch.Tensor:
        """A gated delta-net's recurrence from its convolved projections, continuing from
        ``state`` (Hv, S, S), updated in place: qkv (T, 2 Hk S + Hv S), alpha / beta_logit
        (T, Hv), dt_bias / a (Hv,) float32 -> (T, Hv, S) float32
        (:func:`localllm.backends.deltanet.gated_delta_net`: the recurrence for one token,
        the chunked form for more)."""
        return deltanet.gated_delta_net(qkv, alpha, beta_logit, dt_bias, a, state,
                                        n_k_heads=n_k_heads, eps=eps, interleave=interleave)

    def experts(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate,
                up, down, act: str, *, shared: SharedExpert | None = None) -> torch.Tensor:
        """The routed experts of a mixture-of-experts FFN, after the routing (llama.cpp's
        ``build_moe_ffn``, ``src/llama-graph.cpp``):
        ``out[t] = sum_j weights[t, j] * down_e(act(gate_e(x[t])) * up_e(x[t]))``,
        ``e = chosen[t, j]``, plus the layer's ``shared`` expert when given
        (:class:`~localllm.backends.SharedExpert`, added after the routed sum).

        x: (T, d) float32; chosen: (T, k) int64; weights: (T, k) float32; gate, up, down:
        :class:`~localllm.backends.ExpertMatrix` (``up`` None: ``gate`` holds each
        expert's gate rows then its up rows, llama.cpp's ``ffn_gate_up_exps``) -> (T, d)
        float32. Tokens are grouped by expert: each selected expert multiplies the rows
        routed to it, no other expert is read; one token (decode) runs its k experts
        directly, without the grouping's gathers and scatters.
        """
        out = self._routed(x, chosen, weights, gate, up, down, act)
        return out if shared is None else self.add_shared(out, x, shared)

    def add_shared(self, out: torch.Tensor, x: torch.Tensor, shared: SharedExpert
                   ) -> torch.Tensor:
        """``out += weight * down(silu(gate) * up)`` of the shared expert on ``shared.x``
        or x (T, d) float32 -> out."""
        g, u = shared.gate_up(x if shared.x is None else shared.x)
        y = shared.down(self.gated(g, u, "silu", overwrite=True))
        if shared.weight is not None:
            y = y.mul_(shared.weight)
        return out.add_(y)

    def _routed(self, x, chosen, weights, gate, up, down, act):
        """The routed sum of :meth:`experts` -> a new (T, d) float32 tensor."""
        def hidden(xe: torch.Tensor, e: int) -> torch.Tensor:
            if up is None:  # the halves contiguous, as the kernels' gated functions read them
                g, u = (h.contiguous() for h in gate(xe, e).chunk(2, -1))
                return self.gated(g, u, act, overwrite=True)
            return self.gated(gate(xe, e), up(xe, e), act)

        out = torch.zeros_like(x)
        if x.shape[0] == 1:
            for w, e in zip(weights[0].tolist(), chosen[0].tolist()):
                out += down(hidden(x, e), e) * w
            return out
        for e in chosen.unique().tolist():
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            out.index_add_(0, rows, down(hidden(x[rows], e), e) * weights[rows, slot, None])
        return out


def store_kv(cache, pos: int | torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """``cache.update`` (an int position) or ``cache.update_static`` (a (1,) device position,
    static decode): (keys, values, key positions or None)."""
    if isinstance(pos, torch.Tensor):
        return cache.update_static(pos, k, v)
    return cache.update(pos, k, v)
