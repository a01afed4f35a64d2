// Decode attention that reads K/V where they live: each sequence's block table is walked
// block by block with an online softmax, so no gathered copy of the context and no mask.
// The query heads of a kv head (GQA) share every K/V row read.
#include "cpu_vec.h"

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
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
  float total = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, sum);
  for (; i < n; ++i) total += (x[i] = std::exp(x[i] - m));
  return total;
}

// Ask for a block's K and V rows of one head ahead of use: walking block tables is a chain of
// short strided reads the hardware prefetcher does not run ahead of (a cold cache read at ~7 GB/s).
template <typename cache_t>
inline void prefetch_rows(const cache_t* k, const cache_t* v, int64_t k_stride, int64_t v_stride, int64_t rows,
                          int64_t d) {
  const int64_t bytes = d * static_cast<int64_t>(sizeof(cache_t));
  for (int64_t r = 0; r < rows; ++r) {
    const char* kr = reinterpret_cast<const char*>(k + r * k_stride);
    const char* vr = reinterpret_cast<const char*>(v + r * v_stride);
    for (int64_t off = 0; off < bytes; off += 64) {
      __builtin_prefetch(kr + off);
      __builtin_prefetch(vr + off);
    }
  }
}

// A cache row as float: the row itself for a float32 cache, else converted into buf.
template <typename cache_t>
inline const float* as_float(const cache_t* row, float* buf, int64_t d) {
  if constexpr (std::is_same_v<cache_t, float>) {
    return row;
  } else {
    for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(row[i]);
    return buf;
  }
}

template <typename scalar_t, typename cache_t>
void decode_attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, const torch::Tensor& block_table,
                           const torch::Tensor& kv_offset, const torch::Tensor& kv_len, int64_t block_size,
                           double scale) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1);
  const scalar_t* q_ptr = q.data_ptr<scalar_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const cache_t* k_ptr = k_cache.data_ptr<cache_t>();
  const cache_t* v_ptr = v_cache.data_ptr<cache_t>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* offsets = kv_offset.data_ptr<int64_t>();
  const int64_t* lens = kv_len.data_ptr<int64_t>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k_cache.stride(0), ks1 = k_cache.stride(1);
  const int64_t vs0 = v_cache.stride(0), vs1 = v_cache.stride(1);
  const int64_t os0 = out.stride(0), os1 = out.stride(1);
  const float fscale = static_cast<float>(scale);

  // A work item is a sequence with all its kv heads (whole cache rows, read front to back) when
  // there are sequences enough for every thread; otherwise one kv head of a sequence.
  const int64_t spans = num_seqs >= at::get_num_threads() ? 1 : num_kv_heads;
  const int64_t span_heads = num_kv_heads / spans, nq = span_heads * group;
  at::parallel_for(0, num_seqs * spans, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(nq * head_dim), acc(nq * head_dim), scores(nq * block_size), row(head_dim);
    std::vector<float> row_max(nq), row_sum(nq), correction(nq);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / spans, h0 = item % spans * span_heads;  // kv heads [h0, h0 + span_heads)
      for (int64_t j = 0; j < nq; ++j) {  // query head h0 * group + j
        const scalar_t* src = q_ptr + seq * qs0 + (h0 * group + j) * qs1;
        for (int64_t i = 0; i < head_dim; ++i) qf[j * head_dim + i] = static_cast<float>(src[i]) * fscale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(row_max.begin(), row_max.end(), -std::numeric_limits<float>::infinity());
      std::fill(row_sum.begin(), row_sum.end(), 0.f);
      // positions [first, last) of the sequence's blocks, counted from its first block's start
      const int64_t first = offsets[seq], last = first + lens[seq];
      for (int64_t b = first / block_size; b * block_size < last; ++b) {
        const int64_t base = table[seq * max_blocks + b] * block_size;
        const int64_t lo = std::max(first - b * block_size, int64_t(0));
        const int64_t hi = std::min(last - b * block_size, block_size);
        if ((b + 1) * block_size < last) {
          const int64_t next = table[seq * max_blocks + b + 1] * block_size;
          for (int64_t h = h0; h < h0 + span_heads; ++h)
            prefetch_rows(k_ptr + next * ks0 + h * ks1, v_ptr + next * vs0 + h * vs1, ks0, vs0, block_size, head_dim);
        }
        for (int64_t p = lo; p < hi; ++p) {
          for (int64_t h = 0; h < span_heads; ++h) {
            const float* k = as_float(k_ptr + (base + p) * ks0 + (h0 + h) * ks1, row.data(), head_dim);
            for (int64_t j = h * group; j < (h + 1) * group; ++j)
              scores[j * block_size + p] = dot(&qf[j * head_dim], k, head_dim);
          }
        }
        // online softmax: rescale what was accumulated when a block raises the running max
        for (int64_t j = 0; j < nq; ++j) {
          float* sc = &scores[j * block_size];
          const float m = std::max(row_max[j], *std::max_element(sc + lo, sc + hi));
          correction[j] = std::exp(row_max[j] - m);  // exp(-inf) = 0 on the first block
          row_max[j] = m;
          row_sum[j] = row_sum[j] * correction[j] + exp_sub_sum(sc + lo, m, hi - lo);
        }
        for (int64_t p = lo; p < hi; ++p) {
          for (int64_t h = 0; h < span_heads; ++h) {
            const float* v = as_float(v_ptr + (base + p) * vs0 + (h0 + h) * vs1, row.data(), head_dim);
            for (int64_t j = h * group; j < (h + 1) * group; ++j)
              scale_axpy(&acc[j * head_dim], p == lo ? correction[j] : 1.f, scores[j * block_size + p], v, head_dim);
          }
        }
      }
      for (int64_t j = 0; j < nq; ++j) {
        scalar_t* dst = out_ptr + seq * os0 + (h0 * group + j) * os1;
        const float inv = 1.f / row_sum[j];
        for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<scalar_t>(acc[j * head_dim + i] * inv);
      }
    }
  });
}

}  // namespace

