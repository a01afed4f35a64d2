// A mixture of experts as a layer step of the fused decoder (fused_decoder.h), in the stages of
// the module paths it replays (moe_step.h, sigmoid_route.h): the routing (softmax top-k over a
// packed router, renormalised or not: SparseMoE; or sigmoid scores with a correction bias and
// grouped top-k over a plain float32 router: SigmoidRouter), every routed expert on its rows
// (gated SiLU, or squared ReLU inside an optional latent space: NemotronHMoE's fc1 / fc2), the
// rows' sums in ascending expert order, then the shared expert (gated SiLU times sigmoid of its
// gate where it has one, or squared ReLU). Experts another tensor-parallel rank holds are empty.
#include "fused_decoder.h"
#include "moe_step.h"
#include "ops.h"
#include "sigmoid_route.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace {

void check_bias(const c10::optional<torch::Tensor>& bias, int64_t n, const char* name) {
  if (bias.has_value()) check_vector(*bias, n, name);
}

// An MLP: gated SiLU (in = gate_up [2I, width]) or squared ReLU (in = up [I, width]); out = down
struct ExpertWeights {
  torch::Tensor in, out;
  c10::optional<torch::Tensor> in_bias, out_bias;
};

class MoeStep : public LayerStep {
 public:
  struct Router {
    torch::Tensor softmax;         // packed [experts, hidden]: softmax routing, or undefined
    int64_t top_k = 1;
    bool norm_topk = true;
    SigmoidRouterWeights sigmoid;  // used where `softmax` is undefined
  };
  struct Latent {
    torch::Tensor fc1, fc2;  // undefined: the experts work at the hidden width
    c10::optional<torch::Tensor> fc1_bias, fc2_bias;
    int64_t width = 0;
  };

  MoeStep(int64_t hidden, Router router, bool relu2, std::vector<ExpertWeights> experts, int64_t intermediate,
          Latent latent, ExpertWeights shared, int64_t shared_intermediate, torch::Tensor shared_gate)
      : hidden_(hidden), router_(std::move(router)), relu2_(relu2), experts_(std::move(experts)),
        intermediate_(intermediate), latent_(std::move(latent)), shared_(std::move(shared)),
        shared_intermediate_(shared_intermediate), shared_gate_(std::move(shared_gate)) {
    const int64_t n = static_cast<int64_t>(experts_.size());
    TORCH_CHECK(n >= 1, "a mixture of experts needs experts");
    if (router_.softmax.defined()) {
      TORCH_CHECK(router_.top_k >= 1 && router_.top_k <= n, "top_k must be in [1, ", n, "], got ", router_.top_k);
      check_packed(router_.softmax, hidden_, n, "router");
    } else {
      check_sigmoid_router(router_.sigmoid, hidden_);
      TORCH_CHECK(router_.sigmoid.weight.size(0) == n, "one expert per router row: ", n, " experts for ",
                  router_.sigmoid.weight.size(0), " rows");
    }
    TORCH_CHECK(latent_.fc1.defined() == latent_.fc2.defined(), "a latent space needs fc1 and fc2");
    if (!latent_.fc1.defined()) latent_.width = hidden_;
    if (latent_.fc1.defined()) {
      check_packed(latent_.fc1, hidden_, latent_.width, "fc1_latent_proj");
      check_bias(latent_.fc1_bias, latent_.width, "fc1_latent_proj bias");
      check_packed(latent_.fc2, latent_.width, hidden_, "fc2_latent_proj");
      check_bias(latent_.fc2_bias, hidden_, "fc2_latent_proj bias");
    }
    const int64_t in_rows = (relu2_ ? 1 : 2) * intermediate_;
    for (const ExpertWeights& e : experts_) {
      if (e.in.numel() == 0 && e.out.numel() == 0) continue;  // held by another rank
      TORCH_CHECK(!e.in_bias.has_value() && !e.out_bias.has_value(), "routed experts have no biases");
      check_packed(e.in, latent_.width, in_rows, "expert gate_up / up_proj");
      check_packed(e.out, intermediate_, latent_.width, "expert down_proj");
    }
    TORCH_CHECK(shared_.in.defined() == shared_.out.defined(), "the shared expert needs its two projections");
    if (shared_.in.defined()) {
      check_packed(shared_.in, hidden_, (relu2_ ? 1 : 2) * shared_intermediate_, "shared gate_up / up_proj");
      check_bias(shared_.in_bias, (relu2_ ? 1 : 2) * shared_intermediate_, "shared up_proj bias");
      check_packed(shared_.out, shared_intermediate_, hidden_, "shared down_proj");
      check_bias(shared_.out_bias, hidden_, "shared down_proj bias");
      TORCH_CHECK(relu2_ || (!shared_.in_bias.has_value() && !shared_.out_bias.has_value()),
                  "a gated shared expert has no biases");
    }
    TORCH_CHECK(!shared_gate_.defined() || (shared_.in.defined() && !relu2_),
                "a shared-expert gate needs a gated shared expert");
    if (shared_gate_.defined()) check_packed(shared_gate_, hidden_, 1, "shared_expert_gate");
  }

