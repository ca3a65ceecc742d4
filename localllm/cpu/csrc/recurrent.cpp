// Native CPU kernels of localllm's recurrent mixers (issue #27), float32:
//
//   conv1d(x, w, bias, state, silu) -> y
//       the causal depthwise ("short") convolution of Mamba2, the gated delta-net and LFM2,
//       continuing from `state`: y[t, c] = sum_j w[c, j] * u[t + j, c] (+ bias[c], then
//       SiLU), u = the K - 1 remembered inputs followed by x; `state` (K - 1, C) is then the
//       last K - 1 rows of u. x (T, C) with unit column stride; w (C, K) contiguous (tap j
//       of channel c at [c, j], oldest first: ggml_ssm_conv's layout).
//   gated_delta_net(qkv, alpha, beta, dt_bias, a, state, n_k_heads, eps, interleave) -> o
//       a gated delta-net layer's recurrence (Yang, Kautz & Hatamizadeh 2024) from its
//       convolved projections qkv (T, 2 Hk S + Hv S): per token and value head h, with
//       q, k the L2-normalized query and key of key head h // (Hv/Hk) (interleave) or
//       h % Hk, v the value, g = softplus(alpha + dt_bias) * a, b = sigmoid(beta):
//           M = exp(g) M;  d = b (v - M k);  M += d k^T;  o = M q / sqrt(S)
//       with M the head's (S, S) block of `state` (Hv, S, S): row j = value channel j, as
//       llama.cpp's ggml_gated_delta_net stores it. o (T, Hv, S).
//
// They compute what localllm.backends.ssm.short_conv and localllm.backends.deltanet.
// gated_delta_net compute in torch (the latter's prompt form is chunked; here a prompt runs
// the recurrence token by token, each head's state staying in cache). The convolution's
// products and sums round as the torch composition's (-ffp-contract=off, taps summed oldest
// first); the delta rule sums in another order. exp is the Cephes-style polynomial of ops.cpp
// (within 2 ulp). tests/test_cpu_recurrent.py checks both against float64 references.
//
// Vectorized for AVX-512 (16 lanes) or AVX2+FMA (8 lanes), chosen at compile time, with a
// portable fallback; channels (convolution) or value heads (delta rule) are split over
// threads with at::parallel_for when there is enough work. The vector helpers repeat
// ops.cpp's few that are needed, so that this file builds on its own.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace {

// Multiply-adds per parallel task: below this a loop stays on the calling thread.
constexpr int64_t GRAIN = 1 << 16;

