// Native CPU kernels of localllm: the fused element-wise work of a decoder layer.
//
// Registered beside csrc/qmatmul.cpp's products, as torch.ops.localllm_cpu.* (float32):
//   rms_norm(x, w, eps) -> n                       n = x / rms(x) * w, rows of x (N, D)
//   residual_norm(x, f, post_w, w, eps) -> (h, n)  h = x + [rms_norm(f, post_w)], n = rms_norm(h, w)
//   gated(gate, up, act, out=None) -> y            y = act(gate) * up; act 0: SiLU, 1: GELU (tanh);
//                                                  2: gpt-oss's clamped SwiGLU (swiglu_oai);
//                                                  into `out` when given (may be gate itself)
//   norm_rope(x, w, eps, cos, sin, neox) -> y      RoPE of [rms_norm](x), x (H, T, D)
//   attn_decode(q, k, v, q_norm, k_norm, eps, cos, sin, neox,
//               k_cache, v_cache, k_pos, slot, live, pos, window, scale, softcap,
//               sinks=None) -> o
//       the attention step of T new tokens at positions pos .. pos+T-1 (decode: T = 1; a few
//       tokens): QK-norm + RoPE of q and k, k and v written into cache cells slot ..
//       slot+T-1 (and their positions into k_pos), then grouped-query attention of each
//       query over the first `live` cells (masked by their positions: empty, after the
//       query, or outside the window); `sinks` (n_heads,) adds one logit per head to the
//       softmax's denominator (gpt-oss's attention sinks, ggml_soft_max_add_sinks). The
//       caches hold float32 or float16 (the native backend's, as llama.cpp's default KV
//       type); new cells are rounded to nearest.
//
// They replace the torch compositions of localllm.models.common.TorchOps (rms_norm,
// residual_norm, gated, norm_rope, attention) operation for operation: element-wise
// products round as torch's do (-ffp-contract=off), sums run in another order, and
// exp/tanh are computed here (a Cephes-style polynomial, within 2 ulp), so results agree
// with torch to float32 rounding. RMSNorm: Zhang & Sennrich 2019; RoPE: Su et al. 2021 (normal
// = adjacent pairs, neox = halves, llama.cpp's LLAMA_ROPE_TYPE_NORM / _NEOX); GELU (tanh):
// Hendrycks & Gimpel 2016, computed as x * sigmoid(2u) = 0.5 x (1 + tanh(u)); soft-capping:
// Gemma 2 (llama.cpp's attn_soft_cap). Gemma's (1 + w) norm weights arrive with the 1 added
// (llama.cpp's converter does it), so every norm here is x / rms(x) * w.
//
// Vectorized 16 lanes at a time (simd.h's vf: AVX-512, AVX2 or portable, chosen at compile
// time, -march=native). Rows (and attention heads) are split over
// threads with at::parallel_for only when there is enough work (prefill); a one-token step
// runs on the calling thread.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "checks.h"
#include "simd.h"

