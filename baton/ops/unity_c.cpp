// One translation unit for the sources below (see unity_a.cpp).
#include "fp8_kv.cpp"
#include "mamba_layer.cpp"
#include "shortconv_layer.cpp"
#include "quant_int.cpp"
