// The integer path of quant_linear (quant_linear.h): x quantized per row first, as llama.cpp's
// Q8_0 / Q8_K do but with float32 scales (int8 codes round(x / d) to nearest even; d = max |x| / 127
// per 32 values for the 32-value formats, -max / 128 per 256 for the K formats), and the dot products in
// integers (quant_int_kernels.h): VNNI where the CPU has it, maddubs + madd on AVX2, chosen at run
// time (set_quant_kernel). Each thread takes a run of groups of 8 output rows (with AVX-512 and more
// than kStreamRows rows of x, two groups a call, 16 lanes); a group's blocks are unpacked once for
// every 4 rows of x. A row's bits depend neither on the other rows nor on the instruction set.
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

constexpr int64_t kMaxParts = 8;  // K parts of a weight (gguf_blocks.py's MAX_K_PARTS)

// x as the kernels read it: R rows starting at q (int8, `stride` codes apart), their scales and
// sums `bstride` scales apart: a scale per 32 values (d) for the 32-value formats, per 256 for the
// K formats; the codes' sum per 32 values (bsum) and, for the K formats, per 16 (bsum16); for the
// 32-value formats also d times the sum (s)
struct XRows {
  const int8_t* q;
  const float* d;
  const float* s;
  const int16_t* bsum;
  const int16_t* bsum16;
  int64_t stride, bstride;

