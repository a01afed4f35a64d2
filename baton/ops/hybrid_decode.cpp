// A decode step of Qwen3-Next (Gated DeltaNet layers beside gated full attention, MoE with a
// shared expert) in one call, as decode.cpp does for the Llama family: every layer's norms, packed
// linears, causal conv, delta-rule step, rotary, KV write, paged attention and experts run back to
// back in C++, one token per row.
//
// A row's bits are those of the module path (baton/models/qwen3_next.py, recurrent.py, moe.py).
// The linears, norms, gated activation and attention are the very kernels it calls; its torch ops
// are replicated with torch's own rounding:
//  - elementwise ops (sigmoid, silu, softplus) as torch's cpu_kernel_vec runs them: over the
//    tensor's contiguous runs, two vectors at a time with the vector function (Sleef), the tail
//    element by element with the scalar one (libm), split across threads as at::parallel_for
//    splits them. Which element takes which path depends on the batch, so the replica runs over
//    the same batch-wide tensor the module path builds;
//  - sums over the last dim (l2norm, the gated norm's mean, the top-k renormalisation) in the
//    order of torch's cascade sum, whose CPU kernel has no AVX-512 build: 8 lanes;
//  - softmax with the vectorised functional helpers torch's softmax kernel runs;
//  - the depthwise conv as oneDNN sums it: k ascending, one FMA each from zero;
//  - products that torch rounds before an add (rotary, expert weights, the shared-expert gate)
//    are kept from contracting into an FMA.
// tests/test_fused_hybrid_decode.py checks the bits against the module path.
#include "cpu_vec.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

// Keeps a rounded product from being contracted into a following add (GCC contracts a * b + c into
// an FMA by default, torch's separate kernels round the product first).
#if defined(__x86_64__) || defined(__i386__)
#define BATON_ROUNDED(x) __asm__("" : "+x"(x))
#elif defined(__aarch64__)
#define BATON_ROUNDED(x) __asm__("" : "+w"(x))
#else
#define BATON_ROUNDED(x) __asm__("" : "+m"(x))
#endif

namespace {

constexpr int64_t kVS = Vec::size();

// ---- torch's rounding ------------------------------------------------------------------------

// cpu_kernel_vec's vectorized_loop over n contiguous floats
template <typename Op>
inline void torch_vloop(const float* x, float* y, int64_t n, const Op& op) {
  int64_t i = 0;
  for (; i <= n - 2 * kVS; i += 2 * kVS) {
    const Vec a = op(Vec::loadu(x + i)), b = op(Vec::loadu(x + i + kVS));
    a.store(y + i);
    b.store(y + i + kVS);
  }
  for (; i < n; ++i) y[i] = op(x[i]);
}

// y = op(x) for x [rows, m] contiguous (y may be x), as torch runs it over a tensor of that shape
// whose rows are `coalesced` (one run of rows * m elements) or apart (a run per row).
template <typename Op>
void torch_unary(const float* x, float* y, int64_t rows, int64_t m, bool coalesced, const Op& op) {
  const int64_t total = rows * m;
  if (total == 0) return;
  coalesced = coalesced || rows == 1;
  at::parallel_for(0, total, at::internal::GRAIN_SIZE, [&](int64_t begin, int64_t end) {
    if (coalesced) {
      torch_vloop(x + begin, y + begin, end - begin, op);
      return;
    }
    for (int64_t i = begin; i < end;) {
      const int64_t stop = std::min(end, (i / m + 1) * m);
      torch_vloop(x + i, y + i, stop - i, op);
      i = stop;
    }
  });
}

struct Sigmoid {  // torch.sigmoid
  Vec operator()(Vec a) const { return (Vec(1.f) + (Vec(0.f) - a).exp()).reciprocal(); }
  float operator()(float a) const { return 1.f / (1.f + std::exp(-a)); }
};
struct Silu {  // F.silu
  Vec operator()(Vec a) const { return a / (Vec(1.f) + a.neg().exp()); }
  float operator()(float a) const { return a / (1.f + std::exp(-a)); }
};
struct Softplus {  // F.softplus, beta 1, threshold 20
  Vec operator()(Vec a) const { return Vec::blendv(a.exp().log1p(), a, a > Vec(20.f)); }
  float operator()(float a) const { return a > 20.f ? a : static_cast<float>(std::log1p(std::exp(a))); }
};

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
float torch_row_sum(const float* x, int64_t n) {
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

// x * rsqrt((x * x).sum() + eps) over a row of n floats (l2norm), then * scale when scale != 1
void l2norm_row(const float* x, float* out, int64_t n, float eps, float scale, float* buf) {
  for (int64_t i = 0; i < n; ++i) buf[i] = x[i] * x[i];
  const float inv = 1.f / std::sqrt(torch_row_sum(buf, n) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * inv;
  if (scale != 1.f)
    for (int64_t i = 0; i < n; ++i) out[i] = out[i] * scale;
}

// ---- kernels of the step ---------------------------------------------------------------------

// cache[slots[t], h] = src[t, h] for src [rows, kv heads, dim] (any strides but the last)
void write_kv(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots) {
  const int64_t rows = src.size(0), heads = src.size(1), bytes = src.size(2) * sizeof(float);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* s = src.data_ptr<float>();
  float* c = cache.data_ptr<float>();
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t h = 0; h < heads; ++h)
      std::memcpy(c + slot[t] * cache.stride(0) + h * cache.stride(1), s + t * src.stride(0) + h * src.stride(1), bytes);
}

// Partial rotary in place over x [rows, heads, D] (any strides but the last): the first rot dims
// of every head become x * cos + rotate_half(x) * sin with the sign folded into sin; the products
// are rounded before the add, as the module path's separate torch ops do.
void partial_rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t rows = x.size(0), heads = x.size(1), rot = cos.size(1), half = rot / 2;
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1), c0 = cos.stride(0), n0 = sin.stride(0);
  for (int64_t t = 0; t < rows; ++t) {
    const float* c = cp + t * c0;
    const float* s = sp + t * n0;
    for (int64_t h = 0; h < heads; ++h) {
      float* a = xp + t * s0 + h * s1;
      for (int64_t j = 0; j < half; ++j) {
        const float x1 = a[j], x2 = a[half + j];
        float p1 = x1 * c[j], p2 = x2 * s[j], p3 = x2 * c[half + j], p4 = x1 * s[half + j];
        BATON_ROUNDED(p1);
        BATON_ROUNDED(p2);
        BATON_ROUNDED(p3);
        BATON_ROUNDED(p4);
        a[j] = p1 + p2;
        a[half + j] = p3 + p4;
      }
    }
  }
}

