// A softmax-routed mixture of experts as a layer step of the fused decoder (fused_decoder.h):
// the router, softmax top-k (renormalised or not), every routed expert on its rows, then the
// shared expert (times sigmoid of its gate, where it has one): SparseMoE.forward's stages
// (moe_step.h), in its order. Experts another tensor-parallel rank holds are empty tensors.
#include "fused_decoder.h"
#include "moe_step.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace {

class SoftmaxMoeStep : public LayerStep {
 public:
  struct Experts {
    std::vector<torch::Tensor> gate_up, down;  // packed, one pair per expert (empty: another rank's)
    int64_t intermediate = 0;
  };
  struct Shared {
    torch::Tensor gate_up, down, gate;  // undefined without a shared expert (or its gate)
    int64_t intermediate = 0;
  };

  SoftmaxMoeStep(int64_t hidden, torch::Tensor router, int64_t top_k, bool norm_topk, Experts experts, Shared shared)
      : hidden_(hidden), router_(std::move(router)), top_k_(top_k), norm_topk_(norm_topk),
        experts_(std::move(experts)), shared_(std::move(shared)) {
    const int64_t n = static_cast<int64_t>(experts_.gate_up.size());
    TORCH_CHECK(n >= 1 && experts_.down.size() == experts_.gate_up.size(), "one gate_up and one down per expert");
    TORCH_CHECK(top_k_ >= 1 && top_k_ <= n, "top_k must be in [1, ", n, "], got ", top_k_);
    check_packed(router_, hidden_, n, "router");
    for (int64_t e = 0; e < n; ++e) {
      if (experts_.gate_up[e].numel() == 0 && experts_.down[e].numel() == 0) continue;  // held by another rank
      check_packed(experts_.gate_up[e], hidden_, 2 * experts_.intermediate, "expert gate_up");
      check_packed(experts_.down[e], experts_.intermediate, hidden_, "expert down");
    }
    TORCH_CHECK(shared_.gate_up.defined() == shared_.down.defined(), "the shared expert needs gate_up and down");
    if (shared_.gate_up.defined()) {
      check_packed(shared_.gate_up, hidden_, 2 * shared_.intermediate, "shared gate_up");
      check_packed(shared_.down, shared_.intermediate, hidden_, "shared down");
    }
    TORCH_CHECK(!shared_.gate.defined() || shared_.gate_up.defined(), "a shared-expert gate without a shared expert");
    if (shared_.gate.defined()) check_packed(shared_.gate, hidden_, 1, "shared_expert_gate");
  }

  torch::Tensor run(const torch::Tensor& x, const StepBatch&, StepStopwatch& watch) override {
    torch::Tensor probs = packed_linear(x, router_, c10::nullopt, static_cast<int64_t>(experts_.gate_up.size()));
    watch.lap(StepPart::kLinears);
    const MoeRouting routing = moe_route_(probs, top_k_, norm_topk_);
    watch.lap(StepPart::kNorms);
    torch::Tensor out = moe_experts(x, routing, experts_.gate_up, experts_.down, experts_.intermediate);
    watch.lap(StepPart::kExperts);
    if (shared_.gate_up.defined()) {
      moe_add_shared_(out, x, shared_.gate_up, shared_.down, shared_.intermediate, shared_.gate);
      watch.lap(StepPart::kExperts);
    }
    return out;
  }

 private:
  int64_t hidden_;
  torch::Tensor router_;
  int64_t top_k_;
  bool norm_topk_;
  Experts experts_;
  Shared shared_;
};

}  // namespace

void bind_moe_layer(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<SoftmaxMoeStep, LayerStep, std::shared_ptr<SoftmaxMoeStep>>(m, "SoftmaxMoeStep")
      .def(py::init([](int64_t hidden, torch::Tensor router, int64_t top_k, bool norm_topk_prob,
                       std::vector<torch::Tensor> expert_gate_up, std::vector<torch::Tensor> expert_down,
                       int64_t moe_intermediate, c10::optional<torch::Tensor> shared_gate_up,
                       c10::optional<torch::Tensor> shared_down, int64_t shared_intermediate,
                       c10::optional<torch::Tensor> shared_gate) {
             return std::make_shared<SoftmaxMoeStep>(
                 hidden, std::move(router), top_k, norm_topk_prob,
                 SoftmaxMoeStep::Experts{std::move(expert_gate_up), std::move(expert_down), moe_intermediate},
                 SoftmaxMoeStep::Shared{shared_gate_up.value_or(torch::Tensor()), shared_down.value_or(torch::Tensor()),
                                        shared_gate.value_or(torch::Tensor()), shared_intermediate});
           }),
           py::arg("hidden"), py::arg("router"), py::arg("top_k"), py::arg("norm_topk_prob"),
           py::arg("expert_gate_up"), py::arg("expert_down"), py::arg("moe_intermediate"), py::arg("shared_gate_up"),
           py::arg("shared_down"), py::arg("shared_intermediate"), py::arg("shared_gate"));
}
