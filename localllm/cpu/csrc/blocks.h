// ggml blocks as the native CPU kernels read them (shared by qmatmul.cpp, gemv_q8.cpp and
// moe.cpp): the type ids, each format's geometry, the per-block unpacking of the float GEMV
// and the MoE tiles, and the argument checks of the operators.
//
// W is a (rows, cols) matrix stored as ggml blocks, row after row (llama.cpp
// ggml/src/ggml-common.h block_q*); the per-block unpacking follows dequantize_row_q* in
// ggml/src/ggml-quants.c and is bit-exact with localllm.gguf.quants (the build uses
// -ffp-contract=off so that `d * q - m` is two roundings, as there).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "simd.h"

namespace {

// ggml type ids (ggml.h enum ggml_type).
enum QType : int64_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8,
  Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30, MXFP4 = 39,
};

constexpr int QK = 32;
constexpr int QK_K = 256;

// ---- per-block unpacking ---------------------------------------------------------------
// A block becomes int8 values q[BLOCK] and, per group of 16 weights, a scale d[g] and a
// minimum m[g], so that weight = q * d[g] - m[g] (m = 0 for the symmetric formats; Q4_1 and
// Q5_1 store -m). Each product and difference rounds once in float32, exactly as the
// reference dequantizers do (llama.cpp dequantize_row_q*, localllm.gguf.quants).

constexpr int G = 16;  // weights per scale group

// The 32 weights of a legacy block: low nibbles (weights 0..15) and high nibbles (16..31),
// plus a fifth bit per weight from qh (Q5_0/Q5_1), minus `bias`.
#if defined(__SSE2__)
LOCALLLM_INLINE void nibbles(const uint8_t* qs, uint32_t qh, bool five, int bias, int8_t* q) {
  const __m128i v = _mm_loadu_si128((const __m128i*)qs);
  const __m128i mask = _mm_set1_epi8(0x0F);
  __m128i lo = _mm_and_si128(v, mask);
  __m128i hi = _mm_and_si128(_mm_srli_epi16(v, 4), mask);
  if (five) {
    const __m128i bit = _mm_set1_epi8(0x10);
    lo = _mm_or_si128(lo, _mm_and_si128(bit_mask16(qh), bit));
    hi = _mm_or_si128(hi, _mm_and_si128(bit_mask16(qh >> 16), bit));
  }
  const __m128i b = _mm_set1_epi8(char(bias));
  _mm_storeu_si128((__m128i*)q, _mm_sub_epi8(lo, b));
  _mm_storeu_si128((__m128i*)(q + 16), _mm_sub_epi8(hi, b));
}
#else
LOCALLLM_INLINE void nibbles(const uint8_t* qs, uint32_t qh, bool five, int bias, int8_t* q) {
  for (int j = 0; j < 16; ++j) {
    const int h0 = five ? ((qh >> j) << 4) & 0x10 : 0;
    const int h1 = five ? (qh >> (j + 12)) & 0x10 : 0;
    q[j] = int8_t(((qs[j] & 0x0F) | h0) - bias);
    q[j + 16] = int8_t(((qs[j] >> 4) | h1) - bias);
  }
}
#endif

LOCALLLM_INLINE void unpack_q4_0(const uint8_t* b, int8_t* q, float* d, float*) {  // d, qs[16]
  nibbles(b + 2, 0, false, 8, q);
  d[0] = d[1] = f16(b);
}

LOCALLLM_INLINE void unpack_q4_1(const uint8_t* b, int8_t* q, float* d, float* m) {  // d, m, qs[16]
  nibbles(b + 4, 0, false, 0, q);
  d[0] = d[1] = f16(b);
  m[0] = m[1] = -f16(b + 2);
}

LOCALLLM_INLINE void unpack_q5_0(const uint8_t* b, int8_t* q, float* d, float*) {  // d, qh[4], qs[16]
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  nibbles(b + 6, qh, true, 16, q);
  d[0] = d[1] = f16(b);
}

LOCALLLM_INLINE void unpack_q5_1(const uint8_t* b, int8_t* q, float* d, float* m) {  // d, m, qh, qs
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  nibbles(b + 8, qh, true, 0, q);
  d[0] = d[1] = f16(b);
  m[0] = m[1] = -f16(b + 2);
}

LOCALLLM_INLINE void unpack_q8_0(const uint8_t* b, int8_t* q, float* d, float*) {  // d, qs[32]
  d[0] = d[1] = f16(b);
  std::memcpy(q, b + 2, QK);
}

