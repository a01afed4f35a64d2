// Multi-head latent attention as a layer step of the fused decoder (fused_decoder.h), for decode
// rows (MLAttention.forward, baton/models/mla.py): q (q_proj, or q_a -> its norm -> q_b), rotary
// on q's and kr's rope channels where the model has it, the normed latent and kr (and a sparse-
// attention indexer's key) written to the cache row, the absorbed attention over each row's cached
// latents, or over those its indexer selects (or the layer before it selected: GLM-5's shared
// layers; or a pooled indexer, GLM-5.3-Flash's, from the pools it keeps: PooledIndexer), all as
// MLAttention's very ATen ops so the bits are the same; o_proj. Latents and pooled keys are
// float32 or fp8 (a scale per block), as the KV cache is.
#include "step_common.h"

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

namespace {

struct MlaShape {
  int64_t heads, rank, dn, dr, dv;
  int64_t latent() const { return rank + dr; }  // a cache row: the normed latent c, then kr
};

// A cache of one row per slot ([slots, 1, width]: MLA latents, or a pooled indexer's keys), float32
// or fp8 with a float32 scale per block of `block_size` rows, written and read as the module path's
// LayerKV.write / read_k do (write_kv_fp8 / read_kv_fp8 for fp8, the same functions).
struct PagedRows {
  torch::Tensor cache;
  c10::optional<torch::Tensor> scale;

  void read_args(StepArgs& a, const char* cache_name, const char* scale_name, int64_t width) {
    cache = a.tensor(cache_name);
    TORCH_CHECK(cache.defined() && cache.dim() == 3 && cache.size(1) == 1 && cache.size(2) == width &&
                    cache.stride(2) == 1 && cache.device().is_cpu() &&
                    (cache.scalar_type() == at::kFloat || cache.scalar_type() == at::kFloat8_e4m3fn),
                cache_name, " must be float32 or fp8 [slots, 1, ", width, "], got ",
                cache.defined() ? cache.sizes() : c10::IntArrayRef{});
    if (torch::Tensor t = a.tensor(scale_name); t.defined()) scale = std::move(t);
    TORCH_CHECK(scale.has_value() == (cache.scalar_type() == at::kFloat8_e4m3fn), "an fp8 ", cache_name,
                ", and only one, has scales (", scale_name, ")");
  }
  int64_t slots() const { return cache.size(0); }
  void check(int64_t block_size) const {
    if (scale) check_kv_scales(cache, *scale, block_size);
  }
  void write(const torch::Tensor& rows, const torch::Tensor& slots, int64_t block_size) {
    if (scale) {
      write_kv_fp8(rows.unsqueeze(1), cache, *scale, slots, block_size, false);
    } else {
      cache.select(1, 0).index_copy_(0, slots, rows);
    }
  }
  // the rows at slots (any shape) as float32 [*slots.shape, width]
  torch::Tensor read(const torch::Tensor& slots, int64_t block_size) const {
    if (!scale) return cache.select(1, 0).index({slots});
    std::vector<int64_t> shape(slots.sizes().begin(), slots.sizes().end());
    shape.push_back(cache.size(2));
    return read_kv_fp8(cache, *scale, slots.reshape(-1), block_size).view(shape);
  }
};

// The keys a sparse-attention layer's decode rows read, [rows, k] positions and which are real:
// written by an indexer's step, read by the shared steps after it in the same decode step.
struct Selection {
  torch::Tensor pos, valid;
};

// Each decode row's context positions [n, longest] (within its listed blocks) and which are real.
std::pair<torch::Tensor, torch::Tensor> context(const torch::Tensor& kv_offsets, const torch::Tensor& kv_lens,
                                                int64_t longest) {
  const torch::Tensor l = torch::arange(longest, kv_lens.options()).unsqueeze(0);
  return {l + kv_offsets.unsqueeze(1), l < kv_lens.unsqueeze(1)};
}

// The cache slots of positions `pos` [n, L] (0 where not `valid`), as MLAttention._decode computes them.
torch::Tensor slots_of(const torch::Tensor& pos, const torch::Tensor& valid, const torch::Tensor& block_ids,
                       int64_t block_size) {
  const torch::Tensor block = block_ids.gather(1, at::floor_divide(pos, block_size).clamp_max(block_ids.size(1) - 1));
  return at::where(valid, block * block_size + at::remainder(pos, block_size), 0);
}

// Absorbed attention of q [n, heads, dn + dr] over the cache rows `rows` [n, L, >= rank + dr]
// (`valid` [n, L] the real ones), kv_b [heads * (dn + dv), rank] the plain kv_b_proj weight:
// [n, heads * dv], o_proj's input.
torch::Tensor absorbed(const MlaShape& s, const torch::Tensor& q, torch::Tensor rows, const torch::Tensor& valid,
                       const torch::Tensor& kv_b, double scale) {
  const int64_t n = q.size(0);
  rows = rows.slice(2, 0, s.latent());
  const torch::Tensor w = kv_b.view({s.heads, s.dn + s.dv, s.rank});
  const torch::Tensor w_uk = w.slice(1, 0, s.dn), w_uv = w.slice(1, s.dn);
  const torch::Tensor q_lat = at::einsum("nhd,hdr->nhr", {q.slice(2, 0, s.dn), w_uk});
  torch::Tensor scores = at::einsum("nhc,nlc->nhl", {at::cat({q_lat, q.slice(2, s.dn)}, -1), rows}) * scale;
  scores = scores.masked_fill(valid.unsqueeze(1).logical_not(), -std::numeric_limits<float>::infinity());
  const torch::Tensor o_lat = at::einsum("nhl,nlr->nhr", {scores.softmax(-1), rows.slice(2, 0, s.rank)});
  return at::einsum("nhr,hvr->nhv", {o_lat, w_uv}).contiguous().view({n, s.heads * s.dv});
}

// A layer's lightning indexer (baton/models/indexer.py, Indexer): its queries, head weights and
// key, and each decode row's top-k over the keys cached after the latents. A pooled one (pool > 0,
// PooledIndexer) keeps a row per pool of `pool` tokens in its own group and the open pool's raw
// [k | gate] rows as state (a window of pool - 1 rows per slot, none where pool is 1).
struct IndexerStep {
  int64_t heads = 0, dim = 0, pool = 0;
  StepLinear wq_b, wk, weights;
  torch::Tensor k_norm_weight, k_norm_bias;
  double k_norm_eps = 1e-6;
  StepLinear gate;                          // index_kpool_compress_gate (packed [dim, hidden])
  torch::Tensor ape;                        // index_kpool_compress_ape [pool, dim]
  PagedRows pool_cache;                     // a row per pool: its key
  int64_t pool_group = -1;
  torch::Tensor window, window_checkpoints;  // [slots | checkpoints, pool - 1, 2 dim]

