// Kimi Delta Attention's single-token step (kda_step.h) with the bits of KimiDeltaAttention.forward's
// torch ops (baton/models/kimi_linear.py, recurrent.py) for one token per row.
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "kda_step.h"
#include "ops.h"
#include "step_common.h"

#include <cmath>
#include <cstring>
#include <vector>

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
