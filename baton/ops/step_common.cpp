// The fused decode steps' arguments, shared checks, causal conv and state checkpoints (step_common.h).
#include "torch_rounding.h"  // first: cpu_vec.h picks the vector width before any ATen header

#include "step_common.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>

void check_float(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.defined() && t.scalar_type() == at::kFloat && t.device().is_cpu(), name,
              " must be a float32 CPU tensor");
}

void check_vector(const torch::Tensor& t, int64_t n, const char* name) {
  check_float(t, name);
  TORCH_CHECK(t.is_contiguous() && t.numel() == n, name, " must be contiguous [", n, "], got ", t.sizes());
}

void check_packed(const torch::Tensor& t, int64_t k, int64_t n, const char* name) {
  TORCH_CHECK(t.defined() && t.device().is_cpu(), name, " must be a CPU tensor");
  if (t.scalar_type() == at::kByte) {  // GGUF blocks [n, blocks, block bytes], or regrouped (quant_linear.h)
    const int64_t rows = t.dim() >= 4 ? (n + 7) / 8 : n;
    TORCH_CHECK(t.size(0) == rows && quant_row_blocks(t) * quant_block_values(t) == k, name,
                " must be GGUF blocks of an [", n,
                ", ", k, "] weight, got ", t.sizes());
    return;
  }
  check_float(t, name);
  TORCH_CHECK(t.dim() == 3 && t.is_contiguous() && t.size(1) == k && t.size(2) == panel_lanes() &&
                  t.size(0) * panel_lanes() >= n,
              name, " must be packed panels of a [", n, ", ", k, "] weight, got ", t.sizes());
}

namespace {

// A recurrent layer's causal-conv weight [channels, kc] and its tensors of running slots and
// checkpoints: conv ones [n, channels, kc - 1], recurrent ones [n, *state_shape], each entry
// contiguous, as many conv as recurrent entries.
void check_recurrent_tensors(const torch::Tensor& conv_weight, int64_t channels, int64_t kc,
                             const torch::Tensor& conv_state, const torch::Tensor& state,
                             const torch::Tensor& conv_checkpoints, const torch::Tensor& checkpoints,
                             const std::vector<int64_t>& state_shape) {
  TORCH_CHECK(conv_weight.is_contiguous() && conv_weight.dim() == 2 && conv_weight.size(0) == channels &&
                  conv_weight.size(1) == kc,
              "conv_weight must be contiguous [", channels, ", ", kc, "], got ", conv_weight.sizes());
  const std::vector<int64_t> conv_shape{channels, kc - 1};
  for (const auto& [t, shape, name] : {std::tuple{&conv_state, &conv_shape, "conv_state"},
                                       std::tuple{&state, &state_shape, "rec_state"},
                                       std::tuple{&conv_checkpoints, &conv_shape, "conv_checkpoints"},
                                       std::tuple{&checkpoints, &state_shape, "rec_checkpoints"}}) {
    check_float(*t, name);
    TORCH_CHECK(t->dim() == 1 + static_cast<int64_t>(shape->size()) && t->sizes().slice(1) == *shape &&
                    (t->size(0) == 0 || t->select(0, 0).is_contiguous()),
                name, " must be [n, ", c10::IntArrayRef(*shape), "], each entry contiguous, got ", t->sizes());
  }
  TORCH_CHECK(conv_checkpoints.size(0) == checkpoints.size(0), "one conv and one state checkpoint per id");
  TORCH_CHECK(conv_state.size(0) == state.size(0), "one conv and one state slot per slot");
}

}  // namespace

