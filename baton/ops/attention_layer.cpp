// Attention as a layer step of the fused decoder (fused_decoder.h): the qkv projection (stacked
// by rows from its parts), optional q/k norm, rotary, the KV write (float32, float16, bfloat16 or
// fp8 with per-(block, head) scales), paged decode attention, an optional output gate, o_proj.
// Its options follow the module paths it replays kernel for kernel: baton/models/llama.py's
// Attention (rotary over q and k heads in one pass) and qwen3_next.py's gated attention (q_proj
// gives each head its query and gate; partial rotary as separate torch ops; out * sigmoid(gate)).
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "fused_decoder.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstring>

namespace {

// Partial rotary in place over x [rows, heads, D] (any strides but the last): the first rot dims
// of every head become x * cos + rotate_half(x) * sin with the sign folded into sin; the products
// are rounded before the add, as a module path's separate torch ops do.
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

// How a module path applies rotary: baton's rotary_ op over whole heads, or separate torch ops
// over the first rotary_dim channels (products rounded before the add)
enum class Rotary { kFused = 0, kTorchOps = 1 };

class AttentionStep : public LayerStep {
 public:
  struct Options {
    int64_t rope = 0;         // the rope kind whose cos / sin it reads
    int64_t rotary_dim = 0;   // channels of a head that rotate (the head dim: all)
    Rotary rotary = Rotary::kFused;
    bool output_gate = false;  // q's rows hold each head's query then its gate
  };
  struct Weights {
    std::vector<torch::Tensor> qkv;  // packed panels or GGUF blocks, stacked by rows in parts
    std::vector<int64_t> qkv_rows;
    c10::optional<torch::Tensor> qkv_bias;
    NormWeights q_norm, k_norm;  // undefined weights: none
    torch::Tensor o;
    c10::optional<torch::Tensor> o_bias;
  };
  struct Cache {
    torch::Tensor k, v;                    // [slots, kv heads, head dim]
    c10::optional<torch::Tensor> k_scale, v_scale;  // an fp8 cache's, [blocks, kv heads]
    int64_t group = 0;                     // the KV group whose metadata it reads
  };

