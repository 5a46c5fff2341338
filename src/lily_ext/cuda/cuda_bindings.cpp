// lily._ext.cuda (see cuda_bindings.h): conversion between Python values and the driver layer, plus the harness's
// one-kernel `dispatch` convention (numpy arrays are device buffers copied in and back, bytes are setBytes data).
#include "cuda_bindings.h"

#include <nanobind/stl/array.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <memory>
#include <mutex>
#include <optional>

#include "driver.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace lily::cuda {

namespace {

using Shape = std::array<uint32_t, 3>;
using Lengths = std::optional<std::vector<uint32_t>>;

Dim3 dim3(const Shape& s) { return Dim3{s[0], s[1], s[2]}; }
CUstream stream_of(uintptr_t handle) { return reinterpret_cast<CUstream>(handle); }

// A C-contiguous Python buffer: writable (copied back after a dispatch) where it allows, else read-only.
class BufferView {
 public:
  BufferView(nb::handle obj, const std::string& what) {
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) == 0) {
      writable_ = true;
      return;
    }
    PyErr_Clear();
    if (PyObject_GetBuffer(obj.ptr(), &view_, PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      throw nb::value_error((what + ": expected a C-contiguous numpy array (a device buffer) or bytes (setBytes "
                                    "data); got " + std::string(nb::type_name(obj.type()).c_str()))
                                .c_str());
    }
  }
  ~BufferView() { PyBuffer_Release(&view_); }
  BufferView(const BufferView&) = delete;
  BufferView& operator=(const BufferView&) = delete;

  void* data() const { return view_.buf; }
  size_t size() const { return size_t(view_.len); }
  bool writable() const { return writable_; }

 private:
  Py_buffer view_{};
  bool writable_ = false;
};

// One GPU: its primary context, the kernels of one PTX folder, and the device memory Python allocated.
class PyDevice {
 public:
  PyDevice(std::optional<std::string> ptx_dir, int ordinal)
      : context_(ordinal), kernels_(context_, ptx_dir.value_or("")) {}

  const Context& context() const { return context_; }
  KernelSet& kernels() { return kernels_; }
  std::mutex& mutex() { return mutex_; }

  uintptr_t alloc(size_t bytes) {
    DeviceMemory memory(bytes);
    const CUdeviceptr ptr = memory.ptr();
    std::lock_guard<std::mutex> lock(mutex_);
    memory_.emplace(ptr, std::move(memory));
    return uintptr_t(ptr);
  }

  void free(uintptr_t ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!memory_.erase(CUdeviceptr(ptr))) throw nb::value_error("cuda: free of a pointer alloc() did not return");
  }

  KernelLaunch prepare(const std::string& kernel, const std::vector<uintptr_t>& buffers, const Shape& threadgroups,
                       const Shape& threads, const Lengths& threadgroup_memory) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::vector<CUdeviceptr> pointers(buffers.begin(), buffers.end());
    return kernels_.prepare(kernel, pointers, dim3(threadgroups), dim3(threads), threadgroup_memory.value_or(
                                                                                     std::vector<uint32_t>{}));
  }

  void dispatch(const std::string& kernel, nb::list args, const Shape& threadgroups, const Shape& threads,
                const Lengths& threadgroup_memory);

 private:
  Context context_;
  KernelSet kernels_;
  std::mutex mutex_;  // the kernel set's caches and the memory map
  std::map<CUdeviceptr, DeviceMemory> memory_;
};

