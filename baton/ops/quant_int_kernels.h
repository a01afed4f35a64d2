// Integer dot products of GGUF weight blocks with activations quantized per block (int8 with a
// float32 scale): 8 weight rows (outputs) at once, one per 32-bit lane, against R rows of x.
// Included by quant_int.cpp once per instruction set, inside that set's namespace and under its
// `#pragma GCC target`, with BATON_VNNI 0 (AVX2: maddubs + madd), 1 (AVX512-VNNI on 256-bit
// vectors) or 2 (AVX-VNNI).
//
// A block's codes of the 8 rows (regrouped at load, lane r holding row r's 4 bytes of a group of 4
// values) are unpacked once and meet each row of x as broadcast 4-byte groups: each lane sums one output's block in
// integers, exactly (the instruction sets differ only in how they reach the same int32), then takes
// one scale product and one fused add per block, in block order within each of K's parts, the
// parts' sums added as a balanced tree (dot8_parts), in its own lane. So the
// instruction sets give the same bits, and an output's bits depend neither on R nor on which rows
// share its group: decode and prefill rows come out the same.
//
// Activations: XRows (quant_int.cpp).

inline __m128i load16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }

inline int32_t load_dword(const void* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc + (lane l: sum over k < 4 of u[4l + k] * s[4l + k]), u unsigned, s signed bytes (every
// pair of products stays inside int16, which maddubs needs)
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if BATON_VNNI == 1
  return _mm256_dpbusd_epi32(acc, u, s);
#elif BATON_VNNI == 2
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// the same for signed codes c: |c| times x with c's sign
inline __m256i dpbssd(__m256i acc, __m256i c, __m256i x) {
  return dpbusd(acc, _mm256_sign_epi8(c, c), _mm256_sign_epi8(x, c));
}

// x's 4 codes at p in every lane
inline __m256i x_group(const int8_t* p) { return _mm256_set1_epi32(load_dword(p)); }

// A block of 8 weight rows as regroup_blocks (quant_int.cpp) lays it out: each field of a row's
// block at byte o (an fp16, 32 bits, or 16 bytes of codes) becomes 8 times as many bytes at 8 o,
// lane r holding row r's part. These read it back.
inline __m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// out[t], lane r: bytes [4t, 4t + 4) of the 16 at o of row r, for t < 4
inline void field_dwords(const uint8_t* blk, int64_t o, __m256i* out) {
  for (int t = 0; t < 4; ++t) out[t] = load32(blk + 8 * o + 32 * t);
}

// lane r: the 32 bits at o of row r
inline __m256i field_u32(const uint8_t* blk, int64_t o) { return load32(blk + 8 * o); }

// lane r: the fp16 at o of row r as a float (exact)
inline __m256 field_half(const uint8_t* blk, int64_t o) {
#ifdef __F16C__
  return _mm256_cvtph_ps(load16(blk + 8 * o));
#else
  alignas(32) float v[8];
  for (int r = 0; r < 8; ++r) v[r] = half(blk + 8 * o + 2 * r);
  return _mm256_load_ps(v);
#endif
}

// the 64-byte lines of a group's block `ahead` bytes on (a group's blocks are one sequential stream)
inline void prefetch_block(const uint8_t* blk, int64_t bytes, int64_t ahead) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(blk) + ahead + off, _MM_HINT_T0);
}

inline __m256i low_nibbles(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi8(0x0F)); }
inline __m256i high_nibbles(__m256i v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(0x0F)); }

// bits [4k, 4k + 4) of each lane's 32 as bytes 0x10 (set) or 0 (clear): Q5's fifth bits of group k
inline __m256i fifth_bits(__m256i qh, int k) {
  const __m256i nib = _mm256_and_si256(_mm256_srli_epi32(qh, 4 * k), _mm256_set1_epi32(0xF));
  const __m256i spread = _mm256_and_si256(_mm256_mullo_epi32(nib, _mm256_set1_epi32(0x00204081)),
                                          _mm256_set1_epi32(0x01010101));
  return _mm256_slli_epi32(spread, 4);
}

// lanes [0, n) of v to y
inline void store_lanes(float* y, __m256 v, int64_t n) {
  if (n == 8) {
    _mm256_storeu_ps(y, v);
    return;
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, v);
  for (int64_t l = 0; l < n; ++l) y[l] = lanes[l];
}

