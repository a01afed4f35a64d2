// FusedDecoder (fused_decoder.h): the program of blocks, its checks of a step's metadata before
// any write, and the Python bindings of the decoder and of the layer steps' base.
#include "fused_decoder.h"

#include "ops.h"
#include "step_common.h"

#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>  // Tensor <-> Python for the bindings below

#include <algorithm>
#include <cmath>
#include <limits>

namespace {

constexpr int kParts = static_cast<int>(StepPart::kCount);
constexpr const char* kPartNames[kParts] = {
    "norms, rotary, activation, routing", "linears", "attention (KV write, kernel)",
    "recurrent (conv, scan, gated norm)", "experts (MoE linears)", "all-reduce (tensor parallel)"};

void check_norm(const NormWeights& n, int64_t hidden, const char* name) {
  if (n.weight.defined()) check_vector(n.weight, hidden, name);
}

torch::Tensor norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const NormWeights& n) {
  return rms_norm(x, residual, n.weight, n.eps, n.offset);
}

}  // namespace

FusedDecoder::FusedDecoder(int64_t hidden, NormWeights final_norm, int64_t streams)
    : hidden_(hidden), streams_(streams), final_norm_(std::move(final_norm)) {
  TORCH_CHECK(hidden_ >= 1 && streams_ >= 0, "hidden must be positive and streams not negative, got ", hidden_,
              ", ", streams_);
  check_norm(final_norm_, hidden_, "final_norm");
}

void FusedDecoder::add_block(NormWeights pre_norm, std::shared_ptr<LayerStep> step, NormWeights post_norm,
                             HyperWeights hc, double scale) {
  TORCH_CHECK(step != nullptr, "a block needs a layer step");
  TORCH_CHECK(std::isfinite(scale), "a block's scale must be finite, got ", scale);
  TORCH_CHECK(scale == 1.0 || !hc.fn.defined(), "a block with a hyper-connection takes no scale");
  TORCH_CHECK(pre_norm.weight.defined(), "a block needs its pre-norm");
  check_norm(pre_norm, hidden_, "pre_norm");
  check_norm(post_norm, hidden_, "post_norm");
  TORCH_CHECK(hc.fn.defined() == (streams_ > 0), "a block has a hyper-connection iff the decoder has streams");
  if (hc.fn.defined()) {
    const int64_t k = streams_, width = (2 + k) * k;
    check_packed(hc.fn, k * hidden_, width, "hc fn");
    check_vector(hc.base, width, "hc base");
    check_vector(hc.scale, 3, "hc scale");
    TORCH_CHECK(hc.iters >= 1, "hc iters must be positive, got ", hc.iters);
  }
  const StepNeeds needs = step->needs();
  std::lock_guard<std::mutex> lock(mu_);
  if (needs.rope >= 0) {
    if (static_cast<size_t>(needs.rope) >= rope_dims_.size()) rope_dims_.resize(needs.rope + 1, -1);
    TORCH_CHECK(rope_dims_[needs.rope] < 0 || rope_dims_[needs.rope] == needs.rope_dim, "rope kind ", needs.rope,
                " is read at widths ", rope_dims_[needs.rope], " and ", needs.rope_dim);
    rope_dims_[needs.rope] = needs.rope_dim;
  }
  if (needs.kv_group >= 0) {
    if (static_cast<size_t>(needs.kv_group) >= group_slots_.size())
      group_slots_.resize(needs.kv_group + 1, std::numeric_limits<int64_t>::max());
    group_slots_[needs.kv_group] = std::min(group_slots_[needs.kv_group], needs.kv_slots);
  }
  if (needs.pool_group >= 0) {
    const size_t g = needs.pool_group;
    if (g >= group_slots_.size()) group_slots_.resize(g + 1, std::numeric_limits<int64_t>::max());
    if (g >= group_pools_.size()) group_pools_.resize(g + 1, 1);
    TORCH_CHECK(group_pools_[g] == 1 || group_pools_[g] == needs.pool, "group ", g, " is read with pools of ",
                group_pools_[g], " and ", needs.pool, " tokens");
    group_slots_[g] = std::min(group_slots_[g], needs.pool_rows);
    group_pools_[g] = needs.pool;
  }
  if (needs.state_slots > 0) {
    state_slots_ = state_slots_ == 0 ? needs.state_slots : std::min(state_slots_, needs.state_slots);
    checkpoints_ = checkpoints_ == 0 ? needs.checkpoints : std::min(checkpoints_, needs.checkpoints);
  }
  blocks_.push_back({std::move(pre_norm), std::move(step), std::move(post_norm), std::move(hc), scale});
}

