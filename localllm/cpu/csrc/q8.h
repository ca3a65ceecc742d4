// Int8 activations of the llama.cpp-style GEMV (gemv_q8.cpp) and the MoE FFN (moe.cpp).
//
// x is quantized once per call, per 32 values, to int8 with a float32 scale (llama.cpp
// quantizes to block_q8_0 / block_q8_K, ggml/src/ggml-quants.c quantize_row_q8_*; one scale
// per 32 values is finer than q8_K's one per 256). Every weight block is then read as
// unsigned 8-bit lanes u with, per group of 16 weights, w = a_g * u - b_g (Q4_0's values
// are offset by 8, ...), so a row's product is
//     sum_g a_g * dx_g * (u . xq)_g  -  sum_g b_g * xsum_g
// with (u . xq) an integer dot product (dot4, simd.h) and xsum_g = dx_g * sum(xq over g) the
// group's sum of the quantized activations.
//
// Only where the build has the int8 registers (LOCALLLM_Q8, simd.h).

#pragma once

#include <optional>
#include <vector>

#include "blocks.h"

#if defined(LOCALLLM_Q8)
namespace {

// 32 floats x -> int8 q[i] = round-half-even(x[i] * 127 / amax) (llama.cpp quantize_row_q8_0);
// returns the scale amax / 127 and the sums of q over each half of 16 in s.
inline float quantize32(const float* x, int8_t* q, int s[2]) {
  constexpr int N = 32 / (Q8W / 4);  // registers of 32 floats
  fvec v[N];
  for (int k = 0; k < N; ++k) v[k] = vload<fvec>(x + Q8W / 4 * k);
  fvec am = vabs(v[0]);
  for (int k = 1; k < N; ++k) am = vmax(am, vabs(v[k]));
  const float amax = vmax_all(am);
  const fvec vid = vset1<fvec>(amax > 0.f ? 127.f / amax : 0.f);
  ivec i[N];
  for (int k = 0; k < N; ++k) i[k] = vcvt_i32(vmul(v[k], vid));  // nearest even
  narrow_i8(i, q);
  for (int h = 0; h < 2; ++h) {
    ivec t = i[h * N / 2];
    for (int k = 1; k < N / 2; ++k) t = iadd32(t, i[h * N / 2 + k]);
    s[h] = ireduce(t);
  }
  return amax / 127.f;
}

// c[i] = -offset * (q[4i] + q[4i + 1] + q[4i + 2] + q[4i + 3]) for 64 values q; offset * q
// stays within dot4's bounds (2 * 128 * 127 < 32768).
inline void offset_sums(const int8_t* q, int offset, int32_t* c) {
  for (int k = 0; k < 64 / Q8W; ++k)
    istore(c + Q8W / 4 * k,
           isub32(izero(), dot4(izero(), iset8(offset), iload(q + Q8W * k))));
}

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
  // k4 (Q4_K, Q5_K): per block of 256 one vector dxs (dx32 of its 8 sub-blocks, then their
  // xsum32), and xq in the order of the kernel's nibble registers (k4_runs in gemv_q8.cpp:
  // register c holds the low or high nibbles, c % 2, of Q8W consecutive bytes; with 64-byte
  // registers, in every 128 values the middle two 32s swapped).
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
        for (int64_t sb = 0; sb < cols / 256; ++sb) {
          int8_t* blk = qr + 256 * sb;
          int8_t tmp[256];
          std::memcpy(tmp, blk, 256);
          // register c, run r of 32: bytes Q8W (c / 2) + 32 r of qs, nibble c % 2
          for (int c = 0; c < 256 / Q8W; ++c)
            for (int r = 0; r < Q8W / 32; ++r)
              std::memcpy(blk + Q8W * c + 32 * r, tmp + 64 * (Q8W * (c / 2) / 32 + r) + 32 * (c % 2), 32);
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

// An optional per-expert bias (n_expert, rows) float32 of the expert kernels (moe.cpp's
// moe_ffn_q8, gemv_q8.cpp's moe_token_q8; `op` names the caller in the error), or nullptr.
inline const float* expert_bias(const char* op, const std::optional<at::Tensor>& b,
                                int64_t n_expert, int64_t rows, const char* name) {
  if (!b.has_value() || !b->defined()) return nullptr;
  TORCH_CHECK(b->dim() == 2 && b->size(0) == n_expert && b->size(1) == rows &&
                  b->scalar_type() == at::kFloat && b->is_contiguous() && b->device().is_cpu(),
              op, ": ", name, " must be (", n_expert, ", ", rows, ") contiguous float32");
  return b->data_ptr<float>();
}

}  // namespace
#endif  // LOCALLLM_Q8
