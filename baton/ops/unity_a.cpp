// One translation unit for the sources below: torch's headers are parsed once per unity file, not
// once per source (about 6 s each), which halves a cold build. Sources whose file-local names
// collide go to different unity files. The sources stay separate files, one concept each.
#include "paged_attention.cpp"
#include "linear.cpp"
#include "pointwise.cpp"
#include "fused_decoder.cpp"
#include "attention_layer.cpp"
#include "mlp_layer.cpp"
