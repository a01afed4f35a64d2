// Integer dot products of GGUF weight blocks with activations quantized per block (int8 with a
// float32 scale): 8 weight rows (outputs) at once, one per 32-bit lane, against R rows of x; with
// AVX-512, 16 (two groups of 8 side by side in a 512-bit vector, lanes 8-15 the next group's).
// Included by quant_int.cpp once per instruction set, inside that set's namespace and under its
// `#pragma GCC target`, with BATON_VNNI 0 (AVX2: maddubs + madd), 1 (AVX512-VNNI: 16 lanes, and 8
// for an odd group out) or 2 (AVX-VNNI).
//
// A block's codes of the 8 rows (regrouped at load, lane r holding row r's 4 bytes of a group of 4
// values) are unpacked once and meet each row of x as broadcast 4-byte groups: each lane sums one
// output's block in integers, exactly (the instruction sets differ only in how they reach the same
// int32), then takes one scale product and one fused add per block, in block order within each of
// K's parts, the parts' sums added as a balanced tree (dot_parts), in its own lane. So the
// instruction sets and vector widths give the same bits, and an output's bits depend neither on R
// nor on which rows share its group: decode and prefill rows come out the same.
//
// Activations: XRows (quant_int.cpp).

#include "quant_int_lanes.h"

// Loops over a compile-time count are unrolled whole: GCC's own peeling stops short of these
// bodies and leaves offsets and shift counts to run time (unrolled, a core's decode rate in L2
// rose 1.5x for Q6_K and Q4_K).
#define BATON_UNROLL _Pragma("GCC unroll 16")

// x's 4 codes at p in every lane
template <class I>
inline I x_group(const int8_t* p) { return Lanes<I>::dwords(load_dword(p)); }

// A block of 8 weight rows as regroup_blocks (quant_int.cpp) lays it out: each field of a row's
// block at byte o (an fp16, 32 bits, or 16 bytes of codes) becomes 8 times as many bytes at 8 o,
// lane r holding row r's part. These read it back (with 16 lanes, the next group's too).

// lane r: the 32 bits at o of row r
template <class I>
inline I field_u32(const uint8_t* blk, int64_t gs, int64_t o) { return Lanes<I>::load(blk + 8 * o, gs); }

// lane r: the fp16 at o of row r as a float (exact)
template <class I>
inline typename Lanes<I>::F field_half(const uint8_t* blk, int64_t gs, int64_t o) { return Lanes<I>::halves(blk + 8 * o, gs); }

template <class I>
inline I low_nibbles(I v) { return vand(v, Lanes<I>::bytes(0x0F)); }
template <class I>
inline I high_nibbles(I v) { return vand(vsrl16(v, 4), Lanes<I>::bytes(0x0F)); }

// bits [4k, 4k + 4) of each lane's 32 as bytes 0x10 (set) or 0 (clear): Q5's fifth bits of group k
template <class I>
inline I fifth_bits(I qh, int k) {
  using V = Lanes<I>;
  const I nib = vand(vsrl32(qh, 4 * k), V::dwords(0xF));
  return vsll32(vand(vmullo(nib, V::dwords(0x00204081)), V::dwords(0x01010101)), 4);
}

// lanes [0, n) of v to y
template <class F>
inline void store_lanes(float* y, F v, int64_t n) {
  constexpr int kN = sizeof(F) / sizeof(float);
  if (n == kN) {
    std::memcpy(y, &v, sizeof(F));
    return;
  }
  alignas(64) float lanes[kN];
  std::memcpy(lanes, &v, sizeof(F));
  for (int64_t l = 0; l < n; ++l) y[l] = lanes[l];
}

// The lanes' sums for R rows of x: acc + offsets
template <int R, class F>
struct Out {
  F acc[R], off[R];
  Out() {
    for (int r = 0; r < R; ++r) acc[r] = off[r] = F{};
  }
};

// Integer sums of R rows in C chains each: for a few rows two chains hide dpbusd's latency, for
// more the rows do (and registers are short). Integer sums: any order gives the same.
template <int R>
constexpr int kChains = R <= 2 ? 2 : 1;

