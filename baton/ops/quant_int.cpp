// The integer path of quant_linear (quant_linear.h): x quantized per row first, as llama.cpp's
// Q8_0 / Q8_K do but with float32 scales (int8 codes round(x / d) to nearest even, d = max |x| /
// 127 per 32 values for the 32-value formats, per 256 for the K formats), and the dot products in
// integers (quant_int_kernels.h): VNNI where the CPU has it, maddubs + madd on AVX2, chosen at run
// time (set_quant_kernel). Each thread takes a run of output rows; each output row meets up to 4
// rows of x at a time, its blocks unpacked once for them. A row's bits depend neither on the other
// rows nor on the instruction set.
#include "quant_linear.h"

#include "cpu_vec.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <iterator>
#include <limits>
#include <vector>

#include "gguf_block_formats.h"

namespace {

// x as the kernels read it: R rows starting at q (int8, `stride` codes apart), their scales and
// sums `bstride` scales apart: for the 32-value formats a scale per 32 values (d) and d times the
// codes' sum (s); for the K formats a scale per 256 (d) and the codes' sum per 32 (bsum)
struct XRows {
  const int8_t* q;
  const float* d;
  const float* s;
  const int16_t* bsum;
  int64_t stride, bstride;
};

}  // namespace

namespace isa_avx2 {
#define BATON_VNNI 0
#include "quant_int_kernels.h"
#undef BATON_VNNI
}  // namespace isa_avx2

// The VNNI variants need GCC's target pragma (and, for AVX-VNNI, GCC 11): elsewhere AVX2 alone.
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11
#define BATON_VNNI_TARGETS 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni")
namespace isa_avx512_vnni {
#define BATON_VNNI 1
#include "quant_int_kernels.h"
#undef BATON_VNNI
}  // namespace isa_avx512_vnni
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avxvnni")
namespace isa_avx_vnni {
#define BATON_VNNI 2
#include "quant_int_kernels.h"
#undef BATON_VNNI
}  // namespace isa_avx_vnni
#pragma GCC pop_options
#endif

namespace {

constexpr int64_t kRows = 4;                      // rows of x per weight-row pass
constexpr int64_t kRowBlockBytes = 256 * 1024;    // quantized x rows a pass keeps in L2

using DotRows = void (*)(int64_t, const uint8_t*, int64_t, const XRows&, float*, int64_t, float);

struct Isa {
  const char* name;
  bool (*supported)();
  DotRows rows[kRows];  // rows[R - 1]: R rows at once
};

#define BATON_ISA(ns) {&ns::dot_rows<1>, &ns::dot_rows<2>, &ns::dot_rows<3>, &ns::dot_rows<4>}
const Isa kIsas[] = {
#ifdef BATON_VNNI_TARGETS
    {"avx512_vnni",
     [] { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                 __builtin_cpu_supports("avx512bw"); },
     BATON_ISA(isa_avx512_vnni)},
    {"avx_vnni", [] { return static_cast<bool>(__builtin_cpu_supports("avxvnni")); }, BATON_ISA(isa_avx_vnni)},
#endif
    {"avx2", [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }, BATON_ISA(isa_avx2)},
};
#undef BATON_ISA

const Isa* best_isa() {
  for (const Isa& isa : kIsas)
    if (isa.supported()) return &isa;
  return &kIsas[std::size(kIsas) - 1];
}

std::atomic<const Isa*> g_isa{nullptr};  // null: the float path (quant_linear.cpp)

// x's rows quantized per block of `per` values (32 or 256): codes, scales, and per 32 values the
// codes' sum (K formats) or the scale times it (32-value formats)
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> bsum;
};