#if defined(__AVX512F__)
constexpr int VW = 16;
using vf = __m512;
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vset(float a) { return _mm512_set1_ps(a); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline float vsum(vf v) { return _mm512_reduce_add_ps(v); }
inline vf vexp2i(vf y, vf n) { return _mm512_scalef_ps(y, n); }
inline vf vround(vf x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#define LOCALLLM_VEC 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int VW = 8;
using vf = __m256;
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vset(float a) { return _mm256_set1_ps(a); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline float vsum(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vexp2i(vf y, vf n) {  // n integral in [-126, 127]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline vf vround(vf x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
#define LOCALLLM_VEC 1
#endif

#ifdef LOCALLLM_VEC
// exp(x), Cephes expf's reduction and polynomial (within 2 ulp), x clamped to [-87, 88].
inline vf vexp(vf x) {
  x = vmin(vmax(x, vset(-87.0f)), vset(88.0f));
  const vf n = vround(vmul(x, vset(1.44269504088896341f)));
  vf r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  vf p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  const vf y = vadd(vfma(vmul(p, r), r, r), vset(1.0f));
  return vexp2i(y, n);
}
// x * sigmoid(x) as x / (1 + exp(-x)).
inline vf vsilu(vf x) { return vdiv(x, vadd(vset(1.0f), vexp(vmul(x, vset(-1.0f))))); }
#endif

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

inline float dot(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.0f;
#ifdef LOCALLLM_VEC
  vf acc0 = vset(0.0f), acc1 = vset(0.0f);
  for (; i + 2 * VW <= n; i += 2 * VW) {
    acc0 = vfma(vload(a + i), vload(b + i), acc0);
    acc1 = vfma(vload(a + i + VW), vload(b + i + VW), acc1);
  }
  for (; i + VW <= n; i += VW) acc0 = vfma(vload(a + i), vload(b + i), acc0);
  s = vsum(vadd(acc0, acc1));
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y = x * r
inline void scaled(const float* x, float r, float* y, int64_t n) {
  int64_t i = 0;
#ifdef LOCALLLM_VEC
  const vf vr = vset(r);
  for (; i + VW <= n; i += VW) vstore(y + i, vmul(vload(x + i), vr));
#endif
  for (; i < n; ++i) y[i] = x[i] * r;
}

// ---- the short convolution ---------------------------------------------------------------

// Channels [c0, c1) of every token: y[t, c] = sum_j wt[j, c] * u[t + j, c], u's rows before
// K - 1 from the state, the rest from x. Products and sums round as torch's composition.
void conv_channels(const float* x, int64_t ldx, const float* wt, const float* bias,
                   const float* state, float* y, int64_t t_len, int64_t c_len, int64_t k,
                   bool act, int64_t c0, int64_t c1) {
  auto row = [&](int64_t r) { return r < k - 1 ? state + r * c_len : x + (r - (k - 1)) * ldx; };
  for (int64_t t = 0; t < t_len; ++t) {
    float* yt = y + t * c_len;
    int64_t c = c0;
#ifdef LOCALLLM_VEC
    for (; c + VW <= c1; c += VW) {
      vf acc = vmul(vload(row(t) + c), vload(wt + c));
      for (int64_t j = 1; j < k; ++j) acc = vadd(acc, vmul(vload(row(t + j) + c), vload(wt + j * c_len + c)));
      if (bias) acc = vadd(acc, vload(bias + c));
      vstore(yt + c, act ? vsilu(acc) : acc);
    }
#endif
    for (; c < c1; ++c) {
      float acc = row(t)[c] * wt[c];
      for (int64_t j = 1; j < k; ++j) acc = acc + row(t + j)[c] * wt[j * c_len + c];
      if (bias) acc = acc + bias[c];
      yt[c] = act ? silu(acc) : acc;
    }
  }
}

at::Tensor conv1d(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& bias,
                  at::Tensor& state, bool act) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "localllm_cpu.conv1d: x must be a (T, C) float32 CPU tensor with unit column stride");
  const int64_t t_len = x.size(0), c_len = x.size(1);
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.dim() == 2 && w.is_contiguous() && w.size(0) == c_len &&
                  w.size(1) >= 2, "localllm_cpu.conv1d: w must be (C, K >= 2) contiguous float32");
  const int64_t k = w.size(1);
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous() && state.dim() == 2 &&
                  state.size(0) == k - 1 && state.size(1) == c_len,
              "localllm_cpu.conv1d: state must be (K - 1, C) contiguous float32");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == c_len,
                "localllm_cpu.conv1d: bias must be C contiguous float32 values");
    bp = bias->data_ptr<float>();
  }
  // The taps as (K, C) rows, for vector loads along the channels.
  std::vector<float> wt(k * c_len);
  const float* wp = w.data_ptr<float>();
  for (int64_t c = 0; c < c_len; ++c)
    for (int64_t j = 0; j < k; ++j) wt[j * c_len + c] = wp[c * k + j];
  at::Tensor y = at::empty({t_len, c_len}, x.options());
  const float* xp = x.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t grain = std::max<int64_t>(64, GRAIN / std::max<int64_t>(1, t_len * k));
  at::parallel_for(0, c_len, grain, [&](int64_t c0, int64_t c1) {
    conv_channels(xp, ldx, wt.data(), bp, sp, yp, t_len, c_len, k, act, c0, c1);
    // The new state: the last K - 1 rows of u, for these channels (old state rows may be
    // among them when T < K - 1: read into a copy first).
    std::vector<float> last((k - 1) * (c1 - c0));
    for (int64_t r = 0; r < k - 1; ++r) {
      const int64_t src = t_len + r;  // row of u
      const float* from = src < k - 1 ? sp + src * c_len : xp + (src - (k - 1)) * ldx;
      std::copy(from + c0, from + c1, last.begin() + r * (c1 - c0));
    }
    for (int64_t r = 0; r < k - 1; ++r)
      std::copy(last.begin() + r * (c1 - c0), last.begin() + (r + 1) * (c1 - c0), sp + r * c_len + c0);
  });
  return y;
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
#ifdef LOCALLLM_VEC
      const vf vd = vset(decay), dj = vset(delta[j]);
      vf acc = vset(0.0f);
      for (; i + VW <= s; i += VW) {
        const vf mi = vfma(dj, vload(kn + i), vmul(vload(mj + i), vd));
        vstore(mj + i, mi);
        acc = vfma(mi, vload(qn + i), acc);
      }
      acc_s = vsum(acc);
#endif
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
  m.def("conv1d(Tensor x, Tensor w, Tensor? bias, Tensor(a!) state, bool silu) -> Tensor");
  m.def("gated_delta_net(Tensor qkv, Tensor alpha, Tensor beta, Tensor dt_bias, Tensor a, "
        "Tensor(a!) state, int n_k_heads, float eps, bool interleave) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("conv1d", conv1d);
  m.impl("gated_delta_net", gated_delta_net);
}
