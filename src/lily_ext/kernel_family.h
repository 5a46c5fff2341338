// Kernel libraries: one per metal/*.metal file (an op family), compiled separately, so that a family
// that fails to compile on a user's Mac disables only the kernels it instantiates (docs/engine.md).
#pragma once

#include <map>
#include <string>
#include <vector>

namespace lily {

// One family as tools/msl2cpu.py --embed writes it into the extension.
struct EmbeddedKernelFamily {
  const char* name;        // the file's stem ("rms_norm"); "<stem>.tensor_ops" for its Metal 4 tensor-op library
  const char* file;        // "metal/rms_norm.metal"
  const char* source;      // MSL: metal/lily.h, then the file (with #line, so diagnostics name the file)
  unsigned metal_version;  // the __METAL_VERSION__ it is compiled for: 310, or 400 for tensor ops
  const char* kernel_names;  // the host names its source instantiates, space-separated (tools/msl_text.py)
};

struct KernelFamily {
  std::string name;
  std::string file;
  std::string source;
  unsigned metal_version;
  std::vector<std::string> kernel_names;  // sorted; a family whose source is replaced keeps its built names
};

// The families compiled into the extension, in lookup order (each base family before its tensor-op one), with the
// sources of the families named in `sources` replaced (to try a patched kernel without rebuilding; tests break one).
// Throws std::invalid_argument naming an unknown family.
std::vector<KernelFamily> embedded_kernel_families(const std::map<std::string, std::string>& sources = {});

// The language version of Lily's kernel libraries (tools/msl_rules.py BASE_METAL_VERSION).
unsigned base_metal_version();

}  // namespace lily
