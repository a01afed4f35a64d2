// Decode attention that reads K/V where they live: each sequence's block table is walked
// block by block with an online softmax, so no gathered copy of the context and no mask.
// The query heads of a kv head (GQA) share every K/V row read.
#include "cpu_vec.h"
#include "fp8_kv.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// acc = acc * scale + w * v
inline void scale_axpy(float* acc, float scale, float w, const float* v, int64_t d) {
  const Vec vs(scale), vw(w);
  int64_t i = 0;
  for (; i + Vec::size() <= d; i += Vec::size())
    at::vec::fmadd(vw, Vec::loadu(v + i), Vec::loadu(acc + i) * vs).store(acc + i);
  if (i < d) at::vec::fmadd(vw, Vec::loadu(v + i, d - i), Vec::loadu(acc + i, d - i) * vs).store(acc + i, d - i);
}

// exp(x - m) in place over n scores, returning their sum (torch's flash attention uses the same exp_u20)
inline float exp_sub_sum(float* x, float m, int64_t n) {
  const Vec vm(m);
  Vec sum(0.f);
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size()) {
    const Vec e = (Vec::loadu(x + i) - vm).exp_u20();
    e.store(x + i);
    sum = sum + e;
  }
  float total = sum_lanes(sum);
  for (; i < n; ++i) total += (x[i] = std::exp(x[i] - m));
  return total;
}

// Ask for a block's K and V rows of one head ahead of use: walking block tables is a chain of
// short strided reads the hardware prefetcher does not run ahead of (a cold cache read at ~7 GB/s).
// Into L2 (prefetcht1), not L1: a block is 24 KiB of K and V at SmolLM2's heads, more misses than
// L1 tracks at once (30 layers of cold KV, 8 sequences: 9-10 GB/s into L1, 12-13 into L2).
template <typename cache_t>
inline void prefetch_rows(const cache_t* k, const cache_t* v, int64_t k_stride, int64_t v_stride, int64_t rows,
                          int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t r = 0; r < rows; ++r) {
    const char* kr = reinterpret_cast<const char*>(k + r * k_stride);
    const char* vr = reinterpret_cast<const char*>(v + r * v_stride);
    for (int64_t off = 0; off < bytes; off += 64) {
      __builtin_prefetch(kr + off, 0, 2);
      __builtin_prefetch(vr + off, 0, 2);
    }
  }
}

// A cache row as float: the row itself for a float32 cache, else converted into buf (an fp8
// cache's codes, uint8, times the scale of their block and head).
template <typename cache_t>
inline const float* as_float(const cache_t* row, float* buf, int64_t d, float scale) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return row;
  } else if constexpr (std::is_same_v<cache_t, uint8_t>) {
    fp8_to_float(row, scale, buf, d);
    return buf;
  } else {
    for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(row[i]);
    return buf;
  }
}

// scores[j * stride + p] = q_j . k[p] for a kv head's query heads j < g (q: g rows of d floats)
// and its rows p < n of one block. NV: d in vectors, so the dot products run from registers; 0:
// any d (a masked tail).
template <int64_t NV>
inline void block_scores(const float* q, int64_t g, const float* const* k, int64_t n, float* scores, int64_t stride,
                         int64_t d) {
  for (int64_t p = 0; p < n; ++p) {
    if constexpr (NV == 0) {
      for (int64_t j = 0; j < g; ++j) scores[j * stride + p] = dot(q + j * d, k[p], d);
    } else {
      Vec kv[NV];
      for (int64_t i = 0; i < NV; ++i) kv[i] = Vec::loadu(k[p] + i * Vec::size());
      for (int64_t j = 0; j < g; ++j) {
        Vec s(0.f);
        for (int64_t i = 0; i < NV; ++i) s = at::vec::fmadd(Vec::loadu(q + j * d + i * Vec::size()), kv[i], s);
        scores[j * stride + p] = sum_lanes(s);
      }
    }
  }
}

