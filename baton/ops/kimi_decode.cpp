// FusedKimiDecoder (kimi_decode.h): its layers' registration and the checks of their weights, and
// the Python bindings. The step and its metadata checks run in kimi_step.cpp.
#include "kimi_decode.h"

#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // Tensor <-> Python for the bindings below

#include <algorithm>
#include <tuple>

namespace {

void check_bias(const c10::optional<torch::Tensor>& bias, int64_t n, const char* name) {
  if (bias.has_value()) check_vector(*bias, n, name);
}

}  // namespace

FusedKimiDecoder::FusedKimiDecoder(int64_t hidden, double eps, torch::Tensor final_norm, int64_t heads,
                                   int64_t kv_lora_rank, int64_t nope_dim, int64_t rope_dim, int64_t v_dim,
                                   double scale, int64_t q_lora_rank, int64_t kda_heads, int64_t kda_dim,
                                   int64_t conv_kernel)
    : hidden_(hidden), eps_(eps), final_norm_(std::move(final_norm)),
      mla_{heads, kv_lora_rank, nope_dim, rope_dim, v_dim}, scale_(scale), q_lora_rank_(q_lora_rank),
      kda_{kda_heads, kda_dim, conv_kernel} {
  check_vector(final_norm_, hidden_, "final_norm");
  TORCH_CHECK(kda_.kc >= 2, "conv kernel must be at least 2, got ", kda_.kc);
}

void FusedKimiDecoder::add_kda_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm, torch::Tensor in_proj,
                                     torch::Tensor o_proj, torch::Tensor conv_weight, torch::Tensor f_b,
                                     torch::Tensor g_b, torch::Tensor dt_bias, torch::Tensor neg_exp_a,
                                     torch::Tensor o_norm, double norm_eps, torch::Tensor conv_state,
                                     torch::Tensor rec_state, torch::Tensor conv_checkpoints,
                                     torch::Tensor rec_checkpoints) {
  const KdaShape& s = kda_;
  const int64_t channels = s.channels();
  check_vector(input_norm, hidden_, "input_norm");
  check_vector(post_attn_norm, hidden_, "post_attn_norm");
  check_packed(in_proj, hidden_, s.proj_width(), "in_proj");
  check_packed(o_proj, s.hd(), hidden_, "o_proj");
  check_float(conv_weight, "conv_weight");
  check_recurrent_tensors(conv_weight, channels, s.kc, conv_state, rec_state, conv_checkpoints, rec_checkpoints,
                          {s.h, s.d, s.d}, "rec_state", "rec_checkpoints");
  check_packed(f_b, s.d, s.hd(), "f_b_proj");
  check_packed(g_b, s.d, s.hd(), "g_b_proj");
  check_vector(dt_bias, s.hd(), "dt_bias");
  check_vector(neg_exp_a, s.h, "neg_exp_a");
  check_vector(o_norm, s.d, "o_norm");
  std::lock_guard<std::mutex> lock(mu_);
  KimiLayer l;
  l.recurrent = true;
  l.input_norm = std::move(input_norm);
  l.post_attn_norm = std::move(post_attn_norm);
  l.in_proj = std::move(in_proj);
  l.o_proj = std::move(o_proj);
  l.kda = KdaWeights{std::move(conv_weight), std::move(f_b), std::move(g_b), std::move(dt_bias),
                     std::move(neg_exp_a), std::move(o_norm), norm_eps};
  l.conv_state = std::move(conv_state);
  l.rec_state = std::move(rec_state);
  l.conv_ckpt = std::move(conv_checkpoints);
  l.rec_ckpt = std::move(rec_checkpoints);
  num_state_slots_ = std::min(num_state_slots_, l.conv_state.size(0));
  num_checkpoints_ = std::min(num_checkpoints_, l.conv_ckpt.size(0));
  layers_.push_back(std::move(l));
}