void check_kv_step(int64_t n, const std::vector<torch::Tensor>& slot_mapping,
                   const std::vector<torch::Tensor>& block_ids, const std::vector<torch::Tensor>& kv_offsets,
                   const std::vector<torch::Tensor>& kv_lens, int64_t block_size,
                   const std::vector<int64_t>& group_slots, const std::vector<int64_t>& group_pools) {
  const size_t groups = slot_mapping.size();
  TORCH_CHECK(block_ids.size() == groups && kv_offsets.size() == groups && kv_lens.size() == groups,
              "one block table, offset and length per KV group");
  TORCH_CHECK(block_size >= 1, "block_size must be at least 1, got ", block_size);
  for (size_t g = 0; g < std::min(groups, group_slots.size()); ++g) {
    if (group_slots[g] == std::numeric_limits<int64_t>::max()) continue;  // no layer reads it
    const torch::Tensor& slots = slot_mapping[g];
    TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == n &&
                    slots.device().is_cpu(),
                "slot_mapping must be contiguous int64 [rows=", n, "], got ", slots.scalar_type(), " ",
                slots.sizes());
    const int64_t pool = g < group_pools.size() ? group_pools[g] : 1;
    TORCH_CHECK(pool >= 1 && block_size % pool == 0, "block_size ", block_size, " is not a multiple of group ", g,
                "'s pool of ", pool, " tokens");
    const int64_t* slot = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < n; ++t)
      TORCH_CHECK((slot[t] >= 0 || (pool > 1 && slot[t] == -1)) && slot[t] < group_slots[g], "slot_mapping[", g,
                  "][", t, "] = ", slot[t], " is outside the KV cache's ", group_slots[g], " slots");
    check_decode_context(block_ids[g], kv_offsets[g], kv_lens[g], n, block_size,
                         group_slots[g] / (block_size / pool));
  }
}

void check_state_step(int64_t n, const std::vector<int64_t>& state_slots, int64_t num_slots,
                      const std::vector<int64_t>& snapshot_rows, const std::vector<int64_t>& snapshot_offsets,
                      const std::vector<int64_t>& snapshot_ids, int64_t num_checkpoints) {
  TORCH_CHECK(static_cast<int64_t>(state_slots.size()) == n, "one state slot per row: ", state_slots.size(),
              " for ", n, " rows");
  std::vector<int64_t> seen(state_slots);
  std::sort(seen.begin(), seen.end());
  TORCH_CHECK(std::adjacent_find(seen.begin(), seen.end()) == seen.end(), "two rows share a state slot");
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(state_slots[t] >= 0 && state_slots[t] < num_slots, "state slot ", state_slots[t], " of row ", t,
                " is outside the ", num_slots, " slots");
  TORCH_CHECK(snapshot_rows.size() == snapshot_offsets.size() && snapshot_rows.size() == snapshot_ids.size(),
              "one row, offset and checkpoint id per snapshot");
  for (size_t i = 0; i < snapshot_rows.size(); ++i) {
    TORCH_CHECK(snapshot_rows[i] >= 0 && snapshot_rows[i] < n, "snapshot row ", snapshot_rows[i],
                " is outside the ", n, " rows");
    TORCH_CHECK(snapshot_offsets[i] == 0 || snapshot_offsets[i] == 1, "a decode row's snapshot is 0 or 1 rows in, got ",
                snapshot_offsets[i]);
    TORCH_CHECK(snapshot_ids[i] >= 0 && snapshot_ids[i] < num_checkpoints, "checkpoint ", snapshot_ids[i],
                " is outside the ", num_checkpoints, " checkpoints");
  }
}

void snapshot_state(torch::Tensor& checkpoints, const torch::Tensor& state, const StepBatch& step, int64_t offset) {
  for (size_t i = 0; i < step.snapshot_rows.size(); ++i)
    if (step.snapshot_offsets[i] == offset)
      checkpoints.select(0, step.snapshot_ids[i]).copy_(state.select(0, step.state_slots[step.snapshot_rows[i]]));
}

namespace {

template <class T>
void write_kv_rows(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots) {
  const int64_t rows = src.size(0), heads = src.size(1), dim = src.size(2);
  const int64_t num_slots = cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  const float* s = src.data_ptr<float>();
  T* c = cache.data_ptr<T>();
  for (int64_t t = 0; t < rows; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot ", slot[t], " outside the KV cache's ", num_slots, " slots");
    for (int64_t h = 0; h < heads; ++h) {
      const float* from = s + t * src.stride(0) + h * src.stride(1);
      T* to = c + slot[t] * cache.stride(0) + h * cache.stride(1);
      if constexpr (std::is_same_v<T, float>)
        std::memcpy(to, from, dim * sizeof(float));
      else
        for (int64_t i = 0; i < dim; ++i) to[i] = static_cast<T>(from[i]);
    }
  }
}

}  // namespace

void write_kv(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots) {
  switch (cache.scalar_type()) {
    case at::kHalf: return write_kv_rows<at::Half>(src, cache, slots);
    case at::kBFloat16: return write_kv_rows<at::BFloat16>(src, cache, slots);
    default: return write_kv_rows<float>(src, cache, slots);
  }
}

StepArgs::StepArgs(const pybind11::kwargs& kwargs) {
  for (const auto& [key, value] : kwargs) args_[key.cast<std::string>()] = pybind11::reinterpret_borrow<pybind11::object>(value);
}