// acc_j = acc_j * correction[j] + sum over p < n of w[j * stride + p] * v[p], for j < g; with NV
// (d in vectors) an accumulator stays in registers for the whole block.
template <int64_t NV>
inline void block_values(float* acc, const float* correction, int64_t g, const float* w, int64_t stride,
                         const float* const* v, int64_t n, int64_t d) {
  for (int64_t j = 0; j < g; ++j) {
    float* a = acc + j * d;
    if constexpr (NV == 0) {
      for (int64_t p = 0; p < n; ++p) scale_axpy(a, p == 0 ? correction[j] : 1.f, w[j * stride + p], v[p], d);
    } else {
      Vec r[NV];
      const Vec c(correction[j]);
      for (int64_t i = 0; i < NV; ++i) r[i] = Vec::loadu(a + i * Vec::size()) * c;
      for (int64_t p = 0; p < n; ++p) {
        const Vec wp(w[j * stride + p]);
        for (int64_t i = 0; i < NV; ++i) r[i] = at::vec::fmadd(wp, Vec::loadu(v[p] + i * Vec::size()), r[i]);
      }
      for (int64_t i = 0; i < NV; ++i) r[i].store(a + i * Vec::size());
    }
  }
}

// Positions of one work item: a sequence's context is cut into partitions of this many positions,
// counted from its first position, so a long context is spread over the threads even at one
// sequence. The cut depends on the sequence alone, never on its batch: its bits do not either.
constexpr int64_t kPartition = 256;
constexpr int64_t kPrefetchBlocks = 2;  // how many blocks ahead of the one being read

