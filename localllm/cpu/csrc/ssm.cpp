// Native CPU kernels of localllm: the recurrent operations of state-space and hybrid models.
//
// Registered beside ops.cpp's, as torch.ops.localllm_cpu.* (float32):
//   short_conv(x, w, bias, state, silu) -> y
//       depthwise causal convolution over time continuing from `state`:
//       y[t, c] = sum_j w[c, j] * u[t + j, c] (+ bias[c], then SiLU), u = the d_conv - 1
//       rows of `state` followed by x; afterwards `state` holds the last d_conv - 1 rows of u.
//       x (T, C) with unit column stride (a column slice of a projection), w (C, d_conv),
//       state (d_conv - 1, C). llama.cpp's ggml_ssm_conv (ggml-cpu/ops.cpp) over the
//       concatenation of its conv state and the new inputs; Mamba's, LFM2's and the
//       gated delta-net's short convolution.
//   ssm_scan(x, dt, dt_bias, A, B, C, D, state) -> y
//       Mamba2's selective scan (Dao & Gu 2024), token by token, continuing from `state`:
//       dt' = softplus(dt[t, h] + dt_bias[h]); S_h = exp(dt' A[h]) S_h + dt' x[t, h] (x) B[t, g];
//       y[t, h] = S_h C[t, g] (+ D[h] x[t, h]), g = h / (H / G). x (T, H, P), dt (T, H),
//       B and C (T, G, N), each with unit last stride (views into the projection), state
//       (H, P, N). llama.cpp's ggml_ssm_scan with a scalar A per head.
//
// The references are localllm/backends/ssm.py's torch functions; tests/test_cpu_ssm.py
// checks both kernels against float64 on odd sizes (vector tails, one and many tokens). The
// taps of the convolution are summed oldest first as ggml sums them; the scan's dot product
// over the state runs in vector lanes (another order than torch's einsum: float32 rounding).
//
// Vectorized in one register of simd.h (vr: 16 lanes with AVX-512, 8 with AVX2), chosen at
// compile time (-march=native), with a portable fallback. Channels (convolution) and heads
// (scan) are split over threads with at::parallel_for only when there is enough work
// (prefill).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#include "simd.h"

namespace {

// Multiply-adds per parallel task: below this a loop stays on the calling thread.
constexpr int64_t GRAIN = 1 << 15;

#ifdef LOCALLLM_VR
// One register of the instruction set (simd.h's vr): 16 lanes with AVX-512, 8 with AVX2.
constexpr int VW = Reg<vr>::lanes;
inline vr vset(float a) { return vset1<vr>(a); }
inline vr vld(const float* p) { return vload<vr>(p); }
// x / (1 + exp(-x)): SiLU (torch's F.silu)
inline vr vsilu(vr x) { return vdiv(x, vadd(vset(1.0f), vexp(vmul(x, vset(-1.0f))))); }
#endif

inline float silu(float x) { return x / (1.0f + std::exp(-x)); }

// log(1 + exp(x)), x itself above 20 (ggml_compute_softplus_f32, torch's threshold 20)
inline float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

void check_f32(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kFloat,
              "localllm_cpu.", op, ": ", name, " must be a float32 CPU tensor");
}

// ---- the short convolution ------------------------------------------------------------------

// Channels [c0, c1) of every row: y = conv(u) (+ bias, SiLU), from the taps wt (K, C) (tap j of
// channel c at wt[j * C + c]); row i of u is state[i] for i < K - 1, else x[i - (K - 1)].
void conv_channels(const float* xp, int64_t ldx, const float* sp, const float* wt,
                   const float* bp, bool act, float* yp, int64_t t_len, int64_t n_ch,
                   int64_t k, int64_t c0, int64_t c1) {
  auto row = [&](int64_t i) { return i < k - 1 ? sp + i * n_ch : xp + (i - (k - 1)) * ldx; };
  for (int64_t t = 0; t < t_len; ++t) {
    float* yr = yp + t * n_ch;
    int64_t c = c0;
#ifdef LOCALLLM_VR
    for (; c + VW <= c1; c += VW) {
      vr acc = vmul(vld(row(t) + c), vld(wt + c));
      for (int64_t j = 1; j < k; ++j) acc = vadd(acc, vmul(vld(row(t + j) + c), vld(wt + j * n_ch + c)));
      if (bp) acc = vadd(acc, vld(bp + c));
      vstore(yr + c, act ? vsilu(acc) : acc);
    }
#endif
    for (; c < c1; ++c) {
      float acc = row(t)[c] * wt[c];
      for (int64_t j = 1; j < k; ++j) acc = acc + row(t + j)[c] * wt[j * n_ch + c];
      if (bp) acc = acc + bp[c];
      yr[c] = act ? silu(acc) : acc;
    }
  }
}

