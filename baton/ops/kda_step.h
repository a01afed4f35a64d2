#pragma once
// Kimi Delta Attention for one decode token per row, in the stages of KimiDeltaAttention.forward
// between in_proj and o_proj (kda_step.cpp); KdaStep (recurrent_layers.cpp) runs them in order. The conv has
// the bits of the module path's conv1d (torch_rounding.h, step_common.h); the rest runs the module
// path's very ATen ops on the same views (its l2norm's torch.sqrt is MKL's, not libm's), the delta
// rule recurrent_scan_ itself, one call per row as the module path makes it.
#include <torch/types.h>

#include <cstdint>
#include <vector>

// A layer's shapes: h heads of dim d, short causal convs of kernel kc on q, k and v
struct KdaShape {
  int64_t h, d, kc;
  int64_t hd() const { return h * d; }
  int64_t channels() const { return 3 * hd(); }                 // the conv's: q, k, v
  int64_t proj_width() const { return 3 * hd() + 2 * d + h; }  // in_proj's: q, k, v, f_a, g_a, b
};

struct KdaWeights {
  torch::Tensor conv_weight;  // [3 hd, kc]
  torch::Tensor f_b, g_b;     // packed panels of f_b_proj, g_b_proj [hd, d]
  torch::Tensor dt_bias;      // [hd]
  torch::Tensor neg_exp_a;    // [h]: -exp(A_log)
  torch::Tensor o_norm;       // [d]
  double eps = 1e-6;
};

// silu(causal conv) [rows, 3 hd] of q, k, v in in_proj's output proj [rows, proj_width] over each
// row's window; the window of each row's slot shifts by one.
torch::Tensor kda_conv_(const KdaShape& s, const KdaWeights& w, const torch::Tensor& proj, torch::Tensor& conv_state,
                        const std::vector<int64_t>& slots);

// l2norm of q and k, the per-channel decay and beta, the delta-rule step of each row over its
// slot's state in rec_state [slots, h, d, d], the RMS norm and the sigmoid output gate:
// [rows, hd], o_proj's input.
torch::Tensor kda_mix_(const KdaShape& s, const KdaWeights& w, const torch::Tensor& proj, const torch::Tensor& conv,
                       torch::Tensor& rec_state, const std::vector<int64_t>& slots);
