// nanobind entry point of lily._ext; binds engine functions and holds no logic.
#include <nanobind/nanobind.h>

#include "engine_test_bindings.h"

#if !defined(__APPLE__)
#include "msl_py.h"
#endif

namespace nb = nanobind;

NB_MODULE(_ext, m) {
  m.doc() = "Lily's compiled engine (private; use the lily package).";
  // Host engine: device, encoder and (on Linux) the fake Metal, for tests only.
  lily::bind_test_engine(m.def_submodule("_test_engine"));
#if defined(__APPLE__)
  m.attr("platform") = "metal";
#else
  m.attr("platform") = "cpu-emulation";
  nb::module_ msl = m.def_submodule("msl");
  msl_py::bind(msl);
#endif
}
