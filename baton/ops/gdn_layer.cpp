// Gated DeltaNet as a layer step of the fused decoder (fused_decoder.h), one token per row:
// in_proj_qkvz and in_proj_ba, the causal conv over each row's window, the gates, l2-normed q and
// k, one delta-rule step over the row's state slot, the gated norm, out_proj (gdn_step.h's stages,
// in GatedDeltaNet.forward's order), with the checkpoints the step asks for taken before or after
// the row's token.
#include "fused_decoder.h"
#include "gdn_step.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

namespace {

class GdnStep : public LayerStep {
 public:
  struct Weights {
    torch::Tensor qkvz, ba, out_proj;  // packed panels or GGUF blocks
    torch::Tensor conv_weight;         // [channels, kc]
    torch::Tensor neg_exp_a, dt_bias;  // [vh]: -exp(A_log), dt_bias
    torch::Tensor norm_weight;         // [dv]
    double norm_eps = 1e-6;
  };
  struct State {
    torch::Tensor conv, rec;            // [slots, channels, kc - 1], [slots, vh, dk, dv]
    torch::Tensor conv_ckpt, rec_ckpt;  // [checkpoints, ...] alike
  };

  GdnStep(GdnShape shape, int64_t hidden, Weights w, State state)
      : s_(shape), hidden_(hidden), w_(std::move(w)), state_(std::move(state)) {
    TORCH_CHECK(s_.kh >= 1 && s_.vh % s_.kh == 0, "value heads (", s_.vh, ") must be a multiple of key heads (", s_.kh,
                ")");
    TORCH_CHECK(s_.kc >= 2, "conv kernel must be at least 2, got ", s_.kc);
    check_packed(w_.qkvz, hidden_, s_.kh * s_.group_width(), "in_proj_qkvz");
    check_packed(w_.ba, hidden_, 2 * s_.vh, "in_proj_ba");
    check_packed(w_.out_proj, s_.value_dim(), hidden_, "out_proj");
    check_float(w_.conv_weight, "conv_weight");
    check_recurrent_tensors(w_.conv_weight, s_.channels(), s_.kc, state_.conv, state_.rec, state_.conv_ckpt,
                            state_.rec_ckpt, {s_.vh, s_.dk, s_.dv}, "rec_state", "rec_checkpoints");
    check_vector(w_.neg_exp_a, s_.vh, "neg_exp_a");
    check_vector(w_.dt_bias, s_.vh, "dt_bias");
    check_vector(w_.norm_weight, s_.dv, "norm_weight");
  }

  StepNeeds needs() const override {
    StepNeeds n;
    n.state_slots = state_.conv.size(0);
    n.checkpoints = state_.conv_ckpt.size(0);
    return n;
  }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const int64_t n = h.size(0);
    const torch::Tensor qkvz = packed_linear(h, w_.qkvz, c10::nullopt, s_.kh * s_.group_width());
    const torch::Tensor ba = packed_linear(h, w_.ba, c10::nullopt, 2 * s_.vh);
    watch.lap(StepPart::kLinears);
    snapshot(step, 0);
    const torch::Tensor conv = gdn_conv_(s_, qkvz, w_.conv_weight, state_.conv, step.state_slots);
    const GdnGates gates = gdn_gates(s_, qkvz, ba, w_.neg_exp_a, w_.dt_bias);
    const auto [qn, kn] = gdn_qk_l2norm(s_, conv);
    torch::Tensor out = gdn_delta_rule_(s_, conv, qn, kn, gates, state_.rec, step.state_slots);
    snapshot(step, 1);
    gdn_gated_norm_(s_, out, gates.z, w_.norm_weight, w_.norm_eps);
    watch.lap(StepPart::kRecurrent);
    torch::Tensor o = packed_linear(out.view({n, s_.value_dim()}), w_.out_proj, c10::nullopt, hidden_);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  // the checkpoints of this layer's state taken `offset` rows into their row (0: before its token)
  void snapshot(const StepBatch& step, int64_t offset) {
    snapshot_states(state_.conv_ckpt, state_.rec_ckpt, state_.conv, state_.rec, step.state_slots, step.snapshot_rows,
                    step.snapshot_offsets, step.snapshot_ids, offset);
  }

  GdnShape s_;
  int64_t hidden_;
  Weights w_;
  State state_;
};

}  // namespace

void bind_gdn_layer(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<GdnStep, LayerStep, std::shared_ptr<GdnStep>>(m, "GdnStep")
      .def(py::init([](int64_t key_heads, int64_t value_heads, int64_t key_dim, int64_t value_dim, int64_t conv_kernel,
                       int64_t hidden, torch::Tensor qkvz, torch::Tensor ba, torch::Tensor out_proj,
                       torch::Tensor conv_weight, torch::Tensor neg_exp_a, torch::Tensor dt_bias,
                       torch::Tensor norm_weight, double norm_eps, torch::Tensor conv_state, torch::Tensor rec_state,
                       torch::Tensor conv_checkpoints, torch::Tensor rec_checkpoints) {
             return std::make_shared<GdnStep>(
                 GdnShape{key_heads, value_heads, key_dim, value_dim, conv_kernel}, hidden,
                 GdnStep::Weights{std::move(qkvz), std::move(ba), std::move(out_proj), std::move(conv_weight),
                                  std::move(neg_exp_a), std::move(dt_bias), std::move(norm_weight), norm_eps},
                 GdnStep::State{std::move(conv_state), std::move(rec_state), std::move(conv_checkpoints),
                                std::move(rec_checkpoints)});
           }),
           py::arg("key_heads"), py::arg("value_heads"), py::arg("key_dim"), py::arg("value_dim"),
           py::arg("conv_kernel"), py::arg("hidden"), py::arg("qkvz"), py::arg("ba"), py::arg("out_proj"),
           py::arg("conv_weight"), py::arg("neg_exp_a"), py::arg("dt_bias"), py::arg("norm_weight"),
           py::arg("norm_eps"), py::arg("conv_state"), py::arg("rec_state"), py::arg("conv_checkpoints"),
           py::arg("rec_checkpoints"));
}
