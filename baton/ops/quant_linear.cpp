// y = x W^T (+ b) over a weight kept in a GGUF block format, as the file ships it: W is uint8
// [N, blocks, block_bytes], each row of N its K inputs in ggml's blocks (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1: 32 values a block; Q4_K, Q5_K, Q6_K: 256). The block size in bytes names the format.
// Two paths: this file's float one (the default), and the integer one of quant_int.cpp where
// set_quant_kernel chose it.
//
// The float path: // Each thread takes 4 output rows at a time. With many rows of x, it dequantizes them into a float
// buffer in L1 (once per pass of 1 MiB of x rows), then sums each (row, output) over k in vector
// lanes in k order and reduces the lanes last. With up to 6 rows (2 under AVX2), it dequantizes in
// registers and multiplies each vector into the same accumulators in the same order: the same bits
// without the buffer's stores and loads. So a row's bits do not depend on how many rows share the
// call or which, as with linear.cpp.
#include "quant_linear.h"

#include "cpu_vec.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

#include "gguf_block_formats.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kOutputs = 4;                          // output rows dequantized at a time
constexpr int64_t kRowTile = Vec::size() >= 16 ? 6 : 2;  // rows of x per register tile
constexpr int64_t kRowBlockBytes = 1024 * 1024;          // x rows a pass keeps in L2
constexpr int64_t kPrefetchBytes = 8192;  // how far ahead to prefetch weights (8 KiB: A/B best)

// a row's blocks into out, float32, in order
template <class F>
void dequant_blocks(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b, out += F::kValues) {
    __builtin_prefetch(row + b * F::kBytes + kPrefetchBytes);
    F::run(row + b * F::kBytes, [out](int offset, const Vec& v) { v.store(out + offset); });
  }
}

// y[r, n0 + j] for Rows rows of x and `outputs` <= kOutputs weight rows w + j * row_bytes, the
// weights dequantized in registers: each accumulator takes the same fused multiply-adds in the same
// order as tile_kernel's over a dequant_blocks buffer, so the two give the same bits
template <class F, int64_t Rows>
void register_tile(const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x, int64_t x_stride, float* y,
                   int64_t y_stride, int64_t n0, int64_t outputs, const float* bias) {
  Vec acc[Rows][kOutputs];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t j = 0; j < kOutputs; ++j) acc[r][j] = Vec(0.f);
  for (int64_t b = 0; b < blocks; ++b) {
    const float* xb = x + b * F::kValues;
    for (int64_t j = 0; j < kOutputs; ++j) {
      if (j >= outputs) break;
      __builtin_prefetch(w + j * row_bytes + b * F::kBytes + kPrefetchBytes);
      F::run(w + j * row_bytes + b * F::kBytes, [&](int offset, const Vec& v) {
        for (int64_t r = 0; r < Rows; ++r) acc[r][j] = at::vec::fmadd(Vec::loadu(xb + r * x_stride + offset), v, acc[r][j]);
      });
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t j = 0; j < outputs; ++j)
      y[r * y_stride + n0 + j] = sum_lanes(acc[r][j]) + (bias ? bias[n0 + j] : 0.f);
}

template <class F>
void register_rows(int64_t rows, const uint8_t* w, int64_t row_bytes, int64_t blocks, const float* x, int64_t x_stride,
                   float* y, int64_t y_stride, int64_t n0, int64_t outputs, const float* bias) {
  switch (rows) {
    case 1: return register_tile<F, 1>(w, row_bytes, blocks, x, x_stride, y, y_stride, n0, outputs, bias);
    case 2: return register_tile<F, 2>(w, row_bytes, blocks, x, x_stride, y, y_stride, n0, outputs, bias);
    case 3: return register_tile<F, 3>(w, row_bytes, blocks, x, x_stride, y, y_stride, n0, outputs, bias);
    case 4: return register_tile<F, 4>(w, row_bytes, blocks, x, x_stride, y, y_stride, n0, outputs, bias);
    case 5: return register_tile<F, 5>(w, row_bytes, blocks, x, x_stride, y, y_stride, n0, outputs, bias);
    case 6: return register_tile<F, 6>(w, row_bytes, blocks, x, x_stride, y, y_stride, n0, outputs, bias);
  }
}

struct Format {
  int64_t block_bytes, block_values;
  void (*dequant_row)(const uint8_t*, int64_t, float*);
  void (*register_rows)(int64_t, const uint8_t*, int64_t, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                        int64_t, const float*);
};

