// y = x W^T (+ b) over a float32 weight packed once into column panels [ceil(N / 16), K, 16]: one panel
// holds 16 output features for every k, so the kernel streams each panel front to back
// (prefetching ahead) with 8 rows of x at a time broadcast against it in registers. Every output
// is summed over k in the same order whatever the row count, so a row's result does not depend
// on which other rows share the call (batch invariance by construction). packed_linear also takes
// weights in GGUF blocks (uint8) and hands them to quant_linear.cpp.
#include "cpu_vec.h"
#include "quant_linear.h"

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>

namespace {

constexpr int64_t kLanes = 16;           // outputs per panel
constexpr int64_t kPrefetchFloats = 64;  // 256 bytes ahead within a panel

template <int64_t Rows, int64_t Panels>
void panel_kernel(const float* x, int64_t x_stride, const float* w, int64_t k_dim, float* y, int64_t y_stride,
                  int64_t n0, int64_t n_dim, const float* bias) {
  static_assert(kLanes == 2 * Vec::size() || kLanes == Vec::size(), "panel width is one or two vectors");
  constexpr int64_t V = kLanes / Vec::size();  // vectors per panel
  Vec acc[Rows][Panels * V];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t j = 0; j < Panels * V; ++j) acc[r][j] = Vec(0.f);
  const int64_t panel_floats = k_dim * kLanes;
  for (int64_t k = 0; k < k_dim; ++k) {
    Vec wv[Panels * V];
    for (int64_t p = 0; p < Panels; ++p) {
      const float* src = w + p * panel_floats + k * kLanes;
      __builtin_prefetch(src + kPrefetchFloats);
      for (int64_t j = 0; j < V; ++j) wv[p * V + j] = Vec::loadu(src + j * Vec::size());
    }
    for (int64_t r = 0; r < Rows; ++r) {
      const Vec xb(x[r * x_stride + k]);
      for (int64_t j = 0; j < Panels * V; ++j) acc[r][j] = at::vec::fmadd(xb, wv[j], acc[r][j]);
    }
  }
  for (int64_t p = 0; p < Panels; ++p) {
    const int64_t n = n0 + p * kLanes, count = std::min(kLanes, n_dim - n);
    if (count <= 0) break;
    float out[kLanes];
    for (int64_t r = 0; r < Rows; ++r) {
      for (int64_t j = 0; j < V; ++j) acc[r][p * V + j].store(out + j * Vec::size());
      for (int64_t i = 0; i < count; ++i) y[r * y_stride + n + i] = out[i] + (bias ? bias[n + i] : 0.f);
    }
  }
}

template <int64_t Panels>
void rows_kernel(int64_t rows, const float* x, int64_t x_stride, const float* w, int64_t k_dim, float* y,
                 int64_t y_stride, int64_t n0, int64_t n_dim, const float* bias) {
  switch (rows) {
#define BATON_ROWS(R) \
  case R:             \
    return panel_kernel<R, Panels>(x, x_stride, w, k_dim, y, y_stride, n0, n_dim, bias);
    BATON_ROWS(1) BATON_ROWS(2) BATON_ROWS(3) BATON_ROWS(4) BATON_ROWS(5) BATON_ROWS(6) BATON_ROWS(7) BATON_ROWS(8)
#undef BATON_ROWS
  }
}

}  // namespace

int64_t panel_lanes() { return kLanes; }

// [N, K] -> [ceil(N / 16), K, 16], zero-padded past N
torch::Tensor pack_weight_panels(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "weight must be float32 [N, K] on the CPU, got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t n = weight.size(0), k = weight.size(1), panels = (n + kLanes - 1) / kLanes;
  auto padded = torch::zeros({panels * kLanes, k}, weight.options());
  padded.narrow(0, 0, n).copy_(weight);
  return padded.view({panels, kLanes, k}).transpose(1, 2).contiguous();
}

torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t n_dim) {
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->numel() == n_dim && bias->is_contiguous() && bias->scalar_type() == at::kFloat &&
                    bias->device().is_cpu(),
                "bias must be contiguous float32 [out_features=", n_dim, "], got ", bias->scalar_type(), " ",
                bias->sizes());
    b = bias->data_ptr<float>();
  }
  if (packed.scalar_type() == at::kByte) return quant_linear(x, packed, b, n_dim);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
              "x must be float32 [rows, K] on the CPU, contiguous in K, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kLanes && packed.scalar_type() == at::kFloat &&
                  packed.is_contiguous() && packed.device().is_cpu(),
              "the packed weight must be contiguous float32 [panels, K, ", kLanes, "] (pack_weight_panels) or ",
              "uint8 GGUF blocks [N, blocks, block bytes], got ", packed.scalar_type(), " ", packed.sizes());
  TORCH_CHECK(packed.size(1) == x.size(1), "x has K = ", x.size(1), " input features, the packed weight ",
              packed.size(1));
  TORCH_CHECK(n_dim >= 0 && n_dim <= packed.size(0) * kLanes, "out_features = ", n_dim,
              " is outside the packed weight's ", packed.size(0) * kLanes, " (", packed.size(0), " panels of ", kLanes,
              ")");
  const int64_t rows = x.size(0), k_dim = x.size(1), panels = packed.size(0);
  auto y = torch::empty({rows, n_dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t x_stride = x.stride(0), panel_floats = k_dim * kLanes;
  // two panels (32 outputs) per inner call; rows in groups of up to 8
  at::parallel_for(0, (panels + 1) / 2, 1, [&](int64_t begin, int64_t end) {
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t p0 = 2 * pair, n0 = p0 * kLanes;
      const float* w = wp + p0 * panel_floats;
      for (int64_t r0 = 0; r0 < rows; r0 += 8) {
        const int64_t r = std::min<int64_t>(8, rows - r0);
        if (p0 + 1 < panels)
          rows_kernel<2>(r, xp + r0 * x_stride, x_stride, w, k_dim, yp + r0 * n_dim, n_dim, n0, n_dim, b);
        else
          rows_kernel<1>(r, xp + r0 * x_stride, x_stride, w, k_dim, yp + r0 * n_dim, n_dim, n0, n_dim, b);
      }
    }
  });
  return y;
}

torch::Tensor stacked_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                             const std::vector<int64_t>& rows, const c10::optional<torch::Tensor>& bias, int64_t n_dim) {
  TORCH_CHECK(!parts.empty() && parts.size() == rows.size(), "a stacked weight needs one row count per part, got ",
              parts.size(), " parts and ", rows.size(), " counts");
  int64_t total = 0;
  for (int64_t r : rows) {
    TORCH_CHECK(r > 0, "a part of a stacked weight has ", r, " rows");
    total += r;
  }
  TORCH_CHECK(total == n_dim, "the parts of a stacked weight have ", total, " rows, not out_features = ", n_dim);
  if (parts.size() == 1) return packed_linear(x, parts[0], bias, n_dim);
  const bool has_bias = bias.has_value() && bias->defined();
  TORCH_CHECK(!has_bias || bias->numel() == n_dim, "bias must have out_features = ", n_dim, " values");
  std::vector<torch::Tensor> outs;
  int64_t start = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const c10::optional<torch::Tensor> b =
        has_bias ? c10::optional<torch::Tensor>(bias->narrow(0, start, rows[i])) : c10::nullopt;
    outs.push_back(packed_linear(x, parts[i], b, rows[i]));
    start += rows[i];
  }
  return torch::cat(outs, 1);
}