  void read(StepArgs& a, int64_t hidden, int64_t q_lora_rank) {
    heads = a.integer("index_heads"), dim = a.integer("index_dim");
    wq_b = a.linear("index_wq_b", q_lora_rank, heads * dim);
    wk = a.linear("index_wk", hidden, dim);
    weights = a.linear("index_weights", hidden, heads);
    k_norm_weight = a.vector("index_k_norm", dim);
    k_norm_bias = a.vector("index_k_norm_bias", dim);
    k_norm_eps = a.real("index_k_norm_eps");
    if (!a.has("index_pool")) return;
    pool = a.integer("index_pool");
    TORCH_CHECK(pool >= 1, "index_pool must be positive, got ", pool);
    gate = a.linear("index_gate", hidden, dim);
    ape = a.tensor("index_ape");
    check_float(ape, "index_ape");
    TORCH_CHECK(ape.dim() == 2 && ape.size(0) == pool && ape.size(1) == dim && ape.is_contiguous(),
                "index_ape must be contiguous [", pool, ", ", dim, "], got ", ape.sizes());
    pool_cache.read_args(a, "pool_cache", "pool_scale", dim);
    pool_group = a.integer("pool_group");
    TORCH_CHECK(pool_group >= 0, "pool_group must be an index, got ", pool_group);
    if (pool == 1) return;
    window = a.tensor("window_state"), window_checkpoints = a.tensor("window_checkpoints");
    for (const auto& [t, name] :
         {std::pair{&window, "window_state"}, std::pair{&window_checkpoints, "window_checkpoints"}}) {
      check_float(*t, name);
      TORCH_CHECK(t->dim() == 3 && t->size(1) == pool - 1 && t->size(2) == 2 * dim &&
                      (t->size(0) == 0 || t->select(0, 0).is_contiguous()),
                  name, " must be [n, ", pool - 1, ", ", 2 * dim, "], each entry contiguous, got ", t->sizes());
    }
  }

