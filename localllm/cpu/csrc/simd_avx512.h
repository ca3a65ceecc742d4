// AVX-512 primitives of simd.h (included there): the float register __m512 and, with
// AVX512-VNNI (LOCALLLM_Q8 == 512), the int8 GEMV's 64-byte registers.

#pragma once

namespace {

#if defined(__AVX512F__)
LOCALLLM_FLOAT_REG(__m512, _mm512, si512, 16, __m256i, _mm256_loadu_si256, __m128i, _mm_loadu_si128)
inline float vsum(__m512 a) { return _mm512_reduce_add_ps(a); }
inline float vmax_all(__m512 a) { return _mm512_reduce_max_ps(a); }
inline __m512 vabs(__m512 a) { return _mm512_abs_ps(a); }
inline __m512 vround(__m512 x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m512 vexp2i(__m512 y, __m512 n) { return _mm512_scalef_ps(y, n); }  // y * 2^n
#endif

#if LOCALLLM_Q8 + 0 == 512
// The int8 GEMV reads 64 weights per vpdpbusd (ivec, fvec: simd.h).
// Q8_0's int8 weights are read as u = q + 128 (dot4_q8_0; the kernels start from
// -128 * sum(x): q8_offset in gemv_q8.cpp).
constexpr int Q8_0_OFFSET = 128;

// acc + (lane i: sum_{j<4} u[4i + j] * x[4i + j]), u unsigned 8-bit, x signed (vpdpbusd).
inline ivec dot4(ivec acc, ivec u, ivec x) { return _mm512_dpbusd_epi32(acc, u, x); }

// dot4 with Q8_0's signed weights q: acc must hold -128 * the sums of x (Q8_0_OFFSET).
inline ivec dot4_q8_0(ivec acc, ivec q, ivec x) {
  return dot4(acc, ixor(q, iset8(0x80)), x);
}

inline ivec join(__m256i lo, __m256i hi) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}

// Two copies of v, the second shifted right by `shift` bits (16-bit lanes).
inline ivec spread(__m256i v, int shift) { return join(v, _mm256_srli_epi16(v, shift)); }

// Byte j = `value` where bit j of `bits` is set, else 0.
inline ivec bit_bytes(uint64_t bits, int value) { return _mm512_maskz_set1_epi8(__mmask64(bits), char(value)); }

// The 32-byte runs at p[0] and p[1].
inline ivec load_runs(const uint8_t* const* p) {
  return join(_mm256_loadu_si256((const __m256i*)p[0]), _mm256_loadu_si256((const __m256i*)p[1]));
}

// The nibbles of two blocks' 16 bytes qs[0], qs[1]: [low 0, high 0, low 1, high 1].
inline ivec nibble_runs(const uint8_t* const* qs) {
  const __m256i v = _mm256_set_m128i(_mm_loadu_si128((const __m128i*)qs[1]),
                                     _mm_loadu_si128((const __m128i*)qs[0]));
  // 128-bit lanes [lo0, lo1, hi0, hi1] -> [lo0, hi0, lo1, hi1]
  const ivec u = _mm512_and_si512(join(v, _mm256_srli_epi16(v, 4)), _mm512_set1_epi8(0x0F));
  return _mm512_shuffle_i64x2(u, u, _MM_SHUFFLE(3, 1, 2, 0));
}

// x in every 128-bit lane.
inline ivec broadcast128(__m128i x) { return _mm512_broadcast_i32x4(x); }

// Lane j of the result = lane idx[j] of a.
inline fvec vperm(fvec a, ivec idx) { return _mm512_permutexvar_ps(idx, a); }

// Lane j = s[j / 8] (a value per 32-weight block of a 64-weight chunk).
inline fvec vblocks(const float* s) {
  return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s[0]), _mm512_set1_ps(s[1]));
}

// acc + v in lanes 8-15 (the minimums of a Q4_K / Q5_K block's 16 scales).
inline fvec vadd_last8(fvec acc, fvec v) { return _mm512_mask_add_ps(acc, 0xFF00, acc, v); }

// 16 bytes as int32 lanes.
inline ivec widen_u8(__m128i b) { return _mm512_cvtepu8_epi32(b); }
inline ivec widen_u8(const void* p) { return widen_u8(_mm_loadu_si128((const __m128i*)p)); }
inline ivec widen_i8(const void* p) { return _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)); }

// The first 16 bytes of 4 blocks of `stride` bytes from p, one per 128-bit lane (past n
// blocks, block 0 again).
inline ivec load_heads(const uint8_t* p, int stride, int n) {
  ivec v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i*)p));
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(p + (n > 1 ? stride : 0))), 1);
  v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(p + (n > 2 ? 2 * stride : 0))), 2);
  return _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i*)(p + (n > 3 ? 3 * stride : 0))), 3);
}

template <int I>
inline __m128i lane128(ivec v) {
  if constexpr (I == 0) return _mm512_castsi512_si128(v);
  else return _mm512_extracti32x4_epi32(v, I);
}

// The two float16 at the start of each 128-bit lane as float32 lanes 0-7.
inline fvec head_halves(ivec v) {
  return _mm512_castps256_ps512(_mm256_cvtph_ps(_mm512_castsi512_si128(
      _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v))));
}

inline int ireduce(ivec v) { return _mm512_reduce_add_epi32(v); }

// v[0], v[1] (32 int32) saturated to int8 into q[0 .. 31].
inline void narrow_i8(const ivec* v, int8_t* q) {
  _mm_storeu_si128((__m128i*)q, _mm512_cvtsepi32_epi8(v[0]));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtsepi32_epi8(v[1]));
}
#endif  // LOCALLLM_Q8 == 512

}  // namespace
