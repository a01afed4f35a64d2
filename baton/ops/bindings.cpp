#include "ops.h"

void bind_fused_decoder(pybind11::module_& m);  // decode.cpp

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
  bind_fused_decoder(m);
}