#define BATON_FORMAT(F) {F::kBytes, F::kValues, dequant_blocks<F>, register_rows<F>}
// Distinct block sizes in bytes: a weight's last dimension names its format.
constexpr Format kFormats[] = {
    BATON_FORMAT(Q8_0), BATON_FORMAT(Q4_0), BATON_FORMAT(Q4_1), BATON_FORMAT(Q5_0),
    BATON_FORMAT(Q5_1), BATON_FORMAT(Q4_K), BATON_FORMAT(Q5_K), BATON_FORMAT(Q6_K),
};
#undef BATON_FORMAT

const Format& format_of(const torch::Tensor& w) {
  TORCH_CHECK((w.dim() == 3 || (w.dim() >= 4 && w.dim() <= 5 && w.size(-2) == 8)) && w.scalar_type() == at::kByte &&
                  w.is_contiguous() && w.device().is_cpu(),
              "a quantized weight must be contiguous uint8 [N, blocks, block bytes] (or regrouped, [N / 8, ",
              "blocks, 8, block bytes] or [N / 8, parts, blocks / parts, 8, block bytes]) on the CPU, got ",
              w.scalar_type(), " ", w.sizes());
  for (const Format& f : kFormats)
    if (f.block_bytes == w.size(-1)) return f;
  TORCH_CHECK(false, "no GGUF block format of ", w.size(-1), " bytes (Q8_0 34, Q4_0 18, Q4_1 20, Q5_0 22, Q5_1 24, ",
              "Q4_K 144, Q5_K 176, Q6_K 210)");
}

// acc[r][j] = sum over k of x[r, k] * w[j, k] in lanes; y[r, n0 + j] = its lanes summed (+ bias)
template <int64_t Rows>
void tile_kernel(const float* x, int64_t x_stride, int64_t k_dim, const float* w, float* y, int64_t y_stride,
                 int64_t n0, int64_t outputs, const float* bias) {
  Vec acc[Rows][kOutputs];
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t j = 0; j < kOutputs; ++j) acc[r][j] = Vec(0.f);
  for (int64_t k = 0; k < k_dim; k += Vec::size()) {
    Vec wv[kOutputs];
    for (int64_t j = 0; j < kOutputs; ++j) wv[j] = Vec::loadu(w + j * k_dim + k);
    for (int64_t r = 0; r < Rows; ++r) {
      const Vec xv = Vec::loadu(x + r * x_stride + k);
      for (int64_t j = 0; j < kOutputs; ++j) acc[r][j] = at::vec::fmadd(xv, wv[j], acc[r][j]);
    }
  }
  for (int64_t r = 0; r < Rows; ++r)
    for (int64_t j = 0; j < outputs; ++j)
      y[r * y_stride + n0 + j] = sum_lanes(acc[r][j]) + (bias ? bias[n0 + j] : 0.f);
}

void rows_kernel(int64_t rows, const float* x, int64_t x_stride, int64_t k_dim, const float* w, float* y,
                 int64_t y_stride, int64_t n0, int64_t outputs, const float* bias) {
  switch (rows) {
    case 1: return tile_kernel<1>(x, x_stride, k_dim, w, y, y_stride, n0, outputs, bias);
    case 2: return tile_kernel<2>(x, x_stride, k_dim, w, y, y_stride, n0, outputs, bias);
    case 3: return tile_kernel<3>(x, x_stride, k_dim, w, y, y_stride, n0, outputs, bias);
    case 4: return tile_kernel<4>(x, x_stride, k_dim, w, y, y_stride, n0, outputs, bias);
    case 5: return tile_kernel<5>(x, x_stride, k_dim, w, y, y_stride, n0, outputs, bias);
    case 6: return tile_kernel<6>(x, x_stride, k_dim, w, y, y_stride, n0, outputs, bias);
  }
}

}  // namespace

int64_t quant_block_values(const torch::Tensor& weight) { return format_of(weight).block_values; }

