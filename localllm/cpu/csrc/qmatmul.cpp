// Native CPU kernels of localllm: matrix products read directly from ggml blocks.
//
// Registered as torch operators under torch.ops.localllm_cpu (loaded by localllm/cpu/build.py):
//   gemv(x, w, qtype, rows, cols, out)        out[t, r] = sum_k x[t, k] * W[r, k], T <= 8 rows
//   gemv_q8(x, w, qtype, rows, cols, out)     the same with x quantized to int8 per 32 values
//   gemv_q8_experts(x, w, qtype, rows, cols, experts, out)
//                                             out[j] = W_experts[j] x_j, one token's experts
//                                             (AVX512-VNNI or AVX2 builds; q8_available())
//   dequant_rows(w, qtype, r0, cols, out)     out[i, :] = W[r0 + i, :] as float32
//   moe_ffn_q8(x, chosen, weights, gate, up, down, ..., out)
//                                             a prompt's SwiGLU experts (MoE), int8
//                                             activations (AVX512-VNNI builds; see below)
//
// W is a (rows, cols) matrix stored as ggml blocks, row after row (llama.cpp
// ggml/src/ggml-common.h block_q*); the per-block dequantizers follow dequantize_row_q* in
// ggml/src/ggml-quants.c and are bit-exact with localllm.gguf.quants (the build uses
// -ffp-contract=off so that `d * q - m` is two roundings, as there). gemv keeps the
// activations float32 (products exact up to float32 summation order); gemv_q8 quantizes
// them to int8 per 32 values and multiplies with integer dot products (AVX512-VNNI, or AVX2
// with vpmaddubsw / AVX-VNNI: the section "int8 activations" below).
//
// For gemv, each block is unpacked to int8 values plus one float scale (and minimum) per 16
// weights; the products then run on AVX-512 (16 lanes) or AVX2 (2 x 8 lanes) intrinsics,
// chosen at compile time (-march=native), with a portable fallback; threads split the
// output rows (at::parallel_for, honouring torch.set_num_threads).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

// ggml type ids (ggml.h enum ggml_type).
enum QType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30,
};

constexpr int QK = 32;
constexpr int QK_K = 256;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

inline float bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- per-block unpacking ---------------------------------------------------------------
// A block becomes int8 values q[BLOCK] and, per group of 16 weights, a scale d[g] and a
// minimum m[g], so that weight = q * d[g] - m[g] (m = 0 for the symmetric formats; Q4_1 and
// Q5_1 store -m). Each product and difference rounds once in float32, exactly as the
// reference dequantizers do (llama.cpp dequantize_row_q*, localllm.gguf.quants).

constexpr int G = 16;  // weights per scale group

// The 32 weights of a legacy block: low nibbles (weights 0..15) and high nibbles (16..31),
// plus a fifth bit per weight from qh (Q5_0/Q5_1), minus `bias`.
#if defined(__SSE2__)
inline __m128i high_bits16(uint32_t bits) {  // bit j of `bits` -> 0x10 in byte j (16 bytes)
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm_and_si128(_mm_movm_epi8(__mmask16(bits & 0xFFFF)), _mm_set1_epi8(0x10));
#else
  // Spread 16 bits over 16 bytes: byte j takes bit (j % 8) of byte (j / 8).
  const __m128i spread = _mm_set_epi64x(0x0101010101010101LL * ((bits >> 8) & 0xFF),
                                        0x0101010101010101LL * (bits & 0xFF));
  const __m128i sel = _mm_set_epi64x(0x8040201008040201LL, 0x8040201008040201LL);
  const __m128i on = _mm_cmpeq_epi8(_mm_and_si128(spread, sel), sel);
  return _mm_and_si128(on, _mm_set1_epi8(0x10));
#endif
}

inline void nibbles(const uint8_t* qs, uint32_t qh, bool five, int bias, int8_t* q) {
  const __m128i v = _mm_loadu_si128((const __m128i*)qs);
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(v, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  if (five) {
    lo = _mm_or_si128(lo, high_bits16(qh));
    hi = _mm_or_si128(hi, high_bits16(qh >> 16));
  }
  const __m128i b = _mm_set1_epi8(char(bias));
  _mm_storeu_si128((__m128i*)q, _mm_sub_epi8(lo, b));
  _mm_storeu_si128((__m128i*)(q + 16), _mm_sub_epi8(hi, b));
}
#else
inline void nibbles(const uint8_t* qs, uint32_t qh, bool five, int bias, int8_t* q) {
  for (int j = 0; j < 16; ++j) {
    const int h0 = five ? ((qh >> j) << 4) & 0x10 : 0;
    const int h1 = five ? (qh >> (j + 12)) & 0x10 : 0;
    q[j] = int8_t(((qs[j] & 0x0F) | h0) - bias);
    q[j + 16] = int8_t(((qs[j] >> 4) | h1) - bias);
  }
}
#endif

inline void unpack_q4_0(const uint8_t* b, int8_t* q, float* d, float*) {  // d, qs[16]
  nibbles(b + 2, 0, false, 8, q);
  d[0] = d[1] = f16(b);
}

inline void unpack_q4_1(const uint8_t* b, int8_t* q, float* d, float* m) {  // d, m, qs[16]
  nibbles(b + 4, 0, false, 0, q);
  d[0] = d[1] = f16(b);
  m[0] = m[1] = -f16(b + 2);
}

inline void unpack_q5_0(const uint8_t* b, int8_t* q, float* d, float*) {  // d, qh[4], qs[16]
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  nibbles(b + 6, qh, true, 16, q);
  d[0] = d[1] = f16(b);
}

inline void unpack_q5_1(const uint8_t* b, int8_t* q, float* d, float* m) {  // d, m, qh, qs
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  nibbles(b + 8, qh, true, 0, q);
  d[0] = d[1] = f16(b);
  m[0] = m[1] = -f16(b + 2);
}

inline void unpack_q8_0(const uint8_t* b, int8_t* q, float* d, float*) {  // d, qs[32]
  d[0] = d[1] = f16(b);
  std::memcpy(q, b + 2, QK);
}

inline void unpack_q2_k(const uint8_t* b, int8_t* q, float* d, float* m) {
  // scales[16], qs[64], d, dmin; groups in storage order
  const uint8_t* sc = b;
  const uint8_t* qs = b + 16;
  const float dd = f16(b + 80), dmin = f16(b + 82);
  for (int g = 0; g < 16; ++g) {
    d[g] = dd * float(sc[g] & 0x0F);
    m[g] = dmin * float(sc[g] >> 4);
  }
  for (int n = 0; n < 2; ++n, qs += 32)
    for (int k = 0; k < 4; ++k)  // shift 2k
      for (int l = 0; l < 32; ++l) q[128 * n + 32 * k + l] = int8_t((qs[l] >> (2 * k)) & 3);
}

// Q3_K's 16 six-bit scales, packed in 12 bytes at offset 96, as 16 bytes (0..63; the
// scale is the value - 32) in aux (llama.cpp dequantize_row_q3_K's kmask unpacking).
inline void q3_k_scales(const uint8_t* b, uint32_t aux[4]) {
  std::memcpy(aux, b + 96, 12);
  const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
}

inline void unpack_q3_k(const uint8_t* b, int8_t* q, float* d, float*) {
  // hmask[32], qs[64], scales[12], d
  const uint8_t* hm = b;
  const uint8_t* qs = b + 32;
  const float dd = f16(b + 108);
  uint32_t aux[4];
  q3_k_scales(b, aux);
  int8_t scales[16];
  std::memcpy(scales, aux, 16);
  for (int g = 0; g < 16; ++g) d[g] = dd * float(scales[g] - 32);
  for (int n = 0; n < 2; ++n, qs += 32)
    for (int k = 0; k < 4; ++k) {  // shift 2k, high-bit mask bit 4n + k
      const int bit = 4 * n + k;
      for (int l = 0; l < 32; ++l)
        q[128 * n + 32 * k + l] =
            int8_t(((qs[l] >> (2 * k)) & 3) - (((hm[l] >> bit) & 1) ? 0 : 4));
    }
}

inline void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

inline void k4_scales(const uint8_t* b, float* d, float* m) {  // 8 sub-blocks of 32
  const float dd = f16(b), dmin = f16(b + 2);
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    d[2 * s] = d[2 * s + 1] = dd * float(sc);
    m[2 * s] = m[2 * s + 1] = dmin * float(mn);
  }
}

inline void unpack_q4_k(const uint8_t* b, int8_t* q, float* d, float* m) {
  // d, dmin, scales[12], qs[128]
  k4_scales(b, d, m);
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 4; ++j, qs += 32)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = int8_t(qs[l] & 0x0F);
      q[64 * j + 32 + l] = int8_t(qs[l] >> 4);
    }
}

inline void unpack_q5_k(const uint8_t* b, int8_t* q, float* d, float* m) {
  // d, dmin, scales[12], qh[32], qs[128]
  k4_scales(b, d, m);
  const uint8_t* qh = b + 16;
  const uint8_t* qs = b + 48;
  for (int j = 0; j < 4; ++j, qs += 32)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = int8_t((qs[l] & 0x0F) | (((qh[l] >> (2 * j)) & 1) << 4));
      q[64 * j + 32 + l] = int8_t((qs[l] >> 4) | (((qh[l] >> (2 * j + 1)) & 1) << 4));
    }
}

inline void unpack_q6_k(const uint8_t* b, int8_t* q, float* d, float*) {
  // ql[128], qh[64], scales[16] int8, d
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float dd = f16(b + 208);
  for (int g = 0; g < 16; ++g) d[g] = dd * float(sc[g]);
  for (int n = 0; n < 2; ++n, ql += 64, qh += 32, q += 128)
    for (int l = 0; l < 32; ++l) {
      q[l] = int8_t(((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
      q[l + 32] = int8_t(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
      q[l + 64] = int8_t(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
      q[l + 96] = int8_t(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
    }
}

using UnpackFn = void (*)(const uint8_t*, int8_t*, float*, float*);

// ---- float formats: 16 values -> float32 lanes -----------------------------------------

enum class Flt { F32, F16, BF16 };

// ---- vector helpers --------------------------------------------------------------------
#if defined(__AVX512F__)
using vf = __m512;
constexpr int VL = 16;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline vf vset1(float v) { return _mm512_set1_ps(v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline void vstore(float* p, vf a) { _mm512_storeu_ps(p, a); }
inline float vsum(vf a) { return _mm512_reduce_add_ps(a); }
inline vf vq8(const int8_t* q) {  // 16 int8 -> 16 float
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
}
inline vf vflt(const uint8_t* p, Flt f) {
  switch (f) {
    case Flt::F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)p));
    case Flt::BF16:
      return _mm512_castsi512_ps(_mm512_slli_epi32(
          _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
    default: return _mm512_loadu_ps((const float*)p);
  }
}
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
struct vf {
  __m256 lo, hi;
};
constexpr int VL = 16;
inline vf vzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline vf vload(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline vf vset1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
inline vf vfma(vf a, vf b, vf c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline vf vmul(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf vsub(vf a, vf b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline void vstore(float* p, vf a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline float vsum(vf a) {
  alignas(32) float t[8];
  _mm256_store_ps(t, _mm256_add_ps(a.lo, a.hi));
  float s = 0.f;
  for (float v : t) s += v;
  return s;
}
inline vf vq8(const int8_t* q) {
  const __m128i b = _mm_loadu_si128((const __m128i*)q);
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)),
          _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))};
}
inline vf vflt(const uint8_t* p, Flt f) {
  switch (f) {
    case Flt::F16:
      return {_mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p)),
              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)))};
    case Flt::BF16: {
      auto cv = [](const uint8_t* s) {
        return _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)s)), 16));
      };
      return {cv(p), cv(p + 16)};
    }
    default: return vload((const float*)p);
  }
}
#else  // portable: 16 scalar lanes (the compiler may still vectorize)
struct vf {
  float v[16];
};
constexpr int VL = 16;
inline vf vzero() { return vf{}; }
inline vf vload(const float* p) { vf r; std::memcpy(r.v, p, 64); return r; }
inline vf vset1(float x) { vf r; for (float& e : r.v) e = x; return r; }
inline vf vfma(vf a, vf b, vf c) { for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]); return c; }
inline vf vmul(vf a, vf b) { for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i]; return a; }
inline vf vsub(vf a, vf b) { for (int i = 0; i < 16; ++i) a.v[i] -= b.v[i]; return a; }
inline void vstore(float* p, vf a) { std::memcpy(p, a.v, 64); }
inline float vsum(vf a) { float s = 0.f; for (float e : a.v) s += e; return s; }
inline vf vq8(const int8_t* q) { vf r; for (int i = 0; i < 16; ++i) r.v[i] = float(q[i]); return r; }
inline vf vflt(const uint8_t* p, Flt f) {
  vf r;
  for (int i = 0; i < 16; ++i)
    r.v[i] = f == Flt::F16 ? f16(p + 2 * i) : f == Flt::BF16 ? bf16(p + 2 * i) : ((const float*)p)[i];
  return r;
}
#endif