  torch::Tensor run(const torch::Tensor& x, const StepBatch&, StepStopwatch& watch) override {
    const int64_t n = static_cast<int64_t>(experts_.size());
    MoeRouting routing;
    if (router_.softmax.defined()) {
      torch::Tensor probs = packed_linear(x, router_.softmax, c10::nullopt, n);
      watch.lap(StepPart::kLinears);
      routing = moe_route_(probs, router_.top_k, router_.norm_topk);
    } else {
      routing = sigmoid_route(x, router_.sigmoid);
    }
    watch.lap(StepPart::kNorms);
    torch::Tensor out;
    if (!relu2_) {
      std::vector<torch::Tensor> gate_up, down;
      for (const ExpertWeights& e : experts_) {
        gate_up.push_back(e.in);
        down.push_back(e.out);
      }
      out = moe_experts(x, routing, gate_up, down, intermediate_);
    } else {
      const torch::Tensor xe =
          latent_.fc1.defined() ? packed_linear(x, latent_.fc1, latent_.fc1_bias, latent_.width) : x;
      out = moe_experts_by(xe, routing, n, [&](int64_t e, const torch::Tensor& rows) {
        const ExpertWeights& w = experts_[e];
        if (w.in.numel() == 0) return torch::Tensor();  // elsewhere
        return relu2_mlp(rows, w.in, c10::nullopt, w.out, c10::nullopt, intermediate_, latent_.width);
      });
      if (latent_.fc2.defined()) out = packed_linear(out, latent_.fc2, latent_.fc2_bias, hidden_);
    }
    watch.lap(StepPart::kExperts);
    if (shared_.in.defined()) {
      if (relu2_)
        out.add_(relu2_mlp(x, shared_.in, shared_.in_bias, shared_.out, shared_.out_bias, shared_intermediate_,
                           hidden_));
      else
        moe_add_shared_(out, x, shared_.in, shared_.out, shared_intermediate_, shared_gate_);
      watch.lap(StepPart::kExperts);
    }
    return out;
  }

 private:
  int64_t hidden_;
  Router router_;
  bool relu2_;
  std::vector<ExpertWeights> experts_;
  int64_t intermediate_;
  Latent latent_;
  ExpertWeights shared_;
  int64_t shared_intermediate_;
  torch::Tensor shared_gate_;
};

std::vector<ExpertWeights> expert_weights(std::vector<torch::Tensor> in, std::vector<torch::Tensor> out) {
  TORCH_CHECK(in.size() == out.size(), "one input and one output projection per expert");
  std::vector<ExpertWeights> experts;
  for (size_t e = 0; e < in.size(); ++e) experts.push_back({std::move(in[e]), std::move(out[e]), {}, {}});
  return experts;
}

}  // namespace

