#pragma once
// Linears over weights kept in GGUF block formats (quant_linear.cpp).
#include <torch/types.h>

#include <string>

// False where the build has neither AVX2 + FMA nor AVX-512: the functions below then throw.
bool quant_kernels_available();
// A quantized weight is uint8 [N, blocks, block bytes] as a GGUF file ships it (the float kernel
// reads it), or regrouped for the integer kernels (regroup_blocks): [ceil(N / 8), blocks, 8, block
// bytes], each block of 8 rows with its fields interleaved row by row; viewed as [ceil(N / 8),
// parts, blocks / parts, 8, block bytes], the integer kernels sum each output's K in `parts` equal
// parts and add those pairwise as a balanced tree (gguf_blocks.py's BlockTensor.k_parts says why).
//
// Values per block (32 or 256) of a quantized weight; throws unless the block size in bytes is one
// of the formats'.
int64_t quant_block_values(const torch::Tensor& weight);
// Blocks a row of a quantized weight holds (K / values per block), whatever its layout.
int64_t quant_row_blocks(const torch::Tensor& weight);
// x [rows, K] @ W^T (+ bias, n_dim floats or null) for a quantized W of n_dim rows: by the float
// kernel for a weight as shipped, by the integer kernel set_quant_kernel chose for a regrouped one.
torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& weight, const float* bias, int64_t n_dim);
// float32 [len(ids), K]: rows `ids` of a quantized weight (an embedding lookup).
torch::Tensor dequantize_rows(const torch::Tensor& weight, const torch::Tensor& ids);
// The kernel of quantized linears for the whole process: "int8" (x quantized per block to int8,
// integer dot products on the best instruction set the CPU has), "int8-avx512_vnni",
// "int8-avx_vnni" or "int8-avx2" (throws for one the CPU lacks; they give the same bits), or
// "float" (the blocks dequantized in registers, float32 multiply-adds). Loading regroups a model's
// weights for an int8 kernel and keeps them as shipped for float. Returns the kernel chosen.
std::string set_quant_kernel(const std::string& name);
std::string quant_kernel();

// quant_int.cpp: the integer kernels over a regrouped weight, the regrouping, and one row of it
// back in the format's own layout (row_bytes = blocks * block_bytes bytes into `row`)
torch::Tensor quant_int_linear(const torch::Tensor& x, const torch::Tensor& weight, const float* bias, int64_t n_dim,
                               int64_t block_values, int64_t parts);
torch::Tensor regroup_blocks(const torch::Tensor& weight);
void regrouped_row(const uint8_t* group, int64_t lane, int64_t blocks, int64_t block_bytes, uint8_t* row);
