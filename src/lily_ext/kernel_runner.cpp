// One-kernel runs through the host Metal layer (see kernel_runner.h).
#include "kernel_runner.h"

#include <algorithm>
#include <cstring>
#include <memory>
#include <utility>

#include "encoder.h"

namespace lily {

namespace {
std::vector<std::string> sorted_once(std::vector<std::string> names) {
  std::sort(names.begin(), names.end());
  names.erase(std::unique(names.begin(), names.end()), names.end());
  return names;
}

std::vector<std::string> family_kernel_names(const std::vector<KernelFamily>& families) {
  std::vector<std::string> names;
  for (const KernelFamily& family : families) names.insert(names.end(), family.kernel_names.begin(),
                                                           family.kernel_names.end());
  return sorted_once(std::move(names));
}
}  // namespace

std::vector<std::string> embedded_kernel_names() { return family_kernel_names(embedded_kernel_families()); }

KernelRunner::KernelRunner(const std::string& kernel_source, std::vector<std::string> kernel_names)
    : names_(sorted_once(std::move(kernel_names))), device_(kernel_source) {}

KernelRunner::KernelRunner(const std::vector<KernelFamily>& families)
    : names_(family_kernel_names(families)), device_(families) {}

KernelRunner::KernelRunner(const MetallibFile& metallib, std::vector<std::string> kernel_names)
    : names_(sorted_once(std::move(kernel_names))), device_(metallib) {}

std::string KernelRunner::device_name() const { return device_.name(); }

// Creates the pipeline of every instantiated kernel (cached for run()). A kernel whose function
// the library lacks is missing; any other failure leaves it listed, so that running it reports
// Metal's error instead of hiding the kernel.
void KernelRunner::probe_library() {
  if (probed_) return;
  std::vector<std::string> available, missing;
  for (const std::string& name : names_) {
    try {
      device_.pipeline(name);
      available.push_back(name);
    } catch (const Error& error) {
      (is_function_not_found(error) ? missing : available).push_back(name);
    }
  }
  available_ = std::move(available);
  missing_ = std::move(missing);
  probed_ = true;
}

std::vector<std::string> KernelRunner::kernel_names() {
  std::lock_guard<std::mutex> lock(mutex_);
  probe_library();
  return available_;
}

std::vector<std::string> KernelRunner::missing_kernel_names() {
  std::lock_guard<std::mutex> lock(mutex_);
  probe_library();
  return missing_;
}

void KernelRunner::run(const std::string& name, const std::vector<KernelArgument>& arguments,
                       mtl::Size threadgroups, mtl::Size threads_per_threadgroup,
                       std::vector<FunctionConstant> constants) {
  std::lock_guard<std::mutex> lock(mutex_);
  const std::string where = "kernel '" + name + "'";
  try {
    const Pipeline& pipeline = device_.pipeline(name, std::move(constants));
    // unique_ptr: Arguments and ranges point at the Buffers, so they must not move.
    std::vector<std::unique_ptr<Buffer>> buffers(arguments.size());
    std::vector<Argument> bound;
    std::vector<BufferRange> ranges;
    for (size_t i = 0; i < arguments.size(); ++i) {
      const KernelArgument& argument = arguments[i];
      if (argument.is_bytes) {
        if (argument.size == 0 || argument.size > 4096) {
          throw Error(where + " args[" + std::to_string(i) + "]: setBytes data must be 1 to 4096 bytes; got " +
                      std::to_string(argument.size));
        }
        bound.push_back(Argument::bytes(argument.data, argument.size));
        continue;
      }
      // Metal has no empty buffers; an empty array gets one byte that the kernel must not read.
      buffers[i] = std::make_unique<Buffer>(device_.new_buffer(std::max<size_t>(argument.size, 1)));
      if (argument.size > 0) std::memcpy(buffers[i]->contents(), argument.data, argument.size);
      bound.push_back(Argument::buffer(*buffers[i]));
      ranges.push_back({buffers[i].get(), 0, buffers[i]->length()});
    }
    // One dispatch per command buffer: the declared ranges order nothing, but keep them honest.
    Encoder encoder(device_);
    encoder.dispatch(pipeline, bound, threadgroups, threads_per_threadgroup, ranges, ranges);
    encoder.commit();
    encoder.wait();
    for (size_t i = 0; i < arguments.size(); ++i) {
      if (buffers[i] && arguments[i].size > 0) {
        std::memcpy(arguments[i].data, buffers[i]->contents(), arguments[i].size);
      }
    }
  } catch (const Error& error) {
    const std::string text = error.what();
    if (text.rfind(where, 0) == 0) throw;
    throw Error(where + ": " + text);
  }
}

}  // namespace lily
