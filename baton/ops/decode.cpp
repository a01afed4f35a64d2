// A decode step of a Llama-family model (Llama, Mistral, Qwen2/3, Gemma3) in one call: every
// layer's norms, packed linears, rotary, KV write and paged attention run back to back in C++.
// Through Python each layer is ~25 module calls, views and torch ops at 2-5 us each, ~5 ms of a
// 20 ms SmolLM2 step at one sequence; here a layer costs its kernels. The kernels are the ones
// the Python path calls, in the same order, so a row's bits are the same on either path.
#include "all_reduce_hook.h"
#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // Tensor <-> Python for the bindings below

#include <array>
#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace {

struct DecodeLayer {
  torch::Tensor input_norm, post_attn_norm;
  torch::Tensor pre_ff_norm, post_ff_norm;  // Gemma's sandwich norms; undefined for Llama
  torch::Tensor q_norm, k_norm;             // undefined without q/k norm
  torch::Tensor o, down;                    // packed panels (pack_weight_panels) or GGUF blocks
  std::vector<torch::Tensor> qkv, gate_up;  // the same, stacked by rows in parts (stacked_linear)
  std::vector<int64_t> qkv_rows, gate_up_rows;
  c10::optional<torch::Tensor> qkv_bias, o_bias;
  torch::Tensor k_cache, v_cache;  // [slots, kv heads, head dim] views of this layer's KV
  c10::optional<torch::Tensor> k_scale, v_scale;  // an fp8 cache's scales, [blocks, kv heads]
  int64_t rope = 0, group = 0;     // which cos/sin pair and which KV group's metadata it reads
};

// The parts of a step that profiling times, and their names in profile()
enum Part { kNorms, kLinears, kAttention, kAllReduce, kNumParts };
constexpr const char* kPartNames[kNumParts] = {"norms, rotary, activation", "linears", "attention (KV write, kernel)",
                                               "all-reduce (tensor parallel)"};

// With totals given, lap(part) adds the time since the last lap (or the start) to totals[part];
// without, it does nothing.
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

}  // namespace

