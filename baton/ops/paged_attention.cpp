// Attention that reads K/V where they live, for decodes and prefill chunks alike: each query row
// attends to positions [kv_offset, kv_offset + kv_len) of the blocks its block_table row lists,
// read in place with an online softmax; no gathered copy, no mask.
//
// One arithmetic per query row, whatever else is in the call: a row's positions are cut on a
// fixed grid of its table row's positions (partitions, folded in order; softmax steps within),
// never on block edges. Rows of one sequence (a prefill chunk) go in tiles of up to kTileRows
// rows that share every K/V row read; a decode's partitions go to different threads. Neither
// changes a row's sums: a prompt's row has the bits a decode at its position has, so a prefix
// hit, a chunk boundary, a recompute after preemption, a verify row or another worker's block
// size changes no bit of a later token.
#include "attention_math.h"
#include "ops.h"

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// The grid of a row's arithmetic, in positions of its table row (the same for every row and block
// size): partitions of kPartition positions, each folded into the row's state in order, and
// online-softmax steps of kStep. Keys are transposed and scored kWindow at a time.
constexpr int64_t kPartition = 256;
constexpr int64_t kStep = 16;
constexpr int64_t kWindow = 64;
constexpr int64_t kTileRows = 16;  // rows of one sequence that share every K/V row read

using namespace paged_attn;

struct Tile {
  int64_t seq, row0, rows;  // query rows [row0, row0 + rows) read block_table row seq
  int64_t part0, part1;     // the partitions any of its rows reads
};
struct Item {
  int64_t tile, h0, part0, part1;  // kv heads [h0, h0 + span), partitions [part0, part1) of a tile
  int64_t cost;                    // positions read, for the order items are taken in
};

