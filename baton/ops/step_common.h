#pragma once
// What the fused decoder's layer steps (fused_decoder.h) share: their constructor arguments by
// name with the checks of their weights, the checks of a step's KV and state metadata before any
// write, a recurrent layer's state tensors and its causal conv over each row's window, and the
// state checkpoints a decode row takes before or after its token (baton/models/recurrent.py's
// segments).
#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

#include "fused_decoder.h"
#include "ops.h"

#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

// A layer's weights: a float32 CPU tensor; a contiguous one of n floats; the packed panels
// (pack_weight_panels) or GGUF blocks of an [n, k] weight. Each throws, naming the tensor.
void check_float(const torch::Tensor& t, const char* name);
void check_vector(const torch::Tensor& t, int64_t n, const char* name);
void check_packed(const torch::Tensor& t, int64_t k, int64_t n, const char* name);

// A step of n decode rows: per KV group g that some layer reads (group_slots[g] its layers'
// fewest cache rows; int64 max where no layer reads it; group_pools[g] the tokens a row holds, 1
// but for a pooled indexer's group), the row each token writes (a pooled group's: -1 but where
// the token completes a pool) and the context it reads. Throws on the first bad entry.
void check_kv_step(int64_t n, const std::vector<torch::Tensor>& slot_mapping,
                   const std::vector<torch::Tensor>& block_ids, const std::vector<torch::Tensor>& kv_offsets,
                   const std::vector<torch::Tensor>& kv_lens, int64_t block_size,
                   const std::vector<int64_t>& group_slots, const std::vector<int64_t>& group_pools);

// act(gate) * up of x [rows, 2 * inner] = [gate | up] as gated_act, or (limit > 0: GLM-5.3-Flash's
// swiglu_limit) silu(gate clamped from above at limit) * (up clamped to [-limit, limit]) as the
// module path's ATen ops
torch::Tensor swiglu(const torch::Tensor& x, bool gelu_tanh, double limit);

// One distinct state slot per row in [0, num_slots); snapshots: a row, an offset 0 or 1 and a
// checkpoint id in [0, num_checkpoints) each.
void check_state_step(int64_t n, const std::vector<int64_t>& state_slots, int64_t num_slots,
                      const std::vector<int64_t>& snapshot_rows, const std::vector<int64_t>& snapshot_offsets,
                      const std::vector<int64_t>& snapshot_ids, int64_t num_checkpoints);

// The checkpoints of one state tensor ([slots, ...], checkpoints [ids, ...]) taken `offset` rows
// into their row (0: before its token, 1: after): checkpoint snapshot_ids[i] of row
// snapshot_rows[i]'s slot (baton/models/recurrent.py's segments).
void snapshot_state(torch::Tensor& checkpoints, const torch::Tensor& state, const StepBatch& step, int64_t offset);

// cache[slots[t], h] = src[t, h] for src [rows, kv heads, dim] (any strides but the last), converted
// to a float16 / bfloat16 cache's dtype as torch's copy_ converts (round to nearest even); throws
// on a slot outside the cache
void write_kv(const torch::Tensor& src, torch::Tensor& cache, const torch::Tensor& slots);

// One channel of a depthwise causal conv for one new input x over its window (the K-1 inputs
// before it), as oneDNN sums it: from `init` (the bias, or 0), one FMA per tap, k ascending. The
// window shifts by one: x becomes its newest input.
inline float conv_window_step(const float* w, float* window, int64_t km1, float x, float init) {
  float acc = init;
  for (int64_t k = 0; k < km1; ++k) acc = std::fma(w[k], window[k], acc);
  acc = std::fma(w[km1], x, acc);
  for (int64_t k = 0; k + 1 < km1; ++k) window[k] = window[k + 1];
  window[km1 - 1] = x;
  return acc;
}

// A recurrent layer step's running states and checkpoints ([slots, ...] and [checkpoints, ...]
// alike): what it needs of a step, and its checkpoints taken there
struct StateTensors {
  torch::Tensor conv, rec, conv_ckpt, rec_ckpt;

  StepNeeds needs() const {
    StepNeeds n;
    n.state_slots = conv.size(0);
    n.checkpoints = conv_ckpt.size(0);
    return n;
  }
  // the checkpoints taken `offset` rows into their row (0: before its token)
  void snapshot(const StepBatch& step, int64_t offset) {
    snapshot_state(conv_ckpt, conv, step, offset);
    if (rec.defined()) snapshot_state(rec_ckpt, rec, step, offset);  // undefined: a conv-only layer (LFM2)
  }
};

