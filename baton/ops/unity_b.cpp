// One translation unit for the sources below (see unity_a.cpp).
#include "step_common.cpp"
#include "hybrid_decode.cpp"
#include "hybrid_step.cpp"
#include "gdn_step.cpp"
#include "moe_step.cpp"
#include "sigmoid_route.cpp"
#include "quant_linear.cpp"