void bind_moe_layer(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<MoeStep, LayerStep, std::shared_ptr<MoeStep>>(m, "MoeStep")
      // SparseMoE: softmax routing over a packed router, gated-SiLU experts, a shared expert that
      // may have a gate
      .def(py::init([](int64_t hidden, torch::Tensor router, int64_t top_k, bool norm_topk_prob,
                       std::vector<torch::Tensor> expert_gate_up, std::vector<torch::Tensor> expert_down,
                       int64_t moe_intermediate, c10::optional<torch::Tensor> shared_gate_up,
                       c10::optional<torch::Tensor> shared_down, int64_t shared_intermediate,
                       c10::optional<torch::Tensor> shared_gate) {
             MoeStep::Router r;
             r.softmax = std::move(router);
             r.top_k = top_k;
             r.norm_topk = norm_topk_prob;
             return std::make_shared<MoeStep>(
                 hidden, std::move(r), false, expert_weights(std::move(expert_gate_up), std::move(expert_down)),
                 moe_intermediate, MoeStep::Latent{},
                 ExpertWeights{shared_gate_up.value_or(torch::Tensor()), shared_down.value_or(torch::Tensor()), {}, {}},
                 shared_intermediate, shared_gate.value_or(torch::Tensor()));
           }),
           py::arg("hidden"), py::arg("router"), py::arg("top_k"), py::arg("norm_topk_prob"),
           py::arg("expert_gate_up"), py::arg("expert_down"), py::arg("moe_intermediate"), py::arg("shared_gate_up"),
           py::arg("shared_down"), py::arg("shared_intermediate"), py::arg("shared_gate"))
      // SigmoidRouter routing (a plain float32 weight, correction bias, grouped top-k); gated-SiLU
      // experts (relu2 false) or squared-ReLU ones in an optional latent space (relu2 true)
      .def(py::init([](int64_t hidden, torch::Tensor router_weight, torch::Tensor correction_bias, int64_t top_k,
                       int64_t n_group, int64_t topk_group, bool norm_topk_prob, double routed_scaling_factor,
                       bool relu2, std::vector<torch::Tensor> expert_in, std::vector<torch::Tensor> expert_out,
                       int64_t moe_intermediate, c10::optional<torch::Tensor> fc1,
                       c10::optional<torch::Tensor> fc1_bias, c10::optional<torch::Tensor> fc2,
                       c10::optional<torch::Tensor> fc2_bias, int64_t width, c10::optional<torch::Tensor> shared_in,
                       c10::optional<torch::Tensor> shared_in_bias, c10::optional<torch::Tensor> shared_out,
                       c10::optional<torch::Tensor> shared_out_bias, int64_t shared_intermediate) {
             MoeStep::Router r;
             r.sigmoid = SigmoidRouterWeights{std::move(router_weight), std::move(correction_bias), top_k, n_group,
                                              topk_group, norm_topk_prob, routed_scaling_factor};
             MoeStep::Latent latent{fc1.value_or(torch::Tensor()), fc2.value_or(torch::Tensor()), std::move(fc1_bias),
                                    std::move(fc2_bias), width};
             return std::make_shared<MoeStep>(
                 hidden, std::move(r), relu2, expert_weights(std::move(expert_in), std::move(expert_out)),
                 moe_intermediate, std::move(latent),
                 ExpertWeights{shared_in.value_or(torch::Tensor()), shared_out.value_or(torch::Tensor()),
                               std::move(shared_in_bias), std::move(shared_out_bias)},
                 shared_intermediate, torch::Tensor());
           }),
           py::arg("hidden"), py::arg("router_weight"), py::arg("correction_bias"), py::arg("top_k"),
           py::arg("n_group"), py::arg("topk_group"), py::arg("norm_topk_prob"), py::arg("routed_scaling_factor"),
           py::arg("relu2"), py::arg("expert_in"), py::arg("expert_out"), py::arg("moe_intermediate"),
           py::arg("fc1") = py::none(), py::arg("fc1_bias") = py::none(), py::arg("fc2") = py::none(),
           py::arg("fc2_bias") = py::none(), py::arg("width") = 0, py::arg("shared_in") = py::none(),
           py::arg("shared_in_bias") = py::none(), py::arg("shared_out") = py::none(),
           py::arg("shared_out_bias") = py::none(), py::arg("shared_intermediate") = 0);
}
