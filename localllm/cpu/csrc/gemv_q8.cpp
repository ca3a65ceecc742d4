// The int8 GEMV of localllm's native CPU kernels (torch.ops.localllm_cpu, declared in
// qmatmul.cpp):
//   gemv_q8(x, w, qtype, rows, cols, out)     out[t, r] = sum_k x[t, k] * W[r, k], T <= 8 rows,
//                                             x quantized to int8 per 32 values (q8.h)
//   gemv_q8_experts(x, w, qtype, rows, cols, experts, out)
//                                             out[j] = W_experts[j] x_j, one token's experts
//   moe_token_q8(x, chosen, weights, gate, up, down, ..., shared expert ..., out)
//                                             one token's whole MoE FFN (routed experts
//                                             and a shared one) in two parallel passes
//
// Each weight block is decoded into registers of Q8W unsigned 8-bit lanes (64 with
// AVX512-VNNI, 32 with AVX2: simd.h) and multiplied with the quantized activations by dot4
// (vpdpbusd; on AVX2 vpmaddubsw + vpmaddwd), one int32 lane per 4 weights; each lane's
// product is converted to float32 and multiplied by its group's scale (a lane of a scale
// register, vperm) as it is accumulated. The kernels are written once over simd.h's
// primitives; the instruction sets compute the same products, in another float32
// summation order (llama.cpp ggml-cpu/arch/x86/quants.c ggml_vec_dot_*). Builds without
// LOCALLLM_Q8 do not offer gemv_q8 (q8_available() is false: the float32 GEMV is used).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <map>
#include <optional>
#include <tuple>

#include "q8.h"

namespace localllm_cpu {
void gated_values(const float* g, const float* u, float* y, int64_t n, int64_t act);  // ops.cpp
}  // namespace localllm_cpu

namespace {

#if defined(LOCALLLM_Q8)

constexpr int FL = Q8W / 4;  // int32 / float lanes of a register

// The constant offset o of a type stored as w = a * (u - o) whose kernel starts its dot
// products from Q8Act::corr, else 0 (Q6_K's -32 is applied once per block with the
// activation sums instead: decode_q6_k's b).
constexpr int q8_offset(int64_t qtype) {
  return qtype == Q4_0 ? 8 : qtype == Q5_0 ? 16 : qtype == Q8_0 || qtype == MXFP4 ? Q8_0_OFFSET
         : qtype == Q3_K ? 4 : 0;
}

// Whether the activations of a product with a `qtype` matrix are quantized as Q8Act's k4.
constexpr bool k4_order(int64_t qtype) { return qtype == Q4_K || qtype == Q5_K; }

// A register of int32 lanes, lane j = f(j) (index vectors of vperm; built once per call).
template <class F>
inline ivec lane_index(F f) {
  alignas(64) int32_t v[FL];
  for (int j = 0; j < FL; ++j) v[j] = f(j);
  return iload(v);
}

inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }

// v with bits s .. s + 1 of every byte moved to bits 4-5, the rest of v shifted along.
inline ivec bits_to_4(ivec v, int s) { return s < 4 ? isll16(v, 4 - s) : isrl16(v, s - 4); }

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

// One accumulator per activation row, whatever the row count: a row's sums run in the same
// order in a one-token step and in a batch of up to 8 (a verified speculative guess equals
// the decoded token bit for bit). More accumulators for one row were measured no faster
// (bench/bench_cpu_gemv.py): the product is bound by the weights' bytes.

// ---- K-quants with a scale per 16 weights: Q2_K, Q3_K, Q6_K ------------------------------

constexpr int NC = QK_K / Q8W;  // registers of a 256-weight block
constexpr int NF = 16 / FL;     // registers of its 16 group scales
constexpr int PH = 128 / Q8W;   // registers of each half of 128 weights

// A block decoded: u[c] the u8 lanes of weights Q8W c .. Q8W c + Q8W - 1, a and b the
// scales and offsets of the 16 groups (FL per register): w = a * u - b (b unused for a
// constant offset).
struct KBlock {
  ivec u[NC];
  fvec a[NF], b[NF];
};

