#pragma once
// Mamba2 for one decode token per row, in the stages of Mamba2Mixer.forward between in_proj and
// out_proj (mamba_step.cpp); MambaStep (recurrent_layers.cpp) runs them in order. Each stage has the
// bits of the module path's torch ops (torch_rounding.h): the scan step is recurrent_scan_'s
// arithmetic without beta, with q = C, k = B, v = dt x, decay = dt A over the state [heads, N, P].
#include <torch/types.h>

#include <cstdint>
#include <vector>

// A layer's shapes: nh heads of dim p, g groups of B and C of size n, a causal conv of kernel kc
struct MambaShape {
  int64_t nh, p, g, n, kc;
  int64_t inner() const { return nh * p; }
  int64_t conv_dim() const { return inner() + 2 * g * n; }   // the conv's channels: x, B, C
  int64_t proj_width() const { return inner() + conv_dim() + nh; }  // in_proj's: z, xBC, dt
};

struct MambaWeights {
  torch::Tensor conv_weight;  // [conv_dim, kc]
  torch::Tensor conv_bias;    // [conv_dim] or undefined
  torch::Tensor neg_exp_a;    // [nh]: -exp(A_log)
  torch::Tensor dt_bias, d;   // [nh]
  torch::Tensor norm_weight;  // [inner]
  double dt_min = 0.0, eps = 1e-5;
};

// silu(causal conv) [rows, conv_dim] of xBC in in_proj's output zxbcdt [rows, proj_width] over
// each row's window; the window of each row's slot shifts by one.
torch::Tensor mamba_conv_(const MambaShape& s, const MambaWeights& w, const torch::Tensor& zxbcdt,
                          torch::Tensor& conv_state, const std::vector<int64_t>& slots);

// The SSM step of each row over its slot's state in ssm_state [slots, nh, n, p], then + D x, the
// gate silu(z), the grouped RMS norm and its weight: [rows, inner], out_proj's input.
torch::Tensor mamba_ssm_(const MambaShape& s, const MambaWeights& w, const torch::Tensor& zxbcdt,
                         const torch::Tensor& conv, torch::Tensor& ssm_state, const std::vector<int64_t>& slots);