// One delta-rule step (recurrent_scan_ at T = 1, the same arithmetic per lane) of one head over
// the columns [j0, j0 + width) of its state s [dk, dv]: S *= g; delta = (v - k S) * beta;
// S += k (x) delta; out = q S.
template <int64_t NV, bool Partial>
void delta_step(const float* q, const float* k, const float* v, float g, float beta, float* s, float* out, int64_t dk,
                int64_t dv, int64_t j0, int64_t last) {
  const auto load = [&](const float* p, int64_t b) {
    return (Partial && b == NV - 1) ? Vec::loadu(p + b * kVS, last) : Vec::loadu(p + b * kVS);
  };
  const auto store = [&](const Vec& x, float* p, int64_t b) {
    if (Partial && b == NV - 1)
      x.store(p + b * kVS, last);
    else
      x.store(p + b * kVS);
  };
  float* sb = s + j0;
  const Vec gv(g);
  Vec mem[NV], o[NV];
  for (int64_t b = 0; b < NV; ++b) mem[b] = o[b] = Vec(0.f);
  for (int64_t i = 0; i < dk; ++i) {
    const Vec ki(k[i]);
    float* row = sb + i * dv;
    for (int64_t b = 0; b < NV; ++b) {
      const Vec x = load(row, b) * gv;
      store(x, row, b);
      mem[b] = at::vec::fmadd(ki, x, mem[b]);
    }
  }
  const Vec bt(beta);
  Vec delta[NV];
  for (int64_t b = 0; b < NV; ++b) delta[b] = (load(v + j0, b) - mem[b]) * bt;
  for (int64_t i = 0; i < dk; ++i) {
    const Vec ki(k[i]), qi(q[i]);
    float* row = sb + i * dv;
    for (int64_t b = 0; b < NV; ++b) {
      const Vec x = at::vec::fmadd(ki, delta[b], load(row, b));
      store(x, row, b);
      o[b] = at::vec::fmadd(qi, x, o[b]);
    }
  }
  for (int64_t b = 0; b < NV; ++b) store(o[b], out + j0, b);
}

constexpr int64_t kBlockVecs = 4;  // state columns per task, in vectors (the kernels above go to 4)

using DeltaKernel = decltype(&delta_step<1, false>);
constexpr DeltaKernel kDeltaKernels[kBlockVecs][2] = {{&delta_step<1, false>, &delta_step<1, true>},
                                                      {&delta_step<2, false>, &delta_step<2, true>},
                                                      {&delta_step<3, false>, &delta_step<3, true>},
                                                      {&delta_step<4, false>, &delta_step<4, true>}};

enum Part { kNorms, kLinears, kAttention, kRecurrent, kExperts, kNumParts };
constexpr const char* kPartNames[kNumParts] = {"norms, rotary, activation, routing", "linears",
                                               "attention (KV write, kernel)",
                                               "recurrent (conv, delta rule, gated norm)", "experts (MoE linears)"};

class Stopwatch {
 public:
  explicit Stopwatch(double* totals) : totals_(totals), start_(totals ? now() : 0.0) {}
  void lap(Part part) {
    if (totals_ == nullptr) return;
    const double t = now();
    totals_[part] += t - start_;
    start_ = t;
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  double* totals_;
  double start_;
};

struct HybridLayer {
  bool recurrent = false;
  torch::Tensor input_norm, post_attn_norm;
  // gated attention
  torch::Tensor q_proj, k_proj, v_proj, o_proj;  // packed panels
  c10::optional<torch::Tensor> q_bias, k_bias, v_bias, o_bias;
  torch::Tensor q_norm, k_norm;
  torch::Tensor k_cache, v_cache;  // [slots, kv heads, head dim]
  int64_t group = 0;
  // Gated DeltaNet
  torch::Tensor qkvz, ba, out_proj;        // packed panels
  torch::Tensor conv_weight;               // [C, K]
  torch::Tensor neg_exp_a, dt_bias;        // [vh]: -exp(A_log), dt_bias
  torch::Tensor norm_weight;               // [dv]
  double norm_eps = 1e-6;
  torch::Tensor conv_state, rec_state;     // [slots, C, K - 1], [slots, vh, dk, dv]
  torch::Tensor conv_ckpt, rec_ckpt;       // [checkpoints, ...] alike
  // MLP: dense, or a sparse MoE with an optional (gated) shared expert
  bool has_mlp = false, moe = false;
  torch::Tensor gate_up, down;
  int64_t intermediate = 0;
  torch::Tensor router;
  int64_t num_experts = 0, top_k = 0;
  bool norm_topk = true;
  std::vector<torch::Tensor> expert_gate_up, expert_down;
  int64_t moe_intermediate = 0;
  torch::Tensor shared_gate_up, shared_down, shared_gate;  // undefined without
  int64_t shared_intermediate = 0;
};

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.device().is_cpu(), name,
              " must be a float32 CPU tensor");
}

void check_vector(const torch::Tensor& t, int64_t n, const char* name) {
  check_float(t, name);
  TORCH_CHECK(t.is_contiguous() && t.numel() == n, name, " must be contiguous [", n, "], got ", t.sizes());
}

void check_panels(const torch::Tensor& t, int64_t k, int64_t n, const char* name) {
  check_float(t, name);
  TORCH_CHECK(t.dim() == 3 && t.is_contiguous() && t.size(1) == k && t.size(2) == panel_lanes() &&
                  t.size(0) * panel_lanes() >= n,
              name, " must be packed panels of a [", n, ", ", k, "] weight, got ", t.sizes());
}

}  // namespace