  // the same rows from block b0 on (blocks of `values`)
  XRows shifted(int64_t b0, int64_t values) const {
    return {q + b0 * values, d + b0,  s ? s + b0 : nullptr, bsum + b0 * values / 32, bsum16 ? bsum16 + b0 * values / 16 : nullptr,
            stride, bstride};
  }
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

constexpr int64_t kRows = 4;                      // rows of x per pass over a group of weight rows
constexpr int64_t kRowBlockBytes = 256 * 1024;    // quantized x rows a pass keeps in L2

constexpr int64_t kGroup = 8;                     // output rows of a group, one per lane
constexpr int64_t kStreamRows = 2;                // rows of x up to which a call is bound by memory

// (block bytes, the group's blocks, the next group's `gs` bytes on, blocks, K parts, x, y, y's row
// stride, outputs, bias)
using DotRows = void (*)(int64_t, const uint8_t*, int64_t, int64_t, int64_t, const XRows&, float*, int64_t, int64_t,
                         const float*);

struct Isa {
  const char* name;
  bool (*supported)();
  DotRows rows[kRows];  // rows[R - 1]: R rows of x against a group
  DotRows pairs[kRows];  // the same against two groups side by side (16 lanes), or null
};

#define BATON_ROWS(ns, I) {&ns::dot_rows<1, I>, &ns::dot_rows<2, I>, &ns::dot_rows<3, I>, &ns::dot_rows<4, I>}
const Isa kIsas[] = {
#ifdef BATON_VNNI_TARGETS
    {"avx512_vnni",
     [] { return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl") &&
                 __builtin_cpu_supports("avx512bw"); },
     BATON_ROWS(isa_avx512_vnni, __m256i), BATON_ROWS(isa_avx512_vnni, __m512i)},
    {"avx_vnni", [] { return static_cast<bool>(__builtin_cpu_supports("avxvnni")); }, BATON_ROWS(isa_avx_vnni, __m256i),
     {}},
#endif
    {"avx2", [] { return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"); }, BATON_ROWS(isa_avx2, __m256i),
     {}},
};
#undef BATON_ROWS

const Isa* best_isa() {
  for (const Isa& isa : kIsas)
    if (isa.supported()) return &isa;
  return &kIsas[std::size(kIsas) - 1];
}

std::atomic<const Isa*> g_isa{nullptr};  // null: the float path (quant_linear.cpp)

// x's rows quantized per block of `per` values (32 or 256): codes, scales, the codes' sum per 32
// values (bsum) and, for the K formats, per 16 (bsum16); for the 32-value formats also the scale
// times the sum (s)
struct QuantizedX {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int16_t> bsum, bsum16;
};

void quantize_row(const float* x, int64_t k, int64_t per, int8_t* q, float* d, float* s, int16_t* bsum,
                  int16_t* bsum16) {
  for (int64_t b = 0; b * per < k; ++b) {
    const float* xb = x + b * per;
    float amax = 0.f, vmax = 0.f;  // the largest |x| and the first value that has it
    bool finite = true;
    for (int64_t i = 0; i < per; ++i) {
      const float ax = std::fabs(xb[i]);
      if (ax > amax) amax = ax, vmax = xb[i];
      finite &= std::isfinite(xb[i]);
    }
    // 32 values: d = max |x| / 127; 256 (Q8_K's rule): the largest value's code is -128, so d = -max / 128
    // (signed) and the other sign's codes stop at 127. Non-finite x: a NaN scale and zero codes (the row is NaN).
    float inv = !finite || amax == 0.f ? 0.f : per == 32 ? 1.f / (amax / 127.f) : -128.f / vmax;
    if (!std::isfinite(inv)) inv = 0.f;  // |x| < ~1e-36: zero codes (nothing such values add survives beside others)
    const float scale = !finite ? std::numeric_limits<float>::quiet_NaN() : per == 32 ? amax / 127.f
                                                                          : inv == 0.f ? 0.f : 1.f / inv;
    d[b] = scale;
    for (int64_t c = 0; c < per; c += 32) {
      int sum = 0;
      for (int64_t i = c; i < c + 32; ++i) {
        const int v = std::min(127, static_cast<int>(std::nearbyint(xb[i] * inv)));
        q[b * per + i] = static_cast<int8_t>(v);
        sum += v;
      }
      if (per == 32) s[b] = scale * static_cast<float>(sum);
      bsum[(b * per + c) / 32] = static_cast<int16_t>(sum);
      if (bsum16 != nullptr) {
        int half = 0;
        for (int64_t i = c; i < c + 16; ++i) half += q[b * per + i];
        bsum16[(b * per + c) / 16] = static_cast<int16_t>(half);
        bsum16[(b * per + c) / 16 + 1] = static_cast<int16_t>(sum - half);
      }
    }
  }
}

// A format's block as fields in row order: an fp16 ('h'), 32 bits ('u') or 16 bytes of codes ('c')
// at each offset; regrouped, a field of s bytes at o becomes 8 s bytes at 8 o (lane r: row r's s
// bytes, the 16 code bytes as four 32-byte runs of each row's bytes [4t, 4t + 4)).
struct Field {
  char kind;
  int64_t offset;
};

std::vector<Field> make_fields(int64_t block_bytes) {
  auto codes = [](int64_t from, int64_t to) {
    std::vector<Field> f;
    for (int64_t o = from; o < to; o += 16) f.push_back({'c', o});
    return f;
  };
  auto join = [](std::vector<Field> a, const std::vector<Field>& b) {
    a.insert(a.end(), b.begin(), b.end());
    return a;
  };
  switch (block_bytes) {
    case 18: return {{'h', 0}, {'c', 2}};                                                      // Q4_0
    case 20: return {{'h', 0}, {'h', 2}, {'c', 4}};                                            // Q4_1
    case 22: return {{'h', 0}, {'u', 2}, {'c', 6}};                                            // Q5_0
    case 24: return {{'h', 0}, {'h', 2}, {'u', 4}, {'c', 8}};                                  // Q5_1
    case 34: return {{'h', 0}, {'c', 2}, {'c', 18}};                                           // Q8_0
    case 144: return join({{'h', 0}, {'h', 2}, {'u', 4}, {'u', 8}, {'u', 12}}, codes(16, 144));  // Q4_K
    case 176: return join({{'h', 0}, {'h', 2}, {'u', 4}, {'u', 8}, {'u', 12}}, codes(16, 176));  // Q5_K
    case 210: return join(codes(0, 192), {{'u', 192}, {'u', 196}, {'u', 200}, {'u', 204}, {'h', 208}});  // Q6_K
  }
  TORCH_CHECK(false, "no GGUF block format of ", block_bytes, " bytes");
}

// the fields of a format, built once (a lookup reads them for every row)
const std::vector<Field>& fields_of(int64_t block_bytes) {
  static const std::vector<Field> q4_0 = make_fields(18), q4_1 = make_fields(20), q5_0 = make_fields(22),
                                  q5_1 = make_fields(24), q8_0 = make_fields(34), q4_k = make_fields(144),
                                  q5_k = make_fields(176), q6_k = make_fields(210);
  switch (block_bytes) {
    case 18: return q4_0;
    case 20: return q4_1;
    case 22: return q5_0;
    case 24: return q5_1;
    case 34: return q8_0;
    case 144: return q4_k;
    case 176: return q5_k;
    case 210: return q6_k;
  }
  TORCH_CHECK(false, "no GGUF block format of ", block_bytes, " bytes");
}

// Copies between a row's block and lane `lane` of its group's regrouped block, from `src` to `dst`:
// ToGroup, src is the row's block and dst the group's; else the other way.
template <bool ToGroup>
void move_lane(const uint8_t* src, const std::vector<Field>& fields, int64_t lane, uint8_t* dst) {
  for (const Field& f : fields) {
    const int64_t size = f.kind == 'h' ? 2 : 4;
    for (int64_t t = 0; t < (f.kind == 'c' ? 4 : 1); ++t) {
      const int64_t in_group = 8 * f.offset + 32 * t + size * lane, in_row = f.offset + 4 * t;
      std::memcpy(dst + (ToGroup ? in_group : in_row), src + (ToGroup ? in_row : in_group), size);
    }
  }
}

}  // namespace

torch::Tensor regroup_blocks(const torch::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 3 && weight.scalar_type() == at::kByte && weight.is_contiguous() && weight.device().is_cpu(),
              "regroup_blocks takes a contiguous uint8 [N, blocks, block bytes] on the CPU, got ", weight.scalar_type(),
              " ", weight.sizes());
  const int64_t n = weight.size(0), blocks = weight.size(1), bytes = weight.size(2), groups = (n + 7) / 8;
  const std::vector<Field>& fields = fields_of(bytes);
  auto out = torch::empty({groups, blocks, 8, bytes}, weight.options());
  const uint8_t* src = weight.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 16, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      for (int64_t lane = 0; lane < 8; ++lane) {
        const int64_t r = std::min(g * 8 + lane, n - 1);  // past the last row: copies of it
        for (int64_t b = 0; b < blocks; ++b)
          move_lane<true>(src + (r * blocks + b) * bytes, fields, lane, dst + (g * blocks + b) * 8 * bytes);
      }
  });
  return out;
}