// Runs `kernel` once and waits: arrays are uploaded into fresh device memory (one array bound twice is one buffer,
// for kernels that allow aliasing) and written back when writable; bytes are setBytes data.
void PyDevice::dispatch(const std::string& kernel, nb::list args, const Shape& threadgroups, const Shape& threads,
                        const Lengths& threadgroup_memory) {
  const std::vector<uint32_t> lengths = threadgroup_memory.value_or(std::vector<uint32_t>{});
  std::vector<std::unique_ptr<BufferView>> views;
  std::vector<KernelSet::BoundArgument> bound;
  for (size_t i = 0; i < args.size(); ++i) {
    nb::handle a = args[i];
    if (PyBytes_Check(a.ptr())) {
      bound.push_back({size_t(PyBytes_GET_SIZE(a.ptr())), true});
      views.emplace_back();
      continue;
    }
    views.push_back(std::make_unique<BufferView>(a, "cuda: kernel " + kernel + ": argument " + std::to_string(i)));
    bound.push_back({views.back()->size(), false});
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    kernels_.check_arguments(kernel, bound, lengths);
  }
  std::vector<const void*> data;  // valid while `args` holds the arrays and bytes
  for (size_t i = 0; i < bound.size(); ++i) data.push_back(views[i] ? views[i]->data() : PyBytes_AS_STRING(args[i].ptr()));
  nb::gil_scoped_release release;
  std::vector<DeviceMemory> owned;
  owned.reserve(bound.size());
  std::map<const void*, CUdeviceptr> uploaded;
  std::vector<CUdeviceptr> pointers;
  for (size_t i = 0; i < bound.size(); ++i) {
    auto same = uploaded.find(data[i]);
    if (views[i] && same != uploaded.end()) {
      pointers.push_back(same->second);
      continue;
    }
    owned.emplace_back(bound[i].bytes);
    upload(owned.back().ptr(), data[i], bound[i].bytes);
    pointers.push_back(owned.back().ptr());
    if (views[i]) uploaded[data[i]] = owned.back().ptr();
  }
  KernelLaunch launch;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    launch = kernels_.prepare(kernel, pointers, dim3(threadgroups), dim3(threads), lengths);
  }
  kernels_.launch(launch);
  try {
    context_.synchronize();
  } catch (const DriverError& e) {
    throw DriverError("kernel " + kernel + ": " + e.what(), e.code());
  }
  for (size_t i = 0; i < bound.size(); ++i) {
    if (views[i] && views[i]->writable()) download(views[i]->data(), pointers[i], bound[i].bytes);
  }
}

// A graph of one device's kernels; nodes are numbered in the order they were added.
class PyGraph {
 public:
  explicit PyGraph(PyDevice& device) : device_(device), graph_(device.context()) {}

  size_t add(GraphNode node) {
    nodes_.push_back(node);
    return nodes_.size() - 1;
  }
  std::vector<GraphNode> nodes(const std::vector<size_t>& indices) const {
    std::vector<GraphNode> out;
    for (size_t i : indices) {
      if (i >= nodes_.size()) throw nb::index_error(("cuda graph: no node " + std::to_string(i)).c_str());
      out.push_back(nodes_[i]);
    }
    return out;
  }
  GraphNode node(size_t i) const { return nodes({i}).front(); }

  PyDevice& device_;
  Graph graph_;
  std::vector<GraphNode> nodes_;
};

