// y = x W^T (+ b) over a weight kept in a GGUF block format, as the file ships it: W is uint8
// [N, blocks, block_bytes], each row of N its K inputs in ggml's blocks (Q8_0, Q4_0, Q4_1, Q5_0,
// Q5_1: 32 values a block; Q4_K, Q5_K, Q6_K: 256). The block size in bytes names the format.
//
// Each thread takes 4 output rows at a time. With many rows of x, it dequantizes them into a float
// buffer in L1 (once per pass of 1 MiB of x rows), then sums each (row, output) over k in vector
// lanes in k order and reduces the lanes last. With up to 6 rows (2 under AVX2), it dequantizes in
// registers and multiplies each vector into the same accumulators in the same order: the same bits
// without the buffer's stores and loads. So a row's bits do not depend on how many rows share the
// call or which, as with linear.cpp.
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

// Each dequantizes one block (32 or 256 values) with the formulas of ggml's dequantize_row_*,
// evaluated as the gguf package does (the same bits): the codes unpacked with 16-byte integer
// operations (SSE, on any AVX2 or AVX-512 CPU), converted exactly to float, then scaled in vector
// registers. Each hands its values to `sink(offset, vector)` in ascending offsets, a vector at a
// time: a sink that stores them fills a buffer (dequant_blocks); one that multiplies them into
// accumulators (register_tile) sums exactly what a dot over that buffer sums, in the same order.

// byte lanes of v shifted right by n
inline __m128i srli8(__m128i v, int n) { return _mm_and_si128(_mm_srli_epi16(v, n), _mm_set1_epi8(0xFF >> n)); }

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

// What a block's codes stand for: d * (code - bias), or for the formats with an offset (whose codes
// have no bias) d * code + m; (code - bias) is exact, so this is the gguf package's float32
// arithmetic. emit16 hands 16 byte codes (unsigned, or signed for Q8_0) at `offset` to the sink as
// values: computed per code, or under AVX-512 for codes of 4 or 5 bits looked up in a table of the
// same values computed once per block (two vector operations per 16 weights fewer).
enum class Codes { kUnsigned, kSigned };
enum class Offset { kNone, kAdd };

template <Codes C, Offset O, int Bits>
struct CodeValues {
  Vec d, bias, m;
#if defined(CPU_CAPABILITY_AVX512)
  __m512 lo, hi;  // the values of codes 0..15 and 16..31
#endif

  CodeValues(float d_, float bias_, float m_) : d(d_), bias(bias_), m(m_) {
#if defined(CPU_CAPABILITY_AVX512)
    if constexpr (Bits <= 5) {
      const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      lo = value(Vec(iota));
      if constexpr (Bits == 5) hi = value(Vec(_mm512_add_ps(iota, _mm512_set1_ps(16.f))));
    }
#endif
  }

  Vec value(const Vec& v) const {
    if constexpr (O == Offset::kAdd) return d * v + m;
    else return d * (v - bias);
  }

  template <class Sink>
  void emit16(__m128i codes, int offset, Sink& sink) const {
#if defined(CPU_CAPABILITY_AVX512)
    const __m512i wide = C == Codes::kSigned ? _mm512_cvtepi8_epi32(codes) : _mm512_cvtepu8_epi32(codes);
    if constexpr (Bits == 4) sink(offset, Vec(_mm512_permutexvar_ps(wide, lo)));
    else if constexpr (Bits == 5) sink(offset, Vec(_mm512_permutex2var_ps(lo, wide, hi)));
    else sink(offset, value(Vec(_mm512_cvtepi32_ps(wide))));
#else
    const __m128i upper = _mm_srli_si128(codes, 8);
    const __m256i lo = C == Codes::kSigned ? _mm256_cvtepi8_epi32(codes) : _mm256_cvtepu8_epi32(codes);
    const __m256i hi = C == Codes::kSigned ? _mm256_cvtepi8_epi32(upper) : _mm256_cvtepu8_epi32(upper);
    sink(offset, value(Vec(_mm256_cvtepi32_ps(lo))));
    sink(offset + 8, value(Vec(_mm256_cvtepi32_ps(hi))));
#endif
  }
};

