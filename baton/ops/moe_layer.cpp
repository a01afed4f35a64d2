// A mixture of experts as a layer step of the fused decoder (fused_decoder.h), in the stages of
// the module paths it replays (baton/models/moe.py, nemotron_h.py), each with their bits: the
// routing (softmax top-k over a packed router, renormalised or not: SparseMoE; or SigmoidRouter's
// sigmoid scores with a correction bias that steers the choice only and grouped top-k over a plain
// float32 router, as its very ATen ops), every routed expert once on all its rows (gated SiLU, or
// squared ReLU inside an optional latent space: NemotronHMoE's fc1 / fc2), the rows' weighted
// sums in ascending expert order, then the shared expert (gated SiLU times sigmoid of its gate
// where it has one, or squared ReLU). Experts another tensor-parallel rank holds are empty.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "step_common.h"

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

// Each row's top_k experts and their weights: [rows * top_k] each
struct MoeRouting {
  int64_t top_k;
  std::vector<int64_t> ids;
  std::vector<float> weights;
};

// From the router's logits probs [n, experts] (softmaxed in place): softmax, top-k (the largest
// first, ties to the lower id, as torch.topk) and, with norm_topk, the weights renormalised.
MoeRouting softmax_route_(torch::Tensor& probs, int64_t top_k, bool norm_topk) {
  const int64_t n = probs.size(0), experts = probs.size(1);
  MoeRouting routing{top_k, std::vector<int64_t>(n * top_k), std::vector<float>(n * top_k)};
  float* pp = probs.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    float* p = pp + t * experts;
    torch_softmax_row_(p, experts);
    std::vector<bool> taken(experts, false);
    for (int64_t j = 0; j < top_k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < experts; ++e)
        if (!taken[e] && (best < 0 || p[e] > p[best] || (std::isnan(p[e]) && !std::isnan(p[best])))) best = e;
      taken[best] = true;
      routing.ids[t * top_k + j] = best;
      routing.weights[t * top_k + j] = p[best];
    }
    if (norm_topk) {
      float* w = routing.weights.data() + t * top_k;
      const float total = torch_row_sum(w, top_k);
      for (int64_t j = 0; j < top_k; ++j) w[j] = w[j] / total;
    }
  }
  return routing;
}

struct SigmoidRouter {
  torch::Tensor weight;           // [experts, hidden], float32, not packed
  torch::Tensor correction_bias;  // [experts]
  int64_t top_k = 1, n_group = 1, topk_group = 1;
  bool norm_topk = true;
  double scaling = 1.0, norm_eps = 1e-20;  // weights / (sum + norm_eps)
};

void check_sigmoid_router(const SigmoidRouter& r, int64_t hidden) {
  check_float(r.weight, "router_weight");
  TORCH_CHECK(r.weight.dim() == 2 && r.weight.size(1) == hidden, "router_weight must be [experts, ", hidden,
              "], got ", r.weight.sizes());
  const int64_t experts = r.weight.size(0);
  check_vector(r.correction_bias, experts, "correction_bias");
  TORCH_CHECK(r.top_k >= 1 && r.top_k <= experts, "top_k must be in [1, ", experts, "], got ", r.top_k);
  TORCH_CHECK(r.n_group >= 1 && experts % r.n_group == 0, experts, " experts do not split into ", r.n_group,
              " groups");
  TORCH_CHECK(r.n_group == 1 || (experts / r.n_group >= 2 && r.topk_group >= 1 && r.topk_group <= r.n_group &&
                                 r.top_k <= r.topk_group * (experts / r.n_group)),
              "bad group routing: ", r.n_group, " groups, ", r.topk_group, " kept, top ", r.top_k);
}

MoeRouting sigmoid_route(const torch::Tensor& x, const SigmoidRouter& r) {
  const int64_t t = x.size(0), experts = r.weight.size(0), g = r.n_group;
  const torch::Tensor scores = vec_unary(row_linear(x, r.weight), Sigmoid());
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
  if (r.norm_topk) weights = weights / (weights.sum(-1, true) + r.norm_eps);
  weights = (weights * r.scaling).contiguous();
  MoeRouting routing{r.top_k, std::vector<int64_t>(t * r.top_k), std::vector<float>(t * r.top_k)};
  std::memcpy(routing.ids.data(), ids.data_ptr<int64_t>(), t * r.top_k * sizeof(int64_t));
  std::memcpy(routing.weights.data(), weights.data_ptr<float>(), t * r.top_k * sizeof(float));
  return routing;
}

