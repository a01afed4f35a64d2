// FusedHybridDecoder (hybrid_decode.h): its layers' registration and the checks of their weights,
// the checks of a step's metadata, and the Python bindings. The step runs in hybrid_step.cpp.
#include "hybrid_decode.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // Tensor <-> Python for the bindings below

#include <algorithm>
#include <tuple>

FusedHybridDecoder::FusedHybridDecoder(int64_t hidden, double eps, double norm_offset, torch::Tensor final_norm,
                                       int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim,
                                       double scale, int64_t key_heads, int64_t value_heads, int64_t key_dim,
                                       int64_t value_dim, int64_t conv_kernel)
    : hidden_(hidden), eps_(eps), offset_(norm_offset), final_norm_(std::move(final_norm)), num_heads_(num_heads),
      num_kv_heads_(num_kv_heads), head_dim_(head_dim), rotary_dim_(rotary_dim), scale_(scale),
      gdn_{key_heads, value_heads, key_dim, value_dim, conv_kernel} {
  check_vector(final_norm_, hidden_, "final_norm");
  TORCH_CHECK(rotary_dim_ % 2 == 0 && rotary_dim_ >= 0 && rotary_dim_ <= head_dim_,
              "rotary_dim must be even and at most head_dim, got ", rotary_dim_);
  TORCH_CHECK(gdn_.kh >= 1 && gdn_.vh % gdn_.kh == 0, "value heads (", gdn_.vh, ") must be a multiple of key heads (",
              gdn_.kh, ")");
  TORCH_CHECK(gdn_.kc >= 2, "conv kernel must be at least 2, got ", gdn_.kc);
}

void FusedHybridDecoder::add_attention_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm,
                                             torch::Tensor q_proj, c10::optional<torch::Tensor> q_bias,
                                             torch::Tensor k_proj, c10::optional<torch::Tensor> k_bias,
                                             torch::Tensor v_proj, c10::optional<torch::Tensor> v_bias,
                                             torch::Tensor o_proj, c10::optional<torch::Tensor> o_bias,
                                             torch::Tensor q_norm, torch::Tensor k_norm, torch::Tensor k_cache,
                                             torch::Tensor v_cache, int64_t group) {
  const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
  check_norms(input_norm, post_attn_norm);
  check_packed(q_proj, hidden_, 2 * q_size, "q_proj");
  check_packed(k_proj, hidden_, kv_size, "k_proj");
  check_packed(v_proj, hidden_, kv_size, "v_proj");
  check_packed(o_proj, q_size, hidden_, "o_proj");
  check_vector(q_norm, head_dim_, "q_norm");
  check_vector(k_norm, head_dim_, "k_norm");
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
  HybridLayer l;
  l.input_norm = std::move(input_norm);
  l.post_attn_norm = std::move(post_attn_norm);
  l.q_proj = std::move(q_proj);
  l.k_proj = std::move(k_proj);
  l.v_proj = std::move(v_proj);
  l.o_proj = std::move(o_proj);
  l.q_bias = std::move(q_bias);
  l.k_bias = std::move(k_bias);
  l.v_bias = std::move(v_bias);
  l.o_bias = std::move(o_bias);
  l.q_norm = std::move(q_norm);
  l.k_norm = std::move(k_norm);
  l.k_cache = std::move(k_cache);
  l.v_cache = std::move(v_cache);
  l.group = group;
  layers_.push_back(std::move(l));
}

