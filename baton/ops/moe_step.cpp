// SparseMoE.forward's stages (moe_step.h) over packed panels: the experts' linears and gated
// activation are the module path's kernels; the routing and the weighted sums have its rounding.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "moe_step.h"
#include "ops.h"

#include <cmath>
#include <cstring>
#include <vector>

MoeRouting moe_route_(torch::Tensor& probs, int64_t top_k, bool norm_topk) {
  const int64_t n = probs.size(0), experts = probs.size(1);
  MoeRouting routing{top_k, std::vector<int64_t>(n * top_k), std::vector<float>(n * top_k)};
  std::vector<int64_t>& ids = routing.ids;
  std::vector<float>& weights = routing.weights;
  float* pp = probs.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    float* p = pp + t * experts;
    torch_softmax_row_(p, experts);
    // torch.topk: the largest first (ties to the lower expert id)
    std::vector<bool> taken(experts, false);
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best] || (std::isnan(p[e]) && !std::isnan(p[best])))) best = e;
      taken[best] = true;
      ids[t * top_k + j] = best;
      weights[t * top_k + j] = p[best];
    }
    if (norm_topk) {
      float* w = weights.data() + t * top_k;
      const float total = torch_row_sum(w, top_k);
      for (int64_t j = 0; j < top_k; ++j) w[j] = w[j] / total;
    }
  }
  return routing;
}

// An expert's weighted rows are added to the sum as torch's index_add_ of the rounded products.
torch::Tensor moe_experts(const torch::Tensor& x, const MoeRouting& routing, const std::vector<torch::Tensor>& gate_up,
                          const std::vector<torch::Tensor>& down, int64_t intermediate) {
  const int64_t hidden = x.size(1);
  return moe_experts_by(x, routing, static_cast<int64_t>(gate_up.size()), [&](int64_t e, const torch::Tensor& xe) {
    if (gate_up[e].numel() == 0) return torch::Tensor();  // tensor parallel: another rank's expert
    const torch::Tensor act = gated_act(packed_linear(xe, gate_up[e], c10::nullopt, 2 * intermediate), false);
    return packed_linear(act, down[e], c10::nullopt, hidden);
  });
}

torch::Tensor moe_experts_by(const torch::Tensor& x, const MoeRouting& routing, int64_t experts,
                             const MoeExpertFn& expert) {
  const int64_t n = x.size(0), hidden = x.size(1), top_k = routing.top_k;
  torch::Tensor out = torch::zeros({n, hidden}, x.options());
  float* outp = out.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  std::vector<int64_t> rows;
  std::vector<float> row_weights;
  for (int64_t e = 0; e < experts; ++e) {
    rows.clear();
    row_weights.clear();
    for (int64_t t = 0; t < n; ++t)
      for (int64_t j = 0; j < top_k; ++j)
        if (routing.ids[t * top_k + j] == e) {
          rows.push_back(t);
          row_weights.push_back(routing.weights[t * top_k + j]);
        }
    if (rows.empty()) continue;
    const int64_t m = static_cast<int64_t>(rows.size());
    torch::Tensor xe = torch::empty({m, hidden}, x.options());
    for (int64_t i = 0; i < m; ++i)
      std::memcpy(xe.data_ptr<float>() + i * hidden, xp + rows[i] * hidden, hidden * sizeof(float));
    const torch::Tensor y = expert(e, xe);
    if (!y.defined()) continue;
    const float* yp = y.data_ptr<float>();
    for (int64_t i = 0; i < m; ++i) {
      float* o = outp + rows[i] * hidden;
      const float* yr = yp + i * hidden;
      const float w = row_weights[i];
      for (int64_t c = 0; c < hidden; ++c) {
        float v = yr[c] * w;
        BATON_ROUNDED(v);
        o[c] = o[c] + v;
      }
    }
  }
  return out;
}

void moe_add_shared_(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& gate_up,
                     const torch::Tensor& down, int64_t intermediate, const torch::Tensor& gate_weight) {
  const int64_t n = x.size(0), hidden = x.size(1);
  float* outp = out.data_ptr<float>();
  const torch::Tensor act = gated_act(packed_linear(x, gate_up, c10::nullopt, 2 * intermediate), false);
  const torch::Tensor shared = packed_linear(act, down, c10::nullopt, hidden);
  const float* sp = shared.data_ptr<float>();
  if (gate_weight.defined()) {
    torch::Tensor gate = packed_linear(x, gate_weight, c10::nullopt, 1);
    float* gp = gate.data_ptr<float>();
    torch_unary(gp, gp, n, 1, true, Sigmoid());
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < hidden; ++c) {
        float v = gp[t] * sp[t * hidden + c];
        BATON_ROUNDED(v);
        outp[t * hidden + c] = outp[t * hidden + c] + v;
      }
  } else {
    for (int64_t i = 0; i < n * hidden; ++i) outp[i] = outp[i] + sp[i];
  }
}
