// Kernel registry (see registry.h). Filled by static registrars in the generated kernel files.
#include "registry.h"

#include <cstring>

#include "msl_rt.h"

namespace msl_rt {
namespace {

struct Registry {
  std::map<std::string, std::vector<KernelVariant>> kernels[2];
  std::vector<std::string> errors;
};

// Function-local static: registrars in other translation units may run before this file's statics.
Registry& registry() {
  static Registry r;
  return r;
}

bool same_constants(const std::vector<FcState>& a, const std::vector<FcState>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].index != b[i].index || a[i].defined != b[i].defined || a[i].value != b[i].value) return false;
  return true;
}

}  // namespace

KernelRegistrar::KernelRegistrar(const char* host_name, int registry_id, LaunchFn launch, const ParamAttr* attrs,
                                 int n_attrs, std::vector<ParamInfo> params, const FcState* fcs, int n_fcs,
                                 const char* source) {
  Registry& r = registry();
  std::vector<FcState> constants(fcs, fcs + n_fcs);
  for (int id = 0; id < 2; ++id) {
    auto it = r.kernels[id].find(host_name);
    if (it == r.kernels[id].end()) continue;
    for (const KernelVariant& v : it->second) {
      if (same_constants(v.constants, constants) || std::strcmp(v.source, source) != 0) {
        r.errors.push_back(std::string("host name '") + host_name + "' is instantiated twice (" + v.source +
                           " and " + source + ")");
        return;
      }
    }
  }
  (void)n_attrs;  // equals params.size(): checked by a static_assert in MSL_CPU_INSTANTIATE
  r.kernels[registry_id == kTestKernels ? 1 : 0][host_name].push_back(
      KernelVariant{std::move(constants), launch, attrs, std::move(params), source});
}

const std::vector<KernelVariant>* find_kernel(const std::string& name) {
  for (auto& kernels : registry().kernels) {
    auto it = kernels.find(name);
    if (it != kernels.end()) return &it->second;
  }
  return nullptr;
}

const std::vector<std::string>& registration_errors() { return registry().errors; }

std::vector<std::string> registered_names(RegistryId id) {
  std::vector<std::string> names;
  for (auto& kv : registry().kernels[id]) names.push_back(kv.first);
  return names;  // std::map keeps them sorted
}

std::vector<std::string> kernel_names() {
  if (!registration_errors().empty()) throw std::logic_error("MSL harness: " + registration_errors().front());
  return registered_names(kRealKernels);
}

std::vector<std::string> test_kernel_names() { return registered_names(kTestKernels); }

}  // namespace msl_rt