namespace {

// Elements per parallel task: below this a loop stays on the calling thread.
constexpr int64_t GRAIN = 1 << 15;

// A KV-cache row's values as floats: the cache holds float32 or float16 (half the memory,
// as llama.cpp's default f16 cache; converted on load, F16C's vcvtph2ps).
inline float kv_value(float x) { return x; }
inline float kv_value(at::Half x) { return static_cast<float>(x); }
inline vf vload_kv(const float* p) { return vload(p); }
inline vf vload_kv(const at::Half* p) { return vload_f16(p); }

// Sum of squares of x[0 .. n-1].
inline float sum_squares(const float* x, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
  vf acc = vset1(0.0f);
  for (; i + VL <= n; i += VL) {
    const vf v = vload(x + i);
    acc = vfma(v, v, acc);
  }
  s = vsum(acc);
  for (; i < n; ++i) s += x[i] * x[i];
  return s;
}

// 1 / rms(x) as torch's x.pow(2).mean(-1) + eps, then rsqrt (= 1 / sqrt).
inline float inv_rms(const float* x, int64_t n, float eps) {
  return 1.0f / std::sqrt(sum_squares(x, n) / float(n) + eps);
}

// y = (x * r) * w (w may be null: y = x * r), two roundings per element as torch's.
inline void scale_rows(const float* x, float r, const float* w, float* y, int64_t n) {
  int64_t i = 0;
  const vf vr = vset1(r);
  if (w)
    for (; i + VL <= n; i += VL) vstore(y + i, vmul(vmul(vload(x + i), vr), vload(w + i)));
  else
    for (; i + VL <= n; i += VL) vstore(y + i, vmul(vload(x + i), vr));
  for (; i < n; ++i) y[i] = w ? (x[i] * r) * w[i] : x[i] * r;
}

// y = x + f
inline void add_rows(const float* x, const float* f, float* y, int64_t n) {
  int64_t i = 0;
  for (; i + VL <= n; i += VL) vstore(y + i, vadd(vload(x + i), vload(f + i)));
  for (; i < n; ++i) y[i] = x[i] + f[i];
}

// RoPE of one head x (D) into y (D, may alias x): pairs (i, i + D/2) with neox, else
// (2i, 2i + 1); a' = a cos - b sin, b' = b cos + a sin (each product rounded, as torch's).
inline void rope_head(const float* x, const float* cs, const float* sn, bool neox, float* y,
                      int64_t d) {
  const int64_t half = d / 2;
  if (neox) {
    int64_t i = 0;
    for (; i + VL <= half; i += VL) {
      const vf a = vload(x + i), b = vload(x + half + i), c = vload(cs + i), s = vload(sn + i);
      const vf ya = vsub(vmul(a, c), vmul(b, s));
      const vf yb = vadd(vmul(b, c), vmul(a, s));
      vstore(y + i, ya);
      vstore(y + half + i, yb);
    }
    for (; i < half; ++i) {
      const float a = x[i], b = x[half + i];
      y[i] = a * cs[i] - b * sn[i];
      y[half + i] = b * cs[i] + a * sn[i];
    }
    return;
  }
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[2 * i], b = x[2 * i + 1];
    y[2 * i] = a * cs[i] - b * sn[i];
    y[2 * i + 1] = b * cs[i] + a * sn[i];
  }
}

// [RMSNorm with w, then] RoPE of one head x (D) into y (D); tmp: D floats of scratch.
inline void norm_rope_head(const float* x, const float* w, float eps, const float* cs,
                           const float* sn, bool neox, float* y, float* tmp, int64_t d) {
  if (w) {
    scale_rows(x, inv_rms(x, d, eps), w, tmp, d);
    x = tmp;
  }
  rope_head(x, cs, sn, neox, y, d);
}

// ---- one-token attention: several query heads of one KV head at a time ------------------

// Weights below this are skipped in the value sum: the masked cells' exp(-87) or 0, which
// add nothing a float can hold against the total (>= 1, the maximum's own weight).
constexpr float TINY = 1e-30f;

// out[i] = q[i] . k (d values) for NB query heads: each key vector is loaded once for all.
template <int NB, typename KT>
inline void head_dots(const float* const* q, const KT* k, int64_t d, float* out) {
  int64_t c = 0;
  for (int i = 0; i < NB; ++i) out[i] = 0.0f;
  vf acc[NB];
  for (int i = 0; i < NB; ++i) acc[i] = vset1(0.0f);
  for (; c + VL <= d; c += VL) {
    const vf kv = vload_kv(k + c);
    for (int i = 0; i < NB; ++i) acc[i] = vfma(vload(q[i] + c), kv, acc[i]);
  }
  for (int i = 0; i < NB; ++i) out[i] = vsum(acc[i]);
  for (; c < d; ++c)
    for (int i = 0; i < NB; ++i) out[i] += q[i][c] * kv_value(k[c]);
}

