// The small per-layer ops of a decode step, one pass each: RMS norm (with the residual add
// folded in), rotary embedding in place, and the gated activation of the MLP. As torch ops
// they cost 10-30 us a call at one token (F.rms_norm alone is five kernels on the CPU), which
// at 30 layers is milliseconds per step; here a call is a row loop over vectors. Every row is
// computed alone, so a row's result does not depend on the other rows of the batch.
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <sys/mman.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <vector>

namespace {

constexpr int64_t kGrainFloats = 1 << 15;  // below this much work a call stays on one thread

inline int64_t grain_rows(int64_t row_floats) { return std::max<int64_t>(1, kGrainFloats / row_floats); }

// out = x / sqrt(mean(x^2) + eps) * (offset + w); out may be x
inline void norm_row(const float* x, float* out, const float* w, int64_t d, float eps, float offset) {
  const Vec inv(1.f / std::sqrt(dot(x, x, d) / static_cast<float>(d) + eps));
  const Vec off(offset);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) (Vec::loadu(x + i) * inv * (Vec::loadu(w + i) + off)).store(out + i);
  if (i < d) (Vec::loadu(x + i, d - i) * inv * (Vec::loadu(w + i, d - i) + off)).store(out + i, d - i);
}

inline void add_row(float* r, const float* x, int64_t d) {
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size()) (Vec::loadu(r + i) + Vec::loadu(x + i)).store(r + i);
  if (i < d) (Vec::loadu(r + i, d - i) + Vec::loadu(x + i, d - i)).store(r + i, d - i);
}

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2 && t.scalar_type() == at::kFloat && t.stride(1) == 1 && t.device().is_cpu(), name,
              " must be float32 [rows, dim] on the CPU, contiguous in dim, got ", t.scalar_type(), " ", t.sizes());
}

void check_heads(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == at::kFloat && x.stride(2) == 1 && x.device().is_cpu(),
              "x must be float32 [tokens, heads, dim] on the CPU, contiguous in dim, got ", x.scalar_type(), " ",
              x.sizes());
}

void check_weight(const torch::Tensor& w, int64_t d) {
  TORCH_CHECK(w.numel() == d && w.is_contiguous() && w.scalar_type() == at::kFloat && w.device().is_cpu(),
              "weight must be contiguous float32 [dim=", d, "], got ", w.scalar_type(), " ", w.sizes());
}

}  // namespace

// rms_norm(x) * (offset + weight) for x [rows, dim]; with a residual [rows, dim], first
// residual += x (in place) and normalize the sum, the pre-norm residual stream in one pass.
torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                       double eps, double offset) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), d = x.size(1);
  check_weight(weight, d);
  float* r = nullptr;
  int64_t r_stride = 0;
  if (residual.has_value() && residual->defined()) {
    check_rows(*residual, "residual");
    TORCH_CHECK(residual->size(0) == rows && residual->size(1) == d, "residual ", residual->sizes(),
                " does not match x ", x.sizes());
    r = residual->data_ptr<float>();
    r_stride = residual->stride(0);
  }
  auto out = torch::empty({rows, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  at::parallel_for(0, rows, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* src = xp + t * x_stride;
      if (r != nullptr) {
        add_row(r + t * r_stride, src, d);
        src = r + t * r_stride;
      }
      norm_row(src, op + t * d, w, d, static_cast<float>(eps), static_cast<float>(offset));
    }
  });
  return out;
}

// In place over x [tokens, heads, dim] (any strides but the last): every head normalized alone,
// as q/k norms do.
void rms_norm_heads_(torch::Tensor& x, const torch::Tensor& weight, double eps, double offset) {
  check_heads(x);
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2);
  check_weight(weight, d);
  float* xp = x.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, tokens * heads, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = xp + (i / heads) * s0 + (i % heads) * s1;
      norm_row(row, row, w, d, static_cast<float>(eps), static_cast<float>(offset));
    }
  });
}

