// Integer dot products of GGUF weight blocks with activations quantized per block (int8 with a
// float32 scale), for R rows of x at once. Included by quant_int.cpp once per instruction set,
// inside that set's namespace and under its `#pragma GCC target`, with BATON_VNNI 0 (AVX2:
// maddubs + madd), 1 (AVX512-VNNI on 256-bit vectors) or 2 (AVX-VNNI).
//
// Every integer sum is exact, so the instruction sets differ only in how they reach the same
// int32 lanes (lane l: bytes 4l .. 4l + 3 of a 32-byte chunk); all float arithmetic is shared and
// written as explicit fused operations, so the three give the same bits, and a row's bits do not
// depend on R (each row's accumulators take the same operations in the same order).
//
// Activations: XRows (quant_int.cpp).

// lane l: sum over k < 4 of u[4l + k] * s[4l + k] (u unsigned, s signed bytes; every pair of
// products stays inside int16, which maddubs needs)
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if BATON_VNNI == 1
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif BATON_VNNI == 2
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// the same for signed w: |w| times x with w's sign
inline __m256i dot_s8s8(__m256i w, __m256i x) { return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

// A per-lane integer scale: a for lanes 0-3 (bytes 0-15), b for lanes 4-7 (bytes 16-31)
struct LaneScale {
  __m256i v;
  LaneScale(int a, int b) {
#if BATON_VNNI
    v = _mm256_setr_m128i(_mm_set1_epi32(a), _mm_set1_epi32(b));
#else
    v = _mm256_setr_m128i(_mm_set1_epi16(static_cast<int16_t>(a)), _mm_set1_epi16(static_cast<int16_t>(b)));
#endif
  }
};

// dot_u8s8 with each lane times its scale
inline __m256i dot_u8s8_scaled(__m256i u, __m256i s, const LaneScale& sc) {
#if BATON_VNNI
  return _mm256_mullo_epi32(dot_u8s8(u, s), sc.v);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), sc.v);
#endif
}

inline __m256i dot_s8s8_scaled(__m256i w, __m256i x, const LaneScale& sc) {
  return dot_u8s8_scaled(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w), sc);
}

inline __m256i load32(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// 16 bytes of nibbles: the low ones (values 0-15), then the high ones (values 16-31)
inline __m256i nibbles(const uint8_t* p) {
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  return _mm256_setr_m128i(_mm_and_si128(raw, low4), _mm_and_si128(_mm_srli_epi16(raw, 4), low4));
}

// bit j of the 32 bits at p as byte j: 0x10 where set, 0 where not (Q5's fifth bit)
inline __m256i fifth_bits(const uint8_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, 4);
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3));
  const __m256i mask = _mm256_set1_epi64x(0x8040201008040201LL);
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask), _mm256_set1_epi8(0x10));
}

// the lanes' sum, in a fixed order
inline float reduce(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// y[r] for R rows against one weight row of `nb` blocks.
template <int R>
struct Acc {
  __m256 v[R];
  float m[R];
  Acc() {
    for (int r = 0; r < R; ++r) v[r] = _mm256_setzero_ps(), m[r] = 0.f;
  }
  void add(int r, __m256i lanes, float scale) {
    v[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_set1_ps(scale), v[r]);
  }
  void out(float* y, int64_t y_stride, float bias) const {
    for (int r = 0; r < R; ++r) y[r * y_stride] = reduce(v[r]) + m[r] + bias;
  }
};

// Q8_0 (d, 32 int8), Q4_0 (d, nibbles; d * (q - 8)), Q5_0 (d, fifth bits, nibbles; d * (q - 16)):
// signed codes. Q4_1 / Q5_1 (d, m, ...; d * q + m): unsigned codes, m times the codes' sum.
enum class Kind { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1 };

template <Kind K>
inline __m256i codes32(const uint8_t* b) {
  if constexpr (K == Kind::kQ8_0) return load32(b + 2);
  if constexpr (K == Kind::kQ4_0) return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
  if constexpr (K == Kind::kQ4_1) return nibbles(b + 4);
  if constexpr (K == Kind::kQ5_0)
    return _mm256_sub_epi8(_mm256_or_si256(nibbles(b + 6), fifth_bits(b + 2)), _mm256_set1_epi8(16));
  if constexpr (K == Kind::kQ5_1) return _mm256_or_si256(nibbles(b + 8), fifth_bits(b + 4));
}

template <Kind K, int64_t Bytes, int R>
void dot_blocks32(const uint8_t* w, int64_t nb, const XRows& x, float* y, int64_t y_stride, float bias) {
  constexpr bool kOffset = K == Kind::kQ4_1 || K == Kind::kQ5_1;
  Acc<R> acc;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * Bytes;
    _mm_prefetch(reinterpret_cast<const char*>(blk) + 1024, _MM_HINT_T0);
    const __m256i c = codes32<K>(blk);
    const float d = half(blk);
    for (int r = 0; r < R; ++r) {
      const __m256i xv = load32(x.q + r * x.stride + b * 32);
      const float dx = x.d[r * x.bstride + b];
      if constexpr (kOffset) {
        acc.add(r, dot_u8s8(c, xv), d * dx);
        acc.m[r] = std::fma(half(blk + 2), x.s[r * x.bstride + b], acc.m[r]);
      } else {
        acc.add(r, dot_s8s8(c, xv), d * dx);
      }
    }
  }
  acc.out(y, y_stride, bias);
}