// The 8 rows' sums for R rows of x: acc + offsets
template <int R>
struct Out8 {
  __m256 acc[R], off[R];
  Out8() {
    for (int r = 0; r < R; ++r) acc[r] = off[r] = _mm256_setzero_ps();
  }
};

// Integer sums of R rows in C chains each: for a few rows two chains hide dpbusd's latency, for
// more the rows do (and registers are short). Integer sums: any order gives the same.
template <int R>
constexpr int kChains = R <= 2 ? 2 : 1;

// acc[c] summed into acc[0]
template <int C>
inline __m256i fold_chains(const __m256i* acc) {
  return C == 2 ? _mm256_add_epi32(acc[0], acc[1]) : acc[0];
}

// Q8_0 (d, 32 int8), Q4_0 (d, nibbles; d * (q - 8)), Q5_0 (d, fifth bits, nibbles; d * (q - 16)),
// Q4_1 / Q5_1 (d, m, ...; d * q + m): the unsigned codes meet x as they are, and q's offset
// comes off the integer sum as offset times x's codes' sum; m meets d_x times that sum. Each
// 4-value group of the 8 rows' codes is unpacked once and meets every row of x at once.
enum class Kind { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1 };

template <Kind K, int64_t Bytes, int R>
void dot8_blocks32(const uint8_t* w, int64_t nb, const XRows& x, Out8<R>& out) {
  constexpr bool kMin = K == Kind::kQ4_1 || K == Kind::kQ5_1;
  constexpr bool kFive = K == Kind::kQ5_0 || K == Kind::kQ5_1;
  constexpr int64_t kQs = 2 + (kMin ? 2 : 0) + (kFive ? 4 : 0);
  constexpr int kOffset = K == Kind::kQ4_0 ? 8 : K == Kind::kQ5_0 ? 16 : 0;
  constexpr int C = kChains<R>;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 8 * Bytes;
    prefetch_block(blk, 8 * Bytes, 4096);
    __m256i isum[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) isum[r][c] = _mm256_setzero_si256();
    const __m256i qh = kFive ? field_u32(blk, kQs - 4) : _mm256_setzero_si256();
    for (int k = 0; k < 8; ++k) {  // group k (values 4k .. 4k + 3) of the 8 rows
      __m256i code;
      if constexpr (K == Kind::kQ8_0) {
        code = load32(blk + 8 * (2 + 16 * (k / 4)) + 32 * (k % 4));
      } else {
        const __m256i raw = load32(blk + 8 * kQs + 32 * (k % 4));
        code = k < 4 ? low_nibbles(raw) : high_nibbles(raw);
        if constexpr (kFive) code = _mm256_or_si256(code, fifth_bits(qh, k));
      }
      for (int r = 0; r < R; ++r) {
        const __m256i xg = x_group(x.q + r * x.stride + b * 32 + 4 * k);
        isum[r][k % C] = K == Kind::kQ8_0 ? dpbssd(isum[r][k % C], code, xg) : dpbusd(isum[r][k % C], code, xg);
      }
    }
    const __m256 d = field_half(blk, 0);
    const __m256 m = kMin ? field_half(blk, 2) : _mm256_setzero_ps();
    for (int r = 0; r < R; ++r) {
      __m256i sum = fold_chains<C>(isum[r]);
      const int64_t at = r * x.bstride + b;
      if constexpr (kOffset != 0) sum = _mm256_sub_epi32(sum, _mm256_set1_epi32(kOffset * x.bsum[at]));
      out.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), _mm256_mul_ps(d, _mm256_set1_ps(x.d[at])), out.acc[r]);
      if constexpr (kMin) out.off[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(x.s[at]), out.off[r]);
    }
  }
}

// lane r: byte j of lane r's 32 bits as int32
inline __m256i byte_of(__m256i v, int j) {
  return _mm256_and_si256(_mm256_srli_epi32(v, 8 * j), _mm256_set1_epi32(0xFF));
}

