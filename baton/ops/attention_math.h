#pragma once
// The arithmetic of paged attention (paged_attention.cpp), a piece at a time: scores of query
// heads against a transposed run of keys, the online softmax's exp and max, the weighted sum of
// values, and the fold of two partitions. Each result value is one chain of operations in a fixed
// order, whatever else shares the call: that is what keeps a row's bits independent of its batch.
#include "cpu_vec.h"
#include "fp8_kv.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>

namespace paged_attn {

constexpr int64_t kVecLanes = Vec::size();
constexpr int64_t kAccumulators = kVecLanes == 16 ? 16 : 8;  // vectors a kernel keeps summing at once (of 32 or 16)
// acc = acc * scale + w * v
inline void scale_axpy(float* acc, float scale, float w, const float* v, int64_t d) {
  const Vec vs(scale), vw(w);
  int64_t i = 0;
  for (; i + kVecLanes <= d; i += kVecLanes)
    at::vec::fmadd(vw, Vec::loadu(v + i), Vec::loadu(acc + i) * vs).store(acc + i);
  if (i < d) at::vec::fmadd(vw, Vec::loadu(v + i, d - i), Vec::loadu(acc + i, d - i) * vs).store(acc + i, d - i);
}

// exp(x - m) in place over n scores, returning their sum (torch's flash attention uses the same exp_u20)
inline float exp_sub_sum(float* x, float m, int64_t n) {
  const Vec vm(m);
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + kVecLanes <= n; i += kVecLanes) {
    const Vec e = (Vec::loadu(x + i) - vm).exp_u20();
    e.store(x + i);
    sum = sum + e;
  }
  float total = sum_lanes(sum);
  for (; i < n; ++i) total += (x[i] = std::exp(x[i] - m));
  return total;
}

// Ask for K and V rows of one head ahead of use: walking block tables is a chain of short strided
// reads the hardware prefetcher does not run ahead of (a cold cache read at ~7 GB/s). Into L2
// (prefetcht1), not L1: a window ahead is more misses than L1 tracks at once (30 layers of cold
// KV, 8 sequences: 9-10 GB/s into L1, 12-13 into L2).
template <typename cache_t>
inline void prefetch_rows(const cache_t* k, const cache_t* v, int64_t k_stride, int64_t v_stride, int64_t rows,
                          int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t r = 0; r < rows; ++r) {
    const char* kr = reinterpret_cast<const char*>(k + r * k_stride);
    const char* vr = reinterpret_cast<const char*>(v + r * v_stride);
    for (int64_t off = 0; off < bytes; off += 64) {
      __builtin_prefetch(kr + off, 0, 2);
      __builtin_prefetch(vr + off, 0, 2);
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512)
// 16 values of a float32, float16 or bfloat16 cache row as float (exact)
template <typename cache_t>
inline __m512 load16(const cache_t* p) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return _mm512_loadu_ps(p);
  } else {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if constexpr (std::is_same_v<cache_t, at::Half>)
      return _mm512_cvtph_ps(v);
    else
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
  }
}

// dst[j * ld_dst + r] = src[r * ld_src + j] as float for r, j < 16: loaded, converted and
// transposed in registers (torch's transpose_mxn takes its sizes at run time and goes through memory)
template <typename cache_t>
inline void transpose16(const cache_t* src, int64_t ld_src, float* dst, int64_t ld_dst) {
  __m512 a[16], b[16];
  for (int r = 0; r < 16; ++r) a[r] = load16(src + r * ld_src);
  for (int i = 0; i < 8; ++i) {
    b[2 * i] = _mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]);
    b[2 * i + 1] = _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    const __m512d b0 = _mm512_castps_pd(b[4 * i]), b1 = _mm512_castps_pd(b[4 * i + 1]);
    const __m512d b2 = _mm512_castps_pd(b[4 * i + 2]), b3 = _mm512_castps_pd(b[4 * i + 3]);
    a[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(b0, b2));
    a[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(b0, b2));
    a[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b1, b3));
    a[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b1, b3));
  }
  for (int i = 0; i < 2; ++i)
    for (int k = 0; k < 4; ++k) {
      b[8 * i + k] = _mm512_shuffle_f32x4(a[8 * i + k], a[8 * i + k + 4], 0x88);
      b[8 * i + k + 4] = _mm512_shuffle_f32x4(a[8 * i + k], a[8 * i + k + 4], 0xdd);
    }
  for (int j = 0; j < 8; ++j) {
    _mm512_storeu_ps(dst + j * ld_dst, _mm512_shuffle_f32x4(b[j], b[8 + j], 0x88));
    _mm512_storeu_ps(dst + (j + 8) * ld_dst, _mm512_shuffle_f32x4(b[j], b[8 + j], 0xdd));
  }
}
#endif

