// Python face of the MSL CPU harness: the lily._ext.msl submodule (bound in src/lily_ext/bindings.cpp).
#pragma once

#include <nanobind/nanobind.h>

namespace msl_py {

// Adds kernel_names, test_kernel_names, dispatch and KernelError to `m`.
void bind(nanobind::module_& m);

}  // namespace msl_py
