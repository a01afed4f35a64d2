#pragma once
// Linears over weights kept in GGUF block formats (quant_linear.cpp).
#include <torch/types.h>

#include <string>

// False where the build has neither AVX2 + FMA nor AVX-512: the functions below then throw.
bool quant_kernels_available();
// Values per block (32 or 256) of a quantized weight uint8 [N, blocks, block bytes]; throws
// unless the block size in bytes is one of the formats'.
int64_t quant_block_values(const torch::Tensor& weight);
// x [rows, K] @ W^T (+ bias, n_dim floats or null) for a quantized W of n_dim rows, by the kernel
// set_quant_kernel chose.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& weight, const float* bias, int64_t n_dim);
// float32 [len(ids), K]: rows `ids` of a quantized weight (an embedding lookup).
torch::Tensor dequantize_rows(const torch::Tensor& weight, const torch::Tensor& ids);
// The kernel of quant_linear for the whole process: "float" (the blocks dequantized in registers,
// float32 multiply-adds; the default), "int8" (x quantized per block to int8, integer dot products
// on the best instruction set the CPU has), or "int8-avx512_vnni", "int8-avx_vnni", "int8-avx2";
// throws for one the CPU lacks. Returns the kernel chosen. The int8 ones give the same bits.
std::string set_quant_kernel(const std::string& name);
std::string quant_kernel();

// quant_int.cpp: whether set_quant_kernel chose an int8 kernel, and that kernel
bool quant_int_selected();
torch::Tensor quant_int_linear(const torch::Tensor& x, const torch::Tensor& weight, const float* bias, int64_t n_dim,
                               int64_t block_values);