LOCALLLM_INLINE void decode_q6_k(const uint8_t* p, KBlock& o) {
  // ql[128], qh[64], scales[16] int8, d; weight 128n + 32k + l = d * sc * (u - 32),
  // u = (nibble k / 2 of ql[64n + 32 (k % 2) + l]) | ((qh[32n + l] >> 2k) & 3) << 4
  const fvec dd = vset1<fvec>(f16(p + 208));
  for (int h = 0; h < NF; ++h) {
    o.a[h] = vmul(dd, vcvt(widen_i8(p + 192 + FL * h)));
    o.b[h] = vmul(o.a[h], vset1<fvec>(32.f));  // the offset, applied with xsum16
  }
  const ivec m4 = iset8(0x0F), m30 = iset8(0x30);
  for (int n = 0; n < 2; ++n) {
    const ivec hh = spread(load256(p + 128 + 32 * n), 2);  // lane l: qh[l % 32] >> 2 (l / 32)
    for (int j = 0; j < 64 / Q8W; ++j) {  // ql[64n + Q8W j ..]: registers j and j + 64 / Q8W
      const ivec ql = iload(p + 64 * n + Q8W * j);
      for (int c = j; c < PH; c += 64 / Q8W) {
        const ivec lo = c == j ? ql : isrl16(ql, 4);
        o.u[PH * n + c] = ior(iand(lo, m4), iand(bits_to_4(hh, 2 * (Q8W / 32) * c), m30));
      }
    }
  }
}

LOCALLLM_INLINE void decode_q2_k(const uint8_t* p, KBlock& o) {
  // scales[16], qs[64], d, dmin; weight 128n + 32k + l = d * (sc & 15) * u - dmin * (sc >> 4),
  // u = (qs[32n + l] >> 2k) & 3
  const fvec dd = vset1<fvec>(f16(p + 80)), dmin = vset1<fvec>(f16(p + 82));
  for (int h = 0; h < NF; ++h) {
    const ivec sc = widen_u8(p + FL * h);
    o.a[h] = vmul(dd, vcvt(iand(sc, iset32(15))));
    o.b[h] = vmul(dmin, vcvt(isrl32(sc, 4)));
  }
  const ivec m3 = iset8(0x03);
  for (int n = 0; n < 2; ++n) {
    const ivec q = spread(load256(p + 16 + 32 * n), 2);  // lane l: qs[l % 32] >> 2 (l / 32)
    for (int c = 0; c < PH; ++c) o.u[PH * n + c] = iand(isrl16(q, 2 * (Q8W / 32) * c), m3);
  }
}

LOCALLLM_INLINE void decode_q3_k(const uint8_t* p, KBlock& o) {
  // hmask[32], qs[64], scales[12], d; weight 128n + 32k + l = d * (sc - 32) * (u - 4),
  // u = (qs[32n + l] >> 2k) & 3 | ((hmask[l] >> (4n + k)) & 1) << 2
  const fvec dd = vset1<fvec>(f16(p + 108));
  uint32_t aux[4];
  q3_k_scales(p, aux);
  // from registers: a 16-byte load of aux just stored would stall on store forwarding
  const __m128i sc = _mm_set_epi32(int(aux[3]), int(aux[2]), int(aux[1]), int(aux[0]));
  for (int h = 0; h < NF; ++h)
    o.a[h] = vmul(dd, vcvt(isub32(widen_u8(h == 0 ? sc : _mm_srli_si128(sc, 8)), iset32(32))));
  const ivec m3 = iset8(0x03), one = iset8(1);
  const ivec hm = spread(load256(p), 1);  // lane l: hmask[l % 32] >> (l / 32)
  for (int n = 0; n < 2; ++n) {
    const ivec q = spread(load256(p + 32 + 32 * n), 2);
    for (int c = 0; c < PH; ++c) {
      const int k = Q8W / 32 * c;  // the register's first run of 32
      o.u[PH * n + c] = ior(iand(isrl16(q, 2 * k), m3), isll16(iand(isrl16(hm, 4 * n + k), one), 2));
    }
  }
}

using DecodeFn = void (*)(const uint8_t*, KBlock&);

