#pragma once
// The ops of baton/ops/*.cpp as C++ functions: bound to Python in bindings.cpp and composed by
// the fused decoder's layer steps (fused_decoder.h).
#include <torch/types.h>

#include <string>
#include <vector>

#include "fp8_kv.h"
#include "quant_linear.h"

// Attention of each query row over its context in the paged caches (paged_attention.cpp): one
// decode per block_table row, or (row_seq) the rows of prefill chunks reading one table row each.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                              const torch::Tensor& block_table, const torch::Tensor& kv_offset,
                              const torch::Tensor& kv_len, int64_t block_size, double scale,
                              const c10::optional<torch::Tensor>& k_scale = c10::nullopt,
                              const c10::optional<torch::Tensor>& v_scale = c10::nullopt,
                              const c10::optional<torch::Tensor>& row_seq = c10::nullopt);
// Throws unless block_size >= 1 and each of the num_seqs contexts [kv_offset[s], kv_offset[s] + kv_len[s])
// is non-empty, inside its block_table row, and reads only block ids in [0, num_blocks).
void check_decode_context(const torch::Tensor& block_table, const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                          int64_t num_seqs, int64_t block_size, int64_t num_blocks);
// paged_attention of one decode per table row, for a context that check_decode_context passed with num_blocks at most the
// caches' slots / block_size: a decode step checks its context once, not once per layer.
torch::Tensor paged_decode_attention_checked_context(const torch::Tensor& q, const torch::Tensor& k_cache,
                                                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                                                     const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                                                     int64_t block_size, double scale,
                                                     const c10::optional<torch::Tensor>& k_scale = c10::nullopt,
                                                     const c10::optional<torch::Tensor>& v_scale = c10::nullopt);
int64_t panel_lanes();
torch::Tensor pack_weight_panels(const torch::Tensor& weight);
// x [rows, K] @ W^T (+ bias) where `packed` is float32 panels (pack_weight_panels) or uint8 GGUF
// blocks [N, blocks, block bytes] (quant_linear.h); a row's bits do not depend on the other rows.
torch::Tensor packed_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t n_dim);
// x W^T (+ bias) for a W stacked by rows from parts (each a packed_linear weight of rows[i] outputs,
// n_dim in all): the parts' outputs side by side (a fused projection whose parts ship in different
// GGUF formats; one part is packed_linear itself).
torch::Tensor stacked_linear(const torch::Tensor& x, const std::vector<torch::Tensor>& parts,
                             const std::vector<int64_t>& rows, const c10::optional<torch::Tensor>& bias, int64_t n_dim);

torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                       double eps, double offset);
void rms_norm_heads_(torch::Tensor& x, const torch::Tensor& weight, double eps, double offset);
void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor gated_act(const torch::Tensor& x, bool gelu_tanh);
// silu, sigmoid or softplus of float32 x, an element's bits its value's alone (step_common.cpp)
torch::Tensor pointwise(const torch::Tensor& x, const std::string& op);
// x W^T, each output one dot product in a fixed order: x [rows, k] and W [n, k], or per head
// x [rows, heads, k] and W [heads, n, k] (pointwise.cpp)
torch::Tensor row_linear(const torch::Tensor& x, const torch::Tensor& w);
// a hyper-connection's pre [T, n], post [T, n] and doubly stochastic comb [T, n, n] (pointwise.cpp)
std::vector<torch::Tensor> hc_weights(const torch::Tensor& mixed, const torch::Tensor& base, const torch::Tensor& scale,
                                      int64_t n, int64_t iters, double eps);
// down(relu(up(x) + up_bias)^2) + down_bias over packed weights (mlp_layer.cpp): NemotronH's MLP
torch::Tensor relu2_mlp(const torch::Tensor& x, const torch::Tensor& up, const c10::optional<torch::Tensor>& up_bias,
                        const torch::Tensor& down, const c10::optional<torch::Tensor>& down_bias,
                        int64_t intermediate, int64_t out_features);
// logits[rows[i], t] = -inf wherever bit t of bitmask[i] (int32 words, a bit per token) is clear
void apply_token_bitmask_(torch::Tensor& logits, const torch::Tensor& rows, const torch::Tensor& bitmask);
torch::Tensor empty_huge_pages(int64_t nbytes);
// nbytes zero bytes (uint8) of anonymous memory, the kernel's zero pages resident only once touched (a
// pool costs memory as it fills, not at start); advised as huge pages if `huge_pages`
torch::Tensor zeros_on_demand(int64_t nbytes, bool huge_pages);

// The recurrent-state scan (Gated DeltaNet, Kimi Delta Attention, Mamba2): out [T, H, Dv], state
// [H, Dk, Dv] updated in place; decay [T, H] or [T, H, Dk]; beta [T, H] or none (see recurrent.cpp).
torch::Tensor recurrent_scan_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& decay, const c10::optional<torch::Tensor>& beta,
                              torch::Tensor& state);
// The scan of one token per row (a decode step), row t over the state of its slot slots[t] in
// state [slots, H, Dk, Dv] (each entry contiguous), with recurrent_scan_'s arithmetic per lane:
// q, k [rows, Hk, Dk] and v [rows, H, Dv], each row at any stride and contiguous within (head h
// reads q and k of head h / (H / Hk)); decay [rows, H] or [rows, H, Dk] and beta [rows, H] or
// undefined, contiguous. The steps that call it have checked the shapes; out [rows, H, Dv].
torch::Tensor recurrent_step_(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              const torch::Tensor& decay, const torch::Tensor& beta, torch::Tensor& state,
                              const std::vector<int64_t>& slots);