pybind11::object StepArgs::take(const std::string& name, bool required) {
  const auto it = args_.find(name);
  if (it == args_.end() || it->second.is_none()) {
    TORCH_CHECK(!required, "missing argument ", name);
    if (it != args_.end()) args_.erase(it);
    return pybind11::none();
  }
  pybind11::object value = std::move(it->second);
  args_.erase(it);
  return value;
}

bool StepArgs::has(const char* name) const {
  const auto it = args_.find(name);
  return it != args_.end() && !it->second.is_none();
}

int64_t StepArgs::integer(const char* name) { return take(name, true).cast<int64_t>(); }
double StepArgs::real(const char* name) { return take(name, true).cast<double>(); }

bool StepArgs::flag(const char* name, bool fallback) {
  const pybind11::object v = take(name, false);
  return v.is_none() ? fallback : v.cast<bool>();
}

torch::Tensor StepArgs::tensor(const char* name) {
  const pybind11::object v = take(name, false);
  return v.is_none() ? torch::Tensor() : v.cast<torch::Tensor>();
}

std::vector<torch::Tensor> StepArgs::tensors(const char* name) {
  return take(name, true).cast<std::vector<torch::Tensor>>();
}

std::vector<int64_t> StepArgs::integers(const char* name) { return take(name, true).cast<std::vector<int64_t>>(); }

torch::Tensor StepArgs::vector(const char* name, int64_t n) {
  torch::Tensor t = tensor(name);
  check_vector(t, n, name);
  return t;
}

StepLinear StepArgs::linear(const std::string& name, int64_t k, int64_t n, bool optional) {
  StepLinear l;
  l.n = n;
  const pybind11::object v = take(name, false);
  if (pybind11::isinstance<pybind11::list>(v) || pybind11::isinstance<pybind11::tuple>(v)) {
    l.parts = v.cast<std::vector<torch::Tensor>>();
    l.rows = integers((name + "_rows").c_str());
    TORCH_CHECK(!l.parts.empty() && l.parts.size() == l.rows.size(), name, ": one row count per part");
    int64_t total = 0;
    for (size_t i = 0; i < l.parts.size(); ++i) {
      check_packed(l.parts[i], k, l.rows[i], name.c_str());
      total += l.rows[i];
    }
    TORCH_CHECK(total == n, name, "'s parts have ", total, " rows in all, expected ", n);
  } else if (!v.is_none()) {
    l.weight = v.cast<torch::Tensor>();
  }
  TORCH_CHECK(optional || l.defined(), "missing argument ", name);
  const std::string bias_name = name + "_bias";
  torch::Tensor bias = tensor(bias_name.c_str());
  if (!l.defined()) {
    TORCH_CHECK(!bias.defined(), bias_name, " without ", name);
    return l;
  }
  if (l.parts.empty()) check_packed(l.weight, k, n, name.c_str());
  if (bias.defined()) {
    check_vector(bias, n, bias_name.c_str());
    l.bias = std::move(bias);
  }
  return l;
}

NormWeights StepArgs::norm(const char* name) {
  const pybind11::object v = take(name, false);
  return v.is_none() ? NormWeights{} : v.cast<NormWeights>();
}

StateTensors StepArgs::state(const torch::Tensor& conv_weight, int64_t channels, int64_t kc,
                             const std::vector<int64_t>& state_shape) {
  StateTensors s{tensor("conv_state"), tensor("rec_state"), tensor("conv_checkpoints"), tensor("rec_checkpoints")};
  TORCH_CHECK(kc >= 2, "conv kernel must be at least 2, got ", kc);
  check_float(conv_weight, "conv_weight");
  check_recurrent_tensors(conv_weight, channels, kc, s.conv, s.rec, s.conv_ckpt, s.rec_ckpt, state_shape);
  return s;
}

