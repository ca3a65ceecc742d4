// Argument checks that several operators make (ops.cpp's attn_decode, attn_kvq.cpp's attn_kvq).

#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstdint>

namespace {

// The cells a step of `nt` tokens at position `pos` writes, slot .. slot + nt - 1, inside the
// `live` cells attended over, inside a cache of `size` cells; `k_pos` empty (cell j holds
// position j) or the (size,) int64 position of each cell. Several tokens end the live cells
// (a linear cache: memory/kv.py's decode_slot), so that query t's cells are a prefix
// (cells_seen). Returns k_pos's data or null.
inline int64_t* check_cells(at::Tensor& k_pos, int64_t size, int64_t nt, int64_t slot,
                            int64_t live, int64_t pos, const char* op) {
  const bool has_pos = k_pos.numel() > 0;
  TORCH_CHECK(!has_pos || (k_pos.scalar_type() == at::kLong && k_pos.is_contiguous() &&
                           k_pos.numel() == size),
              "localllm_cpu.", op, ": k_pos must be empty or (size,) int64");
  TORCH_CHECK(nt >= 1 && slot >= 0 && slot + nt <= size && live >= slot + nt && live <= size &&
                  pos >= 0,
              "localllm_cpu.", op, ": cells ", slot, "..", slot + nt - 1, " / live ", live,
              " outside the cache of ", size, " cells");
  TORCH_CHECK(nt == 1 || live == slot + nt, "localllm_cpu.", op, ": ", nt,
              " tokens must be the last of the live cells (cells ", slot, "..", slot + nt - 1,
              " / live ", live, ")");
  return has_pos ? k_pos.data_ptr<int64_t>() : nullptr;
}

// The cells query t of a checked step attends over: up to its own cell, slot + t, leaving out
// the step's later tokens rather than masking them, so that its sums run over the cells a
// one-token step at its position has, in the same order (a verified speculative guess equals
// the decoded token bit for bit).
inline int64_t cells_seen(int64_t live, int64_t nt, int64_t t) { return live - (nt - 1 - t); }

}  // namespace
