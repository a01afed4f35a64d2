#pragma once
#include "all_reduce_hook.h"
// A decode step of NemotronH (Mamba2 layers, NoPE GQA attention, squared-ReLU MLPs and
// sigmoid-routed MoE with a shared expert, one mixer per layer) in one call, as hybrid_decode.h
// does for Qwen3-Next: every layer's norm, packed linears, causal conv, SSM step, KV write, paged
// attention and experts run back to back in C++, one token per row.
//
// A row's bits are those of the module path (baton/models/nemotron_h.py, recurrent.py, moe.py):
// the linears, norms and attention are the very kernels it calls, the Mamba2 step replicates its
// torch ops with torch's rounding (mamba_step.cpp), the router runs its ATen ops
// (sigmoid_route.cpp). tests/test_fused_nemotron_decode.py checks the bits.
//
// Layers are registered and every step's metadata checked in nemotron_decode.cpp (with the
// bindings); the step runs in nemotron_step.cpp.
#include "mamba_step.h"
#include "ops.h"
#include "sigmoid_route.h"

#include <cstdint>
#include <limits>
#include <mutex>
#include <vector>

struct NemotronLayer {
  enum Kind { kMamba, kAttention, kMlp, kMoe } kind = kMlp;
  torch::Tensor norm;  // [hidden]
  // Mamba2
  torch::Tensor in_proj, out_proj;  // packed panels
  c10::optional<torch::Tensor> in_bias, out_bias;
  MambaWeights mamba;
  torch::Tensor conv_state, ssm_state, conv_ckpt, ssm_ckpt;
  // attention
  torch::Tensor q_proj, k_proj, v_proj, o_proj;  // packed panels
  torch::Tensor k_cache, v_cache;                // [slots, kv heads, head dim]
  int64_t group = 0;
  // squared-ReLU MLP (also the MoE's shared expert)
  torch::Tensor up, down;
  c10::optional<torch::Tensor> up_bias, down_bias;
  int64_t intermediate = 0;
  // MoE: router, relu2 experts of width `width` (a latent space between fc1 and fc2, or hidden)
  SigmoidRouterWeights router;
  std::vector<torch::Tensor> expert_up, expert_down;
  int64_t moe_intermediate = 0, width = 0;
  torch::Tensor fc1, fc2;  // packed panels, undefined without a latent space
  c10::optional<torch::Tensor> fc1_bias, fc2_bias;
};

// forward runs without the GIL: mu_ keeps calls from two Python threads apart, as the GIL did.
class FusedNemotronDecoder {
 public:
  FusedNemotronDecoder(int64_t hidden, double eps, torch::Tensor final_norm, int64_t num_heads, int64_t num_kv_heads,
                       int64_t head_dim, double scale, int64_t mamba_heads, int64_t mamba_head_dim,
                       int64_t mamba_groups, int64_t state_size, int64_t conv_kernel);

  void add_mamba_layer(torch::Tensor norm, torch::Tensor in_proj, c10::optional<torch::Tensor> in_bias,
                       torch::Tensor out_proj, c10::optional<torch::Tensor> out_bias, torch::Tensor conv_weight,
                       c10::optional<torch::Tensor> conv_bias, torch::Tensor neg_exp_a, torch::Tensor dt_bias,
                       torch::Tensor d, torch::Tensor norm_weight, double dt_min, double norm_eps,
                       torch::Tensor conv_state, torch::Tensor ssm_state, torch::Tensor conv_checkpoints,
                       torch::Tensor ssm_checkpoints);
  void add_attention_layer(torch::Tensor norm, torch::Tensor q_proj, torch::Tensor k_proj, torch::Tensor v_proj,
                           torch::Tensor o_proj, torch::Tensor k_cache, torch::Tensor v_cache, int64_t group);
  void add_mlp_layer(torch::Tensor norm, torch::Tensor up, c10::optional<torch::Tensor> up_bias, torch::Tensor down,
                     c10::optional<torch::Tensor> down_bias, int64_t intermediate);
  void add_moe_layer(torch::Tensor norm, torch::Tensor router_weight, torch::Tensor correction_bias, int64_t top_k,
                     int64_t n_group, int64_t topk_group, bool norm_topk_prob, double routed_scaling_factor,
                     std::vector<torch::Tensor> expert_up, std::vector<torch::Tensor> expert_down,
                     int64_t moe_intermediate, c10::optional<torch::Tensor> fc1, c10::optional<torch::Tensor> fc1_bias,
                     c10::optional<torch::Tensor> fc2, c10::optional<torch::Tensor> fc2_bias, int64_t width,
                     c10::optional<torch::Tensor> shared_up, c10::optional<torch::Tensor> shared_up_bias,
                     c10::optional<torch::Tensor> shared_down, c10::optional<torch::Tensor> shared_down_bias,
                     int64_t shared_intermediate);

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

  NemotronLayer& add_layer(torch::Tensor norm, NemotronLayer::Kind kind);  // nemotron_decode.cpp

  // a layer's mixer (nemotron_step.cpp)
  torch::Tensor mamba(NemotronLayer& l, const torch::Tensor& h, const Step& step);
  torch::Tensor attention(NemotronLayer& l, const torch::Tensor& h, const Step& step);
  torch::Tensor moe(NemotronLayer& l, const torch::Tensor& h);

  int64_t hidden_;
  double eps_;
  torch::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  MambaShape mamba_;  // every Mamba2 layer's
  std::vector<NemotronLayer> layers_;
  int64_t num_state_slots_ = std::numeric_limits<int64_t>::max();
  int64_t num_checkpoints_ = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> group_slots_;  // per KV group, the fewest slots of its layers' caches
  AllReduceHook all_reduce_;
  mutable std::mutex mu_;
};

// the squared-ReLU MLP down(relu(up(x))^2) over packed panels (nemotron_step.cpp)
torch::Tensor relu2_mlp(const torch::Tensor& x, const torch::Tensor& up, const c10::optional<torch::Tensor>& up_bias,
                        const torch::Tensor& down, const c10::optional<torch::Tensor>& down_bias,
                        int64_t intermediate, int64_t out_features);