// o[i][c0 .. c0 + B*VL) = sum_j w[i * ld + j] * v[j * d + c0 ..] for NB heads and cells
// j < live, the NB * B sums held in registers over all cells j (each value vector loaded
// once). Each sum runs over j in order whatever NB and B are: a head's output does not depend
// on which heads share its call.
template <int NB, int B, typename KT>
inline void weighted_block(const float* w, int64_t ld, int64_t live, const KT* v, int64_t d,
                           int64_t c0, float* const* o) {
  vf acc[NB][B];
  for (int i = 0; i < NB; ++i)
    for (int b = 0; b < B; ++b) acc[i][b] = vset1(0.0f);
  for (int64_t j = 0; j < live; ++j) {
    const KT* vj = v + j * d + c0;
    for (int i = 0; i < NB; ++i) {
      const float wij = w[i * ld + j];
      if (wij <= TINY) continue;
      const vf p = vset1(wij);
      for (int b = 0; b < B; ++b) acc[i][b] = vfma(p, vload_kv(vj + b * VL), acc[i][b]);
    }
  }
  for (int i = 0; i < NB; ++i)
    for (int b = 0; b < B; ++b) vstore(o[i] + c0 + b * VL, acc[i][b]);
}

// o[i][0 .. d) = sum_j w[i * ld + j] * v[j * d ..] for NB heads and cells j < live.
template <int NB, typename KT>
inline void weighted_values(const float* w, int64_t ld, int64_t live, const KT* v, int64_t d,
                            float* const* o) {
  int64_t c0 = 0;
  constexpr int ACC = VF_REGS / 2;  // accumulators: half the register file
  constexpr int B = ACC / NB;
  for (; c0 + B * VL <= d; c0 += B * VL) weighted_block<NB, B, KT>(w, ld, live, v, d, c0, o);
  for (; c0 + VL <= d; c0 += VL) weighted_block<NB, 1, KT>(w, ld, live, v, d, c0, o);
  for (int i = 0; i < NB; ++i)
    for (int64_t c = c0; c < d; ++c) o[i][c] = 0.0f;
  if (c0 < d)
    for (int64_t j = 0; j < live; ++j)
      for (int i = 0; i < NB; ++i) {
        const float wij = w[i * ld + j];
        if (wij > TINY)
          for (int64_t c = c0; c < d; ++c) o[i][c] += wij * kv_value(v[j * d + c]);
      }
}


// ---- argument checks ---------------------------------------------------------------------

void check_rows(const at::Tensor& x, const char* op, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 &&
                  x.stride(1) == 1, "localllm_cpu.", op, ": ", name,
              " must be a (N, D) float32 CPU tensor with unit column stride");
}

const float* vec_or_null(const std::optional<at::Tensor>& w, int64_t n, const char* op) {
  if (!w.has_value() || !w->defined()) return nullptr;
  TORCH_CHECK(w->scalar_type() == at::kFloat && w->is_contiguous() && w->numel() == n,
              "localllm_cpu.", op, ": a norm weight must be ", n, " contiguous float32 values");
  return w->data_ptr<float>();
}

int64_t grain_rows(int64_t d) { return std::max<int64_t>(1, GRAIN / std::max<int64_t>(d, 1)); }

// ---- operators ---------------------------------------------------------------------------

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "rms_norm", "x");
  const int64_t n = x.size(0), d = x.size(1), ldx = x.stride(0);
  const float* wp = vec_or_null(w, d, "rms_norm");
  at::Tensor y = at::empty({n, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float e = float(eps);
  at::parallel_for(0, n, grain_rows(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * ldx;
      scale_rows(xr, inv_rms(xr, d, e), wp, yp + r * d, d);
    }
  });
  return y;
}

std::tuple<at::Tensor, at::Tensor> residual_norm(const at::Tensor& x, const at::Tensor& f,
                                                 const std::optional<at::Tensor>& post_w,
                                                 const at::Tensor& w, double eps) {
  check_rows(x, "residual_norm", "x");
  check_rows(f, "residual_norm", "f");
  const int64_t n = x.size(0), d = x.size(1), ldx = x.stride(0), ldf = f.stride(0);
  TORCH_CHECK(f.size(0) == n && f.size(1) == d, "localllm_cpu.residual_norm: f must match x");
  const float* pw = vec_or_null(post_w, d, "residual_norm");
  const float* wp = vec_or_null(w, d, "residual_norm");
  at::Tensor h = at::empty({n, d}, x.options());
  at::Tensor y = at::empty({n, d}, x.options());
  const float *xp = x.data_ptr<float>(), *fp = f.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>();
  const float e = float(eps);
  at::parallel_for(0, n, grain_rows(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* fr = fp + r * ldf;
      float* hr = hp + r * d;
      if (pw) {  // the post-norm of f, written into h, then the residual add in place
        scale_rows(fr, inv_rms(fr, d, e), pw, hr, d);
        fr = hr;
      }
      add_rows(xp + r * ldx, fr, hr, d);
      scale_rows(hr, inv_rms(hr, d, e), wp, yp + r * d, d);
    }
  });
  return {h, y};
}