template <typename scalar_t, typename cache_t, int64_t NV>
void decode_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& block_table,
                           const torch::Tensor& kv_offset, const torch::Tensor& kv_len, int64_t block_size,
                           double scale, const float* k_scales, const float* v_scales) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const cache_t* k_ptr = static_cast<const cache_t*>(k_cache.data_ptr());
  const cache_t* v_ptr = static_cast<const cache_t*>(v_cache.data_ptr());
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* offsets = kv_offset.data_ptr<int64_t>();
  const int64_t* lens = kv_len.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);

  // A work item is a partition of a sequence's context with all its kv heads (whole cache rows,
  // read front to back) when there are sequences enough for every thread; otherwise with one kv head.
  const int64_t spans = num_seqs >= at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t span_heads = num_kv_heads / spans, nq = span_heads * group;
  // out[seq, h + j] = acc[j] / sum[j] for j < n
  auto write_out = [&](int64_t seq, int64_t h, int64_t n, const float* acc, const float* sum) {
    for (int64_t j = 0; j < n; ++j) {
      scalar_t* dst = out_ptr + seq * os0 + (h + j) * os1;
      const float inv = 1.f / sum[j];
      for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<scalar_t>(acc[j * head_dim + i] * inv);
    }
  };
  std::vector<int64_t> first_part(num_seqs + 1, 0);  // sequence s owns partitions [first_part[s], first_part[s + 1])
  for (int64_t s = 0; s < num_seqs; ++s)
    first_part[s + 1] = first_part[s] + std::max<int64_t>(1, (lens[s] + kPartition - 1) / kPartition);
  const int64_t num_parts = first_part[num_seqs];
  // per partition and query head: the unnormalized output, the running max and the sum of exp
  const bool any_split = num_parts > num_seqs;
  std::vector<float> part_acc(any_split ? num_parts * num_heads * head_dim : 0),
      part_max(any_split ? num_parts * num_heads : 0), part_sum(any_split ? num_parts * num_heads : 0);
  at::parallel_for(0, num_parts * spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nq * head_dim), scores(nq * block_size), correction(nq);
    std::vector<float> rows_buf(block_size * head_dim);  // a block's rows of one head as float (non-float caches)
    std::vector<const float*> rows(block_size);
    std::vector<float> acc_own(nq * head_dim), max_own(nq), sum_own(nq);
    int64_t seq = 0;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t part = item / spans, h0 = item % spans * span_heads;  // kv heads [h0, h0 + span_heads)
      while (first_part[seq + 1] <= part) ++seq;
      // a sequence of one partition is normalized straight into out; partitions go through the merge
      const bool alone = first_part[seq + 1] - first_part[seq] == 1;
      float* acc = alone ? acc_own.data() : &part_acc[(part * num_heads + h0 * group) * head_dim];
      float* row_max = alone ? max_own.data() : &part_max[part * num_heads + h0 * group];
      float* row_sum = alone ? sum_own.data() : &part_sum[part * num_heads + h0 * group];
      for (int64_t j = 0; j < nq; ++j) {  // query head h0 * group + j
        const scalar_t* src = q_ptr + seq * qs0 + (h0 * group + j) * qs1;
        for (int64_t i = 0; i < head_dim; ++i) qf[j * head_dim + i] = static_cast<float>(src[i]) * fscale;
      }
      std::fill(acc, acc + nq * head_dim, 0.f);
      std::fill(row_max, row_max + nq, -std::numeric_limits<float>::infinity());
      std::fill(row_sum, row_sum + nq, 0.f);
      // positions [first, last) of the sequence's blocks, counted from its first block's start
      const int64_t seq_first = offsets[seq], seq_last = seq_first + lens[seq];
      const int64_t first = seq_first + (part - first_part[seq]) * kPartition;
      const int64_t last = std::min(first + kPartition, seq_last);
      for (int64_t b = first / block_size; b * block_size < last; ++b) {
        const int64_t block = table[seq * max_blocks + b], base = block * block_size;
        const int64_t lo = std::max(first - b * block_size, int64_t(0));
        const int64_t hi = std::min(last - b * block_size, block_size);
        // the blocks kPrefetchBlocks ahead (at the first block, every one up to there)
        for (int64_t a = b == first / block_size ? 1 : kPrefetchBlocks; a <= kPrefetchBlocks; ++a) {
          if ((b + a) * block_size >= last) break;
          const int64_t next = table[seq * max_blocks + b + a] * block_size;
          for (int64_t h = h0; h < h0 + span_heads; ++h)
            prefetch_rows(k_ptr + next * ks0 + h * ks1, v_ptr + next * vs0 + h * vs1, ks0, vs0, block_size, head_dim);
        }
        for (int64_t h = 0; h < span_heads; ++h) {
          for (int64_t p = lo; p < hi; ++p)
            rows[p - lo] = as_float(k_ptr + (base + p) * ks0 + (h0 + h) * ks1, &rows_buf[(p - lo) * head_dim], head_dim,
                                    k_scales ? k_scales[block * num_kv_heads + h0 + h] : 1.f);
          block_scores<NV>(&qf[h * group * head_dim], group, rows.data(), hi - lo, &scores[h * group * block_size + lo],
                           block_size, head_dim);
        }
        // online softmax: rescale what was accumulated when a block raises the running max
        for (int64_t j = 0; j < nq; ++j) {
          float* sc = &scores[j * block_size];
          const float m = std::max(row_max[j], *std::max_element(sc + lo, sc + hi));
          correction[j] = std::exp(row_max[j] - m);  // exp(-inf) = 0 on the first block
          row_max[j] = m;
          row_sum[j] = row_sum[j] * correction[j] + exp_sub_sum(sc + lo, m, hi - lo);
        }
        for (int64_t h = 0; h < span_heads; ++h) {
          for (int64_t p = lo; p < hi; ++p)
            rows[p - lo] = as_float(v_ptr + (base + p) * vs0 + (h0 + h) * vs1, &rows_buf[(p - lo) * head_dim], head_dim,
                                    v_scales ? v_scales[block * num_kv_heads + h0 + h] : 1.f);
          block_values<NV>(&acc[h * group * head_dim], &correction[h * group], group,
                           &scores[h * group * block_size + lo], block_size, rows.data(), hi - lo, head_dim);
        }
      }
      if (alone) write_out(seq, h0 * group, nq, acc, row_sum);
    }
  });
  // out = sum_i acc_i * exp(max_i - max) / sum_i sum_i * exp(max_i - max) over a sequence's partitions, in order
  std::vector<float> merged(head_dim);
  for (int64_t s = 0; s < num_seqs; ++s) {
    if (first_part[s + 1] - first_part[s] == 1) continue;
    for (int64_t h = 0; h < num_heads; ++h) {
      float m = -std::numeric_limits<float>::infinity();
      for (int64_t part = first_part[s]; part < first_part[s + 1]; ++part) m = std::max(m, part_max[part * num_heads + h]);
      std::fill(merged.begin(), merged.end(), 0.f);
      float total = 0.f;
      for (int64_t part = first_part[s]; part < first_part[s + 1]; ++part) {
        const float w = std::exp(part_max[part * num_heads + h] - m);
        total += w * part_sum[part * num_heads + h];
        scale_axpy(merged.data(), 1.f, w, &part_acc[(part * num_heads + h) * head_dim], head_dim);
      }
      write_out(s, h, 1, merged.data(), &total);
    }
  }
}