// A format as the kernels see it: `block` weights in `bytes` bytes, unpacked by `unpack`
// (integer formats) or converted 16 at a time (float formats, read in blocks of 32).
struct Format {
  int block;
  int bytes;
  UnpackFn unpack;  // nullptr for the float formats
  bool asym;        // weight = q * d - m with m != 0
  Flt flt;
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case F32: return {QK, 4 * QK, nullptr, false, Flt::F32};
    case F16: return {QK, 2 * QK, nullptr, false, Flt::F16};
    case BF16: return {QK, 2 * QK, nullptr, false, Flt::BF16};
    case Q4_0: return {QK, 18, unpack_q4_0, false, Flt::F32};
    case Q4_1: return {QK, 20, unpack_q4_1, true, Flt::F32};
    case Q5_0: return {QK, 22, unpack_q5_0, false, Flt::F32};
    case Q5_1: return {QK, 24, unpack_q5_1, true, Flt::F32};
    case Q8_0: return {QK, 34, unpack_q8_0, false, Flt::F32};
    case Q2_K: return {QK_K, 84, unpack_q2_k, true, Flt::F32};
    case Q3_K: return {QK_K, 110, unpack_q3_k, false, Flt::F32};
    case Q4_K: return {QK_K, 144, unpack_q4_k, true, Flt::F32};
    case Q5_K: return {QK_K, 176, unpack_q5_k, true, Flt::F32};
    case Q6_K: return {QK_K, 210, unpack_q6_k, false, Flt::F32};
    default: TORCH_CHECK(false, "localllm_cpu: no kernel for ggml type ", qtype);
  }
}

// Group g (16 weights) of an unpacked block as float32 lanes (bit-exact dequantization).
template <bool ASYM>
inline vf group_weights(const int8_t* q, const float* d, const float* m, int g) {
  vf w = vmul(vq8(q + G * g), vset1(d[g]));
  if (ASYM) w = vsub(w, vset1(m[g]));
  return w;
}

// Rows [r0, r1) of W times NT activation rows: each block is unpacked once (into L1) and
// multiplied with every activation row, so each weight byte is read once per call.
template <int NT, int BLOCK, int BYTES, bool ASYM, UnpackFn UNPACK>
void gemv_quant(const Format&, const uint8_t* w, int64_t row_bytes, int64_t cols,
                const float* x, int64_t ldx, float* out, int64_t ldo, int64_t r0, int64_t r1) {
  alignas(64) int8_t q[BLOCK];
  float d[BLOCK / G], m[BLOCK / G] = {};
  const int64_t nb = cols / BLOCK;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    vf acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = vzero();
    for (int64_t b = 0; b < nb; ++b) {
      UNPACK(row + b * BYTES, q, d, m);
      const float* xb = x + b * BLOCK;
      for (int g = 0; g < BLOCK / G; ++g) {
        const vf wv = group_weights<ASYM>(q, d, m, g);
        for (int t = 0; t < NT; ++t) acc[t] = vfma(wv, vload(xb + t * ldx + G * g), acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo + r] = vsum(acc[t]);
  }
}

template <int NT>
void gemv_float(const Format& f, const uint8_t* w, int64_t row_bytes, int64_t cols,
                const float* x, int64_t ldx, float* out, int64_t ldo, int64_t r0, int64_t r1) {
  const int es = f.bytes / QK;  // bytes per element
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    vf acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = vzero();
    for (int64_t k = 0; k < cols; k += VL) {
      const vf wv = vflt(row + k * es, f.flt);
      for (int t = 0; t < NT; ++t) acc[t] = vfma(wv, vload(x + t * ldx + k), acc[t]);
    }
    for (int t = 0; t < NT; ++t) out[t * ldo + r] = vsum(acc[t]);
  }
}

using GemvFn = void (*)(const Format&, const uint8_t*, int64_t, int64_t, const float*, int64_t,
                        float*, int64_t, int64_t, int64_t);

template <int NT>
GemvFn gemv_for(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return gemv_quant<NT, QK, 18, false, unpack_q4_0>;
    case Q4_1: return gemv_quant<NT, QK, 20, true, unpack_q4_1>;
    case Q5_0: return gemv_quant<NT, QK, 22, false, unpack_q5_0>;
    case Q5_1: return gemv_quant<NT, QK, 24, true, unpack_q5_1>;
    case Q8_0: return gemv_quant<NT, QK, 34, false, unpack_q8_0>;
    case Q2_K: return gemv_quant<NT, QK_K, 84, true, unpack_q2_k>;
    case Q3_K: return gemv_quant<NT, QK_K, 110, false, unpack_q3_k>;
    case Q4_K: return gemv_quant<NT, QK_K, 144, true, unpack_q4_k>;
    case Q5_K: return gemv_quant<NT, QK_K, 176, true, unpack_q5_k>;
    case Q6_K: return gemv_quant<NT, QK_K, 210, false, unpack_q6_k>;
    default: return gemv_float<NT>;  // F32, F16, BF16 (format_of rejected the rest)
  }
}

// fn(std::integral_constant<int, nt>{}) for nt = 1 .. 8 activation rows (the kernels'
// row count is a template parameter, so that their accumulators stay in registers).
template <class Fn>
auto by_rows(int64_t nt, const char* op, Fn&& fn) {
  switch (nt) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    case 8: return fn(std::integral_constant<int, 8>{});
    default: TORCH_CHECK(false, "localllm_cpu.", op, ": 1 to 8 rows, got ", nt);
  }
}

GemvFn gemv_of(int64_t qtype, int64_t nt) {
  return by_rows(nt, "gemv", [&](auto n) { return gemv_for<decltype(n)::value>(qtype); });
}

// One row of W dequantized into y (float32, cols values).
void dequant_row(const Format& f, const uint8_t* row, int64_t cols, float* y) {
  if (!f.unpack) {
    const int es = f.bytes / QK;
    for (int64_t k = 0; k < cols; k += VL) vstore(y + k, vflt(row + k * es, f.flt));
    return;
  }
  alignas(64) int8_t q[QK_K];
  float d[QK_K / G], m[QK_K / G] = {};
  for (int64_t b = 0; b < cols / f.block; ++b, y += f.block) {
    f.unpack(row + b * f.bytes, q, d, m);
    for (int g = 0; g < f.block / G; ++g)
      vstore(y + G * g, f.asym ? group_weights<true>(q, d, m, g) : group_weights<false>(q, d, m, g));
  }
}

void check_weight(const at::Tensor& w, const Format& f, int64_t rows, int64_t cols) {
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(),
              "localllm_cpu: weight must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(rows >= 0 && cols > 0 && cols % f.block == 0,
              "localllm_cpu: cols=", cols, " is not a multiple of the block (", f.block, ")");
  TORCH_CHECK(w.numel() == rows * (cols / f.block) * f.bytes,
              "localllm_cpu: weight holds ", w.numel(), " bytes, (", rows, ", ", cols,
              ") needs ", rows * (cols / f.block) * f.bytes);
}

// Grain of the row split: about 64 KiB of weight bytes per task, so that small matrices
// stay on one thread.
inline int64_t grain_of(int64_t row_bytes) {
  return std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
}

// x (T, cols) and out (T, rows) float32, each with unit column stride; returns T.
int64_t check_io(const char* op, const at::Tensor& x, const at::Tensor& out, int64_t rows,
                 int64_t cols) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(1) == cols, "localllm_cpu.", op, ": x must be (T, cols) float32");
  const int64_t nt = x.size(0);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == nt && out.size(1) == rows,
              "localllm_cpu.", op, ": out must be (T, rows) float32");
  return nt;
}

// out (T, >= rows) float32 with unit column stride (a column slice of a wider output is fine).
void gemv(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t rows, int64_t cols,
          at::Tensor& out) {
  const Format f = format_of(qtype);
  check_weight(w, f, rows, cols);
  const int64_t nt = check_io("gemv", x, out, rows, cols);
  const GemvFn fn = gemv_of(qtype, nt);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = (cols / f.block) * f.bytes;
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  at::parallel_for(0, rows, grain_of(row_bytes), [&](int64_t r0, int64_t r1) {
    fn(f, wp, row_bytes, cols, xp, ldx, op, ldo, r0, r1);
  });
}

// ---- int8 activations: the llama.cpp-style GEMV ------------------------------------------
// x is quantized once per call, per 32 values, to int8 with a float32 scale (llama.cpp
// quantizes to block_q8_0 / block_q8_K, ggml/src/ggml-quants.c quantize_row_q8_*; one scale
// per 32 values is finer than q8_K's one per 256). Every weight block is then read as
// unsigned 8-bit lanes u with, per group of 16 weights, w = a_g * u - b_g (Q4_0's values
// are offset by 8, Q8_0's by 128 on AVX-512, ...), so a row's product is
//     sum_g a_g * dx_g * (u . xq)_g  -  sum_g b_g * xsum_g
// with (u . xq) an integer dot product and xsum_g = dx_g * sum(xq over g) the group's sum of
// the quantized activations. Two implementations share the activations (Q8Act below):
//   AVX512F/BW/VL + AVX512_VNNI: vpdpbusd, 64 weights per instruction (the section after
//     Q8Act);
//   AVX2 + FMA + F16C (no AVX512-VNNI): 32 weights per vpmaddubsw + vpmaddwd, or AVX-VNNI's
//     vpdpbusd (namespace q8avx2; llama.cpp ggml-cpu/arch/x86/quants.c ggml_vec_dot_*).
// Both compute the same products; only the float32 summation order differs. Elsewhere
// gemv_q8 is not offered (q8_available() is false) and the float32 GEMV above is used.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LOCALLLM_Q8 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOCALLLM_Q8 256
#endif

#if defined(LOCALLLM_Q8)
#if LOCALLLM_Q8 == 512
// 32 floats x -> int8 q[i] = round-half-even(x[i] * 127 / amax) (llama.cpp quantize_row_q8_0);
// returns the scale amax / 127 and the sums of q over each half of 16 in s.
inline float quantize32(const float* x, int8_t* q, int s[2]) {
  const __m512 v0 = _mm512_loadu_ps(x), v1 = _mm512_loadu_ps(x + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const __m512 vid = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  const __m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid));  // nearest even
  const __m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(i0));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(i1));
  s[0] = _mm512_reduce_add_epi32(i0);
  s[1] = _mm512_reduce_add_epi32(i1);
  return amax / 127.f;
}