enum Act : int64_t { SILU = 0, GELU_TANH = 1, SWIGLU_OAI = 2 };

// gpt-oss's clamped SwiGLU (ggml's swiglu_oai, llama.cpp's LLM_FFN_SWIGLU_OAI_MOE).
constexpr float OAI_ALPHA = 1.702f, OAI_LIMIT = 7.0f;

// act(g) * u for n values; SiLU: g / (1 + exp(-g)); GELU (tanh): g / (1 + exp(-2u)),
// u = sqrt(2/pi) (g + 0.044715 g^3); swiglu_oai: x / (1 + exp(-alpha x)) * (y + 1) with
// x = min(g, limit), y = clamp(u, -limit, limit) (ggml-cpu ops.cpp's swiglu_oai).
inline void gated_row(const float* g, const float* u, float* y, int64_t n, int64_t act) {
  constexpr float K0 = 0.7978845608028654f, K1 = 0.044715f;
  int64_t i = 0;
  const vf one = vset1(1.0f);
  if (act == SILU) {
    for (; i + VL <= n; i += VL) {
      const vf x = vload(g + i);
      const vf e = vexp(vsub(vset1(0.0f), x));
      vstore(y + i, vmul(vdiv(x, vadd(one, e)), vload(u + i)));
    }
  } else if (act == SWIGLU_OAI) {
    const vf lim = vset1(OAI_LIMIT), nlim = vset1(-OAI_LIMIT), na = vset1(-OAI_ALPHA);
    for (; i + VL <= n; i += VL) {
      const vf x = vmin(vload(g + i), lim);
      const vf e = vexp(vmul(na, x));
      const vf up1 = vadd(vmin(vmax(vload(u + i), nlim), lim), one);
      vstore(y + i, vmul(vdiv(x, vadd(one, e)), up1));
    }
  } else {
    const vf k0 = vset1(-2.0f * K0), k1 = vset1(K1);
    for (; i + VL <= n; i += VL) {
      const vf x = vload(g + i);
      const vf inner = vadd(x, vmul(k1, vmul(x, vmul(x, x))));
      const vf e = vexp(vmul(k0, inner));
      vstore(y + i, vmul(vdiv(x, vadd(one, e)), vload(u + i)));
    }
  }
  for (; i < n; ++i) {
    if (act == SWIGLU_OAI) {
      const float x = std::min(g[i], OAI_LIMIT);
      y[i] = (x / (1.0f + std::exp(-OAI_ALPHA * x))) *
             (std::min(std::max(u[i], -OAI_LIMIT), OAI_LIMIT) + 1.0f);
      continue;
    }
    const float x = g[i];
    const float e = act == SILU ? std::exp(-x) : std::exp(-2.0f * K0 * (x + K1 * (x * x * x)));
    y[i] = (x / (1.0f + e)) * u[i];
  }
}

at::Tensor gated(const at::Tensor& gate, const at::Tensor& up, int64_t act,
                 const std::optional<at::Tensor>& out) {
  check_rows(gate, "gated", "gate");
  check_rows(up, "gated", "up");
  TORCH_CHECK(act == SILU || act == GELU_TANH || act == SWIGLU_OAI,
              "localllm_cpu.gated: act 0 (SiLU), 1 (GELU) or 2 (swiglu_oai)");
  const int64_t n = gate.size(0), d = gate.size(1);
  TORCH_CHECK(up.size(0) == n && up.size(1) == d, "localllm_cpu.gated: up must match gate");
  // Each value is read before it is written at the same index, so `out` may be gate (or up):
  // the FFN's activation then takes no buffer of its own (prefill: T x ffn_dim floats).
  at::Tensor y = out.has_value() && out->defined() ? *out : at::empty({n, d}, gate.options());
  check_rows(y, "gated", "out");
  TORCH_CHECK(y.size(0) == n && y.size(1) == d, "localllm_cpu.gated: out must match gate");
  const float *gp = gate.data_ptr<float>(), *up_ = up.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldg = gate.stride(0), ldu = up.stride(0), ldy = y.stride(0);
  at::parallel_for(0, n, grain_rows(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) gated_row(gp + r * ldg, up_ + r * ldu, yp + r * ldy, d, act);
  });
  return y;
}

