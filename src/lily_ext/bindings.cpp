// nanobind entry point of lily._ext; binds engine functions and holds no logic.
#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_ext, m) {
  m.doc() = "Lily's compiled engine (private; use the lily package).";
#if defined(__APPLE__)
  m.attr("platform") = "metal";
#else
  m.attr("platform") = "cpu-emulation";
#endif
}
