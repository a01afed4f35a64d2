#pragma once
// The ops of baton/ops/*.cpp as C++ functions: bound to Python in bindings.cpp and composed by
// decode.cpp's fused decode step.
#include <torch/extension.h>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                                     const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                                     int64_t block_size, double scale);
int64_t panel_lanes();
torch::Tensor pack_weight_panels(const torch::Tensor& weight);
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t n_dim);

torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                       double eps, double offset);
void rms_norm_heads_(torch::Tensor& x, const torch::Tensor& weight, double eps, double offset);
void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor gated_act(const torch::Tensor& x, bool gelu_tanh);
torch::Tensor empty_huge_pages(int64_t nbytes);
