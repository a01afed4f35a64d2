// Mamba2 as a layer step of the fused decoder (fused_decoder.h), one token per row: in_proj, the
// causal conv over each row's window, dt, the SSM step over the row's state slot, the skip, the
// gate and the grouped RMS norm, out_proj, each with the bits of Mamba2Mixer.forward's torch ops
// (baton/models/nemotron_h.py), and the checkpoints the step asks for taken before or after the
// row's token.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "fused_decoder.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

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

struct MambaWeights {
  torch::Tensor conv_weight;  // [conv_dim, kc]
  torch::Tensor conv_bias;    // [conv_dim] or undefined
  torch::Tensor neg_exp_a;    // [nh]: -exp(A_log)
  torch::Tensor dt_bias, d;   // [nh]
  torch::Tensor norm_weight;  // [inner]
  double dt_min = 0.0, eps = 1e-5;
};

// One SSM step (recurrent_scan_'s one-pass arithmetic at T = 1, the same per lane) of one head
// over the columns [j0, j0 + width) of its state s [n, p]: S = S * g + B (x) v; out = C S.
template <int64_t NV, bool Partial>
void ssm_step(const float* c, const float* b, const float* v, float g, float* s, float* out, int64_t n, int64_t p,
              int64_t j0, int64_t last) {
  const auto load = [&](const float* ptr, int64_t k) {
    return (Partial && k == NV - 1) ? Vec::loadu(ptr + k * kVS, last) : Vec::loadu(ptr + k * kVS);
  };
  const auto store = [&](const Vec& x, float* ptr, int64_t k) {
    if (Partial && k == NV - 1)
      x.store(ptr + k * kVS, last);
    else
      x.store(ptr + k * kVS);
  };
  float* sb = s + j0;
  const Vec gv(g);
  Vec vv[NV], o[NV];
  for (int64_t k = 0; k < NV; ++k) {
    vv[k] = load(v + j0, k);
    o[k] = Vec(0.f);
  }
  for (int64_t i = 0; i < n; ++i) {
    const Vec bi(b[i]), ci(c[i]);
    float* row = sb + i * p;
    for (int64_t k = 0; k < NV; ++k) {
      const Vec x = at::vec::fmadd(bi, vv[k], load(row, k) * gv);
      store(x, row, k);
      o[k] = at::vec::fmadd(ci, x, o[k]);
    }
  }
  for (int64_t k = 0; k < NV; ++k) store(o[k], out + j0, k);
}

constexpr int64_t kBlockVecs = 4;  // state columns per task, in vectors (the kernel above goes to 4)

using SsmKernel = decltype(&ssm_step<1, false>);
constexpr SsmKernel kSsmKernels[kBlockVecs][2] = {{&ssm_step<1, false>, &ssm_step<1, true>},
                                                  {&ssm_step<2, false>, &ssm_step<2, true>},
                                                  {&ssm_step<3, false>, &ssm_step<3, true>},
                                                  {&ssm_step<4, false>, &ssm_step<4, true>}};

// silu(causal conv) [rows, conv_dim] of xBC in in_proj's output zxbcdt [rows, proj_width] over
// each row's window; the window of each row's slot shifts by one.
torch::Tensor mamba_conv_(const MambaShape& s, const MambaWeights& w, const torch::Tensor& zxbcdt,
                          torch::Tensor& conv_state, const std::vector<int64_t>& slots) {
  const int64_t rows = zxbcdt.size(0), channels = s.conv_dim(), km1 = s.kc - 1, width = s.proj_width();
  torch::Tensor conv = torch::empty({rows, channels}, zxbcdt.options());
  const float* src = zxbcdt.data_ptr<float>() + s.inner();
  const float* wp = w.conv_weight.data_ptr<float>();
  const float* bias = w.conv_bias.defined() ? w.conv_bias.data_ptr<float>() : nullptr;
  float* out = conv.data_ptr<float>();
  float* states = conv_state.data_ptr<float>();
  const int64_t state_stride = conv_state.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* st = states + slots[t] * state_stride;
      for (int64_t c = 0; c < channels; ++c)
        out[t * channels + c] =
            conv_window_step(wp + c * s.kc, st + c * km1, km1, src[t * width + c], bias ? bias[c] : 0.f);
    }
  });
  torch_unary(out, out, rows, channels, true, Silu());
  return conv;
}