// Rows [r0, r1) of a K-quant W with a scale per 16 weights times NT quantized activation
// rows; OFF: the constant offset, from Q8Act::corr (else the offsets b, with xsum16).
template <int NT, int BYTES, DecodeFn DECODE, int OFF>
void gemv_q8_kquant(const uint8_t* w, int64_t row_bytes, const Q8Act& xa, float* out,
                    int64_t ldo, int64_t r0, int64_t r1) {
  constexpr int CF = NC / NF;  // CF: registers per scale register
  // lane j of register c's dot products covers weights Q8W c + 4j .. + 3: group
  // (Q8W c + 4j) / 16, lane (Q8W (c % CF) + 4j) / 16 of scale register c / CF
  ivec perm[CF];
  for (int c = 0; c < CF; ++c) perm[c] = lane_index([c](int j) { return (Q8W * c + 4 * j) / 16; });
  const int64_t nblocks = xa.cols / QK_K;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    fvec acc[NT];
    for (int t = 0; t < NT; ++t) acc[t] = vzero<fvec>();
    for (int64_t s = 0; s < nblocks; ++s) {
      KBlock blk;
      prefetch_block<BYTES>(row + s * BYTES);
      DECODE(row + s * BYTES, blk);
      for (int t = 0; t < NT; ++t) {
        const int8_t* xq = xa.q.data() + t * xa.stride_q + QK_K * s;
        const int64_t g0 = t * xa.stride_g + 16 * s;
        const int32_t* corr = OFF ? xa.corr.data() + t * xa.stride_c + 64 * s : nullptr;
        fvec av[NF];
        for (int h = 0; h < NF; ++h) av[h] = vmul(blk.a[h], vload<fvec>(xa.dx16.data() + g0 + FL * h));
        if constexpr (!OFF)
          for (int h = 0; h < NF; ++h)
            acc[t] = vfnma(blk.b[h], vload<fvec>(xa.xsum16.data() + g0 + FL * h), acc[t]);
        for (int c = 0; c < NC; ++c) {
          const ivec p = dot4(OFF ? iload(corr + FL * c) : izero(), blk.u[c], iload(xq + Q8W * c));
          acc[t] = vfma(vcvt(p), vperm(av[c / CF], perm[c % CF]), acc[t]);
        }
      }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo + r] = vsum(acc[t]);
  }
}

// ---- Q4_K / Q5_K: a scale and a minimum per 32 weights -----------------------------------

constexpr int KB = Q8W / 16;  // blocks whose scales unpack together, one per 128-bit lane

// The scales of up to KB consecutive Q4_K/Q5_K blocks (p, p + BYTES, ...; past n, block 0
// again), so that the unpacking runs once per KB blocks. Lane i of the 16-byte block
// headers (d, dmin, scales[12]: q[k] at byte 4 + k) gives, as llama.cpp get_scale_min_k4,
// scale j < 4 = q[j] & 63, min j < 4 = q[j + 4] & 63, and for j >= 4 scale = (q[j + 4] & 15)
// | (q[j - 4] >> 6) << 4, min = (q[j + 4] >> 4) | (q[j] >> 6) << 4. Returns sm, 128-bit
// lane i = block i's sc_0..7 then m_0..7 (bytes), and dd, float lanes [d_0, dmin_0, d_1,
// dmin_1, ...].
template <int BYTES>
LOCALLLM_INLINE void k4_scales(const uint8_t* p, int n, ivec& sm, fvec& dd) {
  const ivec v = load_heads(p, BYTES, n);
  // a: q[0..7] & 63 (bytes 4-11), q[8..11] & 15 (bytes 12-15)
  const ivec a = iand(v, broadcast128(_mm_setr_epi8(0, 0, 0, 0, 63, 63, 63, 63, 63, 63, 63, 63, 15, 15, 15, 15)));
  // b: (q[0..7] >> 6) << 4 (bytes 4-11), q[8..11] >> 4 (bytes 12-15)
  const ivec b = ior(iand(isrl16(v, 2), broadcast128(_mm_setr_epi8(0, 0, 0, 0, 48, 48, 48, 48, 48, 48, 48, 48, 0, 0, 0, 0))),
                     iand(isrl16(v, 4), broadcast128(_mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 15, 15, 15, 15))));
  const ivec sa = ishuffle8(a, broadcast128(_mm_setr_epi8(4, 5, 6, 7, 12, 13, 14, 15, 8, 9, 10, 11, -1, -1, -1, -1)));
  const ivec sb = ishuffle8(b, broadcast128(_mm_setr_epi8(-1, -1, -1, -1, 4, 5, 6, 7, -1, -1, -1, -1, 8, 9, 10, 11)));
  const ivec sc = ishuffle8(b, broadcast128(_mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 12, 13, 14, 15)));
  sm = ior(ior(sa, sb), sc);
  dd = head_halves(v);
}

// The 256 nibbles (plus Q5_K's fifth bits) of a Q4_K/Q5_K block: register c holds nibble
// c % 2 of qs[Q8W (c / 2) ..], that is weight 64 (b / 32) + 32 (c % 2) + b % 32 at byte
// b = Q8W (c / 2) + l (the order of Q8Act's k4 activations); Q5_K's fifth bit of weight
// 64j + 32i + l is bit 2j + i of qh[l].
template <bool FIVE>
LOCALLLM_INLINE void k4_runs(const uint8_t* p, ivec* u) {
  const uint8_t* qs = p + (FIVE ? 48 : 16);
  const ivec m4 = iset8(0x0F), one = iset8(1);
  ivec hb = izero();
  if constexpr (FIVE) hb = spread(load256(p + 16), 2);  // lane l: qh[l % 32] >> 2 (l / 32)
  for (int c = 0; c < NC; c += 2) {
    const ivec v = iload(qs + Q8W * c / 2);
    u[c] = iand(v, m4);
    u[c + 1] = iand(isrl16(v, 4), m4);
    if constexpr (FIVE) {
      const int s = Q8W / 32 * c;  // the bit of register c; c + 1's is the next
      u[c] = ior(u[c], isll16(iand(isrl16(hb, s), one), 4));
      u[c + 1] = ior(u[c + 1], isll16(iand(isrl16(hb, s + 1), one), 4));
    }
  }
}

