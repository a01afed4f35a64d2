// FusedNemotronDecoder (nemotron_decode.h): its layers' registration and the checks of their
// weights, and the Python bindings. The step and its metadata checks run in nemotron_step.cpp.
#include "nemotron_decode.h"

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

FusedNemotronDecoder::FusedNemotronDecoder(int64_t hidden, double eps, torch::Tensor final_norm, int64_t num_heads,
                                           int64_t num_kv_heads, int64_t head_dim, double scale, int64_t mamba_heads,
                                           int64_t mamba_head_dim, int64_t mamba_groups, int64_t state_size,
                                           int64_t conv_kernel)
    : hidden_(hidden), eps_(eps), final_norm_(std::move(final_norm)), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale),
      mamba_{mamba_heads, mamba_head_dim, mamba_groups, state_size, conv_kernel} {
  check_vector(final_norm_, hidden_, "final_norm");
  TORCH_CHECK(mamba_.g >= 1 && mamba_.nh % mamba_.g == 0, "Mamba heads (", mamba_.nh,
              ") must be a multiple of its groups (", mamba_.g, ")");
  TORCH_CHECK(mamba_.kc >= 2, "conv kernel must be at least 2, got ", mamba_.kc);
  TORCH_CHECK(num_kv_heads_ >= 1 && num_heads_ % num_kv_heads_ == 0, "heads (", num_heads_,
              ") must be a multiple of KV heads (", num_kv_heads_, ")");
}

NemotronLayer& FusedNemotronDecoder::add_layer(torch::Tensor norm, NemotronLayer::Kind kind) {
  NemotronLayer l;
  l.kind = kind;
  l.norm = std::move(norm);
  layers_.push_back(std::move(l));
  return layers_.back();
}

void FusedNemotronDecoder::add_mamba_layer(torch::Tensor norm, torch::Tensor in_proj,
                                           c10::optional<torch::Tensor> in_bias, torch::Tensor out_proj,
                                           c10::optional<torch::Tensor> out_bias, torch::Tensor conv_weight,
                                           c10::optional<torch::Tensor> conv_bias, torch::Tensor neg_exp_a,
                                           torch::Tensor dt_bias, torch::Tensor d, torch::Tensor norm_weight,
                                           double dt_min, double norm_eps, torch::Tensor conv_state,
                                           torch::Tensor ssm_state, torch::Tensor conv_checkpoints,
                                           torch::Tensor ssm_checkpoints) {
  const MambaShape& s = mamba_;
  const int64_t channels = s.conv_dim();
  check_vector(norm, hidden_, "norm");
  check_packed(in_proj, hidden_, s.proj_width(), "in_proj");
  check_bias(in_bias, s.proj_width(), "in_proj bias");
  check_packed(out_proj, s.inner(), hidden_, "out_proj");
  check_bias(out_bias, hidden_, "out_proj bias");
  check_float(conv_weight, "conv_weight");
  check_recurrent_tensors(conv_weight, channels, s.kc, conv_state, ssm_state, conv_checkpoints, ssm_checkpoints,
                          {s.nh, s.n, s.p}, "ssm_state", "ssm_checkpoints");
  check_bias(conv_bias, channels, "conv_bias");
  check_vector(neg_exp_a, s.nh, "neg_exp_a");
  check_vector(dt_bias, s.nh, "dt_bias");
  check_vector(d, s.nh, "D");
  check_vector(norm_weight, s.inner(), "norm_weight");
  std::lock_guard<std::mutex> lock(mu_);
  NemotronLayer& l = add_layer(std::move(norm), NemotronLayer::kMamba);
  l.in_proj = std::move(in_proj);
  l.in_bias = std::move(in_bias);
  l.out_proj = std::move(out_proj);
  l.out_bias = std::move(out_bias);
  l.mamba = MambaWeights{std::move(conv_weight), conv_bias.value_or(torch::Tensor()), std::move(neg_exp_a),
                         std::move(dt_bias), std::move(d), std::move(norm_weight), dt_min, norm_eps};
  l.conv_state = std::move(conv_state);
  l.ssm_state = std::move(ssm_state);
  l.conv_ckpt = std::move(conv_checkpoints);
  l.ssm_ckpt = std::move(ssm_checkpoints);
  num_state_slots_ = std::min(num_state_slots_, l.conv_state.size(0));
  num_checkpoints_ = std::min(num_checkpoints_, l.conv_ckpt.size(0));
}

