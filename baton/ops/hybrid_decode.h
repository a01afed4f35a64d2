#pragma once
#include "all_reduce_hook.h"
// A decode step of Qwen3-Next (Gated DeltaNet layers beside gated full attention, MoE with a
// shared expert) in one call, as decode.cpp does for the Llama family: every layer's norms, packed
// linears, causal conv, delta-rule step, rotary, KV write, paged attention and experts run back to
// back in C++, one token per row.
//
// A row's bits are those of the module path (baton/models/qwen3_next.py, recurrent.py, moe.py).
// The linears, norms, gated activation and attention are the very kernels it calls; its torch ops
// are replicated with torch's own rounding (torch_rounding.h), the Gated DeltaNet step in
// gdn_step.cpp and the MoE step in moe_step.cpp.
// tests/test_fused_hybrid_decode.py checks the bits against the module path.
//
// FusedHybridDecoder's layers are registered and every step's metadata checked in
// hybrid_decode.cpp (with its bindings); the step itself runs in hybrid_step.cpp.
#include "gdn_step.h"
#include "ops.h"

#include <array>
#include <chrono>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

enum HybridPart { kNorms, kLinears, kAttention, kRecurrent, kExperts, kNumParts };
inline constexpr const char* kPartNames[kNumParts] = {
    "norms, rotary, activation, routing", "linears", "attention (KV write, kernel)",
    "recurrent (conv, delta rule, gated norm)", "experts (MoE linears)"};

// With totals given, lap(part) adds the time since the last lap (or the start) to totals[part];
// without, it does nothing.
class HybridStopwatch {
 public:
  explicit HybridStopwatch(double* totals) : totals_(totals), start_(totals ? now() : 0.0) {}
  void lap(HybridPart part) {
    if (totals_ == nullptr) return;
    const double t = now();
    totals_[part] += t - start_;
    start_ = t;
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  double* totals_;
  double start_;
};

struct HybridLayer {
  bool recurrent = false;
  torch::Tensor input_norm, post_attn_norm;
  // gated attention
  torch::Tensor q_proj, k_proj, v_proj, o_proj;  // packed panels
  c10::optional<torch::Tensor> q_bias, k_bias, v_bias, o_bias;
  torch::Tensor q_norm, k_norm;
  torch::Tensor k_cache, v_cache;  // [slots, kv heads, head dim]
  int64_t group = 0;
  // Gated DeltaNet
  torch::Tensor qkvz, ba, out_proj;        // packed panels
  torch::Tensor conv_weight;               // [C, K]
  torch::Tensor neg_exp_a, dt_bias;        // [vh]: -exp(A_log), dt_bias
  torch::Tensor norm_weight;               // [dv]
  double norm_eps = 1e-6;
  torch::Tensor conv_state, rec_state;     // [slots, C, K - 1], [slots, vh, dk, dv]
  torch::Tensor conv_ckpt, rec_ckpt;       // [checkpoints, ...] alike
  // MLP: dense, or a sparse MoE with an optional (gated) shared expert
  bool has_mlp = false, moe = false;
  torch::Tensor gate_up, down;
  int64_t intermediate = 0;
  torch::Tensor router;
  int64_t num_experts = 0, top_k = 0;
  bool norm_topk = true;
  std::vector<torch::Tensor> expert_gate_up, expert_down;
  int64_t moe_intermediate = 0;
  torch::Tensor shared_gate_up, shared_down, shared_gate;  // undefined without
  int64_t shared_intermediate = 0;
};

// forward runs without the GIL: mu_ keeps calls from two Python threads apart, as the GIL did.
class FusedHybridDecoder {
 public:
  FusedHybridDecoder(int64_t hidden, double eps, double norm_offset, torch::Tensor final_norm, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, double scale, int64_t key_heads,
                     int64_t value_heads, int64_t key_dim, int64_t value_dim, int64_t conv_kernel);

