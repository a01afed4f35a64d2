// Kimi Delta Attention as a layer step of the fused decoder (fused_decoder.h), one token per row:
// in_proj, the short causal convs on q, k and v over each row's window, the delta rule over the
// row's state slot, the norm and the output gate, o_proj, with the bits of
// KimiDeltaAttention.forward's torch ops (baton/models/kimi_linear.py), and the checkpoints the
// step asks for taken before or after the row's token.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "fused_decoder.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstring>
#include <vector>

namespace {

// A layer's shapes: h heads of dim d, short causal convs of kernel kc on q, k and v
struct KdaShape {
  int64_t h, d, kc;
  int64_t hd() const { return h * d; }
  int64_t channels() const { return 3 * hd(); }                 // the conv's: q, k, v
  int64_t proj_width() const { return 3 * hd() + 2 * d + h; }  // in_proj's: q, k, v, f_a, g_a, b
};

struct KdaWeights {
  torch::Tensor conv_weight;  // [3 hd, kc]
  torch::Tensor f_b, g_b;     // packed panels of f_b_proj, g_b_proj [hd, d]
  torch::Tensor dt_bias;      // [hd]
  torch::Tensor neg_exp_a;    // [h]: -exp(A_log)
  torch::Tensor o_norm;       // [d]
  double eps = 1e-6;
};

// silu(causal conv) [rows, 3 hd] of q, k, v in in_proj's output proj [rows, proj_width] over each
// row's window; the window of each row's slot shifts by one.
torch::Tensor kda_conv_(const KdaShape& s, const KdaWeights& w, const torch::Tensor& proj, torch::Tensor& conv_state,
                        const std::vector<int64_t>& slots) {
  const int64_t rows = proj.size(0), channels = s.channels(), km1 = s.kc - 1, width = s.proj_width();
  torch::Tensor conv = torch::empty({rows, channels}, proj.options());
  const float* src = proj.data_ptr<float>();
  const float* wp = w.conv_weight.data_ptr<float>();
  float* out = conv.data_ptr<float>();
  float* states = conv_state.data_ptr<float>();
  const int64_t state_stride = conv_state.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* st = states + slots[t] * state_stride;
      for (int64_t c = 0; c < channels; ++c)
        out[t * channels + c] = conv_window_step(wp + c * s.kc, st + c * km1, km1, src[t * width + c], 0.f);
    }
  });
  torch_unary(out, out, rows, channels, true, Silu());
  return conv;
}

// l2norm of q and k, the per-channel decay and beta, the delta-rule step of each row over its
// slot's state in rec_state [slots, h, d, d], the RMS norm and the sigmoid output gate:
// [rows, hd], o_proj's input.
// KimiDeltaAttention.forward's torch ops after the conv, run as the same ATen ops on the same
// views (their rounding is then torch's by construction); the delta rule one recurrent_scan_ per
// row, as scan_over_segments makes it.
torch::Tensor kda_mix_(const KdaShape& s, const KdaWeights& w, const torch::Tensor& proj, const torch::Tensor& conv,
                       torch::Tensor& rec_state, const std::vector<int64_t>& slots) {
  const int64_t n = proj.size(0), h = s.h, d = s.d, hd = s.hd();
  const std::vector<torch::Tensor> parts = proj.split_with_sizes({3 * hd, d, d, h}, 1);  // qkv, f_a, g_a, b
  const std::vector<torch::Tensor> qkv = conv.view({n, 3, h, d}).unbind(1);
  const auto l2norm = [](const torch::Tensor& x) { return x / torch::sqrt((x * x).sum(-1, true) + 1e-6); };
  const torch::Tensor q = l2norm(qkv[0]) * std::pow(static_cast<double>(d), -0.5), k = l2norm(qkv[1]);
  const torch::Tensor v = qkv[2].contiguous();
  const torch::Tensor raw =
      packed_linear(parts[1].contiguous(), w.f_b, c10::nullopt, hd).view({n, h, d}) + w.dt_bias.view({h, d});
  const torch::Tensor decay = w.neg_exp_a.unsqueeze(1) * at::softplus(raw);
  const torch::Tensor beta = parts[3].sigmoid();
  torch::Tensor out = torch::empty({n, h, d}, proj.options());
  for (int64_t t = 0; t < n; ++t) {
    torch::Tensor state = rec_state.select(0, slots[t]);
    out.narrow(0, t, 1).copy_(recurrent_scan_(q.narrow(0, t, 1).contiguous(), k.narrow(0, t, 1).contiguous(),
                                              v.narrow(0, t, 1), decay.narrow(0, t, 1).contiguous(),
                                              beta.narrow(0, t, 1).contiguous(), state));
  }
  const torch::Tensor gate = packed_linear(parts[2].contiguous(), w.g_b, c10::nullopt, hd).view({n, h, d});
  out = out * torch::rsqrt(out.pow(2).mean(-1, true) + w.eps) * w.o_norm;
  return (out * gate.sigmoid()).reshape({n, hd});
}

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

}  // namespace

void bind_kda_layer(pybind11::module_& m) {
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
}