void FusedNemotronDecoder::add_attention_layer(torch::Tensor norm, torch::Tensor q_proj, torch::Tensor k_proj,
                                               torch::Tensor v_proj, torch::Tensor o_proj, torch::Tensor k_cache,
                                               torch::Tensor v_cache, int64_t group) {
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  check_vector(norm, hidden_, "norm");
  check_packed(q_proj, hidden_, q_size, "q_proj");
  check_packed(k_proj, hidden_, kv_size, "k_proj");
  check_packed(v_proj, hidden_, kv_size, "v_proj");
  check_packed(o_proj, q_size, hidden_, "o_proj");
  check_float(k_cache, "k_cache");
  check_float(v_cache, "v_cache");
  TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == num_kv_heads_ && k_cache.size(2) == head_dim_ &&
                  k_cache.stride(2) == 1 && k_cache.sizes() == v_cache.sizes() && v_cache.stride(2) == 1,
              "KV cache must be [slots, kv heads, head dim]");
  TORCH_CHECK(group >= 0, "group must be an index, got ", group);
  std::lock_guard<std::mutex> lock(mu_);
  if (static_cast<size_t>(group) >= group_slots_.size())
    group_slots_.resize(group + 1, std::numeric_limits<int64_t>::max());
  group_slots_[group] = std::min(group_slots_[group], k_cache.size(0));
  NemotronLayer& l = add_layer(std::move(norm), NemotronLayer::kAttention);
  l.q_proj = std::move(q_proj);
  l.k_proj = std::move(k_proj);
  l.v_proj = std::move(v_proj);
  l.o_proj = std::move(o_proj);
  l.k_cache = std::move(k_cache);
  l.v_cache = std::move(v_cache);
  l.group = group;
}

void FusedNemotronDecoder::add_mlp_layer(torch::Tensor norm, torch::Tensor up, c10::optional<torch::Tensor> up_bias,
                                         torch::Tensor down, c10::optional<torch::Tensor> down_bias,
                                         int64_t intermediate) {
  check_vector(norm, hidden_, "norm");
  check_packed(up, hidden_, intermediate, "up_proj");
  check_bias(up_bias, intermediate, "up_proj bias");
  check_packed(down, intermediate, hidden_, "down_proj");
  check_bias(down_bias, hidden_, "down_proj bias");
  std::lock_guard<std::mutex> lock(mu_);
  NemotronLayer& l = add_layer(std::move(norm), NemotronLayer::kMlp);
  l.up = std::move(up);
  l.up_bias = std::move(up_bias);
  l.down = std::move(down);
  l.down_bias = std::move(down_bias);
  l.intermediate = intermediate;
}

void FusedNemotronDecoder::add_moe_layer(
    torch::Tensor norm, torch::Tensor router_weight, torch::Tensor correction_bias, int64_t top_k, int64_t n_group,
    int64_t topk_group, bool norm_topk_prob, double routed_scaling_factor, std::vector<torch::Tensor> expert_up,
    std::vector<torch::Tensor> expert_down, int64_t moe_intermediate, c10::optional<torch::Tensor> fc1,
    c10::optional<torch::Tensor> fc1_bias, c10::optional<torch::Tensor> fc2, c10::optional<torch::Tensor> fc2_bias,
    int64_t width, c10::optional<torch::Tensor> shared_up, c10::optional<torch::Tensor> shared_up_bias,
    c10::optional<torch::Tensor> shared_down, c10::optional<torch::Tensor> shared_down_bias,
    int64_t shared_intermediate) {
  check_vector(norm, hidden_, "norm");
  SigmoidRouterWeights router{std::move(router_weight), std::move(correction_bias), top_k, n_group, topk_group,
                              norm_topk_prob, routed_scaling_factor};
  check_sigmoid_router(router, hidden_);
  const int64_t experts = router.weight.size(0);
  TORCH_CHECK(static_cast<int64_t>(expert_up.size()) == experts && expert_down.size() == expert_up.size(),
              "one up and one down per expert of the router's ", experts);
  TORCH_CHECK(fc1.has_value() == fc2.has_value(), "a latent space needs fc1 and fc2");
  TORCH_CHECK(fc1.has_value() || width == hidden_, "experts without a latent space have the hidden width");
  if (fc1.has_value()) {
    check_packed(*fc1, hidden_, width, "fc1_latent_proj");
    check_bias(fc1_bias, width, "fc1_latent_proj bias");
    check_packed(*fc2, width, hidden_, "fc2_latent_proj");
    check_bias(fc2_bias, hidden_, "fc2_latent_proj bias");
  }
  for (int64_t e = 0; e < experts; ++e) {
    if (expert_up[e].numel() == 0 && expert_down[e].numel() == 0) continue;  // held by another rank
    check_packed(expert_up[e], width, moe_intermediate, "expert up_proj");
    check_packed(expert_down[e], moe_intermediate, width, "expert down_proj");
  }
  TORCH_CHECK(shared_up.has_value() == shared_down.has_value(), "the shared expert needs up and down");
  if (shared_up.has_value()) {
    check_packed(*shared_up, hidden_, shared_intermediate, "shared up_proj");
    check_bias(shared_up_bias, shared_intermediate, "shared up_proj bias");
    check_packed(*shared_down, shared_intermediate, hidden_, "shared down_proj");
    check_bias(shared_down_bias, hidden_, "shared down_proj bias");
  }
  std::lock_guard<std::mutex> lock(mu_);
  NemotronLayer& l = add_layer(std::move(norm), NemotronLayer::kMoe);
  l.router = std::move(router);
  l.expert_up = std::move(expert_up);
  l.expert_down = std::move(expert_down);
  l.moe_intermediate = moe_intermediate;
  l.width = width;
  l.fc1 = fc1.value_or(torch::Tensor());
  l.fc1_bias = std::move(fc1_bias);
  l.fc2 = fc2.value_or(torch::Tensor());
  l.fc2_bias = std::move(fc2_bias);
  l.up = shared_up.value_or(torch::Tensor());
  l.up_bias = std::move(shared_up_bias);
  l.down = shared_down.value_or(torch::Tensor());
  l.down_bias = std::move(shared_down_bias);
  l.intermediate = shared_intermediate;
}

