// Decode attention over a quantized KV cache (llama.cpp's -ctk / -ctv q8_0, q4_0, q4_1, q5_0,
// q5_1), registered as torch.ops.localllm_cpu.attn_kvq (float32 in and out):
//
//   attn_kvq(q, k, v, k_cache, k_type, v_cache, v_type, k_pos, slot, live, pos, window,
//            scale, softcap) -> o
//     q (n_heads, T, D) and k (n_kv, T, D) rotated (RoPE and QK-norm done: ops.cpp's
//     norm_rope), v (T, n_kv * D) with unit column stride. The T new keys and values are
//     quantized into cells slot .. slot+T-1 of the caches (uint8 (n_kv, size, D / 32 * block
//     bytes), ggml's block layout, ggml/src/ggml-common.h) and their positions pos .. into
//     k_pos (when it is not empty); then each query attends over the first `live` cells
//     (masked by their positions: empty, after the query, outside the window), reading the
//     blocks directly: a key or value row is unpacked into a row of D floats in the thread's
//     scratch (blocks.h's unpack_*, as dequantize_row_* in ggml-quants.c) for all the query
//     heads of its KV head, and never as a whole dequantized cache. o: (T, n_heads * D).
//
// The quantizers are ggml's reference ones (quantize_row_q*_ref in ggml-quants.c), bit-exact
// with localllm.quantize.legacy (-ffp-contract=off: each product and sum rounds once, as in
// torch), so the native step writes the blocks the torch path writes. Scores and the softmax
// follow ops.cpp's attn_decode (float32, vexp of simd.h); the dot products run in another
// order than torch's, so results agree with localllm.backends.dense.attend to float32
// rounding (tests/test_kv_quant.py).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "blocks.h"
#include "checks.h"
#include "simd.h"

