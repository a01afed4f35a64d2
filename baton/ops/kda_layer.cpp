// Kimi Delta Attention as a layer step of the fused decoder (fused_decoder.h), one token per row:
// in_proj, the short causal convs on q, k and v over each row's window, the delta rule over the
// row's state slot, the norm and the output gate, o_proj, with the bits of
// KimiDeltaAttention.forward's torch ops (baton/models/kimi_linear.py), and the checkpoints the
// step asks for taken before or after the row's token.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "step_common.h"

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

// KimiDeltaAttention.forward for one token per row. After the conv: l2norm of q and k, the
// per-channel decay (with a lower bound: lower_bound * sigmoid(exp(A_log) * raw)) and beta, the
// delta-rule step of each row over its slot's state [h, d, d], the RMS norm and the sigmoid output
// gate, run as forward's very ATen ops on the same views (their rounding is then torch's by
// construction), the delta rule with recurrent_scan_'s arithmetic.
class KdaStep : public RecurrentStep {
 public:
  explicit KdaStep(StepArgs& a) : s_{a.integer("heads"), a.integer("head_dim"), a.integer("conv_kernel")} {
    const int64_t hd = s_.hd();
    read_projections(a, a.integer("hidden"), s_.proj_width(), hd);
    std::vector<int64_t> columns(s_.channels());  // q, k and v: in_proj's first 3 hd columns
    for (int64_t c = 0; c < s_.channels(); ++c) columns[c] = c;
    read_conv_state(a, std::move(columns), s_.kc, {s_.h, s_.d, s_.d});
    f_b_ = a.linear("f_b", s_.d, hd);
    g_b_ = a.linear("g_b", s_.d, hd);
    dt_bias_ = a.vector("dt_bias", hd);
    if (a.has("lower_bound")) {  // GLM-5.3-Flash's safe gate
      lower_bound_ = a.real("lower_bound");
      exp_a_ = a.vector("exp_a", s_.h);
    } else {
      neg_exp_a_ = a.vector("neg_exp_a", s_.h);
    }
    o_norm_ = a.vector("o_norm", s_.d);
    eps_ = a.real("norm_eps");
  }

 private:
  torch::Tensor mix(const torch::Tensor&, const torch::Tensor& proj, const torch::Tensor& conv,
                    const StepBatch& step, StepStopwatch&) override {
    const int64_t n = proj.size(0), h = s_.h, d = s_.d, hd = s_.hd();
    const std::vector<torch::Tensor> parts = proj.split_with_sizes({3 * hd, d, d, h}, 1);  // qkv, f_a, g_a, b
    const std::vector<torch::Tensor> qkv = conv.view({n, 3, h, d}).unbind(1);
    const auto l2norm = [](const torch::Tensor& x) { return x / torch::sqrt((x * x).sum(-1, true) + 1e-6); };
    const torch::Tensor q = l2norm(qkv[0]) * std::pow(static_cast<double>(d), -0.5), k = l2norm(qkv[1]);
    const torch::Tensor raw = f_b_(parts[1].contiguous()).view({n, h, d}) + dt_bias_.view({h, d});
    const torch::Tensor decay = exp_a_.defined() ? vec_unary(exp_a_.unsqueeze(1) * raw, Sigmoid()) * lower_bound_
                                                 : neg_exp_a_.unsqueeze(1) * vec_unary(raw, Softplus());
    torch::Tensor out =
        recurrent_step_(q, k, qkv[2], decay, vec_unary(parts[3], Sigmoid()), state_.rec, step.state_slots);
    const torch::Tensor gate = g_b_(parts[2].contiguous()).view({n, h, d});
    out = out * torch::rsqrt(out.pow(2).mean(-1, true) + eps_) * o_norm_;
    return (out * vec_unary(gate, Sigmoid())).reshape({n, hd});
  }

  KdaShape s_;
  StepLinear f_b_, g_b_;   // f_b_proj, g_b_proj [hd, d]
  torch::Tensor dt_bias_;  // [hd]
  torch::Tensor neg_exp_a_;  // [h]: -exp(A_log)
  torch::Tensor exp_a_;      // [h]: exp(A_log), with a lower bound (the decay lower_bound * sigmoid(exp_a * raw))
  double lower_bound_ = 0.0;
  torch::Tensor o_norm_;   // [d]
  double eps_ = 1e-6;
};

}  // namespace

void bind_kda_layer(pybind11::module_& m) { bind_step<KdaStep>(m, "KdaStep"); }
