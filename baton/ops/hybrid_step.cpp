// FusedHybridDecoder's step (hybrid_decode.h): each layer's norms, then its gated attention or
// Gated DeltaNet (gdn_step.cpp), then its dense or MoE MLP (moe_step.cpp), in the module path's
// order, with the time of each part when profiling.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "hybrid_decode.h"
#include "moe_step.h"
#include "step_common.h"

#include <cstring>

namespace {

// Partial rotary in place over x [rows, heads, D] (any strides but the last): the first rot dims
// of every head become x * cos + rotate_half(x) * sin with the sign folded into sin; the products
// are rounded before the add, as the module path's separate torch ops do.
void partial_rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t rows = x.size(0), heads = x.size(1), rot = cos.size(1), half = rot / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), c0 = cos.stride(0), n0 = sin.stride(0);
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cp + t * c0;
    const float* s = sp + t * n0;
    for (int64_t h = 0; h < heads; ++h) {
      float* a = xp + t * s0 + h * s1;
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = a[j], x2 = a[half + j];
        float p1 = x1 * c[j], p2 = x2 * s[j], p3 = x2 * c[half + j], p4 = x1 * s[half + j];
        BATON_ROUNDED(p1);
        BATON_ROUNDED(p2);
        BATON_ROUNDED(p3);
        BATON_ROUNDED(p4);
        a[j] = p1 + p2;
        a[half + j] = p3 + p4;
      }
    }
  }
}

}  // namespace

// x: the embedded tokens [rows, hidden], one decode token per row; cos and signed sin [rows,
// rotary dim]; per KV group the slot each row's K/V goes to and the blocks, first offset and
// length each row reads (GroupAttnMetadata); each row's recurrent state slot; the checkpoints
// to take: checkpoint snapshot_ids[i] of the state of row snapshot_rows[i]'s slot before (offset
// 0) or after (offset 1) its token. Returns the final-normed hidden [rows, hidden].
torch::Tensor FusedHybridDecoder::forward(const torch::Tensor& x_in, const torch::Tensor& cos,
                                          const torch::Tensor& sin, const std::vector<torch::Tensor>& slot_mapping,
                                          const std::vector<torch::Tensor>& block_ids,
                                          const std::vector<torch::Tensor>& kv_offsets,
                                          const std::vector<torch::Tensor>& kv_lens, int64_t block_size,
                                          const std::vector<int64_t>& state_slots,
                                          const std::vector<int64_t>& snapshot_rows,
                                          const std::vector<int64_t>& snapshot_offsets,
                                          const std::vector<int64_t>& snapshot_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  check_step(x_in, cos, sin, slot_mapping, block_ids, kv_offsets, kv_lens, block_size, state_slots, snapshot_rows,
             snapshot_offsets, snapshot_ids);
  Step step{cos, sin, slot_mapping, block_ids, kv_offsets, kv_lens, block_size, state_slots, snapshot_rows,
            snapshot_offsets, snapshot_ids};
  torch::Tensor residual = x_in.contiguous().clone(), x;
  HybridStopwatch watch(profiling_ ? seconds_.data() : nullptr);
  for (size_t i = 0; i < layers_.size(); ++i) {
    HybridLayer& l = layers_[i];
    const torch::Tensor h = i == 0 ? rms_norm(residual, c10::nullopt, l.input_norm, eps_, offset_)
                                   : rms_norm(x, residual, l.input_norm, eps_, offset_);
    watch.lap(kNorms);
    const torch::Tensor mixed = l.recurrent ? delta_net(l, h, step, watch) : attention(l, h, step, watch);
    all_reduce_(mixed);
    const torch::Tensor mlp_in = rms_norm(mixed, residual, l.post_attn_norm, eps_, offset_);
    watch.lap(kNorms);
    x = l.moe ? moe(l, mlp_in, watch) : dense_mlp(l, mlp_in, watch);
    all_reduce_(x);
  }
  torch::Tensor out = layers_.empty() ? rms_norm(residual, c10::nullopt, final_norm_, eps_, offset_)
                                      : rms_norm(x, residual, final_norm_, eps_, offset_);
  watch.lap(kNorms);
  return out;
}

void FusedHybridDecoder::set_all_reduce(pybind11::object fn) {
  std::lock_guard<std::mutex> lock(mu_);
  all_reduce_.set(std::move(fn));
}

void FusedHybridDecoder::set_profiling(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  profiling_ = on;
  seconds_.fill(0.0);
}

std::map<std::string, double> FusedHybridDecoder::profile() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, double> named;
  for (int part = 0; part < kNumParts; ++part) named[kPartNames[part]] = seconds_[part];
  return named;
}