// c[i] = -offset * (q[4i] + q[4i + 1] + q[4i + 2] + q[4i + 3]) for 64 values q (16 lanes).
inline void offset_sums(const int8_t* q, int offset, int32_t* c) {
  _mm512_storeu_si512((void*)c, _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(
      _mm512_setzero_si512(), _mm512_set1_epi8(char(offset)), _mm512_loadu_si512((const void*)q))));
}
#else
inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline int hsum_epi32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// As the AVX-512 quantize32 (same rounding, same saturation), 8 lanes at a time.
inline float quantize32(const float* x, int8_t* q, int s[2]) {
  __m256 v[4];
  __m256 am = _mm256_setzero_ps();
  for (int k = 0; k < 4; ++k) {
    v[k] = _mm256_loadu_ps(x + 8 * k);
    am = _mm256_max_ps(am, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[k]));
  }
  const float amax = hmax(am);
  const __m256 vid = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
  __m256i i[4];
  for (int k = 0; k < 4; ++k) i[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], vid));
  // packs work within 128-bit lanes: the bytes come out as 4-value groups
  // [i0 0-3, i1 0-3, i2 0-3, i3 0-3 | i0 4-7, i1 4-7, ...]; the permute restores the order.
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(i[0], i[1]), _mm256_packs_epi32(i[2], i[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  s[0] = hsum_epi32(_mm256_add_epi32(i[0], i[1]));
  s[1] = hsum_epi32(_mm256_add_epi32(i[2], i[3]));
  return amax / 127.f;
}

// As the AVX-512 offset_sums; offset * q fits vpmaddubsw's int16 pairs (2 * 128 * 127).
inline void offset_sums(const int8_t* q, int offset, int32_t* c) {
  for (int h = 0; h < 2; ++h) {
    const __m256i p = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_set1_epi8(char(offset)), _mm256_loadu_si256((const __m256i*)(q + 32 * h))),
        _mm256_set1_epi16(1));
    _mm256_storeu_si256((__m256i*)(c + 8 * h), _mm256_sub_epi32(_mm256_setzero_si256(), p));
  }
}
#endif

// The activations of one call: per row t, xq int8 (cols + 256 zero padding), and per group
// of 16 (32) values the scale dx16 (dx32) and the sum xsum16 (xsum32), zero padded. For a
// weight type stored with a constant offset o (w = a * (u - o)), corr holds -o * (the sum
// of each 4 consecutive xq), one int32 lane per 4 values: a dot product started from it
// yields sum (u - o) * xq directly.
struct Q8Act {
  int64_t cols, stride_q, stride_g, stride_c;
  std::vector<int8_t> q;
  std::vector<float> dx16, xsum16, dx32, xsum32;
  std::vector<int32_t> corr;
  // k4 layout (Q4_K, Q5_K on AVX-512): in every 128 values the middle two 32s swapped, so
  // that a 64-byte load of the block's nibbles pairs with xq directly (see gemv_q8_k4), and
  // per block of 256 one vector (dx32 of its 8 sub-blocks, then their xsum32).
  int64_t stride_s = 0;
  std::vector<float> dxs;
  Q8Act(const float* x, int64_t ldx, int64_t nt, int64_t cols_, int offset, bool k4 = false)
      : cols(cols_), stride_q(cols_ + 256), stride_g(cols_ / 16 + 16), stride_c(stride_q / 4),
        q(nt * stride_q, 0), dx16(nt * stride_g, 0.f), xsum16(nt * stride_g, 0.f),
        dx32(nt * stride_g, 0.f), xsum32(nt * stride_g, 0.f), corr(offset ? nt * stride_c : 0),
        stride_s(k4 ? 16 * (cols_ / 256) : 0), dxs(nt * stride_s) {
    for (int64_t t = 0; t < nt; ++t) {
      const float* xr = x + t * ldx;
      int8_t* qr = q.data() + t * stride_q;
      float* dr = dx16.data() + t * stride_g;
      float* sr = xsum16.data() + t * stride_g;
      for (int64_t b = 0; b < cols / 32; ++b) {
        int s[2];
        const float d = quantize32(xr + 32 * b, qr + 32 * b, s);
        dr[2 * b] = dr[2 * b + 1] = d;
        sr[2 * b] = d * float(s[0]);
        sr[2 * b + 1] = d * float(s[1]);
        dx32[t * stride_g + b] = d;
        xsum32[t * stride_g + b] = d * float(s[0] + s[1]);
      }
      if (k4) {
        for (int64_t b = 0; b < cols / 128; ++b) {
          int8_t tmp[32];
          std::memcpy(tmp, qr + 128 * b + 32, 32);
          std::memcpy(qr + 128 * b + 32, qr + 128 * b + 64, 32);
          std::memcpy(qr + 128 * b + 64, tmp, 32);
        }
        for (int64_t sb = 0; sb < cols / 256; ++sb) {
          std::memcpy(&dxs[t * stride_s + 16 * sb], &dx32[t * stride_g + 8 * sb], 32);
          std::memcpy(&dxs[t * stride_s + 16 * sb + 8], &xsum32[t * stride_g + 8 * sb], 32);
        }
      }
      if (offset)
        for (int64_t c = 0; c < stride_q / 64; ++c)
          offset_sums(qr + 64 * c, offset, corr.data() + t * stride_c + 16 * c);
    }
  }
};

// How the kernels read Q8_0 and Q4_K/Q5_K: AVX-512 as u = q + 128 (a constant offset) and
// with k4-ordered activations; AVX2 as signed values (vpsignb: vpmaddubsw's int16 pair sums
// would overflow with u up to 255) and in natural order.
constexpr int Q8_0_OFFSET = LOCALLLM_Q8 == 512 ? 128 : 0;
// Q6_K's -32: AVX-512 subtracts it once per block from the activation sums (decode_q6_k's
// xsum16 term), AVX2 starts its dot products from the offset correction.
constexpr int Q6_K_OFFSET = LOCALLLM_Q8 == 512 ? 0 : 32;
constexpr bool K4_ORDER = LOCALLLM_Q8 == 512;
// Whether the activations of a product with a `qtype` matrix are quantized in k4 order.
constexpr bool k4_order(int64_t qtype) { return K4_ORDER && (qtype == Q4_K || qtype == Q5_K); }

// The constant offset o of a type stored as w = a * (u - o), else 0.
constexpr int q8_offset(int64_t qtype) {
  return qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : qtype == Q8_0 ? Q8_0_OFFSET : qtype == Q6_K ? Q6_K_OFFSET
       : qtype == Q3_K ? 4 : 0;
}

// A legacy block's scale a and, for Q4_1/Q5_1, b = -m (w = a * u - b; for the offset types
// b = a * offset).
template <int BYTES>
inline void scales2(const uint8_t* p, float& a, float& b) {
  a = f16(p);
  if constexpr (BYTES == 20 || BYTES == 24) b = -f16(p + 2);               // Q4_1, Q5_1
  else b = a * (BYTES == 18 ? 8.f : BYTES == 22 ? 16.f : 128.f);          // Q4_0, Q5_0, Q8_0
}

// Q4_K/Q5_K: the 8 six-bit scales and 8 mins packed in 12 bytes (llama.cpp
// get_scale_min_k4) as 16 bytes [sc_0..7, m_0..7].
inline __m128i k4_scale_bytes(const uint8_t* p) {
  const __m128i v = _mm_loadu_si128((const __m128i*)(p + 4));  // 12 bytes + 4 of qs
  const __m128i m4 = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(v, _mm_set1_epi8(63));
  const __m128i top = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(v, 6), _mm_set1_epi8(3)), 4);
  const __m128i nlo = _mm_and_si128(v, m4), nhi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
  const __m128i s01 = _mm_shuffle_epi8(lo, _mm_setr_epi8(0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1));
  const __m128i s2 = _mm_shuffle_epi8(nlo, _mm_setr_epi8(-1, -1, -1, -1, 8, 9, 10, 11, -1, -1, -1, -1, -1, -1, -1, -1));
  const __m128i s3 = _mm_shuffle_epi8(nhi, _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 8, 9, 10, 11));
  const __m128i s4 = _mm_shuffle_epi8(top, _mm_setr_epi8(-1, -1, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1, 4, 5, 6, 7));
  return _mm_or_si128(_mm_or_si128(s01, s2), _mm_or_si128(s3, s4));
}

// The weights stream from DRAM once per token: ask for the block PREFETCH_AHEAD bytes on
// into L1 and PREFETCH_FAR bytes on into L2 (the hardware prefetcher alone leaves the
// K-quant kernels ~20% short of the bandwidth; the second, farther stream keeps more misses
// in flight: one token's GEMVs of Llama-3.2-1B Q4_K_M, 1 thread, 56 -> 49 ms).
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 2048
#endif
#ifndef PREFETCH_FAR
#define PREFETCH_FAR 16384
#endif
template <int BYTES>
inline void prefetch_block(const uint8_t* p) {
  for (int o = 0; o < BYTES; o += 64) {
    _mm_prefetch((const char*)p + PREFETCH_AHEAD + o, _MM_HINT_T0);
    _mm_prefetch((const char*)p + PREFETCH_FAR + o, _MM_HINT_T1);
  }
}
#endif  // LOCALLLM_Q8

#if LOCALLLM_Q8 == 512

// A K-quant block (256 weights) decoded: 64 u8 lanes per chunk and, per group of 16
// weights, the scale a and the offset b: w = a * u - b (b unused for a constant offset).
struct U8Block {
  __m512i u[4];
  __m512 a, b;
};

inline __m512i join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}


// Two 32-weight blocks (p0, p1) -> 64 u8 lanes, block p0's weights first, and each block's
// (a, b). BYTES: block size; ASYM: a stored minimum (b = -m) instead of an offset.
// Q4_0 (d, qs[16]): offset 8; Q4_1 (d, m, qs[16]); Q5_0 (d, qh[4], qs[16]): offset 16;
// Q5_1 (d, m, qh[4], qs[16]); Q8_0 (d, qs[32] int8): offset 128 (sign bit flipped).
template <int BYTES>
inline __m512i lanes2(const uint8_t* p0, const uint8_t* p1) {
  if constexpr (BYTES == 34) {  // Q8_0
    return _mm512_xor_si512(join(_mm256_loadu_si256((const __m256i*)(p0 + 2)),
                                 _mm256_loadu_si256((const __m256i*)(p1 + 2))),
                            _mm512_set1_epi8(char(0x80)));
  } else {
    constexpr int QS = BYTES - 16;  // the nibbles are the last 16 bytes of every block
    const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(p1 + QS)),
                                       _mm_loadu_si128((const __m128i*)(p0 + QS)));
    const __m512i m = _mm512_set1_epi8(0x0F);
    // 128-bit lanes [lo0, lo1, hi0, hi1] -> [lo0, hi0, lo1, hi1]
    __m512i u = _mm512_and_si512(join(v, _mm256_srli_epi16(v, 4)), m);
    u = _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));
    if constexpr (BYTES == 22 || BYTES == 24) {  // Q5_0, Q5_1: the fifth bits
      uint32_t h0, h1;
      std::memcpy(&h0, p0 + QS - 4, 4);
      std::memcpy(&h1, p1 + QS - 4, 4);
      u = _mm512_or_si512(u, _mm512_maskz_set1_epi8(__mmask64(h0 | uint64_t(h1) << 32), 0x10));
    }
    return u;
  }
}

