// Native CPU kernels of localllm: matrix products read directly from ggml blocks.
//
// Registered as torch operators under torch.ops.localllm_cpu (loaded by localllm/cpu/build.py):
//   gemv(x, w, qtype, rows, cols, out)        out[t, r] = sum_k x[t, k] * W[r, k], T <= 8 rows
//   dequant_rows(w, qtype, r0, cols, out)     out[i, :] = W[r0 + i, :] as float32 or bfloat16
//   gemv_q8, gemv_q8_experts                  the int8 GEMV (gemv_q8.cpp; q8_available())
//   moe_ffn_q8                                a prompt's MoE experts (moe.cpp; moe_available())
// and, by ops.cpp, the element-wise kernels of a decoder layer.
//
// W is a (rows, cols) matrix of ggml blocks (blocks.h). gemv keeps the activations float32
// (products exact up to float32 summation order): each block is unpacked to int8 values
// plus one float scale (and minimum) per 16 weights, converted 16 at a time to float32
// lanes (simd.h's vf: AVX-512, AVX2 or portable, chosen at compile time) and multiplied
// with every activation row; threads split the output rows (at::parallel_for, honouring
// torch.set_num_threads).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <vector>

#include "blocks.h"

namespace {

// 16 values of a float format as float32 lanes.
LOCALLLM_INLINE vf vflt(const uint8_t* p, Flt f) {
  switch (f) {
    case Flt::F16: return vload_f16(p);
    case Flt::BF16: return vload_bf16(p);
    default: return vload((const float*)p);
  }
}

// Group g (16 weights) of an unpacked block as float32 lanes (bit-exact dequantization).
template <bool ASYM>
LOCALLLM_INLINE vf group_weights(const int8_t* q, const float* d, const float* m, int g) {
  vf w = vmul(vload_i8(q + G * g), vset1(d[g]));
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
    case MXFP4: return gemv_quant<NT, QK, 17, false, unpack_mxfp4>;
    default: return gemv_float<NT>;  // F32, F16, BF16 (format_of rejected the rest)
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

bool q8_available() {
#if defined(LOCALLLM_Q8)
  return true;
#else
  return false;
#endif
}

// moe_ffn_q8 is written for AVX512-VNNI (16 tokens per vpdpbusd); AVX2 builds keep the
// per-expert products.
bool moe_available() {
#if LOCALLLM_Q8 + 0 == 512  // (LOCALLLM_Q8 is undefined in portable builds)
  return true;
#else
  return false;
#endif
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

}  // namespace

TORCH_LIBRARY(localllm_cpu, m) {
  m.def("gemv(Tensor x, Tensor w, int qtype, int rows, int cols, Tensor(a!) out) -> ()");
  m.def("dequant_rows(Tensor w, int qtype, int r0, int cols, Tensor(a!) out) -> ()");
  m.def("gemv_q8(Tensor x, Tensor w, int qtype, int rows, int cols, Tensor(a!) out) -> ()");
  m.def("gemv_q8_experts(Tensor x, Tensor w, int qtype, int rows, int cols, Tensor experts, "
        "Tensor(a!) out) -> ()");
  m.def("moe_token_q8(Tensor x, Tensor chosen, Tensor weights, Tensor gate, Tensor? up, "
        "Tensor down, int gate_type, int up_type, int down_type, int n_ff, Tensor? gate_bias, "
        "Tensor? up_bias, Tensor? down_bias, int act, Tensor? sh_gate, Tensor? sh_up, "
        "Tensor? sh_down, int sh_gate_type, int sh_up_type, int sh_down_type, int sh_ff, "
        "float sh_weight, Tensor? sh_x, Tensor(a!) out) -> ()");
  m.def("q8_available() -> bool", q8_available);
  m.def("moe_available() -> bool", moe_available);
  m.def("moe_ffn_q8(Tensor x, Tensor chosen, Tensor weights, Tensor gate, Tensor up, Tensor down, "
        "int gate_type, int up_type, int down_type, int n_expert, int n_ff, Tensor? gate_bias, "
        "Tensor? up_bias, Tensor? down_bias, int act, bool gate_up_fused, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("gemv", gemv);
  m.impl("dequant_rows", dequant_rows);
}