// forward runs without the GIL: mu_ keeps calls from two Python threads apart, as the GIL did.
class FusedHybridDecoder {
 public:
  FusedHybridDecoder(int64_t hidden, double eps, double norm_offset, torch::Tensor final_norm, int64_t num_heads,
                     int64_t num_kv_heads, int64_t head_dim, int64_t rotary_dim, double scale, int64_t key_heads,
                     int64_t value_heads, int64_t key_dim, int64_t value_dim, int64_t conv_kernel)
      : hidden_(hidden), eps_(eps), offset_(norm_offset), final_norm_(std::move(final_norm)), num_heads_(num_heads),
        num_kv_heads_(num_kv_heads), head_dim_(head_dim), rotary_dim_(rotary_dim), scale_(scale), kh_(key_heads),
        vh_(value_heads), dk_(key_dim), dv_(value_dim), conv_kernel_(conv_kernel) {
    check_vector(final_norm_, hidden_, "final_norm");
    TORCH_CHECK(rotary_dim_ % 2 == 0 && rotary_dim_ >= 0 && rotary_dim_ <= head_dim_,
                "rotary_dim must be even and at most head_dim, got ", rotary_dim_);
    TORCH_CHECK(kh_ >= 1 && vh_ % kh_ == 0, "value heads (", vh_, ") must be a multiple of key heads (", kh_, ")");
    TORCH_CHECK(conv_kernel_ >= 2, "conv kernel must be at least 2, got ", conv_kernel_);
  }