  // PooledIndexer.write_pools for one token per row: the pool a row completes (its pool group's
  // slot_mapping >= 0) written to its pool row, the row's window moved on, its checkpoints taken
  // before (offset 0) or after (offset 1) the token
  void write_pools(const torch::Tensor& raw, const StepBatch& step) {
    const torch::Tensor& slot_mapping = step.slot_mapping[pool_group];
    const int64_t* to = slot_mapping.data_ptr<int64_t>();
    const torch::Tensor ends =  // a completed pool's rows in [window | row], indexed as the module path does
        torch::zeros({1, 1}, slot_mapping.options()) + torch::arange(pool, slot_mapping.options());
    if (pool > 1) snapshot_state(window_checkpoints, window, step, 0);
    for (int64_t r = 0; r < raw.size(0); ++r) {
      torch::Tensor rows = raw.slice(0, r, r + 1), slot_window;
      if (pool > 1) {
        slot_window = window.select(0, step.state_slots[r]);
        rows = at::cat({slot_window, rows});
      }
      if (to[r] >= 0) {
        const torch::Tensor pools = rows.index({ends});  // [1, pool, 2 dim]
        const torch::Tensor w = (pools.slice(2, dim) + ape).softmax(1);
        pool_cache.write((w * pools.slice(2, 0, dim)).sum(1), slot_mapping.slice(0, r, r + 1),
                         step.block_size / pool);
      }
      if (pool > 1) slot_window.copy_(rows.slice(0, 1));
    }
    if (pool > 1) snapshot_state(window_checkpoints, window, step, 1);
  }

  // PooledIndexer._positions: the positions [n, topk + pool - 1] each decode row reads (its top
  // topk / pool pools', then its open pool's) and which are real, from its queries q [n, heads,
  // dim] and head weights w [n, heads]
  std::pair<torch::Tensor, torch::Tensor> pooled_positions(const torch::Tensor& q, const torch::Tensor& w,
                                                           int64_t topk, const StepBatch& step) const {
    const torch::Tensor &lens = step.kv_lens[pool_group], &table = step.block_ids[pool_group];
    const int64_t n = q.size(0), num_pools = lens.max().item<int64_t>() / pool, bs = step.block_size;
    const torch::Tensor first = torch::arange(num_pools, lens.options()) * pool;
    const torch::Tensor blocks = table.index({torch::indexing::Slice(), at::floor_divide(first, bs)});
    const torch::Tensor slots = blocks * (bs / pool) + at::floor_divide(at::remainder(first, bs), pool);
    const torch::Tensor keys = pool_cache.read(slots, bs / pool);  // [n, pools, dim]
    const torch::Tensor pos = lens - 1;
    const torch::Tensor visible = at::floor_divide(pos.unsqueeze(1) + 1, pool);
    const torch::Tensor candidate = torch::arange(num_pools, lens.options()).unsqueeze(0) < visible;
    torch::Tensor per_head = at::matmul(q, keys.transpose(-1, -2)) * std::pow(static_cast<double>(dim), -0.5);
    per_head.relu_();
    const torch::Tensor scores = at::matmul(w.unsqueeze(1), per_head)
                                     .squeeze(1)
                                     .masked_fill(candidate.logical_not(), -std::numeric_limits<float>::infinity());
    const torch::Tensor top = std::get<1>(scores.topk(std::min(topk / pool, num_pools), -1));
    const torch::Tensor within = torch::arange(pool, lens.options());
    const torch::Tensor tail = visible * pool + within.slice(0, 0, pool - 1).unsqueeze(0);
    return {at::cat({(top.unsqueeze(-1) * pool + within).flatten(1), tail}, 1),
            at::cat({candidate.gather(1, top).repeat_interleave(pool, 1), tail <= pos.unsqueeze(1)}, 1)};
  }
};

class MlaStep : public LayerStep {
 public:
  explicit MlaStep(StepArgs& a)
      : s_{a.integer("heads"), a.integer("kv_lora_rank"), a.integer("nope_dim"), a.integer("rope_dim"),
           a.integer("v_dim")},
        hidden_(a.integer("hidden")), q_lora_rank_(a.integer("q_lora_rank")), scale_(a.real("scale")),
        latent_eps_(a.real("latent_eps")), group_(a.integer("group")), rope_(a.integer("rope")),
        topk_(a.integer("topk")) {
    const int64_t q_out = s_.heads * (s_.dn + s_.dr);
    if (q_lora_rank_ > 0) {
      q_a_ = a.linear("q_a", hidden_, q_lora_rank_);
      q_a_norm_ = a.vector("q_a_norm", q_lora_rank_);
      q_b_ = a.linear("q_b", q_lora_rank_, q_out);
    } else {
      q_proj_ = a.linear("q_proj", hidden_, q_out);
    }
    kv_a_ = a.linear("kv_a", hidden_, s_.latent());
    kv_a_norm_ = a.vector("kv_a_norm", s_.rank);
    kv_b_ = a.tensor("kv_b");
    check_float(kv_b_, "kv_b");
    TORCH_CHECK(kv_b_.is_contiguous() && kv_b_.dim() == 2 && kv_b_.size(0) == s_.heads * (s_.dn + s_.dv) &&
                    kv_b_.size(1) == s_.rank,
                "kv_b must be contiguous [", s_.heads * (s_.dn + s_.dv), ", ", s_.rank, "], got ", kv_b_.sizes());
    o_ = a.linear("o_proj", s_.heads * s_.dv, hidden_);
    if (a.has("index_heads")) {
      TORCH_CHECK(q_lora_rank_ > 0, "an indexer reads the q_lora residual");
      index_.read(a, hidden_, q_lora_rank_);
    }
    selection_ = a.object<Selection>("selection");
    TORCH_CHECK(topk_ <= 0 || selection_ != nullptr, "a sparse-attention step needs its selection");
    const int64_t row = s_.latent() + (index_.pool ? 0 : index_.dim);  // a pooled indexer's keys: their own cache
    cache_.read_args(a, "k_cache", "k_scale", row);
    TORCH_CHECK(group_ >= 0, "group must be an index, got ", group_);
  }