// the kernel for q's head_dim: in registers where it is a whole number of vectors (2 to 16)
template <typename scalar_t, typename cache_t>
void decode_attention(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                      const torch::Tensor& v_cache, const torch::Tensor& block_table, const torch::Tensor& kv_offset,
                      const torch::Tensor& kv_len, int64_t block_size, double scale, const float* k_scales,
                      const float* v_scales) {
  const int64_t d = q.size(2), vectors = d % Vec::size() == 0 ? d / Vec::size() : 0;
  switch (vectors) {
#define BATON_HEAD_DIM(NV)                                                                                      \
  case NV:                                                                                                      \
    return decode_attention_impl<scalar_t, cache_t, NV>(out, q, k_cache, v_cache, block_table, kv_offset, kv_len, \
                                                        block_size, scale, k_scales, v_scales);
    BATON_HEAD_DIM(2) BATON_HEAD_DIM(4) BATON_HEAD_DIM(8) BATON_HEAD_DIM(16)
#undef BATON_HEAD_DIM
    default:
      return decode_attention_impl<scalar_t, cache_t, 0>(out, q, k_cache, v_cache, block_table, kv_offset, kv_len,
                                                         block_size, scale, k_scales, v_scales);
  }
}

void check_decode_inputs(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q, k_cache, v_cache must be 3-D, got ",
              q.sizes(), ", ", k_cache.sizes(), ", ", v_cache.sizes());
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu() && v_cache.device().is_cpu(),
              "q, k_cache, v_cache must be on the CPU");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(), "k/v caches differ");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache dtypes differ");
  TORCH_CHECK(k_cache.size(1) >= 1 && q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0,
              "head shapes do not match: q ", q.sizes(), ", k_cache ", k_cache.sizes());
}

// An fp8 cache's scales, checked ([blocks, kv heads] float32 each); nullptr for other caches.
std::pair<const float*, const float*> kv_scales(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                                const c10::optional<torch::Tensor>& k_scale,
                                                const c10::optional<torch::Tensor>& v_scale, int64_t block_size) {
  if (k_cache.scalar_type() != at::kFloat8_e4m3fn) {
    TORCH_CHECK(!k_scale.has_value() && !v_scale.has_value(), "KV scales go with an fp8 cache, not ",
                k_cache.scalar_type());
    return {nullptr, nullptr};
  }
  TORCH_CHECK(k_scale.has_value() && v_scale.has_value(), "an fp8 KV cache needs its k and v scales");
  check_kv_scales(k_cache, *k_scale, block_size);
  check_kv_scales(v_cache, *v_scale, block_size);
  return {k_scale->data_ptr<float>(), v_scale->data_ptr<float>()};
}

torch::Tensor run_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                                   const torch::Tensor& block_table, const torch::Tensor& kv_offset,
                                   const torch::Tensor& kv_len, int64_t block_size, double scale,
                                   const c10::optional<torch::Tensor>& k_scale,
                                   const c10::optional<torch::Tensor>& v_scale) {
  const auto [ks, vs] = kv_scales(k_cache, v_cache, k_scale, v_scale, block_size);
  auto out = torch::empty_like(q, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_q", [&] {
    using q_t = scalar_t;
    if (ks != nullptr) {
      decode_attention<q_t, uint8_t>(out, q, k_cache, v_cache, block_table, kv_offset, kv_len, block_size, scale, ks, vs);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_attention_kv", [&] {
      decode_attention<q_t, scalar_t>(out, q, k_cache, v_cache, block_table, kv_offset, kv_len, block_size, scale,
                                      nullptr, nullptr);
    });
  });
  return out;
}

}  // namespace

