// One translation unit for the sources below (see unity_a.cpp).
#include "kda_step.cpp"
#include "mla_step.cpp"
#include "kimi_step.cpp"
#include "kimi_decode.cpp"
#include "recurrent.cpp"