void FusedHybridDecoder::add_recurrent_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm,
                                             torch::Tensor qkvz, torch::Tensor ba, torch::Tensor out_proj,
                                             torch::Tensor conv_weight, torch::Tensor neg_exp_a,
                                             torch::Tensor dt_bias, torch::Tensor norm_weight, double norm_eps,
                                             torch::Tensor conv_state, torch::Tensor rec_state,
                                             torch::Tensor conv_checkpoints, torch::Tensor rec_checkpoints) {
  const int64_t channels = gdn_.channels();
  check_norms(input_norm, post_attn_norm);
  check_packed(qkvz, hidden_, 2 * gdn_.kh * gdn_.dk + 2 * gdn_.vh * gdn_.dv, "in_proj_qkvz");
  check_packed(ba, hidden_, 2 * gdn_.vh, "in_proj_ba");
  check_packed(out_proj, gdn_.vh * gdn_.dv, hidden_, "out_proj");
  check_float(conv_weight, "conv_weight");
  check_recurrent_tensors(conv_weight, channels, gdn_.kc, conv_state, rec_state, conv_checkpoints, rec_checkpoints,
                          {gdn_.vh, gdn_.dk, gdn_.dv}, "rec_state", "rec_checkpoints");
  check_vector(neg_exp_a, gdn_.vh, "neg_exp_a");
  check_vector(dt_bias, gdn_.vh, "dt_bias");
  check_vector(norm_weight, gdn_.dv, "norm_weight");
  std::lock_guard<std::mutex> lock(mu_);
  HybridLayer l;
  l.recurrent = true;
  l.input_norm = std::move(input_norm);
  l.post_attn_norm = std::move(post_attn_norm);
  l.qkvz = std::move(qkvz);
  l.ba = std::move(ba);
  l.out_proj = std::move(out_proj);
  l.conv_weight = std::move(conv_weight);
  l.neg_exp_a = std::move(neg_exp_a);
  l.dt_bias = std::move(dt_bias);
  l.norm_weight = std::move(norm_weight);
  l.norm_eps = norm_eps;
  l.conv_state = std::move(conv_state);
  l.rec_state = std::move(rec_state);
  l.conv_ckpt = std::move(conv_checkpoints);
  l.rec_ckpt = std::move(rec_checkpoints);
  num_state_slots_ = std::min(num_state_slots_, l.conv_state.size(0));
  num_checkpoints_ = std::min(num_checkpoints_, l.conv_ckpt.size(0));
  layers_.push_back(std::move(l));
}

// The MLP of the layer added last: gate_up [2I, hidden] and down [hidden, I] panels.
void FusedHybridDecoder::set_dense_mlp(torch::Tensor gate_up, torch::Tensor down, int64_t intermediate) {
  check_packed(gate_up, hidden_, 2 * intermediate, "gate_up");
  check_packed(down, intermediate, hidden_, "down");
  std::lock_guard<std::mutex> lock(mu_);
  HybridLayer& l = last_layer();
  l.has_mlp = true;
  l.moe = false;
  l.gate_up = std::move(gate_up);
  l.down = std::move(down);
  l.intermediate = intermediate;
}

// The sparse MoE of the layer added last: a router [E, hidden], every expert's gate_up and down,
// a shared expert (gate_up and down undefined without) and its gate [1, hidden] (or none).
void FusedHybridDecoder::set_moe(torch::Tensor router, int64_t top_k, bool norm_topk_prob,
                                 std::vector<torch::Tensor> expert_gate_up, std::vector<torch::Tensor> expert_down,
                                 int64_t moe_intermediate, c10::optional<torch::Tensor> shared_gate_up,
                                 c10::optional<torch::Tensor> shared_down, int64_t shared_intermediate,
                                 c10::optional<torch::Tensor> shared_gate) {
  const int64_t experts = static_cast<int64_t>(expert_gate_up.size());
  TORCH_CHECK(experts >= 1 && expert_down.size() == expert_gate_up.size(), "one gate_up and one down per expert");
  TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must be in [1, ", experts, "], got ", top_k);
  check_packed(router, hidden_, experts, "router");
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
  TORCH_CHECK(!shared_gate.has_value() || shared_gate_up.has_value(), "a shared-expert gate without a shared expert");
  if (shared_gate.has_value()) check_packed(*shared_gate, hidden_, 1, "shared_expert_gate");
  std::lock_guard<std::mutex> lock(mu_);
  HybridLayer& l = last_layer();
  l.has_mlp = true;
  l.moe = true;
  l.router = std::move(router);
  l.num_experts = experts;
  l.top_k = top_k;
  l.norm_topk = norm_topk_prob;
  l.expert_gate_up = std::move(expert_gate_up);
  l.expert_down = std::move(expert_down);
  l.moe_intermediate = moe_intermediate;
  l.shared_gate_up = shared_gate_up.value_or(torch::Tensor());
  l.shared_down = shared_down.value_or(torch::Tensor());
  l.shared_intermediate = shared_intermediate;
  l.shared_gate = shared_gate.value_or(torch::Tensor());
}

HybridLayer& FusedHybridDecoder::last_layer() {
  TORCH_CHECK(!layers_.empty(), "add a layer before its MLP");
  return layers_.back();
}

void FusedHybridDecoder::check_norms(const torch::Tensor& input_norm, const torch::Tensor& post_attn_norm) const {
  check_vector(input_norm, hidden_, "input_norm");
  check_vector(post_attn_norm, hidden_, "post_attn_norm");
}

