// lily._ext.cuda: the CUDA driver layer (driver.h) for Python; python/lily/cuda.py is the caller.
#pragma once

#include <nanobind/nanobind.h>

namespace lily::cuda {

void bind(nanobind::module_& m);

}  // namespace lily::cuda