void check_angles(const at::Tensor& cs, const at::Tensor& sn, int64_t t, int64_t d, const char* op) {
  TORCH_CHECK(cs.scalar_type() == at::kFloat && sn.scalar_type() == at::kFloat &&
                  cs.is_contiguous() && sn.is_contiguous() && cs.numel() == t * (d / 2) &&
                  sn.numel() == t * (d / 2) && d % 2 == 0,
              "localllm_cpu.", op, ": cos and sin must be (T, D/2) contiguous float32");
}

// x (H, T, D), any strides with unit stride in D -> y (H, T, D) contiguous.
at::Tensor norm_rope(const at::Tensor& x, const std::optional<at::Tensor>& w, double eps,
                     const at::Tensor& cs, const at::Tensor& sn, bool neox) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "localllm_cpu.norm_rope: x must be (H, T, D) float32 with unit stride in D");
  const int64_t nh = x.size(0), t = x.size(1), d = x.size(2);
  check_angles(cs, sn, t, d, "norm_rope");
  const float* wp = vec_or_null(w, d, "norm_rope");
  at::Tensor y = at::empty({nh, t, d}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), half = d / 2;
  const float e = float(eps);
  at::parallel_for(0, nh * t, grain_rows(d), [&](int64_t r0, int64_t r1) {
    std::vector<float> tmp(d);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t h = r / t, i = r % t;
      norm_rope_head(xp + h * s0 + i * s1, wp, e, cp + i * half, sp + i * half, neox,
                     yp + r * d, tmp.data(), d);
    }
  });
  return y;
}

