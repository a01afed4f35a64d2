#include <torch/extension.h>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                                     const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                                     int64_t block_size, double scale);
int64_t panel_lanes();
torch::Tensor pack_weight_panels(const torch::Tensor& weight);
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t n_dim);

torch::Tensor rms_norm(const torch::Tensor& x, const c10::optional<torch::Tensor>& residual, const torch::Tensor& weight,
                       double eps, double offset);
void rms_norm_heads_(torch::Tensor& x, const torch::Tensor& weight, double eps, double offset);
void rotary_(torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor gated_act(const torch::Tensor& x, bool gelu_tanh);
torch::Tensor empty_huge_pages(int64_t nbytes);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged K/V, read in place");
  m.attr("PANEL_LANES") = panel_lanes();
  m.def("pack_weight_panels", &pack_weight_panels, "[N, K] -> [ceil(N/16), K, 16] column panels");
  m.def("panel_linear", &panel_linear, "x W^T (+ b) over column panels");
  m.def("rms_norm", &rms_norm, "RMS norm of rows, optionally of residual += x");
  m.def("rms_norm_heads_", &rms_norm_heads_, "RMS norm of each head, in place");
  m.def("rotary_", &rotary_, "rotary embedding in place");
  m.def("gated_act", &gated_act, "act(gate) * up");
  m.def("empty_huge_pages", &empty_huge_pages, "uninitialized bytes on transparent huge pages");
}
