// Gated DeltaNet as a layer step of the fused decoder (fused_decoder.h), one token per row:
// in_proj_qkvz and in_proj_ba, the causal conv over each row's window, the gates, l2-normed q and
// k, one delta-rule step over the row's state slot, the gated norm, out_proj, in
// GatedDeltaNet.forward's order, each stage with the bits of its torch ops (torch_rounding.h),
// with the checkpoints the step asks for taken before or after the row's token.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "fused_decoder.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

namespace {

// A layer's shapes: kh key heads of dim dk, vh value heads of dim dv, a causal conv of kernel kc
struct GdnShape {
  int64_t kh, vh, dk, dv, kc;
  int64_t r() const { return vh / kh; }  // value heads per key head
  int64_t key_dim() const { return kh * dk; }
  int64_t value_dim() const { return vh * dv; }
  int64_t channels() const { return 2 * key_dim() + value_dim(); }  // the conv's: q, k, v
  int64_t group_width() const { return 2 * dk + 2 * r() * dv; }     // a key head's q, k, v, z in qkvz
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

// One delta-rule step (recurrent_scan_ at T = 1, the same arithmetic per lane) of one head over
// the columns [j0, j0 + width) of its state s [dk, dv]: S *= g; delta = (v - k S) * beta;
// S += k (x) delta; out = q S.
template <int64_t NV, bool Partial>
void delta_step(const float* q, const float* k, const float* v, float g, float beta, float* s, float* out, int64_t dk,
                int64_t dv, int64_t j0, int64_t last) {
  const auto load = [&](const float* p, int64_t b) {
    return (Partial && b == NV - 1) ? Vec::loadu(p + b * kVS, last) : Vec::loadu(p + b * kVS);
  };
  const auto store = [&](const Vec& x, float* p, int64_t b) {
    if (Partial && b == NV - 1)
      x.store(p + b * kVS, last);
    else
      x.store(p + b * kVS);
  };
  float* sb = s + j0;
  const Vec gv(g);
  Vec mem[NV], o[NV];
  for (int64_t b = 0; b < NV; ++b) mem[b] = o[b] = Vec(0.f);
  for (int64_t i = 0; i < dk; ++i) {
    const Vec ki(k[i]);
    float* row = sb + i * dv;
    for (int64_t b = 0; b < NV; ++b) {
      const Vec x = load(row, b) * gv;
      store(x, row, b);
      mem[b] = at::vec::fmadd(ki, x, mem[b]);
    }
  }
  const Vec bt(beta);
  Vec delta[NV];
  for (int64_t b = 0; b < NV; ++b) delta[b] = (load(v + j0, b) - mem[b]) * bt;
  for (int64_t i = 0; i < dk; ++i) {
    const Vec ki(k[i]), qi(q[i]);
    float* row = sb + i * dv;
    for (int64_t b = 0; b < NV; ++b) {
      const Vec x = at::vec::fmadd(ki, delta[b], load(row, b));
      store(x, row, b);
      o[b] = at::vec::fmadd(qi, x, o[b]);
    }
  }
  for (int64_t b = 0; b < NV; ++b) store(o[b], out + j0, b);
}

constexpr int64_t kBlockVecs = 4;  // state columns per task, in vectors (the kernels above go to 4)

using DeltaKernel = decltype(&delta_step<1, false>);
constexpr DeltaKernel kDeltaKernels[kBlockVecs][2] = {{&delta_step<1, false>, &delta_step<1, true>},
                                                      {&delta_step<2, false>, &delta_step<2, true>},
                                                      {&delta_step<3, false>, &delta_step<3, true>},
                                                      {&delta_step<4, false>, &delta_step<4, true>}};

// silu(causal conv) [n, channels] of q, k, v from in_proj_qkvz's output qkvz [n, kh * group width]
// over each row's window [conv_state | x]; the window of each row's slot shifts by one. The
// depthwise conv as oneDNN sums it: k ascending, one FMA each from zero.
torch::Tensor gdn_conv_(const GdnShape& s, const torch::Tensor& qkvz, const torch::Tensor& conv_weight,
                        torch::Tensor& conv_state, const std::vector<int64_t>& slots) {
  const int64_t n = qkvz.size(0), kh = s.kh, dk = s.dk, dv = s.dv, r = s.r();
  const int64_t key_dim = s.key_dim(), channels = s.channels(), kc = s.kc, group_width = s.group_width();
  torch::Tensor conv = torch::empty({n, channels}, qkvz.options());
  {
    const float* src = qkvz.data_ptr<float>();
    const float* w = conv_weight.data_ptr<float>();
    float* out = conv.data_ptr<float>();
    float* states = conv_state.data_ptr<float>();
    const int64_t state_stride = conv_state.stride(0), km1 = kc - 1;
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* row = src + t * kh * group_width;
        float* st = states + slots[t] * state_stride;
        for (int64_t c = 0; c < channels; ++c) {
          int64_t col;  // _split: the column of in_proj_qkvz's output that feeds channel c
          if (c < 2 * key_dim) {
            const int64_t part = c / key_dim, cc = c % key_dim;
            col = cc / dk * group_width + part * dk + cc % dk;
          } else {
            const int64_t cc = c - 2 * key_dim;
            col = cc / (r * dv) * group_width + 2 * dk + cc % (r * dv);
          }
          out[t * channels + c] = conv_window_step(w + c * kc, st + c * km1, km1, row[col], 0.f);
        }
      }
    });
  }
  float* cp = conv.data_ptr<float>();
  torch_unary(cp, cp, n, channels, true, Silu());
  return conv;
}

