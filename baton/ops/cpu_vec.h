#pragma once
// Vector width from the build machine's flags (-march=native): the same selection torch makes
// for its own CPU kernels, so at::vec::Vectorized<float> is 16 lanes under AVX-512, 8 under AVX2.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#else
#define CPU_CAPABILITY DEFAULT
#endif

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>

using Vec = at::vec::Vectorized<float>;

// the sum of a vector's lanes
inline float sum_lanes(const Vec& v) {
  return at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, v);
}

// sum of a[i] * b[i] over d floats (lanes past d load as zero)
inline float dot(const float* a, const float* b, int64_t d) {
  Vec s(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) s = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), s);
  if (i < d) s = at::vec::fmadd(Vec::loadu(a + i, d - i), Vec::loadu(b + i, d - i), s);
  return sum_lanes(s);
}