// A projection of a step: the packed panels or GGUF blocks of an [n, k] weight (undefined:
// absent), or its row parts in different GGUF formats (stacked_linear), an optional float32 bias [n]
struct StepLinear {
  torch::Tensor weight;
  c10::optional<torch::Tensor> bias;
  int64_t n = 0;
  std::vector<torch::Tensor> parts;  // where the weight ships in parts: each of rows[i] outputs
  std::vector<int64_t> rows;
  bool defined() const { return weight.defined() || !parts.empty(); }
  torch::Tensor operator()(const torch::Tensor& x) const {
    return parts.empty() ? packed_linear(x, weight, bias, n) : stacked_linear(x, parts, rows, bias, n);
  }
};

// A layer step's constructor arguments, by the names the Python binder passes them with. Each is
// read once and checked as it is read; finish() throws on a name no reader took (a misspelled or
// unknown argument), so a binder and its step cannot drift apart silently.
class StepArgs {
 public:
  explicit StepArgs(const pybind11::kwargs& kwargs);
  bool has(const char* name) const;  // given, and not None
  int64_t integer(const char* name);
  double real(const char* name);
  bool flag(const char* name, bool fallback = false);
  torch::Tensor tensor(const char* name);  // undefined where absent or None
  std::vector<torch::Tensor> tensors(const char* name);
  std::vector<int64_t> integers(const char* name);
  torch::Tensor vector(const char* name, int64_t n);  // a contiguous float32 [n], required
  // `name` (packed, [n, k], or a list of row parts whose output counts are `name`_rows) and its
  // optional bias `name`_bias [n]; required unless `optional`
  StepLinear linear(const std::string& name, int64_t k, int64_t n, bool optional = false);
  NormWeights norm(const char* name);  // a NormWeights object, or none
  // conv_state, rec_state, conv_checkpoints, rec_checkpoints of a conv over `channels` with the
  // weight conv_weight [channels, kc] and a recurrent state of `state_shape` (each entry)
  StateTensors state(const torch::Tensor& conv_weight, int64_t channels, int64_t kc,
                     const std::vector<int64_t>& state_shape);
  // conv_state and conv_checkpoints alone: a layer whose only state is its conv window
  StateTensors conv_state(const torch::Tensor& conv_weight, int64_t channels, int64_t kc);
  void finish(const char* step) const;
  // a bound C++ object (a state several steps share); null where absent or None
  template <class T>
  std::shared_ptr<T> object(const char* name) {
    const pybind11::object o = take(name, false);
    return o.is_none() ? nullptr : o.cast<std::shared_ptr<T>>();
  }

 private:
  pybind11::object take(const std::string& name, bool required);
  std::map<std::string, pybind11::object> args_;
};

// The Python class `name` of step T, built by keyword from T(StepArgs&)
template <class T>
void bind_step(pybind11::module_& m, const char* name) {
  pybind11::class_<T, LayerStep, std::shared_ptr<T>>(m, name).def(
      pybind11::init([name](const pybind11::kwargs& kwargs) {
        StepArgs args(kwargs);
        auto step = std::make_shared<T>(args);
        args.finish(name);
        return step;
      }));
}

// The depthwise causal conv [rows, columns] of the columns `columns` of proj [rows, *], each over
// its row's window in conv_state [slots, columns, kc - 1] (conv_window_step per channel, the
// window shifting by one), then silu where `silu`; bias undefined: none
torch::Tensor causal_conv_(const torch::Tensor& proj, const std::vector<int64_t>& columns, const torch::Tensor& weight,
                           const torch::Tensor& bias, torch::Tensor& conv_state, const std::vector<int64_t>& slots,
                           bool silu);

// A recurrent mixer (Gated DeltaNet, Kimi Delta Attention, Mamba2) for one token per row: in_proj,
// the checkpoints asked for before the row's token, the causal conv over each row's window, the
// layer's own mix over the row's state slot, the checkpoints after, out_proj. A layer's
// constructor calls read_projections and read_conv_state, its mix does the rest.
class RecurrentStep : public LayerStep {
 public:
  StepNeeds needs() const override { return state_.needs(); }
  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override;

 protected:
  // in_proj [proj_width, hidden] and out_proj [hidden, inner]
  void read_projections(StepArgs& a, int64_t hidden, int64_t proj_width, int64_t inner);
  // conv_weight [channels, kc] (and conv_bias where given) over in_proj's output columns
  // `conv_columns`, and the state tensors (recurrent entries of `state_shape`)
  void read_conv_state(StepArgs& a, std::vector<int64_t> conv_columns, int64_t kc,
                       const std::vector<int64_t>& state_shape);
  // [rows, inner], out_proj's input, from the input h, in_proj's output proj and the conv's
  // output conv, the state of row t in state_.rec's slot step.state_slots[t]
  virtual torch::Tensor mix(const torch::Tensor& h, const torch::Tensor& proj, const torch::Tensor& conv,
                            const StepBatch& step, StepStopwatch& watch) = 0;

  StepLinear in_proj_, out_proj_;
  torch::Tensor conv_weight_, conv_bias_;
  StateTensors state_;
  std::vector<int64_t> conv_columns_;
};
