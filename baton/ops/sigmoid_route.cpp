// SigmoidRouter.forward as the same ATen ops (sigmoid_route.h), one call each, for the rows of a
// decode step; their ids and weights become a MoeRouting for moe_experts_by.
#include "sigmoid_route.h"

#include <cstring>
#include <limits>
#include <tuple>

void check_sigmoid_router(const SigmoidRouterWeights& r, int64_t hidden) {
  const torch::Tensor& w = r.weight;
  TORCH_CHECK(w.defined() && w.scalar_type() == at::kFloat && w.device().is_cpu() && w.dim() == 2 &&
                  w.size(1) == hidden,
              "router weight must be float32 [experts, ", hidden, "] on the CPU, got ", w.sizes());
  const int64_t experts = w.size(0);
  const torch::Tensor& b = r.correction_bias;
  TORCH_CHECK(b.defined() && b.scalar_type() == at::kFloat && b.device().is_cpu() && b.dim() == 1 &&
                  b.size(0) == experts,
              "correction bias must be float32 [", experts, "], got ", b.sizes());
  TORCH_CHECK(r.top_k >= 1 && r.top_k <= experts, "top_k must be in [1, ", experts, "], got ", r.top_k);
  TORCH_CHECK(r.n_group >= 1 && experts % r.n_group == 0, experts, " experts do not split into ", r.n_group,
              " groups");
  TORCH_CHECK(r.n_group == 1 || (experts / r.n_group >= 2 && r.topk_group >= 1 && r.topk_group <= r.n_group &&
                                 r.top_k <= r.topk_group * (experts / r.n_group)),
              "bad group routing: ", r.n_group, " groups, ", r.topk_group, " kept, top ", r.top_k);
}

MoeRouting sigmoid_route(const torch::Tensor& x, const SigmoidRouterWeights& r) {
  const int64_t t = x.size(0), experts = r.weight.size(0), g = r.n_group;
  const torch::Tensor scores = at::linear(x, r.weight).sigmoid();
  torch::Tensor choice = scores + r.correction_bias;
  if (g > 1) {  // one group is always kept
    const torch::Tensor group_scores = std::get<0>(choice.view({t, g, -1}).topk(2, -1)).sum(-1);
    const torch::Tensor groups = std::get<1>(at::topk(group_scores, r.topk_group, -1, true, false));
    const torch::Tensor keep =
        at::zeros_like(group_scores, group_scores.options().dtype(at::kBool)).scatter_(1, groups, true);
    choice = choice.masked_fill(keep.repeat_interleave(experts / g, 1).logical_not(),
                                -std::numeric_limits<float>::infinity());
  }
  const torch::Tensor ids = std::get<1>(at::topk(choice, r.top_k, -1, true, false)).contiguous();
  torch::Tensor weights = scores.gather(1, ids);
  if (r.norm_topk) weights = weights / (weights.sum(-1, true) + 1e-20);
  weights = (weights * r.scaling).contiguous();
  MoeRouting routing{r.top_k, std::vector<int64_t>(t * r.top_k), std::vector<float>(t * r.top_k)};
  std::memcpy(routing.ids.data(), ids.data_ptr<int64_t>(), t * r.top_k * sizeof(int64_t));
  std::memcpy(routing.weights.data(), weights.data_ptr<float>(), t * r.top_k * sizeof(float));
  return routing;
}