// An int32 sum per lane of 4-byte dot products u · s over add() calls: u unsigned codes below
// 2^Bits, s int8 (|s| <= 128). With VNNI one dpbusd a call. On AVX2 maddubs' int16 pairs are added
// in int16 for as many calls as cannot overflow (kRun: 8 for 4-bit codes, 4 for 5-bit, 2 for 6-bit)
// and widened by one madd per run, not per call: fewer multiplies than maddubs + madd each, the
// same integers (a prefill row on AVX2 is bound by them). Calls in fully unrolled loops, so the
// count is known at compile time.
template <class I, int Bits>
struct DotAcc {
  I sum = Lanes<I>::zero();
#if BATON_VNNI == 0
  static constexpr int kRun = std::max(1, 32767 / (2 * ((1 << Bits) - 1) * 128));
  I pairs = Lanes<I>::zero();
  int n = 0;
#endif
  inline void add(I u, I s) {
#if BATON_VNNI == 0
    const I p = _mm256_maddubs_epi16(u, s);
    pairs = n == 0 ? p : _mm256_add_epi16(pairs, p);
    // the running sum held in a register here: otherwise GCC rebalances a run into a tree whose
    // products all live at once and spill (a third of Q4_K's instructions were stack moves)
    __asm__("" : "+x"(pairs));
    if (++n == kRun) flush();
#else
    sum = dpbusd(sum, u, s);
#endif
  }
  // the same for signed codes c: |c| times s with c's sign (Bits 8)
  inline void add_signed(I c, I s) {
#if BATON_VNNI == 0
    add(_mm256_sign_epi8(c, c), _mm256_sign_epi8(s, c));
#else
    sum = dpbssd(sum, c, s);
#endif
  }
  inline void flush() {
#if BATON_VNNI == 0
    if (n == 0) return;
    sum = vadd(sum, vmadd16(pairs, _mm256_set1_epi16(1)));
    n = 0;
#endif
  }
};

// acc[c]'s sums added into one
template <int C, class I, int Bits>
inline I fold_chains(DotAcc<I, Bits>* acc) {
  acc[0].flush();
  if constexpr (C == 2) {
    acc[1].flush();
    return vadd(acc[0].sum, acc[1].sum);
  }
  return acc[0].sum;
}

// Q8_0 (d, 32 int8), Q4_0 (d, nibbles; d * (q - 8)), Q5_0 (d, fifth bits, nibbles; d * (q - 16)),
// Q4_1 / Q5_1 (d, m, ...; d * q + m): the unsigned codes meet x as they are, and q's offset
// comes off the integer sum as offset times x's codes' sum; m meets d_x times that sum. Each
// 4-value group of the rows' codes is unpacked once and meets every row of x at once.
enum class Kind { kQ8_0, kQ4_0, kQ4_1, kQ5_0, kQ5_1 };

template <Kind K, int64_t Bytes, int R, class I>
void dot_blocks32(const uint8_t* w, int64_t gs, int64_t nb, const XRows& x, Out<R, typename Lanes<I>::F>& out) {
  using V = Lanes<I>;
  using F = typename V::F;
  constexpr bool kMin = K == Kind::kQ4_1 || K == Kind::kQ5_1;
  constexpr bool kFive = K == Kind::kQ5_0 || K == Kind::kQ5_1;
  constexpr int64_t kQs = 2 + (kMin ? 2 : 0) + (kFive ? 4 : 0);
  constexpr int kOffset = K == Kind::kQ4_0 ? 8 : K == Kind::kQ5_0 ? 16 : 0;
  constexpr int kBits = K == Kind::kQ8_0 ? 8 : kFive ? 5 : 4;
  constexpr int C = kChains<R>;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 8 * Bytes;
    V::prefetch(blk, gs, 8 * Bytes);
    DotAcc<I, kBits> isum[R][C];
    const I qh = kFive ? field_u32<I>(blk, gs, kQs - 4) : V::zero();
    BATON_UNROLL
    for (int k = 0; k < 8; ++k) {  // group k (values 4k .. 4k + 3) of the rows
      I code;
      if constexpr (K == Kind::kQ8_0) {
        code = V::load(blk + 8 * (2 + 16 * (k / 4)) + 32 * (k % 4), gs);
      } else {
        const I raw = V::load(blk + 8 * kQs + 32 * (k % 4), gs);
        code = k < 4 ? low_nibbles(raw) : high_nibbles(raw);
        if constexpr (kFive) code = vor(code, fifth_bits(qh, k));
      }
      BATON_UNROLL
      for (int r = 0; r < R; ++r) {
        const I xg = x_group<I>(x.q + r * x.stride + b * 32 + 4 * k);
        if constexpr (K == Kind::kQ8_0) isum[r][k % C].add_signed(code, xg);
        else isum[r][k % C].add(code, xg);
      }
    }
    const F d = field_half<I>(blk, gs, 0);
    const F m = kMin ? field_half<I>(blk, gs, 2) : V::fzero();
    BATON_UNROLL
    for (int r = 0; r < R; ++r) {
      I sum = fold_chains<C>(isum[r]);
      const int64_t at = r * x.bstride + b;
      if constexpr (kOffset != 0) sum = vsub(sum, V::dwords(kOffset * x.bsum[at]));
      out.acc[r] = vfma(vcvt(sum), vmul(d, V::floats(x.d[at])), out.acc[r]);
      if constexpr (kMin) out.off[r] = vfma(m, V::floats(x.s[at]), out.off[r]);
    }
  }
}