  void add_attention_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm, torch::Tensor q_proj,
                           c10::optional<torch::Tensor> q_bias, torch::Tensor k_proj,
                           c10::optional<torch::Tensor> k_bias, torch::Tensor v_proj,
                           c10::optional<torch::Tensor> v_bias, torch::Tensor o_proj,
                           c10::optional<torch::Tensor> o_bias, torch::Tensor q_norm, torch::Tensor k_norm,
                           torch::Tensor k_cache, torch::Tensor v_cache, int64_t group) {
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    check_norms(input_norm, post_attn_norm);
    check_panels(q_proj, hidden_, 2 * q_size, "q_proj");
    check_panels(k_proj, hidden_, kv_size, "k_proj");
    check_panels(v_proj, hidden_, kv_size, "v_proj");
    check_panels(o_proj, q_size, hidden_, "o_proj");
    check_vector(q_norm, head_dim_, "q_norm");
    check_vector(k_norm, head_dim_, "k_norm");
    check_float(k_cache, "k_cache");
    check_float(v_cache, "v_cache");
    TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == num_kv_heads_ && k_cache.size(2) == head_dim_ &&
                    k_cache.stride(2) == 1 && k_cache.sizes() == v_cache.sizes() && v_cache.stride(2) == 1,
                "KV cache must be [slots, kv heads, head dim]");
    TORCH_CHECK(group >= 0, "group must be an index, got ", group);
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<size_t>(group) >= group_slots_.size())
      group_slots_.resize(group + 1, std::numeric_limits<int64_t>::max());
    group_slots_[group] = std::min(group_slots_[group], k_cache.size(0));
    HybridLayer l;
    l.input_norm = std::move(input_norm);
    l.post_attn_norm = std::move(post_attn_norm);
    l.q_proj = std::move(q_proj);
    l.k_proj = std::move(k_proj);
    l.v_proj = std::move(v_proj);
    l.o_proj = std::move(o_proj);
    l.q_bias = std::move(q_bias);
    l.k_bias = std::move(k_bias);
    l.v_bias = std::move(v_bias);
    l.o_bias = std::move(o_bias);
    l.q_norm = std::move(q_norm);
    l.k_norm = std::move(k_norm);
    l.k_cache = std::move(k_cache);
    l.v_cache = std::move(v_cache);
    l.group = group;
    layers_.push_back(std::move(l));
  }

  void add_recurrent_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm, torch::Tensor qkvz,
                           torch::Tensor ba, torch::Tensor out_proj, torch::Tensor conv_weight,
                           torch::Tensor neg_exp_a, torch::Tensor dt_bias, torch::Tensor norm_weight,
                           double norm_eps, torch::Tensor conv_state, torch::Tensor rec_state,
                           torch::Tensor conv_checkpoints, torch::Tensor rec_checkpoints) {
    const int64_t channels = conv_channels();
    check_norms(input_norm, post_attn_norm);
    check_panels(qkvz, hidden_, 2 * kh_ * dk_ + 2 * vh_ * dv_, "in_proj_qkvz");
    check_panels(ba, hidden_, 2 * vh_, "in_proj_ba");
    check_panels(out_proj, vh_ * dv_, hidden_, "out_proj");
    check_float(conv_weight, "conv_weight");
    TORCH_CHECK(conv_weight.is_contiguous() && conv_weight.dim() == 2 && conv_weight.size(0) == channels &&
                    conv_weight.size(1) == conv_kernel_,
                "conv_weight must be contiguous [", channels, ", ", conv_kernel_, "], got ", conv_weight.sizes());
    check_vector(neg_exp_a, vh_, "neg_exp_a");
    check_vector(dt_bias, vh_, "dt_bias");
    check_vector(norm_weight, dv_, "norm_weight");
    const std::vector<int64_t> conv_shape{channels, conv_kernel_ - 1}, rec_shape{vh_, dk_, dv_};
    for (const auto& [t, shape, name] : {std::tuple{&conv_state, &conv_shape, "conv_state"},
                                         std::tuple{&rec_state, &rec_shape, "rec_state"},
                                         std::tuple{&conv_checkpoints, &conv_shape, "conv_checkpoints"},
                                         std::tuple{&rec_checkpoints, &rec_shape, "rec_checkpoints"}}) {
      check_float(*t, name);
      TORCH_CHECK(t->dim() == 1 + static_cast<int64_t>(shape->size()) && t->sizes().slice(1) == *shape &&
                      (t->size(0) == 0 || t->select(0, 0).is_contiguous()),
                  name, " must be [n, ", c10::IntArrayRef(*shape), "], each entry contiguous, got ", t->sizes());
    }
    TORCH_CHECK(conv_checkpoints.size(0) == rec_checkpoints.size(0), "one conv and one state checkpoint per id");
    TORCH_CHECK(conv_state.size(0) == rec_state.size(0), "one conv and one state slot per slot");
    std::lock_guard<std::mutex> lock(mu_);
    HybridLayer l;
    l.recurrent = true;
    l.input_norm = std::move(input_norm);
    l.post_attn_norm = std::move(post_attn_norm);
    l.qkvz = std::move(qkvz);
    l.ba = std::move(ba);
    l.out_proj = std::move(out_proj);
    l.conv_weight = std::move(conv_weight);
    l.neg_exp_a = std::move(neg_exp_a);
    l.dt_bias = std::move(dt_bias);
    l.norm_weight = std::move(norm_weight);
    l.norm_eps = norm_eps;
    l.conv_state = std::move(conv_state);
    l.rec_state = std::move(rec_state);
    l.conv_ckpt = std::move(conv_checkpoints);
    l.rec_ckpt = std::move(rec_checkpoints);
    num_state_slots_ = std::min(num_state_slots_, l.conv_state.size(0));
    num_checkpoints_ = std::min(num_checkpoints_, l.conv_ckpt.size(0));
    layers_.push_back(std::move(l));
  }

  // The MLP of the layer added last: gate_up [2I, hidden] and down [hidden, I] panels.
  void set_dense_mlp(torch::Tensor gate_up, torch::Tensor down, int64_t intermediate) {
    check_panels(gate_up, hidden_, 2 * intermediate, "gate_up");
    check_panels(down, intermediate, hidden_, "down");
    std::lock_guard<std::mutex> lock(mu_);
    HybridLayer& l = last_layer();
    l.has_mlp = true;
    l.moe = false;
    l.gate_up = std::move(gate_up);
    l.down = std::move(down);
    l.intermediate = intermediate;
  }

  // The sparse MoE of the layer added last: a router [E, hidden], every expert's gate_up and down,
  // a shared expert (gate_up and down undefined without) and its gate [1, hidden] (or none).
  void set_moe(torch::Tensor router, int64_t top_k, bool norm_topk_prob, std::vector<torch::Tensor> expert_gate_up,
               std::vector<torch::Tensor> expert_down, int64_t moe_intermediate,
               c10::optional<torch::Tensor> shared_gate_up, c10::optional<torch::Tensor> shared_down,
               int64_t shared_intermediate, c10::optional<torch::Tensor> shared_gate) {
    const int64_t experts = static_cast<int64_t>(expert_gate_up.size());
    TORCH_CHECK(experts >= 1 && expert_down.size() == expert_gate_up.size(), "one gate_up and one down per expert");
    TORCH_CHECK(top_k >= 1 && top_k <= experts, "top_k must be in [1, ", experts, "], got ", top_k);
    check_panels(router, hidden_, experts, "router");
    for (int64_t e = 0; e < experts; ++e) {
      check_panels(expert_gate_up[e], hidden_, 2 * moe_intermediate, "expert gate_up");
      check_panels(expert_down[e], moe_intermediate, hidden_, "expert down");
    }
    TORCH_CHECK(shared_gate_up.has_value() == shared_down.has_value(), "the shared expert needs gate_up and down");
    if (shared_gate_up.has_value()) {
      check_panels(*shared_gate_up, hidden_, 2 * shared_intermediate, "shared gate_up");
      check_panels(*shared_down, shared_intermediate, hidden_, "shared down");
    }
    TORCH_CHECK(!shared_gate.has_value() || shared_gate_up.has_value(), "a shared-expert gate without a shared expert");
    if (shared_gate.has_value()) check_panels(*shared_gate, hidden_, 1, "shared_expert_gate");
    std::lock_guard<std::mutex> lock(mu_);
    HybridLayer& l = last_layer();
    l.has_mlp = true;
    l.moe = true;
    l.router = std::move(router);
    l.num_experts = experts;
    l.top_k = top_k;
    l.norm_topk = norm_topk_prob;
    l.expert_gate_up = std::move(expert_gate_up);
    l.expert_down = std::move(expert_down);
    l.moe_intermediate = moe_intermediate;
    l.shared_gate_up = shared_gate_up.value_or(torch::Tensor());
    l.shared_down = shared_down.value_or(torch::Tensor());
    l.shared_intermediate = shared_intermediate;
    l.shared_gate = shared_gate.value_or(torch::Tensor());
  }

  // x: the embedded tokens [rows, hidden], one decode token per row; cos and signed sin [rows,
  // rotary dim]; per KV group the slot each row's K/V goes to and the blocks, first offset and
  // length each row reads (GroupAttnMetadata); each row's recurrent state slot; the checkpoints
  // to take: checkpoint snapshot_ids[i] of the state of row snapshot_rows[i]'s slot before (offset
  // 0) or after (offset 1) its token. Returns the final-normed hidden [rows, hidden].
  torch::Tensor forward(const torch::Tensor& x_in, const torch::Tensor& cos, const torch::Tensor& sin,
                        const std::vector<torch::Tensor>& slot_mapping, const std::vector<torch::Tensor>& block_ids,
                        const std::vector<torch::Tensor>& kv_offsets, const std::vector<torch::Tensor>& kv_lens,
                        int64_t block_size, const std::vector<int64_t>& state_slots,
                        const std::vector<int64_t>& snapshot_rows, const std::vector<int64_t>& snapshot_offsets,
                        const std::vector<int64_t>& snapshot_ids) {
    std::lock_guard<std::mutex> lock(mu_);
    check_step(x_in, cos, sin, slot_mapping, block_ids, kv_offsets, kv_lens, block_size, state_slots, snapshot_rows,
               snapshot_offsets, snapshot_ids);
    Step step{cos, sin, slot_mapping, block_ids, kv_offsets, kv_lens, block_size, state_slots, snapshot_rows,
              snapshot_offsets, snapshot_ids};
    torch::Tensor residual = x_in.contiguous().clone(), x;
    Stopwatch watch(profiling_ ? seconds_.data() : nullptr);
    for (size_t i = 0; i < layers_.size(); ++i) {
      HybridLayer& l = layers_[i];
      const torch::Tensor h = i == 0 ? rms_norm(residual, c10::nullopt, l.input_norm, eps_, offset_)
                                     : rms_norm(x, residual, l.input_norm, eps_, offset_);
      watch.lap(kNorms);
      const torch::Tensor mixed = l.recurrent ? delta_net(l, h, step, watch) : attention(l, h, step, watch);
      const torch::Tensor mlp_in = rms_norm(mixed, residual, l.post_attn_norm, eps_, offset_);
      watch.lap(kNorms);
      x = l.moe ? moe(l, mlp_in, watch) : dense_mlp(l, mlp_in, watch);
    }
    torch::Tensor out = layers_.empty() ? rms_norm(residual, c10::nullopt, final_norm_, eps_, offset_)
                                        : rms_norm(x, residual, final_norm_, eps_, offset_);
    watch.lap(kNorms);
    return out;
  }

  void set_profiling(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    profiling_ = on;
    seconds_.fill(0.0);
  }
  std::map<std::string, double> profile() const {
    std::lock_guard<std::mutex> lock(mu_);
    std::map<std::string, double> named;
    for (int part = 0; part < kNumParts; ++part) named[kPartNames[part]] = seconds_[part];
    return named;
  }

 private:
  struct Step {
    const torch::Tensor& cos;
    const torch::Tensor& sin;
    const std::vector<torch::Tensor>& slot_mapping;
    const std::vector<torch::Tensor>& block_ids;
    const std::vector<torch::Tensor>& kv_offsets;
    const std::vector<torch::Tensor>& kv_lens;
    int64_t block_size;
    const std::vector<int64_t>& slots;
    const std::vector<int64_t>& snapshot_rows;
    const std::vector<int64_t>& snapshot_offsets;
    const std::vector<int64_t>& snapshot_ids;
  };

  int64_t conv_channels() const { return 2 * kh_ * dk_ + vh_ * dv_; }

  HybridLayer& last_layer() {
    TORCH_CHECK(!layers_.empty(), "add a layer before its MLP");
    return layers_.back();
  }

  void check_norms(const torch::Tensor& input_norm, const torch::Tensor& post_attn_norm) const {
    check_vector(input_norm, hidden_, "input_norm");
    check_vector(post_attn_norm, hidden_, "post_attn_norm");
  }

  // Gated attention: q_proj gives every head its query and output gate; q/k norm; partial rotary;
  // paged decode attention; out * sigmoid(gate); o_proj.
  torch::Tensor attention(HybridLayer& l, const torch::Tensor& h, const Step& step, Stopwatch& watch) {
    const int64_t n = h.size(0), d = head_dim_, q_size = num_heads_ * d, kv_size = num_kv_heads_ * d;
    const torch::Tensor qg = panel_linear(h, l.q_proj, l.q_bias, 2 * q_size);
    const torch::Tensor k_flat = panel_linear(h, l.k_proj, l.k_bias, kv_size);
    const torch::Tensor v_flat = panel_linear(h, l.v_proj, l.v_bias, kv_size);
    watch.lap(kLinears);
    // the query halves as a contiguous [n, heads, d] and the gate halves as [n, heads * d]
    torch::Tensor q = torch::empty({n, num_heads_, d}, h.options()), gate = torch::empty({n, q_size}, h.options());
    {
      const float* src = qg.data_ptr<float>();
      float* qp = q.data_ptr<float>();
      float* gp = gate.data_ptr<float>();
      for (int64_t t = 0; t < n; ++t)
        for (int64_t hd = 0; hd < num_heads_; ++hd) {
          const float* s = src + t * 2 * q_size + hd * 2 * d;
          std::memcpy(qp + (t * num_heads_ + hd) * d, s, d * sizeof(float));
          std::memcpy(gp + t * q_size + hd * d, s + d, d * sizeof(float));
        }
    }
    torch::Tensor k = k_flat.view({n, num_kv_heads_, d});
    const torch::Tensor v = v_flat.view({n, num_kv_heads_, d});
    rms_norm_heads_(q, l.q_norm, eps_, offset_);
    rms_norm_heads_(k, l.k_norm, eps_, offset_);
    if (rotary_dim_ > 0) {
      partial_rotary_(q, step.cos, step.sin);
      partial_rotary_(k, step.cos, step.sin);
    }
    // torch.sigmoid(gate): gate's rows are apart in the module path where a head is alone
    float* gp = gate.data_ptr<float>();
    torch_unary(gp, gp, n, q_size, num_heads_ > 1, Sigmoid());
    watch.lap(kNorms);
    write_kv(k, l.k_cache, step.slot_mapping[l.group]);
    write_kv(v, l.v_cache, step.slot_mapping[l.group]);
    const torch::Tensor attn = paged_decode_attention_checked_context(
        q, l.k_cache, l.v_cache, step.block_ids[l.group], step.kv_offsets[l.group], step.kv_lens[l.group],
        step.block_size, scale_);
    watch.lap(kAttention);
    torch::Tensor gated = attn.view({n, q_size}).mul(gate);  // exact products, any order
    watch.lap(kNorms);
    torch::Tensor o = panel_linear(gated, l.o_proj, l.o_bias, hidden_);
    watch.lap(kLinears);
    return o;
  }

  // Gated DeltaNet for one token per row: GatedDeltaNet.forward's ops, in its order.
  torch::Tensor delta_net(HybridLayer& l, const torch::Tensor& h, const Step& step, Stopwatch& watch) {
    const int64_t n = h.size(0), kh = kh_, vh = vh_, dk = dk_, dv = dv_, r = vh / kh;
    const int64_t key_dim = kh * dk, value_dim = vh * dv, channels = conv_channels(), kc = conv_kernel_;
    const int64_t group_width = 2 * dk + 2 * r * dv;  // a key head's q, k, v, z in in_proj_qkvz's output
    const torch::Tensor qkvz = panel_linear(h, l.qkvz, c10::nullopt, kh * group_width);
    const torch::Tensor ba = panel_linear(h, l.ba, c10::nullopt, 2 * vh);
    watch.lap(kLinears);
    snapshot(l, step, 0);
    const auto opts = h.options();
    // causal conv over each row's window [conv_state | x], k ascending, one FMA each from zero;
    // the window shifts by one
    torch::Tensor conv = torch::empty({n, channels}, opts);
    {
      const float* src = qkvz.data_ptr<float>();
      const float* w = l.conv_weight.data_ptr<float>();
      float* out = conv.data_ptr<float>();
      float* states = l.conv_state.data_ptr<float>();
      const int64_t state_stride = l.conv_state.stride(0), km1 = kc - 1;
      at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
          const float* row = src + t * kh * group_width;
          float* st = states + step.slots[t] * state_stride;
          for (int64_t c = 0; c < channels; ++c) {
            int64_t col;  // _split: the column of in_proj_qkvz's output that feeds channel c
            if (c < 2 * key_dim) {
              const int64_t part = c / key_dim, cc = c % key_dim;
              col = cc / dk * group_width + part * dk + cc % dk;
            } else {
              const int64_t cc = c - 2 * key_dim;
              col = cc / (r * dv) * group_width + 2 * dk + cc % (r * dv);
            }
            const float xin = row[col];
            const float* wc = w + c * kc;
            float* sc = st + c * km1;
            float acc = 0.f;
            for (int64_t k = 0; k < km1; ++k) acc = std::fma(wc[k], sc[k], acc);
            acc = std::fma(wc[km1], xin, acc);
            out[t * channels + c] = acc;
            for (int64_t k = 0; k + 1 < km1; ++k) sc[k] = sc[k + 1];
            sc[km1 - 1] = xin;
          }
        }
      });
    }
    float* cp = conv.data_ptr<float>();
    torch_unary(cp, cp, n, channels, true, Silu());
    // z, b and a as the module's contiguous [n, *] tensors; when there is one key head its
    // reshape is a view with rows apart, which is how torch runs the elementwise ops over them
    torch::Tensor z = torch::empty({n, value_dim}, opts), beta = torch::empty({n, vh}, opts),
                  decay = torch::empty({n, vh}, opts);
    {
      const float* src = qkvz.data_ptr<float>();
      const float* bap = ba.data_ptr<float>();
      float* zp = z.data_ptr<float>();
      float* bp = beta.data_ptr<float>();
      float* dp = decay.data_ptr<float>();
      const float* dt = l.dt_bias.data_ptr<float>();
      for (int64_t t = 0; t < n; ++t) {
        for (int64_t g = 0; g < kh; ++g) {
          std::memcpy(zp + t * value_dim + g * r * dv, src + t * kh * group_width + g * group_width + 2 * dk + r * dv,
                      r * dv * sizeof(float));
          for (int64_t j = 0; j < r; ++j) {
            bp[t * vh + g * r + j] = bap[t * 2 * vh + g * 2 * r + j];
            dp[t * vh + g * r + j] = bap[t * 2 * vh + g * 2 * r + r + j] + dt[g * r + j];  // a + dt_bias
          }
        }
      }
      const bool coalesced = kh > 1;
      torch_unary(bp, bp, n, vh, coalesced, Sigmoid());
      torch_unary(dp, dp, n, vh, true, Softplus());  // a + dt_bias is a fresh contiguous tensor
      const float* nea = l.neg_exp_a.data_ptr<float>();
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < vh; ++j) dp[t * vh + j] = nea[j] * dp[t * vh + j];
      torch_unary(zp, zp, n, value_dim, coalesced, Silu());  // F.silu(gate) of the gated norm
    }
    // l2norm(q) * dk^-0.5 and l2norm(k) per key head
    torch::Tensor qn = torch::empty({n, kh, dk}, opts), kn = torch::empty({n, kh, dk}, opts);
    {
      const float* src = conv.data_ptr<float>();
      float* qp = qn.data_ptr<float>();
      float* kp = kn.data_ptr<float>();
      const float q_scale = static_cast<float>(std::pow(static_cast<double>(dk), -0.5));
      at::parallel_for(0, n * kh, std::max<int64_t>(1, 4096 / dk), [&](int64_t begin, int64_t end) {
        std::vector<float> buf(dk);
        for (int64_t i = begin; i < end; ++i) {
          const int64_t t = i / kh, g = i % kh;
          l2norm_row(src + t * channels + g * dk, qp + i * dk, dk, 1e-6f, q_scale, buf.data());
          l2norm_row(src + t * channels + key_dim + g * dk, kp + i * dk, dk, 1e-6f, 1.f, buf.data());
        }
      });
    }
    // one delta-rule step per row and value head, in (row, head, column block) tasks
    torch::Tensor out = torch::empty({n, vh, dv}, opts);
    {
      constexpr int64_t block = kBlockVecs * kVS;
      const int64_t blocks = (dv + block - 1) / block;
      const float* src = conv.data_ptr<float>();
      const float* qp = qn.data_ptr<float>();
      const float* kp = kn.data_ptr<float>();
      const float* bp = beta.data_ptr<float>();
      const float* dp = decay.data_ptr<float>();
      float* states = l.rec_state.data_ptr<float>();
      float* op = out.data_ptr<float>();
      const int64_t state_stride = l.rec_state.stride(0);
      const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, dk * std::min(dv, block)));
      at::parallel_for(0, n * vh * blocks, grain, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
          const int64_t t = task / (vh * blocks), hd = task / blocks % vh, j0 = task % blocks * block;
          const int64_t width = std::min(block, dv - j0), nv = (width + kVS - 1) / kVS, last = width - (nv - 1) * kVS;
          const int64_t kq = (t * kh + hd / r) * dk;
          // exp(decay) as recurrent_scan_ takes it: the vector exp
          float g[kVS];
          Vec(dp[t * vh + hd]).exp().store(g);
          kDeltaKernels[nv - 1][last < kVS](qp + kq, kp + kq, src + t * channels + 2 * key_dim + hd * dv, g[0],
                                            bp[t * vh + hd], states + step.slots[t] * state_stride + hd * dk * dv,
                                            op + (t * vh + hd) * dv, dk, dv, j0, last);
        }
      });
    }
    snapshot(l, step, 1);
    // gated RMS norm: x * rsqrt(mean(x^2) + eps) * weight * silu(z)
    {
      float* op = out.data_ptr<float>();
      const float* zp = z.data_ptr<float>();
      const float* w = l.norm_weight.data_ptr<float>();
      const float eps = static_cast<float>(l.norm_eps), fdv = static_cast<float>(dv);
      at::parallel_for(0, n * vh, std::max<int64_t>(1, 4096 / dv), [&](int64_t begin, int64_t end) {
        std::vector<float> buf(dv);
        for (int64_t i = begin; i < end; ++i) {
          float* o = op + i * dv;
          const float* zr = zp + i * dv;
          for (int64_t j = 0; j < dv; ++j) buf[j] = o[j] * o[j];
          const float inv = 1.f / std::sqrt(torch_row_sum(buf.data(), dv) / fdv + eps);
          for (int64_t j = 0; j < dv; ++j) {
            const float normed = o[j] * inv;
            const float weighted = w[j] * normed;
            o[j] = weighted * zr[j];
          }
        }
      });
    }
    watch.lap(kRecurrent);
    torch::Tensor o = panel_linear(out.view({n, value_dim}), l.out_proj, c10::nullopt, hidden_);
    watch.lap(kLinears);
    return o;
  }

  // The checkpoints of this layer's state taken `offset` rows into their row (0: before its token).
  void snapshot(HybridLayer& l, const Step& step, int64_t offset) const {
    for (size_t i = 0; i < step.snapshot_rows.size(); ++i) {
      if (step.snapshot_offsets[i] != offset) continue;
      const int64_t slot = step.slots[step.snapshot_rows[i]], cid = step.snapshot_ids[i];
      l.conv_ckpt.select(0, cid).copy_(l.conv_state.select(0, slot));
      l.rec_ckpt.select(0, cid).copy_(l.rec_state.select(0, slot));
    }
  }

  torch::Tensor dense_mlp(HybridLayer& l, const torch::Tensor& x, Stopwatch& watch) {
    const torch::Tensor gate_up = panel_linear(x, l.gate_up, c10::nullopt, 2 * l.intermediate);
    watch.lap(kLinears);
    const torch::Tensor act = gated_act(gate_up, false);
    watch.lap(kNorms);
    torch::Tensor out = panel_linear(act, l.down, c10::nullopt, hidden_);
    watch.lap(kLinears);
    return out;
  }

  // SparseMoE.forward: softmax routing, top-k (renormalised), every routed expert on its rows with
  // the rows' sums in ascending expert order, then + sigmoid(shared_expert_gate(x)) * shared(x).
  torch::Tensor moe(HybridLayer& l, const torch::Tensor& x, Stopwatch& watch) {
    const int64_t n = x.size(0), experts = l.num_experts, top_k = l.top_k;
    torch::Tensor probs = panel_linear(x, l.router, c10::nullopt, experts);
    watch.lap(kLinears);
    std::vector<int64_t> ids(n * top_k);
    std::vector<float> weights(n * top_k);
    {
      float* pp = probs.data_ptr<float>();
      for (int64_t t = 0; t < n; ++t) {
        float* p = pp + t * experts;
        // F.softmax's lastdim kernel
        const float top = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, p,
                                                     experts);
        at::vec::map([top](Vec a) { return (a - Vec(top)).exp(); }, p, p, experts);
        float sum = at::vec::reduce_all<float>([](Vec a, Vec b) { return a + b; }, p, experts);
        sum = 1 / sum;
        at::vec::map([sum](Vec a) { return a * Vec(sum); }, p, p, experts);
        // torch.topk: the largest first (ties to the lower expert id)
        std::vector<bool> taken(experts, false);
        for (int64_t j = 0; j < top_k; ++j) {
          int64_t best = -1;
          for (int64_t e = 0; e < experts; ++e)
            if (!taken[e] && (best < 0 || p[e] > p[best] || (std::isnan(p[e]) && !std::isnan(p[best])))) best = e;
          taken[best] = true;
          ids[t * top_k + j] = best;
          weights[t * top_k + j] = p[best];
        }
        if (l.norm_topk) {
          float* w = weights.data() + t * top_k;
          const float total = torch_row_sum(w, top_k);
          for (int64_t j = 0; j < top_k; ++j) w[j] = w[j] / total;
        }
      }
    }
    watch.lap(kNorms);
    torch::Tensor out = torch::zeros({n, hidden_}, x.options());
    float* outp = out.data_ptr<float>();
    const float* xp = x.data_ptr<float>();
    std::vector<int64_t> rows;
    std::vector<float> row_weights;
    for (int64_t e = 0; e < experts; ++e) {
      rows.clear();
      row_weights.clear();
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < top_k; ++j)
          if (ids[t * top_k + j] == e) {
            rows.push_back(t);
            row_weights.push_back(weights[t * top_k + j]);
          }
      if (rows.empty()) continue;
      const int64_t m = static_cast<int64_t>(rows.size());
      torch::Tensor xe = torch::empty({m, hidden_}, x.options());
      for (int64_t i = 0; i < m; ++i)
        std::memcpy(xe.data_ptr<float>() + i * hidden_, xp + rows[i] * hidden_, hidden_ * sizeof(float));
      const torch::Tensor act =
          gated_act(panel_linear(xe, l.expert_gate_up[e], c10::nullopt, 2 * l.moe_intermediate), false);
      const torch::Tensor y = panel_linear(act, l.expert_down[e], c10::nullopt, hidden_);
      const float* yp = y.data_ptr<float>();
      for (int64_t i = 0; i < m; ++i) {
        float* o = outp + rows[i] * hidden_;
        const float* yr = yp + i * hidden_;
        const float w = row_weights[i];
        for (int64_t c = 0; c < hidden_; ++c) {
          float v = yr[c] * w;
          BATON_ROUNDED(v);
          o[c] = o[c] + v;
        }
      }
    }
    watch.lap(kExperts);
    if (l.shared_gate_up.defined()) {
      const torch::Tensor act =
          gated_act(panel_linear(x, l.shared_gate_up, c10::nullopt, 2 * l.shared_intermediate), false);
      const torch::Tensor shared = panel_linear(act, l.shared_down, c10::nullopt, hidden_);
      const float* sp = shared.data_ptr<float>();
      if (l.shared_gate.defined()) {
        torch::Tensor gate = panel_linear(x, l.shared_gate, c10::nullopt, 1);
        float* gp = gate.data_ptr<float>();
        torch_unary(gp, gp, n, 1, true, Sigmoid());
        for (int64_t t = 0; t < n; ++t)
          for (int64_t c = 0; c < hidden_; ++c) {
            float v = gp[t] * sp[t * hidden_ + c];
            BATON_ROUNDED(v);
            outp[t * hidden_ + c] = outp[t * hidden_ + c] + v;
          }
      } else {
        for (int64_t i = 0; i < n * hidden_; ++i) outp[i] = outp[i] + sp[i];
      }
      watch.lap(kExperts);
    }
    return out;
  }

  // Everything a step reads is checked before its first layer runs: bad metadata is an error
  // before any KV or state is written.
  void check_step(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                  const std::vector<torch::Tensor>& slot_mapping, const std::vector<torch::Tensor>& block_ids,
                  const std::vector<torch::Tensor>& kv_offsets, const std::vector<torch::Tensor>& kv_lens,
                  int64_t block_size, const std::vector<int64_t>& state_slots,
                  const std::vector<int64_t>& snapshot_rows, const std::vector<int64_t>& snapshot_offsets,
                  const std::vector<int64_t>& snapshot_ids) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "x must be float32 [rows, hidden=", hidden_, "] on the CPU, got ", x.scalar_type(), " ", x.sizes());
    TORCH_CHECK(block_size >= 1, "block_size must be at least 1, got ", block_size);
    for (size_t l = 0; l < layers_.size(); ++l)
      TORCH_CHECK(layers_[l].has_mlp, "layer ", l, " has no MLP");
    const int64_t n = x.size(0);
    for (const torch::Tensor* t : {&cos, &sin})
      TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == rotary_dim_ && t->scalar_type() == at::kFloat &&
                      t->stride(1) == 1 && t->device().is_cpu(),
                  "cos and sin must be float32 [rows=", n, ", rotary dim=", rotary_dim_, "], got ", t->scalar_type(),
                  " ", t->sizes());
    const size_t groups = slot_mapping.size();
    TORCH_CHECK(block_ids.size() == groups && kv_offsets.size() == groups && kv_lens.size() == groups,
                "one block table, offset and length per KV group");
    for (size_t i = 0; i < layers_.size(); ++i)
      TORCH_CHECK(layers_[i].recurrent || layers_[i].group < static_cast<int64_t>(groups), "layer ", i,
                  " reads a KV group that was not given");
    for (size_t g = 0; g < std::min(groups, group_slots_.size()); ++g) {
      if (group_slots_[g] == std::numeric_limits<int64_t>::max()) continue;  // no layer reads it
      const torch::Tensor& slots = slot_mapping[g];
      TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n &&
                      slots.device().is_cpu(),
                  "slot_mapping must be contiguous int64 [rows=", n, "], got ", slots.scalar_type(), " ",
                  slots.sizes());
      const int64_t* slot = slots.data_ptr<int64_t>();
      for (int64_t t = 0; t < n; ++t)
        TORCH_CHECK(slot[t] >= 0 && slot[t] < group_slots_[g], "slot_mapping[", g, "][", t, "] = ", slot[t],
                    " is outside the KV cache's ", group_slots_[g], " slots");
      check_decode_context(block_ids[g], kv_offsets[g], kv_lens[g], n, block_size, group_slots_[g] / block_size);
    }
    const bool any_recurrent = std::any_of(layers_.begin(), layers_.end(), [](const HybridLayer& l) { return l.recurrent; });
    if (!any_recurrent) return;
    TORCH_CHECK(static_cast<int64_t>(state_slots.size()) == n, "one state slot per row: ", state_slots.size(),
                " for ", n, " rows");
    std::vector<int64_t> seen(state_slots);
    std::sort(seen.begin(), seen.end());
    TORCH_CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end(), "two rows share a state slot");
    for (int64_t t = 0; t < n; ++t)
      TORCH_CHECK(state_slots[t] >= 0 && state_slots[t] < num_state_slots_, "state slot ", state_slots[t], " of row ",
                  t, " is outside the ", num_state_slots_, " slots");
    TORCH_CHECK(snapshot_rows.size() == snapshot_offsets.size() && snapshot_rows.size() == snapshot_ids.size(),
                "one row, offset and checkpoint id per snapshot");
    for (size_t i = 0; i < snapshot_rows.size(); ++i) {
      TORCH_CHECK(snapshot_rows[i] >= 0 && snapshot_rows[i] < n, "snapshot row ", snapshot_rows[i],
                  " is outside the ", n, " rows");
      TORCH_CHECK(snapshot_offsets[i] == 0 || snapshot_offsets[i] == 1, "a decode row's snapshot is 0 or 1 rows in, got ",
                  snapshot_offsets[i]);
      TORCH_CHECK(snapshot_ids[i] >= 0 && snapshot_ids[i] < num_checkpoints_, "checkpoint ", snapshot_ids[i],
                  " is outside the ", num_checkpoints_, " checkpoints");
    }
  }

  int64_t hidden_;
  double eps_, offset_;
  torch::Tensor final_norm_;
  int64_t num_heads_, num_kv_heads_, head_dim_, rotary_dim_;
  double scale_;
  int64_t kh_, vh_, dk_, dv_, conv_kernel_;
  std::vector<HybridLayer> layers_;
  int64_t num_state_slots_ = std::numeric_limits<int64_t>::max();
  int64_t num_checkpoints_ = std::numeric_limits<int64_t>::max();
  bool profiling_ = false;
  std::array<double, kNumParts> seconds_{};
  std::vector<int64_t> group_slots_;  // per KV group, the fewest slots of its layers' caches
  mutable std::mutex mu_;
};