  AttentionStep(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden, double scale,
                Options options, Weights w, Cache cache)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), hidden_(hidden), scale_(scale),
        opt_(options), w_(std::move(w)), cache_(std::move(cache)) {
    TORCH_CHECK(num_heads_ >= 1 && num_kv_heads_ >= 1 && num_heads_ % num_kv_heads_ == 0 && head_dim_ >= 2 &&
                    head_dim_ % 2 == 0,
                "attention needs heads a multiple of kv heads and an even head dim, got ", num_heads_, " / ",
                num_kv_heads_, " heads of ", head_dim_);
    TORCH_CHECK(opt_.rope >= 0, "rope must be an index, got ", opt_.rope);
    TORCH_CHECK(opt_.rotary_dim >= 0 && opt_.rotary_dim <= head_dim_ && opt_.rotary_dim % 2 == 0,
                "rotary_dim must be even and at most head_dim, got ", opt_.rotary_dim);
    TORCH_CHECK(opt_.rotary == Rotary::kTorchOps || opt_.rotary_dim == head_dim_,
                "baton's rotary op turns whole heads: rotary_dim must be head_dim");
    TORCH_CHECK(w_.qkv.size() == w_.qkv_rows.size() && !w_.qkv.empty(), "one row count per qkv part");
    TORCH_CHECK(w_.q_norm.weight.defined() == w_.k_norm.weight.defined(), "q/k norms come in pairs");
    if (w_.q_norm.weight.defined()) {
      check_vector(w_.q_norm.weight, head_dim_, "q_norm");
      check_vector(w_.k_norm.weight, head_dim_, "k_norm");
    }
    const torch::Tensor& k = cache_.k;
    const bool fp8 = k.scalar_type() == at::kFloat8_e4m3fn;
    const auto kv_type = k.scalar_type();
    TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16 || fp8) &&
                    cache_.v.scalar_type() == kv_type,
                "KV cache must be float32, float16, bfloat16 or fp8 (float8_e4m3fn)");
    TORCH_CHECK(cache_.k_scale.has_value() == fp8 && cache_.v_scale.has_value() == fp8,
                "an fp8 KV cache, and only one, has scales");
    TORCH_CHECK(k.device().is_cpu() && cache_.v.device().is_cpu(), "KV cache must be on the CPU");
    TORCH_CHECK(k.dim() == 3 && k.size(1) == num_kv_heads_ && k.size(2) == head_dim_ && k.stride(2) == 1 &&
                    k.sizes() == cache_.v.sizes() && cache_.v.stride(2) == 1,
                "KV cache must be [slots, kv heads, head dim]");
    TORCH_CHECK(cache_.group >= 0, "group must be an index, got ", cache_.group);
  }

  StepNeeds needs() const override {
    StepNeeds n;
    if (opt_.rotary_dim > 0) {
      n.rope = opt_.rope;
      n.rope_dim = opt_.rotary_dim;
    }
    n.kv_group = cache_.group;
    n.kv_slots = cache_.k.size(0);
    return n;
  }

  void check_step(const StepBatch& step) const override {
    if (!cache_.k_scale.has_value()) return;
    check_kv_scales(cache_.k, *cache_.k_scale, step.block_size);
    check_kv_scales(cache_.v, *cache_.v_scale, step.block_size);
  }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const int64_t n = h.size(0), d = head_dim_, q_size = num_heads_ * d, kv_size = num_kv_heads_ * d;
    const int64_t q_width = opt_.output_gate ? 2 * q_size : q_size;
    const torch::Tensor qkv = stacked_linear(h, w_.qkv, w_.qkv_rows, w_.qkv_bias, q_width + 2 * kv_size);
    watch.lap(StepPart::kLinears);
    torch::Tensor q, k, qk, gate;
    if (opt_.output_gate) {  // the query halves as a contiguous [n, heads, d], the gate halves as [n, heads * d]
      q = torch::empty({n, num_heads_, d}, h.options());
      gate = torch::empty({n, q_size}, h.options());
      const float* src = qkv.data_ptr<float>();
      float* qp = q.data_ptr<float>();
      float* gp = gate.data_ptr<float>();
      const int64_t row = qkv.stride(0);
      for (int64_t t = 0; t < n; ++t)
        for (int64_t hd = 0; hd < num_heads_; ++hd) {
          const float* s = src + t * row + hd * 2 * d;
          std::memcpy(qp + (t * num_heads_ + hd) * d, s, d * sizeof(float));
          std::memcpy(gp + t * q_size + hd * d, s + d, d * sizeof(float));
        }
      k = qkv.narrow(1, q_width, kv_size).view({n, num_kv_heads_, d});
    } else {
      qk = qkv.narrow(1, 0, q_size + kv_size).view({n, num_heads_ + num_kv_heads_, d});
      q = qk.narrow(1, 0, num_heads_);
      k = qk.narrow(1, num_heads_, num_kv_heads_);
    }
    const torch::Tensor v = qkv.narrow(1, q_width + kv_size, kv_size).view({n, num_kv_heads_, d});
    if (w_.q_norm.weight.defined()) {
      rms_norm_heads_(q, w_.q_norm.weight, w_.q_norm.eps, w_.q_norm.offset);
      rms_norm_heads_(k, w_.k_norm.weight, w_.k_norm.eps, w_.k_norm.offset);
    }
    if (opt_.rotary_dim > 0) {
      const torch::Tensor& cos = step.cos[opt_.rope];
      const torch::Tensor& sin = step.sin[opt_.rope];
      if (opt_.rotary == Rotary::kTorchOps) {
        partial_rotary_(q, cos, sin);
        partial_rotary_(k, cos, sin);
      } else if (qk.defined()) {
        rotary_(qk, cos, sin);  // q and k heads in one pass
      } else {
        rotary_(q, cos, sin);
        rotary_(k, cos, sin);
      }
    }
    if (gate.defined()) {  // torch.sigmoid(gate): gate's rows are apart in the module path where a head is alone
      float* gp = gate.data_ptr<float>();
      torch_unary(gp, gp, n, q_size, num_heads_ > 1, Sigmoid());
    }
    watch.lap(StepPart::kNorms);
    const int64_t g = cache_.group;
    if (cache_.k_scale.has_value()) {
      write_kv_fp8(k, cache_.k, *cache_.k_scale, step.slot_mapping[g], step.block_size, false);
      write_kv_fp8(v, cache_.v, *cache_.v_scale, step.slot_mapping[g], step.block_size, false);
    } else {
      write_kv(k, cache_.k, step.slot_mapping[g]);
      write_kv(v, cache_.v, step.slot_mapping[g]);
    }
    torch::Tensor attn =
        paged_decode_attention_checked_context(q, cache_.k, cache_.v, step.block_ids[g], step.kv_offsets[g],
                                               step.kv_lens[g], step.block_size, scale_, cache_.k_scale, cache_.v_scale);
    watch.lap(StepPart::kAttention);
    attn = attn.view({n, q_size});
    if (gate.defined()) {
      attn = attn.mul(gate);  // exact products, any order
      watch.lap(StepPart::kNorms);
    }
    torch::Tensor o = packed_linear(attn, w_.o, w_.o_bias, hidden_);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_;
  double scale_;
  Options opt_;
  Weights w_;
  Cache cache_;
};

}  // namespace

void bind_attention_layer(pybind11::module_& m) {
  namespace py = pybind11;
  py::class_<AttentionStep, LayerStep, std::shared_ptr<AttentionStep>>(m, "AttentionStep")
      .def(py::init([](int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden, double scale,
                       int64_t rope, int64_t rotary_dim, bool torch_rotary, bool output_gate,
                       std::vector<torch::Tensor> qkv, std::vector<int64_t> qkv_rows,
                       c10::optional<torch::Tensor> qkv_bias, NormWeights q_norm, NormWeights k_norm, torch::Tensor o,
                       c10::optional<torch::Tensor> o_bias, torch::Tensor k_cache, torch::Tensor v_cache,
                       c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale, int64_t group) {
             return std::make_shared<AttentionStep>(
                 num_heads, num_kv_heads, head_dim, hidden, scale,
                 AttentionStep::Options{rope, rotary_dim, torch_rotary ? Rotary::kTorchOps : Rotary::kFused,
                                        output_gate},
                 AttentionStep::Weights{std::move(qkv), std::move(qkv_rows), std::move(qkv_bias), std::move(q_norm),
                                        std::move(k_norm), std::move(o), std::move(o_bias)},
                 AttentionStep::Cache{std::move(k_cache), std::move(v_cache), std::move(k_scale), std::move(v_scale),
                                      group});
           }),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("hidden"), py::arg("scale"),
           py::arg("rope"), py::arg("rotary_dim"), py::arg("torch_rotary") = false, py::arg("output_gate") = false,
           py::arg("qkv"), py::arg("qkv_rows"), py::arg("qkv_bias"), py::arg("q_norm"),
           py::arg("k_norm"), py::arg("o"), py::arg("o_bias"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("k_scale"), py::arg("v_scale"), py::arg("group"));
}
