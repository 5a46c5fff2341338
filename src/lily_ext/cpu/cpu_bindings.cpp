// nanobind bindings of the CPU runtime (lily._ext.cpu): conversion only; python/lily/backends/cpu.py and the kernel
// tests' "cpu" device (lily.selftest.device) are the callers.
#include "cpu_bindings.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <memory>

#include "../model.h"
#include "cpu_runtime.h"

namespace nb = nanobind;

namespace lily::cpu {

namespace {

CpuRuntime& cpu_runtime(const Engine& engine) {
  auto* runtime = dynamic_cast<CpuRuntime*>(&engine.runtime());
  if (!runtime) throw nb::value_error("this engine does not run on the cpu runtime");
  return *runtime;
}

// The runtime the kernel tests dispatch on (two threads: the split paths run).
CpuRuntime& test_runtime() {
  static CpuRuntime runtime(2);
  return runtime;
}

// One kernel of the table on arrays in place: args[i] binds [[buffer(i)]] (bytes: the argument struct).
void dispatch(const std::string& kernel, const nb::list& args, const std::tuple<size_t, size_t, size_t>& groups,
              const std::tuple<size_t, size_t, size_t>&, const nb::kwargs&) {
  CpuRuntime& runtime = test_runtime();
  auto graph = std::make_shared<Graph>();
  std::vector<std::unique_ptr<DeviceBuffer>> owned;
  std::vector<DeviceBuffer*> buffers;
  Node node;
  node.kernel = kernel;
  node.groups = {std::get<0>(groups), std::get<1>(groups), std::get<2>(groups)};
  for (nb::handle a : args) {
    NodeArg arg;
    if (nb::isinstance<nb::bytes>(a)) {
      nb::bytes b = nb::borrow<nb::bytes>(a);
      const auto* p = static_cast<const unsigned char*>(static_cast<const void*>(b.c_str()));
      arg.bytes.assign(p, p + b.size());
    } else {
      auto array = nb::cast<nb::ndarray<nb::c_contig, nb::device::cpu>>(a);
      owned.push_back(runtime.wrap(array.data(), array.nbytes()));
      buffers.push_back(owned.back().get());
      arg.buffer = graph->add_buffer("arg", array.nbytes(), BufferRole::Io);
    }
    node.args.push_back(std::move(arg));
  }
  graph->nodes.push_back(std::move(node));
  runtime.submit(runtime.record(graph, 0, 1, buffers, {}), 0)->wait();
}

}  // namespace

void bind(nb::module_& m) {
  m.def("set_isa", &set_isa, nb::arg("name"),
        "Instruction set of the hot loops: 'avx512' (the AVX2 loops, the GEMV's with AVX-512VL's 32 registers: the same "
        "sums), 'avx2' (AVX2 + FMA) or 'portable'; ValueError where the CPU lacks it.");
  m.def("isa", &isa, "The instruction set in use: 'avx512', 'avx2' or 'portable'.");
  m.def("isa_environment_refusal", &isa_environment_refusal,
        "Why LILY_CPU_ISA was not taken at start, naming it; '' where it was taken or is unset.");
  m.def("kernel_names", [] { return test_runtime().kernel_names(); },
        "The kernels the CPU runtime's table runs (sized ones at head dims 64, 128 and 256), sorted.");
  m.def("dispatch", &dispatch, nb::arg("kernel"), nb::arg("args"), nb::arg("threadgroups"),
        nb::arg("threads_per_threadgroup"), nb::arg("options"),
        "Run one kernel of the CPU runtime's table on numpy arrays in place (the harness's calling convention: "
        "args[i] binds [[buffer(i)]], bytes are the argument struct; the grid's width is a row count where the "
        "struct has none; harness options are ignored). RuntimeError names a kernel the table lacks.");
  m.def("threads", [](const Engine& e) { return cpu_runtime(e).threads(); }, nb::arg("engine"),
        "Threads of a cpu-runtime engine.");
  m.def(
      "expert_tokens",
      [](Engine& e, bool reset) {
        CpuRuntime& runtime = cpu_runtime(e);
        const size_t layers = e.config().num_layers(), experts = e.config().num_experts;
        auto* counts = new std::vector<uint64_t>(layers * experts, 0);
        for (size_t l = 0; l < std::min(layers, runtime.expert_tokens().size()); ++l) {
          const std::vector<uint64_t>& row = runtime.expert_tokens()[l];
          std::copy(row.begin(), row.begin() + std::min(row.size(), experts), counts->begin() + l * experts);
        }
        if (reset) runtime.reset_expert_tokens();
        nb::capsule owner(counts, [](void* p) noexcept { delete static_cast<std::vector<uint64_t>*>(p); });
        return nb::ndarray<nb::numpy, uint64_t, nb::ndim<2>>(counts->data(), {layers, experts}, owner);
      },
      nb::arg("engine"), nb::arg("reset") = false,
      "Routed (token, slot) pairs per layer and expert since loading or the last reset, uint64 [layers, experts].");
}

}  // namespace lily::cpu
