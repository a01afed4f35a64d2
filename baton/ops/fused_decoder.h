#pragma once
// The one-call decode step of any model, run as a program: the ordered blocks of its layers, each
// a pre-norm, a layer step (a mixer or an MLP: attention_layer.cpp, mlp_layer.cpp, ...) and an
// optional post-norm, over the residual stream. A model declares its blocks from its own modules
// (baton/models/fused_decode.py binds them); the steps call the kernels the module path calls, in
// its order, so a row's bits are the module path's.
//
// Block b of a step: h = pre_norm(residual += pending) (the first block: pre_norm(residual)),
// pending = scale * post_norm(all_reduce(step(h))) (scale: Granite's residual multiplier, else 1); after the last block the final norm of residual +=
// pending, or (a pipeline stage before the last) the stream itself. With hyper-connections
// (GLM-5.3-Flash) the residual is `streams` copies [rows, streams, hidden] that each block's
// HyperWeights collapse into its input and mix with its output; the final norm reads their mean.
#include "all_reduce_hook.h"

#include <torch/types.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

// The parts of a step that profiling times, and their names in profile()
enum class StepPart { kNorms, kLinears, kAttention, kRecurrent, kExperts, kAllReduce, kCount };

// With totals given, lap(part) adds the time since the last lap (or the start) to totals[part];
// without, it does nothing.
class StepStopwatch {
 public:
  explicit StepStopwatch(double* totals) : totals_(totals), start_(totals ? now() : 0.0) {}
  void lap(StepPart part) {
    if (totals_ == nullptr) return;
    const double t = now();
    totals_[static_cast<int>(part)] += t - start_;
    start_ = t;
  }

 private:
  static double now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }
  double* totals_;
  double start_;
};

// What a step's layers read besides x: per rope kind the cos and signed sin [rows, rotary dim];
// per KV group the slot each row's K/V goes to and the blocks, first offset and length each row
// reads (GroupAttnMetadata); each row's recurrent state slot, and the checkpoints to take:
// checkpoint snapshot_ids[i] of the state of row snapshot_rows[i]'s slot before (offset 0) or
// after (offset 1) its token.
struct StepBatch {
  int64_t rows = 0;
  std::vector<torch::Tensor> cos, sin;
  std::vector<torch::Tensor> slot_mapping, block_ids, kv_offsets, kv_lens;
  int64_t block_size = 1;
  std::vector<int64_t> state_slots, snapshot_rows, snapshot_offsets, snapshot_ids;
};

// What a layer step reads of a step, declared when it is built: the decoder checks every step's
// metadata against its layers' needs before the first layer runs, so bad metadata is an error
// before any KV or state is written.
struct StepNeeds {
  int64_t rope = -1, rope_dim = 0;      // the rope kind it reads and its cos/sin width; -1: none
  int64_t kv_group = -1, kv_slots = 0;  // the KV group it writes and reads, its cache's slots; -1: none
  int64_t state_slots = 0, checkpoints = 0;  // a recurrent layer's state slots and checkpoints; 0: none
  // a pooled indexer's group (a row per `pool` tokens), its cache's rows; -1: none
  int64_t pool_group = -1, pool_rows = 0, pool = 1;
};

// A mixer or an MLP of one layer, with its weights (checked when built). run: [rows, hidden] in,
// [rows, hidden] out (this rank's partial sum under tensor parallel), lapping its parts.
class LayerStep {
 public:
  virtual ~LayerStep() = default;
  virtual StepNeeds needs() const { return {}; }
  // After the decoder's checks of the step's metadata, before any layer runs (e.g. fp8 scales).
  virtual void check_step(const StepBatch&) const {}
  virtual torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) = 0;
};

// Two steps over the same input, their outputs summed (first's + second's): Falcon-H1's Mamba2
// mixer and attention side by side in one layer. Each keeps its own KV group or state.
class ParallelStep : public LayerStep {
 public:
  ParallelStep(std::shared_ptr<LayerStep> first, std::shared_ptr<LayerStep> second);
  StepNeeds needs() const override { return needs_; }
  void check_step(const StepBatch& step) const override;
  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override;

 private:
  std::shared_ptr<LayerStep> first_, second_;
  StepNeeds needs_;
};

// An RMS norm's weight, eps and offset ((offset + w) scales the normalized row)
struct NormWeights {
  torch::Tensor weight;  // undefined: no norm
  double eps = 1e-6, offset = 0.0;
};

// A block's hyper-connection (baton/models/glm5_flash.py, HyperConnection): from the RMS-normed
// streams (norm_eps), fn (packed [(2 + n) n, n hidden]) mixes each row's pre / post / comb
// weights (hc_weights with base, scale, iters and eps); fn undefined: none
struct HyperWeights {
  torch::Tensor fn, base, scale;
  int64_t iters = 1;
  double eps = 1e-6, norm_eps = 1e-6;
};

// forward runs without the GIL: mu_ keeps calls from two Python threads apart, as the GIL did.
class FusedDecoder {
 public:
  // final_norm undefined: a pipeline stage before the last, which hands on the residual stream;
  // streams > 0: hyper-connections over that many streams, every block with its HyperWeights
  FusedDecoder(int64_t hidden, NormWeights final_norm, int64_t streams = 0);

  void add_block(NormWeights pre_norm, std::shared_ptr<LayerStep> step, NormWeights post_norm, HyperWeights hc,
                 double scale = 1.0);
  // x: the embedded tokens [rows, hidden] (a later pipeline stage's: the streams [rows, streams *
  // hidden]), one decode token per row; the rest as StepBatch says. Returns the final-normed
  // hidden (or the stream, flat).
  torch::Tensor forward(const torch::Tensor& x, const std::vector<torch::Tensor>& cos,
                        const std::vector<torch::Tensor>& sin, const std::vector<torch::Tensor>& slot_mapping,
                        const std::vector<torch::Tensor>& block_ids, const std::vector<torch::Tensor>& kv_offsets,
                        const std::vector<torch::Tensor>& kv_lens, int64_t block_size,
                        const std::vector<int64_t>& state_slots, const std::vector<int64_t>& snapshot_rows,
                        const std::vector<int64_t>& snapshot_offsets, const std::vector<int64_t>& snapshot_ids);

  // Tensor parallel: sums every block's output over the ranks (all_reduce_hook.h).
  void set_all_reduce(pybind11::object fn);
  // Off by default: with it on, forward adds each part's wall time to profile().
  void set_profiling(bool on);
  std::map<std::string, double> profile() const;

 private:
  struct Block {
    NormWeights pre_norm;
    std::shared_ptr<LayerStep> step;
    NormWeights post_norm;
    HyperWeights hc;
    double scale = 1.0;
  };
  void check_step(const torch::Tensor& x, const StepBatch& step) const;
  // the blocks over the hyper-connection streams (streams_ > 0)
  torch::Tensor run_streams(const torch::Tensor& x, const StepBatch& step, StepStopwatch& watch);

  int64_t hidden_, streams_;
  NormWeights final_norm_;
  std::vector<Block> blocks_;
  // the step metadata the blocks need: per rope kind its width, per KV group its fewest slots
  // (int64 max where no layer reads it) and tokens per row, the fewest state slots and
  // checkpoints (0: no state)
  std::vector<int64_t> rope_dims_, group_slots_, group_pools_;
  int64_t state_slots_ = 0, checkpoints_ = 0;
  AllReduceHook all_reduce_;
  bool profiling_ = false;
  std::array<double, static_cast<int>(StepPart::kCount)> seconds_{};
  mutable std::mutex mu_;
};
