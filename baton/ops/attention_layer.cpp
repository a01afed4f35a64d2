// Attention as a layer step of the fused decoder (fused_decoder.h): the qkv projection (stacked
// by rows from its parts), optional q/k norm, rotary, the KV write (float32, float16, bfloat16 or
// fp8 with per-(block, head) scales), paged decode attention, an optional output gate, o_proj.
// Its options follow the module paths it replays kernel for kernel: baton/models/llama.py's
// Attention (rotary over q and k heads in one pass) and qwen3_next.py's gated attention (q_proj
// gives each head its query and gate; partial rotary as separate torch ops; out * sigmoid(gate)).
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "step_common.h"

#include <cstring>
#include <utility>

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

class AttentionStep : public LayerStep {
 public:
  explicit AttentionStep(StepArgs& a)
      : num_heads_(a.integer("num_heads")), num_kv_heads_(a.integer("num_kv_heads")), head_dim_(a.integer("head_dim")),
        hidden_(a.integer("hidden")), scale_(a.real("scale")), rope_(a.integer("rope")),
        rotary_dim_(a.integer("rotary_dim")), torch_rotary_(a.flag("torch_rotary")),
        output_gate_(a.flag("output_gate")), qkv_(a.tensors("qkv")), qkv_rows_(a.integers("qkv_rows")),
        q_norm_(a.norm("q_norm")), k_norm_(a.norm("k_norm")), k_cache_(a.tensor("k_cache")),
        v_cache_(a.tensor("v_cache")), group_(a.integer("group")) {
    for (auto [name, scale] : {std::pair{"k_scale", &k_scale_}, std::pair{"v_scale", &v_scale_}})
      if (torch::Tensor t = a.tensor(name); t.defined()) *scale = std::move(t);
    TORCH_CHECK(num_heads_ >= 1 && num_kv_heads_ >= 1 && num_heads_ % num_kv_heads_ == 0 && head_dim_ >= 2 &&
                    head_dim_ % 2 == 0,
                "attention needs heads a multiple of kv heads and an even head dim, got ", num_heads_, " / ",
                num_kv_heads_, " heads of ", head_dim_);
    TORCH_CHECK(rope_ >= 0, "rope must be an index, got ", rope_);
    TORCH_CHECK(rotary_dim_ >= 0 && rotary_dim_ <= head_dim_ && rotary_dim_ % 2 == 0,
                "rotary_dim must be even and at most head_dim, got ", rotary_dim_);
    TORCH_CHECK(torch_rotary_ || rotary_dim_ == head_dim_,
                "baton's rotary op turns whole heads: rotary_dim must be head_dim");
    TORCH_CHECK(qkv_.size() == qkv_rows_.size() && !qkv_.empty(), "one row count per qkv part");
    const int64_t qkv_width = (output_gate_ ? 2 : 1) * num_heads_ * head_dim_ + 2 * num_kv_heads_ * head_dim_;
    const torch::Tensor bias = a.tensor("qkv_bias");
    if (bias.defined()) {
      check_vector(bias, qkv_width, "qkv_bias");
      qkv_bias_ = bias;
    }
    o_ = a.linear("o", num_heads_ * head_dim_, hidden_);
    TORCH_CHECK(q_norm_.weight.defined() == k_norm_.weight.defined(), "q/k norms come in pairs");
    if (q_norm_.weight.defined()) {
      check_vector(q_norm_.weight, head_dim_, "q_norm");
      check_vector(k_norm_.weight, head_dim_, "k_norm");
    }
    const auto kv_type = k_cache_.defined() ? k_cache_.scalar_type() : at::kFloat;
    const bool fp8 = kv_type == at::kFloat8_e4m3fn;
    TORCH_CHECK(k_cache_.defined() && v_cache_.defined() &&
                    (kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16 || fp8) &&
                    v_cache_.scalar_type() == kv_type,
                "KV cache must be float32, float16, bfloat16 or fp8 (float8_e4m3fn)");
    TORCH_CHECK(k_scale_.has_value() == fp8 && v_scale_.has_value() == fp8, "an fp8 KV cache, and only one, has scales");
    TORCH_CHECK(k_cache_.device().is_cpu() && v_cache_.device().is_cpu(), "KV cache must be on the CPU");
    TORCH_CHECK(k_cache_.dim() == 3 && k_cache_.size(1) == num_kv_heads_ && k_cache_.size(2) == head_dim_ &&
                    k_cache_.stride(2) == 1 && k_cache_.sizes() == v_cache_.sizes() && v_cache_.stride(2) == 1,
                "KV cache must be [slots, kv heads, head dim]");
    TORCH_CHECK(group_ >= 0, "group must be an index, got ", group_);
  }

