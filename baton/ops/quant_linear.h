#pragma once
// Linears over weights kept in GGUF block formats (quant_linear.cpp).
#include <torch/types.h>

// False where the build has neither AVX2 + FMA nor AVX-512: the functions below then throw.
bool quant_kernels_available();
// Values per block (32 or 256) of a quantized weight uint8 [N, blocks, block bytes]; throws
// unless the block size in bytes is one of the formats'.
int64_t quant_block_values(const torch::Tensor& weight);
// x [rows, K] @ W^T (+ bias, n_dim floats or null) for a quantized W of n_dim rows.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& weight, const float* bias, int64_t n_dim);
// float32 [len(ids), K]: rows `ids` of a quantized weight (an embedding lookup).
torch::Tensor dequantize_rows(const torch::Tensor& weight, const torch::Tensor& ids);