// The gates from qkvz (z) and in_proj_ba's output ba [n, 2 * vh] (b, a): z, b and a as the
// module's contiguous [n, *] tensors; when there is one key head its reshape is a view with rows
// apart, which is how torch runs the elementwise ops over them.
GdnGates gdn_gates(const GdnShape& s, const torch::Tensor& qkvz, const torch::Tensor& ba,
                   const torch::Tensor& neg_exp_a, const torch::Tensor& dt_bias) {
  const int64_t n = qkvz.size(0), kh = s.kh, vh = s.vh, dk = s.dk, dv = s.dv, r = s.r();
  const int64_t value_dim = s.value_dim(), group_width = s.group_width();
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
    for (int64_t g = 0; g < kh; ++g) {
      std::memcpy(zp + t * value_dim + g * r * dv, src + t * kh * group_width + g * group_width + 2 * dk + r * dv,
                  r * dv * sizeof(float));
      for (int64_t j = 0; j < r; ++j) {
        bp[t * vh + g * r + j] = bap[t * 2 * vh + g * 2 * r + j];
        dp[t * vh + g * r + j] = bap[t * 2 * vh + g * 2 * r + r + j] + dt[g * r + j];  // a + dt_bias
      }
    }
  }
  const bool coalesced = kh > 1;
  torch_unary(bp, bp, n, vh, coalesced, Sigmoid());
  torch_unary(dp, dp, n, vh, true, Softplus());  // a + dt_bias is a fresh contiguous tensor
  const float* nea = neg_exp_a.data_ptr<float>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t j = 0; j < vh; ++j) dp[t * vh + j] = nea[j] * dp[t * vh + j];
  torch_unary(zp, zp, n, value_dim, coalesced, Silu());  // F.silu(gate) of the gated norm
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

