// Mamba2 as a layer step of the fused decoder (fused_decoder.h), one token per row: in_proj, the
// causal conv over each row's window, dt, the SSM step over the row's state slot, the skip, the
// gate and the grouped RMS norm, out_proj, each with the bits of Mamba2Mixer.forward's torch ops
// (baton/models/nemotron_h.py), and the checkpoints the step asks for taken before or after the
// row's token.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "step_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

// A layer's shapes: nh heads of dim p, g groups of B and C of size n, a causal conv of kernel kc
struct MambaShape {
  int64_t nh, p, g, n, kc;
  int64_t inner() const { return nh * p; }
  int64_t conv_dim() const { return inner() + 2 * g * n; }   // the conv's channels: x, B, C
  int64_t proj_width() const { return inner() + conv_dim() + nh; }  // in_proj's: z, xBC, dt
};

// Mamba2Dims.norm, by its index in NORM_MODES: the gate alone, the gate then the grouped RMS norm,
// or the norm then the gate
enum class MambaNorm : int64_t { kNone = 0, kAfterGate = 1, kBeforeGate = 2 };

struct MambaWeights {
  torch::Tensor neg_exp_a;    // [nh]: -exp(A_log)
  torch::Tensor dt_bias, d;   // [nh]
  torch::Tensor norm_weight;  // [inner]; undefined with MambaNorm::kNone
  MambaNorm norm = MambaNorm::kAfterGate;
  double dt_min = 0.0, dt_max = INFINITY, eps = 1e-5;
};

// The SSM step of each row over its slot's state in ssm_state [slots, nh, n, p], then + D x, the
// gate silu(z) and the grouped RMS norm with its weight in w.norm's order: [rows, inner], out_proj's input.
torch::Tensor mamba_ssm_(const MambaShape& s, const MambaWeights& w, const torch::Tensor& zxbcdt,
                         const torch::Tensor& conv, torch::Tensor& ssm_state, const std::vector<int64_t>& slots) {
  const int64_t rows = zxbcdt.size(0), nh = s.nh, p = s.p, n = s.n, inner = s.inner();
  const int64_t channels = s.conv_dim(), width = s.proj_width();
  const auto opts = zxbcdt.options();
  const float* zp = zxbcdt.data_ptr<float>();
  const float* cp = conv.data_ptr<float>();
  // dt = softplus(dt + dt_bias).clamp(dt_min, dt_max); decay = dt * -exp(A_log); v = x * dt
  torch::Tensor dt = torch::empty({rows, nh}, opts), decay = torch::empty({rows, nh}, opts),
                v = torch::empty({rows, nh, p}, opts);
  float* dtp = dt.data_ptr<float>();
  float* dp = decay.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float* dtb = w.dt_bias.data_ptr<float>();
  const float* nea = w.neg_exp_a.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < nh; ++h) dtp[t * nh + h] = zp[t * width + inner + channels + h] + dtb[h];
  vec_unary(dtp, dtp, rows * nh, Softplus());
  const float dt_min = static_cast<float>(w.dt_min), dt_max = static_cast<float>(w.dt_max);
  for (int64_t i = 0; i < rows * nh; ++i) {
    if (dtp[i] < dt_min) dtp[i] = dt_min;
    if (dtp[i] > dt_max) dtp[i] = dt_max;
    dp[i] = dtp[i] * nea[i % nh];
  }
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t j = 0; j < p; ++j) vp[(t * nh + h) * p + j] = cp[t * channels + h * p + j] * dtp[t * nh + h];
  // the scan step: C and B of each head's group, beside x in the conv's output
  const int64_t gn = s.g * n;
  const torch::Tensor b = conv.narrow(1, inner, gn).view({rows, s.g, n});
  const torch::Tensor c = conv.narrow(1, inner + gn, gn).view({rows, s.g, n});
  torch::Tensor y = recurrent_step_(c, b, v, decay, torch::Tensor(), ssm_state, slots);
  float* yp = y.data_ptr<float>();
  // y + D x; silu(z) of z, a view of in_proj's output with its rows apart
  torch::Tensor gate = torch::empty({rows, inner}, opts);
  float* gp = gate.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t) std::memcpy(gp + t * inner, zp + t * width, inner * sizeof(float));
  vec_unary(gp, gp, rows * inner, Silu());
  const float* dd = w.d.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t j = 0; j < p; ++j) {
        const int64_t i = (t * nh + h) * p + j;
        float skip = dd[h] * cp[t * channels + h * p + j];
        BATON_ROUNDED(skip);
        yp[i] = yp[i] + skip;
      }
  if (w.norm != MambaNorm::kBeforeGate)
    for (int64_t i = 0; i < rows * inner; ++i) yp[i] = yp[i] * gp[i];
  if (w.norm != MambaNorm::kNone) {  // the RMS norm per group, then its weight
    const int64_t m = inner / s.g;
    const float eps = static_cast<float>(w.eps), fm = static_cast<float>(m);
    const float* nw = w.norm_weight.data_ptr<float>();
    at::parallel_for(0, rows * s.g, std::max<int64_t>(1, 4096 / m), [&](int64_t begin, int64_t end) {
      std::vector<float> buf(m);
      for (int64_t i = begin; i < end; ++i) {
        float* o = yp + i * m;
        const float* wg = nw + i % s.g * m;
        for (int64_t j = 0; j < m; ++j) buf[j] = o[j] * o[j];
        const float inv = 1.f / std::sqrt(torch_row_sum(buf.data(), m) / fm + eps);
        for (int64_t j = 0; j < m; ++j) {
          const float normed = o[j] * inv;
          o[j] = wg[j] * normed;
        }
      }
    });
  }
  if (w.norm == MambaNorm::kBeforeGate)
    for (int64_t i = 0; i < rows * inner; ++i) yp[i] = yp[i] * gp[i];
  return y.view({rows, inner});
}

