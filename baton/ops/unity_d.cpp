// One translation unit for the sources below (see unity_a.cpp).
#include "kda_step.cpp"
#include "mla_step.cpp"
#include "mla_layer.cpp"
#include "recurrent_layers.cpp"
#include "recurrent.cpp"