  StepNeeds needs() const override {
    StepNeeds n;
    n.kv_group = group_;
    n.kv_slots = cache_.slots();
    if (rope_ >= 0) n.rope = rope_, n.rope_dim = s_.dr;
    if (index_.pool) {
      n.pool_group = index_.pool_group, n.pool_rows = index_.pool_cache.slots(), n.pool = index_.pool;
      if (index_.window.defined()) {
        n.state_slots = index_.window.size(0);
        n.checkpoints = index_.window_checkpoints.size(0);
      }
    }
    return n;
  }

  void check_step(const StepBatch& step) const override {
    cache_.check(step.block_size);
    if (index_.pool) index_.pool_cache.check(step.block_size / index_.pool);
  }

  torch::Tensor run(const torch::Tensor& h, const StepBatch& step, StepStopwatch& watch) override {
    const int64_t n = h.size(0);
    const torch::Tensor q_resid =
        q_lora_rank_ > 0 ? rms_norm(q_a_(h), c10::nullopt, q_a_norm_, latent_eps_, 0.0) : torch::Tensor();
    const torch::Tensor q = (q_lora_rank_ > 0 ? q_b_(q_resid) : q_proj_(h)).view({n, s_.heads, s_.dn + s_.dr});
    const torch::Tensor ckv = kv_a_(h);
    torch::Tensor k_rot = ckv.slice(1, s_.rank).unsqueeze(1);
    const torch::Tensor &block_ids = step.block_ids[group_], &kv_lens = step.kv_lens[group_];
    const int64_t longest = n ? kv_lens.max().item<int64_t>() : 0;
    const bool sparse = topk_ > 0 && longest > topk_;  // else every key is read: no scoring, no queries
    torch::Tensor index_q, index_w, index_k, pool_raw;
    if (index_.dim) {
      index_k = at::layer_norm(index_.wk(h), {index_.dim}, index_.k_norm_weight, index_.k_norm_bias,
                               index_.k_norm_eps);
      if (index_.pool) pool_raw = at::cat({index_k, index_.gate(h)}, -1);
      if (sparse) {
        index_q = index_.wq_b(q_resid).view({n, index_.heads, index_.dim});
        index_w = index_.weights(h) * std::pow(static_cast<double>(index_.heads), -0.5);
      }
    }
    watch.lap(StepPart::kLinears);
    if (rope_ >= 0) {
      const torch::Tensor &cos = step.cos[rope_], &sin = step.sin[rope_];
      torch::Tensor q_rope = q.slice(2, s_.dn);
      rotary_(q_rope, cos, sin);
      k_rot = k_rot.contiguous();
      rotary_(k_rot, cos, sin);
      if (index_.dim && !index_.pool) {
        torch::Tensor ik = index_k.unsqueeze(1).slice(2, 0, s_.dr);
        rotary_(ik, cos, sin);
      }
      if (index_q.defined()) {
        torch::Tensor iq = index_q.slice(2, 0, s_.dr);
        rotary_(iq, cos, sin);
      }
    }
    const torch::Tensor c = rms_norm(ckv.slice(1, 0, s_.rank).contiguous(), c10::nullopt, kv_a_norm_, latent_eps_, 0.0);
    std::vector<torch::Tensor> parts{c, k_rot.select(1, 0)};
    if (index_.dim && !index_.pool) parts.push_back(index_k);
    cache_.write(at::cat(parts, -1), step.slot_mapping[group_], step.block_size);
    if (index_.pool) index_.write_pools(pool_raw, step);
    watch.lap(StepPart::kNorms);
    torch::Tensor pos, valid;
    if (sparse && index_.pool) {  // its own pools' selection
      std::tie(pos, valid) = index_.pooled_positions(index_q, index_w, topk_, step);
    } else if (sparse && !index_.dim) {  // the selection of the indexer layer before: read only those
      pos = selection_->pos, valid = selection_->valid;
    } else {
      std::tie(pos, valid) = context(step.kv_offsets[group_], kv_lens, longest);
    }
    torch::Tensor rows = cache_.read(slots_of(pos, valid, block_ids, step.block_size), step.block_size);
    if (sparse && index_.dim && !index_.pool) {  // scored over every key: the selected rows
      torch::Tensor per_head = at::matmul(index_q, rows.slice(2, s_.latent()).transpose(-1, -2)) *
                               std::pow(static_cast<double>(index_.dim), -0.5);
      per_head.relu_();
      const torch::Tensor scores = at::matmul(index_w.unsqueeze(1), per_head)
                                       .squeeze(1)
                                       .masked_fill(valid.logical_not(), -std::numeric_limits<float>::infinity());
      const torch::Tensor top = std::get<1>(scores.topk(topk_, -1));
      selection_->pos = pos.gather(1, top), selection_->valid = valid.gather(1, top);
      rows = rows.gather(1, top.unsqueeze(-1).expand({-1, -1, rows.size(2)}));
      valid = selection_->valid;
    }
    const torch::Tensor attn = absorbed(s_, q, rows, valid, kv_b_, scale_);
    watch.lap(StepPart::kAttention);
    torch::Tensor o = o_(attn);
    watch.lap(StepPart::kLinears);
    return o;
  }

 private:
  MlaShape s_;
  int64_t hidden_, q_lora_rank_;
  double scale_, latent_eps_;
  int64_t group_, rope_, topk_;  // rope: the rope kind (-1: NoPE); topk: index_topk (0: dense)
  StepLinear q_proj_;            // without a q LoRA
  StepLinear q_a_, q_b_;         // with one (q_lora_rank > 0), and q_a's norm
  torch::Tensor q_a_norm_;
  StepLinear kv_a_;  // kv_a_proj_with_mqa, and kv_a_layernorm
  torch::Tensor kv_a_norm_;
  torch::Tensor kv_b_;  // the plain kv_b_proj weight [heads * (dn + dv), rank]
  StepLinear o_;
  IndexerStep index_;  // dim 0: none (dense, or a shared layer); pool > 0: pooled
  std::shared_ptr<Selection> selection_;
  PagedRows cache_;  // a row per slot: the latent c, kr (and a per-token indexer's key)
};

}  // namespace

void bind_mla_layer(pybind11::module_& m) {
  pybind11::class_<Selection, std::shared_ptr<Selection>>(m, "Selection").def(pybind11::init<>());
  bind_step<MlaStep>(m, "MlaStep");
}
