#pragma once
// What the fused decoder's layer steps (fused_decoder.h) share: the checks of their weights and of
// a step's KV and state metadata before any write, a recurrent layer's state tensors, one channel
// of a causal conv over its slot's window, and the state checkpoints a decode row takes before or
// after its token (baton/models/recurrent.py's segments).
#include <torch/types.h>

#include "fused_decoder.h"

#include <cmath>
#include <cstdint>
#include <vector>

// A layer's weights: a float32 CPU tensor; a contiguous one of n floats; the packed panels
// (pack_weight_panels) or GGUF blocks of an [n, k] weight. Each throws, naming the tensor.
void check_float(const torch::Tensor& t, const char* name);
void check_vector(const torch::Tensor& t, int64_t n, const char* name);
void check_packed(const torch::Tensor& t, int64_t k, int64_t n, const char* name);

// A recurrent layer's causal-conv weight [channels, kc] and its tensors of running slots and
// checkpoints: conv ones [n, channels, kc - 1], recurrent ones [n, *state_shape] (named
// `state_name` and `checkpoints_name`), each entry contiguous, as many conv as recurrent entries.
void check_recurrent_tensors(const torch::Tensor& conv_weight, int64_t channels, int64_t kc,
                             const torch::Tensor& conv_state, const torch::Tensor& state,
                             const torch::Tensor& conv_checkpoints, const torch::Tensor& checkpoints,
                             const std::vector<int64_t>& state_shape, const char* state_name,
                             const char* checkpoints_name);

// A step of n decode rows: per KV group g that some layer reads (group_slots[g] its layers'
// fewest cache slots; int64 max where no layer reads it), the slot each row writes and the
// context it reads. Throws on the first bad entry.
void check_kv_step(int64_t n, const std::vector<torch::Tensor>& slot_mapping,
                   const std::vector<torch::Tensor>& block_ids, const std::vector<torch::Tensor>& kv_offsets,
                   const std::vector<torch::Tensor>& kv_lens, int64_t block_size,
                   const std::vector<int64_t>& group_slots);

// One distinct state slot per row in [0, num_slots); snapshots: a row, an offset 0 or 1 and a
// checkpoint id in [0, num_checkpoints) each.
void check_state_step(int64_t n, const std::vector<int64_t>& state_slots, int64_t num_slots,
                      const std::vector<int64_t>& snapshot_rows, const std::vector<int64_t>& snapshot_offsets,
                      const std::vector<int64_t>& snapshot_ids, int64_t num_checkpoints);

// The checkpoints of a layer's conv and recurrent state taken `offset` rows into their row (0:
// before its token, 1: after): checkpoint snapshot_ids[i] of row snapshot_rows[i]'s slot.
void snapshot_states(torch::Tensor& conv_ckpt, torch::Tensor& rec_ckpt, const torch::Tensor& conv_state,
                     const torch::Tensor& rec_state, const std::vector<int64_t>& slots,
                     const std::vector<int64_t>& snapshot_rows, const std::vector<int64_t>& snapshot_offsets,
                     const std::vector<int64_t>& snapshot_ids, int64_t offset);

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
    snapshot_states(conv_ckpt, rec_ckpt, conv, rec, step.state_slots, step.snapshot_rows, step.snapshot_offsets,
                    step.snapshot_ids, offset);
  }
};