void FusedKimiDecoder::add_mla_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm,
                                     c10::optional<torch::Tensor> q_proj, c10::optional<torch::Tensor> q_a,
                                     c10::optional<torch::Tensor> q_a_bias, c10::optional<torch::Tensor> q_a_norm,
                                     c10::optional<torch::Tensor> q_b, torch::Tensor kv_a,
                                     c10::optional<torch::Tensor> kv_a_bias, torch::Tensor kv_a_norm,
                                     torch::Tensor kv_b, torch::Tensor o_proj, c10::optional<torch::Tensor> o_bias,
                                     torch::Tensor k_cache, int64_t group) {
  const MlaShape& s = mla_;
  const int64_t q_out = s.heads * (s.dn + s.dr);
  check_vector(input_norm, hidden_, "input_norm");
  check_vector(post_attn_norm, hidden_, "post_attn_norm");
  if (q_lora_rank_ > 0) {
    TORCH_CHECK(q_a.has_value() && q_a_norm.has_value() && q_b.has_value(), "q_lora_rank needs q_a, its norm, q_b");
    check_packed(*q_a, hidden_, q_lora_rank_, "q_a_proj");
    check_bias(q_a_bias, q_lora_rank_, "q_a_proj bias");
    check_vector(*q_a_norm, q_lora_rank_, "q_a_layernorm");
    check_packed(*q_b, q_lora_rank_, q_out, "q_b_proj");
  } else {
    TORCH_CHECK(q_proj.has_value(), "q_proj is needed without q_lora_rank");
    check_packed(*q_proj, hidden_, q_out, "q_proj");
  }
  check_packed(kv_a, hidden_, s.latent(), "kv_a_proj_with_mqa");
  check_bias(kv_a_bias, s.latent(), "kv_a_proj_with_mqa bias");
  check_vector(kv_a_norm, s.rank, "kv_a_layernorm");
  check_float(kv_b, "kv_b_proj");
  TORCH_CHECK(kv_b.is_contiguous() && kv_b.dim() == 2 && kv_b.size(0) == s.heads * (s.dn + s.dv) &&
                  kv_b.size(1) == s.rank,
              "kv_b_proj must be contiguous [", s.heads * (s.dn + s.dv), ", ", s.rank, "], got ", kv_b.sizes());
  check_packed(o_proj, s.heads * s.dv, hidden_, "o_proj");
  check_bias(o_bias, hidden_, "o_proj bias");
  check_float(k_cache, "k_cache");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == 1 && k_cache.size(2) == s.latent() && k_cache.stride(2) == 1,
              "the latent cache must be [slots, 1, ", s.latent(), "], got ", k_cache.sizes());
  TORCH_CHECK(group >= 0, "group must be an index, got ", group);
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<size_t>(group) >= group_slots_.size())
    group_slots_.resize(group + 1, std::numeric_limits<int64_t>::max());
  group_slots_[group] = std::min(group_slots_[group], k_cache.size(0));
  KimiLayer l;
  l.input_norm = std::move(input_norm);
  l.post_attn_norm = std::move(post_attn_norm);
  l.q_proj = q_proj.value_or(torch::Tensor());
  l.q_a = q_a.value_or(torch::Tensor());
  l.q_a_bias = std::move(q_a_bias);
  l.q_a_norm = q_a_norm.value_or(torch::Tensor());
  l.q_b = q_b.value_or(torch::Tensor());
  l.kv_a = std::move(kv_a);
  l.kv_a_bias = std::move(kv_a_bias);
  l.kv_a_norm = std::move(kv_a_norm);
  l.kv_b = std::move(kv_b);
  l.mla_o = std::move(o_proj);
  l.mla_o_bias = std::move(o_bias);
  l.cache = k_cache.select(1, 0);
  l.group = group;
  layers_.push_back(std::move(l));
}

void FusedKimiDecoder::set_dense_mlp(torch::Tensor gate_up, torch::Tensor down, int64_t intermediate) {
  check_packed(gate_up, hidden_, 2 * intermediate, "gate_up");
  check_packed(down, intermediate, hidden_, "down");
  std::lock_guard<std::mutex> lock(mu_);
  KimiLayer& l = last_layer();
  l.has_mlp = true;
  l.moe = false;
  l.gate_up = std::move(gate_up);
  l.down = std::move(down);
  l.intermediate = intermediate;
}

