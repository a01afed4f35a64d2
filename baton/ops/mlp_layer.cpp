// The dense gated MLP as a layer step of the fused decoder (fused_decoder.h): gate_up (stacked by
// rows from its parts), act(gate) * up (SiLU, or GELU's tanh approximation), down:
// baton/models/llama.py's GatedMLP.forward, kernel for kernel.
#include "fused_decoder.h"
#include "ops.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace {

class GatedMlpStep : public LayerStep {
 public:
  GatedMlpStep(std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_rows, torch::Tensor down,
               int64_t intermediate, int64_t hidden, bool gelu_tanh)
      : gate_up_(std::move(gate_up)), gate_up_rows_(std::move(gate_up_rows)), down_(std::move(down)),
        intermediate_(intermediate), hidden_(hidden), gelu_tanh_(gelu_tanh) {
    TORCH_CHECK(gate_up_.size() == gate_up_rows_.size() && !gate_up_.empty(), "one row count per gate_up part");
    TORCH_CHECK(intermediate_ >= 1 && hidden_ >= 1, "an MLP needs positive sizes, got ", intermediate_, " and ",
                hidden_);
  }

  torch::Tensor run(const torch::Tensor& x, const StepBatch&, StepStopwatch& watch) override {
    const torch::Tensor gate_up = stacked_linear(x, gate_up_, gate_up_rows_, c10::nullopt, 2 * intermediate_);
    watch.lap(StepPart::kLinears);
    const torch::Tensor act = gated_act(gate_up, gelu_tanh_);
    watch.lap(StepPart::kNorms);
    torch::Tensor out = packed_linear(act, down_, c10::nullopt, hidden_);
    watch.lap(StepPart::kLinears);
    return out;
  }

 private:
  std::vector<torch::Tensor> gate_up_;
  std::vector<int64_t> gate_up_rows_;
  torch::Tensor down_;
  int64_t intermediate_, hidden_;
  bool gelu_tanh_;
};

}  // namespace

void bind_mlp_layer(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<GatedMlpStep, LayerStep, std::shared_ptr<GatedMlpStep>>(m, "GatedMlpStep")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, torch::Tensor, int64_t, int64_t, bool>(),
           py::arg("gate_up"), py::arg("gate_up_rows"), py::arg("down"), py::arg("intermediate"), py::arg("hidden"),
           py::arg("gelu_tanh"));
}
