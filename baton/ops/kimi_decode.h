#pragma once
#include "all_reduce_hook.h"
// A decode step of Kimi Linear (Kimi Delta Attention layers beside NoPE multi-head latent
// attention, dense or grouped-sigmoid MoE MLPs) in one call, as hybrid_decode.h does for
// Qwen3-Next: every layer's norms, packed linears, short convs, delta rule, latent cache write,
// absorbed attention and experts run back to back in C++, one token per row.
//
// A row's bits are those of the module path (baton/models/kimi_linear.py, mla.py, moe.py): the
// linears, norms, activation and scan are the very kernels it calls, the KDA conv replicates its
// conv1d with torch's rounding (kda_step.cpp), the rest of KDA, the absorbed attention
// (mla_step.cpp) and the router (sigmoid_route.cpp) run its ATen ops. tests/test_fused_kimi_decode.py checks the bits.
//
// Layers are registered and checked in kimi_decode.cpp (with the bindings); the step, with its
// metadata checks, runs in kimi_step.cpp.
#include "kda_step.h"
#include "mla_step.h"
#include "ops.h"
#include "sigmoid_route.h"

#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

struct KimiLayer {
  bool recurrent = false;
  torch::Tensor input_norm, post_attn_norm;
  // KDA
  torch::Tensor in_proj, o_proj;  // packed panels
  KdaWeights kda;
  torch::Tensor conv_state, rec_state, conv_ckpt, rec_ckpt;
  // MLA: q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj; kv_a_proj_with_mqa -> kv_a_layernorm
  torch::Tensor q_proj, q_a, q_a_norm, q_b, kv_a, kv_a_norm, kv_b, mla_o;  // panels; kv_b plain
  c10::optional<torch::Tensor> q_a_bias, kv_a_bias, mla_o_bias;
  torch::Tensor cache;  // [slots, rank + dr]
  int64_t group = 0;
  // MLP: dense gated SiLU, or a routed MoE of gated SiLU experts and an ungated shared expert
  bool has_mlp = false, moe = false;
  torch::Tensor gate_up, down;
  int64_t intermediate = 0;
  SigmoidRouterWeights router;
  std::vector<torch::Tensor> expert_gate_up, expert_down;
  int64_t moe_intermediate = 0;
};

// forward runs without the GIL: mu_ keeps calls from two Python threads apart, as the GIL did.
class FusedKimiDecoder {
 public:
  FusedKimiDecoder(int64_t hidden, double eps, torch::Tensor final_norm, int64_t heads, int64_t kv_lora_rank,
                   int64_t nope_dim, int64_t rope_dim, int64_t v_dim, double scale, int64_t q_lora_rank,
                   int64_t kda_heads, int64_t kda_dim, int64_t conv_kernel);

  void add_kda_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm, torch::Tensor in_proj,
                     torch::Tensor o_proj, torch::Tensor conv_weight, torch::Tensor f_b, torch::Tensor g_b,
                     torch::Tensor dt_bias, torch::Tensor neg_exp_a, torch::Tensor o_norm, double norm_eps,
                     torch::Tensor conv_state, torch::Tensor rec_state, torch::Tensor conv_checkpoints,
                     torch::Tensor rec_checkpoints);
  void add_mla_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm, c10::optional<torch::Tensor> q_proj,
                     c10::optional<torch::Tensor> q_a, c10::optional<torch::Tensor> q_a_bias,
                     c10::optional<torch::Tensor> q_a_norm, c10::optional<torch::Tensor> q_b, torch::Tensor kv_a,
                     c10::optional<torch::Tensor> kv_a_bias, torch::Tensor kv_a_norm, torch::Tensor kv_b,
                     torch::Tensor o_proj, c10::optional<torch::Tensor> o_bias, torch::Tensor k_cache, int64_t group);
  void set_dense_mlp(torch::Tensor gate_up, torch::Tensor down, int64_t intermediate);
  void set_moe(torch::Tensor router_weight, torch::Tensor correction_bias, int64_t top_k, int64_t n_group,
               int64_t topk_group, bool norm_topk_prob, double routed_scaling_factor,
               std::vector<torch::Tensor> expert_gate_up, std::vector<torch::Tensor> expert_down,
               int64_t moe_intermediate, c10::optional<torch::Tensor> shared_gate_up,
               c10::optional<torch::Tensor> shared_down, int64_t shared_intermediate);

  torch::Tensor forward(const torch::Tensor& x_in, const std::vector<torch::Tensor>& slot_mapping,
                        const std::vector<torch::Tensor>& block_ids, const std::vector<torch::Tensor>& kv_offsets,
                        const std::vector<torch::Tensor>& kv_lens, int64_t block_size,
                        const std::vector<int64_t>& state_slots, const std::vector<int64_t>& snapshot_rows,
                        const std::vector<int64_t>& snapshot_offsets, const std::vector<int64_t>& snapshot_ids);

  // Tensor parallel: sums each row-parallel output over the ranks (all_reduce_hook.h).
  void set_all_reduce(pybind11::object fn) {
    std::lock_guard<std::mutex> lock(mu_);
    all_reduce_.set(std::move(fn));
  }

 private:
  struct Step {
    const std::vector<torch::Tensor>& slot_mapping;
    const std::vector<torch::Tensor>& block_ids;
    const std::vector<torch::Tensor>& kv_offsets;
    const std::vector<torch::Tensor>& kv_lens;
    int64_t block_size;
    const std::vector<int64_t>& slots;
    const std::vector<int64_t>& snapshot_rows;
    const std::vector<int64_t>& snapshot_offsets;
    const std::vector<int64_t>& snapshot_ids;
  };

  KimiLayer& last_layer();  // kimi_decode.cpp

  // a layer's parts (kimi_step.cpp)
  torch::Tensor kda(KimiLayer& l, const torch::Tensor& h, const Step& step);
  torch::Tensor mla(KimiLayer& l, const torch::Tensor& h, const Step& step);
  torch::Tensor mlp(KimiLayer& l, const torch::Tensor& x);

  int64_t hidden_;
  double eps_;
  torch::Tensor final_norm_;
  MlaShape mla_;
  double scale_;
  int64_t q_lora_rank_;
  KdaShape kda_;
  std::vector<KimiLayer> layers_;
  int64_t num_state_slots_ = std::numeric_limits<int64_t>::max();
  int64_t num_checkpoints_ = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> group_slots_;  // per KV group, the fewest slots of its layers' caches
  AllReduceHook all_reduce_;
  mutable std::mutex mu_;
};
