// lily._ext._test_engine: the host engine (Device, Buffer, Encoder, events) and, on Linux, the
// fake Metal's controls, bound for tests only.
#pragma once

#include <nanobind/nanobind.h>

namespace lily {

void bind_test_engine(nanobind::module_ m);

}  // namespace lily
