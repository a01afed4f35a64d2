// Gated DeltaNet as a layer step of the fused decoder (fused_decoder.h), one token per row:
// in_proj_qkvz and in_proj_ba, the causal conv over each row's window, the gates, l2-normed q and
// k, one delta-rule step over the row's state slot, the gated norm, out_proj, in
// GatedDeltaNet.forward's order, each stage with the bits of its torch ops (torch_rounding.h),
// with the checkpoints the step asks for taken before or after the row's token.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "step_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <utility>
#include <vector>

namespace {

// A layer's shapes: kh key heads of dim dk, vh value heads of dim dv, a causal conv of kernel kc
struct GdnShape {
  int64_t kh, vh, dk, dv, kc;
  int64_t r() const { return vh / kh; }  // value heads per key head
  int64_t key_dim() const { return kh * dk; }
  int64_t value_dim() const { return vh * dv; }
  int64_t channels() const { return 2 * key_dim() + value_dim(); }  // the conv's: q, k, v; then z in qkvz
};

struct GdnGates {
  torch::Tensor z;      // [n, vh * dv]: silu(z), the gated norm's gate
  torch::Tensor beta;   // [n, vh]: sigmoid(b)
  torch::Tensor decay;  // [n, vh]: -exp(A_log) * softplus(a + dt_bias)
};

// x * rsqrt((x * x).sum() + eps) over a row of n floats (l2norm), then * scale when scale != 1
void l2norm_row(const float* x, float* out, int64_t n, float eps, float scale, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = x[i] * x[i];
  const float inv = 1.f / std::sqrt(torch_row_sum(buf, n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
  if (scale != 1.f)
    for (int64_t i = 0; i < n; ++i) out[i] = out[i] * scale;
}

// The gates from qkvz (z, its last vh * dv columns) and in_proj_ba's output ba [n, 2 * vh] (b | a),
// each copied to a contiguous [n, *] tensor; the module's z and b are narrow views with rows apart,
// which is how torch runs the elementwise ops over them (row by row).
GdnGates gdn_gates(const GdnShape& s, const torch::Tensor& qkvz, const torch::Tensor& ba,
                   const torch::Tensor& neg_exp_a, const torch::Tensor& dt_bias) {
  const int64_t n = qkvz.size(0), vh = s.vh, value_dim = s.value_dim(), width = s.channels() + value_dim;
  const auto opts = qkvz.options();
  torch::Tensor z = torch::empty({n, value_dim}, opts), beta = torch::empty({n, vh}, opts),
                decay = torch::empty({n, vh}, opts);
  const float* src = qkvz.data_ptr<float>();
  const float* bap = ba.data_ptr<float>();
  float* zp = z.data_ptr<float>();
  float* bp = beta.data_ptr<float>();
  float* dp = decay.data_ptr<float>();
  const float* dt = dt_bias.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t) {
    std::memcpy(zp + t * value_dim, src + t * width + s.channels(), value_dim * sizeof(float));
    std::memcpy(bp + t * vh, bap + t * 2 * vh, vh * sizeof(float));
    for (int64_t j = 0; j < vh; ++j) dp[t * vh + j] = bap[t * 2 * vh + vh + j] + dt[j];  // a + dt_bias
  }
  vec_unary(bp, bp, n * vh, Sigmoid());
  vec_unary(dp, dp, n * vh, Softplus());
  const float* nea = neg_exp_a.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < vh; ++j) dp[t * vh + j] = nea[j] * dp[t * vh + j];
  vec_unary(zp, zp, n * value_dim, Silu());  // F.silu(gate) of the gated norm
  return {z, beta, decay};
}

// l2norm(q) * dk^-0.5 and l2norm(k), each [n, kh, dk], from the conv's output
std::pair<torch::Tensor, torch::Tensor> gdn_qk_l2norm(const GdnShape& s, const torch::Tensor& conv) {
  const int64_t n = conv.size(0), kh = s.kh, dk = s.dk, key_dim = s.key_dim(), channels = s.channels();
  torch::Tensor qn = torch::empty({n, kh, dk}, conv.options()), kn = torch::empty({n, kh, dk}, conv.options());
  const float* src = conv.data_ptr<float>();
  float* qp = qn.data_ptr<float>();
  float* kp = kn.data_ptr<float>();
  const float q_scale = static_cast<float>(std::pow(static_cast<double>(dk), -0.5));
  at::parallel_for(0, n * kh, std::max<int64_t>(1, 4096 / dk), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dk);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / kh, g = i % kh;
      l2norm_row(src + t * channels + g * dk, qp + i * dk, dk, 1e-6f, q_scale, buf.data());
      l2norm_row(src + t * channels + key_dim + g * dk, kp + i * dk, dk, 1e-6f, 1.f, buf.data());
    }
  });
  return {qn, kn};
}