// Checks the metadata of decode attention over a cache of num_blocks blocks, before a kernel reads
// through it: every block id a context [kv_offset[s], kv_offset[s] + kv_len[s]) reads must name a
// block of the cache. A loop over the table entries read, a fraction of what the kernel reads.
void check_decode_context(const torch::Tensor& block_table, const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                          int64_t num_seqs, int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(block_size >= 1, "block_size must be at least 1, got ", block_size);
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.dim() == 2 && block_table.size(0) == num_seqs,
              "block_table must be contiguous int64 [num_seqs=", num_seqs, ", max_blocks] on the CPU, got ",
              block_table.scalar_type(), " ", block_table.sizes());
  TORCH_CHECK(kv_offset.device().is_cpu() && kv_len.device().is_cpu() && kv_offset.scalar_type() == at::kLong &&
                  kv_len.scalar_type() == at::kLong && kv_offset.is_contiguous() && kv_len.is_contiguous() &&
                  kv_offset.numel() == num_seqs && kv_len.numel() == num_seqs,
              "kv_offset and kv_len must be contiguous int64 [num_seqs=", num_seqs, "] on the CPU, got ",
              kv_offset.scalar_type(), " ", kv_offset.sizes(), " and ", kv_len.scalar_type(), " ", kv_len.sizes());
  const int64_t max_blocks = block_table.size(1);
  // positions a table row covers, saturated so that a huge block_size cannot wrap around
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t row_positions = max_blocks > kMax / block_size ? kMax : max_blocks * block_size;
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* offsets = kv_offset.data_ptr<int64_t>();
  const int64_t* lens = kv_len.data_ptr<int64_t>();
  for (int64_t s = 0; s < num_seqs; ++s) {
    const int64_t offset = offsets[s], len = lens[s];
    TORCH_CHECK(offset >= 0, "kv_offset[", s, "] = ", offset, " is negative");
    TORCH_CHECK(len >= 1, "kv_len[", s, "] = ", len, ": a decode attends to at least one position");
    TORCH_CHECK(len <= row_positions && offset <= row_positions - len, "kv_offset[", s, "] + kv_len[", s,
                "] = ", offset, " + ", len, " runs past block_table row ", s, " (", max_blocks, " blocks of ",
                block_size, " positions)");
    for (int64_t b = offset / block_size, last = (offset + len - 1) / block_size; b <= last; ++b) {
      const int64_t id = table[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_table[", s, ", ", b, "] = ", id, " is outside the KV cache's ",
                  num_blocks, " blocks");
    }
  }
}

// out[s] = softmax(q[s] . K^T * scale) V over positions [kv_offset[s], kv_offset[s] + kv_len[s])
// of the concatenated blocks block_table[s, :], where block j holds slots
// [block_table[s, j] * block_size, (block_table[s, j] + 1) * block_size) of the caches.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                                     const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                                     int64_t block_size, double scale, const c10::optional<torch::Tensor>& k_scale,
                                     const c10::optional<torch::Tensor>& v_scale) {
  check_decode_inputs(q, k_cache, v_cache);
  TORCH_CHECK(block_size >= 1, "block_size must be at least 1, got ", block_size);
  check_decode_context(block_table, kv_offset, kv_len, q.size(0), block_size, k_cache.size(0) / block_size);
  return run_decode_attention(q, k_cache, v_cache, block_table, kv_offset, kv_len, block_size, scale, k_scale, v_scale);
}

torch::Tensor paged_decode_attention_checked_context(const torch::Tensor& q, const torch::Tensor& k_cache,
                                                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                                                     const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                                                     int64_t block_size, double scale,
                                                     const c10::optional<torch::Tensor>& k_scale,
                                                     const c10::optional<torch::Tensor>& v_scale) {
  check_decode_inputs(q, k_cache, v_cache);
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0), "block_table ", block_table.sizes(),
              " does not hold a row per sequence of q ", q.sizes());
  return run_decode_attention(q, k_cache, v_cache, block_table, kv_offset, kv_len, block_size, scale, k_scale, v_scale);
}
