#pragma once
// SigmoidRouter.forward (baton/models/moe.py) for the fused decode steps of NemotronH and Kimi
// Linear: sigmoid scores over a plain float32 router weight, a correction bias that steers the
// choice only, the top experts within the `topk_group` best of `n_group` groups, the chosen
// scores renormalised and scaled. It runs the module path's very torch ops (sigmoid_route.cpp),
// so its weights, and the order in which a row's top-k weights are summed, have the same bits.
#include "moe_step.h"

#include <torch/types.h>

#include <cstdint>

struct SigmoidRouterWeights {
  torch::Tensor weight;           // [experts, hidden], float32, not packed
  torch::Tensor correction_bias;  // [experts]
  int64_t top_k = 1, n_group = 1, topk_group = 1;
  bool norm_topk = true;
  double scaling = 1.0;
};

// Throws unless the router fits `hidden` and its grouping splits the experts.
void check_sigmoid_router(const SigmoidRouterWeights& r, int64_t hidden);

// Each row's routed experts and weights for x [rows, hidden] float32.
MoeRouting sigmoid_route(const torch::Tensor& x, const SigmoidRouterWeights& r);