// Q4_K (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) and Q5_K (... 32 bytes
// of fifth bits before the nibbles): per 256 values d * sc_j * q - dmin * m_j for 8 sub-blocks j
// of 32; sub-blocks 2p and 2p + 1 are the low and high nibbles of bytes [32p, 32p + 32).
template <bool Q5, int R>
void dot8_k45(const uint8_t* w, int64_t nb, const XRows& x, Out8<R>& out) {
  constexpr int64_t kBytes = Q5 ? 176 : 144;
  constexpr int64_t kQs = Q5 ? 48 : 16;
  constexpr int C = kChains<R>;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 8 * kBytes;
    prefetch_block(blk, kBytes * 8, 4096);
    // ggml's get_scale_min_k4 for 8 rows at once: q = the 12 scale bytes as dwords s0, s1, s2
    const __m256i s0 = field_u32(blk, 4), s1 = field_u32(blk, 8), s2 = field_u32(blk, 12);
    const __m256i six = _mm256_set1_epi8(63), top2 = _mm256_set1_epi8(static_cast<char>(0xC0));
    const __m256i sc_lo = _mm256_and_si256(s0, six), mn_lo = _mm256_and_si256(s1, six);
    const __m256i sc_hi = _mm256_or_si256(low_nibbles(s2), _mm256_srli_epi16(_mm256_and_si256(s0, top2), 2));
    const __m256i mn_hi = _mm256_or_si256(high_nibbles(s2), _mm256_srli_epi16(_mm256_and_si256(s1, top2), 2));
    {
      __m256i mins[4];  // mins of sub-blocks 2i, 2i + 1 as int16 pairs
      for (int i = 0; i < 2; ++i) {
        const __m256i lo = _mm256_and_si256(_mm256_srli_epi32(mn_lo, 16 * i), _mm256_set1_epi32(0xFFFF));
        const __m256i hi = _mm256_and_si256(_mm256_srli_epi32(mn_hi, 16 * i), _mm256_set1_epi32(0xFFFF));
        // bytes (m_2i, m_2i+1) of each lane as two int16
        mins[i] = _mm256_and_si256(_mm256_or_si256(lo, _mm256_slli_epi32(lo, 8)), _mm256_set1_epi32(0x00FF00FF));
        mins[i + 2] = _mm256_and_si256(_mm256_or_si256(hi, _mm256_slli_epi32(hi, 8)), _mm256_set1_epi32(0x00FF00FF));
      }
      const __m256 dmin = field_half(blk, 2);
      for (int r = 0; r < R; ++r) {  // the mins' part: dmin * sum over j of m_j * bsum_j, two sub-blocks a madd
        const int16_t* bsum = x.bsum + (r * x.bstride + b) * 8;
        __m256i msum = _mm256_setzero_si256();
        for (int i = 0; i < 4; ++i) {
          const int pair = static_cast<int>(static_cast<uint16_t>(bsum[2 * i])) | (static_cast<int>(bsum[2 * i + 1]) << 16);
          msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins[i], _mm256_set1_epi32(pair)));
        }
        const __m256 dx = _mm256_set1_ps(x.d[r * x.bstride + b]);
        out.off[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), out.off[r]);
      }
    }
    __m256i isum[R];
    for (int r = 0; r < R; ++r) isum[r] = _mm256_setzero_si256();
    for (int p = 0; p < 4; ++p) {  // sub-blocks 2p (low nibbles) and 2p + 1 (high), groups t of 4 values
      __m256i s_lo[R][C], s_hi[R][C];
      for (int r = 0; r < R; ++r)
        for (int c = 0; c < C; ++c) s_lo[r][c] = s_hi[r][c] = _mm256_setzero_si256();
      for (int t = 0; t < 8; ++t) {
        const __m256i raw = load32(blk + 8 * (kQs + 32 * p) + 32 * t);
        __m256i lo = low_nibbles(raw), hi = high_nibbles(raw);
        if constexpr (Q5) {
          const __m256i qh = load32(blk + 8 * 16 + 32 * t), one = _mm256_set1_epi8(1);
          lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p), one), 4));
          hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(qh, 2 * p + 1), one), 4));
        }
        for (int r = 0; r < R; ++r) {
          const int8_t* xq = x.q + r * x.stride + b * 256 + 64 * p + 4 * t;
          s_lo[r][t % C] = dpbusd(s_lo[r][t % C], lo, x_group(xq));
          s_hi[r][t % C] = dpbusd(s_hi[r][t % C], hi, x_group(xq + 32));
        }
      }
      const __m256i sc_a = byte_of(p < 2 ? sc_lo : sc_hi, (2 * p) % 4);
      const __m256i sc_b = byte_of(p < 2 ? sc_lo : sc_hi, (2 * p + 1) % 4);
      for (int r = 0; r < R; ++r) {
        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(fold_chains<C>(s_lo[r]), sc_a));
        isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(fold_chains<C>(s_hi[r]), sc_b));
      }
    }
    const __m256 d = field_half(blk, 0);
    for (int r = 0; r < R; ++r) {
      const __m256 dx = _mm256_set1_ps(x.d[r * x.bstride + b]);
      out.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), out.acc[r]);
    }
  }
}