  void add_attention_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm, torch::Tensor q_proj,
                           c10::optional<torch::Tensor> q_bias, torch::Tensor k_proj,
                           c10::optional<torch::Tensor> k_bias, torch::Tensor v_proj,
                           c10::optional<torch::Tensor> v_bias, torch::Tensor o_proj,
                           c10::optional<torch::Tensor> o_bias, torch::Tensor q_norm, torch::Tensor k_norm,
                           torch::Tensor k_cache, torch::Tensor v_cache, int64_t group);
  void add_recurrent_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm, torch::Tensor qkvz,
                           torch::Tensor ba, torch::Tensor out_proj, torch::Tensor conv_weight,
                           torch::Tensor neg_exp_a, torch::Tensor dt_bias, torch::Tensor norm_weight,
                           double norm_eps, torch::Tensor conv_state, torch::Tensor rec_state,
                           torch::Tensor conv_checkpoints, torch::Tensor rec_checkpoints);
  void set_dense_mlp(torch::Tensor gate_up, torch::Tensor down, int64_t intermediate);
  void set_moe(torch::Tensor router, int64_t top_k, bool norm_topk_prob, std::vector<torch::Tensor> expert_gate_up,
               std::vector<torch::Tensor> expert_down, int64_t moe_intermediate,
               c10::optional<torch::Tensor> shared_gate_up, c10::optional<torch::Tensor> shared_down,
               int64_t shared_intermediate, c10::optional<torch::Tensor> shared_gate);

  torch::Tensor forward(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<torch::Tensor>& slot_mapping, const std::vector<torch::Tensor>& block_ids,
                        const std::vector<torch::Tensor>& kv_offsets, const std::vector<torch::Tensor>& kv_lens,
                        int64_t block_size, const std::vector<int64_t>& state_slots,
                        const std::vector<int64_t>& snapshot_rows, const std::vector<int64_t>& snapshot_offsets,
                        const std::vector<int64_t>& snapshot_ids);

  void set_profiling(bool on);
  std::map<std::string, double> profile() const;
  void set_all_reduce(pybind11::object fn);

 private:
  struct Step {
    const torch::Tensor& cos;
    const torch::Tensor& sin;
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

  // registration and checks (hybrid_decode.cpp)
  HybridLayer& last_layer();
  void check_norms(const torch::Tensor& input_norm, const torch::Tensor& post_attn_norm) const;
  void check_step(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                  const std::vector<torch::Tensor>& slot_mapping, const std::vector<torch::Tensor>& block_ids,
                  const std::vector<torch::Tensor>& kv_offsets, const std::vector<torch::Tensor>& kv_lens,
                  int64_t block_size, const std::vector<int64_t>& state_slots,
                  const std::vector<int64_t>& snapshot_rows, const std::vector<int64_t>& snapshot_offsets,
                  const std::vector<int64_t>& snapshot_ids) const;

  // a layer's parts of the step (hybrid_step.cpp)
  torch::Tensor attention(HybridLayer& l, const torch::Tensor& h, const Step& step, HybridStopwatch& watch);
  torch::Tensor delta_net(HybridLayer& l, const torch::Tensor& h, const Step& step, HybridStopwatch& watch);
  void snapshot(HybridLayer& l, const Step& step, int64_t offset) const;
  torch::Tensor dense_mlp(HybridLayer& l, const torch::Tensor& x, HybridStopwatch& watch);
  torch::Tensor moe(HybridLayer& l, const torch::Tensor& x, HybridStopwatch& watch);

  int64_t hidden_;
  double eps_, offset_;
  torch::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_, rotary_dim_;
  double scale_;
  GdnShape gdn_;  // every Gated DeltaNet layer's
  std::vector<HybridLayer> layers_;
  int64_t num_state_slots_ = std::numeric_limits<int64_t>::max();
  int64_t num_checkpoints_ = std::numeric_limits<int64_t>::max();
  bool profiling_ = false;
  std::array<double, kNumParts> seconds_{};
  std::vector<int64_t> group_slots_;  // per KV group, the fewest slots of its layers' caches
  AllReduceHook all_reduce_;  // tensor parallel: after each mixer and each MLP
  mutable std::mutex mu_;
};
