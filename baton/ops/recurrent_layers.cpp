// The recurrent mixers besides Gated DeltaNet as layer steps of the fused decoder
// (fused_decoder.h), one token per row: Kimi Delta Attention (kda_step.h's stages between in_proj
// and o_proj) and Mamba2 (mamba_step.h's), each over its rows' state slots, with the checkpoints
// the step asks for taken before or after the row's token.
#include "fused_decoder.h"
#include "kda_step.h"
#include "mamba_step.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace {

// A recurrent layer's running states and checkpoints: [slots, ...] and [checkpoints, ...] alike
struct StateTensors {
  torch::Tensor conv, rec, conv_ckpt, rec_ckpt;

  StepNeeds needs() const {
    StepNeeds n;
    n.state_slots = conv.size(0);
    n.checkpoints = conv_ckpt.size(0);
    return n;
  }
  // the checkpoints taken `offset` rows into their row (0: before its token)
  void snapshot(const StepBatch& step, int64_t offset) {
    snapshot_states(conv_ckpt, rec_ckpt, conv, rec, step.state_slots, step.snapshot_rows, step.snapshot_offsets,
                    step.snapshot_ids, offset);
  }
};

// KimiDeltaAttention.forward for one token per row
class KdaStep : public LayerStep {
 public:
  KdaStep(KdaShape shape, int64_t hidden, torch::Tensor in_proj, torch::Tensor o_proj, KdaWeights w,
          StateTensors state)
      : s_(shape), hidden_(hidden), in_proj_(std::move(in_proj)), o_proj_(std::move(o_proj)), w_(std::move(w)),
        state_(std::move(state)) {
    TORCH_CHECK(s_.kc >= 2, "conv kernel must be at least 2, got ", s_.kc);
    check_packed(in_proj_, hidden_, s_.proj_width(), "in_proj");
    check_packed(o_proj_, s_.hd(), hidden_, "o_proj");
    check_float(w_.conv_weight, "conv_weight");
    check_recurrent_tensors(w_.conv_weight, s_.channels(), s_.kc, state_.conv, state_.rec, state_.conv_ckpt,
                            state_.rec_ckpt, {s_.h, s_.d, s_.d}, "rec_state", "rec_checkpoints");
    check_packed(w_.f_b, s_.d, s_.hd(), "f_b_proj");
    check_packed(w_.g_b, s_.d, s_.hd(), "g_b_proj");
    check_vector(w_.dt_bias, s_.hd(), "dt_bias");
    check_vector(w_.neg_exp_a, s_.h, "neg_exp_a");
    check_vector(w_.o_norm, s_.d, "o_norm");
  }

  StepNeeds needs() const override { return state_.needs(); }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const torch::Tensor proj = packed_linear(h, in_proj_, c10::nullopt, s_.proj_width());
    watch.lap(StepPart::kLinears);
    state_.snapshot(step, 0);
    const torch::Tensor conv = kda_conv_(s_, w_, proj, state_.conv, step.state_slots);
    const torch::Tensor out = kda_mix_(s_, w_, proj, conv, state_.rec, step.state_slots);
    state_.snapshot(step, 1);
    watch.lap(StepPart::kRecurrent);
    torch::Tensor o = packed_linear(out, o_proj_, c10::nullopt, hidden_);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  KdaShape s_;
  int64_t hidden_;
  torch::Tensor in_proj_, o_proj_;
  KdaWeights w_;
  StateTensors state_;
};

// Mamba2Mixer.forward for one token per row
class MambaStep : public LayerStep {
 public:
  MambaStep(MambaShape shape, int64_t hidden, torch::Tensor in_proj, c10::optional<torch::Tensor> in_bias,
            torch::Tensor out_proj, c10::optional<torch::Tensor> out_bias, MambaWeights w, StateTensors state)
      : s_(shape), hidden_(hidden), in_proj_(std::move(in_proj)), in_bias_(std::move(in_bias)),
        out_proj_(std::move(out_proj)), out_bias_(std::move(out_bias)), w_(std::move(w)), state_(std::move(state)) {
    TORCH_CHECK(s_.kc >= 2, "conv kernel must be at least 2, got ", s_.kc);
    TORCH_CHECK(s_.g >= 1 && s_.nh % s_.g == 0, "heads (", s_.nh, ") must be a multiple of groups (", s_.g, ")");
    check_packed(in_proj_, hidden_, s_.proj_width(), "in_proj");
    if (in_bias_.has_value()) check_vector(*in_bias_, s_.proj_width(), "in_proj bias");
    check_packed(out_proj_, s_.inner(), hidden_, "out_proj");
    if (out_bias_.has_value()) check_vector(*out_bias_, hidden_, "out_proj bias");
    check_float(w_.conv_weight, "conv_weight");
    if (w_.conv_bias.defined()) check_vector(w_.conv_bias, s_.conv_dim(), "conv bias");
    check_recurrent_tensors(w_.conv_weight, s_.conv_dim(), s_.kc, state_.conv, state_.rec, state_.conv_ckpt,
                            state_.rec_ckpt, {s_.nh, s_.n, s_.p}, "ssm_state", "ssm_checkpoints");
    check_vector(w_.neg_exp_a, s_.nh, "neg_exp_a");
    check_vector(w_.dt_bias, s_.nh, "dt_bias");
    check_vector(w_.d, s_.nh, "D");
    check_vector(w_.norm_weight, s_.inner(), "norm weight");
  }