// ggml's GGML_E8M0_TO_FP32_HALF: 2^(e - 128) built from float32 bits (subnormal for e < 2).
LOCALLLM_INLINE float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : uint32_t(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ggml's kvalues_mxfp4: the E2M1 values doubled (the E8M0 scale is halved to match).
constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

LOCALLLM_INLINE void unpack_mxfp4(const uint8_t* b, int8_t* q, float* d, float*) {  // e, qs[16]
  // nibbles as Q4_0's (weights 0..15 low, 16..31 high), each an index into the values
#if defined(__SSSE3__)
  nibbles(b + 1, 0, false, 0, q);
  const __m128i lut = _mm_loadu_si128((const __m128i*)MXFP4_VALUES);
  _mm_storeu_si128((__m128i*)q, _mm_shuffle_epi8(lut, _mm_loadu_si128((const __m128i*)q)));
  _mm_storeu_si128((__m128i*)(q + 16),
                   _mm_shuffle_epi8(lut, _mm_loadu_si128((const __m128i*)(q + 16))));
#else
  for (int j = 0; j < 16; ++j) {
    q[j] = MXFP4_VALUES[b[1 + j] & 0x0F];
    q[j + 16] = MXFP4_VALUES[b[1 + j] >> 4];
  }
#endif
  d[0] = d[1] = e8m0_half(b[0]);
}

LOCALLLM_INLINE void unpack_q2_k(const uint8_t* b, int8_t* q, float* d, float* m) {
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
LOCALLLM_INLINE void q3_k_scales(const uint8_t* b, uint32_t aux[4]) {
  std::memcpy(aux, b + 96, 12);
  const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
}

LOCALLLM_INLINE void unpack_q3_k(const uint8_t* b, int8_t* q, float* d, float*) {
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

LOCALLLM_INLINE void scale_min_k4(int j, const uint8_t* q, int* d, int* m) {
  if (j < 4) {
    *d = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

LOCALLLM_INLINE void k4_scales(const uint8_t* b, float* d, float* m) {  // 8 sub-blocks of 32
  const float dd = f16(b), dmin = f16(b + 2);
  for (int s = 0; s < 8; ++s) {
    int sc, mn;
    scale_min_k4(s, b + 4, &sc, &mn);
    d[2 * s] = d[2 * s + 1] = dd * float(sc);
    m[2 * s] = m[2 * s + 1] = dmin * float(mn);
  }
}

LOCALLLM_INLINE void unpack_q4_k(const uint8_t* b, int8_t* q, float* d, float* m) {
  // d, dmin, scales[12], qs[128]
  k4_scales(b, d, m);
  const uint8_t* qs = b + 16;
  for (int j = 0; j < 4; ++j, qs += 32)
    for (int l = 0; l < 32; ++l) {
      q[64 * j + l] = int8_t(qs[l] & 0x0F);
      q[64 * j + 32 + l] = int8_t(qs[l] >> 4);
    }
}

LOCALLLM_INLINE void unpack_q5_k(const uint8_t* b, int8_t* q, float* d, float* m) {
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

LOCALLLM_INLINE void unpack_q6_k(const uint8_t* b, int8_t* q, float* d, float*) {
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

// The float formats, read 16 values at a time (vload, vload_f16, vload_bf16).
enum class Flt { F32, F16, BF16 };

// A format as the kernels see it: `block` weights in `bytes` bytes, unpacked by `unpack`
// (integer formats) or converted 16 at a time (float formats, read in blocks of 32).
struct Format {
  int block;
  int bytes;
  UnpackFn unpack;  // nullptr for the float formats
  bool asym;        // weight = q * d - m with m != 0
  Flt flt;
};

inline Format format_of(int64_t qtype) {
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
    case MXFP4: return {QK, 17, unpack_mxfp4, false, Flt::F32};
    default: TORCH_CHECK(false, "localllm_cpu: no kernel for ggml type ", qtype);
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

inline void check_weight(const at::Tensor& w, const Format& f, int64_t rows, int64_t cols) {
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
inline int64_t check_io(const char* op, const at::Tensor& x, const at::Tensor& out,
                        int64_t rows, int64_t cols) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(1) == cols, "localllm_cpu.", op, ": x must be (T, cols) float32");
  const int64_t nt = x.size(0);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == nt && out.size(1) == rows,
              "localllm_cpu.", op, ": out must be (T, rows) float32");
  return nt;
}

}  // namespace
