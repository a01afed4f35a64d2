// FusedKimiDecoder's step (kimi_decode.h): each layer's norms, then its KDA (kda_step.cpp) or
// absorbed MLA (mla_step.cpp), then its dense MLP or grouped-sigmoid MoE (sigmoid_route.cpp,
// moe_step.cpp), in the module path's order.
#include "kimi_decode.h"
#include "moe_step.h"
#include "step_common.h"

#include <algorithm>
#include <cstring>

namespace {

constexpr double kLatentNormEps = 1e-6;  // mla.LATENT_NORM_EPS

}  // namespace

// x: the embedded tokens [rows, hidden], one decode token per row; per KV group the slot each
// row's latent goes to and the blocks, first offset and length each row reads; each row's
// recurrent state slot; the checkpoints to take (snapshot_ids[i] of row snapshot_rows[i]'s slot,
// before (offset 0) or after (offset 1) its token). Everything is checked before the first
// layer runs. Returns the final-normed hidden [rows, hidden].
torch::Tensor FusedKimiDecoder::forward(const torch::Tensor& x_in, const std::vector<torch::Tensor>& slot_mapping,
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
  bool any_recurrent = false;
  for (size_t i = 0; i < layers_.size(); ++i) {
    const KimiLayer& l = layers_[i];
    TORCH_CHECK(l.has_mlp, "layer ", i, " has no MLP");
    TORCH_CHECK(l.recurrent || l.group < static_cast<int64_t>(slot_mapping.size()), "layer ", i,
                " reads a KV group that was not given");
    any_recurrent = any_recurrent || l.recurrent;
  }
  check_kv_step(n, slot_mapping, block_ids, kv_offsets, kv_lens, block_size, group_slots_);
  if (any_recurrent)
    check_state_step(n, state_slots, num_state_slots_, snapshot_rows, snapshot_offsets, snapshot_ids,
                     num_checkpoints_);
  const Step step{slot_mapping, block_ids, kv_offsets, kv_lens, block_size,
                  state_slots,  snapshot_rows, snapshot_offsets, snapshot_ids};
  torch::Tensor residual = x_in.contiguous().clone(), x;
  for (size_t i = 0; i < layers_.size(); ++i) {
    KimiLayer& l = layers_[i];
    const torch::Tensor h = i == 0 ? rms_norm(residual, c10::nullopt, l.input_norm, eps_, 0.0)
                                   : rms_norm(x, residual, l.input_norm, eps_, 0.0);
    const torch::Tensor mixed = l.recurrent ? kda(l, h, step) : mla(l, h, step);
    all_reduce_(mixed);
    x = mlp(l, rms_norm(mixed, residual, l.post_attn_norm, eps_, 0.0));
    all_reduce_(x);
  }
  return layers_.empty() ? rms_norm(residual, c10::nullopt, final_norm_, eps_, 0.0)
                         : rms_norm(x, residual, final_norm_, eps_, 0.0);
}

// KimiDeltaAttention.forward for one token per row; its checkpoints before and after the token.
torch::Tensor FusedKimiDecoder::kda(KimiLayer& l, const torch::Tensor& h, const Step& step) {
  const torch::Tensor proj = packed_linear(h, l.in_proj, c10::nullopt, kda_.proj_width());
  const auto snapshot = [&](int64_t offset) {
    snapshot_states(l.conv_ckpt, l.rec_ckpt, l.conv_state, l.rec_state, step.slots, step.snapshot_rows,
                    step.snapshot_offsets, step.snapshot_ids, offset);
  };
  snapshot(0);
  const torch::Tensor conv = kda_conv_(kda_, l.kda, proj, l.conv_state, step.slots);
  const torch::Tensor out = kda_mix_(kda_, l.kda, proj, conv, l.rec_state, step.slots);
  snapshot(1);
  return packed_linear(out, l.o_proj, c10::nullopt, hidden_);
}

// MLAttention.forward for decode rows: q, the normed latent and kr written to the cache, the
// absorbed attention over each row's cached latents, o_proj.
torch::Tensor FusedKimiDecoder::mla(KimiLayer& l, const torch::Tensor& h, const Step& step) {
  const MlaShape& s = mla_;
  const int64_t n = h.size(0), latent = s.latent();
  const int64_t q_out = s.heads * (s.dn + s.dr);
  const torch::Tensor q =
      (q_lora_rank_ > 0
           ? packed_linear(rms_norm(packed_linear(h, l.q_a, l.q_a_bias, q_lora_rank_), c10::nullopt, l.q_a_norm,
                                   kLatentNormEps, 0.0),
                          l.q_b, c10::nullopt, q_out)
           : packed_linear(h, l.q_proj, c10::nullopt, q_out))
          .view({n, s.heads, s.dn + s.dr});
  const torch::Tensor ckv = packed_linear(h, l.kv_a, l.kv_a_bias, latent);
  const torch::Tensor c =
      rms_norm(ckv.slice(1, 0, s.rank).contiguous(), c10::nullopt, l.kv_a_norm, kLatentNormEps, 0.0);
  {
    const int64_t* slot = step.slot_mapping[l.group].data_ptr<int64_t>();
    const float* cp = c.data_ptr<float>();
    const float* kp = ckv.data_ptr<float>();
    float* cache = l.cache.data_ptr<float>();
    const int64_t stride = l.cache.stride(0);
    for (int64_t t = 0; t < n; ++t) {
      float* row = cache + slot[t] * stride;
      std::memcpy(row, cp + t * s.rank, s.rank * sizeof(float));
      std::memcpy(row + s.rank, kp + t * latent + s.rank, s.dr * sizeof(float));
    }
  }
  const torch::Tensor attn = mla_decode(s, q, l.cache, l.kv_b, step.block_ids[l.group], step.kv_offsets[l.group],
                                        step.kv_lens[l.group], step.block_size, scale_);
  return packed_linear(attn, l.mla_o, l.mla_o_bias, hidden_);
}

// The dense gated-SiLU MLP, or GroupedSigmoidMoE.forward: sigmoid routing, the routed experts
// summed in ascending expert order, + the ungated shared expert.
torch::Tensor FusedKimiDecoder::mlp(KimiLayer& l, const torch::Tensor& x) {
  if (!l.moe)
    return packed_linear(gated_act(packed_linear(x, l.gate_up, c10::nullopt, 2 * l.intermediate), false), l.down,
                        c10::nullopt, hidden_);
  const MoeRouting routing = sigmoid_route(x, l.router);
  torch::Tensor out = moe_experts(x, routing, l.expert_gate_up, l.expert_down, l.moe_intermediate);
  if (l.gate_up.defined()) moe_add_shared_(out, x, l.gate_up, l.down, l.intermediate, torch::Tensor());
  return out;
}