// Q4_K/Q5_K scales of up to four consecutive blocks at once (blocks p, p + BYTES, ...;
// past n, block 0 again), so that the unpacking runs once per four blocks. 128-bit lane i
// holds block i's first 16 bytes (d, dmin, scales[12]); llama.cpp get_scale_min_k4 gives
// scale j < 4 = q[j] & 63, min j < 4 = q[j + 4] & 63, and for j >= 4 scale = (q[j + 4] & 15)
// | (q[j - 4] >> 6) << 4, min = (q[j + 4] >> 4) | (q[j] >> 6) << 4 (q = scales, at lane
// byte 4 + k). Returns sm, lane i = block i's sc_0..7 then m_0..7 (bytes), and dd, the 8
// floats [d_0, dmin_0, d_1, dmin_1, ...].
template <int BYTES>
inline void k4_scales4(const uint8_t* p, int n, __m512i& sm, __m256& dd) {
  __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p));
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(p + (n > 1 ? BYTES : 0))), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(p + (n > 2 ? 2 * BYTES : 0))), 2);
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(p + (n > 3 ? 3 * BYTES : 0))), 3);
  const auto lanes = [](__m128i x) { return _mm512_broadcast_i32x4(x); };
  // a: q[0..7] & 63 (bytes 4-11), q[8..11] & 15 (bytes 12-15)
  const __m512i a = _mm512_and_si512(v, lanes(_mm_setr_epi8(0, 0, 0, 0, 63, 63, 63, 63, 63, 63, 63, 63, 15, 15, 15, 15)));
  // b: (q[0..7] >> 6) << 4 (16-bit words 2-5 shifted by 2), q[8..11] >> 4 (words 6-7 by 4)
  const __m512i b = _mm512_and_si512(
      _mm512_srlv_epi16(v, lanes(_mm_setr_epi16(0, 0, 2, 2, 2, 2, 4, 4))),
      lanes(_mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 48, 48, 48, 48, 15, 15, 15, 15)));
  const __m512i sa = _mm512_shuffle_epi8(a, lanes(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, -1, -1, -1, -1)));
  const __m512i sb = _mm512_shuffle_epi8(b, lanes(_mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11)));
  const __m512i sc = _mm512_shuffle_epi8(b, lanes(_mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 12, 13, 14, 15)));
  sm = _mm512_ternarylogic_epi32(sa, sb, sc, 0xFE);  // sa | sb | sc
  dd = _mm256_cvtph_ps(_mm512_castsi512_si128(
      _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v)));
}

// Block I of a k4_scales4 group as one vector [d * sc_0..7, dmin * m_0..7].
template <int I>
inline __m512 k4_block_scales(__m512i sm, __m256 dd) {
  const __m128i b = I == 0 ? _mm512_castsi512_si128(sm) : _mm512_extracti32x4_epi32(sm, I);
  const __m512 ddv = _mm512_permutexvar_ps(
      _mm512_setr_epi32(2 * I, 2 * I, 2 * I, 2 * I, 2 * I, 2 * I, 2 * I, 2 * I, 2 * I + 1,
                        2 * I + 1, 2 * I + 1, 2 * I + 1, 2 * I + 1, 2 * I + 1, 2 * I + 1, 2 * I + 1),
      _mm512_castps256_ps512(dd));
  return _mm512_mul_ps(ddv, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b)));
}

// The 256 nibbles (plus Q5_K's fifth bits) of a Q4_K/Q5_K block in k4 order: chunk 2h is
// the low nibbles of qs[64h .. 64h + 63], chunk 2h + 1 their high nibbles, so chunk 2h holds
// sub-blocks 4h and 4h + 2, chunk 2h + 1 sub-blocks 4h + 1 and 4h + 3.
template <bool FIVE>
inline void k4_lanes(const uint8_t* p, __m512i* u) {
  const uint8_t* qs = p + (FIVE ? 48 : 16);
  const __m512i m = _mm512_set1_epi8(0x0F);
  __m512i hb = _mm512_setzero_si512();
  if constexpr (FIVE) {  // qh[32]: bit 2j of qh[l] is weight 64j + l's, bit 2j + 1 is 64j + 32 + l's
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(p + 16));
    hb = join(qh, _mm256_srli_epi16(qh, 2));
  }
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_loadu_si512((const void*)(qs + 64 * h));
    __m512i lo = _mm512_and_si512(v, m), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m);
    if constexpr (FIVE) {
      const __m512i one = _mm512_set1_epi8(1);
      lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4 * h), one), 4));
      hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hb, 4 * h + 1), one), 4));
    }
    u[2 * h] = lo;
    u[2 * h + 1] = hi;
  }
}

inline void decode_q6_k(const uint8_t* p, U8Block& o) {
  // ql[128], qh[64], scales[16] int8, d; weight = d * sc_g * (u - 32)
  const float dd = f16(p + 208);
  const __m128i sc8 = _mm_loadu_si128((const __m128i*)(p + 192));
  o.a = _mm512_mul_ps(_mm512_set1_ps(dd), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)));
  o.b = _mm512_mul_ps(o.a, _mm512_set1_ps(32.f));  // the offset, applied with xsum16
  const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
  for (int n = 0; n < 2; ++n) {
    const __m512i ql = _mm512_loadu_si512((const void*)(p + 64 * n));
    const __m256i h = _mm256_loadu_si256((const __m256i*)(p + 128 + 32 * n));
    const __m512i hh = join(h, _mm256_srli_epi16(h, 2));  // bits 0-1 | bits 2-3
    // u = (low nibble) | (two high bits << 4): ternary logic 0xEC = (A & C) | B, C = 0x0F
    const __m512i hi0 = _mm512_slli_epi16(_mm512_and_si512(hh, m2), 4);
    const __m512i hi1 = _mm512_and_si512(hh, _mm512_set1_epi8(0x30));  // bits 4-5 already
    o.u[2 * n] = _mm512_ternarylogic_epi32(ql, hi0, m4, 0xEC);
    o.u[2 * n + 1] = _mm512_ternarylogic_epi32(_mm512_srli_epi16(ql, 4), hi1, m4, 0xEC);
  }
}

inline void decode_q2_k(const uint8_t* p, U8Block& o) {
  // scales[16], qs[64], d, dmin; weight = d * (sc & 15) * u - dmin * (sc >> 4)
  const float dd = f16(p + 80), dmin = f16(p + 82);
  const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  o.a = _mm512_mul_ps(_mm512_set1_ps(dd), _mm512_cvtepi32_ps(_mm512_and_si512(sc, _mm512_set1_epi32(15))));
  o.b = _mm512_mul_ps(_mm512_set1_ps(dmin), _mm512_cvtepi32_ps(_mm512_srli_epi32(sc, 4)));
  const __m256i m2 = _mm256_set1_epi8(0x03);
  for (int n = 0; n < 2; ++n) {
    const __m256i q = _mm256_loadu_si256((const __m256i*)(p + 16 + 32 * n));
    for (int k = 0; k < 4; k += 2)
      o.u[2 * n + k / 2] = join(_mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m2),
                                _mm256_and_si256(_mm256_srli_epi16(q, 2 * k + 2), m2));
  }
}

inline void decode_q3_k(const uint8_t* p, U8Block& o) {
  // hmask[32], qs[64], scales[12], d; weight = d * (sc - 32) * (u - 4), u = q2 | hbit << 2
  const float dd = f16(p + 108);
  uint32_t aux[4];
  q3_k_scales(p, aux);
  const __m512i sc = _mm512_cvtepu8_epi32(
      _mm_set_epi32(int(aux[3]), int(aux[2]), int(aux[1]), int(aux[0])));
  o.a = _mm512_mul_ps(_mm512_set1_ps(dd), _mm512_cvtepi32_ps(_mm512_sub_epi32(sc, _mm512_set1_epi32(32))));
  const __m256i m2 = _mm256_set1_epi8(0x03), one = _mm256_set1_epi8(1);
  const __m256i hm = _mm256_loadu_si256((const __m256i*)p);
  for (int n = 0; n < 2; ++n) {
    const __m256i q = _mm256_loadu_si256((const __m256i*)(p + 32 + 32 * n));
    for (int k = 0; k < 4; k += 2) {
      const int bit = 4 * n + k;
      const __m256i u0 = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m2),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, bit), one), 2));
      const __m256i u1 = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(q, 2 * k + 2), m2),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, bit + 1), one), 2));
      o.u[2 * n + k / 2] = join(u0, u1);
    }
  }
}

using DecodeFn = void (*)(const uint8_t*, U8Block&);

template <int N>
inline __m512 sum_acc(const __m512* a) {
  if constexpr (N == 4) return _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
  else if constexpr (N == 2) return _mm512_add_ps(a[0], a[1]);
  else return a[0];
}

