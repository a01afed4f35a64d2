#include <torch/extension.h>

#include "ops.h"

void bind_fused_decoder(pybind11::module_& m);           // fused_decoder.cpp: the program of layer steps
void bind_attention_layer(pybind11::module_& m);         // attention_layer.cpp
void bind_mlp_layer(pybind11::module_& m);               // mlp_layer.cpp
void bind_gdn_layer(pybind11::module_& m);               // gdn_layer.cpp
void bind_moe_layer(pybind11::module_& m);               // moe_layer.cpp
void bind_mla_layer(pybind11::module_& m);               // mla_layer.cpp
void bind_kda_layer(pybind11::module_& m);               // kda_layer.cpp
void bind_mamba_layer(pybind11::module_& m);             // mamba_layer.cpp
void bind_shortconv_layer(pybind11::module_& m);         // shortconv_layer.cpp

// Every op releases the GIL while it runs (its arguments are converted before, its result after),
// so Python threads such as the server's event loop go on meanwhile. No op touches a Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  using release = py::call_guard<py::gil_scoped_release>;
  m.def("paged_attention", &paged_attention, "attention over paged K/V, read in place", py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("kv_offset"), py::arg("kv_len"),
        py::arg("block_size"), py::arg("scale"), py::arg("k_scale") = py::none(), py::arg("v_scale") = py::none(),
        py::arg("row_seq") = py::none(), release());
  m.def("write_kv_fp8", &write_kv_fp8, "K or V into an fp8 cache with per-(block, head) scales", release());
  m.def("read_kv_fp8", &read_kv_fp8, "rows of an fp8 cache as float32", release());
  m.attr("PANEL_LANES") = panel_lanes();
  m.def("pack_weight_panels", &pack_weight_panels, "[N, K] -> [ceil(N/16), K, 16] column panels", release());
  m.def("packed_linear", &packed_linear, "x W^T (+ b) over column panels or GGUF blocks", release());
  m.def("stacked_linear", &stacked_linear, "x W^T (+ b), W stacked by rows from parts", release());
  m.def("dequantize_rows", &dequantize_rows, "rows of a weight in GGUF blocks, as float32", release());
  m.attr("QUANT_KERNELS") = quant_kernels_available();
  m.def("quant_block_values", &quant_block_values, "values per block of a weight in GGUF blocks", release());
  m.def("regroup_blocks", &regroup_blocks, "GGUF blocks regrouped by 8 rows for the integer kernels", release());
  m.def("set_quant_kernel", &set_quant_kernel, "kernel of the GGUF-block linears: float, int8, int8-<isa>");
  m.def("quant_kernel", &quant_kernel, "kernel of the GGUF-block linears in use");
  m.def("rms_norm", &rms_norm, "RMS norm of rows, optionally of residual += x", release());
  m.def("rms_norm_heads_", &rms_norm_heads_, "RMS norm of each head, in place", release());
  m.def("rotary_", &rotary_, "rotary embedding in place", release());
  m.def("gated_act", &gated_act, "act(gate) * up", release());
  m.def("pointwise", &pointwise, "silu, sigmoid or softplus, each element alone", release());
  m.def("row_linear", &row_linear, "x W^T (per head), a fixed order per output", release());
  m.def("hc_weights", &hc_weights, "a hyper-connection's pre, post and Sinkhorn comb weights", release());
  m.def("apply_token_bitmask_", &apply_token_bitmask_, "-inf where a row's token bitmask is clear", release());
  m.def("empty_huge_pages", &empty_huge_pages, "uninitialized bytes on transparent huge pages", release());
  m.def("zeros_on_demand", &zeros_on_demand, "zero bytes, resident once touched", py::arg("nbytes"),
        py::arg("huge_pages") = true, release());
  m.def("recurrent_scan_", &recurrent_scan_, "recurrent-state scan over tokens, state in place", release());
  bind_fused_decoder(m);
  bind_attention_layer(m);
  bind_mlp_layer(m);
  bind_gdn_layer(m);
  bind_moe_layer(m);
  bind_mla_layer(m);
  bind_kda_layer(m);
  bind_mamba_layer(m);
  bind_shortconv_layer(m);
}