// An MLP of the mixture: gated SiLU (in: gate_up [2I, width]) or squared ReLU (in: up [I, width])
// (clamped at `limit` where positive: swiglu)
torch::Tensor expert_mlp(const torch::Tensor& x, const StepLinear& in, const StepLinear& out, bool relu2,
                         double limit) {
  return relu2 ? relu2_mlp(x, in.weight, in.bias, out.weight, out.bias, in.n, out.n)
               : out(swiglu(in(x), false, limit));
}

class MoeStep : public LayerStep {
 public:
  explicit MoeStep(StepArgs& a)
      : hidden_(a.integer("hidden")), relu2_(a.flag("relu2")), intermediate_(a.integer("moe_intermediate")),
        limit_(a.has("swiglu_limit") ? a.real("swiglu_limit") : 0.0) {
    const int64_t top_k = a.integer("top_k");
    const bool norm_topk = a.flag("norm_topk_prob");
    const std::vector<torch::Tensor> in = a.tensors("expert_in"), out = a.tensors("expert_out");
    const int64_t n = static_cast<int64_t>(in.size());
    TORCH_CHECK(n >= 1 && out.size() == in.size(), "a mixture of experts needs experts, each with two projections");
    softmax_router_ = a.linear("router", hidden_, n, true);
    top_k_ = top_k;
    norm_topk_ = norm_topk;
    if (softmax_router_.defined()) {
      TORCH_CHECK(top_k >= 1 && top_k <= n, "top_k must be in [1, ", n, "], got ", top_k);
    } else {
      sigmoid_ = SigmoidRouter{a.tensor("router_weight"), a.tensor("correction_bias"), top_k,
                               a.integer("n_group"), a.integer("topk_group"), norm_topk,
                               a.real("routed_scaling_factor"), a.real("router_norm_eps")};
      check_sigmoid_router(sigmoid_, hidden_);
      TORCH_CHECK(sigmoid_.weight.size(0) == n, "one expert per router row: ", n, " experts for ",
                  sigmoid_.weight.size(0), " rows");
    }
    const bool latent = a.has("fc1");
    width_ = latent ? a.integer("width") : hidden_;
    const int64_t in_rows = (relu2_ ? 1 : 2) * intermediate_;
    for (int64_t e = 0; e < n; ++e) {
      if (in[e].numel() == 0 && out[e].numel() == 0) {  // held by another rank
        experts_.push_back({});
        continue;
      }
      check_packed(in[e], width_, in_rows, "expert_in");
      check_packed(out[e], intermediate_, width_, "expert_out");
      experts_.push_back({StepLinear{in[e], c10::nullopt, in_rows}, StepLinear{out[e], c10::nullopt, width_}});
    }
    const int64_t shared_intermediate = a.integer("shared_intermediate");
    const int64_t shared_rows = (relu2_ ? 1 : 2) * shared_intermediate;
    shared_in_ = a.linear("shared_in", hidden_, shared_rows, true);
    shared_out_ = a.linear("shared_out", shared_intermediate, hidden_, true);
    TORCH_CHECK(shared_in_.defined() == shared_out_.defined(), "the shared expert needs its two projections");
    TORCH_CHECK(relu2_ || (!shared_in_.bias && !shared_out_.bias), "a gated shared expert has no biases");
    shared_gate_ = a.linear("shared_gate", hidden_, 1, true);
    TORCH_CHECK(!shared_gate_.defined() || (shared_in_.defined() && !relu2_),
                "a shared-expert gate needs a gated shared expert");
    TORCH_CHECK(relu2_ || !latent, "a latent space is for squared-ReLU experts");
    if (latent) {
      fc1_ = a.linear("fc1", hidden_, width_);
      fc2_ = a.linear("fc2", width_, hidden_);
    }
  }