namespace {

// ---- ggml's reference quantizers of one block of 32 values -------------------------------

inline void put_f16(uint8_t* p, float x) {
  const uint16_t h = c10::Half(x).x;  // round to nearest even, as GGML_FP32_TO_FP16
  std::memcpy(p, &h, 2);
}

inline float inverse(float d) { return d != 0.0f ? 1.0f / d : 0.0f; }

// The element of largest magnitude with its sign, the first of equals (ggml's loop).
inline float signed_absmax(const float* x) {
  float amax = 0.0f, mx = 0.0f;
  for (int j = 0; j < QK; ++j)
    if (amax < std::fabs(x[j])) {
      amax = std::fabs(x[j]);
      mx = x[j];
    }
  return mx;
}

inline void min_max(const float* x, float* mn, float* mx) {
  *mn = *mx = x[0];
  for (int j = 1; j < QK; ++j) {
    *mn = std::min(*mn, x[j]);
    *mx = std::max(*mx, x[j]);
  }
}

// q[j] (0..15) for j < 16 in low nibbles, j + 16 in high nibbles.
inline void pack_nibbles(const int* q, uint8_t* qs) {
  for (int j = 0; j < 16; ++j) qs[j] = uint8_t((q[j] & 0x0F) | ((q[j + 16] & 0x0F) << 4));
}

// Bit 4 of q[j] as bit j of a little-endian uint32.
inline void pack_high(const int* q, uint8_t* qh) {
  uint32_t h = 0;
  for (int j = 0; j < QK; ++j) h |= uint32_t((q[j] >> 4) & 1) << j;
  std::memcpy(qh, &h, 4);
}

void quantize_q8_0(const float* x, uint8_t* b) {  // d = absmax / 127, q = roundf(x / d)
  float amax = 0.0f;
  for (int j = 0; j < QK; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f, id = inverse(d);
  put_f16(b, d);
  for (int j = 0; j < QK; ++j) b[2 + j] = uint8_t(int8_t(std::round(x[j] * id)));
}

// Q4_0 (BITS 4) and Q5_0 (BITS 5): d = max / -2^(BITS-1), q = min(2^BITS - 1, x / d +
// 2^(BITS-1) + 0.5); the block holds d, Q5_0's fifth bits, then the nibbles.
template <int BITS>
void quantize_x_0(const float* x, uint8_t* b) {
  constexpr int top = (1 << BITS) - 1;
  constexpr float half = float(1 << (BITS - 1));
  const float d = signed_absmax(x) / -half, id = inverse(d);
  int q[QK];
  for (int j = 0; j < QK; ++j) q[j] = std::min(top, int(int8_t(x[j] * id + (half + 0.5f))));
  put_f16(b, d);
  if constexpr (BITS == 5) pack_high(q, b + 2);
  pack_nibbles(q, b + (BITS == 5 ? 6 : 2));
}

// Q4_1 (BITS 4) and Q5_1 (BITS 5): d = (max - min) / (2^BITS - 1), m = min, q = min(2^BITS -
// 1, (x - m) / d + 0.5); the block holds d, m, Q5_1's fifth bits, then the nibbles.
template <int BITS>
void quantize_x_1(const float* x, uint8_t* b) {
  constexpr int top = (1 << BITS) - 1;
  float mn, mx;
  min_max(x, &mn, &mx);
  const float d = (mx - mn) / float(top), id = inverse(d);
  int q[QK];
  for (int j = 0; j < QK; ++j) q[j] = std::min(top, int(int8_t((x[j] - mn) * id + 0.5f)));
  put_f16(b, d);
  put_f16(b + 2, mn);
  if constexpr (BITS == 5) pack_high(q, b + 4);
  pack_nibbles(q, b + (BITS == 5 ? 8 : 4));
}

using QuantizeFn = void (*)(const float*, uint8_t*);

// A cache type: its block format (blocks.h) and quantizer.
struct KVType {
  Format f;
  QuantizeFn quantize;
};

KVType kv_type(int64_t t) {
  switch (t) {
    case Q8_0: return {format_of(t), quantize_q8_0};
    case Q4_0: return {format_of(t), quantize_x_0<4>};
    case Q4_1: return {format_of(t), quantize_x_1<4>};
    case Q5_0: return {format_of(t), quantize_x_0<5>};
    case Q5_1: return {format_of(t), quantize_x_1<5>};
    default: TORCH_CHECK(false, "localllm_cpu.attn_kvq: no quantized cache of ggml type ", t);
  }
}

// A row of d values (d / 32 blocks) into the cache row b.
void quantize_row(const KVType& t, const float* x, uint8_t* b, int64_t d) {
  for (int64_t i = 0; i < d / QK; ++i) t.quantize(x + i * QK, b + i * t.f.bytes);
}

// The row b of d values as floats: q * d - m per 16 values (one rounding each, as
// localllm.gguf.quants' dequantizers).
LOCALLLM_INLINE void decode_row(const Format& f, const uint8_t* b, float* x, int64_t d) {
  int8_t q[QK];
  float sc[2], mn[2] = {0.0f, 0.0f};
  for (int64_t i = 0; i < d / QK; ++i) {
    f.unpack(b + i * f.bytes, q, sc, mn);
    for (int h = 0; h < 2; ++h) {
      vf w = vmul(vload_i8(q + 16 * h), vset1(sc[h]));
      if (f.asym) w = vsub(w, vset1(mn[h]));
      vstore(x + i * QK + 16 * h, w);
    }
  }
}

inline float dot(const float* a, const float* b, int64_t n) {
  vf acc0 = vset1(0.0f), acc1 = vset1(0.0f);
  int64_t i = 0;
  for (; i + 2 * VL <= n; i += 2 * VL) {
    acc0 = vfma(vload(a + i), vload(b + i), acc0);
    acc1 = vfma(vload(a + i + VL), vload(b + i + VL), acc1);
  }
  for (; i < n; i += VL) acc0 = vfma(vload(a + i), vload(b + i), acc0);  // n % 32 == 0
  return vsum(vadd(acc0, acc1));
}

// Weights below this add nothing a float can hold against the total (>= 1): skipped.
constexpr float TINY = 1e-30f;

at::Tensor attn_kvq(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    at::Tensor& k_cache, int64_t k_type, at::Tensor& v_cache, int64_t v_type,
                    at::Tensor& k_pos, int64_t slot, int64_t live, int64_t pos, int64_t window,
                    double scale, double softcap) {
  const KVType tk = kv_type(k_type), tv = kv_type(v_type);
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.dim() == 3 && q.is_contiguous() &&
                  k.scalar_type() == at::kFloat && k.dim() == 3 && k.is_contiguous(),
              "localllm_cpu.attn_kvq: q (n_heads, T, D) and k (n_kv, T, D) must be contiguous "
              "float32");
  const int64_t nh = q.size(0), nt = q.size(1), d = q.size(2), nkv = k.size(0);
  TORCH_CHECK(k.size(1) == nt && k.size(2) == d && nkv > 0 && nh % nkv == 0 && d % QK == 0,
              "localllm_cpu.attn_kvq: k must be (n_kv, T, D), n_heads a multiple of n_kv, "
              "D of whole blocks");
  TORCH_CHECK(v.scalar_type() == at::kFloat && v.dim() == 2 && v.stride(1) == 1 &&
                  v.size(0) == nt && v.size(1) == nkv * d,
              "localllm_cpu.attn_kvq: v must be (T, n_kv * D) float32, unit column stride");
  const int64_t rk = d / QK * tk.f.bytes, rv = d / QK * tv.f.bytes;
  TORCH_CHECK(k_cache.scalar_type() == at::kByte && k_cache.is_contiguous() &&
                  k_cache.dim() == 3 && k_cache.size(0) == nkv && k_cache.size(2) == rk &&
                  v_cache.scalar_type() == at::kByte && v_cache.is_contiguous() &&
                  v_cache.dim() == 3 && v_cache.size(0) == nkv && v_cache.size(2) == rv &&
                  v_cache.size(1) == k_cache.size(1),
              "localllm_cpu.attn_kvq: the caches must be contiguous uint8 (n_kv, size, row "
              "bytes) of their types");
  const int64_t size = k_cache.size(1);
  int64_t* const kpos = check_cells(k_pos, size, nt, slot, live, pos, "attn_kvq");

  uint8_t *kc = k_cache.data_ptr<uint8_t>(), *vc = v_cache.data_ptr<uint8_t>();
  const float *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>(), *qp = q.data_ptr<float>();
  const int64_t ldv = v.stride(0);
  for (int64_t t = 0; t < nt; ++t) {
    for (int64_t g = 0; g < nkv; ++g) {
      quantize_row(tk, kp + (g * nt + t) * d, kc + (g * size + slot + t) * rk, d);
      quantize_row(tv, vp + t * ldv + g * d, vc + (g * size + slot + t) * rv, d);
    }
    if (kpos) kpos[slot + t] = pos + t;
  }

  const int64_t group = nh / nkv;
  const float sc = float(scale), cap = float(softcap);
  const float ninf = -std::numeric_limits<float>::infinity();
  at::Tensor out = at::zeros({nt, nh * d}, q.options());
  float* op = out.data_ptr<float>();
  // One task per (token, KV head): its query heads share each unpacked key and value row.
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(live * d, 1));
  at::parallel_for(0, nt * nkv, grain, [&](int64_t u0, int64_t u1) {
    std::vector<float> row(d), s(group * live), mx(group), total(group);
    for (int64_t u = u0; u < u1; ++u) {
      const int64_t t = u / nkv, g = u % nkv, qpos = pos + t, lt = cells_seen(live, nt, t);
      const uint8_t* kg = kc + g * size * rk;
      const uint8_t* vg = vc + g * size * rv;
      std::fill(mx.begin(), mx.end(), ninf);
      for (int64_t j = 0; j < lt; ++j) {
        const int64_t p = kpos ? kpos[j] : j;
        if (!(p >= 0 && p <= qpos && (window <= 0 || qpos - p < window))) {
          for (int64_t i = 0; i < group; ++i) s[i * live + j] = ninf;
          continue;
        }
        decode_row(tk.f, kg + j * rk, row.data(), d);
        for (int64_t i = 0; i < group; ++i) {
          float x = dot(qp + ((g * group + i) * nt + t) * d, row.data(), d) * sc;
          if (cap > 0.0f) x = std::tanh(x / cap) * cap;
          s[i * live + j] = x;
          mx[i] = std::max(mx[i], x);
        }
      }
      for (int64_t i = 0; i < group; ++i) {  // weights exp(s - max) and their total
        float* si = s.data() + i * live;
        const vf vm = vset1(mx[i]);
        vf acc = vset1(0.0f);
        int64_t j = 0;
        for (; j + VL <= lt; j += VL) {
          const vf e = vexp(vsub(vload(si + j), vm));  // masked: -inf -> exp(-87)
          vstore(si + j, e);
          acc = vadd(acc, e);
        }
        float tot = vsum(acc);
        for (; j < lt; ++j) {
          si[j] = std::exp(si[j] - mx[i]);
          tot += si[j];
        }
        total[i] = tot;
      }
      float* ot = op + t * nh * d + g * group * d;  // the group's heads, one after another
      for (int64_t j = 0; j < lt; ++j) {
        bool any = false;
        for (int64_t i = 0; i < group; ++i) any |= s[i * live + j] > TINY;
        if (!any) continue;
        decode_row(tv.f, vg + j * rv, row.data(), d);
        for (int64_t i = 0; i < group; ++i) {
          const float w = s[i * live + j];
          if (w <= TINY) continue;
          const vf vw = vset1(w);
          float* oi = ot + i * d;
          for (int64_t c = 0; c < d; c += VL)
            vstore(oi + c, vfma(vw, vload(row.data() + c), vload(oi + c)));
        }
      }
      for (int64_t i = 0; i < group; ++i) {
        const vf r = vset1(1.0f / total[i]);
        float* oi = ot + i * d;
        for (int64_t c = 0; c < d; c += VL) vstore(oi + c, vmul(vload(oi + c), r));
      }
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(localllm_cpu, m) {
  m.def("attn_kvq(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, int k_type, "
        "Tensor(b!) v_cache, int v_type, Tensor(c!) k_pos, int slot, int live, int pos, "
        "int window, float scale, float softcap) -> Tensor");
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) { m.impl("attn_kvq", attn_kvq); }