template <int NT, int BYTES>
void gemv_q8_k4(const uint8_t* w, int64_t row_bytes, const Q8Act& xa, float* out,
                int64_t ldo, int64_t r0, int64_t r1) {
  // register c's int32 lane j: sub-block 2 ((Q8W (c / 2) + 4j) / 32) + c % 2 (k4_runs)
  ivec perm[NC];
  for (int c = 0; c < NC; ++c)
    perm[c] = lane_index([c](int j) { return 2 * ((Q8W * (c / 2) + 4 * j) / 32) + c % 2; });
  // block i's 16 scales: [d_i sc_0..7, dmin_i m_0..7], FL per register (k4_scales' dd lanes)
  ivec ddi[KB][NF];
  for (int i = 0; i < KB; ++i)
    for (int h = 0; h < NF; ++h) ddi[i][h] = lane_index([i, h](int j) { return 2 * i + (FL * h + j) / 8; });
  const int64_t nblocks = xa.cols / QK_K;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    fvec acc[NT], bacc[NT];  // bacc: the minimums' lanes sum dmin * m * xsum
    for (int t = 0; t < NT; ++t) {
      bacc[t] = vzero<fvec>();
      acc[t] = vzero<fvec>();
    }
    for (int64_t s0 = 0; s0 < nblocks; s0 += KB) {
      const int n = int(std::min<int64_t>(KB, nblocks - s0));
      ivec sm;
      fvec dd;
      k4_scales<BYTES>(row + s0 * BYTES, n, sm, dd);
      const auto block = [&](auto i) {
        constexpr int I = decltype(i)::value;
        const int64_t s = s0 + I;
        const uint8_t* p = row + s * BYTES;
        prefetch_block<BYTES>(p);
        const __m128i sb = lane128<I>(sm);
        fvec ab[NF];
        for (int h = 0; h < NF; ++h)
          ab[h] = vmul(vperm(dd, ddi[I][h]), vcvt(widen_u8(h == 0 ? sb : _mm_srli_si128(sb, 8))));
        ivec u[NC];
        k4_runs<BYTES == 176>(p, u);
        for (int t = 0; t < NT; ++t) {
          const int8_t* xq = xa.q.data() + t * xa.stride_q + QK_K * s;
          fvec sc[NF];
          for (int h = 0; h < NF; ++h)
            sc[h] = vmul(ab[h], vload<fvec>(xa.dxs.data() + t * xa.stride_s + 16 * s + FL * h));
          bacc[t] = vadd_last8(bacc[t], sc[NF - 1]);
          for (int c = 0; c < NC; ++c) {
            const ivec d = dot4(izero(), u[c], iload(xq + Q8W * c));
            acc[t] = vfma(vcvt(d), vperm(sc[0], perm[c]), acc[t]);
          }
        }
      };
      block(std::integral_constant<int, 0>{});
      if (n > 1) block(std::integral_constant<int, 1>{});
      if constexpr (KB > 2) {
        if (n > 2) block(std::integral_constant<int, 2>{});
        if (n > 3) block(std::integral_constant<int, 3>{});
      }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo + r] = vsum(vsub(acc[t], bacc[t]));
  }
}

// ---- legacy formats: blocks of 32 --------------------------------------------------------

constexpr int LB = Q8W / 32;  // blocks per register