// bits [0, 16) of `bits` as bytes 0x10 (set) or 0 (Q5's fifth bit)
inline __m128i fifth_bits(uint32_t bits) {
  const __m128i spread = _mm_shuffle_epi8(_mm_set1_epi16(static_cast<int16_t>(bits & 0xFFFF)),
                                          _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1));
  const __m128i mask = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 1, 2, 4, 8, 16, 32, 64, -128);
  return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(spread, mask), mask), _mm_set1_epi8(0x10));
}

const __m128i kLow4 = _mm_set1_epi8(0x0F);

template <class Sink>
inline void dequant_q8_0(const uint8_t* b, Sink&& sink) {
  const CodeValues<Codes::kSigned, Offset::kNone, 8> v(half(b), 0.f, 0.f);
  v.emit16(load16(b + 2), 0, sink);
  v.emit16(load16(b + 18), 16, sink);
}

// Q4_0 / Q4_1: 16 bytes of nibbles, the low ones values [0, 16), the high ones [16, 32)
template <class Sink>
inline void dequant_q4_0(const uint8_t* b, Sink&& sink) {
  const CodeValues<Codes::kUnsigned, Offset::kNone, 4> v(half(b), 8.f, 0.f);
  const __m128i raw = load16(b + 2);
  v.emit16(_mm_and_si128(raw, kLow4), 0, sink);
  v.emit16(srli8(raw, 4), 16, sink);
}

template <class Sink>
inline void dequant_q4_1(const uint8_t* b, Sink&& sink) {
  const CodeValues<Codes::kUnsigned, Offset::kAdd, 4> v(half(b), 0.f, half(b + 2));
  const __m128i raw = load16(b + 4);
  v.emit16(_mm_and_si128(raw, kLow4), 0, sink);
  v.emit16(srli8(raw, 4), 16, sink);
}

// Q5_0 / Q5_1: nibbles plus a fifth bit from the 32 bits qh (bit j for value j)
template <class Sink>
inline void dequant_q5_0(const uint8_t* b, Sink&& sink) {
  const CodeValues<Codes::kUnsigned, Offset::kNone, 5> v(half(b), 16.f, 0.f);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const __m128i raw = load16(b + 6);
  v.emit16(_mm_or_si128(_mm_and_si128(raw, kLow4), fifth_bits(qh)), 0, sink);
  v.emit16(_mm_or_si128(srli8(raw, 4), fifth_bits(qh >> 16)), 16, sink);
}

template <class Sink>
inline void dequant_q5_1(const uint8_t* b, Sink&& sink) {
  const CodeValues<Codes::kUnsigned, Offset::kAdd, 5> v(half(b), 0.f, half(b + 2));
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const __m128i raw = load16(b + 8);
  v.emit16(_mm_or_si128(_mm_and_si128(raw, kLow4), fifth_bits(qh)), 0, sink);
  v.emit16(_mm_or_si128(srli8(raw, 4), fifth_bits(qh >> 16)), 16, sink);
}

// Q4_K / Q5_K: 8 sub-blocks of 32, each (d * sc) * code - (dmin * m); per 64 values, 32 bytes whose
// low nibbles are the first sub-block and high nibbles the second (Q5_K: fifth bits from qh)
template <bool FifthBit, class Sink>
inline void dequant_k(const uint8_t* b, Sink&& sink) {
  const float d = half(b), dmin = half(b + 2);
  const uint8_t *scales = b + 4, *qh = b + 16, *qs = b + (FifthBit ? 48 : 16);
  for (int is = 0; is < 8; is += 2, qs += 32) {
    for (int part = 0; part < 2; ++part) {  // the low nibbles' sub-block, then the high ones'
      float sc, m;
      scale_min_k4(is + part, scales, &sc, &m);
      const CodeValues<Codes::kUnsigned, Offset::kAdd, FifthBit ? 5 : 4> v(d * sc, 0.f, -(dmin * m));
      for (int c = 0; c < 32; c += 16) {
        const __m128i raw = load16(qs + c);
        __m128i codes = part == 0 ? _mm_and_si128(raw, kLow4) : srli8(raw, 4);
        if constexpr (FifthBit) {
          const __m128i bit = _mm_and_si128(srli8(load16(qh + c), is + part), _mm_set1_epi8(1));
          codes = _mm_or_si128(codes, _mm_slli_epi16(bit, 4));
        }
        v.emit16(codes, 32 * (is + part) + c, sink);
      }
    }
  }
}