// lane r: byte j of lane r's 32 bits as int32
template <class I>
inline I byte_of(I v, int j) {
  return vand(vsrl32(v, 8 * j), Lanes<I>::dwords(0xFF));
}

// (the int16 pair at 2i of s) in every lane, as 32 bits
inline int32_t pair16(const int16_t* s, int i) {
  return static_cast<int32_t>(static_cast<uint16_t>(s[2 * i])) | (static_cast<int32_t>(s[2 * i + 1]) << 16);
}

// Q4_K (d, dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles) and Q5_K (... 32 bytes
// of fifth bits before the nibbles): per 256 values d * sc_j * q - dmin * m_j for 8 sub-blocks j
// of 32; sub-blocks 2p and 2p + 1 are the low and high nibbles of bytes [32p, 32p + 32).
template <bool Q5, int R, class I>
void dot_k45(const uint8_t* w, int64_t gs, int64_t nb, const XRows& x, Out<R, typename Lanes<I>::F>& out) {
  using V = Lanes<I>;
  using F = typename V::F;
  constexpr int64_t kBytes = Q5 ? 176 : 144;
  constexpr int64_t kQs = Q5 ? 48 : 16;
  constexpr int C = kChains<R>;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 8 * kBytes;
    V::prefetch(blk, gs, kBytes * 8);
    // ggml's get_scale_min_k4 for the rows at once: q = the 12 scale bytes as dwords s0, s1, s2
    const I s0 = field_u32<I>(blk, gs, 4), s1 = field_u32<I>(blk, gs, 8), s2 = field_u32<I>(blk, gs, 12);
    const I six = V::bytes(63), top2 = V::bytes(0xC0);
    const I sc_lo = vand(s0, six), mn_lo = vand(s1, six);
    const I sc_hi = vor(low_nibbles(s2), vsrl16(vand(s0, top2), 2));
    const I mn_hi = vor(high_nibbles(s2), vsrl16(vand(s1, top2), 2));
    {
      I mins[4];  // mins of sub-blocks 2i, 2i + 1 as int16 pairs
      BATON_UNROLL
      for (int i = 0; i < 2; ++i) {
        const I lo = vand(vsrl32(mn_lo, 16 * i), V::dwords(0xFFFF));
        const I hi = vand(vsrl32(mn_hi, 16 * i), V::dwords(0xFFFF));
        // bytes (m_2i, m_2i+1) of each lane as two int16
        mins[i] = vand(vor(lo, vsll32(lo, 8)), V::dwords(0x00FF00FF));
        mins[i + 2] = vand(vor(hi, vsll32(hi, 8)), V::dwords(0x00FF00FF));
      }
      const F dmin = field_half<I>(blk, gs, 2);
      BATON_UNROLL
      for (int r = 0; r < R; ++r) {  // the mins' part: dmin * sum over j of m_j * bsum_j, two sub-blocks a madd
        const int16_t* bsum = x.bsum + (r * x.bstride + b) * 8;
        I msum = V::zero();
        BATON_UNROLL
        for (int i = 0; i < 4; ++i) msum = vadd(msum, vmadd16(mins[i], V::dwords(pair16(bsum, i))));
        out.off[r] = vfnma(vcvt(msum), vmul(dmin, V::floats(x.d[r * x.bstride + b])), out.off[r]);
      }
    }
    I isum[R];
    BATON_UNROLL
    for (int r = 0; r < R; ++r) isum[r] = V::zero();
    // sub-block j: the low (j even) or high nibbles of bytes [32p, 32p + 32), p = j / 2, in groups t
    // of 4 values; one sub-block at a time, so only R sums are live (AVX2 has 16 registers)
    BATON_UNROLL
    for (int j = 0; j < 8; ++j) {
      const int p = j / 2;
      DotAcc<I, Q5 ? 5 : 4> sums[R][C];
      BATON_UNROLL
      for (int t = 0; t < 8; ++t) {
        const I raw = V::load(blk + 8 * (kQs + 32 * p) + 32 * t, gs);
        I code = j % 2 ? high_nibbles(raw) : low_nibbles(raw);
        if constexpr (Q5) {
          const I qh = V::load(blk + 8 * 16 + 32 * t, gs);
          code = vor(code, vsll16(vand(vsrl16(qh, j), V::bytes(1)), 4));
        }
        BATON_UNROLL
        for (int r = 0; r < R; ++r) sums[r][t % C].add(code, x_group<I>(x.q + r * x.stride + b * 256 + 32 * j + 4 * t));
      }
      const I sc = byte_of(j < 4 ? sc_lo : sc_hi, j % 4);
      BATON_UNROLL
      for (int r = 0; r < R; ++r) isum[r] = vadd(isum[r], vmullo(fold_chains<C>(sums[r]), sc));
    }
    const F d = field_half<I>(blk, gs, 0);
    BATON_UNROLL
    for (int r = 0; r < R; ++r) out.acc[r] = vfma(vcvt(isum[r]), vmul(d, V::floats(x.d[r * x.bstride + b])), out.acc[r]);
  }
}