// Q4_0 (d, qs[16]): offset 8; Q4_1 (d, m, qs[16]); Q5_0 (d, qh[4], qs[16]): offset 16;
// Q5_1 (d, m, qh[4], qs[16]); Q8_0 (d, qs[32] int8): weights 0-15 are the low nibbles of
// qs, 16-31 the high ones (Q5_*: plus bit j of qh as weight j's 0x10). MXFP4 (e, qs[16]):
// the nibbles index kvalues_mxfp4, looked up in registers into signed int8 read as Q8_0's.
template <int BYTES>
LOCALLLM_INLINE ivec legacy_runs(const uint8_t* const* p) {
  const uint8_t* qs[LB];
  if constexpr (BYTES == 34) {
    for (int k = 0; k < LB; ++k) qs[k] = p[k] + 2;
    return load_runs(qs);
  } else if constexpr (BYTES == 17) {
    for (int k = 0; k < LB; ++k) qs[k] = p[k] + 1;
    return ishuffle8(broadcast128(_mm_loadu_si128((const __m128i*)MXFP4_VALUES)), nibble_runs(qs));
  } else {
    constexpr int QS = BYTES - 16;  // the nibbles are the last 16 bytes of every block
    for (int k = 0; k < LB; ++k) qs[k] = p[k] + QS;
    ivec u = nibble_runs(qs);
    if constexpr (BYTES == 22 || BYTES == 24) {  // Q5_0, Q5_1: the fifth bits
      uint64_t bits = 0;
      for (int k = 0; k < LB; ++k) {
        uint32_t h;
        std::memcpy(&h, p[k] + QS - 4, 4);
        bits |= uint64_t(h) << (32 * k);
      }
      u = ior(u, bit_bytes(bits, 0x10));
    }
    return u;
  }
}

// Rows [r0, r1) of W times NT quantized activation rows, LB blocks per dot product (lanes
// of block k take its scale: vblocks); OFF: the constant offset, from Q8Act::corr.
template <int NT, int BYTES, int OFF>
void gemv_q8_legacy(const uint8_t* w, int64_t row_bytes, const Q8Act& xa, float* out,
                    int64_t ldo, int64_t r0, int64_t r1) {
  constexpr bool MIN = BYTES == 20 || BYTES == 24;  // Q4_1, Q5_1: w = a * u - b, b = -m
  const int64_t nblocks = xa.cols / QK;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    fvec acc[NT];
    float bsum[NT];
    for (int t = 0; t < NT; ++t) acc[t] = vzero<fvec>(), bsum[t] = 0.f;
    for (int64_t i = 0; i < nblocks; i += LB) {
      // a block past the end repeats the first, weighted 0 (its activations are the zero
      // padding past cols)
      const uint8_t* p[LB];
      float a[LB], b[LB] = {};
      for (int k = 0; k < LB; ++k) {
        const bool in = i + k < nblocks;
        p[k] = row + (in ? i + k : i) * BYTES;
        a[k] = in ? (BYTES == 17 ? e8m0_half(p[k][0]) : f16(p[k])) : 0.f;
        if constexpr (MIN) b[k] = in ? -f16(p[k] + 2) : 0.f;
      }
      prefetch_block<LB * BYTES>(p[0]);
      const ivec u = legacy_runs<BYTES>(p);
      for (int t = 0; t < NT; ++t) {
        const int8_t* xq = xa.q.data() + t * xa.stride_q + QK * i;
        const float* dx = xa.dx32.data() + t * xa.stride_g + i;
        const ivec init = OFF ? iload(xa.corr.data() + t * xa.stride_c + 8 * i) : izero();
        const ivec d = BYTES == 34 || BYTES == 17 ? dot4_q8_0(init, u, iload(xq))
                                                  : dot4(init, u, iload(xq));
        float sc[LB];
        for (int k = 0; k < LB; ++k) sc[k] = a[k] * dx[k];
        acc[t] = vfma(vcvt(d), vblocks(sc), acc[t]);
        if constexpr (MIN) {
          const float* xs = xa.xsum32.data() + t * xa.stride_g + i;
          float bs = b[0] * xs[0];
          for (int k = 1; k < LB; ++k) bs += b[k] * xs[k];
          bsum[t] += bs;
        }
      }
    }
    for (int t = 0; t < NT; ++t) out[t * ldo + r] = vsum(acc[t]) - bsum[t];
  }
}

// ---- the kernels by type and activation row count ----------------------------------------

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
    case Q6_K: return gemv_q8_kquant<NT, 210, decode_q6_k, 0>;
    case MXFP4: return gemv_q8_legacy<NT, 17, q8_offset(MXFP4)>;
    default: TORCH_CHECK(false, "localllm_cpu.gemv_q8: no int8 kernel for ggml type ", qtype);
  }
}

GemvQ8Fn gemv_q8_of(int64_t qtype, int64_t nt) {
  return by_rows(nt, "gemv_q8", [&](auto n) { return gemv_q8_for<decltype(n)::value>(qtype); });
}

// out (T, rows) float32 as gemv, from int8-quantized activations.
void gemv_q8(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t rows, int64_t cols,
             at::Tensor& out) {
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
}

// One token through the k experts it selected of a stacked matrix W (n_expert * rows, cols):
// out[j, :] = W_e x_j for e = experts[j], x_j = x[0] (x of one row: the gate and up
// products) or x[j] (one input per expert: the down product), with x quantized as gemv_q8
// does. Only the selected experts' rows are read; one call per matrix instead of one per
// expert (llama.cpp's ggml_mul_mat_id for one token).
void gemv_q8_experts(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t rows,
                     int64_t cols, const at::Tensor& experts, at::Tensor& out) {
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
}

