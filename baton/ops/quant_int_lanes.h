// The vector types and operations of the integer GGUF kernels (quant_int_kernels.h, which
// includes this once per instruction set, inside that set's namespace: no include guard): 8 lanes
// in 256-bit vectors, and with AVX-512 (BATON_VNNI 1) 16 in 512-bit ones, overloaded by type so
// one kernel body serves both widths. Lane l of every operation depends only on lane l's inputs.

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

inline int32_t load_dword(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// the 64-byte lines of `bytes` at blk, `ahead` bytes on (a group's blocks are one sequential stream),
// into L2: a decode step's weights stream from DRAM, and prefetches into L1 hold its few miss
// buffers, so a core kept too few lines in flight (T1 rather than T0 took one row of Q4_K / Q6_K
// from 17 / 12 to 29 / 28 GB/s on 2 Zen 4 cores, AVX2's 8 lanes from 20 / 17 to 30 / 30)
inline void prefetch_block(const uint8_t* blk, int64_t bytes, int64_t ahead) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(blk) + ahead + off, _MM_HINT_T1);
}

// How far ahead to prefetch a group of `gs` bytes: a short group (2048 values of a 4- or 6-bit format) ends
// before 4 KiB ahead covers the miss latency at a call's start, so 16 KiB reaches into the
// thread's next groups; a long one streams at 4 KiB (8 KiB read no faster from DRAM, into L2, on Zen 4).
inline int64_t prefetch_ahead(int64_t gs) { return gs < 16384 ? 16384 : 4096; }

// The vector types of I (integer lanes) and F (float lanes): loads of regrouped blocks (one group
// at p; with 16 lanes a second `gs` bytes on) and constants.
template <class I>
struct Lanes;

template <>
struct Lanes<__m256i> {
  using F = __m256;
  static constexpr int kN = 8;
  static __m256i load(const uint8_t* p, int64_t) { return load32(p); }
  static __m256 halves(const uint8_t* p, int64_t) {  // fp16 of each lane as a float (exact)
#ifdef __F16C__
    return _mm256_cvtph_ps(load16(p));
#else
    alignas(32) float v[8];
    for (int r = 0; r < 8; ++r) v[r] = half(p + 2 * r);
    return _mm256_load_ps(v);
#endif
  }
  static void prefetch(const uint8_t* p, int64_t gs, int64_t bytes) { prefetch_block(p, bytes, prefetch_ahead(gs)); }
  static __m256i bytes(int v) { return _mm256_set1_epi8(static_cast<char>(v)); }
  static __m256i dwords(int32_t v) { return _mm256_set1_epi32(v); }
  static __m256i zero() { return _mm256_setzero_si256(); }
  static __m256 floats(float v) { return _mm256_set1_ps(v); }
  static __m256 fzero() { return _mm256_setzero_ps(); }
  static __m256 loadf(const float* p) { return _mm256_loadu_ps(p); }
};

inline __m256i vand(__m256i a, __m256i b) { return _mm256_and_si256(a, b); }
inline __m256i vor(__m256i a, __m256i b) { return _mm256_or_si256(a, b); }
inline __m256i vadd(__m256i a, __m256i b) { return _mm256_add_epi32(a, b); }
inline __m256i vsub(__m256i a, __m256i b) { return _mm256_sub_epi32(a, b); }
inline __m256i vmullo(__m256i a, __m256i b) { return _mm256_mullo_epi32(a, b); }
inline __m256i vmadd16(__m256i a, __m256i b) { return _mm256_madd_epi16(a, b); }
inline __m256i vsrl16(__m256i a, int n) { return _mm256_srli_epi16(a, n); }
inline __m256i vsll16(__m256i a, int n) { return _mm256_slli_epi16(a, n); }
inline __m256i vsrl32(__m256i a, int n) { return _mm256_srli_epi32(a, n); }
inline __m256i vsll32(__m256i a, int n) { return _mm256_slli_epi32(a, n); }
inline __m256i vsra32(__m256i a, int n) { return _mm256_srai_epi32(a, n); }
inline __m256i vodd16(__m256i even, __m256i odd) { return _mm256_blend_epi16(even, odd, 0xAA); }
inline __m256 vcvt(__m256i a) { return _mm256_cvtepi32_ps(a); }
inline __m256 vmul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
inline __m256 vaddf(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
inline __m256 vfma(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }
inline __m256 vfnma(__m256 a, __m256 b, __m256 c) { return _mm256_fnmadd_ps(a, b, c); }

#if BATON_VNNI != 0  // AVX2 alone sums through maddubs (DotAcc, quant_int_kernels.h)
// acc + (lane l: sum over k < 4 of u[4l + k] * s[4l + k]), u unsigned, s signed bytes
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if BATON_VNNI == 1
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}

