// Registers lily._ext.cpu (the CPU backend) on a nanobind module.
#pragma once

#include <nanobind/nanobind.h>

namespace lily::cpu {
void bind(nanobind::module_& m);
}
