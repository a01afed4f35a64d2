// The recurrent-state scan of linear-attention layers (Gated DeltaNet, Kimi Delta Attention) and
// of Mamba2's SSM: per head a [Dk, Dv] state S carried token by token,
//   S = S * exp(decay_t)                         (scalar per head, or per key channel: row i of S)
//   S = S + k_t (x) (v_t - k_t S) * beta_t       (delta rule; without beta: S = S + k_t (x) v_t)
//   out_t = q_t S
// Column j of S only ever meets column j of v and of out, so the work splits into (head, column
// block) tasks, each scanning every token over a [Dk, 64]-ish slice of S that stays in L1. Every
// lane's arithmetic is the same whatever the block or the call, so a token's result does not
// depend on how the sequence was cut into calls or on the thread count.
#include "cpu_vec.h"

#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>

namespace {

constexpr int64_t kGrainFloats = 1 << 15;  // below this much state work a call stays on one thread
constexpr int64_t kBlockVecs = 4;          // vectors of S's columns per task (at most 4: the kernels below)

// One task: head h's columns [j0, j0 + (NV - 1) * VS + last) over all tokens, last lanes in the
// final vector (Vec::size() where the block is whole).
template <int64_t NV, bool Partial>
void scan_block(const float* q, const float* k, const float* v, const float* g, bool per_channel, const float* beta,
                float* s, float* out, int64_t tokens, int64_t heads, int64_t h, int64_t dk, int64_t dv, int64_t j0,
                int64_t last) {
  constexpr int64_t VS = Vec::size();
  const auto load = [&](const float* p, int64_t b) {
    return (Partial && b == NV - 1) ? Vec::loadu(p + b * VS, last) : Vec::loadu(p + b * VS);
  };
  const auto store = [&](const Vec& x, float* p, int64_t b) {
    if (Partial && b == NV - 1)
      x.store(p + b * VS, last);
    else
      x.store(p + b * VS);
  };
  float* sb = s + h * dk * dv + j0;  // row i of this block at sb + i * dv
  const int64_t g_step = per_channel ? 1 : 0;  // row i's decay factor at gt[i * g_step]
  for (int64_t t = 0; t < tokens; ++t) {
    const int64_t th = t * heads + h;
    const float* qt = q + th * dk;
    const float* kt = k + th * dk;
    const float* vt = v + th * dv + j0;
    float* ot = out + th * dv + j0;
    const float* gt = per_channel ? g + th * dk : g + th;
    Vec o[NV];
    for (int64_t b = 0; b < NV; ++b) o[b] = Vec(0.f);
    if (beta != nullptr) {
      // pass 1: decay, and kv_mem = k S of the decayed state
      Vec mem[NV];
      for (int64_t b = 0; b < NV; ++b) mem[b] = Vec(0.f);
      for (int64_t i = 0; i < dk; ++i) {
        const Vec gi(gt[i * g_step]), ki(kt[i]);
        float* row = sb + i * dv;
        for (int64_t b = 0; b < NV; ++b) {
          const Vec x = load(row, b) * gi;
          store(x, row, b);
          mem[b] = at::vec::fmadd(ki, x, mem[b]);
        }
      }
      // pass 2: S += k (x) delta, delta = (v - kv_mem) * beta; out = q S
      const Vec bt(beta[th]);
      Vec delta[NV];
      for (int64_t b = 0; b < NV; ++b) delta[b] = (load(vt, b) - mem[b]) * bt;
      for (int64_t i = 0; i < dk; ++i) {
        const Vec ki(kt[i]), qi(qt[i]);
        float* row = sb + i * dv;
        for (int64_t b = 0; b < NV; ++b) {
          const Vec x = at::vec::fmadd(ki, delta[b], load(row, b));
          store(x, row, b);
          o[b] = at::vec::fmadd(qi, x, o[b]);
        }
      }
    } else {
      // one pass: S = S * g + k (x) v; out = q S
      Vec vv[NV];
      for (int64_t b = 0; b < NV; ++b) vv[b] = load(vt, b);
      for (int64_t i = 0; i < dk; ++i) {
        const Vec gi(gt[i * g_step]), ki(kt[i]), qi(qt[i]);
        float* row = sb + i * dv;
        for (int64_t b = 0; b < NV; ++b) {
          const Vec x = at::vec::fmadd(ki, vv[b], load(row, b) * gi);
          store(x, row, b);
          o[b] = at::vec::fmadd(qi, x, o[b]);
        }
      }
    }
    for (int64_t b = 0; b < NV; ++b) store(o[b], ot, b);
  }
}

using ScanKernel = decltype(&scan_block<1, false>);
constexpr ScanKernel kScanKernels[kBlockVecs][2] = {{&scan_block<1, false>, &scan_block<1, true>},
                                                    {&scan_block<2, false>, &scan_block<2, true>},
                                                    {&scan_block<3, false>, &scan_block<3, true>},
                                                    {&scan_block<4, false>, &scan_block<4, true>}};

// The kernel of a task over `width` columns: its vector count and the lanes in its last vector
ScanKernel scan_kernel(int64_t width, int64_t& last) {
  const int64_t nv = (width + Vec::size() - 1) / Vec::size();
  last = width - (nv - 1) * Vec::size();
  return kScanKernels[nv - 1][last < Vec::size()];
}

// exp(decay), a vector at a time: the same function for every element whatever its position, so
// a token's factor does not depend on the call's length or its row
torch::Tensor exp_decay(const torch::Tensor& decay) {
  auto g = torch::empty_like(decay);
  const float* src = decay.data_ptr<float>();
  float* dst = g.data_ptr<float>();
  at::parallel_for(0, decay.numel(), kGrainFloats, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i += Vec::size()) {
      const int64_t m = std::min<int64_t>(Vec::size(), end - i);
      Vec::loadu(src + i, m).exp().store(dst + i, m);
    }
  });
  return g;
}

