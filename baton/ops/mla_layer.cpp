// NoPE multi-head latent attention as a layer step of the fused decoder (fused_decoder.h), for
// decode rows (MLAttention.forward, baton/models/mla.py): q (q_proj, or q_a -> its norm -> q_b),
// the normed latent and kr written to the latent cache, the absorbed attention over each row's
// cached latents (as MLAttention._decode's very ATen ops, so the bits are the same), o_proj.
#include "step_common.h"

#include <algorithm>
#include <cstring>
#include <limits>

namespace {

struct MlaShape {
  int64_t heads, rank, dn, dr, dv;
  int64_t latent() const { return rank + dr; }  // a cache row: the normed latent c, then kr
};

// Attention of q [n, heads, dn + dr] over each row's cached latents in cache [slots, rank + dr]
// (the context block_ids / kv_offsets / kv_lens give, already checked), kv_b [heads * (dn + dv),
// rank] the plain kv_b_proj weight: [n, heads * dv], o_proj's input. The slots each row reads are
// gathered in a plain loop: integers, the same values as the module path's index arithmetic.
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


constexpr double kLatentNormEps = 1e-6;  // mla.LATENT_NORM_EPS

class MlaStep : public LayerStep {
 public:
  explicit MlaStep(StepArgs& a)
      : s_{a.integer("heads"), a.integer("kv_lora_rank"), a.integer("nope_dim"), a.integer("rope_dim"),
           a.integer("v_dim")},
        hidden_(a.integer("hidden")), q_lora_rank_(a.integer("q_lora_rank")), scale_(a.real("scale")),
        group_(a.integer("group")) {
    const int64_t q_out = s_.heads * (s_.dn + s_.dr);
    if (q_lora_rank_ > 0) {
      q_a_ = a.linear("q_a", hidden_, q_lora_rank_);
      q_a_norm_ = a.vector("q_a_norm", q_lora_rank_);
      q_b_ = a.linear("q_b", q_lora_rank_, q_out);
    } else {
      q_proj_ = a.linear("q_proj", hidden_, q_out);
    }
    kv_a_ = a.linear("kv_a", hidden_, s_.latent());
    kv_a_norm_ = a.vector("kv_a_norm", s_.rank);
    kv_b_ = a.tensor("kv_b");
    check_float(kv_b_, "kv_b");
    TORCH_CHECK(kv_b_.is_contiguous() && kv_b_.dim() == 2 && kv_b_.size(0) == s_.heads * (s_.dn + s_.dv) &&
                    kv_b_.size(1) == s_.rank,
                "kv_b must be contiguous [", s_.heads * (s_.dn + s_.dv), ", ", s_.rank, "], got ", kv_b_.sizes());
    o_ = a.linear("o_proj", s_.heads * s_.dv, hidden_);
    const torch::Tensor cache = a.tensor("k_cache");
    check_float(cache, "k_cache");
    TORCH_CHECK(cache.dim() == 3 && cache.size(1) == 1 && cache.size(2) == s_.latent() && cache.stride(2) == 1,
                "the latent cache must be [slots, 1, ", s_.latent(), "], got ", cache.sizes());
    TORCH_CHECK(group_ >= 0, "group must be an index, got ", group_);
    cache_ = cache.select(1, 0);
  }

  StepNeeds needs() const override {
    StepNeeds n;
    n.kv_group = group_;
    n.kv_slots = cache_.size(0);
    return n;
  }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const int64_t n = h.size(0), latent = s_.latent(), q_out = s_.heads * (s_.dn + s_.dr);
    const torch::Tensor q =
        (q_lora_rank_ > 0 ? q_b_(rms_norm(q_a_(h), c10::nullopt, q_a_norm_, kLatentNormEps, 0.0)) : q_proj_(h))
            .view({n, s_.heads, s_.dn + s_.dr});
    const torch::Tensor ckv = kv_a_(h);
    watch.lap(StepPart::kLinears);
    const torch::Tensor c =
        rms_norm(ckv.slice(1, 0, s_.rank).contiguous(), c10::nullopt, kv_a_norm_, kLatentNormEps, 0.0);
    {
      const int64_t* slot = step.slot_mapping[group_].data_ptr<int64_t>();
      const float* cp = c.data_ptr<float>();
      const float* kp = ckv.data_ptr<float>();
      float* cache = cache_.data_ptr<float>();
      const int64_t stride = cache_.stride(0);
      for (int64_t t = 0; t < n; ++t) {
        float* row = cache + slot[t] * stride;
        std::memcpy(row, cp + t * s_.rank, s_.rank * sizeof(float));
        std::memcpy(row + s_.rank, kp + t * latent + s_.rank, s_.dr * sizeof(float));
      }
    }
    const torch::Tensor attn = mla_decode(s_, q, cache_, kv_b_, step.block_ids[group_], step.kv_offsets[group_],
                                          step.kv_lens[group_], step.block_size, scale_);
    watch.lap(StepPart::kAttention);
    torch::Tensor o = o_(attn);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  MlaShape s_;
  int64_t hidden_, q_lora_rank_;
  double scale_;
  int64_t group_;
  StepLinear q_proj_;         // without a q LoRA
  StepLinear q_a_, q_b_;      // with one (q_lora_rank > 0), and q_a's norm
  torch::Tensor q_a_norm_;
  StepLinear kv_a_;           // kv_a_proj_with_mqa, and kv_a_layernorm
  torch::Tensor kv_a_norm_;
  torch::Tensor kv_b_;        // the plain kv_b_proj weight [heads * (dn + dv), rank]
  StepLinear o_;
  torch::Tensor cache_;       // [slots, rank + dr]
};

}  // namespace

void bind_mla_layer(pybind11::module_& m) { bind_step<MlaStep>(m, "MlaStep"); }