// Q6_K (ql 128, qh 64, 16 int8 scales, d): per 256 values d * sc[i / 16] * (q - 32), q 4 bits
// from ql and 2 from qh; per 128 values n, the 32 values of group g take ql's low (g < 2) or high
// nibbles of bytes [32 (g & 1), +32) and qh's bits 2g, 2g + 1. The unsigned q meet x as they are;
// the offset comes off as 32 times the sum over sub-blocks of sc times x's codes' sum per 16.
template <int R>
void dot8_q6_k(const uint8_t* w, int64_t nb, const XRows& x, Out8<R>& out) {
  constexpr int C = kChains<R>;
  const __m256i mask = _mm256_set1_epi8(0x30);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 8 * 210;
    prefetch_block(blk, 8 * 210, 4096);
    __m256i isum[R];
    {
      __m256i sc_pair[8];  // the int8 scales of sub-blocks 2i, 2i + 1 of the 8 rows as int16 pairs
      for (int q4 = 0; q4 < 4; ++q4) {
        const __m256i s = field_u32(blk, 192 + 4 * q4);
        for (int j = 0; j < 4; j += 2)
          sc_pair[2 * q4 + j / 2] = _mm256_blend_epi16(_mm256_srai_epi32(_mm256_slli_epi32(s, 24 - 8 * j), 24),
                                                        _mm256_slli_epi32(_mm256_srai_epi32(_mm256_slli_epi32(s, 16 - 8 * j), 24), 16),
                                                        0xAA);
      }
      for (int r = 0; r < R; ++r) {
        const int16_t* s16 = x.bsum16 + (r * x.bstride + b) * 16;
        __m256i corr = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i) {
          const int pair = static_cast<int>(static_cast<uint16_t>(s16[2 * i])) | (static_cast<int>(s16[2 * i + 1]) << 16);
          corr = _mm256_add_epi32(corr, _mm256_madd_epi16(sc_pair[i], _mm256_set1_epi32(pair)));
        }
        isum[r] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(corr, 5));
      }
    }
    for (int n = 0; n < 2; ++n) {
      for (int g = 0; g < 4; ++g) {
        __m256i lo[R][C], hi[R][C];  // the two sub-blocks of 16 values
        for (int r = 0; r < R; ++r)
          for (int c = 0; c < C; ++c) lo[r][c] = hi[r][c] = _mm256_setzero_si256();
        for (int t = 0; t < 4; ++t) {
          __m256i code[2];  // 4-value groups t and t + 4 of the 8 rows, q in 0 .. 63
          for (int u = 0; u < 2; ++u) {
            const int tt = t + 4 * u;
            const __m256i l = load32(blk + 8 * (64 * n + 16 * (tt / 4 + 2 * (g & 1))) + 32 * (tt % 4));
            const __m256i qh = load32(blk + 8 * (128 + 32 * n + 16 * (tt / 4)) + 32 * (tt % 4));
            const __m256i low = g < 2 ? low_nibbles(l) : high_nibbles(l);
            // qh's bits 2g, 2g + 1 to bits 4, 5 of each byte (16-bit shifts: what crosses a byte is masked off)
            const __m256i h = g == 0   ? _mm256_slli_epi16(qh, 4)
                              : g == 1 ? _mm256_slli_epi16(qh, 2)
                              : g == 2 ? qh
                                       : _mm256_srli_epi16(qh, 2);
            code[u] = _mm256_or_si256(low, _mm256_and_si256(h, mask));
          }
          for (int r = 0; r < R; ++r) {
            const int8_t* xq = x.q + r * x.stride + b * 256 + 128 * n + 32 * g + 4 * t;
            lo[r][t % C] = dpbusd(lo[r][t % C], code[0], x_group(xq));
            hi[r][t % C] = dpbusd(hi[r][t % C], code[1], x_group(xq + 16));
          }
        }
        const int s = 8 * n + 2 * g;  // sub-blocks s, s + 1: scale bytes s % 4, s % 4 + 1 of dword s / 4
        const __m256i sd = field_u32(blk, 192 + 4 * (s / 4));
        const __m256i sc_a = _mm256_srai_epi32(_mm256_slli_epi32(sd, 24 - 8 * (s % 4)), 24);
        const __m256i sc_b = _mm256_srai_epi32(_mm256_slli_epi32(sd, 16 - 8 * (s % 4)), 24);
        for (int r = 0; r < R; ++r) {
          isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(fold_chains<C>(lo[r]), sc_a));
          isum[r] = _mm256_add_epi32(isum[r], _mm256_mullo_epi32(fold_chains<C>(hi[r]), sc_b));
        }
      }
    }
    const __m256 d = field_half(blk, 208);
    for (int r = 0; r < R; ++r)
      out.acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]),
                                   _mm256_mul_ps(d, _mm256_set1_ps(x.d[r * x.bstride + b])), out.acc[r]);
  }
}

