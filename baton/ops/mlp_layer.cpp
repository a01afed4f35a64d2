// The dense MLPs as layer steps of the fused decoder (fused_decoder.h): the gated one, gate_up
// (stacked by rows from its parts), act(gate) * up (SiLU, or GELU's tanh approximation), down
// (baton/models/llama.py's GatedMLP.forward; clamped at a swiglu_limit as moe.py's MLP), and the squared-ReLU one, down(relu(up(x))^2)
// (nemotron_h.py's MLP), kernel for kernel.
#include "step_common.h"

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
  explicit GatedMlpStep(StepArgs& a)
      : gate_up_(a.tensors("gate_up")), gate_up_rows_(a.integers("gate_up_rows")),
        intermediate_(a.integer("intermediate")), hidden_(a.integer("hidden")), gelu_tanh_(a.flag("gelu_tanh")),
        limit_(a.has("swiglu_limit") ? a.real("swiglu_limit") : 0.0) {
    TORCH_CHECK(gate_up_.size() == gate_up_rows_.size() && !gate_up_.empty(), "one row count per gate_up part");
    TORCH_CHECK(intermediate_ >= 1 && hidden_ >= 1, "an MLP needs positive sizes, got ", intermediate_, " and ",
                hidden_);
    down_ = a.linear("down", intermediate_, hidden_);
  }

  torch::Tensor run(const torch::Tensor& x, const StepBatch&, StepStopwatch& watch) override {
    const torch::Tensor gate_up = stacked_linear(x, gate_up_, gate_up_rows_, c10::nullopt, 2 * intermediate_);
    watch.lap(StepPart::kLinears);
    const torch::Tensor act = swiglu(gate_up, gelu_tanh_, limit_);
    watch.lap(StepPart::kNorms);
    torch::Tensor out = down_(act);
    watch.lap(StepPart::kLinears);
    return out;
  }

 private:
  std::vector<torch::Tensor> gate_up_;
  std::vector<int64_t> gate_up_rows_;
  int64_t intermediate_, hidden_;
  bool gelu_tanh_;
  double limit_;  // swiglu_limit; 0: none
  StepLinear down_;
};

class Relu2MlpStep : public LayerStep {
 public:
  explicit Relu2MlpStep(StepArgs& a) {
    const int64_t intermediate = a.integer("intermediate"), hidden = a.integer("hidden");
    up_ = a.linear("up", hidden, intermediate);
    down_ = a.linear("down", intermediate, hidden);
  }

  torch::Tensor run(const torch::Tensor& x, const StepBatch&, StepStopwatch& watch) override {
    torch::Tensor out = relu2_mlp(x, up_.weight, up_.bias, down_.weight, down_.bias, up_.n, down_.n);
    watch.lap(StepPart::kLinears);
    return out;
  }

 private:
  StepLinear up_, down_;
};

}  // namespace

void bind_mlp_layer(pybind11::module_& m) {
  bind_step<GatedMlpStep>(m, "GatedMlpStep");
  bind_step<Relu2MlpStep>(m, "Relu2MlpStep");
}
