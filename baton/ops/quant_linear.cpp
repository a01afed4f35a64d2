// y = x W^T (+ b) over a weight kept in a GGUF block format, as the file ships it: W is uint8
// [N, blocks, block_bytes], each row of N its K inputs in ggml's blocks (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1: 32 values a block; Q4_K, Q5_K, Q6_K: 256). The block size in bytes names the format.
//
// One kernel for every row count: each thread dequantizes 4 output rows at a time into a float
// buffer in L1 (once per 4 outputs and block of x rows, so a decode reads each weight byte once
// and a prefill dequantizes once per 64 rows), then sums each (row, output) over k in vector lanes
// in k order and reduces the lanes last. That order is the same whatever the number of rows or
// which rows share the call, so a row's bits do not depend on its batch, as with linear.cpp.
#include "quant_linear.h"

#include "cpu_vec.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

namespace {

float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return c10::detail::fp16_ieee_to_fp32_value(h);
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block
void scale_min_k4(int j, const uint8_t* q, float* sc, float* m) {
  if (j < 4) {
    *sc = q[j] & 63;
    *m = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Each dequantizes one block into out (32 or 256 floats), the formulas of ggml's dequantize_row_*
// evaluated as the gguf package does (the same bits): the codes unpacked with 16-byte integer
// operations (SSE, on any AVX2 or AVX-512 CPU), converted exactly to float, then scaled.

// byte lanes of v shifted right by n
inline __m128i srli8(__m128i v, int n) { return _mm_and_si128(_mm_srli_epi16(v, n), _mm_set1_epi8(0xFF >> n)); }

// 16 unsigned byte codes -> out[0, 16) as floats (exact)
inline void codes_to_float(__m128i u8, float* out) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_storeu_ps(out, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u8)));
#else
  _mm256_storeu_ps(out, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(u8)));
  _mm256_storeu_ps(out + 8, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(u8, 8))));
#endif
}

// out[j] = d * (out[j] - bias) + m over n floats (n a multiple of the vector width); (u - bias) is
// exact, so this is d * code + m with the code's sign
inline void scale(float* out, int n, float d, float bias, float m) {
  const Vec vd(d), vb(bias), vm(m);
  for (int j = 0; j < n; j += Vec::size()) (vd * (Vec::loadu(out + j) - vb) + vm).store(out + j);
}

inline void scale(float* out, int n, float d, float bias) {
  const Vec vd(d), vb(bias);
  for (int j = 0; j < n; j += Vec::size()) (vd * (Vec::loadu(out + j) - vb)).store(out + j);
}

// 16 bytes of nibbles -> 32 codes: the low nibbles first, then the high ones
inline void nibbles(const uint8_t* qs, float* out) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  codes_to_float(_mm_and_si128(raw, _mm_set1_epi8(0x0F)), out);
  codes_to_float(srli8(raw, 4), out + 16);
}

// bits [0, 16) of `bits` as bytes 0x10 (set) or 0 (Q5's fifth bit)
inline __m128i fifth_bits(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi16(static_cast<int16_t>(bits & 0xFFFF)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i mask = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, mask), mask), _mm_set1_epi8(0x10));
}

inline void nibbles_5(const uint8_t* qs, const uint8_t* qh_bytes, float* out) {
  uint32_t qh;
  std::memcpy(&qh, qh_bytes, 4);
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  codes_to_float(_mm_or_si128(_mm_and_si128(raw, _mm_set1_epi8(0x0F)), fifth_bits(qh)), out);
  codes_to_float(_mm_or_si128(srli8(raw, 4), fifth_bits(qh >> 16)), out + 16);
}

inline void dequant_q8_0(const uint8_t* __restrict b, float* __restrict out) {
  const float d = half(b);
  const int8_t* qs = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) out[j] = d * static_cast<float>(qs[j]);
}

inline void dequant_q4_0(const uint8_t* __restrict b, float* __restrict out) {
  nibbles(b + 2, out);
  scale(out, 32, half(b), 8.f);
}

inline void dequant_q4_1(const uint8_t* __restrict b, float* __restrict out) {
  nibbles(b + 4, out);
  scale(out, 32, half(b), 0.f, half(b + 2));
}

inline void dequant_q5_0(const uint8_t* __restrict b, float* __restrict out) {
  nibbles_5(b + 6, b + 2, out);
  scale(out, 32, half(b), 16.f);
}

inline void dequant_q5_1(const uint8_t* __restrict b, float* __restrict out) {
  nibbles_5(b + 8, b + 4, out);
  scale(out, 32, half(b), 0.f, half(b + 2));
}

// Q4_K / Q5_K: 8 sub-blocks of 32, each (d * sc) * code - (dmin * m)
inline void dequant_q4_k(const uint8_t* __restrict b, float* __restrict out) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t *scales = b + 4, *qs = b + 16;
  for (int is = 0; is < 8; is += 2, qs += 32, out += 64) {
    for (int c = 0; c < 32; c += 16) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + c));
      codes_to_float(_mm_and_si128(raw, _mm_set1_epi8(0x0F)), out + c);
      codes_to_float(srli8(raw, 4), out + 32 + c);
    }
    float sc, m;
    scale_min_k4(is, scales, &sc, &m);
    scale(out, 32, d * sc, 0.f, -(dmin * m));
    scale_min_k4(is + 1, scales, &sc, &m);
    scale(out + 32, 32, d * sc, 0.f, -(dmin * m));
  }
}

