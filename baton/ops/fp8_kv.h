#pragma once
// fp8 (e4m3) KV: a cache of codes [slots, heads, dim] and a float32 scale per (block, head). A value
// is code * scale. Scales are powers of two, so dequantizing is exact in float32 and a block's codes
// are rescaled exactly (a shift of exponents) when a later write raises its scale.
#include <torch/types.h>

#include <cstdint>
#include <cstring>

#if defined(__F16C__)
#include <immintrin.h>
#endif

constexpr float kFp8Max = 448.f;  // largest finite e4m3fn value

// out[i] = e4m3(codes[i]) * scale for i < d. An e4m3 code's bits, moved into an IEEE half (sign to
// bit 15, exponent and mantissa to bits 7..13), are that half's value times 2^-8, subnormals
// included; the 2^8 goes into the scale.
inline void fp8_to_float(const uint8_t* codes, float scale, float* out, int64_t d) {
  int64_t i = 0;
#if defined(__F16C__) && defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512 s16 = _mm512_set1_ps(scale * 256.f);
  for (; i + 16 <= d; i += 16) {
    const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + i)));
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_cvtph_ps(h), s16));
  }
#elif defined(__F16C__) && defined(__AVX2__)
  const __m256 s8 = _mm256_set1_ps(scale * 256.f);
  for (; i + 8 <= d; i += 8) {
    const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + i)));
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x7F)), 7),
                                   _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_cvtph_ps(h), s8));
  }
#endif
  for (; i < d; ++i) out[i] = static_cast<float>(c10::Float8_e4m3fn(codes[i], c10::Float8_e4m3fn::from_bits())) * scale;
}

// src [T, heads, dim] float32 into cache [slots, heads, dim] (e4m3fn) at slots[t], with
// scales [blocks, heads] float32. Tokens go in runs of consecutive slots of one block. A run that
// starts a block (offset 0), or any run when `fresh` (the blocks hold nothing yet: an import), sets
// the block's scale from its own values; a later run raises the scale when its values need it and
// rescales the rows already there.
void write_kv_fp8(const torch::Tensor& src, torch::Tensor& cache, torch::Tensor& scales, const torch::Tensor& slots,
                  int64_t block_size, bool fresh);
// The rows at `slots` of an fp8 cache as float32 [n, heads, dim].
torch::Tensor read_kv_fp8(const torch::Tensor& cache, const torch::Tensor& scales, const torch::Tensor& slots,
                          int64_t block_size);
// Throws unless scales is float32 [cache slots / block_size, heads], contiguous.
void check_kv_scales(const torch::Tensor& cache, const torch::Tensor& scales, int64_t block_size);