void bind_device(nb::module_& m) {
  nb::class_<PyDevice>(m, "Device", "One GPU's primary context and every kernel of one folder of PTX files.")
      .def(nb::init<std::optional<std::string>, int>(), "ptx_dir"_a = nb::none(), "ordinal"_a = 0,
           "Opens GPU `ordinal` and loads every *.ptx of `ptx_dir` (default: default_ptx_dir()).")
      .def_prop_ro("device_name", [](const PyDevice& d) { return d.context().device_name(); })
      .def_prop_ro("compute_capability", [](const PyDevice& d) { return d.context().compute_capability(); })
      .def_prop_ro("total_memory", [](const PyDevice& d) { return d.context().total_memory(); })
      .def_prop_ro("ptx_dir", [](PyDevice& d) { return d.kernels().ptx_dir(); })
      .def("kernel_names", [](PyDevice& d) { return d.kernels().kernel_names(); })
      .def("parameters",
           [](PyDevice& d, const std::string& kernel) {
             std::lock_guard<std::mutex> lock(d.mutex());
             std::vector<std::tuple<uint32_t, uint32_t, uint32_t, uint32_t>> out;
             for (const KernelParameter& p : d.kernels().parameters(kernel)) {
               out.emplace_back(p.attribute, p.index, p.binding, p.size);
             }
             return out;
           },
           "kernel"_a, "Each parameter as (attribute, index, binding, size), from <kernel>_msl_params.")
      .def("alloc", &PyDevice::alloc, "nbytes"_a, "Device memory (at least 1 byte); the pointer as an int.")
      .def("free", &PyDevice::free, "ptr"_a)
      .def("upload",
           [](PyDevice&, uintptr_t ptr, nb::handle data) {
             BufferView view(data, "cuda: upload");
             upload(CUdeviceptr(ptr), view.data(), view.size());
           },
           "ptr"_a, "data"_a)
      .def("download",
           [](PyDevice&, uintptr_t ptr, nb::handle out) {
             BufferView view(out, "cuda: download");
             if (!view.writable()) throw nb::value_error("cuda: download into a read-only buffer");
             download(view.data(), CUdeviceptr(ptr), view.size());
           },
           "ptr"_a, "out"_a)
      .def("copy", [](PyDevice&, uintptr_t dst, uintptr_t src, size_t n, uintptr_t stream) {
             copy_async(CUdeviceptr(dst), CUdeviceptr(src), n, stream_of(stream));
           }, "dst"_a, "src"_a, "nbytes"_a, "stream"_a = 0)
      .def("fill", [](PyDevice&, uintptr_t dst, uint8_t value, size_t n, uintptr_t stream) {
             fill_async(CUdeviceptr(dst), value, n, stream_of(stream));
           }, "ptr"_a, "value"_a, "nbytes"_a, "stream"_a = 0)
      .def("synchronize", [](PyDevice& d) { d.context().synchronize(); }, nb::call_guard<nb::gil_scoped_release>())
      .def("launch",
           [](PyDevice& d, const std::string& kernel, const std::vector<uintptr_t>& buffers, const Shape& tgs,
              const Shape& threads, const Lengths& threadgroup_memory, uintptr_t stream) {
             const KernelLaunch launch = d.prepare(kernel, buffers, tgs, threads, threadgroup_memory);
             nb::gil_scoped_release release;
             d.kernels().launch(launch, stream_of(stream));
           },
           "kernel"_a, "buffers"_a, "threadgroups"_a, "threads_per_threadgroup"_a, "threadgroup_memory"_a = nb::none(),
           "stream"_a = 0, "One asynchronous launch with device pointers `buffers[i]` bound to [[buffer(i)]].")
      .def("dispatch", &PyDevice::dispatch, "kernel"_a, "args"_a, "threadgroups"_a, "threads_per_threadgroup"_a,
           "threadgroup_memory"_a = nb::none(),
           "Checks the arguments as the CPU harness does, runs `kernel` once and waits; numpy arrays are copied to\n"
           "the GPU and back (in place), bytes are setBytes data.");
}

