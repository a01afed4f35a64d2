#pragma once
// The stages of the mixtures of experts in baton/models/moe.py for the fused decoder (moe_step.cpp):
// softmax routing and top-k, the routed experts, the shared expert. MoeStep (moe_layer.cpp) runs
// them in order, after the router; each has the bits of the module path.
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <vector>

// Each row's top_k experts, the largest first, and their weights: [rows * top_k] each
struct MoeRouting {
  int64_t top_k;
  std::vector<int64_t> ids;
  std::vector<float> weights;
};

// From the router's logits probs [n, experts] (softmaxed in place): softmax, top-k and, with
// norm_topk, the weights renormalised to sum to 1.
MoeRouting moe_route_(torch::Tensor& probs, int64_t top_k, bool norm_topk);

// sum over each row's routed experts, in ascending expert order, of weight * expert(x), every
// expert run once on all its rows: [n, hidden] for x [n, hidden].
torch::Tensor moe_experts(const torch::Tensor& x, const MoeRouting& routing, const std::vector<torch::Tensor>& gate_up,
                          const std::vector<torch::Tensor>& down, int64_t intermediate);

// moe_experts over any experts: expert(e, xe) is expert e's output [m, hidden] for its rows xe [m, hidden],
// or undefined for an expert another tensor-parallel rank holds (its rows' share comes from there)
using MoeExpertFn = std::function<torch::Tensor(int64_t, const torch::Tensor&)>;
torch::Tensor moe_experts_by(const torch::Tensor& x, const MoeRouting& routing, int64_t num_experts,
                             const MoeExpertFn& expert);

// out += sigmoid(gate(x)) * shared(x), or out += shared(x) where gate is undefined.
void moe_add_shared_(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& gate_up,
                     const torch::Tensor& down, int64_t intermediate, const torch::Tensor& gate_weight);