// the same for signed codes c: |c| times x with c's sign
inline __m256i dpbssd(__m256i acc, __m256i c, __m256i x) {
  return dpbusd(acc, _mm256_sign_epi8(c, c), _mm256_sign_epi8(x, c));
}
#endif

#if BATON_VNNI == 1
template <>
struct Lanes<__m512i> {
  using F = __m512;
  static constexpr int kN = 16;
  static __m512i load(const uint8_t* p, int64_t gs) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(load32(p)), load32(p + gs), 1);
  }
  static __m512 halves(const uint8_t* p, int64_t gs) {
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(load16(p)), load16(p + gs), 1));
  }
  static void prefetch(const uint8_t* p, int64_t gs, int64_t bytes) {
    prefetch_block(p, bytes, prefetch_ahead(gs));
    prefetch_block(p + gs, bytes, prefetch_ahead(gs));
  }
  static __m512i bytes(int v) { return _mm512_set1_epi8(static_cast<char>(v)); }
  static __m512i dwords(int32_t v) { return _mm512_set1_epi32(v); }
  static __m512i zero() { return _mm512_setzero_si512(); }
  static __m512 floats(float v) { return _mm512_set1_ps(v); }
  static __m512 fzero() { return _mm512_setzero_ps(); }
  static __m512 loadf(const float* p) { return _mm512_loadu_ps(p); }
};

inline __m512i vand(__m512i a, __m512i b) { return _mm512_and_si512(a, b); }
inline __m512i vor(__m512i a, __m512i b) { return _mm512_or_si512(a, b); }
inline __m512i vadd(__m512i a, __m512i b) { return _mm512_add_epi32(a, b); }
inline __m512i vsub(__m512i a, __m512i b) { return _mm512_sub_epi32(a, b); }
inline __m512i vmullo(__m512i a, __m512i b) { return _mm512_mullo_epi32(a, b); }
inline __m512i vmadd16(__m512i a, __m512i b) { return _mm512_madd_epi16(a, b); }
inline __m512i vsrl16(__m512i a, int n) { return _mm512_srli_epi16(a, n); }
inline __m512i vsll16(__m512i a, int n) { return _mm512_slli_epi16(a, n); }
inline __m512i vsrl32(__m512i a, int n) { return _mm512_srli_epi32(a, n); }
inline __m512i vsll32(__m512i a, int n) { return _mm512_slli_epi32(a, n); }
inline __m512i vsra32(__m512i a, int n) { return _mm512_srai_epi32(a, n); }
inline __m512i vodd16(__m512i even, __m512i odd) { return _mm512_mask_blend_epi16(0xAAAAAAAA, even, odd); }
inline __m512 vcvt(__m512i a) { return _mm512_cvtepi32_ps(a); }
inline __m512 vmul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
inline __m512 vaddf(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
inline __m512 vfma(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }
inline __m512 vfnma(__m512 a, __m512 b, __m512 c) { return _mm512_fnmadd_ps(a, b, c); }
inline __m512i dpbusd(__m512i acc, __m512i u, __m512i s) { return _mm512_dpbusd_epi32(acc, u, s); }
inline __m512i dpbssd(__m512i acc, __m512i c, __m512i x) {  // no vpsignb in AVX-512: x negated where c < 0
  return _mm512_dpbusd_epi32(acc, _mm512_abs_epi8(c), _mm512_mask_sub_epi8(x, _mm512_movepi8_mask(c), _mm512_setzero_si512(), x));
}
#endif

