// NoPE multi-head latent attention as a layer step of the fused decoder (fused_decoder.h), for
// decode rows (MLAttention.forward, baton/models/mla.py): q (q_proj, or q_a -> its norm -> q_b),
// the normed latent and kr written to the latent cache, the absorbed attention over each row's
// cached latents (as MLAttention._decode's very ATen ops, so the bits are the same), o_proj.
#include "fused_decoder.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

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

void check_bias(const c10::optional<torch::Tensor>& bias, int64_t n, const char* name) {
  if (bias.has_value()) check_vector(*bias, n, name);
}

class MlaStep : public LayerStep {
 public:
  struct Weights {
    torch::Tensor q_proj;                         // without a q LoRA
    torch::Tensor q_a, q_a_norm, q_b;             // with one (q_lora_rank > 0)
    c10::optional<torch::Tensor> q_a_bias;
    torch::Tensor kv_a, kv_a_norm;                // kv_a_proj_with_mqa, kv_a_layernorm
    c10::optional<torch::Tensor> kv_a_bias;
    torch::Tensor kv_b;                           // the plain kv_b_proj weight [heads * (dn + dv), rank]
    torch::Tensor o;
    c10::optional<torch::Tensor> o_bias;
  };

  MlaStep(MlaShape shape, int64_t hidden, int64_t q_lora_rank, double scale, Weights w, torch::Tensor cache,
          int64_t group)
      : s_(shape), hidden_(hidden), q_lora_rank_(q_lora_rank), scale_(scale), w_(std::move(w)), group_(group) {
    const int64_t q_out = s_.heads * (s_.dn + s_.dr);
    if (q_lora_rank_ > 0) {
      TORCH_CHECK(w_.q_a.defined() && w_.q_a_norm.defined() && w_.q_b.defined(), "q_lora_rank needs q_a, its norm, q_b");
      check_packed(w_.q_a, hidden_, q_lora_rank_, "q_a_proj");
      check_bias(w_.q_a_bias, q_lora_rank_, "q_a_proj bias");
      check_vector(w_.q_a_norm, q_lora_rank_, "q_a_layernorm");
      check_packed(w_.q_b, q_lora_rank_, q_out, "q_b_proj");
    } else {
      TORCH_CHECK(w_.q_proj.defined(), "q_proj is needed without q_lora_rank");
      check_packed(w_.q_proj, hidden_, q_out, "q_proj");
    }
    check_packed(w_.kv_a, hidden_, s_.latent(), "kv_a_proj_with_mqa");
    check_bias(w_.kv_a_bias, s_.latent(), "kv_a_proj_with_mqa bias");
    check_vector(w_.kv_a_norm, s_.rank, "kv_a_layernorm");
    check_float(w_.kv_b, "kv_b_proj");
    TORCH_CHECK(w_.kv_b.is_contiguous() && w_.kv_b.dim() == 2 && w_.kv_b.size(0) == s_.heads * (s_.dn + s_.dv) &&
                    w_.kv_b.size(1) == s_.rank,
                "kv_b_proj must be contiguous [", s_.heads * (s_.dn + s_.dv), ", ", s_.rank, "], got ", w_.kv_b.sizes());
    check_packed(w_.o, s_.heads * s_.dv, hidden_, "o_proj");
    check_bias(w_.o_bias, hidden_, "o_proj bias");
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
        (q_lora_rank_ > 0
             ? packed_linear(rms_norm(packed_linear(h, w_.q_a, w_.q_a_bias, q_lora_rank_), c10::nullopt, w_.q_a_norm,
                                      kLatentNormEps, 0.0),
                             w_.q_b, c10::nullopt, q_out)
             : packed_linear(h, w_.q_proj, c10::nullopt, q_out))
            .view({n, s_.heads, s_.dn + s_.dr});
    const torch::Tensor ckv = packed_linear(h, w_.kv_a, w_.kv_a_bias, latent);
    watch.lap(StepPart::kLinears);
    const torch::Tensor c =
        rms_norm(ckv.slice(1, 0, s_.rank).contiguous(), c10::nullopt, w_.kv_a_norm, kLatentNormEps, 0.0);
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
    const torch::Tensor attn = mla_decode(s_, q, cache_, w_.kv_b, step.block_ids[group_], step.kv_offsets[group_],
                                          step.kv_lens[group_], step.block_size, scale_);
    watch.lap(StepPart::kAttention);
    torch::Tensor o = packed_linear(attn, w_.o, w_.o_bias, hidden_);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  MlaShape s_;
  int64_t hidden_, q_lora_rank_;
  double scale_;
  Weights w_;
  torch::Tensor cache_;  // [slots, rank + dr]
  int64_t group_;
};

}  // namespace

void bind_mla_layer(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<MlaStep, LayerStep, std::shared_ptr<MlaStep>>(m, "MlaStep")
      .def(py::init([](int64_t heads, int64_t kv_lora_rank, int64_t nope_dim, int64_t rope_dim, int64_t v_dim,
                       int64_t hidden, int64_t q_lora_rank, double scale, c10::optional<torch::Tensor> q_proj,
                       c10::optional<torch::Tensor> q_a, c10::optional<torch::Tensor> q_a_bias,
                       c10::optional<torch::Tensor> q_a_norm, c10::optional<torch::Tensor> q_b, torch::Tensor kv_a,
                       c10::optional<torch::Tensor> kv_a_bias, torch::Tensor kv_a_norm, torch::Tensor kv_b,
                       torch::Tensor o_proj, c10::optional<torch::Tensor> o_bias, torch::Tensor k_cache,
                       int64_t group) {
             MlaStep::Weights w{q_proj.value_or(torch::Tensor()), q_a.value_or(torch::Tensor()),
                                q_a_norm.value_or(torch::Tensor()), q_b.value_or(torch::Tensor()),
                                std::move(q_a_bias), std::move(kv_a), std::move(kv_a_norm), std::move(kv_a_bias),
                                std::move(kv_b), std::move(o_proj), std::move(o_bias)};
             return std::make_shared<MlaStep>(MlaShape{heads, kv_lora_rank, nope_dim, rope_dim, v_dim}, hidden,
                                              q_lora_rank, scale, std::move(w), std::move(k_cache), group);
           }),
           py::arg("heads"), py::arg("kv_lora_rank"), py::arg("nope_dim"), py::arg("rope_dim"), py::arg("v_dim"),
           py::arg("hidden"), py::arg("q_lora_rank"), py::arg("scale"), py::arg("q_proj"), py::arg("q_a"),
           py::arg("q_a_bias"), py::arg("q_a_norm"), py::arg("q_b"), py::arg("kv_a"), py::arg("kv_a_bias"),
           py::arg("kv_a_norm"), py::arg("kv_b"), py::arg("o_proj"), py::arg("o_bias"), py::arg("k_cache"),
           py::arg("group"));
}
