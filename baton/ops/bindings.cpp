#include <torch/extension.h>

torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache,
                                     const torch::Tensor& v_cache, const torch::Tensor& block_table,
                                     const torch::Tensor& kv_offset, const torch::Tensor& kv_len,
                                     int64_t block_size, double scale);
torch::Tensor pack_weight_panels(const torch::Tensor& weight);
torch::Tensor panel_linear(const torch::Tensor& x, const torch::Tensor& packed,
                            const c10::optional<torch::Tensor>& bias, int64_t n_dim);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "decode attention over paged K/V, read in place");
  m.def("pack_weight_panels", &pack_weight_panels, "[N, K] -> [ceil(N/16), K, 16] column panels");
  m.def("panel_linear", &panel_linear, "x W^T (+ b) over column panels");
}