int64_t quant_row_blocks(const torch::Tensor& weight) {
  return weight.dim() == 5 ? weight.size(1) * weight.size(2) : weight.size(1);
}

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& weight, const float* bias, int64_t n_dim) {
  const Format& f = format_of(weight);
  const int64_t blocks = quant_row_blocks(weight), k_dim = blocks * f.block_values;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
              "x must be float32 [rows, K] on the CPU, contiguous in K, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == k_dim, "x has K = ", x.size(1), " input features, the quantized weight ", k_dim);
  if (weight.dim() >= 4) {  // regrouped for the integer kernels
    TORCH_CHECK((n_dim + 7) / 8 == weight.size(0), "out_features = ", n_dim, " but the regrouped weight has ",
                weight.size(0), " groups of 8 rows");
    const int64_t parts = weight.dim() == 5 ? weight.size(1) : 1;
    TORCH_CHECK(parts >= 1 && parts <= 8, "a regrouped weight sums K in 1 to 8 parts, not ", parts);
    return quant_int_linear(x, weight.view({weight.size(0), blocks, 8, f.block_bytes}), bias, n_dim, f.block_values,
                            parts);
  }
  TORCH_CHECK(n_dim == weight.size(0), "out_features = ", n_dim, " but the quantized weight has ", weight.size(0),
              " rows");
  const int64_t rows = x.size(0), row_bytes = blocks * f.block_bytes, x_stride = x.stride(0);
  auto y = torch::empty({rows, n_dim}, x.options());
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (n_dim + kOutputs - 1) / kOutputs;
  const int64_t block_rows = std::max<int64_t>(kRowTile, kRowBlockBytes / (k_dim * 4) / kRowTile * kRowTile);
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const int64_t r1 = std::min(rows, r0 + block_rows);
    at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
      if (r1 - r0 <= kRowTile) {  // a few rows (decode): dequantized in registers, no buffer
        for (int64_t t = begin; t < end; ++t) {
          const int64_t n0 = t * kOutputs;
          f.register_rows(r1 - r0, wp + n0 * row_bytes, row_bytes, blocks, xp + r0 * x_stride, x_stride,
                          yp + r0 * n_dim, n_dim, n0, std::min(kOutputs, n_dim - n0), bias);
        }
        return;
      }
      std::vector<float> w(kOutputs * k_dim);
      for (int64_t t = begin; t < end; ++t) {
        const int64_t n0 = t * kOutputs, outputs = std::min(kOutputs, n_dim - n0);
        for (int64_t j = 0; j < kOutputs; ++j) {
          if (j < outputs)
            f.dequant_row(wp + (n0 + j) * row_bytes, blocks, w.data() + j * k_dim);
          else
            std::fill_n(w.data() + j * k_dim, k_dim, 0.f);
        }
        for (int64_t r = r0; r < r1; r += kRowTile)
          rows_kernel(std::min(kRowTile, r1 - r), xp + r * x_stride, x_stride, k_dim, w.data(), yp + r * n_dim,
                      n_dim, n0, outputs, bias);
      }
    });
  }
  return y;
}

torch::Tensor dequantize_rows(const torch::Tensor& weight, const torch::Tensor& ids) {
  const Format& f = format_of(weight);
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.device().is_cpu(),
              "ids must be int64 [n] on the CPU, got ", ids.scalar_type(), " ", ids.sizes());
  const torch::Tensor idx = ids.contiguous();
  const bool regrouped = weight.dim() >= 4;
  const int64_t n = idx.size(0), rows = weight.size(0) * (regrouped ? 8 : 1), blocks = quant_row_blocks(weight);
  const int64_t k_dim = blocks * f.block_values, row_bytes = blocks * f.block_bytes;
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "row id ", id[i], " outside the weight's ", rows, " rows");
  auto out = torch::empty({n, k_dim}, torch::dtype(torch::kFloat));
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint8_t> row(regrouped ? row_bytes : 0);
    for (int64_t i = begin; i < end; ++i) {
      if (!regrouped) {
        f.dequant_row(wp + id[i] * row_bytes, blocks, op + i * k_dim);
        continue;
      }
      regrouped_row(wp + id[i] / 8 * 8 * row_bytes, id[i] % 8, blocks, f.block_bytes, row.data());
      f.dequant_row(row.data(), blocks, op + i * k_dim);
    }
  });
  return out;
}

bool quant_kernels_available() { return true; }

#else  // no AVX2: the kernels are not built, and a weight in blocks is refused with this error

namespace {
[[noreturn]] void unavailable() {
  TORCH_CHECK(false, "weights in GGUF blocks need an x86-64 CPU with AVX2 and FMA (or AVX-512); this build has ",
              "neither: run with --dtype float32 to dequantize them at load");
}
}  // namespace

bool quant_kernels_available() { return false; }
int64_t quant_block_values(const torch::Tensor&) { unavailable(); }
int64_t quant_row_blocks(const torch::Tensor&) { unavailable(); }
torch::Tensor quant_linear(const torch::Tensor&, const torch::Tensor&, const float*, int64_t) { unavailable(); }
torch::Tensor dequantize_rows(const torch::Tensor&, const torch::Tensor&) { unavailable(); }

#endif