// In place over x [tokens, heads, dim]: x * cos + rotate_half(x) * sin, where `sin` is
// [tokens, dim] with rotate_half's sign folded into its first half and `cos` is [tokens, dim].
void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  check_heads(x);
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  const int64_t tokens = x.size(0), heads = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(d % 2 == 0 && cos.size(0) == tokens && cos.size(1) == d && sin.size(0) == tokens && sin.size(1) == d,
              "cos ", cos.sizes(), " and sin ", sin.sizes(), " must be [tokens, dim] of x ", x.sizes(),
              " (dim even)");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), c_stride = cos.stride(0), s_stride = sin.stride(0);
  at::parallel_for(0, tokens * heads, grain_rows(d), [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t t = i / heads;
      float* a = xp + t * s0 + (i % heads) * s1;  // first half
      float* b = a + half;                        // second half
      const float* c = cp + t * c_stride;
      const float* s = sp + t * s_stride;
      int64_t j = 0;
      for (; j < half; j += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), half - j);
        const Vec va = Vec::loadu(a + j, n), vb = Vec::loadu(b + j, n);
        (va * Vec::loadu(c + j, n) + vb * Vec::loadu(s + j, n)).store(a + j, n);
        (vb * Vec::loadu(c + half + j, n) + va * Vec::loadu(s + half + j, n)).store(b + j, n);
      }
    }
  });
}

// x [rows, 2 * inner] = [gate | up] -> act(gate) * up, act silu or gelu (tanh approximation)
torch::Tensor gated_act(const torch::Tensor& x, bool gelu_tanh) {
  check_rows(x, "x");
  TORCH_CHECK(x.size(1) % 2 == 0, "x must hold gate and up halves");
  const int64_t rows = x.size(0), inner = x.size(1) / 2;
  auto out = torch::empty({rows, inner}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t x_stride = x.stride(0);
  const Vec one(1.f), half(0.5f), k0(0.7978845608028654f), k1(0.044715f);
  at::parallel_for(0, rows, grain_rows(inner), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = xp + r * x_stride;
      const float* u = g + inner;
      float* o = op + r * inner;
      for (int64_t j = 0; j < inner; j += Vec::size()) {
        const int64_t n = std::min<int64_t>(Vec::size(), inner - j);
        const Vec vg = Vec::loadu(g + j, n);
        Vec act;
        if (gelu_tanh)
          act = half * vg * (one + (k0 * (vg + k1 * vg * vg * vg)).tanh());
        else
          act = vg / (one + vg.neg().exp());
        (act * Vec::loadu(u + j, n)).store(o + j, n);
      }
    }
  });
  return out;
}

// `nbytes` uninitialized bytes on transparent huge pages where the kernel grants them (its
// madvise mode): weights and KV read every step then need 512x fewer TLB entries.
torch::Tensor empty_huge_pages(int64_t nbytes) {
  TORCH_CHECK(nbytes >= 0, "nbytes must not be negative, got ", nbytes);
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = (static_cast<size_t>(nbytes) + kHuge - 1) / kHuge * kHuge;
  void* p = std::aligned_alloc(kHuge, bytes);
  TORCH_CHECK(p != nullptr, "out of memory allocating ", bytes, " bytes");
  madvise(p, bytes, MADV_HUGEPAGE);  // advice only: without THP the memory is ordinary pages
  return torch::from_blob(p, {nbytes}, [](void* q) { std::free(q); }, torch::TensorOptions().dtype(at::kByte));
}