template <class Sink>
inline void dequant_q4_k(const uint8_t* b, Sink&& sink) {
  dequant_k<false>(b, sink);
}

template <class Sink>
inline void dequant_q5_k(const uint8_t* b, Sink&& sink) {
  dequant_k<true>(b, sink);
}

// Q6_K: 16 sub-blocks of 16, each (d * sc) * (code - 32), code 4 low bits from ql and 2 high bits
// from qh; per 128 values, group g of 32 takes ql's low (g = 0, 1) or high (g = 2, 3) nibbles of
// bytes [0, 32) (g even) or [32, 64) (g odd) and qh's bits 2g, 2g + 1
template <class Sink>
inline void dequant_q6_k(const uint8_t* b, Sink&& sink) {
  const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = half(b + 208);
  for (int n = 0; n < 2; ++n) {
    const uint8_t *ql = b + 64 * n, *qh = b + 128 + 32 * n;
    for (int g = 0; g < 4; ++g) {
      for (int c = 0; c < 32; c += 16) {
        const __m128i raw = load16(ql + 32 * (g & 1) + c);
        const __m128i low = g < 2 ? _mm_and_si128(raw, kLow4) : srli8(raw, 4);
        const __m128i high = _mm_slli_epi16(_mm_and_si128(srli8(load16(qh + c), 2 * g), _mm_set1_epi8(3)), 4);
        const int offset = 128 * n + 32 * g + c;
        const CodeValues<Codes::kUnsigned, Offset::kNone, 6> v(d * static_cast<float>(sc[offset / 16]), 32.f, 0.f);
        v.emit16(_mm_or_si128(low, high), offset, sink);
      }
    }
  }
}

#define BATON_FORMAT_TYPE(Name, fn, values, bytes)         \
  struct Name {                                            \
    static constexpr int64_t kValues = values;             \
    static constexpr int64_t kBytes = bytes;               \
    template <class Sink>                                  \
    static void run(const uint8_t* b, Sink&& sink) {       \
      fn(b, sink);                                         \
    }                                                      \
  };
BATON_FORMAT_TYPE(Q8_0, dequant_q8_0, 32, 34)
BATON_FORMAT_TYPE(Q4_0, dequant_q4_0, 32, 18)
BATON_FORMAT_TYPE(Q4_1, dequant_q4_1, 32, 20)
BATON_FORMAT_TYPE(Q5_0, dequant_q5_0, 32, 22)
BATON_FORMAT_TYPE(Q5_1, dequant_q5_1, 32, 24)
BATON_FORMAT_TYPE(Q4_K, dequant_q4_k, 256, 144)
BATON_FORMAT_TYPE(Q5_K, dequant_q5_k, 256, 176)
BATON_FORMAT_TYPE(Q6_K, dequant_q6_k, 256, 210)
#undef BATON_FORMAT_TYPE

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
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == at::kByte && w.is_contiguous() && w.device().is_cpu(),
              "a quantized weight must be contiguous uint8 [N, blocks, block bytes] on the CPU, got ",
              w.scalar_type(), " ", w.sizes());
  for (const Format& f : kFormats)
    if (f.block_bytes == w.size(2)) return f;
  TORCH_CHECK(false, "no GGUF block format of ", w.size(2), " bytes (Q8_0 34, Q4_0 18, Q4_1 20, Q5_0 22, Q5_1 24, ",
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
