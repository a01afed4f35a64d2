// FusedNemotronDecoder's step (nemotron_decode.h): each layer's norm, then its mixer (Mamba2 in
// mamba_step.cpp, NoPE attention, a squared-ReLU MLP, or the sigmoid-routed MoE over
// sigmoid_route.cpp and moe_step.cpp), in the module path's order.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "moe_step.h"
#include "nemotron_decode.h"
#include "step_common.h"

#include <algorithm>
#include <cmath>

torch::Tensor relu2_mlp(const torch::Tensor& x, const torch::Tensor& up, const c10::optional<torch::Tensor>& up_bias,
                        const torch::Tensor& down, const c10::optional<torch::Tensor>& down_bias,
                        int64_t intermediate, int64_t out_features) {
  torch::Tensor act = packed_linear(x, up, up_bias, intermediate);
  float* a = act.data_ptr<float>();
  for (int64_t i = 0; i < act.numel(); ++i) {
    const float r = a[i] < 0.f ? 0.f : a[i];  // F.relu (NaN stays NaN), then .square()
    a[i] = r * r;
  }
  return packed_linear(act, down, down_bias, out_features);
}

// x: the embedded tokens [rows, hidden], one decode token per row; per KV group the slot each
// row's K/V goes to and the blocks, first offset and length each row reads (GroupAttnMetadata);
// each row's recurrent state slot; the checkpoints to take: checkpoint snapshot_ids[i] of the
// state of row snapshot_rows[i]'s slot before (offset 0) or after (offset 1) its token. Everything
// is checked before the first layer runs. Returns the final-normed hidden [rows, hidden].
torch::Tensor FusedNemotronDecoder::forward(const torch::Tensor& x_in, const std::vector<torch::Tensor>& slot_mapping,
                                            const std::vector<torch::Tensor>& block_ids,
                                            const std::vector<torch::Tensor>& kv_offsets,
                                            const std::vector<torch::Tensor>& kv_lens, int64_t block_size,
                                            const std::vector<int64_t>& state_slots,
                                            const std::vector<int64_t>& snapshot_rows,
                                            const std::vector<int64_t>& snapshot_offsets,
                                            const std::vector<int64_t>& snapshot_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  TORCH_CHECK(x_in.dim() == 2 && x_in.size(1) == hidden_ && x_in.scalar_type() == at::kFloat && x_in.device().is_cpu(),
              "x must be float32 [rows, hidden=", hidden_, "] on the CPU, got ", x_in.scalar_type(), " ",
              x_in.sizes());
  const int64_t n = x_in.size(0);
  TORCH_CHECK(slot_mapping.size() == block_ids.size(), "one block table per KV group");
  bool any_mamba = false;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const NemotronLayer& l = layers_[i];
    TORCH_CHECK(l.kind != NemotronLayer::kAttention || l.group < static_cast<int64_t>(slot_mapping.size()), "layer ",
                i, " reads a KV group that was not given");
    any_mamba = any_mamba || l.kind == NemotronLayer::kMamba;
  }
  check_kv_step(n, slot_mapping, block_ids, kv_offsets, kv_lens, block_size, group_slots_);
  if (any_mamba)
    check_state_step(n, state_slots, num_state_slots_, snapshot_rows, snapshot_offsets, snapshot_ids,
                     num_checkpoints_);
  const Step step{slot_mapping, block_ids, kv_offsets, kv_lens, block_size,
                  state_slots,  snapshot_rows, snapshot_offsets, snapshot_ids};
  torch::Tensor residual = x_in.contiguous().clone(), x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    NemotronLayer& l = layers_[i];
    const torch::Tensor h = i == 0 ? rms_norm(residual, c10::nullopt, l.norm, eps_, 0.0)
                                   : rms_norm(x, residual, l.norm, eps_, 0.0);
    switch (l.kind) {
      case NemotronLayer::kMamba:
        x = mamba(l, h, step);
        break;
      case NemotronLayer::kAttention:
        x = attention(l, h, step);
        break;
      case NemotronLayer::kMlp:
        x = relu2_mlp(h, l.up, l.up_bias, l.down, l.down_bias, l.intermediate, hidden_);
        break;
      case NemotronLayer::kMoe:
        x = moe(l, h);
        break;
    }
    all_reduce_(x);  // every mixer ends in a row-parallel projection
  }
  return layers_.empty() ? rms_norm(residual, c10::nullopt, final_norm_, eps_, 0.0)
                         : rms_norm(x, residual, final_norm_, eps_, 0.0);
}