at::Tensor attn_decode(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& q_norm,
                       const std::optional<at::Tensor>& k_norm, double eps,
                       const at::Tensor& cs, const at::Tensor& sn, bool neox,
                       at::Tensor& k_cache, at::Tensor& v_cache, at::Tensor& k_pos,
                       int64_t slot, int64_t live, int64_t pos, int64_t window, double scale,
                       double softcap, const std::optional<at::Tensor>& sinks) {
  const bool half_kv = k_cache.scalar_type() == at::kHalf;
  TORCH_CHECK((half_kv || k_cache.scalar_type() == at::kFloat) && k_cache.dim() == 3 &&
                  k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
                  v_cache.scalar_type() == k_cache.scalar_type() && v_cache.is_contiguous(),
              "localllm_cpu.attn_decode: the caches must be (n_kv, size, D) contiguous float32 "
              "or float16");
  const int64_t nkv = k_cache.size(0), size = k_cache.size(1), d = k_cache.size(2);
  check_rows(q, "attn_decode", "q");
  check_rows(k, "attn_decode", "k");
  check_rows(v, "attn_decode", "v");
  const int64_t nt = q.size(0);
  TORCH_CHECK(q.size(1) % d == 0 && q.size(1) / d % nkv == 0,
              "localllm_cpu.attn_decode: q must be (T, n_heads * D)");
  const int64_t nh = q.size(1) / d, group = nh / nkv;
  TORCH_CHECK(k.size(0) == nt && v.size(0) == nt && k.size(1) == nkv * d &&
                  v.size(1) == nkv * d,
              "localllm_cpu.attn_decode: k and v must be (T, n_kv * D)");
  check_angles(cs, sn, nt, d, "attn_decode");
  int64_t* const kpw = check_cells(k_pos, size, nt, slot, live, pos, "attn_decode");
  const float* qw = vec_or_null(q_norm, d, "attn_decode");
  const float* kw = vec_or_null(k_norm, d, "attn_decode");
  const float* sk = vec_or_null(sinks, nh, "attn_decode");  // per query head, or null
  const float e = float(eps), sc = float(scale), cap = float(softcap);
  const float *cp = cs.data_ptr<float>(), *sp = sn.data_ptr<float>();
  const int64_t half = d / 2;
  at::Tensor out = at::empty({nt, q.size(1)}, q.options());
  // The same steps over a float32 or a float16 cache (KT: its element type).
  auto step = [&](auto* kc, auto* vc) {
    using KT = std::remove_pointer_t<decltype(kc)>;

    // The new keys and values into cells slot .. slot + T - 1, the rotated queries into qr.
    std::vector<float> tmp(d), row(d), qr(nt * nh * d);
    const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *qp = q.data_ptr<float>();
    const int64_t ldq = q.stride(0), ldk = k.stride(0), ldv = v.stride(0);
    for (int64_t t = 0; t < nt; ++t) {
      const float *ct = cp + t * half, *st = sp + t * half;
      for (int64_t g = 0; g < nkv; ++g) {
        const int64_t cell = (g * size + slot + t) * d;
        if constexpr (std::is_same_v<KT, float>) {
          norm_rope_head(kp + t * ldk + g * d, kw, e, ct, st, neox, kc + cell, tmp.data(), d);
          std::memcpy(vc + cell, vp + t * ldv + g * d, d * sizeof(float));
        } else {  // rounded to nearest as torch's float16 copy of the prefill's rows
          norm_rope_head(kp + t * ldk + g * d, kw, e, ct, st, neox, row.data(), tmp.data(), d);
          const float* vr = vp + t * ldv + g * d;
          for (int64_t c = 0; c < d; ++c) {
            kc[cell + c] = static_cast<KT>(row[c]);
            vc[cell + c] = static_cast<KT>(vr[c]);
          }
        }
      }
      for (int64_t h = 0; h < nh; ++h)
        norm_rope_head(qp + t * ldq + h * d, qw, e, ct, st, neox, qr.data() + (t * nh + h) * d,
                       tmp.data(), d);
      if (kpw) kpw[slot + t] = pos + t;
    }
    const int64_t* kpos = kpw;

    float* op = out.data_ptr<float>();
    const float ninf = -std::numeric_limits<float>::infinity();
    auto visible = [&](int64_t j, int64_t qpos) {  // cell j for the query at position qpos
      const int64_t p = kpos ? kpos[j] : j;
      return p >= 0 && p <= qpos && (window <= 0 || qpos - p < window);
  };
  // Threads take ranges of (token, query head) pairs; the heads of a range that share a
  // token and a KV head go together, so each key and value row is read once for all of
  // them (GQA). Query t attends over cells_seen (checks.h).
  const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(live * d, 1));
  at::parallel_for(0, nt * nh, grain, [&](int64_t u0, int64_t u1) {
    std::vector<float> s((u1 - u0) * live), mx(u1 - u0), total(u1 - u0);
    for (int64_t ua = u0; ua < u1;) {
      const int64_t t = ua / nh, ha = ua % nh, g = ha / group;
      const int64_t hb = std::min({u1 - t * nh, (g + 1) * group, nh}), n = hb - ha;
      const int64_t qpos = pos + t, lt = cells_seen(live, nt, t);
      const KT* kg = kc + g * size * d;
      const KT* vg = vc + g * size * d;
      float* sa = s.data() + (ua - u0) * live;  // scores of head ha + i at sa[i * live + j]
      const float* qa = qr.data() + (t * nh + ha) * d;
      float* oa = op + (t * nh + ha) * d;
      std::fill(mx.begin(), mx.begin() + n, ninf);
      for (int64_t i0 = 0; i0 < n; i0 += 4) {  // scores, four query heads at a time
        const int nb = int(std::min<int64_t>(4, n - i0));
        const float* qs[4];
        for (int i = 0; i < nb; ++i) qs[i] = qa + (i0 + i) * d;
        float x[4];
        for (int64_t j = 0; j < lt; ++j) {
          if (!visible(j, qpos)) {
            for (int i = 0; i < nb; ++i) sa[(i0 + i) * live + j] = ninf;
            continue;
          }
          const KT* kj = kg + j * d;
          switch (nb) {  // the same sums in the same order for any nb
            case 4: head_dots<4>(qs, kj, d, x); break;
            case 3: head_dots<3>(qs, kj, d, x); break;
            case 2: head_dots<2>(qs, kj, d, x); break;
            default: head_dots<1>(qs, kj, d, x);
          }
          for (int i = 0; i < nb; ++i) {
            float xi = x[i] * sc;
            if (cap > 0.0f) xi = std::tanh(xi / cap) * cap;
            sa[(i0 + i) * live + j] = xi;
            mx[i0 + i] = std::max(mx[i0 + i], xi);
          }
        }
      }
      if (sk)  // a sink joins the maximum (and below, the total) as ggml's soft_max does
        for (int64_t i = 0; i < n; ++i) mx[i] = std::max(mx[i], sk[ha + i]);
      for (int64_t i = 0; i < n; ++i) {  // weights exp(s - max), and their total
        float* si = sa + i * live;
        int64_t j = 0;
        float tot = 0.0f;
        const vf vm = vset1(mx[i]);
        vf acc = vset1(0.0f);
        for (; j + VL <= lt; j += VL) {
          const vf ej = vexp(vsub(vload(si + j), vm));  // masked: -inf -> exp(-87)
          vstore(si + j, ej);
          acc = vadd(acc, ej);
        }
        tot = vsum(acc);
        for (; j < lt; ++j) {
          si[j] = std::exp(si[j] - mx[i]);
          tot += si[j];
        }
        total[i] = sk ? tot + std::exp(sk[ha + i] - mx[i]) : tot;
      }
      for (int64_t i0 = 0; i0 < n; i0 += 4) {  // the weighted values, four heads at a time
        const int nb = int(std::min<int64_t>(4, n - i0));
        float* os[4];
        for (int i = 0; i < nb; ++i) os[i] = oa + (i0 + i) * d;
        const float* w = sa + i0 * live;
        switch (nb) {
          case 4: weighted_values<4>(w, live, lt, vg, d, os); break;
          case 3: weighted_values<3>(w, live, lt, vg, d, os); break;
          case 2: weighted_values<2>(w, live, lt, vg, d, os); break;
          default: weighted_values<1>(w, live, lt, vg, d, os);
        }
      }
      for (int64_t i = 0; i < n; ++i) scale_rows(oa + i * d, 1.0f / total[i], nullptr, oa + i * d, d);
      ua += n;
    }
  });
  };
  if (half_kv)
    step(k_cache.data_ptr<at::Half>(), v_cache.data_ptr<at::Half>());
  else
    step(k_cache.data_ptr<float>(), v_cache.data_ptr<float>());
  return out;
}

}  // namespace