// Gated RMS norm of out [n, vh, dv] in place: x * rsqrt(mean(x^2) + eps) * weight * silu(z)
void gdn_gated_norm_(const GdnShape& s, torch::Tensor& out, const torch::Tensor& z, const torch::Tensor& weight,
                     double eps_in) {
  const int64_t n = out.size(0), vh = s.vh, dv = s.dv;
  float* op = out.data_ptr<float>();
  const float* zp = z.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float eps = static_cast<float>(eps_in), fdv = static_cast<float>(dv);
  at::parallel_for(0, n * vh, std::max<int64_t>(1, 4096 / dv), [&](int64_t begin, int64_t end) {
    std::vector<float> buf(dv);
    for (int64_t i = begin; i < end; ++i) {
      float* o = op + i * dv;
      const float* zr = zp + i * dv;
      for (int64_t j = 0; j < dv; ++j) buf[j] = o[j] * o[j];
      const float inv = 1.f / std::sqrt(torch_row_sum(buf.data(), dv) / fdv + eps);
      for (int64_t j = 0; j < dv; ++j) {
        const float normed = o[j] * inv;
        const float weighted = w[j] * normed;
        o[j] = weighted * zr[j];
      }
    }
  });
}

class GdnStep : public RecurrentStep {
 public:
  explicit GdnStep(StepArgs& a)
      : s_{a.integer("key_heads"), a.integer("value_heads"), a.integer("key_dim"), a.integer("value_dim"),
           a.integer("conv_kernel")} {
    TORCH_CHECK(s_.kh >= 1 && s_.vh % s_.kh == 0, "value heads (", s_.vh, ") must be a multiple of key heads (", s_.kh,
                ")");
    const int64_t hidden = a.integer("hidden");
    read_projections(a, hidden, s_.channels() + s_.value_dim(), s_.value_dim());  // in_proj: in_proj_qkvz
    std::vector<int64_t> columns(s_.channels());  // conv channel c is in_proj_qkvz's column c
    std::iota(columns.begin(), columns.end(), 0);
    read_conv_state(a, std::move(columns), s_.kc, {s_.vh, s_.dk, s_.dv});
    ba_ = a.linear("ba", hidden, 2 * s_.vh);
    neg_exp_a_ = a.vector("neg_exp_a", s_.vh);
    dt_bias_ = a.vector("dt_bias", s_.vh);
    norm_weight_ = a.vector("norm_weight", s_.dv);
    norm_eps_ = a.real("norm_eps");
  }

 private:
  torch::Tensor mix(const torch::Tensor& h, const torch::Tensor& qkvz, const torch::Tensor& conv,
                    const StepBatch& step, StepStopwatch& watch) override {
    const int64_t n = h.size(0);
    const torch::Tensor ba = ba_(h);
    watch.lap(StepPart::kLinears);
    const GdnGates gates = gdn_gates(s_, qkvz, ba, neg_exp_a_, dt_bias_);
    const auto [qn, kn] = gdn_qk_l2norm(s_, conv);
    const torch::Tensor v = conv.narrow(1, 2 * s_.key_dim(), s_.value_dim()).view({n, s_.vh, s_.dv});
    torch::Tensor out = recurrent_step_(qn, kn, v, gates.decay, gates.beta, state_.rec, step.state_slots);
    gdn_gated_norm_(s_, out, gates.z, norm_weight_, norm_eps_);
    return out.view({n, s_.value_dim()});
  }

  GdnShape s_;
  StepLinear ba_;
  torch::Tensor neg_exp_a_, dt_bias_;  // [vh]: -exp(A_log), dt_bias
  torch::Tensor norm_weight_;        // [dv]
  double norm_eps_ = 1e-6;
};

}  // namespace

void bind_gdn_layer(pybind11::module_& m) { bind_step<GdnStep>(m, "GdnStep"); }