// Q6_K (ql 128, qh 64, 16 int8 scales, d): per 256 values d * sc[i / 16] * (q - 32), q 4 bits
// from ql and 2 from qh; per 128 values n, the 32 values of group g take ql's low (g < 2) or high
// nibbles of bytes [32 (g & 1), +32) and qh's bits 2g, 2g + 1, so groups e and e + 2 are unpacked
// from one load of ql (and one of qh) for each 4 values. The unsigned q meet x as they are;
// the offset comes off as 32 times the sum over sub-blocks of sc times x's codes' sum per 16.
template <int R, class I>
void dot_q6_k(const uint8_t* w, int64_t gs, int64_t nb, const XRows& x, Out<R, typename Lanes<I>::F>& out) {
  using V = Lanes<I>;
  using F = typename V::F;
  constexpr int C = kChains<R>;
  const I mask = V::bytes(0x30);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = w + b * 8 * 210;
    V::prefetch(blk, gs, 8 * 210);
    I isum[R];
    {
      I sc_pair[8];  // the int8 scales of sub-blocks 2i, 2i + 1 of the rows as int16 pairs
      BATON_UNROLL
      for (int q4 = 0; q4 < 4; ++q4) {
        const I s = field_u32<I>(blk, gs, 192 + 4 * q4);
        BATON_UNROLL
        for (int j = 0; j < 4; j += 2)
          sc_pair[2 * q4 + j / 2] = vodd16(vsra32(vsll32(s, 24 - 8 * j), 24), vsll32(vsra32(vsll32(s, 16 - 8 * j), 24), 16));
      }
      BATON_UNROLL
      for (int r = 0; r < R; ++r) {
        const int16_t* s16 = x.bsum16 + (r * x.bstride + b) * 16;
        I corr = V::zero();
        BATON_UNROLL
        for (int i = 0; i < 8; ++i) corr = vadd(corr, vmadd16(sc_pair[i], V::dwords(pair16(s16, i))));
        isum[r] = vsub(V::zero(), vsll32(corr, 5));
      }
    }
    BATON_UNROLL
    for (int n = 0; n < 2; ++n) {
      BATON_UNROLL
      for (int h = 0; h < 2; ++h) {    // sub-blocks 8n + 2g + h: 4-value groups tt = 4h .. 4h + 3 of each g
        BATON_UNROLL
        for (int e = 0; e < 2; ++e) {  // g = e and e + 2: the low and high nibbles of the same ql bytes
          BATON_UNROLL
          for (int u = 0; u < 2; ++u) {  // one of them at a time, so only R sums are live (AVX2)
            DotAcc<I, 6> acc[R][C];
            BATON_UNROLL
            for (int t = 0; t < 4; ++t) {
              const int tt = 4 * h + t;
              const I l = V::load(blk + 8 * (64 * n + 16 * (tt / 4 + 2 * e)) + 32 * (tt % 4), gs);
              const I qh = V::load(blk + 8 * (128 + 32 * n + 16 * (tt / 4)) + 32 * (tt % 4), gs);
              // qh's bits 2g, 2g + 1 to bits 4, 5 of each byte (16-bit shifts: what crosses a byte is masked off)
              const I code = u == 0 ? vor(low_nibbles(l), vand(e == 0 ? vsll16(qh, 4) : vsll16(qh, 2), mask))
                                    : vor(high_nibbles(l), vand(e == 0 ? qh : vsrl16(qh, 2), mask));
              BATON_UNROLL
              for (int r = 0; r < R; ++r)
                acc[r][t % C].add(code, x_group<I>(x.q + r * x.stride + b * 256 + 128 * n + 32 * e + 64 * u + 4 * tt));
            }
            const int s = 8 * n + 2 * (e + 2 * u) + h;  // the sub-block: scale byte s % 4 of dword s / 4
            const I sd = field_u32<I>(blk, gs, 192 + 4 * (s / 4));
            const I sc = vsra32(vsll32(sd, 24 - 8 * (s % 4)), 24);
            BATON_UNROLL
            for (int r = 0; r < R; ++r) isum[r] = vadd(isum[r], vmullo(fold_chains<C>(acc[r]), sc));
          }
        }
      }
    }
    const F d = field_half<I>(blk, gs, 208);
    BATON_UNROLL
    for (int r = 0; r < R; ++r) out.acc[r] = vfma(vcvt(isum[r]), vmul(d, V::floats(x.d[r * x.bstride + b])), out.acc[r]);
  }
}

