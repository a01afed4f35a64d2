#pragma once
// Tensor parallel inside a fused decode step: a row-parallel projection's output is this rank's
// partial sum, and the hook sums it over the ranks in place (torch.distributed, called back into
// Python with the GIL: the step itself runs without it). Unset on one rank: it does nothing.
#include <torch/csrc/utils/pybind.h>
#include <torch/types.h>

class AllReduceHook {
 public:
  // Called with the GIL held (bound without releasing it), before any step runs.
  void set(pybind11::object fn) { fn_ = std::move(fn); }
  void operator()(const torch::Tensor& t) const {
    if (!fn_) return;
    pybind11::gil_scoped_acquire gil;
    fn_(t);
  }

 private:
  pybind11::object fn_;
};