StateTensors StepArgs::conv_state(const torch::Tensor& conv_weight, int64_t channels, int64_t kc) {
  StateTensors s{tensor("conv_state"), torch::Tensor(), tensor("conv_checkpoints"), torch::Tensor()};
  TORCH_CHECK(kc >= 2, "conv kernel must be at least 2, got ", kc);
  check_float(conv_weight, "conv_weight");
  TORCH_CHECK(conv_weight.is_contiguous() && conv_weight.dim() == 2 && conv_weight.size(0) == channels &&
                  conv_weight.size(1) == kc,
              "conv_weight must be contiguous [", channels, ", ", kc, "], got ", conv_weight.sizes());
  for (const auto& [t, name] : {std::pair{&s.conv, "conv_state"}, std::pair{&s.conv_ckpt, "conv_checkpoints"}}) {
    check_float(*t, name);
    TORCH_CHECK(t->dim() == 3 && t->size(1) == channels && t->size(2) == kc - 1 &&
                    (t->size(0) == 0 || t->select(0, 0).is_contiguous()),
                name, " must be [n, ", channels, ", ", kc - 1, "], each entry contiguous, got ", t->sizes());
  }
  return s;
}

void StepArgs::finish(const char* step) const {
  std::string unknown;
  for (const auto& [name, value] : args_)
    if (!value.is_none()) unknown += (unknown.empty() ? "" : ", ") + name;  // None: not given
  TORCH_CHECK(unknown.empty(), step, " takes no argument(s) ", unknown);
}

torch::Tensor causal_conv_(const torch::Tensor& proj, const std::vector<int64_t>& columns, const torch::Tensor& weight,
                           const torch::Tensor& bias, torch::Tensor& conv_state, const std::vector<int64_t>& slots,
                           bool silu) {
  const int64_t rows = proj.size(0), channels = static_cast<int64_t>(columns.size()), kc = weight.size(1);
  torch::Tensor conv = torch::empty({rows, channels}, proj.options());
  const float* src = proj.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
  const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
  float* out = conv.data_ptr<float>();
  float* states = conv_state.data_ptr<float>();
  const int64_t src_stride = proj.stride(0), state_stride = conv_state.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      float* window = states + slots[t] * state_stride;
      for (int64_t c = 0; c < channels; ++c)
        out[t * channels + c] = conv_window_step(w + c * kc, window + c * (kc - 1), kc - 1,
                                                 src[t * src_stride + columns[c]], b ? b[c] : 0.f);
    }
  });
  if (silu) vec_unary(out, out, rows * channels, Silu());
  return conv;
}

torch::Tensor RecurrentStep::run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) {
  const torch::Tensor proj = in_proj_(h);
  watch.lap(StepPart::kLinears);
  state_.snapshot(step, 0);
  const torch::Tensor conv =
      causal_conv_(proj, conv_columns_, conv_weight_, conv_bias_, state_.conv, step.state_slots, true);
  const torch::Tensor mixed = mix(h, proj, conv, step, watch);
  state_.snapshot(step, 1);
  watch.lap(StepPart::kRecurrent);
  torch::Tensor o = out_proj_(mixed);
  watch.lap(StepPart::kLinears);
  return o;
}

void RecurrentStep::read_projections(StepArgs& a, int64_t hidden, int64_t proj_width, int64_t inner) {
  in_proj_ = a.linear("in_proj", hidden, proj_width);
  out_proj_ = a.linear("out_proj", inner, hidden);
}

void RecurrentStep::read_conv_state(StepArgs& a, std::vector<int64_t> conv_columns, int64_t kc,
                                    const std::vector<int64_t>& state_shape) {
  conv_columns_ = std::move(conv_columns);
  const int64_t channels = static_cast<int64_t>(conv_columns_.size());
  for (const int64_t c : conv_columns_)
    TORCH_CHECK(c >= 0 && c < in_proj_.n, "conv column ", c, " is outside in_proj's ", in_proj_.n, " outputs");
  conv_weight_ = a.tensor("conv_weight");
  state_ = a.state(conv_weight_, channels, kc, state_shape);
  conv_bias_ = a.tensor("conv_bias");
  if (conv_bias_.defined()) check_vector(conv_bias_, channels, "conv_bias");
}

torch::Tensor swiglu(const torch::Tensor& x, bool gelu_tanh, double limit) {
  if (limit <= 0) return gated_act(x, gelu_tanh);
  const std::vector<torch::Tensor> halves = x.chunk(2, -1);
  return vec_unary(halves[0].clamp_max(limit), Silu()) * halves[1].clamp(-limit, limit);
}

torch::Tensor pointwise(const torch::Tensor& x, const std::string& op) {
  if (op == "silu") return vec_unary(x, Silu());
  if (op == "sigmoid") return vec_unary(x, Sigmoid());
  if (op == "softplus") return vec_unary(x, Softplus());
  TORCH_CHECK(false, "unknown pointwise op '", op, "': silu, sigmoid or softplus");
}