void check_input(const torch::Tensor& t, const char* name, const char* shape, int64_t dim) {
  TORCH_CHECK(t.dim() == dim && t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor ", shape, ", got ", t.scalar_type(), " ", t.sizes(),
              t.device().is_cpu() ? "" : " on ", t.device().is_cpu() ? "" : t.device().str(),
              t.is_contiguous() ? "" : " (not contiguous)");
}

void check_no_overlap(const torch::Tensor& state, const torch::Tensor& t, const char* name) {
  TORCH_CHECK(at::get_overlap_status(state, t) == at::MemOverlapStatus::No, "state must not share memory with ",
              name);
}

}  // namespace

// out [T, H, Dv] of the scan over T tokens, state [H, Dk, Dv] carried in place (see the top).
// decay [T, H] (per head) or [T, H, Dk] (per key channel), in log space; beta [T, H] or none.
torch::Tensor recurrent_scan_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& decay, const c10::optional<torch::Tensor>& beta,
                              torch::Tensor& state) {
  check_input(q, "q", "[T, H, Dk]", 3);
  check_input(k, "k", "[T, H, Dk]", 3);
  check_input(v, "v", "[T, H, Dv]", 3);
  check_input(state, "state", "[H, Dk, Dv]", 3);
  const int64_t tokens = q.size(0), heads = q.size(1), dk = q.size(2), dv = v.size(2);
  TORCH_CHECK(k.sizes() == q.sizes(), "k ", k.sizes(), " must match q ", q.sizes(), " ([T, H, Dk])");
  TORCH_CHECK(v.size(0) == tokens && v.size(1) == heads, "v ", v.sizes(), " must be [T=", tokens, ", H=", heads,
              ", Dv] of q ", q.sizes());
  TORCH_CHECK(state.size(0) == heads && state.size(1) == dk && state.size(2) == dv, "state ", state.sizes(),
              " must be [H=", heads, ", Dk=", dk, ", Dv=", dv, "] of q ", q.sizes(), " and v ", v.sizes());
  TORCH_CHECK(decay.dim() == 2 || decay.dim() == 3, "decay must be [T, H] or [T, H, Dk], got ", decay.sizes());
  check_input(decay, "decay", decay.dim() == 2 ? "[T, H]" : "[T, H, Dk]", decay.dim());
  const bool per_channel = decay.dim() == 3;
  TORCH_CHECK(decay.size(0) == tokens && decay.size(1) == heads && (!per_channel || decay.size(2) == dk), "decay ",
              decay.sizes(), " must be [T=", tokens, ", H=", heads, "] or [T=", tokens, ", H=", heads, ", Dk=", dk,
              "]");
  const float* bp = nullptr;
  if (beta.has_value() && beta->defined()) {
    check_input(*beta, "beta", "[T, H]", 2);
    TORCH_CHECK(beta->size(0) == tokens && beta->size(1) == heads, "beta ", beta->sizes(), " must be [T=", tokens,
                ", H=", heads, "]");
    check_no_overlap(state, *beta, "beta");
    bp = beta->data_ptr<float>();
  }
  check_no_overlap(state, q, "q");
  check_no_overlap(state, k, "k");
  check_no_overlap(state, v, "v");
  check_no_overlap(state, decay, "decay");

  auto out = torch::empty({tokens, heads, dv}, q.options());
  if (tokens == 0 || heads == 0 || dv == 0) return out;

  const torch::Tensor g = exp_decay(decay);
  constexpr int64_t block = kBlockVecs * Vec::size();
  const int64_t blocks = (dv + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(1, tokens * dk * std::min(dv, block)));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, heads * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, j0 = (task % blocks) * block;
      int64_t last;
      const ScanKernel kernel = scan_kernel(std::min(block, dv - j0), last);
      kernel(qp, kp, vp, gp, per_channel, bp, sp, op, tokens, heads, h, dk, dv, j0, last);
    }
  });
  return out;
}

torch::Tensor recurrent_step_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& decay, const torch::Tensor& beta, torch::Tensor& state,
                              const std::vector<int64_t>& slots) {
  const int64_t rows = q.size(0), group = v.size(1) / q.size(1), heads = v.size(1), dk = q.size(2), dv = v.size(2);
  const bool per_channel = decay.dim() == 3;
  auto out = torch::empty({rows, heads, dv}, v.options());
  const torch::Tensor g = exp_decay(decay);
  constexpr int64_t block = kBlockVecs * Vec::size();
  const int64_t blocks = (dv + block - 1) / block;
  const int64_t grain = std::max<int64_t>(1, kGrainFloats / std::max<int64_t>(1, dk * std::min(dv, block)));
  const float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  const float* bp = beta.defined() ? beta.data_ptr<float>() : nullptr;
  float* sp = state.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t g_head = per_channel ? dk : 1, state_stride = state.stride(0);
  at::parallel_for(0, rows * heads * blocks, grain, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task / (heads * blocks), h = task / blocks % heads, j0 = task % blocks * block;
      const int64_t th = t * heads + h, qk = h / group * dk;
      int64_t last;
      // the task as a scan of one token and one head over this row's slot
      scan_kernel(std::min(block, dv - j0), last)(
          qp + t * q.stride(0) + qk, kp + t * k.stride(0) + qk, vp + t * v.stride(0) + h * dv, gp + th * g_head,
          per_channel, bp ? bp + th : nullptr, sp + slots[t] * state_stride + h * dk * dv, op + th * dv, 1, 1, 0, dk,
          dv, j0, last);
    }
  });
  return out;
}