// A cache row as float: the row itself for a float32 cache, else converted into buf (an fp8
// cache's codes, uint8, times the scale of their block and head).
template <typename cache_t>
inline const float* as_float(const cache_t* row, float* buf, int64_t d, float scale) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return row;
  } else if constexpr (std::is_same_v<cache_t, uint8_t>) {
    fp8_to_float(row, scale, buf, d);
    return buf;
  } else {  // float16 / bfloat16: exact in float, converted 16 (AVX-512) or 8 at a time (c10's scalar casts are slow)
    int64_t i = 0;
#if defined(CPU_CAPABILITY_AVX512)
    for (; i + 16 <= d; i += 16) _mm512_storeu_ps(buf + i, load16(row + i));
#endif
#if defined(__AVX2__) && defined(__F16C__)
    constexpr bool kHalf = std::is_same_v<cache_t, at::Half>, kBF16 = std::is_same_v<cache_t, at::BFloat16>;
    for (; (kHalf || kBF16) && i + 8 <= d; i += 8) {
      const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i));
      if constexpr (kHalf)
        _mm256_storeu_ps(buf + i, _mm256_cvtph_ps(v));
      else
        _mm256_storeu_ps(buf + i, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16)));
    }
#endif
    for (; i < d; ++i) buf[i] = static_cast<float>(row[i]);
    return buf;
  }
}

// Scores of U query heads against C vectors of a block's keys: out[u][c * kVecLanes + l] =
// sum over i < d of q[u][i] * kt[i * ld + c * kVecLanes + l], one fma chain in order of i per score,
// so a score's bits do not depend on which other heads or keys share the call.
template <int U, int C>
inline void score_vectors(const float* const* q, const float* kt, int64_t ld, int64_t d, float* const* out) {
  Vec s[U][C];
  for (int u = 0; u < U; ++u)
    for (int c = 0; c < C; ++c) s[u][c] = Vec(0.f);
  for (int64_t i = 0; i < d; ++i) {
    Vec k[C];
    for (int c = 0; c < C; ++c) k[c] = Vec::loadu(kt + i * ld + c * kVecLanes);
    for (int u = 0; u < U; ++u) {
      const Vec qu(q[u][i]);
      for (int c = 0; c < C; ++c) s[u][c] = at::vec::fmadd(qu, k[c], s[u][c]);
    }
  }
  for (int u = 0; u < U; ++u)
    for (int c = 0; c < C; ++c) s[u][c].store(out[u] + c * kVecLanes);
}

// score_vectors over n query heads and key vectors [c0, c1), as many chains at once as registers hold
inline void block_scores(const float* const* q, float* const* out, int64_t n, const float* kt, int64_t ld, int64_t c0,
                         int64_t c1, int64_t d) {
  const float* qs[8];
  float* os[8];
  for (int64_t c = c0; c < c1;) {
    const int64_t cs = c + 4 <= c1 ? 4 : c + 2 <= c1 ? 2 : 1;
    const int64_t most = std::min<int64_t>(8, kAccumulators / cs);
    for (int64_t u0 = 0; u0 < n; u0 += most) {
      const int64_t us = std::min(most, n - u0);
      for (int64_t u = 0; u < us; ++u) qs[u] = q[u0 + u], os[u] = out[u0 + u] + c * kVecLanes;
      const float* k = kt + c * kVecLanes;
#define BATON_SCORES(U, C)                 \
  case U:                                  \
    score_vectors<U, C>(qs, k, ld, d, os); \
    break;
      if (cs == 4) {
        switch (us) { BATON_SCORES(1, 4) BATON_SCORES(2, 4) BATON_SCORES(3, 4) BATON_SCORES(4, 4) }
      } else if (cs == 2) {
        switch (us) { BATON_SCORES(1, 2) BATON_SCORES(2, 2) BATON_SCORES(3, 2) BATON_SCORES(4, 2)
                      BATON_SCORES(5, 2) BATON_SCORES(6, 2) BATON_SCORES(7, 2) BATON_SCORES(8, 2) }
      } else {
        switch (us) {
          BATON_SCORES(1, 1) BATON_SCORES(2, 1) BATON_SCORES(3, 1) BATON_SCORES(4, 1)
          BATON_SCORES(5, 1) BATON_SCORES(6, 1) BATON_SCORES(7, 1) BATON_SCORES(8, 1)
        }
      }
#undef BATON_SCORES
    }
    c += cs;
  }
}

