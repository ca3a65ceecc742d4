// SIMD registers of the native CPU kernels, for the instruction set the library is built for
// (-march=native, or LOCALLLM_CPU_ARCH: localllm/cpu/build.py).
//
// Two kinds of vectors, each used by kernels written once:
//  * vf, 16 float32 lanes: a group of 16 weights in the float GEMV and dequantization
//    (qmatmul.cpp), and the element-wise kernels (ops.cpp). An __m512 with AVX-512, two
//    __m256 with AVX2 + FMA + F16C, 16 floats elsewhere: Parts<R, N>, N registers R side by
//    side, every operation applied to each.
//  * the int8 GEMV's registers, where LOCALLLM_Q8 is defined (gemv_q8.cpp, moe.cpp): ivec,
//    Q8W bytes of weights or activations (Q8W / 4 int32 lanes), and fvec, Q8W / 4 float32
//    lanes, with their primitives (dot4, the integer dot product, first). Q8W is 64 with
//    AVX512-VNNI (+BW, VL), 32 with AVX2 + FMA + F16C; without either there is no int8 GEMV.
//
// An instruction set supplies the same names in its own file, simd_avx512.h or simd_avx2.h
// (AVX-512 without VNNI takes AVX-512 floats and the AVX2 int8 GEMV); the operations that
// are one intrinsic lane by lane are declared once, by the macros below. Float registers R
// (float, __m256, __m512, Parts) share the overloaded names vadd, vmul, vfma, vsum, ...;
// Reg<R> builds them (zero, set1, load, conversions from 8- and 16-bit values).

#pragma once

#include <c10/util/Half.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define LOCALLLM_Q8 512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define LOCALLLM_Q8 256
#endif

// Forces inlining where GCC's heuristics would not (the unpackers and decoders in the
// kernels' inner loops, vexp; the wider AVX2 vf makes them look costly to inline).
#if defined(__GNUC__)
#define LOCALLLM_INLINE inline __attribute__((always_inline))
#else
#define LOCALLLM_INLINE inline
#endif

