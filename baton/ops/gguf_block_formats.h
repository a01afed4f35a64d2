#pragma once
// The GGUF block formats baton's kernels read (quant_linear.cpp): for each, how one block turns
// into float32 values, with the formulas of ggml's dequantize_row_* evaluated as the gguf package
// does (the same bits). File-local (anonymous namespace): included by quant_linear.cpp, and by
// quant_int.cpp for half and scale_min_k4, under AVX2 or AVX-512.
#include "cpu_vec.h"

#include <c10/util/Half.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

namespace {

// an fp16 as float32 (exact either way; F16C's one instruction where the build has it)
inline float half(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block
void scale_min_k4(int j, const uint8_t* q, uint8_t* sc, uint8_t* m) {
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
      uint8_t sc, m;
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

}  // namespace