// acc[u] = acc[u] * correction[u] + sum over p < n of w[u][p] * v[p] for U heads that read the same
// rows v (a row's query heads of one kv head), NV vectors of the output at a time: per output value
// one fma chain in order of p, however many heads share the loads.
template <int U, int NV>
inline void values_vectors(float* const* acc, const float* correction, const float* const* w, const float* const* v,
                           int64_t n, int64_t i) {
  Vec r[U][NV];
  for (int u = 0; u < U; ++u)
    for (int k = 0; k < NV; ++k) r[u][k] = Vec::loadu(acc[u] + i + k * kVecLanes) * Vec(correction[u]);
  for (int64_t p = 0; p < n; ++p)
    for (int k = 0; k < NV; ++k) {
      const Vec vp = Vec::loadu(v[p] + i + k * kVecLanes);
      for (int u = 0; u < U; ++u) r[u][k] = at::vec::fmadd(Vec(w[u][p]), vp, r[u][k]);
    }
  for (int u = 0; u < U; ++u)
    for (int k = 0; k < NV; ++k) r[u][k].store(acc[u] + i + k * kVecLanes);
}

inline void block_values(float* const* acc, const float* correction, const float* const* w, const float* const* v,
                         int64_t heads, int64_t n, int64_t d) {
  int64_t i = 0;
  for (; i + 4 * kVecLanes <= d; i += 4 * kVecLanes) {
    for (int64_t u = 0; u < heads;) {
      const int64_t us = std::min<int64_t>(kAccumulators / 4, heads - u);
      if (us >= 4) {
        values_vectors<4, 4>(acc + u, correction + u, w + u, v, n, i);
        u += 4;
      } else if (us >= 3) {
        values_vectors<3, 4>(acc + u, correction + u, w + u, v, n, i);
        u += 3;
      } else if (us >= 2) {
        values_vectors<2, 4>(acc + u, correction + u, w + u, v, n, i);
        u += 2;
      } else {
        values_vectors<1, 4>(acc + u, correction + u, w + u, v, n, i);
        u += 1;
      }
    }
  }
  for (; i < d; i += kVecLanes) {  // what is left, a vector at a time, the last masked
    const int64_t m = std::min(kVecLanes, d - i);
    for (int64_t u = 0; u < heads; ++u) {
      Vec r = Vec::loadu(acc[u] + i, m) * Vec(correction[u]);
      for (int64_t p = 0; p < n; ++p) r = at::vec::fmadd(Vec(w[u][p]), Vec::loadu(v[p] + i, m), r);
      r.store(acc[u] + i, m);
    }
  }
}

// max of x[0, n)
inline float max_of(const float* x, int64_t n) {
  Vec m(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + kVecLanes <= n; i += kVecLanes) m = at::vec::maximum(m, Vec::loadu(x + i));
  float best = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, m);
  for (; i < n; ++i) best = std::max(best, x[i]);
  return best;
}

// dst[j * ld_dst + i] = src[i * ld_src + j] for i < m, j < n
inline void transpose(const float* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t m, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  at::vec::transpose_mxn<float>(src, ld_src, dst, ld_dst, static_cast<int>(m), static_cast<int>(n));
#else
  int64_t i = 0;
  for (; i + 8 <= m; i += 8) {
    int64_t j = 0;
#if defined(CPU_CAPABILITY_AVX2)
    for (; j + 8 <= n; j += 8) at::vec::transpose_mxn<float, 8, 8>(src + i * ld_src + j, ld_src, dst + j * ld_dst + i, ld_dst);
#endif
    for (; j < n; ++j)
      for (int64_t k = i; k < i + 8; ++k) dst[j * ld_dst + k] = src[k * ld_src + j];
  }
  for (; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) dst[j * ld_dst + i] = src[i * ld_src + j];
#endif
}

// dst[j * ld_dst + r] = row r's value j as float (as_float, an fp8 cache's times `scale`) for r < m,
// j < n, the rows src + r * ld_src of a cache (buf: room for m * n floats, where rows convert first)
template <typename cache_t>
inline void transpose_keys(const cache_t* src, int64_t ld_src, float* dst, int64_t ld_dst, int64_t m, int64_t n,
                           float scale, float* buf) {
  int64_t r = 0;
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (!std::is_same_v<cache_t, uint8_t>) {
    if (n % 16 == 0)
      for (; r + 16 <= m; r += 16)
        for (int64_t j = 0; j < n; j += 16) transpose16(src + r * ld_src + j, ld_src, dst + j * ld_dst + r, ld_dst);
  }
#endif
  if (r == m) return;
  if constexpr (std::is_same_v<cache_t, float>) {
    transpose(src + r * ld_src, ld_src, dst + r, ld_dst, m - r, n);
  } else {
    for (int64_t p = r; p < m; ++p) as_float(src + p * ld_src, buf + (p - r) * n, n, scale);
    transpose(buf, n, dst + r, ld_dst, m - r, n);
  }
}

// state = the fold of state and part, in that order (the merge of two partitions)
inline void fold(float& max, float& sum, float* acc, float part_max, float part_sum, const float* part_acc,
                 int64_t d) {
  const float m = std::max(max, part_max);
  const float a = std::exp(max - m), b = std::exp(part_max - m);
  sum = std::fma(b, part_sum, sum * a);
  scale_axpy(acc, a, b, part_acc, d);
  max = m;
}

}  // namespace paged_attn