torch::Tensor zeros_on_demand(int64_t nbytes, bool huge_pages) {
  TORCH_CHECK(nbytes >= 0, "nbytes must not be negative, got ", nbytes);
  constexpr size_t kHuge = size_t{2} << 20;
  const size_t bytes = (static_cast<size_t>(nbytes) + kHuge - 1) / kHuge * kHuge, span = bytes + kHuge;
  void* base = mmap(nullptr, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  TORCH_CHECK(base != MAP_FAILED, "out of memory mapping ", span, " bytes");
  const uintptr_t start = (reinterpret_cast<uintptr_t>(base) + kHuge - 1) / kHuge * kHuge;  // huge-page aligned
  if (huge_pages) madvise(reinterpret_cast<void*>(start), bytes, MADV_HUGEPAGE);
  return torch::from_blob(
      reinterpret_cast<void*>(start), {nbytes}, [base, span](void*) { munmap(base, span); },
      torch::TensorOptions().dtype(at::kByte));
}

void apply_token_bitmask_(torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 && logits.device().is_cpu(),
              "logits must be float32 [rows, vocab] on the CPU, contiguous in vocab, got ", logits.scalar_type(), " ",
              logits.sizes());
  const int64_t n = rows.numel(), vocab = logits.size(1), words = (vocab + 31) / 32;
  TORCH_CHECK(rows.scalar_type() == at::kLong && rows.dim() == 1 && rows.is_contiguous(), "rows must be int64 [n]");
  TORCH_CHECK(bitmask.scalar_type() == at::kInt && bitmask.is_contiguous() && bitmask.dim() == 2 &&
                  bitmask.size(0) == n && bitmask.size(1) >= words,
              "bitmask must be contiguous int32 [", n, ", >= ", words, "], got ", bitmask.scalar_type(), " ",
              bitmask.sizes());
  const int64_t* row = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(row[i] >= 0 && row[i] < logits.size(0), "rows[", i, "] = ", row[i], " is not a row of the logits");
  const uint32_t* mask = reinterpret_cast<const uint32_t*>(bitmask.data_ptr<int32_t>());
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) {
    float* out = logits.data_ptr<float>() + row[i] * logits.stride(0);
    const uint32_t* m = mask + i * bitmask.size(1);
    for (int64_t w = 0; w < words; ++w) {
      const uint32_t bits = m[w];
      if (bits == 0xFFFFFFFFu) continue;  // every token of the word allowed
      const int64_t end = std::min<int64_t>(32, vocab - w * 32);
      if (bits == 0) {  // none allowed: under a grammar, most words of a large vocabulary
        std::fill_n(out + w * 32, end, neg_inf);
        continue;
      }
      for (int64_t b = 0; b < end; ++b)
        if (!(bits >> b & 1u)) out[w * 32 + b] = neg_inf;
    }
  }
}

// A hyper-connection's per-token weights (GLM-5.3-Flash) from its mixing projection mixed [T,
// (2 + n) n] = [pre | post | comb], base [(2 + n) n] and scale [3]: pre = sigmoid + eps, post =
// 2 sigmoid, comb = softmax over its rows + eps, then made doubly stochastic by `iters` Sinkhorn
// passes (columns, then rows and columns). Tiny matrices: a loop per token, not ~80 torch ops.
std::vector<torch::Tensor> hc_weights(const torch::Tensor& mixed, const torch::Tensor& base, const torch::Tensor& scale,
                                      int64_t n, int64_t iters, double eps_in) {
  const int64_t width = (2 + n) * n;
  TORCH_CHECK(n >= 1 && iters >= 1, "hc_weights needs n >= 1 and iters >= 1, got ", n, ", ", iters);
  TORCH_CHECK(mixed.dim() == 2 && mixed.size(1) == width && mixed.scalar_type() == at::kFloat &&
                  mixed.is_contiguous() && mixed.device().is_cpu(),
              "mixed must be contiguous float32 [tokens, ", width, "], got ", mixed.scalar_type(), " ", mixed.sizes());
  TORCH_CHECK(base.numel() == width && base.scalar_type() == at::kFloat && base.is_contiguous() &&
                  scale.numel() == 3 && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
              "base must be float32 [", width, "] and scale float32 [3]");
  const int64_t t = mixed.size(0);
  torch::Tensor pre = torch::empty({t, n}, mixed.options()), post = torch::empty({t, n}, mixed.options()),
                comb = torch::empty({t, n, n}, mixed.options());
  const float *m = mixed.data_ptr<float>(), *b = base.data_ptr<float>(), *sc = scale.data_ptr<float>();
  float *pp = pre.data_ptr<float>(), *po = post.data_ptr<float>(), *pc = comb.data_ptr<float>();
  const float eps = static_cast<float>(eps_in);
  auto sigmoid = [](float x) { return 1.f / (1.f + std::exp(-x)); };
  at::parallel_for(0, t, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> sums(n);
    for (int64_t r = begin; r < end; ++r) {
      const float* x = m + r * width;
      float* c = pc + r * n * n;
      for (int64_t i = 0; i < n; ++i) {
        pp[r * n + i] = sigmoid(x[i] * sc[0] + b[i]) + eps;
        po[r * n + i] = 2.f * sigmoid(x[n + i] * sc[1] + b[n + i]);
      }
      for (int64_t i = 0; i < n; ++i) {  // softmax of each row
        float* row = c + i * n;
        float top = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t j = 0; j < n; ++j) row[j] = x[2 * n + i * n + j] * sc[2] + b[2 * n + i * n + j];
        for (int64_t j = 0; j < n; ++j) top = std::max(top, row[j]);
        for (int64_t j = 0; j < n; ++j) sum += row[j] = std::exp(row[j] - top);
        for (int64_t j = 0; j < n; ++j) row[j] = row[j] / sum + eps;
      }
      auto columns = [&] {
        std::fill(sums.begin(), sums.end(), 0.f);
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) sums[j] += c[i * n + j];
        for (int64_t i = 0; i < n; ++i)
          for (int64_t j = 0; j < n; ++j) c[i * n + j] /= sums[j] + eps;
      };
      columns();
      for (int64_t k = 1; k < iters; ++k) {
        for (int64_t i = 0; i < n; ++i) {
          float sum = 0.f;
          for (int64_t j = 0; j < n; ++j) sum += c[i * n + j];
          for (int64_t j = 0; j < n; ++j) c[i * n + j] /= sum + eps;
        }
        columns();
      }
    }
  });
  return {pre, post, comb};
}