// ---- one token's MoE FFN in one call -------------------------------------------------------

// Rows [0, rows) of one quantized matrix times one quantized activation row, into out.
struct GemvPart {
  const uint8_t* w;
  int64_t row_bytes, rows;
  GemvQ8Fn fn;
  const Q8Act* xa;
  float* out;
};

// Every part's rows in one parallel region, split over the threads by weight bytes (parts
// of other types have rows of other sizes: a shared expert of another type than the
// routed ones, a Q6_K down beside Q4_K gate/up): a row goes to the thread whose share of
// the bytes holds its first byte.
void run_parts(const std::vector<GemvPart>& parts) {
  std::vector<int64_t> start(parts.size() + 1, 0);  // first byte of each part
  for (size_t i = 0; i < parts.size(); ++i)
    start[i + 1] = start[i] + parts[i].rows * parts[i].row_bytes;
  const int64_t total = start.back();
  if (total == 0) return;
  const int64_t n = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                           total / (64 << 10)));
  at::parallel_for(0, n, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b0 = total * t / n, b1 = total * (t + 1) / n;
      for (size_t p = 0; p < parts.size(); ++p) {
        const GemvPart& q = parts[p];
        // rows whose first byte start[p] + r * row_bytes lies in [b0, b1)
        auto first = [&](int64_t b) {
          return std::clamp<int64_t>((b - start[p] + q.row_bytes - 1) / q.row_bytes, 0, q.rows);
        };
        const int64_t r0 = b0 <= start[p] ? 0 : first(b0), r1 = b1 <= start[p] ? 0 : first(b1);
        if (r1 > r0) q.fn(q.w, q.row_bytes, *q.xa, q.out, 0, r0, r1);
      }
    }
  });
}

// A quantized 2-D matrix argument: (n * rows, cols) in ggml blocks, checked.
struct QMat {
  const uint8_t* data = nullptr;
  int64_t qtype = 0, row_bytes = 0, rows_total = 0;
  QMat() = default;
  QMat(const at::Tensor& w, int64_t qtype_, int64_t cols, const char* name) : qtype(qtype_) {
    const Format f = format_of(qtype);
    TORCH_CHECK(f.unpack != nullptr, "localllm_cpu.moe_token_q8: ", name, " is a float type");
    TORCH_CHECK(cols > 0 && cols % f.block == 0, "localllm_cpu.moe_token_q8: ", name,
                ": ", cols, " columns are not whole blocks");
    row_bytes = (cols / f.block) * f.bytes;
    TORCH_CHECK(w.device().is_cpu() && w.scalar_type() == at::kByte && w.is_contiguous() &&
                    w.numel() % row_bytes == 0,
                "localllm_cpu.moe_token_q8: ", name, " must be whole rows of contiguous uint8");
    data = w.data_ptr<uint8_t>();
    rows_total = w.numel() / row_bytes;
  }
};