// y[r * y_stride + l] for rows [0, R) of x and a group of 8 weight rows at w (`nb` blocks of a
// format's `block_bytes` per row, regrouped), lanes l < n; bias: 8 values or null. K in `parts`
// equal parts: each summed from zero (acc + offsets), the parts added pairwise as a balanced tree
// in order (0 + 1, 2 + 3, then those, ...), then the bias.
template <int R, class Kernel>
void dot8_parts(Kernel kernel, int64_t block_bytes, int64_t block_values, const uint8_t* w, int64_t nb, int64_t parts,
                const XRows& x, float* y, int64_t y_stride, int64_t n, const float* bias) {
  __m256 sums[kMaxParts][R];
  const int64_t part_blocks = nb / parts;
  for (int64_t p = 0; p < parts; ++p) {
    Out8<R> out;
    kernel(w + p * part_blocks * 8 * block_bytes, part_blocks, x.shifted(p * part_blocks, block_values), out);
    for (int r = 0; r < R; ++r) sums[p][r] = _mm256_add_ps(out.acc[r], out.off[r]);
  }
  for (int64_t width = 1; width < parts; width *= 2)
    for (int64_t p = 0; p + width < parts; p += 2 * width)
      for (int r = 0; r < R; ++r) sums[p][r] = _mm256_add_ps(sums[p][r], sums[p + width][r]);
  const __m256 b = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  for (int r = 0; r < R; ++r) store_lanes(y + r * y_stride, _mm256_add_ps(sums[0][r], b), n);
}

// the kernels as types, so dot8_parts inlines them
#define BATON_KERNEL(...) \
  [](const uint8_t* w, int64_t nb, const XRows& x, Out8<R>& out) { __VA_ARGS__(w, nb, x, out); }

template <int R>
void dot8_rows(int64_t block_bytes, const uint8_t* w, int64_t nb, int64_t parts, const XRows& x, float* y,
               int64_t y_stride, int64_t n, const float* bias) {
  switch (block_bytes) {
    case 34: return dot8_parts<R>(BATON_KERNEL(dot8_blocks32<Kind::kQ8_0, 34, R>), 34, 32, w, nb, parts, x, y, y_stride, n, bias);
    case 18: return dot8_parts<R>(BATON_KERNEL(dot8_blocks32<Kind::kQ4_0, 18, R>), 18, 32, w, nb, parts, x, y, y_stride, n, bias);
    case 20: return dot8_parts<R>(BATON_KERNEL(dot8_blocks32<Kind::kQ4_1, 20, R>), 20, 32, w, nb, parts, x, y, y_stride, n, bias);
    case 22: return dot8_parts<R>(BATON_KERNEL(dot8_blocks32<Kind::kQ5_0, 22, R>), 22, 32, w, nb, parts, x, y, y_stride, n, bias);
    case 24: return dot8_parts<R>(BATON_KERNEL(dot8_blocks32<Kind::kQ5_1, 24, R>), 24, 32, w, nb, parts, x, y, y_stride, n, bias);
    case 144: return dot8_parts<R>(BATON_KERNEL(dot8_k45<false, R>), 144, 256, w, nb, parts, x, y, y_stride, n, bias);
    case 176: return dot8_parts<R>(BATON_KERNEL(dot8_k45<true, R>), 176, 256, w, nb, parts, x, y, y_stride, n, bias);
    case 210: return dot8_parts<R>(BATON_KERNEL(dot8_q6_k<R>), 210, 256, w, nb, parts, x, y, y_stride, n, bias);
  }
}
#undef BATON_KERNEL