// Everything a step reads is checked before its first layer runs: bad metadata is an error
// before any KV or state is written.
void FusedHybridDecoder::check_step(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                    const std::vector<torch::Tensor>& slot_mapping,
                                    const std::vector<torch::Tensor>& block_ids,
                                    const std::vector<torch::Tensor>& kv_offsets,
                                    const std::vector<torch::Tensor>& kv_lens, int64_t block_size,
                                    const std::vector<int64_t>& state_slots, const std::vector<int64_t>& snapshot_rows,
                                    const std::vector<int64_t>& snapshot_offsets,
                                    const std::vector<int64_t>& snapshot_ids) const {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be float32 [rows, hidden=", hidden_, "] on the CPU, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(block_size >= 1, "block_size must be at least 1, got ", block_size);
  for (size_t l = 0; l < layers_.size(); ++l)
    TORCH_CHECK(layers_[l].has_mlp, "layer ", l, " has no MLP");
  const int64_t n = x.size(0);
  for (const torch::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == rotary_dim_ && t->scalar_type() == at::kFloat &&
                    t->stride(1) == 1 && t->device().is_cpu(),
                "cos and sin must be float32 [rows=", n, ", rotary dim=", rotary_dim_, "], got ", t->scalar_type(),
                " ", t->sizes());
  TORCH_CHECK(slot_mapping.size() == block_ids.size(), "one block table per KV group");
  for (size_t i = 0; i < layers_.size(); ++i)
    TORCH_CHECK(layers_[i].recurrent || layers_[i].group < static_cast<int64_t>(slot_mapping.size()), "layer ", i,
                " reads a KV group that was not given");
  check_kv_step(n, slot_mapping, block_ids, kv_offsets, kv_lens, block_size, group_slots_);
  const bool any_recurrent =
      std::any_of(layers_.begin(), layers_.end(), [](const HybridLayer& l) { return l.recurrent; });
  if (any_recurrent)
    check_state_step(n, state_slots, num_state_slots_, snapshot_rows, snapshot_offsets, snapshot_ids,
                     num_checkpoints_);
}

void bind_fused_hybrid_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<FusedHybridDecoder>(m, "FusedHybridDecoder")
      .def(py::init<int64_t, double, double, torch::Tensor, int64_t, int64_t, int64_t, int64_t, double, int64_t,
                    int64_t, int64_t, int64_t, int64_t>(),
           py::arg("hidden"), py::arg("eps"), py::arg("norm_offset"), py::arg("final_norm"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rotary_dim"), py::arg("scale"),
           py::arg("key_heads"), py::arg("value_heads"), py::arg("key_dim"), py::arg("value_dim"),
           py::arg("conv_kernel"))
      .def("add_attention_layer", &FusedHybridDecoder::add_attention_layer, py::arg("input_norm"),
           py::arg("post_attn_norm"), py::arg("q_proj"), py::arg("q_bias"), py::arg("k_proj"), py::arg("k_bias"),
           py::arg("v_proj"), py::arg("v_bias"), py::arg("o_proj"), py::arg("o_bias"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("k_cache"), py::arg("v_cache"), py::arg("group"), release())
      .def("add_recurrent_layer", &FusedHybridDecoder::add_recurrent_layer, py::arg("input_norm"),
           py::arg("post_attn_norm"), py::arg("qkvz"), py::arg("ba"), py::arg("out_proj"), py::arg("conv_weight"),
           py::arg("neg_exp_a"), py::arg("dt_bias"), py::arg("norm_weight"), py::arg("norm_eps"),
           py::arg("conv_state"), py::arg("rec_state"), py::arg("conv_checkpoints"), py::arg("rec_checkpoints"),
           release())
      .def("set_dense_mlp", &FusedHybridDecoder::set_dense_mlp, py::arg("gate_up"), py::arg("down"),
           py::arg("intermediate"), release())
      .def("set_moe", &FusedHybridDecoder::set_moe, py::arg("router"), py::arg("top_k"), py::arg("norm_topk_prob"),
           py::arg("expert_gate_up"), py::arg("expert_down"), py::arg("moe_intermediate"), py::arg("shared_gate_up"),
           py::arg("shared_down"), py::arg("shared_intermediate"), py::arg("shared_gate"), release())
      .def("forward", &FusedHybridDecoder::forward, py::arg("x"), py::arg("cos"), py::arg("sin"),
           py::arg("slot_mapping"), py::arg("block_ids"), py::arg("kv_offsets"), py::arg("kv_lens"),
           py::arg("block_size"), py::arg("state_slots"), py::arg("snapshot_rows"), py::arg("snapshot_offsets"),
           py::arg("snapshot_ids"), release())
      .def("set_all_reduce", &FusedHybridDecoder::set_all_reduce)
      .def("set_profiling", &FusedHybridDecoder::set_profiling, release())
      .def("profile", &FusedHybridDecoder::profile, release());
}