// out (1, d) = sum over the token's k slots, in increasing expert order, of
//   weights[j] * (down_e(act(gate_e(x) + bg_e, up_e(x) + bu_e)) + bd_e),  e = chosen[j],
// plus sh_weight * sh_down(silu(sh_gate(xs)) * sh_up(xs)) when the shared expert is given,
// xs = sh_x if given (Llama 4 scales the routed input only) else x (llama.cpp's
// build_moe_ffn plus the families' ffn_*_shexp, for one token). gate and up
// stacked (n_expert * n_ff, d), or up absent and gate the fused ffn_gate_up_exps (n_expert *
// 2 n_ff, d); down (n_expert * d, n_ff); the shared matrices (sh_ff, d), (sh_ff, d) and (d,
// sh_ff). x is quantized once per weight type as gemv_q8 does; the gate and up rows of every
// expert (the shared one included) are one parallel pass, the down rows another: two
// parallel regions and one call where the Python side made five to seven.
void moe_token_q8(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights,
                  const at::Tensor& gate, const std::optional<at::Tensor>& up,
                  const at::Tensor& down, int64_t gate_type, int64_t up_type, int64_t down_type,
                  int64_t n_ff, const std::optional<at::Tensor>& gate_bias,
                  const std::optional<at::Tensor>& up_bias,
                  const std::optional<at::Tensor>& down_bias, int64_t act,
                  const std::optional<at::Tensor>& sh_gate, const std::optional<at::Tensor>& sh_up,
                  const std::optional<at::Tensor>& sh_down, int64_t sh_gate_type,
                  int64_t sh_up_type, int64_t sh_down_type, int64_t sh_ff, double sh_weight,
                  const std::optional<at::Tensor>& sh_x, at::Tensor& out) {
  const char* op = "localllm_cpu.moe_token_q8";
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && x.scalar_type() == at::kFloat &&
                  x.stride(1) == 1, op, ": x must be (1, d) float32");
  const int64_t d = x.size(1);
  TORCH_CHECK(chosen.dim() == 1 && chosen.scalar_type() == at::kLong && chosen.is_contiguous(),
              op, ": chosen must be (k,) int64");
  const int64_t k = chosen.size(0);
  TORCH_CHECK(weights.dim() == 1 && weights.size(0) == k && weights.scalar_type() == at::kFloat &&
                  weights.is_contiguous(), op, ": weights must be (k,) float32");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == 1 && out.size(1) == d &&
                  out.scalar_type() == at::kFloat && out.is_contiguous(),
              op, ": out must be (1, d) contiguous float32");
  TORCH_CHECK(n_ff > 0 && act >= 0 && act <= 2, op, ": n_ff must be > 0 and act 0, 1 or 2");
  const bool fused = !up.has_value() || !up->defined();
  const QMat mg(gate, gate_type, d, "gate"), mu = fused ? mg : QMat(*up, up_type, d, "up"),
             md(down, down_type, n_ff, "down");
  const int64_t gu_rows = fused ? 2 * n_ff : n_ff, n_expert = mg.rows_total / gu_rows;
  TORCH_CHECK(n_expert > 0 && mg.rows_total == n_expert * gu_rows &&
                  mu.rows_total == mg.rows_total && md.rows_total == n_expert * d,
              op, ": gate, up and down do not hold the same number of (", n_ff, ", ", d,
              ") experts");
  const int64_t* ch = chosen.data_ptr<int64_t>();
  for (int64_t j = 0; j < k; ++j)
    TORCH_CHECK(ch[j] >= 0 && ch[j] < n_expert, op, ": expert ", ch[j], " out of range [0, ",
                n_expert, ")");
  const float* gb = expert_bias(op, gate_bias, n_expert, n_ff, "gate_bias");
  const float* ub = expert_bias(op, up_bias, n_expert, n_ff, "up_bias");
  const float* db = expert_bias(op, down_bias, n_expert, d, "down_bias");
  const bool shared = sh_gate.has_value() && sh_gate->defined();
  QMat sg, su, sd;
  if (shared) {
    TORCH_CHECK(sh_up.has_value() && sh_up->defined() && sh_down.has_value() &&
                    sh_down->defined() && sh_ff > 0, op, ": the shared expert needs gate, up, "
                "down and sh_ff > 0");
    sg = QMat(*sh_gate, sh_gate_type, d, "sh_gate");
    su = QMat(*sh_up, sh_up_type, d, "sh_up");
    sd = QMat(*sh_down, sh_down_type, sh_ff, "sh_down");
    TORCH_CHECK(sg.rows_total == sh_ff && su.rows_total == sh_ff && sd.rows_total == d, op,
                ": the shared expert's matrices are not (", sh_ff, ", ", d, ") and (", d, ", ",
                sh_ff, ")");
  }
  const bool own_x = shared && sh_x.has_value() && sh_x->defined();
  TORCH_CHECK(!own_x || (sh_x->dim() == 2 && sh_x->size(0) == 1 && sh_x->size(1) == d &&
                         sh_x->scalar_type() == at::kFloat && sh_x->stride(1) == 1),
              op, ": sh_x must be (1, d) float32");
  // each input quantized once per (offset, order) its weight types need
  std::map<std::tuple<const float*, int, bool>, Q8Act> acts;
  auto act_of = [&](const float* v, int64_t cols, int64_t qtype) -> const Q8Act* {
    const auto key = std::make_tuple(v, q8_offset(qtype), k4_order(qtype));
    auto it = acts.find(key);
    if (it == acts.end())
      it = acts.emplace(std::piecewise_construct, std::forward_as_tuple(key),
                        std::forward_as_tuple(v, cols, 1, cols, std::get<1>(key),
                                              std::get<2>(key))).first;
    return &it->second;
  };
  const float* xp = x.data_ptr<float>();
  const float* xs = own_x ? sh_x->data_ptr<float>() : xp;
  const int64_t n_sh = shared ? 1 : 0;
  // g, u: (k + shared) rows of n_ff (the shared row sh_ff wide, last)
  const int64_t width = std::max(n_ff, shared ? sh_ff : 0);
  std::vector<float> g((k + n_sh) * width), u((k + n_sh) * width), h((k + n_sh) * width);
  std::vector<GemvPart> parts;
  parts.reserve(2 * (k + n_sh));
  const GemvQ8Fn fg = gemv_q8_of(gate_type, 1), fu = gemv_q8_of(fused ? gate_type : up_type, 1);
  for (int64_t j = 0; j < k; ++j) {
    const uint8_t* base = mg.data + ch[j] * gu_rows * mg.row_bytes;
    parts.push_back({base, mg.row_bytes, n_ff, fg, act_of(xp, d, gate_type), &g[j * width]});
    const uint8_t* ubase = fused ? base + n_ff * mg.row_bytes
                                 : mu.data + ch[j] * n_ff * mu.row_bytes;
    parts.push_back({ubase, mu.row_bytes, n_ff, fu, act_of(xp, d, mu.qtype), &u[j * width]});
  }
  if (shared) {
    parts.push_back({sg.data, sg.row_bytes, sh_ff, gemv_q8_of(sh_gate_type, 1),
                     act_of(xs, d, sh_gate_type), &g[k * width]});
    parts.push_back({su.data, su.row_bytes, sh_ff, gemv_q8_of(sh_up_type, 1),
                     act_of(xs, d, sh_up_type), &u[k * width]});
  }
  run_parts(parts);
  // the gated activations, then each row quantized for its down matrix
  std::vector<Q8Act> hq;
  hq.reserve(k + n_sh);
  for (int64_t j = 0; j < k + n_sh; ++j) {
    float* gj = &g[j * width];
    float* uj = &u[j * width];
    const int64_t n = j < k ? n_ff : sh_ff;
    if (j < k && gb) for (int64_t i = 0; i < n; ++i) gj[i] += gb[ch[j] * n_ff + i];
    if (j < k && ub) for (int64_t i = 0; i < n; ++i) uj[i] += ub[ch[j] * n_ff + i];
    localllm_cpu::gated_values(gj, uj, &h[j * width], n, j < k ? act : 0);
    const int64_t qt = j < k ? down_type : sh_down_type;
    hq.emplace_back(&h[j * width], n, 1, n, q8_offset(qt), k4_order(qt));
  }
  std::vector<float> y((k + n_sh) * d);
  parts.clear();
  const GemvQ8Fn fd = gemv_q8_of(down_type, 1);
  for (int64_t j = 0; j < k; ++j)
    parts.push_back({md.data + ch[j] * d * md.row_bytes, md.row_bytes, d, fd, &hq[j], &y[j * d]});
  if (shared)
    parts.push_back({sd.data, sd.row_bytes, d, gemv_q8_of(sh_down_type, 1), &hq[k], &y[k * d]});
  run_parts(parts);
  // the weighted sum in increasing expert order, then the shared expert
  std::vector<int64_t> order(k);
  for (int64_t j = 0; j < k; ++j) order[j] = j;
  std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return ch[a] < ch[b]; });
  float* o = out.data_ptr<float>();
  std::fill(o, o + d, 0.f);
  const float* wt = weights.data_ptr<float>();
  for (int64_t j : order) {
    const float w = wt[j];
    const float* yr = &y[j * d];
    const float* bd = db ? db + ch[j] * d : nullptr;
    for (int64_t c = 0; c < d; ++c) o[c] += (bd ? yr[c] + bd[c] : yr[c]) * w;
  }
  if (shared) {
    const float w = float(sh_weight);
    for (int64_t c = 0; c < d; ++c) o[c] += y[k * d + c] * w;
  }
}

