// Pounce: one persistent kernel per pass for the Mixture-of-Experts layer on Hopper GPUs.
#pragma once

#include "pounce/config.h"
#include "pounce/error.h"
#include "pounce/fp8.h"
#include "pounce/group.h"
#include "pounce/layer.h"
#include "pounce/shape.h"
#include "pounce/tensor.h"
#include "pounce/version.h"
#include "pounce/workspace.h"
