// Kernel registry of the harness: every instantiated host name, with one entry per function-constant variant.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "msl_rt_kernel.h"

namespace msl_rt {

struct KernelVariant {
  std::vector<FcState> constants;  // the variant's function constants, in declaration order
  LaunchFn launch;
  const ParamAttr* attrs;
  std::vector<ParamInfo> params;   // one per kernel parameter, same order as attrs
  const char* source;              // the .metal file it came from
};

enum RegistryId { kRealKernels = 0, kTestKernels = 1 };

// Variants of `name` (real kernels first, then harness self-test kernels); null if unknown.
const std::vector<KernelVariant>* find_kernel(const std::string& name);
// Problems found while registering (duplicate host names); empty when all is well.
const std::vector<std::string>& registration_errors();
std::vector<std::string> registered_names(RegistryId id);

}  // namespace msl_rt