void bind_fused_nemotron_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<FusedNemotronDecoder>(m, "FusedNemotronDecoder")
      .def(py::init<int64_t, double, torch::Tensor, int64_t, int64_t, int64_t, double, int64_t, int64_t, int64_t,
                    int64_t, int64_t>(),
           py::arg("hidden"), py::arg("eps"), py::arg("final_norm"), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("scale"), py::arg("mamba_heads"), py::arg("mamba_head_dim"),
           py::arg("mamba_groups"), py::arg("state_size"), py::arg("conv_kernel"))
      .def("add_mamba_layer", &FusedNemotronDecoder::add_mamba_layer, py::arg("norm"), py::arg("in_proj"),
           py::arg("in_bias"), py::arg("out_proj"), py::arg("out_bias"), py::arg("conv_weight"), py::arg("conv_bias"),
           py::arg("neg_exp_a"), py::arg("dt_bias"), py::arg("d"), py::arg("norm_weight"), py::arg("dt_min"),
           py::arg("norm_eps"), py::arg("conv_state"), py::arg("ssm_state"), py::arg("conv_checkpoints"),
           py::arg("ssm_checkpoints"), release())
      .def("add_attention_layer", &FusedNemotronDecoder::add_attention_layer, py::arg("norm"), py::arg("q_proj"),
           py::arg("k_proj"), py::arg("v_proj"), py::arg("o_proj"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("group"), release())
      .def("add_mlp_layer", &FusedNemotronDecoder::add_mlp_layer, py::arg("norm"), py::arg("up"), py::arg("up_bias"),
           py::arg("down"), py::arg("down_bias"), py::arg("intermediate"), release())
      .def("add_moe_layer", &FusedNemotronDecoder::add_moe_layer, py::arg("norm"), py::arg("router_weight"),
           py::arg("correction_bias"), py::arg("top_k"), py::arg("n_group"), py::arg("topk_group"),
           py::arg("norm_topk_prob"), py::arg("routed_scaling_factor"), py::arg("expert_up"), py::arg("expert_down"),
           py::arg("moe_intermediate"), py::arg("fc1"), py::arg("fc1_bias"), py::arg("fc2"), py::arg("fc2_bias"),
           py::arg("width"), py::arg("shared_up"), py::arg("shared_up_bias"), py::arg("shared_down"),
           py::arg("shared_down_bias"), py::arg("shared_intermediate"), release())
      .def("set_all_reduce", &FusedNemotronDecoder::set_all_reduce)
      .def("forward", &FusedNemotronDecoder::forward, py::arg("x"), py::arg("slot_mapping"), py::arg("block_ids"),
           py::arg("kv_offsets"), py::arg("kv_lens"), py::arg("block_size"), py::arg("state_slots"),
           py::arg("snapshot_rows"), py::arg("snapshot_offsets"), py::arg("snapshot_ids"), release());
}