// Rows [r0, r1) of a K-quant W with a scale per 16 weights (Q2_K, Q3_K, Q6_K) times NT
// quantized activation rows.
template <int NT, int BYTES, DecodeFn DECODE, int OFF>
void gemv_q8_kquant(const uint8_t* w, int64_t row_bytes, const Q8Act& xa, float* out,
                    int64_t ldo, int64_t r0, int64_t r1) {
  constexpr int NACC = NT == 1 ? 4 : NT <= 3 ? 2 : 1;
  // lane j of chunk c's dot product covers weights 64c + 4j .. 64c + 4j + 3: group 4c + j / 4
  const __m512i perm[4] = {
      _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0),
      _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4),
      _mm512_set_epi32(11, 11, 11, 11, 10, 10, 10, 10, 9, 9, 9, 9, 8, 8, 8, 8),
      _mm512_set_epi32(15, 15, 15, 15, 14, 14, 14, 14, 13, 13, 13, 13, 12, 12, 12, 12)};
  const int64_t nblocks = xa.cols / QK_K;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    __m512 acc[NT][NACC];  // NACC independent sums: the fma chain is not the bound
    for (int t = 0; t < NT; ++t)
      for (int k = 0; k < NACC; ++k) acc[t][k] = _mm512_setzero_ps();
    for (int64_t s = 0; s < nblocks; ++s) {
      U8Block blk;
      prefetch_block<BYTES>(row + s * BYTES);
      DECODE(row + s * BYTES, blk);
      for (int t = 0; t < NT; ++t) {
        const int8_t* xq = xa.q.data() + t * xa.stride_q + QK_K * s;
        const int64_t g0 = t * xa.stride_g + 16 * s;
        const int32_t* corr = OFF ? xa.corr.data() + t * xa.stride_c + 64 * s : nullptr;
        const __m512 av = _mm512_mul_ps(blk.a, _mm512_loadu_ps(xa.dx16.data() + g0));
        if constexpr (!OFF)
          acc[t][0] = _mm512_fnmadd_ps(blk.b, _mm512_loadu_ps(xa.xsum16.data() + g0), acc[t][0]);
        for (int c = 0; c < 4; ++c) {
          const __m512i p0 = OFF ? _mm512_loadu_si512((const void*)(corr + 16 * c)) : _mm512_setzero_si512();
          const __m512i p = _mm512_dpbusd_epi32(p0, blk.u[c], _mm512_loadu_si512((const void*)(xq + 64 * c)));
          acc[t][c % NACC] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(perm[c], av),
                                             acc[t][c % NACC]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(sum_acc<NACC>(acc[t]));
  }
}

// Q4_K / Q5_K (a scale and a minimum per 32 weights) against k4-ordered activations.
template <int NT, int BYTES>
void gemv_q8_k4(const uint8_t* w, int64_t row_bytes, const Q8Act& xa, float* out,
                int64_t ldo, int64_t r0, int64_t r1) {
  constexpr int NACC = NT == 1 ? 4 : NT <= 3 ? 2 : 1;
  const __m512i perm[4] = {  // sub-blocks of the chunks in k4 order
      _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0),
      _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1),
      _mm512_set_epi32(6, 6, 6, 6, 6, 6, 6, 6, 4, 4, 4, 4, 4, 4, 4, 4),
      _mm512_set_epi32(7, 7, 7, 7, 7, 7, 7, 7, 5, 5, 5, 5, 5, 5, 5, 5)};
  const int64_t nblocks = xa.cols / QK_K;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    __m512 acc[NT][NACC], bacc[NT];  // bacc: lanes 8-15 sum dmin * m * xsum
    for (int t = 0; t < NT; ++t) {
      bacc[t] = _mm512_setzero_ps();
      for (int k = 0; k < NACC; ++k) acc[t][k] = _mm512_setzero_ps();
    }
    for (int64_t s0 = 0; s0 < nblocks; s0 += 4) {  // the scales of four blocks at once
      const int n = int(std::min<int64_t>(4, nblocks - s0));
      __m512i sm;
      __m256 dd;
      k4_scales4<BYTES>(row + s0 * BYTES, n, sm, dd);
      const auto block = [&](auto i) {
        constexpr int I = decltype(i)::value;
        const int64_t s = s0 + I;
        const uint8_t* p = row + s * BYTES;
        prefetch_block<BYTES>(p);
        const __m512 ab = k4_block_scales<I>(sm, dd);
        __m512i u[4];
        k4_lanes<BYTES == 176>(p, u);
        for (int t = 0; t < NT; ++t) {
          const int8_t* xq = xa.q.data() + t * xa.stride_q + QK_K * s;
          const __m512 sc = _mm512_mul_ps(ab, _mm512_loadu_ps(xa.dxs.data() + t * xa.stride_s + 16 * s));
          bacc[t] = _mm512_mask_add_ps(bacc[t], 0xFF00, bacc[t], sc);
          for (int c = 0; c < 4; ++c) {
            const __m512i d = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[c],
                                                  _mm512_loadu_si512((const void*)(xq + 64 * c)));
            acc[t][c % NACC] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_permutexvar_ps(perm[c], sc),
                                               acc[t][c % NACC]);
          }
        }
      };
      block(std::integral_constant<int, 0>{});
      if (n > 1) block(std::integral_constant<int, 1>{});
      if (n > 2) block(std::integral_constant<int, 2>{});
      if (n > 3) block(std::integral_constant<int, 3>{});
    }
    for (int t = 0; t < NT; ++t)
      out[t * ldo + r] = _mm512_reduce_add_ps(_mm512_sub_ps(sum_acc<NACC>(acc[t]), bacc[t]));
  }
}

// Legacy formats (blocks of 32): two blocks per 64-lane dot product; lanes 0-7 take the
// first block's scale, lanes 8-15 the second's.
template <int NT, int BYTES, int OFF>
void gemv_q8_legacy(const uint8_t* w, int64_t row_bytes, const Q8Act& xa, float* out,
                    int64_t ldo, int64_t r0, int64_t r1) {
  const int64_t nblocks = xa.cols / QK;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    __m512 acc[NT];
    float bsum[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm512_setzero_ps(), bsum[t] = 0.f;
    for (int64_t i = 0; i < nblocks; i += 2) {
      // an odd last block pairs with itself, its copy weighted 0 (its activations are the
      // zero padding past cols)
      const bool two = i + 1 < nblocks;
      const uint8_t* q0 = row + i * BYTES;
      const uint8_t* q1 = two ? q0 + BYTES : q0;
      prefetch_block<2 * BYTES>(q0);
      float a0, b0, a1, b1;
      scales2<BYTES>(q0, a0, b0);
      scales2<BYTES>(q1, a1, b1);
      if (!two) a1 = b1 = 0.f;
      const __m512i u = lanes2<BYTES>(q0, q1);
      for (int t = 0; t < NT; ++t) {
        const int8_t* xq = xa.q.data() + t * xa.stride_q + QK * i;
        const float* dx = xa.dx32.data() + t * xa.stride_g + i;
        const float* xs = xa.xsum32.data() + t * xa.stride_g + i;
        const __m512i init = OFF ? _mm512_loadu_si512((const void*)(xa.corr.data() + t * xa.stride_c + 8 * i))
                                 : _mm512_setzero_si512();
        const __m512i p = _mm512_dpbusd_epi32(init, u, _mm512_loadu_si512((const void*)xq));
        const __m512 sc = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a0 * dx[0]), _mm512_set1_ps(a1 * dx[1]));
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), sc, acc[t]);
        if constexpr (!OFF) bsum[t] += b0 * xs[0] + b1 * xs[1];
      }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo + r] = _mm512_reduce_add_ps(acc[t]) - bsum[t];
  }
}

#endif  // LOCALLLM_Q8 == 512

#if LOCALLLM_Q8 == 256
// ---- the int8 GEMV on AVX2 ------------------------------------------------------------------
// The same products as the AVX-512 kernels above, 32 weights (one __m256i of u8 lanes) per
// integer dot product: vpmaddubsw multiplies u8 lanes by the int8 activations and adds
// adjacent pairs into int16, vpmaddwd adds those pairs into int32 lanes of 4 values (llama.cpp
// ggml-cpu/arch/x86/quants.c mul_sum_us8_pairs_float). The int16 pair sums are exact while
// 2 * u * 127 <= 32767: u <= 63 holds for every format read as unsigned here (Q2_K 3, Q3_K 7,
// Q4_* 15, Q5_* 31, Q6_K 63); Q8_0 (-128..127) is multiplied as |w| times x with w's sign
// (vpsignb, as llama.cpp mul_sum_i8_pairs_float), 2 * 128 * 127 < 32768. With AVX-VNNI the
// whole product is one vpdpbusd (int32 sums, no int16 step).
namespace q8avx2 {

inline __m256i load(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }

// acc + (lane i: sum_{j<4} u[4i + j] * x[4i + j]), u unsigned 8-bit, |x| <= 127; without
// AVX-VNNI u <= 63, or u <= 128 (Q8_0's |w|), so that no int16 pair sum saturates.
inline __m256i dot4(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

// Lane c: the sum of d[c]'s 8 lanes (exact int32 sums: one conversion and one fma per
// block instead of one per sub-block).
inline __m256i lane_sums(const __m256i d[8]) {
  // hadd pairs lanes within 128-bit halves: after two levels lane c (c < 4) of q0 holds
  // the low half's sum of d[c] and lane c + 4 its high half's; q1 the same for d[4..7]
  const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[0], d[1]), _mm256_hadd_epi32(d[2], d[3]));
  const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(d[4], d[5]), _mm256_hadd_epi32(d[6], d[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(q0, q1, 0x20), _mm256_permute2x128_si256(q0, q1, 0x31));
}

// A K-quant block with a scale per 16 weights (Q2_K, Q3_K, Q6_K) decoded: u[c] the u8 lanes
// of weights 32c .. 32c + 31, a and b the scales and offsets of groups 0-7 ([0]) and 8-15
// ([1]): w = a * u - b (b unused for a constant offset).
struct Block16 {
  __m256i u[8];
  __m256 a[2], b[2];
};

inline void decode_q6_k(const uint8_t* p, Block16& o) {
  // ql[128], qh[64], scales[16] int8, d; weight 128n + 32k + l = d * sc * (u - 32)
  const __m256 dd = _mm256_set1_ps(f16(p + 208));
  const __m128i sc = _mm_loadu_si128((const __m128i*)(p + 192));
  o.a[0] = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc)));
  o.a[1] = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8))));
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  for (int n = 0; n < 2; ++n) {
    const __m256i l0 = load(p + 64 * n), l1 = load(p + 64 * n + 32), h = load(p + 128 + 32 * n);
    // the two high bits of weight 32k + l are bits 2k, 2k + 1 of qh[l], moved to bits 4-5
    o.u[4 * n] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4), m30));
    o.u[4 * n + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(h, 2), m30));
    o.u[4 * n + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(h, m30));
    o.u[4 * n + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                     _mm256_and_si256(_mm256_srli_epi16(h, 2), m30));
  }
}

inline void decode_q2_k(const uint8_t* p, Block16& o) {
  // scales[16], qs[64], d, dmin; weight 128n + 32k + l = d * (sc & 15) * u - dmin * (sc >> 4)
  const __m256 dd = _mm256_set1_ps(f16(p + 80)), dmin = _mm256_set1_ps(f16(p + 82));
  const __m128i sc8 = _mm_loadu_si128((const __m128i*)p);
  for (int h = 0; h < 2; ++h) {
    const __m256i sc = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(sc8, 8) : sc8);
    o.a[h] = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_and_si256(sc, _mm256_set1_epi32(15))));
    o.b[h] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_srli_epi32(sc, 4)));
  }
  const __m256i m2 = _mm256_set1_epi8(0x03);
  for (int n = 0; n < 2; ++n) {
    const __m256i q = load(p + 16 + 32 * n);
    for (int k = 0; k < 4; ++k) o.u[4 * n + k] = _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m2);
  }
}

inline void decode_q3_k(const uint8_t* p, Block16& o) {
  // hmask[32], qs[64], scales[12], d; weight 128n + 32k + l = d * (sc - 32) * (u - 4),
  // u = q2 | hbit << 2
  const __m256 dd = _mm256_set1_ps(f16(p + 108));
  uint32_t aux[4];
  q3_k_scales(p, aux);
  const __m128i sc8 = _mm_loadu_si128((const __m128i*)aux);
  for (int h = 0; h < 2; ++h) {
    const __m256i sc = _mm256_cvtepu8_epi32(h ? _mm_srli_si128(sc8, 8) : sc8);
    o.a[h] = _mm256_mul_ps(dd, _mm256_cvtepi32_ps(_mm256_sub_epi32(sc, _mm256_set1_epi32(32))));
  }
  const __m256i m2 = _mm256_set1_epi8(0x03), one = _mm256_set1_epi8(1);
  const __m256i hm = load(p);
  for (int n = 0; n < 2; ++n) {
    const __m256i q = load(p + 32 + 32 * n);
    for (int k = 0; k < 4; ++k)
      o.u[4 * n + k] = _mm256_or_si256(
          _mm256_and_si256(_mm256_srli_epi16(q, 2 * k), m2),
          _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hm, 4 * n + k), one), 2));
  }
}

using DecodeFn = void (*)(const uint8_t*, Block16&);