namespace localllm_cpu {
// act(g) * u for n values (act: 0 SiLU, 1 GELU-tanh, 2 swiglu_oai), for the other kernels of
// the library (moe.cpp's moe_ffn_q8).
void gated_values(const float* g, const float* u, float* y, int64_t n, int64_t act) {
  gated_row(g, u, y, n, act);
}
}  // namespace localllm_cpu

TORCH_LIBRARY_FRAGMENT(localllm_cpu, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("residual_norm(Tensor x, Tensor f, Tensor? post_w, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("gated(Tensor gate, Tensor up, int act, Tensor(a!)? out=None) -> Tensor");
  m.def("norm_rope(Tensor x, Tensor? w, float eps, Tensor cos, Tensor sin, bool neox) -> Tensor");
  m.def("attn_decode(Tensor q, Tensor k, Tensor v, Tensor? q_norm, Tensor? k_norm, float eps, "
        "Tensor cos, Tensor sin, bool neox, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor(c!) k_pos, int slot, int live, int pos, int window, float scale, "
        "float softcap, Tensor? sinks=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("rms_norm", rms_norm);
  m.impl("residual_norm", residual_norm);
  m.impl("gated", gated);
  m.impl("norm_rope", norm_rope);
  m.impl("attn_decode", attn_decode);
}
