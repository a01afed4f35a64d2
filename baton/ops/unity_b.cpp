// One translation unit for the sources below (see unity_a.cpp).
#include "step_common.cpp"
#include "gdn_layer.cpp"
#include "moe_layer.cpp"
#include "quant_linear.cpp"