// Mamba2Mixer.forward for one token per row; its checkpoints before and after the token.
torch::Tensor FusedNemotronDecoder::mamba(NemotronLayer& l, const torch::Tensor& h, const Step& step) {
  const torch::Tensor zxbcdt = packed_linear(h, l.in_proj, l.in_bias, mamba_.proj_width());
  const auto snapshot = [&](int64_t offset) {
    snapshot_states(l.conv_ckpt, l.ssm_ckpt, l.conv_state, l.ssm_state, step.slots, step.snapshot_rows,
                    step.snapshot_offsets, step.snapshot_ids, offset);
  };
  snapshot(0);
  const torch::Tensor conv = mamba_conv_(mamba_, l.mamba, zxbcdt, l.conv_state, step.slots);
  const torch::Tensor y = mamba_ssm_(mamba_, l.mamba, zxbcdt, conv, l.ssm_state, step.slots);
  snapshot(1);
  return packed_linear(y, l.out_proj, l.out_bias, hidden_);
}

// NoPEAttention.forward: q, k, v, the KV write, paged decode attention, o_proj.
torch::Tensor FusedNemotronDecoder::attention(NemotronLayer& l, const torch::Tensor& h, const Step& step) {
  const int64_t n = h.size(0), d = head_dim_, q_size = num_heads_ * d, kv_size = num_kv_heads_ * d;
  const torch::Tensor q = packed_linear(h, l.q_proj, c10::nullopt, q_size).view({n, num_heads_, d});
  const torch::Tensor k = packed_linear(h, l.k_proj, c10::nullopt, kv_size).view({n, num_kv_heads_, d});
  const torch::Tensor v = packed_linear(h, l.v_proj, c10::nullopt, kv_size).view({n, num_kv_heads_, d});
  write_kv(k, l.k_cache, step.slot_mapping[l.group]);
  write_kv(v, l.v_cache, step.slot_mapping[l.group]);
  const torch::Tensor attn = paged_decode_attention_checked_context(
      q, l.k_cache, l.v_cache, step.block_ids[l.group], step.kv_offsets[l.group], step.kv_lens[l.group],
      step.block_size, scale_);
  return packed_linear(attn.view({n, q_size}), l.o_proj, c10::nullopt, hidden_);
}

// NemotronHMoE.forward: sigmoid routing, the routed relu2 experts (in the latent space where
// there is one) summed in ascending expert order, + the shared expert.
torch::Tensor FusedNemotronDecoder::moe(NemotronLayer& l, const torch::Tensor& h) {
  const MoeRouting routing = sigmoid_route(h, l.router);
  const torch::Tensor xe = l.fc1.defined() ? packed_linear(h, l.fc1, l.fc1_bias, l.width) : h;
  torch::Tensor out = moe_experts_by(xe, routing, static_cast<int64_t>(l.expert_up.size()),
                                     [&](int64_t e, const torch::Tensor& rows) {
                                       if (l.expert_up[e].numel() == 0) return torch::Tensor();  // elsewhere
                                       return relu2_mlp(rows, l.expert_up[e], c10::nullopt, l.expert_down[e],
                                                        c10::nullopt, l.moe_intermediate, l.width);
                                     });
  if (l.fc2.defined()) out = packed_linear(out, l.fc2, l.fc2_bias, hidden_);
  if (l.up.defined()) out.add_(relu2_mlp(h, l.up, l.up_bias, l.down, l.down_bias, l.intermediate, hidden_));
  return out;
}