// out[t, h, j] = dot(x[t, h], w[h, j]) (cpu_vec.h's order), four outputs at a time for four
// independent chains; x [rows, k] and w [n, k] are the one-head case
torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& w) {
  const bool heads = x.dim() == 3;
  TORCH_CHECK((x.dim() == 2 && w.dim() == 2) || (heads && w.dim() == 3), "x [rows, k] with w [n, k], or x [rows, ",
              "heads, k] with w [heads, n, k]; got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat && x.device().is_cpu() &&
                  w.device().is_cpu() && x.stride(-1) == 1 && w.is_contiguous(),
              "x and w must be float32 on the CPU, contiguous in k (w throughout)");
  const int64_t rows = x.size(0), h = heads ? x.size(1) : 1, k = x.size(-1), n = w.size(-2);
  TORCH_CHECK(w.size(-1) == k && (!heads || w.size(0) == h), "w ", w.sizes(), " does not match x ", x.sizes());
  auto out = heads ? torch::empty({rows, h, n}, x.options()) : torch::empty({rows, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t row_stride = x.stride(0), head_stride = heads ? x.stride(1) : 0;
  at::parallel_for(0, rows * h, std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(1, n * k / 16)),
                   [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float* a = xp + (i / h) * row_stride + (i % h) * head_stride;
      const float* wh = wp + (i % h) * n * k;
      float* o = op + i * n;
      int64_t j = 0;
      for (; j + 4 <= n; j += 4) {
        const float* b = wh + j * k;
        Vec s0(0.f), s1(0.f), s2(0.f), s3(0.f);
        int64_t c = 0;
        for (; c + Vec::size() <= k; c += Vec::size()) {
          const Vec va = Vec::loadu(a + c);
          s0 = at::vec::fmadd(va, Vec::loadu(b + c), s0);
          s1 = at::vec::fmadd(va, Vec::loadu(b + k + c), s1);
          s2 = at::vec::fmadd(va, Vec::loadu(b + 2 * k + c), s2);
          s3 = at::vec::fmadd(va, Vec::loadu(b + 3 * k + c), s3);
        }
        if (c < k) {
          const int64_t r = k - c;
          const Vec va = Vec::loadu(a + c, r);
          s0 = at::vec::fmadd(va, Vec::loadu(b + c, r), s0);
          s1 = at::vec::fmadd(va, Vec::loadu(b + k + c, r), s1);
          s2 = at::vec::fmadd(va, Vec::loadu(b + 2 * k + c, r), s2);
          s3 = at::vec::fmadd(va, Vec::loadu(b + 3 * k + c, r), s3);
        }
        o[j] = sum_lanes(s0);
        o[j + 1] = sum_lanes(s1);
        o[j + 2] = sum_lanes(s2);
        o[j + 3] = sum_lanes(s3);
      }
      for (; j < n; ++j) o[j] = dot(a, wh + j * k, k);
    }
  });
  return out;
}
