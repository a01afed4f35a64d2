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

struct KdaWeights {
  torch::Tensor conv_weight;  // [3 hd, kc]
  StepLinear f_b, g_b;        // f_b_proj, g_b_proj [hd, d]
  torch::Tensor dt_bias;      // [hd]
  torch::Tensor neg_exp_a;    // [h]: -exp(A_log)
  torch::Tensor o_norm;       // [d]
  double eps = 1e-6;
};

// l2norm of q and k, the per-channel decay and beta, the delta-rule step of each row over its
// slot's state in rec_state [slots, h, d, d], the RMS norm and the sigmoid output gate:
// [rows, hd], o_proj's input.
// KimiDeltaAttention.forward's torch ops after the conv, run as the same ATen ops on the same
// views (their rounding is then torch's by construction); the delta rule with recurrent_scan_'s
// arithmetic, each row over its slot.
torch::Tensor kda_mix_(const KdaShape& s, const KdaWeights& w, const torch::Tensor& proj, const torch::Tensor& conv,
                       torch::Tensor& rec_state, const std::vector<int64_t>& slots) {
  const int64_t n = proj.size(0), h = s.h, d = s.d, hd = s.hd();
  const std::vector<torch::Tensor> parts = proj.split_with_sizes({3 * hd, d, d, h}, 1);  // qkv, f_a, g_a, b
  const std::vector<torch::Tensor> qkv = conv.view({n, 3, h, d}).unbind(1);
  const auto l2norm = [](const torch::Tensor& x) { return x / torch::sqrt((x * x).sum(-1, true) + 1e-6); };
  const torch::Tensor q = l2norm(qkv[0]) * std::pow(static_cast<double>(d), -0.5), k = l2norm(qkv[1]);
  const torch::Tensor raw = w.f_b(parts[1].contiguous()).view({n, h, d}) + w.dt_bias.view({h, d});
  const torch::Tensor decay = w.neg_exp_a.unsqueeze(1) * at::softplus(raw);
  torch::Tensor out = recurrent_step_(q, k, qkv[2], decay, parts[3].sigmoid(), rec_state, slots);
  const torch::Tensor gate = w.g_b(parts[2].contiguous()).view({n, h, d});
  out = out * torch::rsqrt(out.pow(2).mean(-1, true) + w.eps) * w.o_norm;
  return (out * gate.sigmoid()).reshape({n, hd});
}

// KimiDeltaAttention.forward for one token per row
class KdaStep : public LayerStep {
 public:
  explicit KdaStep(StepArgs& a) : s_{a.integer("heads"), a.integer("head_dim"), a.integer("conv_kernel")} {
    const int64_t hidden = a.integer("hidden"), hd = s_.hd();
    in_proj_ = a.linear("in_proj", hidden, s_.proj_width());
    o_proj_ = a.linear("o_proj", hd, hidden);
    w_.conv_weight = a.tensor("conv_weight");
    state_ = a.state(w_.conv_weight, s_.channels(), s_.kc, {s_.h, s_.d, s_.d});
    w_.f_b = a.linear("f_b", s_.d, hd);
    w_.g_b = a.linear("g_b", s_.d, hd);
    w_.dt_bias = a.vector("dt_bias", hd);
    w_.neg_exp_a = a.vector("neg_exp_a", s_.h);
    w_.o_norm = a.vector("o_norm", s_.d);
    w_.eps = a.real("norm_eps");
    for (int64_t c = 0; c < s_.channels(); ++c) conv_columns_.push_back(c);
  }

  StepNeeds needs() const override { return state_.needs(); }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const torch::Tensor proj = in_proj_(h);
    watch.lap(StepPart::kLinears);
    state_.snapshot(step, 0);
    const torch::Tensor conv =
        causal_conv_silu_(proj, conv_columns_, w_.conv_weight, torch::Tensor(), state_.conv, step.state_slots);
    const torch::Tensor out = kda_mix_(s_, w_, proj, conv, state_.rec, step.state_slots);
    state_.snapshot(step, 1);
    watch.lap(StepPart::kRecurrent);
    torch::Tensor o = o_proj_(out);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  KdaShape s_;
  StepLinear in_proj_, o_proj_;
  KdaWeights w_;
  StateTensors state_;
  std::vector<int64_t> conv_columns_;  // q, k and v: in_proj's first 3 hd columns
};

}  // namespace

void bind_kda_layer(pybind11::module_& m) { bind_step<KdaStep>(m, "KdaStep"); }