torch::Tensor FusedDecoder::forward(const torch::Tensor& x_in, const std::vector<torch::Tensor>& cos,
                                    const std::vector<torch::Tensor>& sin,
                                    const std::vector<torch::Tensor>& slot_mapping,
                                    const std::vector<torch::Tensor>& block_ids,
                                    const std::vector<torch::Tensor>& kv_offsets,
                                    const std::vector<torch::Tensor>& kv_lens, int64_t block_size,
                                    const std::vector<int64_t>& state_slots,
                                    const std::vector<int64_t>& snapshot_rows,
                                    const std::vector<int64_t>& snapshot_offsets,
                                    const std::vector<int64_t>& snapshot_ids) {
  std::lock_guard<std::mutex> lock(mu_);
  const StepBatch step{x_in.dim() == 2 ? x_in.size(0) : 0,
                       cos,
                       sin,
                       slot_mapping,
                       block_ids,
                       kv_offsets,
                       kv_lens,
                       block_size,
                       state_slots,
                       snapshot_rows,
                       snapshot_offsets,
                       snapshot_ids};
  check_step(x_in, step);
  StepStopwatch watch(profiling_ ? seconds_.data() : nullptr);
  if (streams_ > 0) return run_streams(x_in, step, watch);
  torch::Tensor residual = x_in.contiguous().clone(), pending;
  for (size_t i = 0; i < blocks_.size(); ++i) {
    Block& b = blocks_[i];
    const torch::Tensor h = i == 0 ? norm(residual, c10::nullopt, b.pre_norm) : norm(pending, residual, b.pre_norm);
    watch.lap(StepPart::kNorms);
    pending = b.step->run(h, step, watch);
    all_reduce_(pending);
    watch.lap(StepPart::kAllReduce);
    if (b.post_norm.weight.defined()) {
      pending = norm(pending, c10::nullopt, b.post_norm);
      watch.lap(StepPart::kNorms);
    }
    if (b.scale != 1.0) pending = pending * b.scale;  // the module path's `out * scale`: the same kernel
  }
  if (!final_norm_.weight.defined()) {  // a pipeline stage before the last: it hands on the residual stream
    if (!blocks_.empty()) residual.add_(pending);
    return residual;
  }
  torch::Tensor out =
      blocks_.empty() ? norm(residual, c10::nullopt, final_norm_) : norm(pending, residual, final_norm_);
  watch.lap(StepPart::kNorms);
  return out;
}

