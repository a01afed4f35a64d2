// MLAttention._decode as the same ATen ops (mla_step.h). The slots each row reads are gathered in
// a plain loop: integers, the same values as its index arithmetic.
#include "mla_step.h"

#include <algorithm>
#include <limits>

torch::Tensor mla_decode(const MlaShape& s, const torch::Tensor& q, const torch::Tensor& cache,
                         const torch::Tensor& kv_b, const torch::Tensor& block_ids, const torch::Tensor& kv_offsets,
                         const torch::Tensor& kv_lens, int64_t block_size, double scale) {
  const int64_t n = q.size(0), width = block_ids.size(1);
  const int64_t* bp = block_ids.data_ptr<int64_t>();
  const int64_t* off = kv_offsets.data_ptr<int64_t>();
  const int64_t* lens = kv_lens.data_ptr<int64_t>();
  const int64_t longest = n ? *std::max_element(lens, lens + n) : 0;
  torch::Tensor slots = torch::zeros({n, longest}, kv_lens.options());
  torch::Tensor valid = torch::zeros({n, longest}, kv_lens.options().dtype(at::kBool));
  int64_t* sp = slots.data_ptr<int64_t>();
  bool* vp = valid.data_ptr<bool>();
  const int64_t row_stride = block_ids.stride(0);
  for (int64_t t = 0; t < n; ++t)
    for (int64_t l = 0; l < lens[t]; ++l) {
      const int64_t pos = off[t] + l;
      sp[t * longest + l] = bp[t * row_stride + std::min(pos / block_size, width - 1)] * block_size + pos % block_size;
      vp[t * longest + l] = true;
    }
  const torch::Tensor rows = cache.index({slots});  // [n, L, rank + dr]
  const torch::Tensor w = kv_b.view({s.heads, s.dn + s.dv, s.rank});
  const torch::Tensor w_uk = w.slice(1, 0, s.dn), w_uv = w.slice(1, s.dn);
  const torch::Tensor q_lat = at::einsum("nhd,hdr->nhr", {q.slice(2, 0, s.dn), w_uk});
  torch::Tensor scores = at::einsum("nhc,nlc->nhl", {at::cat({q_lat, q.slice(2, s.dn)}, -1), rows}) * scale;
  scores = scores.masked_fill(valid.unsqueeze(1).logical_not(), -std::numeric_limits<float>::infinity());
  const torch::Tensor o_lat = at::einsum("nhl,nlr->nhr", {scores.softmax(-1), rows.slice(2, 0, s.rank)});
  return at::einsum("nhr,hvr->nhv", {o_lat, w_uv}).contiguous().view({n, s.heads * s.dv});
}
