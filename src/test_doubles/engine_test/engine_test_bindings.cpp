// Bindings of lily._ext._test_engine (see engine_test_bindings.h); argument conversion only.
#include "engine_test_bindings.h"

#include <nanobind/ndarray.h>
#include <nanobind/stl/array.h>
#include <nanobind/stl/function.h>
#include <nanobind/stl/map.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <memory>
#include <string>
#include <tuple>
#include <variant>
#include <vector>

#include "../../lily_ext/device.h"
#include "../../lily_ext/encoder.h"

#if defined(LILY_METAL_TEST_RUNTIME)
#include "../objc_toy/fake_metal.h"
#include "../objc_toy/objc_toy.h"
#endif

namespace nb = nanobind;
using namespace nb::literals;

namespace lily {
namespace {

// A Buffer that keeps the numpy array it wraps (if any) alive.
struct PyBuffer {
  Buffer buffer;
  nb::object wrapped;
};

using PyRange = std::tuple<const PyBuffer*, size_t, size_t>;  // (buffer, offset, length)

std::vector<BufferRange> to_ranges(const std::vector<PyRange>& ranges) {
  std::vector<BufferRange> out;
  for (const auto& [buffer, offset, length] : ranges) out.push_back({&buffer->buffer, offset, length});
  return out;
}

// One argument: a buffer, (buffer, offset) or bytes for setBytes.
Argument to_argument(nb::handle item, size_t index) {
  if (nb::isinstance<PyBuffer>(item)) return Argument::buffer(nb::cast<const PyBuffer&>(item).buffer);
  if (nb::isinstance<nb::bytes>(item)) {
    nb::bytes data = nb::borrow<nb::bytes>(item);
    return Argument::bytes(data.c_str(), data.size());
  }
  if (nb::isinstance<nb::tuple>(item) && nb::len(item) == 2 && nb::isinstance<PyBuffer>(item[0])) {
    return Argument::buffer(nb::cast<const PyBuffer&>(item[0]).buffer, nb::cast<size_t>(item[1]));
  }
  throw nb::type_error(("arguments[" + std::to_string(index) +
                        "] must be a Buffer, (Buffer, offset) or bytes")
                           .c_str());
}

// {index: bool} -> Bool constants; {index: int} -> Int constants.
std::vector<FunctionConstant> to_constants(const nb::dict& constants) {
  std::vector<FunctionConstant> out;
  for (auto [key, value] : constants) {
    int index = nb::cast<int>(key);
    if (nb::isinstance<nb::bool_>(value)) {
      out.push_back({index, mtl::DataType::Bool, nb::cast<bool>(value) ? 1 : 0});
    } else {
      out.push_back({index, mtl::DataType::Int, nb::cast<int64_t>(value)});
    }
  }
  return out;
}

nb::dict counters_dict(const EncoderCounters& c) {
  nb::dict d;
  d["dispatches"] = c.dispatches;
  d["stages"] = c.stages;
  d["barriers"] = c.barriers;
  d["encoders"] = c.encoders;
  d["bytes_read"] = c.bytes_read;
  d["bytes_written"] = c.bytes_written;
  return d;
}

// Pipeline, Buffer, Event and Device.
void bind_device(nb::module_ m) {
  nb::class_<Pipeline>(m, "Pipeline")
      .def_prop_ro("name", &Pipeline::name)
      .def_prop_ro("max_threads_per_threadgroup", &Pipeline::max_threads_per_threadgroup)
      .def_prop_ro("thread_execution_width", &Pipeline::thread_execution_width);

  nb::class_<PyBuffer>(m, "Buffer")
      .def_prop_ro("length", [](const PyBuffer& b) { return b.buffer.length(); })
      .def_prop_ro("address", [](const PyBuffer& b) { return reinterpret_cast<uintptr_t>(b.buffer.contents()); })
      .def(
          "array",
          [](PyBuffer& b) {
            return nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(b.buffer.contents(), {b.buffer.length()},
                                                                 nb::handle());
          },
          nb::rv_policy::reference_internal, "The contents as a writable uint8 numpy view.");

  nb::class_<Event>(m, "Event")
      .def_prop_ro("value", &Event::value)
      // Without the GIL: a completion handler may need it on another thread meanwhile.
      .def("signal", &Event::signal, "value"_a, nb::call_guard<nb::gil_scoped_release>())
      .def("wait", &Event::wait, "value"_a, "timeout_ms"_a, nb::call_guard<nb::gil_scoped_release>());

  nb::class_<Device>(m, "Device")
      .def(nb::init<const std::string&>(), "kernel_source"_a)
      .def_prop_ro("name", &Device::name)
      .def(
          "pipeline",
          [](Device& d, const std::string& name, const nb::dict& constants) -> const Pipeline& {
            return d.pipeline(name, to_constants(constants));
          },
          "name"_a, "constants"_a = nb::dict(), nb::rv_policy::reference_internal)
      .def("pipeline_cache_stats",
           [](const Device& d) {
             PipelineCacheStats s = d.pipeline_cache_stats();
             return std::make_tuple(s.entries, s.hits, s.misses);
           })
      .def("buffer", [](Device& d, size_t length) { return PyBuffer{d.new_buffer(length), nb::object()}; },
           "length"_a)
      .def(
          "wrap",
          [](Device& d, nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig> array, nb::object owner) {
            return PyBuffer{d.wrap_memory(array.data(), array.shape(0)), owner};
          },
          "array"_a, "owner"_a, "Wraps a page-aligned uint8 array without copying; keeps `owner` alive.")
      .def("event", &Device::new_event);
}

void bind_encoder(nb::module_ m) {
  nb::class_<Encoder>(m, "Encoder")
      .def(
          "__init__",
          [](Encoder* e, Device& d, bool automatic_barriers) {
            new (e) Encoder(d, automatic_barriers ? BarrierPolicy::Automatic : BarrierPolicy::Manual);
          },
          "device"_a, "automatic_barriers"_a = true, nb::keep_alive<1, 2>())
      .def(
          "dispatch",
          [](Encoder& e, const Pipeline& pipeline, const nb::list& arguments,
             std::array<size_t, 3> threadgroups, std::array<size_t, 3> threads,
             const std::vector<PyRange>& reads, const std::vector<PyRange>& writes,
             const std::vector<size_t>& threadgroup_memory) {
            std::vector<Argument> args;
            for (size_t i = 0; i < arguments.size(); ++i) args.push_back(to_argument(arguments[i], i));
            e.dispatch(pipeline, args, {threadgroups[0], threadgroups[1], threadgroups[2]},
                       {threads[0], threads[1], threads[2]}, to_ranges(reads), to_ranges(writes),
                       threadgroup_memory);
          },
          "pipeline"_a, "arguments"_a, "threadgroups"_a, "threads_per_threadgroup"_a, "reads"_a,
          "writes"_a, "threadgroup_memory"_a = std::vector<size_t>())
      .def("barrier", &Encoder::barrier)
      .def("wait_for_event", &Encoder::wait_for_event, "event"_a, "value"_a)
      .def("signal_event", &Encoder::signal_event, "event"_a, "value"_a)
      .def(
          "add_completed_handler",
          [](Encoder& e, nb::callable handler) {
            // The callable is called and dropped on whichever thread finishes the command buffer.
            auto held = std::shared_ptr<nb::callable>(new nb::callable(std::move(handler)), [](nb::callable* c) {
              nb::gil_scoped_acquire gil;
              delete c;
            });
            e.add_completed_handler([held](const std::string& error) {
              nb::gil_scoped_acquire gil;
              try {
                (*held)(error);
              } catch (nb::python_error& failure) {
                failure.discard_as_unraisable("completion handler");
              }
            });
          },
          "handler"_a)
      .def("commit", &Encoder::commit, nb::call_guard<nb::gil_scoped_release>())
      .def("wait", &Encoder::wait, nb::call_guard<nb::gil_scoped_release>())
      .def_prop_ro("counters", [](const Encoder& e) { return counters_dict(e.counters()); });
}

#if defined(LILY_METAL_TEST_RUNTIME)
// The fake Metal's controls and counters.
void bind_fake_metal(nb::module_ m) {
  m.def(
      "set_stage_order",
      [](const std::string& order, uint64_t seed) {
        if (order != "reverse" && order != "shuffle") {
          throw nb::value_error(("order must be 'reverse' or 'shuffle'; got '" + order + "'").c_str());
        }
        fake_metal::set_stage_order(
            order == "reverse" ? fake_metal::StageOrder::Reverse : fake_metal::StageOrder::Shuffle, seed);
      },
      "order"_a, "seed"_a = 0);
  m.def("fake_stats", [] {
    fake_metal::Stats s = fake_metal::stats();
    nb::dict d;
    d["dispatches"] = s.dispatches;
    d["barriers"] = s.barriers;
    d["command_buffers"] = s.command_buffers;
    d["completion_handlers"] = s.completion_handlers;
    return d;
  });
  m.def("reset_fake_stats", &fake_metal::reset_stats);
  m.def("set_tensor_ops", &fake_metal::set_tensor_ops, "supported"_a,
        "Whether the fake device reports the Metal 4 tensor-op family (qmm_nax in prefill GEMMs).");
  m.def("set_kernel_execution", &fake_metal::set_kernel_execution, "execute"_a,
        "False: dispatches are counted, their kernels not run (host-cost measurement).");
  m.def("live_objects", &objc_toy::live_objects, "Toy Objective-C objects alive now.");
}
#endif

}  // namespace

void bind_test_engine(nb::module_ m) {
  m.doc() = "The host engine and the fake Metal, for tests only.";
  bind_device(m);
  bind_encoder(m);
#if defined(LILY_METAL_TEST_RUNTIME)
  bind_fake_metal(m);
#endif
}

}  // namespace lily
