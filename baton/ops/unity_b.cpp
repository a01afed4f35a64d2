// One translation unit for the sources below (see unity_a.cpp).
#include "step_common.cpp"
#include "gdn_layer.cpp"
#include "moe_step.cpp"
#include "moe_layer.cpp"
#include "sigmoid_route.cpp"
#include "quant_linear.cpp"