inline void dequant_q5_k(const uint8_t* __restrict b, float* __restrict out) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
  for (int is = 0, shift = 0; is < 8; is += 2, shift += 2, ql += 32, out += 64) {
    for (int c = 0; c < 32; c += 16) {
      const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + c));
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + c));
      const __m128i one = _mm_set1_epi8(1);
      const __m128i h0 = _mm_slli_epi16(_mm_and_si128(srli8(h, shift), one), 4);
      const __m128i h1 = _mm_slli_epi16(_mm_and_si128(srli8(h, shift + 1), one), 4);
      codes_to_float(_mm_or_si128(_mm_and_si128(raw, _mm_set1_epi8(0x0F)), h0), out + c);
      codes_to_float(_mm_or_si128(srli8(raw, 4), h1), out + 32 + c);
    }
    float sc, m;
    scale_min_k4(is, scales, &sc, &m);
    scale(out, 32, d * sc, 0.f, -(dmin * m));
    scale_min_k4(is + 1, scales, &sc, &m);
    scale(out + 32, 32, d * sc, 0.f, -(dmin * m));
  }
}

// Q6_K: 16 sub-blocks of 16, each d * sc * code with code in [-32, 32): 4 low bits from ql, 2
// high bits from qh
inline void dequant_q6_k(const uint8_t* __restrict b, float* __restrict out) {
  const uint8_t *ql = b, *qh = b + 128;
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  const __m128i low4 = _mm_set1_epi8(0x0F), low2 = _mm_set1_epi8(0x03);
  for (int n = 0; n < 2; ++n, ql += 64, qh += 32, sc += 8, out += 128) {
    for (int c = 0; c < 32; c += 16) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + c));
      const __m128i a2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(ql + 32 + c));
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + c));
      const auto high = [&](int shift) { return _mm_slli_epi16(_mm_and_si128(srli8(h, shift), low2), 4); };
      codes_to_float(_mm_or_si128(_mm_and_si128(a, low4), high(0)), out + c);
      codes_to_float(_mm_or_si128(_mm_and_si128(a2, low4), high(2)), out + 32 + c);
      codes_to_float(_mm_or_si128(srli8(a, 4), high(4)), out + 64 + c);
      codes_to_float(_mm_or_si128(srli8(a2, 4), high(6)), out + 96 + c);
    }
    for (int s = 0; s < 8; ++s) scale(out + 16 * s, 16, d * static_cast<float>(sc[s]), 32.f);
  }
}

// one row's blocks; Dequant inlined into the loop
template <void (*Dequant)(const uint8_t* __restrict, float* __restrict), int64_t Values, int64_t Bytes>
void dequant_blocks(const uint8_t* row, int64_t blocks, float* out) {
  for (int64_t b = 0; b < blocks; ++b) Dequant(row + b * Bytes, out + b * Values);
}

struct Format {
  int64_t block_bytes, block_values;
  void (*dequant_row)(const uint8_t*, int64_t, float*);
};

#define BATON_FORMAT(fn, values, bytes) {bytes, values, dequant_blocks<fn, values, bytes>}
// Distinct block sizes in bytes: a weight's last dimension names its format.
constexpr Format kFormats[] = {
    BATON_FORMAT(dequant_q8_0, 32, 34),   BATON_FORMAT(dequant_q4_0, 32, 18),   BATON_FORMAT(dequant_q4_1, 32, 20),
    BATON_FORMAT(dequant_q5_0, 32, 22),   BATON_FORMAT(dequant_q5_1, 32, 24),   BATON_FORMAT(dequant_q4_k, 256, 144),
    BATON_FORMAT(dequant_q5_k, 256, 176), BATON_FORMAT(dequant_q6_k, 256, 210),
};
#undef BATON_FORMAT

const Format& format_of(const torch::Tensor& w) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "a quantized weight must be contiguous uint8 [N, blocks, block bytes] on the CPU, got ",
              w.scalar_type(), " ", w.sizes());
  for (const Format& f : kFormats)
    if (f.block_bytes == w.size(2)) return f;
  TORCH_CHECK(false, "no GGUF block format of ", w.size(2), " bytes (Q8_0 34, Q4_0 18, Q4_1 20, Q5_0 22, Q5_1 24, ",
              "Q4_K 144, Q5_K 176, Q6_K 210)");
}

constexpr int64_t kOutputs = 4;                          // output rows dequantized at a time
constexpr int64_t kRowTile = Vec::size() >= 16 ? 4 : 2;  // rows of x per register tile
constexpr int64_t kRowBlockBytes = 256 * 1024;           // x rows a pass keeps in L2

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
  }
}

}  // namespace

int64_t quant_block_values(const torch::Tensor& weight) { return format_of(weight).block_values; }

torch::Tensor quant_linear(const torch::Tensor& x, const torch::Tensor& weight, const float* bias, int64_t n_dim) {
  const Format& f = format_of(weight);
  const int64_t blocks = weight.size(1), k_dim = blocks * f.block_values;
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1 && x.device().is_cpu(),
              "x must be float32 [rows, K] on the CPU, contiguous in K, got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(x.size(1) == k_dim, "x has K = ", x.size(1), " input features, the quantized weight ", k_dim);
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
  const int64_t n = idx.size(0), rows = weight.size(0), blocks = weight.size(1), k_dim = blocks * f.block_values;
  const int64_t* id = idx.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(id[i] >= 0 && id[i] < rows, "row id ", id[i], " outside the weight's ", rows, " rows");
  auto out = torch::empty({n, k_dim}, torch::dtype(torch::kFloat));
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i)
      f.dequant_row(wp + id[i] * blocks * f.block_bytes, blocks, op + i * k_dim);
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
torch::Tensor quant_linear(const torch::Tensor&, const torch::Tensor&, const float*, int64_t) { unavailable(); }
torch::Tensor dequantize_rows(const torch::Tensor&, const torch::Tensor&) { unavailable(); }

#endif
