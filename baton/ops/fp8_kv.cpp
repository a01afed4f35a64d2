// Writing and reading the fp8 (e4m3) KV cache (fp8_kv.h).
#include "fp8_kv.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

constexpr float kMinScale = 0x1p-100f, kMaxScale = 0x1p100f;

// The smallest power of two s with amax / s <= kFp8Max (clamped: all-zero rows get kMinScale).
float pow2_scale(float amax) {
  const float need = amax / kFp8Max;
  if (!(need > kMinScale)) return kMinScale;
  if (need >= kMaxScale) return kMaxScale;
  int e = 0;
  const float m = std::frexp(need, &e);  // need = m * 2^e, m in [0.5, 1)
  return std::ldexp(1.f, m == 0.5f ? e - 1 : e);
}

inline uint8_t to_fp8(float x) { return c10::Float8_e4m3fn(x).x; }

struct Run {
  int64_t first, last;  // tokens [first, last) of one block, at consecutive slots
  int64_t block, offset;
};

}  // namespace

void check_kv_scales(const torch::Tensor& cache, const torch::Tensor& scales, int64_t block_size) {
  TORCH_CHECK(block_size >= 1, "block_size must be at least 1, got ", block_size);
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == at::kFloat8_e4m3fn && cache.device().is_cpu() &&
                  cache.stride(2) == 1,
              "an fp8 KV cache is float8_e4m3fn [slots, heads, dim] on the CPU with dim contiguous, got ",
              cache.scalar_type(), " ", cache.sizes());
  TORCH_CHECK(cache.size(0) % block_size == 0, "cache slots ", cache.size(0), " are not whole blocks of ", block_size);
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.is_contiguous() && scales.device().is_cpu() &&
                  scales.dim() == 2 && scales.size(0) == cache.size(0) / block_size && scales.size(1) == cache.size(1),
              "KV scales must be contiguous float32 [blocks=", cache.size(0) / block_size, ", heads=", cache.size(1),
              "], got ", scales.scalar_type(), " ", scales.sizes());
}

void write_kv_fp8(const torch::Tensor& src_in, torch::Tensor& cache, torch::Tensor& scales, const torch::Tensor& slots,
                  int64_t block_size, bool fresh) {
  check_kv_scales(cache, scales, block_size);
  const torch::Tensor src = src_in.to(at::kFloat);
  TORCH_CHECK(src.dim() == 3 && src.size(1) == cache.size(1) && src.size(2) == cache.size(2) && src.stride(2) == 1,
              "K/V to write are [tokens, heads=", cache.size(1), ", dim=", cache.size(2), "], got ", src.sizes());
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1 && slots.is_contiguous() &&
                  slots.numel() == src.size(0),
              "slot_mapping must be contiguous int64 [", src.size(0), "], got ", slots.scalar_type(), " ",
              slots.sizes());
  const int64_t n = src.size(0), heads = src.size(1), d = src.size(2), num_slots = cache.size(0);
  const int64_t* slot = slots.data_ptr<int64_t>();
  std::vector<Run> runs;
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slot_mapping[", t, "] = ", slot[t], " is outside the cache's ",
                num_slots, " slots");
    if (!runs.empty() && slot[t] == slot[t - 1] + 1 && slot[t] % block_size != 0) {
      runs.back().last = t + 1;
      continue;
    }
    runs.push_back({t, t + 1, slot[t] / block_size, slot[t] % block_size});
  }
  // runs of distinct blocks may go in parallel; a block written twice in one call goes in order
  std::vector<int64_t> blocks(runs.size());
  for (size_t r = 0; r < runs.size(); ++r) blocks[r] = runs[r].block;
  std::sort(blocks.begin(), blocks.end());
  const bool distinct = std::adjacent_find(blocks.begin(), blocks.end()) == blocks.end();
  uint8_t* codes = reinterpret_cast<uint8_t*>(cache.data_ptr());
  float* scale = scales.data_ptr<float>();
  const float* x = src.data_ptr<float>();
  const int64_t cs0 = cache.stride(0), cs1 = cache.stride(1), xs0 = src.stride(0), xs1 = src.stride(1);
  auto write_run = [&](const Run& run) {
    std::vector<float> row(d);
    for (int64_t h = 0; h < heads; ++h) {
      float amax = 0.f;
      for (int64_t t = run.first; t < run.last; ++t)
        for (int64_t i = 0; i < d; ++i) amax = std::max(amax, std::abs(x[t * xs0 + h * xs1 + i]));
      const bool starts = fresh || run.offset == 0;
      float& s = scale[run.block * heads + h];
      const float old = starts ? 0.f : s, now = std::max(old, pow2_scale(amax));
      if (old > 0.f && now > old) {  // rescale the rows before the run: exact, a power-of-two ratio
        const float ratio = old / now;
        for (int64_t p = 0; p < run.offset; ++p) {
          uint8_t* c = codes + (run.block * block_size + p) * cs0 + h * cs1;
          fp8_to_float(c, ratio, row.data(), d);
          for (int64_t i = 0; i < d; ++i) c[i] = to_fp8(row[i]);
        }
      }
      s = now;
      const float inv = 1.f / now;  // exact: a power of two
      for (int64_t t = run.first; t < run.last; ++t) {
        uint8_t* c = codes + slot[t] * cs0 + h * cs1;
        for (int64_t i = 0; i < d; ++i) c[i] = to_fp8(x[t * xs0 + h * xs1 + i] * inv);
      }
    }
  };
  if (!distinct) {
    for (const Run& run : runs) write_run(run);
    return;
  }
  at::parallel_for(0, static_cast<int64_t>(runs.size()), 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) write_run(runs[r]);
  });
}

torch::Tensor read_kv_fp8(const torch::Tensor& cache, const torch::Tensor& scales, const torch::Tensor& slots,
                          int64_t block_size) {
  check_kv_scales(cache, scales, block_size);
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.dim() == 1, "slots must be int64 [n], got ",
              slots.scalar_type(), " ", slots.sizes());
  const torch::Tensor idx = slots.contiguous();
  const int64_t n = idx.numel(), heads = cache.size(1), d = cache.size(2), num_slots = cache.size(0);
  const int64_t* slot = idx.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(slot[t] >= 0 && slot[t] < num_slots, "slots[", t, "] = ", slot[t], " is outside the cache's ",
                num_slots, " slots");
  auto out = torch::empty({n, heads, d}, torch::kFloat);
  const uint8_t* codes = reinterpret_cast<const uint8_t*>(cache.data_ptr());
  const float* scale = scales.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const int64_t cs0 = cache.stride(0), cs1 = cache.stride(1);
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      for (int64_t h = 0; h < heads; ++h)
        fp8_to_float(codes + slot[t] * cs0 + h * cs1, scale[slot[t] / block_size * heads + h], o + (t * heads + h) * d,
                     d);
  });
  return out;
}