// Rows [r0, r1) of a K-quant W with a scale per 16 weights times NT activation rows.
template <int NT, int BYTES, DecodeFn DECODE, int OFF>
void gemv_q8_kquant(const uint8_t* w, int64_t row_bytes, const Q8Act& xa, float* out, int64_t ldo,
                 int64_t r0, int64_t r1) {
  constexpr int NACC = NT == 1 ? 2 : 1;
  const int64_t nblocks = xa.cols / QK_K;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    __m256 acc[NT][NACC];
    for (int t = 0; t < NT; ++t)
      for (int k = 0; k < NACC; ++k) acc[t][k] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nblocks; ++s) {
      Block16 blk;
      prefetch_block<BYTES>(row + s * BYTES);
      DECODE(row + s * BYTES, blk);
      for (int t = 0; t < NT; ++t) {
        const int8_t* xq = xa.q.data() + t * xa.stride_q + QK_K * s;
        const int64_t g0 = t * xa.stride_g + 16 * s;
        const int32_t* corr = OFF ? xa.corr.data() + t * xa.stride_c + 64 * s : nullptr;
        __m256i p[8];
        for (int c = 0; c < 8; ++c)
          p[c] = dot4(OFF ? load(corr + 8 * c) : _mm256_setzero_si256(), blk.u[c], load(xq + 32 * c));
        for (int h = 0; h < 2; ++h) {  // groups 8h .. 8h + 7: chunks 4h .. 4h + 3
          const __m256 av = _mm256_mul_ps(blk.a[h], _mm256_loadu_ps(xa.dx16.data() + g0 + 8 * h));
          if constexpr (!OFF)
            acc[t][0] = _mm256_fnmadd_ps(blk.b[h], _mm256_loadu_ps(xa.xsum16.data() + g0 + 8 * h), acc[t][0]);
          // chunk c's lanes 0-3 are group 2c, lanes 4-7 group 2c + 1: two levels of hadd
          // give the groups' sums in the order 0, 2, 4, 6, 1, 3, 5, 7 (of this half)
          const __m256i q = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4 * h], p[4 * h + 1]),
                                              _mm256_hadd_epi32(p[4 * h + 2], p[4 * h + 3]));
          acc[t][h % NACC] = _mm256_fmadd_ps(
              _mm256_cvtepi32_ps(q), _mm256_permutevar8x32_ps(av, _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7)),
              acc[t][h % NACC]);
        }
      }
    }
    for (int t = 0; t < NT; ++t)
      out[t * ldo + r] = hsum(NACC == 2 ? _mm256_add_ps(acc[t][0], acc[t][NACC - 1]) : acc[t][0]);
  }
}

// Q4_K / Q5_K (a scale and a minimum per 32 weights; activations in natural order).
template <int NT, int BYTES>
void gemv_q8_k4(const uint8_t* w, int64_t row_bytes, const Q8Act& xa, float* out, int64_t ldo,
             int64_t r0, int64_t r1) {
  constexpr bool FIVE = BYTES == 176;
  const int64_t nblocks = xa.cols / QK_K;
  const __m256i m4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    __m256 acc[NT], bacc[NT];  // bacc: sum of dmin * m * xsum
    for (int t = 0; t < NT; ++t) acc[t] = bacc[t] = _mm256_setzero_ps();
    for (int64_t s = 0; s < nblocks; ++s) {
      const uint8_t* p = row + s * BYTES;
      prefetch_block<BYTES>(p);
      // d, dmin, scales[12], (Q5_K: qh[32]), qs[128]: sub-block 2j is the low nibbles of
      // qs[32j .. 32j + 31], 2j + 1 their high nibbles; Q5_K's fifth bits are bits 2j, 2j + 1
      // of qh
      const __m128i sm = k4_scale_bytes(p);
      const __m256 a = _mm256_mul_ps(_mm256_set1_ps(f16(p)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(sm)));
      const __m256 b = _mm256_mul_ps(_mm256_set1_ps(f16(p + 2)),
                                     _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(sm, 8))));
      const uint8_t* qs = p + (FIVE ? 48 : 16);
      const __m256i qh = FIVE ? load(p + 16) : _mm256_setzero_si256();
      __m256i u[8];
      for (int j = 0; j < 4; ++j) {
        const __m256i v = load(qs + 32 * j);
        u[2 * j] = _mm256_and_si256(v, m4);
        u[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if constexpr (FIVE) {
          u[2 * j] = _mm256_or_si256(u[2 * j], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j), one), 4));
          u[2 * j + 1] = _mm256_or_si256(
              u[2 * j + 1], _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * j + 1), one), 4));
        }
      }
      for (int t = 0; t < NT; ++t) {
        const int8_t* xq = xa.q.data() + t * xa.stride_q + QK_K * s;
        const int64_t g = t * xa.stride_g + 8 * s;
        const __m256 sc = _mm256_mul_ps(a, _mm256_loadu_ps(xa.dx32.data() + g));
        bacc[t] = _mm256_fmadd_ps(b, _mm256_loadu_ps(xa.xsum32.data() + g), bacc[t]);
        __m256i d[8];
        for (int c = 0; c < 8; ++c) d[c] = dot4(_mm256_setzero_si256(), u[c], load(xq + 32 * c));
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lane_sums(d)), sc, acc[t]);
      }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo + r] = hsum(_mm256_sub_ps(acc[t], bacc[t]));
  }
}

// The 32 weights of a legacy block as u8 lanes (Q8_0: its int8 values).
// Q4_0 (d, qs[16]); Q4_1 (d, m, qs[16]); Q5_0 (d, qh[4], qs[16]); Q5_1 (d, m, qh[4], qs[16]);
// Q8_0 (d, qs[32]): weights 0-15 are the low nibbles of qs, 16-31 the high ones.
template <int BYTES>
inline __m256i lanes(const uint8_t* p) {
  if constexpr (BYTES == 34) {
    return load(p + 2);
  } else {
    constexpr int QS = BYTES - 16;  // the nibbles are the last 16 bytes of every block
    const __m128i v = _mm_loadu_si128((const __m128i*)(p + QS));
    __m256i u = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
    if constexpr (BYTES == 22 || BYTES == 24) {  // Q5_0, Q5_1: bit j of qh is weight j's 0x10
      uint32_t h;
      std::memcpy(&h, p + QS - 4, 4);
      u = _mm256_or_si256(u, _mm256_set_m128i(high_bits16(h >> 16), high_bits16(h)));
    }
    return u;
  }
}

// Legacy formats (blocks of 32); OFF: the constant offset taken from corr (Q4_0, Q5_0).
template <int NT, int BYTES, int OFF>
void gemv_q8_legacy(const uint8_t* w, int64_t row_bytes, const Q8Act& xa, float* out, int64_t ldo,
                 int64_t r0, int64_t r1) {
  constexpr bool MIN = BYTES == 20 || BYTES == 24;  // Q4_1, Q5_1: w = a * u - b
  const int64_t nblocks = xa.cols / QK;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    __m256 acc[NT];
    float bsum[NT];
    for (int t = 0; t < NT; ++t) acc[t] = _mm256_setzero_ps(), bsum[t] = 0.f;
    for (int64_t i = 0; i < nblocks; ++i) {
      const uint8_t* p = row + i * BYTES;
      prefetch_block<BYTES>(p);
      float a, b;
      scales2<BYTES>(p, a, b);
      const __m256i u = lanes<BYTES>(p);
      const __m256i au = BYTES == 34 ? _mm256_sign_epi8(u, u) : u;  // Q8_0: |w| as u8
      for (int t = 0; t < NT; ++t) {
        __m256i x = load(xa.q.data() + t * xa.stride_q + QK * i);
        if constexpr (BYTES == 34) x = _mm256_sign_epi8(x, u);  // x with w's sign
        const __m256i init = OFF ? load(xa.corr.data() + t * xa.stride_c + 8 * i) : _mm256_setzero_si256();
        const __m256i d = dot4(init, au, x);
        const int64_t g = t * xa.stride_g + i;
        acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_set1_ps(a * xa.dx32[g]), acc[t]);
        if constexpr (MIN) bsum[t] += b * xa.xsum32[g];
      }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo + r] = hsum(acc[t]) - bsum[t];
  }
}

}  // namespace q8avx2
using namespace q8avx2;
#endif  // LOCALLLM_Q8 == 256

#if defined(LOCALLLM_Q8)
// The kernels of either section by type and activation row count.
using GemvQ8Fn = void (*)(const uint8_t*, int64_t, const Q8Act&, float*, int64_t, int64_t, int64_t);

template <int NT>
GemvQ8Fn gemv_q8_for(int64_t qtype) {
  switch (qtype) {
    case Q4_0: return gemv_q8_legacy<NT, 18, q8_offset(Q4_0)>;
    case Q4_1: return gemv_q8_legacy<NT, 20, 0>;
    case Q5_0: return gemv_q8_legacy<NT, 22, q8_offset(Q5_0)>;
    case Q5_1: return gemv_q8_legacy<NT, 24, 0>;
    case Q8_0: return gemv_q8_legacy<NT, 34, q8_offset(Q8_0)>;
    case Q2_K: return gemv_q8_kquant<NT, 84, decode_q2_k, 0>;
    case Q3_K: return gemv_q8_kquant<NT, 110, decode_q3_k, q8_offset(Q3_K)>;
    case Q4_K: return gemv_q8_k4<NT, 144>;
    case Q5_K: return gemv_q8_k4<NT, 176>;
    case Q6_K: return gemv_q8_kquant<NT, 210, decode_q6_k, q8_offset(Q6_K)>;
    default: TORCH_CHECK(false, "localllm_cpu.gemv_q8: no int8 kernel for ggml type ", qtype);
  }
}

GemvQ8Fn gemv_q8_of(int64_t qtype, int64_t nt) {
  return by_rows(nt, "gemv_q8", [&](auto n) { return gemv_q8_for<decltype(n)::value>(qtype); });
}
#endif

// out (T, rows) float32 as gemv, from int8-quantized activations (see above).
void gemv_q8(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t rows, int64_t cols,
             at::Tensor& out) {
#if defined(LOCALLLM_Q8)
  const Format f = format_of(qtype);
  TORCH_CHECK(f.unpack != nullptr, "localllm_cpu.gemv_q8: float weights take gemv");
  check_weight(w, f, rows, cols);
  const int64_t nt = check_io("gemv_q8", x, out, rows, cols);
  const GemvQ8Fn fn = gemv_q8_of(qtype, nt);
  const Q8Act xa(x.data_ptr<float>(), x.stride(0), nt, cols, q8_offset(qtype), k4_order(qtype));
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = (cols / f.block) * f.bytes, ldo = out.stride(0);
  at::parallel_for(0, rows, grain_of(row_bytes), [&](int64_t r0, int64_t r1) {
    fn(wp, row_bytes, xa, op, ldo, r0, r1);
  });
#else
  TORCH_CHECK(false, "localllm_cpu.gemv_q8: built without AVX2 or AVX512-VNNI");
#endif
}