void bind_fused_hybrid_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<FusedHybridDecoder>(m, "FusedHybridDecoder")
      .def(py::init<int64_t, double, double, torch::Tensor, int64_t, int64_t, int64_t, int64_t, double, int64_t,
                    int64_t, int64_t, int64_t, int64_t>(),
           py::arg("hidden"), py::arg("eps"), py::arg("norm_offset"), py::arg("final_norm"), py::arg("num_heads"),
           py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("rotary_dim"), py::arg("scale"),
           py::arg("key_heads"), py::arg("value_heads"), py::arg("key_dim"), py::arg("value_dim"),
           py::arg("conv_kernel"))
      .def("add_attention_layer", &FusedHybridDecoder::add_attention_layer, py::arg("input_norm"),
           py::arg("post_attn_norm"), py::arg("q_proj"), py::arg("q_bias"), py::arg("k_proj"), py::arg("k_bias"),
           py::arg("v_proj"), py::arg("v_bias"), py::arg("o_proj"), py::arg("o_bias"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("k_cache"), py::arg("v_cache"), py::arg("group"), release())
      .def("add_recurrent_layer", &FusedHybridDecoder::add_recurrent_layer, py::arg("input_norm"),
           py::arg("post_attn_norm"), py::arg("qkvz"), py::arg("ba"), py::arg("out_proj"), py::arg("conv_weight"),
           py::arg("neg_exp_a"), py::arg("dt_bias"), py::arg("norm_weight"), py::arg("norm_eps"),
           py::arg("conv_state"), py::arg("rec_state"), py::arg("conv_checkpoints"), py::arg("rec_checkpoints"),
           release())
      .def("set_dense_mlp", &FusedHybridDecoder::set_dense_mlp, py::arg("gate_up"), py::arg("down"),
           py::arg("intermediate"), release())
      .def("set_moe", &FusedHybridDecoder::set_moe, py::arg("router"), py::arg("top_k"), py::arg("norm_topk_prob"),
           py::arg("expert_gate_up"), py::arg("expert_down"), py::arg("moe_intermediate"), py::arg("shared_gate_up"),
           py::arg("shared_down"), py::arg("shared_intermediate"), py::arg("shared_gate"), release())
      .def("forward", &FusedHybridDecoder::forward, py::arg("x"), py::arg("cos"), py::arg("sin"),
           py::arg("slot_mapping"), py::arg("block_ids"), py::arg("kv_offsets"), py::arg("kv_lens"),
           py::arg("block_size"), py::arg("state_slots"), py::arg("snapshot_rows"), py::arg("snapshot_offsets"),
           py::arg("snapshot_ids"), release())
      .def("set_profiling", &FusedHybridDecoder::set_profiling, release())
      .def("profile", &FusedHybridDecoder::profile, release());
}