// Gated attention: q_proj gives every head its query and output gate; q/k norm; partial rotary;
// paged decode attention; out * sigmoid(gate); o_proj.
torch::Tensor FusedHybridDecoder::attention(HybridLayer& l, const torch::Tensor& h, const Step& step,
                                            HybridStopwatch& watch) {
  const int64_t n = h.size(0), d = head_dim_, q_size = num_heads_ * d, kv_size = num_kv_heads_ * d;
  const torch::Tensor qg = packed_linear(h, l.q_proj, l.q_bias, 2 * q_size);
  const torch::Tensor k_flat = packed_linear(h, l.k_proj, l.k_bias, kv_size);
  const torch::Tensor v_flat = packed_linear(h, l.v_proj, l.v_bias, kv_size);
  watch.lap(kLinears);
  // the query halves as a contiguous [n, heads, d] and the gate halves as [n, heads * d]
  torch::Tensor q = torch::empty({n, num_heads_, d}, h.options()), gate = torch::empty({n, q_size}, h.options());
  {
    const float* src = qg.data_ptr<float>();
    float* qp = q.data_ptr<float>();
    float* gp = gate.data_ptr<float>();
    for (int64_t t = 0; t < n; ++t)
      for (int64_t hd = 0; hd < num_heads_; ++hd) {
        const float* s = src + t * 2 * q_size + hd * 2 * d;
        std::memcpy(qp + (t * num_heads_ + hd) * d, s, d * sizeof(float));
        std::memcpy(gp + t * q_size + hd * d, s + d, d * sizeof(float));
      }
  }
  torch::Tensor k = k_flat.view({n, num_kv_heads_, d});
  const torch::Tensor v = v_flat.view({n, num_kv_heads_, d});
  rms_norm_heads_(q, l.q_norm, eps_, offset_);
  rms_norm_heads_(k, l.k_norm, eps_, offset_);
  if (rotary_dim_ > 0) {
    partial_rotary_(q, step.cos, step.sin);
    partial_rotary_(k, step.cos, step.sin);
  }
  // torch.sigmoid(gate): gate's rows are apart in the module path where a head is alone
  float* gp = gate.data_ptr<float>();
  torch_unary(gp, gp, n, q_size, num_heads_ > 1, Sigmoid());
  watch.lap(kNorms);
  write_kv(k, l.k_cache, step.slot_mapping[l.group]);
  write_kv(v, l.v_cache, step.slot_mapping[l.group]);
  const torch::Tensor attn = paged_decode_attention_checked_context(
      q, l.k_cache, l.v_cache, step.block_ids[l.group], step.kv_offsets[l.group], step.kv_lens[l.group],
      step.block_size, scale_);
  watch.lap(kAttention);
  torch::Tensor gated = attn.view({n, q_size}).mul(gate);  // exact products, any order
  watch.lap(kNorms);
  torch::Tensor o = packed_linear(gated, l.o_proj, l.o_bias, hidden_);
  watch.lap(kLinears);
  return o;
}

// Gated DeltaNet for one token per row: GatedDeltaNet.forward's ops, in its order.
torch::Tensor FusedHybridDecoder::delta_net(HybridLayer& l, const torch::Tensor& h, const Step& step,
                                            HybridStopwatch& watch) {
  const int64_t n = h.size(0);
  const GdnShape& s = gdn_;
  const torch::Tensor qkvz = packed_linear(h, l.qkvz, c10::nullopt, s.kh * s.group_width());
  const torch::Tensor ba = packed_linear(h, l.ba, c10::nullopt, 2 * s.vh);
  watch.lap(kLinears);
  snapshot(l, step, 0);
  const torch::Tensor conv = gdn_conv_(s, qkvz, l.conv_weight, l.conv_state, step.slots);
  const GdnGates gates = gdn_gates(s, qkvz, ba, l.neg_exp_a, l.dt_bias);
  const auto [qn, kn] = gdn_qk_l2norm(s, conv);
  torch::Tensor out = gdn_delta_rule_(s, conv, qn, kn, gates, l.rec_state, step.slots);
  snapshot(l, step, 1);
  gdn_gated_norm_(s, out, gates.z, l.norm_weight, l.norm_eps);
  watch.lap(kRecurrent);
  torch::Tensor o = packed_linear(out.view({n, s.value_dim()}), l.out_proj, c10::nullopt, hidden_);
  watch.lap(kLinears);
  return o;
}

// The checkpoints of this layer's state taken `offset` rows into their row (0: before its token).
void FusedHybridDecoder::snapshot(HybridLayer& l, const Step& step, int64_t offset) const {
  snapshot_states(l.conv_ckpt, l.rec_ckpt, l.conv_state, l.rec_state, step.slots, step.snapshot_rows,
                  step.snapshot_offsets, step.snapshot_ids, offset);
}

torch::Tensor FusedHybridDecoder::dense_mlp(HybridLayer& l, const torch::Tensor& x, HybridStopwatch& watch) {
  const torch::Tensor gate_up = packed_linear(x, l.gate_up, c10::nullopt, 2 * l.intermediate);
  watch.lap(kLinears);
  const torch::Tensor act = gated_act(gate_up, false);
  watch.lap(kNorms);
  torch::Tensor out = packed_linear(act, l.down, c10::nullopt, hidden_);
  watch.lap(kLinears);
  return out;
}

// SparseMoE.forward: softmax routing, top-k (renormalised), every routed expert on its rows with
// the rows' sums in ascending expert order, then + sigmoid(shared_expert_gate(x)) * shared(x).
torch::Tensor FusedHybridDecoder::moe(HybridLayer& l, const torch::Tensor& x, HybridStopwatch& watch) {
  torch::Tensor probs = packed_linear(x, l.router, c10::nullopt, l.num_experts);
  watch.lap(kLinears);
  const MoeRouting routing = moe_route_(probs, l.top_k, l.norm_topk);
  watch.lap(kNorms);
  torch::Tensor out = moe_experts(x, routing, l.expert_gate_up, l.expert_down, l.moe_intermediate);
  watch.lap(kExperts);
  if (l.shared_gate_up.defined()) {
    moe_add_shared_(out, x, l.shared_gate_up, l.shared_down, l.shared_intermediate, l.shared_gate);
    watch.lap(kExperts);
  }
  return out;
}