// forward runs without the GIL: mu_ keeps calls from two Python threads apart, as the GIL did.
class FusedDecoder {
 public:
  FusedDecoder(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t hidden, int64_t intermediate,
               double eps, double norm_offset, double scale, bool gelu_tanh, c10::optional<torch::Tensor> final_norm)
      : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), hidden_(hidden),
        intermediate_(intermediate), eps_(eps), offset_(norm_offset), scale_(scale), gelu_tanh_(gelu_tanh),
        final_norm_(final_norm.value_or(torch::Tensor())) {}

  void add_layer(torch::Tensor input_norm, torch::Tensor post_attn_norm, c10::optional<torch::Tensor> pre_ff_norm,
                 c10::optional<torch::Tensor> post_ff_norm, c10::optional<torch::Tensor> q_norm,
                 c10::optional<torch::Tensor> k_norm, std::vector<torch::Tensor> qkv, std::vector<int64_t> qkv_rows,
                 c10::optional<torch::Tensor> qkv_bias, torch::Tensor o, c10::optional<torch::Tensor> o_bias,
                 std::vector<torch::Tensor> gate_up, std::vector<int64_t> gate_up_rows, torch::Tensor down,
                 torch::Tensor k_cache, torch::Tensor v_cache, int64_t rope, int64_t group,
                 c10::optional<torch::Tensor> k_scale, c10::optional<torch::Tensor> v_scale) {
    const bool fp8 = k_cache.scalar_type() == at::kFloat8_e4m3fn;
    const auto kv_type = k_cache.scalar_type();
    TORCH_CHECK((kv_type == at::kFloat || kv_type == at::kHalf || kv_type == at::kBFloat16 || fp8) &&
                    v_cache.scalar_type() == kv_type,
                "KV cache must be float32, float16, bfloat16 or fp8 (float8_e4m3fn)");
    TORCH_CHECK(k_scale.has_value() == fp8 && v_scale.has_value() == fp8, "an fp8 KV cache, and only one, has scales");
    TORCH_CHECK(k_cache.device().is_cpu() && v_cache.device().is_cpu(), "KV cache must be on the CPU");
    TORCH_CHECK(k_cache.dim() == 3 && k_cache.size(1) == num_kv_heads_ && k_cache.size(2) == head_dim_ &&
                    k_cache.stride(2) == 1 && k_cache.sizes() == v_cache.sizes(),
                "KV cache must be [slots, kv heads, head dim]");
    TORCH_CHECK(pre_ff_norm.has_value() == post_ff_norm.has_value(), "sandwich norms come in pairs");
    TORCH_CHECK(q_norm.has_value() == k_norm.has_value(), "q/k norms come in pairs");
    TORCH_CHECK(rope >= 0 && group >= 0, "rope ", rope, " and group ", group, " must be indices");
    std::lock_guard<std::mutex> lock(mu_);
    if (static_cast<size_t>(group) >= group_slots_.size())
      group_slots_.resize(group + 1, std::numeric_limits<int64_t>::max());
    group_slots_[group] = std::min(group_slots_[group], k_cache.size(0));
    DecodeLayer l;
    l.input_norm = std::move(input_norm);
    l.post_attn_norm = std::move(post_attn_norm);
    l.pre_ff_norm = pre_ff_norm.value_or(torch::Tensor());
    l.post_ff_norm = post_ff_norm.value_or(torch::Tensor());
    l.q_norm = q_norm.value_or(torch::Tensor());
    l.k_norm = k_norm.value_or(torch::Tensor());
    l.qkv = std::move(qkv);
    l.qkv_rows = std::move(qkv_rows);
    l.qkv_bias = std::move(qkv_bias);
    l.o = std::move(o);
    l.o_bias = std::move(o_bias);
    l.gate_up = std::move(gate_up);
    l.gate_up_rows = std::move(gate_up_rows);
    l.down = std::move(down);
    l.k_cache = std::move(k_cache);
    l.v_cache = std::move(v_cache);
    l.k_scale = std::move(k_scale);
    l.v_scale = std::move(v_scale);
    l.rope = rope;
    l.group = group;
    layers_.push_back(std::move(l));
  }

  // x: the embedded tokens [rows, hidden], one decode token per row. Per rope kind its cos and
  // signed sin [rows, head dim]; per KV group the slot each row's K/V goes to and the blocks,
  // first offset and length each row reads (GroupAttnMetadata). Returns the final-normed hidden.
  torch::Tensor forward(const torch::Tensor& x_in, const std::vector<torch::Tensor>& cos,
                        const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& slot_mapping,
                        const std::vector<torch::Tensor>& block_ids, const std::vector<torch::Tensor>& kv_offsets,
                        const std::vector<torch::Tensor>& kv_lens, int64_t block_size) {
    std::lock_guard<std::mutex> lock(mu_);
    check_step(x_in, cos, sin, slot_mapping, block_ids, kv_offsets, kv_lens, block_size);
    const int64_t n = x_in.size(0);
    const int64_t q_size = num_heads_ * head_dim_, kv_size = num_kv_heads_ * head_dim_;
    torch::Tensor residual = x_in.contiguous().clone(), x;
    Stopwatch watch(profiling_ ? seconds_.data() : nullptr);
    for (size_t i = 0; i < layers_.size(); ++i) {
      DecodeLayer& l = layers_[i];
      const torch::Tensor h = i == 0 ? rms_norm(residual, c10::nullopt, l.input_norm, eps_, offset_)
                                     : rms_norm(x, residual, l.input_norm, eps_, offset_);
      watch.lap(kNorms);
      const torch::Tensor qkv = stacked_linear(h, l.qkv, l.qkv_rows, l.qkv_bias, q_size + 2 * kv_size);
      watch.lap(kLinears);
      torch::Tensor qk = qkv.narrow(1, 0, q_size + kv_size).view({n, num_heads_ + num_kv_heads_, head_dim_});
      torch::Tensor q = qk.narrow(1, 0, num_heads_), k = qk.narrow(1, num_heads_, num_kv_heads_);
      const torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({n, num_kv_heads_, head_dim_});
      if (l.q_norm.defined()) {
        rms_norm_heads_(q, l.q_norm, eps_, offset_);
        rms_norm_heads_(k, l.k_norm, eps_, offset_);
      }
      rotary_(qk, cos[l.rope], sin[l.rope]);
      watch.lap(kNorms);
      if (l.k_scale.has_value()) {
        write_kv_fp8(k, l.k_cache, *l.k_scale, slot_mapping[l.group], block_size, false);
        write_kv_fp8(v, l.v_cache, *l.v_scale, slot_mapping[l.group], block_size, false);
      } else {
        write_kv(k, l.k_cache, slot_mapping[l.group]);
        write_kv(v, l.v_cache, slot_mapping[l.group]);
      }
      const torch::Tensor attn =
          paged_decode_attention_checked_context(q, l.k_cache, l.v_cache, block_ids[l.group], kv_offsets[l.group],
                                                 kv_lens[l.group], block_size, scale_, l.k_scale, l.v_scale);
      watch.lap(kAttention);
      const torch::Tensor o = packed_linear(attn.view({n, q_size}), l.o, l.o_bias, hidden_);
      watch.lap(kLinears);
      all_reduce_(o);
      watch.lap(kAllReduce);
      const torch::Tensor mlp_in =
          l.pre_ff_norm.defined()
              ? rms_norm(rms_norm(o, c10::nullopt, l.post_attn_norm, eps_, offset_), residual, l.pre_ff_norm, eps_,
                         offset_)
              : rms_norm(o, residual, l.post_attn_norm, eps_, offset_);
      watch.lap(kNorms);
      const torch::Tensor gate_up = stacked_linear(mlp_in, l.gate_up, l.gate_up_rows, c10::nullopt, 2 * intermediate_);
      watch.lap(kLinears);
      const torch::Tensor act = gated_act(gate_up, gelu_tanh_);
      watch.lap(kNorms);
      x = packed_linear(act, l.down, c10::nullopt, hidden_);
      watch.lap(kLinears);
      all_reduce_(x);
      watch.lap(kAllReduce);
      if (l.post_ff_norm.defined()) x = rms_norm(x, c10::nullopt, l.post_ff_norm, eps_, offset_);
    }
    if (!final_norm_.defined()) {  // a pipeline stage before the last: it hands on the residual stream
      if (!layers_.empty()) residual.add_(x);
      return residual;
    }
    torch::Tensor out = layers_.empty() ? rms_norm(residual, c10::nullopt, final_norm_, eps_, offset_)
                                        : rms_norm(x, residual, final_norm_, eps_, offset_);
    watch.lap(kNorms);
    return out;
  }

  // Tensor parallel: o and down give this rank's partial sums (all_reduce_hook.h).
  void set_all_reduce(pybind11::object fn) {
    std::lock_guard<std::mutex> lock(mu_);
    all_reduce_.set(std::move(fn));
  }

  // Off by default: with it on, forward adds each part's wall time to profile().
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
  // Everything a step reads is checked before its first layer runs, so that bad metadata is an
  // error before any KV is written, and each layer's attention skips the per-call context check.
  void check_step(const torch::Tensor& x, const std::vector<torch::Tensor>& cos, const std::vector<torch::Tensor>& sin,
                  const std::vector<torch::Tensor>& slot_mapping, const std::vector<torch::Tensor>& block_ids,
                  const std::vector<torch::Tensor>& kv_offsets, const std::vector<torch::Tensor>& kv_lens,
                  int64_t block_size) const {
    TORCH_CHECK(x.dim() == 2 && x.size(1) == hidden_ && x.scalar_type() == at::kFloat && x.device().is_cpu(),
                "x must be float32 [rows, hidden=", hidden_, "] on the CPU, got ", x.scalar_type(), " ", x.sizes());
    TORCH_CHECK(block_size >= 1, "block_size must be at least 1, got ", block_size);
    TORCH_CHECK(cos.size() == sin.size(), "one cos per sin");
    const int64_t n = x.size(0);
    for (size_t r = 0; r < cos.size(); ++r)
      for (const torch::Tensor* t : {&cos[r], &sin[r]})
        TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == head_dim_ && t->scalar_type() == at::kFloat &&
                        t->stride(1) == 1 && t->device().is_cpu(),
                    "cos and sin of rope kind ", r, " must be float32 [rows=", n, ", head dim=", head_dim_,
                    "], got ", t->scalar_type(), " ", t->sizes());
    const size_t groups = slot_mapping.size();
    TORCH_CHECK(block_ids.size() == groups && kv_offsets.size() == groups && kv_lens.size() == groups,
                "one block table, offset and length per KV group");
    for (size_t i = 0; i < layers_.size(); ++i) {
      const DecodeLayer& l = layers_[i];
      TORCH_CHECK(l.rope < static_cast<int64_t>(cos.size()) && l.group < static_cast<int64_t>(groups), "layer ", i,
                  " reads a rope kind or KV group that was not given");
      if (l.k_scale.has_value()) {
        check_kv_scales(l.k_cache, *l.k_scale, block_size);
        check_kv_scales(l.v_cache, *l.v_scale, block_size);
      }
    }
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
  }

  int64_t num_heads_, num_kv_heads_, head_dim_, hidden_, intermediate_;
  double eps_, offset_, scale_;
  bool gelu_tanh_;
  AllReduceHook all_reduce_;
  torch::Tensor final_norm_;  // undefined: no final norm (a pipeline stage before the last)
  std::vector<DecodeLayer> layers_;
  bool profiling_ = false;
  std::array<double, kNumParts> seconds_{};
  std::vector<int64_t> group_slots_;  // per KV group, the fewest slots of its layers' caches
  mutable std::mutex mu_;
};

void bind_fused_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  // Every method releases the GIL: forward for the step's length, the others so that none holds
  // the GIL while it waits for mu_.
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, int64_t, double, double, double, bool,
                    c10::optional<torch::Tensor>>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("hidden"),
           py::arg("intermediate"), py::arg("eps"), py::arg("norm_offset"), py::arg("scale"), py::arg("gelu_tanh"),
           py::arg("final_norm"))
      .def("add_layer", &FusedDecoder::add_layer, py::arg("input_norm"), py::arg("post_attn_norm"),
           py::arg("pre_ff_norm"), py::arg("post_ff_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv"),
           py::arg("qkv_rows"), py::arg("qkv_bias"), py::arg("o"), py::arg("o_bias"), py::arg("gate_up"),
           py::arg("gate_up_rows"), py::arg("down"),
           py::arg("k_cache"), py::arg("v_cache"), py::arg("rope"), py::arg("group"),
           py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(), release())
      .def("forward", &FusedDecoder::forward, release())
      .def("set_all_reduce", &FusedDecoder::set_all_reduce)
      .def("set_profiling", &FusedDecoder::set_profiling, release())
      .def("profile", &FusedDecoder::profile, release());
}
