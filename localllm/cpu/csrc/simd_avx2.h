// AVX2 + FMA + F16C primitives of simd.h (included there): the float register __m256 and,
// where AVX512-VNNI is missing (LOCALLLM_Q8 == 256), the int8 GEMV's 32-byte registers.

#pragma once

namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
LOCALLLM_FLOAT_REG(__m256, _mm256, si256, 8, __m128i, _mm_loadu_si128, __m128i, _mm_loadl_epi64)

// 16 int8 as two __m256 from one load (two 8-byte loads cost a move each when the bytes
// are still in a register, as after the unpackers).
inline Parts<__m256, 2> load_i8_parts(const int8_t* q, const Parts<__m256, 2>*) {
  const __m128i b = _mm_loadu_si128((const __m128i*)q);
  return {{_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(b, 8)))}};
}

inline float vsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float vmax_all(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

inline __m256 vabs(__m256 a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
inline __m256 vround(__m256 x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline __m256 vexp2i(__m256 y, __m256 n) {  // y * 2^n, n integral in [-126, 127]
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
#endif

#if LOCALLLM_Q8 + 0 == 256
// The int8 GEMV reads 32 weights per integer dot product: vpmaddubsw multiplies u8 lanes by
// the int8 activations and adds adjacent pairs into int16, vpmaddwd adds those pairs into
// int32 lanes of 4 values (llama.cpp ggml-cpu/arch/x86/quants.c mul_sum_us8_pairs_float).
// The int16 pair sums are exact while 2 * u * 127 <= 32767: u <= 63 holds for every format
// read as unsigned (Q2_K 3, Q3_K 7, Q4_* 15, Q5_* 31, Q6_K 63); Q8_0 (-128..127) is
// multiplied as |w| times x with w's sign (vpsignb, as llama.cpp mul_sum_i8_pairs_float),
// 2 * 128 * 127 < 32768. With AVX-VNNI the whole product is one vpdpbusd. (ivec, fvec:
// simd.h.)
// Q8_0 is read signed (dot4_q8_0): no offset.
constexpr int Q8_0_OFFSET = 0;

// acc + (lane i: sum_{j<4} u[4i + j] * x[4i + j]), u unsigned 8-bit, |x| <= 127; without
// AVX-VNNI u <= 63, or u <= 128 (Q8_0's |w|), so that no int16 pair sum saturates.
inline ivec dot4(ivec acc, ivec u, ivec x) {
#if defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, u, x);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1)));
#endif
}

// dot4 with Q8_0's signed weights q.
inline ivec dot4_q8_0(ivec acc, ivec q, ivec x) {
  return dot4(acc, _mm256_sign_epi8(q, q), _mm256_sign_epi8(x, q));
}

// v (the one copy: see simd_avx512.h).
inline ivec spread(__m256i v, int) { return v; }

// Byte j = `value` where bit j of `bits` is set, else 0.
inline ivec bit_bytes(uint64_t bits, int value) {
  const __m256i m = _mm256_set_m128i(bit_mask16(uint32_t(bits >> 16)), bit_mask16(uint32_t(bits)));
  return _mm256_and_si256(m, _mm256_set1_epi8(char(value)));
}

// The 32-byte run at p[0].
inline ivec load_runs(const uint8_t* const* p) { return _mm256_loadu_si256((const __m256i*)p[0]); }

// The nibbles of a block's 16 bytes qs[0]: [low, high].
inline ivec nibble_runs(const uint8_t* const* qs) {
  const __m128i v = _mm_loadu_si128((const __m128i*)qs[0]);
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), _mm256_set1_epi8(0x0F));
}

// x in every 128-bit lane.
inline ivec broadcast128(__m128i x) { return _mm256_broadcastsi128_si256(x); }

// Lane j of the result = lane idx[j] of a.
inline fvec vperm(fvec a, ivec idx) { return _mm256_permutevar8x32_ps(a, idx); }

// Every lane s[0] (the value of the chunk's one 32-weight block).
inline fvec vblocks(const float* s) { return _mm256_set1_ps(s[0]); }

// acc + v (the 8 minimums of a Q4_K / Q5_K block's 16 scales fill a register).
inline fvec vadd_last8(fvec acc, fvec v) { return _mm256_add_ps(acc, v); }

// 8 bytes as int32 lanes.
inline ivec widen_u8(__m128i b) { return _mm256_cvtepu8_epi32(b); }
inline ivec widen_u8(const void* p) { return widen_u8(_mm_loadl_epi64((const __m128i*)p)); }
inline ivec widen_i8(const void* p) { return _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)); }

// The first 16 bytes of 2 blocks of `stride` bytes from p, one per 128-bit lane (past n
// blocks, block 0 again).
inline ivec load_heads(const uint8_t* p, int stride, int n) {
  return _mm256_set_m128i(_mm_loadu_si128((const __m128i*)(p + (n > 1 ? stride : 0))),
                          _mm_loadu_si128((const __m128i*)p));
}

template <int I>
inline __m128i lane128(ivec v) {
  if constexpr (I == 0) return _mm256_castsi256_si128(v);
  else return _mm256_extracti128_si256(v, 1);
}

// The two float16 at the start of each 128-bit lane as float32 lanes 0-3.
inline fvec head_halves(ivec v) {
  return _mm256_cvtph_ps(_mm256_castsi256_si128(
      _mm256_permutevar8x32_epi32(v, _mm256_setr_epi32(0, 4, 0, 0, 0, 0, 0, 0))));
}

inline int ireduce(ivec v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
}

// v[0 .. 3] (32 int32) saturated to int8 into q[0 .. 31].
inline void narrow_i8(const ivec* v, int8_t* q) {
  // packs work within 128-bit lanes: the bytes come out as 4-value groups
  // [v0 0-3, v1 0-3, v2 0-3, v3 0-3 | v0 4-7, v1 4-7, ...]; the permute restores the order.
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}
#endif  // LOCALLLM_Q8 == 256

}  // namespace