// One delta-rule step per row and value head over the state of its slot in rec_state [slots, vh,
// dk, dv], v from the conv's output: returns out [n, vh, dv]; in (row, head, column block) tasks.
torch::Tensor gdn_delta_rule_(const GdnShape& s, const torch::Tensor& conv, const torch::Tensor& qn,
                              const torch::Tensor& kn, const GdnGates& gates, torch::Tensor& rec_state,
                              const std::vector<int64_t>& slots) {
  const int64_t n = conv.size(0), kh = s.kh, vh = s.vh, dk = s.dk, dv = s.dv, r = s.r();
  const int64_t key_dim = s.key_dim(), channels = s.channels();
  torch::Tensor out = torch::empty({n, vh, dv}, conv.options());
  constexpr int64_t block = kBlockVecs * kVS;
  const int64_t blocks = (dv + block - 1) / block;
  const float* src = conv.data_ptr<float>();
  const float* qp = qn.data_ptr<float>();
  const float* kp = kn.data_ptr<float>();
  const float* bp = gates.beta.data_ptr<float>();
  const float* dp = gates.decay.data_ptr<float>();
  float* states = rec_state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t state_stride = rec_state.stride(0);
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, dk * std::min(dv, block)));
  at::parallel_for(0, n * vh * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / (vh * blocks), hd = task / blocks % vh, j0 = task % blocks * block;
      const int64_t width = std::min(block, dv - j0), nv = (width + kVS - 1) / kVS, last = width - (nv - 1) * kVS;
      const int64_t kq = (t * kh + hd / r) * dk;
      // exp(decay) as recurrent_scan_ takes it: the vector exp
      float g[kVS];
      Vec(dp[t * vh + hd]).exp().store(g);
      kDeltaKernels[nv - 1][last < kVS](qp + kq, kp + kq, src + t * channels + 2 * key_dim + hd * dv, g[0],
                                        bp[t * vh + hd], states + slots[t] * state_stride + hd * dk * dv,
                                        op + (t * vh + hd) * dv, dk, dv, j0, last);
    }
  });
  return out;
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

class GdnStep : public LayerStep {
 public:
  struct Weights {
    torch::Tensor qkvz, ba, out_proj;  // packed panels or GGUF blocks
    torch::Tensor conv_weight;         // [channels, kc]
    torch::Tensor neg_exp_a, dt_bias;  // [vh]: -exp(A_log), dt_bias
    torch::Tensor norm_weight;         // [dv]
    double norm_eps = 1e-6;
  };
  // state: conv [slots, channels, kc - 1], rec [slots, vh, dk, dv], checkpoints alike
  GdnStep(GdnShape shape, int64_t hidden, Weights w, StateTensors state)
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

  StepNeeds needs() const override { return state_.needs(); }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const int64_t n = h.size(0);
    const torch::Tensor qkvz = packed_linear(h, w_.qkvz, c10::nullopt, s_.kh * s_.group_width());
    const torch::Tensor ba = packed_linear(h, w_.ba, c10::nullopt, 2 * s_.vh);
    watch.lap(StepPart::kLinears);
    state_.snapshot(step, 0);
    const torch::Tensor conv = gdn_conv_(s_, qkvz, w_.conv_weight, state_.conv, step.state_slots);
    const GdnGates gates = gdn_gates(s_, qkvz, ba, w_.neg_exp_a, w_.dt_bias);
    const auto [qn, kn] = gdn_qk_l2norm(s_, conv);
    torch::Tensor out = gdn_delta_rule_(s_, conv, qn, kn, gates, state_.rec, step.state_slots);
    state_.snapshot(step, 1);
    gdn_gated_norm_(s_, out, gates.z, w_.norm_weight, w_.norm_eps);
    watch.lap(StepPart::kRecurrent);
    torch::Tensor o = packed_linear(out.view({n, s_.value_dim()}), w_.out_proj, c10::nullopt, hidden_);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  GdnShape s_;
  int64_t hidden_;
  Weights w_;
  StateTensors state_;
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
                 StateTensors{std::move(conv_state), std::move(rec_state), std::move(conv_checkpoints),
                              std::move(rec_checkpoints)});
           }),
           py::arg("key_heads"), py::arg("value_heads"), py::arg("key_dim"), py::arg("value_dim"),
           py::arg("conv_kernel"), py::arg("hidden"), py::arg("qkvz"), py::arg("ba"), py::arg("out_proj"),
           py::arg("conv_weight"), py::arg("neg_exp_a"), py::arg("dt_bias"), py::arg("norm_weight"),
           py::arg("norm_eps"), py::arg("conv_state"), py::arg("rec_state"), py::arg("conv_checkpoints"),
           py::arg("rec_checkpoints"));
}