namespace {

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

#if defined(__SSE2__)
// Bit j of `bits` -> 0xFF in byte j, else 0 (16 bytes).
inline __m128i bit_mask16(uint32_t bits) {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
  return _mm_movm_epi8(__mmask16(bits & 0xFFFF));
#else
  // Spread 16 bits over 16 bytes: byte j takes bit (j % 8) of byte (j / 8).
  const __m128i spread = _mm_set_epi64x(0x0101010101010101LL * ((bits >> 8) & 0xFF),
                                        0x0101010101010101LL * (bits & 0xFF));
  const __m128i sel = _mm_set_epi64x(0x8040201008040201LL, 0x8040201008040201LL);
  return _mm_cmpeq_epi8(_mm_and_si128(spread, sel), sel);
#endif
}
#endif

// ---- float registers ---------------------------------------------------------------------

// Construction of a float register type R: lanes, zero, set1, load / store of float32, and
// load_i8 / load_f16 / load_bf16, `lanes` values converted to float32.
template <class R>
struct Reg;

// Reg<R> and the lane-wise arithmetic of a register type R of LANES floats whose intrinsics
// are PFX##_name_ps (SI: the suffix of its integer casts, si256 / si512); HALF and QUARTER
// are the integer registers of LANES 16-bit and 8-bit values, LOAD_HALF and LOAD_QUARTER
// their loads. vfnma(a, b, c) = c - a b.
#define LOCALLLM_FLOAT_REG(R, PFX, SI, LANES, HALF, LOAD_HALF, QUARTER, LOAD_QUARTER)            \
  template <>                                                                                   \
  struct Reg<R> {                                                                               \
    static constexpr int lanes = LANES;                                                         \
    static R zero() { return PFX##_setzero_ps(); }                                              \
    static R set1(float v) { return PFX##_set1_ps(v); }                                         \
    static R load(const float* p) { return PFX##_loadu_ps(p); }                                 \
    static void store(float* p, R v) { PFX##_storeu_ps(p, v); }                                 \
    static R load_i8(const int8_t* q) {                                                         \
      return PFX##_cvtepi32_ps(PFX##_cvtepi8_epi32(LOAD_QUARTER((const QUARTER*)q)));           \
    }                                                                                           \
    static R load_f16(const void* p) { return PFX##_cvtph_ps(LOAD_HALF((const HALF*)p)); }      \
    static R load_bf16(const void* p) {                                                         \
      const auto h = PFX##_cvtepu16_epi32(LOAD_HALF((const HALF*)p));                           \
      return PFX##_cast##SI##_ps(PFX##_slli_epi32(h, 16));                                      \
    }                                                                                           \
  };                                                                                            \
  inline R vadd(R a, R b) { return PFX##_add_ps(a, b); }                                        \
  inline R vsub(R a, R b) { return PFX##_sub_ps(a, b); }                                        \
  inline R vmul(R a, R b) { return PFX##_mul_ps(a, b); }                                        \
  inline R vdiv(R a, R b) { return PFX##_div_ps(a, b); }                                        \
  inline R vmin(R a, R b) { return PFX##_min_ps(a, b); }                                        \
  inline R vmax(R a, R b) { return PFX##_max_ps(a, b); }                                        \
  inline R vfma(R a, R b, R c) { return PFX##_fmadd_ps(a, b, c); }                              \
  inline R vfnma(R a, R b, R c) { return PFX##_fnmadd_ps(a, b, c); }

// The integer register I of the int8 GEMV and its float counterpart F: the operations that
// are one intrinsic PFX##_name (SI: the suffix of the bitwise ones, si256 / si512). Shift
// counts are immediates once the kernels are inlined (a shift by 0 is no instruction).
#define LOCALLLM_INT_OPS(I, F, PFX, SI)                                        \
  using ivec = I;                                                            \
  using fvec = F;                                                            \
  constexpr int Q8W = sizeof(I); /* bytes of an integer register */         \
  inline I izero() { return PFX##_setzero_##SI(); }                          \
  inline I iload(const void* p) { return PFX##_loadu_##SI((const I*)p); }    \
  inline void istore(void* p, I v) { PFX##_storeu_##SI((I*)p, v); }          \
  inline I iset8(int v) { return PFX##_set1_epi8(char(v)); }                 \
  inline I iset32(int v) { return PFX##_set1_epi32(v); }                     \
  inline I iand(I a, I b) { return PFX##_and_##SI(a, b); }                   \
  inline I ior(I a, I b) { return PFX##_or_##SI(a, b); }                     \
  inline I ixor(I a, I b) { return PFX##_xor_##SI(a, b); }                   \
  inline I iadd32(I a, I b) { return PFX##_add_epi32(a, b); }                \
  inline I isub32(I a, I b) { return PFX##_sub_epi32(a, b); }                \
  inline I isrl16(I a, int n) { return n ? PFX##_srli_epi16(a, n) : a; }    \
  inline I isll16(I a, int n) { return n ? PFX##_slli_epi16(a, n) : a; }    \
  inline I isrl32(I a, int n) { return n ? PFX##_srli_epi32(a, n) : a; }    \
  inline I ishuffle8(I a, I idx) { return PFX##_shuffle_epi8(a, idx); }      \
  inline F vcvt(I a) { return PFX##_cvtepi32_ps(a); }                        \
  inline I vcvt_i32(F a) { return PFX##_cvtps_epi32(a); }

// Scalar lanes (the portable build's vf is 16 of them).
template <>
struct Reg<float> {
  static constexpr int lanes = 1;
  static float zero() { return 0.f; }
  static float set1(float v) { return v; }
  static float load(const float* p) { return *p; }
  static void store(float* p, float v) { *p = v; }
  static float load_i8(const int8_t* q) { return float(*q); }
  static float load_f16(const void* p) { return f16(static_cast<const uint8_t*>(p)); }
  static float load_bf16(const void* p) { return bf16(static_cast<const uint8_t*>(p)); }
};
inline float vadd(float a, float b) { return a + b; }
inline float vsub(float a, float b) { return a - b; }
inline float vmul(float a, float b) { return a * b; }
inline float vdiv(float a, float b) { return a / b; }
inline float vmin(float a, float b) { return std::fmin(a, b); }
inline float vmax(float a, float b) { return std::fmax(a, b); }
inline float vfma(float a, float b, float c) { return std::fma(a, b, c); }
inline float vfnma(float a, float b, float c) { return std::fma(-a, b, c); }
inline float vsum(float a) { return a; }
inline float vround(float x) { return std::nearbyint(x); }
inline float vexp2i(float y, float n) { return std::ldexp(y, int(n)); }

// N registers R as one vector of N * Reg<R>::lanes lanes.
template <class R, int N>
struct Parts {
  R p[N];
};

// Reg<Parts<R, N>>::load_i8, part by part; an instruction set may overload it for its Parts
// (simd_avx2.h: one 16-byte load for both halves).
template <class R, int N>
inline Parts<R, N> load_i8_parts(const int8_t* q, const Parts<R, N>*) {
  Parts<R, N> v;
  for (int i = 0; i < N; ++i) v.p[i] = Reg<R>::load_i8(q + i * Reg<R>::lanes);
  return v;
}

#if LOCALLLM_Q8 + 0 == 512
LOCALLLM_INT_OPS(__m512i, __m512, _mm512, si512)
#elif LOCALLLM_Q8 + 0 == 256
LOCALLLM_INT_OPS(__m256i, __m256, _mm256, si256)
#endif

}  // namespace

#include "simd_avx512.h"
#include "simd_avx2.h"

namespace {

template <class R, int N>
struct Reg<Parts<R, N>> {
  using V = Parts<R, N>;
  static constexpr int lanes = N * Reg<R>::lanes;
  template <class F>
  static V each(F f) {
    V v;
    for (int i = 0; i < N; ++i) v.p[i] = f(i);
    return v;
  }
  static V zero() { return each([](int) { return Reg<R>::zero(); }); }
  static V set1(float a) { return each([a](int) { return Reg<R>::set1(a); }); }
  static V load(const float* p) { return each([p](int i) { return Reg<R>::load(p + i * Reg<R>::lanes); }); }
  static void store(float* p, V v) {
    for (int i = 0; i < N; ++i) Reg<R>::store(p + i * Reg<R>::lanes, v.p[i]);
  }
  static V load_i8(const int8_t* q) { return load_i8_parts(q, static_cast<const V*>(nullptr)); }
  static V load_f16(const void* p) {
    return each([p](int i) { return Reg<R>::load_f16(static_cast<const uint8_t*>(p) + 2 * i * Reg<R>::lanes); });
  }
  static V load_bf16(const void* p) {
    return each([p](int i) { return Reg<R>::load_bf16(static_cast<const uint8_t*>(p) + 2 * i * Reg<R>::lanes); });
  }
};

// An operation of Parts applied to each part.
#define LOCALLLM_PARTS_OP(NAME, PARAMS, ARGS)                                       \
  template <class R, int N>                                                         \
  inline Parts<R, N> NAME PARAMS {                                                  \
    return Reg<Parts<R, N>>::each([&](int i) { return NAME ARGS; });                \
  }
LOCALLLM_PARTS_OP(vadd, (Parts<R, N> a, Parts<R, N> b), (a.p[i], b.p[i]))
LOCALLLM_PARTS_OP(vsub, (Parts<R, N> a, Parts<R, N> b), (a.p[i], b.p[i]))
LOCALLLM_PARTS_OP(vmul, (Parts<R, N> a, Parts<R, N> b), (a.p[i], b.p[i]))
LOCALLLM_PARTS_OP(vdiv, (Parts<R, N> a, Parts<R, N> b), (a.p[i], b.p[i]))
LOCALLLM_PARTS_OP(vmin, (Parts<R, N> a, Parts<R, N> b), (a.p[i], b.p[i]))
LOCALLLM_PARTS_OP(vmax, (Parts<R, N> a, Parts<R, N> b), (a.p[i], b.p[i]))
LOCALLLM_PARTS_OP(vexp2i, (Parts<R, N> a, Parts<R, N> b), (a.p[i], b.p[i]))
LOCALLLM_PARTS_OP(vfma, (Parts<R, N> a, Parts<R, N> b, Parts<R, N> c), (a.p[i], b.p[i], c.p[i]))
LOCALLLM_PARTS_OP(vround, (Parts<R, N> a), (a.p[i]))
#undef LOCALLLM_PARTS_OP

// The sum of the lanes: the parts added lane by lane, then their register's sum.
template <class R, int N>
inline float vsum(Parts<R, N> v) {
  R s = v.p[0];
  for (int i = 1; i < N; ++i) s = vadd(s, v.p[i]);
  return vsum(s);
}

// vf, and VF_REGS: how many vf the register file holds (sizes register-blocked loops).
#if defined(__AVX512F__)
using vf = __m512;
constexpr int VF_REGS = 32;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using vf = Parts<__m256, 2>;
constexpr int VF_REGS = 8;
#else
using vf = Parts<float, 16>;
constexpr int VF_REGS = 8;
#endif
constexpr int VL = 16;  // lanes of vf
static_assert(Reg<vf>::lanes == VL, "vf holds 16 floats");

// vr: one float register of the instruction set, where it has one (LOCALLLM_VR defined), for
// kernels whose lanes follow the hardware's width (ssm.cpp: 16 with AVX-512, 8 with AVX2).
#if defined(__AVX512F__)
using vr = __m512;
#define LOCALLLM_VR 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
using vr = __m256;
#define LOCALLLM_VR 1
#endif

template <class V = vf>
inline V vzero() { return Reg<V>::zero(); }
template <class V = vf>
inline V vset1(float a) { return Reg<V>::set1(a); }
template <class V = vf>
inline V vload(const float* p) { return Reg<V>::load(p); }
template <class V>
inline void vstore(float* p, V v) { Reg<V>::store(p, v); }
// 16 (Reg<V>::lanes) int8, float16 or bfloat16 values as float32.
template <class V = vf>
inline V vload_i8(const int8_t* q) { return Reg<V>::load_i8(q); }
template <class V = vf>
inline V vload_f16(const void* p) { return Reg<V>::load_f16(p); }
template <class V = vf>
inline V vload_bf16(const void* p) { return Reg<V>::load_bf16(p); }

// exp(x) lane by lane, of a vf (ops.cpp's softmax and activations, attn_kvq.cpp's softmax)
// or a vr (ssm.cpp): Cephes expf's reduction and polynomial (relative error within 2 ulp),
// inputs clamped to [-87, 88] (exp(-87) ~ 1.6e-38: the callers only add or divide by it).
template <class V = vf>
LOCALLLM_INLINE V vexp(V x) {
  x = vmin(vmax(x, vset1<V>(-87.0f)), vset1<V>(88.0f));
  const V n = vround(vmul(x, vset1<V>(1.44269504088896341f)));
  V r = vfma(n, vset1<V>(-0.693359375f), x);
  r = vfma(n, vset1<V>(2.12194440e-4f), r);
  V p = vset1<V>(1.9875691500e-4f);
  p = vfma(p, r, vset1<V>(1.3981999507e-3f));
  p = vfma(p, r, vset1<V>(8.3334519073e-3f));
  p = vfma(p, r, vset1<V>(4.1665795894e-2f));
  p = vfma(p, r, vset1<V>(1.6666665459e-1f));
  p = vfma(p, r, vset1<V>(5.0000001201e-1f));
  const V y = vadd(vfma(vmul(p, r), r, r), vset1<V>(1.0f));
  return vexp2i(y, n);
}

}  // namespace