// One token through the k experts it selected of a stacked matrix W (n_expert * rows, cols):
// out[j, :] = W_e x_j for e = experts[j], x_j = x[0] (x of one row: the gate and up
// products) or x[j] (one input per expert: the down product), with x quantized as gemv_q8
// does. Only the selected experts' rows are read; one call per matrix instead of one per
// expert (llama.cpp's ggml_mul_mat_id for one token).
void gemv_q8_experts(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t rows,
                     int64_t cols, const at::Tensor& experts, at::Tensor& out) {
#if defined(LOCALLLM_Q8)
  const Format f = format_of(qtype);
  TORCH_CHECK(f.unpack != nullptr, "localllm_cpu.gemv_q8_experts: float weights take gemv");
  TORCH_CHECK(rows > 0 && cols > 0 && cols % f.block == 0,
              "localllm_cpu.gemv_q8_experts: bad shape (", rows, ", ", cols, ")");
  const int64_t row_bytes = (cols / f.block) * f.bytes;
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() &&
                  w.numel() % (rows * row_bytes) == 0,
              "localllm_cpu.gemv_q8_experts: weight must hold whole (", rows, ", ", cols,
              ") experts as contiguous uint8");
  const int64_t n_expert = w.numel() / (rows * row_bytes);
  TORCH_CHECK(experts.dim() == 1 && experts.scalar_type() == at::kLong && experts.is_contiguous(),
              "localllm_cpu.gemv_q8_experts: experts must be (k,) int64");
  const int64_t k = experts.size(0);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == cols &&
                  x.stride(1) == 1 && (x.size(0) == 1 || x.size(0) == k),
              "localllm_cpu.gemv_q8_experts: x must be (1, cols) or (k, cols) float32");
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.size(0) == k &&
                  out.size(1) >= rows && out.stride(1) == 1,
              "localllm_cpu.gemv_q8_experts: out must be (k, rows) float32");
  const int64_t* ex = experts.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j)
    TORCH_CHECK(ex[j] >= 0 && ex[j] < n_expert, "localllm_cpu.gemv_q8_experts: expert ", ex[j],
                " out of range [0, ", n_expert, ")");
  std::vector<Q8Act> acts;  // one per input row
  acts.reserve(x.size(0));
  for (int64_t i = 0; i < x.size(0); ++i)
    acts.emplace_back(x.data_ptr<float>() + i * x.stride(0), x.stride(0), 1, cols,
                      q8_offset(qtype), k4_order(qtype));
  const GemvQ8Fn fn = gemv_q8_of(qtype, 1);
  const uint8_t* wp = w.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  const int64_t ldo = out.stride(0);
  // The k experts' rows as one range [0, k * rows), split over the threads.
  at::parallel_for(0, k * rows, grain_of(row_bytes), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e;) {
      const int64_t j = i / rows, r0 = i % rows, r1 = std::min(rows, r0 + (e - i));
      fn(wp + ex[j] * rows * row_bytes, row_bytes, acts[acts.size() == 1 ? 0 : j], op + j * ldo,
         ldo, r0, r1);
      i += r1 - r0;
    }
  });
#else
  TORCH_CHECK(false, "localllm_cpu.gemv_q8_experts: built without AVX2 or AVX512-VNNI");
#endif
}

bool q8_available() {
#if defined(LOCALLLM_Q8)
  return true;
#else
  return false;
#endif
}

// moe_ffn_q8 is written for AVX512-VNNI (16 tokens per vpdpbusd); AVX2 builds keep the
// per-expert products.
bool moe_available() { return LOCALLLM_Q8 + 0 == 512; }

// Rows r0 .. r0 + out.size(0) - 1 of W dequantized into out (n, cols), float32 or bfloat16.
void dequant_rows(const at::Tensor& w, int64_t qtype, int64_t r0, int64_t cols, at::Tensor& out) {
  const Format f = format_of(qtype);
  TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous(),
              "localllm_cpu: weight must be a contiguous uint8 CPU tensor");
  TORCH_CHECK(cols > 0 && cols % f.block == 0, "localllm_cpu: cols=", cols,
              " is not a multiple of the block (", f.block, ")");
  const int64_t row_bytes = (cols / f.block) * f.bytes;
  const int64_t n = out.size(0);
  TORCH_CHECK(r0 >= 0 && (r0 + n) * row_bytes <= w.numel(), "localllm_cpu.dequant_rows: rows ",
              r0, "..", r0 + n, " are outside the weight");
  TORCH_CHECK(out.dim() == 2 && out.size(1) == cols && out.stride(1) == 1 &&
                  (out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16),
              "localllm_cpu.dequant_rows: out must be (n, cols) float32 or bfloat16");
  const uint8_t* wp = w.data_ptr<uint8_t>() + r0 * row_bytes;
  const int64_t ldo = out.stride(0);
  const bool to_bf16 = out.scalar_type() == at::kBFloat16;
  void* op = out.data_ptr();
  at::parallel_for(0, n, grain_of(row_bytes), [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(to_bf16 ? cols : 0);
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* row = wp + i * row_bytes;
      if (!to_bf16) {
        dequant_row(f, row, cols, static_cast<float*>(op) + i * ldo);
        continue;
      }
      dequant_row(f, row, cols, buf.data());
      uint16_t* dst = static_cast<uint16_t*>(op) + i * ldo;
      for (int64_t j = 0; j < cols; ++j) {  // round to nearest even (finite inputs)
        uint32_t u;
        std::memcpy(&u, &buf[j], 4);
        dst[j] = uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
      }
    }
  });
}

// ---- mixture of experts: a prompt's expert FFNs in one call ------------------------------
// moe_ffn_q8 runs llama.cpp's build_moe_ffn (SwiGLU experts) after the routing: every
// (token, slot) pair goes to its expert's group (counting sort by expert, tokens in order),
// and per expert: down(silu(gate(x)) * up(x)) over its tokens. Activations are quantized as
// the int8 GEMV does (Q8Act: one scale per 32 values), in batches of 16 tokens stored +128
// as u8 with the tokens' 4-value runs interleaved, so that one vpdpbusd multiplies 4
// weights of one row (broadcast, signed) with 16 tokens at once (one int32 lane per token)
// and each group's scales apply once per 16 tokens. Weights are unpacked per tile of rows
// (the float GEMV's unpack_*: signed int8, a scale and a minimum per 16) once per task, a
// task being (expert, tile of output rows), and the tile then multiplies every batch of the
// expert. Threads take tasks dynamically (experts get different token counts). The outputs
// are summed per token in increasing expert order, each times its routing weight (the
// order of the torch path, localllm.models.llama.moe_ffn). SiLU and the gated product are
// ops.cpp's (gated_values).
#if LOCALLLM_Q8 + 0 == 512
}  // namespace

namespace localllm_cpu {
void gated_values(const float* g, const float* u, float* y, int64_t n, int64_t act);  // ops.cpp
}  // namespace localllm_cpu

namespace {

// fn(i) for i in [0, n) on torch's threads, each thread taking the next i when it is done.
template <class Fn>
void dynamic_for(int64_t n, const Fn& fn) {
  std::atomic<int64_t> next{0};
  const int64_t nthreads = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  at::parallel_for(0, nthreads, 1, [&](int64_t, int64_t) {
    for (int64_t i = next.fetch_add(1); i < n; i = next.fetch_add(1)) fn(i);
  });
}

constexpr int MOE_LANES = 16;  // tokens per batch, one vector lane each
constexpr int MOE_ROWS = 8;    // weight rows per pass of a batch (sharing its loads)

// Values per scale group of a type's unpacked weights: 32 where unpack_* gives equal scales
// and minimums to both 16-value halves of every 32 (the legacy types, Q4_K, Q5_K), else 16.
int moe_group(int64_t qtype) { return qtype == Q2_K || qtype == Q3_K || qtype == Q6_K ? 16 : 32; }

// Up to 16 quantized activation rows (rows idx[0 .. n-1] of a Q8Act, quantized without
// offset) for a type of group gw: xp (cols / 4) x 16 tokens x 4 bytes, q + 128; per group g
// and token: dx[16 g + t] and xsum[16 g + t] (the group's sum of the quantized values times
// dx, for the asymmetric types). Lanes past n are zero activations.
struct MoeAct {
  std::vector<uint8_t> xp;
  std::vector<float> dx, xsum;
  MoeAct(const Q8Act& a, const int64_t* idx, int64_t n, int gw)
      : xp(a.cols * MOE_LANES, 0x80), dx(a.cols / gw * MOE_LANES, 0.f), xsum(dx.size(), 0.f) {
    const int64_t cols = a.cols;
    for (int64_t t = 0; t < n; ++t) {
      const int8_t* q = a.q.data() + idx[t] * a.stride_q;
      for (int64_t i = 0; i < cols / 4; ++i) {
        uint32_t v;
        std::memcpy(&v, q + 4 * i, 4);
        v ^= 0x80808080u;
        std::memcpy(xp.data() + 64 * i + 4 * t, &v, 4);
      }
      const int64_t r = idx[t] * a.stride_g;
      for (int64_t g = 0; g < cols / gw; ++g) {
        dx[MOE_LANES * g + t] = gw == 32 ? a.dx32[r + g] : a.dx16[r + g];
        xsum[MOE_LANES * g + t] = gw == 32 ? a.xsum32[r + g] : a.xsum16[r + g];
      }
    }
  }
};

// The sum of n = 16 or 32 int8 values.
inline int32_t sum_i8(const int8_t* q, int n) {
  const __m256i v = n == 32 ? _mm256_loadu_si256((const __m256i*)q)
                            : _mm256_zextsi128_si256(_mm_loadu_si128((const __m128i*)q));
  // q + 128 as unsigned bytes, summed per 8 (the zero padding of n = 16 adds 16 x 128)
  const __m256i s = _mm256_sad_epu8(_mm256_xor_si256(v, _mm256_set1_epi8(char(0x80))),
                                    _mm256_setzero_si256());
  const int64_t total = _mm256_extract_epi64(s, 0) + _mm256_extract_epi64(s, 1) +
                        _mm256_extract_epi64(s, 2) + _mm256_extract_epi64(s, 3);
  return int32_t(total - 128 * 32);
}

// Rows [r0, r1) of one expert's matrix unpacked (rows padded to MOE_ROWS with zeros): q
// signed int8, and per group of gw values the scale a, the minimum b (weight = q a - b) and
// corr = -128 * sum(q), which removes the +128 of the activations from the dot product.
struct MoeTile {
  int64_t rows, cols, ng;
  std::unique_ptr<int8_t[]> q;
  std::unique_ptr<float[]> a, b;
  std::unique_ptr<int32_t[]> corr;
  MoeTile(const Format& f, const uint8_t* w, int64_t row_bytes, int64_t r0, int64_t r1,
          int64_t cols_, int gw)
      : rows(r1 - r0), cols(cols_), ng(cols_ / gw) {
    const int64_t padded = (rows + MOE_ROWS - 1) / MOE_ROWS * MOE_ROWS;
    q.reset(new int8_t[padded * cols]);
    a.reset(new float[padded * ng]);
    b.reset(new float[padded * ng]);
    corr.reset(new int32_t[padded * ng]);
    std::fill(q.get() + rows * cols, q.get() + padded * cols, 0);
    std::fill(a.get() + rows * ng, a.get() + padded * ng, 0.f);
    std::fill(b.get() + rows * ng, b.get() + padded * ng, 0.f);
    std::fill(corr.get() + rows * ng, corr.get() + padded * ng, 0);
    float d[QK_K / G], m[QK_K / G];
    for (int64_t r = 0; r < rows; ++r) {
      const uint8_t* row = w + (r0 + r) * row_bytes;
      for (int64_t blk = 0; blk < cols / f.block; ++blk) {
        int8_t* qb = q.get() + r * cols + blk * f.block;
        if (f.asym) std::fill(m, m + QK_K / G, 0.f);
        f.unpack(row + blk * f.bytes, qb, d, m);
        for (int j = 0; j < f.block / gw; ++j) {
          const int64_t g = r * ng + blk * (f.block / gw) + j;
          a[g] = d[j * gw / G];
          b[g] = f.asym ? m[j * gw / G] : 0.f;
          corr[g] = -128 * sum_i8(qb + j * gw, gw);
        }
      }
    }
  }
};

// The tile's rows times one batch: out[t * ldo + r] for the batch's n tokens.
template <int GW, bool ASYM>
void moe_tile_batch(const MoeTile& w, const MoeAct& x, int64_t n, float* out, int64_t ldo) {
  for (int64_t r = 0; r < w.rows; r += MOE_ROWS) {
    __m512 f[MOE_ROWS];
    for (int k = 0; k < MOE_ROWS; ++k) f[k] = _mm512_setzero_ps();
    for (int64_t g = 0; g < w.ng; ++g) {
      __m512i acc[MOE_ROWS];
      for (int k = 0; k < MOE_ROWS; ++k) acc[k] = _mm512_set1_epi32(w.corr[(r + k) * w.ng + g]);
      const uint8_t* xg = x.xp.data() + g * GW * MOE_LANES;
      for (int i = 0; i < GW / 4; ++i) {
        const __m512i xv = _mm512_loadu_si512((const void*)(xg + 64 * i));
        for (int k = 0; k < MOE_ROWS; ++k) {
          int32_t wq;
          std::memcpy(&wq, w.q.get() + (r + k) * w.cols + g * GW + 4 * i, 4);
          acc[k] = _mm512_dpbusd_epi32(acc[k], xv, _mm512_set1_epi32(wq));
        }
      }
      const __m512 dx = _mm512_loadu_ps(x.dx.data() + MOE_LANES * g);
      for (int k = 0; k < MOE_ROWS; ++k) {
        const __m512 sc = _mm512_mul_ps(dx, _mm512_set1_ps(w.a[(r + k) * w.ng + g]));
        f[k] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[k]), sc, f[k]);
      }
      if constexpr (ASYM) {
        const __m512 xs = _mm512_loadu_ps(x.xsum.data() + MOE_LANES * g);
        for (int k = 0; k < MOE_ROWS; ++k)
          f[k] = _mm512_fnmadd_ps(_mm512_set1_ps(w.b[(r + k) * w.ng + g]), xs, f[k]);
      }
    }
    for (int k = 0; k < MOE_ROWS && r + k < w.rows; ++k) {
      alignas(64) float v[MOE_LANES];
      _mm512_store_ps(v, f[k]);
      for (int64_t t = 0; t < n; ++t) out[t * ldo + r + k] = v[t];
    }
  }
}