at::Tensor short_conv(const at::Tensor& x, const at::Tensor& w,
                      const std::optional<at::Tensor>& bias, at::Tensor& state, bool act) {
  check_f32(x, "short_conv", "x");
  check_f32(w, "short_conv", "w");
  check_f32(state, "short_conv", "state");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.stride(0) >= x.size(1),
              "localllm_cpu.short_conv: x must be (T, C) with unit column stride");
  const int64_t t_len = x.size(0), n_ch = x.size(1);
  TORCH_CHECK(w.dim() == 2 && w.size(0) == n_ch && w.size(1) >= 2 && w.is_contiguous(),
              "localllm_cpu.short_conv: w must be contiguous (C, d_conv), d_conv >= 2");
  const int64_t k = w.size(1);
  TORCH_CHECK(state.dim() == 2 && state.size(0) == k - 1 && state.size(1) == n_ch &&
                  state.is_contiguous(),
              "localllm_cpu.short_conv: state must be contiguous (d_conv - 1, C)");
  const float* bp = nullptr;
  if (bias && bias->defined()) {
    check_f32(*bias, "short_conv", "bias");
    TORCH_CHECK(bias->numel() == n_ch && bias->is_contiguous(),
                "localllm_cpu.short_conv: bias must be C contiguous values");
    bp = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({t_len, n_ch}, x.options());
  // the taps channel-minor, so that a vector of channels loads each tap at once
  std::vector<float> wt(k * n_ch);
  const float* wp = w.data_ptr<float>();
  for (int64_t c = 0; c < n_ch; ++c)
    for (int64_t j = 0; j < k; ++j) wt[j * n_ch + c] = wp[c * k + j];
  const float* xp = x.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldx = x.stride(0);
  const int64_t per_ch = std::max<int64_t>(1, t_len * k);
  const int64_t grain = std::max<int64_t>(64, GRAIN / per_ch / 64 * 64);
  at::parallel_for(0, n_ch, grain, [&](int64_t c0, int64_t c1) {
    conv_channels(xp, ldx, sp, wt.data(), bp, act, yp, t_len, n_ch, k, c0, c1);
  });
  // the new state: rows T .. T + K - 2 of u (an earlier row of the state, or an input); read
  // indices are never below the written ones, so the shift runs in place, in increasing rows
  for (int64_t i = 0; i < k - 1; ++i) {
    const int64_t src = t_len + i;
    const float* from = src < k - 1 ? sp + src * n_ch : xp + (src - (k - 1)) * ldx;
    std::copy(from, from + n_ch, sp + i * n_ch);
  }
  return y;
}

// ---- the selective scan ---------------------------------------------------------------------

// One head's recurrence over every token: s (P, N) in place, y rows of P values.
void scan_head(const float* xp, int64_t ldx_t, const float* dtp, int64_t lddt, float bias,
               float a, const float* bp, const float* cp, int64_t ldbc, float d, bool has_d,
               float* s, float* yp, int64_t ldy, int64_t t_len, int64_t p_len, int64_t n) {
  for (int64_t t = 0; t < t_len; ++t) {
    const float dts = softplus(dtp[t * lddt] + bias);
    const float decay = std::exp(dts * a);
    const float* xr = xp + t * ldx_t;
    const float* br = bp + t * ldbc;
    const float* cr = cp + t * ldbc;
    float* yr = yp + t * ldy;
    for (int64_t p = 0; p < p_len; ++p) {
      const float xdt = xr[p] * dts;
      float* sr = s + p * n;
      int64_t i = 0;
      float acc = 0.0f;
#ifdef LOCALLLM_VR
      const vr vd = vset(decay), vx = vset(xdt);
      vr va = vset(0.0f);
      for (; i + VW <= n; i += VW) {
        const vr si = vfma(vld(br + i), vx, vmul(vld(sr + i), vd));
        vstore(sr + i, si);
        va = vfma(si, vld(cr + i), va);
      }
      acc = vsum(va);
#endif
      for (; i < n; ++i) {
        const float si = sr[i] * decay + br[i] * xdt;
        sr[i] = si;
        acc += si * cr[i];
      }
      yr[p] = has_d ? acc + d * xr[p] : acc;
    }
  }
}