// y[r * y_stride + l] for rows [0, R) of x and the weight rows of the group at w (`nb` blocks of a
// format's `block_bytes` per row, regrouped; with 16 lanes also the next group, `gs` bytes on),
// lanes l < n; bias: a lane's value each or null. K in `parts` equal parts: each summed from zero
// (acc + offsets), the parts added pairwise as a balanced tree in order (0 + 1, 2 + 3, then those,
// ...), then the bias.
template <int R, class I, class Kernel>
void dot_parts(Kernel kernel, int64_t block_bytes, int64_t block_values, const uint8_t* w, int64_t gs, int64_t nb,
               int64_t parts, const XRows& x, float* y, int64_t y_stride, int64_t n, const float* bias) {
  using V = Lanes<I>;
  using F = typename V::F;
  F sums[kMaxParts][R];
  const int64_t part_blocks = nb / parts;
  for (int64_t p = 0; p < parts; ++p) {
    Out<R, F> out;
    kernel(w + p * part_blocks * 8 * block_bytes, gs, part_blocks, x.shifted(p * part_blocks, block_values), out);
    for (int r = 0; r < R; ++r) sums[p][r] = vaddf(out.acc[r], out.off[r]);
  }
  for (int64_t width = 1; width < parts; width *= 2)
    for (int64_t p = 0; p + width < parts; p += 2 * width)
      for (int r = 0; r < R; ++r) sums[p][r] = vaddf(sums[p][r], sums[p + width][r]);
  const F b = bias ? V::loadf(bias) : V::fzero();
  for (int r = 0; r < R; ++r) store_lanes(y + r * y_stride, vaddf(sums[0][r], b), n);
}

// the kernels as types, so dot_parts inlines them
#define BATON_KERNEL(...)                                                                              \
  [](const uint8_t* w, int64_t gs, int64_t nb, const XRows& x, Out<R, typename Lanes<I>::F>& out) { \
    __VA_ARGS__(w, gs, nb, x, out);                                                                    \
  }

// R rows of x against one group of 8 weight rows (I = __m256i) or two side by side (__m512i)
template <int R, class I>
void dot_rows(int64_t block_bytes, const uint8_t* w, int64_t gs, int64_t nb, int64_t parts, const XRows& x, float* y,
              int64_t y_stride, int64_t n, const float* bias) {
  auto run = [&](auto kernel, int64_t values) {
    dot_parts<R, I>(kernel, block_bytes, values, w, gs, nb, parts, x, y, y_stride, n, bias);
  };
  switch (block_bytes) {
    case 34: return run(BATON_KERNEL(dot_blocks32<Kind::kQ8_0, 34, R, I>), 32);
    case 18: return run(BATON_KERNEL(dot_blocks32<Kind::kQ4_0, 18, R, I>), 32);
    case 20: return run(BATON_KERNEL(dot_blocks32<Kind::kQ4_1, 20, R, I>), 32);
    case 22: return run(BATON_KERNEL(dot_blocks32<Kind::kQ5_0, 22, R, I>), 32);
    case 24: return run(BATON_KERNEL(dot_blocks32<Kind::kQ5_1, 24, R, I>), 32);
    case 144: return run(BATON_KERNEL(dot_k45<false, R, I>), 256);
    case 176: return run(BATON_KERNEL(dot_k45<true, R, I>), 256);
    case 210: return run(BATON_KERNEL(dot_q6_k<R, I>), 256);
  }
}
#undef BATON_KERNEL
