#pragma once
// NoPE multi-head latent attention for one decode token per row, absorbed (MLAttention._decode,
// baton/models/mla.py): the queries meet the cached latents through W_UK, the output leaves
// through W_UV. It runs the module path's very ATen ops (mla_step.cpp), so its bits are the same.
#include <torch/types.h>

#include <cstdint>

struct MlaShape {
  int64_t heads, rank, dn, dr, dv;
  int64_t latent() const { return rank + dr; }  // a cache row: the normed latent c, then kr
};

// Attention of q [n, heads, dn + dr] over each row's cached latents in cache [slots, rank + dr]
// (the context block_ids / kv_offsets / kv_lens give, already checked), kv_b [heads * (dn + dv),
// rank] the plain kv_b_proj weight: [n, heads * dv], o_proj's input.
torch::Tensor mla_decode(const MlaShape& s, const torch::Tensor& q, const torch::Tensor& cache,
                         const torch::Tensor& kv_b, const torch::Tensor& block_ids, const torch::Tensor& kv_offsets,
                         const torch::Tensor& kv_lens, int64_t block_size, double scale);
