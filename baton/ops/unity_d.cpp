// One translation unit for the sources below (see unity_a.cpp).
#include "kda_layer.cpp"
#include "mla_layer.cpp"
#include "recurrent.cpp"
