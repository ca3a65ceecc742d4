// Native CPU kernel of the gated delta-net layers of Qwen3-Next and Qwen3.5 (issue #27), float32
// (their short convolution is ssm.cpp's short_conv):
//
//   gated_delta_net(qkv, alpha, beta, dt_bias, a, state, n_k_heads, eps, interleave) -> o
//       a gated delta-net layer's recurrence (Yang, Kautz & Hatamizadeh 2024) from its
//       convolved projections qkv (T, 2 Hk S + Hv S): per token and value head h, with
//       q, k the L2-normalized query and key of key head h // (Hv/Hk) (interleave) or
//       h % Hk, v the value, g = softplus(alpha + dt_bias) * a, b = sigmoid(beta):
//           M = exp(g) M;  d = b (v - M k);  M += d k^T;  o = M q / sqrt(S)
//       with M the head's (S, S) block of `state` (Hv, S, S): row j = value channel j, as
//       llama.cpp's ggml_gated_delta_net stores it. o (T, Hv, S).
//
// It computes what localllm.backends.deltanet.gated_delta_net computes in torch (whose prompt
// form is chunked; here a prompt runs the recurrence token by token, each head's state
// staying in cache, summed in another order). tests/test_deltanet.py checks it against a
// float64 reference.
//
// Vectorized with simd.h's 16-lane vf (AVX-512, AVX2 + FMA, or portable); value heads are
// split over threads with at::parallel_for when there is enough work.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

// Multiply-adds per parallel task: below this a loop stays on the calling thread.
constexpr int64_t GRAIN = 1 << 16;

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  vf acc0 = vset1(0.0f), acc1 = vset1(0.0f);
  for (; i + 2 * VL <= n; i += 2 * VL) {
    acc0 = vfma(vload(a + i), vload(b + i), acc0);
    acc1 = vfma(vload(a + i + VL), vload(b + i + VL), acc1);
  }
  for (; i + VL <= n; i += VL) acc0 = vfma(vload(a + i), vload(b + i), acc0);
  float s = vsum(vadd(acc0, acc1));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = x * r
inline void scaled(const float* x, float r, float* y, int64_t n) {
  int64_t i = 0;
  const vf vr = vset1(r);
  for (; i + VL <= n; i += VL) vstore(y + i, vmul(vload(x + i), vr));
  for (; i < n; ++i) y[i] = x[i] * r;
}

// ---- the gated delta rule ----------------------------------------------------------------

// One value head over every token: m (S, S) is its state, updated in place.
void delta_head(const float* qkv, int64_t ldq, int64_t t_len, int64_t s, int64_t kd, int64_t kh,
                int64_t h, int64_t hv, const float* alpha, const float* beta, float dt_bias, float a,
                float eps, float* m, float* out) {
  std::vector<float> buf(3 * s);
  float *qn = buf.data(), *kn = qn + s, *delta = kn + s;
  const float scale = 1.0f / std::sqrt(float(s));
  for (int64_t t = 0; t < t_len; ++t) {
    const float* row = qkv + t * ldq;
    const float *q = row + kh * s, *k = row + kd + kh * s, *v = row + 2 * kd + h * s;
    scaled(q, scale / std::sqrt(dot(q, q, s) + eps), qn, s);
    scaled(k, 1.0f / std::sqrt(dot(k, k, s) + eps), kn, s);
    const float x = alpha[t * hv + h] + dt_bias;
    const float decay = std::exp((x > 20.0f ? x : std::log1p(std::exp(x))) * a);
    const float b = 1.0f / (1.0f + std::exp(-beta[t * hv + h]));
    // (exp(g) M) k = exp(g) (M k): the decay is applied once, in the update below.
    for (int64_t j = 0; j < s; ++j) delta[j] = (v[j] - decay * dot(m + j * s, kn, s)) * b;
    float* o = out + (t * hv + h) * s;
    for (int64_t j = 0; j < s; ++j) {
      float* mj = m + j * s;
      int64_t i = 0;
      float acc_s = 0.0f;
      const vf vd = vset1(decay), dj = vset1(delta[j]);
      vf acc = vset1(0.0f);
      for (; i + VL <= s; i += VL) {
        const vf mi = vfma(dj, vload(kn + i), vmul(vload(mj + i), vd));
        vstore(mj + i, mi);
        acc = vfma(mi, vload(qn + i), acc);
      }
      acc_s = vsum(acc);
      for (; i < s; ++i) {
        mj[i] = mj[i] * decay + delta[j] * kn[i];
        acc_s += mj[i] * qn[i];
      }
      o[j] = acc_s;
    }
  }
}

void check_heads(const at::Tensor& t, int64_t rows, int64_t hv, const char* name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(0) == rows &&
                  t.size(1) == hv, "localllm_cpu.gated_delta_net: ", name, " must be (T, Hv) contiguous float32");
}

at::Tensor gated_delta_net(const at::Tensor& qkv, const at::Tensor& alpha, const at::Tensor& beta,
                           const at::Tensor& dt_bias, const at::Tensor& a, at::Tensor& state,
                           int64_t n_k_heads, double eps, bool interleave) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.dim() == 2 && qkv.stride(1) == 1,
              "localllm_cpu.gated_delta_net: qkv must be a (T, C) float32 CPU tensor with unit column stride");
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 3 &&
                  state.size(1) == state.size(2), "localllm_cpu.gated_delta_net: state must be (Hv, S, S) contiguous float32");
  const int64_t t_len = qkv.size(0), hv = state.size(0), s = state.size(1), hk = n_k_heads;
  TORCH_CHECK(hk >= 1 && hv % hk == 0, "localllm_cpu.gated_delta_net: Hv must be a multiple of Hk");
  const int64_t kd = hk * s;
  TORCH_CHECK(qkv.size(1) == 2 * kd + hv * s, "localllm_cpu.gated_delta_net: qkv must have 2 Hk S + Hv S columns");
  check_heads(alpha, t_len, hv, "alpha");
  check_heads(beta, t_len, hv, "beta");
  TORCH_CHECK(dt_bias.scalar_type() == at::kFloat && dt_bias.is_contiguous() && dt_bias.numel() == hv &&
                  a.scalar_type() == at::kFloat && a.is_contiguous() && a.numel() == hv,
              "localllm_cpu.gated_delta_net: dt_bias and a must be Hv contiguous float32 values");
  at::Tensor out = at::empty({t_len, hv, s}, qkv.options());
  const float *qp = qkv.data_ptr<float>(), *ap = alpha.data_ptr<float>(), *bp = beta.data_ptr<float>();
  const float *dtp = dt_bias.data_ptr<float>(), *aap = a.data_ptr<float>();
  float *mp = state.data_ptr<float>(), *op = out.data_ptr<float>();
  const int64_t ratio = hv / hk, ldq = qkv.stride(0);
  const float e = float(eps);
  const int64_t grain = std::max<int64_t>(1, GRAIN / std::max<int64_t>(1, 2 * t_len * s * s));
  at::parallel_for(0, hv, grain, [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h)
      delta_head(qp, ldq, t_len, s, kd, interleave ? h / ratio : h % hk, h, hv, ap, bp, dtp[h], aap[h], e,
                 mp + h * s * s, op);
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm_cpu, m) {
  m.def("gated_delta_net(Tensor qkv, Tensor alpha, Tensor beta, Tensor dt_bias, Tensor a, "
        "Tensor(a!) state, int n_k_heads, float eps, bool interleave) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("gated_delta_net", gated_delta_net);
}
