// One translation unit for the sources below (see unity_a.cpp).
#include "fp8_kv.cpp"
#include "mamba_step.cpp"
#include "quant_int.cpp"