void quantize_row(const float* x, int64_t k, int64_t per, int8_t* q, float* d, float* s, int16_t* bsum) {
  for (int64_t b = 0; b * per < k; ++b) {
    const float* xb = x + b * per;
    float amax = 0.f;
    bool finite = true;
    for (int64_t i = 0; i < per; ++i) {
      amax = std::max(amax, std::fabs(xb[i]));
      finite &= std::isfinite(xb[i]);
    }
    const float scale = finite ? amax / 127.f : std::numeric_limits<float>::quiet_NaN();
    const float inv = finite && amax > 0.f ? 1.f / scale : 0.f;  // NaN scale, zero codes: the row is NaN
    d[b] = scale;
    for (int64_t c = 0; c < per; c += 32) {
      int sum = 0;
      for (int64_t i = c; i < c + 32; ++i) {
        const int v = static_cast<int>(std::nearbyint(xb[i] * inv));
        q[b * per + i] = static_cast<int8_t>(v);
        sum += v;
      }
      if (per == 32) s[b] = scale * static_cast<float>(sum);
      else bsum[(b * per + c) / 32] = static_cast<int16_t>(sum);
    }
  }
}

}  // namespace

bool quant_int_selected() { return g_isa.load() != nullptr; }

torch::Tensor quant_int_linear(const torch::Tensor& x, const torch::Tensor& weight, const float* bias, int64_t n_dim,
                               int64_t block_values) {
  const int64_t blocks = weight.size(1), block_bytes = weight.size(2), k_dim = blocks * block_values;
  const int64_t rows = x.size(0), row_bytes = blocks * block_bytes, per = block_values;
  const int64_t nd = k_dim / per;  // scales per row
  QuantizedX qx;
  qx.q.resize(rows * k_dim);
  qx.d.resize(rows * nd);
  qx.s.resize(per == 32 ? rows * nd : 0);
  qx.bsum.resize(per == 32 ? 0 : rows * k_dim / 32);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(xp + r * x.stride(0), k_dim, per, qx.q.data() + r * k_dim, qx.d.data() + r * nd,
                   per == 32 ? qx.s.data() + r * nd : nullptr, per == 32 ? nullptr : qx.bsum.data() + r * k_dim / 32);
  });
  auto y = torch::empty({rows, n_dim}, x.options());
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const Isa& isa = *g_isa.load();
  const int64_t block_rows = std::max<int64_t>(kRows, kRowBlockBytes / k_dim / kRows * kRows);
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const int64_t r1 = std::min(rows, r0 + block_rows);
    at::parallel_for(0, n_dim, 16, [&](int64_t begin, int64_t end) {
      for (int64_t n = begin; n < end; ++n) {
        const float b = bias ? bias[n] : 0.f;
        for (int64_t r = r0; r < r1; r += kRows) {
          const int64_t count = std::min(kRows, r1 - r);
          const XRows xr{qx.q.data() + r * k_dim,
                         qx.d.data() + r * nd,
                         per == 32 ? qx.s.data() + r * nd : nullptr,
                         per == 32 ? nullptr : qx.bsum.data() + r * k_dim / 32,
                         k_dim,
                         nd};
          isa.rows[count - 1](block_bytes, wp + n * row_bytes, blocks, xr, yp + r * n_dim + n, n_dim, b);
        }
      }
    });
  }
  return y;
}

std::string set_quant_kernel(const std::string& name) {
  if (name == "float") {
    g_isa.store(nullptr);
    return name;
  }
  if (name == "int8") {
    g_isa.store(best_isa());
    return std::string("int8-") + best_isa()->name;
  }
  for (const Isa& isa : kIsas) {
    if (name != std::string("int8-") + isa.name) continue;
    TORCH_CHECK(isa.supported(), "this CPU lacks ", isa.name, " (it has ", best_isa()->name, ")");
    g_isa.store(&isa);
    return name;
  }
  TORCH_CHECK(false, "no quantized-linear kernel ", name, ": float, int8, int8-avx512_vnni, int8-avx_vnni or int8-avx2");
}

std::string quant_kernel() {
  const Isa* isa = g_isa.load();
  return isa ? std::string("int8-") + isa->name : "float";
}

#else  // no AVX2: quant_linear.cpp refuses weights in blocks

bool quant_int_selected() { return false; }
torch::Tensor quant_int_linear(const torch::Tensor&, const torch::Tensor&, const float*, int64_t, int64_t) {
  TORCH_CHECK(false, "the integer kernels need AVX2");
}
std::string set_quant_kernel(const std::string& name) {
  TORCH_CHECK(name == "float", "the integer kernels need an x86-64 CPU with AVX2 and FMA");
  return name;
}
std::string quant_kernel() { return "float"; }

#endif