void bind_graph(nb::module_& m) {
  nb::class_<GraphExec>(m, "GraphExec", "An instantiated graph.")
      .def("launch", [](const GraphExec& e, uintptr_t stream) { e.launch(stream_of(stream)); }, "stream"_a = 0,
           nb::call_guard<nb::gil_scoped_release>());
  nb::class_<PyGraph>(m, "Graph", "An explicit CUDA graph of one Device's kernels; nodes are ints, in order added.")
      .def(nb::init<PyDevice&>(), "device"_a, nb::keep_alive<1, 2>())
      .def("add_kernel",
           [](PyGraph& g, const std::string& kernel, const std::vector<uintptr_t>& buffers, const Shape& tgs,
              const Shape& threads, const Lengths& threadgroup_memory, const std::vector<size_t>& dependencies) {
             const KernelLaunch launch = g.device_.prepare(kernel, buffers, tgs, threads, threadgroup_memory);
             return g.add(g.graph_.add_kernel(launch, g.nodes(dependencies)));
           },
           "kernel"_a, "buffers"_a, "threadgroups"_a, "threads_per_threadgroup"_a, "threadgroup_memory"_a = nb::none(),
           "dependencies"_a = std::vector<size_t>{})
      .def("add_copy", [](PyGraph& g, uintptr_t dst, uintptr_t src, size_t n, const std::vector<size_t>& deps) {
             return g.add(g.graph_.add_copy(CUdeviceptr(dst), CUdeviceptr(src), n, g.nodes(deps)));
           }, "dst"_a, "src"_a, "nbytes"_a, "dependencies"_a = std::vector<size_t>{})
      .def("add_fill", [](PyGraph& g, uintptr_t dst, uint8_t value, size_t n, const std::vector<size_t>& deps) {
             return g.add(g.graph_.add_fill(CUdeviceptr(dst), value, n, g.nodes(deps)));
           }, "ptr"_a, "value"_a, "nbytes"_a, "dependencies"_a = std::vector<size_t>{})
      .def("add_empty", [](PyGraph& g, const std::vector<size_t>& deps) { return g.add(g.graph_.add_empty(g.nodes(deps))); },
           "dependencies"_a = std::vector<size_t>{})
      .def_prop_ro("node_count", [](const PyGraph& g) { return g.graph_.node_count(); })
      .def("instantiate", [](PyGraph& g) { return new GraphExec(g.graph_); }, nb::keep_alive<0, 1>())
      .def("set_kernel",
           [](PyGraph& g, GraphExec& exec, size_t node, const std::string& kernel, const std::vector<uintptr_t>& buffers,
              const Shape& tgs, const Shape& threads, const Lengths& threadgroup_memory) {
             exec.set_kernel(g.node(node), g.device_.prepare(kernel, buffers, tgs, threads, threadgroup_memory));
           },
           "exec"_a, "node"_a, "kernel"_a, "buffers"_a, "threadgroups"_a, "threads_per_threadgroup"_a,
           "threadgroup_memory"_a = nb::none(), "Re-points kernel node `node` of `exec` (same edges).");
}

void bind_events(nb::module_& m) {
  nb::class_<Stream>(m, "Stream", "A non-blocking stream.")
      .def(nb::init<>())
      .def_prop_ro("handle", [](const Stream& s) { return reinterpret_cast<uintptr_t>(s.handle()); })
      .def("synchronize", &Stream::synchronize, nb::call_guard<nb::gil_scoped_release>());
  nb::class_<Event>(m, "Event", "A CUDA event.")
      .def(nb::init<bool>(), "timing"_a = true)
      .def("record", [](const Event& e, uintptr_t stream) { e.record(stream_of(stream)); }, "stream"_a = 0)
      .def("done", &Event::done)
      .def("synchronize", &Event::synchronize, nb::call_guard<nb::gil_scoped_release>())
      .def("elapsed_ms_since", &Event::elapsed_ms_since, "start"_a);
}

}  // namespace

void bind(nb::module_& m) {
  m.doc() = "The CUDA driver API opened at run time, and Lily's kernels as PTX (docs/cuda.md).";
  nb::exception<DriverError>(m, "CudaError", PyExc_RuntimeError);
  m.def("default_ptx_dir", &KernelSet::default_ptx_dir, "$LILY_CUDA_PTX_DIR, else the package's cuda_kernels/.");
  m.def("driver_library", [] { return Driver::get().library(); }, "The driver library opened ($LILY_LIBCUDA).");
  m.def("driver_version", [] { return Driver::get().version(); });
  bind_device(m);
  bind_graph(m);
  bind_events(m);
}

}  // namespace lily::cuda
