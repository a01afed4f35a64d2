// Gated DeltaNet's single-token step (gdn_step.h): causal conv, gates, l2norm of q and k, the
// delta rule and the gated norm, each with the bits of GatedDeltaNet.forward's torch ops
// (baton/models/recurrent.py) for one token per row.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "gdn_step.h"
#include "step_common.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

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

}  // namespace

// The depthwise conv as oneDNN sums it: k ascending, one FMA each from zero.
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

// z, b and a as the module's contiguous [n, *] tensors; when there is one key head its reshape is
// a view with rows apart, which is how torch runs the elementwise ops over them.
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

// In (row, head, column block) tasks.
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
