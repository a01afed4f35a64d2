#pragma once
// torch's ops replicated with torch's own rounding, for the fused decoder's layer steps
// (fused_decoder.h), whose rows must have the bits of the module path's torch ops:
//  - elementwise ops (sigmoid, silu, softplus): torch's vector functions (Sleef) on every element,
//    which the module path runs through ops().pointwise too;
//  - sums over the last dim (l2norm, the gated norm's mean, the top-k renormalisation) in the
//    order of torch's cascade sum, whose CPU kernel has no AVX-512 build: 8 lanes;
//  - softmax with the vectorised functional helpers torch's softmax kernel runs;
//  - products that torch rounds before an add (rotary, expert weights, the shared-expert gate)
//    are kept from contracting into an FMA (BATON_ROUNDED).
#include "cpu_vec.h"  // before any ATen header: a file including this one includes it first

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <torch/types.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

// Keeps a rounded product from being contracted into a following add (GCC contracts a * b + c into
// an FMA by default, torch's separate kernels round the product first).
#if defined(__x86_64__) || defined(__i386__)
#define BATON_ROUNDED(x) __asm__("" : "+x"(x))
#elif defined(__aarch64__)
#define BATON_ROUNDED(x) __asm__("" : "+w"(x))
#else
#define BATON_ROUNDED(x) __asm__("" : "+m"(x))
#endif

inline constexpr int64_t kVS = Vec::size();

// ---- elementwise ops -------------------------------------------------------------------------

// y = op(x) over n contiguous floats (y may be x), every element through the vector function (the
// tail as a partial vector), so an element's bits depend on its value alone: never on the batch,
// on its position in the tensor or on how the threads split the range. torch's own cpu_kernel_vec
// takes a run's tail element by element with libm, which would make a row's bits depend on its
// batch; the module path calls these through ops().pointwise.
template <typename Op>
void vec_unary(const float* x, float* y, int64_t n, const Op& op) {
  at::parallel_for(0, (n + kVS - 1) / kVS, at::internal::GRAIN_SIZE / kVS, [&](int64_t begin, int64_t end) {
    for (int64_t v = begin; v < end; ++v) {
      const int64_t i = v * kVS, k = std::min(kVS, n - i);
      if (k == kVS)
        op(Vec::loadu(x + i)).store(y + i);
      else
        op(Vec::loadu(x + i, k)).store(y + i, k);
    }
  });
}

struct Sigmoid {  // torch.sigmoid's vector function
  Vec operator()(Vec a) const { return (Vec(1.f) + (Vec(0.f) - a).exp()).reciprocal(); }
};
struct Silu {  // F.silu's
  Vec operator()(Vec a) const { return a / (Vec(1.f) + a.neg().exp()); }
};
struct Softplus {  // F.softplus's, beta 1, threshold 20
  Vec operator()(Vec a) const { return Vec::blendv(a.exp().log1p(), a, a > Vec(20.f)); }
};

// op(x) as a new float32 tensor of x's shape
template <typename Op>
at::Tensor vec_unary(const at::Tensor& x, const Op& op) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.device().is_cpu(), "x must be float32 on the CPU, got ",
              x.scalar_type());
  const at::Tensor c = x.contiguous();
  at::Tensor y = at::empty_like(c);
  vec_unary(c.data_ptr<float>(), y.data_ptr<float>(), c.numel(), op);
  return y;
}

// ---- sums over the last dim ------------------------------------------------------------------

// torch's cascade sum (SumKernel.cpp): multi_row_sum / row_sum over T = float or 8 lanes
struct Lanes8 {
  float v[8];
  explicit Lanes8(float s = 0.f) {
    for (float& x : v) x = s;
  }
  Lanes8& operator+=(const Lanes8& o) {
    for (int i = 0; i < 8; ++i) v[i] += o.v[i];
    return *this;
  }
};

inline int64_t ceil_log2(int64_t x) { return x <= 2 ? 1 : 64 - __builtin_clzll(static_cast<uint64_t>(x - 1)); }

template <typename T, typename Load>
std::array<T, 4> multi_row_sum(int64_t size, const Load& load) {
  constexpr int64_t levels = 4;
  const int64_t power = std::max<int64_t>(4, ceil_log2(size) / levels), step = int64_t(1) << power, mask = step - 1;
  T acc[levels][4];
  for (auto& level : acc)
    for (auto& a : level) a = T(0.f);
  int64_t i = 0;
  while (i + step <= size) {
    for (int64_t j = 0; j < step; ++j, ++i)
      for (int64_t k = 0; k < 4; ++k) acc[0][k] += load(i * 4 + k);
    for (int64_t j = 1; j < levels; ++j) {
      for (int64_t k = 0; k < 4; ++k) {
        acc[j][k] += acc[j - 1][k];
        acc[j - 1][k] = T(0.f);
      }
      if ((i & (mask << (j * power))) != 0) break;
    }
  }
  for (; i < size; ++i)
    for (int64_t k = 0; k < 4; ++k) acc[0][k] += load(i * 4 + k);
  for (int64_t j = 1; j < levels; ++j)
    for (int64_t k = 0; k < 4; ++k) acc[0][k] += acc[j][k];
  return {acc[0][0], acc[0][1], acc[0][2], acc[0][3]};
}

template <typename T, typename Load>
T row_sum(int64_t size, const Load& load) {
  const int64_t size_ilp = size / 4;
  std::array<T, 4> p = multi_row_sum<T>(size_ilp, load);
  for (int64_t i = size_ilp * 4; i < size; ++i) p[0] += load(i);
  for (int64_t k = 1; k < 4; ++k) p[0] += p[k];
  return p[0];
}

// x.sum(-1) of one contiguous row of n floats
inline float torch_row_sum(const float* x, int64_t n) {
  constexpr int64_t W = 8;
  if (n < W) return row_sum<float>(n, [&](int64_t i) { return x[i]; });
  const int64_t nv = n / W;
  const Lanes8 v = row_sum<Lanes8>(nv, [&](int64_t i) {
    Lanes8 l;
    std::memcpy(l.v, x + i * W, sizeof(l.v));
    return l;
  });
  float acc = 0.f;
  for (int64_t k = nv * W; k < n; ++k) acc += x[k];
  for (int64_t k = 0; k < W; ++k) acc += v.v[k];
  return acc;
}

// ---- softmax ---------------------------------------------------------------------------------

// F.softmax of one contiguous row of n floats in place: its lastdim kernel
inline void torch_softmax_row_(float* p, int64_t n) {
  const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, p, n);
  at::vec::map([top](Vec a) { return (a - Vec(top)).exp(); }, p, p, n);
  float sum = at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, p, n);
  sum = 1 / sum;
  at::vec::map([sum](Vec a) { return a * Vec(sum); }, p, p, n);
}
