// Device, buffers, events and the pipeline cache (see device.h).
#include "device.h"

#include <algorithm>

namespace lily {

Pipeline::Pipeline(std::string name, std::vector<FunctionConstant> constants, mtl::Object state)
    : name_(std::move(name)),
      constants_(std::move(constants)),
      state_(std::move(state)),
      max_threads_(mtl::max_total_threads_per_threadgroup(state_.get())),
      execution_width_(mtl::thread_execution_width(state_.get())) {}

Buffer::Buffer(mtl::Object buffer)
    : buffer_(std::move(buffer)),
      contents_(mtl::buffer_contents(buffer_.get())),
      length_(mtl::buffer_length(buffer_.get())) {}

uint64_t Event::value() const { return mtl::signaled_value(event_.get()); }

void Event::signal(uint64_t value) { mtl::set_signaled_value(event_.get(), value); }

bool Event::wait(uint64_t value, uint64_t timeout_ms) const {
  return mtl::wait_until_signaled_value(event_.get(), value, timeout_ms);
}

Device::Device(const std::string& kernel_source)
    : device_(mtl::system_default_device()),
      queue_(mtl::new_command_queue(device_.get())),
      library_(mtl::new_library_with_source(device_.get(), kernel_source)) {}

Device::Device(const MetallibFile& metallib)
    : device_(mtl::system_default_device()),
      queue_(mtl::new_command_queue(device_.get())),
      library_(mtl::new_library_with_file(device_.get(), metallib.path)) {}

std::string Device::name() const { return mtl::device_name(device_.get()); }

bool Device::supports_tensor_ops() const {
  constexpr mtl::NSUInteger kGpuFamilyApple10 = 1010;  // MTLGPUFamilyApple10
  return mtl::supports_family(device_.get(), kGpuFamilyApple10);
}

namespace {

// The bytes Metal reads for a constant of `type` (setConstantValue:type:atIndex: takes a pointer).
struct ConstantBytes {
  union {
    bool b;
    int32_t i32;
    uint32_t u32;
    int16_t i16;
    uint16_t u16;
  };
};

ConstantBytes constant_bytes(const std::string& kernel, const FunctionConstant& constant) {
  ConstantBytes bytes{};
  auto out_of_range = [&](int64_t lo, int64_t hi) {
    if (constant.value < lo || constant.value > hi) {
      throw Error("[pipeline] function constant " + std::to_string(constant.index) + " of kernel '" +
                  kernel + "' is out of range for its type; got " + std::to_string(constant.value));
    }
  };
  switch (constant.type) {
    case mtl::DataType::Bool:
      out_of_range(0, 1);
      bytes.b = constant.value != 0;
      break;
    case mtl::DataType::Int:
      out_of_range(INT32_MIN, INT32_MAX);
      bytes.i32 = static_cast<int32_t>(constant.value);
      break;
    case mtl::DataType::UInt:
      out_of_range(0, UINT32_MAX);
      bytes.u32 = static_cast<uint32_t>(constant.value);
      break;
    case mtl::DataType::Short:
      out_of_range(INT16_MIN, INT16_MAX);
      bytes.i16 = static_cast<int16_t>(constant.value);
      break;
    case mtl::DataType::UShort:
      out_of_range(0, UINT16_MAX);
      bytes.u16 = static_cast<uint16_t>(constant.value);
      break;
    default:
      throw Error("[pipeline] function constant " + std::to_string(constant.index) + " of kernel '" +
                  kernel + "' must be bool, int, uint, short or ushort; got MTLDataType " +
                  std::to_string(static_cast<unsigned long>(constant.type)));
  }
  return bytes;
}

}  // namespace

const Pipeline& Device::pipeline(const std::string& name, std::vector<FunctionConstant> constants) {
  std::sort(constants.begin(), constants.end(),
            [](const FunctionConstant& a, const FunctionConstant& b) { return a.index < b.index; });
  PipelineKey key{name, {}};
  for (size_t i = 0; i < constants.size(); ++i) {
    if (i > 0 && constants[i].index == constants[i - 1].index) {
      throw Error("[pipeline] function constant " + std::to_string(constants[i].index) +
                  " of kernel '" + name + "' is given twice");
    }
    key.second.emplace_back(constants[i].index, constants[i].type, constants[i].value);
  }
  std::lock_guard<std::mutex> lock(cache_mutex_);
  auto found = pipelines_.find(key);
  if (found != pipelines_.end()) {
    ++cache_stats_.hits;
    return *found->second;
  }
  ++cache_stats_.misses;
  mtl::Object values = mtl::new_function_constant_values();
  for (const FunctionConstant& constant : constants) {
    ConstantBytes bytes = constant_bytes(name, constant);
    mtl::set_function_constant(values.get(), &bytes, constant.type, static_cast<size_t>(constant.index));
  }
  mtl::Object function = mtl::new_function(library_.get(), name, values.get());
  mtl::Object state = mtl::new_compute_pipeline(device_.get(), function.get(), name);
  auto pipeline = std::make_unique<Pipeline>(name, std::move(constants), std::move(state));
  const Pipeline& result = *pipeline;
  pipelines_.emplace(std::move(key), std::move(pipeline));
  cache_stats_.entries = pipelines_.size();
  return result;
}

PipelineCacheStats Device::pipeline_cache_stats() const {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  return cache_stats_;
}

Buffer Device::new_buffer(size_t length) {
  if (length == 0) throw Error("[buffer] a Metal buffer needs at least 1 byte; got length 0");
  return Buffer(mtl::new_buffer(device_.get(), length));
}

Buffer Device::wrap_memory(void* pointer, size_t length) {
  return Buffer(mtl::new_buffer_no_copy(device_.get(), pointer, length));
}

Event Device::new_event() { return Event(mtl::new_shared_event(device_.get())); }

}  // namespace lily
