// Native CPU kernels of localllm: matrix products read directly from ggml blocks.
//
// Registered as torch operators under torch.ops.localllm_cpu (loaded by localllm/cpu/build.py):
//   gemv(x, w, qtype, rows, cols, out)        out[t, r] = sum_k x[t, k] * W[r, k], T <= 8 rows
//   dequant_rows(w, qtype, r0, cols, out)     out[i, :] = W[r0 + i, :] as float32
//
// W is a (rows, cols) matrix stored as ggml blocks, row after row (llama.cpp
// ggml/src/ggml-common.h block_q*); the per-block dequantizers follow dequantize_row_q* in
// ggml/src/ggml-quants.c and are bit-exact with localllm.gguf.quants (the build uses
// -ffp-contract=off so that `d * q - m` is two roundings, as there). Activations stay
// float32 (no int8 quantization of x): products are exact up to float32 summation order.
//
// Vectorization comes from the compiler (-O3 -march=native: AVX-512 or AVX2 lanes for the
// fixed-width loops below); threads split the output rows (at::parallel_for, honouring
// torch.set_num_threads).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

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
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

inline float bf16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// ---- per-block dequantizers: one block of bytes -> block_size floats ----------------------

inline void deq_q4_0(const uint8_t* b, float* y) {  // d, qs[16]
  const float d = f16(b);
  const uint8_t* qs = b + 2;
  for (int j = 0; j < 16; ++j) {
    y[j] = float(int(qs[j] & 0x0F) - 8) * d;
    y[j + 16] = float(int(qs[j] >> 4) - 8) * d;
  }
}

inline void deq_q4_1(const uint8_t* b, float* y) {  // d, m, qs[16]
  const float d = f16(b), m = f16(b + 2);
  const uint8_t* qs = b + 4;
  for (int j = 0; j < 16; ++j) {
    y[j] = float(qs[j] & 0x0F) * d + m;
    y[j + 16] = float(qs[j] >> 4) * d + m;
  }
}

inline void deq_q5_0(const uint8_t* b, float* y) {  // d, qh[4], qs[16]
  const float d = f16(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* qs = b + 6;
  for (int j = 0; j < 16; ++j) {
    const int h0 = ((qh >> j) << 4) & 0x10;
    const int h1 = (qh >> (j + 12)) & 0x10;
    y[j] = float(int((qs[j] & 0x0F) | h0) - 16) * d;
    y[j + 16] = float(int((qs[j] >> 4) | h1) - 16) * d;
  }
}

inline void deq_q5_1(const uint8_t* b, float* y) {  // d, m, qh[4], qs[16]
  const float d = f16(b), m = f16(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* qs = b + 8;
  for (int j = 0; j < 16; ++j) {
    const int h0 = ((qh >> j) << 4) & 0x10;
    const int h1 = (qh >> (j + 12)) & 0x10;
    y[j] = float((qs[j] & 0x0F) | h0) * d + m;
    y[j + 16] = float((qs[j] >> 4) | h1) * d + m;
  }
}

inline void deq_q8_0(const uint8_t* b, float* y) {  // d, qs[32] int8
  const float d = f16(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < QK; ++j) y[j] = float(qs[j]) * d;
}

inline void deq_q2_k(const uint8_t* b, float* y) {  // scales[16], qs[64], d, dmin
  const uint8_t* sc = b;
  const uint8_t* q = b + 16;
  const float d = f16(b + 80), dmin = f16(b + 82);
  int is = 0;
  for (int n = 0; n < QK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t s = sc[is++];
        const float dl = d * float(s & 0x0F), ml = dmin * float(s >> 4);
        const uint8_t* qq = q + 16 * half;
        for (int l = 0; l < 16; ++l) *y++ = dl * float((qq[l] >> shift) & 3) - ml;
      }
    }
    q += 32;
  }
}

inline void deq_q3_k(const uint8_t* b, float* y) {  // hmask[32], qs[64], scales[12], d
  const uint8_t* hm = b;
  const uint8_t* q = b + 32;
  const float d = f16(b + 108);
  uint32_t aux[4];
  std::memcpy(aux, b + 96, 12);
  const uint32_t kmask1 = 0x03030303, kmask2 = 0x0f0f0f0f, tmp = aux[2];
  aux[2] = ((aux[0] >> 4) & kmask2) | (((tmp >> 4) & kmask1) << 4);
  aux[3] = ((aux[1] >> 4) & kmask2) | (((tmp >> 6) & kmask1) << 4);
  aux[0] = (aux[0] & kmask2) | (((tmp >> 0) & kmask1) << 4);
  aux[1] = (aux[1] & kmask2) | (((tmp >> 2) & kmask1) << 4);
  int8_t scales[16];
  std::memcpy(scales, aux, 16);
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < QK_K; n += 128) {
    for (int shift = 0; shift < 8; shift += 2) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d * float(scales[is++] - 32);
        const uint8_t* qq = q + 16 * half;
        const uint8_t* hh = hm + 16 * half;
        for (int l = 0; l < 16; ++l)
          *y++ = dl * float(int((qq[l] >> shift) & 3) - ((hh[l] & m) ? 0 : 4));
      }
      m <<= 1;
    }
    q += 32;
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

