#pragma once
// Gated DeltaNet for one decode token per row, in the stages of GatedDeltaNet.forward between its
// input projections and out_proj (gdn_step.cpp); GdnStep (gdn_layer.cpp) runs them in order.
// Each stage has the bits of the module path's torch ops (torch_rounding.h).
#include <torch/types.h>

#include <cstdint>
#include <utility>
#include <vector>

// A layer's shapes: kh key heads of dim dk, vh value heads of dim dv, a causal conv of kernel kc
struct GdnShape {
  int64_t kh, vh, dk, dv, kc;
  int64_t r() const { return vh / kh; }  // value heads per key head
  int64_t key_dim() const { return kh * dk; }
  int64_t value_dim() const { return vh * dv; }
  int64_t channels() const { return 2 * key_dim() + value_dim(); }  // the conv's: q, k, v
  int64_t group_width() const { return 2 * dk + 2 * r() * dv; }     // a key head's q, k, v, z in qkvz
};

// silu(causal conv) [n, channels] of q, k, v from in_proj_qkvz's output qkvz [n, kh * group width]
// over each row's window [conv_state | x]; the window of each row's slot shifts by one.
torch::Tensor gdn_conv_(const GdnShape& s, const torch::Tensor& qkvz, const torch::Tensor& conv_weight,
                        torch::Tensor& conv_state, const std::vector<int64_t>& slots);

struct GdnGates {
  torch::Tensor z;      // [n, vh * dv]: silu(z), the gated norm's gate
  torch::Tensor beta;   // [n, vh]: sigmoid(b)
  torch::Tensor decay;  // [n, vh]: -exp(A_log) * softplus(a + dt_bias)
};
// The gates from qkvz (z) and in_proj_ba's output ba [n, 2 * vh] (b, a)
GdnGates gdn_gates(const GdnShape& s, const torch::Tensor& qkvz, const torch::Tensor& ba,
                   const torch::Tensor& neg_exp_a, const torch::Tensor& dt_bias);

// l2norm(q) * dk^-0.5 and l2norm(k), each [n, kh, dk], from the conv's output
std::pair<torch::Tensor, torch::Tensor> gdn_qk_l2norm(const GdnShape& s, const torch::Tensor& conv);

// One delta-rule step per row and value head over the state of its slot in rec_state [slots, vh,
// dk, dv], v from the conv's output: returns out [n, vh, dv].
torch::Tensor gdn_delta_rule_(const GdnShape& s, const torch::Tensor& conv, const torch::Tensor& qn,
                              const torch::Tensor& kn, const GdnGates& gates, torch::Tensor& rec_state,
                              const std::vector<int64_t>& slots);

// Gated RMS norm of out [n, vh, dv] in place: x * rsqrt(mean(x^2) + eps) * weight * silu(z)
void gdn_gated_norm_(const GdnShape& s, torch::Tensor& out, const torch::Tensor& z, const torch::Tensor& weight,
                     double eps);