using MoeTileFn = void (*)(const MoeTile&, const MoeAct&, int64_t, float*, int64_t);

// Rows per task of an expert's (rows, cols) matrix: tiles of about 16 KiB of unpacked
// weights, a multiple of 16 rows (the gated product's vector width), as even as that allows.
int64_t moe_tile_rows(int64_t rows, int64_t cols) {
  const int64_t tiles = std::max<int64_t>(1, (rows * cols + (16 << 10) - 1) >> 14);
  return std::min<int64_t>(rows, ((rows + tiles - 1) / tiles + 15) / 16 * 16);
}

// One 3-D expert tensor (n_expert, rows, cols) in ggml blocks.
struct MoeMatrix {
  const uint8_t* data;
  Format f;
  int64_t rows, cols, row_bytes, expert_bytes;
  int gw;
  MoeTileFn fn;
  MoeMatrix(const at::Tensor& w, int64_t qtype, int64_t n_expert, int64_t rows_, int64_t cols_,
            const char* name)
      : f(format_of(qtype)), rows(rows_), cols(cols_), gw(moe_group(qtype)) {
    TORCH_CHECK(f.unpack != nullptr, "localllm_cpu.moe_ffn_q8: ", name, " is a float type");
    check_weight(w, f, n_expert * rows, cols);
    data = w.data_ptr<uint8_t>();
    row_bytes = (cols / f.block) * f.bytes;
    expert_bytes = rows * row_bytes;
    fn = gw == 32 ? (f.asym ? moe_tile_batch<32, true> : moe_tile_batch<32, false>)
                  : (f.asym ? moe_tile_batch<16, true> : moe_tile_batch<16, false>);
  }
  MoeTile tile(int64_t e, int64_t r0, int64_t r1) const {
    return MoeTile(f, data + e * expert_bytes, row_bytes, r0, r1, cols, gw);
  }
};

void moe_ffn_q8(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights,
                const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                int64_t gate_type, int64_t up_type, int64_t down_type, int64_t n_expert,
                int64_t n_ff, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "localllm_cpu.moe_ffn_q8: x must be (T, d) contiguous float32");
  const int64_t nt = x.size(0), d = x.size(1);
  TORCH_CHECK(chosen.dim() == 2 && chosen.size(0) == nt && chosen.scalar_type() == at::kLong &&
                  chosen.is_contiguous(), "localllm_cpu.moe_ffn_q8: chosen must be (T, k) int64");
  const int64_t k = chosen.size(1);
  TORCH_CHECK(weights.sizes() == chosen.sizes() && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(), "localllm_cpu.moe_ffn_q8: weights must be (T, k) float32");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == at::kFloat && out.is_contiguous(),
              "localllm_cpu.moe_ffn_q8: out must be (T, d) contiguous float32");
  TORCH_CHECK(n_expert > 0 && n_ff > 0, "localllm_cpu.moe_ffn_q8: n_expert and n_ff must be > 0");
  const MoeMatrix mg(gate, gate_type, n_expert, n_ff, d, "gate"),
      mu(up, up_type, n_expert, n_ff, d, "up"), md(down, down_type, n_expert, d, n_ff, "down");
  const int64_t* ch = chosen.data_ptr<int64_t>();
  const float* wt = weights.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const int64_t ns = nt * k;  // (token, slot) pairs
  // counting sort of the pairs by expert: pair i = t * k + j goes to position pos[i]
  std::vector<int64_t> start(n_expert + 1, 0), pos(ns), token(ns);
  for (int64_t i = 0; i < ns; ++i) {
    TORCH_CHECK(ch[i] >= 0 && ch[i] < n_expert, "localllm_cpu.moe_ffn_q8: expert ", ch[i],
                " out of range (", n_expert, " experts)");
    ++start[ch[i] + 1];
  }
  for (int64_t e = 0; e < n_expert; ++e) start[e + 1] += start[e];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (int64_t i = 0; i < ns; ++i) {
      pos[i] = fill[ch[i]]++;
      token[pos[i]] = i / k;
    }
  }
  // batches of up to 16 positions of one expert; each expert's batches are consecutive
  struct Batch { int64_t p0, n; };
  std::vector<Batch> batches;
  std::vector<int64_t> first(n_expert + 1), active;
  for (int64_t e = 0; e < n_expert; ++e) {
    first[e] = int64_t(batches.size());
    if (start[e + 1] > start[e]) active.push_back(e);
    for (int64_t p = start[e]; p < start[e + 1]; p += MOE_LANES)
      batches.push_back({p, std::min<int64_t>(MOE_LANES, start[e + 1] - p)});
  }
  first[n_expert] = int64_t(batches.size());
  const int64_t nb = int64_t(batches.size());
  const bool same_act = mg.gw == mu.gw;
  const Q8Act xq(xp, d, nt, d, 0);  // each token quantized once, whatever its experts
  std::vector<std::unique_ptr<MoeAct>> xg(nb), xu(nb), xh(nb);
  dynamic_for(nb, [&](int64_t b) {
    const Batch& bt = batches[b];
    xg[b] = std::make_unique<MoeAct>(xq, token.data() + bt.p0, bt.n, mg.gw);
    if (!same_act) xu[b] = std::make_unique<MoeAct>(xq, token.data() + bt.p0, bt.n, mu.gw);
  });
  // gate and up per (expert, tile of n_ff rows), then the gated activation of the tile
  std::unique_ptr<float[]> g(new float[ns * n_ff]), u(new float[ns * n_ff]), h(new float[ns * n_ff]);
  const int64_t tile_f = moe_tile_rows(n_ff, d), tiles_f = (n_ff + tile_f - 1) / tile_f;
  dynamic_for(int64_t(active.size()) * tiles_f, [&](int64_t task) {
    const int64_t e = active[task / tiles_f], r0 = (task % tiles_f) * tile_f;
    const int64_t r1 = std::min(n_ff, r0 + tile_f);
    const MoeTile wg = mg.tile(e, r0, r1), wu = mu.tile(e, r0, r1);
    for (int64_t b = first[e]; b < first[e + 1]; ++b) {
      const Batch& bt = batches[b];
      mg.fn(wg, *xg[b], bt.n, g.get() + bt.p0 * n_ff + r0, n_ff);
      mu.fn(wu, same_act ? *xg[b] : *xu[b], bt.n, u.get() + bt.p0 * n_ff + r0, n_ff);
    }
    for (int64_t p = start[e]; p < start[e + 1]; ++p)
      localllm_cpu::gated_values(g.get() + p * n_ff + r0, u.get() + p * n_ff + r0,
                                 h.get() + p * n_ff + r0, r1 - r0, 0);
  });
  g.reset();
  u.reset();
  const Q8Act hq(h.get(), n_ff, ns, n_ff, 0);
  h.reset();  // quantized: the down products hold y (T * k, d) as their one float32 buffer
  std::vector<int64_t> positions(ns);
  for (int64_t p = 0; p < ns; ++p) positions[p] = p;
  dynamic_for(nb, [&](int64_t b) {
    xh[b] = std::make_unique<MoeAct>(hq, positions.data() + batches[b].p0, batches[b].n, md.gw);
  });
  // down per (expert, tile of d rows) into y (one row per position)
  std::unique_ptr<float[]> y(new float[ns * d]);
  const int64_t tile_d = moe_tile_rows(d, n_ff), tiles_d = (d + tile_d - 1) / tile_d;
  dynamic_for(int64_t(active.size()) * tiles_d, [&](int64_t task) {
    const int64_t e = active[task / tiles_d], r0 = (task % tiles_d) * tile_d;
    const int64_t r1 = std::min(d, r0 + tile_d);
    const MoeTile wd = md.tile(e, r0, r1);
    for (int64_t b = first[e]; b < first[e + 1]; ++b)
      md.fn(wd, *xh[b], batches[b].n, y.get() + batches[b].p0 * d + r0, d);
  });
  // out[t] = sum over the token's slots, in increasing expert order, of weight * y
  float* op = out.data_ptr<float>();
  at::parallel_for(0, nt, std::max<int64_t>(1, (1 << 14) / d), [&](int64_t t0, int64_t t1) {
    std::vector<int64_t> order(k);
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t j = 0; j < k; ++j) order[j] = j;
      std::sort(order.begin(), order.end(),
                [&](int64_t a, int64_t b) { return ch[t * k + a] < ch[t * k + b]; });
      float* o = op + t * d;
      std::fill(o, o + d, 0.f);
      for (int64_t j : order) {
        const float w = wt[t * k + j];
        const float* yr = y.get() + pos[t * k + j] * d;
        for (int64_t c = 0; c < d; ++c) o[c] += yr[c] * w;
      }
    }
  });
}
#endif  // LOCALLLM_Q8 == 512

}  // namespace

TORCH_LIBRARY(localllm_cpu, m) {
  m.def("gemv(Tensor x, Tensor w, int qtype, int rows, int cols, Tensor(a!) out) -> ()");
  m.def("dequant_rows(Tensor w, int qtype, int r0, int cols, Tensor(a!) out) -> ()");
  m.def("gemv_q8(Tensor x, Tensor w, int qtype, int rows, int cols, Tensor(a!) out) -> ()");
  m.def("gemv_q8_experts(Tensor x, Tensor w, int qtype, int rows, int cols, Tensor experts, "
        "Tensor(a!) out) -> ()");
  m.def("q8_available() -> bool", q8_available);
  m.def("moe_available() -> bool", moe_available);
  m.def("moe_ffn_q8(Tensor x, Tensor chosen, Tensor weights, Tensor gate, Tensor up, Tensor down, "
        "int gate_type, int up_type, int down_type, int n_expert, int n_ff, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("gemv", gemv);
  m.impl("dequant_rows", dequant_rows);
  m.impl("gemv_q8", gemv_q8);
  m.impl("gemv_q8_experts", gemv_q8_experts);
#if LOCALLLM_Q8 + 0 == 512
  m.impl("moe_ffn_q8", moe_ffn_q8);
#endif
}