// out[s] = softmax(q[s] . K^T * scale) V over positions [kv_offset[s], kv_offset[s] + kv_len[s])
// of the concatenated blocks block_table[s, :], where block j holds slots
// [block_table[s, j] * block_size, (block_table[s, j] + 1) * block_size) of the caches.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                                     const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                                     int64_t block_size, double scale) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 3 && v_cache.dim() == 3, "q, k_cache, v_cache must be 3-D");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(2) == 1 && v_cache.stride(2) == 1, "head_dim must be contiguous");
  TORCH_CHECK(k_cache.sizes() == v_cache.sizes() && k_cache.strides() == v_cache.strides(), "k/v caches differ");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k/v cache dtypes differ");
  TORCH_CHECK(q.size(2) == k_cache.size(2) && q.size(1) % k_cache.size(1) == 0, "head shapes do not match");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && block_table.is_contiguous() && block_table.dim() == 2 &&
                  block_table.size(0) == q.size(0),
              "block_table must be contiguous int64 [num_seqs, max_blocks]");
  TORCH_CHECK(kv_offset.scalar_type() == at::kLong && kv_len.scalar_type() == at::kLong && kv_offset.is_contiguous() &&
                  kv_len.is_contiguous() && kv_offset.numel() == q.size(0) && kv_len.numel() == q.size(0),
              "kv_offset and kv_len must be contiguous int64 [num_seqs]");
  auto out = torch::empty_like(q, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode_attention_q", [&] {
    using q_t = scalar_t;
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_decode_attention_kv", [&] {
      decode_attention_impl<q_t, scalar_t>(out, q, k_cache, v_cache, block_table, kv_offset, kv_len, block_size,
                                           scale);
    });
  });
  return out;
}