template <typename scalar_t, typename cache_t>
void attention_impl(torch::Tensor& out, const torch::Tensor& q, const torch::Tensor& k_cache,
                    const torch::Tensor& v_cache, const torch::Tensor& block_table, const int64_t* row_seq,
                    const torch::Tensor& kv_offset, const torch::Tensor& kv_len, int64_t block_size, double scale,
                    const float* k_scales, const float* v_scales) {
  const int64_t num_rows = q.size(0), num_heads = q.size(1), d = q.size(2);
  const int64_t num_kv_heads = k_cache.size(1), group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_table.size(1), bs = block_size;
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
  auto seq_of = [&](int64_t row) { return row_seq ? row_seq[row] : row; };

  std::vector<Tile> tiles;
  int64_t tile_rows = 1;  // rows of the largest tile
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t p0 = offsets[r] / kPartition, p1 = (offsets[r] + lens[r] - 1) / kPartition + 1;
    if (tiles.empty() || tiles.back().seq != seq_of(r) || tiles.back().rows == kTileRows)
      tiles.push_back({seq_of(r), r, 0, p0, p1});
    Tile& t = tiles.back();
    t.rows += 1;
    t.part0 = std::min(t.part0, p0), t.part1 = std::max(t.part1, p1);
    tile_rows = std::max(tile_rows, t.rows);
  }
  // A tile of one row (a decode) spreads its partitions over the threads, a long context's
  // latency at one sequence; their states are folded after. An item reads whole cache rows, front
  // to back (a head's slice of each row alone is a strided read the prefetcher does not follow),
  // unless there are fewer items than threads: then kv heads go to different items too, in as few
  // spans as give every thread one.
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> split_base(tiles.size() + 1, 0);  // a split tile's partition states start here
  int64_t whole_row_items = 0;
  for (size_t t = 0; t < tiles.size(); ++t) {
    const Tile& tile = tiles[t];
    const bool split = tile.rows == 1 && tile.part1 - tile.part0 > 1;
    split_base[t + 1] = split_base[t] + (split ? tile.part1 - tile.part0 : 0);
    whole_row_items += split ? tile.part1 - tile.part0 : 1;
  }
  int64_t spans = 1;  // a divisor of num_kv_heads
  while (spans < num_kv_heads && whole_row_items * spans < threads)
    for (++spans; num_kv_heads % spans != 0;) ++spans;
  const int64_t span = num_kv_heads / spans;
  std::vector<Item> items;
  for (size_t t = 0; t < tiles.size(); ++t) {
    const Tile& tile = tiles[t];
    const bool split = split_base[t + 1] > split_base[t];
    for (int64_t s = 0; s < spans; ++s) {
      if (split) {
        for (int64_t k = tile.part0; k < tile.part1; ++k)
          items.push_back({static_cast<int64_t>(t), s * span, k, k + 1, kPartition});
      } else {
        int64_t cost = 0;
        for (int64_t r = tile.row0; r < tile.row0 + tile.rows; ++r) cost += lens[r];
        items.push_back({static_cast<int64_t>(t), s * span, tile.part0, tile.part1, cost});
      }
    }
  }
  const int64_t num_split = split_base.back();
  std::vector<float> split_acc(num_split * num_heads * d), split_max(num_split * num_heads),
      split_sum(num_split * num_heads);
  std::vector<int64_t> order(items.size());  // the longest first, then dynamically: the threads end together
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return items[a].cost > items[b].cost; });

  // out[row, h] = acc / sum
  auto write_out = [&](int64_t row, int64_t h, const float* acc, float sum) {
    scalar_t* dst = out_ptr + row * os0 + h * os1;
    const float inv = 1.f / sum;
    for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<scalar_t>(acc[i] * inv);
  };

  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    const int64_t most = tile_rows * span * group;  // query heads of an item
    std::vector<float> qf(most * d), scores(most * kWindow), kt(d * kWindow), rows_buf(kWindow * d);
    std::vector<float> part_max(most), part_sum(most), part_acc(most * d);
    std::vector<float> run_max(most), run_sum(most), run_acc(most * d);
    std::vector<const float*> v_rows(kWindow), q_rows(most), weights(group);
    std::vector<float*> score_rows(most), acc_rows(group);
    std::vector<float> correction(group);
    std::vector<int64_t> first(tile_rows), last(tile_rows), active(tile_rows);
    std::vector<int64_t> win_block(2 * kWindow), win_slot(2 * kWindow);
    for (int64_t taken; (taken = next.fetch_add(1)) < static_cast<int64_t>(items.size());) {
      const Item& item = items[order[taken]];
      const Tile& tile = tiles[item.tile];
      const bool split = split_base[item.tile + 1] > split_base[item.tile];
      const int64_t nq = tile.rows * span * group;  // query head (r, h, j) at (r * span + h) * group + j
      const int64_t* blocks = table + tile.seq * max_blocks;
      for (int64_t r = 0; r < tile.rows; ++r)
        for (int64_t h = 0; h < span; ++h)
          for (int64_t j = 0; j < group; ++j) {
            const scalar_t* src = q_ptr + (tile.row0 + r) * qs0 + ((item.h0 + h) * group + j) * qs1;
            float* dst = &qf[((r * span + h) * group + j) * d];
            for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]) * fscale;
          }
      for (int64_t part = item.part0; part < item.part1; ++part) {
        // each row's positions [first, last) in this partition
        int64_t lo_all = std::numeric_limits<int64_t>::max(), hi_all = 0;
        for (int64_t r = 0; r < tile.rows; ++r) {
          const int64_t row = tile.row0 + r;
          first[r] = std::max(offsets[row], part * kPartition);
          last[r] = std::min(offsets[row] + lens[row], (part + 1) * kPartition);
          if (first[r] < last[r]) lo_all = std::min(lo_all, first[r]), hi_all = std::max(hi_all, last[r]);
        }
        if (hi_all == 0) continue;  // no row reads this partition (a gap between rows' windows)
        std::fill(part_max.begin(), part_max.begin() + nq, -std::numeric_limits<float>::infinity());
        std::fill(part_sum.begin(), part_sum.begin() + nq, 0.f);
        std::fill(part_acc.begin(), part_acc.begin() + nq * d, 0.f);
        for (int64_t w0 = lo_all / kWindow * kWindow; w0 < hi_all; w0 += kWindow) {
          const int64_t w_lo = std::max(w0, lo_all), w_hi = std::min(w0 + kWindow, hi_all);
          int64_t n_active = 0;  // rows that read this window
          for (int64_t r = 0; r < tile.rows; ++r)
            if (std::max(first[r], w0) < std::min(last[r], w0 + kWindow)) active[n_active++] = r;
          if (n_active == 0) continue;
          // the block and cache slot of each position of this window and the next, a division per block
          const int64_t ahead = std::min(w_hi + kWindow, hi_all);
          for (int64_t pos = w_lo; pos < ahead;) {
            const int64_t b = pos / bs, run = std::min(ahead, (b + 1) * bs) - pos;
            for (int64_t k = 0; k < run; ++k)
              win_block[pos - w0 + k] = blocks[b], win_slot[pos - w0 + k] = blocks[b] * bs + pos - b * bs + k;
            pos += run;
          }
          for (int64_t pos = w_hi; pos < ahead; ++pos)  // the next window, ahead of use
            for (int64_t h = item.h0; h < item.h0 + span; ++h)
              prefetch_rows(k_ptr + win_slot[pos - w0] * ks0 + h * ks1, v_ptr + win_slot[pos - w0] * vs0 + h * vs1,
                            ks0, vs0, 1, d);
          for (int64_t h = 0; h < span; ++h) {
            const int64_t kv_head = item.h0 + h;
            // the window's keys [w_lo, w_hi) of this head transposed, kt[i * kWindow + pos - w0], a
            // run of slots of one block at a time (the lanes of other keys hold what they held:
            // their scores are computed and never read)
            for (int64_t pos = w_lo; pos < w_hi;) {
              const int64_t run = std::min(w_hi, (pos / bs + 1) * bs) - pos;
              const float k_scale = k_scales ? k_scales[win_block[pos - w0] * num_kv_heads + kv_head] : 1.f;
              transpose_keys(k_ptr + win_slot[pos - w0] * ks0 + kv_head * ks1, ks0, &kt[pos - w0], kWindow, run, d,
                             k_scale, rows_buf.data());
              pos += run;
            }
            int64_t n = 0;
            for (int64_t a = 0; a < n_active; ++a)
              for (int64_t j = 0; j < group; ++j) {
                const int64_t qi = (active[a] * span + h) * group + j;
                q_rows[n] = &qf[qi * d];
                score_rows[n++] = &scores[qi * kWindow];
              }
            block_scores(q_rows.data(), score_rows.data(), n, kt.data(), kWindow, (w_lo - w0) / kVecLanes,
                         (w_hi - w0 + kVecLanes - 1) / kVecLanes, d);
            for (int64_t pos = w_lo; pos < w_hi; ++pos) {
              const float v_scale = v_scales ? v_scales[win_block[pos - w0] * num_kv_heads + kv_head] : 1.f;
              v_rows[pos - w0] =
                  as_float(v_ptr + win_slot[pos - w0] * vs0 + kv_head * vs1, &rows_buf[(pos - w0) * d], d, v_scale);
            }
            // one online-softmax step per kStep positions of the grid, for each row that reads it
            for (int64_t s0 = w0; s0 < w_hi; s0 += kStep) {
              for (int64_t a = 0; a < n_active; ++a) {
                const int64_t r = active[a];
                const int64_t p0 = std::max(first[r], s0), p1 = std::min(last[r], s0 + kStep);
                if (p0 >= p1) continue;
                for (int64_t j = 0; j < group; ++j) {
                  const int64_t qi = (r * span + h) * group + j;
                  float* sc = &scores[qi * kWindow + p0 - w0];
                  // rescale what was accumulated when a step raises the running max (by exp(-inf)
                  // = 0 on the first step; by exactly 1, skipped, where it stays)
                  const float m = std::max(part_max[qi], max_of(sc, p1 - p0));
                  correction[j] = m == part_max[qi] ? 1.f : std::exp(part_max[qi] - m);
                  part_max[qi] = m;
                  part_sum[qi] = std::fma(part_sum[qi], correction[j], exp_sub_sum(sc, m, p1 - p0));
                  acc_rows[j] = &part_acc[qi * d];
                  weights[j] = sc;
                }
                block_values(acc_rows.data(), correction.data(), weights.data(), &v_rows[p0 - w0], group, p1 - p0, d);
              }
            }
          }
        }
        if (split) {  // a decode's partition: folded after
          const int64_t at = (split_base[item.tile] + part - tile.part0) * num_heads + item.h0 * group;
          std::copy(part_max.begin(), part_max.begin() + nq, &split_max[at]);
          std::copy(part_sum.begin(), part_sum.begin() + nq, &split_sum[at]);
          std::copy(part_acc.begin(), part_acc.begin() + nq * d, &split_acc[at * d]);
          continue;
        }
        for (int64_t r = 0; r < tile.rows; ++r) {
          if (first[r] >= last[r]) continue;  // the row does not read this partition
          const bool row_first = part == offsets[tile.row0 + r] / kPartition;
          for (int64_t qi = r * span * group; qi < (r + 1) * span * group; ++qi) {
            if (row_first) {
              run_max[qi] = part_max[qi], run_sum[qi] = part_sum[qi];
              std::copy(&part_acc[qi * d], &part_acc[(qi + 1) * d], &run_acc[qi * d]);
            } else {
              fold(run_max[qi], run_sum[qi], &run_acc[qi * d], part_max[qi], part_sum[qi], &part_acc[qi * d], d);
            }
          }
        }
      }
      if (split) continue;
      for (int64_t r = 0; r < tile.rows; ++r)
        for (int64_t h = 0; h < span; ++h)
          for (int64_t j = 0; j < group; ++j) {
            const int64_t qi = (r * span + h) * group + j;
            write_out(tile.row0 + r, (item.h0 + h) * group + j, &run_acc[qi * d], run_sum[qi]);
          }
    }
  });
  // a decode's partitions, folded in order as an item folds its own
  std::vector<float> acc(d);
  for (size_t t = 0; t < tiles.size(); ++t) {
    for (int64_t h = 0; h < num_heads && split_base[t + 1] > split_base[t]; ++h) {
      const int64_t at = split_base[t] * num_heads + h;
      float max = split_max[at], sum = split_sum[at];
      std::copy(&split_acc[at * d], &split_acc[(at + 1) * d], acc.data());
      for (int64_t k = 1; k < tiles[t].part1 - tiles[t].part0; ++k) {
        const int64_t p = (split_base[t] + k) * num_heads + h;
        fold(max, sum, acc.data(), split_max[p], split_sum[p], &split_acc[p * d], d);
      }
      write_out(tiles[t].row0, h, acc.data(), sum);
    }
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

torch::Tensor run_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                            const torch::Tensor& block_table, const int64_t* row_seq, const torch::Tensor& kv_offset,
                            const torch::Tensor& kv_len, int64_t block_size, double scale,
                            const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale) {
  const auto [ks, vs] = kv_scales(k_cache, v_cache, k_scale, v_scale, block_size);
  auto out = torch::empty_like(q, at::MemoryFormat::Contiguous);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention_q", [&] {
    using q_t = scalar_t;
    if (ks != nullptr) {
      attention_impl<q_t, uint8_t>(out, q, k_cache, v_cache, block_table, row_seq, kv_offset, kv_len, block_size,
                                   scale, ks, vs);
      return;
    }
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "paged_attention_kv", [&] {
      attention_impl<q_t, scalar_t>(out, q, k_cache, v_cache, block_table, row_seq, kv_offset, kv_len, block_size,
                                    scale, nullptr, nullptr);
    });
  });
  return out;
}

}  // namespace