void FusedKimiDecoder::set_moe(torch::Tensor router_weight, torch::Tensor correction_bias, int64_t top_k,
                               int64_t n_group, int64_t topk_group, bool norm_topk_prob, double routed_scaling_factor,
                               std::vector<torch::Tensor> expert_gate_up, std::vector<torch::Tensor> expert_down,
                               int64_t moe_intermediate, c10::optional<torch::Tensor> shared_gate_up,
                               c10::optional<torch::Tensor> shared_down, int64_t shared_intermediate) {
  SigmoidRouterWeights router{std::move(router_weight), std::move(correction_bias), top_k, n_group, topk_group,
                              norm_topk_prob, routed_scaling_factor};
  check_sigmoid_router(router, hidden_);
  const int64_t experts = router.weight.size(0);
  TORCH_CHECK(static_cast<int64_t>(expert_gate_up.size()) == experts && expert_down.size() == expert_gate_up.size(),
              "one gate_up and one down per expert of the router's ", experts);
  for (int64_t e = 0; e < experts; ++e) {
    if (expert_gate_up[e].numel() == 0 && expert_down[e].numel() == 0) continue;  // held by another rank
    check_packed(expert_gate_up[e], hidden_, 2 * moe_intermediate, "expert gate_up");
    check_packed(expert_down[e], moe_intermediate, hidden_, "expert down");
  }
  TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value(), "the shared expert needs gate_up and down");
  if (shared_gate_up.has_value()) {
    check_packed(*shared_gate_up, hidden_, 2 * shared_intermediate, "shared gate_up");
    check_packed(*shared_down, shared_intermediate, hidden_, "shared down");
  }
  std::lock_guard<std::mutex> lock(mu_);
  KimiLayer& l = last_layer();
  l.has_mlp = true;
  l.moe = true;
  l.router = std::move(router);
  l.expert_gate_up = std::move(expert_gate_up);
  l.expert_down = std::move(expert_down);
  l.moe_intermediate = moe_intermediate;
  l.gate_up = shared_gate_up.value_or(torch::Tensor());
  l.down = shared_down.value_or(torch::Tensor());
  l.intermediate = shared_intermediate;
}

KimiLayer& FusedKimiDecoder::last_layer() {
  TORCH_CHECK(!layers_.empty(), "add a layer before its MLP");
  return layers_.back();
}

void bind_fused_kimi_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<FusedKimiDecoder>(m, "FusedKimiDecoder")
      .def(py::init<int64_t, double, torch::Tensor, int64_t, int64_t, int64_t, int64_t, int64_t, double, int64_t,
                    int64_t, int64_t, int64_t>(),
           py::arg("hidden"), py::arg("eps"), py::arg("final_norm"), py::arg("heads"), py::arg("kv_lora_rank"),
           py::arg("nope_dim"), py::arg("rope_dim"), py::arg("v_dim"), py::arg("scale"), py::arg("q_lora_rank"),
           py::arg("kda_heads"), py::arg("kda_dim"), py::arg("conv_kernel"))
      .def("add_kda_layer", &FusedKimiDecoder::add_kda_layer, py::arg("input_norm"), py::arg("post_attn_norm"),
           py::arg("in_proj"), py::arg("o_proj"), py::arg("conv_weight"), py::arg("f_b"), py::arg("g_b"),
           py::arg("dt_bias"), py::arg("neg_exp_a"), py::arg("o_norm"), py::arg("norm_eps"), py::arg("conv_state"),
           py::arg("rec_state"), py::arg("conv_checkpoints"), py::arg("rec_checkpoints"), release())
      .def("add_mla_layer", &FusedKimiDecoder::add_mla_layer, py::arg("input_norm"), py::arg("post_attn_norm"),
           py::arg("q_proj"), py::arg("q_a"), py::arg("q_a_bias"), py::arg("q_a_norm"), py::arg("q_b"),
           py::arg("kv_a"), py::arg("kv_a_bias"), py::arg("kv_a_norm"), py::arg("kv_b"), py::arg("o_proj"),
           py::arg("o_bias"), py::arg("k_cache"), py::arg("group"), release())
      .def("set_dense_mlp", &FusedKimiDecoder::set_dense_mlp, py::arg("gate_up"), py::arg("down"),
           py::arg("intermediate"), release())
      .def("set_moe", &FusedKimiDecoder::set_moe, py::arg("router_weight"), py::arg("correction_bias"),
           py::arg("top_k"), py::arg("n_group"), py::arg("topk_group"), py::arg("norm_topk_prob"),
           py::arg("routed_scaling_factor"), py::arg("expert_gate_up"), py::arg("expert_down"),
           py::arg("moe_intermediate"), py::arg("shared_gate_up"), py::arg("shared_down"),
           py::arg("shared_intermediate"), release())
      .def("set_all_reduce", &FusedKimiDecoder::set_all_reduce)
      .def("forward", &FusedKimiDecoder::forward, py::arg("x"), py::arg("slot_mapping"), py::arg("block_ids"),
           py::arg("kv_offsets"), py::arg("kv_lens"), py::arg("block_size"), py::arg("state_slots"),
           py::arg("snapshot_rows"), py::arg("snapshot_offsets"), py::arg("snapshot_ids"), release());
}
