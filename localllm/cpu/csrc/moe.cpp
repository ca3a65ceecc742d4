// The mixture-of-experts FFN of localllm's native CPU kernels (torch.ops.localllm_cpu,
// declared in qmatmul.cpp):
//   moe_ffn_q8(x, chosen, weights, gate, up, down, ..., gate_bias, up_bias, down_bias, act,
//              gate_up_fused, out)
//                                             a prompt's gated experts, int8 activations
//                                             (AVX512-VNNI builds: moe_available())
//
// moe_ffn_q8 runs llama.cpp's build_moe_ffn after the routing: every (token, slot) pair goes
// to its expert's group (counting sort by expert, tokens in order), and per expert:
// down(act(gate(x) + bg, up(x) + bu)) + bd over its tokens, the biases optional (gpt-oss's
// ffn_*_exps.bias), act SiLU or GELU-tanh times up, or gpt-oss's clamped SwiGLU
// (swiglu_oai); gate and up as two tensors or fused in one (Gemma 4's ffn_gate_up_exps). Activations are quantized as
// the int8 GEMV does (Q8Act: one scale per 32 values), in batches of 16 tokens stored +128
// as u8 with the tokens' 4-value runs interleaved, so that one vpdpbusd multiplies 4
// weights of one row (broadcast, signed) with 16 tokens at once (one int32 lane per token)
// and each group's scales apply once per 16 tokens. Weights are unpacked per tile of rows
// (the float GEMV's unpack_*: signed int8, a scale and a minimum per 16) once per task, a
// task being (expert, tile of output rows), and the tile then multiplies every batch of the
// expert. Threads take tasks dynamically (experts get different token counts). The outputs
// are summed per token in increasing expert order, each times its routing weight (the
// order of the torch path, localllm.backends.dense.TorchOps.experts). The activations and
// the gated product are ops.cpp's (gated_values).

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <atomic>
#include <memory>
#include <optional>

#include "q8.h"

#if LOCALLLM_Q8 + 0 == 512
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

// y[p * ld + i] += bias[i] for the positions [p0, p1) and i in [0, n).
void add_rows(float* y, int64_t ld, int64_t p0, int64_t p1, const float* bias, int64_t n) {
  for (int64_t p = p0; p < p1; ++p)
    for (int64_t i = 0; i < n; ++i) y[p * ld + i] += bias[i];
}

void moe_ffn_q8(const at::Tensor& x, const at::Tensor& chosen, const at::Tensor& weights,
                const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down,
                int64_t gate_type, int64_t up_type, int64_t down_type, int64_t n_expert,
                int64_t n_ff, const std::optional<at::Tensor>& gate_bias,
                const std::optional<at::Tensor>& up_bias,
                const std::optional<at::Tensor>& down_bias, int64_t act, bool gate_up_fused,
                at::Tensor& out) {
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
  TORCH_CHECK(act >= 0 && act <= 2, "localllm_cpu.moe_ffn_q8: act 0 (SiLU), 1 (GELU) or 2 "
              "(swiglu_oai), got ", act);
  const float* gb = expert_bias("localllm_cpu.moe_ffn_q8", gate_bias, n_expert, n_ff, "gate_bias");
  const float* ub = expert_bias("localllm_cpu.moe_ffn_q8", up_bias, n_expert, n_ff, "up_bias");
  const float* db = expert_bias("localllm_cpu.moe_ffn_q8", down_bias, n_expert, d, "down_bias");
  // fused (llama.cpp's ffn_gate_up_exps): each expert's 2 n_ff rows of `gate` are its gate
  // rows then its up rows (`up` is not read); up's tiles start n_ff rows on
  const int64_t gu_rows = gate_up_fused ? 2 * n_ff : n_ff, up_off = gate_up_fused ? n_ff : 0;
  const MoeMatrix mg(gate, gate_type, n_expert, gu_rows, d, "gate"),
      mu(gate_up_fused ? gate : up, gate_up_fused ? gate_type : up_type, n_expert, gu_rows, d,
         "up"),
      md(down, down_type, n_expert, d, n_ff, "down");
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
    const MoeTile wg = mg.tile(e, r0, r1), wu = mu.tile(e, up_off + r0, up_off + r1);
    for (int64_t b = first[e]; b < first[e + 1]; ++b) {
      const Batch& bt = batches[b];
      mg.fn(wg, *xg[b], bt.n, g.get() + bt.p0 * n_ff + r0, n_ff);
      mu.fn(wu, same_act ? *xg[b] : *xu[b], bt.n, u.get() + bt.p0 * n_ff + r0, n_ff);
    }
    if (gb) add_rows(g.get() + r0, n_ff, start[e], start[e + 1], gb + e * n_ff + r0, r1 - r0);
    if (ub) add_rows(u.get() + r0, n_ff, start[e], start[e + 1], ub + e * n_ff + r0, r1 - r0);
    for (int64_t p = start[e]; p < start[e + 1]; ++p)
      localllm_cpu::gated_values(g.get() + p * n_ff + r0, u.get() + p * n_ff + r0,
                                 h.get() + p * n_ff + r0, r1 - r0, act);
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
    if (db) add_rows(y.get() + r0, d, start[e], start[e + 1], db + e * d + r0, r1 - r0);
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

}  // namespace

TORCH_LIBRARY_IMPL(localllm_cpu, CPU, m) {
  m.impl("moe_ffn_q8", moe_ffn_q8);
}
#endif  // LOCALLLM_Q8 == 512