// Mamba2Mixer.forward for one token per row
class MambaStep : public RecurrentStep {
 public:
  explicit MambaStep(StepArgs& a)
      : s_{a.integer("heads"), a.integer("head_dim"), a.integer("groups"), a.integer("state_size"),
           a.integer("conv_kernel")} {
    TORCH_CHECK(s_.g >= 1 && s_.nh % s_.g == 0, "heads (", s_.nh, ") must be a multiple of groups (", s_.g, ")");
    read_projections(a, a.integer("hidden"), s_.proj_width(), s_.inner());
    std::vector<int64_t> columns(s_.conv_dim());  // xBC, after z
    for (int64_t c = 0; c < s_.conv_dim(); ++c) columns[c] = s_.inner() + c;
    read_conv_state(a, std::move(columns), s_.kc, {s_.nh, s_.n, s_.p});
    w_.neg_exp_a = a.vector("neg_exp_a", s_.nh);
    w_.dt_bias = a.vector("dt_bias", s_.nh);
    w_.d = a.vector("d", s_.nh);
    const int64_t norm = a.integer("norm");
    TORCH_CHECK(norm >= 0 && norm <= 2, "norm must be 0 (none), 1 (after the gate) or 2 (before it), got ", norm);
    w_.norm = static_cast<MambaNorm>(norm);
    w_.norm_weight = a.tensor("norm_weight");
    if (w_.norm != MambaNorm::kNone) check_vector(w_.norm_weight, s_.inner(), "norm_weight");
    TORCH_CHECK(w_.norm != MambaNorm::kNone || !w_.norm_weight.defined(), "norm_weight without a norm");
    w_.dt_min = a.real("dt_min");
    w_.dt_max = a.real("dt_max");
    TORCH_CHECK(w_.dt_min <= w_.dt_max, "dt_min (", w_.dt_min, ") must not exceed dt_max (", w_.dt_max, ")");
    w_.eps = a.real("norm_eps");
  }

 private:
  torch::Tensor mix(const torch::Tensor&, const torch::Tensor& zxbcdt, const torch::Tensor& conv,
                    const StepBatch& step, StepStopwatch&) override {
    return mamba_ssm_(s_, w_, zxbcdt, conv, state_.rec, step.state_slots);
  }

  MambaShape s_;
  MambaWeights w_;
};

}  // namespace

void bind_mamba_layer(pybind11::module_& m) { bind_step<MambaStep>(m, "MambaStep"); }