void regrouped_row(const uint8_t* group, int64_t lane, int64_t blocks, int64_t block_bytes, uint8_t* row) {
  const std::vector<Field>& fields = fields_of(block_bytes);
  for (int64_t b = 0; b < blocks; ++b) move_lane<false>(group + b * 8 * block_bytes, fields, lane, row + b * block_bytes);
}

torch::Tensor quant_int_linear(const torch::Tensor& x, const torch::Tensor& weight, const float* bias, int64_t n_dim,
                               int64_t block_values, int64_t parts) {
  TORCH_CHECK(parts >= 1 && parts <= kMaxParts && weight.size(1) % parts == 0, weight.size(1),
              " blocks a row do not split into ", parts, " parts");
  const int64_t groups = weight.size(0), blocks = weight.size(1), block_bytes = weight.size(3);
  const int64_t k_dim = blocks * block_values, rows = x.size(0), group_bytes = 8 * blocks * block_bytes;
  const int64_t per = block_values, nd = k_dim / per;  // scales per row
  QuantizedX qx;
  qx.q.resize(rows * k_dim);
  qx.d.resize(rows * nd);
  qx.s.resize(per == 32 ? rows * nd : 0);
  qx.bsum.resize(rows * k_dim / 32);
  qx.bsum16.resize(per == 256 ? rows * k_dim / 16 : 0);
  const float* xp = x.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      quantize_row(xp + r * x.stride(0), k_dim, per, qx.q.data() + r * k_dim, qx.d.data() + r * nd,
                   per == 32 ? qx.s.data() + r * nd : nullptr, qx.bsum.data() + r * k_dim / 32,
                   per == 256 ? qx.bsum16.data() + r * k_dim / 16 : nullptr);
  });
  auto y = torch::empty({rows, n_dim}, x.options());
  const uint8_t* wp = weight.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const Isa* chosen = g_isa.load();
  const Isa& isa = chosen ? *chosen : *best_isa();  // a weight regrouped before the float kernel was chosen
  std::vector<float> padded_bias;  // a lane's bias for every lane of the last group
  if (bias != nullptr && n_dim % kGroup != 0) {
    padded_bias.assign(groups * kGroup, 0.f);
    std::copy(bias, bias + n_dim, padded_bias.begin());
    bias = padded_bias.data();
  }
  // groups a kernel call takes (the last may take one): two side by side read two streams, which
  // a call bound by memory (decode's few rows) reads slower than one (Q6_K 23 vs 29 GB/s from DRAM
  // on Zen 4); more rows are bound by the arithmetic, where 16 lanes pay
  const int64_t span = isa.pairs[0] && rows > kStreamRows ? 2 : 1;
  const int64_t block_rows = std::max<int64_t>(kRows, kRowBlockBytes / k_dim / kRows * kRows);
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const int64_t r1 = std::min(rows, r0 + block_rows);
    at::parallel_for(0, (groups + span - 1) / span, 1, [&](int64_t begin, int64_t end) {
      for (int64_t g = begin * span; g < std::min(groups, end * span); g += span) {
        const int64_t take = std::min(span, groups - g), outputs = std::min(n_dim - g * kGroup, take * kGroup);
        const float* b = bias == nullptr ? nullptr : bias + g * kGroup;
        for (int64_t r = r0; r < r1; r += kRows) {
          const int64_t count = std::min(kRows, r1 - r);
          const XRows xr{qx.q.data() + r * k_dim,
                         qx.d.data() + r * nd,
                         per == 32 ? qx.s.data() + r * nd : nullptr,
                         qx.bsum.data() + r * k_dim / 32,
                         per == 256 ? qx.bsum16.data() + r * k_dim / 16 : nullptr,
                         k_dim,
                         nd};
          (take == 2 ? isa.pairs : isa.rows)[count - 1](block_bytes, wp + g * group_bytes, group_bytes, blocks, parts, xr,
                                                        yp + r * n_dim + g * kGroup, n_dim, outputs, b);
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

torch::Tensor quant_int_linear(const torch::Tensor&, const torch::Tensor&, const float*, int64_t, int64_t, int64_t) {
  TORCH_CHECK(false, "the integer kernels need AVX2");
}
torch::Tensor regroup_blocks(const torch::Tensor&) { TORCH_CHECK(false, "the integer kernels need AVX2"); }
void regrouped_row(const uint8_t*, int64_t, int64_t, int64_t, uint8_t*) {
  TORCH_CHECK(false, "the integer kernels need AVX2");
}
std::string set_quant_kernel(const std::string& name) {
  TORCH_CHECK(name == "float", "the integer kernels need an x86-64 CPU with AVX2 and FMA");
  return name;
}
std::string quant_kernel() { return "float"; }

#endif
