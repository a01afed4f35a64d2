// The dense MLPs as layer steps of the fused decoder (fused_decoder.h): the gated one, gate_up
// (stacked by rows from its parts), act(gate) * up (SiLU, or GELU's tanh approximation), down
// (baton/models/llama.py's GatedMLP.forward), and the squared-ReLU one, down(relu(up(x))^2)
// (nemotron_h.py's MLP), kernel for kernel.
#include "fused_decoder.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

torch::Tensor relu2_mlp(const torch::Tensor& x, const torch::Tensor& up, const c10::optional<torch::Tensor>& up_bias,
                        const torch::Tensor& down, const c10::optional<torch::Tensor>& down_bias,
                        int64_t intermediate, int64_t out_features) {
  torch::Tensor act = packed_linear(x, up, up_bias, intermediate);
  float* a = act.data_ptr<float>();
  for (int64_t i = 0; i < act.numel(); ++i) {
    const float r = a[i] < 0.f ? 0.f : a[i];  // F.relu (NaN stays NaN), then .square()
    a[i] = r * r;
  }
  return packed_linear(act, down, down_bias, out_features);
}

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

class Relu2MlpStep : public LayerStep {
 public:
  Relu2MlpStep(torch::Tensor up, c10::optional<torch::Tensor> up_bias, torch::Tensor down,
               c10::optional<torch::Tensor> down_bias, int64_t intermediate, int64_t hidden)
      : up_(std::move(up)), up_bias_(std::move(up_bias)), down_(std::move(down)), down_bias_(std::move(down_bias)),
        intermediate_(intermediate), hidden_(hidden) {
    check_packed(up_, hidden_, intermediate_, "up_proj");
    if (up_bias_.has_value()) check_vector(*up_bias_, intermediate_, "up_proj bias");
    check_packed(down_, intermediate_, hidden_, "down_proj");
    if (down_bias_.has_value()) check_vector(*down_bias_, hidden_, "down_proj bias");
  }

  torch::Tensor run(const torch::Tensor& x, const StepBatch&, StepStopwatch& watch) override {
    torch::Tensor out = relu2_mlp(x, up_, up_bias_, down_, down_bias_, intermediate_, hidden_);
    watch.lap(StepPart::kLinears);
    return out;
  }

 private:
  torch::Tensor up_;
  c10::optional<torch::Tensor> up_bias_;
  torch::Tensor down_;
  c10::optional<torch::Tensor> down_bias_;
  int64_t intermediate_, hidden_;
};

}  // namespace

void bind_mlp_layer(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<GatedMlpStep, LayerStep, std::shared_ptr<GatedMlpStep>>(m, "GatedMlpStep")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, torch::Tensor, int64_t, int64_t, bool>(),
           py::arg("gate_up"), py::arg("gate_up_rows"), py::arg("down"), py::arg("intermediate"), py::arg("hidden"),
           py::arg("gelu_tanh"));
  py::class_<Relu2MlpStep, LayerStep, std::shared_ptr<Relu2MlpStep>>(m, "Relu2MlpStep")
      .def(py::init<torch::Tensor, c10::optional<torch::Tensor>, torch::Tensor, c10::optional<torch::Tensor>, int64_t,
                    int64_t>(),
           py::arg("up"), py::arg("up_bias"), py::arg("down"), py::arg("down_bias"), py::arg("intermediate"),
           py::arg("hidden"));
}
