// Types every part of the engine shares, whatever runs the kernels: the error the engine raises and a launch shape.
#pragma once

#include <cstddef>
#include <stdexcept>

namespace lily {

// A failure the engine reports to its caller (Python sees RuntimeError); what() names what was wrong.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A launch shape in Metal's terms: threadgroups per grid, or threads per threadgroup. Laid out as MTLSize (three
// NSUIntegers), so the Metal binding passes it by value as it is.
struct Dim3 {
  size_t width = 1, height = 1, depth = 1;
  size_t count() const { return width * height * depth; }
};

}  // namespace lily