// Q4_K (d, dmin, scales, 128 bytes of nibbles) and Q5_K (... 32 bytes of fifth bits first): per
// 256 values d * sc_j * q - dmin * m_j, for 8 sub-blocks j of 32
template <bool Q5, int R>
void dot_k45(const uint8_t* w, int64_t nb, const XRows& x, float* y, int64_t y_stride, float bias) {
  constexpr int64_t kBytes = Q5 ? 176 : 144;
  Acc<R> acc;
  const __m256i low4 = _mm256_set1_epi8(0x0F), one = _mm256_set1_epi8(1);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * kBytes;
    _mm_prefetch(reinterpret_cast<const char*>(blk) + 1024, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk) + 1088, _MM_HINT_T0);
    const float d = half(blk), dmin = half(blk + 2);
    uint8_t sm[16];  // the 8 sub-blocks' scales, then their mins
    for (int j = 0; j < 8; ++j) scale_min_k4(j, blk + 4, sm + j, sm + 8 + j);
    const __m128i mins = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sm + 8)));
    const uint8_t* qs = blk + (Q5 ? 48 : 16);
    const __m256i qh = Q5 ? load32(blk + 16) : _mm256_setzero_si256();
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high nibbles)
      const __m256i raw = load32(qs + 32 * p);
      __m256i lo = _mm256_and_si256(raw, low4), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), low4);
      if constexpr (Q5) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4));
      }
      const LaneScale s_lo(sm[2 * p], sm[2 * p]), s_hi(sm[2 * p + 1], sm[2 * p + 1]);
      for (int r = 0; r < R; ++r) {
        const int8_t* xq = x.q + r * x.stride + b * 256 + 64 * p;
        isum[r] = _mm256_add_epi32(isum[r], dot_u8s8_scaled(lo, load32(xq), s_lo));
        isum[r] = _mm256_add_epi32(isum[r], dot_u8s8_scaled(hi, load32(xq + 32), s_hi));
      }
    }
    for (int r = 0; r < R; ++r) {
      const float dx = x.d[r * x.bstride + b];
      acc.add(r, isum[r], d * dx);
      const __m128i bs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x.bsum + (r * x.bstride + b) * 8));
      __m128i mm = _mm_madd_epi16(mins, bs);
      mm = _mm_add_epi32(mm, _mm_shuffle_epi32(mm, 0x4E));
      mm = _mm_add_epi32(mm, _mm_shuffle_epi32(mm, 0xB1));
      acc.m[r] = std::fma(-dmin * dx, static_cast<float>(_mm_cvtsi128_si32(mm)), acc.m[r]);
    }
  }
  acc.out(y, y_stride, bias);
}

// Q6_K (ql 128, qh 64, 16 int8 scales, d): per 256 values d * sc[i / 16] * (q - 32), q 4 bits
// from ql and 2 from qh; per 128 values, the 32 values of group g take ql's low (g < 2) or high
// nibbles of bytes [32 (g & 1), +32) and qh's bits 2g, 2g + 1
template <int R>
void dot_q6_k(const uint8_t* w, int64_t nb, const XRows& x, float* y, int64_t y_stride, float bias) {
  Acc<R> acc;
  const __m256i low4 = _mm256_set1_epi8(0x0F), three = _mm256_set1_epi8(3), bias32 = _mm256_set1_epi8(32);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 210;
    _mm_prefetch(reinterpret_cast<const char*>(blk) + 1024, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk) + 1088, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(blk) + 1152, _MM_HINT_T0);
    const int8_t* sc = reinterpret_cast<const int8_t*>(blk + 192);
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int n = 0; n < 2; ++n) {
      const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
      const __m256i h = load32(qh), l0 = load32(ql), l1 = load32(ql + 32);
      for (int g = 0; g < 4; ++g) {
        const __m256i l = (g & 1) ? l1 : l0;
        const __m256i low = g < 2 ? _mm256_and_si256(l, low4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), low4);
        const __m256i high = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, 2 * g), three), 4);
        const __m256i c = _mm256_sub_epi8(_mm256_or_si256(low, high), bias32);
        const int offset = 128 * n + 32 * g;
        const LaneScale s(sc[offset / 16], sc[offset / 16 + 1]);
        for (int r = 0; r < R; ++r)
          isum[r] = _mm256_add_epi32(isum[r], dot_s8s8_scaled(c, load32(x.q + r * x.stride + b * 256 + offset), s));
      }
    }
    const float d = half(blk + 208);
    for (int r = 0; r < R; ++r) acc.add(r, isum[r], d * x.d[r * x.bstride + b]);
  }
  acc.out(y, y_stride, bias);
}

// y[r, n] for rows [0, R) of x and one weight row w of `nb` blocks of a format's `block_bytes`
template <int R>
void dot_rows(int64_t block_bytes, const uint8_t* w, int64_t nb, const XRows& x, float* y, int64_t y_stride,
              float bias) {
  switch (block_bytes) {
    case 34: return dot_blocks32<Kind::kQ8_0, 34, R>(w, nb, x, y, y_stride, bias);
    case 18: return dot_blocks32<Kind::kQ4_0, 18, R>(w, nb, x, y, y_stride, bias);
    case 20: return dot_blocks32<Kind::kQ4_1, 20, R>(w, nb, x, y, y_stride, bias);
    case 22: return dot_blocks32<Kind::kQ5_0, 22, R>(w, nb, x, y, y_stride, bias);
    case 24: return dot_blocks32<Kind::kQ5_1, 24, R>(w, nb, x, y, y_stride, bias);
    case 144: return dot_k45<false, R>(w, nb, x, y, y_stride, bias);
    case 176: return dot_k45<true, R>(w, nb, x, y, y_stride, bias);
    case 210: return dot_q6_k<R>(w, nb, x, y, y_stride, bias);
  }
}