torch::Tensor FusedDecoder::run_streams(const torch::Tensor& x, const StepBatch& step, StepStopwatch& watch) {
  const int64_t n = x.size(0), k = streams_;
  torch::Tensor streams = x.size(1) == hidden_ ? x.unsqueeze(1).expand({n, k, hidden_}).contiguous()
                                               : x.contiguous().view({n, k, hidden_});
  for (Block& b : blocks_) {
    const HyperWeights& hc = b.hc;
    torch::Tensor flat = streams.reshape({n, -1});
    flat = flat * torch::rsqrt(flat.square().mean(-1, true) + hc.norm_eps);
    const torch::Tensor mixed = packed_linear(flat, hc.fn, c10::nullopt, (2 + k) * k);
    const std::vector<torch::Tensor> w = hc_weights(mixed, hc.base, hc.scale, k, hc.iters, hc.eps);  // pre, post, comb
    const torch::Tensor h = norm((w[0].unsqueeze(-1) * streams).sum(1), c10::nullopt, b.pre_norm);
    watch.lap(StepPart::kNorms);
    torch::Tensor out = b.step->run(h, step, watch);
    all_reduce_(out);
    watch.lap(StepPart::kAllReduce);
    if (b.post_norm.weight.defined()) out = norm(out, c10::nullopt, b.post_norm);
    streams = w[1].unsqueeze(-1) * out.unsqueeze(-2) + at::matmul(w[2].transpose(-1, -2), streams);
    watch.lap(StepPart::kNorms);
  }
  if (!final_norm_.weight.defined()) return streams.reshape({n, -1});
  torch::Tensor out = norm(streams.mean(1), c10::nullopt, final_norm_);
  watch.lap(StepPart::kNorms);
  return out;
}

// Everything a step reads is checked before its first block runs, so that bad metadata is an error
// before any KV or state is written, and each layer's attention skips the per-call context check.
void FusedDecoder::check_step(const torch::Tensor& x, const StepBatch& step) const {
  TORCH_CHECK(x.dim() == 2 && (x.size(1) == hidden_ || (streams_ > 0 && x.size(1) == streams_ * hidden_)) &&
                  x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "x must be float32 [rows, hidden=", hidden_, "] (or [rows, ", streams_,
              " streams * hidden]) on the CPU, got ", x.scalar_type(), " ", x.sizes());
  const int64_t n = step.rows;
  TORCH_CHECK(step.cos.size() == step.sin.size(), "one cos per sin");
  TORCH_CHECK(step.cos.size() >= rope_dims_.size(), "the layers read ", rope_dims_.size(), " rope kinds, ",
              step.cos.size(), " were given");
  for (size_t r = 0; r < rope_dims_.size(); ++r) {
    if (rope_dims_[r] < 0) continue;  // no layer reads it
    for (const torch::Tensor* t : {&step.cos[r], &step.sin[r]})
      TORCH_CHECK(t->dim() == 2 && t->size(0) == n && t->size(1) == rope_dims_[r] && t->scalar_type() == at::kFloat &&
                      t->stride(1) == 1 && t->device().is_cpu(),
                  "cos and sin of rope kind ", r, " must be float32 [rows=", n, ", rotary dim=", rope_dims_[r],
                  "], got ", t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK(step.slot_mapping.size() >= group_slots_.size(), "the layers read ", group_slots_.size(),
              " KV groups, ", step.slot_mapping.size(), " were given");
  check_kv_step(n, step.slot_mapping, step.block_ids, step.kv_offsets, step.kv_lens, step.block_size, group_slots_,
                group_pools_);
  if (state_slots_ > 0)
    check_state_step(n, step.state_slots, state_slots_, step.snapshot_rows, step.snapshot_offsets, step.snapshot_ids,
                     checkpoints_);
  for (const Block& b : blocks_) b.step->check_step(step);
}

void FusedDecoder::set_all_reduce(pybind11::object fn) {
  std::lock_guard<std::mutex> lock(mu_);
  all_reduce_.set(std::move(fn));
}

void FusedDecoder::set_profiling(bool on) {
  std::lock_guard<std::mutex> lock(mu_);
  profiling_ = on;
  seconds_.fill(0.0);
}

std::map<std::string, double> FusedDecoder::profile() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, double> named;
  for (int part = 0; part < kParts; ++part) named[kPartNames[part]] = seconds_[part];
  return named;
}

ParallelStep::ParallelStep(std::shared_ptr<LayerStep> first, std::shared_ptr<LayerStep> second)
    : first_(std::move(first)), second_(std::move(second)) {
  TORCH_CHECK(first_ && second_, "a parallel step needs two steps");
  const StepNeeds a = first_->needs(), b = second_->needs();
  // each need is one step's: a rope or KV group, a recurrent state, a pooled group
  TORCH_CHECK((a.rope < 0 || b.rope < 0) && (a.kv_group < 0 || b.kv_group < 0) &&
                  (a.state_slots == 0 || b.state_slots == 0) && (a.pool_group < 0 || b.pool_group < 0),
              "the two steps of a parallel step must not share a kind of cache");
  needs_ = a;
  if (b.rope >= 0) needs_.rope = b.rope, needs_.rope_dim = b.rope_dim;
  if (b.kv_group >= 0) needs_.kv_group = b.kv_group, needs_.kv_slots = b.kv_slots;
  if (b.state_slots > 0) needs_.state_slots = b.state_slots, needs_.checkpoints = b.checkpoints;
  if (b.pool_group >= 0) needs_.pool_group = b.pool_group, needs_.pool_rows = b.pool_rows, needs_.pool = b.pool;
}

void ParallelStep::check_step(const StepBatch& step) const {
  first_->check_step(step);
  second_->check_step(step);
}

torch::Tensor ParallelStep::run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) {
  torch::Tensor out = first_->run(h, step, watch);
  const torch::Tensor other = second_->run(h, step, watch);
  return out.add_(other);  // the module path's first + second, the same kernel
}