// Checks the metadata of attention over a cache of num_blocks blocks, before a kernel reads through
// it: row t reads positions [kv_offset[t], kv_offset[t] + kv_len[t]) of block_table row row_seq[t]
// (row t where row_seq is null), and every block id read must name a block of the cache. A loop
// over the table entries read (once per table row, however many rows read it), a fraction of
// what the kernel reads.
void check_attention_context(const torch::Tensor& block_table, const int64_t* row_seq, const torch::Tensor& kv_offset,
                             const torch::Tensor& kv_len, int64_t num_rows, int64_t block_size, int64_t num_blocks) {
  TORCH_CHECK(block_size >= 1, "block_size must be at least 1, got ", block_size);
  TORCH_CHECK(block_table.device().is_cpu() && block_table.scalar_type() == at::kLong && block_table.is_contiguous() &&
                  block_table.dim() == 2 && (row_seq != nullptr || block_table.size(0) == num_rows),
              "block_table must be contiguous int64 [num_seqs", row_seq ? "" : "=" + std::to_string(num_rows),
              ", max_blocks] on the CPU, got ", block_table.scalar_type(), " ", block_table.sizes());
  TORCH_CHECK(kv_offset.device().is_cpu() && kv_len.device().is_cpu() && kv_offset.scalar_type() == at::kLong &&
                  kv_len.scalar_type() == at::kLong && kv_offset.is_contiguous() && kv_len.is_contiguous() &&
                  kv_offset.numel() == num_rows && kv_len.numel() == num_rows,
              "kv_offset and kv_len must be contiguous int64 [num_rows=", num_rows, "] on the CPU, got ",
              kv_offset.scalar_type(), " ", kv_offset.sizes(), " and ", kv_len.scalar_type(), " ", kv_len.sizes());
  const int64_t num_seqs = block_table.size(0), max_blocks = block_table.size(1);
  // positions a table row covers, saturated so that a huge block_size cannot wrap around
  constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
  const int64_t row_positions = max_blocks > kMax / block_size ? kMax : max_blocks * block_size;
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* offsets = kv_offset.data_ptr<int64_t>();
  const int64_t* lens = kv_len.data_ptr<int64_t>();
  std::vector<int64_t> seq_first(num_seqs, kMax), seq_end(num_seqs, 0);  // positions any row reads, per table row
  for (int64_t t = 0; t < num_rows; ++t) {
    const int64_t s = row_seq ? row_seq[t] : t, offset = offsets[t], len = lens[t];
    TORCH_CHECK(s >= 0 && s < num_seqs, "row_seq[", t, "] = ", s, " is not a row of the ", num_seqs,
                "-row block_table");
    TORCH_CHECK(offset >= 0, "kv_offset[", t, "] = ", offset, " is negative");
    TORCH_CHECK(len >= 1, "kv_len[", t, "] = ", len, ": a query attends to at least one position");
    TORCH_CHECK(len <= row_positions && offset <= row_positions - len, "kv_offset[", t, "] + kv_len[", t, "] = ",
                offset, " + ", len, " runs past block_table row ", s, " (", max_blocks, " blocks of ", block_size,
                " positions)");
    seq_first[s] = std::min(seq_first[s], offset);
    seq_end[s] = std::max(seq_end[s], offset + len);
  }
  for (int64_t s = 0; s < num_seqs; ++s) {
    for (int64_t b = seq_first[s] / block_size; seq_end[s] > 0 && b <= (seq_end[s] - 1) / block_size; ++b) {
      const int64_t id = table[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block_table[", s, ", ", b, "] = ", id, " is outside the KV cache's ",
                  num_blocks, " blocks");
    }
  }
}