inline void deq_q4_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qs[128]
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* q = b + 16;
  for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, q += 32) {
    int s, mm;
    scale_min_k4(is, sc, &s, &mm);
    const float d1 = d * float(s), m1 = dmin * float(mm);
    scale_min_k4(is + 1, sc, &s, &mm);
    const float d2 = d * float(s), m2 = dmin * float(mm);
    for (int l = 0; l < 32; ++l) y[j + l] = d1 * float(q[l] & 0x0F) - m1;
    for (int l = 0; l < 32; ++l) y[j + 32 + l] = d2 * float(q[l] >> 4) - m2;
  }
}

inline void deq_q5_k(const uint8_t* b, float* y) {  // d, dmin, scales[12], qh[32], qs[128]
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t* sc = b + 4;
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + 48;
  uint8_t u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < QK_K; j += 64, is += 2, ql += 32, u1 <<= 2, u2 <<= 2) {
    int s, mm;
    scale_min_k4(is, sc, &s, &mm);
    const float d1 = d * float(s), m1 = dmin * float(mm);
    scale_min_k4(is + 1, sc, &s, &mm);
    const float d2 = d * float(s), m2 = dmin * float(mm);
    for (int l = 0; l < 32; ++l)
      y[j + l] = d1 * float((ql[l] & 0x0F) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l)
      y[j + 32 + l] = d2 * float((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
  }
}

inline void deq_q6_k(const uint8_t* b, float* y) {  // ql[128], qh[64], scales[16], d
  const uint8_t* ql = b;
  const uint8_t* qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32, sc += 8, y += 128) {
    float ds[8];
    for (int i = 0; i < 8; ++i) ds[i] = d * float(sc[i]);
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = int((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = int((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = int((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = int((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = ds[is] * float(q1);
      y[l + 32] = ds[is + 2] * float(q2);
      y[l + 64] = ds[is + 4] * float(q3);
      y[l + 96] = ds[is + 6] * float(q4);
    }
  }
}

inline void deq_f16(const uint8_t* b, float* y) {
  for (int j = 0; j < QK; ++j) y[j] = f16(b + 2 * j);
}

inline void deq_bf16(const uint8_t* b, float* y) {
  for (int j = 0; j < QK; ++j) y[j] = bf16(b + 2 * j);
}

inline void deq_f32(const uint8_t* b, float* y) { std::memcpy(y, b, QK * sizeof(float)); }

// A format as the kernels see it: `block` weights in `bytes` bytes. F32/F16/BF16 are read in
// groups of 32 values (the callers check that cols is a multiple of the block).
struct Format {
  int block;
  int bytes;
  void (*deq)(const uint8_t*, float*);
};

Format format_of(int64_t qtype) {
  switch (qtype) {
    case F32: return {QK, 4 * QK, deq_f32};
    case F16: return {QK, 2 * QK, deq_f16};
    case BF16: return {QK, 2 * QK, deq_bf16};
    case Q4_0: return {QK, 18, deq_q4_0};
    case Q4_1: return {QK, 20, deq_q4_1};
    case Q5_0: return {QK, 22, deq_q5_0};
    case Q5_1: return {QK, 24, deq_q5_1};
    case Q8_0: return {QK, 34, deq_q8_0};
    case Q2_K: return {QK_K, 84, deq_q2_k};
    case Q3_K: return {QK_K, 110, deq_q3_k};
    case Q4_K: return {QK_K, 144, deq_q4_k};
    case Q5_K: return {QK_K, 176, deq_q5_k};
    case Q6_K: return {QK_K, 210, deq_q6_k};
    default: TORCH_CHECK(false, "localllm_cpu: no kernel for ggml type ", qtype);
  }
}

constexpr int LANES = 16;  // one AVX-512 register of float32 (two AVX2 ones)

// Rows [r0, r1) of W times NT activation rows. The block is dequantized into a small buffer
// (L1) and multiplied with every activation row, so each weight byte is read once.
template <int NT, void (*DEQ)(const uint8_t*, float*), int BLOCK, int BYTES>
void gemv_rows(const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x, int64_t ldx,
               float* out, int64_t ldo, int64_t r0, int64_t r1) {
  alignas(64) float buf[BLOCK];
  const int64_t nb = cols / BLOCK;
  for (int64_t r = r0; r < r1; ++r) {
    const uint8_t* row = w + r * row_bytes;
    alignas(64) float acc[NT][LANES] = {};
    for (int64_t b = 0; b < nb; ++b) {
      DEQ(row + b * BYTES, buf);
      const float* xb = x + b * BLOCK;
      for (int t = 0; t < NT; ++t) {
        const float* xt = xb + t * ldx;
        for (int j = 0; j < BLOCK; j += LANES)
          for (int l = 0; l < LANES; ++l)
            acc[t][l] = __builtin_fmaf(buf[j + l], xt[j + l], acc[t][l]);
      }
    }
    for (int t = 0; t < NT; ++t) {
      float s = 0.f;
      for (int l = 0; l < LANES; ++l) s += acc[t][l];
      out[t * ldo + r] = s;
    }
  }
}

template <void (*DEQ)(const uint8_t*, float*), int BLOCK, int BYTES>
void gemv_dispatch_t(int nt, const uint8_t* w, int64_t row_bytes, int64_t cols, const float* x,
                     int64_t ldx, float* out, int64_t ldo, int64_t r0, int64_t r1) {
  switch (nt) {
#define LOCALLLM_CASE(N) \
  case N: return gemv_rows<N, DEQ, BLOCK, BYTES>(w, row_bytes, cols, x, ldx, out, ldo, r0, r1);
    LOCALLLM_CASE(1) LOCALLLM_CASE(2) LOCALLLM_CASE(3) LOCALLLM_CASE(4)
    LOCALLLM_CASE(5) LOCALLLM_CASE(6) LOCALLLM_CASE(7) LOCALLLM_CASE(8)
#undef LOCALLLM_CASE
    default: TORCH_CHECK(false, "localllm_cpu.gemv: 1 to 8 rows, got ", nt);
  }
}

using GemvFn = void (*)(int, const uint8_t*, int64_t, int64_t, const float*, int64_t, float*,
                        int64_t, int64_t, int64_t);

GemvFn gemv_of(int64_t qtype) {
  switch (qtype) {
    case F32: return gemv_dispatch_t<deq_f32, QK, 4 * QK>;
    case F16: return gemv_dispatch_t<deq_f16, QK, 2 * QK>;
    case BF16: return gemv_dispatch_t<deq_bf16, QK, 2 * QK>;
    case Q4_0: return gemv_dispatch_t<deq_q4_0, QK, 18>;
    case Q4_1: return gemv_dispatch_t<deq_q4_1, QK, 20>;
    case Q5_0: return gemv_dispatch_t<deq_q5_0, QK, 22>;
    case Q5_1: return gemv_dispatch_t<deq_q5_1, QK, 24>;
    case Q8_0: return gemv_dispatch_t<deq_q8_0, QK, 34>;
    case Q2_K: return gemv_dispatch_t<deq_q2_k, QK_K, 84>;
    case Q3_K: return gemv_dispatch_t<deq_q3_k, QK_K, 110>;
    case Q4_K: return gemv_dispatch_t<deq_q4_k, QK_K, 144>;
    case Q5_K: return gemv_dispatch_t<deq_q5_k, QK_K, 176>;
    case Q6_K: return gemv_dispatch_t<deq_q6_k, QK_K, 210>;
    default: TORCH_CHECK(false, "localllm_cpu: no kernel for ggml type ", qtype);
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

// out (T, >= rows) float32 with unit column stride (a column slice of a wider output is fine).
void gemv(const at::Tensor& x, const at::Tensor& w, int64_t qtype, int64_t rows, int64_t cols,
          at::Tensor& out) {
  const Format f = format_of(qtype);
  check_weight(w, f, rows, cols);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 &&
                  x.size(1) == cols, "localllm_cpu.gemv: x must be (T, cols) float32");
  const int64_t nt = x.size(0);
  TORCH_CHECK(nt >= 1 && nt <= 8, "localllm_cpu.gemv: 1 to 8 rows, got ", nt);
  TORCH_CHECK(out.dim() == 2 && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                  out.size(0) == nt && out.size(1) == rows,
              "localllm_cpu.gemv: out must be (T, rows) float32");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_bytes = (cols / f.block) * f.bytes;
  const int64_t ldx = x.stride(0), ldo = out.stride(0);
  const GemvFn fn = gemv_of(qtype);
  // Grain: about 64 KiB of weight bytes per task, so small matrices stay on one thread.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    fn(int(nt), wp, row_bytes, cols, xp, ldx, op, ldo, r0, r1);
  });
}

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
  const int64_t ldo = out.stride(0), nb = cols / f.block;
  const bool to_bf16 = out.scalar_type() == at::kBFloat16;
  void* op = out.data_ptr();
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(row_bytes, 1));
  at::parallel_for(0, n, grain, [&](int64_t i0, int64_t i1) {
    alignas(64) float buf[QK_K];
    for (int64_t i = i0; i < i1; ++i) {
      const uint8_t* row = wp + i * row_bytes;
      for (int64_t b = 0; b < nb; ++b) {
        if (!to_bf16) {
          f.deq(row + b * f.bytes, static_cast<float*>(op) + i * ldo + b * f.block);
          continue;
        }
        f.deq(row + b * f.bytes, buf);
        uint16_t* dst = static_cast<uint16_t*>(op) + i * ldo + b * f.block;
        for (int j = 0; j < f.block; ++j) {  // round to nearest even (finite inputs)
          uint32_t u;
          std::memcpy(&u, &buf[j], 4);
          dst[j] = uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(localllm_cpu, m) {
  m.def("gemv(Tensor x, Tensor w, int qtype, int rows, int cols, Tensor(a!) out) -> ()");
  m.def("dequant_rows(Tensor w, int qtype, int r0, int cols, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("gemv", gemv);
  m.impl("dequant_rows", dequant_rows);
}
