// Python kernel arguments (numpy arrays, bytes) as {pointer, size, is_bytes} bindings: shared by the Metal kernel
// runner (bindings.cpp) and the CPU execution harness (msl_cpu/msl_py.cpp), so both check and report alike.
#pragma once

#include <nanobind/nanobind.h>

#include <string>
#include <vector>

namespace lily::py_args {

// Which Python exception a non-buffer, non-bytes argument raises (the two callers' contracts differ).
enum class NotBufferError { TypeError, ValueError };

// The numpy arrays (device buffers) and bytes (setBytes data) of one dispatch, as `Binding` values
// ({void* data; size_t size; bool is_bytes;}); holds the arrays' buffer views until the dispatch is over.
template <typename Binding>
class BufferArguments {
 public:
  // `copy_back` ends the read-only error: what the dispatch does to a device buffer's array.
  BufferArguments(const std::string& kernel, const nanobind::list& args, const char* copy_back,
                  NotBufferError not_buffer_error) {
    views_.reserve(args.size());
    for (size_t i = 0; i < args.size(); ++i) add(kernel, i, args[i], copy_back, not_buffer_error);
  }
  ~BufferArguments() {
    for (Py_buffer& view : views_) PyBuffer_Release(&view);
  }
  BufferArguments(const BufferArguments&) = delete;
  BufferArguments& operator=(const BufferArguments&) = delete;
  const std::vector<Binding>& bindings() const { return bindings_; }

 private:
  void add(const std::string& kernel, size_t i, nanobind::handle obj, const char* copy_back,
           NotBufferError not_buffer_error) {
    if (PyBytes_Check(obj.ptr())) {
      bindings_.push_back({PyBytes_AS_STRING(obj.ptr()), size_t(PyBytes_GET_SIZE(obj.ptr())), true});
      return;
    }
    const std::string slot = "kernel '" + kernel + "' args[" + std::to_string(i) + "]: ";
    Py_buffer view;
    if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) != 0) {
      PyErr_Clear();
      std::string type = nanobind::type_name(obj.type()).c_str();
      if (PyObject_GetBuffer(obj.ptr(), &view, PyBUF_STRIDES) != 0) {
        PyErr_Clear();
        const std::string message =
            slot + "expected a numpy array (a device buffer) or bytes (setBytes data); got " + type;
        if (not_buffer_error == NotBufferError::TypeError) throw nanobind::type_error(message.c_str());
        throw nanobind::value_error(message.c_str());
      }
      bool readonly = view.readonly;
      PyBuffer_Release(&view);
      throw nanobind::value_error((slot + "the " + type + " is " +
                                   (readonly ? std::string("read-only; device buffers are ") + copy_back
                                             : std::string("not C-contiguous; pass numpy.ascontiguousarray(...)")))
                                      .c_str());
    }
    views_.push_back(view);
    bindings_.push_back({view.buf, size_t(view.len), false});
  }

  std::vector<Py_buffer> views_;
  std::vector<Binding> bindings_;
};

}  // namespace lily::py_args