void check_decode_context(const torch::Tensor& block_table, const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                          int64_t num_seqs, int64_t block_size, int64_t num_blocks) {
  check_attention_context(block_table, nullptr, kv_offset, kv_len, num_seqs, block_size, num_blocks);
}

// out[t] = softmax(q[t] . K^T * scale) V over positions [kv_offset[t], kv_offset[t] + kv_len[t])
// of the concatenated blocks of block_table row row_seq[t] (row t when row_seq is absent: one
// decode per row), where block j holds slots [block_table[s, j] * block_size, (block_table[s, j]
// + 1) * block_size) of the caches. Rows of one table row are a prefill chunk's queries.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_table, const torch::Tensor& kv_offset,
                              const torch::Tensor& kv_len, int64_t block_size, double scale,
                              const c10::optional<torch::Tensor>& k_scale, const c10::optional<torch::Tensor>& v_scale,
                              const c10::optional<torch::Tensor>& row_seq) {
  check_decode_inputs(q, k_cache, v_cache);
  const int64_t* seqs = nullptr;
  if (row_seq.has_value()) {
    TORCH_CHECK(row_seq->device().is_cpu() && row_seq->scalar_type() == at::kLong && row_seq->is_contiguous() &&
                    row_seq->numel() == q.size(0),
                "row_seq must be contiguous int64 [num_rows=", q.size(0), "] on the CPU, got ",
                row_seq->scalar_type(), " ", row_seq->sizes());
    seqs = row_seq->data_ptr<int64_t>();
  }
  TORCH_CHECK(block_size >= 1, "block_size must be at least 1, got ", block_size);
  check_attention_context(block_table, seqs, kv_offset, kv_len, q.size(0), block_size, k_cache.size(0) / block_size);
  return run_attention(q, k_cache, v_cache, block_table, seqs, kv_offset, kv_len, block_size, scale, k_scale, v_scale);
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
  return run_attention(q, k_cache, v_cache, block_table, nullptr, kv_offset, kv_len, block_size, scale, k_scale,
                       v_scale);
}
