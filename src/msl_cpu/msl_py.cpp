// lily._ext.msl: turns Python arguments (numpy arrays, bytes) into harness bindings and runs the dispatch.
#include "msl_py.h"

#include <nanobind/stl/array.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <optional>
#include <string>

#include "../lily_ext/py_args.h"
#include "msl_rt.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace msl_py {
namespace {

void dispatch(const std::string& name, nb::list args, std::array<uint32_t, 3> threadgroups,
              std::array<uint32_t, 3> threads_per_threadgroup, std::optional<std::map<int, int64_t>> constants,
              bool random_schedule, bool greedy_simdgroups, uint64_t seed, bool poison_threadgroup_memory, bool guard,
              std::optional<std::vector<size_t>> threadgroup_memory) {
  lily::py_args::BufferArguments<msl_rt::Binding> bound(name, args, "written in place",
                                                        lily::py_args::NotBufferError::ValueError);
  msl_rt::DispatchOptions opts;
  opts.random_schedule = random_schedule;
  opts.greedy_simdgroups = greedy_simdgroups;
  opts.seed = seed;
  opts.poison_threadgroup_memory = poison_threadgroup_memory;
  opts.guard = guard;
  if (threadgroup_memory) opts.threadgroup_memory_lengths = *threadgroup_memory;
  std::map<int, int64_t> fcs = constants ? *constants : std::map<int, int64_t>{};
  nb::gil_scoped_release release;
  msl_rt::dispatch(name, bound.bindings(), threadgroups.data(), threads_per_threadgroup.data(), fcs, opts);
}

}  // namespace

void bind(nb::module_& m) {
  m.doc() = "CPU execution harness for Lily's Metal kernels (tests only; see docs/harness.md).";
  nb::exception<msl_rt::KernelError>(m, "KernelError", PyExc_RuntimeError);
  m.def("kernel_names", &msl_rt::kernel_names, "Every instantiated host name of metal/*.metal, sorted.");
  m.def("executions", &msl_rt::executions, "Runs to completion per kernel host name in this process.");
  m.def("test_kernel_names", &msl_rt::test_kernel_names,
        "Host names of the harness self-test kernels (tests/harness/*.metal), sorted.");
  m.def("dispatch", &dispatch, "name"_a, "args"_a, "threadgroups"_a, "threads_per_threadgroup"_a, nb::kw_only(),
        "constants"_a = nb::none(), "random_schedule"_a = true, "greedy_simdgroups"_a = false, "seed"_a = 0,
        "poison_threadgroup_memory"_a = true, "guard"_a = true, "threadgroup_memory"_a = nb::none(),
        "Run kernel `name` on the CPU. args[i] binds [[buffer(i)]]: a C-contiguous writable numpy array is a\n"
        "device buffer (written in place), bytes are setBytes data. constants maps function-constant index to\n"
        "bool/int. greedy_simdgroups runs one simdgroup's ready threads before any other's (exposes threadgroup-\n"
        "memory races between simdgroups). threadgroup_memory gives the byte length of each [[threadgroup(i)]]\n"
        "parameter.\n"
        "Raises KernelError for barrier divergence, divergent SIMD collectives, deadlock and out-of-bounds\n"
        "writes, ValueError for bad arguments.");
}

}  // namespace msl_py
