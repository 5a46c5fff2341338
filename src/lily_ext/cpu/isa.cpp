// The instruction set of the CPU kernels' hot loops (cpu_ops.h, set_isa): chosen once at start, the widest the CPU
// has unless LILY_CPU_ISA names one; tests switch it.
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "avx2.h"
#include "cpu_ops.h"

namespace lily::cpu {

namespace {
// Avx2: the AVX2 + FMA loops; Avx512: the same, the GEMV's compiled for AVX-512VL's 32 vector registers.
enum class Isa { Portable, Avx2, Avx512 };
Isa g_isa = Isa::Portable;
}  // namespace

void set_isa(const std::string& name) {
  Isa chosen;
  if (name == "portable") {
    chosen = Isa::Portable;
  } else if (name == "avx2" || name == "avx512") {
    chosen = name == "avx2" ? Isa::Avx2 : Isa::Avx512;
    bool supported = false;
#ifdef LILY_CPU_X86
    __builtin_cpu_init();
    supported = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                (chosen == Isa::Avx2 || (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")));
#endif
    if (!supported) {
      throw std::invalid_argument(chosen == Isa::Avx2
                                      ? "this CPU has no AVX2/FMA; use the 'portable' instruction set"
                                      : "this CPU has no AVX-512F/VL (or no AVX2/FMA); use 'avx2' or 'portable'");
    }
  } else {
    throw std::invalid_argument("CPU instruction set must be 'avx512', 'avx2' or 'portable'; got '" + name + "'");
  }
  g_isa = chosen;
}

std::string isa() {
  switch (g_isa) {
    case Isa::Avx512: return "avx512";
    case Isa::Avx2: return "avx2";
    case Isa::Portable: break;
  }
  return "portable";
}

bool avx2_enabled() { return g_isa != Isa::Portable; }

bool avx512_enabled() { return g_isa == Isa::Avx512; }

namespace {
// Why LILY_CPU_ISA was not taken at start ("" where it was, or is unset): the cpu backend refuses to load with it.
std::string g_environment_refusal;

// The default: the widest set the CPU has (AVX-512, else AVX2), unless LILY_CPU_ISA names one.
const bool g_isa_chosen = [] {
  const char* env = std::getenv("LILY_CPU_ISA");
  if (env && *env) {
    try {
      set_isa(env);
      return true;
    } catch (const std::invalid_argument& e) {  // an unknown or unsupported name: said at load; the widest meanwhile
      g_environment_refusal = "LILY_CPU_ISA='" + std::string(env) + "': " + e.what();
    }
  }
  for (const char* name : {"avx512", "avx2"}) {
    try {
      set_isa(name);
      return true;
    } catch (const std::invalid_argument&) {
    }
  }
  return true;
}();
}  // namespace

std::string isa_environment_refusal() { return g_environment_refusal; }

}  // namespace lily::cpu