#else  // no int8 registers: q8_available() is false and the callers use gemv

void gemv_q8(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, at::Tensor&) {
  TORCH_CHECK(false, "localllm_cpu.gemv_q8: built without AVX2 or AVX512-VNNI");
}

void gemv_q8_experts(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t,
                     const at::Tensor&, at::Tensor&) {
  TORCH_CHECK(false, "localllm_cpu.gemv_q8_experts: built without AVX2 or AVX512-VNNI");
}

void moe_token_q8(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                  const std::optional<at::Tensor>&, const at::Tensor&, int64_t, int64_t, int64_t,
                  int64_t, const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                  const std::optional<at::Tensor>&, int64_t, const std::optional<at::Tensor>&,
                  const std::optional<at::Tensor>&, const std::optional<at::Tensor>&, int64_t,
                  int64_t, int64_t, int64_t, double, const std::optional<at::Tensor>&,
                  at::Tensor&) {
  TORCH_CHECK(false, "localllm_cpu.moe_token_q8: built without AVX2 or AVX512-VNNI");
}

#endif  // LOCALLLM_Q8

}  // namespace

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("gemv_q8", gemv_q8);
  m.impl("gemv_q8_experts", gemv_q8_experts);
  m.impl("moe_token_q8", moe_token_q8);
}
