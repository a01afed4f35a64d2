// LFM2's short convolution as a layer step of the fused decoder (fused_decoder.h), one token per
// row: in_proj into B | C | x, the depthwise causal conv of B * x over each row's window (no
// activation), C times it, out_proj; each with the bits of ShortConv.forward's torch ops
// (baton/models/lfm2.py), and the window checkpoints the step asks for taken before or after the
// row's token. The conv window is the layer's whole state.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "step_common.h"

#include <numeric>
#include <vector>

namespace {

class ShortConvStep : public LayerStep {
 public:
  // hidden: the model's width; channels: the conv's (a tensor-parallel rank's share of hidden)
  explicit ShortConvStep(StepArgs& a) : channels_(a.integer("channels")) {
    const int64_t hidden = a.integer("hidden");
    TORCH_CHECK(hidden >= 1 && channels_ >= 1, "hidden and channels must be positive, got ", hidden, ", ", channels_);
    in_proj_ = a.linear("in_proj", hidden, 3 * channels_);
    out_proj_ = a.linear("out_proj", channels_, hidden);
    conv_weight_ = a.tensor("conv_weight");
    state_ = a.conv_state(conv_weight_, channels_, a.integer("conv_kernel"));
    conv_bias_ = a.tensor("conv_bias");
    if (conv_bias_.defined()) check_vector(conv_bias_, channels_, "conv_bias");
    columns_.resize(channels_);
    std::iota(columns_.begin(), columns_.end(), 0);
  }

  StepNeeds needs() const override { return state_.needs(); }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const torch::Tensor proj = in_proj_(h);
    watch.lap(StepPart::kLinears);
    const torch::Tensor bx = proj.narrow(1, 0, channels_) * proj.narrow(1, 2 * channels_, channels_);
    state_.snapshot(step, 0);
    const torch::Tensor conv =
        causal_conv_(bx, columns_, conv_weight_, conv_bias_, state_.conv, step.state_slots, false);
    state_.snapshot(step, 1);
    const torch::Tensor y = proj.narrow(1, channels_, channels_) * conv;
    watch.lap(StepPart::kRecurrent);
    torch::Tensor o = out_proj_(y);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  int64_t channels_;
  std::vector<int64_t> columns_;
  StepLinear in_proj_, out_proj_;
  torch::Tensor conv_weight_, conv_bias_;
  StateTensors state_;
};

}  // namespace

void bind_shortconv_layer(pybind11::module_& m) { bind_step<ShortConvStep>(m, "ShortConvStep"); }