  StepNeeds needs() const override {
    StepNeeds n;
    if (rotary_dim_ > 0) {
      n.rope = rope_;
      n.rope_dim = rotary_dim_;
    }
    n.kv_group = group_;
    n.kv_slots = k_cache_.size(0);
    return n;
  }

  void check_step(const StepBatch& step) const override {
    if (!k_scale_) return;
    check_kv_scales(k_cache_, *k_scale_, step.block_size);
    check_kv_scales(v_cache_, *v_scale_, step.block_size);
  }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const int64_t n = h.size(0), d = head_dim_, q_size = num_heads_ * d, kv_size = num_kv_heads_ * d;
    const int64_t q_width = output_gate_ ? 2 * q_size : q_size;
    const torch::Tensor qkv = stacked_linear(h, qkv_, qkv_rows_, qkv_bias_, q_width + 2 * kv_size);
    watch.lap(StepPart::kLinears);
    torch::Tensor q, k, qk, gate;
    if (output_gate_) {  // the query halves as a contiguous [n, heads, d], the gate halves as [n, heads * d]
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
    if (q_norm_.weight.defined()) {
      rms_norm_heads_(q, q_norm_.weight, q_norm_.eps, q_norm_.offset);
      rms_norm_heads_(k, k_norm_.weight, k_norm_.eps, k_norm_.offset);
    }
    if (rotary_dim_ > 0) {
      const torch::Tensor& cos = step.cos[rope_];
      const torch::Tensor& sin = step.sin[rope_];
      if (torch_rotary_) {
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
      vec_unary(gp, gp, n * q_size, Sigmoid());
    }
    watch.lap(StepPart::kNorms);
    const int64_t g = group_;
    if (k_scale_) {
      write_kv_fp8(k, k_cache_, *k_scale_, step.slot_mapping[g], step.block_size, false);
      write_kv_fp8(v, v_cache_, *v_scale_, step.slot_mapping[g], step.block_size, false);
    } else {
      write_kv(k, k_cache_, step.slot_mapping[g]);
      write_kv(v, v_cache_, step.slot_mapping[g]);
    }
    torch::Tensor attn = paged_decode_attention_checked_context(q, k_cache_, v_cache_, step.block_ids[g],
                                                                step.kv_offsets[g], step.kv_lens[g], step.block_size,
                                                                scale_, k_scale_, v_scale_);
    watch.lap(StepPart::kAttention);
    attn = attn.view({n, q_size});
    if (gate.defined()) {
      attn = attn.mul(gate);  // exact products, any order
      watch.lap(StepPart::kNorms);
    }
    torch::Tensor o = o_(attn);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_;
  double scale_;
  int64_t rope_;          // the rope kind whose cos / sin it reads
  int64_t rotary_dim_;    // channels of a head that rotate (the head dim: all; 0: no rotary)
  bool torch_rotary_;     // rotary as separate torch ops over rotary_dim, not baton's op over whole heads
  bool output_gate_;      // q's rows hold each head's query then its gate
  std::vector<torch::Tensor> qkv_;  // packed panels or GGUF blocks, stacked by rows in parts
  std::vector<int64_t> qkv_rows_;
  c10::optional<torch::Tensor> qkv_bias_;
  NormWeights q_norm_, k_norm_;  // undefined weights: none
  StepLinear o_;
  torch::Tensor k_cache_, v_cache_;  // [slots, kv heads, head dim]
  int64_t group_;                    // the KV group whose metadata it reads
  c10::optional<torch::Tensor> k_scale_, v_scale_;  // an fp8 cache's, [blocks, kv heads]
};

}  // namespace

void bind_attention_layer(pybind11::module_& m) { bind_step<AttentionStep>(m, "AttentionStep"); }