at::Tensor ssm_scan(const at::Tensor& x, const at::Tensor& dt, const at::Tensor& dt_bias,
                    const at::Tensor& a, const at::Tensor& b, const at::Tensor& c,
                    const std::optional<at::Tensor>& d, at::Tensor& state) {
  for (auto [t, name] : {std::pair{&x, "x"}, {&dt, "dt"}, {&dt_bias, "dt_bias"}, {&a, "A"},
                         {&b, "B"}, {&c, "C"}, {&state, "state"}})
    check_f32(*t, "ssm_scan", name);
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1, "localllm_cpu.ssm_scan: x must be (T, H, P) with unit last stride");
  const int64_t t_len = x.size(0), h_len = x.size(1), p_len = x.size(2);
  TORCH_CHECK(dt.dim() == 2 && dt.size(0) == t_len && dt.size(1) == h_len && dt.stride(1) == 1,
              "localllm_cpu.ssm_scan: dt must be (T, H) with unit last stride");
  TORCH_CHECK(b.dim() == 3 && b.size(0) == t_len && b.stride(2) == 1 && b.sizes() == c.sizes() &&
                  b.strides() == c.strides() && b.stride(1) == b.size(2),
              "localllm_cpu.ssm_scan: B and C must be (T, G, N) alike, rows of G N values");
  const int64_t g_len = b.size(1), n = b.size(2);
  TORCH_CHECK(g_len > 0 && h_len % g_len == 0, "localllm_cpu.ssm_scan: groups must divide heads");
  TORCH_CHECK(state.dim() == 3 && state.size(0) == h_len && state.size(1) == p_len &&
                  state.size(2) == n && state.is_contiguous(),
              "localllm_cpu.ssm_scan: state must be contiguous (H, P, N)");
  for (auto [t, name] : {std::pair{&dt_bias, "dt_bias"}, {&a, "A"}})
    TORCH_CHECK(t->numel() == h_len && t->is_contiguous(), "localllm_cpu.ssm_scan: ", name,
                " must be H contiguous values");
  const float* dp = nullptr;
  if (d && d->defined()) {
    check_f32(*d, "ssm_scan", "D");
    TORCH_CHECK(d->numel() == h_len && d->is_contiguous(), "localllm_cpu.ssm_scan: D must be H values");
    dp = d->data_ptr<float>();
  }
  at::Tensor y = at::empty({t_len, h_len, p_len}, x.options());
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>();
  const float *bias = dt_bias.data_ptr<float>(), *ap = a.data_ptr<float>();
  const float *bp = b.data_ptr<float>(), *cp = c.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *yp = y.data_ptr<float>();
  const int64_t heads_per_group = h_len / g_len;
  const int64_t per_head = std::max<int64_t>(1, t_len * p_len * n);
  at::parallel_for(0, h_len, std::max<int64_t>(1, GRAIN / per_head), [&](int64_t h0, int64_t h1) {
    for (int64_t h = h0; h < h1; ++h) {
      const int64_t g = h / heads_per_group;
      scan_head(xp + h * x.stride(1), x.stride(0), dtp + h, dt.stride(0), bias[h], ap[h],
                bp + g * n, cp + g * n, b.stride(0), dp ? dp[h] : 0.0f, dp != nullptr,
                sp + h * p_len * n, yp + h * p_len, h_len * p_len, t_len, p_len, n);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm_cpu, m) {
  m.def("short_conv(Tensor x, Tensor w, Tensor? bias, Tensor(a!) state, bool silu) -> Tensor");
  m.def("ssm_scan(Tensor x, Tensor dt, Tensor dt_bias, Tensor A, Tensor B, Tensor C, Tensor? D, "
        "Tensor(a!) state) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("short_conv", short_conv);
  m.impl("ssm_scan", ssm_scan);
}