void bind_fused_decoder(pybind11::module_& m) {
  namespace py = pybind11;
  // Every method releases the GIL: forward for the step's length, the others so that none holds
  // the GIL while it waits for mu_ (set_all_reduce keeps it: it stores a Python object).
  using release = py::call_guard<py::gil_scoped_release>;
  py::class_<NormWeights>(m, "NormWeights")
      .def(py::init([](torch::Tensor weight, double eps, double offset) { return NormWeights{weight, eps, offset}; }),
           py::arg("weight"), py::arg("eps"), py::arg("offset") = 0.0)
      .def(py::init<>());
  py::class_<HyperWeights>(m, "HyperWeights")
      .def(py::init([](torch::Tensor fn, torch::Tensor base, torch::Tensor scale, int64_t iters, double eps,
                       double norm_eps) { return HyperWeights{fn, base, scale, iters, eps, norm_eps}; }),
           py::arg("fn"), py::arg("base"), py::arg("scale"), py::arg("iters"), py::arg("eps"), py::arg("norm_eps"))
      .def(py::init<>());
  py::class_<LayerStep, std::shared_ptr<LayerStep>>(m, "LayerStep");
  py::class_<ParallelStep, LayerStep, std::shared_ptr<ParallelStep>>(m, "ParallelStep")
      .def(py::init<std::shared_ptr<LayerStep>, std::shared_ptr<LayerStep>>(), py::arg("first"), py::arg("second"));
  py::class_<FusedDecoder>(m, "FusedDecoder")
      .def(py::init<int64_t, NormWeights, int64_t>(), py::arg("hidden"), py::arg("final_norm"),
           py::arg("streams") = 0)
      .def("add_block", &FusedDecoder::add_block, py::arg("pre_norm"), py::arg("step"), py::arg("post_norm"),
           py::arg("hc") = HyperWeights{}, py::arg("scale") = 1.0, release())
      .def("forward", &FusedDecoder::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"),
           py::arg("block_ids"), py::arg("kv_offsets"), py::arg("kv_lens"), py::arg("block_size"),
           py::arg("state_slots") = std::vector<int64_t>{}, py::arg("snapshot_rows") = std::vector<int64_t>{},
           py::arg("snapshot_offsets") = std::vector<int64_t>{}, py::arg("snapshot_ids") = std::vector<int64_t>{},
           release())
      .def("set_all_reduce", &FusedDecoder::set_all_reduce)
      .def("set_profiling", &FusedDecoder::set_profiling, release())
      .def("profile", &FusedDecoder::profile, release());
}