  torch::Tensor run(const torch::Tensor& x, const StepBatch&, StepStopwatch& watch) override {
    MoeRouting routing;
    if (softmax_router_.defined()) {
      torch::Tensor probs = softmax_router_(x);
      watch.lap(StepPart::kLinears);
      routing = softmax_route_(probs, top_k_, norm_topk_);
    } else {
      routing = sigmoid_route(x, sigmoid_);
    }
    watch.lap(StepPart::kNorms);
    torch::Tensor out = routed_experts(fc1_.defined() ? fc1_(x) : x, routing);
    if (fc2_.defined()) out = fc2_(out);
    watch.lap(StepPart::kExperts);
    if (shared_in_.defined()) {
      add_shared_(out, x);
      watch.lap(StepPart::kExperts);
    }
    return out;
  }

 private:
  // sum over each row's routed experts, in ascending expert order, of weight * expert(x), each
  // expert run once on all its rows; a weighted row is added as torch's index_add_ of the rounded
  // products
  torch::Tensor routed_experts(const torch::Tensor& x, const MoeRouting& routing) const {
    const int64_t n = x.size(0), width = x.size(1), top_k = routing.top_k;
    torch::Tensor out = torch::zeros({n, width}, x.options());
    float* outp = out.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    std::vector<int64_t> rows;
    std::vector<float> row_weights;
    for (int64_t e = 0; e < static_cast<int64_t>(experts_.size()); ++e) {
      rows.clear();
      row_weights.clear();
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < top_k; ++j)
          if (routing.ids[t * top_k + j] == e) {
            rows.push_back(t);
            row_weights.push_back(routing.weights[t * top_k + j]);
          }
      if (rows.empty() || !experts_[e].first.defined()) continue;  // another rank adds an absent expert's share
      const int64_t m = static_cast<int64_t>(rows.size());
      torch::Tensor xe = torch::empty({m, width}, x.options());
      for (int64_t i = 0; i < m; ++i)
        std::memcpy(xe.data_ptr<float>() + i * width, xp + rows[i] * width, width * sizeof(float));
      const torch::Tensor y = expert_mlp(xe, experts_[e].first, experts_[e].second, relu2_, limit_);
      const float* yp = y.data_ptr<float>();
      for (int64_t i = 0; i < m; ++i) {
        float* o = outp + rows[i] * width;
        for (int64_t c = 0; c < width; ++c) {
          float v = yp[i * width + c] * row_weights[i];
          BATON_ROUNDED(v);
          o[c] = o[c] + v;
        }
      }
    }
    return out;
  }

  // out += shared(x), times sigmoid(shared_gate(x)) where there is a gate
  void add_shared_(torch::Tensor& out, const torch::Tensor& x) const {
    const torch::Tensor shared = expert_mlp(x, shared_in_, shared_out_, relu2_, limit_);
    if (!shared_gate_.defined()) {
      out.add_(shared);
      return;
    }
    const int64_t n = x.size(0), hidden = x.size(1);
    torch::Tensor gate = shared_gate_(x);
    float* gp = gate.data_ptr<float>();
    vec_unary(gp, gp, n, Sigmoid());
    float* outp = out.data_ptr<float>();
    const float* sp = shared.data_ptr<float>();
    for (int64_t t = 0; t < n; ++t)
      for (int64_t c = 0; c < hidden; ++c) {
        float v = gp[t] * sp[t * hidden + c];
        BATON_ROUNDED(v);
        outp[t * hidden + c] = outp[t * hidden + c] + v;
      }
  }

  int64_t hidden_;
  bool relu2_;
  int64_t intermediate_;
  double limit_;  // the gated experts' swiglu_limit; 0: none
  int64_t width_ = 0, top_k_ = 1;
  bool norm_topk_ = true;
  StepLinear softmax_router_;  // packed [experts, hidden]: softmax routing; undefined: sigmoid_
  SigmoidRouter sigmoid_;
  std::vector<std::pair<StepLinear, StepLinear>> experts_;  // (in, out); undefined: another rank's
  StepLinear fc1_, fc2_;                                   // the latent space; undefined: none
  StepLinear shared_in_, shared_out_, shared_gate_;
};

}  // namespace

void bind_moe_layer(pybind11::module_& m) { bind_step<MoeStep>(m, "MoeStep"); }