// The SSM step of each row over its slot's state in ssm_state [slots, nh, n, p], then + D x, the
// gate silu(z), the grouped RMS norm and its weight: [rows, inner], out_proj's input.
torch::Tensor mamba_ssm_(const MambaShape& s, const MambaWeights& w, const torch::Tensor& zxbcdt,
                         const torch::Tensor& conv, torch::Tensor& ssm_state, const std::vector<int64_t>& slots) {
  const int64_t rows = zxbcdt.size(0), nh = s.nh, p = s.p, n = s.n, inner = s.inner();
  const int64_t channels = s.conv_dim(), width = s.proj_width(), heads_per_group = nh / s.g;
  const auto opts = zxbcdt.options();
  const float* zp = zxbcdt.data_ptr<float>();
  const float* cp = conv.data_ptr<float>();
  // dt = softplus(dt + dt_bias).clamp(min=dt_min); decay = dt * -exp(A_log); v = x * dt
  torch::Tensor dt = torch::empty({rows, nh}, opts), decay = torch::empty({rows, nh}, opts),
                v = torch::empty({rows, nh, p}, opts);
  float* dtp = dt.data_ptr<float>();
  float* dp = decay.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const float* dtb = w.dt_bias.data_ptr<float>();
  const float* nea = w.neg_exp_a.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < nh; ++h) dtp[t * nh + h] = zp[t * width + inner + channels + h] + dtb[h];
  torch_unary(dtp, dtp, rows, nh, true, Softplus());
  const float dt_min = static_cast<float>(w.dt_min);
  for (int64_t i = 0; i < rows * nh; ++i) {
    if (dtp[i] < dt_min) dtp[i] = dt_min;
    dp[i] = dtp[i] * nea[i % nh];
  }
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t j = 0; j < p; ++j) vp[(t * nh + h) * p + j] = cp[t * channels + h * p + j] * dtp[t * nh + h];
  // the scan step, in (row, head, column block) tasks
  torch::Tensor y = torch::empty({rows, nh, p}, opts);
  float* yp = y.data_ptr<float>();
  float* states = ssm_state.data_ptr<float>();
  const int64_t state_stride = ssm_state.stride(0);
  constexpr int64_t block = kBlockVecs * kVS;
  const int64_t blocks = (p + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, n * std::min(p, block)));
  at::parallel_for(0, rows * nh * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / (nh * blocks), h = task / blocks % nh, j0 = task % blocks * block;
      const int64_t cols = std::min(block, p - j0), nv = (cols + kVS - 1) / kVS, last = cols - (nv - 1) * kVS;
      const float* bc = cp + t * channels + inner + h / heads_per_group * n;  // B of head h's group
      float g[kVS];  // exp(decay) as recurrent_scan_ takes it: the vector exp
      Vec(dp[t * nh + h]).exp().store(g);
      kSsmKernels[nv - 1][last < kVS](bc + s.g * n, bc, vp + (t * nh + h) * p, g[0],
                                      states + slots[t] * state_stride + h * n * p, yp + (t * nh + h) * p, n, p,
                                      j0, last);
    }
  });
  // y + D x, times silu(z): z is a view of in_proj's output, its rows apart
  torch::Tensor gate = torch::empty({rows, inner}, opts);
  float* gp = gate.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t) std::memcpy(gp + t * inner, zp + t * width, inner * sizeof(float));
  torch_unary(gp, gp, rows, inner, false, Silu());
  const float* dd = w.d.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t j = 0; j < p; ++j) {
        const int64_t i = (t * nh + h) * p + j;
        float skip = dd[h] * cp[t * channels + h * p + j];
        BATON_ROUNDED(skip);
        const float sum = yp[i] + skip;
        yp[i] = sum * gp[i];
      }
  // the gated RMS norm per group, then its weight
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
  return y.view({rows, inner});
}

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

void bind_mamba_layer(pybind11::module_& m) {
  namespace py = pybind11;
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