  StepNeeds needs() const override { return state_.needs(); }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const torch::Tensor zxbcdt = packed_linear(h, in_proj_, in_bias_, s_.proj_width());
    watch.lap(StepPart::kLinears);
    state_.snapshot(step, 0);
    const torch::Tensor conv = mamba_conv_(s_, w_, zxbcdt, state_.conv, step.state_slots);
    const torch::Tensor y = mamba_ssm_(s_, w_, zxbcdt, conv, state_.rec, step.state_slots);
    state_.snapshot(step, 1);
    watch.lap(StepPart::kRecurrent);
    torch::Tensor o = packed_linear(y, out_proj_, out_bias_, hidden_);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  MambaShape s_;
  int64_t hidden_;
  torch::Tensor in_proj_;
  c10::optional<torch::Tensor> in_bias_;
  torch::Tensor out_proj_;
  c10::optional<torch::Tensor> out_bias_;
  MambaWeights w_;
  StateTensors state_;
};

}  // namespace

void bind_recurrent_layers(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<KdaStep, LayerStep, std::shared_ptr<KdaStep>>(m, "KdaStep")
      .def(py::init([](int64_t heads, int64_t head_dim, int64_t conv_kernel, int64_t hidden, torch::Tensor in_proj,
                       torch::Tensor o_proj, torch::Tensor conv_weight, torch::Tensor f_b, torch::Tensor g_b,
                       torch::Tensor dt_bias, torch::Tensor neg_exp_a, torch::Tensor o_norm, double norm_eps,
                       torch::Tensor conv_state, torch::Tensor rec_state, torch::Tensor conv_checkpoints,
                       torch::Tensor rec_checkpoints) {
             return std::make_shared<KdaStep>(
                 KdaShape{heads, head_dim, conv_kernel}, hidden, std::move(in_proj), std::move(o_proj),
                 KdaWeights{std::move(conv_weight), std::move(f_b), std::move(g_b), std::move(dt_bias),
                            std::move(neg_exp_a), std::move(o_norm), norm_eps},
                 StateTensors{std::move(conv_state), std::move(rec_state), std::move(conv_checkpoints),
                              std::move(rec_checkpoints)});
           }),
           py::arg("heads"), py::arg("head_dim"), py::arg("conv_kernel"), py::arg("hidden"), py::arg("in_proj"),
           py::arg("o_proj"), py::arg("conv_weight"), py::arg("f_b"), py::arg("g_b"), py::arg("dt_bias"),
           py::arg("neg_exp_a"), py::arg("o_norm"), py::arg("norm_eps"), py::arg("conv_state"), py::arg("rec_state"),
           py::arg("conv_checkpoints"), py::arg("rec_checkpoints"));
  py::class_<MambaStep, LayerStep, std::shared_ptr<MambaStep>>(m, "MambaStep")
      .def(py::init([](int64_t heads, int64_t head_dim, int64_t groups, int64_t state_size, int64_t conv_kernel,
                       int64_t hidden, torch::Tensor in_proj, c10::optional<torch::Tensor> in_bias,
                       torch::Tensor out_proj, c10::optional<torch::Tensor> out_bias, torch::Tensor conv_weight,
                       c10::optional<torch::Tensor> conv_bias, torch::Tensor neg_exp_a, torch::Tensor dt_bias,
                       torch::Tensor d, torch::Tensor norm_weight, double dt_min, double norm_eps,
                       torch::Tensor conv_state, torch::Tensor ssm_state, torch::Tensor conv_checkpoints,
                       torch::Tensor ssm_checkpoints) {
             return std::make_shared<MambaStep>(
                 MambaShape{heads, head_dim, groups, state_size, conv_kernel}, hidden, std::move(in_proj),
                 std::move(in_bias), std::move(out_proj), std::move(out_bias),
                 MambaWeights{std::move(conv_weight), conv_bias.value_or(torch::Tensor()), std::move(neg_exp_a),
                              std::move(dt_bias), std::move(d), std::move(norm_weight), dt_min, norm_eps},
                 StateTensors{std::move(conv_state), std::move(ssm_state), std::move(conv_checkpoints),
                              std::move(ssm_checkpoints)});
           }),
           py::arg("heads"), py::arg("head_dim"), py::arg("groups"), py::arg("state_size"), py::arg("conv_kernel"),
           py::arg("hidden"), py::arg("in_proj"), py::arg("in_bias"), py::arg("out_proj"), py::arg("out_bias"),
           py::arg("conv_weight"), py::arg("conv_bias"), py::arg("neg_exp_a"), py::arg("dt_bias"), py::arg("d"),
           py::arg("norm_weight"), py::arg("dt_min"), py::arg("norm_eps"), py::arg("conv_state"),
           py::arg("ssm_state"), py::arg("conv_checkpoints"), py::arg("ssm_checkpoints"));
}
